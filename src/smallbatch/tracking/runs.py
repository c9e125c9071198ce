"""A cell's MLflow run: found again by its cell id and hash, leased to one trainer, its metrics buffered and logged once per step."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import (
    ACCURACY_UNIT,
    LEASE_S,
    NUMERIC_SETTINGS,
    SETTING_METRIC,
    TAG_ACCURACY_UNIT,
    TAG_BASELINE,
    TAG_CELL,
    TAG_COMMIT,
    TAG_ERROR,
    TAG_EXPERIMENT,
    TAG_HASH,
    TAG_KIND,
    TAG_LEASE,
    TAG_PARENT,
    TAG_PRETRAIN,
    TAG_STATUS,
    LeaseHeld,
    RunVanished,
    TrackingError,
)
from .client import store_client, wrap
from .provenance import git_commit, package_versions, source_tags
from .sqlite import sqlite_file, store_identity
from .store import get_or_create_experiment, local_artifacts


def _lease_holder(text: str | None) -> dict | None:
    try:
        held = json.loads(text) if text else None
    except ValueError:
        return None
    return held if isinstance(held, dict) and {"folder", "host", "pid", "at"} <= set(held) else None


def _lease_live(held: dict) -> bool:
    """A lease of this host is live while its process is; another host's until LEASE_S after
    its last renewal."""
    if held["host"] == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError, OverflowError):
            pass
        return True
    return time.time() - float(held["at"]) < LEASE_S


class CellRun:
    """An MLflow run bound to one cell; buffered metric logging.

    A SQLite store's file is remembered when the run is opened: if it is deleted or
    replaced while the cell logs (``flush``, ``verify``), the run stops with one line
    instead of logging the rest of a history into a new, empty store."""

    def __init__(self, uri: str, run_id: str, client, resumed: bool, cell_id: str = ""):
        self.uri = uri
        self.run_id = run_id
        self.client = client
        self.resumed = resumed
        self.cell_id = cell_id
        self._store = store_identity(uri)
        self._buf: list = []
        self._last_flush = time.monotonic()
        self._skip_through: dict[str, int] = {}
        self._lease: dict | None = None
        self._artifact_uri: str | None = None

    # -- one writer per cell per store ---------------------------------------------
    def take_lease(self, folder: str | Path) -> None:
        """Record this process, writing into ``folder``, as the run's one trainer; LeaseHeld
        when a live trainer of another folder holds it (the folder's own lock already keeps
        two trainers of one folder apart; a stale lease is taken over)."""
        mine = {"folder": str(Path(folder).resolve()), "host": socket.gethostname(), "pid": os.getpid()}
        held = _lease_holder(self.tags().get(TAG_LEASE))
        if held and held["folder"] != mine["folder"] and _lease_live(held):
            age = time.time() - float(held["at"])
            raise LeaseHeld(
                f"cell {self.cell_id} is being trained into the MLflow store {self.uri} from another "
                f"folder, {held['folder']} (process {held['pid']} on {held['host']}, seen {age:.0f} s "
                "ago); one trainer per cell per store: let it finish, or give this study its own "
                "store or experiment"
            )
        self._lease = mine
        self._renew_lease()

    def _renew_lease(self) -> None:
        assert self._lease is not None  # take_lease set it before the first renewal
        self._lease["at"] = time.time()
        self._lease_renewed = time.monotonic()
        self.set_tags({TAG_LEASE: json.dumps(self._lease, sort_keys=True)})

    def verify(self) -> None:
        """The store is the one the run was opened in and still holds the run."""
        if self._store is not None and store_identity(self.uri) != self._store:
            raise RunVanished(
                f"the MLflow store {sqlite_file(self.uri)} was deleted or replaced while cell "
                f"{self.cell_id} was logging to it (run {self.run_id}); its history would be lost"
            )
        if not run_exists(self.client, self.uri, self.run_id):
            raise RunVanished(f"run {self.run_id} of cell {self.cell_id} is no longer in the MLflow store {self.uri}")

    # -- metrics -----------------------------------------------------------------
    def skip_logged_steps(self, keys: list[str]) -> None:
        """After a resume, do not log again the steps already in the store."""
        for key in keys:
            try:
                hist = self.client.get_metric_history(self.run_id, key)
            except Exception as exc:  # noqa: BLE001
                raise wrap(self.uri, f"reading metric history of {key}", exc) from None
            if hist:
                self._skip_through[key] = max(m.step for m in hist)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            if v is None:
                continue
            if k in self._skip_through and step <= self._skip_through[k]:
                continue
            self._buf.append(Metric(k, float(v), ts, int(step)))
        if len(self._buf) >= 900 or time.monotonic() - self._last_flush > 10:
            self.flush()

    def flush(self) -> None:
        if self._buf and self._store is not None and store_identity(self.uri) != self._store:
            self.verify()  # raises: the store file was deleted or replaced
        while self._buf:
            chunk, self._buf = self._buf[:1000], self._buf[1000:]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as exc:  # noqa: BLE001
                self._buf = chunk + self._buf
                raise wrap(self.uri, "logging metrics", exc) from None
        self._last_flush = time.monotonic()
        if self._lease is not None and self._last_flush - self._lease_renewed > LEASE_S / 4:
            self._renew_lease()

    # -- tags / status -----------------------------------------------------------
    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if TAG_PRETRAIN in tags and self._lease is not None:  # pretraining has ended: the lease goes
            tags, self._lease = {**tags, TAG_LEASE: ""}, None

        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        except Exception as exc:  # noqa: BLE001
            raise wrap(self.uri, "setting tags", exc) from None

    def set_status(self, status: str) -> None:
        """status: running | finished | diverged | failed (our tag) + MLflow's run status."""
        self.flush()
        self.set_tags({TAG_STATUS: status})
        mlflow_status = {
            "running": "RUNNING",
            "finished": "FINISHED",
            "diverged": "FINISHED",
            "collapsed": "FINISHED",
            "failed": "FAILED",
            "killed": "KILLED",
        }[status]
        try:
            if mlflow_status == "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                self.client.set_terminated(self.run_id, status=mlflow_status)
        except Exception as exc:  # noqa: BLE001
            raise wrap(self.uri, "setting run status", exc) from None

    def mark_failed(self, exc: BaseException) -> None:
        """End the run FAILED with the error's first line as the tag ``smallbatch.error`` (a
        cell that failed, in setup or later, is never left RUNNING); quiet when the store
        itself is what failed."""
        from mlflow.entities import RunTag

        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        line = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
        tags = {TAG_STATUS: "failed", TAG_ERROR: line, **({TAG_LEASE: ""} if self._lease is not None else {})}
        self._lease = None
        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            self.client.set_terminated(self.run_id, status="FAILED")
        except Exception:  # noqa: BLE001 - keep the original error
            pass

    # -- artifacts ---------------------------------------------------------------
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy the file ``path`` into the run's artifacts (under ``artifact_path``)."""
        try:
            if self._artifact_uri is None:  # asked once per run
                self._artifact_uri = self.client.get_run(self.run_id).info.artifact_uri
            repo = local_artifacts(self.uri, self._artifact_uri)
            if repo is not None:
                repo.log_artifact(str(path), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise wrap(self.uri, f"logging the artifact {Path(path).name}", exc) from None

    def log_dataset(self, name: str, digest: str, source: str, profile: dict[str, Any], context: str) -> None:
        """Record the data set the run read as an MLflow dataset input (the UI's "Dataset"
        column): ``name`` with the ``digest`` of its files, ``source`` where they were read, a
        ``profile`` of sizes and ``context`` (``training``).  Logging it again is a no-op."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        inputs = self._data_inputs()
        if any(i.dataset.name == name and i.dataset.digest == digest[:36] for i in inputs):
            return
        ds = Dataset(
            name=name,
            digest=digest[:36],  # MLflow's limit; the cell's hash holds the whole digest
            source_type="local",
            source=json.dumps({"uri": source}),
            profile=json.dumps(profile, sort_keys=True),
        )
        inputs = [DatasetInput(ds, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
        try:
            try:
                self.client.log_inputs(self.run_id, inputs)
            except Exception as exc:  # noqa: BLE001
                if not _is_duplicate(exc):
                    raise
                # a parallel job stored the same data set between MLflow's look-up and its insert
                # (the experiment's (name, digest) is unique): the second try finds it and links it
                self.client.log_inputs(self.run_id, inputs)
        except Exception as exc:  # noqa: BLE001
            raise wrap(self.uri, f"logging the data set {name}", exc) from None

    def _data_inputs(self) -> list:
        inputs = self._run("inputs").inputs
        return list(inputs.dataset_inputs) if inputs is not None else []

    def _data(self, what: str):
        return self._run(what).data

    def _run(self, what: str):
        try:
            return self.client.get_run(self.run_id)
        except Exception as exc:  # noqa: BLE001 - one line naming the store, not a traceback
            raise wrap(self.uri, f"reading the {what} of run {self.run_id}", exc) from None

    def tags(self) -> dict[str, str]:
        return dict(self._data("tags").tags)

    def metrics(self) -> dict[str, float]:
        return dict(self._data("metrics").metrics)


def _is_duplicate(exc: BaseException) -> bool:
    """Whether a store refused a write for a row that another writer stored first (SQLite's
    UNIQUE constraint, PostgreSQL's duplicate key, MySQL's duplicate entry)."""
    text = str(exc).lower()
    return any(w in text for w in ("unique constraint", "duplicate key", "duplicate entry"))


def find_runs(client, exp_id: str, cell_id: str, cell_hash: str | None) -> list:
    filt = f"tags.`{TAG_CELL}` = '{cell_id}'"
    if cell_hash:
        filt += f" and tags.`{TAG_HASH}` = '{cell_hash}'"
    return client.search_runs([exp_id], filter_string=filt, max_results=50, order_by=["attributes.start_time DESC"])


def run_exists(client, uri: str, run_id: str) -> bool:
    """Whether the store holds ``run_id`` (a failing store is a TrackingError)."""
    try:
        client.get_run(run_id)
        return True
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
            return False
        raise wrap(uri, f"reading run {run_id}", exc) from None


def open_cell_run(
    uri: str,
    experiment: str,
    cell,
    kind: str = "cell",
    params: dict[str, str] | None = None,
    run_id: str | None = None,
    fresh: bool = False,
    lease: str | Path | None = None,
    parent: str | None = None,
) -> CellRun:
    """The cell's run: ``run_id`` when given (a resumed state's run; :class:`RunVanished`
    if the store lacks it), else the newest unfinished run of the same id and hash, else a
    new one (a pretraining never reopens a finished run: a rerun of a finished cell is a new run);
    ``fresh`` always creates a new run (a restarted cell: its history starts again).
    ``lease``: the folder a trainer writes into; the run is leased to it
    (:meth:`CellRun.take_lease`: :class:`LeaseHeld` when another folder's trainer holds it).
    ``parent``: the run id this one is nested under (tag ``mlflow.parentRunId``).
    ``cell``: what :func:`run_key` reads."""
    run = _open_cell_run(uri, experiment, cell, kind, params, run_id, fresh, parent)
    if lease is not None:
        run.take_lease(lease)
    return run


def run_key(owner) -> tuple[str, str, str, str]:
    """(id, hash, experiment, baseline) naming a run: of a Cell or BaselineCell
    (:mod:`smallbatch.study.cell`), or of the JSON object of a run that is not a cell's (an MI row,
    the report, their parent runs: ``id`` and ``hash``, optionally ``experiment``)."""
    if isinstance(owner, Mapping):
        return owner["id"], owner["hash"], owner.get("experiment", "grid"), owner.get("baseline", "")
    return owner.id, owner.hash, owner.experiment, getattr(owner, "baseline", "")


def _open_cell_run(
    uri: str,
    experiment: str,
    cell,
    kind: str,
    params: dict[str, str] | None,
    run_id: str | None,
    fresh: bool,
    parent: str | None = None,
) -> CellRun:
    cid, chash, cexp, baseline = run_key(cell)
    exp_id = get_or_create_experiment(uri, experiment)
    client = store_client(uri)
    if run_id is not None:
        if not run_exists(client, uri, run_id):
            raise RunVanished(f"run {run_id} of cell {cid} is not in the MLflow store {uri}")
        return CellRun(uri, run_id, client, resumed=True, cell_id=cid)
    try:
        runs = [] if fresh else find_runs(client, exp_id, cid, chash)
        if runs and (kind != "cell" or runs[0].info.status != "FINISHED"):
            run = CellRun(uri, runs[0].info.run_id, client, resumed=True, cell_id=cid)
            if parent and runs[0].data.tags.get(TAG_PARENT) != parent:
                run.set_tags({TAG_PARENT: parent})
            return run
        tags = {
            TAG_CELL: cid,
            TAG_HASH: chash,
            TAG_KIND: kind,
            TAG_EXPERIMENT: cexp,
            TAG_STATUS: "running",
            TAG_ACCURACY_UNIT: ACCURACY_UNIT,
            TAG_COMMIT: git_commit(),
            **package_versions(),
            **source_tags(),
        }
        if kind == "baseline":
            tags[TAG_BASELINE] = baseline
        if parent:
            tags[TAG_PARENT] = parent
        created = client.create_run(exp_id, run_name=cid, tags=tags)
        run = CellRun(uri, created.info.run_id, client, resumed=False, cell_id=cid)
        if params:
            _log_params(client, run.run_id, params)
        return run
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise wrap(uri, f"opening the run of cell {cid}", exc) from None


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    """A new run's params, and its numeric settings also as metrics (:data:`NUMERIC_SETTINGS`), which
    MLflow's UI sorts as numbers."""
    from mlflow.entities import Metric, Param

    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])
    ts = int(time.time() * 1000)
    numbers = [
        Metric(SETTING_METRIC + k, x, ts, 0) for k in NUMERIC_SETTINGS if (x := _number(params.get(k))) is not None
    ]
    if numbers:
        client.log_batch(run_id, metrics=numbers)


def _number(text: str | None) -> float | None:
    """A param's value as a finite number; None for text, None, a bool or a list."""
    try:
        x = float(text) if text not in (None, "True", "False") else None
    except (TypeError, ValueError):
        return None
    return x if x is not None and x == x and abs(x) != float("inf") else None


def find_cell_run(uri: str, experiment: str, cell) -> CellRun:
    """The existing run of a cell (for evaluation steps); error if pretraining never logged."""
    cid, chash, _, _ = run_key(cell)
    exp_id = get_or_create_experiment(uri, experiment)
    client = store_client(uri)
    try:
        runs = find_runs(client, exp_id, cid, chash)
    except Exception as exc:  # noqa: BLE001
        raise wrap(uri, f"searching the run of cell {cid}", exc) from None
    if not runs:
        raise TrackingError(
            f"no MLflow run for cell {cid} (hash {chash}) in experiment "
            f"'{experiment}' at {uri}: run `smallbatch pretrain` for it first"
        )
    return CellRun(uri, runs[0].info.run_id, client, resumed=True, cell_id=cid)


def count_cell_runs(uri: str, experiment: str, cell_id: str) -> int:
    exp_id = get_or_create_experiment(uri, experiment)
    client = store_client(uri)
    return len(find_runs(client, exp_id, cell_id, None))
