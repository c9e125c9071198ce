"""The steps-to-target sweep (``experiments.critical_batch``) as one job: every arm x batch size
x seed trained to the target (:mod:`smallbatch.evaluation.steps_to_target`), one row each
appended to ``runs.csv`` (its curve to ``curves.csv``) in the output folder as soon as it ends,
so a rerun skips the rows already there; then the critical-batch fit per arm
(:mod:`smallbatch.report.steps_to_target`) written beside them: ``fit.md``,
``steps_to_target.png`` and ``images_to_target.png``.

Every arm trains the config's network with its ``train`` settings, laid over by the section's
``train`` and with ``train.steps`` the last evaluation's step; the labelled training images of
the data set (``datasets.<name>.train_subset`` of them) are split once into the validation
split (``validation`` images, a fixed draw) and the images the arms train on.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import time
from collections.abc import Callable
from pathlib import Path

from ..evaluation import SUPERVISED_ARM
from ..io import make_folder, write_text
from ..losses.registry import loss_names
from ..study.cell import Cell
from ..study.cells import data_settings, make_cell
from ..study.config import ConfigError

__all__ = ["RUN_FIELDS", "CURVE_FIELDS", "section_of", "run_sweep", "write_fits", "stop_time"]

RUN_FIELDS = ["arm", "batch_size", "seed", "target", "steps", "images", "status", "peak_lr", "evals", "cpu_s", "wall_s"]
CURVE_FIELDS = ["arm", "batch_size", "seed", "step", "images", "accuracy"]
_KEY = "experiments.critical_batch"


def section_of(cfg: dict) -> dict:
    """The config's (validated) ``experiments.critical_batch``, checked whole before any run:
    a one-line ConfigError naming the key otherwise."""
    sec = (cfg.get("experiments") or {}).get("critical_batch") or {}
    if sec.get("target") is None:
        raise ConfigError(f"config key '{_KEY}.target' is not set: state the kNN top-1 (percent) to reach")
    if sec["dataset"] not in cfg["datasets"]:
        raise ConfigError(
            f"config key '{_KEY}.dataset' is {sec['dataset']!r}, not one of datasets ({', '.join(cfg['datasets'])})"
        )
    known = loss_names()
    for arm in sec["arms"]:
        if arm != SUPERVISED_ARM and arm not in known:
            raise ConfigError(f"config key '{_KEY}.arms' has {arm!r}: a loss of the registry or {SUPERVISED_ARM}")
    if sec["queries"] > sec["validation"] // 5:
        raise ConfigError(
            f"config key '{_KEY}.queries' is {sec['queries']}: at most a fifth of validation "
            f"({sec['validation'] // 5}); raise validation or lower queries"
        )
    return sec


def _cell(cfg: dict, sec: dict, arm: str, batch: int, seed: int, last: int) -> Cell:
    """The arm's cell (the supervised control trains the InfoNCE cell's network and optimiser)."""
    raw = make_cell(
        cfg,
        dataset=sec["dataset"],
        loss="infonce" if arm == SUPERVISED_ARM else arm,
        loss_params={},
        batch_size=batch,
        temperature=float(sec["temperature"]),
        seed=seed,
        train_overrides={**sec["train"], "steps": last},
    )
    return Cell.of(raw)


def _done(path: Path) -> set[tuple[str, int, int]]:
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["arm"], int(r["batch_size"]), int(r["seed"])) for r in csv.DictReader(f)}


def _append(path: Path, fields: list[str], rows: list[dict]) -> None:
    """``rows`` added to the CSV ``path`` (its header first when new): the whole file rewritten
    atomically (:func:`smallbatch.io.write_text`), so a killed sweep leaves no half row."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    if not path.exists():
        w.writeheader()
    w.writerows(rows)
    write_text(path, (path.read_text() if path.exists() else "") + buf.getvalue())


def _record(out: Path, res, wall: float) -> dict:
    """The run's row (and its curve) appended; the row returned."""
    row = {
        "arm": res.arm,
        "batch_size": res.batch_size,
        "seed": res.seed,
        "target": res.target,
        "steps": "" if res.steps is None else f"{res.steps:.2f}",
        "images": "" if res.images is None else f"{res.images:.0f}",
        "status": res.status,
        "peak_lr": f"{res.peak_lr:.6g}",
        "evals": len(res.curve.steps),
        "cpu_s": f"{res.cpu_s:.1f}",
        "wall_s": f"{wall:.1f}",
    }
    c = res.curve
    curve = [
        {"arm": res.arm, "batch_size": res.batch_size, "seed": res.seed, "step": s, "images": i, "accuracy": a}
        for s, i, a in zip(c.steps, c.images, c.accuracy)
    ]
    _append(out / "curves.csv", CURVE_FIELDS, curve)
    _append(out / "runs.csv", RUN_FIELDS, [row])  # last: a row here means the run is whole
    return row


def _data(cfg: dict, sec: dict):
    """(the arms' training data, the probe): the data set's labelled training images split once."""
    from ..data import load as data
    from ..evaluation import steps_to_target as stt

    where = data_settings(cfg, sec["dataset"])
    opts = where["dataset_options"]
    d = data.load_dataset(
        sec["dataset"],
        where["data_root"],
        download=where["download"],
        image_size=opts.get("image_size"),
        train_subset=opts.get("train_subset"),
        test_subset=opts.get("test_subset"),
    )
    return stt.split_data(d, sec["validation"], queries=sec["queries"], k=sec["knn_k"], t=float(sec["knn_t"]))


def stop_time(hhmm: str) -> float:
    """The epoch time of ``hhmm`` (UTC) today; ValueError naming the flag for another form."""
    try:
        h, m = (int(x) for x in hhmm.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        return now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()
    except ValueError:
        raise ValueError(f"--stop-by must be HH:MM (UTC), not {hhmm!r}") from None


def run_sweep(cfg: dict, out: Path, *, stop_by: float | None = None, log: Callable[[str], None] = print) -> int:
    """Every arm x batch size x seed not yet in ``out/runs.csv`` (seeds outermost: a sweep cut
    short keeps every batch size and arm), none started after ``stop_by`` (epoch time); returns
    the runs made."""
    import torch

    from ..evaluation import steps_to_target as stt

    sec = section_of(cfg)
    torch.set_num_threads(int(sec["threads"]))
    make_folder(out)
    log(f"target: kNN@{sec['knn_k']} top-1 >= {sec['target']} % on {sec['validation']} held-out training images")
    arms_data, probe = _data(cfg, sec)
    done, made = _done(out / "runs.csv"), 0
    for seed in sec["seeds"]:
        for batch in sec["batch_sizes"]:
            schedule = stt.eval_steps(batch, sec["first_images"], sec["max_images"], sec["per_octave"])
            for arm in sec["arms"]:
                if (arm, batch, seed) in done:
                    continue
                if stop_by is not None and time.time() > stop_by:
                    log("stopped: no new run after --stop-by")
                    return made
                w0 = time.perf_counter()
                cell = _cell(cfg, sec, arm, batch, seed, schedule[-1])
                res = stt.run_arm(cell, arm, arms_data, probe, schedule, float(sec["target"]))
                row = _record(out, res, time.perf_counter() - w0)
                made += 1
                log(f"{arm} B={batch} seed {seed}: {row['status']}, steps {row['steps'] or '-'}, {row['cpu_s']} CPU-s")
    return made


def write_fits(out: Path, replicas: int = 1000) -> str:
    """The fit per arm of ``out/runs.csv`` as ``out/fit.md`` and both figures beside it; the table returned."""
    from ..report import steps_to_target as st

    with (out / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    fits = st.fit_arms(rows, replicas=replicas)
    table = st.fit_markdown(fits)
    write_text(out / "fit.md", table)
    st.plot_steps(rows, fits, out / "steps_to_target.png")
    st.plot_images(rows, fits, out / "images_to_target.png")
    return table
