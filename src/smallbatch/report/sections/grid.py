"""Section 'grid': the main grid, loss x batch size x temperature (x seeds, x extra axes).

Per dataset and metric four tables (top-1 by loss x batch size; by temperature x
batch size per loss; the batch-size dependence; the gain over the best
baseline), the findings read from them, and the grid's figures.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...data.registry import display_name as dataset_name
from ...losses.registry import loss_rank
from ..aggregate import NO_NUMBER, aggregate_cells, pivot, shown, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..fmt import signed, slug
from ..runs import metric_label, optimiser_steps, select_cells, shown_metrics
from ..tables import markdown_table
from .baselines import best_baseline_values, best_baselines
from .grid_figures import FIGURES
from .grid_findings import (
    HIDDEN,
    POOLED_NOTE,
    baseline_finding,
    batch_finding,
    budget,
    dependence,
    dependence_display,
    pooled_changes,
    pooled_display,
)

KEYS = ["dataset", "temperature", "loss", "label", "batch_size"]
_TIDY = [
    "dataset",
    "metric",
    "temperature",
    "loss",
    "label",
    "batch_size",
    "mean",
    "std",
    "n_seeds",
    "n_runs",
    "n_diverged",
    "n_collapsed",
    "n_failed",
    "state",
    "display",
    "best_baseline",
    "best_baseline_top1",
    "gain_vs_best_baseline",
]


def _by_batch(agg: pd.DataFrame, index: list[str], value: str = "display") -> pd.DataFrame:
    """One column per batch size (``B=16``), rows ``index``."""
    bss = sorted(agg["batch_size"].dropna().unique())
    return shown(pivot(agg, index, "batch_size", lambda b: f"B={int(b)}", value, columns=bss))


def _with_gain(agg: pd.DataFrame, best: dict) -> pd.DataFrame:
    agg = agg.copy()
    pick = [best.get((d, m), ("", math.nan)) for d, m in zip(agg["dataset"], agg["metric"])]
    agg["best_baseline"] = [b for b, _ in pick]
    agg["best_baseline_top1"] = [v for _, v in pick]
    agg["gain_vs_best_baseline"] = agg["mean"] - agg["best_baseline_top1"]
    return agg


def _best_temperature(a: pd.DataFrame) -> pd.DataFrame:
    """The cells with a ``disp2`` column that stars the best τ of each loss and batch size."""
    a2 = a.copy()
    a2["disp2"] = a2["display"]
    for _, g in a2.groupby(["label", "batch_size"]):
        g = g[np.isfinite(g["mean"])]
        if g["temperature"].nunique() > 1:
            i = g["mean"].idxmax()
            a2.loc[i, "disp2"] = a2.loc[i, "display"] + " *"
    return (
        a2.assign(_lr=a2["loss"].map(loss_rank))
        .sort_values(["_lr", "label", "temperature", "batch_size"], kind="stable")
        .drop(columns="_lr")
    )


def _metric_tables(
    a: pd.DataFrame, d: pd.DataFrame, best: dict, ds: str, m: str, ctx: ReportContext, seed_note: str, mlabel: str
) -> tuple[list, str]:
    """The four tables of one dataset and metric (``mlabel``: its label); (files, the index.md paragraph)."""
    tidy = [c for c in _TIDY if c in a.columns]
    f1 = ctx.write_table(
        f"grid_top1_{slug(ds)}_{m}",
        f"{ds}: {mlabel} (%) by loss × batch size",
        a[tidy],
        [(None, _by_batch(a, ["temperature", "label"]))],
        note=seed_note,
    )
    a2 = _best_temperature(a)
    f2 = ctx.write_table(
        f"grid_temperature_{slug(ds)}_{m}",
        f"{ds}: {mlabel} (%), temperature × batch size per loss",
        a2[tidy],
        [(None, _by_batch(a2, ["label", "temperature"], "disp2"))],
        note=seed_note + "; * = best temperature for this loss and batch size",
    )
    f3 = ctx.write_table(
        f"grid_dependence_{slug(ds)}_{m}",
        f"{ds}: {mlabel} batch-size dependence (points lost from each loss's best batch size)",
        d.drop(columns=[c for c in HIDDEN if c in d]),
        [(None, dependence_display(d))],
        note="drop@B = best mean top-1 over batch sizes minus mean top-1 at B; "
        "Δ = mean top-1 at the smallest minus at the largest batch size (small − large), "
        "its 95 % paired-t interval over seeds and its p Holm-adjusted over the losses "
        "of one τ",
    )
    f5 = []
    if np.isfinite(a["best_baseline_top1"]).any():
        a5 = a.assign(
            gain_disp=[
                st if st in NO_NUMBER else ("" if not np.isfinite(v) else signed(v))
                for v, st in zip(a["gain_vs_best_baseline"], a["state"])
            ]
        )
        bname, bval = best[(ds, m)]
        f5 = ctx.write_table(
            f"grid_gain_{slug(ds)}_{m}",
            f"{ds}: pretraining gain in {mlabel} over the best baseline ({bname}, {bval:.1f}%)",
            a[tidy],
            [(None, _by_batch(a5, ["temperature", "label"], "gain_disp"))],
            note="gain = cell mean top-1 minus the best baseline's mean top-1 (points)",
        )
    md = (
        f"**{mlabel}** — loss × batch size: {ctx.table_links(f1)}; temperature × batch size: "
        f"{ctx.table_links(f2)}; batch-size dependence: {ctx.table_links(f3)}"
        + (f"; gain over best baseline: {ctx.table_links(f5)}" if f5 else "")
        + "\n"
    )
    return f1 + f2 + f3 + f5, md


def _seed_note(agg: pd.DataFrame) -> str:
    """The tables' note: over how many seeds a cell's mean is -- those that gave a number
    (``n_seeds`` of the aggregate), not the runs (a failed run's seed does not enter)."""
    n_lo, n_hi = int(agg["n_seeds"].min()), int(agg["n_seeds"].max())
    n_seeds = f"{n_lo} seed{'s' if n_lo != 1 else ''}" if n_lo == n_hi else f"{n_lo}–{n_hi} seeds"
    return (
        f"mean ± sample std (ddof=1) over the seeds that gave a number ({n_seeds} per cell); "
        "'—' = one seed; diverged/failed runs give no number; 'pending' = not evaluated yet"
    )


def _pooled_table(pool: pd.DataFrame, ds: str, ctx: ReportContext) -> tuple[list, str]:
    """The dataset's pooled batch-size changes (one row per metric and τ); (files, the index.md paragraph)."""
    p = pool[pool["dataset"] == ds] if len(pool) else pool
    if p.empty:
        return [], ""
    shown_ = pooled_display(p)
    files = ctx.write_table(
        f"grid_pooled_{slug(ds)}",
        f"{dataset_name(ds)}: small − large batch pooled over the losses",
        p.drop(columns=[c for c in HIDDEN if c in p]),
        [(None, shown_)],
        note=POOLED_NOTE,
    )
    md = f"**Pooled over the losses** ({ctx.table_links(files)}): {POOLED_NOTE}.\n\n" + markdown_table(shown_)
    return files, md


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells = select_cells(runs, "grid", (), ctx.notes)
    out = SectionOutput("grid", "Main grid: loss × batch size × temperature", "")
    if cells.empty:
        out.markdown = "No grid cells (runs with kind 'cell' and experiment 'grid') in this experiment.\n"
        return out
    out.run_ids = set(cells["run_id"])
    metrics = shown_metrics(cells)  # the default probes' and any opt-in probe's the cells logged
    best = best_baselines(runs, ctx.scale)
    base_values = best_baseline_values(runs, ctx.scale)
    agg = _with_gain(
        sort_by_loss(
            aggregate_cells(cells, KEYS, ctx.scale, metrics, values=True),
            ["dataset", "metric", "temperature", "loss", "label", "batch_size"],
        ),
        best,
    )
    dep = dependence(agg, budget(cells, optimiser_steps(cells)))
    pool = pooled_changes(dep)
    seed_note = _seed_note(agg)
    md = [f"{len(cells)} runs, {len(agg) // max(len(metrics), 1)} cells. Top-1 in percent, {seed_note}.\n"]
    figs_md = []
    for ds in sorted(agg["dataset"].unique()):
        md.append(f"### {dataset_name(ds)}\n")
        a_ds = agg[agg["dataset"] == ds]
        out.findings += [batch_finding(dep, pool, ds, t) for t in sorted(a_ds["temperature"].unique())]
        for m in metrics:
            a = a_ds[a_ds["metric"] == m]
            if a.empty:
                continue
            d = dep[(dep["dataset"] == ds) & (dep["metric"] == m)]
            label = metric_label(cells[cells["dataset"] == ds], m)  # kNN's names its k
            files, text = _metric_tables(a, d, best, ds, m, ctx, _seed_note(a), label)
            out.files += files
            md += [text, markdown_table(dependence_display(d))]
            out.findings.append(baseline_finding(a, best, ds, m, base_values.get((ds, m))))
        files, text = _pooled_table(pool, ds, ctx)
        out.files += files
        md += [text] if text else []
        for fig in FIGURES:
            files, text = fig(cells[cells["dataset"] == ds], agg[agg["dataset"] == ds], ds, ctx)
            out.files += files
            figs_md.append(text)
    out.markdown = "\n".join(md + ["### Figures\n"] + figs_md)
    return out
