"""A gap between two encoders as a fraction of the supervised gap: a formula the report reads
too, kept apart from the probes so that reading it loads no torch."""

from __future__ import annotations


def gap_fraction(value: float, random_init: float, supervised: float) -> float:
    """Where ``value`` lies between the random-init encoder (0) and the supervised upper bound
    (1) of the same network: ``(value - random_init) / (supervised - random_init)``. A
    difference d between two encoders is ``d / (supervised - random_init)`` of that range:
    ``gap_fraction(d, 0, supervised - random_init)``. NaN when the range is not positive
    (supervision added nothing: no fraction of it is defined)."""
    span = float(supervised) - float(random_init)
    if not span > 0:
        return float("nan")
    return (float(value) - float(random_init)) / span
