"""The typed cell: made once from a cell's JSON object, frozen, and its JSON byte-identical."""

from __future__ import annotations

import dataclasses

import pytest

from smallbatch.io import json_text
from smallbatch.study.cell import Cell
from smallbatch.study.cells import cell_hash, expand_cells
from smallbatch.study.config import load_config


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


def test_only_the_modules_that_make_a_cell_read_it_by_string_keys():
    """Everywhere else a cell is typed (smallbatch.study.cell.read_cell) and read by attributes: a
    ``cell["..."]`` / ``cell.get(...)`` read in any other module (or the workflow) fails here."""
    import re
    from pathlib import Path

    import smallbatch

    src = Path(smallbatch.__file__).parent
    makers = {src / "study" / "cell.py", src / "study" / "cells.py"}
    read = re.compile(r"""\bcell\s*(\[\s*["']|\.get\()""")
    files = [*src.rglob("*.py"), *(src.parents[1] / "workflow" / "rules").glob("*.smk")]
    found = [
        f"{f.name}:{i}: {line.strip()}"
        for f in files
        if f not in makers
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if read.search(line)
    ]
    assert files and not found, found
