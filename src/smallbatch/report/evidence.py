"""Whether a measured difference stands out of the seed noise: the one two-standard-error rule,
and the one wording of a verdict on a paper's claim.

A difference of cell means (or of sums and differences of them) has the standard
error ``sqrt(Σ sd²/n)`` over its independent cell means; it is *within noise*
when its size is at most two standard errors.  A verdict worded by
:func:`support` can never call a difference within noise support.
"""

from __future__ import annotations

import math
from typing import Any

from .fmt import finite


def two_se(*cells: tuple[Any, Any]) -> float:
    """Two standard errors of a sum or difference of independent cell means, each given as
    (sample sd, number of seeds); NaN when a cell has fewer than two seeds (no estimate)."""
    if any(not finite(n) or int(n) < 2 for _, n in cells):
        return math.nan
    return 2.0 * math.sqrt(sum(float(sd) ** 2 / int(n) for sd, n in cells))


def within_noise(diff: Any, tse: Any) -> bool | None:
    """True when ``|diff|`` is at most ``tse`` (two standard errors); None without an estimate."""
    if not finite(tse):
        return None
    return abs(float(diff)) <= float(tse)


def support(holds: bool, within: bool | None, claim: str = "the claim") -> str:
    """'our numbers support <claim>' / 'do not support' / 'neither support nor refute' (within noise)."""
    if within:
        return f"our numbers neither support nor refute {claim}"
    return f"our numbers {'support' if holds else 'do not support'} {claim}"
