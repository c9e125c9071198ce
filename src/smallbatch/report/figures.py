"""The figure style and the data shapes every figure starts from (top-1 per run, binned histories)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

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


#: a paper's column widths (inches): one column, and the two columns of a two-column page
PAPER_WIDTHS = {1: 3.3, 2: 6.9}
#: the smallest font of a paper figure (points)
MIN_FONT_PT = 8.0
#: rc of a paper figure: every text at least :data:`MIN_FONT_PT`, a light grid, no top/right spines
PAPER_RC = {
    "font.size": MIN_FONT_PT,
    "axes.titlesize": 9.0,
    "axes.labelsize": MIN_FONT_PT,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 10.0,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
#: what the seeds' marks mean, for every caption that draws them with :func:`draw_seeds`
SEEDS_MEANING = "dots: the seeds; bar: their range (lowest to highest); open marker on the line: their mean"


def paper_figure(plt, nrow: int, ncol: int, row_height: float = 2.2, extra_height: float = 0.8):
    """A figure one paper column wide (one panel per row) or two (several), laid out by matplotlib's
    constrained layout so that nothing is cut and no canvas is left empty; save it at its own size
    (``ReportContext.save_figure(..., exact=True)``)."""
    width = PAPER_WIDTHS[1 if ncol == 1 else 2]
    return plt.subplots(
        nrow,
        ncol,
        figsize=(width, row_height * nrow + extra_height),
        squeeze=False,
        sharex="col",
        layout="constrained",
    )


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
    out: dict = {}
    seen: dict = {}
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
def seed_range(values: pd.Series) -> tuple[float, float, float]:
    """(mean, lowest, highest) of a cell's finite seed values; NaN for none."""
    v = values.astype(float).to_numpy()
    v = v[np.isfinite(v)]
    if not len(v):
        return math.nan, math.nan, math.nan
    return float(v.mean()), float(v.min()), float(v.max())


def draw_seeds(ax, d: pd.DataFrame, x: str, y: str, labels: Sequence[str], pal: dict, log2: bool = True) -> list:
    """Per label: every seed as a dot, their range (lowest to highest) as a bar, their mean as an open
    marker on a line (:data:`SEEDS_MEANING`), the seeds drawn over it; labels are dodged apart on the (log) x axis so that their
    seeds do not overlap.  No interval is drawn: with two seeds a 95 % t interval is 12.7 times the
    seeds' half-difference, wider than any effect it would show.  Returns the values drawn."""
    drawn, n = [], max(len(labels), 1)
    for i, lab in enumerate(labels):
        g = d[d["label"] == lab]
        off = (i - (n - 1) / 2) * 0.1
        rows = []
        for xv, gx in g.groupby(x, sort=True):
            m, lo, hi = seed_range(gx[y])
            if not np.isfinite(m):
                continue
            xs = float(xv) * 2**off if log2 else float(xv) + 2 * off
            rows.append((xs, m))
            v = gx[y].astype(float)
            ax.vlines(xs, lo, hi, color=pal[lab], lw=1.0, zorder=2)
            ax.scatter([xs] * len(v), v, s=9, color=pal[lab], linewidths=0, zorder=5)  # over the mean's marker
            drawn += [float(t) for t in v if np.isfinite(t)]
        if rows:
            ax.plot(*zip(*rows), "-o", color=pal[lab], ms=4.5, mfc="white", mew=1.1, lw=1.2, label=lab, zorder=4)
    return drawn


def seed_handles() -> list:
    """Legend entries for :func:`draw_seeds`' marks: one seed, the seeds' range, their mean."""
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color="grey", marker="o", ls="", ms=3.5, mew=0, label="one seed"),
        Line2D([], [], color="grey", marker="|", ls="", ms=9, mew=1.0, label="range of the seeds"),
        Line2D([], [], color="grey", marker="o", ls="", ms=4.5, mfc="white", mew=1.1, label="their mean"),
    ]


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


def spread_labels(targets: Sequence[float], sizes: Sequence[float], lo: float, hi: float, gap: float) -> list[float]:
    """Centres for labels of heights ``sizes`` wanted at ``targets`` (ascending, one axis) such that no two
    overlap (``gap`` between them) and all lie within [lo, hi] where they fit: labels that would collide are
    stacked as a block centred, in the least-squares sense, on their targets (pool adjacent violators)."""
    blocks: list[list] = []  # [first, last, bottom]

    def offsets(i: int, j: int) -> list[float]:
        out, acc = [], 0.0
        for k in range(i, j + 1):
            out.append(acc + sizes[k] / 2)
            acc += sizes[k] + gap
        return out

    def place(i: int, j: int) -> float:
        off = offsets(i, j)
        bottom = sum(targets[k] - o for k, o in zip(range(i, j + 1), off)) / len(off)
        total = off[-1] + sizes[j] / 2
        return max(lo, min(bottom, hi - total)) if hi - lo >= total else lo

    for i in range(len(targets)):
        blocks.append([i, i, place(i, i)])
        while len(blocks) > 1:
            a, b = blocks[-2], blocks[-1]
            top_a = a[2] + offsets(a[0], a[1])[-1] + sizes[a[1]] / 2
            if top_a + gap <= b[2] + 1e-9:
                break
            blocks[-2:] = [[a[0], b[1], place(a[0], b[1])]]
    centres = []
    for i, j, bottom in blocks:
        centres += [bottom + o for o in offsets(i, j)]
    return centres


def margin_labels(ax, items: Sequence[tuple[float, str, str]], fontsize: float = MIN_FONT_PT) -> list:
    """Texts right of the axes at the heights (axes fraction) ``items`` = (y, text, colour) ask for, moved
    apart where they would overlap (:func:`spread_labels`, measured with the figure's renderer after the
    layout).  Returns the texts."""
    fig = ax.figure
    items = sorted(items, key=lambda it: it[0])
    texts = [
        ax.annotate(
            text,
            (1.0, y),
            xycoords="axes fraction",
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            ha="left",
            fontsize=fontsize,
            color=col,
            annotation_clip=False,
        )
        for y, text, col in items
    ]
    if texts:
        fig.draw_without_rendering()  # the layout, with the labels' widths: the axes' final height in pixels
        box, renderer = ax.get_window_extent(), fig.canvas.get_renderer()
        targets = [box.y0 + y * box.height for y, _, _ in items]
        sizes = [t.get_window_extent(renderer).height for t in texts]
        for t, want, got in zip(texts, targets, spread_labels(targets, sizes, box.y0, box.y1, 1.0 * fig.dpi / 72)):
            t.xyann = (4, (got - want) * 72 / fig.dpi)
    return texts


def baseline_lines(ax, base: dict[str, float]) -> list:
    """A horizontal reference line per baseline inside the y range; every baseline named right of the axes
    with its value, at its line or, when outside the range, at the edge it lies beyond (↑/↓), with labels
    moved apart so that none overlaps another (:func:`margin_labels`).  Returns the label texts."""
    lo, hi = ax.get_ylim()
    items = []
    for name, v in sorted(base.items()):
        if not np.isfinite(v):
            continue
        ls, col = BASELINE_STYLE.get(name, ("--", "#555555"))
        text = f"{name.replace('_', ' ')} {v:.1f}"
        if lo <= v <= hi:
            ax.axhline(v, ls=ls, lw=1.0, color=col, zorder=1)
            items.append(((v - lo) / (hi - lo), text, col))
        else:
            items.append((1.0 if v > hi else 0.0, ("↑ " if v > hi else "↓ ") + text, col))
    return margin_labels(ax, items)


def bottom_legend(fig, axes, extra: Sequence = (), ncol: int | None = None) -> None:
    """One legend for all panels below them (constrained layout): each label once, in the order first drawn,
    then ``extra`` handles (what the marks mean)."""
    seen: dict = {}
    for ax in axes.flat:
        for handle, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, handle)
    handles = [*seen.values(), *extra]
    fig.legend(
        handles,
        [*seen, *(h.get_label() for h in extra)],
        loc="outside lower center",
        ncol=ncol or min(len(handles), 5 if fig.get_figwidth() > PAPER_WIDTHS[1] + 0.1 else 2),
        frameon=False,
        handletextpad=0.4,
        columnspacing=1.2,
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
