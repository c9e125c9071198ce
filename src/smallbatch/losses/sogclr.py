"""SogCLR: a per-image moving average of the negatives' term across steps; iSogCLR: and a
temperature per image."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import ContrastiveLoss, check_start_temperature
from .scores import masked, row_counts

__all__ = ["SogCLR", "ISogCLR"]


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

    Against GCLoss_v1: GCLoss_v1's loss
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

    gamma: float  # set by ContrastiveLoss.__init__ from the registry's parameters

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.register_buffer("log_u", torch.empty(0))

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
        index = self._checked_index(index, pos)
        with torch.no_grad():
            log_u = self._moved_log_u(neg, neg_mask, tau, index)
        return self._weighted(pos, neg, neg_mask, tau, log_u)

    def _checked_index(self, index, pos: Tensor) -> Tensor:
        index = torch.as_tensor(index, device=pos.device)
        if index.dim() != 2 or index.numel() != pos.shape[0]:
            raise ValueError(f"index must be (V, N) with V N = {pos.shape[0]} anchors, got {tuple(index.shape)}")
        if self.log_u.numel() == 0:
            raise ValueError(f"{self.display}'s u is not allocated: call init_state(n_images) before a step with index")
        return index

    def _moved_log_u(self, neg: Tensor, neg_mask: Tensor | None, tau, index: Tensor) -> Tensor:
        """(no gradient) ``log u_r`` of every anchor this step, ``u[i]`` of its image updated."""
        log_g = self._log_g(neg, neg_mask, tau)
        old = self.log_u[index.reshape(-1)].to(log_g.dtype)
        keep = math.log1p(-self.gamma) if self.gamma < 1 else float("-inf")
        moved = torch.logaddexp(old + keep, log_g + math.log(self.gamma))
        log_u = torch.where(torch.isneginf(old), log_g, moved)
        per_image = torch.logsumexp(log_u.view(index.shape), dim=0) - math.log(index.shape[0])
        self.log_u[index[0]] = per_image.to(self.log_u.dtype)
        return log_u


class ISogCLR(SogCLR, spec="isogclr"):
    r"""iSogCLR (Qiu, Hu, Yuan, Zhou, Zhang, Yang 2023, "Not All Semantics are Created Equal:
    Contrastive Self-supervised Learning with Automatic Temperature Individualization", ICML,
    arXiv:2305.11965), as LibAUC's ``GCLoss_v1(enable_isogclr=True)`` implements it.

    SogCLR's global objective with a temperature ``tau_i`` per *dataset image*, chosen by a
    distributionally robust objective (``rho`` the size of its KL ball)::

        F_r(w, tau_i) = tau_i log E_{j in data set} exp((s_rj - s_p,r)/tau_i) + tau_i rho

    Per step, each anchor r (image i) reads its ``tau_i`` and SogCLR's moving average ``u``
    (:class:`SogCLR`, with ``exp(s_rj/tau_i)``), then::

        w_rj = exp(s_rj/tau_i) / u_r                                  (no gradient)
        L_r  = -s_p,r + (1/K_r) sum_j w_rj s_rj         (its gradient is dF_r/dw; LibAUC's scale)
        d_r  = log u_r + rho - (1/K_r) sum_j w_rj s_rj / tau_i        (dF_r/dtau_i)
        m_i  <- (1 - beta) m_i + beta mean_views(d_r)                 (GCLoss_v1's momentum)
        tau_i <- clamp(tau_i - eta m_i, tau_min, tau_max)              (after the loss is taken)

    ``value`` is ``tau_i (log u_r + rho) - s_p,r``, the moving estimate of ``F_r``.  The
    loss is that of LibAUC's (views summed, images averaged) halved, its gradient too; with
    ``eta = 0`` its gradient is ``tau`` times SogCLR's (both hold in float64, step after step, with
    the τ's and u's entry by entry).  ``u`` starts
    as SogCLR's does: an image's first visit takes the batch estimate, every later one the
    moving average at the original gamma -- what LibAUC's fix of its u initialisation (pull
    request 53, "set gamma to original value when u is not 0") restored; here per image.

    The temperatures start at the cell's τ (:meth:`init_temperature`) and are state, not
    parameters: saved in ``state.pt`` with ``u`` (buffers ``tau_i``, ``tau_momentum``), read
    and written only by the training step (a call with ``index``), on one process.
    ``train/tau`` logs their mean over the training images.  A call without ``index`` is
    the gamma = 1 form at the call's τ (or that mean) and changes nothing.
    Parameters: ``gamma`` in (0, 1] (default 0.9), ``rho >= 0`` (0.3), ``eta >= 0`` (0.01),
    ``beta`` in (0, 1] (0.9), ``0 < tau_min < tau_max`` (0.05, 0.7): LibAUC's defaults.
    """

    tau_min: float
    tau_max: float

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)  # tau_min < tau_max: the registry's relation
        self.tau_start = self.tau0
        self.register_buffer("tau_i", torch.empty(0))
        self.register_buffer("tau_momentum", torch.empty(0))

    def init_state(self, n_images: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        """SogCLR's ``log u``, and every image's temperature at the start value (momentum 0)."""
        super().init_state(n_images, device, dtype)
        self.tau_i = torch.full((int(n_images),), self.tau_start, device=device, dtype=dtype)
        self.tau_momentum = torch.zeros(int(n_images), device=device, dtype=dtype)

    @torch.no_grad()
    def init_temperature(self, tau: float) -> None:
        """Start every image's temperature at ``tau`` (the cell's τ)."""
        check_start_temperature(tau)
        self.tau_start = float(tau)
        if self.tau_i.numel():
            self.tau_i.fill_(self.tau_start)

    def learnt_temperature(self) -> Tensor:
        """The mean of the images' temperatures (their start value before any state)."""
        if self.tau_i.numel():
            return self.tau_i.mean()
        return torch.tensor(self.tau_start)

    def _iso(self, pos, neg, neg_mask, tau, log_u):
        """``(rows, value, d)`` at the anchors' temperatures ``tau`` (a number or ``(R, 1)``)."""
        k = row_counts(neg, neg_mask)
        w = torch.exp(masked(neg.detach() / tau, neg_mask) - log_u[:, None])  # masked entries: weight 0
        rows = -pos + (w * neg).sum(dim=1) / k
        t = tau.reshape(-1) if torch.is_tensor(tau) else tau
        with torch.no_grad():
            d = log_u + self.rho - (w * neg.detach() / tau).sum(dim=1) / k
        return rows, t * (log_u + self.rho) - pos.detach(), d

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows, value, _ = self._iso(pos, neg, neg_mask, tau, self._log_g(neg, neg_mask, tau))
        return rows, value

    def _rows_at(self, pos, neg, neg_mask, tau, index):
        index = self._checked_index(index, pos)
        with torch.no_grad():
            t = self.tau_i[index.reshape(-1)].to(pos.dtype)[:, None]
            log_u = self._moved_log_u(neg, neg_mask, t, index)
        rows, value, d = self._iso(pos, neg, neg_mask, t, log_u)
        with torch.no_grad():
            img = index[0]
            m = (1 - self.beta) * self.tau_momentum[img] + self.beta * d.view(index.shape).mean(dim=0).to(
                self.tau_i.dtype
            )
            self.tau_momentum[img] = m
            self.tau_i[img] = (self.tau_i[img] - self.eta * m).clamp(self.tau_min, self.tau_max)
        return rows, value
