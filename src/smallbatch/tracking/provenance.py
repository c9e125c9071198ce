"""Where a new run comes from: the command, the checkout's commit and whether it had changes, the machine and the package versions (read once per process)."""

from __future__ import annotations

import functools
import getpass
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from types import MappingProxyType

from .base import TAG_GIT_DIRTY, TAG_PLATFORM, TAG_PYTHON


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
    from mlflow.utils import mlflow_tags as mt

    command = _SOURCE[0] if _SOURCE else Path(sys.argv[0] or "python").name
    return {mt.MLFLOW_SOURCE_NAME: command, **_machine_tags()}


@functools.cache
def _machine_tags() -> Mapping[str, str]:
    """The source tags that hold for the whole process, read once (read-only: every run shares them)."""
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
def package_versions() -> Mapping[str, str]:
    """The version tags of a new run, read once per process (~8 ms of package metadata;
    read-only, as every run shares it)."""
    out = {}
    for pkg in ("smallbatch", "torch", "torchvision", "faiss-cpu", "faiss-gpu", "mlflow", "numpy"):
        try:
            out[f"smallbatch.version.{pkg}"] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return MappingProxyType(out)
