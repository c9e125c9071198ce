"""The names a run is found and read by (its tags, statuses and kinds, where its artifacts live) and the tracking errors."""

from __future__ import annotations

#: the format of the cell files and stores this smallbatch writes and reads: every cell carries it
#: (``format``, part of its hash) and every study's experiment (tag :data:`TAG_FORMAT`).  It goes up
#: when a cell or a run would be read differently; a file or store of another format is refused in
#: one line (:func:`format_problem`), never read half-right.
FORMAT = 2
TAG_FORMAT = "smallbatch.format"
TAG_CELL = "smallbatch.cell_id"
TAG_HASH = "smallbatch.cell_hash"
TAG_KIND = "smallbatch.kind"
TAG_STATUS = "smallbatch.status"
TAG_EXPERIMENT = "smallbatch.experiment"
TAG_BASELINE = "smallbatch.baseline"
TAG_COMMIT = "smallbatch.git_commit"
TAG_GIT_DIRTY = "smallbatch.git_dirty"  # "true" when the checkout the run's code came from had changes
TAG_PYTHON, TAG_PLATFORM = "smallbatch.python", "smallbatch.platform"
TAG_PRETRAIN = "smallbatch.pretrain"  # how pretraining ended: finished | diverged | collapsed
TAG_EXTENDED = "smallbatch.extended_from"  # "<hash> at step <n>": the shorter budget's run a cell continued
#: one writer per cell per store: the trainer that logs into a cell's run (JSON: folder, host, pid,
#: when renewed); another folder's trainer is refused while it is live (see CellRun.take_lease)
TAG_LEASE = "smallbatch.lease"
TAG_ERROR = "smallbatch.error"  # why a failed run failed (its first line)
#: the unit of a run's accuracies (every metric whose name holds top1 or top5), recorded when
#: the run is made: the pipeline logs percent; the report reads a run by its tag, never by its values
TAG_ACCURACY_UNIT = "smallbatch.accuracy_unit"
ACCURACY_UNIT = "percent"
LEASE_S = 120.0  # a lease of another host not renewed for this long is stale (its trainer is gone)
#: a cell's outcome (tag TAG_STATUS): running until both probes are logged; the bad
#: outcomes are results the report shows beside the numbers, never drops
STATUS_RUNNING, STATUS_FINISHED = "running", "finished"
BAD_STATUSES = ("diverged", "collapsed", "failed")


class TrackingError(RuntimeError):
    """The tracking store could not be reached or used; one line, names the URI."""


def format_problem(what: str, found: object, fix: str) -> str | None:
    """One line when ``found`` (a cell's ``format``, an experiment's :data:`TAG_FORMAT`) is not
    this smallbatch's :data:`FORMAT`: ``what`` names the file or store, ``fix`` how to go on."""
    if str(found) == str(FORMAT):
        return None
    return (
        f"{what} was written by another smallbatch (format {found if found is not None else 'none'}; "
        f"this one reads and writes format {FORMAT}): {fix}"
    )


#: where a SQLite store's artifacts live: this folder beside the database file.  A new experiment's
#: artifact root is MLflow's proxied ``mlflow-artifacts:/<id>`` (what ``mlflow server`` gives one),
#: never an absolute path: the tracking module resolves it against the store's own folder, and
#: ``mlflow ui`` run in that folder serves it (its default ``--artifacts-destination`` is
#: ``./mlartifacts``), so a moved or copied study folder still browses its artifacts
ARTIFACTS_DIR = "mlartifacts"
PROXIED_ROOT = "mlflow-artifacts:/"
#: MLflow 3's experiment tag that picks the UI's view of an experiment: model training
#: (``custom_model_development``: runs, parameters, metrics, charts) rather than GenAI (traces)
TAG_EXPERIMENT_KIND, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
#: a run's numeric settings also logged as metrics ``setting/<name>`` (step 0): MLflow's params are
#: strings, which its UI sorts as text (batch 128 before 16); metrics it sorts and filters as numbers
SETTING_METRIC = "setting/"
NUMERIC_SETTINGS = (
    "batch_size",
    "temperature",
    "seed",
    "negatives",
    "train.epochs",
    "train.steps",
    "train.lr",
    "train.queue_size",
    "train.extra_negatives",
    "pretrain_images",
)
TAG_NOTE = "mlflow.note.content"  # the experiment's (and a run's) description in MLflow's UI
TAG_PARENT = "mlflow.parentRunId"  # a nested run: the MLflow UI shows it under its parent
#: runs that hold no result: the report's own runs, and the parents grouping a side experiment's rows
KIND_REPORT, KIND_PARENT = "report", "parent"
NON_RESULT_KINDS = (KIND_REPORT, KIND_PARENT)


class RunVanished(TrackingError):
    """A run a cell's state refers to is not in the store (deleted or replaced store)."""


class LeaseHeld(TrackingError):
    """Another folder's live trainer logs into the cell's run (one line: who and where)."""
