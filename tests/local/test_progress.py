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


def plan_entry(cid: str, images: int, steps: int) -> dict:
    return {"id": cid, "kind": "cell", "images": images, "steps": steps, "outputs": [f"runs/{cid}/knn.json"]}


#: a designed study: the same 1600 images seen at batch 16 (100 steps), 64 (25 steps, two seeds) and 32 (50)
DESIGNED = [
    plan_entry("a/bs16", 1600, 100),
    plan_entry("b/bs64-s0", 1600, 25),
    plan_entry("c/bs64-s1", 1600, 25),
    plan_entry("d/bs32", 1600, 50),
]


def run_cell(p: StudyProgress, jobid: int, cell: str, start: float, pretrained: float, end: float) -> list[str]:
    p.job_started(jobid, "pretrain", {"cell": cell}, start)
    p.job_finished(jobid, pretrained)
    p.job_started(jobid + 100, "evaluate", {"cell": cell}, pretrained)
    return p.job_finished(jobid + 100, end)


def test_the_eta_weights_each_cell_left_by_its_images_and_steps_at_the_measured_rates():
    """One cell at a time.  After the batch-16 cell (66 s; 1600 images + 100 steps, a step counted as 32
    images: 4800 units, so 66/4800 s a unit) the cells left cost 2400, 2400 and 3200 units: 33 + 33 + 44 =
    110 s (the mean of the cells done would say 3 x 66 = 198 s).  After the first batch-64 cell (30 s) the
    two shapes give the rates: 66 = 1600 a + 100 b and 30 = 1600 a + 25 b, so b = 0.48 s a step and
    a = 0.01125 s an image; the second batch-64 cell takes the 30 s its shape took, the batch-32 one
    1600 a + 50 b = 42 s: 72 s.  14 s into the next cell: 16 s of it left and 42: 58 s."""
    p = StudyProgress()
    p.planned({"pretrain": 4, "evaluate": 4, "total": 9}, 0.0)
    p.use_plan(DESIGNED, lambda rel: False)
    assert run_cell(p, 1, "a/bs16", 0.0, 60.0, 66.0) == [
        "[1/4] a/bs16  1 min 06 s  (elapsed 1 min 06 s, ETA 1 min 50 s)"
    ]
    assert run_cell(p, 2, "b/bs64-s0", 66.0, 90.0, 96.0) == [
        "[2/4] b/bs64-s0  30 s  (elapsed 1 min 36 s, ETA 1 min 12 s)"
    ]
    p.job_started(3, "pretrain", {"cell": "c/bs64-s1"}, 96.0)
    assert p.eta(110.0) == pytest.approx(58.0)


def test_one_job_per_cell_is_a_cell_with_the_same_line_and_eta_as_a_job_per_step():
    """Under one_job_per_cell the rule run_cell starts and ends a grid cell: the designed study of the
    test above gives the same lines and ETA (1 min 50 s, then 1 min 12 s, then 58 s)."""
    p = StudyProgress()
    assert p.planned({"run_cell": 4, "total": 5}, 0.0) == ["4 cells to run (5 jobs); one line per finished cell"]
    p.use_plan(DESIGNED, lambda rel: False)
    for jobid, cell, start, end, line in (
        (1, "a/bs16", 0.0, 66.0, "[1/4] a/bs16  1 min 06 s  (elapsed 1 min 06 s, ETA 1 min 50 s)"),
        (2, "b/bs64-s0", 66.0, 96.0, "[2/4] b/bs64-s0  30 s  (elapsed 1 min 36 s, ETA 1 min 12 s)"),
    ):
        assert p.job_started(jobid, "run_cell", {"cell": cell}, start) == []
        assert p.job_finished(jobid, end) == [line]
    p.job_started(3, "run_cell", {"cell": "c/bs64-s1"}, 96.0)
    assert p.eta(110.0) == pytest.approx(58.0)


def test_the_eta_keeps_the_means_when_the_plan_is_not_this_runs_cells():
    """A run that computes 3 cells where the plan has 4 left: which cells it computes is not known, so
    the plan's costs are not used (the cell done is 66 s, 2 left: 132 s)."""
    p = StudyProgress()
    p.planned({"pretrain": 3, "evaluate": 3, "total": 7}, 0.0)
    p.use_plan(DESIGNED, lambda rel: False)
    assert run_cell(p, 1, "a/bs16", 0.0, 60.0, 66.0) == [
        "[1/3] a/bs16  1 min 06 s  (elapsed 1 min 06 s, ETA 2 min 12 s)"
    ]


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


def smallbatch_handler():
    pytest.importorskip("snakemake_interface_logger_plugins")
    from snakemake_interface_logger_plugins.registry import LoggerPluginRegistry

    return LoggerPluginRegistry().get_plugin("smallbatch").log_handler(Settings(), None)


def record(t: float, msg: str | None = None, level: int = logging.INFO, **extra) -> logging.LogRecord:
    r = logging.LogRecord("snakemake", level, __file__, 0, msg, None, None)
    r.created = t
    r.__dict__.update(extra)
    return r


def test_snakemake_finds_the_logger_plugin_and_its_handler_reads_job_records():
    handler = smallbatch_handler()
    from snakemake_interface_logger_plugins.common import LogEvent

    assert handler.writes_to_stream and not handler.writes_to_file and handler.has_filter
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


def closing_lines(handler, capsys) -> list[str]:
    """What the handler prints as Snakemake closes it (its stream is stdout: Settings.stdout)."""
    capsys.readouterr()
    handler.close()
    return capsys.readouterr().out.splitlines()


def test_a_study_stopped_by_sigterm_says_so_once_with_the_cells_done_and_how_to_resume(monkeypatch, capsys):
    """Snakemake, sent SIGTERM, repeats "Will exit after ..." at every turn of its scheduler, lets the
    running job finish (exit 0) and ends with "At least one job did not complete successfully": the
    console says the signal once, leaves that closing error out and ends with its own two lines."""
    handler = smallbatch_handler()
    from snakemake_interface_logger_plugins.common import LogEvent

    monkeypatch.setattr("sys.argv", ["/venv/bin/snakemake", "--cores", "2", "--logger", "smallbatch"])
    will_exit = "Will exit after finishing currently running jobs (scheduler)."
    out = []
    for r in (
        record(0.0, "Job stats: ...", event=LogEvent.RUN_INFO, stats={"evaluate": 3, "total": 7}),
        record(0.0, " Rule: pretrain", event=LogEvent.JOB_INFO, jobid=1, rule_name="pretrain", wildcards={"cell": "a"}),
        record(8.0, "Finished jobid: 1", event=LogEvent.JOB_FINISHED, job_id=1),
        record(8.0, " Rule: evaluate", event=LogEvent.JOB_INFO, jobid=2, rule_name="evaluate", wildcards={"cell": "a"}),
        record(9.0, will_exit),
        record(9.5, will_exit),
        record(10.0, "Finished jobid: 2", event=LogEvent.JOB_FINISHED, job_id=2),
        record(10.0, will_exit),
        record(10.0, "Complete log(s): /x/.snakemake/log/1.snakemake.log"),
        record(
            10.0,
            "At least one job did not complete successfully.",
            logging.ERROR,
            event=LogEvent.ERROR,
            exception="WorkflowError",
        ),
    ):
        out += handler.lines(r)
    assert out == [
        "3 cells to run (7 jobs); one line per finished cell",
        "SIGTERM received: the running jobs finish, no new one starts",
        "[1/3] a  10 s  (elapsed 10 s, ETA 20 s)",
        "Complete log(s): /x/.snakemake/log/1.snakemake.log",
    ]
    assert closing_lines(handler, capsys) == [
        "stopped by SIGTERM after 10 s: 1 of 3 cells done, 2 not",
        "resume: snakemake --cores 2 --logger smallbatch  (the same command: finished cells are kept, an "
        "interrupted one resumes)",
    ]
    assert closing_lines(handler, capsys) == []  # closed twice (Snakemake, then logging at exit): said once


def test_a_study_stopped_by_a_failed_job_names_its_error_and_log_and_a_lost_store_as_such(
    tmp_path, monkeypatch, capsys
):
    handler = smallbatch_handler()
    from snakemake_interface_logger_plugins.common import LogEvent

    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/site-packages/snakemake/__main__.py", "--cores", "1"])
    log = tmp_path / "pretrain.log"
    log.write_text(
        "epoch 1/6 ...\nsmallbatch: error: MLflow tracking store sqlite:///r/mlflow.db: no such store (moved "
        "or deleted?)\n"
    )
    for r in (
        record(0.0, "Job stats: ...", event=LogEvent.RUN_INFO, stats={"evaluate": 2, "total": 5}),
        record(0.0, " Rule: pretrain", event=LogEvent.JOB_INFO, jobid=1, rule_name="pretrain", wildcards={"cell": "b"}),
        record(
            65.0,
            "Error in rule pretrain",
            logging.ERROR,
            event=LogEvent.JOB_ERROR,
            jobid=1,
            rule_name="pretrain",
            log=[str(log)],
        ),
    ):
        handler.lines(r)
    assert closing_lines(handler, capsys) == [
        "ended after 1 min 05 s: 0 of 2 cells done, 2 not",
        "why: the MLflow store failed: rule pretrain failed for b (MLflow tracking store sqlite:///r/mlflow.db: no "
        f"such store (moved or deleted?)); its log: {log}",
        "resume: snakemake --cores 1  (the same command: finished cells are kept, an interrupted one resumes)",
    ]


def test_a_study_whose_cells_are_all_done_ends_without_a_summary(capsys):
    handler = smallbatch_handler()
    from snakemake_interface_logger_plugins.common import LogEvent

    for r in (
        record(0.0, "Job stats: ...", event=LogEvent.RUN_INFO, stats={"mi_bench": 1, "total": 2}),
        record(0.0, " Rule: mi_bench", event=LogEvent.JOB_INFO, jobid=1, rule_name="mi_bench", wildcards={}),
        record(3.0, "Finished jobid: 1", event=LogEvent.JOB_FINISHED, job_id=1),
    ):
        handler.lines(r)
    assert closing_lines(handler, capsys) == []
