"""A loss that learns parameters, in the training loop: InfoNCE at a learnt τ = exp(-t')
(``infonce_lt``), a real digits cell in float64.

Its registry entry (``learnable``, ``owns_temperature``) is all the loop reads: t' joins the
optimiser (a second group, no weight decay), starts at the cell's τ, is what ``train/tau``
logs, is saved and restored with the loss (a resumed run ends bitwise where an
uninterrupted one does), and on two gloo processes its gradient is averaged like the
network's (the 2-process cell ends where the 1-process cell does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hooks import crash_after
from test_distributed import run_spawned

from smallbatch.data import load as data
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.checks import control_problem
from smallbatch.study.config import load_config
from smallbatch.training import loop as train

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "precision": "fp64"}
TAU0 = 0.5


def learnt_tau_cell(loss: str = "infonce_lt", **train_opts) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    params = cfg["loss_params"].get(loss, {})
    return make_cell(cfg, dataset="digits", loss=loss, loss_params=params, batch_size=32, temperature=TAU0, seed=0)


def run(cell: dict, images, d, out: Path, **kw) -> train.TrainResult:
    return train.pretrain(Cell.of(cell), images, d.mean, d.std, out, device="cpu", progress=False, **kw)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_the_learnt_temperature_is_trained_without_weight_decay_and_starts_at_the_cells(tmp_path, digits):
    cell = learnt_tau_cell(epochs=1, weight_decay=1e-4)
    t = train.build_training(Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, torch.device("cpu"), tmp_path)
    groups = t.step_fn.opt.param_groups
    loss = t.step_fn.loss_fn
    assert len(groups) == 2 and groups[1]["params"] == [loss.log_scale] and groups[1]["weight_decay"] == 0.0
    assert groups[0]["weight_decay"] == 1e-4 and len(groups[0]["params"]) == len(list(t.step_fn.model.parameters()))
    assert loss.log_scale.dtype == torch.float64 and float(loss.learnt_temperature().detach()) == pytest.approx(TAU0)
    assert t.step_fn.temperature.value == pytest.approx(TAU0)


@pytest.mark.parametrize("loss", ["infonce_lt", "siglip"])
def test_the_learnt_temperature_trains_logs_its_value_and_resumes_bitwise(loss, tmp_path, digits, capfd):
    """(SigLIP learns its bias b beside t'.)"""
    cell = learnt_tau_cell(loss, epochs=2, log_every=1)
    logs: list[tuple[int, dict]] = []
    ref = run(cell, digits.pretrain_x, digits, tmp_path / "ref", log_fn=lambda m, s: logs.append((s, m)))
    assert ref.status == "finished"
    # train/tau is the τ each step used: exp(-t') of t' after the step before it
    for (s0, m0), (s1, m1) in zip(logs, logs[1:]):
        tau = torch.exp(-torch.tensor(m0["train/loss_log_scale"], dtype=torch.float64))  # the loss's own op
        assert s1 == s0 + 1 and m1["train/tau"] == float(tau)
    assert logs[0][1]["train/tau"] == TAU0  # the first step: t' = -log τ of the cell
    assert abs(logs[-1][1]["train/tau"] - TAU0) > 1e-3, "the temperature did not move"
    final = train.load_checkpoint(tmp_path / "ref" / "state.pt")["loss"]["log_scale"]
    assert float(final) == logs[-1][1]["train/loss_log_scale"]
    # resumed mid-epoch from the epoch-1 state: the same network and the same t', bitwise
    spe = digits.pretrain_x.shape[0] // 32
    with pytest.raises(KeyboardInterrupt):
        run(cell, digits.pretrain_x, digits, tmp_path / "cell", after_step=crash_after(spe + 5))
    capfd.readouterr()
    res = run(cell, digits.pretrain_x, digits, tmp_path / "cell")
    assert f"from step {spe}/" in capfd.readouterr().err
    assert res.final_loss == ref.final_loss
    a, b = (train.load_checkpoint(tmp_path / f / "state.pt") for f in ("ref", "cell"))
    assert a["loss"].keys() == b["loss"].keys() == {p for p, _ in train.build_loss(loss).named_parameters()}
    for k, v in a["loss"].items():
        assert torch.equal(v, b["loss"][k]), k
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def test_a_learnt_temperature_and_an_ess_schedule_are_refused_in_one_line():
    problem = control_problem(Cell.of(learnt_tau_cell(epochs=1, ess_schedule={"start": 0.9, "end": 0.3})))
    assert problem == "InfoNCE (learnt τ) learns its temperature; set train.ess_schedule: null"


# --------------------------------------------------------------------------- two processes
STEPS = 12


def trained_tau(world=None, out: Path | None = None) -> float:
    """The cell's τ after STEPS steps on ``world``'s processes (default: one)."""
    import tempfile
    import time

    d = data.load_dataset("digits", None)
    size = world.size if world is not None else 1
    cell = learnt_tau_cell(steps=STEPS, devices=size, log_every=STEPS)
    out = out or Path(tempfile.mkdtemp(prefix="learnt-tau-"))
    t = train.build_training(Cell.of(cell), d.pretrain_x[:256], d.mean, d.std, torch.device("cpu"), out, world)
    assert train.run_loop(t, train.Hooks(progress=False), time.perf_counter()) == "finished" and t.step == STEPS
    return float(t.step_fn.loss_fn.learnt_temperature().detach())


def checks():
    return [("learnt_tau", lambda world: {"tau": trained_tau(world)})]


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
def test_a_learnt_temperature_on_two_processes_is_the_one_process_temperature(tmp_path):
    """Each of 2 gloo processes has half the anchors; t's gradient averaged over them is the
    whole batch's, so the 2-process cell's τ after 12 steps is the 1-process cell's (to
    float64's summation order) and the same on both processes."""
    spawned = run_spawned("test_loss_parameters:checks", tmp_path)
    one = trained_tau(out=tmp_path / "one")
    assert abs(one - TAU0) > 1e-4  # it moved: the comparison below tells averaged from not
    for rank, res in enumerate(spawned):
        r = res["learnt_tau"]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["tau"] == pytest.approx(one, rel=1e-10, abs=0), rank
    assert spawned[0]["learnt_tau"]["tau"] == spawned[1]["learnt_tau"]["tau"]
