"""The one way the pipeline writes a file: atomically, and a lock per cell folder.

:func:`atomic_write` writes to a temporary file in the target's folder, flushes and
fsyncs it, then moves it into place with ``os.replace``; a failed or interrupted write
leaves no partial file behind (the temporary file is removed) and never a file that
looks finished.  Every file format of the pipeline (JSON results and cell files,
``torch.save`` checkpoints and states, ``.npz`` features, the data cache) goes through
it, via :func:`write_json` / :func:`save_torch` or a ``write`` callback.  A written file
gets the permissions the user's umask gives a new file (``0666 & ~umask``: ``-rw-r--r--``
under umask 022, so a group shares a study's results), not ``mkstemp``'s ``-rw-------``.

:class:`CellLock` is the one-writer-per-cell guarantee: an OS-level ``flock`` on
``<cell folder>/.lock``, held for the life of the process that trains the cell and
released by the kernel when that process dies (however it dies), so a second process
on the same cell (a second Snakemake in another working directory, a trainer left
running after Snakemake was killed) stops at once with one line naming the cell and
the PID that holds it.

Imports nothing heavy (no torch, no numpy at module level).
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

#: a cell id's grammar: segments of letters, digits and ``_ . = + -`` joined by single
#: slashes, no segment empty or starting with a dot (so no ``..``, no absolute path)
CELL_ID_RE = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]{0,199}(?:/[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]{0,199}){0,15}")


def check_cell_id(cid: Any, source: str = "cell id") -> str:
    """``cid`` when it is a cell id (:data:`CELL_ID_RE`): the one check of every id that
    enters (it names a folder under results_dir); ValueError naming it otherwise."""
    if not isinstance(cid, str) or not CELL_ID_RE.fullmatch(cid):
        raise ValueError(
            f"{source} {cid!r} is not a cell id (segments of letters, digits and _ . = + - "
            "joined by single '/', none empty or starting with a dot); use an id "
            "`smallbatch cells` lists"
        )
    return cid


#: where Linux shows a process's umask without changing it
PROC_STATUS = "/proc/self/status"


def current_umask(status: str = PROC_STATUS) -> int:
    """The process's umask, read from ``status`` (Linux's ``Umask:`` line) without changing
    it; where there is none, set and restored with :func:`os.umask` (a thread creating a file
    in that instant would get umask 077: stricter, never looser)."""
    try:
        with open(status, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fh)`` on a temporary binary file next to ``path``, fsync it and move it
    to ``path``, with the permissions ``open`` would give it (the umask's).  The folder is
    created; on any error the temporary file is removed, and a full disk is an OSError
    "no space left on device" naming ``path`` (torch.save's own error for it names neither)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())  # mkstemp's file is 0600 whatever the umask
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if _disk_full(exc, path.parent):
            raise OSError(errno.ENOSPC, "no space left on device", str(path)) from None
        raise
    return path


def _disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write failed because ``folder``'s file system is full: ENOSPC / EDQUOT,
    or another library's error (torch.save: "unexpected pos") on a file system without space."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not isinstance(exc, RuntimeError):
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def json_text(obj: Any, allow_nan: bool = True) -> str:
    """The pipeline's JSON layout (sorted keys, indent 2, trailing newline)."""
    return json.dumps(obj, indent=2, sort_keys=True, default=float, allow_nan=allow_nan) + "\n"


def write_json(path: str | Path, obj: Any, allow_nan: bool = True) -> Path:
    """Write ``obj`` as JSON atomically."""
    data = json_text(obj, allow_nan).encode()
    return atomic_write(path, lambda fh: fh.write(data))


def save_torch(path: str | Path, obj: Any) -> Path:
    """``torch.save(obj)`` atomically."""
    import torch

    return atomic_write(path, lambda fh: torch.save(obj, fh))


class CellBusy(RuntimeError):
    """Another live process holds the cell's lock (one line: the cell and the PID)."""


class CellLock:
    """An exclusive, non-blocking ``flock`` on ``<folder>/.lock`` (see the module docstring).

    Use as a context manager; the PID of the holder is written into the lock file so the
    refusal can name it.  Re-entrant within one process (a nested acquire is a no-op).
    """

    _held: dict[str, int] = {}

    def __init__(self, folder: str | Path, name: str | None = None) -> None:
        self.path = Path(folder) / ".lock"
        self.name = name or str(folder)
        self._fd: int | None = None

    def acquire(self) -> "CellLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._key = key = str(self.path.resolve())
        if key in CellLock._held:
            CellLock._held[key] += 1
            return self
        try:  # O_NOFOLLOW: a link planted as .lock would have the lock truncate its target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CellBusy(
                    f"the lock of cell {self.name}, {self.path}, is a symbolic link; refused (a lock "
                    "is never a link): remove the link"
                ) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"process {holder}" if holder else "another process"
                raise CellBusy(
                    f"cell {self.name} is being trained by {who} (lock {self.path}); "
                    "wait for it to finish or stop it first"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        CellLock._held[key] = 1
        return self

    def release(self) -> None:
        key = getattr(self, "_key", None)
        if key is None or key not in CellLock._held:
            return
        CellLock._held[key] -= 1
        if CellLock._held[key] > 0:
            return
        del CellLock._held[key]
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "CellLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def nullcontext_lock():
    """No lock (the other processes of a data-parallel cell: rank 0 holds the cell's)."""
    from contextlib import nullcontext

    return nullcontext()


def _read_pid(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        return ""
