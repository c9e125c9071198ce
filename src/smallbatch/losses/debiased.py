"""InfoNCE with a corrected negatives' term: debiased (Chuang et al.) and hard-negative
(Robinson et al.) contrastive learning."""

from __future__ import annotations

import math

import torch

from .base import ContrastiveLoss
from .scores import masked, row_counts

__all__ = ["HardNegatives", "Debiased"]


class HardNegatives(ContrastiveLoss, spec="hcl"):
    r"""Hard-negative contrastive learning (Robinson, Chuang, Sra, Jegelka 2021, "Contrastive
    Learning with Hard Negative Samples", ICLR, arXiv:2010.04592) on the debiased estimator
    of Chuang et al. 2020 (:class:`Debiased`, beta = 0).

    With ``x = s/tau``, K negatives per anchor, the class prior ``tau+`` (the chance that a
    negative is of the anchor's class) and the hardness ``beta``::

        w_j  = K exp(beta x_j) / sum_k exp(beta x_k)                  (importance weights)
        Ng   = max( (sum_j w_j e^{x_j} - tau+ K e^{x_p}) / (1 - tau+),  K e^{-1/tau} )
        L_i  = -log( e^{x_p} / (e^{x_p} + Ng) )

    as ``joshr17/HCL`` ``image/main.py::criterion`` computes it (its weights keep their
    gradient; the clamp is the smallest value the negatives' sum can take on the sphere).
    ``tau+ = 0, beta = 0`` is InfoNCE.  Computed in log space:
    ``log sum_j w_j e^{x_j} = lse((beta+1) x) - lse(beta x) + log K``.  The oracle of the
    instrument (``train.mask_same_class``) removes same-class negatives with labels; this
    corrects for them in expectation, from the prior alone.
    Parameters (τ is given per call): ``0 <= tau_plus < 1`` (default 0.1), ``beta >= 0`` (default 1).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        k = row_counts(neg, neg_mask)
        xp, xn = pos / tau, neg / tau
        log_k = torch.log(k)
        log_reweighted = (
            torch.logsumexp(masked((self.beta + 1) * xn, neg_mask), dim=1)
            - torch.logsumexp(masked(self.beta * xn, neg_mask), dim=1)
            + log_k
        )
        log_tau_k = (math.log(self.tau_plus) if self.tau_plus > 0 else float("-inf")) + log_k
        r = log_tau_k + xp - log_reweighted  # log( tau+ K e^{x_p} / sum_j w_j e^{x_j} )
        inside = r < 0
        r_safe = torch.where(inside, r, torch.full_like(r, -1.0))  # no nan in the branch not taken
        log_ng = log_reweighted + torch.log(-torch.expm1(r_safe)) - math.log1p(-self.tau_plus)
        log_ng = torch.where(inside, log_ng, torch.full_like(log_ng, float("-inf")))
        log_ng = torch.maximum(log_ng, log_k - 1.0 / tau)
        rows = torch.logaddexp(xp, log_ng) - xp
        return rows, rows


class Debiased(HardNegatives, spec="debiased"):
    r"""Debiased contrastive learning (Chuang, Robinson, Lin, Torralba, Jegelka 2020, "Debiased
    Contrastive Learning", NeurIPS, arXiv:2007.00224): the negatives' term of InfoNCE
    corrected for negatives of the anchor's class, from the class prior ``tau+``::

        Ng  = max( (sum_j e^{x_j} - tau+ K e^{x_p}) / (1 - tau+),  K e^{-1/tau} )
        L_i = -log( e^{x_p} / (e^{x_p} + Ng) )

    :class:`HardNegatives` with ``beta = 0`` (``joshr17/HCL`` with ``beta=0``; the authors'
    README, STL-10: tau+ = 0.1 gives 84.26 against InfoNCE's 80.15).  ``tau+`` is about 1/C
    for C balanced classes: 0.1 for Fashion-MNIST, 0.01 for its 100-class pairs.
    Parameters (τ is given per call): ``0 <= tau_plus < 1`` (default 0.1).
    """

    beta = 0.0
