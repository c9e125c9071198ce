"""Section 'regime': where the small-batch penalty lives (batch size x training length x
optimiser regime), SimCLR's Figure 9 / Table B.1 analogue, and DCL's gradient-scale
mechanism measured.

* top-1 vs batch size, one line per epoch budget, one panel per regime x loss, per probe;
* the gap table: top-1 at the smallest and the largest batch per (loss, regime, epochs),
  the gap small − large with two standard errors, and SimCLR's gaps beside it;
* the mechanism: the logged ratio ``‖∇InfoNCE‖/‖∇DCL‖`` against ``q_B`` (``diag/grad_ratio_infonce_dcl``
  vs ``diag/qb_mean``), and the update size per unit lr (``diag/update_per_lr``) of
  InfoNCE vs DCL against ``q_B`` (does the optimiser pass the scale on or divide it out?).

The numbers and findings are computed in :mod:`.regime_findings`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ...tracking import BAD_STATUSES
from ..aggregate import aggregate_cells, label_order, pivot, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..figures import (
    SEEDS_MEANING,
    accuracy_long,
    draw_seeds,
    history,
    mark_bad,
    palette,
    plot_style,
    shared_legend,
    y_range,
)
from ..fmt import num, runs_count, short, signed, slug
from ..runs import METRIC_LABELS, METRICS, param, param_num, select_cells
from ..tables import markdown_table
from .papers import paper_gaps, paper_setting, run_setting
from .regime_findings import (
    SETTING,
    dcl_finding,
    gap_summary,
    gap_text,
    length_finding,
    penalty_finding,
    ratio_finding,
    ratio_summary,
    regime_order,
    update_finding,
    update_summary,
)

AXES = ("epochs", "regime")
HISTORIES = {"qb": "diag/qb_mean", "ratio": "diag/grad_ratio_infonce_dcl", "update": "diag/update_per_lr"}
Figure = tuple[list[Path], str]


def regime_cells(runs: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """The 'regime' cells (:func:`.runs.select_cells`) with ``regime``, ``optimizer``, ``lr_scaling`` and a
    numeric ``epochs``; a run without ``epochs`` is left out with a note."""
    cells = select_cells(runs, "regime", AXES, notes)
    if cells.empty:
        return cells
    cells["optimizer"] = param(cells, "optimizer").fillna("?")
    cells["lr_scaling"] = param(cells, "lr_scaling").fillna("none")  # 'none' is logged, and read, as absent
    cells["regime"] = param(cells, "regime").fillna(cells["optimizer"] + "/" + cells["lr_scaling"])
    cells["epochs"] = param_num(cells, "epochs")
    bad = ~np.isfinite(cells["epochs"])
    if bad.any():
        notes.append(f"{int(bad.sum())} 'regime' run(s) lack the param epochs and are not in the regime tables.")
    return cells[~bad].copy()


def simclr_rows(papers: pd.DataFrame) -> pd.DataFrame:
    """SimCLR's Table B.1 (= Figure 9) rows of the papers' CSV: top-1 by batch size, epochs and lr scaling."""
    return papers[
        papers["paper"].astype(str).str.startswith("SimCLR")
        & papers["source"].astype(str).str.contains(r"\bB\.1\b", regex=True)
    ]


def simclr_gaps(rows: pd.DataFrame) -> pd.DataFrame:
    """SimCLR's top-1 at its smallest and largest batch per epochs and lr scaling rule
    (:func:`.papers.paper_gaps`, whose gap is small − large)."""
    g = paper_gaps(rows) if len(rows) else pd.DataFrame()
    if g.empty:
        return pd.DataFrame(
            columns=[
                "source",
                "lr_scaling",
                "epochs",
                "small_batch_size",
                "large_batch_size",
                "top1_small",
                "top1_large",
                "gap_small_minus_large",
            ]
        )
    return g.sort_values(["lr_scaling", "epochs"], kind="stable").reset_index(drop=True)


# --------------------------------------------------------------------------- the tables of top-1
def _top1_table(agg: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], str]:
    """tables/regime_top1: every cell's top-1 (loss × regime × epochs rows, one column per batch size)."""
    rank = {r: i for i, r in enumerate(regime_order(agg["regime"], agg["optimizer"]))}
    agg = sort_by_loss(
        agg.assign(_r=agg["regime"].map(rank)),
        ["dataset", "temperature", "metric", "loss", "label", "_r", "epochs", "batch_size"],
    )
    agg = agg.drop(columns="_r")
    blocks = []
    for (ds, t, m), g in agg.groupby(["dataset", "temperature", "metric"], sort=False):
        wide = pivot(
            g.assign(epochs=g["epochs"].map(short)),
            ["label", "regime", "epochs"],
            "batch_size",
            lambda b: f"B={int(b)}",
            columns=sorted(g["batch_size"].unique()),
        )
        blocks.append((f"{ds}, τ={short(t)}, {METRIC_LABELS.get(m, m)}", wide.rename(columns={"label": "loss"})))
    files = ctx.write_table(
        "regime_top1",
        "Regime: top-1 (%) by loss × regime × training length × batch size",
        agg,
        blocks,
        note="mean ± sample std over seeds; '—' = one seed; a cell whose seeds all "
        "diverged, collapsed or failed reads that status",
    )
    return files, f"Top-1 of every cell (loss × regime × epochs × batch size): {ctx.table_links(files)}\n"


# --------------------------------------------------------------------------- the gap table
def _gap_blocks(gap: pd.DataFrame, agg: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One block per (dataset, τ, metric): loss, regime, epochs, top-1 at each end (as the cells read), gap."""
    keys = [*SETTING, "metric", "label", "batch_size"]
    shown = dict(zip(map(tuple, agg[keys].to_numpy().tolist()), agg["display"]))

    def at(g: pd.DataFrame, end: str) -> list[str]:
        return [shown.get((*[r[k] for k in SETTING], r["metric"], r["label"], r[end]), "") for _, r in g.iterrows()]

    return [
        (
            f"{ds}, τ={short(t)}, {METRIC_LABELS.get(m, m)}",
            pd.DataFrame(
                {
                    "loss": g["label"],
                    "regime": [f"{r} ({o}, {s})" for r, o, s in zip(g["regime"], g["optimizer"], g["lr_scaling"])],
                    "epochs": g["epochs"].map(short),
                    "B small→large": [f"{int(a)}→{int(b)}" for a, b in zip(g["batch_size_min"], g["batch_size_max"])],
                    "top-1 small": at(g, "batch_size_min"),
                    "top-1 large": at(g, "batch_size_max"),
                    "gap (small − large) [95 % CI]": [gap_text(r) for _, r in g.iterrows()],
                    "verdict": g["verdict"],
                }
            ).reset_index(drop=True),
        )
        for (ds, t, m), g in gap.groupby(["dataset", "temperature", "metric"], sort=False)
    ]


def _simclr_block(simclr: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "source": simclr["source"],
            "lr scaling": simclr["lr_scaling"],
            "epochs": simclr["epochs"].map(short),
            "B small→large": [
                f"{int(a)}→{int(b)}" for a, b in zip(simclr["small_batch_size"], simclr["large_batch_size"])
            ],
            "top-1 small": simclr["top1_small"].map(num),
            "top-1 large": simclr["top1_large"].map(num),
            "gap (small − large)": simclr["gap_small_minus_large"].map(signed),
        }
    )


def _gap_table(
    gap: pd.DataFrame, agg: pd.DataFrame, cells: pd.DataFrame, ctx: ReportContext
) -> tuple[list[Path], list[str], pd.DataFrame]:
    """tables/regime_gap: ours per (dataset, τ, metric) and SimCLR's Table B.1 beside it (tidy CSV: both);
    also returns SimCLR's gaps."""
    blocks, rows = _gap_blocks(gap, agg), simclr_rows(ctx.papers)
    simclr = simclr_gaps(rows)
    note = "gap = mean top-1 at the smallest − at the largest batch; ± two standard errors of that difference"
    if len(simclr):
        note += (
            f"; SimCLR's setting ({paper_setting(rows)}, trained with LARS) differs from ours "
            f"({run_setting(cells)}): datasets, backbones and budgets differ, so compare how the gap moves "
            "with training length, not the numbers"
        )
        blocks.append(("SimCLR (Chen et al. 2020), Table B.1 / Figure 9: linear-probe top-1", _simclr_block(simclr)))
    paper = simclr.rename(
        columns={
            "method": "label",
            "small_batch_size": "batch_size_min",
            "large_batch_size": "batch_size_max",
            "top1_small": "mean_small",
            "top1_large": "mean_large",
        }
    )
    tidy = pd.concat(
        [
            gap.assign(who="ours", source="MLflow store"),
            paper.assign(who="paper").drop(columns=["family"], errors="ignore"),
        ],
        ignore_index=True,
    )
    files = ctx.write_table(
        "regime_gap",
        "Regime: small − large batch top-1 gap per loss, regime and training length (SimCLR's Table B.1 beside it)",
        tidy,
        blocks,
        note=note,
    )
    md = [f"Small − large batch gap per loss, regime and epochs: {ctx.table_links(files)}\n", f"> Note: {note}.\n"]
    md += [x for sub, df in blocks for x in (f"**{sub}**\n", markdown_table(df))]
    return files, md, simclr


# --------------------------------------------------------------------------- SimCLR Figure 9's analogue
def _mark_partial(ax, x: float, y: float, color) -> None:
    """□ around a point whose mean comes from only some of its seeds."""
    ax.scatter([x], [y], marker="s", s=140, facecolors="none", edgecolors=[color], linewidths=1.2, zorder=6)


def _top1_figure(cells: pd.DataFrame, agg: pd.DataFrame, ctx: ReportContext, where: tuple) -> Figure:
    """Top-1 vs batch size (log2), one line per epoch budget, one panel per loss (row) x regime (column)."""
    ds, t, m = where
    lab = METRIC_LABELS.get(m, m)
    data = accuracy_long(cells, ctx.scale, ["batch_size", "regime", "optimizer", "epochs", "seed"])
    data = data[data["metric"] == lab] if len(data) else data
    if data.empty:
        return [], f"_{ds}, τ={short(t)}: no {lab} logged for the regime runs yet; figure skipped._\n"
    budgets = [f"{short(e)} epochs" for e in sorted(cells["epochs"].unique())]
    data = data.assign(loss_label=data["label"], label=data["epochs"].map(lambda e: f"{short(e)} epochs"))
    regimes = regime_order(cells["regime"], cells["optimizer"])
    losses = label_order(cells)
    pal, bss = palette(budgets), sorted(int(b) for b in cells["batch_size"].unique())
    plt, sns, rc = plot_style()
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(losses),
            len(regimes),
            figsize=(3.0 * len(regimes) + 0.3, 2.5 * len(losses) + 0.6),
            squeeze=False,
            sharex=True,
        )
        a = agg[agg["metric"] == m]
        for i, loss_lab in enumerate(losses):
            drawn = []
            for j, reg in enumerate(regimes):
                ax = axes[i][j]
                drawn += draw_seeds(
                    ax,
                    data[(data["loss_label"] == loss_lab) & (data["regime"] == reg)],
                    "batch_size",
                    "top-1 (%)",
                    budgets,
                    pal,
                )
                ax.set_xscale("log", base=2)
                ax.set_xticks(bss)
                ax.set_xticklabels([str(b) for b in bss], fontsize=7)
                ax.set_xlim(bss[0] / 1.4, bss[-1] * 1.4)
                ax.minorticks_off()
                ax.set_title(f"{loss_lab}, {reg}", fontsize=9)
                ax.set_xlabel("batch size" if i == len(losses) - 1 else "")
                ax.set_ylabel(f"{lab} (%)" if j == 0 else "")
            for j, reg in enumerate(regimes):
                ax = axes[i][j]
                ax.set_ylim(*y_range(drawn))
                for _, r in a[
                    a["state"].isin([*BAD_STATUSES, "partial"]) & (a["label"] == loss_lab) & (a["regime"] == reg)
                ].iterrows():
                    color = pal.get(f"{short(r['epochs'])} epochs", "k")
                    if r["state"] == "partial":
                        _mark_partial(ax, int(r["batch_size"]), float(r["mean"]), color)
                    else:
                        mark_bad(ax, [int(r["batch_size"])], color)
        shared_legend(fig, axes, "training length")
        fig.suptitle(f"{ds}, τ={short(t)}: {lab} vs batch size", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.96))
        files = ctx.save_figure(fig, f"regime_top1_{slug(ds)}_t{slug(short(t))}_{m}")
    return files, (
        f"**{ds}, τ={short(t)}: {lab} vs batch size per training length and optimiser regime** (SimCLR "
        f"Figure 9's analogue; {SEEDS_MEANING}; ▽ on the x axis: no seed "
        "gave a number; □: some seeds diverged, collapsed or failed)\n\n"
        + ctx.figure_md(files, f"{ds} {lab} vs batch size per regime")
    )


# --------------------------------------------------------------------------- the mechanism
def mechanism_points(cells: pd.DataFrame, ctx: ReportContext) -> pd.DataFrame:
    """Per logged step of every run: ``qb`` (diag/qb_mean) and ``ratio`` (diag/grad_ratio_infonce_dcl)."""
    cols = [*SETTING, "batch_size", "loss", "label"]
    q = history(cells, HISTORIES["qb"], ctx, cols)
    r = history(cells, HISTORIES["ratio"], ctx, [])
    if q.empty or r.empty:
        return pd.DataFrame(columns=["run_id", "step", "qb", "ratio", *cols])
    r = r[["run_id", "step", "value"]].rename(columns={"value": "ratio"})
    return q.rename(columns={"value": "qb"}).merge(r, on=["run_id", "step"]).drop(columns="progress")


def run_means(cells: pd.DataFrame, ctx: ReportContext) -> pd.DataFrame:
    """One row per run without a bad status: its setting, loss, and the means over its logged steps of
    ``update`` (diag/update_per_lr) and ``qb`` (diag/qb_mean); runs that logged no update size are left out."""
    good = cells[~cells["status"].isin(BAD_STATUSES)]
    out = good[["run_id", *SETTING, "batch_size", "loss", "seed"]].set_index("run_id")
    for name in ("update", "qb"):
        h = history(good, HISTORIES[name], ctx, [])
        out[name] = h.groupby("run_id")["value"].mean() if len(h) else math.nan
    return out[np.isfinite(out["update"].astype(float))].reset_index()


def _ratio_table(rs: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], list[str]]:
    blocks = [
        (
            f"{ds}, τ={short(t)}",
            pd.DataFrame(
                {
                    "regime": g["regime"],
                    "B": g["batch_size"].astype(int),
                    "loss": g["label"],
                    "mean q_B": g["qb_mean"].map(lambda v: num(v, 3)),
                    "mean ratio": g["ratio_mean"].map(lambda v: num(v, 3)),
                    "ratio / q_B − 1": g["ratio_over_qb_minus_1"].map(lambda v: f"{signed(100 * v)}%"),
                    "steps": g["n_points"],
                    "runs": g["n_runs"],
                }
            ).reset_index(drop=True),
        )
        for (ds, t), g in rs.groupby(["dataset", "temperature"], sort=False)
    ]
    files = ctx.write_table(
        "regime_grad_ratio",
        "Regime: logged gradient ratio ‖∇InfoNCE‖/‖∇DCL‖ against q_B",
        rs,
        blocks,
        note="means over every logged step of every run (all seeds and training "
        "lengths); the ratio is measured w.r.t. the step's embeddings",
    )
    return files, [f"Gradient ratio against q_B: {ctx.table_links(files)}\n"] + [markdown_table(df) for _, df in blocks]


def _update_table(us: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], list[str]]:
    blocks = [
        (
            f"{ds}, τ={short(t)}",
            pd.DataFrame(
                {
                    "regime": [f"{r} ({o})" for r, o in zip(g["regime"], g["optimizer"])],
                    "B": g["batch_size"].astype(int),
                    "epochs": g["epochs"].map(short),
                    "InfoNCE ‖Δθ‖/lr": g["infonce_update"].map(lambda v: num(v, 3)),
                    "DCL ‖Δθ‖/lr": g["dcl_update"].map(lambda v: num(v, 3)),
                    "InfoNCE/DCL": g["ratio"].map(lambda v: num(v, 3)),
                    "mean q_B": g["qb"].map(lambda v: num(v, 3)),
                    "log ratio 95 % CI": [
                        f"[{num(a, 3)}, {num(b, 3)}]" for a, b in zip(g["log_ratio_ci_low"], g["log_ratio_ci_high"])
                    ],
                    "verdict": g["verdict"],
                }
            ).reset_index(drop=True),
        )
        for (ds, t), g in us.groupby(["dataset", "temperature"], sort=False)
    ]
    files = ctx.write_table(
        "regime_update_size",
        "Regime: update size per unit lr, InfoNCE vs DCL, against q_B",
        us,
        blocks,
        note="‖Δθ‖/lr averaged over a run's logged steps, geometric mean over seeds (runs that diverged, collapsed "
        "or failed left out); mean q_B of the InfoNCE runs; the ratio is tested on the log scale against 1 and "
        "against q_B (95 % paired-t intervals over seeds)",
    )
    return files, [f"Update size per unit lr against q_B: {ctx.table_links(files)}\n"] + [
        markdown_table(df) for _, df in blocks
    ]


def _diagonal(ax, lo: float, hi: float, one: bool) -> None:
    ax.plot([lo, hi], [lo, hi], ls="--", lw=1, color="grey", zorder=1)
    if one:
        ax.axhline(1.0, ls=":", lw=1, color="black", zorder=1)


def _ratio_figure(pts: pd.DataFrame, ctx: ReportContext, ds: str) -> Figure:
    """The logged ratio against q_B per step, coloured by batch size; one panel per loss x regime."""
    h = pts.assign(B=pts["batch_size"].astype(int).astype(str))
    border = [str(b) for b in sorted(h["batch_size"].astype(int).unique())]
    plt, sns, rc = plot_style()
    lo, hi = float(min(h["qb"].min(), h["ratio"].min())), float(max(h["qb"].max(), h["ratio"].max()))
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(
            data=h,
            kind="scatter",
            x="qb",
            y="ratio",
            hue="B",
            hue_order=border,
            palette=sns.color_palette("viridis", len(border)),
            row="label",
            row_order=label_order(h),
            col="regime",
            col_order=regime_order(h["regime"], h["optimizer"]),
            s=10,
            alpha=0.5,
            linewidth=0,
            rasterized=True,
            height=2.8,
            aspect=1.0,
            facet_kws={"margin_titles": True},
        )
        for ax in g.axes.flat:
            _diagonal(ax, lo, hi, one=False)
        g.set_titles(row_template="{row_name}", col_template="{col_name}")
        g.set_axis_labels("q_B (mean over the batch)", "‖∇InfoNCE‖ / ‖∇DCL‖")
        if g.legend is not None:
            g.legend.set_title("batch size")
        g.figure.suptitle(f"{ds}: the gradient ratio against q_B at every logged step (dashed: ratio = q_B)", y=1.02)
        files = ctx.save_figure(g.figure, f"regime_grad_ratio_{slug(ds)}")
    return files, (
        f"**{ds}: gradient ratio against q_B** (`{HISTORIES['ratio']}` vs `{HISTORIES['qb']}`)\n\n"
        + ctx.figure_md(files, f"{ds} gradient ratio vs q_B")
    )


def _update_figure(us: pd.DataFrame, ctx: ReportContext, ds: str) -> Figure:
    """InfoNCE/DCL update-size ratio against q_B per cell (± 2 SE), one panel per regime."""
    d = us[np.isfinite(us["ratio"].astype(float)) & np.isfinite(us["qb"].astype(float))]
    if d.empty:
        return [], f"_{ds}: no InfoNCE/DCL pair with update sizes and q_B; update-size figure skipped._\n"
    d = d.assign(B=d["batch_size"].astype(int).astype(str), budget=d["epochs"].map(lambda e: f"{short(e)} epochs"))
    border = [str(b) for b in sorted(d["batch_size"].astype(int).unique())]
    regimes = regime_order(d["regime"], d["optimizer"])
    plt, sns, rc = plot_style()
    lo, hi = float(min(d["qb"].min(), d["ratio"].min(), 1.0)), float(max(d["qb"].max(), d["ratio"].max(), 1.0))
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(
            data=d,
            kind="scatter",
            x="qb",
            y="ratio",
            hue="B",
            hue_order=border,
            style="budget",
            palette=sns.color_palette("viridis", len(border)),
            col="regime",
            col_order=regimes,
            s=60,
            height=3.0,
            aspect=1.0,
        )
        for reg, ax in g.axes_dict.items():
            r = d[d["regime"] == reg]
            lo_, hi_ = (
                np.exp(r[c].astype(float)).fillna(r["ratio"]) for c in ("log_ratio_ci_low", "log_ratio_ci_high")
            )
            ax.errorbar(
                r["qb"],
                r["ratio"],
                yerr=[(r["ratio"] - lo_).clip(lower=0), (hi_ - r["ratio"]).clip(lower=0)],
                fmt="none",
                ecolor="grey",
                elinewidth=1,
                zorder=0,
            )
            _diagonal(ax, lo, hi, one=True)
        g.set_titles(col_template="{col_name}")
        g.set_axis_labels("q_B (InfoNCE runs' mean)", "‖Δθ‖/lr: InfoNCE / DCL")
        g.figure.suptitle(
            f"{ds}: does the gradient scale reach the update? (dashed: ratio = q_B, the scale passed on; "
            "dotted: ratio = 1, divided out; bars: 95 % CI)",
            y=1.04,
        )
        files = ctx.save_figure(g.figure, f"regime_update_size_{slug(ds)}")
    return files, (
        f"**{ds}: update size per unit lr, InfoNCE / DCL, against q_B** (`{HISTORIES['update']}`)\n\n"
        + ctx.figure_md(files, f"{ds} update-size ratio vs q_B")
    )


def _mechanism(cells: pd.DataFrame, ctx: ReportContext, out: SectionOutput) -> list[str]:
    """The mechanism's tables, findings and figures; what was not logged is said, not hidden."""
    md = ["### The mechanism: gradient scale q_B\n"]
    pts, us = mechanism_points(cells, ctx), update_summary(run_means(cells, ctx))
    settings = list(dict.fromkeys(zip(cells["dataset"], cells["temperature"])))
    if len(pts):
        rs = ratio_summary(pts)
        files, text = _ratio_table(rs, ctx)
        out.files += files
        md += text
        out.findings += [ratio_finding(rs, ds, t) for ds, t in settings]
    else:
        md.append(f"_No run logged both `{HISTORIES['ratio']}` and `{HISTORIES['qb']}`; ratio table skipped._\n")
    if len(us):
        files, text = _update_table(us, ctx)
        out.files += files
        md += text
        out.findings += [update_finding(us, ds, t) for ds, t in settings]
    else:
        md.append(f"_No InfoNCE and DCL runs of one cell logged `{HISTORIES['update']}`; update-size table skipped._\n")
    figures = [_ratio_figure(pts[pts["dataset"] == ds], ctx, ds) for ds in dict.fromkeys(pts["dataset"])]
    figures += [_update_figure(us[us["dataset"] == ds], ctx, ds) for ds in dict.fromkeys(us["dataset"])]
    for fig_files, fig_md in figures:
        out.files += fig_files
        md.append(fig_md)
    return md


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """Where InfoNCE's small-batch penalty lives (regime x training length), and DCL's mechanism measured."""
    cells = regime_cells(runs, ctx.notes)
    if cells.empty:
        return None
    out = SectionOutput(
        "regime",
        "Side experiment: optimiser regime × training length (where the small-batch penalty lives)",
        "",
        run_ids=set(cells["run_id"]),
    )
    agg = aggregate_cells(cells, [*SETTING, "loss", "label", "batch_size"], ctx.scale, values=True)
    gap = gap_summary(agg)
    f_top, md_top = _top1_table(agg, ctx)
    files, md, simclr = _gap_table(gap, agg, cells, ctx)
    out.files += f_top + files
    md.insert(0, md_top)
    md.insert(
        0,
        f"{runs_count(len(cells))} (experiment 'regime'): {cells['label'].nunique()} loss(es) × "
        f"{cells['regime'].nunique()} regime(s) × {cells['epochs'].nunique()} training length(s) × "
        f"{cells['batch_size'].nunique()} batch size(s).\n",
    )
    for ds, t, m in dict.fromkeys(zip(gap["dataset"], gap["temperature"], gap["metric"])):
        out.findings += [
            penalty_finding(gap, ds, t, m),
            dcl_finding(gap, ds, t, m),
            length_finding(gap, simclr, ds, t, m),
        ]
    md.append("### Figures: top-1 vs batch size\n")
    for (ds, t), c in cells.groupby(["dataset", "temperature"], sort=False):
        for m in METRICS:
            files, text = _top1_figure(c, agg[(agg["dataset"] == ds) & (agg["temperature"] == t)], ctx, (ds, t, m))
            out.files += files
            md.append(text)
    md += _mechanism(cells, ctx, out)
    out.markdown = "\n".join(md)
    return out
