"""The toy MI study's estimators and critics by name: torch-free, so the report orders its
tables by them without loading the study (:mod:`smallbatch.mi.toy`, which re-exports them)."""

from __future__ import annotations

ESTIMATORS: tuple[str, ...] = ("infonce", "flatnce", "eqco")
CRITICS: tuple[str, ...] = ("separable", "concat", "oracle")
