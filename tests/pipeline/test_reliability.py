"""Nothing wrong passes silently: one writer per cell, a vanished MLflow run stops the
cell, files are checked against the cell they are read for, a probe logs once, and a
cell whose representation collapsed (without a NaN) is recorded as collapsed.

Real `smallbatch` processes, a real SQLite MLflow store, the real digits data.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster import HANG_S

from smallbatch import tracking
from smallbatch.data import load as data
from smallbatch.errors import CheckpointError
from smallbatch.pipeline import jobs as steps
from smallbatch.study.cell import Cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config
from smallbatch.tracking import provenance
from smallbatch.training import loop as train

SMALLBATCH = Path(sys.executable).with_name("smallbatch")
TINY = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 5}
EXPERIMENT = "reliability"


def digits_cell(**train_opts) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, **train_opts}})
    return make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=32, temperature=0.5, seed=0)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(SMALLBATCH), *args], capture_output=True, text=True, timeout=timeout)


def start_pretrain(cell: dict, out: Path, cache: Path, uri: str = "none", *extra: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cell.json").write_text(json.dumps(cell))
    cmd = [
        str(SMALLBATCH),
        "pretrain",
        "--cell",
        str(out / "cell.json"),
        "--out",
        str(out),
        "--data-cache",
        str(cache),
        "--tracking-uri",
        uri,
        "--experiment",
        EXPERIMENT,
        "--no-progress",
        *extra,
    ]
    log = out.parent / f"{out.name}.{time.monotonic_ns()}.stderr"
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    proc.log = log
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    return proc.log.read_text()


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"process ended early: {stderr_of(proc)[-800:]}"
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.02)


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert lines and lines[-1].startswith("smallbatch: error: "), stderr[-2000:]
    return lines[-1]


# --------------------------------------------------------------------------- one writer
@pytest.mark.slow  # several of the package's processes (pyproject: markers)
def test_a_second_trainer_of_a_cell_stops_at_once_naming_the_holder(tmp_path, cache):
    """Two processes on one cell folder (e.g. two Snakemake calls sharing an absolute
    results_dir, or a trainer left running after Snakemake was killed): the second stops
    with one line naming the cell and the PID; once the first dies (SIGKILL: the kernel
    drops its lock) a new trainer may take the cell over."""
    cell = digits_cell(epochs=30)
    out = tmp_path / "cell"
    first = start_pretrain(cell, out, cache)
    try:
        wait_for(out / "state.pt", first)  # it holds the lock (state.pt is written under it)
        # stopped, it keeps its lock and cannot finish however slow the second one is to start;
        # a second trainer that waited for the lock instead of stopping would wait forever (timeout)
        first.send_signal(signal.SIGSTOP)
        second = cli(
            "pretrain",
            "--cell",
            str(out / "cell.json"),
            "--out",
            str(out),
            "--data-cache",
            str(cache),
            "--tracking-uri",
            "none",
            "--no-progress",
            timeout=300,
        )
        assert second.returncode == 2
        line = one_error_line(second.stderr)
        assert cell["id"] in line and f"process {first.pid}" in line, line
        first.send_signal(signal.SIGCONT)
        assert first.poll() is None, "the first trainer was disturbed"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = start_pretrain(cell, out, cache, "none")
    try:
        deadline = time.monotonic() + HANG_S
        while "resuming" not in stderr_of(third) and time.monotonic() < deadline:
            assert third.poll() is None, stderr_of(third)[-800:]
            time.sleep(0.05)
        assert "resuming" in stderr_of(third)
    finally:
        third.kill()
        third.wait()


# --------------------------------------------------------------------------- the store
def _store(path: Path) -> str:
    uri = f"sqlite:///{path}"
    tracking.init_store(uri, EXPERIMENT)
    return uri


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
def test_a_run_that_vanished_from_the_store_stops_the_cell_in_one_line(tmp_path, cache):
    """state.pt continues MLflow run X; the store was deleted and recreated: the rerun must
    not log the rest of the history into a new run and call it finished.  --restart
    trains the cell afresh into the new store, history from the first step."""
    cell = digits_cell(epochs=3)
    out, db = tmp_path / "cell", tmp_path / "mlflow.db"
    uri = _store(db)
    proc = start_pretrain(cell, out, cache, uri)
    wait_for(out / "state.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    db.unlink()
    _store(db)
    res = cli(
        "pretrain",
        "--cell",
        str(out / "cell.json"),
        "--out",
        str(out),
        "--data-cache",
        str(cache),
        "--tracking-uri",
        uri,
        "--experiment",
        EXPERIMENT,
        "--no-progress",
    )
    assert res.returncode == 2
    line = one_error_line(res.stderr)
    assert "not in the MLflow store" in line and "--restart" in line and "state.pt" in line, line
    assert not (out / "checkpoint.pt").exists()
    res = cli(
        "pretrain",
        "--cell",
        str(out / "cell.json"),
        "--out",
        str(out),
        "--data-cache",
        str(cache),
        "--tracking-uri",
        uri,
        "--experiment",
        EXPERIMENT,
        "--no-progress",
        "--restart",
    )
    assert res.returncode == 0, res.stderr[-1500:]
    run = tracking.find_cell_run(uri, EXPERIMENT, cell)
    steps_logged = [m.step for m in run.client.get_metric_history(run.run_id, "train/loss")]
    assert steps_logged[0] == TINY["log_every"] and len(steps_logged) == len(set(steps_logged))


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
def test_a_store_deleted_while_the_cell_trains_stops_it_before_the_next_save(tmp_path, cache):
    cell = digits_cell(epochs=40)
    out, db = tmp_path / "cell", tmp_path / "mlflow.db"
    uri = _store(db)
    proc = start_pretrain(cell, out, cache, uri)
    try:
        wait_for(out / "state.pt", proc)
        proc.send_signal(signal.SIGSTOP)  # no save between reading the state and replacing the store
        saved = train.load_checkpoint(out / "state.pt")["step"]
        db.unlink()
        _store(db)  # a new, empty store at the same path
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2
    line = one_error_line(stderr_of(proc))
    assert "deleted or replaced" in line and cell["id"] in line, line
    assert train.load_checkpoint(out / "state.pt")["step"] == saved  # nothing saved after the loss of history
    assert not (out / "checkpoint.pt").exists()


def test_rerunning_a_probe_logs_its_metrics_once(tmp_path, cache):
    cell = digits_cell(epochs=1)
    out = tmp_path / "cell"
    uri = _store(tmp_path / "mlflow.db")
    steps.run_pretrain(Cell.of(cell), out, tracking_uri=uri, experiment=EXPERIMENT, cache=cache, progress=False)
    steps.run_embed(Cell.of(cell), out / "checkpoint.pt", out / "features.npz", cache=cache)
    for _ in range(2):
        for kind in ("knn", "linear"):
            steps.run_probe(
                kind, Cell.of(cell), out / "features.npz", out / f"{kind}.json", tracking_uri=uri, experiment=EXPERIMENT
            )
    run = tracking.find_cell_run(uri, EXPERIMENT, cell)
    for key in ("knn/top1", "linear/top1", "knn/seconds"):
        assert len(run.client.get_metric_history(run.run_id, key)) == 1, key
    assert run.tags()[tracking.TAG_STATUS] == "finished"


# --------------------------------------------------------------------------- files of other cells
@pytest.fixture(scope="module")
def two_cells(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("two")
    cells = {"a": digits_cell(epochs=1)}
    cells["b"] = make_cell(
        load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, "epochs": 0.5}}),
        dataset="digits",
        loss="dcl",
        loss_params={},
        batch_size=32,
        temperature=0.5,
        seed=0,
    )
    for name, cell in cells.items():
        steps.run_pretrain(Cell.of(cell), root / name, tracking_uri=None, experiment="x", cache=cache, progress=False)
        steps.run_embed(Cell.of(cell), root / name / "checkpoint.pt", root / name / "features.npz", cache=cache)
        (root / name / "cell.json").write_text(json.dumps(cell))
    return root, cells


def test_embed_refuses_another_cells_checkpoint_and_a_state(two_cells, cache, tmp_path):
    root, cells = two_cells
    with pytest.raises(CheckpointError, match="belongs to cell 'digits/dcl/bs32-t0.5-s0', not to 'digits/infonce"):
        steps.run_embed(Cell.of(cells["a"]), root / "b" / "checkpoint.pt", tmp_path / "f.npz", cache=cache)
    with pytest.raises(CheckpointError, match="is a training state"):
        steps.run_embed(Cell.of(cells["a"]), root / "a" / "state.pt", tmp_path / "f.npz", cache=cache)
    other_config = dict(cells["a"], hash="0123456789")
    with pytest.raises(CheckpointError, match="another config"):
        steps.run_embed(Cell.of(other_config), root / "a" / "checkpoint.pt", tmp_path / "f.npz", cache=cache)
    assert not (tmp_path / "f.npz").exists()
    res = cli(
        "embed",
        "--cell",
        str(root / "a" / "cell.json"),
        "--checkpoint",
        str(root / "b" / "checkpoint.pt"),
        "--data-cache",
        str(cache),
        "--out",
        str(tmp_path / "g.npz"),
    )
    assert res.returncode == 2 and "belongs to cell" in one_error_line(res.stderr)


def test_probes_refuse_another_cells_features(two_cells, tmp_path):
    root, cells = two_cells
    for kind in ("knn", "linear"):
        res = cli(
            kind,
            "--cell",
            str(root / "a" / "cell.json"),
            "--features",
            str(root / "b" / "features.npz"),
            "--out",
            str(tmp_path / f"{kind}.json"),
            "--tracking-uri",
            "none",
        )
        assert res.returncode == 2
        assert "holds the features of cell 'digits/dcl/bs32-t0.5-s0'" in one_error_line(res.stderr)
        assert not (tmp_path / f"{kind}.json").exists()


# --------------------------------------------------------------------------- collapse
def test_a_cell_that_collapses_without_a_nan_is_recorded_as_collapsed(tmp_path, cache):
    """Adam at lr 1e6 keeps every number finite but maps every image to one point: the
    checkpoint, the probes and the MLflow run say `collapsed`, not `finished`."""
    cell = digits_cell(epochs=2, lr=1e6)
    out = tmp_path / "cell"
    uri = _store(tmp_path / "mlflow.db")
    res = steps.run_pretrain(Cell.of(cell), out, tracking_uri=uri, experiment=EXPERIMENT, cache=cache, progress=False)
    assert res["status"] == "collapsed" and res["final_loss"] == res["final_loss"]  # finite, not diverged
    ck = train.load_checkpoint(out / "checkpoint.pt")
    assert ck["status"] == "collapsed" and ck["health"]["projection_std"] < 1e-3
    steps.run_embed(Cell.of(cell), out / "checkpoint.pt", out / "features.npz", cache=cache)
    knn = steps.run_probe(
        "knn", Cell.of(cell), out / "features.npz", out / "knn.json", tracking_uri=uri, experiment=EXPERIMENT
    )
    lin = steps.run_probe(
        "linear", Cell.of(cell), out / "features.npz", out / "lin.json", tracking_uri=uri, experiment=EXPERIMENT
    )
    assert knn["status"] == lin["status"] == "collapsed" and knn["knn/top1"] < 15
    run = tracking.find_cell_run(uri, EXPERIMENT, cell)
    assert run.tags()[tracking.TAG_STATUS] == "collapsed"
    assert run.metrics()["train/projection_std"] < 1e-3


def test_a_healthy_cell_is_not_called_collapsed(tmp_path, cache):
    d = data.load_cache(cache)
    res = train.pretrain(
        Cell.of(digits_cell(epochs=1)), d.pretrain_x, d.mean, d.std, tmp_path, device="cpu", progress=False
    )
    assert res.status == "finished" and res.health["effective_rank"] > 2 and res.health["projection_std"] > 1e-2


def test_chance_level_rule():
    from smallbatch.training.health import at_chance

    assert at_chance(10.0, 2000, 10) and at_chance(8.3, 2000, 10) and at_chance(11.3, 2000, 10)
    assert not at_chance(11.5, 2000, 10) and not at_chance(80.0, 2000, 10)
    assert torch.isclose(torch.tensor(2 * (0.1 * 0.9 / 2000) ** 0.5), torch.tensor(0.0134164), atol=1e-6)


def test_effective_rank_from_the_gram_matrix_equals_the_svd_definition():
    from smallbatch.training.health import effective_rank

    torch.manual_seed(0)
    for shape in ((64, 200), (300, 40)):
        x = torch.randn(*shape, dtype=torch.float64) * torch.logspace(0, -3, shape[1], dtype=torch.float64)
        c = x - x.mean(0)
        s = torch.linalg.svdvals(c)
        p = s / s.sum()
        ref = float(torch.exp(-(p * p.log()).sum()))
        assert effective_rank(x) == pytest.approx(ref, rel=1e-7)  # the Gram matrix squares the condition number
    one_direction = torch.randn(100, 1, dtype=torch.float64) * torch.randn(1, 50, dtype=torch.float64)
    assert effective_rank(one_direction) == pytest.approx(1.0, abs=1e-3)


def test_every_new_run_is_tagged_with_the_commit_and_versions_read_once_per_process(tmp_path, monkeypatch):
    """A new run carries the package's commit and versions; the git subprocess and the
    package metadata are asked once per process, not once per run (the MI step opens 150)."""
    calls = []
    real_run = subprocess.run
    monkeypatch.setattr(provenance.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    tracking.git_state.cache_clear()
    provenance._machine_tags.cache_clear()
    provenance.package_versions.cache_clear()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "e")
    for i in range(2):
        run = tracking.open_cell_run(uri, "e", {"id": f"c{i}", "hash": f"h{i}"}, kind="mi")
        tags = run.tags()
        assert tags[tracking.TAG_COMMIT] and torch.__version__.startswith(tags["smallbatch.version.torch"])
    assert sum("rev-parse" in a[0] for a in calls) == 1 and sum("status" in a[0] for a in calls) <= 1
    assert provenance.package_versions.cache_info().misses == 1 and provenance._machine_tags.cache_info().misses == 1
