"""The critical batch size: steps-to-target against batch size, fitted by the empirical model.

McCandlish et al. 2018 (*An Empirical Model of Large-Batch Training*, eq. 2.11) and Shallue et
al. 2019 (JMLR): the optimiser steps S(B) that reach a fixed target at batch size B follow

    S(B) = S_min (1 + B_noise / B),

so the images (examples) it takes are

    E(B) = B S(B) = S_min (B + B_noise) = E_min (1 + B / B_noise),   E_min = S_min B_noise.

Below B_noise a larger batch buys proportionally fewer steps, above it almost none. Two
critical batch sizes are read off the model:

* McCandlish's ``B_crit = B_noise``: there S = 2 S_min and E = 2 E_min (steps and images both
  twice their minimum).
* Zhang et al. (ICLR 2025, *How Does Critical Batch Size Scale in Pre-training?*): the batch
  at which the steps exceed perfect (linear) scaling by 20 %.  Perfect scaling is the
  model's small-batch line ``S_lin(B) = S_min B_noise / B`` (doubling B halves the steps), so

      S(B) / S_lin(B) = (1 + B_noise / B) / (B_noise / B) = 1 + B / B_noise,

  and an overhead ε is reached at ``B = ε B_noise``: 0.2 B_noise for 20 %.

The fit (:func:`fit_steps`) is least squares in log space -- log S against
``log S_min + log(1 + B_noise / B)``, every seed's S at every B one point -- so each point
weighs by its relative error, as multiplicative noise in steps asks.  ``log S_min`` is
profiled out (for a given B_noise its optimum is the mean residual), leaving a
one-dimensional search over log B_noise.  A B_noise outside the batch sizes measured is an
extrapolation: the fit then says only "above the largest batch measured" (no diminishing
returns seen: perfect scaling throughout) or "below the smallest", never a number.
:func:`bootstrap_fit` resamples the seeds within each batch size and refits (percentile
interval).  NumPy and SciPy are imported inside the functions (the report starts without
them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ZHANG_OVERHEAD",
    "CriticalBatch",
    "Interval",
    "steps_to_target",
    "images_to_target",
    "overhead_batch",
    "fit_steps",
    "bootstrap_fit",
]

#: Zhang et al.'s overhead over perfect scaling that defines their critical batch size
ZHANG_OVERHEAD = 0.2
#: how far beyond the measured batch sizes (a factor each way) the search for B_noise runs
_SEARCH_FACTOR = 1e4


def steps_to_target(batch: float, s_min: float, b_noise: float) -> float:
    """The model's steps to the target at batch ``batch``: ``S_min (1 + B_noise / B)``."""
    return s_min * (1.0 + b_noise / batch)


def images_to_target(batch: float, s_min: float, b_noise: float) -> float:
    """The model's images to the target: ``E(B) = B S(B) = S_min (B + B_noise)``."""
    return batch * steps_to_target(batch, s_min, b_noise)


def overhead_batch(b_noise: float, overhead: float = ZHANG_OVERHEAD) -> float:
    """The batch at which the model's steps exceed perfect scaling by ``overhead`` (a fraction):
    ``S / S_lin = 1 + B / B_noise`` (module docstring), so ``B = overhead * B_noise``."""
    if not overhead > 0:
        raise ValueError(f"overhead must be a positive fraction (0.2 for 20 %), not {overhead!r}")
    return overhead * b_noise


@dataclass(frozen=True)
class CriticalBatch:
    """One least-squares fit: ``s_min`` and ``b_noise`` (the fitted values, possibly beyond the
    batches measured: read :attr:`where` before quoting them) and the batches' range."""

    s_min: float
    b_noise: float
    b_lo: float
    b_hi: float

    @property
    def where(self) -> str:
        """``within`` the batch sizes measured, ``above`` the largest or ``below`` the smallest."""
        return "above" if self.b_noise > self.b_hi else "below" if self.b_noise < self.b_lo else "within"

    @property
    def b_crit(self) -> float | None:
        """McCandlish's critical batch (= B_noise), None when it lies outside the batches measured."""
        return self.b_noise if self.where == "within" else None

    @property
    def b_zhang(self) -> float | None:
        """Zhang et al.'s 20 %-overhead batch (0.2 B_noise), None when B_noise lies outside."""
        return overhead_batch(self.b_noise) if self.where == "within" else None

    def describe(self) -> str:
        """B_noise as a number, or where it lies when the fit places it outside the data."""
        if self.where == "above":
            return f"B_noise above the largest batch measured ({self.b_hi:g}): no diminishing returns seen"
        if self.where == "below":
            return f"B_noise below the smallest batch measured ({self.b_lo:g}): no gain from a larger batch seen"
        return f"B_noise = {self.b_noise:.4g}, S_min = {self.s_min:.4g}, 20 %-overhead batch = {self.b_zhang:.4g}"


@dataclass(frozen=True)
class Interval:
    """A bootstrap percentile interval of B_noise and S_min, and the share of the replicas whose
    B_noise lay above the largest batch measured (an upper end there is open)."""

    level: float
    b_noise: tuple[float, float]
    s_min: tuple[float, float]
    above: float
    replicas: int


def _points(steps: Mapping[float, Sequence[float]]) -> tuple[list[float], list[float]]:
    """(batch, steps) of every seed at every batch size; a one-line error for a bad value."""
    bs, ss = [], []
    for b, values in steps.items():
        for s in values:
            if not (b > 0 and s > 0):
                raise ValueError(f"steps-to-target needs positive batches and steps, got B={b!r}, S={s!r}")
            bs.append(float(b))
            ss.append(float(s))
    if len(set(bs)) < 2:
        raise ValueError(f"the fit needs steps at two or more batch sizes, got {sorted(set(bs))}")
    return bs, ss


def _fit_points(batch, log_steps) -> tuple[float, float]:
    """(S_min, B_noise) minimising the squared log residuals; ``batch`` and ``log_steps`` arrays."""
    import numpy as np
    from scipy.optimize import minimize_scalar

    def rss(u):  # u: log B_noise, any shape; log S_min profiled out (the mean residual)
        u = np.asarray(u, dtype=np.float64)[..., None]
        r = log_steps - np.log1p(np.exp(u) / batch)
        return ((r - r.mean(axis=-1, keepdims=True)) ** 2).sum(axis=-1)

    lo, hi = np.log(batch.min() / _SEARCH_FACTOR), np.log(batch.max() * _SEARCH_FACTOR)
    grid = np.linspace(lo, hi, 801)
    i = int(np.argmin(rss(grid)))
    res = minimize_scalar(
        rss, bounds=(grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]), method="bounded", options={"xatol": 1e-9}
    )
    u = float(res.x) if res.fun <= rss(grid[i]) else float(grid[i])
    log_s_min = float(np.mean(log_steps - np.log1p(np.exp(u) / batch)))
    return float(np.exp(log_s_min)), float(np.exp(u))


def fit_steps(steps: Mapping[float, Sequence[float]]) -> CriticalBatch:
    """The model fitted to ``steps`` (batch size -> the steps-to-target of each seed) by least
    squares in log space (module docstring)."""
    import numpy as np

    bs, ss = _points(steps)
    batch = np.asarray(bs, dtype=np.float64)
    s_min, b_noise = _fit_points(batch, np.log(np.asarray(ss, dtype=np.float64)))
    return CriticalBatch(s_min, b_noise, float(batch.min()), float(batch.max()))


def bootstrap_fit(
    steps: Mapping[float, Sequence[float]], replicas: int = 1000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Percentile interval of B_noise and S_min: the seeds resampled with replacement within
    each batch size (each batch keeps its number of seeds), the model refitted ``replicas``
    times."""
    import numpy as np

    if not 0 < level < 1:
        raise ValueError(f"the interval's level must lie in (0, 1), not {level!r}")
    _points(steps)  # the same checks as the fit
    rng = np.random.default_rng(seed)
    groups = [(float(b), np.log(np.asarray(v, dtype=np.float64))) for b, v in steps.items()]
    batch = np.concatenate([np.full(v.size, b) for b, v in groups])
    fits = np.empty((replicas, 2))
    for r in range(replicas):
        log_steps = np.concatenate([rng.choice(v, size=v.size, replace=True) for _, v in groups])
        fits[r] = _fit_points(batch, log_steps)
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    s_lo, s_hi = np.percentile(fits[:, 0], q)
    b_lo, b_hi = np.percentile(fits[:, 1], q)
    above = float(np.mean(fits[:, 1] > batch.max()))
    return Interval(level, (float(b_lo), float(b_hi)), (float(s_lo), float(s_hi)), above, replicas)
