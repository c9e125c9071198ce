"""SogCLR: a per-image moving average of the negatives' term across steps."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import ContrastiveLoss
from .scores import masked, row_counts

__all__ = ["SogCLR"]


class SogCLR(ContrastiveLoss, spec="sogclr"):
    r"""SogCLR (Yuan et al. 2022, "Provable Stochastic Optimization for Global
    Contrastive Learning: Small Batch Does Not Harm Performance", ICML,
    arXiv:2202.12387), as LibAUC's ``libauc/losses/contrastive.py::GCLoss_v1``
    implements it.

    The global contrastive objective of anchor ``r`` puts the mean over *every*
    negative of the data set where DCL has the batch's::

        F_r = -s_p,r/tau + log E_{j in data set} exp(s_rj/tau)

    A batch estimates its gradient's ``1/E exp`` with a bias that grows as the batch
    shrinks; SogCLR keeps a moving average ``u`` per *dataset image* of the batch's
    estimate instead (``K_r`` = the anchor's valid negatives, ``i(r)`` its image)::

        g_r   = (1/K_r) sum_j exp(s_rj/tau)                 # this batch's estimate
        u_r   = (1 - gamma) u[i(r)] + gamma g_r              # u_r = g_r for an image never seen
        u[i] <- mean of u_r over the views r of image i      # GCLoss_v1: (u1 + u2)/2
        w_rj  = exp(s_rj/tau) / u_r                          # no gradient
        L_r   = -s_p,r/tau + (1/K_r) sum_j w_rj s_rj/tau     # its gradient is SogCLR's

    ``value`` (logged) is ``-s_p,r/tau + log u_r``, the moving estimate of ``F_r``.

    *gamma = 1, the non-moving (DCL-like) ablation*: ``u_r = g_r``, so
    ``w_rj = K_r softmax_j(s_rj/tau)`` and the gradient of ``L_r`` is exactly DCL's,
    with ``value_r = DCL_r - log K_r``, whatever ``u`` held before.

    Against GCLoss_v1 (checked in float64 by ``tests/core/test_sogclr.py``): GCLoss_v1's loss
    (scores not divided by tau, summed over the two views, averaged over N images) is
    ``2 tau`` times this one (averaged over the 2N anchors) — same ``u``, same weights,
    gradient scaled by ``2 tau``.  Two choices of ours: ``u`` is stored as ``log u``
    (``exp(s/tau)`` overflows float32 below tau ~ 0.011; no eps clamp is needed), and
    "never seen" (``u = 0``) is decided per image, where GCLoss_v1 asks whether the whole
    batch's ``u`` sums to 0; the two agree for a batch of only new or only seen images
    (every batch of the first epoch, and of later ones when an epoch covers the data) and
    differ for a batch mixing both, where GCLoss_v1 gives a new image ``u = gamma g``.
    The paper writes ``g`` with ``exp((s_rj - s_p,r)/tau)``; GCLoss_v1 (and this loss)
    averages ``exp(s_rj/tau)``: the same gradient at gamma = 1, and ``u`` does not move
    with the positive's score.

    ``u`` lives in this module (buffer ``log_u``, one entry per training image,
    :meth:`init_state`), is read and written only by a call with ``index`` (the training
    step: :meth:`from_scores`), and is saved in ``state.pt`` with the loss's
    ``state_dict()``.  A call without ``index`` (diagnostics, the gradient-norm and
    rounding-error measurements, a process's share of anchors) is the gamma = 1 form and
    changes nothing.  With a mask, ``g_r`` averages the anchor's valid negatives only.
    Parameters (τ is given per call): ``gamma`` in (0, 1] (default 0.9, GCLoss_v1's).
    """

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.register_buffer("log_u", torch.empty(0))

    def _check_param(self, key, value):
        try:
            g = float(value)
        except (TypeError, ValueError):
            g = float("nan")
        if not (0 < g <= 1):
            raise ValueError(f"gamma must be in (0, 1] (SogCLR's moving-average weight; 1 = no memory), got {value!r}")
        return g

    def init_state(self, n_images: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        """``log u`` of ``n_images`` training images, all ``-inf`` (``u = 0``: never seen)."""
        if int(n_images) < 1:
            raise ValueError(f"n_images must be >= 1, got {n_images!r}")
        self.log_u = torch.full((int(n_images),), float("-inf"), device=device, dtype=dtype)

    @staticmethod
    def _log_g(neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor) -> Tensor:
        """``log g_r``: log of the mean of ``exp(s_rj/tau)`` over the valid negatives (no gradient)."""
        return torch.logsumexp(masked(neg.detach() / tau, neg_mask), dim=1) - torch.log(row_counts(neg, neg_mask))

    @staticmethod
    def _weighted(
        pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, log_u: Tensor
    ) -> tuple[Tensor, Tensor]:
        xp, xn = pos / tau, neg / tau
        w = torch.exp(masked(xn.detach(), neg_mask) - log_u[:, None])  # masked entries: weight 0
        rows = -xp + (w * xn).sum(dim=1) / row_counts(neg, neg_mask)
        return rows, -xp.detach() + log_u

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        return self._weighted(pos, neg, neg_mask, tau, self._log_g(neg, neg_mask, tau))

    def _rows_at(self, pos, neg, neg_mask, tau, index):
        index = torch.as_tensor(index, device=pos.device)
        if index.dim() != 2 or index.numel() != pos.shape[0]:
            raise ValueError(f"index must be (V, N) with V N = {pos.shape[0]} anchors, got {tuple(index.shape)}")
        if self.log_u.numel() == 0:
            raise ValueError("SogCLR's u is not allocated: call init_state(n_images) before a step with index")
        with torch.no_grad():
            log_g = self._log_g(neg, neg_mask, tau)
            old = self.log_u[index.reshape(-1)].to(log_g.dtype)
            keep = math.log1p(-self.gamma) if self.gamma < 1 else float("-inf")
            moved = torch.logaddexp(old + keep, log_g + math.log(self.gamma))
            log_u = torch.where(torch.isneginf(old), log_g, moved)
            per_image = torch.logsumexp(log_u.view(index.shape), dim=0) - math.log(index.shape[0])
            self.log_u[index[0]] = per_image.to(self.log_u.dtype)
        return self._weighted(pos, neg, neg_mask, tau, log_u)
