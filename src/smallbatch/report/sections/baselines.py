"""Section 'baselines': raw pixels and a random-init encoder under the same kNN and linear probes."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..aggregate import aggregate_cells
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, describe, paired
from ..fmt import finite
from ..runs import METRIC_LABELS, METRICS, newest
from ..tables import markdown_table


def baseline_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest run of each baseline cell, with a ``baseline`` name."""
    b, _ = newest(runs[runs["kind"] == "baseline"])
    return b.assign(baseline=b["baseline"].fillna("baseline"))


def baseline_table(runs: pd.DataFrame, scale: float) -> pd.DataFrame:
    """Mean top-1 per dataset x baseline x metric (see :func:`aggregate.aggregate_cells`)."""
    agg = aggregate_cells(baseline_runs(runs), ["dataset", "baseline"], scale, values=True)
    return agg.sort_values(["dataset", "metric", "baseline"], kind="stable").reset_index(drop=True)


def _ranked(agg: pd.DataFrame):
    """(dataset, metric, baselines with a number, best first) for each dataset x metric."""
    for (ds, m), g in agg.groupby(["dataset", "metric"], sort=True):
        g = g[np.isfinite(g["mean"])].sort_values(["mean", "baseline"], ascending=[False, True], kind="stable")
        if len(g):
            yield ds, m, g


def best_baseline_values(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str], dict]:
    """(dataset, metric) -> {seed: top-1} of the best baseline (what a cell is tested against)."""
    agg = aggregate_cells(baseline_runs(runs), ["dataset", "baseline"], scale, values=True)
    best = best_baselines(runs, scale)
    return {
        (ds, m): next((dict(v) for b, v in zip(g["baseline"], g["values"]) if b == best[(ds, m)][0]), {})
        for (ds, m), g in agg.groupby(["dataset", "metric"], sort=True)
        if (ds, m) in best
    }


def best_baselines(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str], tuple[str, float]]:
    """(dataset, metric) -> (baseline name, mean top-1) of the best baseline."""
    return {
        (ds, m): (str(g["baseline"].iloc[0]), float(g["mean"].iloc[0]))
        for ds, m, g in _ranked(baseline_table(runs, scale))
    }


def _best_sentence(ds: str, m: str, g: pd.DataFrame) -> str:
    """The highest baseline of a dataset and metric, and its lead over the next one with its test."""
    s = f"Highest baseline on {ds} ({METRIC_LABELS.get(m, m)}): {g['baseline'].iloc[0]} at {g['mean'].iloc[0]:.1f}%"
    if len(g) < 2:
        return s + "."
    a, b = g.iloc[0], g.iloc[1]
    e = paired(a.get("values") or {}, b.get("values") or {})
    e = e if finite(e.diff) else Estimate(diff=float(a["mean"]) - float(b["mean"]))
    return s + f"; its lead over {b['baseline']} ({b['mean']:.1f}%) is {describe(e)}."


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    b = baseline_runs(runs)
    out = SectionOutput("baselines", "Baselines: raw pixels and a random-init encoder", "")
    if b.empty:
        out.markdown = "No baseline runs (kind 'baseline') in this experiment.\n"
        return out
    out.run_ids = set(b["run_id"])
    agg = baseline_table(runs, ctx.scale)
    disp = []
    for (ds, name), g in agg.groupby(["dataset", "baseline"], sort=True):
        row = {"dataset": ds, "baseline": name}
        for m in METRICS:
            gm = g[g["metric"] == m]
            row[METRIC_LABELS[m]] = gm["display"].iloc[0] if len(gm) else ""
        row["seeds"] = int(g["n_runs"].max())
        disp.append(row)
    files = ctx.write_table(
        "baselines",
        "Baselines: top-1 (%) of the same kNN and linear probes",
        agg,
        [(None, pd.DataFrame(disp))],
        note="mean ± sample std over seeds; pretraining gain tables are in the grid section",
    )
    out.files += files
    out.findings += [_best_sentence(ds, m, g) for ds, m, g in _ranked(agg)]
    out.markdown = f"Baseline top-1: {ctx.table_links(files)}\n\n" + markdown_table(pd.DataFrame(disp))
    return out
