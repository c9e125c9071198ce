"""The main grid's figures, one dataset at a time: accuracy vs batch size, and the training
diagnostics (InfoNCE's MI-bound saturation, DCL's q_B, the softmax weights' ESS)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ...data.registry import display_name as dataset_name
from ...losses.registry import display_name
from ...tracking import BAD_STATUSES
from ..aggregate import label_order
from ..context import ReportContext
from ..figures import (
    PAPER_RC,
    SEEDS_MEANING,
    accuracy_long,
    baseline_lines,
    batch_order,
    binned,
    bottom_legend,
    draw_seeds,
    history,
    loss_palette,
    mark_bad,
    paper_figure,
    plot_style,
    seed_handles,
    y_range,
)
from ..fmt import short, slug
from ..runs import METRIC_LABELS, METRICS, optimiser_steps
from .baselines import baseline_table

#: the losses each diagnostic figure draws (the DCL paper's Figure 1 is about SimCLR/InfoNCE's q_B)
MI_LOSSES = ("infonce",)
QB_LOSSES = ("infonce",)
ESS_LOSSES = ("infonce", "flatnce")
Figure = tuple[list[Path], str]


def _baselines(ctx: ReportContext, ds: str) -> dict[str, dict[str, float]]:
    """{metric label: {baseline: mean top-1}} of a dataset's baselines in the store (raw pixels, random-init,
    supervised where present)."""
    t = baseline_table(ctx.runs, ctx.scale)
    t = t[(t["dataset"] == ds) & np.isfinite(t["mean"].astype(float))]
    return {METRIC_LABELS.get(m, m): dict(zip(g["baseline"], g["mean"].astype(float))) for m, g in t.groupby("metric")}


def _log2_axis(ax, ticks: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([f"{t:,}" if t < 10_000 else f"{t / 1000:.0f}k" for t in ticks])
    ax.minorticks_off()


def _steps_axis(ax, steps: dict[int, float]) -> None:
    """The optimiser steps each batch size took, on a second x axis at the top (at a fixed number of
    epochs the batch axis is also a steps axis)."""
    top = ax.secondary_xaxis("top")
    top.set_xticks(list(steps), labels=[f"{int(v):,}" for v in steps.values()])
    top.tick_params(axis="x", which="minor", top=False, labeltop=False)
    top.set_xlabel("optimiser steps")


def _batch_steps(cells: pd.DataFrame) -> dict[int, float]:
    """{batch size: optimiser steps} when every run of a batch size took the same number (else {})."""
    steps = optimiser_steps(cells)
    per = pd.DataFrame({"b": cells["batch_size"].astype(int), "s": steps}).dropna().groupby("b")["s"]
    if per.ngroups == 0 or (per.nunique() > 1).any() or per.ngroups < cells["batch_size"].nunique():
        return {}
    return {int(b): float(v) for b, v in per.first().items()}


def _common_span(limits: list[tuple[float, float]], top: float = 100.0) -> list[tuple[float, float]]:
    """Every panel's limits widened about its centre to the widest span: a point looks the same size in each;
    a window past ``top`` (a top-1 of 100 %) slid down to end there, not at 100.5 %."""
    span = max(hi - lo for lo, hi in limits)
    centres = [min((lo + hi) / 2, top - span / 2) for lo, hi in limits]
    return [(c - span / 2, c + span / 2) for c in centres]


def accuracy_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    """Top-1 vs batch size per loss, one column per metric and one row per τ: each seed, the seeds' range and
    their mean; the baselines as reference lines named in the margin; the optimiser steps on the top axis
    where every batch size's runs took one number; ▽ where no seed gave a number.  Paper-sized: one column
    (3.3 in) for one panel, two (6.9 in) for more."""
    data = accuracy_long(cells, ctx.scale, ["batch_size", "temperature", "seed"])
    name = dataset_name(ds)
    if data.empty:
        return [], f"_{name}: no kNN/linear top-1 logged yet; accuracy figure skipped._\n"
    plt, _, rc = plot_style()
    labels, pal = label_order(data), loss_palette(cells)
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    taus = sorted(cells["temperature"].unique())
    bss, base, steps = sorted(int(b) for b in cells["batch_size"].unique()), _baselines(ctx, ds), _batch_steps(cells)
    with plt.rc_context({**rc, **PAPER_RC}):
        fig, axes = paper_figure(plt, len(taus), len(metrics))
        limits = []
        for i, t in enumerate(taus):
            for j, m in enumerate(metrics):
                ax = axes[i][j]
                d = data[(data["metric"] == m) & (data["temperature"] == t)]
                limits.append(y_range(draw_seeds(ax, d, "batch_size", "top-1 (%)", labels, pal), min_span=1.5))
                _log2_axis(ax, bss)
                ax.set_xlim(bss[0] / 1.5, bss[-1] * 1.5)
                ax.set_title(f"{m}" + (f", τ = {short(t)}" if len(taus) > 1 else ""))
                ax.set_xlabel("batch size" if i == len(taus) - 1 else "")
                ax.set_ylabel("top-1 (%)" if j == 0 else "")
                if i == 0 and steps:
                    _steps_axis(ax, steps)
        for ax, lim, (t, m) in zip(axes.flat, _common_span(limits), [(t, m) for t in taus for m in metrics]):
            ax.set_ylim(*lim)
            for _, r in agg[
                agg["state"].isin(BAD_STATUSES) & (agg["temperature"] == t) & (agg["metric"].map(METRIC_LABELS) == m)
            ].iterrows():
                mark_bad(ax, [int(r["batch_size"])], pal.get(r["label"], "k"))
        bottom_legend(fig, axes, seed_handles())
        fig.suptitle(f"{name}: top-1 against batch size" + (f" (τ = {short(taus[0])})" if len(taus) == 1 else ""))
        for ax, m in zip(axes.flat, [m for _ in taus for m in metrics]):
            baseline_lines(ax, base.get(m, {}))
        files = ctx.save_figure(fig, f"accuracy_vs_batch_{slug(ds)}", exact=True)
    return files, f"**{name}: accuracy against batch size** ({_caption(cells, agg, steps)})\n\n" + ctx.figure_md(
        files, f"{name} accuracy vs batch size"
    )


def _caption(cells: pd.DataFrame, agg: pd.DataFrame, steps: dict[int, float]) -> str:
    n = cells.groupby(["label", "batch_size", "temperature"])["seed"].nunique()
    seeds = f"{int(n.min())}" if n.min() == n.max() else f"{int(n.min())}–{int(n.max())}"
    why = "with two seeds a 95 % t interval is 12.7 times half their difference; " if n.max() == 2 else ""
    parts = [
        f"{seeds} seeds per cell; {SEEDS_MEANING}; no interval is drawn ({why}the findings state each change "
        "with its test)",
        "grey lines: the baselines, named at the right; ↑/↓: a baseline above/below the range shown",
    ]
    if steps:
        b0, b1 = min(steps), max(steps)
        parts.append(
            f"top axis: the optimiser steps each batch size took (batch {b0} took {steps[b0] / steps[b1]:.1f}× "
            f"those of batch {b1})"
        )
    if agg["state"].isin(BAD_STATUSES).any():
        parts.append("▽ on the x axis: no seed gave a number")
    return "; ".join(parts)


#: the monitor's held-out kNN top-1 (:mod:`smallbatch.evaluation.monitor`), logged at the optimiser step
MONITOR_KEY = "monitor/knn_top1"


def learning_curve_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    """The kNN monitor's top-1 against images seen, one panel per loss and one colour per batch size (each
    seed thin, their mean with markers): at equal images seen a smaller batch has taken more optimiser
    steps, so this separates what the images give from what the steps give.  Drawn where runs log the
    monitor (``eval.monitor_every``); at the most common τ."""
    name = dataset_name(ds)
    h = history(cells, MONITOR_KEY, ctx, ["label", "loss", "batch_size", "temperature", "seed"])
    if h.empty:
        return [], (
            f"_{name}: no run logged the kNN monitor (`{MONITOR_KEY}`, switched on by `eval.monitor_every`); "
            "the figure of accuracy against images seen is skipped._\n"
        )
    t = h["temperature"].value_counts().sort_index().idxmax()
    h = h[h["temperature"] == t].assign(images=lambda f: f["step"].astype(float) * f["batch_size"].astype(float))
    labels, border = label_order(h), batch_order(h)
    plt, sns, rc = plot_style()
    pal = dict(zip(border, sns.color_palette("viridis", len(border))))
    ncol = min(len(labels), 3)
    with plt.rc_context({**rc, **PAPER_RC}):
        fig, axes = paper_figure(plt, -(-len(labels) // ncol), ncol, row_height=1.9)
        for ax in axes.flat[len(labels) :]:
            ax.set_visible(False)
        for ax, lab in zip(axes.flat, labels):
            g = h[h["label"] == lab]
            for b in border:
                gb = g[g["batch_size"].astype(int).astype(str) == b]
                for _, run in gb.groupby("run_id"):
                    ax.plot(run["images"] / 1000, run["value"], color=pal[b], lw=0.6, alpha=0.45)
                mean = gb.groupby("images")["value"].mean()
                ax.plot(mean.index / 1000, mean.to_numpy(), "-o", color=pal[b], lw=1.4, ms=3, label=f"B = {b}")
            ax.set_title(lab)
            ax.set_xlabel("images seen (thousands)")
            ax.set_ylabel("monitor kNN top-1 (%)" if ax in axes[:, 0] else "")
        bottom_legend(fig, axes, ncol=len(border))
        fig.suptitle(f"{name}: held-out kNN top-1 during training (τ = {short(t)})")
        files = ctx.save_figure(fig, f"accuracy_vs_images_{slug(ds)}", exact=True)
    return files, (
        f"**{name}: accuracy against images seen** (τ = {short(t)}; the kNN monitor's top-1 on held-out training "
        "images, never the test split; thin: each seed, markers: their mean; at equal images seen batch B has "
        "taken 1/B of the optimiser steps per image)\n\n" + ctx.figure_md(files, f"{name} accuracy vs images seen")
    )


def _diagnostic(cells: pd.DataFrame, key: str, ctx: ReportContext, losses: Sequence[str]) -> pd.DataFrame:
    """History of ``key`` for the runs of ``losses``, with τ and B as strings (facets and hues)."""
    h = history(cells[cells["loss"].isin(losses)], key, ctx, ["label", "loss", "batch_size", "temperature", "seed"])
    return h.assign(τ=h["temperature"].map(short), B=h["batch_size"].astype(int).astype(str)) if len(h) else h


def _missing(ds: str, what: str, key: str, losses: Sequence[str]) -> Figure:
    names = ", ".join(display_name(x) for x in losses)
    return [], f"_{dataset_name(ds)}: no `{key}` history for {names} runs; {what} figure skipped._\n"


def _tau_order(h: pd.DataFrame) -> list[str]:
    return [short(t) for t in sorted(h["τ"].astype(float).unique())]


def _over_training(sns, h: pd.DataFrame, ylabel: str, **kw):
    """A value over training (binned per run), one panel per loss label x τ: each seed's run a
    thin line, the mean over seeds a thick one, one colour per batch size."""
    hb = binned(h, ["label", "loss", "τ", "B", "batch_size"])
    border = batch_order(hb)
    pal = sns.color_palette("viridis", len(border))
    g = sns.relplot(
        data=hb,
        kind="line",
        x="progress",
        y="value",
        hue="B",
        hue_order=border,
        palette=pal,
        errorbar=None,
        lw=2,
        col="τ",
        col_order=_tau_order(hb),
        row="label",
        height=3.0,
        aspect=1.3,
        **kw,
    )
    g.map_dataframe(
        sns.lineplot,
        x="progress",
        y="value",
        hue="B",
        hue_order=border,
        palette=pal,
        units="run_id",
        estimator=None,
        lw=0.7,
        alpha=0.45,
        legend=False,
    )
    g.set_titles("{row_name} | τ = {col_name}")
    g.set_axis_labels("fraction of training (epoch / epochs)", ylabel)
    g.legend.set_title("batch size")
    return g, hb


def mi_fraction_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    key = "diag/mi_fraction"
    h = _diagnostic(cells, key, ctx, MI_LOSSES)
    if h.empty:
        return _missing(ds, "MI-saturation", key, MI_LOSSES)
    plt, sns, rc = plot_style()
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g, _ = _over_training(sns, h, "MI estimate / log(K+1)")
        for ax in g.axes.flat:
            ax.axhline(1.0, ls="--", lw=1, color="grey")
        g.figure.suptitle(f"{dataset_name(ds)}: InfoNCE's MI estimate as a fraction of its ceiling log(K+1)", y=1.02)
        files = ctx.save_figure(g.figure, f"mi_fraction_{slug(ds)}")
    return files, (
        f"**{dataset_name(ds)}: InfoNCE's MI bound saturation** (`{key}` over training, one colour per batch size; "
        "thin: each seed, thick: their mean)\n\n" + ctx.figure_md(files, f"{dataset_name(ds)} MI fraction")
    )


def qb_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    key = "diag/qb_mean"
    h = _diagnostic(cells, key, ctx, QB_LOSSES)
    h = h[h["progress"] >= 0.5] if not h.empty else h
    if h.empty:  # also: no value logged in the second half of training (a run of a few steps)
        return _missing(ds, "q_B", key, QB_LOSSES)
    plt, sns, rc = plot_style()
    border = batch_order(h)
    with plt.rc_context(rc), sns.axes_style("whitegrid"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # seaborn 0.13 passes boxplot(vert=) to mpl 3.11
        g = sns.catplot(
            data=h,
            kind="box",
            x="B",
            order=border,
            y="value",
            hue="B",
            hue_order=border,
            palette=sns.color_palette("viridis", len(border)),
            legend=False,
            col="τ",
            col_order=_tau_order(h),
            row="label",
            height=3.0,
            aspect=1.1,
            fliersize=2,
        )
        g.set_titles("{row_name} | τ = {col_name}")
        g.set_axis_labels("batch size", "q_B (mean over the batch)")
        g.figure.suptitle(
            f"{dataset_name(ds)}: distribution of q_B over the second half of training (DCL, Fig. 1)", y=1.02
        )
        files = ctx.save_figure(g.figure, f"qb_{slug(ds)}")
    return files, (
        f"**{dataset_name(ds)}: q_B per batch size** (`{key}` logged over the second half of training, all seeds; "
        "the negative-positive coupling DCL removes)\n\n" + ctx.figure_md(files, f"{dataset_name(ds)} q_B")
    )


def ess_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    key = "diag/ess"
    h = _diagnostic(cells, key, ctx, ESS_LOSSES)
    if h.empty:
        return _missing(ds, "ESS", key, ESS_LOSSES)
    plt, sns, rc = plot_style()
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g, hb = _over_training(sns, h, "ESS / K = 1 / (K Σ w²)", row_order=label_order(h), facet_kws={"sharey": True})
        v = hb["value"]
        if (v > 0).all() and v.max() / v.min() > 20:
            for ax in g.axes.flat:
                ax.set_yscale("log")
        g.figure.suptitle(
            f"{dataset_name(ds)}: normalised effective sample size of the softmax weights over negatives", y=1.02
        )
        files = ctx.save_figure(g.figure, f"ess_{slug(ds)}")
    return files, (
        f"**{dataset_name(ds)}: ESS over training** (`{key}`, "
        + ", ".join(display_name(x) for x in ESS_LOSSES)
        + ", one colour per batch size; thin: each seed, thick: their mean)\n\n"
        + ctx.figure_md(files, f"{dataset_name(ds)} ESS")
    )


FIGURES = (accuracy_figure, learning_curve_figure, mi_fraction_figure, qb_figure, ess_figure)
