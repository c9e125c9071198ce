"""Numbers and words as the report prints them: one function for each format."""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import pandas as pd

#: how a param that was not set is logged
ABSENT = {"", "none", "nan", "null"}


def finite(x: Any) -> bool:
    """True for a finite number; False for NaN, ±inf, None, NA or a non-number."""
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def short(v: Any) -> str:
    """A number in ``%g`` form (``0.1``, ``256``); anything else as it is."""
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


def num(x: Any, nd: int = 1) -> str:
    """``nd`` decimals; three significant digits from 1000 on; ``—`` for no number."""
    if not finite(x):
        return "—"
    return f"{x:.3g}" if abs(x) >= 1000 else f"{x:.{nd}f}"


def signed(x: Any, nd: int = 1) -> str:
    """Like :func:`num` with a sign: ``+2.0``, ``-0.5``."""
    if not finite(x):
        return "—"
    return f"{x:+.3g}" if abs(x) >= 1000 else f"{x:+.{nd}f}"


def sci(x: Any) -> str:
    """Scientific notation with three significant digits (``1.88e-02``); ``—`` for no number."""
    return f"{float(x):.2e}" if finite(x) else "—"


def join(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    if not items:
        return ""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def runs_count(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def slug(s: Any) -> str:
    """A file-name part: letters, digits and underscores, other runs of characters as ``-``."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", str(s)).strip("-").lower() or "x"


def short_values(values: Any) -> str:
    """The distinct values of a column, ``%g``-formatted and joined with '/' in first-seen order; '?' for none."""
    vals = [short(v) for v in pd.Series(list(values)).dropna()]
    vals = [v for v in dict.fromkeys(vals) if v.strip().lower() not in ABSENT]
    return "/".join(vals) if vals else "?"
