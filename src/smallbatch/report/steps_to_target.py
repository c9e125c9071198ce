"""Steps-to-target against batch size, per arm: the critical-batch fit and its two figures.

Reads the per-seed table of a steps-to-target sweep (one row per arm, batch size and seed:
``arm``, ``batch_size``, ``seed``, ``steps`` -- empty when the target was not reached --,
``status``), fits ``S(B) = S_min (1 + B_noise / B)`` per arm with
:mod:`smallbatch.report.critical_batch` (least squares in log space, a bootstrap over the
seeds), and draws steps-to-target against B (log-log, the perfect-scaling line and the fitted
curve per arm) and images-to-target ``B S(B)``.  A run that did not reach the target has no
steps: it enters no fit and is counted beside it (never given a number).  NumPy, pandas and
matplotlib are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..evaluation import SUPERVISED_ARM
from ..losses.registry import display_name
from .critical_batch import CriticalBatch, Interval, bootstrap_fit, fit_steps, images_to_target
from .critical_batch import steps_to_target as model_steps
from .figures import LOSS_COLORS, OTHER_COLORS, PAPER_RC, paper_figure, plot_style

__all__ = ["ArmFit", "steps_by_batch", "fit_arms", "fit_markdown", "plot_steps", "plot_images"]


def arm_label(arm: str) -> str:
    """How an arm is named in a table or legend: a loss's display name, or the supervised control."""
    return "supervised CE" if arm == SUPERVISED_ARM else display_name(arm)


@dataclass(frozen=True)
class ArmFit:
    """One arm's fit, its bootstrap interval and its runs that did not reach the target."""

    arm: str
    fit: CriticalBatch | None  # None: steps at fewer than two batch sizes
    interval: Interval | None
    not_reached: dict[int, int]  # batch size -> runs that did not reach the target
    at_start: dict[int, int] = field(default_factory=dict)  # batch size -> runs whose initial network reached it


def steps_by_batch(rows: Iterable[Mapping]) -> dict[str, tuple[dict[int, list[float]], dict[int, int]]]:
    """Per arm (in the rows' order): (batch size -> the reached runs' steps, batch size -> the runs
    that did not reach the target)."""
    out: dict[str, tuple[dict[int, list[float]], dict[int, int]]] = {}
    for r in rows:
        reached, missed = out.setdefault(str(r["arm"]), ({}, {}))
        b = int(r["batch_size"])
        if r["steps"] in ("", None):
            missed[b] = missed.get(b, 0) + 1
        else:
            reached.setdefault(b, []).append(float(r["steps"]))
    return out


def fit_arms(rows: Iterable[Mapping], replicas: int = 1000, seed: int = 0) -> list[ArmFit]:
    """The fit of every arm with steps at two or more batch sizes; a run whose initial network
    already reached the target (step 0) enters no fit either (the model has no zero steps) and is
    counted apart."""
    fits = []
    for arm, (reached, missed) in steps_by_batch(rows).items():
        at_start = {b: n for b, n in ((b, sum(1 for s in v if s <= 0)) for b, v in reached.items()) if n}
        usable: dict[float, list[float]] = {float(b): [s for s in v if s > 0] for b, v in reached.items()}
        usable = {b: v for b, v in usable.items() if v}
        if len(usable) < 2:
            fits.append(ArmFit(arm, None, None, missed, at_start))
            continue
        fits.append(ArmFit(arm, fit_steps(usable), bootstrap_fit(usable, replicas, seed=seed), missed, at_start))
    return fits


def _ci(lo: float, hi: float, b_hi: float) -> str:
    return f"{lo:.3g} – above {b_hi:g}" if hi > b_hi else f"{lo:.3g} – {hi:.3g}"


def fit_markdown(fits: list[ArmFit]) -> str:
    """One row per arm: S_min, B_noise (where it lies), their 95 % intervals, the 20 %-overhead batch,
    the runs that did not reach the target."""
    lines = [
        "| arm | S_min | 95 % interval | B_noise | 95 % interval | replicas above the largest B | "
        "B_crit (20 % overhead) | not reached | reached at step 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in fits:
        missed = ", ".join(f"B={b}: {n}" for b, n in sorted(f.not_reached.items())) or "none"
        missed += " | " + (", ".join(f"B={b}: {n}" for b, n in sorted(f.at_start.items())) or "none")
        name = arm_label(f.arm)
        if f.fit is None or f.interval is None:
            lines.append(f"| {name} | – | – | – | – | – | – | {missed} |")
            continue
        c, iv = f.fit, f.interval
        b_noise = f"{c.b_noise:.3g}" if c.where == "within" else f"{c.b_noise:.3g} ({c.where} the batches measured)"
        zhang = f"{c.b_zhang:.3g}" if c.b_zhang is not None else "–"
        lines.append(
            f"| {name} | {c.s_min:.3g} | {_ci(*iv.s_min, float('inf'))} | {b_noise} | {_ci(*iv.b_noise, c.b_hi)} | "
            f"{100 * iv.above:.0f} % | {zhang} | {missed} |"
        )
    return "\n".join(lines) + "\n"


def _color(arm: str, i: int) -> str:
    """The loss's colour of every figure; the supervised control black."""
    return "#000000" if arm == SUPERVISED_ARM else LOSS_COLORS.get(arm) or OTHER_COLORS[1 + i % (len(OTHER_COLORS) - 1)]


def _draw(rows: Iterable[Mapping], fits: list[ArmFit], path, images: bool) -> None:
    """Steps (or images) to the target against B, log-log: the seeds' points, the fitted curve
    (solid) and perfect scaling (dashed: S_min B_noise / B, images flat at E_min) per arm."""
    import numpy as np
    import pandas as pd

    plt, sns, rc = plot_style()
    frame = pd.DataFrame(list(rows))
    batches = sorted({int(b) for b in frame["batch_size"]})
    frame = frame[frame["steps"].astype(str) != ""].astype({"batch_size": float, "steps": float})
    frame = frame[frame["steps"] > 0]  # reached at step 0: no point on a log axis (counted in the table)
    frame["y"] = frame["steps"] * (frame["batch_size"] if images else 1.0)
    with plt.rc_context({**rc, **PAPER_RC}):
        fig, axes = paper_figure(plt, 1, 1, row_height=2.6)
        ax = axes[0][0]
        for i, f in enumerate(fits):
            color, d = _color(f.arm, i), frame[frame["arm"] == f.arm]
            sns.scatterplot(data=d, x="batch_size", y="y", color=color, s=14, alpha=0.7, ax=ax, legend=False)
            if f.fit is None:
                continue
            b = np.geomspace(f.fit.b_lo, f.fit.b_hi, 64)
            curve = [(images_to_target if images else model_steps)(x, f.fit.s_min, f.fit.b_noise) for x in b]
            ax.plot(b, curve, color=color, lw=1.2, label=arm_label(f.arm))
            line = f.fit.s_min * f.fit.b_noise * (np.ones_like(b) if images else 1.0 / b)
            ax.plot(b, line, color=color, lw=0.8, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="batch size B")
        ax.set_ylabel("images to target, B·S(B)" if images else "steps to target, S(B)")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        if any(f.fit is not None for f in fits):
            ax.legend(title="solid: fit; dashed: perfect scaling", frameon=False)
        fig.savefig(path, dpi=200)
        plt.close(fig)


def plot_steps(rows: Iterable[Mapping], fits: list[ArmFit], path) -> None:
    """Steps-to-target against B (log-log), the fitted S(B) and the perfect-scaling line per arm."""
    _draw(rows, fits, path, images=False)


def plot_images(rows: Iterable[Mapping], fits: list[ArmFit], path) -> None:
    """Images-to-target B·S(B) against B (log-log), the fitted E(B) and E_min (perfect scaling) per arm."""
    _draw(rows, fits, path, images=True)
