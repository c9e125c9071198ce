"""Where a step's negatives come from: in the batch, or from a MoCo-style queue.

A *negatives source* owns how a step's two views become embeddings and scores:

* ``embed(model, v1, v2) -> (z1, z2)`` — in-batch: both views in one forward pass
  (BatchNorm sees the 2N views, as in SimCLR); queue: queries through the model, keys
  through the momentum encoder without gradient.
* ``scores(z1, z2, idx) -> Scores`` — computed ONCE per step; the loss and the
  diagnostics read the same scores (``Scores.pos``, ``neg``, ``mask``, ``batch_pos``).
* ``after_step(model, z2, idx)`` — after the optimiser step: the momentum encoder's EMA
  and the enqueue of this step's keys (nothing for in-batch negatives).
* ``state_dict()`` / ``load_state_dict()`` — what a resumed run needs (queue, encoder).

The loss never knows where its negatives came from: it gets ``Scores``.  With several
processes (``smallbatch.distributed.World``) the in-batch negatives are every process's
views, gathered with their gradient, and the queue is fed every process's keys, so the
queue and K are global and identical everywhere.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .distributed import World, gather, gather_with_grad
from .losses import MomentumQueue, batch_positives, in_batch_scores, queue_scores


class Scores(NamedTuple):
    """One step's scores: ``pos (B,)``, ``neg (B, K)``, ``mask (B, K)`` or None (True =
    a valid negative); with several processes, ``batch_pos`` — the whole batch's
    positives when ``pos`` holds only this process's anchors — and ``tau_neg`` — the whole
    batch's negatives, from which an ESS-scheduled τ is chosen identically everywhere
    (None: ``neg``)."""

    pos: Tensor
    neg: Tensor
    mask: Tensor | None
    batch_pos: Tensor | None = None
    tau_neg: Tensor | None = None

    def detached(self) -> "Scores":
        return Scores(*(None if t is None else t.detach() for t in self))


def _gathered_in_batch(z1: Tensor, z2: Tensor, world: World, full: bool) -> Scores:
    """This process's anchors against every process's views (``smallbatch.distributed``:
    the gather's backward returns each embedding's gradient to the process that made it)."""
    z1a, z2a = gather_with_grad(z1), gather_with_grad(z2)
    pos, neg, mask = in_batch_scores(z1a, z2a, rows=world.anchor_rows(z1.shape[0], z1.device))
    tau_neg = in_batch_scores(z1a.detach(), z2a.detach())[1] if full else None
    return Scores(pos, neg, mask, batch_positives(z1a, z2a), tau_neg)


class InBatch:
    """SimCLR's negatives: the 2N-2 other views of the (global) batch (K = 2N-2).  With
    several processes each computes the loss of its own anchors against all 2N views
    (``full``: also the whole batch's negatives, for an ESS-scheduled τ)."""

    kind = "in_batch"

    def __init__(self, world: World | None = None, full: bool = False) -> None:
        self.world = world or World()
        self.full = full

    def embed(self, model: torch.nn.Module, v1: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
        z = model(torch.cat([v1, v2]))
        return z[: v1.shape[0]], z[v1.shape[0]:]

    def scores(self, z1: Tensor, z2: Tensor, idx: Tensor) -> Scores:
        if self.world.size > 1:
            return _gathered_in_batch(z1, z2, self.world, self.full)
        pos, neg, mask = in_batch_scores(z1, z2)
        return Scores(pos, neg, mask)

    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {"key_model": None, "queue": None}

    def load_state_dict(self, state: dict) -> None:
        pass


class QueueNegatives:
    """MoCo's negatives (He et al. 2020): a FIFO queue of ``size`` keys from a momentum
    encoder (K = the queue's length); an anchor's own older keys are masked.  Until the
    first keys are queued (the first step) the step uses in-batch negatives."""

    kind = "queue"

    def __init__(self, key_model: torch.nn.Module, size: int, dim: int, momentum: float,
                 device: torch.device, dtype: torch.dtype, world: World | None = None) -> None:
        self.world = world or World()
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
            pos, neg, mask = in_batch_scores(z1, z2.detach())
            return Scores(pos, neg, mask)
        keys, key_idx = self.queue.negatives()
        pos, neg, mask = queue_scores(z1, z2.detach(), keys, idx, key_idx)
        if self.world.size > 1:  # DCLW's weights: every process's queries' positives
            return Scores(pos, neg, mask, gather(pos), None)
        return Scores(pos, neg, mask)

    @torch.no_grad()
    def after_step(self, model: torch.nn.Module, z2: Tensor, idx: Tensor) -> None:
        """EMA of the query encoder into the key encoder (buffers copied), then enqueue."""
        mom = self.momentum
        keys_p, query_p = list(self.key_model.parameters()), [p.detach() for p in model.parameters()]
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
