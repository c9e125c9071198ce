"""A SQLite store's file: built whole beside its place, checked read-only, found half-built, remembered by its inode."""

from __future__ import annotations

import glob
import os
import socket
import sqlite3
from pathlib import Path

from ..io import make_folder
from .base import PROXIED_ROOT, TrackingError

#: the file a new SQLite store is built in, beside it: <name>.tmp-<host>-<pid>
_BUILD_SUFFIX = ".tmp-"


def build_sqlite_store(uri: str, path: Path) -> None:
    """MLflow's migrations (65 tables, seconds) run in a file beside ``path``, which is linked
    into place once whole: a step killed half-way leaves only that file (removed by the next
    build, once its process is gone), never a half-built store at ``path``.  A store another
    process put at ``path`` meanwhile is kept (a link never replaces a file)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    make_folder(path.parent)
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
        for leftover in sqlite_files(tmp):
            leftover.unlink(missing_ok=True)


def sqlite_files(db: Path) -> list[Path]:
    """A SQLite database file and the files SQLite keeps beside it."""
    return [db, *(db.with_name(db.name + s) for s in ("-journal", "-wal", "-shm"))]


def remove_dead_builds(path: Path) -> None:
    """The build files beside ``path`` of this host's processes that are gone (a creation killed
    half-way, or between linking the store into place and removing its build file)."""
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
    once MLflow failed on the store (:func:`wrap`)."""
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
    beside = [f.name for f in sqlite_files(path)[1:] if f.exists()]
    also = f" (and {', '.join(beside)} beside it)" if beside else ""
    return f"{what}, with no runs: delete it{also} and run again (the store is then created whole)"


def sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def store_identity(uri: str) -> tuple | None:
    """(device, inode) of a SQLite store's file — None for other stores, ("missing",) if gone."""
    path = sqlite_file(uri)
    if path is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return ("missing",)
    return (st.st_dev, st.st_ino)


_SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_path(uri: str) -> Path:
    return Path(uri[len("sqlite:///") :].split("?", 1)[0])


def _check_sqlite_store(uri: str) -> None:
    """An existing SQLite file with MLflow's tables, checked read-only (the report never creates one)."""
    path = sqlite_path(uri)
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


def check_existing_store(uri: str) -> None:
    """Refuse a local store that does not exist yet: MLflow would create it (and its folder)."""
    if uri.startswith("sqlite:///"):
        _check_sqlite_store(uri)
    elif "://" not in uri or uri.startswith("file:"):
        if not uri.strip():
            raise TrackingError(
                "no MLflow store at '': the tracking URI is empty; name the study's store, e.g. sqlite:///results/mlflow.db"
            )
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        if path.is_file():  # a local store is a folder: a file here is most likely the SQLite database
            raise TrackingError(
                f"no MLflow store at {uri}: {path} is a file, and a URI without a scheme names a folder store; "
                f"for an SQLite database use sqlite:///{path.resolve()}"
            )
        if not path.is_dir():
            raise TrackingError(f"no MLflow store at {uri}: folder {path} does not exist")
