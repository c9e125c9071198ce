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
  the child's process group, from the client itself, which stops as it would (pretraining
  saves its state and exits 143);
* a client that dies (SIGKILL) closes its socket: the child gets SIGTERM, and SIGKILL
  ``GRACE_S`` later;
* a server that dies (SIGKILL) takes its children with it: each asks the kernel for SIGTERM
  when its parent dies (``PR_SET_PDEATHSIG``), so pretraining saves its state and exits 143
  and no orphan keeps a cell's lock;
* the exit status comes back as the child's (128 + N for a child killed by signal N).

Without the variable ``SMALLBATCH_WARM`` (the socket's path), or when nothing answers
there (a cluster job on another node, a server that stopped: no answer within
``ACK_TIMEOUT_S``), or when the socket's server runs as another user, or in a worker of a
multi-process launch (``RANK`` set), the command runs in its own process as before.  The
server serves only connections of its own user (``SO_PEERCRED``).

Threads at fork: the server imports torch, MLflow (pyarrow starts a jemalloc background
thread at import) and numpy/scipy (OpenBLAS sizes its worker pool from the server's thread
variables), but runs no torch operation and opens no store before forking.  A forked child
holds only the thread that forked; the libraries' pools start again in the child as needed,
and the child sizes them from the *job's* environment (:func:`apply_thread_env`: OpenBLAS,
MKL and OpenMP through threadpoolctl, torch's intra-op pool through
``torch.set_num_threads``), so ``OMP_NUM_THREADS=1`` in a job means one BLAS thread even
though the server imported numpy with two (tests/pipeline/test_trust.py).  Each child computes as a
fresh process would (tests/pipeline/test_warm.py: bit-identical checkpoints).

Protocol: the client sends 8 bytes (the request's length) with its descriptors 0, 1, 2
attached (SCM_RIGHTS), then the request as JSON ``{argv, cwd, env}``.  The server answers
4 bytes, the child's PID, once the child is started (a client that gave up waiting for
them has closed its socket, and the server then starts nothing), and 4 bytes, the exit
status, once it has reaped the child.  A client that sees the child gone and no status
within ``STATUS_GRACE_S`` (a stopped server) says so in one line.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

ENV = "SMALLBATCH_WARM"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FOLDER_PREFIX = "smallbatch-warm-"
GRACE_S = 30.0  # after a client vanished: SIGTERM, then SIGKILL this much later
ACK_TIMEOUT_S = 15.0  # a server that has not started the job by then (stopped, hung): run it here
STATUS_GRACE_S = 5.0  # the child is gone but no status came: give up waiting after this long
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.optim",
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "faiss",
    "smallbatch.pipeline.jobs",
    "smallbatch.evaluation.knn",
    "smallbatch.evaluation.linear",
    "smallbatch.mi.toy",
    "smallbatch.report",
    "seaborn",
    "smallbatch.pipeline.config:load_config",
)
# Snakemake sets these for a job's own process (snakemake.shell); the server's children get them too
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


# --------------------------------------------------------------------------- client
def delegate(argv: list[str]) -> int | None:
    """Run ``smallbatch *argv`` in a child of the warm server; its exit status, or None when
    there is no server to ask (the caller then runs the command itself)."""
    path = os.environ.get(ENV)
    if not path or not argv or argv[0] == "warm-server" or "RANK" in os.environ:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ACK_TIMEOUT_S)
    try:
        conn.connect(path)
        if peer_uid(conn) != os.getuid():
            raise OSError("the socket's server runs as another user")
        payload = json.dumps(
            {"argv": [sys.argv[0] or "smallbatch", *argv], "cwd": os.getcwd(), "env": dict(os.environ)}
        ).encode()
        socket.send_fds(conn, [len(payload).to_bytes(8, "big")], [0, 1, 2])
        conn.sendall(payload)
        ack = _recv_exact(conn, 4)
    except OSError:  # refused, timed out (a stopped server), another user's: nothing was started
        ack = None
    if ack is None:
        conn.close()
        return None  # run here
    child = int.from_bytes(ack, "big")
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: _kill_group(child, n))
    return _wait_status(conn, child)


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _wait_status(conn: socket.socket, child: int) -> int:
    """The 4 bytes of the child's exit status; 1 with one line when the server closed the
    connection, or the child is gone and no status came within STATUS_GRACE_S (a server
    stopped or killed while its child ran)."""
    conn.settimeout(1.0)
    buf, gone_since = b"", None
    while len(buf) < 4:
        try:
            chunk = conn.recv(4 - len(buf))
        except TimeoutError:
            if not _running(child):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > STATUS_GRACE_S:
                    print(
                        f"smallbatch: error: the command's process {child} ended but the warm-start server did not "
                        "report its exit status (server stopped?); see the job's log, and rerun the job",
                        file=sys.stderr,
                    )
                    return 1
            continue
        except OSError:
            chunk = b""
        if not chunk:
            print("smallbatch: error: the warm-start server stopped before the command finished", file=sys.stderr)
            return 1
        buf += chunk
    return int.from_bytes(buf, "big", signed=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        return _alive(pid)


def _client_gone(conn: socket.socket) -> bool:
    """The client closed its end (it gave up waiting): nothing is to be started for it."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return True


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

    def __init__(
        self, path: str, watch_pid: int | None, idle_timeout: float, entry: Callable[[list[str]], int]
    ) -> None:
        self.path, self.watch_pid, self.idle_timeout = path, watch_pid, idle_timeout
        self.entry = entry  # the CLI's main, passed in by the CLI (warm imports no CLI: no import circle)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(256)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[socket.socket, float, str]] = {}  # pid -> (client, start, what it runs)
        self.kill_at: dict[int, float] = {}  # pid -> when SIGKILL follows (client gone)
        self.stop = False
        self.pid = os.getpid()

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
            if peer_uid(conn) != os.getuid():  # only this user's jobs: the request carries an environment
                raise OSError("a connection of another user")
            head, fds, _flags, _addr = socket.recv_fds(conn, 8, 3)
            body = _recv_exact(conn, int.from_bytes(head, "big")) if len(head) == 8 and len(fds) == 3 else None
            request = json.loads(body) if body else None
            if request is not None and _client_gone(conn):
                print(
                    f"{time.strftime('%H:%M:%S')} a client gave up waiting before its command started: "
                    f"not started ({_what(request)})",
                    flush=True,
                )
                request = None
        except (OSError, ValueError) as exc:
            if "another user" in str(exc):
                print(f"{time.strftime('%H:%M:%S')} refused a connection of another user", flush=True)
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
        _send_quietly(conn, pid.to_bytes(4, "big"))  # started: the client now waits for the status
        self.children[pid] = (conn, time.monotonic(), _what(request))
        print(f"{time.strftime('%H:%M:%S')} child {pid} started: {self.children[pid][2]}", flush=True)
        self.sel.register(conn, selectors.EVENT_READ, pid)

    def _child(self, request: dict, fds: list[int], conn: socket.socket) -> None:
        code = 1
        try:
            _die_with_parent(self.pid)
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
            apply_thread_env(os.environ)
            sys.argv = list(request["argv"])
            code = self.entry(sys.argv[1:])
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
            print(
                f"{time.strftime('%H:%M:%S')} child {pid} exited {code} after {time.monotonic() - t0:.1f} s: {what}",
                flush=True,
            )
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


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the server dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so
    a SIGKILLed server leaves no orphan training on; a child whose server is already gone
    exits at once.  Elsewhere a no-op."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(128 + int(signal.SIGTERM))


def apply_thread_env(env) -> None:
    """Size the thread pools of libraries already imported (by the server, before this process
    forked) from the job's variables: OpenBLAS / MKL / OpenMP through threadpoolctl, torch's
    intra-op pool with ``torch.set_num_threads``.  Unset or unusable values change nothing."""

    def count(*names: str) -> int | None:
        for name in names:
            try:
                n = int(env.get(name, ""))
            except ValueError:
                continue
            if n >= 1:
                return n
        return None

    blas = count("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
    omp = count("OMP_NUM_THREADS")
    limits = {k: v for k, v in (("blas", blas), ("openmp", omp)) if v is not None}
    if limits:
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=limits)
        except Exception:  # noqa: BLE001 - no threadpoolctl, or a library it cannot drive
            pass
    if omp is not None and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(omp)


def _what(request: dict) -> str:
    """The command and its output folder, for the server's log."""
    argv = [str(a) for a in request.get("argv", [])[1:]]
    joined = [a.split("=", 1)[1] for a in argv if a.startswith("--out=")]  # the workflow's --out=VALUE
    out = joined[0] if joined else argv[argv.index("--out") + 1] if "--out" in argv[:-1] else ""
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


def serve(
    path: str, entry: Callable[[list[str]], int], watch_pid: int | None = None, idle_timeout: float = 3600.0
) -> int:
    """Run the server on ``path`` until SIGTERM/SIGINT, ``watch_pid`` ends, or no command ran
    for ``idle_timeout`` seconds; each request runs ``entry(argv)`` (the CLI's ``main``) in a child."""
    server = _Server(path, watch_pid, idle_timeout, entry)

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
    jobs then run as plain processes) when it could not be started; the reason is in ``log``
    (a log that is a link, a FIFO or a hard link is refused first: ValueError, nothing started)."""
    from ..io import open_log

    out = open_log(log)  # never through a planted link, FIFO or hard link
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # short: a socket path has <= 107 bytes
    path = os.path.join(folder, "socket")
    env = dict(os.environ, **{k: str(threads) for k in THREAD_VARS})
    env.pop(ENV, None)
    with out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smallbatch", "warm-server", "--socket", path, "--watch-pid", str(os.getpid())],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
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
