"""A ready study folder from the installed package (``smallbatch init-study DIR``).

The package holds the workflow as data, ``smallbatch/resources/study``: in a checkout, links
to the repository's own Snakefile, config.yaml, workflow/ and envs/ (one copy of each); in a
wheel, the files those links name (the build follows them).  Copied into a new folder, they
are a study that ``snakemake`` runs as in a checkout: its rules call the installed
``smallbatch`` command, its config is the default study's, to edit or to overlay.
"""

from __future__ import annotations

import os
import shutil
from importlib import resources
from pathlib import Path

__all__ = ["study_source", "write_study"]


def study_source() -> Path:
    """The study's files in the installed package (``smallbatch/resources/study``)."""
    return Path(str(resources.files("smallbatch") / "resources" / "study"))


def write_study(dest: Path) -> list[str]:
    """Copy the study's files into ``dest`` (created; an existing one must be an empty folder:
    nothing of the user's is ever overwritten) and return the names written, sorted.
    ValueError, one line naming ``dest``, for an existing file or non-empty folder."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ValueError(f"{dest} exists and is not a folder; name a new or empty folder for the study")
    if dest.is_dir() and any(dest.iterdir()):
        raise ValueError(
            f"{dest} exists and is not empty; name a new or empty folder for the study (nothing was written)"
        )
    src = study_source()
    names = sorted(p.name for p in src.iterdir() if p.name != "__pycache__")
    if "Snakefile" not in names:
        raise ValueError(f"the installed package holds no study files at {src}; reinstall smallbatch")
    dest.mkdir(parents=True, exist_ok=True)
    for folder, dirs, files in os.walk(src, followlinks=True):  # a checkout's links are followed
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        here = dest / Path(folder).relative_to(src)
        here.mkdir(exist_ok=True)
        for name in files:  # the contents alone: the user's own files, writable, whatever the package's modes
            shutil.copyfile(Path(folder) / name, here / name)
    return names
