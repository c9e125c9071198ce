"""The study's plan against the runs in the store: how many planned cells finished, and which
never ran, so a report of a study stopped early says it is partial instead of reading as a
smaller plan (index.md's header, a finding, and a line atop each section with cells missing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..tracking import BAD_STATUSES, STATUS_FINISHED
from .fmt import join, short

#: the statuses of a cell that ran to an outcome (a diverged or collapsed cell is a result too)
DONE_STATUSES = (STATUS_FINISHED, *(s for s in BAD_STATUSES if s != "failed"))


@dataclass(frozen=True)
class PlanStatus:
    """``planned`` and ``finished`` counts of the study and per report section (its name ->
    (finished, planned)); ``missing`` the plan's entries of the cells not finished."""

    planned: int
    finished: int
    sections: dict[str, tuple[int, int]] = field(default_factory=dict)
    missing: list[dict[str, Any]] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return self.finished < self.planned


def section_of(entry: dict[str, Any]) -> str:
    """The report section an entry of the plan is shown in: its experiment, the baselines' own."""
    return "baselines" if entry.get("kind") == "baseline" else str(entry.get("section") or "grid")


def plan_status(runs: pd.DataFrame, plan: dict[str, Any] | None) -> PlanStatus | None:
    """The plan (``tracking.recorded_plan``) against ``runs`` (the report's runs): a planned cell is
    finished when a run of its id and hash ended with a result.  None without a plan."""
    if not plan:
        return None
    done_runs = runs[runs["status"].isin(DONE_STATUSES)] if "cell_hash" in runs else runs.iloc[:0]
    done = set(zip(done_runs["cell_id"], done_runs["cell_hash"], strict=True))
    sections: dict[str, tuple[int, int]] = {}
    missing = []
    for entry in plan["cells"]:
        ok = (entry["id"], entry["hash"]) in done
        f, n = sections.get(section_of(entry), (0, 0))
        sections[section_of(entry)] = (f + ok, n + 1)
        if not ok:
            missing.append(entry)
    planned = len(plan["cells"])
    return PlanStatus(planned, planned - len(missing), sections, missing)


def _span(missing: list[dict[str, Any]]) -> str:
    """What the cells not finished span: their data sets, losses and batch sizes."""
    parts = []
    for key, one, many in (
        ("dataset", "data set", "data sets"),
        ("loss", "loss", "losses"),
        ("batch_size", "batch size", "batch sizes"),
    ):
        values = sorted({e[key] for e in missing if e.get(key) is not None})
        if values:
            parts.append(f"{one if len(values) == 1 else many} {join([short(v) for v in values])}")
    return f" ({'; '.join(parts)})" if parts else ""


def partial_header(status: PlanStatus | None) -> list[str]:
    """index.md's lines under its title for a partial study (none for a whole one)."""
    if status is None or not status.partial:
        return []
    left = status.planned - status.finished
    return [
        f"**Partial study: {status.finished} of {status.planned} planned cells finished**; {left} never ran or did "
        f"not finish{_span(status.missing)}. Every table, figure and finding below covers the finished cells only, "
        "not the plan: run the study again to resume it (finished cells are kept).",
        "",
    ]


def partial_finding(status: PlanStatus | None) -> str | None:
    """The first finding of a partial study."""
    if status is None or not status.partial:
        return None
    return (
        f"The study is partial: {status.finished} of {status.planned} planned cells finished, so the findings "
        "below describe those cells, not the planned study."
    )


def section_note(status: PlanStatus | None, name: str) -> str | None:
    """A section's first line when some of its planned cells did not finish."""
    if status is None or name not in status.sections:
        return None
    f, n = status.sections[name]
    return None if f >= n else f"*Partial: {f} of {n} planned cells of this section finished.*"
