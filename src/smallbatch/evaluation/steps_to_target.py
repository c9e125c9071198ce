"""Steps to a target: how many optimiser steps one arm takes to reach a fixed probe accuracy.

One arm is a loss at a batch size and seed: a contrastive cell trained by the package's own
loop (:mod:`smallbatch.training.loop`), or the supervised control -- the same network, data,
augmentations, optimiser, rate rule and data order trained by cross-entropy
(:func:`smallbatch.evaluation.supervised.train_supervised`).  The probe is the kNN monitor's
(:class:`smallbatch.evaluation.monitor.KnnMonitor`) on a **validation split held out of the
training images** (:func:`hold_out`): the arm never trains on it and the test split is never
read.  It is evaluated on a grid of steps geometric in images (:func:`eval_steps`: the same
images at every batch size, dense enough to interpolate) and the steps-to-target is the first
crossing of the curve, linearly interpolated between the two evaluations around it
(:func:`first_crossing`); a curve that never reaches the target gives None ("not reached"),
never a number.  With a constant rate after the warm-up (``train.lr_schedule: constant``) the
trajectory does not depend on the budget, so an arm may stop at its first evaluation at or past
the target.  Nothing here reads or writes a file: the caller gets the result back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..study.cell import Cell
from ..study.lr_scaling import scaled_lr
from ..training import loop
from . import SUPERVISED_ARM
from .monitor import KnnMonitor
from .supervised import train_supervised

__all__ = ["Curve", "Result", "first_crossing", "eval_steps", "hold_out", "split_data", "run_arm"]

_SPLIT_SEED = 0x76616C  # the validation split's generator: apart from every training stream


@dataclass
class Curve:
    """The probe's accuracy (percent) at each evaluated step (step 0: the initial network)."""

    batch_size: int
    steps: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)

    @property
    def images(self) -> list[int]:
        return [s * self.batch_size for s in self.steps]


@dataclass(frozen=True)
class Result:
    """One arm's steps-to-target (None: not reached within its budget), its curve and cost."""

    arm: str
    batch_size: int
    seed: int
    target: float
    steps: float | None
    curve: Curve
    peak_lr: float
    cpu_s: float
    status: str  # reached | not reached | diverged

    @property
    def images(self) -> float | None:
        return None if self.steps is None else self.steps * self.batch_size


def first_crossing(steps: Sequence[float], accuracy: Sequence[float], target: float) -> float | None:
    """The first step at which the curve reaches ``target``, linearly interpolated between the
    last evaluation below it and the first at or above it; the first evaluation itself when it
    already reaches it; None when no evaluation does."""
    if len(steps) != len(accuracy):
        raise ValueError(f"a curve needs one accuracy per step, got {len(steps)} steps and {len(accuracy)} values")
    for i, (s, a) in enumerate(zip(steps, accuracy)):
        if a >= target:
            if i == 0:
                return float(s)
            s0, a0 = steps[i - 1], accuracy[i - 1]
            return float(s0 + (target - a0) / (a - a0) * (s - s0))
    return None


def eval_steps(batch_size: int, first_images: int, max_images: int, per_octave: int) -> list[int]:
    """Step 0 and the steps nearest ``first_images * 2**(k / per_octave)`` images (k = 0, 1, ...)
    up to ``max_images``: the same images at every batch size, distinct steps, ascending."""
    if not (batch_size >= 1 and 1 <= first_images <= max_images and per_octave >= 1):
        raise ValueError(
            "the evaluation grid needs batch_size >= 1, 1 <= first_images <= max_images and per_octave >= 1, "
            f"got {batch_size}, {first_images}, {max_images}, {per_octave}"
        )
    n = int(math.floor(per_octave * math.log2(max_images / first_images) + 1e-9))
    out = {0}
    for k in range(n + 1):
        out.add(max(1, round(first_images * 2 ** (k / per_octave) / batch_size)))
    return sorted(out)


def hold_out(images: torch.Tensor, labels: torch.Tensor, n_val: int, seed: int = 0):
    """(train images, train labels, validation images, validation labels): ``n_val`` of the
    labelled *training* images drawn by a fixed generator (``seed``), the rest to train on."""
    n = images.shape[0]
    if not 0 < n_val < n:
        raise ValueError(
            f"the validation split must hold between 1 and {n - 1} of the {n} training images, not {n_val}"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed) + _SPLIT_SEED))
    val, train = perm[:n_val], perm[n_val:]
    return images[train], labels[train], images[val], labels[val]


def split_data(data, n_val: int, *, queries: int, k: int, t: float, device="cpu", seed: int = 0):
    """(the arms' training data, the probe) from ``data`` (an :class:`smallbatch.data.load.ImageData`):
    ``n_val`` of its labelled training images held out (:func:`hold_out`), the probe a kNN top-1
    of ``queries`` of them against the rest; the arms get the other training images as (images,
    labels, number of classes, mean, std).  The test split is never read."""
    tx, ty, vx, vy = hold_out(data.train_x, data.train_y, n_val, seed)
    probe = KnnMonitor(
        vx, vy, data.mean, data.std, every=1, k=k, t=t, seed=seed, device=device, queries=queries, bank=n_val - queries
    )
    return (tx, ty, data.num_classes, data.mean, data.std), probe


class _Watch:
    """Evaluates the probe at the scheduled steps; says when to stop."""

    def __init__(self, probe: KnnMonitor, schedule: list[int], batch_size: int, target: float, stop_at_target: bool):
        self.probe, self.due, self.target, self.stop_at_target = probe, set(schedule), target, stop_at_target
        self.curve = Curve(batch_size)

    def __call__(self, step: int, backbone: torch.nn.Module) -> bool:
        if step not in self.due:
            return False
        acc = self.probe(backbone, 0)["monitor/knn_top1"]  # type: ignore[index]  # due every epoch: never None
        self.curve.steps.append(step)
        self.curve.accuracy.append(acc)
        return self.stop_at_target and acc >= self.target


def _train_contrastive(cell: Cell, images, mean, std, dev, watch: _Watch, last: int) -> tuple[str, float]:
    """The cell trained by the package's loop up to step ``last`` or until ``watch`` stops it."""
    t = loop.build_training(cell, images, mean, std, dev, Path("unused"))  # nothing is saved
    if watch(0, t.step_fn.model.backbone):
        return "finished", t.peak_lr
    t.step_fn.model.train()
    perm = None
    while t.step < last:
        perm, idx = loop.next_batch(t, perm)
        loop.one_step(t, idx, watch=False)
        if t.step in watch.due and not bool(t.finite):
            return "diverged", t.peak_lr
        if watch(t.step, t.step_fn.model.backbone):
            break
    return "finished", t.peak_lr


def run_arm(
    cell: Cell,
    arm: str,
    data: tuple,
    probe: KnnMonitor,
    schedule: list[int],
    target: float,
    *,
    device="cpu",
    stop_at_target: bool = True,
) -> Result:
    """Train ``arm`` (a loss: the cell as it is; :data:`SUPERVISED_ARM`: cross-entropy on the cell's
    network, data and optimiser) at the cell's batch size and seed, evaluating ``probe`` at the
    steps of ``schedule`` (the last one is the budget); ``data`` = (train images, train labels,
    number of classes, mean, std), the validation split already removed."""
    images, labels, n_classes, mean, std = data
    if not schedule or schedule[0] != 0 or int(cell.train.steps or 0) != schedule[-1]:
        raise ValueError(
            f"the evaluation steps must start at 0 and end at the cell's train.steps ({cell.train.steps}), "
            f"got {schedule[:1]} ... {schedule[-1:]}: set train.steps to the schedule's last step"
        )
    dev = torch.device(device)
    watch = _Watch(probe, schedule, cell.batch_size, target, stop_at_target)
    cpu0 = time.process_time()
    if arm == SUPERVISED_ARM:  # the budget: the cell's train.steps (the caller sets it to the schedule's last step)
        status, peak = "finished", scaled_lr(float(cell.train.lr), cell.batch_size, cell.train.lr_scaling)
        train_supervised(cell, images, labels, n_classes, mean, std, dev, watch=watch)
    else:
        if arm != cell.loss:
            raise ValueError(f"arm {arm!r} is neither {SUPERVISED_ARM!r} nor the cell's loss {cell.loss!r}")
        status, peak = _train_contrastive(cell, images, mean, std, dev, watch, schedule[-1])
    crossing = first_crossing(watch.curve.steps, watch.curve.accuracy, target)
    if status == "finished":
        status = "reached" if crossing is not None else "not reached"
    else:
        crossing = None
    return Result(
        arm, cell.batch_size, cell.seed, target, crossing, watch.curve, peak, time.process_time() - cpu0, status
    )
