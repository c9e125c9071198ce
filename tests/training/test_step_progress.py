"""A pretraining job's progress: a bar on a terminal; in a log file (not a terminal) a whole line
per 10 % of the steps with the rate and the time left, never a carriage return."""

from __future__ import annotations

import io

from smallbatch.training import loop
from smallbatch.training.progress import LineProgress, step_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_one_whole_line_per_ten_percent_and_no_carriage_return(monkeypatch):
    log = io.StringIO()  # what a job's `> {log}` is: not a terminal
    monkeypatch.setattr(loop.sys, "stderr", log)
    bar = loop._progress(40, 0, "digits/infonce/bs16-t0.5-s0", True)
    for _ in range(40):
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text, text[:300]
    lines = text.splitlines()
    assert [line.split(": ", 1)[1].split(" %")[0] for line in lines] == [str(p) for p in range(10, 101, 10)], lines
    assert lines[3].startswith("digits/infonce/bs16-t0.5-s0: 40 % (16/40 steps), ") and "steps/s" in lines[3]


def test_each_line_says_the_rate_and_the_time_left_on_a_designed_clock():
    """2 steps per second (a clock 0.5 s per step), 20 steps: at 10 % (2 steps) 18 are left, 9 s."""
    log, t = io.StringIO(), [0.0]
    bar = LineProgress(20, 0, "cell", log, now=lambda: t[0])
    for step in range(1, 21):
        t[0] = step * 0.5
        bar.update(1)
        if step == 4:
            bar.set_postfix(epoch="0.20", loss="3.1416")
    lines = log.getvalue().splitlines()
    assert lines[0] == "cell: 10 % (2/20 steps), 2 steps/s, ETA 9 s"
    assert lines[1] == "cell: 20 % (4/20 steps), 2 steps/s, ETA 8 s"  # its postfix comes after its update
    assert lines[2] == "cell: 30 % (6/20 steps), 2 steps/s, ETA 7 s, epoch=0.20 loss=3.1416"
    assert lines[-1] == "cell: 100 % (20/20 steps), 2 steps/s, ETA 0 s, epoch=0.20 loss=3.1416"
    assert len(lines) == 10


def test_a_resumed_run_counts_its_rate_from_where_it_resumed_and_a_stop_says_where():
    log, t = io.StringIO(), [0.0]
    bar = LineProgress(100, 55, "cell", log, now=lambda: t[0])
    for step in range(56, 73):  # 17 steps in 17 s
        t[0] = float(step - 55)
        bar.update(1)
    bar.close()  # stopped (e.g. preempted) at 72 %
    assert log.getvalue().splitlines() == [
        "cell: 60 % (60/100 steps), 1 steps/s, ETA 40 s",
        "cell: 70 % (70/100 steps), 1 steps/s, ETA 30 s",
        "cell: 72 % (72/100 steps), 1 steps/s, ETA 28 s",
    ]


def test_a_terminal_gets_a_bar():
    bar = step_progress(10, 0, "cell", Terminal())
    assert type(bar).__name__ == "tqdm"
    bar.close()
