"""The supervised upper bound: the cells' backbone trained with labels, same budget.

The backbone of a cell (``train.backbone``, ``width``, ``pool_grid``) with a linear
classifier on its features, trained by cross-entropy on one augmented view per image --
the cells' augmentations (``augment``), optimiser, learning rate and its batch-size
scaling, warm-up + cosine schedule, weight decay and epochs (or ``train.steps``) -- on the
same training images. Data order and augmentations come from the same counter-based
streams as pretraining (:class:`smallbatch.training.checkpoint.StepRandom`), so a supervised run of
seed s sees its batches in the order a cell of seed s at the same batch size does. The
classifier is then dropped: the frozen backbone is evaluated by the very probes the cells
get (kNN, linear, few-label), so (supervised - random-init) is the range a
self-supervised encoder of this network can be placed in
(:func:`smallbatch.evaluation.probes.gap_fraction`).

Runs in float32 on one process; BatchNorm over the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..data.augment import AugmentConfig, BatchAugment
from ..study.cell import BaselineCell, Cell, TrainSettings
from ..study.lr_scaling import scaled_decay
from ..training.checkpoint import StepRandom
from ..training.models import build_backbone
from ..training.optim import lr_at, make_optimizer, scaled_lr, set_lr

__all__ = ["train_supervised", "supervised_schedule"]


def supervised_schedule(train: TrainSettings, n_images: int, batch_size: int) -> tuple[int, int, int, float]:
    """(steps per epoch, total steps, warm-up steps, peak rate) of the cells' schedule."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 2 <= batch_size <= n_images:
        raise ValueError(
            f"the supervised baseline's batch_size must be an integer in [2, {n_images}] "
            f"(the training images), got {batch_size!r}"
        )
    spe = n_images // batch_size
    total = int(train.steps) if train.steps else max(1, math.ceil(float(train.epochs) * spe))
    warmup = int(round(float(train.warmup_epochs) * spe))
    return spe, total, warmup, scaled_lr(float(train.lr), batch_size, train.lr_scaling)


def train_supervised(
    cell: BaselineCell | Cell,
    images: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    mean,
    std,
    device: torch.device | str = "cpu",
    watch: Callable[[int, nn.Module], bool] | None = None,
) -> nn.Module:
    """The cell's backbone trained with cross-entropy (module docstring); returns it (on
    ``device``). ``cell`` needs ``train``, ``augment``, ``seed`` and ``batch_size``;
    ``images`` uint8 ``(N, C, H, W)``, ``labels`` int64 ``(N,)``.  ``watch(steps done,
    backbone)``, if given, runs before every step and after the last; True stops the training
    there (a probe during training: it must leave the backbone's weights and modes as it found
    them)."""
    dev = torch.device(device)
    bs, augment = cell.batch_size, cell.augment
    if bs is None or augment is None:  # a supervised baseline cell has both (pipeline.cells)
        raise ValueError(f"the supervised baseline {cell.id} needs a batch_size and augment")
    tr = cell.train
    n, c, h, _ = images.shape
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
    spe, total, warmup, peak = supervised_schedule(tr, n, bs)
    torch.manual_seed(cell.seed)
    backbone, feat_dim = build_backbone(tr.backbone, c, h, width=tr.width, pool_grid=tr.pool_grid)
    net = nn.Sequential(backbone, nn.Linear(feat_dim, int(num_classes))).to(dev)
    beta2 = scaled_decay(float(tr.adam_beta2), bs, tr.beta2_scaling)  # the same rule as the cells'
    opt = make_optimizer(net.parameters(), tr.optimizer, peak, tr.momentum, tr.weight_decay, dev, beta2=beta2)
    aug = BatchAugment(AugmentConfig(**augment), image_size=h, channels=c, mean=mean, std=std)
    rng = StepRandom(cell.seed, dev)
    x_all, y_all = images.to(dev), labels.to(dev)
    net.train()
    perm, loss = None, None
    for step in range(total + 1):
        if (watch is not None and watch(step, backbone)) or step == total:
            break
        pos = step % spe
        if perm is None or pos == 0:
            perm = torch.randperm(n, generator=rng.generator("permutation", step // spe), device=dev)
        idx = perm[pos * bs : (pos + 1) * bs]
        x = x_all[idx]
        views = aug.apply(x, aug.draw(bs, rng.generator("augment", step), dev))
        set_lr(opt, lr_at(step, total, warmup, peak, tr.lr_schedule))
        loss = nn.functional.cross_entropy(net(views), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if loss is not None and not math.isfinite(float(loss.detach())):
        raise ValueError(f"the supervised baseline {cell.id} diverged (loss {float(loss)}); lower train.lr")
    return backbone.eval()
