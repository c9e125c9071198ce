"""Each bound of a cell is checked once, in :mod:`smallbatch.study.checks`, and every door refuses
a value past it in one line: the config (the schema's declarative bound or the check), a cell
file, the command line's flags and the training job.  The doors that run code say the check's
own words (written out here), each naming its key."""

from __future__ import annotations

import json
import re

import pytest
import torch

from smallbatch.pipeline import cli
from smallbatch.study.cells import cell_hash, cell_negatives, make_cell
from smallbatch.study.config import ConfigError, load_config
from smallbatch.training import loop
from smallbatch.training.distributed import World

CPU = torch.device("cpu")
DIGITS = 1437  # digits' pretraining images
TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 5}
BATCH_OF_ONE = re.escape("must be >= 2 (a batch of 1 has no negatives), not 1")
TAU_ZERO = re.escape("τ = 0 is outside [0.001, 100], where the losses stop being meaningful")
TOO_BIG = re.escape("batch size 2048 is larger than the 1,437 pretraining images of digits")


def _cell(batch_size: int = 16, temperature: float = 0.5, **train) -> dict:
    """A cell past the plan: a planned one with the values given put in."""
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": TINY, "device": "cpu"})
    cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.5, seed=0)
    return {**cell, "batch_size": batch_size, "temperature": temperature, "train": {**cell["train"], **train}}


def _one_line(exc: BaseException) -> str:
    line = str(exc)
    assert "\n" not in line, line
    return line


def config_door(batch_size: int = 16, temperature: float = 0.5, **train) -> str:
    grid = {"losses": ["infonce"], "batch_sizes": [batch_size], "temperatures": [temperature], "seeds": [0]}
    with pytest.raises(ConfigError) as info:
        load_config(None, {"datasets": {"digits": {}}, "grid": grid, "train": {**TINY, **train}})
    return _one_line(info.value)


def cell_file_door(batch_size: int = 16, temperature: float = 0.5, **train) -> str:
    """A cell file edited by hand, its derived K and its hash made its settings' own."""
    cell = _cell(batch_size, temperature, **train)
    cell["negatives"] = cell_negatives(cell["train"], batch_size, "infonce")
    cell["hash"] = cell_hash(cell)
    with pytest.raises(ValueError) as info:
        cli._cell_from_text(json.dumps(cell), "--cell-json", False)
    return _one_line(info.value)


def flags_door(capsys, batch_size: int = 16, temperature: float = 0.5) -> str:
    argv = ["pretrain", "--tracking-uri", "none", "--out", "unused", "--dataset", "digits", "--loss", "infonce"]
    rc = cli.main([*argv, "--batch-size", str(batch_size), "--temperature", f"{temperature:g}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    return err


def job_door(batch_size: int = 16, temperature: float = 0.5, **train) -> str:
    from smallbatch.study.cell import Cell

    with pytest.raises(ValueError) as info:
        loop._validate(Cell.of(_cell(batch_size, temperature, **train)), DIGITS, CPU, World(device=CPU))
    return _one_line(info.value)


def test_a_batch_of_one_is_refused_at_every_door(capsys):
    assert re.search(r"config key 'grid\.batch_sizes\[0\]' = 1 is out of range; it must be >= 2", config_door(1))
    assert re.search(rf"^--cell-json: cell .*: batch_size {BATCH_OF_ONE}$", cell_file_door(1))
    assert re.search(rf"--batch-size {BATCH_OF_ONE}$", flags_door(capsys, batch_size=1))
    assert re.search(rf"^cell .*: batch_size {BATCH_OF_ONE}$", job_door(1))


def test_a_temperature_outside_its_range_is_refused_at_every_door(capsys):
    assert re.search(
        r"config key 'grid\.temperatures\[0\]' = 0 is out of range; it must be > 0", config_door(temperature=0)
    )
    assert re.search(rf"^--cell-json: cell .*: temperature {TAU_ZERO}", cell_file_door(temperature=0.0))
    assert re.search(rf"--temperature {TAU_ZERO}", flags_door(capsys, temperature=0.0))
    assert re.search(r"temperature τ = 1e-09 is outside \[0\.001, 100\]", config_door(temperature=1e-9))


def test_a_batch_larger_than_the_images_is_refused_at_every_door(capsys):
    assert re.search(rf"cell 'digits/infonce/bs2048-t0\.5-s0': {TOO_BIG}$", config_door(2048))
    assert re.search(rf"cell 'digits/infonce/bs2048-t0\.5-s0': {TOO_BIG}$", flags_door(capsys, batch_size=2048))
    assert re.search(rf"^cell .*: {TOO_BIG}$", job_door(2048))
    assert re.search(
        r"^cell .*: batch size 16 with 1500 extra negatives is larger than the 1,437", job_door(extra_negatives=1500)
    )
