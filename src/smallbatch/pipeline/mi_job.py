"""The Gaussian MI benchmark as one pipeline step: run, log to MLflow, write JSON.

Glue between :mod:`smallbatch.mi.toy` (the computation, no I/O) and
:mod:`smallbatch.tracking` (the only MLflow writer).  Each row of the grid
becomes one MLflow run of kind ``mi``:

* run name / tag ``smallbatch.cell_id``: ``mi/<estimator>/<critic>/K<K>-mi<true_mi>-s<seed>``;
* tag ``smallbatch.cell_hash``: 10 hex digits of the SHA-1 of the section's
  settings that change a row's numbers (everything but ``enabled``, ``threads``
  and the grid lists) plus the row's own keys, so a changed setting is a new
  run and adding a K or a seed leaves the other rows' runs alone;
* tag ``smallbatch.experiment = mi``;
* params: ``estimator, critic, K, negatives`` (= K), ``true_mi, seed, dim, rho,
  alpha`` (EqCo only), ``steps, lr, hidden, embed, layers, anchors,
  train_anchors, critic_temperature`` (unbounded critics: absent), ``eval_k,
  max_pairs, eval_batches``;
* metrics (step = training steps): ``mi/estimate, mi/std, mi/variance,
  mi/bias, mi/ceiling, mi/true_mi, mi/dual_estimate, mi/dual_std,
  mi/estimate_eval_k, mi/std_eval_k, mi/train_final, mi/seconds, mi/cpu_s``, and the
  training trace ``mi/train_estimate`` (window means, ``trace_points`` values
  per run);
* tag ``mlflow.parentRunId``: the section's parent run (kind ``parent``, run name and
  cell id ``mi``, hashed over the whole section), so the MLflow UI shows the rows
  nested under one run instead of beside the cells;
* status ``diverged`` for a row :func:`smallbatch.mi.toy.failed` calls a setup failure
  (non-finite loss, or an unbounded critic's readout below 0), ``finished`` otherwise.

A re-run of an interrupted step resumes the same runs (same id and hash) and
skips the steps already logged, so nothing is logged twice.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import tracking
from ..io import write_json
from ..mi import toy as mi
from ..study.config import validate_config

#: section keys that do not change a row's numbers (excluded from the run hash)
_HASH_EXCLUDE = {"enabled", "threads", "mi_values", "ks", "estimators", "critics", "seeds"}

METRIC_KEYS = (
    "estimate",
    "std",
    "variance",
    "bias",
    "ceiling",
    "true_mi",
    "dual_estimate",
    "dual_std",
    "estimate_eval_k",
    "std_eval_k",
    "train_final",
    "seconds",
    "cpu_s",
)
PARAM_KEYS = (
    "estimator",
    "critic",
    "K",
    "true_mi",
    "seed",
    "dim",
    "rho",
    "alpha",
    "steps",
    "lr",
    "hidden",
    "embed",
    "layers",
    "anchors",
    "train_anchors",
    "critic_temperature",
    "eval_k",
)


def cell_id(row: dict) -> str:
    """``mi/<estimator>/<critic>/K<K>-mi<true_mi>-s<seed>`` (true MI printed with ``%g``)."""
    return f"mi/{row['estimator']}/{row['critic']}/K{int(row['K'])}-mi{float(row['true_mi']):g}-s{int(row['seed'])}"


def row_hash(section: dict, row: dict) -> str:
    """10 hex digits of SHA-1 over the row-relevant settings of a validated section and the row keys."""
    settings = {k: v for k, v in section.items() if k not in _HASH_EXCLUDE}
    if row["estimator"] != "eqco":
        settings.pop("eqco_alpha", None)
    key = {k: row[k] for k in ("estimator", "critic", "K", "true_mi", "seed")}
    key["true_mi"] = float(key["true_mi"])
    blob = json.dumps({"section": settings, "row": key}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def parent_cell(section: dict) -> dict:
    """The tracking cell of the section's parent run: every row's run is nested under it."""
    settings = {k: v for k, v in section.items() if k not in ("enabled", "threads")}
    blob = json.dumps(settings, sort_keys=True, default=str)
    return {"id": "mi", "hash": hashlib.sha1(blob.encode()).hexdigest()[:10], "experiment": "mi"}


def cell_of(section: dict, row: dict) -> dict:
    """The tracking cell of one row: ``{'id', 'hash', 'experiment': 'mi'}``."""
    return {"id": cell_id(row), "hash": row_hash(section, row), "experiment": "mi"}


def row_params(section: dict, row: dict) -> dict[str, str]:
    params = {k: str(row[k]) for k in PARAM_KEYS if row.get(k) is not None}
    params["negatives"] = str(row["K"])
    params["max_pairs"] = str(section["max_pairs"])
    params["eval_batches"] = str(section["eval_batches"])
    return params


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and v != v:  # NaN
        return None
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return None
    return v


def validate_section(section: dict | None) -> dict:
    """The ``experiments.mi`` section validated against the config schema (the one home of
    its keys, bounds and defaults, which it fills in); ConfigError (a ValueError) naming
    the key otherwise."""
    sec = validate_config({"experiments": {"mi": dict(section or {})}})["experiments"]["mi"]
    temp = sec.get("critic_temperature")
    return {
        **sec,
        "eqco_alpha": float(sec["eqco_alpha"]),
        "lr": float(sec["lr"]),
        "critic_temperature": None if temp is None else float(temp),
    }


def run_mi_step(
    section: dict | None, out_path: str | Path, tracking_uri: str | None, experiment: str, *, progress: bool = True
) -> dict:
    """Run the ``experiments.mi`` grid, log each row as an MLflow run (unless
    ``tracking_uri`` is None) and write ``{"section": ..., "rows": [...],
    "seconds": ...}`` to ``out_path`` atomically.  Returns that dict."""
    from ..training.optim import eager_optimizers

    eager_optimizers()  # the critics' optimisers import no compiler
    sec = validate_section(section)
    t0 = time.perf_counter()
    parent = (
        tracking.open_cell_run(tracking_uri, experiment, parent_cell(sec), kind=tracking.KIND_PARENT)
        if tracking_uri
        else None
    )

    def log_row(row: dict, trace: list[tuple[int, float]]) -> None:
        assert tracking_uri is not None and parent is not None  # passed on only with a store
        run = tracking.open_cell_run(
            tracking_uri, experiment, cell_of(sec, row), kind="mi", params=row_params(sec, row), parent=parent.run_id
        )
        if run.resumed:
            run.skip_logged_steps(["mi/train_estimate"] + [f"mi/{k}" for k in METRIC_KEYS])
        for step, value in trace:
            run.log({"mi/train_estimate": value}, step)
        final_step = int(row["steps"])
        run.log({f"mi/{k}": row[k] for k in METRIC_KEYS if row.get(k) is not None}, final_step)
        run.set_status("diverged" if row.get("failed") else "finished")

    rows = mi.run_mi_experiment(sec, log_fn=log_row if tracking_uri else None, progress=progress)
    if parent is not None:
        parent.set_status("finished")
    result = {
        "section": sec,
        "rows": [{k: _json_safe(v) for k, v in r.items()} | {"cell_id": cell_id(r)} for r in rows],
        "seconds": time.perf_counter() - t0,
    }

    write_json(Path(out_path), result, allow_nan=False)
    if progress:
        print(f"[mi] wrote {len(rows)} rows to {out_path}", file=sys.stderr, flush=True)
    return result
