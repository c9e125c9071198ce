"""Section 'precision': FlatNCE's floating-point hypothesis (Chen et al. 2021).

Top-1 per loss x batch x training precision, the FlatNCE − InfoNCE gap per
precision (does fp64 close most of InfoNCE's small-batch gap?), and the measured
gradient rounding error (``diag/grad_rel_err`` = fp32 vs fp64,
``diag/grad_rel_err_bf16``).  The findings are in :mod:`.precision_findings`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pandas as pd

from ..aggregate import aggregate_cells, label_order, pivot, shown, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..figures import (
    SEEDS_MEANING,
    accuracy_long,
    draw_seeds,
    history,
    loss_palette,
    plot_style,
    shared_legend,
    y_range,
)
from ..fmt import finite, runs_count, sci, short, signed, slug
from ..runs import METRIC_LABELS, METRICS, param, select_cells
from ..tables import markdown_table
from .precision_findings import gap_finding, gaps, grad_finding, grad_tau_finding, precision_order

GRAD_KEYS = {"fp32": "diag/grad_rel_err", "bf16": "diag/grad_rel_err_bf16"}
_CELL = ["dataset", "temperature", "loss", "label", "batch_size"]
_SEED_NOTE = (
    "mean ± sample std (ddof=1) over seeds; '—' = one seed; diverged/failed runs give no number; "
    "'pending' = not evaluated yet"
)


def _gap_blocks(gp: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for (ds, m), g in gp.groupby(["dataset", "metric"], sort=False):
        rows = []
        for (t, b), gb in g.groupby(["temperature", "batch_size"], sort=False):
            row: dict[str, Any] = {"τ": t, "B": int(b)}
            for p in precision_order(gb["precision"]):
                row[f"gap {p}"] = signed(gb[gb["precision"] == p]["gap_flatnce_minus_infonce"].iloc[0])
            r64 = gb[gb["precision"] == "fp64"]
            row["fp64 closes"] = (
                f"{100 * r64['closed_fraction_of_fp32_gap'].iloc[0]:.0f}%"
                if len(r64) and finite(r64["closed_fraction_of_fp32_gap"].iloc[0])
                else "—"
            )
            rows.append(row)
        blocks.append((f"{ds}, {METRIC_LABELS.get(m, m)}", pd.DataFrame(rows)))
    return blocks


def grad_errors(cells: pd.DataFrame, ctx: ReportContext) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-point histories with a 'dtype' column, summary per dataset × τ × loss × B × dtype)."""
    frames = [
        h.assign(dtype=dt)
        for dt, key in GRAD_KEYS.items()
        if len(h := history(cells, key, ctx, [*_CELL, "precision", "seed"]))
    ]
    if not frames:
        return pd.DataFrame(), pd.DataFrame()
    h = pd.concat(frames, ignore_index=True)
    keys = [*_CELL, "dtype"]
    summ = (
        h.groupby(keys, sort=False)
        .agg(
            mean=("value", "mean"),
            median=("value", "median"),
            p90=("value", lambda v: float(np.quantile(v, 0.9))),
            n_points=("value", "size"),
            n_runs=("run_id", "nunique"),
        )
        .reset_index()
    )
    summ["key"] = summ["dtype"].map(GRAD_KEYS)
    return h, sort_by_loss(summ, keys)


def _grad_wide(summ: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: mean, median, p90 and points of each dtype's error."""
    wide = []
    for key, g in summ.groupby(_CELL, sort=False):
        row = dict(zip(_CELL, key))
        for dt in GRAD_KEYS:
            r = g[g["dtype"] == dt]
            row.update(
                {
                    f"{dt}_{stat}": r[stat].iloc[0] if len(r) else math.nan
                    for stat in ("mean", "median", "p90", "n_points")
                }
            )
        row["n_runs"] = int(g["n_runs"].max())
        wide.append(row)
    return pd.DataFrame(wide)


def _grad_table(summ: pd.DataFrame, ctx: ReportContext, out: SectionOutput) -> list[str]:
    wide = _grad_wide(summ)
    blocks = [
        (
            str(ds),
            pd.DataFrame(
                {
                    "τ": g["temperature"],
                    "loss": g["label"],
                    "B": g["batch_size"].astype(int),
                    "fp32 mean": g["fp32_mean"].map(sci),
                    "fp32 median": g["fp32_median"].map(sci),
                    "bf16 mean": g["bf16_mean"].map(sci),
                    "bf16 median": g["bf16_median"].map(sci),
                    "points": g["fp32_n_points"].map(lambda v: "" if not finite(v) else str(int(v))),
                    "runs": g["n_runs"],
                }
            ).reset_index(drop=True),
        )
        for ds, g in wide.groupby("dataset", sort=False)
    ]
    files = ctx.write_table(
        "precision_grad_error",
        "Precision: relative rounding error of the loss gradient w.r.t. the embeddings",
        wide,
        blocks,
        note="||g_dtype − g_fp64|| / ||g_fp64|| on the training batches where it was logged "
        "(diag/grad_rel_err for fp32, diag/grad_rel_err_bf16 for bf16), pooled over seeds and "
        "the runs' training precisions",
    )
    out.files += files
    out.findings += [grad_finding(summ, ds, t) for (ds, t), _ in summ.groupby(["dataset", "temperature"], sort=False)]
    out.findings += [grad_tau_finding(summ, ds) for ds in dict.fromkeys(summ["dataset"])]
    return [f"Gradient rounding error (`diag/grad_rel_err`, `diag/grad_rel_err_bf16`): {ctx.table_links(files)}\n"] + [
        markdown_table(df) for _, df in blocks
    ]


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """FlatNCE's floating-point hypothesis: top-1 per loss × batch × precision, the gap, gradient error."""
    cells = select_cells(runs, "precision", ("precision",), ctx.notes)
    if cells.empty:
        return None
    cells["precision"] = param(cells, "precision").fillna("fp32").astype(str)
    out = SectionOutput(
        "precision",
        "Side experiment: floating-point precision (FlatNCE's hypothesis)",
        "",
        run_ids=set(cells["run_id"]),
    )
    agg = aggregate_cells(cells, [*_CELL, "precision"], ctx.scale, values=True)
    order = {p: i for i, p in enumerate(precision_order(agg["precision"]))}
    agg = sort_by_loss(
        agg.assign(_p=agg["precision"].map(order)),
        ["dataset", "metric", "temperature", "loss", "label", "batch_size", "_p"],
    ).drop(columns="_p")
    blocks = [
        (f"{ds}, {METRIC_LABELS.get(m, m)}", shown(pivot(g, ["temperature", "label", "batch_size"], "precision", str)))
        for (ds, m), g in agg.groupby(["dataset", "metric"], sort=False)
    ]
    f_top = ctx.write_table(
        "precision_top1", "Precision: top-1 (%) by loss × batch size × training precision", agg, blocks, note=_SEED_NOTE
    )
    gp = gaps(agg)
    gblocks = _gap_blocks(gp)
    f_gap = ctx.write_table(
        "precision_gap",
        "Precision: FlatNCE − InfoNCE top-1 gap (points) per precision and batch size",
        gp,
        gblocks or None,
        note="gap = FlatNCE mean − InfoNCE mean with its 95 % paired-t interval over seeds; "
        "'fp64 closes' = 1 − gap(fp64)/gap(fp32), defined where the fp32 gap is positive",
    )
    out.files += f_top + f_gap
    md = [
        f"{runs_count(len(cells))} (experiment 'precision'). Top-1 by precision: {ctx.table_links(f_top)}; "
        f"FlatNCE − InfoNCE gap: {ctx.table_links(f_gap)}\n"
    ]
    md += [x for sub, df in gblocks for x in (f"**Gap, {sub}**\n", markdown_table(df))] or [
        "_InfoNCE and FlatNCE were not both run at a common precision and batch size: no gap to show._\n"
    ]
    out.findings += [
        gap_finding(gp, agg, ds, m, t)
        for (ds, m, t), _ in agg.groupby(["dataset", "metric", "temperature"], sort=False)
    ]
    hist, summ = grad_errors(cells, ctx)
    md += (
        _grad_table(summ, ctx, out)
        if len(summ)
        else [
            "_No `diag/grad_rel_err` history logged (set `experiments.precision.train.grad_error_every` > 0); "
            "gradient-error table and figure skipped._\n"
        ]
    )
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        for files, text in [_top1_figure(cells[cells["dataset"] == ds], ds, ctx)] + (
            [_grad_figure(hist[hist["dataset"] == ds], ds, ctx)] if len(hist) else []
        ):
            out.files += files
            md.append(text)
    out.findings = [f for f in out.findings if f]
    out.markdown = "\n".join(md)
    return out


def _top1_figure(cells: pd.DataFrame, ds: str, ctx: ReportContext) -> tuple[list, str]:
    """Top-1 per training precision: every seed, the seeds' range and their mean; one panel per
    metric (row) and batch size (column)."""
    data = accuracy_long(cells, ctx.scale, ["batch_size", "temperature", "precision", "seed"])
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged for the precision runs yet; figure skipped._\n"
    plt, sns, rc = plot_style()
    multi_t = data["temperature"].nunique() > 1
    colours = loss_palette(data)
    data["series"] = [f"{lab}, τ={short(t)}" if multi_t else lab for lab, t in zip(data["label"], data["temperature"])]
    order = label_order(data)
    series = sorted(data["series"].unique(), key=lambda s: (order.index(s.split(", τ=")[0]), s))
    pal = {ser: colours[ser.split(", τ=")[0]] for ser in series}
    precs = precision_order(cells["precision"])
    data = data.assign(label=data["series"], x=data["precision"].map({p: i for i, p in enumerate(precs)}))
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    bss = [int(b) for b in sorted(cells["batch_size"].unique())]
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(metrics), len(bss), figsize=(3.0 * len(bss) + 0.3, 2.6 * len(metrics) + 0.5), squeeze=False
        )
        for i, m in enumerate(metrics):
            drawn = []
            for j, b in enumerate(bss):
                ax = axes[i][j]
                drawn += draw_seeds(
                    ax,
                    data[(data["metric"] == m) & (data["batch_size"] == b)],
                    "x",
                    "top-1 (%)",
                    series,
                    pal,
                    log2=False,
                )
                ax.set_xticks(range(len(precs)))
                ax.set_xticklabels(precs)
                ax.set_xlim(-0.5, len(precs) - 0.5)
                ax.set_title(f"{m}, batch size {b}", fontsize=9)
                ax.set_xlabel("training precision" if i == len(metrics) - 1 else "")
                ax.set_ylabel("top-1 (%)" if j == 0 else "")
            for j in range(len(bss)):
                axes[i][j].set_ylim(*y_range(drawn))
        shared_legend(fig, axes, "loss")
        fig.suptitle(f"{ds}: top-1 vs training precision", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        files = ctx.save_figure(fig, f"precision_top1_{slug(ds)}")
    return files, (
        f"**{ds}: top-1 vs precision** ({SEEDS_MEANING}; a missing "
        "point: every seed diverged or is not evaluated)\n\n" + ctx.figure_md(files, f"{ds} top-1 vs precision")
    )


def _grad_figure(hist: pd.DataFrame, ds: str, ctx: ReportContext) -> tuple[list, str]:
    h = hist[hist["value"] > 0].copy()
    if h.empty:
        return [], f"_{ds}: every logged gradient error is 0; figure skipped._\n"
    plt, sns, rc = plot_style()
    h["B"] = h["batch_size"].astype(int).astype(str)
    h["τ"] = h["temperature"].map(short)
    labels = label_order(h)
    with plt.rc_context(rc), sns.axes_style("whitegrid"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # seaborn 0.13 passes boxplot(vert=) to mpl 3.11
        g = sns.catplot(
            data=h,
            kind="box",
            x="B",
            order=[str(b) for b in sorted(h["batch_size"].astype(int).unique())],
            y="value",
            hue="label",
            hue_order=labels,
            palette=loss_palette(h),
            col="dtype",
            col_order=[d for d in GRAD_KEYS if d in set(h["dtype"])],
            row="τ",
            row_order=[short(t) for t in sorted(h["temperature"].unique())],
            height=3.0,
            aspect=1.2,
            fliersize=2,
            log_scale=(False, True),
            sharey=False,
        )
        g.set_titles("{col_name} vs fp64 | τ = {row_name}")
        g.set_axis_labels("batch size", "relative gradient error")
        if g.legend is not None:
            g.legend.set_title("loss")
        g.figure.suptitle(f"{ds}: rounding error of the loss gradient w.r.t. the embeddings (all logged steps)", y=1.02)
        files = ctx.save_figure(g.figure, f"precision_grad_error_{slug(ds)}")
    return files, (
        f"**{ds}: gradient rounding error** (distribution over logged steps and seeds, log scale)\n\n"
        + ctx.figure_md(files, f"{ds} gradient error")
    )
