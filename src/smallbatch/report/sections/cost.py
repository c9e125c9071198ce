"""Section 'cost': wall and CPU seconds per run and per study section, from the store alone.

A cell's wall seconds are its pretraining's (``train/wall_s``, over resumes) plus its probes'
(``<probe>/seconds`` of each probe of :mod:`smallbatch.study.probe_registry` it ran: ``knn``,
``linear``, ...); its CPU seconds the same steps' process CPU time (``train/cpu_s``,
``<probe>/cpu_s``: every thread of the process).  A baseline's
are its whole job's (``baseline/wall_s``, ``baseline/cpu_s``: features and both probes), an MI
row's its training and readout (``mi/seconds``, ``mi/cpu_s``; the critics trained together share
theirs equally).  A run that logged none of them (one from before they were logged) reads blank,
never 0."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...study.probe_registry import all_specs as probe_specs
from ..context import ReportContext, SectionOutput
from ..runs import newest
from ..tables import markdown_table

WALL, CPU = ("train_wall_s", "eval_wall_s", "other_wall_s"), ("train_cpu_s", "eval_cpu_s", "other_cpu_s")
#: the decimals a reader's table shows: seconds to a tenth (a step's start-up varies more), hours to
#: four (a third of a second), not the float's ten digits; the tidy CSV keeps every digit
SHOWN_DECIMALS = {**{c: 1 for c in (*WALL, *CPU)}, "wall_s": 1, "cpu_s": 1, "wall_h": 4, "cpu_h": 4}


def parts() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(column, the metrics whose sum it is): every probe of the registry the run logged (plugins too)."""
    probes = tuple(probe_specs())
    return (
        ("train_wall_s", ("train/wall_s",)),
        ("train_cpu_s", ("train/cpu_s",)),
        ("eval_wall_s", tuple(f"{p}/seconds" for p in probes)),
        ("eval_cpu_s", tuple(f"{p}/cpu_s" for p in probes)),
        ("other_wall_s", ("mi/seconds", "baseline/wall_s")),
        ("other_cpu_s", ("mi/cpu_s", "baseline/cpu_s")),
    )


def _sum(df: pd.DataFrame, cols) -> pd.Series:
    """Row sums of the columns present, NaN where every one of them is missing."""
    vals = pd.DataFrame({c: pd.to_numeric(df[c], errors="coerce") if c in df else np.nan for c in cols}, index=df.index)
    return vals.sum(axis=1, min_count=1)


def cost_per_run(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest run of each cell: its section, kind, batch size, status and seconds."""
    d, _ = newest(runs)
    out = d[["cell_id", "section", "kind", "batch_size", "status"]].copy()
    for col, keys in parts():
        out[col] = _sum(d, [f"metrics.{k}" for k in keys])
    out["wall_s"], out["cpu_s"] = _sum(out, WALL), _sum(out, CPU)
    return out.sort_values(["section", "kind", "cell_id"], kind="stable").reset_index(drop=True)


def cost_per_section(per_run: pd.DataFrame) -> pd.DataFrame:
    """Runs and summed seconds (and hours) per study section, and the whole study."""
    cols = [c for c, _ in parts()] + ["wall_s", "cpu_s"]
    g = per_run.groupby("section", sort=True)
    out = g[cols].sum(min_count=1).assign(runs=g.size()).reset_index()
    total = per_run[cols].sum(min_count=1).to_frame().T.assign(section="study", runs=len(per_run))
    out = pd.concat([out, total], ignore_index=True)
    out["wall_h"], out["cpu_h"] = out["wall_s"] / 3600, out["cpu_s"] / 3600
    return out[["section", "runs", *cols, "wall_h", "cpu_h"]]


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """A cost table as a reader's table shows it (:data:`SHOWN_DECIMALS`)."""
    return table.round({c: n for c, n in SHOWN_DECIMALS.items() if c in table.columns})


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    per_run = cost_per_run(runs)
    if per_run[["wall_s", "cpu_s"]].isna().all().all():
        return None
    per_section = cost_per_section(per_run)
    out = SectionOutput("cost", "Cost: wall and CPU seconds", "")
    note = (
        "wall = pretraining (over resumes) + probes; other = a baseline's whole job, an MI row's training and "
        "readout; CPU = the same steps' process CPU time, every thread; blank: not logged"
    )
    runs_files = ctx.write_table("cost_runs", "Wall and CPU seconds per run", per_run, [(None, shown(per_run))], note)
    files = ctx.write_table(
        "cost_study",
        "Wall and CPU seconds per section and for the study",
        per_section,
        [(None, shown(per_section))],
        note,
    )
    out.files += runs_files + files
    shown_section = shown(per_section)[["section", "runs", "wall_s", "cpu_s", "wall_h", "cpu_h"]]
    out.markdown = (
        f"Per section: {ctx.table_links(files)}; per run: {ctx.table_links(runs_files)}\n\n"
        + markdown_table(shown_section)
    )
    return out
