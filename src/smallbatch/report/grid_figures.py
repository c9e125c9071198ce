"""The main grid's figures, one dataset at a time: accuracy vs batch size, and the training
diagnostics (InfoNCE's MI-bound saturation, DCL's q_B, the softmax weights' ESS)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import pandas as pd

from ..losses import display_name
from ..tracking import BAD_STATUSES
from .aggregate import label_order
from .context import ReportContext
from .figures import accuracy_long, batch_order, binned, history, mark_bad, palette, plot_style
from .fmt import short, slug
from .runs import METRIC_LABELS, METRICS

#: the losses each diagnostic figure draws (the DCL paper's Figure 1 is about SimCLR/InfoNCE's q_B)
MI_LOSSES = ("infonce",)
QB_LOSSES = ("infonce",)
ESS_LOSSES = ("infonce", "flatnce")
Figure = tuple[list[Path], str]


def accuracy_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    """Top-1 vs batch size per loss; one column per τ, one row per metric; ▽ where all seeds failed."""
    data = accuracy_long(cells, ctx.scale, ["batch_size", "temperature"])
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged yet; accuracy figure skipped._\n"
    data = data.assign(**{"batch size": data["batch_size"].astype(int), "τ": data["temperature"].map(short)})
    plt, sns, rc = plot_style()
    labels = label_order(data)
    pal = palette(labels)
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    bss = sorted(int(b) for b in cells["batch_size"].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=data, kind="line", x="batch size", y="top-1 (%)", hue="label", hue_order=labels,
                        style="label", style_order=labels, markers=True, dashes=False, palette=pal,
                        errorbar="sd", err_style="bars", col="τ",
                        col_order=[short(t) for t in sorted(cells["temperature"].unique())], row="metric",
                        row_order=metrics, height=3.0, aspect=1.25, facet_kws={"sharey": "row", "margin_titles": True})
        for ax in g.axes.flat:
            ax.set_xscale("log", base=2)
            ax.set_xticks(bss)
            ax.set_xticklabels([str(b) for b in bss])
            ax.minorticks_off()
        for _, r in agg[agg["state"].isin(BAD_STATUSES)].iterrows():
            ax = g.axes_dict.get((METRIC_LABELS.get(r["metric"]), short(r["temperature"])))
            if ax is not None:
                mark_bad(ax, [int(r["batch_size"])], pal.get(r["label"], "k"))
        g.set_titles(row_template="{row_name}", col_template="τ = {col_name}")
        g.legend.set_title("loss")
        g.figure.suptitle(f"{ds}: top-1 vs batch size (mean ± sd over seeds; ▽ on the x axis = "
                          "no seed gave a number: diverged, collapsed or failed)", y=1.02)
        files = ctx.save_figure(g.figure, f"accuracy_vs_batch_{slug(ds)}")
    return files, f"**{ds}: accuracy vs batch size**\n\n" + ctx.figure_md(files, f"{ds} accuracy vs batch size")


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
    """A value over training (binned per run), one line per batch size, one panel per loss label x τ."""
    hb = binned(h, ["label", "loss", "τ", "B", "batch_size"])
    border = batch_order(hb)
    g = sns.relplot(data=hb, kind="line", x="progress", y="value", hue="B", hue_order=border,
                    palette=sns.color_palette("viridis", len(border)), errorbar="sd", col="τ",
                    col_order=_tau_order(hb), row="label", height=3.0, aspect=1.3, **kw)
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
    return files, (f"**{ds}: InfoNCE's MI bound saturation** (`{key}` over training, one line per batch size, "
                   "mean ± sd over seeds)\n\n" + ctx.figure_md(files, f"{ds} MI fraction"))


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
        g = sns.catplot(data=h, kind="box", x="B", order=border, y="value", hue="B", hue_order=border,
                        palette=sns.color_palette("viridis", len(border)), legend=False,
                        col="τ", col_order=_tau_order(h), row="label", height=3.0, aspect=1.1, fliersize=2)
        g.set_titles("{row_name} | τ = {col_name}")
        g.set_axis_labels("batch size", "q_B (mean over the batch)")
        g.figure.suptitle(f"{ds}: distribution of q_B over the second half of training (DCL, Fig. 1)", y=1.02)
        files = ctx.save_figure(g.figure, f"qb_{slug(ds)}")
    return files, (f"**{ds}: q_B per batch size** (`{key}` logged over the second half of training, all seeds; "
                   "the negative-positive coupling DCL removes)\n\n" + ctx.figure_md(files, f"{ds} q_B"))


def ess_figure(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> Figure:
    key = "diag/ess"
    h = _diagnostic(cells, key, ctx, ESS_LOSSES)
    if h.empty:
        return _missing(ds, "ESS", key, ESS_LOSSES)
    plt, sns, rc = plot_style()
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g, hb = _over_training(sns, h, "ESS / K = 1 / (K Σ w²)", row_order=label_order(h),
                               facet_kws={"sharey": True})
        v = hb["value"]
        if (v > 0).all() and v.max() / v.min() > 20:
            for ax in g.axes.flat:
                ax.set_yscale("log")
        g.figure.suptitle(f"{ds}: normalised effective sample size of the softmax weights over negatives", y=1.02)
        files = ctx.save_figure(g.figure, f"ess_{slug(ds)}")
    return files, (f"**{ds}: ESS over training** (`{key}`, " + ", ".join(display_name(x) for x in ESS_LOSSES)
                   + ", one line per batch size)\n\n" + ctx.figure_md(files, f"{ds} ESS"))


FIGURES = (accuracy_figure, mi_fraction_figure, qb_figure, ess_figure)
