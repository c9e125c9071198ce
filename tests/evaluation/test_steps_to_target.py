"""Steps to a target (smallbatch.evaluation.steps_to_target): the first crossing, the evaluation
grid, the held-out validation split, and one arm trained to a target on the digits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from smallbatch.data.load import load_dataset
from smallbatch.evaluation import SUPERVISED_ARM
from smallbatch.evaluation import steps_to_target as stt
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import validate_config


def test_first_crossing_interpolates_between_the_evaluations_around_it():
    steps, acc = [0, 10, 20, 40], [50.0, 60.0, 70.0, 90.0]
    assert stt.first_crossing(steps, acc, 65.0) == pytest.approx(15.0)  # halfway from 60 (step 10) to 70 (20)
    assert stt.first_crossing(steps, acc, 85.0) == pytest.approx(35.0)  # three quarters of 20 -> 40
    assert stt.first_crossing(steps, acc, 70.0) == pytest.approx(20.0)  # reached exactly at an evaluation
    assert stt.first_crossing(steps, acc, 40.0) == 0.0  # the initial network already there


def test_first_crossing_is_the_first_one_when_the_curve_dips_back():
    # up past 65 at step 10 -> 20 (crossing at 15), down below it, up again later: 15, not a later one
    assert stt.first_crossing([0, 10, 20, 30, 40], [60.0, 60.0, 70.0, 55.0, 80.0], 65.0) == pytest.approx(15.0)


def test_a_curve_that_never_reaches_the_target_gives_none():
    assert stt.first_crossing([0, 10, 20], [50.0, 60.0, 64.99], 65.0) is None
    assert stt.first_crossing([], [], 65.0) is None


def test_eval_grid_is_geometric_in_images_and_the_same_images_at_every_batch():
    assert stt.eval_steps(10, 100, 800, 1) == [0, 10, 20, 40, 80]  # 100, 200, 400, 800 images
    assert stt.eval_steps(100, 100, 800, 1) == [0, 1, 2, 4, 8]
    assert stt.eval_steps(200, 100, 800, 1) == [0, 1, 2, 4]  # 100 and 200 images: both the first step
    with pytest.raises(ValueError, match="evaluation grid"):
        stt.eval_steps(10, 900, 800, 1)


def test_hold_out_takes_training_images_only_and_keeps_them_apart():
    x = torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1)
    y = torch.arange(20)
    tx, ty, vx, vy = stt.hold_out(x, y, 5)
    assert vx.shape[0] == 5 and tx.shape[0] == 15
    assert sorted(ty.tolist() + vy.tolist()) == list(range(20))  # a partition of the training images
    assert torch.equal(tx.view(-1).long(), ty) and torch.equal(vx.view(-1).long(), vy)  # images keep their labels
    with pytest.raises(ValueError, match="validation split"):
        stt.hold_out(x, y, 20)


def _cell(batch: int = 32, steps: int = 8) -> Cell:
    cfg = validate_config(
        {
            "datasets": {"digits": {}},
            "train": {"width": 8, "lr": 0.003, "lr_schedule": "constant", "warmup_epochs": 0, "log_every": 10**6},
        }
    )
    raw = make_cell(
        cfg,
        dataset="digits",
        loss="infonce",
        loss_params={},
        batch_size=batch,
        temperature=0.2,
        seed=0,
        train_overrides={"steps": steps},
    )
    return Cell.of(raw)


@pytest.fixture(scope="module")
def digits():
    torch.set_num_threads(1)
    return load_dataset("digits", None)


def _run(d, arm: str, target: float):
    data, probe = stt.split_data(d, 300, queries=60, k=5, t=0.1)
    return stt.run_arm(_cell(), arm, data, probe, [0, 2, 4, 8], target, stop_at_target=False)


@pytest.mark.parametrize("arm", ["infonce", SUPERVISED_ARM])
def test_the_target_is_read_on_the_validation_split_only(digits, arm):
    base = _run(digits, arm, 50.0)
    g = torch.Generator().manual_seed(1)
    moved = dataclasses.replace(digits, test_y=digits.test_y[torch.randperm(digits.test_y.shape[0], generator=g)])
    assert _run(moved, arm, 50.0).curve.accuracy == base.curve.accuracy  # test labels moved: nothing changes
    shuffled = dataclasses.replace(digits, train_y=digits.train_y[torch.randperm(digits.train_y.shape[0], generator=g)])
    assert _run(shuffled, arm, 50.0).curve.accuracy != base.curve.accuracy  # the training labels do reach it


def test_an_arm_that_never_reaches_the_target_says_so(digits):
    res = _run(digits, "infonce", 100.1)
    assert res.steps is None and res.images is None and res.status == "not reached"
    assert res.curve.steps == [0, 2, 4, 8] and len(res.curve.accuracy) == 4


def test_an_arm_stops_at_its_first_evaluation_past_the_target(digits):
    data, probe = stt.split_data(digits, 300, queries=60, k=5, t=0.1)
    res = stt.run_arm(_cell(), "infonce", data, probe, [0, 2, 4, 8], 0.0)
    assert res.status == "reached" and res.steps == 0.0 and res.curve.steps == [0]


def test_the_schedule_must_end_at_the_cells_steps(digits):
    data, probe = stt.split_data(digits, 300, queries=60, k=5, t=0.1)
    with pytest.raises(ValueError, match="train.steps"):
        stt.run_arm(_cell(steps=9), "infonce", data, probe, [0, 2, 4, 8], 50.0)
