"""The plateau rule: the training budget at which a probe's accuracy has stopped moving.

A *curve* is one arm's values of one probe at several training budgets (epochs), each a
``{seed: value}`` of the same runs (snapshots of one run per seed, so two budgets pair by seed).
The rule reads the curve's *doublings*: every budget ``e`` whose half ``e / 2`` is also on the
curve.  Over one doubling the mean changes by ``mean(e) − mean(e / 2)``, paired by seed; the
change is *flat* when its size is below its MDE (the smallest difference the seeds' spread
detects at 80 % power, as the instrument computes every MDE: :func:`smallbatch.report.evidence.contrast`).

The plateau is the smallest budget ``e`` ending a flat doubling such that every later doubling is
flat too: from there on, no doubling of the budget moved the mean by what the seeds could detect.
A curve whose last doubling is not flat is *still moving* (no plateau yet, and no verdict at it),
and so is one whose change over a doubling cannot be judged (one seed, or seeds that differ at
one budget only).  Budgets that end no doubling take no part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .evidence import contrast
from .fmt import finite, num, short, signed

__all__ = ["Doubling", "Plateau", "doublings", "plateau", "PLATEAU", "MOVING", "NO_DOUBLING"]

#: a budget is the double of another within this relative tolerance (snapshots land on whole steps)
DOUBLING_RTOL = 0.02
#: a curve's statuses
PLATEAU, MOVING, NO_DOUBLING = "plateau", "no plateau yet", "no doubling"


@dataclass(frozen=True)
class Doubling:
    """One doubling of the budget: ``epochs`` its end, ``change`` the paired mean change from
    its half, ``mde`` that change's MDE; ``flat`` None where it cannot be judged."""

    epochs: float
    change: float
    mde: float
    seeds: int

    @property
    def flat(self) -> bool | None:
        if not finite(self.change):
            return None
        if finite(self.mde):
            return abs(self.change) < self.mde
        # identical seed differences (no spread): only no change at all is flat
        return self.change == 0.0 if self.seeds >= 2 else None

    def text(self) -> str:
        return (
            f"{short(self.epochs / 2)} → {short(self.epochs)} epochs: {signed(self.change, 2)} (MDE {num(self.mde, 2)})"
        )


@dataclass(frozen=True)
class Plateau:
    """A curve under the rule: ``epochs`` the plateau budget (NaN without one), ``status`` one of
    :data:`PLATEAU`, :data:`MOVING`, :data:`NO_DOUBLING`, and every doubling read."""

    epochs: float
    status: str
    steps: tuple[Doubling, ...] = ()

    @property
    def reached(self) -> bool:
        return self.status == PLATEAU

    def text(self) -> str:
        """``plateau at 8 epochs (4 → 8 epochs: +0.12 (MDE 0.40))`` or why there is none."""
        if self.status == NO_DOUBLING:
            return "no doubling of the budget measured"
        last = self.steps[-1].text()
        if self.reached:
            return f"plateau at {short(self.epochs)} epochs (last doubling {last})"
        return f"no plateau yet (last doubling {last})"


def doublings(budgets) -> list[tuple[float, float]]:
    """(half, budget) for every budget of ``budgets`` whose half is among them, by budget."""
    bs = sorted(float(b) for b in budgets if finite(b) and b > 0)
    out = []
    for b in bs:
        half = next((h for h in bs if math.isclose(2 * h, b, rel_tol=DOUBLING_RTOL)), None)
        if half is not None:
            out.append((half, b))
    return out


def plateau(curve: Mapping[float, Mapping[int, float]]) -> Plateau:
    """The plateau of ``curve`` (budget in epochs -> {seed: value}) under the rule of the module."""
    steps = []
    for half, full in doublings(curve):
        e = contrast([(1.0, curve[full]), (-1.0, curve[half])])
        steps.append(Doubling(full, e.diff, e.mde, e.n))
    if not steps:
        return Plateau(math.nan, NO_DOUBLING)
    start = None
    for d in reversed(steps):
        if d.flat is not True:
            break
        start = d.epochs
    if start is None:
        return Plateau(math.nan, MOVING, tuple(steps))
    return Plateau(start, PLATEAU, tuple(steps))
