"""The batch-size scaling rules, without torch.  Every batch-dependent knob is stated at
:data:`REFERENCE_BATCH` (256) and mapped to a cell's batch size N here, once:

* the learning rate (:func:`scaled_lr`): ``train.lr`` -- ``linear`` lr*N/256 (SimCLR), ``sqrt``
  lr*sqrt(N/256) (SimCLR's square-root rule, normalised at 256), ``none`` lr;
* a decay per step (:func:`scaled_decay`): Adam's β2 (``train.beta2_scaling``) and the EMA momenta
  (``train.ema_scaling``: the MoCo key encoder's, a target network's) -- ``samples`` ρ^(N/256), so the
  average's horizon is the same number of images at every batch (β2 0.999 at 256 is 0.999^(1/16)
  at 16: Marek et al. 2025; ρ^κ with κ = N/256: Busbridge et al. 2023), ``none`` ρ.

Training (:mod:`smallbatch.training.optim`, the loop), the pretraining job (which logs the
resolved values) and the report (the rate a logged cell trained at) all read them here."""

from __future__ import annotations

import math
from typing import Any

LR_SCALINGS = ("none", "linear", "sqrt")
DECAY_SCALINGS = ("none", "samples")
#: the batch size at which train.lr, train.adam_beta2 and the EMA momenta are stated
REFERENCE_BATCH = 256

#: the exponent k of each rule's rate ∝ N^k (what an lr sweep's validated rates are set against)
RULE_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def scaled_lr(base_lr: float, batch_size: int, rule: str) -> float:
    """The peak rate of a cell: ``train.lr`` (at batch 256) scaled to ``batch_size``."""
    if rule == "linear":
        return base_lr * batch_size / REFERENCE_BATCH
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_size / REFERENCE_BATCH)
    if rule == "none":
        return base_lr
    raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}, not {rule!r}")


def scaled_decay(decay: float, batch_size: int, rule: str) -> float:
    """A per-step decay (Adam's β2, an EMA momentum) stated at batch 256, for ``batch_size``:
    ``samples`` decay^(N/256) (the same horizon in images), ``none`` decay."""
    if rule == "samples":
        return decay ** (batch_size / REFERENCE_BATCH)
    if rule == "none":
        return decay
    raise ValueError(f"a decay's scaling must be one of {', '.join(DECAY_SCALINGS)}, not {rule!r}")


def resolved_knobs(train: Any, batch_size: int, ema: float | None = None) -> dict[str, float]:
    """The batch-dependent knobs of a cell as it trains them: ``train.adam_beta2``, and where the
    cell has them ``train.moco_momentum`` (a queue) and ``loss.ema`` (``ema``: a target network's
    momentum at batch 256, None without one), each at its batch size.  ``train``: the cell's train
    settings (attributes)."""
    out = {"train.adam_beta2": scaled_decay(float(train.adam_beta2), batch_size, train.beta2_scaling)}
    if int(train.queue_size):
        out["train.moco_momentum"] = scaled_decay(float(train.moco_momentum), batch_size, train.ema_scaling)
    if ema is not None:
        out["loss.ema"] = scaled_decay(float(ema), batch_size, train.ema_scaling)
    return out
