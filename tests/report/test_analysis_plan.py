"""The analysis plan (:mod:`smallbatch.report.plan`) on contrast rows written out by hand: which rows
are claimed, the margin resolved from the control or the supervised range, Holm over the family for
significance and TOST alike, and each claim's outcome -- every expectation computed here from the
rows' own numbers with the textbook formulas."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats

from smallbatch.report.plan import AnalysisPlan, apply_plan, default_mapping


def _row(key, metric, diff, p, *, ds="ds", budget="ep8", view="epochs", se=0.1, n=6, frac=math.nan):
    half = stats.t.ppf(0.975, n - 1) * se
    return {
        "dataset": ds,
        "temperature": 0.1,
        "budget": budget,
        "view": view,
        "metric": metric,
        "key": key,
        "diff": diff,
        "lo": diff - half,
        "hi": diff + half,
        "p": p,
        "seeds": n,
        "test": "paired t",
        "fraction_of_supervised_gap": frac,
    }


def _plan(**kw) -> AnalysisPlan:
    base = {
        "primary": "linear",
        "secondary": [],
        "claims": ["negatives", "steps", "interaction"],
        "margin": 0.5,
        "margin_scale": "points",
        "family": "study",
    }
    return AnalysisPlan.from_mapping({**base, **kw})


def _tost(diff, se, df, margin):
    return max(stats.t.sf((diff + margin) / se, df), stats.t.cdf((diff - margin) / se, df))


def _holm_by_hand(ps: list[float]) -> list[float]:
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adj, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return adj


def test_holm_runs_over_the_claimed_rows_only_for_significance_and_tost_alike():
    rows = pd.DataFrame(
        [
            _row("negatives", "linear", 0.05, 0.01),
            _row("steps", "linear", 1.0, 0.04),
            _row("interaction", "linear", 0.25, 0.03),  # raw TOST p 0.027: equivalent only before the correction
            _row("negatives", "linear", 0.0, 0.9, budget="ep2"),
            _row("negatives", "knn200", 2.0, 0.001),  # a probe outside the plan: descriptive
            _row("small_large", "linear", 2.0, 0.001),  # a contrast the plan does not claim
        ]
    )
    out = apply_plan(_plan(), rows)
    assert list(out["claimed"]) == [True] * 4 + [False, False]
    assert list(out["role"]) == ["primary"] * 4 + ["descriptive", "primary"]
    # Holm by hand over the four claims: p 0.01, 0.04, 0.03, 0.9 -> 0.04, 0.09, 0.09, 0.9
    assert out["p_family"].tolist()[:4] == pytest.approx([0.04, 0.09, 0.09, 0.9])
    assert out["p_family"].iloc[4:].isna().all() and set(out["family"].iloc[:4]) == {4}
    tost = [_tost(d, 0.1, 5, 0.5) for d in (0.05, 1.0, 0.25, 0.0)]
    assert out["tost_p"].tolist()[:4] == pytest.approx(tost, rel=1e-6)
    assert tost[2] < 0.05 <= _holm_by_hand(tost)[2]
    assert out["tost_family"].tolist()[:4] == pytest.approx(_holm_by_hand(tost), rel=1e-6)
    assert list(out["outcome"]) == ["significant", "unresolved", "unresolved", "equivalent"] + ["descriptive"] * 2


def test_a_relative_margin_is_resolved_from_the_rows_own_control_and_range():
    rows = pd.DataFrame(
        [
            _row("control", "linear", -0.8, 0.001),
            _row("negatives", "linear", 0.3, 0.2, frac=0.1),  # supervised - random-init = 0.3 / 0.1 = 3 points
            _row("negatives", "linear", 0.3, 0.2, budget="ep2"),  # no control at this budget
        ]
    )
    control = apply_plan(_plan(margin=0.5, margin_scale="control"), rows)
    assert control["margin"].iloc[1] == pytest.approx(0.4) and math.isnan(control["margin"].iloc[2])
    assert control["tost_p"].iloc[1] == pytest.approx(_tost(0.3, 0.1, 5, 0.4), rel=1e-6)
    # an unresolved margin keeps its claim in the family, at TOST p 1
    assert control["tost_family"].iloc[2] == 1.0 and control["outcome"].iloc[2] == "unresolved"
    span = apply_plan(_plan(margin=0.1, margin_scale="span"), rows)
    assert span["margin"].tolist() == pytest.approx([0.3, 0.3, 0.3])


def test_the_family_is_the_whole_study_or_each_data_set():
    rows = pd.DataFrame(
        [
            _row("negatives", "linear", 0.1, 0.02, ds=ds, budget=b)
            for ds, b in (("a", "ep2"), ("a", "ep4"), ("b", "ep2"))
        ]
    )
    assert set(apply_plan(_plan(), rows)["family"]) == {3}
    per = apply_plan(_plan(family="dataset"), rows)
    assert per["family"].tolist() == [2, 2, 1]
    assert per["p_family"].tolist() == pytest.approx([0.04, 0.04, 0.02])


def test_the_plan_refuses_a_value_outside_its_vocabulary_naming_the_key():
    with pytest.raises(ValueError, match=r"analysis\.claims: 'negative' is not one of"):
        _plan(claims=["negative"])
    with pytest.raises(ValueError, match=r"analysis\.margin: .* must be a positive number"):
        _plan(margin=0.0)


def test_the_schema_states_the_default_plan():
    """The default a study gets when its config says nothing (written out: a change is deliberate)."""
    assert default_mapping() == {
        "primary": "linear",
        "secondary": ["knn20"],
        "claims": ["negatives", "steps", "interaction", "negatives_at_large", "negatives_at_small"],
        "margin": 0.5,
        "margin_scale": "control",
        "family": "study",
    }


def test_one_test_read_in_both_views_is_one_member_of_the_family():
    """The negatives effect at the reference batch is the same seeds' numbers at fixed epochs and at
    fixed steps: one test, not two (its twin gets the same adjusted p)."""
    rows = pd.DataFrame(
        [
            _row("negatives_at_large", "linear", 0.1, 0.02, view="epochs"),
            _row("negatives_at_large", "linear", 0.1, 0.02, view="steps"),
            _row("steps", "linear", 1.0, 0.04, view="steps"),
        ]
    )
    out = apply_plan(_plan(claims=["negatives_at_large", "steps"]), rows)
    assert set(out["family"]) == {2}
    assert out["p_family"].tolist() == pytest.approx([0.04, 0.04, 0.04])


def test_a_study_with_no_tested_claim_gets_untested_claims_not_a_crash():
    """One seed gives no p (no test): the plan marks every claim untested, with no family, and a data
    set whose claims are all untested sits beside one whose are tested."""
    rows = pd.DataFrame(
        [
            _row("negatives", "linear", -0.3, math.nan, n=1, ds="one_seed"),
            _row("steps", "linear", -1.0, math.nan, n=1, ds="one_seed"),
            _row("steps", "linear", -1.0, 0.01, ds="six_seeds"),
        ]
    )
    for family in ("study", "dataset"):
        out = apply_plan(_plan(family=family), rows)
        assert out["outcome"].tolist() == ["untested", "untested", "significant"]
        assert out["family"].tolist() == [0, 0, 1]


def test_a_bad_plan_on_the_command_line_is_refused_in_one_line_before_the_store_is_read(tmp_path, capsys):
    from smallbatch.pipeline import cli

    store = f"sqlite:///{tmp_path / 'none.db'}"  # never created: the plan is checked first
    for text, want in (
        ('{"margin": -1}', "analysis.margin"),
        ('{"claims": ["negative"]}', "analysis.claims"),
        ("[1]", "--analysis: must be a JSON object"),
        ("{", "--analysis: not JSON"),
    ):
        rc = cli.main(["report", "--tracking-uri", store, "--out", str(tmp_path / "r"), "--analysis", text])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and want in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "r").exists()


def test_every_recorded_claims_table_is_what_the_plan_computes_from_its_record_today():
    """The README quotes the records' claims tables: each must equal a fresh application of the
    default plan to its record's contrast table (a change of the plan's code regenerates them)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "record_claims.py"
    spec = importlib.util.spec_from_file_location("record_claims", path)
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert sorted(tool.RESULTS.glob("*/instrument_claims.csv")), "the records carry their claims tables"
    assert tool.main(["--all", "--check"]) == 0
