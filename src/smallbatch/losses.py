"""Contrastive losses as pure functions of embeddings (no I/O).

Losses: InfoNCE / NT-Xent (SimCLR), FlatNCE (+ its Hölder-mean generalisation),
DCL, DCLW, EqCo and SogCLR (per-image state across steps), each usable with in-batch negatives (SimCLR style) or with
negatives from a MoCo-style FIFO queue of momentum-encoder keys
(:class:`smallbatch.training.negatives.MomentumQueue`).  The quantities the study tracks
on the same similarities (InfoNCE MI estimate vs its ``log(K+1)`` ceiling, FlatNCE's ESS,
DCL's coupling ``q_B``, alignment, uniformity, ...) are :mod:`smallbatch.diagnostics`.

Conventions used throughout
---------------------------
* Embeddings are L2-normalised before use; the *scores* ``s`` are cosine
  similarities and ``x = s / tau`` are the logits (tau = temperature, beta = 1/tau
  in FlatNCE's notation).
* ``pos`` is a vector ``(B,)`` of anchor-positive scores, ``neg`` a matrix
  ``(B, K)`` of anchor-negative scores.  ``neg_mask`` (optional, bool,
  ``(B, K)``) is **True for a valid negative** and False for an entry to
  ignore (set to ``-inf`` before any logsumexp); with a mask, K differs per
  row and every "K" below means that row's own number of valid negatives.
* In-batch (SimCLR): N images give 2N views; each of the 2N views is an anchor
  with one positive (the other view of its image) and the 2N-2 other views as
  negatives (K = 2N-2).  Losses average over all 2N anchors, so they are
  symmetric in the two views.
* Queue (MoCo): anchors are the N queries ``q = z1``, positives their keys
  ``k = z2`` (detached by the caller, who runs the momentum encoder), negatives
  the M queued keys (K = M, independent of the batch size).  Queue entries
  whose dataset index equals the anchor's index are masked out (see
  :class:`~smallbatch.training.negatives.MomentumQueue` for the CIFAR pitfall this guards against).
* :meth:`ContrastiveLoss.from_scores` accepts any real-valued scores (e.g. a
  critic's outputs in the Gaussian MI benchmark), not only cosines.
* Precision: float16/bfloat16 inputs are computed internally in float32;
  float32 stays float32 and float64 stays float64 (never downcast — the
  precision experiment relies on float64 being really float64).
* Losses use ``logsumexp`` everywhere; a row without any valid negative is a
  ``ValueError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LossOutput",
    "in_batch_scores",
    "in_batch_columns",
    "grouped_in_batch_scores",
    "grouped_rows",
    "batch_positives",
    "queue_scores",
    "ContrastiveLoss",
    "InfoNCE",
    "FlatNCE",
    "DCL",
    "DCLW",
    "EqCo",
    "SogCLR",
    "LOSSES",
    "REGISTRY",
    "canonical_name",
    "display_name",
    "loss_rank",
    "paper_family",
    "config_schema",
    "build_loss",
    "loss_param_names",
]


# --------------------------------------------------------------------------- helpers
def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype to compute in: the promoted input dtype, half types raised to float32."""
    dt = dtypes[0]
    for other in dtypes[1:]:
        dt = torch.promote_types(dt, other)
    if not dt.is_floating_point:
        raise ValueError(f"embeddings/scores must be floating point tensors, got dtype {dt}")
    if dt in (torch.float16, torch.bfloat16):
        return torch.float32
    return dt


def check_views(z1: Tensor, z2: Tensor) -> None:
    if not isinstance(z1, Tensor) or not isinstance(z2, Tensor):
        raise ValueError("z1 and z2 must be torch tensors of shape (N, D)")
    if z1.dim() != 2:
        raise ValueError(f"z1 must have shape (N, D), got {tuple(z1.shape)}")
    if z2.dim() != 2:
        raise ValueError(f"z2 must have shape (N, D), got {tuple(z2.shape)}")
    if z1.shape != z2.shape:
        raise ValueError(
            f"z1 and z2 must have the same shape (N, D), got z1 {tuple(z1.shape)} and z2 {tuple(z2.shape)}"
        )
    if z1.shape[1] < 1:
        raise ValueError(f"z1/z2 embedding dimension must be >= 1, got {z1.shape[1]}")


def row_counts(neg: Tensor, neg_mask: Tensor | None) -> Tensor:
    """K per row (float tensor in neg's dtype)."""
    if neg_mask is None:
        return torch.full((neg.shape[0],), float(neg.shape[1]), dtype=neg.dtype, device=neg.device)
    return neg_mask.sum(dim=1).to(neg.dtype)


def prepare_scores(
    pos: Tensor, neg: Tensor, neg_mask: Tensor | None, check: bool = True
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate (pos, neg, neg_mask) and cast to the compute dtype.  ``check=False`` skips
    the one value check (a mask row without any valid negative), which reads the mask on
    the host; the training step skips it (such a row gives an infinite loss, which the
    step reports as a diverged cell)."""
    if not isinstance(pos, Tensor) or pos.dim() != 1:
        raise ValueError(f"pos must be a 1-D tensor (B,), got {getattr(pos, 'shape', type(pos))}")
    if not isinstance(neg, Tensor) or neg.dim() != 2:
        raise ValueError(f"neg must be a 2-D tensor (B, K), got {getattr(neg, 'shape', type(neg))}")
    if neg.shape[0] != pos.shape[0]:
        raise ValueError(f"neg must have one row per anchor: pos has {pos.shape[0]}, neg {neg.shape[0]} rows")
    if pos.shape[0] < 1:
        raise ValueError("pos/neg must contain at least one anchor")
    if neg.shape[1] < 1:
        raise ValueError("neg must contain at least one negative per anchor (K >= 1)")
    dt = compute_dtype(pos.dtype, neg.dtype)
    pos, neg = pos.to(dt), neg.to(dt)
    if neg_mask is not None:
        if not isinstance(neg_mask, Tensor) or neg_mask.shape != neg.shape:
            raise ValueError(
                f"neg_mask must be a bool tensor of neg's shape {tuple(neg.shape)}, "
                f"got {getattr(neg_mask, 'shape', type(neg_mask))}"
            )
        neg_mask = neg_mask.to(device=neg.device, dtype=torch.bool)
        empty = ~neg_mask.any(dim=1)
        if check and bool(empty.any()):
            rows = torch.nonzero(empty).flatten().tolist()
            raise ValueError(
                f"neg_mask leaves anchors without any valid negative (rows {rows[:10]}"
                f"{'...' if len(rows) > 10 else ''}); enlarge the queue or batch"
            )
    return pos, neg, neg_mask


def masked(x: Tensor, neg_mask: Tensor | None) -> Tensor:
    return x if neg_mask is None else x.masked_fill(~neg_mask, float("-inf"))


def _infonce_rows(pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor) -> Tensor:
    """Per-anchor InfoNCE: logsumexp([s_pos, s_neg]/tau) - s_pos/tau."""
    xp = pos / tau
    xn = masked(neg / tau, neg_mask)
    logits = torch.cat([xp[:, None], xn], dim=1)
    return torch.logsumexp(logits, dim=1) - xp


# --------------------------------------------------------------------------- scores
def in_batch_scores(z1: Tensor, z2: Tensor, rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """SimCLR in-batch scores of two views ``z1, z2`` of shape ``(N, D)``.

    The 2N views ``z = cat(z1, z2)`` are L2-normalised; view ``i`` has positive
    ``(i + N) mod 2N`` and the 2N-2 remaining views as negatives (in increasing
    view order).  Returns ``(pos (R,), neg (R, 2N-2), None)`` as cosine
    similarities in the compute dtype (half types -> float32, float64 kept), for
    the anchors ``rows`` (view indices in ``[0, 2N)``; default all 2N, R = 2N).
    Several processes that each own some anchors of one gathered batch pass their
    rows (``smallbatch.training.negatives``); their losses then average to the whole batch's.

    The negatives are picked with an index computed from the shapes alone
    (``k + [k >= lo] + [k + 1 >= hi]`` skips the anchor and its positive), not with
    a boolean mask, so no step of it depends on the values: nothing syncs a GPU and
    ``torch.compile`` sees one graph.
    """
    check_views(z1, z2)
    n = z1.shape[0]
    if n < 2:
        raise ValueError(f"z1/z2 batch size must be >= 2 for in-batch negatives, got N={n}")
    dt = compute_dtype(z1.dtype, z2.dtype)
    z = F.normalize(torch.cat([z1, z2], dim=0).to(dt), dim=1)
    m = 2 * n
    if rows is None:
        rows = torch.arange(m, device=z.device)
        sim = z @ z.T
    else:
        rows = torch.as_tensor(rows, device=z.device).reshape(-1)
        sim = z[rows] @ z.T
    partner = (rows + n) % m
    pos = sim.gather(1, partner[:, None]).squeeze(1)
    neg = sim.gather(1, in_batch_columns(rows, n))
    return pos, neg, None


def grouped_in_batch_scores(z1: Tensor, z2: Tensor, group: int) -> tuple[Tensor, Tensor, None]:
    """In-batch scores with negatives only within groups of ``group`` images (block-diagonal
    negatives): images ``[gG, (g+1)G)`` form group ``g``, and each of their 2G views has the
    positive of :func:`in_batch_scores` and the group's 2G-2 other views as negatives.

    Each group is scored as :func:`in_batch_scores` scores a batch of its G images alone
    (one batched product of k = N/G blocks: O(N G) work, not the whole batch's O(N^2)),
    then the rows are put in the whole batch's anchor order (view 1 of every image, then
    view 2).  Returns ``(pos (2N,), neg (2N, 2G-2), None)``; ``group = N`` is the
    ungrouped batch."""
    check_views(z1, z2)
    n, d = z1.shape
    if group < 2 or n % group:
        raise ValueError(f"the negatives' group of {group} images must be >= 2 and divide the batch of {n} images")
    k = n // group
    dt = compute_dtype(z1.dtype, z2.dtype)
    z = F.normalize(torch.cat([z1.reshape(k, group, d), z2.reshape(k, group, d)], dim=1).to(dt), dim=2)
    sim = z @ z.transpose(1, 2)  # (k, 2G, 2G)
    rows = torch.arange(2 * group, device=z.device)
    pos = sim[:, rows, (rows + group) % (2 * group)]
    neg = sim.gather(2, in_batch_columns(rows, group).expand(k, -1, -1))
    return grouped_rows(pos), grouped_rows(neg), None


def grouped_rows(t: Tensor) -> Tensor:
    """Group-major rows ``(k, 2G, ...)`` (group, then its views 1 and 2) in the whole batch's
    anchor order ``(2kG, ...)``: view 1 of images 0..N-1, then view 2."""
    k, two_g = t.shape[:2]
    g = two_g // 2
    return t.reshape(k, 2, g, *t.shape[2:]).transpose(0, 1).reshape(2 * k * g, *t.shape[2:])


def in_batch_columns(rows: Tensor, n: int) -> Tensor:
    """The view index (in ``[0, 2N)``) of every in-batch negative of the anchors ``rows``:
    ``(R, 2N-2)``, column ``k`` of :func:`in_batch_scores`'s ``neg`` is view
    ``k + [k >= lo] + [k + 1 >= hi]`` (``lo``/``hi`` the anchor and its positive, sorted).
    Masks of the negatives (grouped, same-class) are built on it from shapes alone."""
    m = 2 * n
    partner = (rows + n) % m
    lo, hi = torch.minimum(rows, partner)[:, None], torch.maximum(rows, partner)[:, None]
    k = torch.arange(m - 2, device=rows.device)[None, :]
    return k + (k >= lo).long() + (k + 1 >= hi).long()


def batch_positives(z1: Tensor, z2: Tensor) -> Tensor:
    """The positive score of every one of the 2N in-batch anchors, ``(2N,)``, detached:
    what a batch-level statistic (DCLW's weight normaliser) needs when a process
    computes the loss of only some anchors (``from_scores(..., batch_pos=...)``)."""
    dt = compute_dtype(z1.dtype, z2.dtype)
    p = (F.normalize(z1.detach().to(dt), dim=1) * F.normalize(z2.detach().to(dt), dim=1)).sum(dim=1)
    return torch.cat([p, p])


class KeyQueue(Protocol):
    """A queue of negatives (:class:`smallbatch.training.negatives.MomentumQueue`): its filled
    keys ``(M, D)`` and the dataset index of each."""

    def negatives(self) -> tuple[Tensor, Tensor]: ...


def queue_scores(
    q: Tensor,
    k: Tensor,
    queue: "Tensor | KeyQueue",
    q_index: Tensor | None = None,
    queue_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """MoCo scores: queries ``q (N,D)``, their keys ``k (N,D)``, queued keys ``queue (M,D)``.

    Returns ``(pos (N,), neg (N, M), neg_mask (N, M) or None)`` as cosine
    similarities.  ``neg_mask`` is True for a valid negative; it is built when
    ``q_index`` (dataset index of each query) is given and masks every queue
    entry whose dataset index (``queue_index``, or the queue's own indices when
    ``queue`` is a :class:`KeyQueue`) equals the anchor's index, so an
    anchor never meets an old key of its own image as a negative.  ``k`` is not
    detached here (the caller's momentum encoder produces it without grad).
    """
    check_views(q, k)
    if not isinstance(queue, Tensor) and hasattr(queue, "negatives"):  # a KeyQueue
        keys, idx = queue.negatives()
        if queue_index is None:
            queue_index = idx
        queue = keys
    if not isinstance(queue, Tensor) or queue.dim() != 2:
        raise ValueError(
            f"queue must be a (M, D) tensor or a MomentumQueue, got {getattr(queue, 'shape', type(queue))}"
        )
    if queue.shape[0] < 1:
        raise ValueError("queue is empty: enqueue keys before using queue negatives")
    if queue.shape[1] != q.shape[1]:
        raise ValueError(f"queue has dimension {queue.shape[1]} but q/k have dimension {q.shape[1]}")
    dt = compute_dtype(q.dtype, k.dtype, queue.dtype)
    qn = F.normalize(q.to(dt), dim=1)
    kn = F.normalize(k.to(dt), dim=1)
    un = F.normalize(queue.to(device=q.device, dtype=dt), dim=1)
    pos = (qn * kn).sum(dim=1)
    neg = qn @ un.T
    mask = None
    if q_index is not None:
        if queue_index is None:
            raise ValueError("queue_index is required when q_index is given (dataset index of each queued key)")
        q_index = torch.as_tensor(q_index, device=q.device).reshape(-1)
        queue_index = torch.as_tensor(queue_index, device=q.device).reshape(-1)
        if q_index.shape[0] != q.shape[0]:
            raise ValueError(f"q_index must have one entry per query ({q.shape[0]}), got {q_index.shape[0]}")
        if queue_index.shape[0] != queue.shape[0]:
            raise ValueError(
                f"queue_index must have one entry per queued key ({queue.shape[0]}), got {queue_index.shape[0]}"
            )
        mask = q_index[:, None] != queue_index[None, :]
    return pos, neg, mask


# --------------------------------------------------------------------------- losses
@dataclass
class LossOutput:
    """Result of a contrastive loss.

    ``loss``: scalar to call ``backward()`` on.  ``value``: detached scalar to
    log as "the loss" (for FlatNCE its logsumexp value, not the constant 1).
    ``infonce``: detached InfoNCE of the same scores, for logging/diagnostics.
    """

    loss: Tensor
    value: Tensor
    infonce: Tensor


class ContrastiveLoss(torch.nn.Module):
    """Base class: a contrastive loss of (pos, neg, neg_mask) scores at temperature tau.

    Subclasses set ``name``, ``param_defaults`` (extra parameters and their
    defaults) and implement :meth:`_rows` returning ``(loss_rows, value_rows)``.
    :meth:`forward` builds the scores from embeddings (in-batch or queue) and
    calls :meth:`from_scores`, which averages over anchors.
    """

    name: ClassVar[str] = "base"
    param_defaults: ClassVar[dict[str, Any]] = {}
    #: registry metadata (see :data:`REGISTRY`): the name shown in tables, other names
    #: accepted for it, the paper, a regex that recognises the loss in the papers'
    #: method names (``paper_results.csv``), and one JSON schema per extra parameter
    #: (its ``default`` is the study's default, written into the config schema)
    display: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    paper: ClassVar[str] = ""
    paper_pattern: ClassVar[str] = ""
    param_schema: ClassVar[dict[str, dict]] = {}

    def __init__(self, **params: Any) -> None:
        super().__init__()
        unknown = sorted(set(params) - set(self.param_defaults))
        if unknown:
            allowed = ", ".join(sorted(self.param_defaults)) or "none"
            raise ValueError(f"unknown parameter(s) {unknown} for loss '{self.name}'; allowed: {allowed}")
        for key, default in self.param_defaults.items():
            setattr(self, key, self._check_param(key, params.get(key, default)))

    # subclasses validate their own parameters
    def _check_param(self, key: str, value: Any) -> Any:  # pragma: no cover - overridden
        return value

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={getattr(self, k)!r}" for k in self.param_defaults)

    def params(self) -> dict[str, Any]:
        """The loss's own parameters (its extras; the temperature is the caller's, per call), e.g. for logging."""
        return {k: getattr(self, k) for k in self.param_defaults}

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        queue: "Tensor | KeyQueue | None" = None,
        q_index: Tensor | None = None,
        queue_index: Tensor | None = None,
        *,
        temperature: float | Tensor,
    ) -> LossOutput:
        """Loss of two views ``z1, z2 (N, D)`` at ``temperature`` (see :meth:`from_scores`).

        Without ``queue``: in-batch negatives over the 2N views (N >= 2).  With
        ``queue`` (a ``(M, D)`` tensor or :class:`MomentumQueue`): ``z1`` are the
        queries, ``z2`` their (detached) keys and the queue supplies the
        negatives; ``q_index``/``queue_index`` mask an anchor's own old keys.
        The queue form is asymmetric (MoCo v1/v2); to symmetrise, call it twice
        with the views' roles swapped and average.
        """
        if queue is None:
            if q_index is not None or queue_index is not None:
                raise ValueError("q_index/queue_index are only meaningful with queue negatives (queue=None given)")
            pos, neg, mask = in_batch_scores(z1, z2)
        else:
            pos, neg, mask = queue_scores(z1, z2, queue, q_index, queue_index)
        return self.from_scores(pos, neg, mask, temperature=temperature)

    def from_scores(
        self,
        pos: Tensor,
        neg: Tensor,
        neg_mask: Tensor | None = None,
        *,
        temperature: float | Tensor,
        batch_pos: Tensor | None = None,
        check: bool = True,
        index: Tensor | None = None,
    ) -> LossOutput:
        """Loss from scores ``pos (B,)``, ``neg (B, K)``, ``neg_mask (B, K)`` (True = valid).

        ``temperature``: τ of this call -- a float, or a 0-d tensor when it changes per step
        (ESS-scheduled); the caller owns it (training: :mod:`smallbatch.training.temperature`)
        and a cell's τ is checked once, where the cell is made (config validation).  ``batch_pos``: the positives of
        every anchor of the whole batch when ``pos`` holds only some of them (batch-level
        statistics such as DCLW's weights use it; default ``pos``).  ``check=False``:
        see :func:`prepare_scores`.  ``index``: the training step's dataset image index
        of every anchor, ``(V, N)`` with anchor ``v N + i`` a view of image
        ``index[v, i]``; a loss with per-image state (SogCLR) reads and updates its state
        there (:meth:`init_state`); the others ignore it.  Without it (diagnostics, tests)
        nothing is updated.
        """
        tau = temperature
        pos, neg, neg_mask = prepare_scores(pos, neg, neg_mask, check)
        bp = None if batch_pos is None else batch_pos.detach().to(pos.dtype)
        if index is None or not self.stateful:
            loss_rows, value_rows = self._rows(pos, neg, neg_mask, tau, bp)
        else:
            loss_rows, value_rows = self._rows_at(pos, neg, neg_mask, tau, index)
        with torch.no_grad():
            info = _infonce_rows(pos.detach(), neg.detach(), neg_mask, tau).mean()
        return LossOutput(loss=loss_rows.mean(), value=value_rows.detach().mean(), infonce=info)

    def _rows(
        self, pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, batch_pos: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(loss_rows, value_rows)``, one entry per anchor (see :meth:`from_scores`)."""
        raise NotImplementedError

    #: True for a loss with per-image state across steps (SogCLR's u): the training step
    #: calls :meth:`init_state` and saves :meth:`state_dict` in ``state.pt``
    stateful: ClassVar[bool] = False

    def init_state(self, n_images: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        """Allocate the per-image state of a training set of ``n_images`` (stateless: nothing)."""

    def _rows_at(
        self, pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, index: Tensor
    ) -> tuple[Tensor, Tensor]:  # pragma: no cover - stateful losses override
        raise NotImplementedError


class InfoNCE(ContrastiveLoss):
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
    measures (``benchmarks/loss_precision.py``).
    Parameters: none (τ is given per call).
    """

    name = "infonce"
    display = "InfoNCE"
    aliases = ("ntxent", "simclr")
    paper = "van den Oord et al. 2018; Chen et al. 2020 (SimCLR)"
    paper_pattern = r"nt-xent|simclr|infonce|cross-entropy|moco"

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = _infonce_rows(pos, neg, neg_mask, tau)
        return rows, rows


class FlatNCE(ContrastiveLoss):
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

    name = "flatnce"
    param_defaults = {"gamma": 1.0}
    display = "FlatNCE"
    paper = "Chen et al. 2021 (FlatNCE)"
    paper_pattern = r"flatnce"
    param_schema = {
        "gamma": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 1.0,
            "description": "Hölder-mean exponent (1 = FlatNCE)",
        }
    }

    def _check_param(self, key, value):
        g = float(value)
        if not (math.isfinite(g) and g >= 0):
            raise ValueError(f"gamma must be a finite number >= 0 (1 = FlatNCE), got {value!r}")
        return g

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


class DCL(ContrastiveLoss):
    r"""Decoupled Contrastive Learning (Yeh et al. 2021/ECCV 2022, "Decoupled
    Contrastive Learning", arXiv:2110.06848).

    The positive is removed from InfoNCE's denominator; one logsumexp over the
    K negatives (in-batch: all 2N-2 other views of both views)::

        L_i = -s_p/tau + logsumexp_j (s_j/tau)

    This removes InfoNCE's negative-positive coupling factor
    ``q_B = 1 - exp(s_p/tau)/(exp(s_p/tau) + sum_j exp(s_j/tau))`` from the
    gradient.  Its gradient equals FlatNCE's.  Parameters: none (τ is given per call).
    """

    name = "dcl"
    display = "DCL"
    paper = "Yeh et al. 2021 (DCL)"
    paper_pattern = r"\bdcl\b"

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        rows = torch.logsumexp(masked(neg / tau, neg_mask), dim=1) - pos / tau
        return rows, rows


class DCLW(ContrastiveLoss):
    r"""Weighted DCL (Yeh et al. 2021, "Decoupled Contrastive Learning", DCLW).

    The positive term is weighted by a von Mises-Fisher-style weight computed
    on detached similarities, ``B`` anchors in the batch::

        w_i = 2 - exp(s_p,i/sigma) / ((1/B) sum_k exp(s_p,k/sigma))   (no gradient)
        L_i = -w_i s_p,i/tau + logsumexp_j (s_j/tau)

    The batch mean of ``w`` is 1; harder positives (lower similarity) get more
    weight.  ``sigma -> infinity`` gives ``w = 1``, i.e. DCL.
    Parameters (τ is given per call): ``sigma > 0`` (default 0.5, the paper's).
    """

    name = "dclw"
    param_defaults = {"sigma": 0.5}
    display = "DCLW"
    paper = "Yeh et al. 2021 (DCLW)"
    paper_pattern = r"dclw"
    param_schema = {
        "sigma": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 0.5,
            "description": "width of the von Mises-Fisher weights of the positives (inf = DCL)",
        }
    }

    def _check_param(self, key, value):
        s = float(value)
        if not (s > 0):  # allows +inf (the DCL limit)
            raise ValueError(f"sigma must be > 0, got {value!r}")
        return s

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


class EqCo(ContrastiveLoss):
    r"""EqCo (Zhu et al. 2020, "EqCo: Equivalent Rules for Self-supervised
    Contrastive Learning", arXiv:2010.01929).

    The negative sum is rescaled by ``alpha/K`` so the loss (and the gradient
    balance between positive and negatives) does not depend on the number of
    negatives K::

        L_i = log( exp(s_p/tau) + (alpha/K) sum_{j<=K} exp(s_j/tau) ) - s_p/tau
            = logsumexp([s_p/tau, s_j/tau + log(alpha/K)]) - s_p/tau

    ``alpha = K`` recovers InfoNCE; ``alpha=None`` (default) means "alpha = K"
    i.e. plain InfoNCE-equivalent (so the loss is the registry's InfoNCE until
    an alpha is chosen, e.g. alpha = 256 as in the paper's MoCo experiments).
    With a mask, each row uses its own K.
    Parameters (τ is given per call): ``alpha > 0`` or None (default None).
    """

    name = "eqco"
    param_defaults = {"alpha": None}
    display = "EqCo"
    paper = "Zhu et al. 2020 (EqCo)"
    paper_pattern = r"eqco|simo"
    param_schema = {
        "alpha": {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "default": 256,
            "description": "the negatives' term is scaled by alpha/K (null: alpha = K, i.e. InfoNCE)",
        }
    }

    def _check_param(self, key, value):
        if value is None:
            return None
        a = float(value)
        if not (math.isfinite(a) and a > 0):
            raise ValueError(f"alpha must be a positive finite number or None (alpha = K), got {value!r}")
        return a

    def _rows(self, pos, neg, neg_mask, tau, batch_pos):
        xp = pos / tau
        xn = neg / tau
        if self.alpha is not None:
            k = row_counts(neg, neg_mask)
            xn = xn + torch.log(self.alpha / k)[:, None]
        logits = torch.cat([xp[:, None], masked(xn, neg_mask)], dim=1)
        rows = torch.logsumexp(logits, dim=1) - xp
        return rows, rows


class SogCLR(ContrastiveLoss):
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

    Against GCLoss_v1 (checked in float64 by ``tests/core/test_sogclr.py``): GCLoss_v1's loss
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

    name = "sogclr"
    param_defaults = {"gamma": 0.9}
    display = "SogCLR"
    paper = "Yuan et al. 2022 (SogCLR)"
    paper_pattern = r"sogclr"
    param_schema = {
        "gamma": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": 0.9,
            "description": "SogCLR: weight of the batch in u's moving average (1 = no memory: DCL's gradient)",
        }
    }
    stateful = True

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.register_buffer("log_u", torch.empty(0))

    def _check_param(self, key, value):
        try:
            g = float(value)
        except (TypeError, ValueError):
            g = float("nan")
        if not (0 < g <= 1):
            raise ValueError(f"gamma must be in (0, 1] (SogCLR's moving-average weight; 1 = no memory), got {value!r}")
        return g

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
        index = torch.as_tensor(index, device=pos.device)
        if index.dim() != 2 or index.numel() != pos.shape[0]:
            raise ValueError(f"index must be (V, N) with V N = {pos.shape[0]} anchors, got {tuple(index.shape)}")
        if self.log_u.numel() == 0:
            raise ValueError("SogCLR's u is not allocated: call init_state(n_images) before a step with index")
        with torch.no_grad():
            log_g = self._log_g(neg, neg_mask, tau)
            old = self.log_u[index.reshape(-1)].to(log_g.dtype)
            keep = math.log1p(-self.gamma) if self.gamma < 1 else float("-inf")
            moved = torch.logaddexp(old + keep, log_g + math.log(self.gamma))
            log_u = torch.where(torch.isneginf(old), log_g, moved)
            per_image = torch.logsumexp(log_u.view(index.shape), dim=0) - math.log(index.shape[0])
            self.log_u[index[0]] = per_image.to(self.log_u.dtype)
        return self._weighted(pos, neg, neg_mask, tau, log_u)


# --------------------------------------------------------------------------- registry
#: The one list of losses, in the order tables show them.  Adding a loss is a class
#: above (its formula and paper in the docstring, the metadata attributes of
#: :class:`ContrastiveLoss`) plus its line here: cells, the config schema, the CLI
#: and the report read everything else from this registry.
REGISTRY: dict[str, type[ContrastiveLoss]] = {cls.name: cls for cls in (InfoNCE, FlatNCE, DCL, DCLW, EqCo, SogCLR)}
#: every accepted name (canonical names and aliases) -> the loss class
LOSSES: dict[str, type[ContrastiveLoss]] = {
    **REGISTRY,
    **{alias: cls for cls in REGISTRY.values() for alias in cls.aliases},
}


def _lookup(name: str) -> type[ContrastiveLoss]:
    key = str(name).strip().lower()
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; allowed: {', '.join(sorted(LOSSES))}")
    return LOSSES[key]


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (an alias such as ``ntxent`` -> ``infonce``);
    ValueError naming the allowed names for an unknown one."""
    return _lookup(name).name


def display_name(name: str) -> str:
    """The name tables show (``InfoNCE``); an unknown name is returned unchanged."""
    cls = LOSSES.get(str(name).strip().lower())
    return cls.display if cls is not None else str(name)


def loss_rank(name: str) -> tuple[int, str]:
    """Sort key: registry order first, unknown names after, alphabetically."""
    order = list(REGISTRY)
    return (order.index(name) if name in order else len(order), str(name))


def paper_family(method: Any) -> str | None:
    """The loss a paper's method name belongs to (``'SimCLR (NT-Xent)'`` -> ``infonce``),
    matched by each loss's ``paper_pattern``; the most specific loss wins (the registry
    is searched from its end, so DCLW before DCL and every fix before InfoNCE)."""
    import re

    s = str(method).lower()
    for cls in reversed(list(REGISTRY.values())):
        if cls.paper_pattern and re.search(cls.paper_pattern, s):
            return cls.name
    return None


def loss_param_names(name: str) -> dict[str, Any]:
    """The extra parameters loss ``name`` accepts, with defaults (temperature excluded)."""
    return dict(_lookup(name).param_defaults)


def config_schema() -> dict[str, Any]:
    """The config schema's loss parts, generated from the registry:
    ``names`` (enum of accepted names), ``loss_params`` (one object per loss with its
    parameters and the study's defaults) and ``entry_params`` (a grid entry's
    parameter may be a value or a list of values to sweep)."""
    loss_params, scalars = {}, {}
    for name, cls in REGISTRY.items():
        loss_params[name] = {
            "type": "object",
            "default": {},
            "additionalProperties": False,
            "description": f"{cls.display} ({cls.paper})",
            "properties": {k: dict(v) for k, v in cls.param_schema.items()},
        }
        for key, sch in cls.param_schema.items():
            scalar = {k: v for k, v in sch.items() if k != "default"}
            if scalar not in scalars.setdefault(key, []):
                scalars[key].append(scalar)
    entry_params = {}
    for key, alts in scalars.items():  # a name shared by losses (gamma: FlatNCE, SogCLR) takes either's values
        scalar = alts[0] if len(alts) == 1 else {"anyOf": alts}
        entry_params[key] = {"anyOf": [scalar, {"type": "array", "minItems": 1, "items": scalar}]}
    return {"names": sorted(LOSSES), "loss_params": loss_params, "entry_params": entry_params}


def build_loss(name: str, **params: Any) -> ContrastiveLoss:
    """Build a loss by registry name (``infonce``/``ntxent``/``simclr``, ``flatnce``,
    ``dcl``, ``dclw``, ``eqco``, ``sogclr``) with its parameters; ValueError on an unknown
    name or parameter."""
    return _lookup(name)(**params)
