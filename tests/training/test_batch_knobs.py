"""The batch-size rules of the knobs beyond the rate (:mod:`smallbatch.study.lr_scaling`): Adam's β2 and
the EMA momenta stated at batch 256 and mapped to a cell's batch so that their horizon in images is
the same, each checked against a hand computation; the value training uses is the one the run logs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hooks import crash_after
from test_train import digits_cell, run, steps_per_epoch

from smallbatch.pipeline.jobs import run_params
from smallbatch.study.cell import read_cell
from smallbatch.study.lr_scaling import resolved_knobs, scaled_decay


@pytest.mark.parametrize(
    "decay,bs,rule,want",
    [
        (0.999, 16, "samples", 0.999**0.0625),  # Marek et al.: 0.99994 at 16 from 0.999 at 256
        (0.999, 256, "samples", 0.999),
        (0.999, 1024, "samples", 0.999**4),
        (0.99, 64, "samples", 0.99**0.25),  # Busbridge et al.: rho^kappa, kappa = 64/256
        (0.999, 16, "none", 0.999),
    ],
)
def test_a_decay_keeps_its_horizon_in_images(decay, bs, rule, want):
    assert scaled_decay(decay, bs, rule) == pytest.approx(want, rel=1e-15)
    if rule == "samples":  # the half-life in images is the same at every batch
        half = lambda rho, n: (
            n * torch.log(torch.tensor(0.5, dtype=torch.float64)) / torch.log(torch.tensor(rho, dtype=torch.float64))
        )  # noqa: E731
        assert float(half(want, bs)) == pytest.approx(float(half(decay, 256)), rel=1e-9)


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="must be one of none, samples"):
        scaled_decay(0.9, 16, "linear")


def test_the_knobs_a_cell_has_are_resolved_at_its_batch():
    tr = SimpleNamespace(
        adam_beta2=0.999, beta2_scaling="samples", queue_size=4096, moco_momentum=0.99, ema_scaling="samples"
    )
    got = resolved_knobs(tr, 16, 0.996)
    assert got == pytest.approx(
        {"train.adam_beta2": 0.999 ** (1 / 16), "train.moco_momentum": 0.99 ** (1 / 16), "loss.ema": 0.996 ** (1 / 16)}
    )
    plain = SimpleNamespace(
        adam_beta2=0.999, beta2_scaling="none", queue_size=0, moco_momentum=0.99, ema_scaling="none"
    )
    assert resolved_knobs(plain, 16) == {"train.adam_beta2": 0.999}


def test_training_uses_the_resolved_beta2_and_the_run_logs_it(tmp_path, digits):
    cell = digits_cell(batch_size=64, epochs=2, beta2_scaling="samples", adam_beta2=0.99)
    want = 0.99**0.25  # 0.99 at 256, a quarter of the images per step at 64
    with pytest.raises(KeyboardInterrupt):  # stopped in epoch 2: state.pt holds the optimiser's state
        run(cell, digits, tmp_path, after_step=crash_after(steps_per_epoch(cell, digits) + 1))
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    betas = [tuple(g["betas"]) for g in state["optimizer"]["param_groups"]]
    assert betas and all(b == (0.9, pytest.approx(want, rel=1e-12)) for b in betas)
    data = SimpleNamespace(train_x=torch.zeros(1, 1, 8, 8), pretrain_x=torch.zeros(10, 1, 8, 8))
    params = run_params(read_cell(cell), data)
    assert float(params["resolved.train.adam_beta2"]) == pytest.approx(want, rel=1e-15)
    assert params["train.beta2_scaling"] == "samples"


def test_a_regime_sets_the_decay_rules_and_each_cell_resolves_them_at_its_batch(tmp_path):
    """An optimiser regime bundles the knobs' rules with the rate (the regime side experiment then
    sets B = 16 against 256 with the rule on and off): each cell carries its regime's rule, and the
    β2 it trains with is 0.999^(N/256) under ``samples``, 0.999 under ``none``."""
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    regimes = [
        {"name": "plain", "optimizer": "adam", "beta2_scaling": "none"},
        {"name": "b2", "optimizer": "adam", "beta2_scaling": "samples", "adam_beta2": 0.998, "ema_scaling": "samples"},
    ]
    cfg = load_config(
        None,
        {
            "results_dir": str(tmp_path / "results"),
            "datasets": {"digits": {}},
            "grid": {"enabled": False},
            "baselines": False,
            "experiments": {
                "mi": {"enabled": False},
                "regime": {
                    "enabled": True,
                    "losses": ["infonce"],
                    "batch_sizes": [16, 256],
                    "temperatures": [0.1],
                    "seeds": [0],
                    "axes": {"regime": regimes},
                },
            },
        },
    )
    got = {}
    for cell in expand_cells(cfg).values():
        tr = SimpleNamespace(**cell["train"])
        got[(cell["train"]["regime"], cell["batch_size"])] = resolved_knobs(tr, cell["batch_size"])["train.adam_beta2"]
    assert got == pytest.approx(
        {("plain", 16): 0.999, ("plain", 256): 0.999, ("b2", 16): 0.998 ** (1 / 16), ("b2", 256): 0.998}, rel=1e-15
    )


def test_a_regime_may_set_the_rate_schedule_and_its_cells_differ_in_it_alone(tmp_path):
    """The cosine check of the small batch's lead sets a constant rate against a cosine decay as two
    regimes at each batch's own rate (a batch entry's lr): each pair of cells differs in
    ``train.lr_schedule`` (and the regime's name) alone, and each cell trains with its regime's."""
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    section = {
        "enabled": True,
        "losses": ["infonce"],
        "batch_sizes": [{"size": 16, "train": {"lr": 2e-3}}, {"size": 64, "train": {"lr": 1e-3}}],
        "temperatures": [0.1],
        "seeds": [0],
        "train": {"snapshot_epochs": None},
        "axes": {"regime": [{"name": "flat", "lr_schedule": "constant"}, {"name": "cos", "lr_schedule": "cosine"}]},
    }
    overlay = {
        "results_dir": str(tmp_path / "results"),
        "datasets": {"digits": {}},
        "grid": {"enabled": False},
        "baselines": False,
        "experiments": {"mi": {"enabled": False}, "regime": section},
    }
    cells = expand_cells(load_config(None, overlay))
    assert sorted(cells) == [
        f"regime/digits/infonce/bs{b}-t0.1-s0-lr{lr}-{r}"
        for b, lr in ((16, 0.002), (64, 0.001))
        for r in ("cos", "flat")
    ]
    for b, lr in ((16, 0.002), (64, 0.001)):
        flat, cos = (cells[f"regime/digits/infonce/bs{b}-t0.1-s0-lr{lr}-{r}"]["train"] for r in ("flat", "cos"))
        assert (flat["lr_schedule"], cos["lr_schedule"]) == ("constant", "cosine") and flat["lr"] == cos["lr"] == lr
        assert {k for k in flat if flat[k] != cos[k]} == {"lr_schedule", "regime"}
