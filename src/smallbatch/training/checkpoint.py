"""The files pretraining writes, in one place: ``state.pt``, ``checkpoint.pt`` and the snapshots.

* ``state.pt`` (``kind: "state"``) — everything a rerun needs to continue a cell and end
  with the weights of an uninterrupted run: model, optimiser, negatives source (queue,
  momentum encoder), grad scaler, temperature, step, wall time, and the MLflow run it
  logs to.  Written atomically after every epoch and on SIGTERM, never after a
  non-finite loss.  It also names the cell's trajectory (its settings less its budget, when its
  steps do not depend on the budget), so a longer budget of the cell continues it
  (:func:`read_state`) and takes over its snapshots (:func:`earlier_snapshots`).
* ``checkpoint.pt`` (``kind: "checkpoint"``) — the finished cell: the model, the cell it
  belongs to (id, hash, settings), how training ended and what the probes need to embed.

* ``snapshots/ep<e>.pt`` (``kind: "snapshot"``, ``train.snapshot_epochs``) — the weights after
  ``round(e x steps per epoch)`` steps, and that *budget* (its name, epochs, steps, images
  seen); written at that step, before any state after it (a resumed run rewrites it, the same).

Each carries the cell's id and hash; :func:`load_checkpoint` refuses, in one line, a file
of another cell, another config of the cell, or another kind, and :func:`load_snapshot` a
snapshot of another budget.

Random numbers are not state: every random draw of a step comes from a generator
seeded by (cell seed, stream, step or epoch) (:class:`StepRandom`), so a state saved
on one device resumes on another — a state saved on CUDA resumes on a CPU-only
machine (the random streams of the two device types differ, so the rest of that run
differs from an uninterrupted CUDA run, as any cross-device run does).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..io import path_kind, read_problem, save_torch
from ..study.cell import Cell, snapshot_name, snapshot_steps  # noqa: F401  (the snapshots' names and steps: one rule, in cell)
from ..study.cells import trajectory_hash
from ..study.checks import budget_dependence

STATE_VERSION = 2
KINDS = ("state", "checkpoint", "snapshot")


def load_checkpoint(
    path: str | Path, map_location: Any = "cpu", *, cell: Cell | None = None, kind: str | None = None
) -> dict:
    """Load a state or checkpoint file; one-line :class:`CheckpointError` if it is missing,
    corrupt, not ours, of the other ``kind``, or (with ``cell``) of another cell or
    another config of it."""
    path = Path(path)
    problem = read_problem(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} {problem}")
    obj = _load_weights_only(path, map_location)
    if not isinstance(obj, dict) or "model" not in obj:
        raise CheckpointError(f"checkpoint {path} is not a smallbatch checkpoint (no 'model' entry)")
    found = obj.get("kind", "state" if "step" in obj else "checkpoint")
    if kind is not None and found != kind:
        what = {
            "state": "a training state (state.pt: training has not finished)",
            "checkpoint": "a finished checkpoint",
            "snapshot": "a snapshot of a budget on the way (snapshots/ep<e>.pt)",
        }
        raise CheckpointError(f"{path} is {what[found]}, not {what[kind]}")
    if cell is not None:
        check_cell(obj, cell, path)
    return obj


def _load_weights_only(path: Path, map_location: Any) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors, containers and plain values only
    (every part of a state or checkpoint is one of these), so no file can run code when it is
    read; anything else (a pickled object, a truncated zip) is a one-line CheckpointError."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        blocked = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        what = f" ({blocked[0][:120]})" if blocked else ""
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain values{what}; "
            "refused, as loading it could run code"
        ) from None
    except Exception as exc:  # noqa: BLE001 - truncated zip, bad header, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({first[:160]})") from None


def check_cell(obj: dict, cell: Cell, path: str | Path) -> None:
    """The file's cell id and hash are the cell's (one-line CheckpointError otherwise)."""
    fid = obj.get("cell_id") or (obj.get("cell") or {}).get("id")
    fhash = obj.get("cell_hash") or (obj.get("cell") or {}).get("hash")
    if fid != cell.id:
        raise CheckpointError(f"{path} belongs to cell {fid!r}, not to {cell.id!r}")
    if fhash != cell.hash:
        raise CheckpointError(
            f"{path} belongs to another config of cell {cell.id} (hash {fhash}, this config's is {cell.hash})"
        )


def save_state(path: Path, cell: Cell, **parts: Any) -> None:
    """Write ``state.pt``: the cell's id/hash, its trajectory and ``parts`` (model, optimizer, ..., step)."""
    trajectory = None if budget_dependence(cell) else trajectory_hash(cell.to_dict())
    save_torch(
        path,
        {
            "kind": "state",
            "version": STATE_VERSION,
            "cell_id": cell.id,
            "cell_hash": cell.hash,
            "trajectory": trajectory,
            **parts,
        },
    )


def read_state(path: Path, cell: Cell, total_steps: int | None = None) -> dict | None:
    """The cell's resumable state, or None (with the reason on stderr) when ``state.pt``
    is absent, of another config of the cell, or of an older format; a corrupt file is a
    CheckpointError naming it.  A state of a shorter budget of the cell (another config with
    the same trajectory, at most ``total_steps`` steps in) is returned with ``extends``: the
    hash of the config it was written for, whose run this cell continues."""
    kind = path_kind(path)
    if kind is None:
        return None
    if kind != "a regular file":
        raise CheckpointError(f"state {path} is {kind}, not a file; remove it (the cell then starts afresh)")
    st = _load_state(path)
    if st.get("version") != STATE_VERSION:
        print(
            f"state {path} was written by an older smallbatch (format {st.get('version')}); starting afresh",
            file=sys.stderr,
        )
        return None
    if st.get("cell_hash") == cell.hash:
        return st
    why = _extension_problem(st, cell, total_steps)
    if why is not None:
        print(f"state {path} belongs to another config of this cell{why}; starting afresh", file=sys.stderr)
        return None
    return {**st, "extends": st["cell_hash"]}


def _extension_problem(st: dict, cell: Cell, total_steps: int | None) -> str | None:
    """None when ``st`` is this cell's run at a shorter budget; else why not ("" when the
    configs differ in more than their budgets)."""
    need = budget_dependence(cell)
    if need:
        return f" (a longer budget continues a run only with {need})" if st.get("trajectory") else ""
    if st.get("trajectory") != trajectory_hash(cell.to_dict()):
        return ""
    if total_steps is None or int(st["step"]) > total_steps:
        return f" (its run is past this budget: step {st['step']})"
    return None


def earlier_snapshots(out_dir: Path, cell: Cell, st: dict, budgets: dict[int, dict]) -> dict[int, dict] | str:
    """The snapshots ``cell``, continuing ``st`` (a shorter budget's state), takes over: step ->
    the file's contents, for each of ``budgets`` (step -> budget) before the state's step --
    written by the run continued (of config ``st["extends"]``) or already taken over by this
    cell -- or why it cannot (one line: a budget the shorter run did not keep)."""
    mine = {st["extends"], cell.hash}
    out = {}
    for step, budget in sorted(budgets.items()):
        if step >= int(st["step"]):
            continue
        path = snapshot_path(out_dir, budget["name"])
        obj = _load_weights_only(path, "cpu") if path_kind(path) == "a regular file" else None
        if obj is None or obj.get("kind") != "snapshot" or (obj.get("budget") or {}) != budget:
            return f"the run at a shorter budget kept no snapshot {path.name} of step {step}"
        if obj.get("cell_id") != cell.id or obj.get("cell_hash") not in mine:
            return f"{path} is not a snapshot of the run at a shorter budget"
        out[step] = obj
    return out


def _load_state(path: Path) -> dict:
    """``state.pt``; its CheckpointError names ``--restart``, the way past an unreadable state."""
    try:
        return load_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}; rerun with --restart to start the cell afresh (it overwrites state.pt), or delete the file"
        ) from None


def state_run_id(path: Path, cell: Cell) -> str | None:
    """The MLflow run id a resumable ``state.pt`` of this cell logs to (None if none)."""
    if path_kind(path) is None:
        return None
    st = _load_state(path)
    if st.get("cell_hash") != cell.hash or st.get("version") != STATE_VERSION:
        return None
    return st.get("run_id")


def save_checkpoint(path: Path, cell: Cell, **parts: Any) -> None:
    """Write ``checkpoint.pt``: the finished cell (``parts``: model, status, steps, ...)."""
    save_torch(
        path, {"kind": "checkpoint", "cell_id": cell.id, "cell_hash": cell.hash, "cell": cell.to_dict(), **parts}
    )


def snapshot_path(out_dir: str | Path, name: str) -> Path:
    """``<cell folder>/snapshots/<name>.pt``."""
    return Path(out_dir) / "snapshots" / f"{name}.pt"


#: what a snapshot file holds besides its parts (model, what the probes need to embed)
SNAPSHOT_HEADER = ("kind", "cell_id", "cell_hash", "cell", "budget")


def save_snapshot(path: Path, cell: Cell, budget: dict, **parts: Any) -> None:
    """Write a snapshot: the cell's id/hash, its ``budget`` (name, epochs, steps, images_seen)
    and ``parts`` (model, what the probes need to embed)."""
    header = ("snapshot", cell.id, cell.hash, cell.to_dict(), dict(budget))
    save_torch(path, {**dict(zip(SNAPSHOT_HEADER, header)), **parts})


def restamp_snapshot(path: Path, cell: Cell, snapshot: dict) -> None:
    """Write ``snapshot`` (a snapshot file's contents) again as ``cell``'s, the same budget and parts."""
    parts = {k: v for k, v in snapshot.items() if k not in SNAPSHOT_HEADER}
    save_snapshot(path, cell, snapshot["budget"], **parts)


def load_snapshot(path: str | Path, cell: Cell, name: str, map_location: Any = "cpu") -> dict:
    """The cell's snapshot of budget ``name``; a one-line CheckpointError for a missing file,
    another cell's or config's, another kind, or another budget."""
    obj = load_checkpoint(path, map_location, cell=cell, kind="snapshot")
    found = (obj.get("budget") or {}).get("name")
    if found != name:
        raise CheckpointError(f"{path} is the snapshot of budget {found!r}, not of {name!r}")
    return obj


class StepRandom:
    """Counter-based random streams: ``generator(stream, counter)`` is a generator on the
    device seeded by (cell seed, stream, counter) — the same draws whenever the same step
    is run, with no generator state to save (seeding is a host-side operation: no device
    synchronisation)."""

    STREAMS = {"permutation": 1, "augment": 2, "extra": 3}  # extra: the views of fresh negatives

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = int(seed)
        self.gen = torch.Generator(device=device)

    def generator(self, stream: str, counter: int) -> torch.Generator:
        self.gen.manual_seed(_mix(self.seed, self.STREAMS[stream], int(counter)))
        return self.gen


def _mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps): well-spread seeds for nearby inputs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF
