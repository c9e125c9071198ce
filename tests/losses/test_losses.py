"""Tests of smallbatch.losses against plain float64 loop references written from the papers' formulas.

References: InfoNCE/NT-Xent (SimCLR, Chen et al. 2020), FlatNCE (Chen et al. 2021),
DCL/DCLW (Yeh et al. 2021), EqCo (Zhu et al. 2020), alignment/uniformity (Wang & Isola 2020).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loss_at_tau import at_tau

from smallbatch.losses import (
    DCL,
    DCLW,
    LOSSES,
    REGISTRY,
    EqCo,
    FlatNCE,
    InfoNCE,
    LossOutput,
    batch_positives,
    build_loss,
    in_batch_scores,
    loss_param_names,
    queue_scores,
    same_view_mask,
)
from smallbatch.losses.diagnostics import diagnostics
from smallbatch.training.negatives import MomentumQueue

torch.set_num_threads(1)


# --------------------------------------------------------------------------- loop references
def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.sum(v * v))


def ref_in_batch(z1: np.ndarray, z2: np.ndarray):
    """Per anchor (pos, [negs]) for the 2N SimCLR views, by explicit loops."""
    n = z1.shape[0]
    views = [_unit(z1[i]) for i in range(n)] + [_unit(z2[i]) for i in range(n)]
    rows = []
    for i in range(2 * n):
        p = (i + n) % (2 * n)
        pos = float(np.dot(views[i], views[p]))
        negs = [float(np.dot(views[i], views[j])) for j in range(2 * n) if j not in (i, p)]
        rows.append((pos, negs))
    return rows


def ref_queue(q, k, queue, q_index=None, queue_index=None):
    rows = []
    for i in range(q.shape[0]):
        qi = _unit(q[i])
        pos = float(np.dot(qi, _unit(k[i])))
        negs = [
            float(np.dot(qi, _unit(queue[j])))
            for j in range(queue.shape[0])
            if q_index is None or int(queue_index[j]) != int(q_index[i])
        ]
        rows.append((pos, negs))
    return rows


def ref_loss(name: str, rows, tau: float, sigma: float = 0.5, alpha=256.0, gamma: float = 1.0, weights=None):
    """Mean over anchors of the paper formula, python floats and math.exp/log (each loss's
    parameters at their defaults unless given; EqCo's alpha None: alpha = K)."""
    total = 0.0
    if name == "dclw" and weights is None:
        e = [math.exp(p / sigma) for p, _ in rows]
        mean_e = sum(e) / len(e)
        weights = [2.0 - ei / mean_e for ei in e]
    for i, (sp, negs) in enumerate(rows):
        k = len(negs)
        if name == "infonce":
            num = math.exp(sp / tau)
            li = -math.log(num / (num + sum(math.exp(s / tau) for s in negs)))
        elif name == "flatnce":
            if gamma == 0:
                li = sum((s - sp) / tau for s in negs) / k + math.log(k)
            else:
                mean_pow = sum(math.exp(gamma * (s - sp) / tau) for s in negs) / k
                li = math.log(mean_pow ** (1.0 / gamma)) + math.log(k)
        elif name == "dcl":
            li = -sp / tau + math.log(sum(math.exp(s / tau) for s in negs))
        elif name == "dclw":
            li = -weights[i] * sp / tau + math.log(sum(math.exp(s / tau) for s in negs))
        elif name == "eqco":
            a = k if alpha is None else alpha
            li = math.log(math.exp(sp / tau) + a / k * sum(math.exp(s / tau) for s in negs)) - sp / tau
        else:
            raise KeyError(name)
        total += li
    return total / len(rows)


def _views(n: int, d: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g, dtype=torch.float64)
    z2 = z1 + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return z1.to(dtype), z2.to(dtype)


NAMES = ["infonce", "flatnce", "dcl", "dclw", "eqco"]
# (N, D, tau): a representative sample of N in 2..33, D in 1..128, tau in {0.05, 0.1, 0.5, 1, 10}, extremes included
CASES = [
    (2, 1, 0.05),
    (2, 128, 10.0),
    (3, 7, 0.1),
    (5, 2, 1.0),
    (8, 32, 0.5),
    (13, 64, 0.05),
    (21, 3, 10.0),
    (33, 1, 0.1),
    (33, 128, 0.05),
    (33, 128, 10.0),
]


# --------------------------------------------------------------------------- values vs reference
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,d,tau", CASES)
def test_in_batch_loss_matches_loop_reference(name, n, d, tau):
    z1, z2 = _views(n, d, seed=n * 1000 + d)
    out = at_tau(build_loss(name), tau)(z1, z2)
    ref = ref_loss(name, ref_in_batch(z1.numpy(), z2.numpy()), tau)
    assert isinstance(out, LossOutput)
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    assert out.value.item() == pytest.approx(ref, rel=1e-10, abs=1e-10)
    if name == "flatnce":  # FlatNCE's own objective is identically 1
        assert out.loss.item() == pytest.approx(1.0, abs=1e-12)
    else:
        assert out.loss.item() == pytest.approx(ref, rel=1e-10, abs=1e-10)
    info = ref_loss("infonce", ref_in_batch(z1.numpy(), z2.numpy()), tau)
    assert out.infonce.item() == pytest.approx(info, rel=1e-10, abs=1e-10)
    assert not out.value.requires_grad and not out.infonce.requires_grad


@pytest.mark.parametrize(
    "name,params",
    [
        ("dclw", {"sigma": 0.1}),
        ("dclw", {"sigma": 2.0}),
        ("eqco", {"alpha": 1.0}),
        ("eqco", {"alpha": 256.0}),
        ("flatnce", {"gamma": 0.0}),
        ("flatnce", {"gamma": 0.5}),
        ("flatnce", {"gamma": 3.0}),
    ],
)
@pytest.mark.parametrize("n,d,tau", [(2, 1, 0.05), (9, 16, 0.5), (33, 128, 0.1)])
def test_parameterised_losses_match_loop_reference(name, params, n, d, tau):
    z1, z2 = _views(n, d, seed=7 + n)
    out = at_tau(build_loss(name, **params), tau)(z1, z2)
    ref = ref_loss(name, ref_in_batch(z1.numpy(), z2.numpy()), tau, **params)
    assert out.value.item() == pytest.approx(ref, rel=1e-10, abs=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,m,d,tau", [(1, 1, 4, 0.1), (4, 17, 8, 0.05), (6, 40, 128, 1.0), (3, 9, 1, 10.0)])
def test_queue_loss_matches_loop_reference(name, n, m, d, tau):
    g = torch.Generator().manual_seed(100 + m)
    q = torch.randn(n, d, generator=g, dtype=torch.float64)
    k = q + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64)
    queue = torch.randn(m, d, generator=g, dtype=torch.float64)
    out = at_tau(build_loss(name), tau)(q, k, queue=queue)
    ref = ref_loss(name, ref_queue(q.numpy(), k.numpy(), queue.numpy()), tau)
    assert out.value.item() == pytest.approx(ref, rel=1e-10, abs=1e-10)


@pytest.mark.parametrize(
    "name,params",
    [
        ("infonce", {}),
        ("flatnce", {}),
        ("flatnce", {"gamma": 2.0}),
        ("dcl", {}),
        ("dclw", {}),
        ("eqco", {}),
        ("eqco", {"alpha": 16.0}),
    ],
)
def test_masked_queue_matches_reference_with_per_row_k(name, params):
    """Own-index masking: each row's K differs; EqCo's alpha/K and Hölder's log K use the row's own K."""
    g = torch.Generator().manual_seed(3)
    n, d, m, tau = 5, 6, 23, 0.2
    q = torch.randn(n, d, generator=g, dtype=torch.float64)
    k = q + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    queue = torch.randn(m, d, generator=g, dtype=torch.float64)
    q_index = torch.tensor([0, 1, 2, 3, 4])
    queue_index = torch.tensor([0, 0, 0, 1, 5, 6, 2, 2, 7, 8, 9, 0, 1, 10, 11, 12, 13, 14, 4, 15, 16, 17, 18])
    pos, neg, mask = queue_scores(q, k, queue, q_index, queue_index)
    ks = mask.sum(1).tolist()
    assert ks == [19, 21, 21, 23, 22]
    out = at_tau(build_loss(name, **params), tau).from_scores(pos, neg, mask)
    ref = ref_loss(name, ref_queue(q.numpy(), k.numpy(), queue.numpy(), q_index, queue_index), tau, **params)
    assert out.value.item() == pytest.approx(ref, rel=1e-10)


# --------------------------------------------------------------------------- gradients vs finite differences
def _fd_grad(f, arrays, h=1e-6):
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            old = a[idx]
            a[idx] = old + h
            fp = f()
            a[idx] = old - h
            fm = f()
            a[idx] = old
            g[idx] = (fp - fm) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize(
    "name,params",
    [
        ("infonce", {}),
        ("flatnce", {}),
        ("flatnce", {"gamma": 2.5}),
        ("dcl", {}),
        ("dclw", {"sigma": 0.3}),
        ("eqco", {"alpha": 4.0}),
    ],
)
@pytest.mark.parametrize("n,d,tau", [(2, 1, 0.5), (3, 4, 0.1), (4, 3, 1.0)])
def test_gradient_matches_finite_differences(name, params, n, d, tau):
    z1, z2 = _views(n, d, seed=11 * n + d)
    a = z1.clone().requires_grad_()
    b = z2.clone().requires_grad_()
    at_tau(build_loss(name, **params), tau)(a, b).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    weights = None
    if name == "dclw":  # DCLW's weights are computed on detached similarities: hold them fixed
        sp = [p for p, _ in ref_in_batch(x1, x2)]
        e = [math.exp(p / params["sigma"]) for p in sp]
        weights = [2.0 - ei / (sum(e) / len(e)) for ei in e]
    # FlatNCE's objective exp(l - sg(l)) is constant, its gradient is that of l: differentiate the value l
    g1, g2 = _fd_grad(lambda: ref_loss(name, ref_in_batch(x1, x2), tau, weights=weights, **params), [x1, x2])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b.grad.numpy(), g2, rtol=1e-5, atol=1e-7)


def test_queue_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(3, 4, generator=g, dtype=torch.float64)
    queue = torch.randn(7, 4, generator=g, dtype=torch.float64)
    qi, ui = torch.tensor([0, 1, 2]), torch.tensor([0, 3, 1, 4, 5, 6, 0])
    qq = q.clone().requires_grad_()
    at_tau(build_loss("eqco", alpha=2.0), 0.2)(qq, k, queue=queue, q_index=qi, queue_index=ui).loss.backward()
    xq = q.numpy().copy()
    (gq,) = _fd_grad(lambda: ref_loss("eqco", ref_queue(xq, k.numpy(), queue.numpy(), qi, ui), 0.2, alpha=2.0), [xq])
    np.testing.assert_allclose(qq.grad.numpy(), gq, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("n", [2, 5, 33])
@pytest.mark.parametrize("tau", [0.05, 1.0, 10.0])
def test_collinear_closed_forms_in_batch(n, tau):
    z = torch.ones(n, 3, dtype=torch.float64) * torch.arange(1, n + 1, dtype=torch.float64)[:, None]
    k = 2 * n - 2
    assert at_tau(build_loss("infonce"), tau)(z, z).value.item() == pytest.approx(math.log(2 * n - 1), rel=1e-12)
    assert at_tau(build_loss("flatnce"), tau)(z, z).value.item() == pytest.approx(math.log(k), rel=1e-12, abs=1e-12)
    assert at_tau(build_loss("dcl"), tau)(z, z).value.item() == pytest.approx(math.log(k), rel=1e-12, abs=1e-12)
    assert at_tau(build_loss("eqco", alpha=3.0), tau)(z, z).value.item() == pytest.approx(math.log(4.0), rel=1e-12)
    pos, neg, mask = in_batch_scores(z, z)
    d = diagnostics(pos, neg, tau, mask)
    assert d["mi_estimate"] == pytest.approx(0.0, abs=1e-12)
    assert d["mi_ceiling"] == pytest.approx(math.log(2 * n - 1))
    assert d["ess"] == pytest.approx(1.0)
    assert d["qb_mean"] == pytest.approx(k / (k + 1)) and d["qb_cv"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("m", [1, 7, 100])
def test_collinear_closed_form_queue(m):
    q = torch.ones(4, 2, dtype=torch.float64)
    queue = MomentumQueue(size=m, dim=2, dtype=torch.float64)
    queue.enqueue(3 * torch.ones(m, 2, dtype=torch.float64), torch.arange(10, 10 + m))
    out = at_tau(build_loss("infonce"), 0.1)(q, q, queue=queue, q_index=torch.arange(4))
    assert len(queue) == m
    assert out.value.item() == pytest.approx(math.log(m + 1), rel=1e-12)
    # masking r entries of a row leaves K = M - r: InfoNCE = log(M - r + 1)
    if m > 1:
        queue.enqueue(torch.ones(1, 2, dtype=torch.float64), torch.tensor([0]))
        out = at_tau(build_loss("infonce"), 0.1)(q[:1], q[:1], queue=queue, q_index=torch.tensor([0]))
        assert out.value.item() == pytest.approx(math.log(m), rel=1e-12)


# --------------------------------------------------------------------------- identities the papers prove
def _grads(loss, z1, z2, **kw):
    a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    loss(a, b, **kw).loss.backward()
    return torch.cat([a.grad.flatten(), b.grad.flatten()])


@pytest.mark.parametrize("n,d,tau", [(2, 3, 0.05), (8, 16, 0.1), (17, 64, 1.0)])
def test_flatnce_gradient_equals_dcl_gradient(n, d, tau):
    z1, z2 = _views(n, d, seed=n)
    torch.testing.assert_close(
        _grads(at_tau(FlatNCE(), tau), z1, z2), _grads(at_tau(DCL(), tau), z1, z2), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize("n,d,tau", [(2, 3, 0.5), (8, 16, 0.1), (17, 64, 1.0)])
def test_flatnce_with_positive_among_negatives_has_infonce_gradient(n, d, tau):
    """FlatNCE Prop. 3.1: logsumexp over {pos} ∪ negatives of (s - s_pos)/tau is InfoNCE."""
    z1, z2 = _views(n, d, seed=n + 1)
    grads = []
    for which in ("flat+pos", "infonce"):
        a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
        pos, neg, _ = in_batch_scores(a, b)
        if which == "flat+pos":
            out = at_tau(FlatNCE(), tau).from_scores(pos, torch.cat([pos[:, None], neg], dim=1))
        else:
            out = at_tau(InfoNCE(), tau).from_scores(pos, neg)
        out.loss.backward()
        grads.append(torch.cat([a.grad.flatten(), b.grad.flatten()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-14)


def test_dclw_tends_to_dcl_as_sigma_grows():
    z1, z2 = _views(6, 8, seed=2)
    g_dcl = _grads(at_tau(DCL(), 0.1), z1, z2)
    errs = [
        float((_grads(at_tau(DCLW(sigma=s), 0.1), z1, z2) - g_dcl).norm() / g_dcl.norm()) for s in (0.5, 10.0, 1e3, 1e6)
    ]
    assert all(e1 > e2 for e1, e2 in zip(errs, errs[1:])), errs
    assert errs[-1] < 1e-6 and errs[0] > 1e-3, errs
    torch.testing.assert_close(_grads(at_tau(DCLW(sigma=math.inf), 0.1), z1, z2), g_dcl)
    assert at_tau(DCLW(sigma=1e6), 0.1)(z1, z2).value.item() == pytest.approx(
        at_tau(DCL(), 0.1)(z1, z2).value.item(), rel=1e-6
    )


def test_dclw_weights_mean_one_and_favour_hard_positives():
    pos = torch.tensor([0.9, 0.5, 0.1, -0.2], dtype=torch.float64)
    w = at_tau(DCLW(sigma=0.5), 0.1).weights(pos)
    assert w.mean().item() == pytest.approx(1.0)
    assert torch.all(w[1:] > w[:-1])


@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_eqco_with_alpha_k_equals_infonce(tau):
    z1, z2 = _views(7, 10, seed=3)
    k = 2 * 7 - 2
    v_info = at_tau(InfoNCE(), tau)(z1, z2)
    for eq in (at_tau(EqCo(alpha=float(k)), tau), at_tau(EqCo(alpha=None), tau)):
        out = eq(z1, z2)
        assert out.value.item() == pytest.approx(v_info.value.item(), rel=1e-12)
        torch.testing.assert_close(_grads(eq, z1, z2), _grads(at_tau(InfoNCE(), tau), z1, z2), rtol=1e-10, atol=1e-14)
    # alpha != K differs
    assert at_tau(EqCo(alpha=1.0), tau)(z1, z2).value.item() < v_info.value.item()


def test_holder_gamma_one_is_flatnce_and_gamma_limits():
    z1, z2 = _views(6, 5, seed=4)
    assert at_tau(FlatNCE(), 0.2).gamma == 1.0
    # gamma = 1 takes its own branch (plain logsumexp); the general Hoelder formula just beside it
    # gives the same gradient: measured max difference 1.7e-10 at gamma = 1 + 1e-9 (it is the
    # family's own change with gamma, linear in the step), held to 1e-9
    torch.testing.assert_close(
        _grads(at_tau(FlatNCE(gamma=1.0), 0.2), z1, z2),
        _grads(at_tau(FlatNCE(gamma=1.0 + 1e-9), 0.2), z1, z2),
        rtol=0,
        atol=1e-9,
    )
    # gamma -> 1 continuously, gamma -> 0 tends to the geometric-mean limit
    v1 = at_tau(FlatNCE(), 0.2)(z1, z2).value.item()
    assert at_tau(FlatNCE(gamma=1.0 + 1e-7), 0.2)(z1, z2).value.item() == pytest.approx(v1, rel=1e-6)
    v0 = at_tau(FlatNCE(gamma=0.0), 0.2)(z1, z2).value.item()
    assert at_tau(FlatNCE(gamma=1e-7), 0.2)(z1, z2).value.item() == pytest.approx(v0, rel=1e-5)
    # power means are ordered in gamma
    vals = [at_tau(FlatNCE(gamma=g), 0.2)(z1, z2).value.item() for g in (0.0, 0.5, 1.0, 2.0, 8.0)]
    assert all(a < b for a, b in zip(vals, vals[1:])), vals


# --------------------------------------------------------------------------- symmetry, permutation
@pytest.mark.parametrize("name", NAMES)
def test_symmetric_in_the_two_views(name):
    z1, z2 = _views(9, 12, seed=9)
    loss = at_tau(build_loss(name), 0.1)
    o12, o21 = loss(z1, z2), loss(z2, z1)
    assert o12.value.item() == pytest.approx(o21.value.item(), rel=1e-12)
    g12 = _grads(loss, z1, z2).view(2, -1)
    g21 = _grads(loss, z2, z1).view(2, -1)
    torch.testing.assert_close(g12[0], g21[1], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", NAMES)
def test_invariant_to_permuting_the_batch(name):
    z1, z2 = _views(11, 6, seed=10)
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    loss = at_tau(build_loss(name), 0.3)
    assert loss(z1, z2).value.item() == pytest.approx(loss(z1[perm], z2[perm]).value.item(), rel=1e-12)
    g = _grads(loss, z1, z2).view(2, 11, 6)
    gp = _grads(loss, z1[perm], z2[perm]).view(2, 11, 6)
    torch.testing.assert_close(g[:, perm], gp, rtol=1e-10, atol=1e-14)


def test_in_batch_scores_layout():
    z1, z2 = _views(4, 3, seed=0)
    pos, neg, mask = in_batch_scores(z1, z2)
    assert pos.shape == (8,) and neg.shape == (8, 6) and mask is None
    rows = ref_in_batch(z1.numpy(), z2.numpy())
    np.testing.assert_allclose(pos.numpy(), [r[0] for r in rows], rtol=1e-12)
    np.testing.assert_allclose(neg.numpy(), [r[1] for r in rows], rtol=1e-12)


def test_in_batch_scores_of_some_rows_are_those_rows_of_the_whole_batch():
    z1, z2 = _views(5, 4, seed=1)
    pos, neg, _ = in_batch_scores(z1, z2)
    rows = torch.tensor([1, 3, 6, 8])
    p, n, _ = in_batch_scores(z1, z2, rows=rows)
    assert torch.equal(p, pos[rows]) and torch.equal(n, neg[rows])
    torch.testing.assert_close(batch_positives(z1, z2), pos, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("name", [n for n, cls in REGISTRY.items() if cls.per_anchor])
def test_losses_of_disjoint_anchor_sets_average_to_the_whole_batch(name):
    """What a process that owns some anchors of a gathered batch computes: the mean of
    the per-process losses (equal shares) is the whole batch's loss, and so is its
    gradient w.r.t. every embedding (DCLW's weights use the whole batch's positives; a
    loss of same-view negatives masks the other view's, from the rows alone).  A loss that
    is not a mean over anchors (``per_anchor`` False) runs on one process."""
    z1, z2 = _views(6, 5, seed=2)
    a, b = z1.clone().requires_grad_(True), z2.clone().requires_grad_(True)
    loss = at_tau(build_loss(name), 0.2)
    whole = loss(a, b).loss
    g_whole = torch.autograd.grad(whole, (a, b))
    n = z1.shape[0]
    parts = []
    for r in range(2):  # two "processes", each owning half of the images (both views)
        own = torch.cat([torch.arange(r * 3, r * 3 + 3), n + torch.arange(r * 3, r * 3 + 3)])
        pos, neg, mask = in_batch_scores(a, b, rows=own)
        if loss.negatives == "same_view":
            mask = same_view_mask(n, rows=own)
        parts.append(loss.from_scores(pos, neg, mask, batch_pos=batch_positives(a, b)).loss)
    split = (parts[0] + parts[1]) / 2
    g_split = torch.autograd.grad(split, (a, b))
    assert split.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    for gw, gs in zip(g_whole, g_split):
        torch.testing.assert_close(gs, gw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", [n for n, cls in REGISTRY.items() if cls.spec.contrastive])
def test_a_temperature_tensor_equals_the_float(name):
    z1, z2 = _views(4, 3, seed=3)
    pos, neg, mask = in_batch_scores(z1, z2)
    loss = at_tau(build_loss(name), 0.3)
    a = loss.from_scores(pos, neg, mask)
    b = at_tau(build_loss(name), 1.0).from_scores(pos, neg, mask, temperature=torch.tensor(0.3, dtype=torch.float64))
    assert torch.equal(a.loss, b.loss) and torch.equal(a.value, b.value) and torch.equal(a.infonce, b.infonce)


# --------------------------------------------------------------------------- queue
def test_momentum_queue_fifo_and_wraparound():
    qu = MomentumQueue(size=5, dim=2, dtype=torch.float64)
    assert len(qu) == 0 and qu.negatives()[0].shape == (0, 2)
    qu.enqueue(torch.tensor([[1.0, 0], [2, 0], [3, 0]]), torch.tensor([0, 1, 2]))
    keys, idx = qu.negatives()
    assert len(qu) == 3 and idx.tolist() == [0, 1, 2]
    assert torch.allclose(keys, torch.tensor([[1.0, 0]] * 3, dtype=torch.float64))  # stored normalised
    qu.enqueue(torch.tensor([[0.0, 1], [0, 2], [0, 3]]), torch.tensor([3, 4, 5]))  # wraps: 0 replaced by 5
    keys, idx = qu.negatives()
    assert len(qu) == 5 and sorted(idx.tolist()) == [1, 2, 3, 4, 5]
    qu.enqueue(torch.randn(12, 2), torch.arange(100, 112))  # more than size: only the newest 5 remain
    assert sorted(qu.negatives()[1].tolist()) == list(range(107, 112))
    assert not qu.negatives()[0].requires_grad
    state = qu.state_dict()
    qu2 = MomentumQueue(size=5, dim=2, dtype=torch.float64)
    qu2.load_state_dict(state)
    assert torch.equal(qu2.negatives()[0], qu.negatives()[0]) and qu2.ptr == qu.ptr


def test_queue_longer_than_dataset_masks_old_keys_of_the_same_image():
    """CIFAR pitfall: a queue spanning several epochs holds old keys of the anchor's own image."""
    dataset_size, d = 6, 8
    g = torch.Generator().manual_seed(0)
    images = torch.randn(dataset_size, d, generator=g, dtype=torch.float64)
    qu = MomentumQueue(size=20, dim=d, dtype=torch.float64)
    for _ in range(4):  # 4 epochs of keys: 24 > 20 slots, each image present 3-4 times
        qu.enqueue(images + 0.01 * torch.randn(dataset_size, d, generator=g, dtype=torch.float64), torch.arange(6))
    q_idx = torch.arange(dataset_size)
    pos, neg, mask = queue_scores(images, images, qu, q_index=q_idx)
    _, qidx = qu.negatives()
    for i in range(dataset_size):
        own = qidx == i
        assert own.sum() >= 3 and not mask[i][own].any() and mask[i][~own].all()
    # unmasked, the stale own keys look like near-perfect "negatives" (cos ~ 1)
    assert neg[~mask].min() > 0.99
    masked = at_tau(InfoNCE(), 0.1)(images, images, queue=qu, q_index=q_idx).value.item()
    unmasked = at_tau(InfoNCE(), 0.1)(images, images, queue=qu).value.item()
    assert unmasked > masked + 1.0


def test_queue_scores_shapes_and_dtype_promotion():
    q = torch.randn(3, 4)
    queue = MomentumQueue(8, 4, dtype=torch.float64)
    queue.enqueue(torch.randn(8, 4), torch.arange(8))
    pos, neg, mask = queue_scores(q, q, queue)
    assert pos.shape == (3,) and neg.shape == (3, 8) and mask is None
    assert neg.dtype == torch.float64


# --------------------------------------------------------------------------- diagnostics
def test_diagnostics_against_loop_reference():
    z1, z2 = _views(6, 5, seed=21)
    tau = 0.2
    pos, neg, mask = in_batch_scores(z1, z2)
    d = diagnostics(pos, neg, tau, mask, z1=z1, z2=z2)
    assert set(d) == {
        "infonce",
        "mi_estimate",
        "mi_ceiling",
        "mi_fraction",
        "ess",
        "qb_mean",
        "qb_cv",
        "alignment",
        "uniformity",
        "pos_cos",
        "neg_cos",
        "k",
    }
    assert all(type(v) is float for v in d.values())
    rows = ref_in_batch(z1.numpy(), z2.numpy())
    k = len(rows[0][1])
    ess, qb = [], []
    for sp, negs in rows:
        e = [math.exp(s / tau) for s in negs]
        w = [x / sum(e) for x in e]
        ess.append(1.0 / (k * sum(x * x for x in w)))
        qb.append(1.0 - math.exp(sp / tau) / (math.exp(sp / tau) + sum(e)))
    info = ref_loss("infonce", rows, tau)
    assert d["k"] == k
    assert d["infonce"] == pytest.approx(info)
    assert d["mi_ceiling"] == pytest.approx(math.log(k + 1))
    assert d["mi_estimate"] == pytest.approx(math.log(k + 1) - info)
    assert d["mi_fraction"] == pytest.approx((math.log(k + 1) - info) / math.log(k + 1))
    assert d["ess"] == pytest.approx(np.mean(ess))
    assert d["qb_mean"] == pytest.approx(np.mean(qb))
    assert d["qb_cv"] == pytest.approx(np.std(qb) / np.mean(qb))
    a = z1.numpy() / np.linalg.norm(z1.numpy(), axis=1, keepdims=True)
    b = z2.numpy() / np.linalg.norm(z2.numpy(), axis=1, keepdims=True)
    assert d["alignment"] == pytest.approx(np.mean(np.sum((a - b) ** 2, axis=1)))

    def unif(x):
        vals = [math.exp(-2 * np.sum((x[i] - x[j]) ** 2)) for i in range(len(x)) for j in range(i + 1, len(x))]
        return math.log(np.mean(vals))

    assert d["uniformity"] == pytest.approx((unif(a) + unif(b)) / 2)
    assert d["pos_cos"] == pytest.approx(np.mean([r[0] for r in rows]))
    assert d["neg_cos"] == pytest.approx(np.mean([s for r in rows for s in r[1]]))
    # without z1/z2, alignment comes from the positive scores
    assert diagnostics(pos, neg, tau)["alignment"] == pytest.approx(d["alignment"])


def test_diagnostics_ess_bounds_and_masks():
    g = torch.Generator().manual_seed(1)
    pos = torch.rand(16, generator=g)
    neg = torch.rand(16, 30, generator=g) * 2 - 1
    for tau in (0.01, 0.1, 10.0):
        e = diagnostics(pos, neg, tau)["ess"]
        assert 1 / 30 <= e <= 1.0
    # one dominant negative: ESS -> 1/K; flat negatives: ESS = 1
    peaked = torch.zeros(2, 10)
    peaked[:, 3] = 1.0
    assert diagnostics(torch.zeros(2), peaked, 0.01)["ess"] == pytest.approx(0.1, rel=1e-6)
    assert diagnostics(torch.zeros(2), torch.zeros(2, 10), 0.1)["ess"] == pytest.approx(1.0)
    mask = torch.ones(16, 30, dtype=torch.bool)
    mask[0, :25] = False
    d = diagnostics(pos, neg, 0.1, neg_mask=mask)
    assert d["k"] == pytest.approx((5 + 15 * 30) / 16)
    assert d["mi_ceiling"] == pytest.approx((math.log(6) + 15 * math.log(31)) / 16)
    assert d["neg_cos"] == pytest.approx(float(neg[mask].mean()), rel=1e-6)
    for name in NAMES:  # works for any loss's (pos, neg, mask); the loss's infonce field agrees
        out = at_tau(build_loss(name), 0.1).from_scores(pos, neg, mask)
        assert out.infonce.item() == pytest.approx(d["infonce"], rel=1e-6)


# --------------------------------------------------------------------------- registry
def test_registry_names_aliases_and_params():
    assert {"infonce", "flatnce", "dcl", "dclw", "eqco", "ntxent", "simclr"} <= set(LOSSES)
    assert LOSSES["ntxent"] is InfoNCE and LOSSES["simclr"] is InfoNCE
    assert loss_param_names("dclw") == {"sigma": 0.5}
    assert loss_param_names("eqco") == {"alpha": 256}
    assert loss_param_names("flatnce") == {"gamma": 1.0}
    assert loss_param_names("infonce") == {} and loss_param_names("dcl") == {}
    loss = build_loss("DCLW", sigma=2.0)
    assert isinstance(loss, DCLW) and loss.sigma == 2.0 and loss.name == "dclw" and not hasattr(loss, "temperature")
    assert build_loss("eqco").alpha == 256.0 and build_loss("eqco", alpha=64).alpha == 64.0
    assert build_loss("simclr").params() == {} and build_loss("dclw").params() == {"sigma": 0.5}
    with pytest.raises(ValueError, match="unknown loss 'barlow'.*allowed: .*dclw"):
        build_loss("barlow")
    with pytest.raises(ValueError, match="unknown loss"):
        loss_param_names("nope")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['sigma'\] for loss 'eqco'; allowed: alpha"):
        build_loss("eqco", sigma=1.0)
    with pytest.raises(ValueError, match="unknown parameter"):
        build_loss("infonce", gamma=2.0)


#: every loss of the registry and how the training treats it, written out from the papers (not
#: read from the registry, which the tests parametrised by its flags rely on): name -> (aliases,
#: negatives, per_anchor, stateful, learnable, owns_temperature, uses_temperature, predictor,
#: ema_target, the study's default of each parameter)
LOSS_TABLE = {
    "infonce": (("ntxent", "simclr"), "all", True, False, False, False, True, False, False, {}),
    "flatnce": ((), "all", True, False, False, False, True, False, False, {"gamma": 1.0}),
    "dcl": ((), "all", True, False, False, False, True, False, False, {}),
    "dclw": ((), "all", True, False, False, False, True, False, False, {"sigma": 0.5}),
    "eqco": ((), "all", True, False, False, False, True, False, False, {"alpha": 256}),
    "sogclr": ((), "all", True, True, False, False, True, False, False, {"gamma": 0.9}),
    "isogclr": (
        (),
        "all",
        True,
        True,
        False,
        True,
        True,
        False,
        False,
        {"gamma": 0.9, "rho": 0.3, "eta": 0.01, "beta": 0.9, "tau_min": 0.05, "tau_max": 0.7},
    ),
    "siglip": (("sigclr",), "all", True, False, True, True, True, False, False, {"bias_init": -10.0}),
    "dhel": ((), "same_view", True, False, False, False, True, False, False, {}),
    "kcl": ((), "same_view", True, False, False, False, False, False, False, {"t": 2.0, "gamma": 16.0}),
    "simco": ((), "all", True, False, False, False, True, False, False, {"m": 10.0}),
    "align_uniform": (
        (),
        "same_view",
        False,
        False,
        False,
        False,
        False,
        False,
        False,
        {"lam": 1.0, "alpha": 2.0, "t": 2.0},
    ),
    "debiased": ((), "all", True, False, False, False, True, False, False, {"tau_plus": 0.1}),
    "hcl": ((), "all", True, False, False, False, True, False, False, {"tau_plus": 0.1, "beta": 1.0}),
    "infonce_lt": ((), "all", True, False, True, True, True, False, False, {}),
    "simsiam": ((), "none", False, False, False, False, False, True, False, {"pred_hidden": None}),
    "vicreg": ((), "none", False, False, False, False, False, False, False, {"lam": 25.0, "mu": 25.0, "nu": 1.0}),
    "byol": (
        (),
        "none",
        False,
        False,
        False,
        False,
        False,
        True,
        True,
        {"pred_hidden": None, "ema": 0.99, "ema_schedule": "cosine"},
    ),
}


def test_every_losss_registry_entry_is_the_one_written_out_here():
    """The registry's losses, in its order, and each one's properties and study defaults are
    those of LOSS_TABLE: a flag flipped by mistake (a whole-batch loss split over processes, a
    temperature reported for a kernel loss) or a default changed fails here, not silently in
    the tests that pick their losses by those flags."""
    from smallbatch.losses.registry import SPECS

    assert list(SPECS) == list(LOSS_TABLE)
    fields = (
        "aliases",
        "negatives",
        "per_anchor",
        "stateful",
        "learnable",
        "owns_temperature",
        "uses_temperature",
        "predictor",
        "ema_target",
    )
    for name, spec in SPECS.items():
        *flags, defaults = LOSS_TABLE[name]
        assert {f: getattr(spec, f) for f in fields} == dict(zip(fields, flags)), name
        assert {k: sch.get("default") for k, sch in spec.params.items()} == defaults, name


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise_value_error_naming_the_argument(name):
    z = torch.randn(4, 8)
    with pytest.raises(ValueError, match="z1/z2 batch size must be >= 2"):
        at_tau(build_loss(name), 0.1)(z[:1], z[:1])
    # (τ is the caller's, checked once where a cell is made: tests/study/test_config.py)
    with pytest.raises(ValueError, match="z1 and z2 must have the same shape"):
        at_tau(build_loss(name), 0.1)(z, torch.randn(4, 7))
    with pytest.raises(ValueError, match="z1 and z2 must have the same shape"):
        at_tau(build_loss(name), 0.1)(z, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"z1 must have shape \(N, D\)"):
        at_tau(build_loss(name), 0.1)(z[0], z[0])
    with pytest.raises(ValueError, match="queue has dimension 7 but q/k have dimension 8"):
        at_tau(build_loss(name), 0.1)(z, z, queue=torch.randn(10, 7))
    with pytest.raises(ValueError, match="queue is empty"):
        at_tau(build_loss(name), 0.1)(z, z, queue=MomentumQueue(10, 8))
    with pytest.raises(ValueError, match="queue_index is required"):
        at_tau(build_loss(name), 0.1)(z, z, queue=torch.randn(10, 8), q_index=torch.arange(4))
    with pytest.raises(ValueError, match="neg_mask leaves anchors without any valid negative"):
        at_tau(build_loss(name), 0.1)(
            z, z, queue=torch.randn(2, 8), q_index=torch.arange(4), queue_index=torch.tensor([1, 1])
        )


def test_bad_parameters_and_queue_inputs():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="sigma must be a number > 0"):
            at_tau(DCLW(sigma=bad), 0.1)
        with pytest.raises(ValueError, match="alpha must be a finite number > 0 or null"):
            at_tau(EqCo(alpha=bad), 0.1)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        at_tau(FlatNCE(gamma=-1.0), 0.1)
    with pytest.raises(ValueError, match="size must be >= 1"):
        MomentumQueue(0, 4)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        MomentumQueue(4, 0)
    qu = MomentumQueue(4, 3)
    with pytest.raises(ValueError, match=r"keys must have shape \(B, 3\)"):
        qu.enqueue(torch.randn(2, 4), torch.arange(2))
    with pytest.raises(ValueError, match="indices must have one entry per key"):
        qu.enqueue(torch.randn(2, 3), torch.arange(3))
    with pytest.raises(ValueError, match="neg must have one row per anchor"):
        at_tau(InfoNCE(), 0.1).from_scores(torch.zeros(3), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="neg_mask must be a bool tensor"):
        at_tau(InfoNCE(), 0.1).from_scores(torch.zeros(3), torch.zeros(3, 2), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_index/queue_index are only meaningful"):
        at_tau(InfoNCE(), 0.1)(torch.randn(3, 2), torch.randn(3, 2), q_index=torch.arange(3))


# --------------------------------------------------------------------------- DCL's mechanism
def _equal_coupling_batch(n: int, cos: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2N views in 2N dimensions: view i and its positive have cosine `cos`, every other
    pair is orthogonal, so every anchor has the same scores and the same q_B."""
    z1 = torch.zeros(n, 2 * n, dtype=torch.float64)
    z2 = torch.zeros(n, 2 * n, dtype=torch.float64)
    for i in range(n):
        z1[i, 2 * i] = 1.0
        z2[i, 2 * i], z2[i, 2 * i + 1] = cos, math.sqrt(1 - cos * cos)
    return z1, z2


@pytest.mark.parametrize("n,cos,tau", [(2, 0.9, 0.1), (8, 0.5, 0.2), (32, 0.99, 0.05), (16, 0.1, 1.0)])
def test_infonce_gradient_is_dcls_times_the_coupling_factor(n, cos, tau):
    """DCL (Yeh et al.): InfoNCE's gradient is DCL's times q_B = 1 - softmax_pos.  On a batch
    where every anchor has the same q_B the ratio of the embedding-gradient norms is q_B,
    which is what training logs (diag/grad_ratio_infonce_dcl next to diag/qb_mean)."""
    from smallbatch.losses.diagnostics import embedding_grad_norm

    z1, z2 = _equal_coupling_batch(n, cos)
    k = 2 * n - 2
    q = 1 - math.exp(cos / tau) / (math.exp(cos / tau) + k)
    g_info = embedding_grad_norm(InfoNCE(), z1, z2, temperature=tau)
    g_dcl = embedding_grad_norm(DCL(), z1, z2, temperature=tau)
    assert float(g_info / g_dcl) == pytest.approx(q, rel=1e-12)
    pos, neg, mask = in_batch_scores(z1, z2)
    assert diagnostics(pos, neg, tau, mask)["qb_mean"] == pytest.approx(q, rel=1e-12)
    # FlatNCE's gradient is DCL's (the paper's identity), so its norm is too
    assert float(embedding_grad_norm(FlatNCE(), z1, z2, temperature=tau)) == pytest.approx(float(g_dcl), rel=1e-12)


def test_the_ratio_is_not_q_b_when_anchors_differ():
    """With unequal q_B the norm ratio is a weighted mean of the anchors' q_B: between
    their extremes, but not their plain mean (the identity is per anchor)."""
    from smallbatch.losses.diagnostics import embedding_grad_norm

    z1, z2 = _views(12, 6, seed=4)
    pos, neg, mask = in_batch_scores(z1, z2)
    x_p, x_n = pos / 0.1, neg / 0.1
    qs = 1 - torch.exp(x_p - torch.logsumexp(torch.cat([x_p[:, None], x_n], 1), 1))
    ratio = float(
        embedding_grad_norm(InfoNCE(), z1, z2, temperature=0.1) / embedding_grad_norm(DCL(), z1, z2, temperature=0.1)
    )
    assert float(qs.min()) <= ratio <= float(qs.max())
    assert ratio != pytest.approx(float(qs.mean()), rel=1e-6)


def test_the_registry_loads_without_torch():
    """Names, labels and the config schema's loss parts come from a module that imports no
    torch: what the report and config planning read."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from smallbatch.losses import canonical_name, config_schema, display_name, loss_param_names, paper_family\n"
        "assert canonical_name('ntxent') == 'infonce' and display_name('dclw') == 'DCLW'\n"
        "assert config_schema()['loss_params'] and loss_param_names('eqco') == {'alpha': 256}\n"
        "assert paper_family('SimCLR (NT-Xent)') == 'infonce'\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_registry_entry_is_its_class_and_every_lazy_name_resolves():
    import smallbatch.losses as losses
    from smallbatch.losses.registry import SPECS

    for name, spec in SPECS.items():
        cls = REGISTRY[name]
        assert cls.spec is spec and cls.name == name and cls.display == spec.display, name
        assert cls.param_defaults == spec.defaults and cls.stateful == spec.stateful, name
        assert cls.__doc__ and spec.paper.split()[0] in cls.__doc__, f"{name}: its paper is not in its docstring"
    for attr in losses.__all__:
        assert getattr(losses, attr) is not None, attr
    import importlib

    for module, names in losses._LAZY.items():  # the lazy names are each module's public names, no more
        assert set(names) == set(importlib.import_module(f"smallbatch.losses.{module}").__all__), module
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        losses.nope  # noqa: B018


def test_the_documented_examples_run_as_written():
    """The ``Examples:`` of smallbatch.losses and of build_loss (README shows the same calls)."""
    import doctest

    import smallbatch.losses as losses
    from smallbatch.losses import build

    for module in (losses, build):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted >= 4 and result.failed == 0, f"{module.__name__}: {result}"


#: values to try on every loss parameter: at and around the usual bounds, huge, tiny, infinite, NaN
PROBES = (-1.0, 0, 0.0, 1e-300, 0.5, 1, 1.0, 1.5, 20, 20.5, 100, 101, 1e30, 1e308, math.inf, -math.inf, math.nan)


def _loss_param_cases():
    from smallbatch.losses.registry import SPECS

    return [(name, key) for name, spec in SPECS.items() for key in spec.params]


@pytest.mark.parametrize("name,key", _loss_param_cases(), ids=lambda v: str(v))
def test_the_config_schema_and_the_loss_accept_the_same_values_of_each_parameter(name, key):
    """One set of bounds: a value the schema lets into a study is one the loss is built with, and
    a value the loss refuses is refused when the study is planned (never by the job)."""
    from smallbatch.study.config import ConfigError, validate_config

    for value in PROBES:
        try:
            # τ = 100, the largest a cell takes: above every probe a τ floor (iSogCLR's tau_min) could be at
            grid = {"losses": [name], "batch_sizes": [16], "temperatures": [100], "seeds": [0]}
            validate_config({"datasets": {"digits": {}}, "grid": grid, "loss_params": {name: {key: value}}})
            planned = True
        except ConfigError:
            planned = False
        try:
            build_loss(name, **{key: value})
            built = True
        except ValueError:
            built = False
        assert planned == built, f"{name}.{key} = {value!r}: the schema {'accepts' if planned else 'refuses'} it"


# --------------------------------------------------------------------------- one default per door
#: a few losses' defaults as CONFIGURATION.md states them (EqCo: the paper's alpha = 256)
STATED_DEFAULTS = {
    "eqco": {"alpha": 256},
    "dclw": {"sigma": 0.5},
    "flatnce": {"gamma": 1.0},
    "vicreg": {"lam": 25.0, "mu": 25.0, "nu": 1.0},
    "byol": {"pred_hidden": None, "ema": 0.99, "ema_schedule": "cosine"},
    "infonce": {},
}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_build_loss_without_parameters_has_the_config_defaults(name):
    """The API (build_loss) and a config that leaves loss_params out build one loss: every
    parameter of every loss of the registry at the config's default."""
    from smallbatch.study.config import validate_config

    config_default = validate_config({})["loss_params"][name]
    assert build_loss(name).params() == config_default
    if name in STATED_DEFAULTS:
        assert config_default == STATED_DEFAULTS[name]


def test_eqco_built_by_the_api_is_not_infonce():
    """build_loss("eqco") scales the negatives by alpha/K with alpha = 256: at K = 12 its value
    differs from InfoNCE's by hand: log(e^{s_p} + (256/12) sum e^{s_j}) - s_p, here with all
    scores equal (z1 = z2 = one vector): log(1 + 256) against InfoNCE's log(1 + 12)."""
    z = torch.ones(7, 4, dtype=torch.float64)
    eq, info = at_tau(build_loss("eqco"), 0.5)(z, z), at_tau(build_loss("infonce"), 0.5)(z, z)
    assert info.value.item() == pytest.approx(math.log(13.0), rel=1e-12)
    assert eq.value.item() == pytest.approx(math.log(257.0), rel=1e-12)
