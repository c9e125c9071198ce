"""Where a step's negatives come from: in the batch, fresh extra images, or a MoCo-style queue --
or, for a method without negatives, where its targets come from (:class:`Siamese`).

A *negatives source* owns how a step's two views become embeddings and scores:

* ``embed(model, v1, v2) -> (z1, z2)`` — in-batch: both views in one forward pass
  (BatchNorm sees the 2N views, as in SimCLR); queue: queries through the model, keys
  through the momentum encoder without gradient.
* ``scores(z1, z2, idx) -> Scores`` — computed ONCE per step; the loss and the
  diagnostics read the same scores (``Scores.pos``, ``neg``, ``mask``, ``batch_pos``).
* ``after_step(model, z2, idx)`` — after the optimiser step: the momentum encoder's EMA
  and the enqueue of this step's keys (nothing for in-batch negatives).
* ``state_dict()`` / ``load_state_dict()`` — what a resumed run needs (queue, encoder).

Two controls restrict the negatives, from shapes and labels only (no host read, so the
step stays one graph):

* ``group`` (``train.neg_group``): an anchor's negatives are the other views of its group
  of G images (images ``[gG, (g+1)G)`` of the batch): block-diagonal negatives, K = 2G-2,
  scored block by block (:func:`smallbatch.losses.grouped_in_batch_scores`, no mask);
* ``labels`` (``train.mask_same_class``): negatives of the anchor's own class are masked
  (an oracle for false negatives; the labels serve the mask and nothing else).

Fresh negatives (:class:`FreshNegatives`, ``train.extra_negatives``): a step of N images (its
*anchors*, with gradient) also encodes E extra images without gradient, by the current weights
(no queue, no staleness), as negatives only: K = 2(N+E)-2 with the N-image step count.  The
step's images are the N of the plain batch-N step and the E others of the window of N+E
images of the epoch's permutation that holds them (:func:`fresh_window`); the extras' views
come from a random stream of their own (``smallbatch.training.checkpoint.StepRandom``), so the
anchors and their views are those of the plain batch-N cell of the same seed, step by step.

The loss never knows where its negatives came from: it gets ``Scores``.  With several
processes (``smallbatch.training.distributed.World``) the in-batch negatives are every process's
views, gathered with their gradient, and the queue is fed every process's keys, so the
queue and K are global and identical everywhere.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..losses import (
    batch_positives,
    check_group,
    grouped_in_batch_scores,
    grouped_rows,
    in_batch_columns,
    in_batch_scores,
    queue_scores,
    same_view_mask,
)
from .distributed import World, gather, gather_with_grad


class Scores(NamedTuple):
    """One step's scores: ``pos (B,)``, ``neg (B, K)``, ``mask (B, K)`` or None (True =
    a valid negative); with several processes, ``batch_pos`` — the whole batch's
    positives when ``pos`` holds only this process's anchors — and ``tau_neg`` — the whole
    batch's negatives, from which an ESS-scheduled τ is chosen identically everywhere
    (None: ``neg``) — and ``index``, the dataset index of every anchor's image as ``(V, N)``
    (anchor ``v N + i`` is a view of image ``index[v, i]``; a loss with per-image state,
    SogCLR, reads it; None with several processes)."""

    pos: Tensor
    neg: Tensor
    mask: Tensor | None
    batch_pos: Tensor | None = None
    tau_neg: Tensor | None = None
    index: Tensor | None = None  # type: ignore[assignment]  # a field named as tuple's index(): read only as .index

    def detached(self) -> Scores:
        return Scores._make(None if t is None else t.detach() for t in self)


def _gathered_in_batch(z1: Tensor, z2: Tensor, world: World, full: bool, same_view: bool = False) -> Scores:
    """This process's anchors against every process's views (``smallbatch.training.distributed``:
    the gather's backward returns each embedding's gradient to the process that made it);
    ``same_view``: only the anchor's own view's negatives."""
    z1a, z2a = gather_with_grad(z1), gather_with_grad(z2)
    rows = world.anchor_rows(z1.shape[0], z1.device)
    pos, neg, mask = in_batch_scores(z1a, z2a, rows=rows)
    if same_view:
        mask = same_view_mask(z1a.shape[0], rows=rows)
    tau_neg = in_batch_scores(z1a.detach(), z2a.detach())[1] if full else None
    return Scores(pos, neg, mask, batch_positives(z1a, z2a), tau_neg)


def in_batch_mask(n: int, labels: Tensor, group: int | None = None) -> Tensor:
    """The valid in-batch negatives (True) of a batch of ``n`` images whose labels are
    ``labels (n,)``: those of another class than the anchor's, for the scores
    :func:`smallbatch.losses.in_batch_scores` (``group`` None) or
    :func:`~smallbatch.losses.grouped_in_batch_scores` lay out: ``(2n, 2G-2)``.  An anchor
    whose every negative shares its class (all 2G-2: odds 10^-15 at G = 16 and 10 balanced
    classes) has none left: the losses without the positive in their denominator (DCL,
    FlatNCE, SogCLR) are then infinite and the cell ends as diverged."""
    g = group or n
    check_group(n, g)
    rows = torch.arange(2 * g, device=labels.device)
    cols = in_batch_columns(rows, g) % g  # each negative's image within its group
    lab = labels.reshape(n // g, g)
    return grouped_rows(lab[:, rows % g][:, :, None] != lab[:, cols])


class InBatch:
    """SimCLR's negatives: the 2N-2 other views of the (global) batch (K = 2N-2).  With
    several processes each computes the loss of its own anchors against all 2N views
    (``full``: also the whole batch's negatives, for an ESS-scheduled τ).  ``group``
    (one process): negatives within groups of that many images; ``labels`` (one process,
    every training image's label): same-class negatives masked; ``same_view`` (a loss of
    same-view negatives: DHEL, the kernel losses): the other view's negatives masked."""

    kind = "in_batch"
    extra = 0  # no fresh extra images (FreshNegatives)

    def __init__(
        self,
        world: World | None = None,
        full: bool = False,
        group: int | None = None,
        labels: Tensor | None = None,
        same_view: bool = False,
    ) -> None:
        self.world = world or World()
        self.full = full
        self.group, self.labels, self.same_view = group or None, labels, same_view
        if self.world.size > 1 and (self.group or labels is not None):
            raise ValueError("grouped or same-class-masked negatives run on one process (train.devices = 1)")

    def embed(self, model: torch.nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        z = model(torch.cat([v1, v2]))
        return z[: v1.shape[0]], z[v1.shape[0] :]

    def scores(self, z1: Tensor, z2: Tensor, idx: Tensor) -> Scores:
        if self.world.size > 1:
            return _gathered_in_batch(z1, z2, self.world, self.full, self.same_view)
        pos, neg, mask = self.rescore(z1, z2)
        if self.labels is not None:
            oracle = in_batch_mask(z1.shape[0], self.labels[idx], self.group)
            mask = oracle if mask is None else mask & oracle
        return Scores(pos, neg, mask, index=torch.stack([idx, idx]))

    def rescore(self, z1: Tensor, z2: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Scores of embeddings for a diagnostic that re-scores them (the gradient norms):
        grouped and same-view as the step's are, without the oracle mask (it needs the
        batch's images)."""
        pos, neg, _ = grouped_in_batch_scores(z1, z2, self.group) if self.group else in_batch_scores(z1, z2)
        mask = same_view_mask(z1.shape[0], self.group, device=neg.device) if self.same_view else None
        return pos, neg, mask

    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {"key_model": None, "queue": None}

    def load_state_dict(self, state: dict) -> None:
        pass


def fresh_window(perm: Tensor, pos: int, n: int, extra: int) -> Tensor:
    """The dataset indices of step ``pos`` of an epoch (``perm``: its permutation) with
    ``extra`` fresh negatives: its ``n`` anchors ``perm[pos n : (pos+1) n]`` (the plain batch-n
    step's images), then the ``extra`` other images of the window of W = n + extra
    consecutive images of ``perm`` that holds them -- ``perm[w W : (w+1) W]``, ``w = pos n // W``
    (when W is a multiple of n: the batch of W images a batch-W cell trains on at that point of
    the epoch), moved to end with the anchors where they would stick out of it, and to end at
    the permutation's last image where it would run past it (an epoch's last steps)."""
    w, total, a0 = n + extra, perm.shape[0], pos * n
    if w > total:
        raise ValueError(f"{n} images and {extra} extra negatives exceed the {total} pretraining images")
    start = min(max(a0 // w * w, a0 + n - w), total - w)
    k = torch.arange(extra, device=perm.device)
    return torch.cat([perm[a0 : a0 + n], perm[start + k + n * (k >= a0 - start).long()]])


def with_extra_views(u_anchors: Tensor, u_extra: Tensor) -> Tensor:
    """The uniforms of a step's views, view 1 of every image then view 2 (what
    ``BatchAugment.apply(cat([x, x]), u)`` takes), from the anchors' ``(2N, ...)`` and the
    extra images' ``(2E, ...)``, each view 1 then view 2."""
    n, e = u_anchors.shape[0] // 2, u_extra.shape[0] // 2
    return torch.cat([u_anchors[:n], u_extra[:e], u_anchors[n:], u_extra[e:]])


def running_stats(model: torch.nn.Module) -> list[Tensor]:
    """Every BatchNorm running mean, variance and batch count of ``model``."""
    return [
        b
        for m in model.modules()
        if isinstance(m, _BatchNorm)
        for b in (m.running_mean, m.running_var, m.num_batches_tracked)
        if b is not None
    ]


@torch.no_grad()
def embed_without_grad(model: torch.nn.Module, x: Tensor) -> Tensor:
    """``model(x)`` without gradient, in the model's mode (train: BatchNorm normalises with
    the batch's statistics, in its groups), its running statistics left as they were."""
    stats = running_stats(model)
    kept = [b.clone() for b in stats]
    z = model(x)
    for b, k in zip(stats, kept):
        b.copy_(k)
    return z


class FreshNegatives:
    """Fresh negatives (module docstring): the step's images are N anchors then E extra
    images (:func:`fresh_window`); the anchors' 2N views go through the model with gradient,
    the extras' 2E views without (:func:`embed_without_grad`: the running statistics are the
    anchors' alone, as in a plain batch-N cell), and each anchor is scored against the other
    2(N+E)-2 views: :func:`smallbatch.losses.in_batch_scores` of the N+E images restricted to
    the anchors' rows, so the loss is the batch-(N+E) loss of those rows, and no gradient
    reaches an extra image."""

    kind = "fresh"

    def __init__(self, extra: int, world: World | None = None) -> None:
        self.world = world or World()
        if self.world.size > 1:
            raise ValueError("fresh negatives run on one process (train.devices = 1)")
        if int(extra) < 1:
            raise ValueError(f"extra negatives must be >= 1, not {extra!r}")
        self.extra = int(extra)

    def _anchor_rows(self, n_all: int, device) -> Tensor:
        n = n_all - self.extra
        rows = torch.arange(n, device=device)
        return torch.cat([rows, rows + n_all])

    def embed(self, model: torch.nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        n, e = v1.shape[0] - self.extra, self.extra
        z = model(torch.cat([v1[:n], v2[:n]]))
        ze = embed_without_grad(model, torch.cat([v1[n:], v2[n:]]))
        return torch.cat([z[:n], ze[:e]]), torch.cat([z[n:], ze[e:]])

    def scores(self, z1: Tensor, z2: Tensor, idx: Tensor) -> Scores:
        pos, neg, _ = self.rescore(z1, z2)
        anchors = idx[: idx.shape[0] - self.extra]
        return Scores(pos, neg, None, index=torch.stack([anchors, anchors]))

    def rescore(self, z1: Tensor, z2: Tensor) -> tuple[Tensor, Tensor, None]:
        return in_batch_scores(z1, z2, rows=self._anchor_rows(z1.shape[0], z1.device))

    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        """Nothing to keep: the extras are the data order's and their views a counter-based
        stream's (``StepRandom``), both functions of the step."""
        return {"key_model": None, "queue": None}

    def load_state_dict(self, state: dict) -> None:
        pass


class QueueNegatives:
    """MoCo's negatives (He et al. 2020): a FIFO queue of ``size`` keys from a momentum
    encoder (K = the queue's length); an anchor's own older keys are masked.  Until the
    first keys are queued (the first step) the step uses in-batch negatives."""

    kind = "queue"
    extra = 0

    def __init__(
        self,
        key_model: torch.nn.Module,
        size: int,
        dim: int,
        momentum: float,
        device: torch.device,
        dtype: torch.dtype,
        world: World | None = None,
        labels: Tensor | None = None,
    ) -> None:
        self.world = world or World()
        self.labels = labels  # every training image's label: same-class keys masked (one process)
        if self.world.size > 1 and labels is not None:
            raise ValueError("same-class-masked negatives run on one process (train.devices = 1)")
        self.key_model = key_model
        for p in key_model.parameters():
            p.requires_grad_(False)
        self.queue = MomentumQueue(size, dim, device=device, dtype=dtype)
        self.momentum = float(momentum)

    def embed(self, model: torch.nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        z1 = model(v1)
        with torch.no_grad():
            z2 = self.key_model(v2)
        return z1, z2

    def scores(self, z1: Tensor, z2: Tensor, idx: Tensor) -> Scores:
        if len(self.queue) == 0:
            if self.world.size > 1:
                return _gathered_in_batch(z1, z2.detach(), self.world, False)
            pos, neg, _ = in_batch_scores(z1, z2.detach())
            mask = None if self.labels is None else in_batch_mask(z1.shape[0], self.labels[idx])
            return Scores(pos, neg, mask, index=torch.stack([idx, idx]))
        keys, key_idx = self.queue.negatives()
        pos, neg, mask = queue_scores(z1, z2.detach(), keys, idx, key_idx)
        if self.world.size > 1:  # DCLW's weights: every process's queries' positives
            return Scores(pos, neg, mask, gather(pos), None)
        if self.labels is not None:
            mask = mask & (self.labels[idx][:, None] != self.labels[key_idx][None, :])
        return Scores(pos, neg, mask, index=idx[None])

    @torch.no_grad()
    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        """EMA of the query encoder into the key encoder (buffers copied), then enqueue."""
        mom = self.momentum
        keys_p: list[Tensor] = list(self.key_model.parameters())
        query_p = [p.detach() for p in model.parameters()]
        torch._foreach_mul_(keys_p, mom)
        torch._foreach_add_(keys_p, query_p, alpha=1 - mom)
        for bk, bq in zip(self.key_model.buffers(), model.buffers()):
            bk.copy_(bq)
        keys = F.normalize(z2.detach().to(self.queue.keys.dtype), dim=1)
        self.queue.enqueue(gather(keys), gather(idx))  # every process's keys, in rank order

    def state_dict(self) -> dict:
        return {"key_model": self.key_model.state_dict(), "queue": self.queue.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.key_model.load_state_dict(state["key_model"])
        self.queue.load_state_dict(state["queue"])


# --------------------------------------------------------------------------- no negatives
def ema_momentum(base: float, schedule: str, k: int, total: int) -> float:
    """The EMA target's momentum at update ``k`` of ``total`` (BYOL): ``base`` at every step
    (``fixed``), or ``1 - (1 - base)(cos(pi k / total) + 1) / 2`` (``cosine``: ``base`` at the
    first update, rising to 1 at the end; Grill et al. 2020, Sec. 3.2)."""
    if schedule == "fixed":
        return float(base)
    if schedule != "cosine":
        raise ValueError(f"ema_schedule must be cosine or fixed, not {schedule!r}")
    return 1.0 - (1.0 - float(base)) * (math.cos(math.pi * k / max(1, total)) + 1.0) / 2.0


class Siamese:
    """The two views of a method without negatives (SimSiam, VICReg, BYOL): both through the
    online network in one forward (BatchNorm over the 2N views, as for in-batch negatives),
    then the method's outputs and targets (:meth:`outputs`):

    * outputs: the predictor's ``q(z)`` where the method has one, else the projections ``z``;
    * targets: the projections ``z`` of the online network (the loss stops their gradient), or,
      with an EMA ``target`` network (BYOL), its projections of the same views, without graph.

    ``scores`` are the projections' in-batch scores, without gradient: diagnostics only (the
    loss never reads them).  ``after_step`` moves the target network towards the online one
    (:func:`ema_momentum`, its parameters; BatchNorm's buffers copied, as the MoCo encoder's);
    ``state_dict`` holds it (as ``key_model``, the momentum encoder's slot) and its update count."""

    kind = "siamese"
    extra = 0  # no fresh extra images (FreshNegatives)

    def __init__(
        self,
        predictor: bool,
        target: torch.nn.Module | None = None,
        ema: float = 0.99,
        schedule: str = "cosine",
        total: int = 1,
    ) -> None:
        self.predictor, self.target = predictor, target
        self.ema, self.schedule, self.total = float(ema), schedule, int(total)
        self.updates = 0
        if target is not None:
            ema_momentum(self.ema, schedule, 0, self.total)  # refuses an unknown schedule here
            for p in target.parameters():
                p.requires_grad_(False)

    def embed(self, model: torch.nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        z = model(torch.cat([v1, v2]))
        return z[: v1.shape[0]], z[v1.shape[0] :]

    def outputs(self, model, v1: Tensor, v2: Tensor, z1: Tensor, z2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(p1, p2, t1, t2)``: the online outputs and the targets of the two views."""
        n = z1.shape[0]
        if self.predictor:
            p = model.predict(torch.cat([z1, z2]))  # one pass: the predictor's BatchNorm sees the 2N views
            p1, p2 = p[:n], p[n:]
        else:
            p1, p2 = z1, z2
        if self.target is None:
            return p1, p2, z1, z2
        with torch.no_grad():
            t = self.target(torch.cat([v1, v2]))
        return p1, p2, t[:n], t[n:]

    def scores(self, z1: Tensor, z2: Tensor, idx: Tensor) -> Scores:
        pos, neg, mask = in_batch_scores(z1.detach(), z2.detach())
        return Scores(pos, neg, mask, index=torch.stack([idx, idx]))

    @torch.no_grad()
    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        """The target network's EMA update (a method without one: nothing)."""
        if self.target is None:
            return
        m = ema_momentum(self.ema, self.schedule, self.updates, self.total)
        names = [name for name, _ in self.target.named_parameters()]
        target_p: list[Tensor] = [p for _, p in self.target.named_parameters()]
        online_p = [model.get_parameter(name).detach() for name in names]
        torch._foreach_mul_(target_p, m)
        torch._foreach_add_(target_p, list(torch._foreach_mul(online_p, 1 - m)))  # m xi + (1 - m) theta, op by op
        for name, buf in self.target.named_buffers():
            buf.copy_(model.get_buffer(name))
        self.updates += 1

    def state_dict(self) -> dict:
        if self.target is None:
            return {"key_model": None, "queue": None}
        return {"key_model": self.target.state_dict(), "queue": None, "ema_updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        if self.target is not None:
            self.target.load_state_dict(state["key_model"])
            self.updates = int(state["ema_updates"])


# --------------------------------------------------------------------------- queue
class MomentumQueue:
    """MoCo-style FIFO queue of momentum-encoder keys and their dataset indices (He et al. 2020).

    Keys are stored detached and L2-normalised, in the queue's dtype/device;
    each key keeps the dataset index of the image it came from, so that
    :func:`queue_scores` can mask an anchor's own old keys.  ``enqueue``
    overwrites the oldest slots; ``negatives()`` returns the filled slots
    (slot order; losses do not depend on order).  K = ``len(queue)``.

    CIFAR pitfall: a queue longer than the data set (e.g. 65,536 keys with
    CIFAR-10's 50,000 images, or any queue spanning more than one epoch) holds
    old keys of the *same* image as the current anchor; unmasked they act as
    "negatives" that are really positives, pushing an image away from itself.
    We mask every queued key whose dataset index equals the anchor's index, so
    K varies per anchor (EqCo's alpha/K then uses each row's own K).
    """

    def __init__(self, size: int, dim: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size!r}")
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
        self.size = int(size)
        self.dim = int(dim)
        self.keys = torch.zeros(self.size, self.dim, device=device, dtype=dtype)
        self.indices = torch.full((self.size,), -1, device=device, dtype=torch.long)
        self.ptr = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"MomentumQueue(size={self.size}, dim={self.dim}, filled={self.count}, dtype={self.keys.dtype})"

    @torch.no_grad()
    def enqueue(self, keys: Tensor, indices: Tensor) -> None:
        """Append ``keys (B, D)`` with dataset ``indices (B,)``, dropping the oldest."""
        if not isinstance(keys, Tensor) or keys.dim() != 2 or keys.shape[1] != self.dim:
            raise ValueError(f"keys must have shape (B, {self.dim}), got {getattr(keys, 'shape', type(keys))}")
        indices = torch.as_tensor(indices).reshape(-1)
        if indices.shape[0] != keys.shape[0]:
            raise ValueError(f"indices must have one entry per key ({keys.shape[0]}), got {indices.shape[0]}")
        keys = F.normalize(keys.detach().to(self.keys.device, self.keys.dtype), dim=1)
        indices = indices.to(self.indices.device, torch.long)
        if keys.shape[0] > self.size:  # only the newest `size` keys survive
            keys, indices = keys[-self.size :], indices[-self.size :]
        b = keys.shape[0]
        slots = (self.ptr + torch.arange(b, device=self.keys.device)) % self.size
        self.keys[slots] = keys
        self.indices[slots] = indices
        self.ptr = (self.ptr + b) % self.size
        self.count = min(self.size, self.count + b)

    def negatives(self) -> tuple[Tensor, Tensor]:
        """``(keys (M, D), indices (M,))`` of the filled slots, M = len(self)."""
        if self.count == self.size:
            return self.keys, self.indices
        return self.keys[: self.count], self.indices[: self.count]

    def to(self, device: Any) -> MomentumQueue:
        self.keys = self.keys.to(device)
        self.indices = self.indices.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (for checkpoints)."""
        return {
            "size": self.size,
            "dim": self.dim,
            "keys": self.keys.clone(),
            "indices": self.indices.clone(),
            "ptr": self.ptr,
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["size"]) != self.size or int(state["dim"]) != self.dim:
            raise ValueError(f"state has size/dim {state['size']}/{state['dim']}, queue has {self.size}/{self.dim}")
        self.keys = state["keys"].to(self.keys.device, self.keys.dtype).clone()
        self.indices = state["indices"].to(self.indices.device).clone()
        self.ptr = int(state["ptr"])
        self.count = int(state["count"])
