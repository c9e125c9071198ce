"""Every refusal a job makes of a cell's settings is made when the study is planned.

One row per check the training job runs on a cell (``smallbatch.training.loop``: the batch
against the images read, the controls, the snapshot budgets against the steps, the precision
against the device, the labels of the same-class mask, Adam's β2 at the cell's batch: torch's
own refusal of β2 = 1; ``training.temperature``: the ESS schedule; the loss's constructor: its
parameters).  Each row's settings are planned
(``validate_config``, what ``smallbatch cells`` and ``snakemake -n`` run) and must be refused
there in one line; the same settings given straight to the job (a cell past the plan) are
refused by the job too, so the row is one of the job's refusals and not a check of the plan's
own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from smallbatch.losses import build_loss
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training import loop
from smallbatch.training.distributed import World
from smallbatch.training.temperature import build_temperature

TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 5}
CPU = torch.device("cpu")
DIGITS = 1437  # digits' pretraining images: 89 steps an epoch at batch 16


def validate(cell: Cell) -> None:
    loop._validate(cell, DIGITS, CPU, World(device=CPU))


def snapshots(cell: Cell) -> None:
    loop.snapshot_budgets(cell, DIGITS // cell.batch_size, loop.budget_steps(cell, DIGITS // cell.batch_size))


def temperature(cell: Cell) -> None:
    build_temperature(cell, 10, CPU)


def loss(cell: Cell) -> None:
    build_loss(cell.loss, **cell.loss_params)


def unlabeled_images(cell: Cell, tmp: Path) -> None:
    loop.build_training(cell, torch.zeros(64, 3, 8, 8, dtype=torch.uint8), [0.5] * 3, [0.2] * 3, CPU, tmp)


def digits_images(cell: Cell, tmp: Path) -> None:
    loop.build_training(cell, torch.zeros(64, 1, 8, 8, dtype=torch.uint8), [0.5], [0.2], CPU, tmp)


@dataclass(frozen=True)
class Refusal:
    name: str
    plan: str  # regex the plan's one line must hold
    job: Callable  # the job's check, called with the cell (and a folder where it takes one)
    train: dict = field(default_factory=dict)
    cell: dict = field(default_factory=dict)  # batch_size, loss, loss_params, dataset, device


REFUSALS = [
    Refusal(
        "a batch larger than the images",
        r"batch size 2048 is larger than the 1,437",
        validate,
        cell={"batch_size": 2048},
    ),
    Refusal(
        "fresh negatives beyond the images",
        r"batch size 16 with 1500 extra negatives is larger than the 1,437",
        validate,
        train={"extra_negatives": 1500},
    ),
    Refusal(
        "a negatives' group that does not divide the batch",
        r"train\.neg_group = 3 does not divide",
        validate,
        {"neg_group": 3},
    ),
    Refusal("fp16 on the CPU", r"precision fp16 needs CUDA", validate, {"precision": "fp16"}, {"device": "cpu"}),
    Refusal(
        "a snapshot past a fixed steps budget",
        r"train\.snapshot_epochs 1 is step 89, past the cell's 12 steps",
        snapshots,
        {"steps": 12, "lr_schedule": "constant", "snapshot_epochs": [1]},
    ),
    Refusal(
        "two snapshots on one step",
        r"train\.snapshot_epochs 0\.5 and 0\.501 are both step 45",
        snapshots,
        {"epochs": 2, "lr_schedule": "constant", "snapshot_epochs": [0.5, 0.501]},
    ),
    Refusal(
        "a snapshot of the untrained weights",
        r"train\.snapshot_epochs 1e-06 is less than half of one of the cell's 89 steps",
        snapshots,
        {"lr_schedule": "constant", "snapshot_epochs": [1e-6]},
    ),
    Refusal(
        "an ESS schedule whose tau_min is above its tau_max",
        r"train\.ess_schedule\.tau_min = 5 is not below its tau_max = 1",
        temperature,
        {"ess_schedule": {"start": 0.5, "end": 0.5, "rate": 1.0, "tau_min": 5.0, "tau_max": 1.0}},
    ),
    Refusal(
        "the same-class mask without labels",
        r"train\.mask_same_class needs labels, and stl10's pretraining split \(unlabeled\) has none",
        unlabeled_images,
        {"mask_same_class": True},
        {"dataset": "stl10"},
    ),
    Refusal(
        "Adam's beta2 that its batch rule rounds to 1",
        r"train\.adam_beta2 at batch 16 is 1 under train\.beta2_scaling samples",
        digits_images,
        {"adam_beta2": 0.9999999999999999, "beta2_scaling": "samples"},
    ),
    Refusal(
        "a loss parameter past its bound",
        r"config key 'grid\.losses\[0\]\.t' = 1e\+308 is out of range; it must be <= 20",
        loss,
        cell={"loss": "kcl", "loss_params": {"t": 1e308, "gamma": 16.0}},
    ),
    Refusal(
        "a loss whose every weight is 0",
        r"VICReg's lam, mu, nu are all 0",
        loss,
        cell={"loss": "vicreg", "loss_params": {"lam": 0.0, "mu": 0.0, "nu": 0.0}},
    ),
    Refusal(
        "iSogCLR's tau_min above its tau_max",
        r"tau_min must be below tau_max, got 0\.9 and 0\.7",
        loss,
        cell={"loss": "isogclr", "loss_params": {"tau_min": 0.9}},
    ),
]


def _planned(r: Refusal) -> dict:
    """The row's settings as a study config of one cell."""
    c = {"batch_size": 16, "loss": "infonce", "loss_params": {}, "dataset": "digits", "device": "cpu", **r.cell}
    entry = {"name": c["loss"], **c["loss_params"]} if c["loss_params"] else c["loss"]
    grid = {"losses": [entry], "batch_sizes": [c["batch_size"]], "temperatures": [0.5], "seeds": [0]}
    return {"datasets": {c["dataset"]: {}}, "device": c["device"], "grid": grid, "train": {**TINY, **r.train}}


def _past_the_plan(r: Refusal) -> Cell:
    """The row's cell as the job would get it if nothing had planned it."""
    cfg = load_config(None, {"datasets": {"digits": {}, "stl10": {}}, "train": TINY})
    cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.5, seed=0)
    return Cell.of({**cell, **r.cell, "train": {**cell["train"], **r.train}})


@pytest.mark.parametrize("r", REFUSALS, ids=[r.name for r in REFUSALS])
def test_a_refusal_of_the_job_is_made_when_the_study_is_planned(r, tmp_path):
    with pytest.raises(ConfigError) as planned:
        load_config(None, _planned(r))
    line = str(planned.value)
    assert "\n" not in line and re.search(r.plan, line), line
    cell = _past_the_plan(r)
    with pytest.raises(ValueError):
        r.job(cell, tmp_path) if r.job in (unlabeled_images, digits_images) else r.job(cell)
