"""The instrument section against synthetic stores of designed arms: the gates come first and a
failed gate suppresses every sentence about negatives or steps (a store where self-supervision
loses to raw pixels has no negatives sentence); the 2 x 2's main effects and interaction, at
fixed epochs and at fixed steps (snapshots), at each batch size's rate chosen on validation
accuracy; the analysis plan applied to them (claims resolved as significant or equivalent after the
family's correction, or unresolved); and every table rebuilt from the per-seed table alone."""

from __future__ import annotations

import io
import itertools
import math
import re
import zlib

import numpy as np
import pandas as pd
import pytest

from smallbatch.report.context import ReportContext
from smallbatch.report.fmt import csv_number
from smallbatch.report.plan import AnalysisPlan
from smallbatch.report.sections import instrument
from smallbatch.report.sections.instrument_budgets import budget_rows
from smallbatch.report.sections.instrument_gates import SUPERVISED_OVER_PIXELS

#: the plan these designs are read with: an absolute margin (points), the factorial and its simple
#: negatives effects claimed on the linear probe, kNN@20 secondary, one family for the study
MARGIN = 0.5
PLAN = AnalysisPlan.from_mapping(
    {
        "primary": "linear",
        "secondary": ["knn20"],
        "claims": ["negatives", "steps", "interaction", "negatives_at_large", "negatives_at_small"],
        "margin": MARGIN,
        "margin_scale": "points",
        "family": "study",
    }
)

SEEDS = range(6)
#: per-seed noise shared by every arm of one seed (pairing removes it)
SHARED = [0.9, -1.1, 0.4, -0.3, 0.1, 0.6]
IMAGES = 10_000
EPOCHS = 5
#: arm -> (loss, batch size, neg_group, extra_negatives)
ARMS = {
    "a": ("infonce", 256, None, None),
    "b": ("infonce", 256, 16, None),
    "c": ("infonce", 16, None, None),
    "d": ("infonce", 16, None, 240),
    "control": ("infonce", 256, 2, None),
}


def _own(arm: str, seed: int, lr: float, scale: float) -> float:
    """Each arm's own noise (what pairing leaves): fixed, small, different per arm and seed."""
    r = np.random.default_rng(zlib.crc32(f"{arm}-{seed}-{lr}".encode()))
    return scale * float(r.normal())


def _metrics(prefix: str, v: float, val: float) -> dict:
    out = {f"metrics.{prefix}{key}": v for key, _ in instrument.METRICS.values()}
    out[f"metrics.{prefix}{instrument.VAL_METRIC}"] = val
    return out


def _cell(ds, arm, seed, mean, *, tau=0.1, lr=1e-3, own=0.03, snapshots=(), val_shift=-1.0) -> dict:
    """One cell run: final metrics at EPOCHS, and a snapshot at each of ``snapshots``
    (epochs, its mean)."""
    loss, bs, group, extra = ARMS[arm]
    spe = IMAGES // bs
    v = mean + SHARED[seed] + _own(arm, seed, lr, own)
    row = {
        "run_id": f"{ds}-{arm}-{tau}-{lr}-{seed}",
        "kind": "cell",
        "status": "finished",
        "section": "instrument",
        "cell_id": f"instrument/{ds}/{arm}-t{tau}-lr{lr}-s{seed}",
        "start_time": 1,
        "dataset": ds,
        "loss": loss,
        "batch_size": bs,
        "temperature": tau,
        "seed": seed,
        "baseline": None,
        "params.neg_group": str(group),
        "params.extra_negatives": str(extra),
        "params.lr": str(lr),
        "params.lr_scaling": "none",
        "params.epochs": str(EPOCHS),
        "params.pretrain_images": str(IMAGES),
        "metrics.train/steps": float(EPOCHS * spe),
        **_metrics("", v, v + val_shift),
    }
    for e, m in snapshots:
        steps = max(1, int(e * spe + 0.5))
        pre = f"snapshot/ep{e:g}/"
        sv = m + SHARED[seed] + _own(arm, seed + 100, lr, own)
        row.update(_metrics(pre, sv, sv + val_shift))
        row.update({f"metrics.{pre}steps": float(steps), f"metrics.{pre}epochs": steps / spe})
        row.update({f"metrics.{pre}images_seen": float(steps * bs), f"metrics.{pre}status": 0.0})
    return row


def _baselines(ds, pixels=50.0, random_init=40.0, supervised=70.0) -> list[dict]:
    rows = []
    for name, mean, seeds in (
        ("raw_pixels", pixels, [0]),
        ("random_init", random_init, [0, 1, 2]),
        ("supervised", supervised, [0, 1, 2]),
    ):
        for s in seeds:
            rows.append(
                {
                    "run_id": f"{ds}-{name}-{s}",
                    "kind": "baseline",
                    "status": "finished",
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
    return rows


#: a design that passes every gate: the steps matter (+2.2), the negatives do not (−0.2)
PASSING = {"a": 60.0, "b": 60.0, "c": 62.0, "d": 62.4, "control": 57.0}


def _store(means=PASSING, ds="ds", own=0.03, baselines=None, **kw) -> pd.DataFrame:
    rows = [_cell(ds, arm, s, m, own=own, **kw) for arm, m in means.items() for s in SEEDS]
    return pd.DataFrame(rows + _baselines(ds, **(baselines or {})))


class Analysed(list):
    """The units of a store (a list) and their contrast rows with the plan applied (``claims``)."""

    claims: pd.DataFrame
    plan: AnalysisPlan


def _analyse(runs: pd.DataFrame, plan: AnalysisPlan = PLAN) -> Analysed:
    cells = runs[runs["kind"] == "cell"]
    rows = budget_rows(cells, 1.0)
    res = Analysed(instrument.analyse(rows, instrument.baseline_values(runs, 1.0)))
    res.claims = instrument.claims_of(res, plan)
    res.plan = plan
    return res


def _row(res: Analysed, key, view="epochs", metric="linear") -> dict:
    c = res.claims
    return c[(c["view"] == view) & (c["key"] == key) & (c["metric"] == metric)].iloc[0].to_dict()


def _findings(res: Analysed) -> list[str]:
    return instrument.findings(res, res.claims, res.plan)


def _text(res: Analysed) -> str:
    return " ".join(_findings(res))


def _gate_lines(res: Analysed) -> list[str]:
    return [s for s in _findings(res) if s.startswith("Gates")]


# --------------------------------------------------------------------------- the gates
def test_a_store_where_ssl_loses_to_raw_pixels_yields_no_negatives_sentence():
    passing = _analyse(_store())
    assert all(r.ok for r in passing)
    assert "negatives main effect" in _text(passing)  # the control: with the gates passed it is there
    failing = _analyse(_store(baselines={"pixels": 61.0}))  # InfoNCE@256 (60) below raw pixels (61)
    text = _text(failing)
    g2 = next(s for s in _findings(failing) if s.startswith("Gates, ds"))
    assert re.search(r"G2 InfoNCE B=256 \(linear probe\) − raw pixels = -0\.\d \[", g2) and "FAILED" in g2
    for s in _findings(failing):  # the plan, the gate line, and the line saying why there is no verdict
        assert s.startswith(("Analysis plan:", "Claims:", "Gates, ds", "No verdict on negatives or steps for ds")), s
    for word in (
        "negatives main effect (K",
        "steps main effect (B_opt",
        "interaction (",
        "small − large",
        "steps part",
    ):
        assert word not in text
    assert "No verdict on negatives or steps for ds, τ 0.1, 5 epochs (fixed epochs): G2 not passed." in text


def test_the_plan_then_the_gates_come_first_with_their_numbers():
    res = _analyse(_store())
    f = _findings(res)
    assert (
        f[0] == "Analysis plan: primary probe: linear; secondary: knn20; every other probe is descriptive (no verdict)."
    )
    assert f[2] == "Analysis plan: equivalence margin: ± 0.50 points."
    (gates,) = _gate_lines(res)
    first_claim = next(i for i, s in enumerate(f) if "negatives main effect" in s)
    assert f.index(gates) < first_claim
    assert gates.startswith("Gates, ds, τ 0.1, 5 epochs: G1 supervised − raw pixels (linear probe) = +20.3 points")
    for g in ("G1", "G2", "G3"):
        assert f"{g} " in gates
    assert "G4" not in gates  # precision is a property of each claim, not a gate
    assert "InfoNCE B=256, G=2 (K=2) − InfoNCE B=256" in gates


@pytest.mark.parametrize(
    "change,gate",
    [
        ({"baselines": {"supervised": 50.0 + SUPERVISED_OVER_PIXELS - 0.5}}, "G1"),
        ({"means": {**PASSING, "control": 60.0}}, "G3"),
        ({"means": {k: v for k, v in PASSING.items() if k != "control"}}, "G3"),
        ({"baselines": {"random_init": 61.0}}, "G2"),
    ],
    ids=["supervised-close-to-pixels", "control-does-not-fire", "no-control", "random-init-ahead"],
)
def test_each_failed_gate_withholds_the_verdict(change, gate):
    res = _analyse(_store(**change))
    (unit,) = [r for r in res if r.unit.view == "epochs"]
    failed = [g.name for g in unit.gates if g.passed is not True]
    assert failed == [gate]
    text = _text(res)
    assert "negatives main effect (K" not in text and f"{gate} not passed" in text


def test_noisy_seeds_pass_the_gates_but_leave_each_imprecise_claim_unresolved():
    """Seeds too noisy to resolve −0.2: no verdict word for the negatives effect, its interval and
    MDE instead; a steps effect of +6.2 is still resolved."""
    res = _analyse(_store(means={**PASSING, "c": 66.0, "d": 66.4}, own=1.5))
    assert all(r.ok for r in res)
    neg, steps = _row(res, "negatives"), _row(res, "steps")
    assert neg["outcome"] == "unresolved" and steps["outcome"] == "significant"
    clause = _text(res).split("negatives main effect (K 30 − 510)")[1].split("; steps main effect")[0]
    assert "— unresolved, no verdict (TOST Holm p" in clause and "MDE at 80 % power" in clause
    assert "equivalent" not in clause and "significant" not in clause


def test_g2_takes_raw_pixels_as_a_constant_and_random_init_by_welch():
    res = _analyse(_store())
    g2 = res[0].gates[1]
    ssl = [60.0 + SHARED[s] for s in SEEDS]
    assert g2.passed and f"− raw pixels = +{np.mean(ssl) - 50.0:.1f}" in g2.text and "p < 0.001" in g2.text
    assert "Welch t" in g2.text  # random-init: other networks, never paired with InfoNCE's seeds


# --------------------------------------------------------------------------- the factorial
def test_the_main_effects_and_interaction_of_the_two_by_two():
    res = _analyse(_store())
    neg, steps, inter = (_row(res, k) for k in ("negatives", "steps", "interaction"))
    a, b, c, d = (PASSING[k] for k in "abcd")
    assert neg["diff"] == pytest.approx(((b - a) + (c - d)) / 2, abs=0.05)
    assert steps["diff"] == pytest.approx(((c - b) + (d - a)) / 2, abs=0.05)
    assert inter["diff"] == pytest.approx((c - d) - (b - a), abs=0.08)
    assert _row(res, "negatives_at_large")["diff"] == pytest.approx(b - a, abs=0.05)
    assert _row(res, "negatives_at_small")["diff"] == pytest.approx(c - d, abs=0.05)
    assert steps["outcome"] == neg["outcome"] == "significant"  # tight seeds: even −0.2 is significant
    assert neg["tost_p"] < 0.05 and neg["lo"] > -MARGIN and neg["hi"] < MARGIN
    # the family: 5 claimed contrasts x 2 planned probes (linear, kNN@20) of the one unit
    assert set(res.claims[res.claims["claimed"]]["family"]) == {10}
    assert not res.claims[~res.claims["claimed"]]["p_family"].notna().any()
    text = _text(res)
    assert "negatives main effect (K 30 − 510) -0.2" in text
    assert "of 10) — resolved: significant" in text
    assert "steps main effect (B_opt 16 − 256: 16x the steps at equal epochs) +2.2" in text
    assert "small − large" not in text  # a contrast the plan does not claim gets no sentence


def test_a_negatives_effect_that_costs_nothing_is_equivalent_and_says_its_mde():
    """Negatives main effect 0 with some seed noise: not significant, the 90 % interval inside ± 0.5."""
    res = _analyse(_store(means={**PASSING, "d": 62.0}, own=0.2))
    assert res[0].ok
    neg = _row(res, "negatives")
    assert neg["outcome"] == "equivalent" and neg["p_family"] >= 0.05 and neg["tost_family"] < 0.05
    text = _text(res)
    assert "negatives main effect (K 30 − 510)" in text
    clause = text.split("negatives main effect (K 30 − 510)")[1].split(";")[0]
    assert "— resolved: equivalent within ± 0.50 points (TOST Holm p" in clause


def test_an_unresolved_claim_says_so_with_its_mde_and_no_verdict():
    """An interaction of +0.4 whose seeds cannot tell it from 0 nor bound it within ± 0.5."""
    res = _analyse(_store(means={**PASSING, "d": 61.6}, own=0.2))  # (c − d) − (b − a) = 0.4
    assert res[0].ok
    r = _row(res, "interaction")
    assert r["outcome"] == "unresolved" and r["p_family"] >= 0.05 and r["tost_family"] >= 0.05
    assert r["lo"] < 0 < r["hi"] and r["hi"] > MARGIN
    pattern = (
        r"interaction \(negatives effect at B_opt 16 − at 256\) \+0\.4 \[[^]]+\] \(paired t, 6 seeds, "
        r"Holm p = [0-9.]+ of 10\) — unresolved, no verdict \(TOST Holm p = [0-9.]+ within ± 0\.50 points; "
        rf"MDE at 80 % power = {r['mde']:.2f}\)"
    )
    assert re.search(pattern, _text(res))


def test_fixed_steps_reads_the_small_batch_at_the_large_batch_steps():
    """B=16's snapshot after 195 steps (0.3125 epochs) is the fixed-steps twin of B=256's 5 epochs."""
    rows = []
    for arm, m in PASSING.items():
        snaps = [(0.3125, m - 5.0)] if ARMS[arm][1] == 16 else []
        rows += [_cell("ds", arm, s, m, snapshots=snaps) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    res = _analyse(runs)
    assert [(r.unit.view, r.unit.steps) for r in res] == [("epochs", 195.0), ("steps", 195.0)]
    fixed = _row(res, "steps", view="steps")
    assert fixed["diff"] == pytest.approx(2.2 - 5.0, abs=0.05)  # c, d at 195 steps: 5 points lower
    assert "1/16 of the images at equal steps" in fixed["contrast"]
    assert "small_large" not in {r["key"] for r in res[1].rows}  # the earlier contrasts: fixed epochs only


def test_budgets_from_snapshots_and_the_final_checkpoint_counted_once():
    rows = [_cell("ds", arm, s, m, snapshots=[(1, m - 3.0), (EPOCHS, m)]) for arm, m in PASSING.items() for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    b = budget_rows(runs[runs["kind"] == "cell"], 1.0)
    a = b[(b["arm"] == "infonce@256") & (b["seed"] == 0)].sort_values("steps")
    assert list(a["budget"]) == ["ep1", "final"] and list(a["steps"]) == [39.0, 195.0]
    assert list(a["images"]) == [39.0 * 256, 195.0 * 256] and list(a["epochs"]) == [1.0, 5.0]
    res = _analyse(runs)
    assert [(r.unit.budget, r.unit.view) for r in res] == [("ep1", "epochs"), ("final", "epochs")]
    assert _row(res, "steps")["unit"].startswith("ds, τ 0.1, 1 epoch")
    assert [s.split(":")[0] for s in _gate_lines(res)] == ["Gates, ds, τ 0.1, 1 epoch", "Gates, ds, τ 0.1, 5 epochs"]


def test_a_diverged_snapshot_is_left_out():
    row = _cell("ds", "c", 0, 60.0, snapshots=[(1, 50.0)])
    row["metrics.snapshot/ep1/status"] = 2.0
    b = budget_rows(pd.DataFrame([row]), 1.0)
    assert list(b["status"]) == ["finished", "diverged"]


# --------------------------------------------------------------------------- learning rate and τ
def test_each_batch_size_is_read_at_its_validated_rate_never_the_test_best():
    """Three rates per batch size; the best validation rate is read for every arm of that size
    (the test split would pick another)."""
    rows = []
    for arm, m in PASSING.items():
        for lr, dv, dt in ((5e-4, 0.0, 2.0), (1e-3, 1.0, 0.0), (2e-3, -1.0, 1.0)):  # val best: 1e-3; test best: 5e-4
            rows += [_cell("ds", arm, s, m + dt, lr=lr, val_shift=dv - dt) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    res = _analyse(runs)
    assert res[0].lrs == {16: 1e-3, 256: 1e-3}
    assert all(set(a["lr"]) == {1e-3} for a in res[0].arms.values())
    lrs = instrument.lr_table(res, budget_rows(runs[runs["kind"] == "cell"], 1.0))
    assert set(lrs[lrs["chosen"]]["lr"]) == {1e-3}
    assert "at the validated lr (B=16: lr 0.001, B=256: lr 0.001)" in _text(res)


def test_a_run_still_training_is_no_seed_of_the_learning_rate_table():
    """A cell whose run has no evaluation yet (still training when the report was built) adds no
    seed to its rate's row: the row counts only the seeds it averaged."""
    last = max(SEEDS)
    rows = [_cell("ds", arm, s, m) for arm, m in PASSING.items() for s in SEEDS if (arm, s) != ("c", last)]
    running = _cell("ds", "c", last, PASSING["c"])  # B = 16, plain: its last seed still training
    running.update({k: math.nan for k in running if k.startswith("metrics.")}, status="running")
    runs = pd.DataFrame([*rows, running, *_baselines("ds")])
    lrs = instrument.lr_table(_analyse(runs), budget_rows(runs[runs["kind"] == "cell"], 1.0))
    plain16 = lrs[(lrs["batch_size"] == 16) & (lrs["arm"] == "infonce@16")]
    assert list(plain16["seeds"]) == [len(SEEDS) - 1]


def test_without_a_validation_score_the_rate_most_cells_use_is_read_not_the_test_best():
    rows = []
    for arm, m in PASSING.items():
        rates = ((5e-4, 3.0), (1e-3, 0.0)) if arm in ("a", "c") else ((1e-3, 0.0),)
        rows += [_cell("ds", arm, s, m + dt, lr=lr) for lr, dt in rates for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    runs = runs.drop(columns=[f"metrics.{instrument.VAL_METRIC}"])
    res = _analyse(runs)
    assert res[0].lrs == {16: 1e-3, 256: 1e-3}  # 5e-4 has the better test top-1, 1e-3 the most cells


def test_an_arm_run_at_one_rate_only_is_read_at_it_and_named():
    rows = []
    for arm, m in PASSING.items():
        rates = ((5e-4, -1.0), (1e-3, 0.0)) if arm in ("a", "c") else ((1e-3, 0.0),)
        if arm == "d":
            rates = ((2e-3, 0.0),)
        rows += [_cell("ds", arm, s, m + dv, lr=lr) for lr, dv in rates for s in SEEDS]
    res = _analyse(pd.DataFrame(rows + _baselines("ds")))
    assert res[0].lrs == {16: 1e-3, 256: 1e-3} and set(res[0].arms["infonce@16/X240"]["lr"]) == {2e-3}
    assert instrument.off_rate(res[0]) == [
        "InfoNCE B=16, +240 fresh (K=510) at lr 0.002 (its only rate; B=16's validated lr is 0.001)"
    ]
    assert "read at another rate than the validated one: InfoNCE B=16, +240 fresh" in _text(res)


def test_every_temperature_is_its_own_unit():
    runs = pd.concat([_store(tau=0.1), _store(means={k: v - 1 for k, v in PASSING.items()}, tau=0.5)])
    runs = runs.drop_duplicates("run_id")
    res = _analyse(runs)
    assert [r.unit.temperature for r in res] == [0.1, 0.5]
    assert _row(res, "negatives")["unit"].startswith("ds, τ 0.1")


# --------------------------------------------------------------------------- the section
def test_the_section_writes_its_tables_figures_and_findings(tmp_path):
    rows = []
    for arm, m in PASSING.items():
        snaps = [(0.3125, m - 5.0)] if ARMS[arm][1] == 16 else []
        rows += [_cell("ds", arm, s, m, snapshots=snaps) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    ctx = ReportContext(
        out_dir=tmp_path, tracking_uri="", experiment="x", reader=None, scale=1.0, papers=pd.DataFrame(), runs=runs
    )
    out = instrument.build(runs, ctx)
    names = {p.name for p in out.files}
    assert {
        "instrument_gates.csv",
        "instrument_arms.csv",
        "instrument_contrasts.md",
        "instrument_ssl.csv",
        "instrument_arms.png",
        "instrument_contrasts.png",
    } <= names
    assert out.findings[0].startswith("Analysis plan: primary probe: linear")
    assert "Analysis plan (declared in the config's `analysis`" in out.markdown
    gates = pd.read_csv(tmp_path / "tables" / "instrument_gates.csv")
    assert set(gates["gate"]) == {"G1", "G2", "G3"}
    contrasts = pd.read_csv(tmp_path / "tables" / "instrument_contrasts.csv")
    want = {"tost_p", "outcome", "mde", "p_family", "tost_family", "margin", "claimed", "role", "gates_passed"}
    assert want <= set(contrasts.columns)
    assert set(contrasts["reference"]) == {"InfoNCE B=256, lr 0.001, τ 0.1, 6 seeds"}
    arms_md = (tmp_path / "tables" / "instrument_arms.md").read_text()
    assert "InfoNCE B=16, +240 fresh (K=510)" in arms_md and "InfoNCE B=256, G=16 (K=30)" in arms_md
    ssl = pd.read_csv(tmp_path / "tables" / "instrument_ssl.csv")
    row = ssl[(ssl["metric"] == "linear") & (ssl["baseline"] == "raw_pixels")]
    assert row["test"].iloc[0] == "paired t" and math.isfinite(row["lo"].iloc[0])  # one-sample t against the constant


def test_each_other_loss_at_the_small_batch_is_set_against_infonce_at_the_large_one():
    """Any loss beside InfoNCE at B=16 gets its own contrast, named with the parameters its cell id
    carries (two settings of one loss stay two arms), and its own sentence in the verdict."""
    others = {"dcl": (62.5, "dcl"), "debiased": (61.0, "debiased-tau_plus0.01")}
    rows = []
    for loss, (mean, named) in others.items():
        for s in SEEDS:
            row = _cell("ds", "c", s, mean)
            row.update(loss=loss, run_id=f"{named}-{s}", cell_id=f"instrument/ds/{named}/bs16-t0.1-s{s}")
            rows.append(row)
    runs = pd.concat([_store(), pd.DataFrame(rows)], ignore_index=True)
    res = _analyse(runs, AnalysisPlan.from_mapping({**_mapping(PLAN), "claims": ["negatives", "loss"]}))
    dcl, deb = _row(res, "loss:dcl@16"), _row(res, "loss:debiased-tau_plus0.01@16")
    assert dcl["diff"] == pytest.approx(62.5 - PASSING["a"], abs=0.05)
    assert deb["diff"] == pytest.approx(61.0 - PASSING["a"], abs=0.05)
    text = _text(res)
    assert "DCL@16 − InfoNCE@256 +2.5" in text
    assert "(tau_plus0.01)@16 − InfoNCE@256 +1.0" in text


def test_a_raw_pixel_baseline_without_a_seed_is_read_as_the_constant_it_is():
    """The raw-pixel baseline logs no seed (it has no randomness): G2 still reads it."""
    runs = _store()
    raw = runs["baseline"] == "raw_pixels"
    runs["seed"] = runs["seed"].astype("Int64")
    runs.loc[raw, "seed"] = pd.NA
    res = _analyse(runs)
    g2 = next(g for g in res[0].gates if g.name == "G2")
    assert g2.passed and "raw pixels" in g2.text and res[0].ok


def test_an_opt_in_probes_metric_is_a_column_of_the_arms_table_never_a_contrast(tmp_path):
    def build(runs, out):
        ctx = ReportContext(
            out_dir=out, tracking_uri="", experiment="x", reader=None, scale=1.0, papers=pd.DataFrame(), runs=runs
        )
        instrument.build(runs, ctx)
        return (out / "tables" / "instrument_arms.md").read_text(), pd.read_csv(
            out / "tables" / "instrument_contrasts.csv"
        )

    plain = _store()
    with_nmi = plain.assign(**{"metrics.kmeans/nmi": [70.0 if k == "cell" else np.nan for k in plain["kind"]]})
    arms, contrasts = build(with_nmi, tmp_path / "nmi")
    assert "k-means NMI" in arms
    assert "70.0 ± 0.0" in arms and "kmeans" not in set(contrasts["metric"])
    arms_plain, contrasts_plain = build(plain, tmp_path / "plain")
    assert "k-means NMI" not in arms_plain and contrasts_plain.equals(contrasts)


def _mapping(plan: AnalysisPlan) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in plan.__dict__.items()}


def _section(runs: pd.DataFrame, out, plan: AnalysisPlan = PLAN):
    ctx = ReportContext(
        out_dir=out,
        tracking_uri="",
        experiment="x",
        reader=None,
        scale=1.0,
        papers=pd.DataFrame(),
        runs=runs,
        plan=plan,
    )
    return instrument.build(runs, ctx)


def test_every_contrast_table_is_rebuilt_from_the_per_seed_table_alone(tmp_path):
    """The per-seed CSV the section writes holds every seed of every arm, rate, budget and probe and the
    baselines' seeds; the contrasts rebuilt from that file alone equal the section's table."""
    rows = []
    for arm, m in PASSING.items():
        snaps = [(0.3125, m - 5.0)] if ARMS[arm][1] == 16 else []
        for lr, dv in ((5e-4, -1.0), (1e-3, 0.0)):
            rows += [_cell("ds", arm, s, m + dv, lr=lr, own=0.3, snapshots=snaps) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    _section(runs, tmp_path)
    seeds = pd.read_csv(tmp_path / "tables" / "instrument_seeds.csv")
    # 5 arms x 2 rates x 6 seeds x (final + the small batch's snapshot) x 6 probes (5 + validation)
    cells = seeds[~seeds["arm"].str.startswith("baseline:")]
    assert len(cells) == (3 * 2 * 6 + 2 * 2 * 6 * 2) * 6
    assert set(cells.columns) >= {"arm", "seed", "budget", "lr", "probe", "value"}
    assert cells[(cells["arm"] == "infonce@16") & (cells["probe"] == "linear")]["seed"].nunique() == 6
    assert set(seeds[seeds["arm"].str.startswith("baseline:")]["arm"]) == {
        "baseline:raw_pixels",
        "baseline:random_init",
        "baseline:supervised",
    }
    _, claims = instrument.analyse_seeds(seeds, PLAN)
    table = pd.read_csv(tmp_path / "tables" / "instrument_contrasts.csv")
    rebuilt = pd.read_csv(io.StringIO(claims.drop(columns=["estimate"]).to_csv(index=False, float_format=csv_number)))
    pd.testing.assert_frame_equal(rebuilt, table)


def test_a_relative_margin_is_resolved_from_the_control_and_from_the_supervised_range():
    """control: half the positive control's effect (57 − 60 = −3 → 1.5 points); span: a tenth of
    supervised − random-init (70.3 − 40.3 = 30 → 3.0 points), per probe."""
    for scale, margin, want in (("control", 0.5, 1.5), ("span", 0.1, 3.0)):
        plan = AnalysisPlan.from_mapping({**_mapping(PLAN), "margin": margin, "margin_scale": scale})
        res = _analyse(_store(), plan)
        neg = _row(res, "negatives")
        assert neg["margin"] == pytest.approx(want, abs=0.05), scale
        if scale == "control":  # exactly half the control's own estimate
            assert neg["margin"] == pytest.approx(0.5 * abs(_row(res, "control")["diff"]), rel=1e-12)
        (gates,) = _gate_lines(res)  # resolved with the gates, before any claim
        assert f"margin: linear probe ± {neg['margin']:.2f} points" in gates


def test_the_family_holds_every_claim_of_the_study_and_a_secondary_claim_is_labelled():
    """Two τ (two units) and two planned probes: the family is 5 claims x 2 probes x 2 units = 20;
    a plan with family per data set and one probe halves it."""
    runs = pd.concat([_store(tau=0.1), _store(means={k: v - 1 for k, v in PASSING.items()}, tau=0.5)])
    res = _analyse(runs.drop_duplicates("run_id"))
    claimed = res.claims[res.claims["claimed"]]
    assert set(claimed["family"]) == {20} and set(claimed["metric"]) == {"linear", "knn20"}
    assert "kNN@20 (secondary)" in _text(res)
    one = AnalysisPlan.from_mapping({**_mapping(PLAN), "secondary": [], "family": "dataset"})
    res1 = _analyse(runs.drop_duplicates("run_id"), one)
    assert set(res1.claims[res1.claims["claimed"]]["family"]) == {10}
    assert "kNN@20 (secondary)" not in _text(res1)


# --------------------------------------------------------------------------- budgets to a plateau
def _rising_store(still_rising: str = "d", tau: float = 0.1) -> pd.DataFrame:
    """Every arm 6 points lower at 1 epoch than at 2 and 4 (flat from 2 to 4: a plateau at 4), but
    ``still_rising``, 3 points lower at 2 than at 4; the final 5 epochs end no doubling."""
    rows = []
    for arm, m in PASSING.items():
        mid = m - 3.0 if arm == still_rising else m
        rows += [_cell("ds", arm, s, m, tau=tau, snapshots=[(1, m - 6.0), (2, mid), (4, m)]) for s in SEEDS]
    return pd.DataFrame(rows + _baselines("ds"))


def test_each_contrast_is_a_curve_over_budgets_and_its_claim_is_worded_at_its_plateau(tmp_path):
    out = _section(_rising_store(), tmp_path)
    names = {p.name for p in out.files}
    assert {"instrument_plateau.csv", "instrument_curves.csv", "instrument_curves.png"} <= names
    plateaus = pd.read_csv(tmp_path / "tables" / "instrument_plateau.csv")
    lin = plateaus[plateaus["metric"] == "linear"].set_index("arm")
    assert lin.at["infonce@256", "plateau"] == 4.0 and lin.at["infonce@256/G16", "plateau"] == 4.0
    assert lin.at["infonce@16/X240", "status"] == "no plateau yet" and math.isnan(lin.at["infonce@16/X240", "plateau"])
    curves = pd.read_csv(tmp_path / "tables" / "instrument_curves.csv")
    lin = curves[curves["metric"] == "linear"]
    grouped = lin[lin["key"] == "negatives_at_large"].sort_values("epochs")
    assert list(grouped["epochs"]) == [1.0, 2.0, 4.0, 5.0]  # one curve over every fixed-epochs budget
    assert list(grouped["at_plateau"]) == [False, False, True, False]
    assert lin[lin["key"] == "negatives"]["plateau"].isna().all()  # its fresh-negatives arm still moves
    text = " ".join(out.findings)
    assert "At the plateau (4 epochs), ds, τ 0.1, linear probe: negatives at B_opt 256 (K 30 − 510" in text
    assert (
        "At the plateau, ds, τ 0.1, linear probe: negatives main effect (K 30 − 510) — no plateau yet at 5 epochs, no verdict."
        in text
    )
    assert "InfoNCE B=16, +240 fresh (K=510): no plateau yet (last doubling 2 → 4 epochs: +3.00" in text
    md = (tmp_path / "tables" / "instrument_curves.md").read_text()
    assert "◆" in md and "none yet" in md


@pytest.mark.parametrize("best_256, edge_256", [(1e-3, ""), (5e-4, "bottom")])
def test_a_validated_rate_at_the_edge_of_its_grid_is_flagged_per_batch_size(best_256, edge_256):
    """B=16's validation is best at its highest rate (2e-3 of 5e-4, 1e-3, 2e-3): flagged at the top and
    told to extend the grid above 0.002; B=256's at its middle rate (interior: not flagged) or at its lowest
    (flagged at the bottom)."""
    rows = []
    for arm, m in PASSING.items():
        best = 2e-3 if ARMS[arm][1] == 16 else best_256
        for lr in (5e-4, 1e-3, 2e-3):
            dv = 1.0 if lr == best else 0.0
            rows += [_cell("ds", arm, s, m, lr=lr, val_shift=dv - 1.0) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    res = _analyse(runs)
    assert res[0].lrs == {16: 2e-3, 256: best_256}
    lrs = instrument.lr_table(res, budget_rows(runs[runs["kind"] == "cell"], 1.0))
    assert lrs[lrs["chosen"]].set_index("batch_size")["edge"].to_dict() == {16: "top", 256: edge_256}
    lines = instrument.grid_edge_findings(lrs)
    assert lines[0] == (
        "Learning-rate grid, B=16: the validated rate is the top of its grid (0.0005, 0.001, 0.002) in 1 of 1 "
        "units (ds, τ 0.1, 5 epochs (fixed epochs)): the best rate may lie above it; extend the grid above 0.002."
    )
    assert lines[1:] == (
        [] if not edge_256 else ["Learning-rate grid, B=256: the validated rate is the bottom of its grid (0.0005, "
        "0.001, 0.002) in 1 of 1 units (ds, τ 0.1, 5 epochs (fixed epochs)): the best rate may lie below it; extend "
        "the grid below 0.0005."]
    )  # fmt: skip


def _title(ax) -> str:
    """A panel's title, wherever it is placed (left, centre or right)."""
    return "".join(ax.get_title(loc=loc) for loc in ("left", "center", "right"))


class _Seen(ReportContext):
    """A report context that keeps each saved figure's panels (title, row labels) and text boxes."""

    def save_figure(self, fig, stem, exact=False):
        from matplotlib.text import Text

        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
        self.seen[stem] = {
            "panels": [(_title(ax), [t.get_text() for t in ax.get_yticklabels()]) for ax in fig.axes],
            "boxes": [(t.get_text(), t.get_window_extent(r)) for t in texts],
            "width": fig.get_size_inches()[0],
            "canvas": fig.bbox,
        }
        return super().save_figure(fig, stem, exact)


def test_the_forest_plot_has_a_readable_panel_per_unit_at_its_longest_budget_and_no_text_overlaps(tmp_path):
    # two τ, each at 1, 2, 4 and 5 epochs and at the steps of 5 epochs of B = 256 (5/16 epochs of B = 16):
    # 6 rows (5 claims + the control) x 5 budgets x 2 τ, 60 rows in one panel before
    rows = []
    for tau in (0.1, 0.5):
        for arm, m in PASSING.items():
            snaps = [(1, m - 6.0), (2, m), (4, m)] + ([(0.3125, m - 5.0)] if ARMS[arm][1] == 16 else [])
            rows += [_cell("ds", arm, s, m, tau=tau, snapshots=snaps) for s in SEEDS]
    runs = pd.DataFrame(rows + _baselines("ds"))
    ctx = _Seen(out_dir=tmp_path, tracking_uri="", experiment="x", reader=None, scale=1.0, papers=pd.DataFrame(),
                runs=runs, plan=PLAN)  # fmt: skip
    ctx.seen = {}
    out = instrument.build(runs, ctx)
    fig = ctx.seen["instrument_contrasts"]
    assert [title for title, _ in fig["panels"]] == [
        "ds, τ 0.1, 5 epochs (fixed epochs)",
        "ds, τ 0.1, 195 steps (fixed steps: the reference's 5 epochs)",
        "ds, τ 0.5, 5 epochs (fixed epochs)",
        "ds, τ 0.5, 195 steps (fixed steps: the reference's 5 epochs)",
    ]
    for _, rows in fig["panels"]:
        assert len(rows) == 6 and rows[0] == "negatives main effect (K 30 − 510)" and "positive control" in rows[-1]
    assert fig["width"] == pytest.approx(6.9)  # two paper columns
    for (t1, b1), (t2, b2) in itertools.combinations(fig["boxes"], 2):
        assert not (b1.x0 < b2.x1 and b2.x0 < b1.x1 and b1.y0 < b2.y1 and b2.y0 < b1.y1), f"{t1!r} overlaps {t2!r}"
    words = {title for title, _ in fig["panels"]} | {row for _, rows in fig["panels"] for row in rows}
    for t, box in fig["boxes"]:  # no title or row label cut off at the canvas' edges
        assert t not in words or fig["canvas"].x0 <= box.x0 and box.x1 <= fig["canvas"].x1 + 0.5, t
    assert "**Claimed contrasts and the positive control**" in out.markdown
