"""``smallbatch init-study DIR``: the checkout's study files, copied from the package's data
into a new or empty folder, and nothing of the user's ever overwritten (the wheel's own study,
planned by Snakemake outside the checkout, is the slow test of the wheel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smallbatch.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _files(top: Path) -> dict[str, bytes]:
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("exists", [False, True])  # a new folder, or an empty one
def test_init_study_writes_the_checkouts_study_files(tmp_path, capsys, exists):
    dest = tmp_path / "study"
    if exists:
        dest.mkdir()
    assert main(["init-study", str(dest)]) == 0
    want = {f"{name}/{k}": v for name in ("workflow", "envs") for k, v in _files(ROOT / name).items()}
    want |= {name: (ROOT / name).read_bytes() for name in ("Snakefile", "config.yaml")}
    want = {k: v for k, v in want.items() if "__pycache__" not in k}
    assert _files(dest) == want
    assert "snakemake -n" in capsys.readouterr().out


@pytest.mark.parametrize("planted", ["config.yaml", "notes.txt"])
def test_init_study_refuses_a_folder_that_is_not_empty_and_writes_nothing(tmp_path, capsys, planted):
    dest = tmp_path / "study"
    dest.mkdir()
    (dest / planted).write_text("mine\n")
    assert main(["init-study", str(dest)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"smallbatch: error: {dest} exists and is not empty; name a new or empty folder for the study (nothing was written)\n"
    )
    assert _files(dest) == {planted: b"mine\n"}


def test_init_study_refuses_a_file(tmp_path, capsys):
    dest = tmp_path / "study"
    dest.write_text("mine\n")
    assert main(["init-study", str(dest)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert dest.read_text() == "mine\n"
