"""A slow store is not a dead store, and an interrupted store creation is not a dead end.

Real servers and real processes, no mock of MLflow: ``smallbatch init-store`` (MLflow's own
HTTP client) against a real ``mlflow server`` behind a proxy that holds its answer back (a busy
shared server), a stdlib HTTP server that trickles its answer a byte at a time or answers an
HTTP error, and a port nothing listens on; and a real ``init-store`` of a SQLite store killed
(SIGKILL) while MLflow's migrations run, at random points.
"""

from __future__ import annotations

import http.client
import http.server
import os
import random
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cluster
import pytest

pytestmark = pytest.mark.slow  # servers, and processes killed mid-write (pyproject: markers)

SMALLBATCH = Path(sys.executable).with_name("smallbatch")
HANG_GUARD_S = 150  # a request the deadline does not end would block far longer than this
BUSY_S = 6.0  # a busy server's first answer: more than the 5-s read timeout that used to fail it


def init_store(uri: str, env: dict | None = None, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_HTTP_", "SMALLBATCH_STORE"))}
    return subprocess.run(
        [str(SMALLBATCH), "init-store", "--tracking-uri", uri, "--experiment", "study"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environment, **(env or {})},
    )


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("smallbatch: error:") or "Traceback" in ln]


# --------------------------------------------------------------------------- servers
class _Server:
    """A ThreadingHTTPServer on 127.0.0.1 answering every request with ``answer(handler)``;
    ``stop`` is set when it closes."""

    def __init__(self, answer: Callable[[http.server.BaseHTTPRequestHandler], None], stop: threading.Event):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                answer(self)

            do_GET = do_POST = do_PATCH = do_DELETE = _any

        self.stop = stop
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _body(handler) -> bytes:
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


def trickling(stop: threading.Event) -> Callable:
    """200 and headers at once, then the body a byte a second, never finished: every read of
    the client gets a byte well within any per-read timeout."""

    def answer(h):
        _body(h)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "100000")
        h.end_headers()
        try:
            while not stop.wait(1.0):
                h.wfile.write(b" ")
                h.wfile.flush()
        except OSError:  # the client gave up
            pass

    return answer


def failing(code: int) -> Callable:
    def answer(h):
        _body(h)
        h.send_response(code)
        h.send_header("Content-Length", "4")
        h.end_headers()
        h.wfile.write(b"busy")

    return answer


def held_back(upstream: str, first_s: float) -> Callable:
    """A proxy to ``upstream`` that holds its first answer back ``first_s`` seconds (a server busy
    with other studies' requests), then passes every answer on as it came."""
    host, port = upstream.removeprefix("http://").split(":")
    first = threading.Lock()

    def answer(h):
        body = _body(h)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(h.command, h.path, body=body or None, headers=headers)
        res = conn.getresponse()
        data = res.read()
        if first.acquire(blocking=False):
            threading.Event().wait(first_s)  # the busy server's delay (the fault injected)
        h.send_response(res.status)
        for k, v in res.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
        conn.close()

    return answer


# --------------------------------------------------------------------------- the table
@dataclass
class Case:
    name: str
    serve: str  # "busy" | "trickle" | "503" | "nothing"
    env: dict
    rc: int
    line: str | None  # the one error line's end (a regex), None when the step succeeds


CASES = [
    Case("a busy server that answers after more than 5 s", "busy", {}, 0, None),
    Case(
        "a store that trickles its answer",
        "trickle",
        {"SMALLBATCH_STORE_TIMEOUT": "8"},
        2,
        r"failed while opening experiment 'study': no whole answer within 8 s \(a stalled or overloaded server; "
        r"\$SMALLBATCH_STORE_TIMEOUT sets the deadline\)",
    ),
    Case(
        "a server that answers HTTP 503",
        "503",
        {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"},
        2,
        r"failed while opening experiment 'study': HTTP error 503 \(up to 2 tries\)",
    ),
    Case(
        "nothing listening",
        "nothing",
        {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"},
        2,
        r"failed while opening experiment 'study': nothing is listening there \(connection refused, 2 tries\)",
    ),
]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with cluster.MlflowServer(tmp_path_factory.mktemp("busy_server")) as s:
        yield s


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_store_request_ends_in_one_line_saying_why_or_succeeds(case, request):
    stop, upstream = threading.Event(), None
    if case.serve == "busy":
        upstream = request.getfixturevalue("mlflow_server")
        server = _Server(held_back(upstream.uri, BUSY_S), stop)
    elif case.serve in ("trickle", "503"):
        server = _Server(trickling(stop) if case.serve == "trickle" else failing(int(case.serve)), stop)
    else:
        server = None
    uri = server.uri if server else f"http://127.0.0.1:{cluster.free_port()}"
    try:
        res = init_store(uri, case.env)
    finally:
        if server:
            server.close()
    assert res.returncode == case.rc, res.stderr[-2000:]
    if case.line is None:
        from smallbatch.tracking import StoreReader

        assert StoreReader(upstream.uri).experiment("study")[1] == "study"
        return
    lines = error_lines(res)
    assert len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"smallbatch: error: MLflow tracking store {uri} "), lines[0]
    assert re.search(case.line + "$", lines[0]), lines[0]


# --------------------------------------------------------------------------- an interrupted creation
def tables(db: Path) -> set[str]:
    con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
    finally:
        con.close()


@pytest.fixture(scope="module")
def whole_store(tmp_path_factory) -> Path:
    """A store created without interruption: the size and tables a whole one has."""
    db = tmp_path_factory.mktemp("whole") / "mlflow.db"
    res = init_store(f"sqlite:///{db}")
    assert res.returncode == 0, res.stderr[-2000:]
    return db


def kill_when(cmd: list[str], ready: Callable[[], bool], what: str) -> None:
    """Start ``cmd`` and SIGKILL it once ``ready()`` (while MLflow's migrations run)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def now() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the store was created whole (exit {proc.returncode}) before {what}")
        return ready()

    try:
        cluster.wait_until(now, 120, what, interval=0.002)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def grown(folder: Path, size: int) -> Callable[[], bool]:
    """A file of the store under construction in ``folder`` (``mlflow.db`` or one beside it) holds ``size`` bytes."""

    def size_of(f: Path) -> int:
        try:  # the creator renames and deletes its journal and temporary files while this looks
            st = f.stat()
            return st.st_size if stat.S_ISREG(st.st_mode) else 0
        except FileNotFoundError:
            return 0

    return lambda: any(size_of(f) >= size for f in folder.glob("mlflow.db*"))


def has_table(db: Path, name: str) -> Callable[[], bool]:
    """A reader of ``db`` sees the table ``name`` (committed by the migration that creates it)."""

    def ready() -> bool:
        try:
            return name in tables(db)
        except sqlite3.Error:  # not there yet, or locked by the writer
            return False

    return ready


KILL_POINTS = [random.Random(seed).uniform(0.02, 0.9) for seed in (1, 2)]


@pytest.mark.parametrize("fraction", KILL_POINTS, ids=[f"at {f:.0%} of the store" for f in KILL_POINTS])
def test_a_store_creation_killed_at_any_point_is_completed_by_the_next_run(tmp_path, whole_store, fraction):
    db = tmp_path / "mlflow.db"
    cmd = [str(SMALLBATCH), "init-store", "--tracking-uri", f"sqlite:///{db}", "--experiment", "study"]
    size = int(fraction * whole_store.stat().st_size)
    kill_when(cmd, grown(tmp_path, size), f"a store file of {size} bytes")
    assert not db.exists() or tables(db) == tables(whole_store), "a half-built store at the store's own path"
    res = init_store(f"sqlite:///{db}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert tables(db) == tables(whole_store)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["mlflow.db"], "a leftover of the killed creation"


BUILD_IN_PLACE = (  # how a store used to be created: MLflow's migrations in the store's own file
    "import sys; from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore; "
    "SqlAlchemyStore('sqlite:///' + sys.argv[1], 'mlflow-artifacts:/')"
)


def test_a_store_half_built_in_place_is_refused_in_one_line_that_says_how_to_recover(tmp_path, whole_store):
    """A store whose creation or migration was killed in its own file (as stores used to be
    made, and as MLflow migrates an older store) after a migration's tables were written but
    before its version was: every later start of MLflow fails on it ("table webhooks already
    exists", "duplicate column name").  The kill falls as the table ``webhooks`` is committed;
    as that window is milliseconds wide, the store's version row is then removed, as a kill
    before the first version was recorded leaves it.  The next step says in one line how to
    recover; doing what it says completes the store."""
    db = tmp_path / "mlflow.db"
    kill_when([sys.executable, "-c", BUILD_IN_PLACE, str(db)], has_table(db, "webhooks"), "the table webhooks")
    con = sqlite3.connect(db)
    con.execute("delete from alembic_version")
    con.commit()
    con.close()
    res = init_store(f"sqlite:///{db}")
    lines = error_lines(res)
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    n = len(tables(db) & tables(whole_store) - {"alembic_version"})
    m = re.fullmatch(
        re.escape(
            f"smallbatch: error: MLflow store {db} is half-built: {n} of MLflow's {len(tables(whole_store)) - 1} "
            "tables (MLflow's creation or migration of it was interrupted), with no runs: delete it"
        )
        + r"(?: \(and ([^ ]+) beside it\))?"
        + re.escape(" and run again (the store is then created whole)"),
        lines[0],
    )
    assert m, lines[0]
    for name in [db.name, *(m.group(1) or "").split(", ")]:
        if name:
            (tmp_path / name).unlink()
    res = init_store(f"sqlite:///{db}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert tables(db) == tables(whole_store)
