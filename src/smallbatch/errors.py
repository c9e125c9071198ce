"""Exceptions shared across steps (kept import-light: no torch, no mlflow)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any


class Preempted(RuntimeError):
    """SIGTERM arrived; the state was saved and the job should exit non-zero."""


class CheckpointError(ValueError):
    """A checkpoint/state/features file is unreadable; the message names the file."""


class PluginError(ValueError):
    """An installed plugin (a loss, a data set, a probe) that cannot join its registry; the
    message, one line, names its entry point and package."""


def loaded_entries(entries: Iterable[metadata.EntryPoint], kind: str) -> Iterator[tuple[str, Any, str]]:
    """(entry point name, the object it names, where: "<kind> plugin 'NAME' (GROUP entry point
    'VALUE' of package 'P')") for each entry point, sorted by name and value, each once; each
    registry checks the object and raises :class:`PluginError` starting with ``where``.  An
    entry point that does not load raises that here, whatever its import raised."""
    for ep in sorted(set(entries), key=lambda e: (e.name, e.value)):
        dist = getattr(ep, "dist", None)
        package = f"package {dist.metadata['Name']!r}" if dist is not None else "an unknown package"
        where = f"{kind} plugin {ep.name!r} ({ep.group} entry point {ep.value!r} of {package})"
        try:
            obj = ep.load()
        except Exception as exc:  # any error of a third-party import: reported as the plugin's
            raise PluginError(f"{where} does not load: {type(exc).__name__}: {exc}") from None
        yield ep.name, obj, where
