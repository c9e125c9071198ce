"""index.md: the findings, every section's text, the runs in the store, and a link to every file."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pandas as pd

from .context import ReportContext, SectionOutput
from .planned import partial_finding, partial_header, section_note
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


def portable_uri(uri: str, out_dir: Path) -> str:
    """The store's URI as index.md shows it, with no absolute path and no credentials: a SQLite
    file (or a plain path) relative to the report folder, a server's URI without its user and
    password.  A copied or moved study's report then names its own store."""
    if uri.startswith("sqlite:///"):
        path, _, query = uri[len("sqlite:///") :].partition("?")
        return "sqlite:///" + _relative(path, out_dir) + (f"?{query}" if query else "")
    parts = urlsplit(uri)
    if uri in ("databricks", "databricks-uc"):
        return uri
    if parts.scheme in ("", "file"):  # a folder store: its path (MLflow reads a plain path as one)
        return _relative(parts.path, out_dir)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _relative(path: str, out_dir: Path) -> str:
    """``path`` (absolute, or relative to the working directory) relative to ``out_dir``."""
    try:
        return os.path.relpath(Path(path).resolve(), Path(out_dir).resolve())
    except ValueError:  # another drive: its name only
        return Path(path).name


def _bullet(finding: str) -> str:
    """A finding as a list item: its later lines (a table, a note) indented to stay inside the item."""
    first, *rest = finding.split("\n")
    return "\n".join([f"- {first}", *(f"  {line}" if line else "" for line in rest)])


def index_markdown(runs: pd.DataFrame, ctx: ReportContext, outputs: list[SectionOutput]) -> str:
    counts = runs.groupby(["section", "kind", "status"], sort=True).size().reset_index(name="runs")
    store = portable_uri(ctx.tracking_uri, ctx.out_dir)
    rebuild = shlex.join(
        ["smallbatch", "report", "--tracking-uri", store, "--experiment", ctx.experiment, "--out", "."]
    )
    md = [
        "# smallbatch report",
        "",
        f"Experiment `{ctx.experiment}` in the store `{store}` (a path here is relative to this folder): "
        f"{len(runs)} runs. Everything below is computed from the MLflow store alone; rebuild it from this "
        f"folder with `{rebuild}`.",
        "",
        *partial_header(ctx.planned),
        "## Findings",
        "",
    ]
    findings = [f for f in [partial_finding(ctx.planned)] + [f for o in outputs for f in o.findings] if f]
    md += [_bullet(f) for f in findings]
    if not any(o.findings for o in outputs):
        md.append("- Too few runs with results to state a finding.")
    md.append("")
    for o in outputs:
        note = section_note(ctx.planned, o.name)
        md += [f"## {o.title}", "", *([note, ""] if note else []), o.markdown, ""]
    md += ["## Runs in the store", "", markdown_table(counts), ""] + _uncovered(runs, outputs)
    md += [f"- {n}" for n in ctx.notes]
    md += ["", "## All files", ""] + [f"- [{ctx.rel(p)}]({ctx.rel(p)})" for o in outputs for p in o.files]
    md.append("")
    return "\n".join(md)
