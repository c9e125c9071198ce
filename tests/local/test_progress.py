"""The study's compact console (smallbatch.local.console): one line per finished cell with its time
and an ETA from the cells done so far, fed with Snakemake's job events at designed times; and the
logger plugin Snakemake finds by its package name."""

from __future__ import annotations

import logging

import pytest

from smallbatch.local.console import StudyProgress, clock


def test_clock_reads_seconds_minutes_and_hours():
    assert [clock(x) for x in (0.4, 42, 187, 3725)] == ["0 s", "42 s", "3 min 07 s", "1 h 02 min"]


def test_one_line_per_finished_cell_timed_from_its_pretraining_with_an_eta():
    p = StudyProgress()
    assert p.planned({"pretrain": 2, "evaluate": 2, "baseline": 1, "report": 1, "total": 7}, 0.0) == [
        "3 cells to run (7 jobs); one line per finished cell"
    ]
    for jobid, cell in ((1, "d/a/bs16-t0.1-s0"), (2, "d/a/bs64-t0.1-s0")):
        assert p.job_started(jobid, "pretrain", {"cell": cell}, 0.0) == []
    assert p.job_finished(1, 10.0) == []  # a pretraining is not a cell's end
    p.job_started(3, "evaluate", {"cell": "d/a/bs16-t0.1-s0"}, 10.0)
    # cell 1 took 12 s; cell 2 has run 12 s: 24 busy seconds in 12 -> 2 at once; 2 cells left of 12 s
    # each, 12 s of them already spent -> (24 - 12) / 2 = 6 s
    assert p.job_finished(3, 12.0) == ["[1/3] d/a/bs16-t0.1-s0  12 s  (elapsed 12 s, ETA 6 s)"]
    p.job_started(4, "baseline", {"dataset": "d", "kind": "raw_pixels"}, 12.0)
    assert p.job_finished(4, 15.0)[0].startswith("[2/3] baselines/d/raw_pixels  3 s  (elapsed 15 s, ETA ")
    p.job_finished(2, 20.0)
    p.job_started(5, "evaluate", {"cell": "d/a/bs64-t0.1-s0"}, 20.0)
    assert p.job_finished(5, 21.0) == ["[3/3] d/a/bs64-t0.1-s0  21 s  (elapsed 21 s, all done)"]
    p.job_started(6, "report", {}, 21.0)
    assert p.job_finished(6, 30.0) == ["report written (9 s)"]


def test_the_eta_times_each_kind_of_cell_by_its_own_kind():
    """The MI toy (100 s) done does not make the grid cell left look 100 s long: 10 s of work at the
    1.1 cells at once seen so far (110 busy seconds in 100)."""
    p = StudyProgress()
    p.planned({"pretrain": 2, "evaluate": 2, "mi_bench": 1, "total": 5}, 0.0)
    p.job_started(1, "mi_bench", {}, 0.0)
    p.job_started(2, "pretrain", {"cell": "a"}, 0.0)
    p.job_finished(2, 8.0)
    p.job_started(3, "evaluate", {"cell": "a"}, 8.0)
    assert p.job_finished(3, 10.0) == ["[1/3] a  10 s  (elapsed 10 s, ETA 5 s)"]
    assert p.job_finished(1, 100.0) == ["[2/3] mi (the MI toy)  1 min 40 s  (elapsed 1 min 40 s, ETA 9 s)"]


def test_a_failed_job_names_its_cell_and_log_and_a_retry_keeps_the_cells_clock():
    p = StudyProgress()
    p.planned({"evaluate": 2, "total": 4}, 0.0)
    p.job_started(7, "pretrain", {"cell": "d/x/bs16-t0.1-s0"}, 0.0)
    assert p.job_failed(7, "pretrain", ["results/logs/pretrain/d/x/bs16-t0.1-s0.log"], 5.0) == [
        "FAILED d/x/bs16-t0.1-s0 (rule pretrain); its log: results/logs/pretrain/d/x/bs16-t0.1-s0.log"
    ]
    assert p.retried(7, 5.0) == ["retrying d/x/bs16-t0.1-s0 (rule pretrain)"]
    p.job_started(7, "pretrain", {"cell": "d/x/bs16-t0.1-s0"}, 5.0)
    p.job_finished(7, 9.0)
    p.job_started(8, "evaluate", {"cell": "d/x/bs16-t0.1-s0"}, 9.0)
    line = p.job_finished(8, 10.0)[0]
    assert line.startswith("[1/2] d/x/bs16-t0.1-s0  10 s  (elapsed 10 s, ETA ") and not p.failed
    # a cell that failed for good is not waited for
    p.job_started(9, "pretrain", {"cell": "d/y/bs16-t0.1-s0"}, 10.0)
    p.job_failed(9, "pretrain", [], 11.0)
    assert p.eta(11.0) is None


def test_snakemake_finds_the_logger_plugin_and_its_handler_reads_job_records():
    pytest.importorskip("snakemake_interface_logger_plugins")
    from snakemake_interface_logger_plugins.common import LogEvent
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

    plugin = LoggerPluginRegistry().get_plugin("smallbatch")

    class Settings:  # what Snakemake hands a handler (OutputSettingsLoggerInterface)
        printshellcmds, nocolor, quiet, debug_dag, verbose, show_failed_logs, stdout, dryrun = (
            True,
            True,
            None,
            False,
            False,
            True,
            True,
            False,
        )

    handler = plugin.log_handler(Settings(), None)
    assert handler.writes_to_stream and not handler.writes_to_file and handler.has_filter

    def record(t: float, msg: str | None = None, **extra) -> logging.LogRecord:
        r = logging.LogRecord("snakemake", logging.INFO, __file__, 0, msg, None, None)
        r.created = t
        r.__dict__.update(extra)
        return r

    out = []
    for r in (
        record(0.0, "Job stats: ...", event=LogEvent.RUN_INFO, stats={"evaluate": 1, "total": 3}),
        record(0.0, " Rule: pretrain", event=LogEvent.JOB_INFO, jobid=1, rule_name="pretrain", wildcards={"cell": "c"}),
        record(0.5, "Shell command: smallbatch pretrain ...", event=LogEvent.SHELLCMD, shellcmd="..."),
        record(4.0, "Finished jobid: 1 (Rule: pretrain)", event=LogEvent.JOB_FINISHED, job_id=1),
        record(4.0, None, event=LogEvent.PROGRESS, done=1, total=3),
        record(4.0, " Rule: evaluate", event=LogEvent.JOB_INFO, jobid=2, rule_name="evaluate", wildcards={"cell": "c"}),
        record(6.0, "Finished jobid: 2 (Rule: evaluate)", event=LogEvent.JOB_FINISHED, job_id=2),
        record(6.0, "Select jobs to execute..."),
        record(7.0, "Complete log(s): /x/.snakemake/log/1.snakemake.log"),
    ):
        out += handler.lines(r)
    assert out == [
        "1 cell to run (3 jobs); one line per finished cell",
        "[1/1] c  6 s  (elapsed 6 s, all done)",
        "Complete log(s): /x/.snakemake/log/1.snakemake.log",
    ]
