"""Losses without the positive in the denominator: DCL, its weighted form DCLW, and DHEL (same-view negatives)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import ContrastiveLoss
from .scores import masked

__all__ = ["DCL", "DCLW", "DHEL"]


class DCL(ContrastiveLoss, spec="dcl"):
    r"""Decoupled Contrastive Learning (Yeh et al. 2021/ECCV 2022, "Decoupled
    Contrastive Learning", arXiv:2110.06848).

    The positive is removed from InfoNCE's denominator; one logsumexp over the
    K negatives (in-batch: all 2N-2 other views of both views)::

        L_i = -s_p/tau + logsumexp_j (s_j/tau)

    This removes InfoNCE's negative-positive coupling factor
    ``q_B = 1 - exp(s_p/tau)/(exp(s_p/tau) + sum_j exp(s_j/tau))`` from the
    gradient.  Its gradient equals FlatNCE's.  Parameters: none (τ is given per call).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = torch.logsumexp(masked(neg / tau, neg_mask), dim=1) - pos / tau
        return rows, rows


class DCLW(ContrastiveLoss, spec="dclw"):
    r"""Weighted DCL (Yeh et al. 2021, "Decoupled Contrastive Learning", DCLW).

    The positive term is weighted by a von Mises-Fisher-style weight computed
    on detached similarities, ``B`` anchors in the batch::

        w_i = 2 - exp(s_p,i/sigma) / ((1/B) sum_k exp(s_p,k/sigma))   (no gradient)
        L_i = -w_i s_p,i/tau + logsumexp_j (s_j/tau)

    The batch mean of ``w`` is 1; harder positives (lower similarity) get more
    weight.  ``sigma -> infinity`` gives ``w = 1``, i.e. DCL.
    Parameters (τ is given per call): ``sigma > 0`` (default 0.5, the paper's).
    """

    sigma: float  # set by ContrastiveLoss.__init__ from the registry's parameters

    def weights(self, pos: Tensor, batch_pos: Tensor | None = None) -> Tensor:
        """The detached positive weights ``w_i`` of the anchors ``pos``, normalised by the
        mean over ``batch_pos`` (every anchor of the batch; default ``pos``: batch mean 1)."""
        p = pos.detach()
        if math.isinf(self.sigma):
            return torch.ones_like(p)
        if batch_pos is None:
            return 2.0 - p.shape[0] * torch.softmax(p / self.sigma, dim=0)
        b = batch_pos.detach().to(p.dtype)
        log_mean = torch.logsumexp(b / self.sigma, dim=0) - math.log(b.shape[0])
        return 2.0 - torch.exp(p / self.sigma - log_mean)

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        w = self.weights(pos, batch_pos)
        rows = -w * pos / tau + torch.logsumexp(masked(neg / tau, neg_mask), dim=1)
        return rows, rows


class DHEL(DCL, spec="dhel"):
    r"""Decoupled Hyperspherical Energy Loss (Koromilas, Bouritsas, Giannakopoulos, Nicolaou,
    Panagakis 2024, "Bridging Mini-Batch and Asymptotic Analysis in Contrastive Learning: From
    InfoNCE to Kernel-Based Losses", ICML, arXiv:2405.18045).

    DCL with uniformity taken over the anchor's own view only: for anchor ``u_i`` (view 1 of
    image i) the negatives are the other images' view-1 embeddings ``u_j``, N-1 of them, and
    the positive is not in the denominator::

        L_i = -s(u_i, v_i)/tau + log sum_{j != i} exp(s(u_i, u_j)/tau)

    averaged here over both views' anchors (2N rows; the paper's and the authors' code's
    ``include_augs=False`` average the N view-1 anchors, so this is the mean of that loss
    with the views in both orders; the authors' default ``include_augs=True`` adds the other
    view's energy to each anchor's: ``-s_p/tau + lse_u,i + lse_v,i``, i.e. twice this loss plus
    the mean ``s_p/tau``).  Against DCL on the same scores, the positive's term is the same and
    the negatives are a subset: ``DCL_i - DHEL_i = log(1 + sum_cross / sum_same)`` >= 0.  The same-view negatives are a mask built from
    shapes (:func:`smallbatch.losses.scores.same_view_mask`): in-batch negatives only.
    Parameters: none (τ is given per call).
    """
