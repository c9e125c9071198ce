"""The K dose-response section (:mod:`smallbatch.report.sections.kcurve`) on a designed store: accuracy
against K per probe with intervals, the knee under the analysis plan's margin, C·H_C computed, and
BatchNorm over the whole batch against groups."""

from __future__ import annotations

import zlib

import numpy as np
import pandas as pd
import pytest

from smallbatch.report.context import ReportContext
from smallbatch.report.plan import AnalysisPlan
from smallbatch.report.sections import kcurve
from smallbatch.report.sections.instrument_budgets import METRICS, VAL_METRIC

SEEDS = range(4)
SHARED = [0.8, -1.0, 0.3, -0.1]
IMAGES, EPOCHS, BATCH = 10_000, 4, 256
#: K -> (neg_group, extra_negatives, designed linear top-1): +4, +3, +2 then +0.9, +0.1 and flat
DESIGN = {
    2: (2, None, 50.0),
    6: (4, None, 54.0),
    14: (8, None, 57.0),
    30: (16, None, 59.0),
    62: (32, None, 59.9),
    126: (64, None, 60.0),
    254: (128, None, 60.0),
    510: (None, None, 60.0),
    1022: (None, 256, 60.0),
}


def _plan(margin: float, scale: str) -> AnalysisPlan:
    return AnalysisPlan.from_mapping({"margin": margin, "margin_scale": scale, "claims": ["negatives"]})


def _cell(k: int, seed: int, mean: float, bn: int, snapshots: tuple = ()) -> dict:
    """One K arm's run: its final top-1 at EPOCHS and a snapshot at each ``(epochs, offset from the final mean)``."""
    group, extra, _ = DESIGN[k]
    spe = IMAGES // BATCH
    own = 0.03 * float(np.random.default_rng(zlib.crc32(f"{k}-{bn}-{seed}".encode())).normal())
    v = mean + SHARED[seed] + own
    tag = f"-ng{group}" if group else f"-xn{extra}" if extra else ""
    row = {
        "run_id": f"k{k}-bn{bn}-s{seed}",
        "kind": "cell",
        "status": "finished",
        "section": "kcurve",
        "cell_id": f"kcurve/fashion_mnist/infonce/bs{BATCH}-t0.1-s{seed}{tag}-bn{bn}",
        "start_time": 1,
        "dataset": "fashion_mnist",
        "loss": "infonce",
        "batch_size": BATCH,
        "temperature": 0.1,
        "seed": seed,
        "baseline": None,
        "params.neg_group": str(group),
        "params.extra_negatives": str(extra),
        "params.bn_group": str(bn),
        "params.negatives": str(k),
        "params.lr": "0.001",
        "params.lr_scaling": "sqrt",
        "params.epochs": str(EPOCHS),
        "params.pretrain_images": str(IMAGES),
        "metrics.train/steps": float(EPOCHS * spe),
        f"metrics.{VAL_METRIC}": v - 1.0,
    }
    row.update({f"metrics.{key}": v for key, _ in METRICS.values()})
    for e, off in snapshots:
        pre = f"snapshot/ep{e:g}/"
        row.update({f"metrics.{pre}{key}": v + off for key, _ in METRICS.values()})
        row.update({f"metrics.{pre}steps": float(e * spe), f"metrics.{pre}epochs": float(e)})
        row.update({f"metrics.{pre}images_seen": float(e * spe * BATCH), f"metrics.{pre}status": 0.0})
    return row


def _store(whole: dict[int, float] | None = None) -> pd.DataFrame:
    rows = [_cell(k, s, m, 16) for k, (_, _, m) in DESIGN.items() for s in SEEDS]
    rows += [_cell(k, s, m, BATCH) for k, m in (whole or {}).items() for s in SEEDS]
    return pd.DataFrame(rows)


def _table(plan: AnalysisPlan, runs: pd.DataFrame) -> pd.DataFrame:
    cells = runs[runs["kind"] == "cell"]
    return kcurve.knee_table(kcurve.k_rows(cells, 1.0), plan, {})


def test_the_coupon_collectors_draws_are_c_times_the_harmonic_number():
    # 10 (1 + 1/2 + ... + 1/10) = 29.2897; H_100 = 5.18738, so 518.738
    assert kcurve.coupon_draws(10) == pytest.approx(29.2897, abs=1e-4)
    assert kcurve.coupon_draws(100) == pytest.approx(518.7378, abs=1e-4)
    assert kcurve.coupon_draws(1) == 1.0


@pytest.mark.parametrize(
    "margin, scale, knee",
    [
        # within ±0.5 points of K 1022: 62 (−0.1) and above; 30 (−1.0) is not
        (0.5, "points", 62),
        # half the K 2 arm's effect (50 − 60 = −10): ±5 points; 14 (−3) is within, 6 (−6) not
        (0.5, "control", 14),
    ],
)
def test_the_knee_is_the_smallest_k_from_which_every_larger_k_is_within_the_margin(margin, scale, knee):
    t = _table(_plan(margin, scale), _store())
    lin = t[t["metric"] == "linear"].set_index("K")
    assert set(lin["knee"]) == {knee}
    assert list(lin.index) == sorted(DESIGN) and (lin["K_max"] == 1022).all()
    assert lin.at[30, "diff"] == pytest.approx(-1.0, abs=0.1)
    assert lin.at[2, "mean_lo"] < 50.0 < lin.at[2, "mean_hi"]  # an interval over seeds around each mean
    assert (lin["coupon"].round(1) == 29.3).all()


def test_a_curve_still_rising_at_its_largest_k_has_no_knee():
    # 2 points a step of K up to the largest: K 510 is 2 below K 1022
    runs = pd.DataFrame([_cell(k, s, 50.0 + 2.0 * i, 16) for i, k in enumerate(DESIGN) for s in SEEDS])
    t = _table(_plan(0.5, "points"), runs)
    assert t["knee"].isna().all()
    text = " ".join(kcurve.findings(t, []))
    assert "no knee: K 510 is not shown within ± 0.50 points of K 1022" in text


def test_the_section_draws_the_curve_and_sets_batchnorm_over_the_whole_batch_against_groups(tmp_path):
    runs = _store(whole={30: 59.0 + 0.5, 510: 60.0 + 1.0})
    ctx = ReportContext(
        out_dir=tmp_path,
        tracking_uri="",
        experiment="x",
        reader=None,
        scale=1.0,
        papers=pd.DataFrame(),
        runs=runs,
        plan=_plan(0.5, "points"),
    )
    out = kcurve.build(runs, ctx)
    assert {"kcurve.csv", "kcurve.md", "kcurve.png"} <= {p.name for p in out.files}
    text = " ".join(out.findings)
    assert (
        "K dose-response, fashion_mnist, τ 0.1, 4 epochs, BatchNorm over groups of 16, linear probe: top-1 50.0 at K 2 "
        "to 60.0 at K 1022; knee at K 62" in text
    )
    assert "C·H_C = 29.3 for 10 classes" in text
    assert "BatchNorm, fashion_mnist, τ 0.1, 4 epochs, linear probe, K 510: whole batch − groups of 16 = +1.0" in text
    assert "K 30: whole batch − groups of 16 = +0.5" in text
    md = (tmp_path / "tables" / "kcurve.md").read_text()
    assert "◆ 59.9" in md  # the knee marked


@pytest.mark.parametrize(
    "k2_at_2, expected",
    [
        (0.0, "K curve's plateau, fashion_mnist, τ 0.1, BatchNorm over groups of 16, linear probe: every K stopped "
         "moving by 4 epochs."),
        (-2.0, "K curve's plateau, fashion_mnist, τ 0.1, BatchNorm over groups of 16, linear probe: none yet at 4 "
         "epochs (still moving: K 2)."),
    ],
)  # fmt: skip
def test_the_k_curve_has_its_plateau_where_every_k_arm_stopped_moving(k2_at_2, expected):
    """Every K arm 4 points lower at 1 epoch than at 2 and 4 (flat from 2 to 4: a plateau at 4); the K 2 arm
    either so too or 2 points lower at 2 than at 4, still moving over the last doubling."""
    rows = []
    for k, (_, _, m) in DESIGN.items():
        at_2 = k2_at_2 if k == 2 else 0.0
        rows += [_cell(k, s, m, 16, snapshots=((1, -4.0), (2, at_2))) for s in SEEDS]
    runs = pd.DataFrame(rows)
    long = kcurve.k_rows(runs, 1.0)
    assert sorted(set(long["epochs"])) == [1.0, 2.0, 4.0]
    assert expected in kcurve.plateau_findings(kcurve.k_plateaus(long), ("linear",))
