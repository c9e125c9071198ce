"""MLflow's client of a tracking store: the URI check, the HTTP deadline every request runs under, and a store's failure as one line."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import signal
import threading
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import urlparse

from ..io import make_folder
from .base import TrackingError
from .sqlite import half_built, sqlite_file, sqlite_path

#: the one setting of how long an HTTP tracking store may take: every request (MLflow's own
#: tries and their backoff included) must be answered whole within this many seconds, or the step
#: fails in one line.  A busy shared server answers well within it; a silent one, or one that
#: trickles its answer a byte at a time, ends the step once it has passed.
DEADLINE_ENV = "SMALLBATCH_STORE_TIMEOUT"
DEADLINE_S = 60.0
#: MLflow's own knobs (mlflow.environment_variables), each kept when the user set it: a request is
#: tried up to 4 times (again at once, then 2 and 4 s later: urllib3's backoff), within the deadline.
#: Which failures MLflow tries again is its own policy: a failed connection always; HTTP 408/429/5xx
#: for reads, and since MLflow 3.18 only 408/429 for a write the server may already have applied
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


def load_mlflow():
    for key, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if os.environ.get(_READ_TIMEOUT) in (None, *_OWN_READ_TIMEOUT):  # never shorter than the deadline
        _OWN_READ_TIMEOUT[:] = [str(math.ceil(store_deadline()))]
        os.environ[_READ_TIMEOUT] = _OWN_READ_TIMEOUT[0]
    import mlflow
    from mlflow.tracking import MlflowClient

    return mlflow, MlflowClient


class _TooSlow(BaseException):
    """Raised by the deadline's alarm inside a request (a BaseException: MLflow and urllib3
    catch Exception around their tries, and must not retry past the deadline)."""


class StoreTooSlow(Exception):
    """A request to an HTTP store had no whole answer within the deadline."""


def is_http(uri: str) -> bool:
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


#: what an MLflow tracking server answers at ``<uri>/health`` (a route no login guards)
MLFLOW_HEALTH = "OK"


def check_mlflow_server(uri: str) -> None:
    """TrackingError in one line unless the HTTP store ``uri`` answers MLflow's health check
    (:data:`MLFLOW_HEALTH` at ``/health``) within :func:`store_deadline`: any other server (one
    answering ``200 {}`` to every request) would take a study's runs and keep none of them."""
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/health"
    try:
        with _deadline(store_deadline()), urllib.request.urlopen(url, timeout=store_deadline()) as res:
            answer = repr(res.read(200).decode("utf-8", "replace").strip())
    except urllib.error.HTTPError as exc:
        answer = f"HTTP error {exc.code}"
    except (OSError, ValueError, StoreTooSlow) as exc:
        answer = first_line(exc)
    if answer != repr(MLFLOW_HEALTH):
        raise TrackingError(
            f"MLflow tracking store {uri} is not an MLflow tracking server: {url} answered {answer}, not "
            f"{MLFLOW_HEALTH!r}; check --tracking-uri / tracking_uri (an `mlflow server` URI)"
        )


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


def bounded_client(uri: str):
    """MLflow's client of ``uri``; an HTTP store's calls bounded by the deadline."""
    _, MlflowClient = load_mlflow()
    client = MlflowClient(tracking_uri=uri)
    return _BoundedClient(client, store_deadline()) if is_http(uri) else client


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


def store_client(uri: str):
    problem = tracking_uri_problem(uri)
    if problem:
        raise TrackingError(f"MLflow tracking store {uri}: {problem}")
    try:
        # MLflow logs a failed SQL statement with its whole traceback before raising; the
        # user gets the error's root cause as one line instead (wrap)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:///file:"):  # not a SQLite URI filename
            make_folder(Path(uri[len("sqlite:///") :]).parent)
        return bounded_client(uri)
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001 - any store failure becomes one clear line
        raise wrap(uri, "opening the store", exc) from None


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
    from mlflow.exceptions import RestException

    n = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0") or 0) + 1
    tries = "1 try" if n == 1 else f"{n} tries"
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, StoreTooSlow):
            return str(e)
        if isinstance(e, ConnectionRefusedError):
            return f"nothing is listening there (connection refused, {tries})"
        # the server's last answer once MLflow's tries ended: raised by urllib3 (MLflow < 3.18) or
        # returned to MLflow (3.18 on); which answers it tries again depends on the request (above)
        if m := re.search(r"too many (\d{3}) error responses|failed with error code (\d{3}) != 200", str(e)):
            return f"HTTP error {m.group(1) or m.group(2)} (up to {tries})"
    for e in chain:
        if isinstance(e, RestException):  # the server's own error, as JSON
            return f"HTTP error {e.get_http_status_code()} ({e.error_code}: {first_line(e.message)})"
    return None


def first_line(exc: object) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def wrap(uri: str, what: str, exc: Exception) -> TrackingError:
    db = sqlite_path(uri) if sqlite_file(uri) is not None else None
    try:
        problem = half_built(db) if db is not None and db.is_file() else None
    except Exception:  # noqa: BLE001 - no MLflow to compare with: the error itself says it
        problem = None
    if problem:
        return TrackingError(problem)
    msg = (_http_failure(exc) if is_http(uri) else None) or first_line(_root_cause(exc))
    return TrackingError(f"MLflow tracking store {uri} failed while {what}: {msg}")


def connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a failed HTTP connection."""
    from requests.exceptions import ConnectionError as HTTPConnectionError

    cur: BaseException | None = exc
    seen = 0
    while cur is not None and seen < 10:
        if isinstance(cur, HTTPConnectionError):
            return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False
