"""The instrument section against designed arms: a penalty that lives in the negatives part, a
null bounded below 0.5 points, and a null the seeds cannot bound."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from smallbatch.report.context import ReportContext
from smallbatch.report.sections import instrument

SEEDS = range(5)
#: per-seed noise shared by every arm of one seed (pairing removes it) plus a little of each arm's own
SHARED = [0.9, -1.1, 0.4, -0.3, 0.1]
OWN = {
    "infonce@16": [0.05, -0.04, 0.02, -0.03, 0.0],
    "infonce@256": [-0.02, 0.03, 0.0, 0.04, -0.05],
    "infonce@256/G": [0.01, 0.02, -0.04, 0.0, 0.01],
    "dcl@16": [0.0, 0.03, -0.02, 0.01, -0.02],
    "sogclr@16": [0.02, -0.01, 0.0, -0.03, 0.02],
}
ARM_PARAMS = {
    "infonce@16": ("infonce", 16, "None"),
    "infonce@256": ("infonce", 256, "None"),
    "infonce@256/G": ("infonce", 256, "16"),
    "dcl@16": ("dcl", 16, "None"),
    "sogclr@16": ("sogclr", 16, "None"),
}


def _runs(means: dict[str, dict[str, float]], own_scale: dict[str, float]) -> pd.DataFrame:
    rows = []
    for ds, arms in means.items():
        for (arm, mean), s in itertools.product(arms.items(), SEEDS):
            loss, bs, group = ARM_PARAMS[arm]
            v = mean + SHARED[s] + own_scale[ds] * OWN[arm][s]
            rows.append(
                {
                    "run_id": f"{ds}-{arm}-{s}",
                    "kind": "cell",
                    "status": "FINISHED",
                    "section": "instrument",
                    "cell_id": f"instrument/{ds}/{arm}-s{s}",
                    "start_time": 1,
                    "dataset": ds,
                    "loss": loss,
                    "batch_size": bs,
                    "temperature": 0.1,
                    "seed": s,
                    "baseline": None,
                    "params.neg_group": group,
                    "params.mask_same_class": "False",
                    **{f"metrics.{key}": v for key, _ in instrument.METRICS.values()},
                }
            )
    for ds, (name, mean) in itertools.product(means, (("random_init", 40.0), ("supervised", 70.0))):
        for s in (0, 1):
            rows.append(
                {
                    "run_id": f"{ds}-{name}-{s}",
                    "kind": "baseline",
                    "status": "FINISHED",
                    "section": "baseline",
                    "cell_id": f"baselines/{ds}/{name}-s{s}",
                    "start_time": 1,
                    "dataset": ds,
                    "loss": None,
                    "batch_size": np.nan,
                    "temperature": np.nan,
                    "seed": s,
                    "baseline": name,
                    **{f"metrics.{key}": mean + 0.3 * s for key, _ in instrument.METRICS.values()},
                }
            )
    return pd.DataFrame(rows)


DESIGN = {
    # the penalty is all negatives: grouped loses what small loses, at the large batch's steps
    "negatives": {"infonce@16": 58.0, "infonce@256": 60.0, "infonce@256/G": 58.0, "dcl@16": 60.0, "sogclr@16": 60.0},
    "null": {arm: 60.0 for arm in OWN},
}


def _rows(own_scale=None):
    own_scale = own_scale or {"negatives": 1.0, "null": 1.0}
    runs = _runs(DESIGN, own_scale)
    cells = runs[runs["kind"] == "cell"].assign(arm=lambda d: [instrument.arm_of(r) for _, r in d.iterrows()])
    vals, base = instrument.arm_values(cells, 100.0 / 100.0), instrument._baseline_values(runs, 1.0)
    return instrument.contrast_rows(vals, base, sorted(DESIGN)), runs


def _by(rows, ds, name, metric="linear"):
    return next(r for r in rows if r["dataset"] == ds and r["contrast"] == name and r["metric"] == metric)


def test_a_penalty_of_negatives_is_found_and_attributed_to_the_negatives_part():
    rows, _ = _rows()
    small_large = _by(rows, "negatives", "small − large")
    neg, steps = (
        _by(rows, "negatives", "negatives part (grouped − large)"),
        _by(rows, "negatives", "steps part (small − grouped)"),
    )
    assert small_large["diff"] == pytest.approx(-2.0, abs=0.1) and small_large["significant"]
    assert neg["diff"] == pytest.approx(-2.0, abs=0.1) and neg["significant"]
    assert steps["diff"] == pytest.approx(0.0, abs=0.1) and not steps["significant"]
    # the decomposition is exact seed by seed
    assert small_large["diff"] == pytest.approx(neg["diff"] + steps["diff"], abs=1e-9)
    text = " ".join(instrument.findings(rows))
    assert "negatives: a small-batch penalty" not in text  # the data set name is not part of the verdict
    assert "On negatives (linear probe), InfoNCE small − large" in text and "a small-batch penalty" in text
    assert "its negatives part" in text and "— significant" in text and "its steps part" in text


def test_a_null_with_tight_seeds_is_bounded_and_a_noisy_one_is_not():
    rows, _ = _rows()
    e = _by(rows, "null", "small − large")
    assert not e["significant"] and e["bounded"] and e["hi"] - e["lo"] < 2 * instrument.BOUND
    text = " ".join(instrument.findings(rows))
    assert (
        "bounds it below 0.5 points" in text and "its negatives part" in text and "— bounded below 0.5 points" in text
    )
    noisy, _ = _rows({"negatives": 1.0, "null": 40.0})
    e = _by(noisy, "null", "small − large")
    assert not e["significant"] and not e["bounded"] and e["mde"] > instrument.BOUND
    assert "not bounded below 0.5 points (MDE at 80 % power" in " ".join(instrument.findings(noisy))


def test_contrasts_are_holm_adjusted_within_one_probe_and_scaled_by_the_supervised_gap():
    rows, _ = _rows()
    lin = [r for r in rows if r["metric"] == "linear"]
    assert len(lin) == 2 * 5  # two data sets x five contrasts (no oracle arm)
    assert all(r["p_holm"] >= r["p"] for r in lin if np.isfinite(r["p"]))
    assert {r["estimate"].family for r in lin} == {len([r for r in lin if r["estimate"].tested])}
    r = _by(rows, "negatives", "small − large")
    assert r["fraction_of_supervised_gap"] == pytest.approx(r["diff"] / 30.0)


def test_the_section_writes_its_tables_figure_and_findings(tmp_path):
    _, runs = _rows()
    ctx = ReportContext(
        out_dir=tmp_path, tracking_uri="", experiment="x", reader=None, scale=1.0, papers=pd.DataFrame(), runs=runs
    )
    out = instrument.build(runs, ctx)
    names = {p.name for p in out.files}
    assert {
        "instrument_arms.csv",
        "instrument_contrasts.md",
        "instrument_arms.png",
        "instrument_arms.svg",
        "instrument_contrasts.png",
    } <= names
    assert any(s.startswith("Self-supervision on negatives (10 % labels") for s in out.findings)
    ssl = pd.read_csv(tmp_path / "tables" / "instrument_ssl.csv")
    row = ssl[(ssl["dataset"] == "negatives") & (ssl["metric"] == "linear") & (ssl["baseline"] == "random_init")]
    # InfoNCE@256 = 60 + seed noise, random-init 40.0/40.3 over two seeds: the Welch difference of the means
    assert row["diff"].iloc[0] == pytest.approx(60.0 + np.mean(SHARED) + np.mean(OWN["infonce@256"]) - 40.15)
    assert "InfoNCE B=256, G=16" in (tmp_path / "tables" / "instrument_arms.md").read_text()


def _control_runs() -> pd.DataFrame:
    """One data set, 4 seeds: InfoNCE at B=16 and 256 at lr 1e-3 (the common one: most cells),
    B=16 at lr 3e-4 (validation best at 16) and 3e-3, B=256 at 3e-3 (validation best at 256),
    B=16 stopped at B=256's steps, B=16 with the oracle mask. Test top-1 = validation top-1 + 1."""
    arms = {  # (batch size, lr, steps, oracle): validation mean
        (16, 1e-3, None, False): 60.0,
        (256, 1e-3, None, False): 59.0,
        (16, 3e-4, None, False): 62.0,
        (16, 3e-3, None, False): 58.0,
        (256, 3e-3, None, False): 61.0,
        (16, 1e-3, 195, False): 50.0,
        (16, 1e-3, None, True): 60.5,
        (256, 1e-3, None, False, "G"): 59.0,
    }
    rows = []
    for key, val in arms.items():
        bs, lr, steps, oracle = key[:4]
        for s in range(4):
            v = val + SHARED[s] + 0.05 * OWN["infonce@16"][s]
            rows.append(
                {
                    "run_id": f"{key}-{s}",
                    "kind": "cell",
                    "status": "FINISHED",
                    "section": "instrument",
                    "cell_id": f"instrument/ds/{key}-s{s}",
                    "start_time": 1,
                    "dataset": "ds",
                    "loss": "infonce",
                    "batch_size": bs,
                    "temperature": 0.1,
                    "seed": s,
                    "baseline": None,
                    "params.neg_group": "16" if len(key) > 4 else "None",
                    "params.mask_same_class": str(oracle),
                    "params.steps": str(steps),
                    "params.lr": str(lr),
                    f"metrics.{instrument.VAL_METRIC}": v,
                    **{f"metrics.{k}": v + 1.0 for k, _ in instrument.METRICS.values()},
                }
            )
    return pd.DataFrame(rows)


def test_controls_name_their_arms_choose_the_lr_on_validation_and_state_their_contrasts(tmp_path):
    runs = _control_runs()
    common = instrument.base_lr(runs)
    assert common == pytest.approx(1e-3)
    cells = runs.assign(arm=[instrument.arm_of(r, common) for _, r in runs.iterrows()])
    assert set(cells["arm"]) == {
        "infonce@16",
        "infonce@256",
        "infonce@16/lr0.0003",
        "infonce@16/lr0.003",
        "infonce@256/lr0.003",
        "infonce@16/S",
        "infonce@16/oracle",
        "infonce@256/G",
    }
    lrs = instrument.lr_table(cells, 1.0)
    chosen = lrs[lrs["chosen"]].set_index("batch_size")["arm"].to_dict()
    assert chosen == {16: "infonce@16/lr0.0003", 256: "infonce@256/lr0.003"}  # the best validation, not test
    assert instrument.validated_contrasts(lrs) == {
        "ds": {instrument.VALIDATED_LR: [(1.0, "infonce@16/lr0.0003"), (-1.0, "infonce@256/lr0.003")]}
    }
    vals = instrument.arm_values(cells, 1.0)
    rows = instrument.contrast_rows(vals, {}, ["ds"], instrument.validated_contrasts(lrs))
    assert _by(rows, "ds", instrument.VALIDATED_LR)["diff"] == pytest.approx(1.0, abs=0.05)
    assert _by(rows, "ds", "small − large, equal steps")["diff"] == pytest.approx(-9.0, abs=0.05)
    assert _by(rows, "ds", "oracle − plain, InfoNCE@16")["diff"] == pytest.approx(0.5, abs=0.05)
    text = " ".join(instrument.control_findings(rows, lrs))
    assert "at equal optimiser steps" in text and "B=16: lr 0.0003, B=256: lr 0.003" in text
    assert "oracle − plain" in text
    ctx = ReportContext(
        out_dir=tmp_path, tracking_uri="", experiment="x", reader=None, scale=1.0, papers=pd.DataFrame(), runs=runs
    )
    out = instrument.build(runs, ctx)
    assert "instrument_lr.csv" in {p.name for p in out.files}
    assert "InfoNCE B=16, equal steps" in (tmp_path / "tables" / "instrument_arms.md").read_text()
