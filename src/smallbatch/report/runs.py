"""The runs the report reads: loading (through :mod:`smallbatch.tracking`), the newest-run
rule, the cell selection, and the one labelling rule for a loss in every table."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..losses.registry import canonical_name, display_name, label_defaults
from ..study.probe_registry import all_specs as probe_specs
from ..study.probe_registry import probe_spec, report_labels, report_metrics
from ..tracking import (
    BAD_STATUSES,
    NON_RESULT_KINDS,
    STATUS_RUNNING,
    TAG_ACCURACY_UNIT,
    TAG_BASELINE,
    TAG_CELL,
    TAG_EXPERIMENT,
    TAG_HASH,
    TAG_KIND,
    StoreReader,
)
from .fmt import ABSENT

#: short metric name (the probe's) -> MLflow metric key of its headline metric, for the probes
#: every study runs (smallbatch.study.probe_registry: the final top-1 accuracies)
METRICS = report_metrics()
#: every probe's headline label, by its short name
METRIC_LABELS = report_labels()


def metric_label(runs: pd.DataFrame, probe: str) -> str:
    """The label of ``probe``'s headline metric over ``runs``, naming the setting it was read at
    where the probe logs one (its registry ``qualifier``): ``kNN top-1 (k = 20)``; several values:
    each (``k = 20, 200``)."""
    spec = probe_spec(probe)
    col = f"metrics.{probe}/{spec.qualifier}"
    if not spec.qualifier or col not in runs:
        return spec.label
    values = sorted({int(v) if float(v).is_integer() else v for v in runs[col].dropna()})
    return f"{spec.label} ({spec.qualifier} = {', '.join(map(str, values))})" if values else spec.label


def shown_metrics(runs: pd.DataFrame) -> dict[str, str]:
    """:data:`METRICS` and each other probe's headline key that some run of ``runs`` logged (an
    opt-in probe of ``eval.probes``): the metrics a table of these runs lists, in registry order."""

    def logged(key: str) -> bool:
        return f"metrics.{key}" in runs and bool(runs[f"metrics.{key}"].notna().any())

    return {n: s.key for n, s in probe_specs().items() if n in METRICS or logged(s.key)}


#: the params that define a cell (with a section's own axes); the others may label it
CELL_KEYS = ("dataset", "loss", "batch_size", "temperature")
#: params that never tell two cells apart on their own (grid axes, seed, derived values)
NOT_AXIS = {
    "dataset",
    "loss",
    "batch_size",
    "temperature",
    "seed",
    "negatives",
    "experiment",
    "device",
    "threads",
    "pretrain_images",
    "data_root",
    "download",
    "data_digest",
}
_GREEK = {"alpha": "α", "sigma": "σ", "gamma": "γ"}


def report_param(key: str) -> str:
    """The report's name of a logged param (:func:`smallbatch.study.cells.flat_params`): a train
    setting without its ``train.`` prefix (``train.lr`` -> ``lr``), the name its tables, labels
    and the ``smallbatch.results`` frame give it."""
    return key[len("train.") :] if key.startswith("train.") else key


def _canonical(v: Any) -> str | None:
    if not isinstance(v, str):
        return None
    try:
        return canonical_name(v)
    except ValueError:  # a loss the registry does not know keeps its own name
        return v.strip().lower()


def run_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per run (a record of :meth:`StoreReader.runs`).

    Columns: ``run_id, run_name, cell_id, cell_hash, kind, status, section, baseline, start_time,
    metric_keys`` (frozenset of logged metric keys), ``params.<key>`` (strings),
    ``metrics.<key>`` (latest value), and typed ``dataset, loss, batch_size,
    temperature, seed``; sorted by section, kind, cell id, start time.
    """
    rows = []
    for r in records:
        tags, params = r["tags"], r["params"]
        row = {
            "run_id": r["run_id"],
            "run_name": r["run_name"],
            "cell_id": tags.get(TAG_CELL) or r["run_name"] or r["run_id"],
            "cell_hash": tags.get(TAG_HASH),
            "kind": tags.get(TAG_KIND) or "cell",
            "status": r["status"],
            "section": tags.get(TAG_EXPERIMENT) or "grid",
            "baseline": tags.get(TAG_BASELINE) or params.get("baseline"),
            "start_time": r["start_time"],
            "metric_keys": frozenset(r["metrics"]),
            "accuracy_unit": tags.get(TAG_ACCURACY_UNIT) or DEFAULT_UNIT,
        }
        row.update({f"params.{report_param(k)}": v for k, v in params.items()})
        row.update({f"metrics.{k}": v for k, v in r["metrics"].items()})
        rows.append(row)
    df = pd.DataFrame(rows)
    df["dataset"] = df.get("params.dataset", pd.Series(index=df.index, dtype=object))
    df["loss"] = df.get("params.loss", pd.Series(index=df.index, dtype=object)).map(_canonical)
    for col in ("batch_size", "seed", "temperature"):
        num = pd.to_numeric(df.get(f"params.{col}", pd.Series(index=df.index, dtype=object)), errors="coerce")
        whole = num.where(num == num.round())  # '16.5' is no batch size of 16: no value (checked_params says so)
        df[col] = num.astype(float) if col == "temperature" else whole.astype("Int64")
    df = df.sort_values(["section", "kind", "cell_id", "start_time", "run_id"], kind="stable")
    return df.reset_index(drop=True)


def load_runs(reader, experiment: str | None, notes: list[str] | None = None) -> tuple[pd.DataFrame, str]:
    """All active runs of one experiment that hold results (see :func:`run_frame`), their
    accuracies in percent and checked (:func:`checked_accuracies`; a line per run it marks
    failed is appended to ``notes``), and the experiment's name: the report's own runs and the
    parents grouping a side experiment's rows (:data:`smallbatch.tracking.NON_RESULT_KINDS`)
    are left out.

    ValueError for a missing or empty experiment.
    """
    exp_id, name = reader.experiment(experiment)
    records = [r for r in reader.runs(exp_id) if r["tags"].get(TAG_KIND) not in NON_RESULT_KINDS]
    if not records:
        raise ValueError(f"no runs in experiment {name!r} at URI {reader.uri!r}")
    return checked_params(checked_accuracies(run_frame(records), notes), notes), name


#: a cell id's batch size and seed (``.../bs16-t0.1-s0[-axes]``)
_ID_PARTS = {"batch_size": re.compile(r"(?:^|/)bs(\d+)-"), "seed": re.compile(r"-s(\d+)(?:-|$)")}


def checked_params(runs: pd.DataFrame, notes: list[str] | None = None) -> pd.DataFrame:
    """``runs`` without those still RUNNING (training, or killed before they ended: their
    metrics are not final), and with each run whose ``batch_size`` or ``seed`` is not a whole
    number, or not the one its cell id names, marked ``failed`` (a store edited by hand: it
    would be averaged into another cell or counted as another seed); a line in ``notes`` per run."""
    running = runs["status"] == STATUS_RUNNING
    lines = [
        f"Run {runs.at[i, 'run_id']} (cell {runs.at[i, 'cell_id']}) is still running (or was killed before it "
        "ended): its metrics are not counted."
        for i in runs.index[running]
    ]
    runs = runs[~running].copy()
    for i in runs.index:
        problem = _param_problem(runs.loc[i])
        if problem and runs.at[i, "status"] not in BAD_STATUSES:
            runs.at[i, "status"] = "failed"
            lines.append(
                f"Run {runs.at[i, 'run_id']} (cell {runs.at[i, 'cell_id']}) {problem}: counted as a failed run."
            )
    if notes is not None:
        notes += lines
    return runs


def _param_problem(run: pd.Series) -> str | None:
    for key, pattern in _ID_PARTS.items():
        text = run.get(f"params.{key}")
        if absent(text):
            continue
        if pd.isna(run[key]) or run[key] < 0:
            return f"logged {key} = {text!r}, not a whole number"
        m = pattern.search(str(run["cell_id"])) if run["kind"] == "cell" else None
        if m and int(m.group(1)) != run[key]:
            return f"logged {key} = {text!r}, but its cell id names {m.group(1)}"
    return None


#: run_frame's columns for the report's own bookkeeping, left out of :func:`results`
#: (the logged metric keys; the accuracy unit, which load_runs has turned into percent)
INTERNAL_COLUMNS = ("metric_keys", "accuracy_unit")


def results(tracking_uri: str, experiment: str | None = None) -> pd.DataFrame:
    """A study's runs from its MLflow store, one row per cell or baseline run: what the
    report reads (:func:`load_runs`), as ``smallbatch.results(tracking_uri, experiment)``.

    Columns: ``cell_id, kind`` ("cell" or "baseline"), ``status, section, baseline``, the typed
    settings ``dataset, loss, batch_size, temperature, seed``, every logged setting as
    ``params.<key>`` (text) and every final metric as ``metrics.<key>`` (accuracies in
    percent); ``run_id, run_name, start_time``.  ``experiment`` None: 'smallbatch' or the
    store's only experiment.  A run whose accuracies are not valid is marked ``failed``, with
    a warning naming it.  ValueError for a missing or empty experiment;
    :class:`smallbatch.tracking.TrackingError` for a store that cannot be read.
    """
    if not isinstance(tracking_uri, (str, os.PathLike)):
        raise ValueError(
            f"smallbatch.results needs the study's tracking URI, e.g. 'sqlite:///results/mlflow.db', not {tracking_uri!r}"
        )
    notes: list[str] = []
    runs, _ = load_runs(StoreReader(os.fspath(tracking_uri)), experiment, notes)
    for note in notes:
        warnings.warn(note, stacklevel=2)
    return runs.drop(columns=list(INTERNAL_COLUMNS))


#: the unit of a run's accuracies by its tag (smallbatch.tracking.TAG_ACCURACY_UNIT) -> the factor
#: to percent; a run without the tag was logged by a version that always logged percent
UNIT_FACTORS = {"percent": 1.0, "fraction": 100.0}
DEFAULT_UNIT = "percent"
ACCURACY_RANGE = (0.0, 100.0)


def accuracy_columns(runs: pd.DataFrame) -> list[str]:
    """The metric columns that are accuracies (their name holds top1 or top5, as the pipeline's)."""
    return [c for c in runs.columns if c.startswith("metrics.") and re.search(r"top[15]", c)]


def checked_accuracies(runs: pd.DataFrame, notes: list[str] | None = None) -> pd.DataFrame:
    """``runs`` with every accuracy in percent by its run's recorded unit (never guessed from
    the values), and each run whose unit is unknown, or that logged an accuracy that is not
    a finite number in [0, 100], marked ``failed``: it gives no number, it is listed with the
    failed runs, and a line in ``notes`` says which value (never silently dropped)."""
    runs = runs.copy()
    factor = runs["accuracy_unit"].map(UNIT_FACTORS)
    problems = pd.Series(
        [f"records its accuracies in {u!r}, not {' or '.join(UNIT_FACTORS)}" for u in runs["accuracy_unit"]],
        index=runs.index,
    ).where(factor.isna())
    lo, hi = ACCURACY_RANGE
    for col in accuracy_columns(runs):
        key = col[len("metrics.") :]
        logged = runs["metric_keys"].map(lambda keys, key=key: key in keys) & factor.notna()
        runs.loc[logged, col] = runs.loc[logged, col].astype(float) * factor[logged]
        values = runs[col].astype(float)
        bad = logged & ~(np.isfinite(values) & (values >= lo) & (values <= hi)) & problems.isna()
        problems[bad] = [f"logged {key} = {v:g}, not an accuracy in [{lo:g}, {hi:g}] %" for v in values[bad]]
    flagged = problems.notna() & ~runs["status"].isin(BAD_STATUSES)
    runs.loc[flagged, "status"] = "failed"
    if notes is not None:
        notes += [
            f"Run {runs.at[i, 'run_id']} (cell {runs.at[i, 'cell_id']}) {problems[i]}: counted as a failed run."
            for i in runs.index[flagged]
        ]
    return runs


#: what tells one cell's runs from another's: the newest-run rule keeps one run per key
RUN_KEY = ["kind", "section", "cell_id"]


def holds_results(runs: pd.DataFrame) -> pd.Series:
    """Whether each run holds a result: any outcome but a failure (a diverged or collapsed run
    is a result; a run that failed, such as a rerun that crashed, holds none)."""
    return runs["status"] != "failed"


def newest(runs: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The newest run that holds results (:func:`holds_results`) per (kind, section, cell id),
    or the newest run where none of the cell's does, in the frame's order; and how many runs
    were left out (:func:`failed_attempts` lists the failed ones newer than the run kept)."""
    if runs.empty:
        return runs, 0
    order = runs.assign(_holds=holds_results(runs)).sort_values(["_holds", "start_time"], kind="stable")
    keep = order.groupby(RUN_KEY, sort=False).tail(1)
    return runs.loc[sorted(keep.index)], len(runs) - len(keep)


def failed_attempts(runs: pd.DataFrame) -> pd.DataFrame:
    """The failed runs started after the run :func:`newest` keeps of their cell (a rerun that
    crashed after a run that holds results): failed runs of the study, not in its tables."""
    kept, _ = newest(runs)
    started = runs[RUN_KEY].merge(kept[[*RUN_KEY, "start_time"]], on=RUN_KEY, how="left")["start_time"]
    later = ~holds_results(runs) & (runs["start_time"].to_numpy() > started.to_numpy())
    return runs[later & ~runs.index.isin(kept.index)]


def absent(v: Any) -> bool:
    """A param that was not set: missing, NaN, or logged as '', 'None', 'nan', 'null'."""
    return v is None or (isinstance(v, float) and math.isnan(v)) or str(v).strip().lower() in ABSENT


def param(df: pd.DataFrame, key: str) -> pd.Series:
    """Param column as strings, None where absent."""
    col = df.get(f"params.{key}")
    if col is None:
        return pd.Series([None] * len(df), index=df.index, dtype=object)
    return col.map(lambda v: None if absent(v) else str(v)).astype(object)


def param_num(df: pd.DataFrame, key: str) -> pd.Series:
    return pd.to_numeric(param(df, key), errors="coerce").astype(float)


def optimiser_steps(runs: pd.DataFrame) -> pd.Series:
    """Each run's optimiser steps: ``train/steps`` where logged, else epochs × ⌈pretrain_images / B⌉ (NaN
    where neither is known).  At a fixed number of epochs a smaller batch takes more steps."""
    logged = pd.to_numeric(runs.get("metrics.train/steps", pd.Series(np.nan, index=runs.index)), errors="coerce")
    b = pd.to_numeric(runs["batch_size"], errors="coerce").astype(float)
    planned = param_num(runs, "epochs") * np.ceil(param_num(runs, "pretrain_images") / b)
    return logged.astype(float).where(np.isfinite(logged.astype(float)), planned)


# --------------------------------------------------------------------------- labels
def _is_default(loss: Any, key: str, v: Any) -> bool:
    try:
        default = label_defaults(str(loss)).get(key, "∅")
    except ValueError:  # a loss the registry does not know: no defaults
        return False
    if default is None:
        return absent(v)
    try:
        return float(v) == float(default)
    except (TypeError, ValueError):
        return str(v) == str(default)


def _varying(grp: pd.DataFrame, pcols: list[str], keys: list[str]) -> set[str]:
    """The param columns with more than one value among runs equal in ``keys``."""
    if len(grp) < 2:
        return set()
    filled = grp[pcols].fillna("∅").astype(str)
    kg = grp[keys].astype(object).fillna("∅").astype(str).agg("|".join, axis=1)
    return {c for c in pcols if filled[c].groupby(kg).nunique().max() > 1}


def _loss_param_text(loss: Any, col: str, v: Any, varying: bool) -> str | None:
    p = col[len("params.loss.") :]
    if absent(v) or not (varying or not _is_default(loss, p, v)):
        return None
    try:
        return f"{_GREEK.get(p, p)}={float(v):g}"
    except (TypeError, ValueError):
        return f"{p}={v}"


def cell_labels(cells: pd.DataFrame, axes: Sequence[str] = ()) -> pd.Series:
    """Display label per run, one rule for every table.

    The loss's display name, then in parentheses its parameters that differ from
    the registry's default (as the cell id's loss part does) or vary between
    otherwise equal cells (``σ=1``, ``α=256``), then any other param that varies
    between runs equal in dataset, loss, batch size, temperature, seed and ``axes``
    (an extra axis: ``epochs=40``).  ``axes`` are the params a section varies on
    purpose (``precision``; a name also covers its dotted sub-params).
    """

    def on_axis(c: str) -> bool:
        k = c[len("params.") :]
        return any(k == a or k.startswith(f"{a}.") for a in axes)

    pcols = [
        c for c in cells.columns if c.startswith("params.") and c[len("params.") :] not in NOT_AXIS and not on_axis(c)
    ]
    keys = [*CELL_KEYS, "seed", *(f"params.{a}" for a in axes if f"params.{a}" in cells.columns)]
    labels = pd.Series(index=cells.index, dtype=object)
    for loss, grp in cells.groupby("loss", sort=True, dropna=False):
        varying = _varying(grp, pcols, keys)
        loss_cols = sorted(c for c in pcols if c.startswith("params.loss."))
        other = sorted(c for c in varying if not c.startswith("params.loss."))
        for idx, row in grp.iterrows():
            extra = [t for c in loss_cols if (t := _loss_param_text(loss, c, row[c], c in varying))]
            extra += [f"{c[len('params.') :]}={row[c]}" for c in other]
            base = display_name(loss) if isinstance(loss, str) else "?"
            labels[idx] = f"{base} ({', '.join(extra)})" if extra else base
    return labels


# --------------------------------------------------------------------------- selection
def select_cells(
    runs: pd.DataFrame, section: str, axes: Sequence[str] = (), notes: list[str] | None = None
) -> pd.DataFrame:
    """The runs of kind 'cell' tagged with ``section``: newest per cell id, those with every
    param of :data:`CELL_KEYS`, an integer ``batch_size`` and a ``label`` (:func:`cell_labels`).

    The lines about the runs left out are appended to ``notes`` (index.md's notes).
    """
    mine = runs[(runs["kind"] == "cell") & (runs["section"] == section)]
    c, left_out = newest(mine)
    crashed = len(failed_attempts(mine))
    ok = c[list(CELL_KEYS)].notna().all(axis=1)
    what = "grid" if section == "grid" else f"'{section}'"
    if notes is not None and left_out > crashed:
        notes.append(
            f"{left_out - crashed} {what} run(s) were superseded by a newer run of the same cell id "
            "(changed config) and are not in the tables."
        )
    if notes is not None and crashed:
        notes.append(
            f"{crashed} {what} run(s) failed after a run of the same cell id that holds results (a rerun "
            "that crashed): listed with the failed runs; the tables keep the earlier run."
        )
    if notes is not None and (~ok).any():
        notes.append(
            f"{int((~ok).sum())} {what} run(s) lack one of the params dataset/loss/batch_size/temperature "
            "and are not in the tables."
        )
    c = c[ok].copy()
    c["label"] = cell_labels(c, axes) if len(c) else pd.Series(dtype=object)
    c["batch_size"] = c["batch_size"].astype(int)
    return c
