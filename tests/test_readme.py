"""The README's quoted numbers against the reports they come from.

* The default study's block (its table, the batch effect, the detectable effect and the
  Holm-adjusted p) against the report of a default study run on this machine
  (``results/report``, or ``$SMALLBATCH_REPORT``), within the tolerance the README states.
  ``.ci/run`` runs ``make study`` first and sets ``SMALLBATCH_REQUIRE_REPORT=1``, so there a
  missing report fails; elsewhere it skips with the reason.
* Every ``x [lo, hi]`` interval the README quotes from the instrument study against the
  recorded instrument report linked from that paragraph (the study takes an hour: its
  tables are kept under ``benchmarks/results/``), to the README's rounding.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: the README's stated tolerance for another machine: points for accuracies and differences,
#: a factor for the minimum detectable effect (it scales with the seeds' spread)
TOL_POINTS, TOL_FACTOR = 0.5, 1.5
NUM = r"[−+-]?\d+(?:\.\d+)?"


def _f(s: str) -> float:
    return float(s.replace("−", "-"))


def _block(title: str) -> str:
    m = re.search(rf"\*\*{re.escape(title)}\*\*(.*?)(?=\n\*\*|\n## )", README, re.S)
    assert m, f"README has no paragraph starting with **{title}**"
    return m.group(1)


def _report() -> Path:
    rep = Path(os.environ.get("SMALLBATCH_REPORT", ROOT / "results" / "report"))
    if not (rep / "tables" / "baselines.csv").is_file():
        reason = f"no default-study report at {rep} (run `make study` first)"
        if os.environ.get("SMALLBATCH_REQUIRE_REPORT", "") not in ("", "0"):
            pytest.fail(f"SMALLBATCH_REQUIRE_REPORT is set but: {reason}")
        pytest.skip(f"{reason}; SMALLBATCH_REQUIRE_REPORT=1 makes this a failure")
    return rep / "tables"


def _close(quoted: float, measured: float, what: str) -> None:
    assert abs(quoted - measured) <= TOL_POINTS + 1e-9, f"README quotes {what} {quoted}, the report has {measured:.2f}"


def test_readme_states_the_tolerance_this_test_checks():
    block = _block("The default study")
    assert f"{TOL_POINTS:g} points" in block and "detectable" in block, "the README must state the tolerance"


def test_the_default_study_table_matches_the_report():
    tables = _report()
    pattern = rf"^\| ([^|]+?) \| ({NUM}(?:–{NUM})?) \| ({NUM}(?:–{NUM})?) \|$"
    rows = {r[0]: r[1:] for r in re.findall(pattern, _block("The default study"), re.M)}
    cells = next(k for k in rows if k.endswith("pretrained cells"))
    base = pd.read_csv(tables / "baselines.csv")
    for col, metric in enumerate(("knn", "linear")):
        grid = pd.read_csv(tables / f"grid_top1_fashion_mnist_{metric}.csv")
        assert int(cells.split()[0]) == len(grid), "the README's cell count"
        lo, hi = (_f(x) for x in rows[cells][col].split("–"))
        _close(lo, grid["mean"].min(), f"the lowest {metric} cell")
        _close(hi, grid["mean"].max(), f"the highest {metric} cell")
        for label, name in (("raw pixels", "raw_pixels"), ("random-init encoder", "random_init")):
            row = next(k for k in rows if k.startswith(label))
            measured = base[(base["baseline"] == name) & (base["metric"] == metric)]["mean"].iloc[0]
            _close(_f(rows[row][col]), measured, f"{label} {metric}")


def test_the_default_study_batch_effect_matches_the_report():
    tables = _report()
    block = " ".join(_block("The default study").split())
    dep = pd.concat([pd.read_csv(tables / f"grid_dependence_fashion_mnist_{m}.csv") for m in ("knn", "linear")])
    lo, hi = (_f(x) for x in re.search(rf"batch 16 − 256: ({NUM}) to ({NUM}) points", block).groups())
    _close(lo, dep["change_small_minus_large"].min(), "the smallest batch effect")
    _close(hi, dep["change_small_minus_large"].max(), "the largest batch effect")
    p = _f(re.search(rf"every Holm-adjusted p ≥ ({NUM})", block).group(1))
    assert dep["p_holm"].min() >= p * 0.5 and dep["p_holm"].min() > 0.05, "no batch effect may be significant"
    mlo, mhi = (_f(x) for x in re.search(rf"smallest detectable effect is ({NUM})–({NUM}) points", block).groups())
    for quoted, measured in ((mlo, dep["mde_80"].min()), (mhi, dep["mde_80"].max())):
        assert measured / TOL_FACTOR <= quoted <= measured * TOL_FACTOR, f"README MDE {quoted}, report {measured:.2f}"


def test_the_default_study_pooled_batch_effect_matches_the_report():
    tables = _report()
    block = " ".join(_block("The default study").split())
    pool = pd.read_csv(tables / "grid_pooled_fashion_mnist.csv").set_index("metric")
    iv = rf"({NUM}) \[({NUM}), ({NUM})\]"
    m = re.search(
        rf"batch 16 is ahead, {iv} by kNN and {iv} by the linear probe, with (\d+)× the optimiser steps", block
    )
    assert m, "the README states the pooled batch effect and the steps it took"
    for i, metric in enumerate(("knn", "linear")):
        row = pool.loc[metric]
        for quoted, col in zip(m.groups()[3 * i : 3 * i + 3], ("change_small_minus_large", "ci_low", "ci_high")):
            _close(_f(quoted), row[col], f"the pooled {metric} {col}")
        assert row["p_holm"] < 0.05 and row["change_small_minus_large"] > 0, f"'ahead' by {metric}: significant"
    assert int(m.group(7)) == round(pool["steps_smallest"].iloc[0] / pool["steps_largest"].iloc[0])


def test_every_instrument_interval_the_readme_quotes_is_in_its_record():
    block = _block("The instrument")
    record = re.search(r"\]\((benchmarks/results/[^)]+\.md)\)", block)
    assert record, "the instrument paragraph links its record"
    csvs = sorted((ROOT / record.group(1)).with_suffix("").glob("*.csv"))
    assert csvs, f"the record {record.group(1)} keeps its tables in {Path(record.group(1)).with_suffix('')}/"
    known = []
    for csv in csvs:
        t = pd.read_csv(csv)
        if {"diff", "lo", "hi"} <= set(t.columns):
            known += list(zip(t["diff"], t["lo"], t["hi"]))
    quoted = re.findall(rf"({NUM}) \[({NUM}), ({NUM})\]", block)
    assert quoted, "the instrument paragraph quotes its intervals"
    for q in quoted:  # each number to the README's own rounding: half a unit of its last digit
        tol = [0.5 * 10 ** -len(x.partition(".")[2]) + 1e-9 for x in q]
        want = [_f(x) for x in q]
        assert any(all(abs(w - v) <= t for w, v, t in zip(want, row, tol)) for row in known), (
            f"README quotes {' '.join(q)}, which is in no table of {record.group(1)}"
        )
