"""Methods without negatives in the training loop: SimSiam, VICReg and BYOL on real digits cells.

Their registry entries (``negatives = "none"``, ``predictor``, ``ema_target``) are all the loop
reads: the model carries the predictor, the step takes the two views' outputs and targets, a
BYOL cell keeps an EMA target network (updated exactly, never trained), the state resumes
bitwise, every logging step says how the batch's covariance rank compares with B and D, and
what needs negatives or several processes is refused in one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hooks import crash_after

from smallbatch.study import checks
from smallbatch.study.cell import Cell, read_cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config
from smallbatch.training import loop as train
from smallbatch.training.negatives import Siamese, ema_momentum

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "lr": 3e-3, "precision": "fp64"}
METHODS = ("simsiam", "vicreg", "byol")
pytestmark = pytest.mark.usefixtures("one_thread")  # bitwise resume


def method_cell(loss: str, batch_size: int = 32, **train_opts) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    params = cfg["loss_params"].get(loss, {})
    return make_cell(
        cfg, dataset="digits", loss=loss, loss_params=params, batch_size=batch_size, temperature=0.5, seed=0
    )


def run(cell: dict, d, out: Path, **kw) -> train.TrainResult:
    return train.pretrain(Cell.of(cell), d.pretrain_x, d.mean, d.std, out, device="cpu", progress=False, **kw)


def test_the_ema_schedule_is_byols_cosine_from_its_base_to_one_or_fixed():
    assert ema_momentum(0.99, "cosine", 0, 100) == 0.99
    assert ema_momentum(0.99, "cosine", 100, 100) == 1.0
    assert ema_momentum(0.99, "cosine", 50, 100) == pytest.approx(0.995, abs=1e-15)
    k, total = 17, 60
    assert ema_momentum(0.9, "cosine", k, total) == 1 - 0.1 * (math.cos(math.pi * k / total) + 1) / 2
    assert all(ema_momentum(0.99, "fixed", k, 100) == 0.99 for k in (0, 50, 99))
    with pytest.raises(ValueError, match="ema_schedule"):
        ema_momentum(0.99, "linear", 0, 10)


def test_the_model_carries_the_predictor_its_loss_declares(tmp_path, digits):
    for loss, hidden in (("simsiam", 2), ("byol", 16), ("vicreg", None)):  # proj_dim 8 / 4; proj_hidden
        t = train.build_training(
            Cell.of(method_cell(loss, epochs=1)),
            digits.pretrain_x,
            digits.mean,
            digits.std,
            torch.device("cpu"),
            tmp_path,
        )
        model, src = t.step_fn.model, t.step_fn.source
        assert isinstance(src, Siamese) and t.cell.negatives == 0
        pred = getattr(model, "predictor", None)
        assert (pred is None) == (hidden is None), loss
        if pred is not None:
            assert pred.net[0].out_features == hidden and pred.net[-1].out_features == 8
            trained = {id(p) for g in t.step_fn.opt.param_groups for p in g["params"]}
            assert all(id(p) in trained for p in pred.parameters()), "the optimiser does not train the predictor"
        assert (src.target is not None) == (loss == "byol")


def test_byols_target_is_an_exact_ema_of_the_online_network_and_never_trained(tmp_path, digits):
    cell = method_cell("byol", epochs=1, bn_group=8)
    t = train.build_training(Cell.of(cell), digits.pretrain_x, digits.mean, digits.std, torch.device("cpu"), tmp_path)
    s, target = t.step_fn, t.step_fn.source.target
    assert not hasattr(target, "predictor") and all(not p.requires_grad for p in target.parameters())
    online0 = {k: v.clone() for k, v in s.model.state_dict().items()}
    assert all(torch.equal(v, online0[k]) for k, v in target.state_dict().items())  # starts as a copy
    for step in range(3):
        before = {k: v.clone() for k, v in target.named_parameters()}
        idx = torch.arange(step * 32, (step + 1) * 32)
        train.one_step(t, idx, watch=False)
        m = ema_momentum(0.99, "cosine", step, t.total)
        assert all(p.grad is None for p in target.parameters()), "a gradient reached the target network"
        for name, p in target.named_parameters():
            want = before[name] * m + s.model.get_parameter(name).detach() * (1 - m)
            assert torch.equal(p, want), name
        for name, b in target.named_buffers():  # BatchNorm's statistics: the online network's
            assert torch.equal(b, s.model.get_buffer(name)), name
    assert s.source.updates == 3


@pytest.mark.parametrize("loss", METHODS)
def test_a_method_cell_trains_logs_the_covariance_rank_and_resumes_bitwise(loss, tmp_path, digits, capfd):
    cell = method_cell(loss, batch_size=16, epochs=2, log_every=8)
    logs: list[tuple[int, dict]] = []
    ref = run(cell, digits, tmp_path / "ref", log_fn=lambda m, s: logs.append((s, m)))
    assert ref.status == "finished" and math.isfinite(ref.final_loss)
    for _, m in logs[:-1]:  # B = 16 images in D = 8 dimensions: the bound is D
        assert m["diag/cov_rank_bound"] == 8 and 1 <= m["diag/cov_rank"] <= 8
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/infonce"])
    assert not any(k.startswith("diag/grad_norm") for _, m in logs for k in m)  # no negatives: no InfoNCE/DCL gradients
    spe = digits.pretrain_x.shape[0] // 16
    with pytest.raises(KeyboardInterrupt):
        run(cell, digits, tmp_path / "cell", after_step=crash_after(spe + 5))
    capfd.readouterr()
    res = run(cell, digits, tmp_path / "cell")
    assert f"from step {spe}/" in capfd.readouterr().err
    assert res.final_loss == ref.final_loss
    a, b = (train.load_checkpoint(tmp_path / f / "state.pt") for f in ("ref", "cell"))
    assert any(k.startswith("predictor.") for k in a["model"]) == (loss != "vicreg")
    for part in ("model", "key_model"):
        assert (a[part] is None) == (b[part] is None) == (part == "key_model" and loss != "byol")
        for k, v in (a[part] or {}).items():
            assert torch.equal(v, b[part][k]), (part, k)
    if loss == "byol":
        assert a["ema_updates"] == b["ema_updates"] == ref.steps
    ck = train.load_checkpoint(tmp_path / "cell" / "checkpoint.pt")
    train.build_model(read_cell(ck["cell"]), ck["channels"], ck["image_size"]).load_state_dict(
        ck["model"]
    )  # strict: predictor too


@pytest.mark.parametrize(
    "opts,says",
    [
        ({"devices": 2}, "SimSiam (a method without negatives) runs on one process; set train.devices = 1"),
        (
            {"queue_size": 64},
            "SimSiam has no negatives: train.queue_size asks for a queue of negatives; set queue_size: 0",
        ),
        (
            {"neg_group": 8},
            "SimSiam has no negatives: train.neg_group asks for groups of negatives; set neg_group: null",
        ),
        ({"mask_same_class": True}, "train.mask_same_class asks for the same-class mask of negatives"),
        ({"ess_schedule": {"start": 0.9, "end": 0.3}}, "train.ess_schedule asks for a temperature scheduled"),
        ({"chunk_size": 8}, "train.chunk_size asks for gradient caching"),
    ],
    ids=["devices", "queue", "neg_group", "oracle", "ess", "chunks"],
)
def test_what_needs_negatives_or_processes_is_refused_in_one_line(opts, says):
    problem = checks.control_problem(Cell.of(method_cell("simsiam", epochs=1, **opts)))
    assert problem is not None and says in problem and "\n" not in problem
    assert checks.control_problem(Cell.of(method_cell("simsiam", epochs=1, bn_group=8))) is None


@pytest.mark.parametrize("method", ["simsiam", "vicreg", "byol"])
def test_a_method_cell_file_with_no_negatives_is_a_valid_cell_file(method):
    """K = 0 for a method without negatives: the cell file the planner writes passes the whole-file check."""
    import json

    from smallbatch.study import cellcheck, cells

    cfg = load_config(None, overrides={"grid": {"losses": [method], "batch_sizes": [16], "seeds": [0]}})
    cell = next(c for c in cells.expand_cells(cfg).values() if c["loss"] == method)
    assert cell["negatives"] == 0
    assert cellcheck.cell_json_problem(json.loads(json.dumps(cell)), baseline=False) is None
