"""Faults at the level a user meets them: the workflow, its processes, the
tracking server and the files on disk.  Each test asserts that nothing
finished is lost.

(The pretraining loop's own resume/SIGTERM behaviour and the CLI's one-line
errors are tested in-process in test_train.py / test_cli.py; here real
Snakemake runs are killed, preempted, and cut off from a real MLflow server.)

One tiny digits cell is trained by every test (small_cnn width 8, batch 16,
6 epochs: a few seconds of training after a few seconds of start-up).  Its
uninterrupted reference is one ``smallbatch pretrain`` process; a faulted run
must end with bitwise the same weights, the same final loss, exactly one
MLflow run for the cell, and the same per-step loss history (one value per
step, the values of the reference).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import cluster
import pytest
import torch
from cluster import BIN, DEFAULT_PROFILE, run, snakemake_cmd, wait_until, write_config

CELL_ID = "digits/infonce/bs16-t0.5-s0"
EXPERIMENT = "smallbatch-faults"
SNAKE_TIMEOUT = 900  # s; the hang guard of one Snakemake run (a tracking call that never returns)
#: a job's requests to a test's MLflow server wait for their answers as long as its Snakemake run may last
CLIENT_ENV = cluster.MlflowServer.client_env(SNAKE_TIMEOUT)


def fault_config(path: Path, results: Path, tracking_uri: str | None = None, **extra) -> Path:
    over = dict(
        study=EXPERIMENT,
        results_dir=str(results),
        tracking_uri=tracking_uri,
        device="cpu",
        grid={"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.5], "seeds": [0]},
        train={"epochs": 6, "width": 8, "proj_hidden": 32, "proj_dim": 16, "log_every": 5},
        baselines=False,
    )
    over.update(extra)
    return write_config(path, **over)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def loss_history(uri: str, experiment: str, cell_id: str = CELL_ID) -> tuple[int, list[tuple[int, float]]]:
    """(number of runs of the cell, [(step, value)] of train/loss of its run)."""
    from mlflow.tracking import MlflowClient

    with cluster.client_deadline(cluster.HANG_S):
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`smallbatch.cell_id` = '{cell_id}'")
        if len(runs) != 1:
            return len(runs), []
        hist = client.get_metric_history(runs[0].info.run_id, "train/loss")
    return 1, sorted((m.step, m.value) for m in hist)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The data cache (prepared once, copied into every study) and the uninterrupted
    reference run of the cell: weights, final loss, train/loss history."""
    root = tmp_path_factory.mktemp("faults_ref")
    cfg = fault_config(root / "config.yaml", root / "results")
    cache = root / "digits.pt"
    run(
        [str(BIN / "smallbatch"), "prepare-data", "--config", str(cfg), "--dataset", "digits", "--out", str(cache)],
        timeout=cluster.HANG_S,
        check=True,
    )
    uri = f"sqlite:///{root / 'ref.db'}"
    out = root / "ref"
    res = run(
        [
            str(BIN / "smallbatch"),
            "pretrain",
            "--config",
            str(cfg),
            "--cell-id",
            CELL_ID,
            "--data-cache",
            str(cache),
            "--out",
            str(out),
            "--tracking-uri",
            uri,
            "--experiment",
            EXPERIMENT,
            "--no-progress",
        ],
        timeout=cluster.HANG_S,
        check=True,
    )
    summary = cluster.json_lines(res.stdout)[-1]
    n, hist = loss_history(uri, EXPERIMENT)
    assert n == 1 and hist, "the reference run logged no loss history"
    return {
        "cache": cache,
        "weights": weights(out / "checkpoint.pt"),
        "final_loss": summary["final_loss"],
        "steps": summary["steps"],
        "history": hist,
        "config": cfg,
    }


def new_study(tmp_path: Path, ref: dict, tracking_uri: str | None = None) -> tuple[Path, Path]:
    """A study folder with the reference's data cache in place; returns (config, results)."""
    results = tmp_path / "results"
    (results / "data" / "cache").mkdir(parents=True)
    shutil.copy(ref["cache"], results / "data" / "cache" / "digits.pt")
    uri = tracking_uri or f"sqlite:///{results / 'mlflow.db'}"
    return fault_config(tmp_path / "config.yaml", results, tracking_uri=uri), results


def stamp_as_the_workflow_does(cfg: Path, results: Path) -> None:
    """The settings stamps a study's `settings` rule writes before its data and cell jobs
    (workflow/rules/common.smk), an hour old: the outputs in place are then results of the
    settings planned now, not of others (which the workflow would recompute)."""
    from smallbatch.study import cells, config

    conf = config.load_config(cfg)
    cell = cells.expand_cells(conf)[CELL_ID]
    data = cells.data_cache_settings(conf, "digits")
    old = time.time() - 3600
    for stamp in (
        results / "runs" / CELL_ID / f".settings-{cell['hash']}",
        results / "data" / "cache" / "digits" / f".settings-{cells.settings_hash(data)}",
    ):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text("stamped by the test\n")
        os.utime(stamp, (old, old))


def start_snakemake(tmp_path: Path, cfg: Path, *args: str, log: str = "snakemake.log") -> subprocess.Popen:
    cmd = snakemake_cmd(tmp_path, cfg, DEFAULT_PROFILE, "--cores", "2", *args)
    # the child writes to its own copy of the descriptor: ours closes once it has started
    with open(tmp_path / log, "w") as fh:
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=cluster.env_with_venv(CLIENT_ENV),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(proc: subprocess.Popen, tmp_path: Path, log: str = "snakemake.log", timeout: float = SNAKE_TIMEOUT) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.kill_group(proc, signal.SIGTERM)
        raise AssertionError(f"snakemake ran over {timeout} s:\n{(tmp_path / log).read_text()[-3000:]}") from None
    return (tmp_path / log).read_text()


def wait_for_training(proc: subprocess.Popen, results: Path, tmp_path: Path, timeout: float = cluster.HANG_S) -> int:
    """Wait until the cell's pretraining process has saved its first epoch; return its pid."""
    state = results / "runs" / CELL_ID / "state.pt"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"snakemake ended before training started:\n{(tmp_path / 'snakemake.log').read_text()[-3000:]}"
            )
        return state.exists()

    wait_until(ready, timeout, f"{state}", interval=0.02)
    pid = cluster.find_descendant(proc.pid, "smallbatch pretrain")
    assert pid is not None, "no `smallbatch pretrain` process below snakemake"
    assert not (results / "runs" / CELL_ID / "checkpoint.pt").exists()
    return pid


def job_pid(results: Path) -> int:
    """The PID of the process training the cell: the holder of its lock file (io.CellLock).
    With warm start that is a child of the warm-start server, outside Snakemake's group."""
    return int((results / "runs" / CELL_ID / ".lock").read_text().split()[0])


def cell_unlocked(results: Path) -> bool:
    """Nobody holds the cell's lock: the process that trained it is gone (the kernel drops a
    dead process's flock), so nothing writes state.pt any more."""
    import fcntl

    fd = os.open(results / "runs" / CELL_ID / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it again
    return True


def assert_like_reference(results: Path, uri: str, ref: dict) -> None:
    ckpt = results / "runs" / CELL_ID / "checkpoint.pt"
    ck = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert ck["status"] == "finished" and ck["steps"] == ref["steps"]
    assert ck["final_loss"] == ref["final_loss"]
    assert_same_weights(ck["model"], ref["weights"])
    n, hist = loss_history(uri, EXPERIMENT)
    assert n == 1, f"{n} MLflow runs for {CELL_ID}, expected exactly one"
    steps = [s for s, _ in hist]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    assert hist == ref["history"], (
        f"train/loss history differs from the uninterrupted run: steps {steps[:3]}..{steps[-3:]} "
        f"({len(steps)}) vs {[s for s, _ in ref['history']][:3]}.. ({len(ref['history'])})"
    )


# --------------------------------------------------------------------------- kill / preempt
@pytest.mark.slow
def test_sigkill_of_the_whole_workflow_mid_epoch_then_rerun_resumes(tmp_path, ref):
    """The machine dies: Snakemake and its pretraining job get SIGKILL mid-epoch.
    A rerun (after `--unlock`) resumes from state.pt and ends like the reference."""
    cfg, results = new_study(tmp_path, ref)
    uri = f"sqlite:///{results / 'mlflow.db'}"
    target = str(results / "runs" / CELL_ID / "checkpoint.pt")
    proc = start_snakemake(tmp_path, cfg, target)
    try:
        wait_for_training(proc, results, tmp_path)  # its first epoch saved: it trains the second
        job = job_pid(results)
    finally:
        cluster.kill_group(proc, signal.SIGKILL)
    # the job itself dies with the machine too (with warm start it is not in Snakemake's group;
    # left alone it would get SIGTERM from the server and save a newer state.pt)
    try:
        os.kill(job, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_until(lambda: cell_unlocked(results), cluster.HANG_S, "the killed job to release the cell")
    state = torch.load(results / "runs" / CELL_ID / "state.pt", map_location="cpu", weights_only=False)
    assert 0 < state["step"] < ref["steps"]
    assert not Path(target).exists(), "the killed job left a checkpoint.pt"
    run(snakemake_cmd(tmp_path, cfg, DEFAULT_PROFILE, "--unlock"), cwd=tmp_path, timeout=cluster.HANG_S, check=True)
    res = run(
        snakemake_cmd(tmp_path, cfg, DEFAULT_PROFILE, "--cores", "2", target),
        cwd=tmp_path,
        timeout=SNAKE_TIMEOUT,
        check=True,
    )
    log = (results / "logs" / "pretrain" / f"{CELL_ID}.log").read_text()
    assert f"resuming {CELL_ID} from step {state['step']}/{ref['steps']}" in log, res.stdout[-2000:]
    assert_like_reference(results, uri, ref)


@pytest.mark.slow
def test_sigterm_preempted_job_exits_143_and_snakemake_retry_finishes_it(tmp_path, ref):
    """SLURM's preemption / time-limit signal: the job saves its state, exits 143
    at once, and the profile's `retries` runs it again, resuming."""
    cfg, results = new_study(tmp_path, ref)
    uri = f"sqlite:///{results / 'mlflow.db'}"
    target = str(results / "runs" / CELL_ID / "checkpoint.pt")
    proc = start_snakemake(tmp_path, cfg, target)
    try:
        pid = wait_for_training(proc, results, tmp_path)  # its SIGTERM handler is installed: state.pt exists
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not cluster._pid_alive(pid), cluster.HANG_S, "the pretraining process to exit after SIGTERM")
        out = finish(proc, tmp_path)
    finally:
        cluster.kill_group(proc, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    # (that it saves at the step the signal reaches, not at an epoch end, is asserted without a clock
    # by tests/training/test_train.py's paused-trainer tests)
    assert "exit status 143" in out, "the first attempt did not exit 143"  # Snakemake reports the failed attempt
    assert "Trying to restart job" in out, out[-3000:]
    log = (results / "logs" / "pretrain" / f"{CELL_ID}.log").read_text()
    assert f"resuming {CELL_ID} from step" in log
    assert_like_reference(results, uri, ref)


@pytest.mark.slow
def test_a_study_stopped_by_sigterm_says_why_and_its_report_says_partial(tmp_path, ref):
    """`kill <snakemake>` (what a job scheduler's time limit sends) once the first of two cells is done:
    the running job finishes (exit 0), the console's last lines name the signal, the cells done and
    the command that resumes -- not Snakemake's "did not complete successfully" -- and a report built
    from the store then says the study is partial against the plan the workflow recorded."""
    cfg, results = new_study(tmp_path, ref)
    cfg = fault_config(cfg, results, f"sqlite:///{results / 'mlflow.db'}", grid=GRID_TWO_CELLS)
    proc = start_snakemake(tmp_path, cfg, "--cores", "1", "--logger", "smallbatch")
    try:

        def first_cell_done() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"snakemake ended early:\n{(tmp_path / 'snakemake.log').read_text()[-3000:]}")
            return "[1/2] " in (tmp_path / "snakemake.log").read_text()

        wait_until(first_cell_done, cluster.HANG_S, "the console's line of the first finished cell")
        os.kill(proc.pid, signal.SIGTERM)
        out = finish(proc, tmp_path)
    finally:
        cluster.kill_group(proc, signal.SIGKILL)
    assert proc.returncode != 0, out[-3000:]
    last = out.strip().splitlines()[-2:]
    assert last[0].startswith("stopped by SIGTERM after ") and last[0].endswith(": 1 of 2 cells done, 1 not"), out
    assert last[1].startswith("resume: snakemake "), out
    assert out.count("SIGTERM received") == 1 and "Will exit after" not in out, out
    assert "did not complete successfully" not in out, out
    run(
        [
            str(BIN / "smallbatch"),
            "report",
            "--tracking-uri",
            f"sqlite:///{results / 'mlflow.db'}",
            "--experiment",
            EXPERIMENT,
            "--out",
            str(results / "report"),
        ],
        timeout=cluster.HANG_S,
        check=True,
    )
    index = (results / "report" / "index.md").read_text()
    assert "**Partial study: 1 of 2 planned cells finished**; 1 never ran or did not finish" in index, index


#: two digits cells (batch 16 and 32) for a study stopped between them
GRID_TWO_CELLS = {"losses": ["infonce"], "batch_sizes": [16, 32], "temperatures": [0.5], "seeds": [0]}


# --------------------------------------------------------------------------- tracking server
@pytest.mark.slow
def test_mlflow_server_goes_away_mid_study_then_rerun_completes_without_duplicates(tmp_path, ref):
    server = cluster.MlflowServer(tmp_path / "server").start()
    try:
        cfg, results = new_study(tmp_path, ref, tracking_uri=server.uri)
        target = str(results / "runs" / CELL_ID / "checkpoint.pt")
        proc = start_snakemake(tmp_path, cfg, target, "--retries", "0")
        try:
            wait_for_training(proc, results, tmp_path)
            server.stop(signal.SIGKILL)  # the server dies while the cell trains
            finish(proc, tmp_path)
        finally:
            cluster.kill_group(proc, signal.SIGKILL)
        assert proc.returncode != 0, "the study finished although its tracking server was gone"
        last = (results / "logs" / "pretrain" / f"{CELL_ID}.log").read_text().strip().splitlines()[-1]
        assert last.startswith(f"smallbatch: error: MLflow tracking store {server.uri} failed while "), last
        assert "Traceback" not in (results / "logs" / "pretrain" / f"{CELL_ID}.log").read_text()
        server.start()  # same port, same store
        run(
            snakemake_cmd(tmp_path, cfg, DEFAULT_PROFILE, "--cores", "2", target),
            cwd=tmp_path,
            env=cluster.env_with_venv(CLIENT_ENV),
            timeout=SNAKE_TIMEOUT,
            check=True,
        )
        assert_like_reference(results, server.uri, ref)
    finally:
        server.stop()


# --------------------------------------------------------------------------- disk artefacts
@pytest.mark.slow
def test_truncated_checkpoint_in_a_study_fails_its_step_naming_the_file(tmp_path, ref):
    """A checkpoint.pt cut short (a copy interrupted, a full disk in another tool)
    is not taken for a finished one: the step reading it fails, naming the file."""
    cfg, results = new_study(tmp_path, ref, tracking_uri="none")
    run([str(BIN / "smallbatch"), "cells", "--config", str(cfg), "--write"], timeout=cluster.HANG_S, check=True)
    (results / "mlflow.ready").write_text("none\n")
    ckpt = results / "runs" / CELL_ID / "checkpoint.pt"
    blob = (ref["config"].parent / "ref" / "checkpoint.pt").read_bytes()
    ckpt.write_bytes(blob[: len(blob) // 2])
    stamp_as_the_workflow_does(cfg, results)  # the checkpoint is this study's, of the settings planned now
    later = time.time() + 5  # newer than every input, so Snakemake has no reason to retrain
    os.utime(ckpt, (later, later))
    res = run(
        snakemake_cmd(
            tmp_path,
            cfg,
            DEFAULT_PROFILE,
            "--cores",
            "1",
            "--retries",
            "0",
            str(results / "runs" / CELL_ID / "knn.json"),
        ),
        cwd=tmp_path,
        timeout=SNAKE_TIMEOUT,
    )
    assert res.returncode != 0, res.stdout[-2000:]
    assert "rule pretrain:" not in res.stdout, "Snakemake retrained instead of reading the checkpoint"
    log = (results / "logs" / "evaluate" / f"{CELL_ID}.log").read_text().strip().splitlines()
    assert log[-1].startswith("smallbatch: error: checkpoint ") and str(ckpt) in log[-1], log[-3:]
    assert "corrupt or truncated" in log[-1]
    assert not (results / "runs" / CELL_ID / "features.npz").exists()
    assert not (results / "runs" / CELL_ID / "knn.json").exists()


class _Explodes:
    """Pickling this raises: a write that dies half way (disk full, a kill)."""

    def __reduce__(self):
        raise OSError("disk full (simulated half-way through the write)")


def test_partial_writes_never_replace_a_finished_file(tmp_path):
    """The file writers write to a temp file and rename: a write that fails half way
    leaves the finished file as it was (and a new file absent), never a truncated one."""
    from smallbatch.data import load as data
    from smallbatch.io import save_torch
    from smallbatch.training import loop as train

    ckpt = tmp_path / "checkpoint.pt"
    save_torch(ckpt, {"model": {"w": torch.arange(10.0)}})
    before = ckpt.read_bytes()
    big = torch.randn(256, 1024)  # written into the zip before the failing entry
    with pytest.raises(OSError, match="disk full"):
        save_torch(ckpt, {"model": {"w": big}, "extra": _Explodes()})
    assert ckpt.read_bytes() == before
    assert torch.equal(train.load_checkpoint(ckpt)["model"]["w"], torch.arange(10.0))
    fresh = tmp_path / "new" / "state.pt"
    with pytest.raises(OSError, match="disk full"):
        save_torch(fresh, {"model": {"w": big}, "extra": _Explodes()})
    assert not fresh.exists()
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name not in ("checkpoint.pt",)]
    assert leftovers == [], f"temp files left behind: {leftovers}"

    d = data.load_dataset("digits", None)
    cache = tmp_path / "cache.pt"
    data.save_cache(d, cache)
    before = cache.read_bytes()
    d.meta["boom"] = _Explodes()
    with pytest.raises(OSError, match="disk full"):
        data.save_cache(d, cache)
    assert cache.read_bytes() == before


# --------------------------------------------------------------------------- bad config
BAD_CONFIGS = {
    "unknown loss": ({"grid": {"losses": ["infonse"]}}, ["infonse", "grid.losses"]),
    "batch size 1": ({"grid": {"batch_sizes": [1]}}, ["grid.batch_sizes", "1"]),
    "temperature 0": ({"grid": {"temperatures": [0.0]}}, ["grid.temperatures", "0"]),
    "negative temperature": ({"grid": {"temperatures": [-0.5]}}, ["grid.temperatures", "-0.5"]),
    "unknown dataset": ({"datasets": {"mnist": {}}}, ["mnist", "datasets"]),
    "negative epochs": ({"train": {"epochs": -1}}, ["train.epochs", "-1"]),
    "typo'd key": ({"train": {"widht": 8}}, ["train.widht", "width"]),
    "missing data root": ({"datasets": {"cifar10": {"root": "/nonexistent/cifar"}}}, ["cifar10", "/nonexistent/cifar"]),
}


#: run through Snakemake: one error of the schema check and one of the data-root check (the two
#: checks the workflow runs, in one try block, before any job); every case is checked in-process
#: below against the same functions, as the workflow calls them on the file's contents
THROUGH_SNAKEMAKE = ("unknown loss", "missing data root")


def bad_config(tmp_path: Path, name: str) -> tuple[Path, Path, list[str]]:
    """(the config file of case ``name``, its results folder, the words its one line must name)."""
    import yaml

    over, names = BAD_CONFIGS[name]
    results = tmp_path / "results"
    cfg = write_config(tmp_path / "bad.yaml", results_dir=str(results), study="bad", **over)
    if name == "missing data root":  # only cifar10 then, so nothing else could run first
        c = yaml.safe_load(cfg.read_text())
        c["datasets"] = over["datasets"]
        cfg.write_text(yaml.safe_dump(c))
    return cfg, results, names


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_is_one_line_naming_the_key_from_the_workflows_checks(tmp_path, name):
    import yaml

    from smallbatch.study.config import ConfigError, check_data_roots, validate_config

    cfg, results, names = bad_config(tmp_path, name)
    config = yaml.safe_load(cfg.read_text())  # what Snakemake hands the workflow
    with pytest.raises(ConfigError) as info:
        validate_config(config)
        check_data_roots(config)
    line = str(info.value)
    assert "\n" not in line and all(n in line for n in names), line
    assert not results.exists()


@pytest.mark.parametrize("name", THROUGH_SNAKEMAKE)
def test_bad_config_fails_the_dry_run_before_any_job(tmp_path, name):
    cfg, results, names = bad_config(tmp_path, name)
    res = run(snakemake_cmd(tmp_path, cfg, DEFAULT_PROFILE, "-n"), cwd=tmp_path, timeout=cluster.HANG_S)
    assert res.returncode != 0, res.stdout[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("config error: ")]
    assert len(lines) == 1, res.stdout[-2000:]
    for n in names:
        assert n in lines[0], lines[0]
    assert not results.exists(), "a job ran (or wrote) before the config was rejected"
