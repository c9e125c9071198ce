"""McCandlish et al.'s gradient-noise estimators, unbiased on a quadratic with a known
per-example gradient distribution (float64), and the fixed-pool contrastive loss whose
per-image terms are independent."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from smallbatch.losses import build_loss
from smallbatch.training.noise_scale import (
    fixed_pool_loss,
    noise_scale,
    noise_scale_interval,
    squared_grad_norm,
)

# the quadratic: example x ~ N(mu, Sigma), loss 1/2 |w - x|^2, so its gradient w - x has mean
# G = w - mu and covariance Sigma
SIGMA_DIAG = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0], dtype=torch.float64)
G_TRUE = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5], dtype=torch.float64)
G2, TRACE = 6.5, 10.5  # |G|^2 = 1 + 1 + 0.25 + 0 + 4 + 0.25; tr(Sigma) = 0.5 + 1 + ... + 3
B_SMALL, B_BIG, DRAWS = 2, 16, 3000


def _squared_norms(batch: int, draws: int, gen: torch.Generator) -> list[float]:
    w = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    mu = w.detach() - G_TRUE
    out = []
    for _ in range(draws):
        x = mu + SIGMA_DIAG.sqrt() * torch.randn(batch, 6, dtype=torch.float64, generator=gen)
        out.append(squared_grad_norm(0.5 * ((w - x) ** 2).sum(dim=1).mean(), [w]))
    return out


def _var_sq_norm(batch: int) -> float:
    """Var |g_B|^2 for g_B ~ N(G, Sigma/B): 2 tr((Sigma/B)^2) + 4 G^T (Sigma/B) G."""
    s = SIGMA_DIAG / batch
    return float(2 * (s * s).sum() + 4 * (G_TRUE * s * G_TRUE).sum())


def test_the_estimators_invert_the_expected_squared_norms_exactly():
    # E|g_B|^2 = |G|^2 + tr(Sigma)/B: 6.5 + 10.5/2 = 11.75 and 6.5 + 10.5/16 = 7.15625
    est = noise_scale([11.75], [7.15625], 2, 16)
    assert est.g2 == pytest.approx(6.5, rel=1e-12)
    assert est.trace == pytest.approx(10.5, rel=1e-12)
    assert est.b_simple == pytest.approx(10.5 / 6.5, rel=1e-12)


def test_the_estimators_are_unbiased_on_a_quadratic_with_known_sigma():
    """Averages over 3000 draws at each batch size lie within 4 standard errors of |G|^2 and
    tr(Sigma); the standard errors from the closed-form variance of |g_B|^2."""
    gen = torch.Generator().manual_seed(0)
    small, big = _squared_norms(B_SMALL, DRAWS, gen), _squared_norms(B_BIG, DRAWS, gen)
    est = noise_scale(small, big, B_SMALL, B_BIG)
    v_small, v_big = _var_sq_norm(B_SMALL) / DRAWS, _var_sq_norm(B_BIG) / DRAWS
    se_g2 = math.sqrt(B_BIG**2 * v_big + B_SMALL**2 * v_small) / (B_BIG - B_SMALL)
    se_trace = math.sqrt(v_small + v_big) / (1 / B_SMALL - 1 / B_BIG)
    assert abs(est.g2 - G2) < 4 * se_g2
    assert abs(est.trace - TRACE) < 4 * se_trace
    assert se_g2 < 0.1 * G2 and se_trace < 0.1 * TRACE  # a check with teeth
    lo, hi = noise_scale_interval(small, big, B_SMALL, B_BIG, replicas=300)
    assert lo < TRACE / G2 < hi


def test_no_resolved_signal_gives_an_unbounded_noise_scale():
    # the same mean squared norm at both batch sizes: no noise, tr(Sigma) = 0 and |G|^2 = 4
    assert noise_scale([4.0], [4.0], 2, 16).b_simple == 0.0
    # |G|^2 = (16 * 1 - 2 * 9) / 14 < 0: no signal resolved
    assert noise_scale([9.0], [1.0], 2, 16).b_simple == float("inf")
    # every resample: 16 * (at most 1) - 2 * (at least 9) < 0
    lo, hi = noise_scale_interval([9.0, 10.0, 11.0], [0.5, 1.0, 0.8], 2, 16, replicas=50)
    assert lo == hi == float("inf")


def test_bad_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_scale([1.0], [1.0], 16, 16)


def test_the_fixed_pool_loss_is_infonce_against_the_pool_and_a_mean_over_images():
    gen = torch.Generator().manual_seed(1)
    z1, z2, pool = (torch.randn(n, 5, dtype=torch.float64, generator=gen) for n in (4, 4, 7))
    tau = 0.5
    loss = build_loss("infonce")
    got = fixed_pool_loss(loss, z1, z2, pool, tau)
    a, p, u = F.normalize(z1, dim=1), F.normalize(z2, dim=1), F.normalize(pool, dim=1)
    terms = []
    for anchor, positive in ((a, p), (p, a)):  # both views are anchors
        s_pos = (anchor * positive).sum(dim=1) / tau
        logits = torch.cat([s_pos[:, None], anchor @ u.T / tau], dim=1)
        terms.append(torch.logsumexp(logits, dim=1) - s_pos)
    assert float(got) == pytest.approx(float(torch.cat(terms).mean()), rel=1e-12)
    alone = [float(fixed_pool_loss(loss, z1[i : i + 1], z2[i : i + 1], pool, tau)) for i in range(4)]
    assert float(got) == pytest.approx(sum(alone) / 4, rel=1e-12)  # no term depends on another image
