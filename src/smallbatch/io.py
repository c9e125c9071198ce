"""The one way the pipeline writes a file: atomically, and a lock per cell folder.

:func:`atomic_write` writes to a temporary file in the target's folder, flushes and
fsyncs it, then moves it into place with ``os.replace``; a failed or interrupted write
leaves no partial file behind (the temporary file is removed) and never a file that
looks finished.  Every file format of the pipeline (JSON results and cell files,
``torch.save`` checkpoints and states, ``.npz`` features, the data cache) goes through
it, via :func:`write_json` / :func:`save_torch` / :func:`write_text` or a ``write``
callback.  A written file gets the permissions the user's umask gives a new file
(``0666 & ~umask``: ``-rw-r--r--`` under umask 022, so a group shares a study's results),
not ``mkstemp``'s ``-rw-------``.

A path is never clobbered (:func:`check_target`): the writer refuses, in one line naming
the path, a target that exists and is not a regular file (a device such as ``/dev/null``, a
FIFO, a socket, a folder) or is a symbolic link; it never writes into an existing file (the
new file is renamed over the old name, so a hard link elsewhere keeps its content), and
``exclusive=True`` refuses an existing target altogether.  Nothing is written through a link
inside a results folder (:func:`check_inside`): a path below a results folder (the config's
``results_dir``, a report folder, a cell's folder's ``<results>/runs/..``) must really lie inside
that folder's real location, so a folder under ``runs/`` replaced by a link to elsewhere is
refused in one line naming the link, while a results folder that is itself a link (to a big
disk) is used as it is.  Files this package keeps open
(a cell's ``.lock``, a log) are opened by :func:`open_regular`: never through a link, never
a FIFO or device, never a file with a second name (a hard link), whose content the PID or
the log would overwrite.

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
import fcntl
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, BinaryIO

#: a cell id's grammar: segments of letters, digits and ``_ . = + -`` joined by single
#: slashes, no segment empty or starting with a dot (so no ``..``, no absolute path)
CELL_ID_RE = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]{0,199}(?:/[A-Za-z0-9_=+-][A-Za-z0-9_.=+-]{0,199}){0,15}")


def text_problem(text: Any, kind: str = "path") -> str | None:
    """Why ``text`` cannot be a path (``kind="path"``), a name or a URI (``"name"``, ``"uri"``),
    one phrase to follow its key or flag, or None.  The one rule for text wherever it enters
    (a flag, a config key, a cell): not empty (a path would name the current folder), no
    control character (NUL ends a C string, ESC drives the terminal), a path not starting with
    '~' (nothing expands it), a name or URI without spaces at its ends (read as part of it:
    ``' sqlite:///x.db'`` is a file-store path)."""
    if not isinstance(text, str) or not text.strip():
        if kind == "path":
            return "is empty (it would name the current folder); name a file or folder"
        return f"is empty; give it a {kind.replace('uri', 'URI')}"
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        return f"= {text!r} holds a control character; rename it"
    if kind == "path" and text.startswith("~"):
        return f"= {text!r} starts with '~', which nothing expands here; write the full path ({os.path.expanduser(text)!r}?)"
    if kind != "path" and text != text.strip():
        what = "URI" if kind == "uri" else kind
        return f"= {text!r} starts or ends with a space, which would be read as part of the {what}; remove it"
    return None


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


#: an exclusive write's refusal of an existing target (the CLI prints "<path>: <this>")
EXISTS = "exists; refused (never overwritten): remove it or choose another path"


class UnsafeTarget(ValueError):
    """A path the package would write is not a plain file of its own (one line naming it)."""


#: what an existing non-regular file is, by its ``stat`` type
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def path_kind(path: str | Path) -> str | None:
    """What lies at ``path`` itself (a link not followed): ``"a regular file"``, ``"a folder"``,
    ``"a FIFO"``, ``"a symbolic link"``, ...; None when nothing does."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)


def read_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a file (following a link), one phrase to follow its
    name, or None: it does not exist (or the working folder it is relative to was deleted),
    or it is a folder, a FIFO, a device ... (a FIFO would block the reader)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not Path(path).is_absolute() and not _cwd_exists():
            return "cannot be found: the working folder was deleted; cd into a folder that exists"
        return "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a file"


def _cwd_exists() -> bool:
    try:
        return os.path.isdir(os.getcwd())
    except FileNotFoundError:
        return False


class DuplicateKey(ValueError):
    """A JSON object with one key twice (a reader would keep one silently)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(
                f"has the key {key!r} twice in one object; a reader would keep only one: remove the other"
            )
        out[key] = value
    return out


def loads_unique(text: str) -> Any:
    """``json.loads`` that refuses an object with a key twice (:class:`DuplicateKey`, its message
    a phrase to follow the source's name); a syntax error is json's own JSONDecodeError."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


def refusal(label: str, what: str, advice: str = "choose another path") -> str:
    """The one line refusing to write ``label`` because it is ``what``."""
    return (
        f"{label} is {what}; refused (smallbatch writes only regular files of one name, never through a link): {advice}"
    )


def check_target(path: str | Path, label: str | None = None, advice: str = "choose another path") -> None:
    """Refuse (:class:`UnsafeTarget`, one line naming ``path``, or ``label``) a target that
    exists and is a symbolic link or not a regular file; a missing one or a regular file passes."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: the write names it
        return
    if not stat.S_ISREG(mode):
        raise UnsafeTarget(refusal(label or str(path), f"{_kind(mode)}, not a regular file", advice))


#: the environment variable holding the results folders (joined by ``os.pathsep``) that the
#: processes a workflow starts write into: a job names only its files, not its results folder
RESULTS_ENV = "SMALLBATCH_RESULTS_DIRS"

#: the results folders this process writes into (absolute, not resolved), :func:`add_results_folder`
_RESULTS: list[str] = []


def add_results_folder(folder: str | Path) -> None:
    """Hold every later write of this process below ``folder`` inside ``folder``'s real
    location (:func:`check_inside`); ``folder`` itself may be a link."""
    path = os.path.abspath(os.path.expanduser(str(folder)))
    if path not in _RESULTS:
        _RESULTS.append(path)


def results_folders() -> list[str]:
    """This process's results folders, and those its starter named in :data:`RESULTS_ENV`."""
    inherited = [os.path.abspath(p) for p in os.environ.get(RESULTS_ENV, "").split(os.pathsep) if p]
    return [*_RESULTS, *inherited]


def _below(path: str, folder: str) -> bool:
    return path != folder and os.path.commonpath([path, folder]) == folder


def check_inside(path: str | Path, label: str | None = None) -> None:
    """Refuse (:class:`UnsafeTarget`, one line naming ``path`` and the link) a path below a
    results folder (:func:`results_folders`) whose real location is not inside that folder's
    real location: a folder under it replaced by a link to elsewhere would take the write
    (and the folders created for it) there."""
    here = os.path.abspath(path)
    for folder in results_folders():
        if _below(here, folder):
            real = os.path.realpath(folder)
            if not (os.path.realpath(here) == real or _below(os.path.realpath(here), real)):
                raise UnsafeTarget(
                    f"{label or path} lies through the link {_first_link(here, folder)}, outside the results "
                    f"folder {folder}; refused (smallbatch writes nothing outside its results folder): "
                    "remove the link"
                )


def _first_link(path: str, folder: str) -> str:
    """The first symbolic link on the way from ``folder`` down to ``path``, with its target."""
    step = folder
    for part in Path(os.path.relpath(path, folder)).parts:
        step = os.path.join(step, part)
        if os.path.islink(step):
            return f"{step} -> {os.readlink(step)}"
    return path


def link_leaving(folder: str | Path) -> str | None:
    """The first symbolic link under ``folder`` (none is followed) whose real location lies
    outside ``folder``'s, as ``link -> target``; None when there is none.  What other writers
    (Snakemake's logs, the folders it makes for a job's outputs) would write through."""
    real = os.path.realpath(folder)
    for top, dirs, files in os.walk(folder):  # a linked folder is listed, never entered
        for name in sorted([*dirs, *files]):
            path = os.path.join(top, name)
            target = os.path.realpath(path)
            if os.path.islink(path) and not (target == real or _below(target, real)):
                return f"{path} -> {os.readlink(path)}"
    return None


def make_folder(path: str | Path) -> Path:
    """The folder ``path`` with its parents, created only inside its results folder (:func:`check_inside`)."""
    check_inside(path)
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], exclusive: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary binary file next to ``path``, fsync it and move it
    to ``path``, with the permissions ``open`` would give it (the umask's).  The folder is
    created; on any error the temporary file is removed, and a full disk is an OSError
    "no space left on device" naming ``path`` (torch.save's own error for it names neither).
    A target that is not a regular file (:func:`check_target`) is refused before anything is
    written; ``exclusive``: an existing target is refused too (and never replaced, even by a
    writer racing this one)."""
    path = Path(path)
    check_target(path)
    check_inside(path)
    if exclusive and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, EXISTS, str(path))
    make_folder(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # its error names the temporary file, which the user never asked for
        raise OSError(exc.errno, f"{exc.strerror} (cannot write into {path.parent})", str(path)) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~current_umask())  # mkstemp's file is 0600 whatever the umask
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        _move_into_place(tmp, path, exclusive)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if _disk_full(exc, path.parent):
            raise OSError(errno.ENOSPC, "no space left on device", str(path)) from None
        raise
    return path


def _move_into_place(tmp: str, path: Path, exclusive: bool) -> None:
    """``tmp`` under the name ``path``: renamed over it (checked again just before), or with
    ``exclusive`` linked there only if the name is free (the kernel refuses an existing one)."""
    if exclusive:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, EXISTS, str(path)) from None
        os.unlink(tmp)
        return
    check_target(path)
    os.replace(tmp, path)


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


def write_text(path: str | Path, text: str, exclusive: bool = False) -> Path:
    """Write ``text`` (UTF-8) atomically."""
    data = text.encode("utf-8")
    return atomic_write(path, lambda fh: fh.write(data), exclusive)


def save_torch(path: str | Path, obj: Any, exclusive: bool = False) -> Path:
    """``torch.save(obj)`` atomically."""
    import torch

    return atomic_write(path, lambda fh: torch.save(obj, fh), exclusive)


def open_regular(path: str | Path, label: str | None = None, flags: int = os.O_RDWR) -> int:
    """A descriptor of the regular file ``path`` (created if missing, mode 0644 less the umask),
    opened with ``flags`` but never through a symbolic link, never a FIFO, device, socket or
    folder, and never a file with another name (a hard link: writing it would change that
    other file); :class:`UnsafeTarget` naming ``label`` (default the path) otherwise.  Nothing
    is written or truncated before these checks."""
    label = label or str(path)
    check_inside(path, label)
    try:  # O_NONBLOCK: a FIFO opens without waiting for a reader (and is then refused)
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        check_target(path, label, "remove it")  # a link, a FIFO without a reader, a socket, a folder
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeTarget(refusal(label, f"{_kind(st.st_mode)}, not a regular file", "remove it"))
        if st.st_nlink > 1:
            raise UnsafeTarget(refusal(label, f"a file with {st.st_nlink} names (a hard link)", "remove it"))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_log(path: str | Path):
    """A log file opened for writing from its start (:func:`open_regular`: never through a link,
    never a FIFO or a hard-linked file); its folder is created."""
    make_folder(Path(path).parent)
    fd = open_regular(path, f"log file {path}", os.O_WRONLY)
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "w", encoding="utf-8")


class CellBusy(RuntimeError):
    """Another live process holds the cell's lock (one line: the cell and the PID)."""


class FolderLock:
    """An exclusive, non-blocking ``flock`` on the file ``path`` (see the module docstring), of
    ``subject`` (what it guards, named in the refusal with what its holder does: ``busy``).

    Use as a context manager; the PID of the holder is written into the lock file so the
    refusal can name it.  Re-entrant within one process (a nested acquire is a no-op).
    """

    _held: dict[str, int] = {}

    def __init__(self, path: str | Path, subject: str, busy: str) -> None:
        self.path, self.subject, self.busy = Path(path), subject, busy
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        make_folder(self.path.parent)
        self._key = key = str(self.path.resolve())
        if key in FolderLock._held:
            FolderLock._held[key] += 1
            return self
        # never through a link, never a FIFO or a hard-linked file: the PID written into it
        # would otherwise truncate and overwrite another file (open_regular)
        fd = open_regular(self.path, f"the lock of {self.subject}, {self.path},")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"process {holder}" if holder else "another process"
                raise CellBusy(
                    f"{self.subject} is {self.busy} by {who} (lock {self.path}); wait for it to finish or stop it first"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        FolderLock._held[key] = 1
        return self

    def release(self) -> None:
        key = getattr(self, "_key", None)
        if key is None or key not in FolderLock._held:
            return
        FolderLock._held[key] -= 1
        if FolderLock._held[key] > 0:
            return
        del FolderLock._held[key]
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class CellLock(FolderLock):
    """The one trainer of a cell: the lock ``<folder>/.lock`` of cell ``name`` (default the folder)."""

    def __init__(self, folder: str | Path, name: str | None = None) -> None:
        super().__init__(Path(folder) / ".lock", f"cell {name or folder}", "being trained")


def nullcontext_lock():
    """No lock (the other processes of a data-parallel cell: rank 0 holds the cell's)."""
    return nullcontext()


def _read_pid(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        return ""
