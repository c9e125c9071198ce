"""The study's plan as recorded when a run of the workflow starts: every planned cell and
baseline (id, hash, section, shape), so a report of a study stopped early can say what never ran.

The workflow writes it (``plan.json``) into the results folder, beside the default SQLite store,
before any job runs; the report finds it beside the store it reads, or in the results folder
it is given.  A plan of another study (its ``study`` is not the experiment read) is none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .sqlite import sqlite_file

#: the plan's file name, in the results folder
PLAN_FILE = "plan.json"


def plan_candidates(uri: str, results_dir: str | Path | None = None) -> list[Path]:
    """Where a study's plan may lie: beside a SQLite store's file, then in ``results_dir``."""
    db = sqlite_file(uri)
    found = [] if db is None else [Path(str(db).split("?", 1)[0]).parent / PLAN_FILE]
    return found + ([Path(results_dir) / PLAN_FILE] if results_dir is not None else [])


def recorded_plan(uri: str, experiment: str, results_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The plan recorded for study ``experiment`` (``{"study", "cells": [...]}``, each entry with its
    ``id``, ``hash``, ``kind`` and ``section``), or None where none is found or readable."""
    for path in plan_candidates(uri, results_dir):
        try:
            plan = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(plan, dict) and plan.get("study") == experiment and isinstance(plan.get("cells"), list):
            return plan
    return None
