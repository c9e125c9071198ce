"""The temperature τ of a cell's loss: one object owns it, fixed, ESS-scheduled or learnt.

:class:`FixedTemperature` is the cell's τ, a constant.  :class:`LearntTemperature` is the
τ a loss learns (a loss whose registry entry ``owns_temperature``: its parameter t',
τ = exp(-t'), started at the cell's τ and trained with the network).  :class:`EssTemperature` is
FlatNCE's ESS-scheduled temperature (Chen et al. 2021, Algorithm S1, in spirit): before
each step τ is chosen so that the effective sample size of the batch's negative weights
equals a target moving from ``start`` (flat weights: many negatives count) to ``end``
(peaked: hard negatives dominate) on a cosine schedule.

Both have the same interface, used by the training step:

* ``begin_step(step)`` — host side, before the step (the schedule's target is written
  into a device tensor: an asynchronous copy, no synchronisation);
* ``__call__(neg, neg_mask)`` — inside the step, on the detached negative scores: the τ
  the loss uses this step (a float, or a 0-d float64 tensor on the device);
* ``value`` (for logging), ``target(step)``, ``state_dict()`` / ``load_state_dict()``.

The ESS bisection runs on the device as tensor operations with a fixed number of
iterations (no ``.item()``, no data-dependent branch), so it neither synchronises a GPU
nor breaks a compiled graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..losses.diagnostics import effective_sample_size
from ..study.cell import Cell

_BISECTIONS = 40  # halvings of [log tau_min, log tau_max]: far below float64's resolution of tau


def ess_of(neg: Tensor, tau: float | Tensor, neg_mask: Tensor | None = None) -> Tensor:
    """Mean of :func:`smallbatch.losses.diagnostics.effective_sample_size` over anchors, in float64
    (a 0-d tensor)."""
    return effective_sample_size(neg.double(), tau, neg_mask).mean()


class FixedTemperature:
    """The cell's temperature, unchanged during training."""

    def __init__(self, tau: float) -> None:
        self.value = float(tau)

    def begin_step(self, step: int) -> None:
        pass

    def __call__(self, neg: Tensor, neg_mask: Tensor | None = None) -> float:
        return self.value

    def target(self, step: int) -> None:
        return None

    def state_dict(self) -> dict:
        return {"tau": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["tau"])


class EssTemperature:
    """τ chosen each step so the batch's ESS meets a cosine-scheduled target.

    ESS is increasing in τ, so τ* is found by bisection in log τ within
    ``[tau_min, tau_max]`` (clamped to an end when the target lies outside); ``rate`` in
    (0, 1] smooths the update in log space (1 = jump to τ*)."""

    def __init__(
        self,
        start: float,
        end: float,
        total_steps: int,
        tau0: float,
        rate: float = 1.0,
        tau_min: float = 0.01,
        tau_max: float = 10.0,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (("start", start), ("end", end)):
            if not 0 < v <= 1:
                raise ValueError(f"ess_schedule.{name} must be in (0, 1], not {v!r}")
        if not 0 < rate <= 1:
            raise ValueError(f"ess_schedule.rate must be in (0, 1], not {rate!r}")
        if not 0 < tau_min < tau_max:
            raise ValueError(f"ess_schedule needs 0 < tau_min < tau_max, not {tau_min!r}, {tau_max!r}")
        self.start, self.end, self.total = float(start), float(end), max(1, int(total_steps))
        self.rate, self.tau_min, self.tau_max = float(rate), float(tau_min), float(tau_max)
        self.value = torch.tensor(float(tau0), dtype=torch.float64, device=device)
        self._target = torch.zeros((), dtype=torch.float64, device=device)

    def target(self, step: int) -> float:
        p = min(1.0, step / self.total)
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * p))

    def begin_step(self, step: int) -> None:
        self._target.fill_(self.target(step))

    def __call__(self, neg: Tensor, neg_mask: Tensor | None = None) -> Tensor:
        star = self.solve(neg.detach(), self._target, neg_mask)
        new = torch.exp((1 - self.rate) * torch.log(self.value) + self.rate * torch.log(star))
        self.value.copy_(new)
        return new

    def solve(self, neg: Tensor, target: Tensor | float, neg_mask: Tensor | None = None) -> Tensor:
        """τ* with ESS(τ*) = target, by bisection on log τ (a 0-d float64 tensor)."""
        lo = torch.full_like(self.value, math.log(self.tau_min))
        hi = torch.full_like(self.value, math.log(self.tau_max))
        low_enough = ess_of(neg, torch.exp(lo), neg_mask) >= target  # even tau_min is flat enough
        never = ess_of(neg, torch.exp(hi), neg_mask) <= target  # even tau_max is too peaked
        for _ in range(_BISECTIONS):
            mid = 0.5 * (lo + hi)
            below = ess_of(neg, torch.exp(mid), neg_mask) < target
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        star = torch.exp(0.5 * (lo + hi))
        star = torch.where(never, torch.full_like(star, self.tau_max), star)
        return torch.where(low_enough, torch.full_like(star, self.tau_min), star)

    def state_dict(self) -> dict:
        return {"tau": self.value.detach().cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.value.copy_(torch.as_tensor(state["tau"], dtype=torch.float64))


class LearntTemperature:
    """τ learnt by the cell's loss: ``loss.learnt_temperature()`` = exp(-t'), its parameter
    t' started at the cell's τ.  Each call returns it with its gradient (the step's loss
    trains t' through it); ``value`` is its current value, what ``train/tau`` logs.  The
    parameter is saved and restored with the loss (``state.pt``'s ``loss``), so this
    object's own state is only a record of τ."""

    def __init__(self, loss, tau0: float) -> None:
        loss.init_temperature(tau0)
        self.loss = loss

    @property
    def value(self) -> float:
        return float(self.loss.learnt_temperature().detach())

    def begin_step(self, step: int) -> None:
        pass

    def __call__(self, neg: Tensor, neg_mask: Tensor | None = None) -> Tensor:
        return self.loss.learnt_temperature()

    def target(self, step: int) -> None:
        return None

    def state_dict(self) -> dict:
        return {"tau": self.value}

    def load_state_dict(self, state: dict) -> None:
        pass  # t' comes back with the loss's own state


def build_temperature(
    cell: Cell, total_steps: int, device: torch.device, loss=None
) -> FixedTemperature | EssTemperature | LearntTemperature:
    """The cell's temperature object: learnt by ``loss`` when its registry entry
    ``owns_temperature``, else ESS-scheduled with ``train.ess_schedule``, else fixed."""
    if loss is not None and loss.owns_temperature:
        return LearntTemperature(loss, cell.temperature)
    es = cell.train.ess_schedule
    if not es:
        return FixedTemperature(cell.temperature)
    return EssTemperature(
        es["start"], es["end"], total_steps, cell.temperature, es["rate"], es["tau_min"], es["tau_max"], device=device
    )
