"""A longer budget continues a shorter one: when nothing in a cell's steps depends on its whole
budget (a constant rate after the warm-up, a fixed τ, no target momentum schedule), raising
``train.epochs`` of a finished cell and training it again continues the shorter run from its
``state.pt`` and ends with the weights of an uninterrupted run of the longer budget, bitwise,
with the snapshots of the budgets it passed taken over as the longer config's.  Anything else
starts afresh and says why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hooks import crash_after

from smallbatch import tracking
from smallbatch.pipeline import jobs
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell, trajectory_hash
from smallbatch.study.config import load_config
from smallbatch.training import loop as train
from smallbatch.training.checkpoint import load_snapshot, snapshot_path

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "log_every": 10, "lr_schedule": "constant"}
BS = 32

pytestmark = pytest.mark.usefixtures("one_thread")


def _cell(loss: str = "infonce", **train_opts) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    params = cfg["loss_params"].get(loss, {})
    return make_cell(cfg, dataset="digits", loss=loss, loss_params=params, batch_size=BS, temperature=0.5, seed=1)


def _run(cell: dict, d, out: Path) -> train.TrainResult:
    return train.pretrain(Cell.of(cell), d.pretrain_x, d.mean, d.std, out, device="cpu", progress=False)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _weights(out: Path) -> dict:
    return train.load_checkpoint(out / "checkpoint.pt")["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, digits):
    """Two epochs in one run, snapshots after half an epoch and one epoch."""
    cell = _cell(epochs=2, snapshot_epochs=[0.5, 1])
    out = tmp_path_factory.mktemp("two_epochs")
    _run(cell, digits, out)
    return cell, out


def test_the_trajectory_hash_leaves_out_the_budget_and_nothing_else():
    base = _cell(epochs=1)
    for budget in ({"epochs": 3}, {"steps": 7}, {"snapshot_epochs": [0.5]}):
        other = _cell(**{"epochs": 1, **budget})
        assert other["hash"] != base["hash"] and trajectory_hash(other) == trajectory_hash(base), budget
    for change in ({"lr": 1e-3}, {"warmup_epochs": 0.5}, {"bn_group": 16}):
        assert trajectory_hash(_cell(epochs=1, **change)) != trajectory_hash(base), change


def test_raising_the_budget_continues_the_run_to_the_uninterrupted_weights(uninterrupted, digits, tmp_path, capfd):
    long, direct = uninterrupted
    spe = digits.pretrain_x.shape[0] // BS
    short = _cell(epochs=1, snapshot_epochs=[0.5])
    _run(short, digits, tmp_path)
    capfd.readouterr()
    res = _run(long, digits, tmp_path)
    err = capfd.readouterr().err
    said = f"continuing {long['id']} from step {spe}/{2 * spe}: the run of config {short['hash']} at step {spe}"
    assert said in err, err
    assert res.extended_from == f"{short['hash']} at step {spe}" and res.steps == 2 * spe
    _same(_weights(tmp_path), _weights(direct))
    for name in ("ep0.5", "ep1"):  # taken over (ep0.5) and written from the shorter run's end (ep1)
        mine = load_snapshot(snapshot_path(tmp_path, name), Cell.of(long), name)  # stamped with the longer config
        _same(mine["model"], torch.load(snapshot_path(direct, name))["model"])
    assert train.load_checkpoint(tmp_path / "checkpoint.pt")["extended_from"] == res.extended_from


def test_a_continued_run_that_stops_and_resumes_still_names_the_run_it_continued(digits, tmp_path):
    spe = digits.pretrain_x.shape[0] // BS
    short, long = _cell(epochs=1), _cell(epochs=3)
    _run(short, digits, tmp_path)
    with pytest.raises(KeyboardInterrupt):  # past the end of epoch 2: a state of the longer config is saved
        train.pretrain(
            Cell.of(long),
            digits.pretrain_x,
            digits.mean,
            digits.std,
            tmp_path,
            device="cpu",
            progress=False,
            after_step=crash_after(2 * spe + 3),
        )
    assert train.load_checkpoint(tmp_path / "state.pt")["cell_hash"] == long["hash"]
    res = _run(long, digits, tmp_path)
    assert res.extended_from == f"{short['hash']} at step {spe}" and res.steps == 3 * spe


def test_a_schedule_over_the_whole_budget_starts_the_longer_budget_afresh(digits, tmp_path, capfd):
    _run(_cell(epochs=1, lr_schedule="cosine"), digits, tmp_path)
    capfd.readouterr()
    res = _run(_cell(epochs=2, lr_schedule="cosine"), digits, tmp_path)
    err = capfd.readouterr().err
    assert "belongs to another config of this cell; starting afresh" in err, err
    assert res.extended_from is None and "continuing" not in err


def test_a_run_past_the_budget_or_of_other_settings_is_not_continued(uninterrupted, digits, tmp_path, capfd):
    long, direct = uninterrupted
    (tmp_path / "past").mkdir()
    (tmp_path / "past" / "state.pt").write_bytes((direct / "state.pt").read_bytes())
    capfd.readouterr()
    res = _run(_cell(epochs=1), digits, tmp_path / "past")
    err = capfd.readouterr().err
    assert "its run is past this budget" in err and "starting afresh" in err, err
    assert res.extended_from is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "state.pt").write_bytes((direct / "state.pt").read_bytes())
    res = _run(_cell(epochs=3, lr=1e-3), digits, tmp_path / "other")  # another rate: another trajectory
    assert res.extended_from is None and "starting afresh" in capfd.readouterr().err


def test_a_shorter_run_without_a_snapshot_the_longer_budget_asks_for_starts_afresh(digits, tmp_path, capfd):
    _run(_cell(epochs=1), digits, tmp_path)  # no snapshot after half an epoch
    capfd.readouterr()
    res = _run(_cell(epochs=2, snapshot_epochs=[0.5, 1]), digits, tmp_path)
    err = capfd.readouterr().err
    assert "kept no snapshot ep0.5.pt" in err and "starting afresh" in err, err
    assert res.extended_from is None


def test_the_store_names_the_run_a_longer_budget_continued(digits, cache, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "longer")
    short, long = _cell(epochs=1), _cell(epochs=2)
    for cell in (short, long):
        jobs.run_pretrain(Cell.of(cell), tmp_path / "cell", tracking_uri=uri, experiment="longer", cache=cache)
    spe = digits.pretrain_x.shape[0] // BS
    run = tracking.find_cell_run(uri, "longer", long)
    assert run.tags()[tracking.TAG_EXTENDED] == f"{short['hash']} at step {spe}"
    assert tracking.find_cell_run(uri, "longer", short).run_id != run.run_id  # the shorter budget's run is kept
