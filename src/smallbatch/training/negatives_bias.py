"""The bias of a contrastive mini-batch gradient from its number of negatives (Chen et al. 2022,
NeurIPS, *Why do We Need Large Batchsizes in Contrastive Learning? A Gradient-Bias
Perspective*).

InfoNCE's per-anchor term ``log(exp(s_p/tau) + sum_j exp(s_j/tau))`` is a log of a sum over
the negatives, so its gradient with K negatives drawn from a batch is not, in expectation,
the gradient with all of them: ``E g_K != g_Kmax``.  At a fixed batch of N images (fixed
views, fixed weights) K is varied by grouping the negatives (``train.neg_group``,
:func:`smallbatch.losses.grouped_in_batch_scores`): in groups of G images every anchor has
K = 2G - 2 negatives, and G = N is the whole batch (K_max = 2N - 2).  Over uniformly random
orders of the batch's images (which images share a group) the expected gradient is
estimated by the mean of P draws, and

    bias(K) = || mean_P g_K - g_Kmax || / || g_Kmax ||.

The Monte Carlo noise of the mean adds to it: ``floor(K) = sqrt(tr Cov(g_K) / P) /
||g_Kmax||`` is the value it would have from that noise alone (the expected norm of the
mean's error), reported beside it, and ``sqrt(bias^2 - floor^2)`` estimates the bias
without that noise (:attr:`Bias.debiased`).  A loss that does not depend on the negatives (a
supervised cross-entropy) has bias 0 by construction at every K: the estimator's own
check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..losses import ContrastiveLoss, check_group, grouped_in_batch_scores

__all__ = ["Bias", "negatives_bias", "grouped_gradient", "cross_entropy_gradient"]

#: ``grad_at(order, group)``: the flat gradient of the loss of the batch's images taken in
#: ``order`` (a permutation of the N images) with negatives in groups of ``group`` images
GradAt = Callable[[Tensor, int], Tensor]


class Bias(NamedTuple):
    """``k`` negatives per anchor (2G - 2), the relative ``bias`` of the mean gradient and the
    Monte Carlo ``floor`` it would show without any bias (module docstring)."""

    k: int
    bias: float
    floor: float

    @property
    def debiased(self) -> float:
        """The bias with the Monte Carlo noise taken out: ``E bias^2 = true^2 + floor^2`` (the
        floor from the draws' unbiased variance), so ``sqrt(max(bias^2 - floor^2, 0))``."""
        return max(self.bias**2 - self.floor**2, 0.0) ** 0.5


def negatives_bias(grad_at: GradAt, n: int, groups: Sequence[int], draws: int, seed: int = 0) -> list[Bias]:
    """bias(K) for every group size of ``groups`` (each dividing the batch of ``n`` images),
    each from ``draws`` random orders of the images; the reference is the whole batch
    (group ``n``, one order: every order groups it the same)."""
    if draws < 2:
        raise ValueError(f"the expected gradient needs at least 2 draws, got {draws}")
    for g in groups:
        check_group(n, g)
    ref = grad_at(torch.arange(n), n).double()
    scale = float(torch.linalg.vector_norm(ref))
    if scale == 0:
        raise ValueError("the whole batch's gradient is zero: a relative bias is undefined")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in groups:
        if g == n:
            out.append(Bias(2 * n - 2, 0.0, 0.0))
            continue
        gs = torch.stack([grad_at(torch.randperm(n, generator=gen), g).double() for _ in range(draws)])
        mean = gs.mean(dim=0)
        floor = float(gs.var(dim=0).sum().div(draws).sqrt()) / scale
        out.append(Bias(2 * g - 2, float(torch.linalg.vector_norm(mean - ref)) / scale, floor))
    return out


def _flat_grad(loss: Tensor, wrt: Sequence[Tensor]) -> Tensor:
    grads = torch.autograd.grad(loss, list(wrt), retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(w) if g is None else g).reshape(-1) for g, w in zip(grads, wrt)])


def grouped_gradient(
    loss: ContrastiveLoss, z1: Tensor, z2: Tensor, wrt: Sequence[Tensor], temperature: float | Tensor
) -> GradAt:
    """``grad_at`` of a contrastive loss with in-batch negatives grouped as the training step
    groups them: the batch's two views ``z1, z2 (N, D)`` reordered, scored by
    :func:`smallbatch.losses.grouped_in_batch_scores`, the gradient taken w.r.t. ``wrt`` (the
    embeddings themselves, or the parameters of the network that made them: its graph is
    kept, so one forward serves every draw)."""

    def grad_at(order: Tensor, group: int) -> Tensor:
        pos, neg, mask = grouped_in_batch_scores(z1[order], z2[order], group)
        return _flat_grad(loss.from_scores(pos, neg, mask, temperature=temperature).loss, wrt)

    return grad_at


def cross_entropy_gradient(logits: Tensor, labels: Tensor, wrt: Sequence[Tensor]) -> GradAt:
    """``grad_at`` of a supervised cross-entropy over the batch's ``logits (N, C)``: the images
    reordered as the contrastive loss's are, the group ignored (no negatives)."""

    def grad_at(order: Tensor, group: int) -> Tensor:
        return _flat_grad(F.cross_entropy(logits[order], labels[order]), wrt)

    return grad_at
