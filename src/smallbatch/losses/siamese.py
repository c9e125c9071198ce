"""Methods without negatives: SimSiam, VICReg and BYOL.

Their losses are functions of the two views' *online outputs* ``p1, p2`` (the predictor's
output where the method has one, else the projections) and their *targets* ``t1, t2`` (the
other branch: the online projections for SimSiam, an EMA network's projections for BYOL;
VICReg has none and reads ``p1, p2`` only).  A target is never trained through: the loss
detaches it (the stop-gradient is part of the formula), whatever the caller passes.  What the
method needs besides its loss -- a predictor, an EMA target network -- its registry entry
declares (:mod:`smallbatch.losses.registry`), and the model and the training step follow.

Their batch dependence is not in negatives but in statistics of the batch: BatchNorm in the
projector and predictor, and (VICReg) a variance and a covariance estimated from B samples:
at B = 16 a D = 64 covariance has rank at most 15.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import ContrastiveLoss, LossOutput, infonce_rows
from .scores import compute_dtype, in_batch_scores

__all__ = ["SiameseLoss", "SimSiam", "VICReg", "BYOL", "vicreg_terms"]


class SiameseLoss(ContrastiveLoss):
    """Base of the methods without negatives: ``loss(p1, p2, t1, t2, temperature=τ)``.

    ``p1, p2 (N, D)``: the online outputs of the two views of N images; ``t1, t2 (N, D)``: their
    targets (detached by the loss; None for a method without a target branch).  Returns a
    :class:`LossOutput` whose ``infonce`` is the InfoNCE, at ``temperature`` (1 when None), of
    the in-batch scores of the targets (of the online outputs without targets): a diagnostic,
    the method never reads it.  A subclass implements :meth:`_pair`."""

    def forward(  # type: ignore[override]  # no negatives: (p1, p2, t1, t2), not (z1, z2, queue, ...)
        self,
        p1: Tensor,
        p2: Tensor,
        t1: Tensor | None = None,
        t2: Tensor | None = None,
        *,
        temperature: float | Tensor | None = None,
    ) -> LossOutput:
        tau = 1.0 if temperature is None else temperature
        if p1.dim() != 2 or p1.shape != p2.shape or p1.shape[0] < 2:
            raise ValueError(
                f"{self.display} needs two views of shape (N >= 2, D), got {tuple(p1.shape)}, {tuple(p2.shape)}"
            )
        if (t1 is None) != (t2 is None) or (
            t1 is not None and t2 is not None and (t1.shape != p1.shape or t2.shape != p2.shape)
        ):
            raise ValueError(f"{self.display}: the targets must be both None or both shaped like the outputs")
        dt = compute_dtype(p1.dtype, p2.dtype)
        p1, p2 = p1.to(dt), p2.to(dt)
        if t1 is not None and t2 is not None:  # both or neither (checked above)
            t1, t2 = t1.to(dt), t2.to(dt)
        loss = self._pair(p1, p2, t1, t2)
        with torch.no_grad():
            a, b = (p1, p2) if t1 is None or t2 is None else (t1, t2)
            pos, neg, mask = in_batch_scores(a.detach(), b.detach())
            info = infonce_rows(pos, neg, mask, tau.detach() if torch.is_tensor(tau) else tau).mean()
        return LossOutput(loss=loss, value=loss.detach(), infonce=info)

    def from_scores(self, *args: Any, **kwargs: Any) -> LossOutput:
        raise TypeError(f"{self.display} is a method without negatives: it takes the views' outputs, not scores")

    def _pair(self, p1: Tensor, p2: Tensor, t1: Tensor | None, t2: Tensor | None) -> Tensor:
        raise NotImplementedError

    def predictor_hidden(self, proj_dim: int, proj_hidden: int) -> int:
        """The predictor's hidden width (a method that declares a predictor)."""
        raise ValueError(f"{self.display} has no predictor")


def _cosines(p: Tensor, t: Tensor) -> Tensor:
    """Row-wise cosine of ``p`` and the detached target ``t``."""
    return (F.normalize(p, dim=1) * F.normalize(t.detach(), dim=1)).sum(dim=1)


class SimSiam(SiameseLoss, spec="simsiam"):
    r"""SimSiam (Chen & He 2021, "Exploring Simple Siamese Representation Learning", CVPR,
    arXiv:2011.10566; reference ``facebookresearch/simsiam``: ``simsiam/builder.py`` and
    ``main_simsiam.py``)::

        D(p, z) = -cos(p, stopgrad(z))
        L = D(p1, z2) / 2 + D(p2, z1) / 2          (mean over the N images)

    ``p = h(z)`` is the predictor's output on the projection ``z`` (an MLP with a bottleneck:
    Linear-BN-ReLU-Linear, hidden width ``pred_hidden``, default proj_dim / 4 as the paper's
    2048 -> 512 -> 2048), ``z`` the projection of the other view, the target (``t``), through
    which no gradient flows: the stop-gradient the paper shows prevents collapse.  No
    negatives, no temperature (the cell's τ sets only the InfoNCE reported beside it).
    L lies in [-1, 1]; -1 when every prediction points at its target.
    Deviation: the projector is the study's 2-layer head (SimSiam's CIFAR variant has 2 layers
    and a BatchNorm on its output; ours has none there).  Parameters: ``pred_hidden``.
    """

    pred_hidden: int | None  # set by ContrastiveLoss.__init__ from the registry's parameters

    def _pair(self, p1, p2, t1, t2):
        if t1 is None:
            raise ValueError("SimSiam needs its targets (the projections z1, z2)")
        return -(_cosines(p1, t2).mean() + _cosines(p2, t1).mean()) / 2

    def predictor_hidden(self, proj_dim: int, proj_hidden: int) -> int:
        return self.pred_hidden or max(1, proj_dim // 4)


class BYOL(SiameseLoss, spec="byol"):
    r"""BYOL (Grill et al. 2020, "Bootstrap Your Own Latent: A New Approach to Self-Supervised
    Learning", NeurIPS, arXiv:2006.07733; loss as solo-learn's ``solo/losses/byol.py`` and
    ``solo/methods/byol.py``)::

        L = || p1/|p1| - z'2/|z'2| ||^2 + || p2/|p2| - z'1/|z'1| ||^2
          = (2 - 2 cos(p1, z'2)) + (2 - 2 cos(p2, z'1))       (mean over the N images)

    the symmetrised loss of the paper (L + L~): ``p`` the online predictor's output, ``z'`` the
    target network's projection (the target ``t``), no gradient through it.  The target network
    is an exponential moving average of the online backbone and projector, ``xi <- m xi + (1 -
    m) theta`` after every step, with ``m_k = 1 - (1 - ema)(cos(pi k / K) + 1) / 2`` over the K
    steps (``ema_schedule = cosine``, the paper's, from ``ema`` to 1) or ``m_k = ema``
    (``fixed``).  The paper's base momentum is 0.996 for 1000 ImageNet epochs; the default here
    is 0.99 for runs of a few hundred steps.  L lies in [0, 8].
    Parameters: ``pred_hidden`` (default the projector's hidden width: BYOL's predictor is as
    wide as its projector), ``ema``, ``ema_schedule``.
    """

    pred_hidden: int | None  # set by ContrastiveLoss.__init__ from the registry's parameters

    def _pair(self, p1, p2, t1, t2):
        if t1 is None:
            raise ValueError("BYOL needs its targets (the target network's projections)")
        return (2 - 2 * _cosines(p1, t2)).mean() + (2 - 2 * _cosines(p2, t1)).mean()

    def predictor_hidden(self, proj_dim: int, proj_hidden: int) -> int:
        return self.pred_hidden or proj_hidden


def vicreg_terms(z1: Tensor, z2: Tensor, eps: float = 1e-4, gamma: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """VICReg's three terms ``(invariance, variance, covariance)`` of two views (see :class:`VICReg`)."""
    n, d = z1.shape
    invariance = F.mse_loss(z1, z2)

    def variance(z: Tensor) -> Tensor:
        std = torch.sqrt(z.var(dim=0) + eps)  # unbiased (N - 1), as the authors' code
        return F.relu(gamma - std).mean()

    def covariance(z: Tensor) -> Tensor:
        c = z - z.mean(dim=0)
        cov = c.T @ c / (n - 1)
        diagonal = torch.eye(d, dtype=torch.bool, device=z.device)
        return cov.masked_fill(diagonal, 0.0).pow(2).sum() / d  # the off-diagonal entries (a fixed shape)

    return invariance, (variance(z1) + variance(z2)) / 2, covariance(z1) + covariance(z2)


class VICReg(SiameseLoss, spec="vicreg"):
    r"""VICReg (Bardes, Ponce & LeCun 2022, "VICReg: Variance-Invariance-Covariance
    Regularization for Self-Supervised Learning", ICLR, arXiv:2105.04906; reference
    ``facebookresearch/vicreg`` ``main_vicreg.py``, as lightly's ``VICRegLoss``)::

        s(Z, Z') = (1 / (N D)) sum_i ||z_i - z'_i||^2                  (F.mse_loss)
        v(Z)     = (1 / D) sum_j max(0, gamma - sqrt(Var(z^j) + eps))   (gamma = 1, eps = 1e-4)
        C(Z)     = (1 / (N - 1)) sum_i (z_i - zbar)(z_i - zbar)^T
        c(Z)     = (1 / D) sum_{j != k} C(Z)_jk^2
        L = lam s(Z, Z') + mu (v(Z) + v(Z')) / 2 + nu (c(Z) + c(Z'))

    on the projections themselves (not normalised; no predictor, no target branch: both views
    carry gradient), Var the unbiased variance over the N images.  The weights default to the
    paper's lam = mu = 25, nu = 1.  As the authors' code does, the invariance is a mean over
    the N D entries (the paper's s sums over dimensions) and the variance term is the mean of
    the two views' (the paper writes their sum).  The variance and covariance are estimated
    from the N images of the batch: C has rank at most N - 1, so at N < D the covariance term
    cannot reach 0 with every dimension's variance at gamma.  Parameters: ``lam``, ``mu``, ``nu``.
    """

    def _pair(self, p1, p2, t1, t2):
        inv, var, cov = vicreg_terms(p1, p2)
        return self.lam * inv + self.mu * var + self.nu * cov
