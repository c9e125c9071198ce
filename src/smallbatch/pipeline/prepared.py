"""A cell's evaluation run by its pretraining process, ready for its evaluate step.

The workflow runs a cell as two jobs, ``pretrain`` (writes ``checkpoint.pt``) and
``evaluate`` (embed + kNN + linear probe; writes ``knn.json`` and ``linear.json``), so a
failed or changed evaluation never costs the pretraining.  Each job is a process that
pays torch's, torch._dynamo's and MLflow's imports and the MLflow client's set-up before
any work (~6 s per evaluate process on this 2-core machine, a quarter of a default cell).

``smallbatch pretrain --evaluate-ahead`` therefore evaluates the checkpoint it has just
written in the same process, with the same code as ``smallbatch evaluate``
(:func:`smallbatch.pipeline.jobs.run_evaluate`: the same files, the same MLflow metrics), into
``<cell>/evaluated/`` — never into the evaluate job's own outputs, which Snakemake
removes before it runs that job — and writes :data:`STAMP` last.  The evaluate job then
*adopts* those files (:func:`adopt`) without importing torch or MLflow, when the stamp
says they were computed from

* the same checkpoint file (its SHA-1),
* the same cell (its JSON, every key but ``threads``), and
* the same tracking store and experiment (so the metrics are already logged there), which
  still holds the cell's run with the probes' metrics (checked read-only: SQLite directly,
  other stores through MLflow);

and the probes' files are the ones stamped (their SHA-1s, their cell id); otherwise it
evaluates as before.  A failure of the evaluation ahead leaves no stamp and
does not fail the pretraining; the evaluate job then runs it and reports it.

Imports nothing heavy: this module is on the evaluate job's fast path.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..io import atomic_write, write_json

EVAL_DIR = "evaluated"  # in the cell's folder
STAMP = "stamp.json"  # written last: its presence means the probes' files are complete
PROBES = ("knn", "linear")  # the files the evaluate step writes (steps.run_evaluate), one per probe
_NOT_COMPARED = ("threads",)  # how many threads ran the probes does not change their results


def file_sha1(path: str | Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cell_key(cell: dict) -> dict:
    return {k: v for k, v in cell.items() if k not in _NOT_COMPARED}


def eval_dir(cell_dir: str | Path) -> Path:
    return Path(cell_dir) / EVAL_DIR


def clear(cell_dir: str | Path) -> None:
    """Remove the stamp (before a new evaluation ahead: a half-written one never counts)."""
    (eval_dir(cell_dir) / STAMP).unlink(missing_ok=True)


def write_stamp(
    cell_dir: str | Path,
    cell: dict,
    checkpoint_sha1: str,
    tracking_uri: str | None,
    experiment: str,
    embed_seconds: float,
) -> Path:
    """Mark ``<cell>/evaluated/`` complete (after both probes' files are written), for the
    checkpoint whose SHA-1 (:func:`file_sha1`) was taken before it was evaluated."""
    probes = {kind: file_sha1(eval_dir(cell_dir) / f"{kind}.json") for kind in PROBES}
    stamp = {
        "cell": _cell_key(cell),
        "checkpoint_sha1": checkpoint_sha1,
        "tracking_uri": tracking_uri,
        "experiment": experiment,
        "embed_seconds": embed_seconds,
        "probes": probes,
    }
    return write_json(eval_dir(cell_dir) / STAMP, stamp)


def _stamp_problem(stamp: dict, cell: dict, checkpoint: Path, tracking_uri: str | None, experiment: str) -> str | None:
    """Why the prepared files may not be adopted (None: they may)."""
    if stamp.get("cell") != json.loads(json.dumps(_cell_key(cell))):
        return "they were computed for other cell settings"
    if (stamp.get("tracking_uri"), stamp.get("experiment")) != (tracking_uri, experiment):
        return "they were logged to another tracking store or experiment"
    if not checkpoint.is_file() or stamp.get("checkpoint_sha1") != file_sha1(checkpoint):
        return f"they were computed from another checkpoint than {checkpoint}"
    return None


def _files_problem(stamp: dict, cell: dict, texts: dict[str, bytes], results: dict) -> str | None:
    """The probes' files are the ones the stamp was written for, of this cell."""
    for kind in PROBES:
        if (stamp.get("probes") or {}).get(kind) != hashlib.sha1(texts[kind]).hexdigest():
            return f"{kind}.json is not the file the stamp was written for"
        if not isinstance(results[kind], dict) or results[kind].get("cell_id") != cell["id"]:
            return f"{kind}.json holds the results of another cell"
    return None


def _store_problem(cell: dict, tracking_uri: str | None, experiment: str) -> str | None:
    """The store still holds the cell's run (id and hash) with the probes' metrics."""
    if tracking_uri is None:
        return None
    try:
        held = (
            _sqlite_holds(tracking_uri, experiment, cell)
            if tracking_uri.startswith("sqlite:///")
            else _store_holds(tracking_uri, experiment, cell)
        )
    except Exception as exc:  # noqa: BLE001 - unreadable store: evaluate (and let that say what fails)
        return f"the store could not be read ({type(exc).__name__})"
    return None if held else f"the store {tracking_uri} no longer holds the cell's run with its probes' metrics"


def _sqlite_holds(uri: str, experiment: str, cell: dict) -> bool:
    import sqlite3

    path = Path(uri[len("sqlite:///") :].split("?", 1)[0])
    if not path.is_file():
        return False
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = con.execute(
            "select count(*) from runs r join experiments e on e.experiment_id = r.experiment_id "
            "join tags a on a.run_uuid = r.run_uuid and a.key = 'smallbatch.cell_id' and a.value = ? "
            "join tags h on h.run_uuid = r.run_uuid and h.key = 'smallbatch.cell_hash' and h.value = ? "
            "join latest_metrics m on m.run_uuid = r.run_uuid and m.key = 'knn/top1' "
            "where e.name = ? and r.lifecycle_stage = 'active'",
            (cell["id"], cell["hash"], experiment),
        ).fetchone()
    finally:
        con.close()
    return bool(row and row[0])


def _store_holds(uri: str, experiment: str, cell: dict) -> bool:
    from ..tracking import find_cell_run

    return "knn/top1" in find_cell_run(uri, experiment, cell).metrics()


def adopt(
    cell: dict, checkpoint: str | Path, out_dir: str | Path, tracking_uri: str | None, experiment: str
) -> dict | None:
    """Copy ``<cell>/evaluated/{knn,linear}.json`` (the checkpoint's folder) to ``out_dir``
    when :data:`STAMP` matches (see the module docstring); return the evaluate step's
    summary, or None (with the reason on stderr when a stamp exists) to evaluate afresh."""
    checkpoint = Path(checkpoint)
    src = eval_dir(checkpoint.parent)
    try:
        stamp = json.loads((src / STAMP).read_text())
        texts = {kind: (src / f"{kind}.json").read_bytes() for kind in PROBES}
        results = {kind: json.loads(texts[kind]) for kind in PROBES}
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"{src}: not adopted ({exc}); evaluating", file=sys.stderr)
        return None
    problem = (
        _stamp_problem(stamp, cell, checkpoint, tracking_uri, experiment)
        or _files_problem(stamp, cell, texts, results)
        or _store_problem(cell, tracking_uri, experiment)
    )
    if problem:
        print(f"{src}: not adopted ({problem}); evaluating", file=sys.stderr)
        return None
    for kind in PROBES:
        atomic_write(Path(out_dir) / f"{kind}.json", lambda fh, data=texts[kind]: fh.write(data))
    return {"adopted": str(src), "embed_seconds": stamp.get("embed_seconds"), **results}
