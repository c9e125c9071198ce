"""Section 'diverged': every run with a bad outcome (diverged, collapsed, failed), listed as a result."""

from __future__ import annotations

import math

import pandas as pd

from ...tracking import BAD_STATUSES
from ..context import ReportContext, SectionOutput
from ..runs import failed_attempts, newest
from ..tables import markdown_table

_COLUMNS = [
    "cell_id",
    "status",
    "section",
    "kind",
    "dataset",
    "loss",
    "temperature",
    "batch_size",
    "seed",
    "last_train_loss",
    "run_id",
]


def bad_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The run of each cell id the tables use (:func:`~smallbatch.report.runs.newest`) whose status
    is bad, and each failed run newer than it (a rerun that crashed), with its last logged training loss."""
    d, _ = newest(runs)
    d = pd.concat([d[d["status"].isin(BAD_STATUSES)], failed_attempts(runs)])
    d = d.assign(last_train_loss=d.get("metrics.train/loss", pd.Series(math.nan, index=d.index)))[_COLUMNS]
    return d.sort_values(["section", "cell_id"], kind="stable").reset_index(drop=True)


def _words(collapsed: bool) -> dict[str, str]:
    """The section's wording; 'collapsed' is named only where a run collapsed."""
    if not collapsed:
        return {
            "title": "Diverged and failed runs",
            "caption": "Runs that diverged or failed",
            "note": "a diverged run gives no accuracy; its cell reads 'diverged' in every table",
            "none": "No run diverged or failed.",
        }
    return {
        "title": "Diverged, collapsed and failed runs",
        "caption": "Runs that diverged, collapsed or failed",
        "note": "a diverged or collapsed run gives no accuracy; its cell reads 'diverged' ('collapsed') in every table",
        "none": "No run diverged, collapsed or failed.",
    }


def _finding(d: pd.DataFrame) -> str:
    n = {s: int((d["status"] == s).sum()) for s in BAD_STATUSES}
    collapsed = f", {n['collapsed']} collapsed" if n["collapsed"] else ""
    return f"{n['diverged']} run(s) diverged{collapsed} and {n['failed']} failed; they are listed, not dropped."


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    d = bad_runs(runs)
    words = _words(bool((d["status"] == "collapsed").any()))
    out = SectionOutput("diverged", words["title"], "")
    files = ctx.write_table("diverged_runs", f"{words['caption']} (they count as results)", d, note=words["note"])
    out.files += files
    if d.empty:
        out.markdown = f"{words['none']} ({ctx.table_links(files)})\n"
    else:
        out.findings.append(_finding(d))
        out.markdown = f"{len(d)} run(s): {ctx.table_links(files)}\n\n" + markdown_table(
            d.drop(columns=["run_id"]).rename(columns={"temperature": "τ"})
        )
    return out
