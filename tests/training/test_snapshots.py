"""Training budgets from one run (``train.snapshot_epochs``): with a learning rate that does
not depend on the budget's length (``train.lr_schedule: constant``) the weights after S steps of
a long run are the weights of a run of S steps, bitwise; a snapshot file names its cell, config
and budget and is refused for another; the last snapshot at the final epoch is the checkpoint;
the probes evaluate a snapshot as they do the final checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hooks import crash_after

from smallbatch.errors import CheckpointError
from smallbatch.pipeline import jobs
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training import loop as train
from smallbatch.training.checkpoint import load_snapshot, snapshot_path, snapshot_steps
from smallbatch.training.optim import lr_at

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "log_every": 10}
BS = 32


def _cell(**train_opts) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, "lr_schedule": "constant", **train_opts}})
    return make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=BS, temperature=0.5, seed=1)


def _run(cell: dict, d, out: Path, **kw) -> train.TrainResult:
    return train.pretrain(Cell.of(cell), d.pretrain_x, d.mean, d.std, out, device="cpu", progress=False, **kw)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, digits):
    """Two epochs with snapshots after half an epoch, one epoch and two (the end)."""
    cell = _cell(epochs=2, snapshot_epochs=[0.5, 1, 2])
    out = tmp_path_factory.mktemp("long")
    return cell, out, _run(cell, digits, out)


def test_the_constant_schedule_holds_the_peak_after_the_warm_up():
    assert [lr_at(s, 100, 4, 1.0, "constant") for s in (0, 3, 4, 50, 99, 500)] == [0.25, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert lr_at(50, 100, 4, 1.0) < 1.0  # cosine, the default, decays over the budget
    with pytest.raises(ValueError, match="lr_schedule must be one of cosine, constant"):
        lr_at(0, 10, 0, 1.0, "step")


def test_snapshots_with_a_schedule_of_the_whole_budget_are_refused_in_one_line():
    over = {"datasets": {"digits": {}}, "train": {**TINY, "snapshot_epochs": [1]}}
    with pytest.raises(ConfigError, match=r"train.snapshot_epochs needs train.lr_schedule: constant") as exc:
        load_config(None, over)
    assert "\n" not in str(exc.value)
    ess = {"start": 0.5, "end": 0.5}
    with pytest.raises(ConfigError, match="needs a fixed tau"):
        load_config(None, {**over, "train": {**over["train"], "lr_schedule": "constant", "ess_schedule": ess}})
    with pytest.raises(ConfigError, match="snapshot_epochs 4 is past train.epochs = 3"):
        load_config(None, {**over, "train": {**TINY, "lr_schedule": "constant", "snapshot_epochs": [1, 4]}})


def test_snapshots_of_a_target_network_with_a_momentum_schedule_are_refused_in_one_line():
    over = {
        "datasets": {"digits": {}},
        "train": {**TINY, "lr_schedule": "constant", "snapshot_epochs": [1]},
        "grid": {"losses": ["byol"]},
    }
    with pytest.raises(ConfigError, match=r"snapshot_epochs needs loss_params.ema_schedule: fixed") as exc:
        load_config(None, over)
    assert "\n" not in str(exc.value)
    load_config(None, {**over, "loss_params": {"byol": {"ema_schedule": "fixed"}}})


def test_two_budgets_on_one_step_are_refused_when_planned_and_by_the_job(tmp_path):
    # digits' 1,437 images make 89 steps an epoch at batch 16: 0.5 and 0.501 epochs are both round(44.5) = 45
    with pytest.raises(ConfigError, match=r"snapshot_epochs 0.5 and 0.501 are both step 45 \(89 steps per epoch\)"):
        _cell(epochs=2, snapshot_epochs=[0.5, 0.501])
    one = _cell(epochs=2, snapshot_epochs=[0.5])
    cell = {**one, "train": {**one["train"], "snapshot_epochs": [0.5, 0.501]}}  # past the plan: the job's own check
    images = torch.zeros(8 * BS, 1, 8, 8, dtype=torch.uint8)  # 8 steps an epoch
    with pytest.raises(ValueError, match=r"snapshot_epochs 0.5 and 0.501 are both step 4"):
        train.build_training(Cell.of(cell), images, [0.5], [0.2], torch.device("cpu"), tmp_path)


def test_a_snapshot_is_the_run_of_its_budget_and_the_last_is_the_checkpoint(long_run, digits, tmp_path):
    cell, out, res = long_run
    spe = digits.pretrain_x.shape[0] // BS
    assert res.steps == 2 * spe
    final = train.load_checkpoint(out / "checkpoint.pt")["model"]
    last = load_snapshot(snapshot_path(out, "ep2"), Cell.of(cell), "ep2")
    _same(last["model"], final)
    assert last["budget"] == {"name": "ep2", "epochs": 2.0, "steps": 2 * spe, "images_seen": 2 * spe * BS}
    half = load_snapshot(snapshot_path(out, "ep0.5"), Cell.of(cell), "ep0.5")
    steps = snapshot_steps(0.5, spe)
    assert half["budget"]["steps"] == steps == round(spe / 2) and half["budget"]["images_seen"] == steps * BS
    short = _cell(epochs=2, steps=steps)  # the same cell trained for the snapshot's steps only
    _run(short, digits, tmp_path / "short")
    _same(half["model"], train.load_checkpoint(tmp_path / "short" / "checkpoint.pt")["model"])
    first = next(iter(final))
    assert not torch.equal(half["model"][first], final[first])


def test_a_snapshot_file_is_checked_against_its_cell_config_and_budget(long_run):
    cell, out, _ = long_run
    with pytest.raises(CheckpointError, match="is the snapshot of budget 'ep1', not of 'ep0.5'"):
        load_snapshot(snapshot_path(out, "ep1"), Cell.of(cell), "ep0.5")
    other = _cell(epochs=2, snapshot_epochs=[0.5, 1, 2], lr=1e-3)
    with pytest.raises(CheckpointError, match="belongs to another config of cell"):
        load_snapshot(snapshot_path(out, "ep1"), Cell.of(other), "ep1")
    with pytest.raises(CheckpointError, match="is a snapshot of a budget on the way"):
        train.load_checkpoint(snapshot_path(out, "ep1"), kind="checkpoint")


def test_a_resumed_run_writes_the_same_snapshots(long_run, digits, tmp_path):
    cell, out, _ = long_run
    spe = digits.pretrain_x.shape[0] // BS
    with pytest.raises(KeyboardInterrupt):
        _run(cell, digits, tmp_path, after_step=crash_after(spe + 3))  # past the first two snapshots' steps
    _run(cell, digits, tmp_path)
    for name in ("ep0.5", "ep1", "ep2"):
        _same(
            load_snapshot(snapshot_path(tmp_path, name), Cell.of(cell), name)["model"],
            torch.load(snapshot_path(out, name))["model"],
        )


def test_the_probes_evaluate_a_snapshot_as_the_final_checkpoint(long_run, cache):
    cell, out, _ = long_run
    res = jobs.run_evaluate(
        Cell.of(cell),
        snapshot_path(out, "ep2"),
        out / "snapshots",
        tracking_uri=None,
        experiment="x",
        cache=cache,
        snapshot="ep2",
    )
    final = jobs.run_evaluate(Cell.of(cell), out / "checkpoint.pt", out, tracking_uri=None, experiment="x", cache=cache)
    for kind in ("knn", "linear"):
        a = json.loads((out / "snapshots" / f"ep2.{kind}.json").read_text())
        b = json.loads((out / f"{kind}.json").read_text())
        assert a[f"{kind}/top1"] == b[f"{kind}/top1"] == res[kind][f"{kind}/top1"] == final[kind][f"{kind}/top1"]
    with pytest.raises(ValueError, match=r"has no snapshot 'ep3' \(its snapshots: ep0.5, ep1, ep2\)"):
        jobs.run_evaluate(
            Cell.of(cell), out / "x.pt", out, tracking_uri=None, experiment="x", cache=cache, snapshot="ep3"
        )
    m = jobs.snapshot_metrics(
        {"name": "ep1", "epochs": 1.0, "steps": 44, "images_seen": 1408}, {"knn/top1": 50.0}, "finished"
    )
    assert m == {
        "snapshot/ep1/knn/top1": 50.0,
        "snapshot/ep1/epochs": 1.0,
        "snapshot/ep1/steps": 44.0,
        "snapshot/ep1/images_seen": 1408.0,
        "snapshot/ep1/status": 0.0,
    }


def test_budgets_a_diverged_run_did_not_reach_finite_say_so(tmp_path, digits, cache):
    """SGD at lr 1e30 overflows the weights on the first update (a real non-finite loss)."""
    cell = _cell(epochs=2, snapshot_epochs=[1, 2], optimizer="sgd", warmup_epochs=0)
    cell = {**cell, "train": {**cell["train"], "lr": 1e30}}  # past the plan's bound on lr: the run's own handling
    assert _run(cell, digits, tmp_path).status == "diverged"
    for name in ("ep1", "ep2"):
        snap = load_snapshot(snapshot_path(tmp_path, name), Cell.of(cell), name)
        assert snap["status"] == "diverged" and snap["model"] == {}
    res = jobs.run_evaluate(
        Cell.of(cell),
        snapshot_path(tmp_path, "ep1"),
        tmp_path,
        tracking_uri=None,
        experiment="x",
        cache=cache,
        snapshot="ep1",
    )
    assert res["linear"]["status"] == res["knn"]["status"] == "diverged"


def test_evaluate_writes_the_features_it_probed_with_their_meta(long_run, cache, tmp_path):
    from smallbatch.evaluation.embed import load_features

    cell, out, _ = long_run
    path = tmp_path / "features.npz"
    jobs.run_evaluate(
        Cell.of(cell), out / "checkpoint.pt", tmp_path, tracking_uri=None, experiment="x", cache=cache, features=path
    )
    fs = load_features(path)
    assert fs.meta["status"] == "finished" and fs.meta["cell_id"] == cell["id"]
    assert len(fs.train_f) == len(fs.train_y) > 0 and len(fs.test_f) == len(fs.test_y) > 0
