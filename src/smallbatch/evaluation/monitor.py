"""The kNN monitor: a cheap kNN top-1 of the backbone while it trains (every
``eval.monitor_every`` epochs), to see when a cell's representation stops improving.

It never touches the test split: a fixed held-out split of the labelled *training* images
(seeded by the cell's seed, its own generator: the training's random streams are untouched)
gives the queries, another part of them the bank.  The backbone is embedded in eval mode
under ``no_grad`` (:func:`smallbatch.evaluation.embed.embed` restores every module's mode), so a cell
trains to the same weights with the monitor on or off: an execution setting, not in the hash.
Logged at the epoch end's optimiser step: ``monitor/knn_top1`` (percent), ``monitor/epoch``,
``monitor/seconds``, and (by the training loop) ``monitor/images_seen``."""

from __future__ import annotations

import copy
import time

import torch

from ..study.cell import Cell
from . import percent

#: images of the held-out queries and of the bank (their cost is a benchmark record)
QUERIES, BANK = 500, 2000
_SEED_OFFSET = 0x6D6F6E  # the split's generator: apart from every training stream


class KnnMonitor:
    """``monitor(backbone, epoch)`` -> the metrics of a due epoch (every ``every``-th), else None."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean,
        std,
        *,
        every: int,
        k: int,
        t: float,
        seed: int,
        device,
        queries: int = QUERIES,
        bank: int = BANK,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"eval.monitor_every must be a whole number of epochs >= 1 (0 or null: off), not {every!r}"
            )
        n = images.shape[0]
        n_q = min(queries, n // 5)
        n_b = min(bank, n - n_q)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) + _SEED_OFFSET))
        q, b = perm[:n_q], perm[n_q : n_q + n_b]
        self.xq, self.yq, self.xb, self.yb = images[q], labels[q].numpy(), images[b], labels[b].numpy()
        self.mean, self.std, self.every, self.k, self.t, self.device = mean, std, every, k, t, device

    def __call__(self, backbone, epoch: int) -> dict | None:
        from .embed import embed
        from .knn import knn_eval

        if epoch % self.every:
            return None
        t0 = time.perf_counter()
        if any(p.dtype == torch.float64 for p in backbone.parameters()):  # an fp64 cell: a float32 copy, as evaluated
            backbone = copy.deepcopy(backbone).float()
        fb = embed(backbone, self.xb, self.mean, self.std, batch_size=256, device=self.device)
        fq = embed(backbone, self.xq, self.mean, self.std, batch_size=256, device=self.device)
        top1 = knn_eval(fb, self.yb, fq, self.yq, ks=(self.k,), t=self.t, backend="torch", device=self.device)["top1"]
        return {
            "monitor/knn_top1": percent(top1),
            "monitor/epoch": float(epoch),
            "monitor/seconds": time.perf_counter() - t0,
        }


def knn_monitor(cell: Cell, data, device) -> KnnMonitor | None:
    """The cell's monitor, or None when ``eval.monitor_every`` is off (0 / null) or the data
    has no labelled training images."""
    ev = cell.eval
    every = ev.monitor_every or 0
    if not every or data.train_y is None:
        return None
    return KnnMonitor(
        data.train_x,
        data.train_y,
        data.mean,
        data.std,
        every=every,
        k=min(ev.knn_k),
        t=ev.knn_t,
        seed=cell.seed,
        device=device,
    )
