"""Where a run comes from, as MLflow's own tags read it, against a real SQLite store: the
command that logged it, LOCAL, the user, the git commit and whether that checkout had changes
(only when the package runs from a checkout: a copy outside one, or a machine without git,
logs its runs without them and never fails), Python and the platform."""

from __future__ import annotations

import getpass
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import HANG_S

import smallbatch
from smallbatch import tracking
from smallbatch.pipeline import cli
from smallbatch.tracking import provenance

PACKAGE = Path(smallbatch.__file__).resolve().parent
SOURCE = "mlflow.source.name"

#: a separate process opens a run in the store named by argv[1] and prints its tags as JSON
OPEN_RUN = """
import json, sys
from smallbatch import tracking
uri = f"sqlite:///{sys.argv[1]}"
tracking.init_store(uri, "e")
run = tracking.open_cell_run(uri, "e", {"id": "c", "hash": "h"})
print(json.dumps(run.tags()))
"""


def git(*args: str) -> str | None:
    """git's answer in the package's folder, read here independently of the tracking module."""
    try:
        out = subprocess.run(["git", *args], cwd=PACKAGE, capture_output=True, text=True, timeout=HANG_S)
    except FileNotFoundError:
        return None
    return out.stdout if out.returncode == 0 else None


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "e")
    return uri


@pytest.fixture
def command():
    """The command name the CLI recorded, put back afterwards."""
    saved = list(provenance._SOURCE)
    yield
    provenance._SOURCE[:] = saved


def test_a_run_carries_mlflows_source_tags_and_the_checkouts_commit_and_dirty_flag(store, command):
    tracking.set_source("smallbatch pretrain")
    tags = tracking.open_cell_run(store, "e", {"id": "c", "hash": "h"}).tags()
    assert tags[SOURCE] == "smallbatch pretrain" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags[tracking.TAG_PYTHON] == platform.python_version() and tags[tracking.TAG_PLATFORM]
    in_checkout = git("ls-files", "--error-unmatch", "tracking/provenance.py") is not None
    if not in_checkout:
        pytest.skip("the package under test is not a git checkout's (the next tests cover that case)")
    head, status = git("rev-parse", "HEAD").strip(), git("status", "--porcelain")
    assert tags["mlflow.source.git.commit"] == head and tags[tracking.TAG_COMMIT] == head[:12]
    assert tags[tracking.TAG_GIT_DIRTY] == ("true" if status.strip() else "false")


def test_the_cli_names_its_command_as_the_runs_source(command, capsys):
    assert cli.main(["config-reference"]) == 0
    assert tracking.source_tags()[SOURCE] == "smallbatch config-reference"


def run_elsewhere(tmp_path: Path, pythonpath: Path, path_env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", OPEN_RUN, str(tmp_path / "mlflow.db")],
        env={**os.environ, "PYTHONPATH": str(pythonpath), "PATH": path_env, "GIT_CEILING_DIRECTORIES": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_no_git(tags: dict) -> None:
    assert "mlflow.source.git.commit" not in tags and tracking.TAG_GIT_DIRTY not in tags
    assert tags[tracking.TAG_COMMIT] == "unknown"
    assert tags["mlflow.source.type"] == "LOCAL" and tags[tracking.TAG_PYTHON] == platform.python_version()


def test_a_copy_outside_a_checkout_logs_no_commit_and_does_not_fail(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "smallbatch", ignore=shutil.ignore_patterns("__pycache__"))
    assert_no_git(run_elsewhere(tmp_path, site, os.environ["PATH"]))


def test_a_machine_without_git_logs_no_commit_and_does_not_fail(tmp_path):
    empty = tmp_path / "bin"  # the only folder on PATH: no git to be found
    empty.mkdir()
    assert_no_git(run_elsewhere(tmp_path, PACKAGE.parent, str(empty)))
