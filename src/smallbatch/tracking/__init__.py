"""The one package that talks to MLflow.

One experiment per study, one run per cell.  A run is found again by its cell
id and config hash (tags ``smallbatch.cell_id`` / ``smallbatch.cell_hash``), so
a re-run of an unfinished cell resumes the same run and never duplicates it;
a changed config (new hash) is a new run, and so is a pretraining rerun of a
finished cell (a finished run is never flipped back to RUNNING).  A new run carries
MLflow's own source tags (the command, LOCAL, the user, the git commit when the package runs
from a checkout) beside the package's versions (:func:`source_tags`).

One trainer per cell per store: a pretraining leases its run (tag
``smallbatch.lease``: its folder, host and PID, renewed as it logs) and a trainer
writing into another folder is refused in one line while that lease is live
(the folder's own lock, :class:`smallbatch.io.CellLock`, keeps two trainers of one
folder apart).  A cell that fails once its run is open ends it FAILED with the
error's first line as ``smallbatch.error``.

Metrics are buffered and written with ``log_batch`` (one call costs about the
same as one ``log_metric``: ~7 ms on SQLite, ~55 ms over HTTP).  After a resume
the steps that were already logged are skipped, so a metric history has exactly
one value per step even when a job was killed between logging and checkpointing.

Concurrency: several processes creating a *fresh* SQLite store at once race on
its schema; ``init_store`` is therefore run once (the workflow's ``init_store``
rule) before any job logs.  It builds a new store in a file beside it and links
it into place once whole, so a killed creation never leaves a half-built store.

An HTTP store (``mlflow server``) may be slow -- a shared server busy with other
studies -- but not silent: every request must be answered whole within one
deadline, ``$SMALLBATCH_STORE_TIMEOUT`` seconds (60), MLflow's own tries and
backoff included; a step whose request is not ends in one line saying which way
it failed: no whole answer within the deadline, nothing listening, or HTTP error N.

Its modules: ``base`` (the tags, statuses and kinds a run is found and read by; the errors),
``client`` (MLflow's client, the URI check, the HTTP deadline, a failure as one line),
``sqlite`` (a SQLite store's file: built whole, checked read-only), ``store`` (the experiment,
where artifacts are), ``provenance`` (a run's source tags), ``runs`` (a cell's run, its lease and
buffered metrics), ``reader`` (read-only, for the report), ``report_run`` (the report's own
run) and ``plan`` (the study's plan recorded beside the store: what a stopped study never ran).
Everything else imports what it needs from here.
"""

from __future__ import annotations

from .base import (
    ACCURACY_UNIT,
    ARTIFACTS_DIR,
    BAD_STATUSES,
    FORMAT,
    KIND_PARENT,
    KIND_REPORT,
    LEASE_S,
    NON_RESULT_KINDS,
    PROXIED_ROOT,
    STATUS_FINISHED,
    STATUS_RUNNING,
    TAG_ACCURACY_UNIT,
    TAG_BASELINE,
    TAG_CELL,
    TAG_COMMIT,
    TAG_ERROR,
    TAG_EXPERIMENT,
    TAG_EXTENDED,
    TAG_FORMAT,
    TAG_GIT_DIRTY,
    TAG_HASH,
    TAG_KIND,
    TAG_LEASE,
    TAG_NOTE,
    TAG_PARENT,
    TAG_PLATFORM,
    TAG_PRETRAIN,
    TAG_PYTHON,
    TAG_STATUS,
    LeaseHeld,
    RunVanished,
    TrackingError,
    format_problem,
)
from .client import DEADLINE_ENV, DEADLINE_S, StoreTooSlow, store_deadline, tracking_uri_problem
from .plan import PLAN_FILE, recorded_plan
from .provenance import git_commit, git_state, set_source, source_tags
from .reader import StoreReader
from .report_run import log_report_run
from .runs import CellRun, count_cell_runs, find_cell_run, open_cell_run, run_key
from .sqlite import half_built
from .store import artifact_path, artifacts_root, describe_study, get_or_create_experiment, init_store

__all__ = [
    "FORMAT",
    "TAG_FORMAT",
    "format_problem",
    "ACCURACY_UNIT",
    "ARTIFACTS_DIR",
    "BAD_STATUSES",
    "CellRun",
    "DEADLINE_ENV",
    "DEADLINE_S",
    "KIND_PARENT",
    "KIND_REPORT",
    "LEASE_S",
    "LeaseHeld",
    "NON_RESULT_KINDS",
    "PLAN_FILE",
    "PROXIED_ROOT",
    "RunVanished",
    "STATUS_FINISHED",
    "STATUS_RUNNING",
    "StoreReader",
    "StoreTooSlow",
    "TAG_ACCURACY_UNIT",
    "TAG_BASELINE",
    "TAG_CELL",
    "TAG_COMMIT",
    "TAG_ERROR",
    "TAG_EXPERIMENT",
    "TAG_EXTENDED",
    "TAG_GIT_DIRTY",
    "TAG_HASH",
    "TAG_KIND",
    "TAG_LEASE",
    "TAG_NOTE",
    "TAG_PARENT",
    "TAG_PLATFORM",
    "TAG_PRETRAIN",
    "TAG_PYTHON",
    "TAG_STATUS",
    "TrackingError",
    "artifact_path",
    "artifacts_root",
    "count_cell_runs",
    "describe_study",
    "find_cell_run",
    "get_or_create_experiment",
    "git_commit",
    "git_state",
    "half_built",
    "init_store",
    "log_report_run",
    "open_cell_run",
    "recorded_plan",
    "run_key",
    "set_source",
    "source_tags",
    "store_deadline",
    "tracking_uri_problem",
]
