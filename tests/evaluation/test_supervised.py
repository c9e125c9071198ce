"""The supervised upper bound (smallbatch.evaluation.supervised) and its baseline cells."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from smallbatch.data.load import load_dataset
from smallbatch.evaluation.supervised import supervised_schedule, train_supervised
from smallbatch.study.cell import BaselineCell, TrainSettings
from smallbatch.study.cells import baseline_cells
from smallbatch.study.config import validate_config


def _config(enabled=True, **extra):
    return validate_config(
        {
            "datasets": {"digits": {}},
            "grid": {"seeds": [0, 1]},
            "supervised_baseline": {"enabled": enabled, "batch_size": 32},
            "train": {"width": 8, "epochs": 1, "lr": 0.003},
            "eval": {"knn_k": [5], "linear_iterations": 20},
            **extra,
        }
    )


def test_supervised_baselines_are_cells_per_seed_only_when_enabled():
    cfg = _config(augment={"crop_scale": [0.5, 1.0]})
    cells = baseline_cells(cfg)
    sup = [c for c in cells.values() if c["baseline"] == "supervised"]
    assert [c["id"] for c in sup] == ["baselines/digits/supervised-s0", "baselines/digits/supervised-s1"]
    assert all(c["batch_size"] == 32 and c["augment"] == cfg["augment"] for c in sup)
    assert "batch_size" not in cells["baselines/digits/random_init-s0"]  # the other baselines keep their keys
    assert not any(c["baseline"] == "supervised" for c in baseline_cells(_config(enabled=False)).values())


def test_schedule_is_the_cells_schedule():
    given = {"epochs": 2.5, "steps": None, "warmup_epochs": 0.5, "lr": 0.1, "lr_scaling": "linear"}
    train = TrainSettings.from_dict({**_config()["train"], **given})
    assert supervised_schedule(train, 1000, 100) == (10, 25, 5, pytest.approx(0.1 * 100 / 256))
    assert supervised_schedule(dataclasses.replace(train, steps=7), 1000, 100)[1] == 7
    with pytest.raises(ValueError, match="batch_size"):
        supervised_schedule(train, 10, 11)


def _digits_cell():
    return next(c for c in baseline_cells(_config()).values() if c["baseline"] == "supervised")


def test_training_is_seeded_and_learns_the_labels():
    torch.set_num_threads(1)
    d = load_dataset("digits", None)
    cell = _digits_cell()
    a = train_supervised(BaselineCell.of(cell), d.train_x, d.train_y, 10, d.mean, d.std)
    b = train_supervised(BaselineCell.of(cell), d.train_x, d.train_y, 10, d.mean, d.std)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    # 10 epochs with a crop that keeps most of an 8 px digit
    cell = {**cell, "train": {**cell["train"], "epochs": 10}, "augment": {"crop_scale": [0.5, 1.0]}}
    a = train_supervised(BaselineCell.of(cell), d.train_x, d.train_y, 10, d.mean, d.std)
    from smallbatch.evaluation.embed import embed
    from smallbatch.evaluation.linear import linear_eval

    feats = [embed(a, x, d.mean, d.std) for x in (d.train_x, d.test_x)]
    trained = linear_eval(feats[0], d.train_y, feats[1], d.test_y, epochs=20)["top1"]
    torch.manual_seed(cell["seed"])
    from smallbatch.training.models import build_backbone

    fresh, _ = build_backbone("small_cnn", 1, 8, width=8, pool_grid=1)
    rand = [embed(fresh, x, d.mean, d.std) for x in (d.train_x, d.test_x)]
    untrained = linear_eval(rand[0], d.train_y, rand[1], d.test_y, epochs=20)["top1"]
    assert trained > untrained + 0.03, (trained, untrained)


def test_run_baseline_evaluates_the_supervised_backbone_with_the_same_probes(tmp_path):
    from smallbatch.pipeline.jobs import run_baseline

    out = tmp_path / "result.json"
    res = run_baseline(BaselineCell.of(_digits_cell()), out, tracking_uri=None, experiment="x")
    assert res["status"] == "finished" and json.loads(out.read_text())["cell_id"] == "baselines/digits/supervised-s0"
    assert {"knn/top1", "linear/top1"} <= set(res)


def test_a_baseline_job_refuses_a_study_cell_and_a_supervised_cell_without_its_training_keys():
    from smallbatch.study.cell import BaselineCell
    from smallbatch.study.cells import expand_cells

    study = next(iter(expand_cells(_config()).values()))
    with pytest.raises(ValueError, match="is not a baseline"):
        BaselineCell.of(study)
    d = load_dataset("digits", None)
    for key in ("batch_size", "augment"):
        cell = {k: v for k, v in _digits_cell().items() if k != key}
        with pytest.raises(ValueError, match="needs a batch_size and augment"):
            train_supervised(BaselineCell.of(cell), d.train_x, d.train_y, 10, d.mean, d.std)
