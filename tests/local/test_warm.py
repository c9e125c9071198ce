"""The warm-start server (smallbatch.local.warm): a command handed to it runs in a forked child
exactly as in its own process -- the same checkpoint bit for bit, output, exit status --
signals to the client reach the child, a vanished client stops its child, and without a
server (or in a multi-process worker) the command runs in its own process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster import HANG_S

from smallbatch.local import warm

pytestmark = pytest.mark.slow  # a server and its clients (pyproject: markers)

SMALLBATCH = Path(sys.executable).parent / "smallbatch"
CELL = [
    "--tracking-uri",
    "none",
    "--dataset",
    "digits",
    "--loss",
    "dcl",
    "--batch-size",
    "32",
    "--temperature",
    "0.5",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("warm") / "server.log"
    saved = os.environ.pop(warm.ENV, None)
    proc = warm.start(log, threads=1)
    path = os.environ[warm.ENV]
    deadline = time.monotonic() + 600  # a hang guard: it imports torch, MLflow and faiss first
    while "ready on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    yield {"proc": proc, "log": log, "env": dict(os.environ), "path": path}
    warm.stop(proc)
    if saved is not None:
        os.environ[warm.ENV] = saved
    assert proc.returncode == 0 and not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


def _run(argv, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(SMALLBATCH), *argv], env=env, capture_output=True, text=True, timeout=300, **kw)


def _children(log: Path, status: str, naming: str | None = None) -> list[str]:
    """The server log's child lines with ``status``; with ``naming``, waits (hang guard 300 s) until
    one names it: the client has its status from the child itself, before the server reaps and logs."""
    deadline = time.monotonic() + 300
    while True:
        lines = [line for line in log.read_text().splitlines() if f" {status}" in line]
        if naming is None or any(naming in line for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_command_in_a_child_is_the_command_in_its_own_process(server, tmp_path):
    plain_env = {k: v for k, v in server["env"].items() if k != warm.ENV}
    served = _run(["pretrain", *CELL, "--epochs", "1", "--out", str(tmp_path / "served")], server["env"])
    plain = _run(["pretrain", *CELL, "--epochs", "1", "--out", str(tmp_path / "plain")], plain_env)
    assert served.returncode == plain.returncode == 0, served.stderr[-2000:] + plain.stderr[-2000:]
    exited = _children(server["log"], "exited 0", str(tmp_path / "served"))
    assert any(str(tmp_path / "served") in line for line in exited), server["log"].read_text()[-3000:]
    assert not any(str(tmp_path / "plain") in line for line in _children(server["log"], "started"))
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("served", "plain"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # bit for bit
    assert a["final_loss"] == b["final_loss"] and a["steps"] == b["steps"]
    out_a, out_b = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (served, plain))
    assert {k: v for k, v in out_a.items() if k not in ("wall_s", "images_per_s")} == {
        k: v for k, v in out_b.items() if k not in ("wall_s", "images_per_s")
    }
    assert "digits/dcl/bs32-t0.5-s0" in served.stderr  # the progress bar reached the client's stderr


def test_bad_input_gives_the_exit_status_and_one_line(server, tmp_path):
    argv = [("1" if prev == "--batch-size" else a) for prev, a in zip(["", *CELL], CELL)]
    p = _run(["pretrain", *argv, "--out", str(tmp_path)], server["env"])
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert p.stderr.startswith("smallbatch: error: --batch-size must be >= 2")
    assert any(str(tmp_path) in line for line in _children(server["log"], "exited 2", naming=str(tmp_path)))


def _start_long(server, out: Path) -> tuple[subprocess.Popen, int]:
    """A 200-epoch cell in a child of the server, once its training loop runs with its SIGTERM
    handler installed: the loop writes state.pt (at each epoch end) only inside that handler's
    scope, so the first state.pt is the event waited for.  Returns the client and the step of
    that first state."""
    proc = subprocess.Popen(
        [str(SMALLBATCH), "pretrain", *CELL, "--epochs", "200", "--out", str(out)],
        env=server["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300  # a hang guard, not a race: nothing happens to the child meanwhile
    while not (out / "state.pt").exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, server["log"].read_text()[-2000:]
        time.sleep(0.05)
    assert any(str(out) in line for line in _children(server["log"], "started"))  # it runs in a child
    return proc, _state_step(out)


def _state_step(out: Path) -> int:
    return int(torch.load(out / "state.pt", map_location="cpu", weights_only=False)["step"])


def test_sigterm_to_the_client_preempts_the_child(server, tmp_path):
    proc, first_state = _start_long(server, tmp_path / "cell")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 143, err[-2000:]
    assert "smallbatch: preempted: SIGTERM received" in err
    assert _state_step(tmp_path / "cell") > first_state  # saved on the signal, at the step it was at


def test_a_killed_client_stops_its_child(server, tmp_path):
    proc, first_state = _start_long(server, tmp_path / "cell")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + HANG_S
    while not any(str(tmp_path / "cell") in line for line in _children(server["log"], "exited 143")):
        assert time.monotonic() < deadline, server["log"].read_text()[-2000:]
        time.sleep(0.1)
    err = proc.stderr.read()  # the child wrote into the client's stderr (its descriptor was handed over)
    assert "smallbatch: preempted: SIGTERM received" in err, err[-2000:]  # it stopped as a preempted job does
    assert _state_step(tmp_path / "cell") > first_state


@pytest.mark.parametrize("env", [{warm.ENV: "/nonexistent/socket"}, {"RANK": "0"}])
def test_without_a_server_or_in_a_worker_the_command_runs_itself(server, tmp_path, env):
    before = len(_children(server["log"], "started"))
    p = _run(["pretrain", *CELL, "--steps", "3", "--out", str(tmp_path)], {**server["env"], **env})
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(_children(server["log"], "started")) == before and (tmp_path / "checkpoint.pt").exists()


def test_the_server_stops_with_the_process_it_watches(tmp_path):
    sock = tmp_path / "s"
    watched = subprocess.Popen(["cat"], stdin=subprocess.PIPE)  # ends when its input is closed
    server = subprocess.Popen(
        [str(SMALLBATCH), "warm-server", "--socket", str(sock), "--watch-pid", str(watched.pid)],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != warm.ENV},
    )
    ready = [server.stdout.readline() for _ in range(2)]  # preloaded ..., then ready on ...
    assert "ready on" in ready[-1], ready
    watched.stdin.close()
    watched.wait()
    server.communicate(timeout=HANG_S)
    assert server.returncode == 0 and not sock.exists()


def test_once_the_package_changed_the_server_starts_no_child_and_commands_run_the_new_code(tmp_path):
    """A server of a copy of the package serves a command; a file of the copy changes (as when the
    checkout is updated during a study); the next command is not started by the server (its log
    says which file changed) but runs in its own process, on the new code, with its own status."""
    import smallbatch

    src = tmp_path / "src"
    shutil.copytree(Path(smallbatch.__file__).parent, src / "smallbatch", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != warm.ENV} | {"PYTHONPATH": str(src)}
    sock, log = tmp_path / "socket", tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "smallbatch", "warm-server", "--socket", str(sock), "--watch-pid", str(os.getpid())],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 600  # a hang guard: it imports torch, MLflow and faiss first
        while "ready on" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        client = {**env, warm.ENV: str(sock)}
        served = _run(["config-reference"], client)
        assert served.returncode == 0 and len(_children(log, "started")) == 1, log.read_text()
        with (src / "smallbatch" / "__init__.py").open("a") as init:
            init.write('\nimport sys as _sys\n\n_sys.stderr.write("the new code\\n")\n')
        own = _run(["config-reference"], client)
        assert own.returncode == 0 and own.stdout == served.stdout and "the new code" in own.stderr, own.stderr
        assert len(_children(log, "started")) == 1, log.read_text()
        assert "source changed since this server imported it (__init__.py)" in log.read_text()
    finally:
        server.terminate()
        server.wait(timeout=HANG_S)


def test_preload_entry_calls_its_function(monkeypatch):
    """``module:function`` in the preload list imports the module and calls the function (the
    default config is validated in the server, once, for every child); a missing module is
    skipped."""
    from smallbatch.study import config as C

    calls = []
    monkeypatch.setattr(C, "load_config", lambda: calls.append(1))
    warm._import("smallbatch.study.config:load_config")
    warm._import("no_such_module_for_smallbatch:anything")
    assert calls == [1]
    assert "smallbatch.study.config:load_config" in warm.PRELOAD
