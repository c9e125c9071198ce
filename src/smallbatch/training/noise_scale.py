"""The gradient noise scale of McCandlish et al. 2018 (*An Empirical Model of Large-Batch
Training*, App. A), from squared gradient norms at two batch sizes.

A mini-batch of B examples drawn independently has the gradient ``g_B = G + noise`` with
``E g_B = G`` and covariance ``Sigma / B`` (``Sigma`` the per-example gradients' covariance),
so ``E |g_B|^2 = |G|^2 + tr(Sigma) / B``.  From the mean squared norms at ``B_small < B_big``
the unbiased estimators are

    |G|^2     ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small),
    tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big),

and the simple noise scale is their ratio, ``B_simple = tr(Sigma) / |G|^2``, taken as a ratio
of the averages over many draws (as the paper does: the ratio of one draw's estimates is
biased and may be negative).  Unbiased only if the examples are independent: draw them with
replacement, and use a loss in which one example's term does not depend on the others --
BatchNorm in eval mode, and for a contrastive loss negatives that stay fixed while the
anchors are drawn (:func:`fixed_pool_loss`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..losses import ContrastiveLoss, queue_scores

__all__ = ["NoiseScale", "noise_scale", "noise_scale_interval", "squared_grad_norm", "fixed_pool_loss"]


class NoiseScale(NamedTuple):
    """``g2`` the estimate of |G|^2, ``trace`` of tr(Sigma), ``b_simple`` = trace / g2."""

    g2: float
    trace: float
    b_simple: float


def _mean(values: Sequence[float], name: str) -> float:
    if len(values) < 1:
        raise ValueError(f"{name} needs at least one squared gradient norm")
    return sum(float(v) for v in values) / len(values)


def _estimates(small, big, b_small: int, b_big: int):
    """(|G|^2, tr(Sigma)) from the mean squared norms ``small`` and ``big`` (floats or arrays)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"the two batch sizes must satisfy 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


def _ratio(trace, g2):
    """B_simple = tr(Sigma) / |G|^2; infinite where the estimated |G|^2 is not positive (no
    signal resolved above the noise: the noise scale is unbounded)."""
    import numpy as np

    g2 = np.asarray(g2, dtype=np.float64)
    return np.where(g2 > 0, np.asarray(trace, dtype=np.float64) / np.where(g2 > 0, g2, 1.0), np.inf)


def noise_scale(sq_small: Sequence[float], sq_big: Sequence[float], b_small: int, b_big: int) -> NoiseScale:
    """McCandlish et al.'s estimates (module docstring) from the squared gradient norms of
    independent draws at ``b_small`` (``sq_small``) and ``b_big`` (``sq_big``)."""
    g2, trace = _estimates(_mean(sq_small, "sq_small"), _mean(sq_big, "sq_big"), b_small, b_big)
    return NoiseScale(g2, trace, float(_ratio(trace, g2)))


def noise_scale_interval(
    sq_small: Sequence[float],
    sq_big: Sequence[float],
    b_small: int,
    b_big: int,
    replicas: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of B_simple: the draws at each batch size resampled with
    replacement, the estimates recomputed ``replicas`` times.  A replica whose |G|^2 is not
    positive counts as an infinite B_simple, so an upper end of ``inf`` says the draws do not
    bound the noise scale from above (the lower end still holds)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    small, big = np.asarray(sq_small, dtype=np.float64), np.asarray(sq_big, dtype=np.float64)
    means = [rng.choice(x, size=(replicas, x.size)).mean(axis=1) for x in (small, big)]
    g2, trace = _estimates(means[0], means[1], b_small, b_big)
    q = [(1 - level) / 2, (1 + level) / 2]
    lo, hi = np.quantile(_ratio(trace, g2), q, method="inverted_cdf")  # data points: inf stays inf
    return float(lo), float(hi)


def squared_grad_norm(loss: Tensor, params: Iterable[Tensor]) -> float:
    """``|d loss / d params|^2`` in float64 (a parameter the loss does not reach counts 0)."""
    params = [p for p in params if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(sum((g.double() ** 2).sum() for g in grads if g is not None))


def fixed_pool_loss(loss: ContrastiveLoss, z1: Tensor, z2: Tensor, pool: Tensor, temperature: float | Tensor) -> Tensor:
    """A contrastive loss whose negatives are a fixed pool: each of the 2N views of the N
    anchors' images is scored against its other view (the positive) and the M pool
    embeddings (K = M negatives, the same for every anchor and every draw), as MoCo scores a
    query against its key and a queue (:func:`smallbatch.losses.queue_scores`).  Its value is
    the mean of independent per-image terms, so the gradient noise of a draw of anchors is
    the anchors' alone."""
    pos, neg, mask = queue_scores(torch.cat([z1, z2]), torch.cat([z2, z1]), pool.detach())
    return loss.from_scores(pos, neg, mask, temperature=temperature).loss
