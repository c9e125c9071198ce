"""The analysis plan applied to a recorded instrument study: ``instrument_claims.csv`` beside its tables.

A record under ``benchmarks/results/`` keeps the report tables of a study whose store is gone
(``instrument_contrasts.csv``: every contrast with its raw test; ``instrument_gates.csv``;
``instrument_arms.csv``).  The plan (:mod:`smallbatch.report.plan`) needs only those rows, so this
script re-analyses a record with the same code the report runs: the gates G1–G3 from the gates
table (a gate that did not pass withholds every verdict of its data set, τ and budget), the
reference arm each contrast is read against (InfoNCE at the largest plain batch at the rate its
unit read, from the arms table), then the plan's margin, family and outcome.  The README's
instrument findings quote these files, one row each (``tests/test_readme.py`` binds them).

    python tools/record_claims.py benchmarks/results/2026-12-03-instrument-fmnist-factorial
    python tools/record_claims.py --all          # every record folder with a contrasts table
    python tools/record_claims.py --all --check  # exit 1 if a written file differs from a fresh one

The plan is the schema's default (``analysis`` in CONFIGURATION.md) unless ``--plan FILE`` names a
YAML file whose ``analysis`` key replaces it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import yaml

from smallbatch.report.fmt import csv_number, short
from smallbatch.report.plan import AnalysisPlan, apply_plan
from smallbatch.report.sections.instrument import arm_label

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CLAIMS = "instrument_claims.csv"
#: the columns a claims table keeps (the contrasts table's identity and test, the plan's verdict)
COLUMNS = [
    "dataset",
    "temperature",
    "budget",
    "epochs",
    "steps",
    "view",
    "unit",
    "metric",
    "key",
    "contrast",
    "reference",
    "diff",
    "lo",
    "hi",
    "p",
    "seeds",
    "mde",
    "role",
    "claimed",
    "margin",
    "tost_p",
    "p_family",
    "tost_family",
    "family",
    "outcome",
    "gates_passed",
]


def gates_passed(gates: pd.DataFrame) -> dict[tuple, bool]:
    """(dataset, τ, budget) -> whether G1, G2 and G3 all passed (a post-hoc G4 row is not a gate)."""
    g = gates[gates["gate"].isin(["G1", "G2", "G3"])]
    out = {}
    for (ds, tau, budget), rows in g.groupby(["dataset", "temperature", "budget"], sort=False):
        out[(ds, float(tau), budget)] = len(rows) == 3 and bool((rows["passed"] == "yes").all())
    return out


def references(arms: pd.DataFrame) -> dict[tuple, str]:
    """(dataset, τ, budget) -> the reference arm as a claim names it: arm, rate, τ and seeds."""
    plain = arms[arms["arm"].str.fullmatch(r"infonce@\d+") & arms["read"] & (arms["metric"] == "linear")]
    out = {}
    for (ds, tau, budget), g in plain.groupby(["dataset", "temperature", "budget"], sort=False):
        top = g.iloc[int(g["arm"].str.split("@").str[1].astype(int).argmax())]
        out[(ds, float(tau), budget)] = (
            f"{arm_label(top['arm'])}, lr {short(float(top['lr']))}, τ {short(float(tau))}, {int(top['seeds'])} seeds"
        )
    return out


def claims(folder: Path, plan: AnalysisPlan) -> pd.DataFrame:
    """The record's contrasts with the plan applied (see the module docstring)."""
    c = pd.read_csv(folder / "instrument_contrasts.csv")
    g = pd.read_csv(folder / "instrument_gates.csv")
    ref = references(pd.read_csv(folder / "instrument_arms.csv"))
    ok = gates_passed(g)
    keys = list(zip(c["dataset"], c["temperature"].astype(float), c["budget"]))
    c["gates_passed"] = [ok.get(k, False) for k in keys]
    c["reference"] = [ref.get(k, "—") for k in keys]
    return apply_plan(plan, c)[COLUMNS]


def _text(df: pd.DataFrame) -> str:
    return df.to_csv(index=False, float_format=csv_number)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", type=Path, help="record folders (with instrument_contrasts.csv)")
    ap.add_argument("--all", action="store_true", help="every record folder under benchmarks/results")
    ap.add_argument("--plan", type=Path, help="a YAML file whose `analysis` key is the plan")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a claims file differs")
    args = ap.parse_args(argv)
    mapping = yaml.safe_load(args.plan.read_text())["analysis"] if args.plan else None
    plan = AnalysisPlan.from_mapping(mapping)
    folders = list(args.folders)
    if args.all:
        folders += sorted(p.parent for p in RESULTS.glob("*/instrument_gates.csv"))
    stale = 0
    for folder in folders:
        text, path = _text(claims(folder, plan)), folder / CLAIMS
        if args.check:
            same = path.is_file() and path.read_text(encoding="utf-8") == text
            stale += not same
            print(f"{'ok' if same else 'differs'}: {path}")
        else:
            path.write_text(text, encoding="utf-8")
            print(f"written: {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
