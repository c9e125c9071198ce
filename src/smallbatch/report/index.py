"""index.md: the findings, every section's text, the runs in the store, and a link to every file."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .context import ReportContext, SectionOutput
from .tables import markdown_table


def _uncovered(runs: pd.DataFrame, outputs: list[SectionOutput]) -> list[str]:
    covered = set().union(*(o.run_ids for o in outputs)) if outputs else set()
    uncovered = runs[~runs["run_id"].isin(covered)]
    if uncovered.empty:
        return []
    g = uncovered.groupby(["section", "kind"], sort=True).size()
    return [
        "Runs no report section covers yet (no builder registered in `smallbatch.report.SECTIONS`, "
        "or superseded/incomplete): "
        + "; ".join(f"{n} of experiment '{s}' (kind '{k}')" for (s, k), n in g.items())
        + ".",
        "",
    ]


def _bullet(finding: str) -> str:
    """A finding as a list item: its later lines (a table, a note) indented to stay inside the item."""
    first, *rest = finding.split("\n")
    return "\n".join([f"- {first}", *(f"  {line}" if line else "" for line in rest)])


def index_markdown(runs: pd.DataFrame, ctx: ReportContext, outputs: list[SectionOutput]) -> str:
    counts = runs.groupby(["section", "kind", "status"], sort=True).size().reset_index(name="runs")
    md = [
        "# smallbatch report",
        "",
        f"Experiment `{ctx.experiment}` at `{ctx.tracking_uri}`: {len(runs)} runs. Everything below is "
        "computed from the MLflow store alone; rebuild with "
        f"`smallbatch report --tracking-uri {ctx.tracking_uri} --out {Path(ctx.out_dir).as_posix()}`.",
        "",
        "## Findings",
        "",
    ]
    md += [_bullet(f) for o in outputs for f in o.findings if f]
    if not any(o.findings for o in outputs):
        md.append("- Too few runs with results to state a finding.")
    md.append("")
    for o in outputs:
        md += [f"## {o.title}", "", o.markdown, ""]
    md += ["## Runs in the store", "", markdown_table(counts), ""] + _uncovered(runs, outputs)
    md += [f"- {n}" for n in ctx.notes]
    md += ["", "## All files", ""] + [f"- [{ctx.rel(p)}]({ctx.rel(p)})" for o in outputs for p in o.files]
    md.append("")
    return "\n".join(md)
