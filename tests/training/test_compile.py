"""The training step as one graph: what the CPU can prove about the GPU path.

A `.item()`, a data-dependent shape or a Python branch on a tensor inside the step
would both break a `torch.compile` graph and make a GPU wait for the host; so zero
graph breaks (``torch._dynamo.explain``) in the step of an in-batch cell, for every loss
and both augmentation recipes (and the ESS-scheduled temperature, and every
optimiser's update), is the CPU's proof that the step never synchronises.  A compiled
run must also train like the eager one (same loss curve within float tolerance).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from smallbatch.losses import REGISTRY
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config
from smallbatch.training import loop as train
from smallbatch.training.optim import make_optimizer, optimizer_step

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8}


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _training(loss: str, recipe: str, channels: int, size: int, tmp: Path, **train_opts):
    cfg = load_config(
        None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}, "augment": {"recipe": recipe}}
    )
    cell = make_cell(cfg, dataset="digits", loss=loss, loss_params={}, batch_size=8, temperature=0.2, seed=0)
    images = (torch.rand(64, channels, size, size, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    t = train.build_training(Cell.of(cell), images, [0.5] * channels, [0.25] * channels, torch.device("cpu"), tmp)
    return t, images


#: the optimiser update's explanation per (optimiser, momentum, weight decay, parameter shapes)
_UPDATES: dict = {}


def _explain_step(t, images):
    idx = torch.arange(8)
    u = t.step_fn.aug.draw(16, torch.Generator().manual_seed(0))
    fwd = torch._dynamo.explain(t.step_fn.forward)(images[idx], u, idx)
    out = t.step_fn.forward(images[idx], u, idx)
    out.loss.backward()
    tr = t.cell.train  # the optimiser as a compiled step builds it (not CPU Adam's fused kernel)
    params = list(t.step_fn.model.parameters())
    key = (tr.optimizer, tr.momentum, tr.weight_decay, tuple(tuple(p.shape) for p in params))
    if key not in _UPDATES:  # the update's graph depends on the optimiser and the parameters' shapes only
        opt = make_optimizer(params, tr.optimizer, 0.01, tr.momentum, tr.weight_decay, compiled=True)
        _UPDATES[key] = torch._dynamo.explain(optimizer_step)(opt)
    return fwd, _UPDATES[key]


#: every loss with one recipe, and each recipe with a contrastive loss and a method without
#: negatives (predictor and EMA target): the augmentation's graph does not depend on the loss,
#: nor the loss's (on the embeddings) on the recipe
STEPS = [(loss, "gray_small", 1, 8) for loss in REGISTRY] + [(loss, "simclr", 3, 32) for loss in ("infonce", "byol")]


@pytest.mark.parametrize("loss,recipe,channels,size", STEPS)
def test_in_batch_step_has_no_graph_break(loss, recipe, channels, size, tmp_path):
    fwd, upd = _explain_step(*_training(loss, recipe, channels, size, tmp_path))
    assert fwd.graph_break_count == 0 and fwd.graph_count == 1, [str(r.reason) for r in fwd.break_reasons]
    assert upd.graph_break_count == 0 and upd.graph_count == 1, [str(r.reason) for r in upd.break_reasons]


@pytest.mark.parametrize(
    "opts",
    [
        {"optimizer": "sgd"},
        {"optimizer": "lars"},
        {"ess_schedule": {"start": 0.9, "end": 0.3}},
        {"precision": "bf16"},
        {"precision": "fp64"},
    ],
    ids=["sgd", "lars", "ess", "bf16", "fp64"],
)
def test_other_settings_keep_the_step_one_graph(opts, tmp_path):
    fwd, upd = _explain_step(*_training("flatnce", "gray_small", 1, 8, tmp_path, **opts))
    assert fwd.graph_break_count == 0 and fwd.graph_count == 1, [str(r.reason) for r in fwd.break_reasons]
    assert upd.graph_break_count == 0 and upd.graph_count == 1, [str(r.reason) for r in upd.break_reasons]


def test_blurred_simclr_views_keep_the_step_one_graph(tmp_path):
    """SimCLR's Gaussian blur applies from 96 px: its per-sample kernels are masks too."""
    fwd, _ = _explain_step(*_training("infonce", "simclr", 3, 96, tmp_path))
    assert fwd.graph_break_count == 0, [str(r.reason) for r in fwd.break_reasons]


def test_compiled_training_follows_the_eager_loss_curve(tmp_path):
    """The same digits cell, eager and `train.compile: true`: the logged losses agree to
    float32 rounding (inductor fuses and reorders float operations, so not bitwise)."""
    from smallbatch.data import load as data

    d = data.load_dataset("digits", tmp_path)
    curves = {}
    for compiled in (False, True):
        cfg = load_config(
            None, {"datasets": {"digits": {}}, "train": {**TINY, "steps": 30, "log_every": 5, "compile": compiled}}
        )
        cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=32, temperature=0.5, seed=0)
        logs: list = []
        train.pretrain(
            Cell.of(cell),
            d.pretrain_x,
            d.mean,
            d.std,
            tmp_path / str(compiled),
            device="cpu",
            progress=False,
            log_fn=lambda m, s, logs=logs: logs.append(m["train/loss"]),
        )
        curves[compiled] = logs
    assert len(curves[True]) == len(curves[False]) == 6
    # measured: at most 3.3e-7 relative (1.4e-6 absolute) over the six logged losses; held to 9x that
    torch.testing.assert_close(
        torch.tensor(curves[True], dtype=torch.float64),
        torch.tensor(curves[False], dtype=torch.float64),
        rtol=3e-6,
        atol=0,
    )


def test_cuda_graph_steps_are_marked_and_cached_constants_made_outside_the_graph(tmp_path, monkeypatch):
    """Two faults only the H200 showed (benchmarks/results/gpu_check_h200.md): compiled with
    CUDA graphs (mode reduce-overhead), every training iteration must be marked as a new one,
    and the tensors the step caches (the augmentation's device constants) must be made before
    the compiled region — made inside it they are outputs of the graph, overwritten by its next
    run ("accessing tensor output of CUDAGraphs that has been overwritten").  The CPU has no
    CUDA graphs: this checks the wiring, with torch.compile replaced by the identity."""
    t, images = _training("infonce", "gray_small", 1, 8, tmp_path)
    s = t.step_fn
    assert not s.aug._constants
    marks: list[int] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    s.compile(None)
    assert s.cuda_graphs is False and list(s.aug._constants) == [images.device]
    s.compile("reduce-overhead")
    assert s.cuda_graphs is True
    for step in range(3):
        idx = torch.arange(8) + 8 * step
        s.run(images[idx], s.aug.draw(16, torch.Generator().manual_seed(step)), idx)
    assert len(marks) == 3
