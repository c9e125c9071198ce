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


#: one colour per loss in every figure of the report (Okabe–Ito, colour-blind safe), keyed by registry name
LOSS_COLORS = {
    "infonce": "#0072B2",
    "flatnce": "#D55E00",
    "dcl": "#009E73",
    "dclw": "#CC79A7",
    "eqco": "#E69F00",
    "sogclr": "#56B4E9",
}
#: colours for hues that are not losses (precision, budget, schedule), and for a loss not in LOSS_COLORS
OTHER_COLORS = ("#000000", "#999999", "#882255", "#44AA99", "#117733", "#AA4499", "#DDCC77", "#332288")
#: the baselines' reference lines: (line style, grey level)
BASELINE_STYLE = {"raw_pixels": ("--", "#555555"), "random_init": (":", "#555555"), "supervised": ("-.", "#555555")}


def _shade(color: str, k: int) -> tuple:
    """The k-th variant of a loss's colour: the colour itself, then darker and lighter by turns."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(color)
    if k == 0:
        return rgb
    f = 0.35 * ((k + 1) // 2) / max(1, (k + 1) // 2 + 1)
    target = (0.0, 0.0, 0.0) if k % 2 else (1.0, 1.0, 1.0)
    return tuple(c + (t - c) * min(f * 1.6, 0.6) for c, t in zip(rgb, target))


def loss_palette(frame: pd.DataFrame) -> dict:
    """{label: colour} for a frame's (loss, label) pairs: each label its loss's colour (:data:`LOSS_COLORS`),
    a loss's further variants (another epochs or σ) in shades of it; the same label gets the same colour in
    every figure."""
    pairs = frame[["loss", "label"]].drop_duplicates()
    out, seen = {}, {}
    for loss, lab in sorted(zip(pairs["loss"], pairs["label"]), key=lambda p: (str(p[0]), str(p[1]))):
        k = seen.get(loss, 0)
        seen[loss] = k + 1
        base = LOSS_COLORS.get(str(loss), OTHER_COLORS[len(seen) % len(OTHER_COLORS)])
        out[lab] = _shade(base, k)
    return out


def palette(labels: Sequence[str]) -> dict:
    """{value: colour} for a hue that is not a loss (:data:`OTHER_COLORS` in order)."""
    return {lab: OTHER_COLORS[i % len(OTHER_COLORS)] for i, lab in enumerate(labels)}


def mark_bad(ax, xs: Iterable[float], color) -> None:
    """▽ on the x axis where every seed of a cell had a bad status."""
    xs = list(xs)
    if xs:
        y0 = ax.get_ylim()[0]
        ax.scatter(
            xs,
            [y0] * len(xs),
            marker="v",
            s=80,
            facecolors="none",
            edgecolors=[color],
            linewidths=1.5,
            clip_on=False,
            zorder=5,
        )


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


# --------------------------------------------------------------------------- seeds, means, intervals, baselines
def seed_summary(values: pd.Series) -> tuple[float, float, float]:
    """(mean, lower, upper) of a cell's seeds: the 95 % Student-t interval of the mean (NaN bounds for one seed)."""
    from .evidence import t_interval

    v = values.astype(float).to_numpy()
    v = v[np.isfinite(v)]
    if not len(v):
        return math.nan, math.nan, math.nan
    m = float(v.mean())
    if len(v) < 2:
        return m, math.nan, math.nan
    lo, hi = t_interval(m, float(v.std(ddof=1)) / math.sqrt(len(v)), len(v) - 1)
    return m, lo, hi


def draw_seeds(ax, d: pd.DataFrame, x: str, y: str, labels: Sequence[str], pal: dict, log2: bool = True) -> list:
    """Per label: every seed as a small point beside its x, the mean as a line with markers and its 95 %
    interval as bars; labels are dodged apart on the (log) x axis so their seeds do not overlap.
    Returns the values drawn (seeds and interval ends) for the y range."""
    drawn, n = [], max(len(labels), 1)
    for i, lab in enumerate(labels):
        g = d[d["label"] == lab]
        if g.empty:
            continue
        off = (i - (n - 1) / 2) * 0.06
        rows = []
        for xv, gx in g.groupby(x, sort=True):
            m, lo, hi = seed_summary(gx[y])
            xs = float(xv) * 2**off if log2 else float(xv) + 2 * off
            rows.append((xs, m, lo, hi))
            ax.scatter(
                [xs * 2**0.025 if log2 else xs + 0.05] * len(gx),
                gx[y],
                s=9,
                color=pal[lab],
                alpha=0.5,
                linewidths=0,
                zorder=2,
            )
            drawn += list(gx[y].astype(float)) + [v for v in (lo, hi) if np.isfinite(v)]
        xs, ms, los, his = (np.array(c, dtype=float) for c in zip(*rows))
        ax.plot(xs, ms, "-o", color=pal[lab], ms=4, lw=1.4, label=lab, zorder=3)
        ok = np.isfinite(los)
        if ok.any():
            ax.errorbar(
                xs[ok],
                ms[ok],
                yerr=[ms[ok] - los[ok], his[ok] - ms[ok]],
                fmt="none",
                ecolor=pal[lab],
                elinewidth=1.2,
                capsize=2.5,
                zorder=3,
            )
    return drawn


def y_range(values: Sequence[float], min_span: float = 2.0) -> tuple[float, float]:
    """Limits that hold every drawn value with a margin, at least ``min_span`` wide: a difference is shown against
    the seeds' spread, never blown up by a tight zoom."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if not len(v):
        return 0.0, 1.0
    lo, hi = float(v.min()), float(v.max())
    pad = max(0.08 * (hi - lo), 0.25)
    lo, hi = lo - pad, hi + pad
    if hi - lo < min_span:
        c = (hi + lo) / 2
        lo, hi = c - min_span / 2, c + min_span / 2
    return lo, hi


def baseline_lines(ax, base: dict[str, float]) -> None:
    """A horizontal reference line per baseline inside the y range, labelled at the right; one outside the
    range is named at the edge it lies beyond (with its value), so the range stays on the effect."""
    lo, hi = ax.get_ylim()
    above, below = [], []
    for name, v in sorted(base.items()):
        if not np.isfinite(v):
            continue
        ls, col = BASELINE_STYLE.get(name, ("--", "#555555"))
        if lo <= v <= hi:
            ax.axhline(v, ls=ls, lw=1.0, color=col, zorder=1)
            ax.annotate(
                f"{name.replace('_', ' ')} {v:.1f}",
                (1.0, v),
                xycoords=("axes fraction", "data"),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color=col,
            )
        else:
            (above if v > hi else below).append(f"{name.replace('_', ' ')} {v:.1f}")
    for items, y, va, arrow in ((above, 0.99, "top", "↑"), (below, 0.01, "bottom", "↓")):
        if items:
            ax.text(
                0.99,
                y,
                f"{arrow} " + ", ".join(items),
                transform=ax.transAxes,
                va=va,
                ha="right",
                fontsize=7,
                color="#555555",
            )


def shared_legend(fig, axes, title: str) -> None:
    """One legend for all panels, right of the figure: each label once, in the order first drawn."""
    seen: dict = {}
    for ax in axes.flat:
        for handle, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, handle)
    fig.legend(
        list(seen.values()),
        list(seen),
        title=title,
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        frameon=False,
        fontsize=8,
        title_fontsize=9,
    )
