"""DHEL and KCL (Koromilas et al. 2024) and alignment + uniformity (Wang & Isola 2020) against
float64 loop references written from the authors' code (``pakoromilas/DHEL-KCL``
``losses.py``/``utils.py``, ``ssnl/align_uniform``): value and gradient; DHEL against DCL on
their shared terms; KCL's expected loss the same at two batch sizes on a fixed population."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from test_losses import _fd_grad, _views

from smallbatch.losses import build_loss, in_batch_scores, same_view_mask

torch.set_num_threads(1)


def _units(z: np.ndarray) -> np.ndarray:
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def _sq(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a - b) ** 2))


def ref_dhel(u: np.ndarray, v: np.ndarray, tau: float) -> float:
    """The authors' DHEL with include_augs=False: anchors u, positives v, negatives the other u's."""
    u, v = _units(u), _units(v)
    n = u.shape[0]
    total = 0.0
    for i in range(n):
        neg = sum(math.exp(float(u[i] @ u[j]) / tau) for j in range(n) if j != i)
        total += -float(u[i] @ v[i]) / tau + math.log(neg)
    return total / n


def ref_dhel_with_augs(u: np.ndarray, v: np.ndarray, tau: float) -> float:
    """The authors' default (include_augs=True): the other view's energy in the denominator too."""
    u, v = _units(u), _units(v)
    n = u.shape[0]
    total = 0.0
    for i in range(n):
        eu = sum(math.exp(float(u[i] @ u[j]) / tau) for j in range(n) if j != i)
        ev = sum(math.exp(float(v[i] @ v[j]) / tau) for j in range(n) if j != i)
        total += -math.log(math.exp(float(u[i] @ v[i]) / tau) / (eu * ev))
    return total / n


def ref_kcl(u: np.ndarray, v: np.ndarray, t: float, gamma: float) -> float:
    """The authors' KCL (Gaussian kernel): -2 mean_i k(u_i, v_i) + gamma (E(u) + E(v)), E the
    mean of k over the pairs i < j of a view (torch.pdist's pairs)."""
    u, v = _units(u), _units(v)
    n = u.shape[0]

    def energy(x):
        return float(np.mean([math.exp(-t * _sq(x[i], x[j])) for i in range(n) for j in range(i + 1, n)]))

    align = float(np.mean([math.exp(-t * _sq(u[i], v[i])) for i in range(n)]))
    return -2 * align + gamma * (energy(u) + energy(v))


def ref_align_uniform(u: np.ndarray, v: np.ndarray, lam: float, alpha: float, t: float) -> float:
    """ssnl/align_uniform's training loss: align_loss(x, y, alpha) + lam (uniform_loss(x, t) + uniform_loss(y, t)) / 2."""
    u, v = _units(u), _units(v)
    n = u.shape[0]
    align = float(np.mean([math.sqrt(_sq(u[i], v[i])) ** alpha for i in range(n)]))

    def unif(x):
        return math.log(np.mean([math.exp(-t * _sq(x[i], x[j])) for i in range(n) for j in range(i + 1, n)]))

    return align + lam * (unif(u) + unif(v)) / 2


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("n,d,tau", [(2, 3, 0.1), (5, 8, 0.3), (9, 16, 1.0)])
def test_dhel_is_the_authors_loss_with_the_views_in_both_orders(n, d, tau):
    z1, z2 = _views(n, d, seed=n)
    u, v = z1.numpy(), z2.numpy()
    out = build_loss("dhel")(z1, z2, temperature=tau)
    assert out.loss.item() == pytest.approx((ref_dhel(u, v, tau) + ref_dhel(v, u, tau)) / 2, rel=1e-12)
    # the authors' default adds the other view's energy: twice this loss plus the mean s_p/tau
    pos, _, _ = in_batch_scores(z1, z2)
    assert ref_dhel_with_augs(u, v, tau) == pytest.approx(2 * out.loss.item() + pos.mean().item() / tau, rel=1e-12)


@pytest.mark.parametrize("n,d,t,gamma", [(2, 3, 2.0, 16.0), (6, 8, 2.0, 16.0), (9, 4, 0.5, 1.0)])
def test_kcl_is_the_authors_loss(n, d, t, gamma):
    z1, z2 = _views(n, d, seed=10 + n)
    out = build_loss("kcl", t=t, gamma=gamma)(z1, z2)
    assert out.loss.item() == pytest.approx(ref_kcl(z1.numpy(), z2.numpy(), t, gamma), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("n,d,lam,alpha,t", [(2, 3, 1.0, 2.0, 2.0), (7, 8, 1.0, 2.0, 2.0), (5, 4, 0.5, 1.5, 3.0)])
def test_align_uniform_is_ssnls_loss(n, d, lam, alpha, t):
    z1, z2 = _views(n, d, seed=20 + n)
    out = build_loss("align_uniform", lam=lam, alpha=alpha, t=t)(z1, z2)
    ref = ref_align_uniform(z1.numpy(), z2.numpy(), lam, alpha, t)
    assert out.loss.item() == pytest.approx(ref, rel=1e-12) and out.value.item() == pytest.approx(ref, rel=1e-12)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize(
    "name,params,ref",
    [
        ("dhel", {}, lambda u, v: (ref_dhel(u, v, 0.3) + ref_dhel(v, u, 0.3)) / 2),
        ("kcl", {"t": 2.0, "gamma": 4.0}, lambda u, v: ref_kcl(u, v, 2.0, 4.0)),
        ("align_uniform", {"lam": 1.0, "alpha": 2.0, "t": 2.0}, lambda u, v: ref_align_uniform(u, v, 1.0, 2.0, 2.0)),
    ],
)
@pytest.mark.parametrize("n,d", [(2, 2), (3, 4)])
def test_gradient_matches_finite_differences(name, params, ref, n, d):
    z1, z2 = _views(n, d, seed=3 * n + d)
    a, b = z1.clone().requires_grad_(), z2.clone().requires_grad_()
    build_loss(name, **params)(a, b, temperature=0.3).loss.backward()
    x1, x2 = z1.numpy().copy(), z2.numpy().copy()
    g1, g2 = _fd_grad(lambda: ref(x1, x2), [x1, x2])
    np.testing.assert_allclose(a.grad.numpy(), g1, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(b.grad.numpy(), g2, rtol=1e-5, atol=1e-8)


# --------------------------------------------------------------------------- the papers' identities
@pytest.mark.parametrize("n,tau", [(3, 0.1), (8, 0.5)])
def test_dhel_against_dcl_on_their_shared_terms(n, tau):
    """The same positive term; DHEL's negatives are DCL's same-view ones, so per anchor
    DCL - DHEL = log(1 + sum over the other view / sum over the own view) >= 0, and the
    gradient of the positive's score is -1/tau in both."""
    z1, z2 = _views(n, 6, seed=n)
    pos, neg, _ = in_batch_scores(z1, z2)
    same = same_view_mask(n)
    dcl = build_loss("dcl")._rows(pos, neg, None, tau, None)[0]
    p = pos.clone().requires_grad_()
    dhel = build_loss("dhel")._rows(p, neg, same, tau, None)[0]
    e = torch.exp(neg / tau)
    expected = torch.log1p((e * ~same).sum(1) / (e * same).sum(1))
    torch.testing.assert_close(dcl - dhel, expected, rtol=1e-12, atol=1e-14)
    assert (dcl - dhel > 0).all()
    (g,) = torch.autograd.grad(dhel.sum(), p)
    torch.testing.assert_close(g, torch.full_like(g, -1 / tau))
    assert build_loss("dhel")(z1, z2, temperature=tau).loss.item() == pytest.approx(
        build_loss("dcl").from_scores(pos, neg, same, temperature=tau).loss.item(), rel=1e-14
    )


def _expected_over_batches(name: str, z1: torch.Tensor, z2: torch.Tensor, size: int, **params) -> float:
    """The loss averaged over every batch of ``size`` images of the population (z1, z2)."""
    subsets = list(itertools.combinations(range(z1.shape[0]), size))
    loss = build_loss(name, **params)
    return sum(loss(z1[list(s)], z2[list(s)], temperature=0.5).loss.item() for s in subsets) / len(subsets)


def test_kcls_expected_loss_does_not_depend_on_the_batch_size():
    """Koromilas et al.'s claim, on a fixed population of 7 images (two views each): the
    mean of KCL over all C(7, B) batches is the same for B = 2, 3 and 5 -- every term is a
    mean over pairs, an unbiased estimate of the population's.  DHEL's (a log of a batch
    mean) and InfoNCE's move with B."""
    z1, z2 = _views(7, 5, seed=42)
    kcl = [_expected_over_batches("kcl", z1, z2, b) for b in (2, 3, 5)]
    assert kcl[1] == pytest.approx(kcl[0], rel=1e-12) and kcl[2] == pytest.approx(kcl[0], rel=1e-12)
    assert kcl[0] == pytest.approx(build_loss("kcl")(z1, z2).loss.item(), rel=1e-12)  # = the whole population's
    for other in ("dhel", "infonce"):
        small, large = (_expected_over_batches(other, z1, z2, b) for b in (2, 5))
        assert abs(small - large) > 0.1, other


def test_same_view_losses_refuse_a_queue_and_align_uniform_needs_both_views():
    z1, z2 = _views(4, 3, seed=0)
    for name in ("dhel", "kcl", "align_uniform"):
        with pytest.raises(ValueError, match="same-view in-batch negatives, which a queue does not hold"):
            build_loss(name)(z1, z2, queue=torch.randn(5, 3, dtype=torch.float64), temperature=0.1)
    pos, neg, _ = in_batch_scores(z1, z2)
    with pytest.raises(ValueError, match="anchors of both views"):
        build_loss("align_uniform").from_scores(pos[:3], neg[:3])
    for key, bad in (("t", 0.0), ("gamma", -1.0), ("lam", float("inf"))):
        name = "align_uniform" if key == "lam" else "kcl"
        with pytest.raises(ValueError, match=rf"{key} must be a finite number (> 0|in \(0, )"):
            build_loss(name, **{key: bad})
