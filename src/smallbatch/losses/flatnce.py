"""FlatNCE and its Hölder-mean generalisation."""

from __future__ import annotations

import torch

from .base import ContrastiveLoss
from .scores import masked, row_counts

__all__ = ["FlatNCE"]


class FlatNCE(ContrastiveLoss, spec="flatnce"):
    r"""FlatNCE (Chen et al. 2021, "Simpler, Faster, Stronger: Breaking the log-K
    Curse on Contrastive Learners with FlatNCE", arXiv:2107.01152).

    Per anchor, with logits relative to the positive ``x_j = (s_j - s_p)/tau``
    over the K negatives only (positive removed)::

        l_i    = logsumexp_j x_j
        loss_i = exp(l_i - stopgrad(l_i))        # value identically 1
        grad loss_i = grad l_i = sum_j softmax(x)_j (grad s_j - grad s_p) / tau

    **The value of FlatNCE's own objective is identically the constant 1**
    (its gradient is all that matters).  That confuses users watching a loss
    curve, so :class:`LossOutput` reports ``value = mean_i l_i`` (the
    logsumexp, which decreases as training progresses) and ``infonce`` = the
    InfoNCE of the same batch; ``loss`` is the constant-valued objective to
    back-propagate.  The gradient is InfoNCE's gradient divided by its
    vanishing factor ``1 - softmax_p = sum_j exp(x_j)/(1 + sum_j exp(x_j))``,
    so it does not lose precision when positives dominate (the paper's
    argument), and it equals DCL's gradient exactly.  Adding the positive to
    the negatives gives back InfoNCE's gradient (the paper's Prop. 3.1).

    Hölder generalisation (parameter ``gamma``, default 1).  With
    ``r_j = exp(x_j)``, replace the arithmetic mean of the r_j by their Hölder
    (power) mean ``M_gamma(r) = ((1/K) sum_j r_j**gamma)**(1/gamma)``::

        l_i(gamma) = log M_gamma(r) + log K
                   = (logsumexp_j(gamma x_j) - log K) / gamma + log K

    ``gamma = 1`` is FlatNCE exactly (``l_i(1) = l_i``); the gradient weights
    the negatives by ``softmax(gamma x)`` (gamma > 1 sharpens the focus on hard
    negatives, gamma -> infinity tends to the hardest negative only, gamma < 1
    flattens, ``gamma = 0`` is the geometric-mean limit
    ``l_i(0) = mean_j x_j + log K`` with uniform weights).  The loss stays
    ``exp(l - stopgrad(l))``.  (This is our power-mean definition; we could not
    retrieve the paper's exact statement of its Hölder variant, so the formula
    above is the reference.)  K is each row's own count under a mask.
    Parameters (τ is given per call): ``gamma >= 0`` (default 1.0).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        g = self.gamma
        x = (neg - pos[:, None]) / tau
        if g == 1.0:
            l = torch.logsumexp(masked(x, neg_mask), dim=1)
        else:
            k = row_counts(neg, neg_mask)
            logk = torch.log(k)
            if g == 0.0:
                xs = x if neg_mask is None else x.masked_fill(~neg_mask, 0.0)
                l = xs.sum(dim=1) / k + logk
            else:
                l = (torch.logsumexp(masked(g * x, neg_mask), dim=1) - logk) / g + logk
        return torch.exp(l - l.detach()), l
