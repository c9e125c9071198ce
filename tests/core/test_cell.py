"""The typed cell: made once from a cell's JSON object, frozen, and its JSON byte-identical."""

from __future__ import annotations

import dataclasses

import pytest

from smallbatch.cell import Cell
from smallbatch.io import json_text
from smallbatch.pipeline.cells import cell_hash, expand_cells
from smallbatch.pipeline.config import load_config


@pytest.fixture(scope="module")
def cells():
    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "grid": {
                "losses": ["infonce", {"name": "dclw", "sigma": 2.0}],
                "batch_sizes": [16],
                "temperatures": [0.1],
                "seeds": [0],
            },
        },
    )
    return list(expand_cells(cfg).values())


def test_the_json_is_the_cells_own_text(cells):
    for d in cells:
        cell = Cell.of(d)
        assert cell.to_json() == json_text(d)  # the bytes of cell.json: hashes and files do not change
        assert Cell.from_json(cell.to_json()) == cell and cell.to_dict() == d
        assert cell_hash(cell.to_dict()) == d["hash"] == cell.hash


def test_fields_are_typed_and_frozen(cells):
    cell = Cell.of(cells[1])
    assert cell.loss == "dclw" and cell.loss_params["sigma"] == 2.0 and cell.train.queue_size == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cell.temperature = 0.2
    with pytest.raises(TypeError):
        cell.loss_params["sigma"] = 1.0
    with pytest.raises(AttributeError):
        cell.train.queue_sise  # noqa: B018 - a misspelt setting fails where it is read
    assert Cell.of(cell) is cell
