"""The learning-rate scaling rules, without torch: ``train.lr`` is the rate at batch 256 and
:func:`scaled_lr` maps it to a cell's batch size N -- ``linear`` lr*N/256 (SimCLR),
``sqrt`` lr*sqrt(N/256) (SimCLR's square-root rule, normalised at 256), ``none`` lr.  Training
(:mod:`smallbatch.training.optim`) and the report (the rate a logged cell trained at) both
read it here."""

from __future__ import annotations

import math

LR_SCALINGS = ("none", "linear", "sqrt")

#: the exponent k of each rule's rate ∝ N^k (what an lr sweep's validated rates are set against)
RULE_EXPONENTS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def scaled_lr(base_lr: float, batch_size: int, rule: str) -> float:
    """The peak rate of a cell: ``train.lr`` (at batch 256) scaled to ``batch_size``."""
    if rule == "linear":
        return base_lr * batch_size / 256
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_size / 256)
    if rule == "none":
        return base_lr
    raise ValueError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}, not {rule!r}")
