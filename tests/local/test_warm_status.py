"""The warm-start server is exact, or it would be gone (benchmarks/results/2026-12-02-warm-start.md):

* a job's exit status through it is the job's own, whatever the job does (an exit status, an
  exception, ``sys.exit`` of a message, a signal it dies of, a SIGTERM it is sent) and whenever
  it runs (before the server is ready, while others start and end), property-tested over random
  jobs and timings beside a CPU hog;
* no bytes on its socket stop it (or start anything): after each, a real job runs through it;
* a SIGTERM ends any client within ``FORWARD_GRACE_S``, even against a server that never reports.

The jobs are a small harness's (CPU work of random length, no sleeps), run by a client that
does what ``smallbatch``'s ``main`` does: ask the server, else run the job itself.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smallbatch.local import warm

pytestmark = pytest.mark.slow  # a server and its clients (pyproject: markers)

HARNESS = """
import os, sys

def spin(n):
    x = 0
    for i in range(int(n)):
        x += i
    return x

def job(argv):
    mode, value, work = argv
    spin(work)
    if mode == "exit":
        return int(value)
    if mode == "sysexit":
        sys.exit(int(value) if value.lstrip("-").isdigit() else value)
    if mode == "raise":
        raise RuntimeError(value)
    if mode == "signal":
        os.kill(os.getpid(), int(value))
        spin(10**12)
    if mode == "forever":
        open(value, "w").close()  # the event: the job runs
        while True:
            spin(10**6)
    raise AssertionError(mode)

def preload():  # the server's imports: work of a random length
    spin(int(os.environ.get("HARNESS_PRELOAD", "0")))
"""
SERVER = (  # its imports: five pieces of work of a random length
    "import sys, warm_harness; from smallbatch.local import warm; warm.PRELOAD = ('warm_harness:preload',) * 5; "
    "sys.exit(warm.serve(sys.argv[1], warm_harness.job, None, 300))"
)
CLIENT = (  # smallbatch's main: the server's status, else the job in this process
    "import sys, warm_harness as h; h.spin(sys.argv[1]); from smallbatch.local import warm; "
    "rc = warm.delegate(sys.argv[2:]); sys.exit(h.job(sys.argv[2:]) if rc is None else rc)"
)
HANG_GUARD_S = 300


def shell_status(returncode: int) -> int:
    """A process's status as a shell (and Snakemake) reports it: 128 + N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def wait_for(event, what: str, limit: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + limit
    while not event():
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.02)


@pytest.fixture
def harness(tmp_path):
    (tmp_path / "warm_harness.py").write_text(HARNESS)
    env = {k: v for k, v in os.environ.items() if k != warm.ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def cpu_hog():
    """Two processes that keep both cores busy while the test runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for h in hogs:
        h.kill()
        h.wait()


def start_server(tmp_path: Path, env: dict, preload_work: int) -> tuple[subprocess.Popen, Path, Path]:
    sock, log = tmp_path / "s.sock", tmp_path / "server.log"
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(sock)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, "HARNESS_PRELOAD": str(preload_work)},
        )
    return proc, sock, log


def client(env: dict, spec: list[str], pre_work: int = 0, sock: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(pre_work), *spec],
        env={**env, warm.ENV: str(sock)} if sock else env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def random_job(rng: random.Random, marker: Path) -> list[str]:
    work = str(rng.choice([0, 10**3, 10**5, 10**6]))
    kind = rng.choice(["exit", "exit", "sysexit", "raise", "signal", "forever"])
    value = {
        "exit": lambda: str(rng.choice([0, 1, 2, 3, 7, 42, 143, 255, 256 + 5, -1])),
        "sysexit": lambda: rng.choice(["0", "9", "-3", "a message"]),
        "raise": lambda: "boom",
        "signal": lambda: str(rng.choice([signal.SIGTERM, signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT])),
        "forever": lambda: str(marker),
    }[kind]()
    return [kind, value, work]


def run_job(env: dict, spec: list[str], pre_work: int, sock: Path | None) -> int:
    """The job's status as its client ends (a ``forever`` job is sent SIGTERM once it runs, or
    at once when ``pre_work`` is odd: before, during or after the client's handshake)."""
    p = client(env, spec, pre_work, sock)
    if spec[0] == "forever":
        if pre_work % 2 == 0:
            wait_for(lambda: Path(spec[1]).exists() or p.poll() is not None, "the job to run")
        p.send_signal(signal.SIGTERM)
    p.communicate(timeout=HANG_GUARD_S)
    return shell_status(p.returncode)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_jobs_status_through_the_server_is_its_own_whatever_and_whenever_it_runs(tmp_path, harness, cpu_hog, seed):
    """16 jobs (12 random ones and 4 edge cases), each first in its own process, then through a
    server whose imports take a random time: 8 started at once (some before it is ready: they run themselves), 8 once it
    is ready (each served, unless SIGTERMed before it asked), each after random work of its own."""
    rng = random.Random(seed)
    jobs = [random_job(rng, tmp_path / f"running-{i}") for i in range(12)] + [
        ["exit", "-1", "0"],  # a status modulo 256, as a process's
        ["sysexit", "a message", "0"],
        ["signal", str(int(signal.SIGKILL)), "0"],
        ["forever", str(tmp_path / "running-forever"), "0"],
    ]
    rng.shuffle(jobs)
    pre = [rng.choice([0, 1, 10**4, 10**5]) for _ in jobs]  # odd: a forever job is SIGTERMed at once
    own = []
    for spec in jobs:  # each job in its own process: what it reports by itself
        own.append(run_job(harness, spec, 0, None))
        if spec[0] == "forever":
            Path(spec[1]).unlink()
    proc, sock, log = start_server(tmp_path, harness, rng.choice([0, 10**5, 10**6, 3 * 10**6]))
    try:
        early = [run_job(harness, spec, w, sock) for spec, w in zip(jobs[:8], pre[:8])]
        wait_for(lambda: "ready on" in log.read_text(), "the server to be ready")
        served = [run_job(harness, spec, w, sock) for spec, w in zip(jobs[8:], pre[8:])]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert early + served == own, [(spec, o, s) for spec, o, s in zip(jobs, own, early + served) if o != s]
    asked = sum(not (spec[0] == "forever" and w % 2) for spec, w in zip(jobs[8:], pre[8:]))
    assert len(re.findall(r"child \d+ started", log.read_text())) >= asked, log.read_text()[-3000:]


def test_a_job_started_with_the_real_server_gets_its_own_status(tmp_path, cpu_hog):
    """``smallbatch warm-server --socket S &`` then at once a job that fails its config: its own
    status 2 and its one line (it was 1, "server stopped?", when the job ended while the server
    imported)."""
    (tmp_path / "bad.yaml").write_text("grid: {batch_sizes: [1]}\n")
    env = {k: v for k, v in os.environ.items() if k != warm.ENV}
    smallbatch = Path(sys.executable).with_name("smallbatch")
    server = subprocess.Popen(
        [str(smallbatch), "warm-server", "--socket", str(tmp_path / "S")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        res = subprocess.run(
            [str(smallbatch), "cells", "--config", str(tmp_path / "bad.yaml")],
            env={**env, warm.ENV: str(tmp_path / "S")},
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
    finally:
        server.terminate()
        server.wait(timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith("smallbatch: error: config key 'grid.batch_sizes[0]' = 1 is out of range"), lines


# --------------------------------------------------------------------------- bytes on the socket
def _fds() -> list[int]:
    return [0, 1, 2, 2]


def raw(head: bytes, body: bytes = b"", fds: list[int] | None = None, then_close: bool = True):
    """Send ``head`` (with ``fds`` attached) and ``body`` on a new connection."""

    def send(path: Path) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        try:
            if fds:
                socket.send_fds(s, [head], fds)
            else:
                s.sendall(head)
            if body:
                s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):  # the server closed it at a bad head: as it should
            pass
        if then_close:
            s.close()
        return s

    return send


def request(**fields) -> bytes:
    base = {"argv": ["x", "fake", "5", "0"], "cwd": "/", "env": {}}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def framed(body: bytes, fds: list[int] | None = None, then_close: bool = True):
    return raw(len(body).to_bytes(8, "big"), body, _fds() if fds is None else fds, then_close)


BYTES = {
    "a head announcing 2^40 bytes": raw((1 << 40).to_bytes(8, "big"), b"", _fds()),
    "a head announcing 2^40 bytes without descriptors": raw((1 << 40).to_bytes(8, "big")),
    "a head announcing 0 bytes": raw((0).to_bytes(8, "big"), b"", _fds()),
    "3 bytes, then closed": raw(b"\x00\x00\x01"),
    "3 bytes, then silence": raw(b"\x00\x00\x01", then_close=False),
    "random bytes": raw(random.Random(0).randbytes(10_000)),
    "a request that is not JSON": framed(b"\xff{not json"),
    "JSON nested 100,000 deep": framed(b"[" * 100_000 + b"]" * 100_000),
    "a request without env": framed(request(env=...)),
    "a request with a cwd that is a number": framed(request(cwd=3)),
    "a request whose argv holds a number": framed(request(argv=["x", 5])),
    "a request with an empty argv": framed(request(argv=[])),
    "a request whose env holds a list": framed(request(env={"A": ["b"]})),
    "a request with five descriptors": framed(request(), fds=[0, 1, 2, 2, 2]),
    "a request with one descriptor": framed(request(), fds=[0]),
    "a whole request, never a go-ahead": framed(request(), then_close=False),
}


def test_no_bytes_on_its_socket_stop_the_server_or_start_anything_but_a_real_request(tmp_path, harness, cpu_hog):
    proc, sock, log = start_server(tmp_path, harness, 0)
    wait_for(lambda: "ready on" in log.read_text(), "the server to be ready")
    held = []
    try:
        for name, send in BYTES.items():
            held.append(send(sock))
            assert run_job(harness, ["exit", "7", "0"], 0, sock) == 7, name
            assert proc.poll() is None, f"{name}: the server stopped\n{log.read_text()[-3000:]}"
        text = log.read_text()
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(timeout=60)
    children = re.findall(r"child \d+ started: (.*)", text)
    assert children == ["smallbatch exit"] * len(BYTES), text[-3000:]  # only the real jobs ran


def unread(conn: socket.socket) -> int:
    """Bytes sent on ``conn`` that its peer has not read yet (Linux SIOCOUTQ)."""
    import fcntl
    import termios

    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def test_a_sigterm_ends_a_client_whose_server_never_reports(tmp_path, harness, cpu_hog):
    """A server that takes the job (ready, a PID: a process group that is not its child) and
    then never reports: a SIGTERM ends the client with 143, and reaches no process but its own."""
    bystander = int(  # a process group leader that is not the server's child: the PID the server names
        subprocess.run(
            ["sh", "-c", "setsid sleep 100000 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
        ).stdout.strip()
    )
    path = tmp_path / "mute.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    p = client(harness, ["exit", "0", "0"], 0, path)
    fds: list[int] = []
    try:
        conn, _ = srv.accept()
        head, fds, _f, _a = socket.recv_fds(conn, 8, 4)
        for fd in fds:  # the client's streams: its stderr must reach its end when it exits
            os.close(fd)
        fds = []
        body = b""
        while len(body) < int.from_bytes(head, "big"):
            body += conn.recv(65536)
        conn.sendall(warm.READY + bystander.to_bytes(4, "big"))  # the PID right behind the ready
        assert conn.recv(1) == warm.GO
        wait_for(lambda: unread(conn) == 0, "the client to read the PID")  # it waits for the status now
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=HANG_GUARD_S)[1]
        print(f"the client ended {time.monotonic() - t0:.1f} s after its SIGTERM")
        assert shell_status(p.returncode) == 143, err
        assert "did not report within" in err, err  # it forwarded the signal and waited its grace
        assert Path(f"/proc/{bystander}").exists(), "the client signalled a process that is not the server's child"
    finally:
        p.kill()
        os.kill(bystander, signal.SIGKILL)
        srv.close()
        for fd in fds:
            os.close(fd)
