"""SIGTERM to one process of a two-process cell (as srun delivers it: to each task on its
own) or to both: every process stops at the same agreed step, rank 0 saves that step's
state, every process exits 143 after the save, none dies in a collective, and only rank 0
says it saved.

Each rank is the real CLI (``python -c`` around ``smallbatch.pipeline.cli.main``, with torchrun's
environment variables, gloo on the CPU), paused after step PAUSE_AT: it writes a marker
file and blocks reading stdin.  The test signals the chosen ranks while both are paused,
then lets them go, so where the signal lands is decided by events, not by timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cluster
import pytest
import yaml

from smallbatch.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

CELL = "digits/dclw/bs32-t0.5-s0"
LOG_EVERY, PAUSE_AT = 4, 6  # the ranks compare flags at steps 4, 8, ...: the agreed step is 8
TRAIN = {
    "width": 4,
    "proj_hidden": 16,
    "proj_dim": 8,
    "log_every": LOG_EVERY,
    "precision": "fp64",
    "epochs": 1,
    "devices": 2,
}


def _config(root: Path) -> Path:
    cfg = {
        "study": "rank-signals",
        "results_dir": str(root / "results"),
        "device": "cpu",
        "datasets": {"digits": {}},
        "grid": {"losses": ["dclw"], "batch_sizes": [32], "temperatures": [0.5], "seeds": [0]},
        "train": TRAIN,
        "baselines": False,
        "experiments": {"mi": {"enabled": False}},
    }
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(root: Path, port: int) -> list[subprocess.Popen]:
    cfg = _config(root)
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        cmd = [
            sys.executable,
            "-c",
            cluster.PAUSED_PRETRAIN,
            str(root / f"paused{rank}"),
            str(PAUSE_AT),
            "pretrain",
            "--config",
            str(cfg),
            "--cell-id",
            CELL,
            "--tracking-uri",
            "none",
            "--no-progress",
        ]
        with open(root / f"stderr{rank}.txt", "w") as err:  # a file: no pipe to fill up
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env))
    return procs


def _signal_when_paused(root: Path, procs: list[subprocess.Popen], ranks: tuple[int, ...]) -> None:
    deadline = time.monotonic() + 300  # a hang guard only: the ranks wait for us once paused
    while not all((root / f"paused{r}").exists() for r in range(2)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            return  # the test reports it with the ranks' stderr
        time.sleep(0.05)
    for r in ranks:
        procs[r].send_signal(signal.SIGTERM)
    for p in procs:  # the signal is pending before the rank reads this
        p.stdin.write(b"go")
        p.stdin.flush()


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> dict:
    """Three two-process cells, started together: SIGTERM to rank 0, to rank 1, to both.
    Returns per case: (return codes, stderr texts, folder)."""
    cases = {"rank0": (0,), "rank1": (1,), "all": (0, 1)}
    roots = {name: tmp_path_factory.mktemp(name) for name in cases}
    procs = {name: _start(roots[name], cluster.free_port()) for name in cases}
    try:
        for name, ranks in cases.items():
            _signal_when_paused(roots[name], procs[name], ranks)
    finally:
        for ps in procs.values():
            for p in ps:
                try:
                    p.stdin.close()
                    p.wait(timeout=300)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait()
    return {
        name: (
            [p.returncode for p in procs[name]],
            [(roots[name] / f"stderr{r}.txt").read_text() for r in range(2)],
            roots[name],
        )
        for name in cases
    }


@pytest.mark.parametrize("case", ["rank0", "rank1", "all"])
def test_sigterm_to_some_ranks_saves_the_agreed_step_and_every_rank_exits_143(preempted, case):
    rcs, errs, root = preempted[case]
    both = "\n--- rank 1 ---\n".join(e[-1500:] for e in errs)
    assert all((root / f"paused{r}").exists() for r in range(2)), f"a rank ended before its pause:\n{both}"
    assert rcs == [143, 143], both
    assert not any(w in e for e in errs for w in ("gloo", "Connection closed", "Traceback")), both
    state = load_checkpoint(root / "results" / "runs" / CELL / "state.pt")
    assert PAUSE_AT <= state["step"] < PAUSE_AT + LOG_EVERY and state["step"] % LOG_EVERY == 0
    assert not (root / "results" / "runs" / CELL / "checkpoint.pt").exists()
    last = [e.strip().splitlines()[-1] for e in errs]
    assert last[0].startswith("smallbatch: preempted:") and f"saved its state at step {state['step']} " in last[0]
    assert last[1].startswith("smallbatch: preempted:") and f"stopped at step {state['step']} " in last[1]
    assert "saved its state" not in errs[1]  # rank 1 never claims a save
    signalled = [case in ("all", f"rank{r}") for r in range(2)]
    for r in range(2):
        assert ("another process" not in last[r]) == signalled[r], last[r]
