"""Exceptions shared across steps (kept import-light: no torch, no mlflow)."""

from __future__ import annotations


class Preempted(RuntimeError):
    """SIGTERM arrived; the state was saved and the job should exit non-zero."""


class CheckpointError(ValueError):
    """A checkpoint/state/features file is unreadable; the message names the file."""


class PluginError(ValueError):
    """An installed plugin (a loss, a data set) that cannot join its registry; the message, one
    line, names its entry point and package."""
