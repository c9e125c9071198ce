"""Scores: a batch's embeddings made into one positive and K negatives per anchor.

Every loss of :mod:`smallbatch.losses` reads ``(pos (B,), neg (B, K), neg_mask (B, K) or
None)``: cosine similarities in the compute dtype, ``neg_mask`` True for a valid negative.
The builders -- in-batch (SimCLR), in-batch within groups of images, and a MoCo-style
queue -- and the checks and casts the losses share live here (see :mod:`smallbatch.losses`
for the conventions)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "compute_dtype",
    "check_views",
    "check_group",
    "row_counts",
    "prepare_scores",
    "masked",
    "in_batch_scores",
    "grouped_in_batch_scores",
    "grouped_rows",
    "in_batch_columns",
    "same_view_mask",
    "batch_positives",
    "KeyQueue",
    "queue_scores",
]


# --------------------------------------------------------------------------- checks and casts
def check_group(n: int, group: int) -> None:
    """A one-line ValueError unless ``group`` (at least 2) divides the batch of ``n`` images: the
    layout of grouped scores and of their masks (a cell's groups are checked before any job:
    :func:`smallbatch.study.checks.control_problem`)."""
    if group < 2 or n % group:
        raise ValueError(f"the negatives' group of {group} images must be >= 2 and divide the batch of {n} images")


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
    check_group(n, group)
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


def same_view_mask(
    n: int, group: int | None = None, rows: Tensor | None = None, device: torch.device | str | None = None
) -> Tensor:
    """The in-batch negatives that are views of the anchor's own view (True), laid out as
    :func:`in_batch_scores` lays out the negatives of a batch of ``n`` images (of the anchors
    ``rows``, default all 2N) or :func:`grouped_in_batch_scores` of groups of ``group``:
    ``(R, 2N-2)`` or ``(2N, 2G-2)``, N-1 (G-1) True per row.  Built from shapes alone (no
    value of the batch is read): the negatives of DHEL and of the kernel losses, which take
    uniformity within each view (anchor ``v N + i`` is view ``v`` of image ``i``)."""
    if group and group != n:
        check_group(n, group)
        return grouped_rows(same_view_mask(group, device=device).expand(n // group, -1, -1))
    rows = torch.arange(2 * n, device=device) if rows is None else torch.as_tensor(rows, device=device).reshape(-1)
    return (in_batch_columns(rows, n) >= n) == (rows >= n)[:, None]


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
    queue: Tensor | KeyQueue,
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
