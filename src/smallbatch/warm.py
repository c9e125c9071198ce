"""Warm start: the workflow's jobs run in children of one process that imported torch once.

A local study runs ~45 short `smallbatch` processes, and each paid ~6 s of imports (torch,
the compiler stack that ``torch.optim`` loads, MLflow and its SQL store, faiss) before its
first step: a fifth of the default study's CPU time.  During a local Snakemake run a
**server** (started by the workflow's ``onstart``, stopped by ``onsuccess``/``onerror``)
binds a Unix socket and imports all that once, between its first requests.  Each job's
``smallbatch COMMAND ...`` is then a **client**: it hands the server its arguments, working
folder, environment and standard streams (the file descriptors themselves), and the server
forks a child that runs ``cli.main`` exactly as the job's own process would -- same files,
same log, same exit status -- while the client waits and passes on what happens to it:

* SIGTERM / SIGINT / SIGHUP sent to the client (Snakemake cancelling, a preemption) go to
  the child, which stops as it would (pretraining saves its state and exits 143);
* a client that dies (SIGKILL) closes its socket: the child gets SIGTERM, and SIGKILL
  ``GRACE_S`` later;
* the exit status comes back as the child's (128 + N for a child killed by signal N).

Without the variable ``SMALLBATCH_WARM`` (the socket's path), or when nothing answers
there (a cluster job on another node, a server that stopped), or in a worker of a
multi-process launch (``RANK`` set), the command runs in its own process as before.  The
server never runs a torch operation, opens a store or starts a thread before forking, so
each child starts as a fresh process would (tests/test_warm.py: bit-identical checkpoints).

Protocol: the client sends 8 bytes (the request's length) with its descriptors 0, 1, 2
attached (SCM_RIGHTS), then the request as JSON ``{argv, cwd, env}``; afterwards one byte
per signal to forward.  The server answers 4 bytes: the exit status.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ENV = "SMALLBATCH_WARM"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FOLDER_PREFIX = "smallbatch-warm-"
GRACE_S = 30.0  # after a client vanished: SIGTERM, then SIGKILL this much later
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "mlflow", "mlflow.tracking",
           "mlflow.store.tracking.sqlalchemy_store", "faiss", "smallbatch.steps", "smallbatch.evaluate",
           "smallbatch.mi", "smallbatch.report", "seaborn", "smallbatch.config:load_config")
# Snakemake sets these for a job's own process (snakemake.shell); the server's children get them too
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


# --------------------------------------------------------------------------- client
def delegate(argv: list[str]) -> int | None:
    """Run ``smallbatch *argv`` in a child of the warm server; its exit status, or None when
    there is no server to ask (the caller then runs the command itself)."""
    path = os.environ.get(ENV)
    if not path or not argv or argv[0] == "warm-server" or "RANK" in os.environ:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        payload = json.dumps({"argv": [sys.argv[0] or "smallbatch", *argv], "cwd": os.getcwd(),
                              "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [len(payload).to_bytes(8, "big")], [0, 1, 2])
        conn.sendall(payload)
    except OSError:
        conn.close()
        return None  # nothing was started: run here
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: _send_quietly(conn, bytes([n])))
    status = _recv_exact(conn, 4)
    if status is None:
        print("smallbatch: error: the warm-start server stopped before the command finished", file=sys.stderr)
        return 1
    return int.from_bytes(status, "big", signed=True)


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.send(data)
    except OSError:
        pass


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# --------------------------------------------------------------------------- server
class _Server:
    """The accept / fork / reap loop (single-threaded: forking is safe)."""

    def __init__(self, path: str, watch_pid: int | None, idle_timeout: float) -> None:
        self.path, self.watch_pid, self.idle_timeout = path, watch_pid, idle_timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(256)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[socket.socket, float, str]] = {}  # pid -> (client, start, what it runs)
        self.kill_at: dict[int, float] = {}  # pid -> when SIGKILL follows (client gone)
        self.stop = False

    def loop(self, preload: list[str]) -> None:
        """Serve; between requests import the next module of ``preload`` (the first jobs
        need not wait for all of them: a child imports what is not loaded yet itself)."""
        last_busy = time.monotonic()
        while not self.stop:
            events = self.sel.select(timeout=0 if preload else 0.2)
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._from_client(key.fileobj, key.data)
            if preload and not events:
                _import(preload.pop(0))
                if not preload:
                    print(f"{time.strftime('%H:%M:%S')} preloaded {', '.join(PRELOAD)}", flush=True)
            self._reap()
            now = time.monotonic()
            for pid, when in list(self.kill_at.items()):
                if now >= when:
                    _kill_group(pid, signal.SIGKILL)
            if self.children:
                last_busy = now
            elif now - last_busy > self.idle_timeout or not _alive(self.watch_pid):
                break

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(10.0)
        fds: list[int] = []
        try:
            head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
            body = _recv_exact(conn, int.from_bytes(head, "big")) if len(head) == 8 and len(fds) == 3 else None
            request = json.loads(body) if body else None
        except (OSError, ValueError):
            request = None
        if request is None:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(request, fds, conn)  # never returns
        try:
            os.setpgid(pid, pid)  # as the child does: a signal forwarded at once reaches its group
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children[pid] = (conn, time.monotonic(), _what(request))
        print(f"{time.strftime('%H:%M:%S')} child {pid} started: {self.children[pid][2]}", flush=True)
        self.sel.register(conn, selectors.EVENT_READ, pid)

    def _child(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        code = 1
        try:
            self.sel.close()
            self.sock.close()
            conn.close()
            for other, _t0, _what_runs in self.children.values():
                other.close()
            os.setpgid(0, 0)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update({k: v for k, v in request["env"].items() if k != ENV})
            sys.argv = list(request["argv"])
            from .cli import main

            code = main(sys.argv[1:])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child reports and exits like a process would
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code & 0xFF if code >= 0 else 1)

    def _from_client(self, conn: socket.socket, pid: int) -> None:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data:  # signals the client received
            for sig in data:
                _kill_group(pid, sig)
            return
        self.sel.unregister(conn)  # the client is gone: stop its child
        _kill_group(pid, signal.SIGTERM)
        self.kill_at[pid] = time.monotonic() + GRACE_S

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid not in self.children:
                continue
            conn, t0, what = self.children.pop(pid)
            self.kill_at.pop(pid, None)
            print(f"{time.strftime('%H:%M:%S')} child {pid} exited {code} after {time.monotonic() - t0:.1f} s: {what}",
                  flush=True)
            _send_quietly(conn, (code if code >= 0 else 128 - code).to_bytes(4, "big", signed=True))
            try:
                self.sel.unregister(conn)
            except (KeyError, ValueError):  # already, when its client vanished
                pass
            conn.close()

    def close(self) -> None:
        for pid in list(self.children):
            _kill_group(pid, signal.SIGTERM)
        self.sel.close()
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)
        if Path(self.path).parent.name.startswith(FOLDER_PREFIX):
            try:
                Path(self.path).parent.rmdir()
            except OSError:
                pass


def _what(request: dict) -> str:
    """The command and its output folder, for the server's log."""
    argv = [str(a) for a in request.get("argv", [])[1:]]
    out = argv[argv.index("--out") + 1] if "--out" in argv[:-1] else ""
    return " ".join(filter(None, ["smallbatch", argv[0] if argv else "", out]))


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _import(name: str) -> None:
    """Import a module the commands import (a missing one is skipped: a child then meets the
    same ImportError a process of its own would); ``module:function`` also calls the function
    (a cache every child would otherwise fill itself)."""
    import importlib

    module, _, function = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    if function:
        getattr(mod, function)()


def serve(path: str, watch_pid: int | None = None, idle_timeout: float = 3600.0) -> int:
    """Run the server on ``path`` until SIGTERM/SIGINT, ``watch_pid`` ends, or no command ran
    for ``idle_timeout`` seconds."""
    server = _Server(path, watch_pid, idle_timeout)

    def _stop(*_a) -> None:
        server.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        print(f"warm-start server {os.getpid()} ready on {path}", flush=True)
        server.loop(list(PRELOAD))
    finally:
        server.close()
    return 0


# --------------------------------------------------------------------------- workflow hooks
def start(log: str | Path, threads: int, timeout_s: float = 30.0) -> subprocess.Popen | None:
    """Start a server for this process's jobs (Snakemake's ``onstart``) and point them at it
    (``SMALLBATCH_WARM`` in this process's environment, which the jobs inherit).  None (the
    jobs then run as plain processes) when it could not be started; the reason is in ``log``."""
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # short: a socket path has <= 107 bytes
    path = os.path.join(folder, "socket")
    env = dict(os.environ, **{k: str(threads) for k in THREAD_VARS})
    env.pop(ENV, None)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "smallbatch.cli", "warm-server", "--socket", path,
                                 "--watch-pid", str(os.getpid())], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            os.rmdir(folder)
            return None
        time.sleep(0.05)
    os.environ[ENV] = path
    return proc


def stop(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """Stop a server :func:`start` returned (Snakemake's ``onsuccess`` / ``onerror``)."""
    os.environ.pop(ENV, None)
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
