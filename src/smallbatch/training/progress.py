"""A long loop's progress: a bar on a terminal, a line per :data:`EVERY_PERCENT` % in a log file.

tqdm redraws its bar with carriage returns: in a job's log file (Snakemake's ``> {log}``) that is
one line holding every redraw, of which ``tail`` shows only the last.  Where the stream is not a
terminal, :class:`LineProgress` writes a whole line instead at each :data:`EVERY_PERCENT` % of
the steps, with the rate and the time left.  No torch: the study's console reads :func:`clock`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: a log file gets one line each time this share of the steps (in percent) is done
EVERY_PERCENT = 10


def clock(seconds: float) -> str:
    """``42 s``, ``3 min 07 s``, ``1 h 02 min``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def step_progress(total: int, initial: int, desc: str, file: TextIO | None = None) -> Any:
    """The progress of ``total`` steps from step ``initial``, written to ``file`` (stderr): a tqdm
    bar where it is a terminal, else a :class:`LineProgress`; both take ``update``,
    ``set_postfix`` and ``close``."""
    stream = file if file is not None else sys.stderr
    if not stream.isatty():
        return LineProgress(total, initial, desc, stream)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, mininterval=0.5, file=stream)


class LineProgress:
    """One line per :data:`EVERY_PERCENT` % of ``total`` steps, e.g.
    ``digits/infonce/bs16-t0.5-s0: 40 % (40/100 steps), 12.5 steps/s, ETA 4 s, epoch=0.40 loss=3.1``;
    the rate is this process's (a resumed run counts from ``initial``)."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        file: TextIO,
        now: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total, self.n, self.desc, self.file, self.now = max(int(total), 1), int(initial), desc, file, now
        self.first, self.started = self.n, now()
        self.shown = self._percent()  # a resumed run's first line is at its next threshold
        self.postfix = ""

    def _percent(self) -> int:
        return self.n * 100 // self.total // EVERY_PERCENT * EVERY_PERCENT

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._percent() > self.shown:
            self.shown = self._percent()
            self._write()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        """Nothing to erase (each line is whole); a loop stopped between thresholds says where."""
        if self.n < self.total and self.n * 100 // self.total > self.shown:
            self._write()

    def _write(self) -> None:
        took = self.now() - self.started
        rate = (self.n - self.first) / took if took > 0 else float("inf")
        eta = f", ETA {clock((self.total - self.n) / rate)}" if 0 < rate < float("inf") else ""
        pct = self.n * 100 // self.total
        tail = f", {self.postfix}" if self.postfix else ""
        line = f"{self.desc}: {pct} % ({self.n}/{self.total} steps), {rate:.3g} steps/s{eta}{tail}"
        print(line, file=self.file, flush=True)
