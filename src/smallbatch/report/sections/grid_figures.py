"""The main grid's figures, one dataset at a time: accuracy vs batch size, and the training
diagnostics (InfoNCE's MI-bound saturation, DCL's q_B, the softmax weights' ESS)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ...losses.registry import display_name
from ...tracking import BAD_STATUSES
from ..aggregate import label_order
from ..context import ReportContext
from ..figures import (
    accuracy_long,
    baseline_lines,
    batch_order,
    binned,
    draw_seeds,
    history,
    loss_palette,
    mark_bad,
    plot_style,
    shared_legend,
    y_range,
)
from ..fmt import short, slug
from ..runs import METRIC_LABELS, METRICS, param_num
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


def _facets(plt, nrow: int, ncol: int, extra_w: float = 0.3):
    """A figure sized to its panels (3.2 × 2.6 in each) plus a legend column on the right."""
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol + extra_w, 2.6 * nrow + 0.5), squeeze=False, sharex="col")
    return fig, axes


def _log2_axis(ax, ticks: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([f"{t:,}" if t < 10_000 else f"{t / 1000:.0f}k" for t in ticks], fontsize=7)
    ax.minorticks_off()


def accuracy_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    """Top-1 vs batch size per loss: seeds as points beside each mean, the mean's 95 % t interval, the baselines
    as reference lines; one column per τ, one row per metric; ▽ where no seed gave a number."""
    data = accuracy_long(cells, ctx.scale, ["batch_size", "temperature", "seed"])
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged yet; accuracy figure skipped._\n"
    plt, sns, rc = plot_style()
    labels, pal = label_order(data), loss_palette(cells)
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    taus = sorted(cells["temperature"].unique())
    bss, base = sorted(int(b) for b in cells["batch_size"].unique()), _baselines(ctx, ds)
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = _facets(plt, len(metrics), len(taus))
        for i, m in enumerate(metrics):
            drawn_row = []
            for j, t in enumerate(taus):
                ax = axes[i][j]
                d = data[(data["metric"] == m) & (data["temperature"] == t)]
                drawn_row += draw_seeds(ax, d, "batch_size", "top-1 (%)", labels, pal)
                _log2_axis(ax, bss)
                ax.set_xlim(bss[0] / 1.4, bss[-1] * 1.4)
                ax.set_title(f"{m}, τ = {short(t)}", fontsize=9)
                ax.set_xlabel("batch size" if i == len(metrics) - 1 else "")
                ax.set_ylabel("top-1 (%)" if j == 0 else "")
            for j, t in enumerate(taus):
                ax = axes[i][j]
                ax.set_ylim(*y_range(drawn_row))
                baseline_lines(ax, base.get(m, {}))
                for _, r in agg[
                    agg["state"].isin(BAD_STATUSES)
                    & (agg["temperature"] == t)
                    & (agg["metric"].map(METRIC_LABELS) == m)
                ].iterrows():
                    mark_bad(ax, [int(r["batch_size"])], pal.get(r["label"], "k"))
        shared_legend(fig, axes, "loss")
        fig.suptitle(f"{ds}: top-1 vs batch size", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.97))
        files = ctx.save_figure(fig, f"accuracy_vs_batch_{slug(ds)}")
    bad = "; ▽ on the x axis: no seed gave a number" if agg["state"].isin(BAD_STATUSES).any() else ""
    return files, (
        f"**{ds}: accuracy vs batch size** (points: seeds; line: mean with its 95 % t interval; grey "
        f"lines: baselines, named at the edge when outside the range{bad})\n\n"
        + ctx.figure_md(files, f"{ds} accuracy vs batch size")
    )


def _budget(cells: pd.DataFrame) -> pd.DataFrame:
    """Each run's optimiser steps (``train/steps`` if logged, else epochs × ⌈images / B⌉) and images seen."""
    b = cells["batch_size"].astype(float)
    logged = cells.get("metrics.train/steps", pd.Series(np.nan, index=cells.index)).astype(float)
    ep, n = param_num(cells, "epochs"), param_num(cells, "pretrain_images")
    steps = logged.where(np.isfinite(logged), ep * np.ceil(n / b))
    return cells.assign(steps=steps, images=steps * b)


def steps_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    """Top-1 against optimiser steps (the batch axis's confound): at a fixed number of epochs every batch size
    sees the same images, and a small batch takes more steps for them."""
    cells = _budget(cells)
    cells = cells[np.isfinite(cells["steps"]) & (cells["steps"] > 0)]
    data = (
        accuracy_long(cells, ctx.scale, ["batch_size", "temperature", "seed", "steps", "images"])
        if len(cells)
        else pd.DataFrame()
    )
    if data.empty:
        return (
            [],
            f"_{ds}: no run logs its steps (train/steps, or epochs and pretrain_images); steps figure skipped._\n",
        )
    t = data["temperature"].value_counts().sort_index().idxmax()
    data = data[data["temperature"] == t]
    plt, sns, rc = plot_style()
    labels, pal = label_order(data), loss_palette(cells)
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    base = _baselines(ctx, ds)
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = _facets(plt, 1, len(metrics))
        for j, m in enumerate(metrics):
            ax, d = axes[0][j], data[data["metric"] == m]
            ax.set_ylim(*y_range(draw_seeds(ax, d, "steps", "top-1 (%)", labels, pal)))
            _log2_axis(ax, sorted({int(v) for v in d["steps"].unique()}))
            ax.tick_params(axis="x", labelrotation=45)
            baseline_lines(ax, base.get(m, {}))
            ax.set_title(m, fontsize=9)
            ax.set_xlabel("optimiser steps (log scale)")
            ax.set_ylabel("top-1 (%)" if j == 0 else "")
        shared_legend(fig, axes, "loss")
        fig.suptitle(f"{ds}: top-1 vs optimiser steps (τ = {short(t)})", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        files = ctx.save_figure(fig, f"accuracy_vs_steps_{slug(ds)}")
    seen = ", ".join(f"{lab} {int(v):,}" for lab, v in data.groupby("label", sort=False)["images"].median().items())
    return files, (
        f"**{ds}: accuracy vs optimiser steps** (τ = {short(t)}; the largest batch size takes the fewest "
        "steps; at a fixed number of epochs every batch size sees the same images — images seen per run: "
        f"{seen}; points: seeds, line: mean with its 95 % t interval)\n\n"
        + ctx.figure_md(files, f"{ds} accuracy vs steps")
    )


def _diagnostic(cells: pd.DataFrame, key: str, ctx: ReportContext, losses: Sequence[str]) -> pd.DataFrame:
    """History of ``key`` for the runs of ``losses``, with τ and B as strings (facets and hues)."""
    h = history(cells[cells["loss"].isin(losses)], key, ctx, ["label", "loss", "batch_size", "temperature", "seed"])
    return h.assign(τ=h["temperature"].map(short), B=h["batch_size"].astype(int).astype(str)) if len(h) else h


def _missing(ds: str, what: str, key: str, losses: Sequence[str]) -> Figure:
    names = ", ".join(display_name(x) for x in losses)
    return [], f"_{ds}: no `{key}` history for {names} runs; {what} figure skipped._\n"


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
        g.figure.suptitle(f"{ds}: InfoNCE's MI estimate as a fraction of its ceiling log(K+1)", y=1.02)
        files = ctx.save_figure(g.figure, f"mi_fraction_{slug(ds)}")
    return files, (
        f"**{ds}: InfoNCE's MI bound saturation** (`{key}` over training, one colour per batch size; "
        "thin: each seed, thick: their mean)\n\n" + ctx.figure_md(files, f"{ds} MI fraction")
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
        g.figure.suptitle(f"{ds}: distribution of q_B over the second half of training (DCL, Fig. 1)", y=1.02)
        files = ctx.save_figure(g.figure, f"qb_{slug(ds)}")
    return files, (
        f"**{ds}: q_B per batch size** (`{key}` logged over the second half of training, all seeds; "
        "the negative-positive coupling DCL removes)\n\n" + ctx.figure_md(files, f"{ds} q_B")
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
        g.figure.suptitle(f"{ds}: normalised effective sample size of the softmax weights over negatives", y=1.02)
        files = ctx.save_figure(g.figure, f"ess_{slug(ds)}")
    return files, (
        f"**{ds}: ESS over training** (`{key}`, "
        + ", ".join(display_name(x) for x in ESS_LOSSES)
        + ", one colour per batch size; thin: each seed, thick: their mean)\n\n"
        + ctx.figure_md(files, f"{ds} ESS")
    )


FIGURES = (accuracy_figure, steps_figure, mi_fraction_figure, qb_figure, ess_figure)
