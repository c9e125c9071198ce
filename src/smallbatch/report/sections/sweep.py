"""What the K sweep and the temperature sweep share: the per-loss summary over the swept
value, and the top-1-vs-swept-value figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ...tracking import BAD_STATUSES
from ..aggregate import label_order
from ..context import ReportContext
from ..figures import (
    SEEDS_MEANING,
    accuracy_long,
    draw_seeds,
    loss_palette,
    mark_bad,
    plot_style,
    shared_legend,
    y_range,
)
from ..fmt import finite, short, slug
from ..runs import METRIC_LABELS, METRICS


def _ends(g: pd.DataFrame, xmin, xmax) -> dict:
    """mean/std/n/state/{seed: value} at the smallest (``small``) and largest (``large``) swept value."""
    row = {}
    for tag, xv in (("small", xmin), ("large", xmax)):
        if xv in g.index:
            r = g.loc[xv]
            row.update(
                {
                    f"mean_{tag}": float(r["mean"]),
                    f"std_{tag}": float(r["std"]),
                    f"n_{tag}": int(r["n_seeds"]),
                    f"state_{tag}": str(r["state"]),
                    f"values_{tag}": dict(r.get("values", None) or {}),
                }
            )
        else:
            row.update(
                {
                    f"mean_{tag}": math.nan,
                    f"std_{tag}": math.nan,
                    f"n_{tag}": 0,
                    f"state_{tag}": "not run",
                    f"values_{tag}": {},
                }
            )
    return row


def _spread(g: pd.DataFrame, x: str) -> dict:
    """Range, best and worst swept value, pooled seed sd, and the values whose seeds all failed."""
    vals = g[np.isfinite(g["mean"].astype(float))]
    any_ = len(vals) > 0
    seeded = vals[vals["n_seeds"].astype(int) >= 2]
    bad = g[g["state"].isin(BAD_STATUSES)]
    return {
        "range": float(vals["mean"].max() - vals["mean"].min()) if any_ else math.nan,
        f"best_{x}": vals["mean"].astype(float).idxmax() if any_ else math.nan,
        "best_mean": float(vals["mean"].max()) if any_ else math.nan,
        f"worst_{x}": vals["mean"].astype(float).idxmin() if any_ else math.nan,
        "worst_mean": float(vals["mean"].min()) if any_ else math.nan,
        f"n_{x}_with_values": len(vals),
        "pooled_sd": float(np.sqrt((seeded["std"].astype(float) ** 2).mean())) if len(seeded) else math.nan,
        "n_seeds_min": int(seeded["n_seeds"].min()) if len(seeded) else 1,
        f"{x}_diverged": ", ".join(short(v) for v in bad.index),
        "n_diverged_points": len(bad),
        "values_best": _values(vals, vals["mean"].astype(float).idxmax()) if any_ else {},
        "values_worst": _values(vals, vals["mean"].astype(float).idxmin()) if any_ else {},
    }


def _values(g: pd.DataFrame, xv) -> dict:
    v = g.loc[xv].get("values", None)
    return dict(v) if isinstance(v, dict) else {}


def sweep_summary(agg: pd.DataFrame, setting: Sequence[str], x: str) -> pd.DataFrame:
    """Per setting × metric × label: values at the smallest/largest x, change, range, best x."""
    rows = []
    keys = [*setting, "metric", "loss", "label"]
    for key, g in agg.groupby(keys, sort=False):
        kd = dict(zip(keys, key))
        allx = agg
        for c in [*setting, "metric"]:
            allx = allx[allx[c] == kd[c]]
        xs = sorted(allx[x].unique())
        row = {**kd, f"{x}_min": xs[0], f"{x}_max": xs[-1], **_ends(g.set_index(x), xs[0], xs[-1])}
        row["change_large_to_small"] = row["mean_small"] - row["mean_large"]
        rows.append({**row, **_spread(g.set_index(x), x)})
    return pd.DataFrame(rows)


def _setting_text(frame: pd.DataFrame, fixed: list[str]) -> list[str]:
    return [
        ", ".join(
            f"{'B' if c == 'batch_size' else 'τ'}={short(v) if c == 'temperature' else int(v)}"
            for c, v in zip(fixed, vals)
        )
        for vals in zip(*(frame[c] for c in fixed))
    ]


def sweep_figure(
    cells: pd.DataFrame,
    agg: pd.DataFrame,
    ds: str,
    ctx: ReportContext,
    *,
    x: str,
    xlabel: str,
    base: int,
    stem: str,
    title: str,
    vline: float = math.nan,
) -> tuple[list[Path], str]:
    """Top-1 vs a swept value (log x) per loss; one column per metric, one row per other setting;
    ▽ where all seeds failed; a dashed line at ``vline`` (e.g. the number of images) when in range."""
    data = accuracy_long(cells, ctx.scale, list(dict.fromkeys(["batch_size", "temperature", "seed", x])))
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged for the {stem} runs yet; figure skipped._\n"
    plt, sns, rc = plot_style()
    fixed = [c for c in ("batch_size", "temperature") if c != x]
    data["setting"] = _setting_text(data, fixed)
    agg = agg.assign(setting=_setting_text(agg, fixed))
    labels, pal = label_order(data), loss_palette(data)
    xs = sorted(float(v) for v in cells[x].unique())
    shown_line = finite(vline) and xs[0] / 2 <= vline <= xs[-1] * 2
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    settings = list(dict.fromkeys(data.sort_values(fixed)["setting"]))  # B=16 before B=256
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(settings), len(metrics), figsize=(3.4 * len(metrics) + 0.3, 2.7 * len(settings) + 0.5), squeeze=False
        )
        for i, st in enumerate(settings):
            for j, m in enumerate(metrics):
                ax = axes[i][j]
                d = data[(data["setting"] == st) & (data["metric"] == m)]
                ax.set_ylim(*y_range(draw_seeds(ax, d, x, "top-1 (%)", labels, pal)))
                ax.set_xscale("log", base=base)
                ax.set_xticks(xs)
                ax.set_xticklabels(
                    [short(v) if v >= 1e-3 else f"{v:.3g}" for v in xs], fontsize=7, rotation=45 if len(xs) > 5 else 0
                )
                ax.set_xlim(xs[0] / 1.5, xs[-1] * 1.5)
                ax.minorticks_off()
                if shown_line:
                    ax.axvline(vline, ls="--", lw=1, color="grey")
                ax.set_title(f"{m}, {st}", fontsize=9)
                ax.set_xlabel(xlabel if i == len(settings) - 1 else "")
                ax.set_ylabel("top-1 (%)" if j == 0 else "")
                for _, r in agg[
                    agg["state"].isin(BAD_STATUSES) & (agg["setting"] == st) & (agg["metric"].map(METRIC_LABELS) == m)
                ].iterrows():
                    mark_bad(ax, [float(r[x])], pal.get(r["label"], "k"))
        shared_legend(fig, axes, "loss")
        fig.suptitle(f"{ds}: {title}", fontsize=11)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
        files = ctx.save_figure(fig, f"{stem}_{slug(ds)}")
    extra_t = "; dashed line: the number of pretraining images" if shown_line else ""
    return files, (
        f"**{ds}: {title}** ({SEEDS_MEANING}; ▽ on the x axis: no "
        f"seed gave a number{extra_t})\n\n" + ctx.figure_md(files, f"{ds} {title}")
    )
