"""Numbers and words as the report prints them: one function for each format."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

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


def rounded(x: Any, nd: int = 1) -> float:
    """The report's one rounding rule: ``nd`` decimals below 1000, three significant digits from 1000
    on, and a result of zero is +0.0 (never ``-0.0``)."""
    x = float(x)
    r = float(f"{x:.3g}") if abs(x) >= 1000 else round(x, nd)
    return r + 0.0 if r != 0 else 0.0


def num(x: Any, nd: int = 1) -> str:
    """:func:`rounded` as text (``86.9``, ``1.23e+03``); ``—`` for no number."""
    if not finite(x):
        return "—"
    r = rounded(x, nd)
    return f"{r:.3g}" if abs(float(x)) >= 1000 else f"{r:.{nd}f}"


def signed(x: Any, nd: int = 1) -> str:
    """Like :func:`num` with a sign: ``+2.0``, ``-0.5``, and ``+0.0`` for anything that rounds to zero."""
    if not finite(x):
        return "—"
    r = rounded(x, nd)
    return f"{r:+.3g}" if abs(float(x)) >= 1000 else f"{r:+.{nd}f}"


#: significant digits of a number in a CSV: enough for any top-1 or loss value, none of float32's noise
CSV_DIGITS = 7


def csv_number(x: float) -> str:
    """A float in a tidy CSV: :data:`CSV_DIGITS` significant digits (``86.94999814`` → ``86.95``), no ``-0``."""
    s = f"{float(x):.{CSV_DIGITS}g}"
    return "0" if s in ("-0", "0") else s


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
