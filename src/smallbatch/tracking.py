"""The one module that talks to MLflow.

One experiment per study, one run per cell.  A run is found again by its cell
id and config hash (tags ``smallbatch.cell_id`` / ``smallbatch.cell_hash``), so
a re-run of an unfinished cell resumes the same run and never duplicates it;
a changed config (new hash) is a new run, and so is a pretraining rerun of a
finished cell (a finished run is never flipped back to RUNNING).  A new run carries
MLflow's own source tags (the command, LOCAL, the user, the git commit when the package runs
from a checkout) beside the package's versions (:func:`source_tags`).

One trainer per cell per store: a pretraining leases its run (tag
``smallbatch.lease``: its folder, host and PID, renewed as it logs) and a trainer
writing into another folder is refused in one line while that lease is live
(the folder's own lock, :class:`smallbatch.io.CellLock`, keeps two trainers of one
folder apart).  A cell that fails once its run is open ends it FAILED with the
error's first line as ``smallbatch.error``.

Metrics are buffered and written with ``log_batch`` (one call costs about the
same as one ``log_metric``: ~7 ms on SQLite, ~55 ms over HTTP).  After a resume
the steps that were already logged are skipped, so a metric history has exactly
one value per step even when a job was killed between logging and checkpointing.

Concurrency: several processes creating a *fresh* SQLite store at once race on
its schema; ``init_store`` is therefore run once (the workflow's ``init_store``
rule) before any job logs.  It builds a new store in a file beside it and links
it into place once whole, so a killed creation never leaves a half-built store.

An HTTP store (``mlflow server``) may be slow -- a shared server busy with other
studies -- but not silent: every request must be answered whole within one
deadline, ``$SMALLBATCH_STORE_TIMEOUT`` seconds (60), MLflow's own tries and
backoff included; a step whose request is not ends in one line saying which way
it failed: no whole answer within the deadline, nothing listening, or HTTP error N.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

TAG_CELL = "smallbatch.cell_id"
TAG_HASH = "smallbatch.cell_hash"
TAG_KIND = "smallbatch.kind"
TAG_STATUS = "smallbatch.status"
TAG_EXPERIMENT = "smallbatch.experiment"
TAG_BASELINE = "smallbatch.baseline"
TAG_COMMIT = "smallbatch.git_commit"
TAG_GIT_DIRTY = "smallbatch.git_dirty"  # "true" when the checkout the run's code came from had changes
TAG_PYTHON, TAG_PLATFORM = "smallbatch.python", "smallbatch.platform"
TAG_PRETRAIN = "smallbatch.pretrain"  # how pretraining ended: finished | diverged | collapsed
#: one writer per cell per store: the trainer that logs into a cell's run (JSON: folder, host, pid,
#: when renewed); another folder's trainer is refused while it is live (see CellRun.take_lease)
TAG_LEASE = "smallbatch.lease"
TAG_ERROR = "smallbatch.error"  # why a failed run failed (its first line)
#: the unit of a run's accuracies (every metric whose name holds top1 or top5), recorded when
#: the run is made: the pipeline logs percent; the report reads a run by its tag, never by its values
TAG_ACCURACY_UNIT = "smallbatch.accuracy_unit"
ACCURACY_UNIT = "percent"
LEASE_S = 120.0  # a lease of another host not renewed for this long is stale (its trainer is gone)
#: a cell's outcome (tag TAG_STATUS): running until both probes are logged; the bad
#: outcomes are results the report shows beside the numbers, never drops
STATUS_RUNNING, STATUS_FINISHED = "running", "finished"
BAD_STATUSES = ("diverged", "collapsed", "failed")


class TrackingError(RuntimeError):
    """The tracking store could not be reached or used; one line, names the URI."""


#: the one setting of how long an HTTP tracking store may take: every request (MLflow's own
#: tries and their backoff included) must be answered whole within this many seconds, or the step
#: fails in one line.  A busy shared server answers well within it; a silent one, or one that
#: trickles its answer a byte at a time, ends the step once it has passed.
DEADLINE_ENV = "SMALLBATCH_STORE_TIMEOUT"
DEADLINE_S = 60.0
#: MLflow's own knobs (mlflow.environment_variables), each kept when the user set it: a request
#: that could not connect or got HTTP 408/429/5xx is tried 4 times (again at once, then 2 and 4 s
#: later: urllib3's backoff), within the deadline
MLFLOW_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}
#: MLflow's per-read timeout (it bounds each read, not the request): the deadline's, unless the user set one
_READ_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_OWN_READ_TIMEOUT: list[str] = []  # the value this process set, if it set one


def store_deadline() -> float:
    """The deadline of one request to an HTTP store, in seconds (:data:`DEADLINE_ENV`)."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return DEADLINE_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < 1e6):
        raise TrackingError(f"${DEADLINE_ENV} = {text!r}: give the seconds a tracking request may take (e.g. 60)")
    return value


def _mlflow():
    for key, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.environ.get(_READ_TIMEOUT) in (None, *_OWN_READ_TIMEOUT):  # never shorter than the deadline
        _OWN_READ_TIMEOUT[:] = [str(math.ceil(store_deadline()))]
        os.environ[_READ_TIMEOUT] = _OWN_READ_TIMEOUT[0]
    import mlflow  # noqa: F401  (heavy: ~1.5 s)
    from mlflow.tracking import MlflowClient

    return mlflow, MlflowClient


class _TooSlow(BaseException):
    """Raised by the deadline's alarm inside a request (a BaseException: MLflow and urllib3
    catch Exception around their tries, and must not retry past the deadline)."""


class StoreTooSlow(Exception):
    """A request to an HTTP store had no whole answer within the deadline."""


def _http(uri: str) -> bool:
    return uri.split(":", 1)[0].lower() in ("http", "https")


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise :class:`StoreTooSlow` when the block has not ended within ``seconds`` (a real-time
    alarm: it interrupts a socket read that trickles as well as one that waits).  Only in the
    main thread and when no other alarm is set; elsewhere MLflow's per-read timeout alone bounds it."""
    free = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )
    if not free:
        yield
        return

    def alarm(_signum, _frame):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _TooSlow:
        raise StoreTooSlow(
            f"no whole answer within {seconds:g} s (a stalled or overloaded server; ${DEADLINE_ENV} sets the deadline)"
        ) from None
    finally:
        signal.signal(signal.SIGALRM, previous)


class _BoundedClient:
    """An MlflowClient of an HTTP store whose every call ends within :func:`store_deadline`."""

    def __init__(self, client, seconds: float):
        self._client, self._seconds = client, seconds

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def bounded(*args, **kwargs):
            with _deadline(self._seconds):
                return attr(*args, **kwargs)

        return bounded


def _open_client(uri: str):
    """MLflow's client of ``uri``; an HTTP store's calls bounded by the deadline."""
    _, MlflowClient = _mlflow()
    client = MlflowClient(tracking_uri=uri)
    return _BoundedClient(client, store_deadline()) if _http(uri) else client


#: URI schemes MLflow 3.17 has a tracking store for (mlflow.tracking._tracking_service.utils;
#: SQLAlchemy's may name a driver: postgresql+psycopg2); plugins add theirs as entry points
TRACKING_SCHEMES = (
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "http",
    "https",
    "file",
    "databricks",
    "databricks-uc",
    "uc",
)


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use ``uri`` as its tracking store (one phrase), or None.
    Imports no MLflow, so validating a config stays fast."""
    from importlib.metadata import entry_points
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0].lower()
    if len(scheme) <= 1:  # a local path: MLflow's file store
        return None
    if scheme == "sqlite" and parsed.netloc:
        return "a SQLite URI has three slashes before a relative path, four before an absolute one (sqlite:///results/mlflow.db)"
    if scheme in ("http", "https") and not parsed.netloc:
        return f"no host after {scheme}://"
    if scheme in TRACKING_SCHEMES or scheme in {ep.name for ep in entry_points(group="mlflow.tracking_store")}:
        return None
    return (
        f"MLflow has no tracking store for the scheme '{scheme}'; use sqlite:///PATH, http(s)://HOST:PORT, "
        "postgresql://, mysql://, mssql:// or databricks"
    )


def _client(uri: str):
    problem = tracking_uri_problem(uri)
    if problem:
        raise TrackingError(f"MLflow tracking store {uri}: {problem}")
    try:
        # MLflow logs a failed SQL statement with its whole traceback before raising; the
        # user gets the error's root cause as one line instead (_wrap)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:///file:"):  # not a SQLite URI filename
            Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        return _open_client(uri)
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
        raise _wrap(uri, "opening the store", exc) from None


def _root_cause(exc: BaseException) -> BaseException:
    """The error that says what went wrong: the database's own (SQLAlchemy carries sqlite3's
    "attempt to write a readonly database" as ``orig``, under MLflow's error raised from it)
    or the deepest OS error of the chain (connection refused, disk full); else ``exc``."""
    found, seen = exc, set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        orig = getattr(cur, "orig", None)
        if isinstance(orig, BaseException):
            return orig
        if isinstance(cur, OSError):
            found = cur
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return found


def _chain(exc: BaseException | None):
    """``exc`` and every exception it was raised from or during (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _http_failure(exc: BaseException) -> str | None:
    """Which way a request to an HTTP store failed, in words: too slow (the deadline), nothing
    listening (no connection after MLflow's tries), or the server's HTTP error; None otherwise."""
    import re

    from mlflow.exceptions import RestException

    n = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0") or 0) + 1
    tries = "1 try" if n == 1 else f"{n} tries"
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, StoreTooSlow):
            return str(e)
        if isinstance(e, ConnectionRefusedError):
            return f"nothing is listening there (connection refused, {tries})"
        if m := re.search(r"too many (\d{3}) error responses", str(e)):
            return f"HTTP error {m.group(1)} ({tries})"
        if m := re.search(r"failed with error code (\d{3}) != 200", str(e)):
            return f"HTTP error {m.group(1)}"
    for e in chain:
        if isinstance(e, RestException):  # the server's own error, as JSON
            return f"HTTP error {e.get_http_status_code()} ({e.error_code}: {_first_line(e.message)})"
    return None


def _first_line(exc: object) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _wrap(uri: str, what: str, exc: Exception) -> TrackingError:
    db = _sqlite_path(uri) if _sqlite_file(uri) is not None else None
    try:
        problem = half_built(db) if db is not None and db.is_file() else None
    except Exception:  # noqa: BLE001 - no MLflow to compare with: the error itself says it
        problem = None
    if problem:
        return TrackingError(problem)
    msg = (_http_failure(exc) if _http(uri) else None) or _first_line(_root_cause(exc))
    return TrackingError(f"MLflow tracking store {uri} failed while {what}: {msg}")


#: where a SQLite store's artifacts live: this folder beside the database file.  A new experiment's
#: artifact root is MLflow's proxied ``mlflow-artifacts:/<id>`` (what ``mlflow server`` gives one),
#: never an absolute path: the tracking module resolves it against the store's own folder, and
#: ``mlflow ui`` run in that folder serves it (its default ``--artifacts-destination`` is
#: ``./mlartifacts``), so a moved or copied study folder still browses its artifacts
ARTIFACTS_DIR = "mlartifacts"
PROXIED_ROOT = "mlflow-artifacts:/"
TAG_NOTE = "mlflow.note.content"  # the experiment's (and a run's) description in MLflow's UI
TAG_PARENT = "mlflow.parentRunId"  # a nested run: the MLflow UI shows it under its parent
#: runs that hold no result: the report's own runs, and the parents grouping a side experiment's rows
KIND_REPORT, KIND_PARENT = "report", "parent"
NON_RESULT_KINDS = (KIND_REPORT, KIND_PARENT)


def artifacts_root(uri: str) -> Path | None:
    """A SQLite store's artifact folder (beside the database, as its URI names it), else None."""
    db = _sqlite_file(uri)
    return None if db is None else Path(str(db).split("?", 1)[0]).parent / ARTIFACTS_DIR


def describe_study(experiment: str, config: str | None = None) -> str:
    """The experiment's description (tag ``mlflow.note.content``): the study, its config, what a run is."""
    cfg = f" from the config `{config}`" if config else ""
    return (
        f"smallbatch study **{experiment}**{cfg}: one run per cell (run name = cell id; tags "
        f"`{TAG_CELL}`, `{TAG_HASH}`, `{TAG_KIND}` = cell | baseline | mi | {KIND_PARENT} | {KIND_REPORT}). "
        "A cell's artifacts: its resolved config (`cell.json`), its evaluation (`knn.json`, `linear.json`, "
        "`representation.json`), "
        "its backbone when `tracking.log_checkpoint` is on. The side experiments' rows are nested under a "
        f"parent run; the report is a run of kind `{KIND_REPORT}` with its tables and figures. Training "
        "curves: x-axis `train/images_seen` or `epoch` compares batch sizes (the step is the optimiser's). "
        f"Browse: `mlflow ui --backend-store-uri sqlite:///mlflow.db` in the folder holding the store "
        f"(its artifacts are `./{ARTIFACTS_DIR}`); in Python: `smallbatch.tracking.artifact_path(uri, run_id)`."
    )


def _create_experiment(client, uri: str, experiment: str, note: str) -> str:
    from mlflow.entities import ExperimentTag

    tags = [ExperimentTag(TAG_NOTE, note)]
    if _sqlite_file(uri) is None:  # a server or another store: its own artifact root
        return client.create_experiment(experiment, tags={TAG_NOTE: note})
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    # the store's default root, not an explicit location: MLflow makes an explicit one absolute
    return SqlAlchemyStore(uri, PROXIED_ROOT).create_experiment(experiment, tags=tags)


def get_or_create_experiment(uri: str, experiment: str, note: str | None = None) -> str:
    client = _client(uri)
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            if note and exp.tags.get(TAG_NOTE) != note:
                client.set_experiment_tag(exp.experiment_id, TAG_NOTE, note)
            return exp.experiment_id
        try:
            return _create_experiment(client, uri, experiment, note or describe_study(experiment))
        except Exception:
            exp = client.get_experiment_by_name(experiment)  # created by a parallel job
            if exp is None:
                raise
            return exp.experiment_id
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
        raise _wrap(uri, f"opening experiment '{experiment}'", exc) from None


def init_store(uri: str, experiment: str, config: str | None = None) -> str:
    """Create the store's schema and the study's experiment (described: :func:`describe_study`)
    once; return its id.  A new SQLite store comes into existence whole (:func:`_build_sqlite_store`)
    with the proxied artifact root, so even MLflow's own 'Default' experiment names no absolute
    folder (the creator's ./mlruns).  An existing one MLflow cannot complete (half-built by an
    interrupted creation or migration) fails in one line saying how to recover (:func:`_wrap`)."""
    db = _sqlite_file(uri)
    if db is not None and not uri.startswith("sqlite:///file:") and not tracking_uri_problem(uri):
        path = _sqlite_path(uri)
        _remove_dead_builds(path)
        if not path.exists():
            try:
                _build_sqlite_store(uri, path)
            except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
                raise _wrap(uri, "creating the store", exc) from None
    return get_or_create_experiment(uri, experiment, describe_study(experiment, config))


#: the file a new SQLite store is built in, beside it: <name>.tmp-<host>-<pid>
_BUILD_SUFFIX = ".tmp-"


def _build_sqlite_store(uri: str, path: Path) -> None:
    """MLflow's migrations (65 tables, seconds) run in a file beside ``path``, which is linked
    into place once whole: a step killed half-way leaves only that file (removed by the next
    build, once its process is gone), never a half-built store at ``path``.  A store another
    process put at ``path`` meanwhile is kept (a link never replaces a file)."""
    import socket

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{_BUILD_SUFFIX}{socket.gethostname()}-{os.getpid()}")
    query = uri.split("?", 1)[1] if "?" in uri else ""
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}" + (f"?{query}" if query else ""), PROXIED_ROOT)
        store.engine.dispose()
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process created it meanwhile: theirs stays
            pass
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
    finally:
        for leftover in _sqlite_files(tmp):
            leftover.unlink(missing_ok=True)


def _sqlite_files(db: Path) -> list[Path]:
    """A SQLite database file and the files SQLite keeps beside it."""
    return [db, *(db.with_name(db.name + s) for s in ("-journal", "-wal", "-shm"))]


def _remove_dead_builds(path: Path) -> None:
    """The build files beside ``path`` of this host's processes that are gone (a creation killed
    half-way, or between linking the store into place and removing its build file)."""
    import socket

    prefix = f"{path.name}{_BUILD_SUFFIX}{socket.gethostname()}-"
    for f in path.parent.glob(f"{glob.escape(prefix)}*"):
        pid = f.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or f.name[len(prefix) + len(pid) :] not in ("", "-journal", "-wal", "-shm"):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            f.unlink(missing_ok=True)
        except (PermissionError, OverflowError):
            pass


def half_built(path: Path) -> str | None:
    """One line when the SQLite file ``path`` holds some of MLflow's tables but not all (a
    creation or migration interrupted where MLflow cannot take it up again: its migrations
    fail on it forever, "table ... already exists"), saying how to recover; None for a whole
    store, an empty file or another kind of file (MLflow's own checks name those).  Asked
    once MLflow failed on the store (:func:`_wrap`)."""
    import sqlite3

    from mlflow.store.db.utils import Base  # every table of MLflow's schema (its ORM's)

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
            runs = con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0
        finally:
            con.close()
    except sqlite3.Error:
        return None
    expected = set(Base.metadata.tables)
    present = tables & expected
    if not present or expected <= tables:
        return None
    what = (
        f"MLflow store {path} is half-built: {len(present)} of MLflow's {len(expected)} tables (MLflow's "
        "creation or migration of it was interrupted)"
    )
    if runs:
        return f"{what}, with {runs} runs: restore it from a backup, or move it aside to start a new store"
    beside = [f.name for f in _sqlite_files(path)[1:] if f.exists()]
    also = f" (and {', '.join(beside)} beside it)" if beside else ""
    return f"{what}, with no runs: delete it{also} and run again (the store is then created whole)"


def local_artifacts(uri: str, artifact_uri: str):
    """The artifact repository of a run whose root is proxied (``mlflow-artifacts:/...``) in a
    SQLite store: the folder :func:`artifacts_root` holds, wherever the study folder now is;
    None for any other root (MLflow's client resolves it)."""
    from urllib.parse import urlparse

    root = artifacts_root(uri)
    if root is None or not artifact_uri.startswith("mlflow-artifacts:"):
        return None
    rel = Path(urlparse(artifact_uri).path.lstrip("/"))
    if not rel.parts or ".." in rel.parts or rel.is_absolute():
        raise TrackingError(f"MLflow store {uri}: artifact root {artifact_uri!r} is not a path inside {root}")
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    return LocalArtifactRepository(str((root / rel).resolve()))


def artifact_path(uri: str, run_id: str) -> Path:
    """The local folder holding a run's artifacts, wherever the study folder now is: a SQLite
    store's proxied root (:func:`local_artifacts`) or a ``file:`` one (a store made before).
    MLflow's own client cannot read a proxied root through a ``sqlite:`` URI (it asks an
    ``mlflow server`` for it), and a ``file:`` root MLflow always makes absolute, which a moved
    study folder breaks: so the store keeps the proxied root, and this is how a script reads
    the artifacts without a server (``mlflow ui`` started in the store's folder serves them).
    TrackingError for a run whose artifacts are on a server or another remote store."""
    from urllib.parse import urlparse

    client = _client(uri)
    try:
        root = client.get_run(run_id).info.artifact_uri
    except Exception as exc:  # noqa: BLE001
        raise _wrap(uri, f"reading run {run_id}", exc) from None
    repo = local_artifacts(uri, root)
    if repo is not None:
        return Path(repo.artifact_dir)
    if urlparse(root).scheme in ("", "file"):
        from mlflow.utils.file_utils import local_file_uri_to_path

        return Path(local_file_uri_to_path(root))
    raise TrackingError(
        f"run {run_id}'s artifacts are at {root}, not in a local folder: read them with MLflow's client "
        f"(MlflowClient('{uri}').download_artifacts)"
    )


def _git(*args: str) -> str | None:
    """``git ARGS`` run (no shell) in the package's folder: its output, or None when git is
    missing, fails, or the package's own file is not in that checkout (an installed wheel)."""
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
    except Exception:  # noqa: BLE001 - no git, or none that answers: the run goes on without it
        return None
    return out.stdout if out.returncode == 0 else None


@functools.cache
def git_state() -> tuple[str, bool | None] | None:
    """(commit, its 40 hex digits; whether the checkout has changes: ``git status --porcelain``,
    None when git could not say in time) of the package's checkout, or None outside one (a wheel, even one installed in a checkout's
    virtual environment) or without git; asked once per process (subprocesses: ~10 ms, paid
    by each of the MI step's 150 runs before)."""
    if _git("ls-files", "--error-unmatch", "--", Path(__file__).name) is None:
        return None
    commit = (_git("rev-parse", "HEAD") or "").strip()
    status = _git("status", "--porcelain")
    return (commit, None if status is None else bool(status.strip())) if commit else None


def git_commit() -> str:
    """The package's commit (12 hex digits) or "unknown" (:func:`git_state`)."""
    state = git_state()
    return state[0][:12] if state else "unknown"


#: the command a run is logged by (MLflow's ``mlflow.source.name``): the CLI sets it
#: (:func:`set_source`); a run logged by another program names that program
_SOURCE: list[str] = []


def set_source(command: str) -> None:
    """Name the command (``smallbatch pretrain``) that this process's new runs are logged by."""
    _SOURCE[:] = [command]


def source_tags() -> dict[str, str]:
    """MLflow's own tags of where a new run comes from (the command, LOCAL, the user, the git
    commit in a checkout) and smallbatch's (whether that checkout had changes, Python, platform)."""
    import sys

    from mlflow.utils import mlflow_tags as mt

    command = _SOURCE[0] if _SOURCE else Path(sys.argv[0] or "python").name
    return {mt.MLFLOW_SOURCE_NAME: command, **_machine_tags()}


@functools.cache
def _machine_tags() -> Mapping[str, str]:
    """The source tags that hold for the whole process, read once (read-only: every run shares them)."""
    import getpass
    import platform

    from mlflow.utils import mlflow_tags as mt

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container's bare uid): MLflow's own fallback
        user = "unknown"
    tags = {
        mt.MLFLOW_SOURCE_TYPE: "LOCAL",
        mt.MLFLOW_USER: user,
        TAG_PYTHON: platform.python_version(),
        TAG_PLATFORM: platform.platform(),
    }
    state = git_state()
    if state:
        tags[mt.MLFLOW_GIT_COMMIT] = state[0]
    if state and state[1] is not None:
        tags[TAG_GIT_DIRTY] = str(state[1]).lower()
    return MappingProxyType(tags)


@functools.cache
def _versions() -> Mapping[str, str]:
    """The version tags of a new run, read once per process (~8 ms of package metadata;
    read-only, as every run shares it)."""
    from importlib import metadata

    out = {}
    for pkg in ("smallbatch", "torch", "torchvision", "faiss-cpu", "faiss-gpu", "mlflow", "numpy"):
        try:
            out[f"smallbatch.version.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return MappingProxyType(out)


class RunVanished(TrackingError):
    """A run a cell's state refers to is not in the store (deleted or replaced store)."""


class LeaseHeld(TrackingError):
    """Another folder's live trainer logs into the cell's run (one line: who and where)."""


def _lease_holder(text: str | None) -> dict | None:
    try:
        held = json.loads(text) if text else None
    except ValueError:
        return None
    return held if isinstance(held, dict) and {"folder", "host", "pid", "at"} <= set(held) else None


def _lease_live(held: dict) -> bool:
    """A lease of this host is live while its process is; another host's until LEASE_S after
    its last renewal."""
    import socket

    if held["host"] == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, OverflowError):
            pass
        return True
    return time.time() - float(held["at"]) < LEASE_S


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def _store_identity(uri: str) -> tuple | None:
    """(device, inode) of a SQLite store's file — None for other stores, ("missing",) if gone."""
    path = _sqlite_file(uri)
    if path is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return ("missing",)
    return (st.st_dev, st.st_ino)


class CellRun:
    """An MLflow run bound to one cell; buffered metric logging.

    A SQLite store's file is remembered when the run is opened: if it is deleted or
    replaced while the cell logs (``flush``, ``verify``), the run stops with one line
    instead of logging the rest of a history into a new, empty store."""

    def __init__(self, uri: str, run_id: str, client, resumed: bool, cell_id: str = ""):
        self.uri = uri
        self.run_id = run_id
        self.client = client
        self.resumed = resumed
        self.cell_id = cell_id
        self._store = _store_identity(uri)
        self._buf: list = []
        self._last_flush = time.monotonic()
        self._skip_through: dict[str, int] = {}
        self._lease: dict | None = None
        self._artifact_uri: str | None = None

    # -- one writer per cell per store ---------------------------------------------
    def take_lease(self, folder: str | Path) -> None:
        """Record this process, writing into ``folder``, as the run's one trainer; LeaseHeld
        when a live trainer of another folder holds it (the folder's own lock already keeps
        two trainers of one folder apart; a stale lease is taken over)."""
        import socket

        mine = {"folder": str(Path(folder).resolve()), "host": socket.gethostname(), "pid": os.getpid()}
        held = _lease_holder(self.tags().get(TAG_LEASE))
        if held and held["folder"] != mine["folder"] and _lease_live(held):
            age = time.time() - float(held["at"])
            raise LeaseHeld(
                f"cell {self.cell_id} is being trained into the MLflow store {self.uri} from another "
                f"folder, {held['folder']} (process {held['pid']} on {held['host']}, seen {age:.0f} s "
                "ago); one trainer per cell per store: let it finish, or give this study its own "
                "store or experiment"
            )
        self._lease = mine
        self._renew_lease()

    def _renew_lease(self) -> None:
        assert self._lease is not None  # take_lease set it before the first renewal
        self._lease["at"] = time.time()
        self._lease_renewed = time.monotonic()
        self.set_tags({TAG_LEASE: json.dumps(self._lease, sort_keys=True)})

    def verify(self) -> None:
        """The store is the one the run was opened in and still holds the run."""
        if self._store is not None and _store_identity(self.uri) != self._store:
            raise RunVanished(
                f"the MLflow store {_sqlite_file(self.uri)} was deleted or replaced while cell "
                f"{self.cell_id} was logging to it (run {self.run_id}); its history would be lost"
            )
        if not run_exists(self.client, self.uri, self.run_id):
            raise RunVanished(f"run {self.run_id} of cell {self.cell_id} is no longer in the MLflow store {self.uri}")

    # -- metrics -----------------------------------------------------------------
    def skip_logged_steps(self, keys: list[str]) -> None:
        """After a resume, do not log again the steps already in the store."""
        for key in keys:
            try:
                hist = self.client.get_metric_history(self.run_id, key)
            except Exception as exc:  # noqa: BLE001
                raise _wrap(self.uri, f"reading metric history of {key}", exc) from None
            if hist:
                self._skip_through[key] = max(m.step for m in hist)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is None:
                continue
            if k in self._skip_through and step <= self._skip_through[k]:
                continue
            self._buf.append(Metric(k, float(v), ts, int(step)))
        if len(self._buf) >= 900 or time.monotonic() - self._last_flush > 10:
            self.flush()

    def flush(self) -> None:
        if self._buf and self._store is not None and _store_identity(self.uri) != self._store:
            self.verify()  # raises: the store file was deleted or replaced
        while self._buf:
            chunk, self._buf = self._buf[:1000], self._buf[1000:]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as exc:  # noqa: BLE001
                self._buf = chunk + self._buf
                raise _wrap(self.uri, "logging metrics", exc) from None
        self._last_flush = time.monotonic()
        if self._lease is not None and self._last_flush - self._lease_renewed > LEASE_S / 4:
            self._renew_lease()

    # -- tags / status -----------------------------------------------------------
    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if TAG_PRETRAIN in tags and self._lease is not None:  # pretraining has ended: the lease goes
            tags, self._lease = {**tags, TAG_LEASE: ""}, None

        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except Exception as exc:  # noqa: BLE001
            raise _wrap(self.uri, "setting tags", exc) from None

    def set_status(self, status: str) -> None:
        """status: running | finished | diverged | failed (our tag) + MLflow's run status."""
        self.flush()
        self.set_tags({TAG_STATUS: status})
        mlflow_status = {
            "running": "RUNNING",
            "finished": "FINISHED",
            "diverged": "FINISHED",
            "collapsed": "FINISHED",
            "failed": "FAILED",
            "killed": "KILLED",
        }[status]
        try:
            if mlflow_status == "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                self.client.set_terminated(self.run_id, status=mlflow_status)
        except Exception as exc:  # noqa: BLE001
            raise _wrap(self.uri, "setting run status", exc) from None

    def mark_failed(self, exc: BaseException) -> None:
        """End the run FAILED with the error's first line as the tag ``smallbatch.error`` (a
        cell that failed, in setup or later, is never left RUNNING); quiet when the store
        itself is what failed."""
        from mlflow.entities import RunTag

        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        line = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
        tags = {TAG_STATUS: "failed", TAG_ERROR: line, **({TAG_LEASE: ""} if self._lease is not None else {})}
        self._lease = None
        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self.client.set_terminated(self.run_id, status="FAILED")
        except Exception:  # noqa: BLE001 - keep the original error
            pass

    # -- artifacts ---------------------------------------------------------------
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy the file ``path`` into the run's artifacts (under ``artifact_path``)."""
        try:
            if self._artifact_uri is None:  # asked once per run
                self._artifact_uri = self.client.get_run(self.run_id).info.artifact_uri
            repo = local_artifacts(self.uri, self._artifact_uri)
            if repo is not None:
                repo.log_artifact(str(path), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _wrap(self.uri, f"logging the artifact {Path(path).name}", exc) from None

    def log_dataset(self, name: str, digest: str, source: str, profile: dict[str, Any], context: str) -> None:
        """Record the data set the run read as an MLflow dataset input (the UI's "Dataset"
        column): ``name`` with the ``digest`` of its files, ``source`` where they were read, a
        ``profile`` of sizes and ``context`` (``training``).  Logging it again is a no-op."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = self._data_inputs()
        if any(i.dataset.name == name and i.dataset.digest == digest[:36] for i in inputs):
            return
        ds = Dataset(
            name=name,
            digest=digest[:36],  # MLflow's limit; the cell's hash holds the whole digest
            source_type="local",
            source=json.dumps({"uri": source}),
            profile=json.dumps(profile, sort_keys=True),
        )
        try:
            self.client.log_inputs(self.run_id, [DatasetInput(ds, [InputTag(MLFLOW_DATASET_CONTEXT, context)])])
        except Exception as exc:  # noqa: BLE001
            raise _wrap(self.uri, f"logging the data set {name}", exc) from None

    def _data_inputs(self) -> list:
        inputs = self._run("inputs").inputs
        return list(inputs.dataset_inputs) if inputs is not None else []

    def _data(self, what: str):
        return self._run(what).data

    def _run(self, what: str):
        try:
            return self.client.get_run(self.run_id)
        except Exception as exc:  # noqa: BLE001 - one line naming the store, not a traceback
            raise _wrap(self.uri, f"reading the {what} of run {self.run_id}", exc) from None

    def tags(self) -> dict[str, str]:
        return dict(self._data("tags").tags)

    def metrics(self) -> dict[str, float]:
        return dict(self._data("metrics").metrics)


def _find_runs(client, exp_id: str, cell_id: str, cell_hash: str | None) -> list:
    filt = f"tags.`{TAG_CELL}` = '{cell_id}'"
    if cell_hash:
        filt += f" and tags.`{TAG_HASH}` = '{cell_hash}'"
    return client.search_runs([exp_id], filter_string=filt, max_results=50, order_by=["attributes.start_time DESC"])


def run_exists(client, uri: str, run_id: str) -> bool:
    """Whether the store holds ``run_id`` (a failing store is a TrackingError)."""
    try:
        client.get_run(run_id)
        return True
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
            return False
        raise _wrap(uri, f"reading run {run_id}", exc) from None


def open_cell_run(
    uri: str,
    experiment: str,
    cell,
    kind: str = "cell",
    params: dict[str, str] | None = None,
    run_id: str | None = None,
    fresh: bool = False,
    lease: str | Path | None = None,
    parent: str | None = None,
) -> CellRun:
    """The cell's run: ``run_id`` when given (a resumed state's run; :class:`RunVanished`
    if the store lacks it), else the newest unfinished run of the same id and hash, else a
    new one (a pretraining never reopens a finished run: a rerun of a finished cell is a new run);
    ``fresh`` always creates a new run (a restarted cell: its history starts again).
    ``lease``: the folder a trainer writes into; the run is leased to it
    (:meth:`CellRun.take_lease`: :class:`LeaseHeld` when another folder's trainer holds it).
    ``parent``: the run id this one is nested under (tag ``mlflow.parentRunId``).
    ``cell``: what :func:`run_key` reads."""
    run = _open_cell_run(uri, experiment, cell, kind, params, run_id, fresh, parent)
    if lease is not None:
        run.take_lease(lease)
    return run


def run_key(owner) -> tuple[str, str, str, str]:
    """(id, hash, experiment, baseline) naming a run: of a Cell or BaselineCell
    (:mod:`smallbatch.cell`), or of the JSON object of a run that is not a cell's (an MI row,
    the report, their parent runs: ``id`` and ``hash``, optionally ``experiment``)."""
    if isinstance(owner, Mapping):
        return owner["id"], owner["hash"], owner.get("experiment", "grid"), owner.get("baseline", "")
    return owner.id, owner.hash, owner.experiment, getattr(owner, "baseline", "")


def _open_cell_run(
    uri: str,
    experiment: str,
    cell,
    kind: str,
    params: dict[str, str] | None,
    run_id: str | None,
    fresh: bool,
    parent: str | None = None,
) -> CellRun:
    cid, chash, cexp, baseline = run_key(cell)
    exp_id = get_or_create_experiment(uri, experiment)
    client = _client(uri)
    if run_id is not None:
        if not run_exists(client, uri, run_id):
            raise RunVanished(f"run {run_id} of cell {cid} is not in the MLflow store {uri}")
        return CellRun(uri, run_id, client, resumed=True, cell_id=cid)
    try:
        runs = [] if fresh else _find_runs(client, exp_id, cid, chash)
        if runs and (kind != "cell" or runs[0].info.status != "FINISHED"):
            run = CellRun(uri, runs[0].info.run_id, client, resumed=True, cell_id=cid)
            if parent and runs[0].data.tags.get(TAG_PARENT) != parent:
                run.set_tags({TAG_PARENT: parent})
            return run
        tags = {
            TAG_CELL: cid,
            TAG_HASH: chash,
            TAG_KIND: kind,
            TAG_EXPERIMENT: cexp,
            TAG_STATUS: "running",
            TAG_ACCURACY_UNIT: ACCURACY_UNIT,
            TAG_COMMIT: git_commit(),
            **_versions(),
            **source_tags(),
        }
        if kind == "baseline":
            tags[TAG_BASELINE] = baseline
        if parent:
            tags[TAG_PARENT] = parent
        created = client.create_run(exp_id, run_name=cid, tags=tags)
        run = CellRun(uri, created.info.run_id, client, resumed=False, cell_id=cid)
        if params:
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 100):
                client.log_batch(run.run_id, params=items[i : i + 100])
        return run
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _wrap(uri, f"opening the run of cell {cid}", exc) from None


def find_cell_run(uri: str, experiment: str, cell) -> CellRun:
    """The existing run of a cell (for evaluation steps); error if pretraining never logged."""
    cid, chash, _, _ = run_key(cell)
    exp_id = get_or_create_experiment(uri, experiment)
    client = _client(uri)
    try:
        runs = _find_runs(client, exp_id, cid, chash)
    except Exception as exc:  # noqa: BLE001
        raise _wrap(uri, f"searching the run of cell {cid}", exc) from None
    if not runs:
        raise TrackingError(
            f"no MLflow run for cell {cid} (hash {chash}) in experiment "
            f"'{experiment}' at {uri}: run `smallbatch pretrain` for it first"
        )
    return CellRun(uri, runs[0].info.run_id, client, resumed=True, cell_id=cid)


def count_cell_runs(uri: str, experiment: str, cell_id: str) -> int:
    exp_id = get_or_create_experiment(uri, experiment)
    client = _client(uri)
    return len(_find_runs(client, exp_id, cell_id, None))


# --------------------------------------------------------------------------- reading (the report)
#: MLflow's run status -> ours, for a run without the TAG_STATUS tag
_MLFLOW_STATUS = {
    "FINISHED": STATUS_FINISHED,
    "RUNNING": STATUS_RUNNING,
    "SCHEDULED": STATUS_RUNNING,
    "FAILED": "failed",
    "KILLED": "failed",
}
_SQLITE_MAGIC = b"SQLite format 3\x00"


def _sqlite_path(uri: str) -> Path:
    return Path(uri[len("sqlite:///") :].split("?", 1)[0])


def _check_sqlite_store(uri: str) -> None:
    """An existing SQLite file with MLflow's tables, checked read-only (the report never creates one)."""
    import sqlite3

    path = _sqlite_path(uri)
    if not str(path) or not path.exists():
        raise TrackingError(f"no MLflow store at {uri}: {path} does not exist (the report never creates a store)")
    if path.is_dir():
        raise TrackingError(f"no MLflow store at {uri}: {path} is a folder, not an SQLite database file")
    try:
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
        if head != _SQLITE_MAGIC:
            what = "is empty" if not head else "is not an SQLite database"
            raise TrackingError(f"no MLflow store at {uri}: {path} {what}")
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
        finally:
            con.close()
    except (OSError, sqlite3.Error) as exc:
        raise TrackingError(f"no MLflow store at {uri}: {path} cannot be read as an SQLite database ({exc})") from None
    if not {"experiments", "runs"} <= tables:
        raise TrackingError(f"no MLflow store at {uri}: {path} is an SQLite database without MLflow's tables")


def _check_existing_store(uri: str) -> None:
    """Refuse a local store that does not exist yet: MLflow would create it (and its folder)."""
    if uri.startswith("sqlite:///"):
        _check_sqlite_store(uri)
    elif "://" not in uri or uri.startswith("file:"):
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        if not path.is_dir():
            raise TrackingError(f"no MLflow store at {uri}: folder {path} does not exist")


def _connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a failed HTTP connection."""
    from requests.exceptions import ConnectionError as HTTPConnectionError

    cur: BaseException | None = exc
    seen = 0
    while cur is not None and seen < 10:
        if isinstance(cur, HTTPConnectionError):
            return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False


class StoreReader:
    """Read-only access to an existing tracking store, for the report.

    Opening never creates a store: a ``sqlite:///`` path must be an existing
    SQLite file with MLflow's tables, a local folder store must exist.  HTTP
    requests run under the retry caps of :func:`_mlflow`, so a stopped server
    fails within seconds.  Every failure is a :class:`TrackingError` of one line
    (``no MLflow server at <URI>`` when nothing answers at the address).
    """

    def __init__(self, uri: str):
        self.uri = str(uri)
        _check_existing_store(self.uri)
        self._client = self._call("opening the store", lambda: _open_client(self.uri))

    def _call(self, what: str, fn):
        try:
            return fn()
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
            if _connection_refused(exc):
                raise TrackingError(f"no MLflow server at {self.uri} (nothing answered while {what})") from None
            raise _wrap(self.uri, what, exc) from None

    def experiment(self, name: str | None) -> tuple[str, str]:
        """(id, name) of experiment ``name``; None picks 'smallbatch' or the store's only experiment.

        ValueError naming the store's experiments when there is no such experiment or no
        unambiguous default.
        """
        if name is not None:
            exp = self._call(f"reading experiment '{name}'", lambda: self._client.get_experiment_by_name(name))
            if exp is None:
                names = sorted(e.name for e in self._experiments())
                raise ValueError(
                    f"no runs in experiment {name!r} at URI {self.uri!r} "
                    f"(no such experiment; available: {', '.join(names) or 'none'})"
                )
            return exp.experiment_id, exp.name
        exps = [e for e in self._experiments() if e.name != "Default"]
        chosen = [e for e in exps if e.name == "smallbatch"] or (exps if len(exps) == 1 else [])
        if chosen:
            return chosen[0].experiment_id, chosen[0].name
        names = sorted(e.name for e in exps)
        raise ValueError(
            f"experiment must be given: the store at URI {self.uri!r} holds "
            f"{len(names)} experiments ({', '.join(names) or 'none'}) and none is named 'smallbatch'"
        )

    def _experiments(self) -> list:
        return self._call("listing experiments", lambda: list(self._client.search_experiments()))

    def runs(self, experiment_id: str) -> list[dict[str, Any]]:
        """Every active run of the experiment: ``run_id, run_name, status`` (TAG_STATUS, else
        MLflow's mapped to ours), ``start_time`` (ms), ``tags``, ``params``, ``metrics`` (latest)."""
        runs: list = []
        token = None
        while True:
            page = self._call(
                "searching runs",
                lambda token=token: self._client.search_runs([experiment_id], max_results=5000, page_token=token),
            )
            runs.extend(page)
            token = page.token
            if not token:
                break
        return [
            {
                "run_id": r.info.run_id,
                "run_name": r.info.run_name,
                "start_time": r.info.start_time or 0,
                "status": r.data.tags.get(TAG_STATUS) or _MLFLOW_STATUS.get(r.info.status, r.info.status.lower()),
                "tags": dict(r.data.tags),
                "params": dict(r.data.params),
                "metrics": dict(r.data.metrics),
            }
            for r in runs
        ]

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of every logged value of metric ``key`` of one run."""
        hist = self._call(f"reading the history of {key}", lambda: self._client.get_metric_history(run_id, key))
        return [(m.step, m.value) for m in hist]

    def _artifact_repo(self, run_id: str):
        """(repo, None) for a proxied root in a SQLite store (:func:`local_artifacts`), else (None, client)."""
        run = self._call(f"reading run {run_id}", lambda: self._client.get_run(run_id))
        return local_artifacts(self.uri, run.info.artifact_uri)

    def artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        """The artifact paths of a run (files, recursively) under ``path``."""
        repo = self._artifact_repo(run_id)
        lister = repo.list_artifacts if repo is not None else (lambda p: self._client.list_artifacts(run_id, p))
        out: list[str] = []
        for info in self._call("listing artifacts", lambda: lister(path)):
            out += self.artifacts(run_id, info.path) if info.is_dir else [info.path]
        return sorted(out)

    def download_artifact(self, run_id: str, path: str, dst: str | Path) -> Path:
        """Copy one artifact of a run into the folder ``dst``; return its local path."""
        repo = self._artifact_repo(run_id)
        Path(dst).mkdir(parents=True, exist_ok=True)
        return Path(
            self._call(
                f"downloading the artifact {path}",
                lambda: (
                    repo.download_artifacts(path, str(dst))
                    if repo is not None
                    else self._client.download_artifacts(run_id, path, str(dst))
                ),
            )
        )


# --------------------------------------------------------------------------- the report's own run
def log_report_run(uri: str, experiment: str, out_dir: str | Path, files: list[Path]) -> str:
    """Log a built report as the experiment's one run of kind ``report`` (run name ``report``):
    its files as artifacts (``index.md``, ``tables/...``, ``figures/...``).  Its hash tag is the
    files' content: the same report built again leaves the run as it is; a changed one replaces
    the run's artifacts and tags in the same run (its id stays).  Report runs beside it (several
    builds of a store from before) are deleted, artifacts first.  Returns its id."""
    import hashlib

    out = Path(out_dir)
    rels = sorted((Path(f).relative_to(out).as_posix(), Path(f)) for f in files)
    digest = hashlib.sha1()
    for rel, f in rels:
        digest.update(rel.encode() + b"\0" + f.read_bytes())
    key = {"id": KIND_REPORT, "hash": digest.hexdigest()[:10], "experiment": KIND_REPORT}
    client, latest = _latest_report_run(uri, experiment)
    if latest is not None and latest.data.tags.get(TAG_HASH) == key["hash"] and latest.info.status == "FINISHED":
        return latest.info.run_id
    run = _emptied(client, uri, latest) if latest is not None else None
    if run is None:
        run = open_cell_run(uri, experiment, key, kind=KIND_REPORT, fresh=True)
    else:
        run.set_tags({TAG_HASH: key["hash"], TAG_COMMIT: git_commit(), **source_tags()})
    for rel, f in rels:
        run.log_artifact(f, str(Path(rel).parent) if "/" in rel else None)
    run.set_tags({TAG_NOTE: f"The study's report ({len(rels)} files): open `index.md` among the artifacts."})
    run.set_status("finished")
    return run.run_id


def _latest_report_run(uri: str, experiment: str):
    """(client, the experiment's newest report run or None); every older one is deleted."""
    exp_id = get_or_create_experiment(uri, experiment)
    client = _client(uri)
    try:
        runs = [r for r in _find_runs(client, exp_id, KIND_REPORT, None) if r.data.tags.get(TAG_KIND) == KIND_REPORT]
        for old in runs[1:]:
            _delete_run(client, uri, old)
    except Exception as exc:  # noqa: BLE001
        raise _wrap(uri, "finding the report's run", exc) from None
    return client, (runs[0] if runs else None)


def _emptied(client, uri: str, latest) -> CellRun | None:
    """The report run ``latest`` with its artifacts deleted, RUNNING again, to log a new
    build into; None when its store cannot delete them (the run is deleted instead)."""
    try:
        _run_artifacts(uri, latest.info.artifact_uri).delete_artifacts()
    except Exception:  # noqa: BLE001 - artifacts that cannot be deleted: a new run instead
        try:
            _delete_run(client, uri, latest)
        except Exception as exc:  # noqa: BLE001
            raise _wrap(uri, "replacing the report's run", exc) from None
        return None
    run = CellRun(uri, latest.info.run_id, client, resumed=True, cell_id=KIND_REPORT)
    run.set_status("running")
    return run


def _run_artifacts(uri: str, artifact_uri: str):
    """The artifact repository of a run's artifact root (:func:`local_artifacts` for a SQLite
    store's proxied root, MLflow's own for any other)."""
    repo = local_artifacts(uri, artifact_uri)
    if repo is None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        repo = get_artifact_repository(artifact_uri, tracking_uri=uri)
    return repo


def _delete_run(client, uri: str, run) -> None:
    """Delete a run, its artifacts first where they can be (MLflow keeps a deleted run's)."""
    with contextlib.suppress(Exception):
        _run_artifacts(uri, run.info.artifact_uri).delete_artifacts()
    client.delete_run(run.info.run_id)
