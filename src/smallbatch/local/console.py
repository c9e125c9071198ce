"""A study's compact console: one line per finished cell with its time and an ETA.

:class:`StudyProgress` reads Snakemake's job events (planned counts, a job started, finished,
failed) and returns the lines to print; :class:`ConsoleHandler` is the Snakemake logger plugin
(``snakemake --logger smallbatch``, registered by the ``snakemake_logger_plugin_smallbatch``
package) that feeds it from Snakemake's log records and prints them instead of Snakemake's rule
blocks.  Snakemake's full log still goes to ``.snakemake/log/*.snakemake.log`` and each job's to
its file under ``<results>/logs``.

A run that ends with planned cells not done ends with two lines (:meth:`StudyProgress.summary`):
why it stopped -- the signal Snakemake was sent (SIGTERM lets the running jobs finish, SIGINT
stops them), or the first failed job with its own error line and its log (a store that failed
is named so) -- how many cells are done, and the command that resumes it; Snakemake's repeated
"Will exit after finishing currently running jobs" and its closing "At least one job did not
complete successfully" (said even when every job exited 0) are left out.

A *cell* is what the study reports: a grid cell (its ``evaluate`` job finishing, timed from its
``pretrain`` job's start), a baseline, or the MI toy.  The ETA is the time the cells left are
expected to take, divided by how many ran at once (the cells' busy time over the wall time).  A
grid cell's expected time comes from its cost in the study's plan (``plan.json``: its optimiser
steps and the images its network sees, which its batch size, epochs, data set and extra negatives
give): the mean time of the finished cells of its shape, else its images and steps at the rates
the finished cells measure (:func:`cost_rates`) -- cells run longest first, so a mean of the cells
done would make the first estimates high.  Baselines and the MI toy take their own kind's mean.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..io import RESULTS_ENV
from ..tracking import PLAN_FILE
from ..training.progress import clock  # noqa: F401  (the console's times; imported from here too)

#: rules whose finished job completes a cell, and how a job of each names its cell
CELL_RULES = {
    "evaluate": lambda w: w.get("cell", "cell"),
    "run_cell": lambda w: w.get("cell", "cell"),  # one_job_per_cell: pretraining and evaluations
    "baseline": lambda w: f"baselines/{w.get('dataset', '?')}/{w.get('kind', '?')}",
    "mi_bench": lambda w: "mi (the MI toy)",
}
#: rules whose finished job gets a line of its own without being a cell
STEP_RULES = {
    "prepare_data": lambda w: f"data {w.get('dataset', '')} ready".replace("  ", " "),
    "report": lambda w: "report written",
}
#: the rule whose start starts a grid cell's clock, and the rules that complete a grid cell (a job
#: per step, one job per cell)
START_RULE, GRID_RULE, GRID_RULES = "pretrain", "evaluate", ("evaluate", "run_cell")
#: Snakemake's plain messages still shown (the rest is in its log file)
KEPT_MESSAGES = re.compile(r"^(Nothing to be done|Complete log|Exiting because)")
#: Snakemake's message when it restarts a failed job
RESTART = re.compile(r"^Trying to restart job (\S+)\.")
#: a step's fixed cost (the optimiser, the data loading, Python) in images' worth, assumed for the ETA
#: until finished cells of two shapes measure it (:func:`cost_rates`)
STEP_IMAGES = 32.0
#: exceptions Snakemake logs for a failed job, before the job's own error (which names it and its log)
JOB_EXCEPTIONS = ("RuleException", "CalledProcessError")
#: Snakemake's messages when a signal stops it, and the signal: SIGTERM lets the running jobs finish
#: (repeated at every turn of its scheduler), SIGINT (Ctrl-C) cancels them
STOP_MESSAGES = {
    "Will exit after finishing currently running jobs": "SIGTERM",
    "Terminating processes on user request": "SIGINT",
}
#: Snakemake's closing error of a run that did not finish its jobs, which says neither why nor what
#: is done: the console's own summary (:meth:`StudyProgress.summary`) replaces it
UNFINISHED = "At least one job did not complete successfully"
#: how a job's own one-line error begins in its log (``smallbatch.pipeline.cli``)
JOB_ERROR_PREFIX = "smallbatch: error: "


@dataclass
class StudyProgress:
    """The console's state: cells planned per kind (the rule that completes them), jobs running (their rule,
    cell and start), the times of the cells done per kind.  Every method takes the event's time (seconds)
    and returns the lines to print."""

    plan: dict = field(default_factory=dict)  # completing rule -> cells planned
    start: float | None = None
    running: dict = field(default_factory=dict)  # jobid -> (rule, name, start)
    cell_start: dict = field(default_factory=dict)  # cell name -> (completing rule, its first job's start)
    durations: dict = field(default_factory=dict)  # completing rule -> [seconds of each cell done]
    failed: dict = field(default_factory=dict)  # cell -> completing rule, failed and not finished since (a retry may)
    cause: str | None = None  # why the run stops before its planned cells are done (a signal, a failed job)
    costs: dict = field(default_factory=dict)  # grid cell of this run -> (images, steps), from the plan
    cell_seconds: dict = field(default_factory=dict)  # grid cell done -> its seconds

    @property
    def cells_planned(self) -> int:
        return sum(self.plan.values())

    @property
    def cells_done(self) -> int:
        return sum(len(d) for d in self.durations.values())

    def planned(self, counts: dict, now: float) -> list[str]:
        """Snakemake's job counts per rule for this run."""
        self.plan = {r: int(counts.get(r, 0)) for r in CELL_RULES if counts.get(r)}
        self.start = now if self.start is None else self.start
        n = self.cells_planned
        if not n:
            return []
        return [
            f"{n} cell{'s' if n != 1 else ''} to run ({int(counts.get('total', 0))} jobs); one line per finished cell"
        ]

    def job_started(self, jobid, rule: str, wildcards: dict, now: float) -> list[str]:
        self.start = now if self.start is None else self.start
        name = _name(rule, wildcards)
        self.running[jobid] = (rule, name, now)
        if rule in (START_RULE, *CELL_RULES):
            self.cell_start.setdefault(name, (rule if rule in CELL_RULES else GRID_RULE, now))
        return []

    def job_finished(self, jobid, now: float) -> list[str]:
        rule, name, began = self.running.pop(jobid, (None, None, now))
        if rule in STEP_RULES:
            return [f"{name} ({clock(now - began)})"]
        if rule not in CELL_RULES:
            return []
        took = now - self.cell_start.pop(name, (rule, began))[1]
        self.durations.setdefault(rule, []).append(took)
        if rule in GRID_RULES:
            self.cell_seconds[name] = took
        self.failed.pop(name, None)
        done, total = self.cells_done, max(self.cells_planned, self.cells_done)
        eta = self.eta(now)
        assert self.start is not None  # job_started ran for this job
        tail = f"elapsed {clock(now - self.start)}" + (f", ETA {clock(eta)}" if eta is not None else ", all done")
        return [f"[{done:>{len(str(total))}}/{total}] {name}  {clock(took)}  ({tail})"]

    def job_failed(self, jobid, rule: str, logs, now: float) -> list[str]:
        """A job failed: its cell (or step) with its log files.  The job stays known by its id: Snakemake
        may retry it (:meth:`retried`), and the cell's clock keeps its first start."""
        _, name, _ = self.running.get(jobid, (rule, rule, now))
        if rule in CELL_RULES or rule == START_RULE:
            self.failed[name] = rule if rule in CELL_RULES else GRID_RULE
        where = f"; its log: {', '.join(str(x) for x in logs)}" if logs else ""
        error = job_error(logs[0]) if logs else None
        self.cause = self.cause or (
            f"{'the MLflow store failed: ' if error and 'MLflow' in error else ''}rule {rule} failed for {name}"
            + (f" ({error})" if error else "")
            + where
        )
        return [f"FAILED {name} (rule {rule}){where}"]

    def stopping(self, signal_name: str) -> list[str]:
        """Snakemake was sent ``signal_name``: the first time, one line saying what happens now."""
        if self.cause is not None and self.cause.startswith("stopped by"):
            return []
        self.cause = f"stopped by {signal_name}"
        then = "the running jobs finish, no new one starts" if signal_name == "SIGTERM" else "the running jobs stop"
        return [f"{signal_name} received: {then}"]

    def summary(self, now: float, resume: str) -> list[str]:
        """The last lines of a run that ended with planned cells not done: why it stopped, how many
        cells are done, and the command that resumes it (none for a run whose cells are all done)."""
        planned, done = self.cells_planned, self.cells_done
        if done >= planned:
            return []
        took = f" after {clock(now - self.start)}" if self.start is not None else ""
        signalled = self.cause is not None and self.cause.startswith("stopped by")
        head = self.cause if signalled else "ended"
        return [
            f"{head}{took}: {done} of {planned} cells done, {planned - done} not",
            *([f"why: {self.cause}"] if self.cause and not signalled else []),
            f"resume: {resume}  (the same command: finished cells are kept, an interrupted one resumes)",
        ]

    def retried(self, jobid, now: float) -> list[str]:
        """Snakemake restarts a failed job (``retries``)."""
        rule, name, _ = self.running.pop(jobid, (None, f"job {jobid}", now))
        return [f"retrying {name}" + (f" (rule {rule})" if rule else "")]

    def eta(self, now: float) -> float | None:
        """Seconds until the planned cells are done, from the cells done so far: each grid cell left by its
        expected time (:meth:`expected`, where the plan gave the cells' costs), the other cells left of each
        kind (baseline, MI toy) times the mean time of that kind's cells done (of all cells done while a kind
        has none), less what the running cells have done, over how many ran at once.  None when no cell is
        left."""
        left = {r: n - len(self.durations.get(r, [])) for r, n in self.plan.items()}
        for r in self.failed.values():
            left[r] = left.get(r, 0) - 1
        if sum(max(0, n) for n in left.values()) <= 0:
            return None
        done = [d for ds in self.durations.values() for d in ds]
        if not done or self.start is None or now <= self.start:
            return 0.0
        mean = {r: sum(self.durations.get(r) or done) / len(self.durations.get(r) or done) for r in left}
        grid = self.expected()
        cells = {n: self.cell_start[n] for _, n, _ in self.running.values() if n in self.cell_start}
        at_once = max(1.0, (sum(done) + sum(now - t for _, t in cells.values())) / (now - self.start))
        work = sum(
            sum(grid.values()) if r in GRID_RULES and grid is not None else max(0, n) * mean[r] for r, n in left.items()
        )
        for n, (r, t) in cells.items():  # what the running cells have done, at most what each is expected to take
            work -= min(now - t, grid[n] if grid is not None and n in grid else mean.get(r, 0.0))
        return max(0.0, work) / at_once

    def use_plan(self, entries: list[dict], exists: Callable[[str], bool]) -> None:
        """The costs of the grid cells this run computes, from the study's plan (``plan.json``): the cells
        with a result file missing (``exists`` tells, for a path relative to the results folder) -- taken
        only when they are as many as the grid cells Snakemake planned, else the ETA keeps the means."""
        todo = [e for e in entries if e.get("kind") == "cell" and not all(exists(o) for o in e.get("outputs", []))]
        if len(todo) == sum(self.plan.get(r, 0) for r in GRID_RULES) and all(
            "images" in e and "steps" in e for e in todo
        ):
            self.costs = {e["id"]: (int(e["images"]), int(e["steps"])) for e in todo}

    def expected(self) -> dict[str, float] | None:
        """The expected seconds of each grid cell of this run not done: the mean time of the finished cells
        of its shape (its images and steps), else its images and steps at the rates the finished cells
        give (:func:`cost_rates`).  None without the plan's costs or a finished grid cell."""
        done = [(self.costs[n], d) for n, d in self.cell_seconds.items() if n in self.costs]
        if not done:
            return None
        per_image, per_step = cost_rates(done)
        by_shape: dict[tuple[int, int], list[float]] = {}
        for shape, d in done:
            by_shape.setdefault(shape, []).append(d)
        return {
            n: sum(by_shape[c]) / len(by_shape[c]) if c in by_shape else per_image * c[0] + per_step * c[1]
            for n, c in self.costs.items()
            if n not in self.cell_seconds and n not in self.failed
        }


def cost_rates(done: list[tuple[tuple[int, int], float]]) -> tuple[float, float]:
    """(seconds per image, seconds per step) of the finished cells (``((images, steps), seconds)``): the
    least-squares fit of seconds = a x images + b x steps where the cells' images per step differ and the
    fit is not negative; else one rate, a step costing :data:`STEP_IMAGES` images."""
    sii = sum(c[0] * c[0] for c, _ in done)
    sss = sum(c[1] * c[1] for c, _ in done)
    sis = sum(c[0] * c[1] for c, _ in done)
    sid = sum(c[0] * d for c, d in done)
    ssd = sum(c[1] * d for c, d in done)
    det = sii * sss - sis * sis
    if det > 1e-9 * sii * sss:
        a, b = (sid * sss - ssd * sis) / det, (ssd * sii - sid * sis) / det
        if a >= 0 and b >= 0:
            return a, b
    a = sum(d for _, d in done) / sum(c[0] + STEP_IMAGES * c[1] for c, _ in done)
    return a, STEP_IMAGES * a


def job_error(log) -> str | None:
    """The job's own one-line error (``smallbatch: error: ...``), the last in its log, or None."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    lines = [x for x in tail.splitlines() if x.startswith(JOB_ERROR_PREFIX)]
    return lines[-1][len(JOB_ERROR_PREFIX) :].strip() if lines else None


def read_plan(progress: StudyProgress) -> None:
    """The grid cells' costs for the ETA (:meth:`StudyProgress.use_plan`) from the plan the workflow wrote
    into its results folder (named in the environment of the Snakemake process); none where unreadable."""
    folders = [f for f in os.environ.get(RESULTS_ENV, "").split(os.pathsep) if f]
    if not folders:
        return
    try:
        entries = json.loads((Path(folders[0]) / PLAN_FILE).read_text())["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    progress.use_plan(entries, lambda rel: (Path(folders[0]) / rel).is_file())


def resume_command(argv: list[str]) -> str:
    """The command that ran Snakemake (``python -m snakemake`` shown as ``snakemake``)."""
    head = Path(argv[0]) if argv else Path("snakemake")
    prog = "snakemake" if "snakemake" in head.parts or head.name.startswith("snakemake") else str(head)
    return shlex.join([prog, *argv[1:]])


def _name(rule: str, wildcards: dict) -> str:
    w = dict(wildcards or {})
    if rule in CELL_RULES:
        return CELL_RULES[rule](w)
    if rule == START_RULE:
        return w.get("cell", "cell")
    if rule in STEP_RULES:
        return STEP_RULES[rule](w)
    return rule


def write_summary(stream, progress: StudyProgress, now: float) -> None:
    """Write the summary of a run that ends (why it stopped, the cells done, how to resume) to
    ``stream``; a stream already closed at exit gets nothing."""
    try:
        for line in progress.summary(now, resume_command(sys.argv)):
            stream.write(line + "\n")
        stream.flush()
    except Exception:  # noqa: BLE001 - a closed stream at exit: nothing left to tell
        pass


def message_lines(progress: StudyProgress, record, now: float) -> list[str]:
    """The console's lines for one of Snakemake's plain messages (a record without an event): a
    stop's announcement, a job's restart, a warning or a message worth keeping; else none."""
    message = str(record.getMessage()) if record.msg is not None else ""
    stop = next((sig for m, sig in STOP_MESSAGES.items() if message.startswith(m)), None)
    if stop:
        return progress.stopping(stop)
    restart = RESTART.match(message)
    if restart:
        jobid = restart.group(1)
        return progress.retried(int(jobid) if jobid.isdigit() else jobid, now)
    if record.levelno >= 30 or KEPT_MESSAGES.match(message):
        return [message]
    return []


def console_handler_class():
    """The Snakemake logger plugin's handler class (imports Snakemake's plugin interface, so only when asked)."""
    from snakemake_interface_logger_plugins.base import LogHandlerBase
    from snakemake_interface_logger_plugins.common import LogEvent

    class ConsoleHandler(LogHandlerBase):
        """Prints :class:`StudyProgress`'s lines, errors and a few of Snakemake's plain messages; a dry run
        (``-n``) is printed as Snakemake prints it."""

        def __post_init__(self) -> None:
            from snakemake.logging import DefaultFilter

            s = self.common_settings
            self.progress = StudyProgress()
            self.stream = sys.stdout if getattr(s, "stdout", False) else sys.stderr
            self.plain = DefaultFilter(s.quiet, s.debug_dag, s.verbose, s.dryrun, s.printshellcmds)
            self.last_time: float | None = None
            self.summarised = False
            self.plan_unread = True

        def close(self) -> None:
            """Snakemake closes its handlers as it ends: a run that stopped with cells left says why,
            how many are done and how to resume (once)."""
            if not self.summarised and not self.common_settings.dryrun and self.progress.start is not None:
                self.summarised = True
                now = self.last_time if self.last_time is not None else self.progress.start
                write_summary(self.stream, self.progress, now)
            super().close()

        def emit(self, record) -> None:
            try:
                for line in self.lines(record):
                    self.stream.write(line + "\n")
                self.stream.flush()
            except Exception:
                self.handleError(record)

        def lines(self, record) -> list[str]:
            event, now = getattr(record, "event", None), record.created
            if self.common_settings.dryrun:
                return [self.format(record)] if self.plain.filter(record) else []
            p, self.last_time = self.progress, now
            if event == LogEvent.RUN_INFO:
                return p.planned(getattr(record, "stats", {}) or {}, now)
            if event == LogEvent.JOB_INFO:
                if self.plan_unread:  # the onstart hook wrote it before the first job
                    self.plan_unread = False
                    read_plan(p)
                return p.job_started(record.jobid, record.rule_name, record.wildcards, now)
            if event == LogEvent.JOB_FINISHED:
                return p.job_finished(record.job_id, now)
            if event == LogEvent.JOB_ERROR:
                return p.job_failed(record.jobid, record.rule_name, getattr(record, "log", []), now)
            if event == LogEvent.ERROR:
                message = str(record.getMessage()) if record.msg is not None else ""
                quiet = getattr(record, "exception", None) in JOB_EXCEPTIONS or UNFINISHED in message
                return [] if quiet else [self.format(record)]
            return message_lines(p, record, now) if event is None else []

        @property
        def writes_to_stream(self) -> bool:
            return True

        @property
        def writes_to_file(self) -> bool:
            return False

        @property
        def has_filter(self) -> bool:
            return True

        @property
        def has_formatter(self) -> bool:
            return False

        @property
        def needs_rulegraph(self) -> bool:
            return False

    return ConsoleHandler
