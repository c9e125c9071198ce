"""The pairwise sigmoid loss: SigLIP, and its two-view use SigCLR."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import ContrastiveLoss

__all__ = ["SigLIP"]


class SigLIP(ContrastiveLoss, spec="siglip"):
    r"""SigLIP's pairwise sigmoid loss (Zhai, Mustafa, Kolesnikov, Beyer 2023, "Sigmoid Loss
    for Language Image Pre-Training", ICCV, arXiv:2303.15343), used on the two views of
    images as SigCLR (Çağatan 2024, "SigCLR: Sigmoid Contrastive Learning of Visual
    Representations", arXiv:2410.17427).

    Every pair is its own binary decision, with no normalisation over the batch::

        L = -(1/|B|) sum_i sum_j log sigmoid( z_ij (t s_ij + b) )
            z_ij = +1 for the positive, -1 for a negative
        L_i = softplus(-(t s_p + b)) + sum_j softplus(t s_j + b)     (per anchor)

    with a learnt scale ``t = exp(t')`` (τ = 1/t: the loss owns its temperature, started at
    the cell's τ; SigLIP's t'_0 = log 10 is τ = 0.1) and a learnt bias ``b`` (``bias_init``,
    SigLIP's b_0 = -10, which offsets the 1 : K imbalance of positives and negatives at the
    start).  Reference: big_vision ``trainers/proj/image_text/siglip.py`` (``log_sigmoid`` of
    ``m1_diag1 * logits`` summed over a row, averaged over rows) and open_clip's
    ``SigLipLoss``; on two views of N images the rows are the 2N views, each with its
    2N-2 negatives (SigCLR).
    SigCLR reports that a fixed t works better on CIFAR; a fixed t is not offered here.

    As ``b -> -inf`` every sigmoid is in its exponential tail and
    ``L_i = -(t s_p + b) + e^b sum_{k in {p, j}} e^{t s_k} + O(e^{2b})``, so
    ``log(L_i + b + t s_p) - b -> logsumexp_k(t s_k)``: InfoNCE's denominator at τ = 1/t.
    Called with ``temperature=τ`` it uses that τ (and its own ``b``).
    Parameters: ``bias_init`` (default -10); learnt: ``log_scale`` (t') and ``bias`` (b).
    """

    bias_init: float  # set by ContrastiveLoss.__init__ from the registry's parameters

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.bias = torch.nn.Parameter(torch.tensor(float(self.bias_init)))

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        b = self.bias.to(pos.dtype)
        x_neg = F.softplus(neg / tau + b)
        if neg_mask is not None:
            x_neg = x_neg.masked_fill(~neg_mask, 0.0)
        rows = F.softplus(-(pos / tau + b)) + x_neg.sum(dim=1)
        return rows, rows
