"""Diagnostics of a contrastive loss's similarities, computed without gradient unless the
quantity is a gradient: the InfoNCE MI estimate vs its ``log(K+1)`` ceiling, FlatNCE's
effective sample size, DCL's coupling ``q_B``, alignment, uniformity, mean positive /
negative cosine (:func:`diagnostics`; alignment and uniformity of two views alone,
:func:`alignment_uniformity`, and the spread of their negative cosines,
:func:`negative_cosines`), the rank of a batch's covariance
(:func:`batch_covariance_rank`), the gradient norm w.r.t. the embeddings and a
low-precision gradient's relative error."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ContrastiveLoss, check_views, compute_dtype, in_batch_scores, masked, prepare_scores, row_counts


def effective_sample_size(neg: Tensor, temperature: float | Tensor, neg_mask: Tensor | None = None) -> Tensor:
    """FlatNCE's normalised effective sample size per anchor, ``1/(K sum_j w_j^2)`` of the
    weights ``w = softmax_j(s_j/tau)`` over the anchor's (valid) negatives, in ``[1/K, 1]``
    (1: all negatives weigh the same; 1/K: one hard negative carries all the weight)."""
    k = row_counts(neg, neg_mask)
    w = torch.softmax(masked(neg / temperature, neg_mask), dim=1)
    return 1.0 / (k * (w * w).sum(dim=1))


@torch.no_grad()
def batch_covariance_rank(z: Tensor) -> dict[str, float]:
    """The numerical rank of the covariance of one view's embeddings ``z (N, D)`` over the N
    images of a batch (``torch.linalg.matrix_rank`` of the centred embeddings, in float64,
    its default tolerance ``sigma_max max(N, D) eps``), and its bound ``min(N - 1, D)``: a
    covariance estimated from N samples has rank at most N - 1, so at B = 16 in D = 64
    dimensions VICReg's covariance term and every BatchNorm see a rank-15 batch."""
    x = z.detach().double()
    x = x - x.mean(dim=0, keepdim=True)
    n, d = x.shape
    return {"cov_rank": float(torch.linalg.matrix_rank(x)), "cov_rank_bound": float(min(n - 1, d))}


def embedding_grad_norm(
    loss: ContrastiveLoss,
    z1: Tensor,
    z2: Tensor,
    scores=None,
    *,
    temperature: float | Tensor,
    through_z2: bool = True,
) -> Tensor:
    """``||d loss / d(z1, z2)||`` of one batch: the gradient w.r.t. the embeddings only, no
    backward through a network (DCL's mechanism is a factor on exactly this gradient).

    ``scores(z1, z2) -> (pos, neg, mask)`` builds the scores (default: in-batch); with
    ``through_z2=False`` (MoCo keys, which get no gradient) only ``z1``'s gradient counts.
    For one anchor, InfoNCE's gradient w.r.t. the logits is DCL's times
    ``q_B = 1 - softmax_pos``; so when every anchor of a batch has the same ``q_B`` the
    ratio of the two norms IS ``q_B`` (the test suite builds such a batch)."""
    a = z1.detach().clone().requires_grad_(True)
    b = z2.detach().clone().requires_grad_(through_z2)
    pos, neg, mask = (scores or in_batch_scores)(a, b)
    out = loss.from_scores(pos, neg, mask, temperature=temperature, check=False)
    grads = torch.autograd.grad(out.loss, (a, b) if through_z2 else (a,))
    return torch.sqrt(torch.stack([(g.double() ** 2).sum() for g in grads]).sum())


def grad_rel_error(
    loss: ContrastiveLoss, z1: Tensor, z2: Tensor, dtype: torch.dtype, temperature: float | Tensor
) -> float:
    """Relative error ``||g_dtype - g_fp64|| / ||g_fp64||`` of the in-batch loss gradient
    w.r.t. one batch's embeddings when they are held in ``dtype`` (the loss computes half
    types in float32, as training does): the rounding error FlatNCE blames for InfoNCE's
    collapse.  0 when the fp64 gradient is 0."""

    def grad(dt):
        a = z1.detach().to(dt).requires_grad_(True)
        b = z2.detach().to(dt).requires_grad_(True)
        out = loss(a, b, temperature=temperature)  # in-batch scores (same-view ones for such a loss)
        ga, gb = torch.autograd.grad(out.loss, (a, b))
        return torch.cat([ga.double().flatten(), gb.double().flatten()])

    g64 = grad(torch.float64)
    denom = torch.linalg.vector_norm(g64)
    if denom == 0:
        return 0.0
    return float(torch.linalg.vector_norm(grad(dtype) - g64) / denom)


@torch.no_grad()
def diagnostics(
    pos: Tensor,
    neg: Tensor,
    temperature: float,
    neg_mask: Tensor | None = None,
    z1: Tensor | None = None,
    z2: Tensor | None = None,
) -> dict[str, float]:
    """Training diagnostics from one step's scores (no gradient), as python floats.

    * ``infonce``: mean InfoNCE ``L`` of the scores; ``k``: mean K per anchor.
    * ``mi_estimate = mean(log(K+1) - L)`` (the InfoNCE MI lower bound),
      ``mi_ceiling = mean log(K+1)`` (its cap), ``mi_fraction`` = ratio.
    * ``ess``: FlatNCE's normalised effective sample size of the softmax
      weights over negatives, ``w = softmax_j(s_j/tau)``,
      ``ESS = 1/(K sum_j w_j^2)`` in ``[1/K, 1]``, mean over anchors.
    * ``qb_mean``, ``qb_cv``: DCL's coupling multiplier
      ``q_B = 1 - exp(s_p/tau)/(exp(s_p/tau) + sum_j exp(s_j/tau))``, its mean
      and coefficient of variation (std/mean, population std) over anchors.
    * ``alignment = E||z1 - z2||^2`` (Wang & Isola 2020, alpha = 2) on
      normalised embeddings (from ``pos`` as ``2 - 2 s_p`` if z1/z2 not given).
    * ``uniformity = log E exp(-2 ||z_a - z_b||^2)`` (t = 2) over distinct pairs
      within each view, averaged over the two views (Wang & Isola's training
      form); without z1/z2 (or with N < 2) it is computed over the
      anchor-negative pairs of the scores instead.
    * ``pos_cos``, ``neg_cos``: mean positive and (valid) negative score.
    """
    tau = temperature
    pos, neg, neg_mask = prepare_scores(pos.detach(), neg.detach(), neg_mask)
    k = row_counts(neg, neg_mask)
    xp = pos / tau
    xn = masked(neg / tau, neg_mask)
    lse_all = torch.logsumexp(torch.cat([xp[:, None], xn], dim=1), dim=1)
    lse_neg = torch.logsumexp(xn, dim=1)
    infonce_rows = lse_all - xp
    ceiling = torch.log1p(k)
    mi = ceiling - infonce_rows
    ess = effective_sample_size(neg, tau, neg_mask)
    qb = torch.exp(lse_neg - lse_all)
    qb_mean = qb.mean()
    qb_std = qb.std(unbiased=False) if qb.numel() > 1 else torch.zeros_like(qb_mean)
    qb_cv = float(qb_std / qb_mean) if float(qb_mean) > 0 else float("nan")
    neg_vals = neg.flatten() if neg_mask is None else neg[neg_mask]
    alignment, uniformity = _alignment_uniformity(pos, neg_vals, z1, z2)
    mi_estimate = float(mi.mean())
    mi_ceiling = float(ceiling.mean())
    return {
        "infonce": float(infonce_rows.mean()),
        "mi_estimate": mi_estimate,
        "mi_ceiling": mi_ceiling,
        "mi_fraction": mi_estimate / mi_ceiling,
        "ess": float(ess.mean()),
        "qb_mean": float(qb_mean),
        "qb_cv": qb_cv,
        "alignment": alignment,
        "uniformity": uniformity,
        "pos_cos": float(pos.mean()),
        "neg_cos": float(neg_vals.mean()),
        "k": float(k.mean()),
    }


def _alignment_uniformity(pos: Tensor, neg_vals: Tensor, z1: Tensor | None, z2: Tensor | None) -> tuple[float, float]:
    """Wang & Isola's alignment and uniformity (see :func:`diagnostics`): from the views
    when given, else from the scores (alignment 2 - 2 s_p, uniformity over the negatives)."""

    def from_scores(s: Tensor) -> float:
        return float(torch.logsumexp(-2.0 * (2 - 2 * s), 0) - math.log(s.numel()))

    if z1 is None or z2 is None:
        return float((2 - 2 * pos).mean()), from_scores(neg_vals)
    if z1.shape[0] < 2:
        check_views(z1, z2)
        return alignment_uniformity(z1, z2)[0], from_scores(neg_vals)
    return alignment_uniformity(z1, z2)


@torch.no_grad()
def alignment_uniformity(z1: Tensor, z2: Tensor) -> tuple[float, float]:
    """Wang & Isola's (2020) alignment ``E ||f(x) - f(y)||^2`` over the positive pairs
    (alpha = 2) and uniformity ``log E exp(-2 ||f(x) - f(x')||^2)`` over the distinct pairs
    of one view (t = 2), the mean of the two views', of the L2-normalised ``z1, z2 (N, D)``
    (uniformity needs N >= 2)."""
    check_views(z1, z2)
    dt = compute_dtype(z1.dtype, z2.dtype)
    a = F.normalize(z1.detach().to(dt), dim=1)
    b = F.normalize(z2.detach().to(dt), dim=1)
    alignment = float((a - b).pow(2).sum(dim=1).mean())

    def unif(x: Tensor) -> Tensor:
        # ||x_i - x_j||^2 = 2 - 2 x_i . x_j of unit rows, from one matrix product (torch.pdist
        # took 9x longer for 2,000 rows of 2,048 dimensions), over the pairs i < j
        n = x.shape[0]
        i, j = torch.triu_indices(n, n, offset=1, device=x.device)
        d2 = (2 - 2 * (x @ x.T)[i, j]).clamp_min(0)
        return torch.logsumexp(-2.0 * d2, dim=0) - math.log(d2.numel())

    return alignment, float((unif(a) + unif(b)) / 2) if a.shape[0] >= 2 else float("nan")


@torch.no_grad()
def negative_cosines(z1: Tensor, z2: Tensor) -> dict[str, float]:
    """Mean and standard deviation (population) of the cosines between views of *different*
    images among the 2N views ``z1, z2 (N, D)`` -- every in-batch negative pair of a batch of
    all N, both orders -- without the (2N)^2 matrix: with Z the 2N unit rows,
    ``sum_ab s_ab = ||sum_a z_a||^2`` and ``sum_ab s_ab^2 = ||Z^T Z||_F^2``, less the pairs of one
    image (s = 1 for a view with itself, s = s_p,i twice for its two views)."""
    check_views(z1, z2)
    a = F.normalize(z1.detach().double(), dim=1)
    b = F.normalize(z2.detach().double(), dim=1)
    n = a.shape[0]
    if n < 2:
        return {"neg_cos_mean": float("nan"), "neg_cos_sd": float("nan")}
    z = torch.cat([a, b])
    pos = (a * b).sum(dim=1)
    total = z.sum(dim=0).pow(2).sum() - 2 * n - 2 * pos.sum()
    squares = (z.T @ z).pow(2).sum() - 2 * n - 2 * pos.pow(2).sum()
    count = 4 * n * n - 4 * n
    mean = total / count
    var = (squares / count - mean * mean).clamp_min(0)
    return {"neg_cos_mean": float(mean), "neg_cos_sd": float(var.sqrt())}
