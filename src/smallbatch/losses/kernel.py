"""Kernel losses on the hypersphere: KCL's pairwise averages and Wang & Isola's alignment and
uniformity.  Both take the kernel ``exp(-t ||z - z'||^2) = exp(2t (s - 1))`` of two unit
embeddings with cosine ``s``, and uniformity within each view (same-view negatives)."""

from __future__ import annotations

import torch

from .base import ContrastiveLoss
from .scores import row_counts

__all__ = ["KCL", "AlignUniform"]


class KCL(ContrastiveLoss, spec="kcl"):
    r"""Kernel Contrastive Loss (Koromilas, Bouritsas, Giannakopoulos, Nicolaou, Panagakis
    2024, "Bridging Mini-Batch and Asymptotic Analysis in Contrastive Learning: From InfoNCE
    to Kernel-Based Losses", ICML, arXiv:2405.18045), with the Gaussian kernel
    ``k(a, b) = exp(-t ||a - b||^2)`` of the authors' code (``pakoromilas/DHEL-KCL``,
    ``losses.py::KCL``, ``kernel='gaussian'``, t = 2, gamma = 16)::

        L = -2 mean_i k(u_i, v_i) + gamma (mean_{i<j} k(u_i, u_j) + mean_{i<j} k(v_i, v_j))

    an alignment term over the positives and an energy term over pairs within each view,
    both plain averages (no log, no softmax).  Per anchor r (2N rows, each view's anchors
    against the other images of the same view, K_r of them)::

        L_r = 2 ( -k(z_r, z_r+) + gamma (1/K_r) sum_j k(z_r, z_j) ),   k = exp(2t (s - 1))

    whose mean over the 2N rows is the authors' L.  Every term is a mean over pairs, an
    unbiased estimate of its expectation over the data: the expected loss does not depend
    on the batch size (the paper's claim).  No temperature: the cell's τ
    only sets the InfoNCE reported beside the loss.
    Parameters: ``t > 0`` (default 2), ``gamma > 0`` (default 16).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        k_neg = torch.exp(2 * self.t * (neg - 1))
        if neg_mask is not None:
            k_neg = k_neg.masked_fill(~neg_mask, 0.0)
        rows = 2 * (-torch.exp(2 * self.t * (pos - 1)) + self.gamma * k_neg.sum(dim=1) / row_counts(neg, neg_mask))
        return rows, rows


class AlignUniform(ContrastiveLoss, spec="align_uniform"):
    r"""Alignment and uniformity as a loss (Wang & Isola 2020, "Understanding Contrastive
    Representation Learning through Alignment and Uniformity on the Hypersphere", ICML,
    arXiv:2005.10242; reference ``ssnl/align_uniform``: ``align_loss``, ``uniform_loss`` and
    its training loss ``align + lam (unif(x) + unif(y)) / 2``)::

        L_align = mean_i ||u_i - v_i||^alpha = mean_i (2 - 2 s_p,i)^(alpha/2)
        L_unif(x) = log mean_{i<j} exp(-t ||x_i - x_j||^2) = log mean_{i<j} exp(2t (s_ij - 1))
        L = L_align + lam (L_unif(u) + L_unif(v)) / 2

    The uniformity of a view is the log of the mean over *all* pairs of its embeddings, not
    a mean over anchors: the loss is computed from the whole batch's scores on one process
    (``per_anchor = False``), with the rows in view order (anchors ``0..N-1`` view 1, ``N..2N-1``
    view 2, each with its same-view negatives, as the in-batch and grouped scores lay them
    out; grouped, the pairs are those within the groups).  It is the log of a minibatch mean
    (biased at a small batch, as InfoNCE's denominator is); its kernel form without the log
    is KCL.  No temperature: the cell's τ only sets the InfoNCE reported beside the loss.
    Parameters: ``lam > 0`` (default 1), ``alpha > 0`` (default 2), ``t > 0`` (default 2).
    """

    def _reduce(self, pos, neg, neg_mask, tau, batch_pos):
        rows = pos.shape[0]
        if rows % 2:
            raise ValueError(f"{self.display} needs the in-batch anchors of both views (an even number), got {rows}")
        align = (2 - 2 * pos).clamp_min(0).pow(self.alpha / 2).mean()
        log_k = 2 * self.t * (neg - 1)
        if neg_mask is not None:
            log_k = log_k.masked_fill(~neg_mask, float("-inf"))
        halves = log_k.reshape(2, rows // 2 * neg.shape[1])  # view 1's anchors, then view 2's
        counts = torch.ones_like(neg).masked_fill(~neg_mask, 0) if neg_mask is not None else torch.ones_like(neg)
        unif = torch.logsumexp(halves, dim=1) - torch.log(counts.reshape(2, -1).sum(dim=1))
        loss = align + self.lam * unif.mean()
        return loss, loss
