"""Warm start: the workflow's jobs run in children of one process that imported torch once.

A local study runs ~90 short ``smallbatch`` processes, and each would pay its imports (torch,
MLflow and its SQL store, faiss) before its first step.  During a local Snakemake run a **server**
(started by the workflow's ``onstart``, stopped by ``onsuccess``/``onerror``) imports all that
once and then binds a Unix socket.  Each job's ``smallbatch COMMAND ...`` is a **client**: it
hands the server its arguments, working folder, environment and standard streams (the file
descriptors themselves), and the server forks a child that runs ``cli.main`` exactly as the
job's own process would -- same files, same log, same exit status:

* the exit status is the child's own: the child writes it to the client (through a pipe the
  client made) as its last act, so it arrives whatever the server is doing; a child killed by a
  signal N cannot, and the server, which reaps it, reports 128 + N;
* SIGTERM / SIGINT / SIGHUP sent to the client (Snakemake cancelling, a preemption) go to the
  child's process group, from the client itself (once it has checked that the process is the
  server's child); the client then waits ``FORWARD_GRACE_S`` at most for the child's status
  (pretraining saves its state and exits 143 well within it), and otherwise SIGKILLs the group
  and exits 128 + N itself: a client ends within 5 s of a signal, and its job with it;
* a client that dies (SIGKILL) closes its socket: the child gets SIGTERM, and SIGKILL
  ``GRACE_S`` later;
* a server that dies (SIGKILL) takes its children with it: each asks the kernel for SIGTERM
  when its parent dies (``PR_SET_PDEATHSIG``), so pretraining saves its state and exits 143
  (the status its client then gets) and no orphan keeps a cell's lock.

A server serves the code it imported: once any file of the smallbatch package has changed since
(an update of the checkout during a study), it starts no more children -- a child would run the
old modules it inherits beside new ones it imports later -- and each command from then on runs in
its own process, on the new code (:func:`source_stamp`).

Without the variable ``SMALLBATCH_WARM`` (the socket's path), or when nothing answers there
(a server still importing, a cluster job on another node, a stopped server: no answer within
``ACK_TIMEOUT_S``), or when the socket's server runs as another user, or in a worker of a
multi-process launch (``RANK`` set), the command runs in its own process as before.  The
server serves only connections of its own user (``SO_PEERCRED``) and reads each request with
bounds (its size, its time, its fields): bytes that are not a request close that connection
and nothing else.

Protocol: the client sends 8 bytes (the request's length, at most ``MAX_REQUEST``) with four
descriptors attached (SCM_RIGHTS: 0, 1, 2 and the write end of its status pipe), then the
request as JSON ``{argv, cwd, env}``.  The server answers ``R`` once it has read a valid
request; the client answers ``G`` to have it run (it waited ``ACK_TIMEOUT_S`` at most for the
``R``: a client that gave up has closed its socket, the server then starts nothing, and the
client runs the command itself).  The server then forks, sends the child's PID (4 bytes)
and, once it has reaped the child, its exit status (4 bytes); the child writes its exit
status (4 bytes) into the status pipe.  The client takes the first status it gets.

Threads at fork: the server imports torch, MLflow (pyarrow starts a jemalloc background
thread at import) and numpy/scipy (OpenBLAS sizes its worker pool from the server's thread
variables), but runs no torch operation and opens no store before forking.  A forked child
holds only the thread that forked; the libraries' pools start again in the child as needed,
and the child sizes them from the *job's* environment (:func:`apply_thread_env`: OpenBLAS,
MKL and OpenMP through threadpoolctl, torch's intra-op pool through
``torch.set_num_threads``), so ``OMP_NUM_THREADS=1`` in a job means one BLAS thread even
though the server imported numpy with two.  Each child computes as a fresh process would
(bit-identical checkpoints).
"""

from __future__ import annotations

import importlib
import json
import math
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..io import open_log, path_kind

ENV = "SMALLBATCH_WARM"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FOLDER_PREFIX = "smallbatch-warm-"
GRACE_S = 30.0  # after a client vanished: SIGTERM, then SIGKILL this much later
EXIT_GRACE_S = 1.0  # a child whose client is gone (or whose server stops) may be between its status and its exit
ACK_TIMEOUT_S = 15.0  # a server that has not read the request by then (busy, stopped): run it here
FORWARD_GRACE_S = 3.0  # after forwarding a signal: the longest the client waits for the child's status
REQUEST_S = 5.0  # the longest the server waits for a connection's request
GO_S = 60.0  # the longest it waits for the go-ahead once it answered ready
MAX_REQUEST = 1 << 20  # bytes of a request's JSON (its environment is most of it)
READY, GO = b"R", b"G"
PRELOAD = (
    "torch",
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
    "smallbatch.study.config:load_config",
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


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


# --------------------------------------------------------------------------- client
def delegate(argv: list[str]) -> int | None:
    """Run ``smallbatch *argv`` in a child of the warm server; its exit status, or None when
    no server took the command (the caller then runs it itself: nothing was started)."""
    path = os.environ.get(ENV)
    if not path or not argv or argv[0] == "warm-server" or "RANK" in os.environ:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ACK_TIMEOUT_S)
    status_r, status_w = os.pipe()
    try:
        server = _handshake(conn, path, argv, status_w)
    finally:
        os.close(status_w)  # the child holds the write end now (and the server until it forks)
    if server is None:
        conn.close()
        os.close(status_r)
        return None  # run here
    try:
        return _Waiter(conn, status_r, server).wait()  # None: the server stopped before it started the command
    finally:
        conn.close()
        os.close(status_r)


def _handshake(conn: socket.socket, path: str, argv: list[str], status_w: int) -> int | None:
    """Send the request and, once the server has read it, the go-ahead; the server's PID, or
    None when it was not taken (refused, timed out, another user's server): nothing runs then."""
    try:
        conn.connect(path)
        server_pid, uid = peer(conn)
        if uid != os.getuid():
            return None  # the socket's server runs as another user
        payload = json.dumps(
            {"argv": [sys.argv[0] or "smallbatch", *argv], "cwd": os.getcwd(), "env": dict(os.environ)}
        ).encode()
        socket.send_fds(conn, [len(payload).to_bytes(8, "big")], [0, 1, 2, status_w])
        conn.sendall(payload)
        if _recv_exact(conn, 1) != READY:
            return None
        conn.sendall(GO)  # from here on the server runs the command: the client waits for its status
    except OSError:  # refused, timed out (a busy or stopped server), closed: nothing was started
        return None
    return server_pid


@dataclass
class _Waiter:
    """The client's wait for the child's status (see the module's docstring)."""

    conn: socket.socket
    status_r: int
    server: int
    child: int | None = None
    got: bytes = b""  # from the server: the child's PID, then the status it reaped
    pipe: bytes = b""  # from the child itself: its status
    signals: list[int] = field(default_factory=list)
    forwarded_at: float | None = None

    def wait(self) -> int | None:
        for sig in FORWARDED:
            signal.signal(sig, lambda n, _f: self.signals.append(n))
        self.conn.setblocking(False)
        open_fds = {self.conn.fileno(), self.status_r}
        while True:
            code = self._signalled()
            if code is not None:
                return code
            if len(self.pipe) == 4:
                return int.from_bytes(self.pipe, "big", signed=True)
            if len(self.got) == 8:
                return int.from_bytes(self.got[4:], "big", signed=True)
            if not open_fds:
                return self._no_status()
            for fd in select.select(list(open_fds), [], [], 0.25)[0]:
                if not self._read(fd):
                    open_fds.discard(fd)

    def _read(self, fd: int) -> bool:
        """Read what ``fd`` has; False at its end."""
        try:
            if fd == self.status_r:
                data = os.read(fd, 4 - len(self.pipe))
                self.pipe += data
            else:
                data = self.conn.recv(8 - len(self.got))
                self.got += data
        except BlockingIOError:
            return True
        except OSError:
            return False
        if self.child is None and len(self.got) >= 4:
            self.child = int.from_bytes(self.got[:4], "big")
        return bool(data)

    def _signalled(self) -> int | None:
        """Forward a signal the client got to the child's group; the client's exit status once
        the child has not reported within FORWARD_GRACE_S (or there is no child yet)."""
        if not self.signals:
            return None
        sig = self.signals[0]
        if self.child is None:
            return 128 + sig  # nothing started yet (the server stops what it starts for a closed socket)
        ours = _parent_of(self.child) == self.server  # never a process that is not the server's child
        if self.forwarded_at is None:
            self.forwarded_at = time.monotonic()
            if ours:
                _kill_group(self.child, sig)
        elif time.monotonic() - self.forwarded_at > FORWARD_GRACE_S or len(self.signals) > 1:
            if ours:  # the job ends with its client: nothing of it outlives the status
                _kill_group(self.child, signal.SIGKILL)
            print(
                f"smallbatch: error: the command's process {self.child} did not report within "
                f"{FORWARD_GRACE_S:g} s of the signal {sig}; it was stopped, see the job's log",
                file=sys.stderr,
            )
            return 128 + sig
        return None

    def _no_status(self) -> int | None:
        """Both ends closed without a status.  Without a PID no child ran the command (or one
        was stopped as it started, by its server's end): None, the client runs it itself.  With
        one, the child was killed by a signal and its server stopped before it could say so: the
        signal its server's end sent it (SIGTERM, ``_die_with_parent``), as 128 + 15."""
        if self.child is None:
            return None
        print(
            "smallbatch: error: the warm-start server stopped while the command ran, and stopped it (SIGTERM)",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# --------------------------------------------------------------------------- server
@dataclass
class _Conn:
    """A client connection while its request is read: ``head`` (8 bytes and the descriptors),
    ``body`` (the JSON), ``go`` (waiting for the go-ahead), then ``running`` (its child's PID)."""

    sock: socket.socket
    deadline: float
    state: str = "head"
    buf: bytes = b""
    need: int = 8
    fds: list[int] = field(default_factory=list)
    request: dict | None = None
    pid: int | None = None
    started: float = 0.0

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        self.sock.close()


class BadRequest(ValueError):
    """Bytes on the socket that are not a request (one line for the server's log)."""


def check_request(request) -> dict:
    """A request as the client sends it: ``argv`` a non-empty list of strings, ``cwd`` a string,
    ``env`` an object of strings; BadRequest otherwise (the connection is closed, no child runs)."""
    if not isinstance(request, dict) or set(request) != {"argv", "cwd", "env"}:
        raise BadRequest("not an object of argv, cwd and env")
    argv, cwd, env = request["argv"], request["cwd"], request["env"]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise BadRequest("argv is not a list of strings")
    if not isinstance(cwd, str) or not cwd or "\0" in cwd:
        raise BadRequest("cwd is not a path")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v for k, v in env.items()
    ):
        raise BadRequest("env is not an object of strings")
    return request


class _Server:
    """The accept / fork / reap loop (single-threaded: forking is safe).  Every connection's
    bytes are read without blocking and with bounds; whatever they are, only that connection
    is closed."""

    def __init__(
        self,
        path: str,
        watch_pid: int | None,
        idle_timeout: float,
        entry: Callable[[list[str]], int],
        source: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        self.path, self.watch_pid, self.idle_timeout = path, watch_pid, idle_timeout
        self.source = source if source is not None else source_stamp()  # the package as the server imported it
        self.stale: str | None = None  # the first file found changed since: no child is started any more
        self.entry = entry  # the CLI's main, passed in by the CLI (warm imports no CLI: no import circle)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(256)
        self.sock.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.conns: dict[int, _Conn] = {}  # fileno -> connection
        self.children: dict[int, _Conn] = {}  # pid -> its client's connection
        self.kill_at: dict[int, float] = {}  # pid -> when SIGKILL follows (client gone)
        self.term_at: dict[int, float] = {}  # pid -> when SIGTERM follows (client gone; EXIT_GRACE_S)
        self.stop = False
        self.pid = os.getpid()

    def loop(self) -> None:
        last_busy = time.monotonic()
        while not self.stop:
            for key, _ in self.sel.select(timeout=0.2):
                try:
                    self._accept() if key.data is None else self._readable(key.data)
                except Exception as exc:  # noqa: BLE001 - no connection's bytes may stop the server
                    if key.data is not None:
                        self._drop(key.data, f"{type(exc).__name__}: {exc}")
            self._reap()
            now = time.monotonic()
            for conn in [c for c in self.conns.values() if c.state != "running" and now > c.deadline]:
                self._drop(conn, "no request within its time" if conn.state != "go" else None)
            for pid, when in list(self.term_at.items()):
                if now >= when:  # still running after its client left: stop it
                    del self.term_at[pid]
                    _kill_group(pid, signal.SIGTERM)
                    self.kill_at[pid] = now + GRACE_S
            for pid, when in list(self.kill_at.items()):
                if now >= when:
                    _kill_group(pid, signal.SIGKILL)
            if self.children or self.conns:
                last_busy = now
            elif now - last_busy > self.idle_timeout or not _alive(self.watch_pid):
                break

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        conn = _Conn(sock, time.monotonic() + REQUEST_S)
        if peer(sock)[1] != os.getuid():  # only this user's jobs: the request carries an environment
            _log("refused a connection of another user")
            sock.close()
            return
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        if conn.state == "running":
            return self._running(conn)
        try:
            if conn.state == "head":
                data, fds, _flags, _addr = socket.recv_fds(conn.sock, conn.need, 4)
                conn.fds += fds
            else:
                data = conn.sock.recv(conn.need)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            return self._drop(conn, None if conn.state == "go" else "closed before its request was complete")
        conn.buf, conn.need = conn.buf + data, conn.need - len(data)
        if conn.need == 0:
            self._advance(conn)

    def _running(self, conn: _Conn) -> None:
        """Bytes from a client whose child runs are ignored; its end (it died) stops the child."""
        try:
            if conn.sock.recv(64):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self.sel.unregister(conn.sock)
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        # a client leaves also once it has its status from the child, which may not have exited yet:
        # the child is stopped only if it still runs EXIT_GRACE_S later (then SIGKILL GRACE_S after)
        assert conn.pid is not None  # a running connection has its child
        self.term_at[conn.pid] = time.monotonic() + EXIT_GRACE_S

    def _advance(self, conn: _Conn) -> None:
        """A part of the request is complete: the next part, the ready answer, or the child."""
        if conn.state == "head":
            size = int.from_bytes(conn.buf, "big")
            if len(conn.fds) != 4 or not 0 < size <= MAX_REQUEST:
                raise BadRequest(f"a head announcing {size} bytes with {len(conn.fds)} descriptors")
            conn.state, conn.buf, conn.need = "body", b"", size
        elif conn.state == "body":
            try:
                conn.request = check_request(json.loads(conn.buf))
            except (ValueError, RecursionError) as exc:
                raise BadRequest(str(exc).splitlines()[0][:200]) from None
            if self._source_changed():
                conn.request = None  # not started, and not a client that gave up: nothing more to log
                return self._drop(conn, None)  # its client, seeing the connection closed, runs it itself
            conn.state, conn.buf, conn.need = "go", b"", 1
            conn.deadline = time.monotonic() + GO_S
            try:
                conn.sock.send(READY)
            except OSError:  # the client gave up waiting and closed its end
                self._drop(conn, None)
        elif conn.buf != GO:
            raise BadRequest("no go-ahead")
        else:
            self._fork(conn)

    def _source_changed(self) -> bool:
        """Whether a file of the package changed since the server imported it (said once, in the log)."""
        if self.stale is None:
            self.stale = changed_file(self.source, source_stamp())
            if self.stale is not None:
                _log(
                    f"the package's source changed since this server imported it ({self.stale}): "
                    "every command from now on runs in a process of its own"
                )
        return self.stale is not None

    def _drop(self, conn: _Conn, why: str | None) -> None:
        """Close a connection whose command is not started (``why`` None: its client gave up)."""
        if conn.request is not None and why is None:
            _log(f"a client gave up waiting before its command started: not started ({_what(conn.request)})")
        elif why:
            _log(f"closed a connection: {why}")
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(conn.sock.fileno(), None)
        conn.close()

    def _fork(self, conn: _Conn) -> None:
        assert conn.request is not None  # read before the go-ahead
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn)  # never returns
        try:
            os.setpgid(pid, pid)  # as the child does: a signal forwarded at once reaches its group
        except OSError:
            pass
        for fd in conn.fds:
            os.close(fd)
        conn.fds, conn.state, conn.pid, conn.started = [], "running", pid, time.monotonic()
        self.children[pid] = conn
        _log(f"child {pid} started: {_what(conn.request)}")
        _send_quietly(conn.sock, pid.to_bytes(4, "big"))  # started: the client now waits for the status

    def _child(self, conn: _Conn) -> None:
        code, status_w = 1, conn.fds[3]
        try:
            _die_with_parent(self.pid)
            self.sel.close()
            self.sock.close()
            for other in self.conns.values():
                if other is not conn:
                    other.close()
            conn.sock.close()
            os.setpgid(0, 0)
            for target, fd in enumerate(conn.fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            os.set_inheritable(status_w, False)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            assert conn.request is not None  # read before the go-ahead
            code = exit_status(_run_request(self.entry, conn.request))
        except SystemExit as exc:
            code = exit_status(exc.code)
        except KeyboardInterrupt:  # a process dies of the SIGINT then: 128 + 2
            traceback.print_exc()
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 - the child reports and exits like a process would
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            try:
                os.write(status_w, code.to_bytes(4, "big", signed=True))
            except OSError:  # the client is gone
                pass
            os._exit(code)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            conn = self.children.pop(pid, None)
            self.kill_at.pop(pid, None)
            self.term_at.pop(pid, None)
            if conn is None:
                continue
            assert conn.request is not None  # _fork had it
            _log(f"child {pid} exited {code} after {time.monotonic() - conn.started:.1f} s: {_what(conn.request)}")
            _send_quietly(conn.sock, (code if code >= 0 else 128 - code).to_bytes(4, "big", signed=True))
            if conn.sock.fileno() >= 0 and self.conns.pop(conn.sock.fileno(), None) is not None:
                self.sel.unregister(conn.sock)
            conn.close()

    def close(self) -> None:
        deadline = time.monotonic() + EXIT_GRACE_S  # children that have reported are exiting: let them
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        for pid in list(self.children):
            _kill_group(pid, signal.SIGTERM)
        for conn in list(self.conns.values()):
            conn.close()
        self.sel.close()
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)
        if Path(self.path).parent.name.startswith(FOLDER_PREFIX):
            try:
                Path(self.path).parent.rmdir()
            except OSError:
                pass


def exit_status(value) -> int:
    """The exit status of a process that ends with ``sys.exit(value)`` (what the CLI's
    ``main`` returns goes there): None 0, an integer modulo 256, anything else printed, 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except Exception:  # noqa: BLE001 - as the interpreter: the status is 1 whatever the message
        pass
    return 1


def _run_request(entry: Callable[[list[str]], int], request: dict) -> int:
    """In the child: the job's folder, environment and arguments, then the command."""
    try:
        os.chdir(request["cwd"])
    except OSError as exc:
        print(f"smallbatch: error: cannot enter the job's folder {request['cwd']}: {exc.strerror}", file=sys.stderr)
        return 2
    os.environ.clear()
    os.environ.update({k: v for k, v in request["env"].items() if k != ENV})
    apply_thread_env(os.environ)
    sys.argv = list(request["argv"])
    return entry(sys.argv[1:])


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.send(data)
    except OSError:
        pass


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the server dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so
    a SIGKILLed server leaves no orphan training on; a child whose server is already gone
    exits at once.  Elsewhere a no-op."""
    import ctypes  # the server's children only: every job's client imports this module
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
    module, _, function = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    if function:
        getattr(mod, function)()


def source_stamp(root: Path | None = None) -> dict[str, tuple[int, int]]:
    """(modification time in ns, size) of every file of the smallbatch package (``root``: its
    folder), its code and its resources, by path inside it; caches (``__pycache__``) left out."""
    root = root or Path(__file__).resolve().parents[1]
    stamp = {}
    for path in root.rglob("*"):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        st = path.stat()
        stamp[path.relative_to(root).as_posix()] = (st.st_mtime_ns, st.st_size)
    return stamp


def changed_file(before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> str | None:
    """The first file (by path) added, removed or changed between two stamps, or None."""
    return next((name for name in sorted(before.keys() | now.keys()) if before.get(name) != now.get(name)), None)


def serve_problem(path: str, watch_pid: int | None, idle_timeout: float) -> str | None:
    """Why the server could not serve as asked, one line naming the flag, or None: something
    already at the socket's path (bind would fail with "Address already in use"), a folder for
    it that does not exist, a watched process that has already ended (the server would stop at
    once without a word), an idle timeout that is not a positive number of seconds."""
    kind = path_kind(path)
    if kind is not None:
        return (
            f"--socket {path} exists ({kind}); the server makes its own socket there: remove it or choose another path"
        )
    if not Path(path).parent.is_dir():
        return f"--socket {path}: its folder {Path(path).parent} does not exist; create it or choose another path"
    if watch_pid is not None and not _alive(watch_pid):
        return f"--watch-pid {watch_pid}: no such process (it has ended); give the PID of the running process to watch"
    if not (idle_timeout > 0 and math.isfinite(idle_timeout)):
        return f"--idle-timeout must be a positive number of seconds, not {idle_timeout:g}"
    return None


def serve(
    path: str, entry: Callable[[list[str]], int], watch_pid: int | None = None, idle_timeout: float = 3600.0
) -> int:
    """Import :data:`PRELOAD`, then serve on ``path`` until SIGTERM/SIGINT, ``watch_pid`` ends,
    or no command ran for ``idle_timeout`` seconds; each request runs ``entry(argv)`` (the
    CLI's ``main``) in a child.  Until the socket exists the jobs run as processes of their own."""
    problem = serve_problem(path, watch_pid, idle_timeout)
    if problem:  # before the preload (seconds of imports), not after it
        raise ValueError(problem)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_a: stop.append(1))
    source = source_stamp()  # before the imports: a file changed while they ran counts as changed
    for name in PRELOAD:
        if stop or not _alive(watch_pid):
            return 0
        _import(name)
    _log(f"preloaded {', '.join(PRELOAD)}")
    server = _Server(path, watch_pid, idle_timeout, entry, source)

    def _stop(*_a) -> None:
        server.stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        print(f"warm-start server {os.getpid()} ready on {path}", flush=True)
        server.loop()
    finally:
        server.close()
    return 0


# --------------------------------------------------------------------------- workflow hooks
def start(log: str | Path, threads: int) -> subprocess.Popen:
    """Start a server for this process's jobs (Snakemake's ``onstart``) and point them at it
    (``SMALLBATCH_WARM`` in this process's environment, which the jobs inherit); the jobs that
    start before it is ready run as processes of their own.  A log that is a link, a FIFO or a
    hard link is refused first (ValueError naming it, :func:`smallbatch.io.open_log`), nothing started."""
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
    os.environ[ENV] = path
    return proc


def stop(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """Stop a server :func:`start` returned (Snakemake's ``onsuccess`` / ``onerror``)."""
    path = os.environ.pop(ENV, None)
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if path and Path(path).parent.name.startswith(FOLDER_PREFIX):  # a server stopped before it bound
        Path(path).unlink(missing_ok=True)
        try:
            Path(path).parent.rmdir()
        except OSError:
            pass
