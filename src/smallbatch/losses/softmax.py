"""Losses of one softmax over the positive and the negatives: InfoNCE (at a given or a learnt τ),
EqCo, and SimCo's dual temperature."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import ContrastiveLoss, infonce_rows
from .scores import masked, row_counts

__all__ = ["InfoNCE", "EqCo", "DualTemperature", "LearntTemperatureInfoNCE"]


class InfoNCE(ContrastiveLoss, spec="infonce"):
    r"""InfoNCE / NT-Xent (van den Oord et al. 2018 "Representation Learning with
    Contrastive Predictive Coding"; Chen et al. 2020 "A Simple Framework for
    Contrastive Learning of Visual Representations", SimCLR).

    Per anchor ``i`` with positive score ``s_p`` and K negatives ``s_j``::

        L_i = -log( exp(s_p/tau) / (exp(s_p/tau) + sum_j exp(s_j/tau)) )
            = logsumexp([s_p, s_1..s_K]/tau) - s_p/tau

    In-batch (SimCLR's NT-Xent): 2N anchors, K = 2N-2, averaged over all 2N
    anchors (symmetric in the views).  ``log(K+1) - L`` is the InfoNCE lower
    bound on mutual information, capped at ``log(K+1)``.

    Computed the standard way (as ``cross_entropy`` does: logsumexp minus the
    positive logit), deliberately: its gradient on the positive is
    ``-(1 - softmax_p)``, which loses relative precision when
    ``q_B = 1 - softmax_p`` approaches the unit roundoff (and is exactly 0 in
    float32 once ``q_B < 2^-24``) — the effect FlatNCE addresses and the study
    measures.
    Parameters: none (τ is given per call).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = infonce_rows(pos, neg, neg_mask, tau)
        return rows, rows


class EqCo(ContrastiveLoss, spec="eqco"):
    r"""EqCo (Zhu et al. 2020, "EqCo: Equivalent Rules for Self-supervised
    Contrastive Learning", arXiv:2010.01929).

    The negative sum is rescaled by ``alpha/K`` so the loss (and the gradient
    balance between positive and negatives) does not depend on the number of
    negatives K::

        L_i = log( exp(s_p/tau) + (alpha/K) sum_{j<=K} exp(s_j/tau) ) - s_p/tau
            = logsumexp([s_p/tau, s_j/tau + log(alpha/K)]) - s_p/tau

    ``alpha = K`` recovers InfoNCE, as does ``alpha=None`` ("alpha = K" at every K).
    With a mask, each row uses its own K.
    Parameters (τ is given per call): ``alpha > 0`` or None; default 256, the paper's MoCo
    experiments' (the registry's default, as the config's).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        xp = pos / tau
        xn = neg / tau
        if self.alpha is not None:
            k = row_counts(neg, neg_mask)
            xn = xn + torch.log(self.alpha / k)[:, None]
        logits = torch.cat([xp[:, None], masked(xn, neg_mask)], dim=1)
        rows = torch.logsumexp(logits, dim=1) - xp
        return rows, rows


def _log_coupling(pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau) -> Tensor:
    """``log(1 - softmax_p)`` of the logits ``[s_p, s_j]/tau``: the log of InfoNCE's coupling q_B."""
    xp, xn = pos / tau, masked(neg / tau, neg_mask)
    return torch.logsumexp(xn, dim=1) - torch.logsumexp(torch.cat([xp[:, None], xn], dim=1), dim=1)


class DualTemperature(ContrastiveLoss, spec="simco"):
    r"""SimCo's dual temperature (Zhang, Zhang, Zhang, Pham, Yoo, Kweon 2022, "Dual Temperature
    Helps Contrastive Learning Without Many Negative Samples: Towards Understanding and
    Simplifying MoCo", CVPR, arXiv:2203.17248).

    InfoNCE at τ (the intra-anchor softmax), each anchor's term weighted by a stop-gradient
    factor from a second softmax at τ·m (the inter-anchor temperature)::

        p_intra = softmax([s_p, s_j]/tau)_p,   p_inter = softmax([s_p, s_j]/(tau m))_p
        w_i = sg[ (1 - p_inter) / (1 - p_intra) ]
        L_i = w_i (-log p_intra)

    Reference: ``ChaoningZhang/Dual-temperature``, ``solo/losses/dual_temperature_loss.py``
    (``dual_temperature_loss_func``, tau = 0.1, ``dt_m`` = 10), which scores queries against
    keys (N-1 negatives each); here the study's scores (in-batch: 2N anchors and 2N-2
    negatives, symmetric in the views) go through the same formula.  InfoNCE's gradient on
    the positive is ``-(1 - p_intra)/tau``; SimCo's is ``-(1 - p_inter)/tau``: the coupling
    q_B at the large temperature replaces it (the paper's inter-anchor hardness), and
    ``m = 1`` is InfoNCE exactly.  The weights are computed in log space.
    Parameters (τ is given per call): ``m >= 1`` (default 10, the paper's).
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        with torch.no_grad():
            log_w = _log_coupling(pos, neg, neg_mask, tau * self.m) - _log_coupling(pos, neg, neg_mask, tau)
        rows = torch.exp(log_w) * infonce_rows(pos, neg, neg_mask, tau)
        return rows, rows


class LearntTemperatureInfoNCE(ContrastiveLoss, spec="infonce_lt"):
    r"""InfoNCE whose temperature is learnt with the network, as CLIP's (Radford et al. 2021,
    "Learning Transferable Visual Models From Natural Language Supervision": the logits
    are scaled by ``t = exp(t')``, t' a trained parameter)::

        tau = exp(-t')                                   (t' = log_scale, a parameter)
        L_i = logsumexp([s_p, s_1..s_K]/tau) - s_p/tau   (InfoNCE at that tau)
        dL/dt' = -(1/B) sum_i (s_p,i - E_{softmax_i}[s]) / tau

    The training loop starts t' at the cell's τ (``t' = -log tau``), hands it to the optimiser
    (no weight decay), logs ``train/tau`` = exp(-t') and saves it with the loss; CLIP also
    clamps ``t <= 100``, which is not done here (τ leaves ``[1e-3, 1e2]`` only by diverging).
    Called with ``temperature=τ`` it is InfoNCE at that τ (what the step does: the learnt
    τ, with its gradient, comes from :class:`smallbatch.training.temperature.LearntTemperature`).
    Parameters: none besides t'.
    """

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = infonce_rows(pos, neg, neg_mask, tau)
        return rows, rows
