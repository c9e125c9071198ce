"""Shared fixtures (the digits data set, its prepared cache file, a module's SQLite store URI)
and session hooks: which tests need the real SLURM daemons or a GPU, and how many of them ran.

A test that uses the ``slurm`` or ``smoke_slurm`` fixture is marked ``slurm`` here (it
runs only where tests/cluster.py can start munged + slurmctld + slurmd); a test marked
``gpu`` is skipped, with the reason, where torch sees no CUDA device.  At the end of the
run one line per kind says how many passed, failed and were skipped, and why -- so a run
whose daemons could not start does not read like one that tested them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

SLURM_FIXTURES = {"slurm", "smoke_slurm"}


# --------------------------------------------------------------------------- shared fixtures
#: what MLflow's fluent API writes into ``os.environ`` for subprocesses (``set_tracking_uri``,
#: ``set_experiment``, ``start_run``)
MLFLOW_INHERITED = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """No test inherits another's store: ``mlflow.set_tracking_uri`` writes
    MLFLOW_TRACKING_URI into ``os.environ`` (for subprocesses), so a store an earlier test
    set would otherwise reach every later test's ``smallbatch`` and Snakemake children
    (a study with ``tracking_uri: null`` then logs to that store); the experiment and run
    alike.  Dropped before each test's fixtures are set up, so a module fixture that copies
    the environment (a wheel's venv, a study's children) never copies them either; a test
    or fixture that needs a store sets it."""
    for name in MLFLOW_INHERITED:
        os.environ.pop(name, None)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits data set (ships inside scikit-learn), loaded once per test module."""
    from smallbatch.data import load as data

    return data.load_dataset("digits", tmp_path_factory.mktemp("digits_root"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The digits data set as a prepared cache file (``smallbatch prepare-data``'s output)."""
    from smallbatch.data import load as data

    path = tmp_path_factory.mktemp("cache") / "digits.pt"
    data.save_cache(data.load_dataset("digits", None), path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Bitwise comparisons need one fixed thread count (the CLI uses the cell's `threads`: 1);
    a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory) -> str:
    """One SQLite MLflow store for the module (creating MLflow's schema takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


# --------------------------------------------------------------------------- session hooks
KINDS = {"slurm": "real-SLURM", "gpu": "GPU"}


#: The modules that drive the one local SLURM (its daemons, its job records, and the smoke run
#: through it that test_mlflow_server.py starts in the background and test_slurm.py reads):
#: pytest-xdist runs them in one worker, one test at a time.
SLURM_MODULES = ("tests/test_mlflow_server.py", "tests/test_slurm.py")
SLURM_SHARED = SLURM_FIXTURES | {"smoke_sqlite"}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole (``make test`` runs two): a test's module, so its
    module fixtures (a store, a finished study) are built once, or "slurm" for every module that
    drives the local SLURM."""
    module = module_of(nodeid)
    return "slurm" if module in SLURM_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler with :func:`work_unit` as its unit, sent in the workers'
    collection order (:func:`_order_for_workers`'s, not xdist's reordering by test count)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)


#: The longest work units, longest first (CPU seconds of their tests, measured 2026-12-03 with a
#: getrusage hook around each test, whole suite in two workers: 223, 123, 111, 97, 87, 80, 78, 76,
#: 69, 51; the SLURM unit also waits on its jobs): sent before all others, so that none of them
#: starts last and runs alone while the other worker idles (the fast tier included).
LONG_UNITS = (
    "slurm",
    "tests/test_workflow.py",
    "tests/test_faults.py",
    "tests/pipeline/test_trust.py",
    "tests/pipeline/test_instrument.py",
    "tests/training/test_distributed_cell.py",
    "tests/test_gpu_check.py",
    "tests/training/test_compile.py",
    "tests/tracking/test_store_deadlines.py",
    "tests/local/test_warm_status.py",
)


def _order_for_workers(items) -> None:
    """Every test that uses the local SLURM is in :data:`SLURM_MODULES` (else two workers could
    drive it at once); the :data:`LONG_UNITS` come first, in their order, then the work units
    with end-to-end (``slow``) tests, most of them first, so no long unit starts last and runs
    alone while the other worker idles."""
    strays = sorted(
        {module_of(it.nodeid) for it in items if SLURM_SHARED & set(getattr(it, "fixturenames", ()))}
        - set(SLURM_MODULES)
    )
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use the local SLURM: add them to conftest.SLURM_MODULES")
    unit = {it.nodeid: work_unit(it.nodeid) for it in items}
    slow = Counter(unit[it.nodeid] for it in items if it.get_closest_marker("slow"))
    first = {u: i for i, u in enumerate(dict.fromkeys(unit.values()))}
    long = {u: i for i, u in enumerate(LONG_UNITS)}
    items.sort(key=lambda it: (long.get(unit[it.nodeid], len(long)), -slow[unit[it.nodeid]], first[unit[it.nodeid]]))


def pytest_collection_modifyitems(config, items):
    _order_for_workers(items)
    gpu_items = []
    for item in items:
        if SLURM_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slurm)
        if item.get_closest_marker("gpu"):
            gpu_items.append(item)
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none here")
            for item in gpu_items:
                item.add_marker(skip)


def _outcomes(terminalreporter) -> dict[str, tuple[str, set, str]]:
    """nodeid -> (outcome, marker names, skip reason) over the run's reports (a failed
    setup or teardown counts as failed, a skip in any phase as skipped)."""
    out: dict[str, tuple[str, set, str]] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if not isinstance(rep, pytest.TestReport):
                continue
            outcome = rep.outcome if rep.outcome in rank else "failed"
            if outcome == "passed" and rep.when != "call":
                continue
            reason = rep.longrepr[2] if outcome == "skipped" and isinstance(rep.longrepr, tuple) else ""
            marks = {k for k in KINDS if k in rep.keywords}
            if rep.nodeid not in out or rank[outcome] > rank[out[rep.nodeid][0]]:
                out[rep.nodeid] = (outcome, marks, reason)
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcomes = _outcomes(terminalreporter)
    terminalreporter.write_sep("-", "tests that need SLURM daemons or a GPU")
    for kind, label in KINDS.items():
        mine = [(o, r) for o, marks, r in outcomes.values() if kind in marks]
        n = {k: sum(o == k for o, _ in mine) for k in ("passed", "failed", "skipped")}
        reasons = sorted({r.removeprefix("Skipped: ") for o, r in mine if o == "skipped"})
        line = f"{label} tests: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
        if reasons:
            line += " -- " + "; ".join(reasons)
        if not mine:
            line += " (none selected)"
        terminalreporter.write_line(line)
