"""Result files get the permissions the user's umask gives a new file (0666 & ~umask), as
``open`` would: group members of a shared cluster can read a colleague's results under
umask 022; umask 077 keeps them private.  Every writer of results goes through
:func:`smallbatch.io.atomic_write` (``mkstemp`` alone gives -rw------- whatever the umask)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from smallbatch import io


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _features(path: Path) -> None:
    from smallbatch.evaluation.embed import save_features

    rng = np.random.default_rng(0)
    save_features(
        path,
        rng.normal(size=(6, 3)).astype(np.float32),
        rng.integers(0, 2, 6),
        rng.normal(size=(4, 3)).astype(np.float32),
        rng.integers(0, 2, 4),
        {"status": "finished"},
    )


def _checkpoint(path: Path) -> None:
    from smallbatch.study.cell import Cell
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config
    from smallbatch.training.checkpoint import save_checkpoint

    cell = next(
        iter(expand_cells(load_config(Path(__file__).resolve().parents[2] / "workflow/configs/smoke.yaml")).values())
    )
    save_checkpoint(path, Cell.of(cell), model={"w": torch.ones(2)})


WRITERS = {
    "atomic_write": lambda p: io.atomic_write(p, lambda fh: fh.write(b"x")),
    "write_json": lambda p: io.write_json(p, {"a": 1}),
    "save_torch": lambda p: io.save_torch(p, {"w": torch.zeros(3)}),
    "save_features": _features,
    "save_checkpoint": _checkpoint,
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_result_files_get_the_umask_permissions(tmp_path, umask, writer):
    path = tmp_path / "sub" / "result.out"
    WRITERS[writer](path)
    reference = tmp_path / "opened"
    reference.write_bytes(b"")  # what open() gives under this umask
    assert mode(path) == 0o666 & ~umask == mode(reference), oct(mode(path))
    assert [p.name for p in path.parent.iterdir()] == ["result.out"]  # no temporary file left


def test_umask_022_gives_0644_and_077_gives_0600(tmp_path):
    old = os.umask(0o022)
    try:
        io.write_json(tmp_path / "shared.json", {})
        os.umask(0o077)
        io.write_json(tmp_path / "private.json", {})
    finally:
        os.umask(old)
    assert mode(tmp_path / "shared.json") == 0o644
    assert mode(tmp_path / "private.json") == 0o600


def test_an_overwritten_file_gets_the_umask_of_its_writer(tmp_path):
    path = tmp_path / "r.json"
    old = os.umask(0o077)
    try:
        io.write_json(path, {"v": 1})
        os.umask(0o022)
        io.write_json(path, {"v": 2})
    finally:
        os.umask(old)
    assert mode(path) == 0o644


def test_the_umask_is_read_without_changing_it(umask, tmp_path):
    assert io.current_umask() == umask  # Linux: /proc/self/status
    assert io.current_umask(str(tmp_path / "no-such-status")) == umask  # elsewhere: set and restored
    assert os.umask(umask) == umask  # still the umask it was
