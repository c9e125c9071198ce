"""One test's MLflow store never reaches another's: ``mlflow.set_tracking_uri`` writes
MLFLOW_TRACKING_URI into ``os.environ`` (``set_experiment`` and ``start_run`` their ids), and a
later module's fixture that copies the environment for its children (the wheel's venv, a
study's Snakemake) would hand them that store.  Checked by running a generated two-module suite,
in file order in one process, with this conftest's setup hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cluster

TESTS = Path(__file__).resolve().parent

SETS = """
import os

def test_sets_a_store():  # what mlflow.set_tracking_uri, set_experiment and start_run do
    os.environ.update(MLFLOW_TRACKING_URI="sqlite:///elsewhere.db", MLFLOW_EXPERIMENT_ID="7", MLFLOW_RUN_ID="abc")
"""

COPIES = """
import os
import pytest

@pytest.fixture(scope="module")
def children_env():
    return dict(os.environ)

def test_a_module_fixture_copies_no_store_of_an_earlier_test(children_env):
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")
    assert [n for n in names if n in children_env] == []
    assert [n for n in names if n in os.environ] == []
"""


def test_a_store_set_by_one_test_reaches_no_later_modules_fixture(tmp_path):
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "tests" / "conftest.py").write_text(  # this suite's setup hook, nothing else of it
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_runtest_setup = suite.pytest_runtest_setup\n"
    )
    (suite / "tests" / "test_a_sets.py").write_text(SETS)
    (suite / "tests" / "test_b_copies.py").write_text(COPIES)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "no:randomly",
            "tests",
        ],
        cwd=suite,
        capture_output=True,
        text=True,
        timeout=cluster.HANG_S,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 passed" in res.stdout, res.stdout[-3000:]
