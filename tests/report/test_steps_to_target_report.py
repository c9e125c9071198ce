"""The steps-to-target table fitted per arm and drawn (smallbatch.report.steps_to_target)."""

from __future__ import annotations

import warnings

import pytest

from smallbatch.report import steps_to_target as st


def _rows(arm: str, s_min: float, b_noise: float, batches=(16, 32, 64, 128, 256), wobble=(0.95, 1.0, 1.05)):
    """Three seeds a batch, the model's steps times a fixed wobble (the fit's log-mean is the model's)."""
    return [
        {"arm": arm, "batch_size": b, "seed": i, "steps": f"{s_min * (1 + b_noise / b) * w:.6f}", "status": "reached"}
        for b in batches
        for i, w in enumerate(wobble)
    ]


def test_each_arm_gets_its_own_fit():
    rows = _rows("infonce", 10.0, 64.0) + _rows("supervised_ce", 40.0, 16.0)
    fits = {f.arm: f for f in st.fit_arms(rows, replicas=50)}
    assert fits["infonce"].fit.b_noise == pytest.approx(64.0, rel=0.02)
    assert fits["infonce"].fit.s_min == pytest.approx(10.0 * (0.95 * 1.05) ** (1 / 3), rel=0.02)
    assert fits["supervised_ce"].fit.b_noise == pytest.approx(16.0, rel=0.02)
    assert fits["infonce"].not_reached == {} and fits["infonce"].interval.replicas == 50


def test_runs_that_did_not_reach_the_target_enter_no_fit_and_are_counted():
    rows = _rows("dcl", 10.0, 64.0)
    missed = [{"arm": "dcl", "batch_size": 256, "seed": s, "steps": "", "status": "not reached"} for s in (3, 4)]
    at_zero = [{"arm": "dcl", "batch_size": 16, "seed": 5, "steps": "0.0", "status": "reached"}]
    (f,) = st.fit_arms(rows + missed + at_zero, replicas=20)
    assert f.fit.b_noise == pytest.approx(64.0, rel=0.02)  # the same fit as without them
    assert f.not_reached == {256: 2} and f.at_start == {16: 1}
    assert "| B=256: 2 | B=16: 1 |" in st.fit_markdown([f])


def test_an_arm_reached_at_one_batch_size_only_has_no_fit():
    rows = _rows("dcl", 10.0, 64.0, batches=(16,)) + [
        {"arm": "dcl", "batch_size": 32, "seed": 0, "steps": "", "status": "not reached"}
    ]
    (f,) = st.fit_arms(rows, replicas=10)
    assert f.fit is None and f.not_reached == {32: 1}
    assert "| DCL | – |" in st.fit_markdown([f])


def test_figures_leave_out_runs_reached_at_step_0(tmp_path):
    rows = [{"arm": "dcl", "batch_size": b, "seed": 0, "steps": "0.00", "status": "reached"} for b in (16, 32)]
    fits = st.fit_arms(rows, replicas=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zeros on the log axis: "Data has no positive values"
        st.plot_steps(rows, fits, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 1000


def test_a_noise_scale_beyond_the_batches_is_no_number():
    (f,) = st.fit_arms(_rows("infonce", 1.0, 1e6), replicas=20)  # perfect scaling throughout
    assert f.fit.where == "above" and f.fit.b_zhang is None
    assert "above the batches measured" in st.fit_markdown([f])


def test_both_figures_are_written(tmp_path):
    rows = _rows("infonce", 10.0, 64.0) + [
        {"arm": "infonce", "batch_size": 256, "seed": 9, "steps": "", "status": "not reached"}
    ]
    fits = st.fit_arms(rows, replicas=10)
    st.plot_steps(rows, fits, tmp_path / "steps.png")
    st.plot_images(rows, fits, tmp_path / "images.png")
    assert (tmp_path / "steps.png").stat().st_size > 1000 and (tmp_path / "images.png").stat().st_size > 1000
