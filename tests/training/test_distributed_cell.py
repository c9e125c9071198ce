"""One cell on two processes, end to end: the real CLI under torchrun (gloo on the CPU),
through Snakemake, preempted by SIGTERM and resumed on another number of processes.

The cell is a tiny digits cell in float64 (DCLW: its weights need the whole batch's
positives; Adam; BatchNorm over the global batch), so "the same as one process" can be
held to ~1e-9 after many steps: the arithmetic differs only in the order of sums.
(``tests/training/test_distributed.py`` proves the pieces: losses, gradients, optimiser steps.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from cluster import HANG_S

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CELL = "digits/dclw/bs32-t0.5-s0"
TRAIN = {"width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 4, "precision": "fp64", "epochs": 3}


def study(path: Path, results: Path, devices: int, **train) -> Path:
    cfg = {
        "study": "ddp-cell",
        "results_dir": str(results),
        "device": "cpu",
        "datasets": {"digits": {}},
        "grid": {"losses": ["dclw"], "batch_sizes": [32], "temperatures": [0.5], "seeds": [0]},
        "train": {**TRAIN, **train, "devices": devices},
        "baselines": False,
        "experiments": {"mi": {"enabled": False}},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def weights(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def assert_close_weights(a: dict, b: dict) -> None:
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The cell trained by one process (the reference)."""
    root = tmp_path_factory.mktemp("one")
    cfg = study(root / "c.yaml", root / "results", devices=1)
    res = subprocess.run(
        [
            str(BIN / "smallbatch"),
            "pretrain",
            "--config",
            str(cfg),
            "--cell-id",
            CELL,
            "--tracking-uri",
            "none",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return weights(root / "results" / "runs" / CELL / "checkpoint.pt")


def test_two_processes_through_snakemake_equal_one_and_log_one_run(tmp_path, one_process):
    """`snakemake --cores 2` launches the cell with torchrun on 2 processes: one MLflow run
    (rank 0 logs), a loss history with one value per step, the 1-process weights."""
    cfg = study(tmp_path / "c.yaml", tmp_path / "results", devices=2)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--directory",
        str(tmp_path),
        "--configfile",
        str(cfg),
        "--cores",
        "2",
        "--quiet",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (tmp_path / "results" / "logs" / "pretrain" / f"{CELL}.log").read_text()
    assert '"processes": 2' in log and log.count('"cell_id"') == 1, log[-2000:]
    assert_close_weights(weights(tmp_path / "results" / "runs" / CELL / "checkpoint.pt"), one_process)
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "ddp-cell"]
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`smallbatch.cell_id` = '{CELL}'")
    assert len(runs) == 1 and runs[0].data.tags["smallbatch.status"] == "finished"
    assert runs[0].data.params["train.devices"] == "2"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and steps[0] == TRAIN["log_every"]


def test_a_preempted_two_process_cell_resumes_on_one(tmp_path, one_process):
    """SIGTERM to torchrun (as SLURM or a user sends it): every process stops at the same
    step, rank 0 saves the state; the state is global, so the rest of the run continues
    on ONE process and ends at the uninterrupted run's weights."""
    cfg = study(tmp_path / "c.yaml", tmp_path / "results", devices=2, epochs=30)
    out = tmp_path / "results" / "runs" / CELL
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "smallbatch",
        "pretrain",
        "--config",
        str(cfg),
        "--cell-id",
        CELL,
        "--tracking-uri",
        "none",
        "--no-progress",
    ]
    with open(tmp_path / "torchrun.log", "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env())
    try:
        deadline = time.monotonic() + 300
        while not (out / "state.pt").exists():
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no state.pt within 300 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "torchrun.log").read_text()
    assert "preempted" in text and not (out / "checkpoint.pt").exists(), text[-3000:]
    saved = torch.load(out / "state.pt", weights_only=False)
    assert 0 < saved["step"] < 30 * (1437 // 32)
    one = study(tmp_path / "one.yaml", tmp_path / "results", devices=1, epochs=30)
    res = subprocess.run(
        [
            str(BIN / "smallbatch"),
            "pretrain",
            "--config",
            str(one),
            "--cell-id",
            CELL,
            "--tracking-uri",
            "none",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=900,
    )
    assert res.returncode == 0 and f"from step {saved['step']}/" in res.stderr, res.stderr[-2000:]
    ref_root = tmp_path / "ref"
    ref = study(tmp_path / "ref.yaml", ref_root, devices=1, epochs=30)
    res = subprocess.run(
        [
            str(BIN / "smallbatch"),
            "pretrain",
            "--config",
            str(ref),
            "--cell-id",
            CELL,
            "--tracking-uri",
            "none",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env(),
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert_close_weights(weights(out / "checkpoint.pt"), weights(ref_root / "runs" / CELL / "checkpoint.pt"))
    assert json.loads(res.stdout.strip().splitlines()[-1])["status"] == "finished"
