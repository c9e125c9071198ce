"""Hooks the tests hand to the training loop."""

from __future__ import annotations

from collections.abc import Callable


def crash_after(steps: int) -> Callable[[int], None]:
    """An ``after_step`` hook that ends the run as a crash would (KeyboardInterrupt, which no
    handler of the loop takes for a finished run) once ``steps`` optimiser steps are done."""

    def hook(step: int) -> None:
        if step >= steps:
            raise KeyboardInterrupt(f"simulated crash after {step} steps")

    return hook
