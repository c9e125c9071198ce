"""The study as the workflow plans it: its cells and baselines, their folders and outputs, the
settings stamps, the results folder's run lock and the jobs' resources -- the Python that
``workflow/rules/common.smk`` calls, kept here so the linters, the type checker and the unit
tests read it.  Only what needs Snakemake's own objects (``workflow``, its DAG, its
``WorkflowError``) stays in the rule file, as a line or two around these functions; every
function here raises ``ValueError`` with the one line the workflow shows.

Settings stamps: ``<results_dir>/<folder>/.settings-<hash>``, one per cell, baseline, data
cache and the MI benchmark, an input of the job that computes there; the local rule
``settings`` writes it just before that job (:meth:`StudyPlan.write_settings`, which removes
the folder's other stamps).  A folder whose output exists but lacks the stamp of the settings
planned now holds results of other settings (:meth:`StudyPlan.stale_output`): the workflow
forces that output to rerun, and with it every job after it -- with or without Snakemake's
metadata (.snakemake/), so a results folder never serves results of other settings.  Hashes:
:mod:`smallbatch.study.cells` (a cell's covers its id, its settings and its data's digest,
not where the data lie).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.registry import pretrain_images
from ..io import UnsafeTarget, add_results_folder, check_inside, link_leaving, open_regular, path_kind, write_text
from ..study.cell import BaselineCell, Cell, budget_steps, read_cell, snapshot_names
from ..study.cells import baseline_cells, data_cache_settings, expand_cells, settings_hash
from ..study.probe_registry import probe_spec
from ..tracking import PLAN_FILE
from .jobs import record_cell

__all__ = ["StudyPlan", "flag", "pretrain_priority", "gpu_permille", "hold_results_folder"]


@dataclass
class StudyPlan:
    """What one config plans: ``cells`` and ``baselines`` (typed, by id), ``settings``
    (folder -> (hash, the settings' JSON) of every stamped folder), ``stamped`` (folder -> the
    output of the job its stamp is an input of) and ``probe_files`` (probe -> result file name,
    ``eval.probes``).  Folders are relative to ``results_dir``.  ``one_job_per_cell``: each
    cell pretrains and is evaluated in one job (``smallbatch run-cell``), whose outputs are
    the final checkpoint's probe files (its snapshots' files are written before them)."""

    results_dir: str
    cells: dict[str, Cell]
    baselines: dict[str, BaselineCell]
    probe_files: dict[str, str]
    one_job_per_cell: bool = False
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)
    stamped: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> StudyPlan:
        r = config["results_dir"]
        add_results_folder(r)
        cells = {cid: _typed(c, Cell) for cid, c in expand_cells(config).items()}
        bases = {bid: _typed(c, BaselineCell) for bid, c in baseline_cells(config).items()}
        probes = {p: probe_spec(p).file for p in config["eval"]["probes"]}
        plan = cls(r, cells, bases, probes, bool(config["one_job_per_cell"]))
        for cid, cell in cells.items():
            plan.stamp(f"runs/{cid}", cell.hash, cell.to_json(), f"{r}/runs/{cid}/{plan.cell_job_output()}")
        for bid, base in bases.items():
            plan.stamp(bid, base.hash, base.to_json(), f"{r}/{bid}/result.json")
        for ds in config["datasets"]:
            data = data_cache_settings(config, ds)
            plan.stamp(f"data/cache/{ds}", settings_hash(data), _json(data), f"{r}/data/cache/{ds}.pt")
        return plan

    def stamp(self, folder: str, digest: str, text: str, output: str) -> None:
        """Plan ``folder``'s settings stamp (``digest``, holding ``text``) for the job writing ``output``."""
        self.settings[folder] = (digest, text)
        self.stamped[folder] = output

    def stamp_section(self, folder: str, section: dict, output: str) -> None:
        """A stamp for a config section computed in one job (the MI benchmark)."""
        self.stamp(folder, settings_hash(section), _json(section), output)

    def settings_stamp(self, folder: str) -> str:
        """The stamp of ``folder``'s planned settings (an input of the job that writes there)."""
        return f"{self.results_dir}/{folder}/.settings-{self.settings[folder][0]}"

    def stale_output(self, folder: str) -> str | None:
        """``folder``'s output when it exists without the stamp of the planned settings (it was
        computed under other settings and must rerun), else None."""
        output, stamp = self.stamped[folder], self.settings_stamp(folder)
        kind = path_kind(stamp)
        if kind not in (None, "a regular file"):  # the workflow writes only files: not its stamp
            raise ValueError(
                f"settings stamp {stamp} is {kind}, not the file the workflow writes; remove it (the jobs of "
                f"{folder} then run again)"
            )
        return output if os.path.exists(output) and kind is None else None

    def write_settings(self, folder: str, stamp: str | Path, log: str | Path) -> None:
        """The ``settings`` rule's job: ``stamp`` (<folder>/.settings-<hash>) holding the settings
        planned for ``folder``, the folder's stamps of other settings removed (named in ``log``)."""
        planned, stamp = self.settings.get(folder), Path(stamp)
        if planned is None or stamp.name != f".settings-{planned[0]}":
            raise ValueError(f"{stamp}: no such settings are planned for {self.results_dir}/{folder}")
        check_inside(stamp)  # no stamp removed or written through a linked folder
        removed = [old for old in stamp.parent.glob(".settings-*") if old.name != stamp.name and not old.is_dir()]
        for old in removed:
            old.unlink()
        write_text(log, "".join(f"removed {old.name}: results of other settings\n" for old in removed))
        write_text(stamp, planned[1])

    def cell(self, cell_id: str) -> Cell:
        try:
            return self.cells[cell_id]
        except KeyError:
            raise ValueError(f"unknown cell {cell_id!r}: not in the config's grid") from None

    def cell_dir(self, cell_id: str) -> str:
        return f"{self.results_dir}/runs/{cell_id}"

    def write_cell_files(self) -> None:
        """Every cell's and baseline's settings as <its folder>/cell.json (what ``smallbatch
        cells --write`` writes), rewritten only when they change: the jobs read their cell
        from it."""
        for cid, cell in self.cells.items():
            record_cell(cell, Path(self.cell_dir(cid)) / "cell.json")
        for bid, base in self.baselines.items():
            record_cell(base, Path(self.results_dir) / bid / "cell.json")

    def record(self, study: str) -> dict[str, Any]:
        """The plan as the report and the console read it (``plan.json``): every cell and baseline
        with its id, hash, kind, section (its experiment) and, for a cell, its shape, cost
        (:func:`cell_cost`) and result files (relative to the results folder)."""
        cells = [
            {
                "id": cid,
                "hash": c.hash,
                "kind": "cell",
                "section": c.experiment,
                "dataset": c.dataset,
                "loss": c.loss,
                "batch_size": int(c.batch_size),
                **cell_cost(c),
                "outputs": [f"runs/{cid}/{f}" for f in self.probe_files.values()],
            }
            for cid, c in self.cells.items()
        ]
        bases = [
            {"id": bid, "hash": b.hash, "kind": "baseline", "section": b.experiment, "dataset": b.dataset}
            for bid, b in self.baselines.items()
        ]
        return {"study": study, "cells": cells + bases}

    def write_plan(self, study: str) -> None:
        """``<results_dir>/plan.json`` (:meth:`record`), rewritten only when the plan changes: written
        when a run of the workflow starts, before any job, so a study stopped early still says what
        it planned."""
        path, text = Path(self.results_dir) / PLAN_FILE, _json(self.record(study))
        if not (path.is_file() and path.read_text() == text):
            write_text(path, text)

    def cell_job_output(self) -> str:
        """The file (in a cell's folder) whose job pretrains the cell: checkpoint.pt, or under
        ``one_job_per_cell`` the first probe's result file."""
        return next(iter(self.probe_files.values()), "checkpoint.pt") if self.one_job_per_cell else "checkpoint.pt"

    def one_process_problem(self) -> str | None:
        """Under ``one_job_per_cell``, the first cell that trains on several processes (its job
        could not evaluate in the same process), else None."""
        many = next((c for c in self.cells.values() if c.train.devices > 1), None) if self.one_job_per_cell else None
        if many is None:
            return None
        return (
            f"one_job_per_cell runs each cell in one process, but cell {many.id} has train.devices = "
            f"{many.train.devices}; set one_job_per_cell: false (a job per step) or train.devices: 1"
        )

    def cell_outputs(self) -> list[str]:
        """Every probe's result file of every cell, and of each of its snapshots
        (``train.snapshot_epochs``: evaluated as its final checkpoint is; under
        ``one_job_per_cell`` the cell's job writes them before its final files, which alone
        are its outputs)."""
        files = self.probe_files.values()
        out = [f"{self.cell_dir(c)}/{f}" for c in self.cells for f in files]
        if self.one_job_per_cell:
            return out
        return out + [
            f"{self.cell_dir(c)}/snapshots/{name}.{f}"
            for c, cell in self.cells.items()
            for name in snapshot_names(cell)
            for f in files
        ]

    def baseline_outputs(self) -> list[str]:
        return [f"{self.results_dir}/{b}/result.json" for b in self.baselines]


def _typed(cell: dict, kind: type) -> Any:
    typed = read_cell(cell)
    if not isinstance(typed, kind):  # expand_cells plans cells, baseline_cells baselines
        raise ValueError(f"{typed.id!r} is not a {kind.__name__}")
    return typed


def _json(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, indent=2) + "\n"


def cell_cost(cell: Cell) -> dict[str, int]:
    """What a cell's pretraining costs, before it runs: its optimiser ``steps`` and the ``images`` its
    network sees (``steps x`` (batch size + its extra negatives)); empty where the data set's size is
    known only once read."""
    n = pretrain_images(cell.dataset, cell.dataset_options.get("train_subset"))
    if n is None or n < int(cell.batch_size):
        return {}
    steps = budget_steps(cell, n // int(cell.batch_size))
    return {"steps": steps, "images": steps * (int(cell.batch_size) + int(cell.train.extra_negatives or 0))}


def flag(option: str, value: Any = True) -> list[str]:
    """One optional command-line option as the words of a ``{params.NAME:q}`` placeholder:
    [] when ``value`` is None, False or "" (the option is left out), [option] for True,
    else [f"{option}={value}"] (joined: a value starting with a dash stays a value)."""
    if value is None or value is False or value == "":
        return []
    return [option] if value is True else [f"{option}={value}"]


def pretrain_priority(cell: Cell) -> int:
    """Longest cells first (1..9 by log2 of epochs x 256 / batch size: the steps a cell takes
    relative to batch 256), so the jobs that end the study are short ones and neither core
    waits long for the other (the MI toy, longer still, has 10)."""
    work = float(cell.train.epochs) * 256 / int(cell.batch_size)
    return min(9, max(1, round(math.log2(max(1.0, work)))))


def gpu_permille(devices: int, cells_per_gpu: int) -> int:
    """A job's share of the node's GPUs in permille (each GPU is 1000): a one-device cell
    takes 1000 // cells_per_gpu, so that many run on a GPU at once; a cell on N devices N x 1000."""
    return 1000 * devices if devices > 1 else 1000 // cells_per_gpu


def hold_results_folder(results_dir: str) -> int:
    """One Snakemake run per results folder: an flock on <results_dir>/.snakemake-run.lock,
    held for the life of the process (the descriptor returned; keep it open).  Two runs on one
    folder from different working directories (Snakemake's own lock is per working directory)
    would otherwise remove each other's job logs and outputs; the second stops before any job
    with one line naming the first.  A link in the folder to a place outside it is refused
    (:func:`smallbatch.io.link_leaving`): the jobs' logs and outputs would be written there."""
    Path(results_dir).mkdir(parents=True, exist_ok=True)
    path = f"{results_dir}/.snakemake-run.lock"
    try:  # never through a link, a FIFO or a hard link (the PID written into it would land there)
        fd = open_regular(path, f"the run lock of results folder {results_dir}, {path},")
    except UnsafeTarget as exc:
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"results folder {results_dir}: cannot open its run lock {path} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(
            f"results folder {results_dir} is in use by another Snakemake run (process {holder}); wait for it "
            "to finish, or give this run another results_dir"
        ) from None
    link = link_leaving(results_dir)
    if link:
        os.close(fd)
        raise ValueError(
            f"results folder {results_dir} holds the link {link}, which leads outside it; refused (smallbatch "
            "writes nothing outside its results folder): remove the link"
        )
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
