"""Batches of K-groups and the estimators' readouts on them: a bound's loss, its estimate and ceiling, the dual estimate."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..losses import build_loss
from .critics import Critic
from .gaussian import check_k, sample_correlated_gaussians
from .names import ESTIMATORS


def group_layout(k: int, anchors: int) -> tuple[int, int, int]:
    """``(G, n, A)``: groups per batch, pairs per group (K+1), anchors per group."""
    k = check_k(k)
    anchors = check_k(anchors, "anchors")
    n = k + 1
    a = min(n, anchors)
    g = max(1, math.ceil(anchors / n))
    return g, n, a


def train_anchors(k: int, anchors: int, max_pairs: int | None) -> int:
    """Anchors per training batch: ``min(anchors, max_pairs // (K+1))``, at least 1 (no cap if None)."""
    k = check_k(k)
    anchors = check_k(anchors, "anchors")
    if max_pairs is None:
        return anchors
    max_pairs = check_k(max_pairs, "max_pairs")
    return max(1, min(anchors, max_pairs // (k + 1)))


def sample_groups(k: int, anchors: int, d: int, rho: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    g, n, _ = group_layout(k, anchors)
    x, y = sample_correlated_gaussians(g * n, d, rho, generator)
    return x.view(g, n, d), y.view(g, n, d)


def batch_scores(critic: Critic, x: Tensor, y: Tensor, anchors: int) -> tuple[Tensor, Tensor]:
    """Scores of a batch ``x, y (G, n, d)`` (n = K+1 pairs per group):
    ``pos (G*A,)`` and ``neg (G*A, K)`` for the first ``A = min(n, anchors)`` anchors of each group."""
    n = x.shape[1]
    a = min(n, int(anchors))
    s = critic.group_scores(x[:, :a], y)  # (G, A, n)
    s = s.reshape(-1, n)
    return s[:, 0], s[:, 1:]


def check_estimator(name: str) -> str:
    key = str(name).strip().lower()
    if key not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {name!r}")
    return key


#: the τ every estimator's loss is called at: the critics' scores are the logits themselves
#: (not cosines to be divided by a temperature; a bounded critic has its own, critic_temperature)
SCORE_TAU = 1.0


def estimator_loss(estimator: str, alpha: float | None = None):
    """The study's loss for an estimator (called at :data:`SCORE_TAU`: scores are critic outputs)."""
    key = check_estimator(estimator)
    if key == "eqco":
        if alpha is None:
            raise ValueError("alpha is required for the eqco estimator (eqco_alpha in the mi section)")
        return build_loss("eqco", alpha=float(alpha))
    return build_loss(key)


def mi_ceiling(estimator: str, k: int, alpha: float | None = None) -> float:
    """The largest value the estimator can report: ``log(K+1)`` (InfoNCE, FlatNCE's
    readout) or ``log(alpha+1)`` (EqCo)."""
    key = check_estimator(estimator)
    k = check_k(k)
    if key == "eqco":
        if alpha is None or not float(alpha) > 0:
            raise ValueError(f"alpha must be > 0 for the eqco estimator, got {alpha!r}")
        return math.log1p(float(alpha))
    return math.log1p(k)


def mi_estimate(estimator: str, pos: Tensor, neg: Tensor, alpha: float | None = None, loss=None) -> Tensor:
    """The estimator's MI estimate (detached scalar) from scores ``pos (B,)``, ``neg (B, K)``.

    ``infonce``/``flatnce``: ``log(K+1) - L_InfoNCE``; ``eqco``: ``log(alpha+1) - L_EqCo``
    (see the module docstring).  The loss values come from the losses module
    (``from_scores`` at temperature 1); ``loss`` may pass a prebuilt loss.
    """
    key = check_estimator(estimator)
    k = neg.shape[1]
    loss = loss if loss is not None else estimator_loss(key, alpha)
    with torch.no_grad():
        out = loss.from_scores(pos.detach(), neg.detach(), temperature=SCORE_TAU)
    return estimate_from_output(key, out, k, alpha)


def estimate_from_output(key: str, out, k: int, alpha: float | None) -> Tensor:
    if key == "eqco":
        assert alpha is not None  # estimator_loss gave EqCo its alpha
        return math.log1p(float(alpha)) - out.value
    return math.log1p(k) - out.infonce


def dual_estimate(pos: Tensor, neg: Tensor) -> Tensor:
    """FLO/FlatNCE dual readout ``log K - mean_i logsumexp_j(s_j - s_+)`` (no log-K ceiling;
    not a guaranteed lower bound).  Uses FlatNCE's loss value from the losses module."""
    with torch.no_grad():
        out = build_loss("flatnce").from_scores(pos.detach(), neg.detach(), temperature=SCORE_TAU)
    return math.log(neg.shape[1]) - out.value
