"""How `make test` spreads the suite over pytest-xdist's workers (tests/conftest.py): a module's
tests in one worker, every module that drives the local SLURM in the same one, the modules with
end-to-end (``slow``) tests sent first.  Checked by running pytest -n 2 on a generated suite
with this conftest's hooks, since they lean on xdist's scheduler class (a module split over
two workers would build its fixtures twice; two SLURM modules in two workers would race)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cluster
import conftest

TESTS = Path(__file__).resolve().parent

MODULE = """
import json, os, time
import pytest

{mark}
@pytest.mark.parametrize("i", range({n}))
def test_where(i):
    with open({log!r}, "a") as f:
        f.write(json.dumps([__name__, i, os.environ["PYTEST_XDIST_WORKER"], time.monotonic()]) + "\\n")
"""


def test_a_module_runs_whole_in_one_worker_and_the_slurm_modules_share_one(tmp_path):
    log = tmp_path / "where.jsonl"
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: end-to-end\n")
    (suite / "tests" / "conftest.py").write_text(  # this suite's two scheduling hooks, nothing else of it
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
        "pytest_xdist_make_scheduler = suite.pytest_xdist_make_scheduler\n"
    )
    modules = {f"test_m{i}": ("", 6) for i in range(6)} | {"test_z_slow": ("@pytest.mark.slow", 2)}
    modules |= {Path(m).stem: ("", 3) for m in conftest.SLURM_MODULES}
    for name, (mark, n) in modules.items():
        (suite / "tests" / f"{name}.py").write_text(MODULE.format(mark=mark, n=n, log=str(log)))
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "tests"],
        cwd=suite,
        capture_output=True,
        text=True,
        timeout=cluster.HANG_S,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == sum(n for _, n in modules.values())
    workers = {}
    for module, _, worker, _ in rows:
        workers.setdefault(module, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len({*workers["test_mlflow_server"], *workers["test_slurm"]}) == 1, workers
    assert len({w for ws in workers.values() for w in ws}) == 2, "both workers ran tests"
    (slow_worker,) = workers["test_z_slow"]
    mine = sorted((r for r in rows if r[2] == slow_worker), key=lambda r: r[3])
    assert mine[0][0] == "test_z_slow", "the module with slow tests is sent first, though collected last"


def test_every_long_unit_is_a_module_of_the_suite_or_the_slurm_unit():
    """conftest.LONG_UNITS names work units that exist (a renamed module would silently lose its place)."""
    root = Path(__file__).resolve().parents[1]
    assert [u for u in conftest.LONG_UNITS if u != "slurm" and not (root / u).is_file()] == []


def test_every_test_module_has_a_unique_basename():
    """pytest imports test modules by basename (rootdir import mode, no __init__.py): two modules of one
    name in two folders stop the whole collection with 'import file mismatch'."""
    names: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
