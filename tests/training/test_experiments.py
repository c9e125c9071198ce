"""Side experiments (issue: precision, K sweep, ESS schedule, temperature sweep): cells and ESS control."""

from __future__ import annotations

import math

import pytest
import torch

from smallbatch.losses import in_batch_scores
from smallbatch.losses.diagnostics import diagnostics
from smallbatch.study.cell import Cell
from smallbatch.study.cells import expand_cells
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training.temperature import EssTemperature
from smallbatch.training.temperature import ess_of as _ess_of


def ess_of(neg, tau, mask):
    return float(_ess_of(neg, tau, mask))


def _scores(n=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    z1, z2 = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    return in_batch_scores(z1, z2)


@pytest.mark.parametrize("tau", [0.01, 0.1, 1.0, 100.0])
def test_ess_bounds(tau):
    pos, neg, mask = _scores()
    k = neg.shape[1]
    e = ess_of(neg, tau, mask)
    assert 1.0 / k - 1e-12 <= e <= 1.0 + 1e-12
    # agrees with the loss library's diagnostic
    assert e == pytest.approx(diagnostics(pos, neg, tau, neg_mask=mask)["ess"], rel=1e-5)


def test_ess_extremes():
    pos, neg, mask = _scores()
    k = neg.shape[1]
    assert ess_of(neg, 1e4, mask) == pytest.approx(1.0, abs=1e-6)  # flat weights
    # one dominant negative per row -> ESS -> 1/K
    assert ess_of(neg, 1e-4, mask) == pytest.approx(1.0 / k, rel=1e-3)


@pytest.mark.parametrize("target", [0.2, 0.5, 0.9])
def test_ess_update_hits_target_on_fixed_batch(target):
    _, neg, mask = _scores(n=32, d=16, seed=1)
    ctl = EssTemperature(start=target, end=target, total_steps=100, tau0=0.1)
    ctl.begin_step(0)
    tau = ctl(neg, mask)
    assert abs(ess_of(neg, tau, mask) - target) < 1e-4


def test_ess_smoothed_update_converges():
    _, neg, mask = _scores(n=32, d=16, seed=2)
    ctl = EssTemperature(start=0.6, end=0.6, total_steps=100, tau0=0.05, rate=0.5)
    errs = []
    for step in range(30):
        ctl.begin_step(step)
        tau = ctl(neg, mask)
        errs.append(abs(ess_of(neg, tau, mask) - 0.6))
    assert errs[-1] < 1e-4 and errs[0] > errs[-1]


def test_ess_target_schedule_moves_from_start_to_end():
    ctl = EssTemperature(start=0.9, end=0.3, total_steps=100, tau0=0.1)
    assert ctl.target(0) == pytest.approx(0.9)
    assert ctl.target(50) == pytest.approx(0.6)
    assert ctl.target(100) == pytest.approx(0.3)
    assert ctl.target(500) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"start": 0.0, "end": 0.5}, "start"),
        ({"start": 0.5, "end": 1.5}, "end"),
        ({"start": 0.5, "end": 0.5, "rate": 0}, "rate"),
    ],
)
def test_ess_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EssTemperature(total_steps=10, tau0=0.1, **kwargs)


def test_side_experiment_cells():
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "grid": {"enabled": False},
            "experiments": {
                "precision": {
                    "enabled": True,
                    "losses": ["infonce", "flatnce"],
                    "batch_sizes": [16],
                    "temperatures": [0.1],
                    "seeds": [0],
                    "axes": {"precision": ["fp64", "fp32", "bf16"]},
                    "train": {"grad_error_every": 5},
                },
                "ksweep": {
                    "enabled": True,
                    "losses": ["infonce", {"name": "eqco", "alpha": 64}],
                    "batch_sizes": [32],
                    "temperatures": [0.1],
                    "seeds": [0],
                    "axes": {"queue_size": [16, 256]},
                },
                "ess": {
                    "enabled": True,
                    "losses": ["flatnce"],
                    "batch_sizes": [16],
                    "temperatures": [0.1],
                    "seeds": [0],
                    "axes": {"ess_schedule": [None, {"start": 0.9, "end": 0.3}]},
                },
                "tsweep": {"enabled": False},
            },
        },
    )
    cells = expand_cells(cfg)
    ids = set(cells)
    assert "precision/digits/infonce/bs16-t0.1-s0-fp64" in ids
    assert cells["precision/digits/flatnce/bs16-t0.1-s0-bf16"]["train"]["precision"] == "bf16"
    assert cells["precision/digits/flatnce/bs16-t0.1-s0-bf16"]["train"]["grad_error_every"] == 5
    assert cells["ksweep/digits/eqco-alpha64/bs32-t0.1-s0-q256"]["negatives"] == 256
    assert cells["ksweep/digits/infonce/bs32-t0.1-s0-q16"]["train"]["queue_size"] == 16
    sched = cells["ess/digits/flatnce/bs16-t0.1-s0-ess0.9to0.3"]["train"]["ess_schedule"]
    assert sched["start"] == 0.9 and sched["end"] == 0.3
    assert cells["ess/digits/flatnce/bs16-t0.1-s0"]["train"]["ess_schedule"] is None
    assert not any(c.startswith("tsweep/") or c.startswith("digits/") for c in ids)
    assert len(ids) == 6 + 4 + 2
    assert all(c["experiment"] == c["id"].split("/")[0] for c in cells.values())


def test_side_experiment_bad_train_key():
    with pytest.raises(ConfigError, match="experiments.precision.train.grad_eror_every"):
        load_config(None, {"experiments": {"precision": {"enabled": True, "train": {"grad_eror_every": 5}}}})


def test_ess_scheduled_training_follows_target(tmp_path):
    from smallbatch.data import load as D
    from smallbatch.study.cells import make_cell
    from smallbatch.training.loop import pretrain

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": {
                "width": 4,
                "proj_hidden": 16,
                "proj_dim": 8,
                "steps": 12,
                "log_every": 1,
                "ess_schedule": {"start": 0.8, "end": 0.4},
            },
        },
    )
    cell = make_cell(cfg, dataset="digits", loss="flatnce", loss_params={}, batch_size=16, temperature=0.1, seed=0)
    d = D.load_dataset("digits", tmp_path)
    logged = []
    res = pretrain(
        Cell.of(cell),
        d.pretrain_x,
        d.mean,
        d.std,
        tmp_path / "run",
        log_fn=lambda m, s: logged.append((s, m)),
        progress=False,
    )
    assert res.status == "finished"
    for step, m in logged:
        # ESS logged after the step's update is measured on the same batch the tau was solved for
        assert abs(m["diag/ess"] - m["diag/ess_target"]) < 1e-3, (step, m["diag/ess"], m["diag/ess_target"])
    taus = [m["train/tau"] for _, m in logged]
    assert len(set(round(t, 6) for t in taus)) > 1 and all(math.isfinite(t) and t > 0 for t in taus)
