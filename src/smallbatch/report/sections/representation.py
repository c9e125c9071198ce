"""Section 'representation': what each grid cell's representation looks like, against batch size.

The evaluation measures every cell's frozen network on a fixed sample of held-out test images
(:mod:`smallbatch.evaluation.representation`, logged as ``repr/*``); training logs DCL's ``q_B``
and the rank of each batch's covariance (``diag/qb_mean``, ``diag/cov_rank``, their last logged
value here).  Per data set: one table of every metric (mean ± sample std over seeds) by loss and
batch size, and per temperature one figure of six of them against batch size, sized for a
paper's column.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...losses.registry import loss_names, loss_spec
from ..aggregate import aggregate_cells, label_order, pivot, shown, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..figures import draw_seeds, loss_palette, plot_style
from ..fmt import finite, short, slug
from ..runs import select_cells

#: the metrics, in the tables' order: short name -> (MLflow key, label)
METRICS = {
    "alignment": ("repr/projection_alignment", "alignment"),
    "uniformity": ("repr/projection_uniformity", "uniformity"),
    "rankme_features": ("repr/features_rankme", "RankMe, features"),
    "rankme_projection": ("repr/projection_rankme", "RankMe, projection"),
    "neg_cos_sd": ("repr/projection_neg_cos_sd", "sd of negative cosines"),
    "neg_cos_mean": ("repr/projection_neg_cos_mean", "mean negative cosine"),
    "features_alignment": ("repr/features_alignment", "alignment, features"),
    "features_uniformity": ("repr/features_uniformity", "uniformity, features"),
    "features_neg_cos_sd": ("repr/features_neg_cos_sd", "sd of negative cosines, features"),
    "qb": ("diag/qb_mean", "q_B (training)"),
    "cov_rank": ("diag/cov_rank", "batch covariance rank (training)"),
}
#: the figure's panels (short names of :data:`METRICS`), in reading order, two per row
PANELS = ("alignment", "uniformity", "rankme_features", "rankme_projection", "neg_cos_sd", "qb")
#: metrics that need negatives to mean anything (blank for a method without negatives)
CONTRASTIVE_ONLY = ("qb",)
KEYS = ["dataset", "temperature", "loss", "label", "batch_size"]

CAPTION = (
    "Each cell's frozen network on the same 2,000 held-out test images (all of a smaller test split) and two "
    "augmented views of each, drawn once with a fixed seed and the cell's augmentation recipe, in eval mode. "
    "Alignment: mean squared distance between an image's two L2-normalised projections (Wang & Isola 2020, "
    "α = 2; 0 = identical views). Uniformity: log of the mean of exp(−2‖u − v‖²) over pairs of different "
    "images within a view (t = 2; lower = spread more evenly over the sphere, 0 = one point). RankMe: exp of "
    "the entropy of the normalised singular values of the clean images' embeddings (Garrido et al. 2023; "
    "1 = one direction, at most the dimension): features = the backbone's output the probes read, projection "
    "= the head's output the loss saw. sd of negative cosines: spread of the cosines between projections of "
    "different images. q_B: DCL's negative–positive coupling 1 − softmax weight of the positive, the factor by "
    "which InfoNCE's gradient is smaller than DCL's (Yeh et al. 2021), at the last logging step of training, on "
    "that step's batch and τ (contrastive losses only). Points: seeds; lines: means with their 95 % t interval."
)


def _display(mean: float, std: float) -> str:
    """``0.512 ± 0.031`` (three significant digits, the spread two), ``± —`` for one seed."""
    return f"{mean:.3g} ± " + (f"{std:.2g}" if finite(std) else "—")


def _by_metric(agg: pd.DataFrame) -> pd.DataFrame:
    """Display: one row per (τ, loss, B), one column per metric."""
    return shown(
        pivot(
            agg,
            ["temperature", "label", "batch_size"],
            "metric",
            lambda m: METRICS[m][1],
            "display",
            columns=[m for m in METRICS if m in set(agg["metric"])],
        )
    )


def _blank_without_negatives(agg: pd.DataFrame) -> pd.DataFrame:
    """q_B read on a method without negatives is not q_B of anything: left out."""
    names = loss_names()
    # astype: the map of an empty column keeps its str dtype, which no boolean mask combines with
    method = agg["loss"].map(lambda n: n in names and not loss_spec(n).contrastive).astype(bool)
    drop = method & agg["metric"].isin(CONTRASTIVE_ONLY)
    return agg[~drop]


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells = select_cells(runs, "grid", ())
    keys = {key for key, _ in METRICS.values() if key.startswith("repr/")}
    cols = [f"metrics.{k}" for k in keys if f"metrics.{k}" in cells.columns]
    if cells.empty or not cols or not np.isfinite(cells[cols].astype(float)).any(axis=None):
        return None  # no cell's representation was measured (a store from before the measure)
    agg = aggregate_cells(cells, KEYS, 1.0, {m: key for m, (key, _) in METRICS.items()})
    agg = sort_by_loss(_blank_without_negatives(agg[agg["n_seeds"] > 0]), KEYS)
    agg["display"] = [_display(m, s) for m, s in zip(agg["mean"], agg["std"])]
    out = SectionOutput("representation", "What each representation looks like", "")
    md = [
        "Alignment, uniformity, effective rank and the spread of negative similarities of every grid cell, "
        "against batch size; the caption under each figure says how each is computed.\n"
    ]
    for ds in sorted(agg["dataset"].unique()):
        a = agg[agg["dataset"] == ds]
        tidy = a[[*KEYS, "metric", "mean", "std", "n_seeds", "n_runs", "display"]]
        files = ctx.write_table(
            f"representation_{slug(ds)}",
            f"{ds}: the representation by loss × batch size",
            tidy,
            [(None, _by_metric(a))],
            note="mean ± sample std (ddof=1) over seeds; '—' = one seed; q_B and the covariance rank are "
            "training's last logged values; q_B only for losses with negatives",
        )
        out.files += files
        md.append(f"**{ds}** — table: {ctx.table_links(files)}\n")
        for tau in sorted(a["temperature"].unique()):
            figs = _figure(cells[(cells["dataset"] == ds) & (cells["temperature"] == tau)], ds, tau, ctx)
            out.files += figs
            if figs:
                md.append(ctx.figure_md(figs, f"{ds}, τ = {short(tau)}: the representation vs batch size"))
    md.append(f"_{CAPTION}_\n")
    out.markdown = "\n".join(md)
    return out


def _long(cells: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, panel metric) with a finite value."""
    rows = []
    for m in PANELS:
        col = f"metrics.{METRICS[m][0]}"
        if col not in cells:
            continue
        sub = cells[["loss", "label", "batch_size", "seed"]].copy()
        sub["metric"], sub["value"] = m, cells[col].astype(float)
        if m in CONTRASTIVE_ONLY:
            names = loss_names()
            sub = sub[sub["loss"].map(lambda n, names=names: n in names and loss_spec(n).contrastive)]
        rows.append(sub[np.isfinite(sub["value"])])
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def _figure(cells: pd.DataFrame, ds: str, tau: float, ctx: ReportContext) -> list:
    """Six panels (:data:`PANELS`) against batch size, 3.4 in wide (a paper's column), 8 pt text."""
    data = _long(cells)
    if data.empty:
        return []
    plt, sns, rc = plot_style()
    rc = {**rc, **{k: 8 for k in ("font.size", "axes.titlesize", "axes.labelsize", "legend.fontsize")}}
    rc.update({"xtick.labelsize": 8, "ytick.labelsize": 8})
    labels, pal = label_order(data), loss_palette(cells)
    bss = sorted(int(b) for b in data["batch_size"].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(3, 2, figsize=(3.4, 4.9), sharex=True, squeeze=False)
        for ax, m in zip(axes.flat, PANELS):
            d = data[data["metric"] == m]
            draw_seeds(ax, d, "batch_size", "value", [lab for lab in labels if lab in set(d["label"])], pal)
            ax.set_xscale("log", base=2)
            ax.set_xticks(bss)
            step = max(1, math.ceil(len(bss) / 4))  # at most four labels: 8 pt labels of 1.5 in panels do not touch
            ax.set_xticklabels([f"{b}" if i % step == 0 else "" for i, b in enumerate(bss)])
            ax.minorticks_off()
            ax.set_xlim(bss[0] / 1.5, bss[-1] * 1.5)
            ax.set_title(METRICS[m][1], pad=3)
            ax.tick_params(axis="both", pad=1.5)
            ax.yaxis.set_major_locator(plt.MaxNLocator(4))
        for ax in axes[-1]:
            ax.set_xlabel("batch size", labelpad=1)
        handles: dict = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncol=3,
            frameon=False,
            handlelength=1.2,
            columnspacing=0.8,
        )
        fig.suptitle(f"{ds}, τ = {short(tau)}", y=1.0)
        fig.tight_layout(h_pad=0.6, w_pad=0.6, rect=(0, 0, 1, 0.98))
        return ctx.save_figure(fig, f"representation_{slug(ds)}_t{short(tau)}")
