"""The methods without negatives -- SimSiam (Chen & He 2021), BYOL (Grill et al. 2020) and VICReg
(Bardes et al. 2022) -- against float64 loop references written from the authors' code
(``facebookresearch/simsiam`` ``main_simsiam.py``: ``-(cos(p1, z2) + cos(p2, z1)) / 2`` with the
targets detached; solo-learn's ``byol_loss_func``; ``facebookresearch/vicreg`` ``main_vicreg.py``),
value and gradient; the stop-gradient (no gradient reaches a target); the covariance term as the
paper defines it and its rank at a batch smaller than the dimension."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_losses import _fd_grad

from smallbatch.losses import build_loss, vicreg_terms
from smallbatch.losses.diagnostics import batch_covariance_rank
from smallbatch.losses.registry import loss_spec

torch.set_num_threads(1)


def _four(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(4)]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b) / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b)))


def ref_simsiam(p1, p2, z1, z2) -> float:
    n = p1.shape[0]
    return -(sum(_cos(p1[i], z2[i]) for i in range(n)) / n + sum(_cos(p2[i], z1[i]) for i in range(n)) / n) / 2


def ref_byol(p1, p2, z1, z2) -> float:
    n = p1.shape[0]
    return sum(2 - 2 * _cos(p1[i], z2[i]) for i in range(n)) / n + sum(2 - 2 * _cos(p2[i], z1[i]) for i in range(n)) / n


def ref_vicreg_terms(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """The paper's three terms, one entry at a time (the authors' code's means: the invariance
    over the N D entries, the variance term the mean of the two views')."""
    n, d = x.shape
    inv = sum((x[i, j] - y[i, j]) ** 2 for i in range(n) for j in range(d)) / (n * d)

    def var_term(z):
        total = 0.0
        for j in range(d):
            mean = sum(z[i, j] for i in range(n)) / n
            var = sum((z[i, j] - mean) ** 2 for i in range(n)) / (n - 1)
            total += max(0.0, 1.0 - math.sqrt(var + 1e-4))
        return total / d

    def cov_term(z):
        mean = [sum(z[i, j] for i in range(n)) / n for j in range(d)]
        total = 0.0
        for j in range(d):
            for k in range(d):
                if j != k:
                    c = sum((z[i, j] - mean[j]) * (z[i, k] - mean[k]) for i in range(n)) / (n - 1)
                    total += c * c
        return total / d

    return inv, (var_term(x) + var_term(y)) / 2, cov_term(x) + cov_term(y)


def ref_vicreg(x, y, lam=25.0, mu=25.0, nu=1.0) -> float:
    inv, var, cov = ref_vicreg_terms(x, y)
    return lam * inv + mu * var + nu * cov


@pytest.mark.parametrize("name,ref", [("simsiam", ref_simsiam), ("byol", ref_byol)])
@pytest.mark.parametrize("n,d", [(2, 1), (5, 3), (8, 16)])
def test_predictive_losses_match_the_reference_and_stop_the_targets_gradient(name, ref, n, d):
    """Value and gradient w.r.t. the predictions against finite differences of the loop
    reference at fixed targets; the targets get exactly zero gradient (the stop-gradient)."""
    p1, p2, t1, t2 = (x.clone().requires_grad_(True) for x in _four(n, d, seed=n + d))
    out = build_loss(name)(p1, p2, t1, t2)
    arrays = [x.detach().numpy().copy() for x in (p1, p2, t1, t2)]
    assert out.loss.item() == pytest.approx(ref(*arrays), rel=1e-12, abs=1e-12)
    g = torch.autograd.grad(out.loss, (p1, p2, t1, t2), allow_unused=True)
    fd = _fd_grad(lambda: ref(*arrays), arrays[:2])
    for got, want in zip(g[:2], fd):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-8)
    assert all(x is None or not x.any() for x in g[2:]), "a gradient reached the target branch"


def test_simsiam_through_a_shared_network_is_its_detached_target_form():
    """SimSiam's targets are the same network's projections: the loss's stop-gradient makes the
    network's gradient the one of explicitly detached targets, and not the one without it."""
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(6, 4).double()
    pred = torch.nn.Linear(4, 4).double()
    x1, x2 = torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 6, generator=g, dtype=torch.float64)
    loss = build_loss("simsiam")

    def grads(detach_by_hand: bool, stop: bool = True):
        z1, z2 = net(x1), net(x2)
        t1, t2 = (z1.detach(), z2.detach()) if detach_by_hand else (z1, z2)
        if stop:
            value = loss(pred(z1), pred(z2), t1, t2).loss
        else:  # the same formula with the gradient through the targets
            cos = torch.nn.functional.cosine_similarity
            value = -(cos(pred(z1), z2).mean() + cos(pred(z2), z1).mean()) / 2
        return torch.autograd.grad(value, list(net.parameters()))

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)
    assert any(not torch.allclose(a, b) for a, b in zip(grads(False), grads(True, stop=False)))


@pytest.mark.parametrize("n,d", [(2, 2), (5, 3), (9, 4)])
def test_vicreg_matches_the_reference_in_value_and_gradient(n, d):
    x, y, _, _ = _four(n, d, seed=3 * n + d)
    y = 0.3 * y  # some dimensions below gamma = 1: the hinge is active for a few
    a, b = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    loss = build_loss("vicreg", lam=2.0, mu=3.0, nu=5.0)
    out = loss(a, b)
    arrays = [x.numpy().copy(), y.numpy().copy()]
    assert out.loss.item() == pytest.approx(ref_vicreg(*arrays, 2.0, 3.0, 5.0), rel=1e-12)
    ga, gb = torch.autograd.grad(out.loss, (a, b))
    fa, fb = _fd_grad(lambda: ref_vicreg(*arrays, 2.0, 3.0, 5.0), arrays)
    np.testing.assert_allclose(ga.numpy(), fa, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gb.numpy(), fb, rtol=1e-6, atol=1e-8)
    terms = [t.item() for t in vicreg_terms(x, y)]
    assert terms == pytest.approx(list(ref_vicreg_terms(*arrays)), rel=1e-12)
    assert build_loss("vicreg")(x, y).loss.item() == pytest.approx(ref_vicreg(*arrays), rel=1e-12)  # 25, 25, 1


def test_vicregs_covariance_term_is_zero_exactly_for_decorrelated_dimensions_and_needs_n_above_d():
    """c(Z) = (1/d) sum_{j != k} C_jk^2 with C the unbiased covariance: 0 for a batch whose
    centred columns are orthogonal; scaled to unit variance such a batch also zeroes the
    variance hinge up to eps.  With N <= D no N-sample batch can have D orthogonal centred
    columns of unit variance: its covariance has rank at most N - 1 (logged as cov_rank)."""
    n, d = 12, 4
    q, _ = torch.linalg.qr(torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    q = q - q.mean(dim=0)
    q, _ = torch.linalg.qr(q)  # orthonormal, still centred (the mean of a centred column's combinations is 0)
    z = q * math.sqrt(n - 1)  # unit unbiased variance per column, zero covariance
    inv, var, cov = vicreg_terms(z, z)
    assert inv.item() == 0 and cov.item() == pytest.approx(0.0, abs=1e-24)
    assert var.item() == pytest.approx(max(0.0, 1 - math.sqrt(1 + 1e-4)), abs=1e-15)
    assert batch_covariance_rank(z) == {"cov_rank": 4.0, "cov_rank_bound": 4.0}
    small = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert batch_covariance_rank(small) == {"cov_rank": 2.0, "cov_rank_bound": 2.0}
    scale = (small - small.mean(0)).std(dim=0, keepdim=True)
    assert vicreg_terms(small / scale, small / scale)[2].item() > 0.1  # unit variances force correlations


def test_the_methods_declare_what_they_need_and_refuse_scores():
    simsiam, vicreg, byol = (loss_spec(n) for n in ("simsiam", "vicreg", "byol"))
    assert not simsiam.contrastive and simsiam.predictor and not simsiam.ema_target
    assert not vicreg.predictor and not vicreg.ema_target and byol.predictor and byol.ema_target
    assert all(s.one_process and not s.uses_temperature for s in (simsiam, vicreg, byol))
    with pytest.raises(TypeError, match="SimSiam is a method without negatives"):
        build_loss("simsiam").from_scores(torch.zeros(4), torch.zeros(4, 6))
    assert build_loss("simsiam").predictor_hidden(64, 128) == 16  # SimSiam's bottleneck, proj_dim / 4
    assert (
        build_loss("byol").predictor_hidden(64, 128) == 128
        and build_loss("byol", pred_hidden=7).predictor_hidden(64, 128) == 7
    )
    for bad in ({"pred_hidden": 0}, {"ema": 1.5}, {"ema_schedule": "linear"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build_loss("byol", **bad)
    with pytest.raises(ValueError, match="targets"):
        build_loss("simsiam")(*_four(4, 3, 0)[:2])
