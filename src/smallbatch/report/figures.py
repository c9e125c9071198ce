"""The figure style and the data shapes every figure starts from (top-1 per run, binned histories)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ..tracking import BAD_STATUSES
from .runs import METRIC_LABELS, METRICS

#: points a training history is averaged into (per run) before it is drawn
HISTORY_BINS = 40


def plot_style():
    """(pyplot, seaborn, rc) with the Agg backend and an SVG hash salt (stable SVG ids)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    return plt, sns, {"svg.hashsalt": "smallbatch", "figure.max_open_warning": 0}


def palette(labels: Sequence[str]) -> dict:
    import seaborn as sns

    return dict(zip(labels, sns.color_palette("tab10", max(len(labels), 1))))


def mark_bad(ax, xs: Iterable[float], color) -> None:
    """▽ on the x axis where every seed of a cell had a bad status."""
    xs = list(xs)
    if xs:
        y0 = ax.get_ylim()[0]
        ax.scatter(xs, [y0] * len(xs), marker="v", s=80, facecolors="none", edgecolors=[color],
                   linewidths=1.5, clip_on=False, zorder=5)


def accuracy_long(cells: pd.DataFrame, scale: float, extra: Sequence[str]) -> pd.DataFrame:
    """One row per (run without a bad status, metric) with a finite top-1: loss, label, ``extra``,
    metric (its label) and 'top-1 (%)'."""
    good = cells[~cells["status"].isin(BAD_STATUSES)]
    rows = []
    for m, key in METRICS.items():
        col = f"metrics.{key}"
        if col not in good:
            continue
        v = good[col].astype(float) * scale
        ok = np.isfinite(v)
        if ok.any():
            sub = good.loc[ok, ["loss", "label", *extra]].copy()
            sub["metric"] = METRIC_LABELS[m]
            sub["top-1 (%)"] = v[ok].to_numpy()
            rows.append(sub)
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def fraction_done(runs: pd.DataFrame) -> pd.Series:
    """Share of the planned training a run's last logged step reached: last ``epoch`` / ``epochs``.

    1.0 where either is missing, so a history's x axis is then step / last step.
    """
    ep = runs.get("metrics.epoch", pd.Series(math.nan, index=runs.index)).astype(float)
    total = pd.to_numeric(runs.get("params.epochs", pd.Series(math.nan, index=runs.index)), errors="coerce")
    frac = (ep / total).where(np.isfinite(ep / total) & (total > 0), 1.0)
    return frac.clip(lower=1e-9, upper=1.0)


def history(cells: pd.DataFrame, key: str, ctx, cols: Sequence[str]) -> pd.DataFrame:
    """Finite values of metric ``key`` over training joined with run columns ``cols``;
    ``progress`` = step / last step x :func:`fraction_done` (the fraction of planned training)."""
    h = ctx.histories(cells["run_id"], key)
    if len(h):
        h = h.assign(value=h["value"].astype(float))
        h = h[np.isfinite(h["value"])]
    if h.empty:
        return pd.DataFrame(columns=["run_id", "step", "value", "progress", *cols])
    meta = cells.set_index("run_id")[list(cols)].assign(_done=fraction_done(cells).to_numpy())
    h = h.join(meta, on="run_id")
    mx = h.groupby("run_id")["step"].transform("max").replace(0, 1)
    h["progress"] = h["step"] / mx * h["_done"]
    return h.drop(columns="_done").reset_index(drop=True)


def binned(h: pd.DataFrame, group: Sequence[str]) -> pd.DataFrame:
    """Mean of each run's values in :data:`HISTORY_BINS` equal bins of ``progress`` (bin centres)."""
    b = np.minimum((h["progress"].astype(float) * HISTORY_BINS).astype(int), HISTORY_BINS - 1)
    h = h.assign(progress=(b + 0.5) / HISTORY_BINS)
    return h.groupby(["run_id", *group, "progress"], as_index=False, dropna=False)["value"].mean()


def batch_order(h: pd.DataFrame) -> list[str]:
    """Batch sizes of ``h`` as sorted strings (a categorical hue)."""
    return [str(b) for b in sorted(h["batch_size"].astype(int).unique())]
