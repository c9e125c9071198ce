"""One step of one cell (prepare data, pretrain, embed, kNN, linear probe, baseline).

Glue between the rooms: each function loads what its step needs, calls the
room that does the work, writes its output file atomically, and reports to the
tracking layer.  The CLI maps one command to one function here; Snakemake maps
one rule to one command.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import tracking
from ..errors import Preempted
from ..evaluation import percent
from ..io import CellBusy, CellLock, UnsafeTarget, nullcontext_lock, write_json
from ..study.cell import BaselineCell, Cell, snapshot_names
from ..study.cells import flat_params
from ..study.lr_scaling import resolved_knobs
from ..study.probe_registry import probe_function, probe_spec
from ..tracking import TrackingError
from .export import export_backbone

if TYPE_CHECKING:
    import numpy as np

    #: a cell's (train_f, train_y, test_f, test_y), as :func:`_cell_features` embeds them
    Features = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _threads(cell: Cell | BaselineCell) -> None:
    """A job's torch: the cell's threads, and optimisers that import no compiler (a cell
    that compiles its step restores torch's wrappers: TrainStep.compile)."""
    import torch

    from ..training.optim import eager_optimizers

    torch.set_num_threads(int(cell.threads or 1))
    eager_optimizers()


# --------------------------------------------------------------------------- data
def data_options(options: Mapping) -> dict:
    """The loader's keywords among a data set's options (``datasets.<name>`` of the config)."""
    return {k: options.get(k) for k in ("image_size", "train_subset", "test_subset")}


def prepare_data(dataset: str, root: str | None, download: bool, options: Mapping, out: Path) -> dict:
    """Load a data set (``options``: its ``datasets.<name>`` settings) through its real loader
    and cache it as one tensor file."""
    from ..data import load as data

    d = data.load_dataset(dataset, root, download=download, seed=0, **data_options(options))
    data.save_cache(d, out)
    return {
        "dataset": d.name,
        "train": int(d.train_x.shape[0]),
        "test": int(d.test_x.shape[0]),
        "pretrain": int(d.pretrain_x.shape[0]),
        "shape": list(d.train_x.shape[1:]),
    }


def load_cell_data(cell: Cell | BaselineCell, cache: Path | None = None):
    """The cell's data: from the prepared cache when given (fast, no torchvision import)."""
    from ..data import load as data

    if cache is not None:
        d = data.load_cache(cache)
        data.check_cache(d, cell, cache)  # the cell's data set, size and subsets
        return d
    return data.load_dataset(
        cell.dataset, cell.data_root, download=cell.download, seed=0, **data_options(cell.dataset_options)
    )


# --------------------------------------------------------------------------- pretrain
def run_pretrain(
    cell: Cell,
    out_dir: Path,
    *,
    tracking_uri: str | None,
    experiment: str,
    cache: Path | None = None,
    restart: bool = False,
    progress: bool = True,
    device: str | None = None,
) -> dict:
    """Pretrain one cell, logging to its MLflow run; one trainer per cell (the folder's lock
    is held from before the run is opened until the checkpoint is written).  Launched by
    torchrun or srun with ``train.devices`` processes, this process joins them
    (:class:`smallbatch.training.distributed.World`); rank 0 locks, logs and saves."""
    from ..training.distributed import World

    _threads(cell)
    out_dir = Path(out_dir)
    with World.from_env(device=device or cell.device) as world:
        return _pretrain_in(world, cell, out_dir, tracking_uri, experiment, cache, restart, progress)


def record_cell(cell: Cell | BaselineCell, path: Path) -> None:
    """The cell's settings next to its outputs (for reruns by hand: ``--cell <path>``),
    rewritten only when they change."""
    if not (path.is_file() and path.read_text() == cell.to_json()):
        write_json(path, cell.to_dict())


def _pretrain_in(
    world, cell: Cell, out_dir: Path, tracking_uri, experiment: str, cache, restart: bool, progress: bool
) -> dict:
    from ..training import loop as train
    from ..training.distributed import any_over_processes

    lock = CellLock(out_dir, cell.id) if world.is_main else nullcontext_lock()
    busy = None
    try:
        lock.__enter__()
    except (CellBusy, UnsafeTarget) as exc:  # held, or a lock file that is a link, FIFO, hard link
        busy = exc
    try:
        if any_over_processes(busy is not None, world.device):  # the others stop with rank 0
            raise busy or CellBusy(f"cell {cell.id} is being trained by another process (rank 0 could not lock it)")
        if world.is_main:  # the folder is this trainer's: its cell's settings beside its outputs
            record_cell(cell, out_dir / "cell.json")
        d = load_cell_data(cell, cache)
        run = _pretrain_run(cell, out_dir, d, tracking_uri, experiment, restart) if world.is_main else None
        try:
            res = train.pretrain(
                cell,
                d.pretrain_x,
                d.mean,
                d.std,
                out_dir,
                log_fn=_log_fn(run, world, tracking_uri),
                before_save=_before_save(run),
                restart=restart,
                progress=progress,
                meta={"run_id": run.run_id} if run else {},
                world=world,
                labels=d.pretrain_y,
                at_epoch_end=_monitor(cell, d, world, run),
            )
        except BaseException as exc:
            if not isinstance(exc, TrackingError):  # the store failing: not asked again (another timeout)
                _flush_quietly(run)
            if run is not None and isinstance(exc, Exception) and not isinstance(exc, (Preempted, TrackingError)):
                run.mark_failed(exc)  # setup included: never left RUNNING (a retry resumes the run)
            raise
        if run is not None:
            _log_pretrain_end(run, res)
            _log_pretrain_artifacts(run, cell, out_dir, weights=res.status != "diverged")
    finally:
        if busy is None:
            lock.__exit__(None, None, None)
    return {
        "cell_id": cell.id,
        "status": res.status,
        "steps": res.steps,
        "epochs": res.epochs,
        "final_loss": res.final_loss,
        "wall_s": res.wall_s,
        "images_per_s": res.images_per_s,
        "processes": world.size,
        "rank": world.rank,
    }


def _monitor(cell: Cell, d, world, run):
    """The kNN monitor when ``eval.monitor_every`` asks and rank 0 logs somewhere (:mod:`smallbatch.evaluation.monitor`)."""
    if run is None or not world.is_main:
        return None
    from ..evaluation.monitor import knn_monitor

    return knn_monitor(cell, d, world.device)


def _log_fn(run, world, tracking_uri):
    """Rank 0 logs to the run; the other processes get a no-op, so every process computes
    the (collective) metrics of a logging step together."""
    if run is not None:
        return run.log
    return (lambda metrics, step: None) if tracking_uri and not world.is_main else None


def run_params(cell: Cell, d) -> dict[str, str]:
    """A cell run's MLflow params: its settings (:func:`.cells.flat_params`), its data's image size
    and pretraining images, and its batch-dependent knobs as it trains them (``resolved.train.adam_beta2``
    at its batch size, ...: :func:`smallbatch.study.lr_scaling.resolved_knobs`, the values training uses)."""
    params = flat_params(cell.to_dict())
    params["image_size"] = str(d.train_x.shape[-1])
    params["pretrain_images"] = str(d.pretrain_x.shape[0])
    knobs = resolved_knobs(cell.train, cell.batch_size, cell.loss_params.get("ema"))
    params.update({f"resolved.{k}": repr(v) for k, v in knobs.items()})
    return params


def _pretrain_run(cell: Cell, out_dir: Path, d, uri: str | None, experiment: str, restart: bool):
    """The cell's MLflow run: the one its resumable state logs to (an error if the store
    lost it), else found by id and hash, else new; a restart starts a new run."""
    from ..training import checkpoint

    if not uri:
        return None
    params = run_params(cell, d)
    state = out_dir / "state.pt"
    prior = None if restart else checkpoint.state_run_id(state, cell)
    try:
        run = tracking.open_cell_run(
            uri, experiment, cell, kind="cell", params=params, run_id=prior, fresh=restart, lease=out_dir
        )
    except tracking.RunVanished as exc:
        raise tracking.RunVanished(
            f"{exc}, but {state} continues it: the store was deleted or replaced since the "
            "cell started; run `smallbatch pretrain --restart` for this cell to train it "
            "afresh into this store"
        ) from None
    _log_data(run, cell, d)
    if run.resumed:  # skip the steps already logged, for every metric of the run (not only the loss)
        run.skip_logged_steps(sorted(run.metrics()))
        run.set_status("running")
    return run


def _log_data(run, cell, d) -> None:
    """The run's MLflow dataset input: the data set's name, the digest of its files (the
    cell's ``data_digest``), where it was read and the sizes the run saw."""
    profile = {
        "pretrain_images": int(d.pretrain_x.shape[0]),
        "train_images": int(d.train_x.shape[0]),
        "test_images": int(d.test_x.shape[0]),
        "image_shape": [int(n) for n in d.train_x.shape[1:]],
        "classes": int(d.num_classes),
    }
    run.log_dataset(cell.dataset, cell.data_digest or "unknown", cell.data_root, profile, context="training")


def _before_save(run):
    """Before each state save: the store still holds the run, and it has every logged step."""
    if run is None:
        return None

    def hook() -> None:
        run.verify()
        run.flush()

    return hook


def _flush_quietly(run) -> None:
    if run is not None:
        try:
            run.flush()
        except Exception:  # noqa: BLE001 - keep the original error
            pass


def _log_pretrain_end(run, res) -> None:
    final = {
        "train/wall_s": res.wall_s,
        "train/cpu_s": res.cpu_s,
        "train/steps": res.steps,
        "train/images_per_s_mean": res.images_per_s,
    }
    final.update({f"train/{k}": v for k, v in res.health.items()})
    if res.status != "diverged":
        final["train/final_loss"] = res.final_loss
    run.verify()
    run.log(final, res.steps)
    run.set_status(res.status if res.status in tracking.BAD_STATUSES else "running")
    extended = {tracking.TAG_EXTENDED: res.extended_from} if res.extended_from else {}
    run.set_tags({tracking.TAG_PRETRAIN: res.status, **extended})
    run.flush()


def _log_pretrain_artifacts(run, cell: Cell, out_dir: Path, weights: bool = True) -> None:
    """The cell's resolved config (``cell.json``), and its backbone's weights as a plain state
    dict (``backbone.pt``, the keys without ``backbone.``) when ``tracking.log_checkpoint`` asks
    and the cell did not diverge."""
    run.log_artifact(out_dir / "cell.json")
    if not weights or not cell.tracking.get("log_checkpoint"):
        return

    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".artifact-") as tmp:
        export_backbone(out_dir / "checkpoint.pt", Path(tmp) / "backbone.pt", cell=cell)  # `smallbatch export`'s file
        run.log_artifact(Path(tmp) / "backbone.pt")


# --------------------------------------------------------------------------- embed
def _cell_model(cell: Cell, ck: dict, cache: Path | None, device: str | None):
    """(data, the checkpoint's frozen model, device)."""
    from ..training import loop as train

    d = load_cell_data(cell, cache)
    dev = train.resolve_device(device or cell.device)
    model = train.build_model(cell, ck["channels"], ck["image_size"])
    model.load_state_dict(ck["model"])  # fp64 weights are cast to this float32 model; features are float32
    return d, model, dev


def _cell_features(cell: Cell, d, model, dev) -> Features:
    """(train_f, train_y, test_f, test_y) of the model's frozen backbone."""
    from ..evaluation import embed

    bb, bs = model.backbone.to(dev), int(cell.eval.batch_size)
    return (
        embed.embed(bb, d.train_x, d.mean, d.std, batch_size=bs, device=dev),
        d.train_y.numpy(),
        embed.embed(bb, d.test_x, d.mean, d.std, batch_size=bs, device=dev),
        d.test_y.numpy(),
    )


def _load_cell_checkpoint(cell: Cell, checkpoint: Path, snapshot: str | None = None) -> tuple[dict, dict]:
    """The cell's own finished checkpoint, or its snapshot of budget ``snapshot`` (refuses
    another cell's, another config's, another budget's, a state file) and the meta its
    features carry."""
    from ..training import checkpoint as ckpt_mod

    if snapshot is None:
        ck = ckpt_mod.load_checkpoint(checkpoint, cell=cell, kind="checkpoint")
    else:
        ck = ckpt_mod.load_snapshot(checkpoint, cell, snapshot)
    return ck, {"cell_id": cell.id, "cell_hash": cell.hash, "pretrain_status": ck.get("status", "finished")}


def run_embed(cell: Cell, checkpoint: Path, out: Path, *, cache: Path | None = None, device: str | None = None) -> dict:
    """Frozen backbone features of the cell's train and test images, to ``out``."""
    from ..evaluation import embed

    _threads(cell)
    ck, meta = _load_cell_checkpoint(cell, checkpoint)
    if ck.get("status") == "diverged":
        embed.save_status_features(out, {"status": "diverged", **meta})
        return {"status": "diverged"}
    t0 = time.perf_counter()
    tr_f, tr_y, te_f, te_y = _cell_features(cell, *_cell_model(cell, ck, cache, device))
    embed.save_features(out, tr_f, tr_y, te_f, te_y, {"status": "finished", **meta})
    return {"status": "finished", "train": tr_f.shape, "test": te_f.shape, "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- probes
def cell_probes(cell: Cell | BaselineCell) -> tuple[str, ...]:
    """The probes the evaluate step runs on the cell (``eval.probes``), each written to
    ``<cell>/<probe>.json`` (:mod:`smallbatch.study.probe_registry`)."""
    return tuple(cell.eval.probes)


def _percent(metrics: dict) -> dict:
    """Accuracies (top1/top5 keys) as percentages, like the papers' tables (:func:`..evaluation.percent`)."""
    return {k: (percent(v) if ("top1" in k or "top5" in k) else v) for k, v in metrics.items()}


def _eval_on_features(kind: str, cell: Cell | BaselineCell, feats, knn_backend: str | None = None) -> dict:
    """The registry's probe ``kind`` on the features; accuracies returned in percent."""
    spec = probe_spec(kind)
    settings = {k: cell.eval.setting(k) for k in spec.settings}
    settings["seed"] = cell.seed
    settings["knn_backend"] = knn_backend or (
        "faiss-cpu" if cell.device == "cpu" else "auto"
    )  # a cpu study stays off a GPU
    return _percent(probe_function(kind)(feats, settings))


def check_features_cell(meta: dict, cell: Cell | BaselineCell, path: Path) -> None:
    """A features file is the cell's own (id and hash in its meta), else one-line ValueError."""
    if meta.get("cell_id") != cell.id:
        raise ValueError(f"{path} holds the features of cell {meta.get('cell_id')!r}, not of {cell.id!r}")
    if "cell_hash" in meta and meta["cell_hash"] != cell.hash:
        raise ValueError(
            f"{path} holds features of another config of cell {cell.id} "
            f"(hash {meta['cell_hash']}, this config's is {cell.hash})"
        )


def run_probe(
    kind: str,
    cell: Cell,
    features: Path,
    out: Path | None,
    *,
    tracking_uri: str | None,
    experiment: str,
    knn_backend: str | None = None,
) -> dict:
    """kind: a probe of the registry (:mod:`smallbatch.study.probe_registry`): evaluate the cell's
    frozen features file, write JSON (unless ``out`` is None), log to the cell's run (once: a
    rerun does not log the same step again)."""
    from ..evaluation import embed

    if probe_spec(kind).threads:
        _threads(cell)
    tr_f, tr_y, te_f, te_y, meta = embed.load_features(features)
    check_features_cell(meta, cell, Path(features))
    return _probe(kind, cell, (tr_f, tr_y, te_f, te_y), meta, out, tracking_uri, experiment, knn_backend)


def _probe(
    kind: str,
    cell: Cell,
    feats,
    meta: dict,
    out: Path | None,
    uri: str | None,
    experiment: str,
    knn_backend: str | None = None,
    budget: dict | None = None,
) -> dict:
    """One probe of features in memory: JSON result, MLflow metrics.  A kNN probe at chance
    level marks the cell *collapsed* (:mod:`smallbatch.training.health`).  ``budget``: the
    features are a snapshot's; its metrics are logged as ``snapshot/<name>/<metric>`` beside
    the budget (epochs, steps, images seen) and its status as ``snapshot/<name>/status``
    (:data:`SNAPSHOT_STATUS`), the cell's own status untouched."""
    if meta.get("status") == "diverged":
        result: dict[str, Any] = {"status": "diverged", "cell_id": cell.id}
        if budget is not None and uri:
            _log_probe(cell, uri, experiment, snapshot_metrics(budget, {}, "diverged"), None)
        if out is not None:
            write_json(out, result)
        return result
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = _eval_on_features(kind, cell, feats, knn_backend)
    numeric = {f"{kind}/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    numeric[f"{kind}/seconds"] = time.perf_counter() - t0
    numeric[f"{kind}/cpu_s"] = time.process_time() - c0  # every thread's CPU time (the cost table)
    status = _probe_status(kind, metrics, meta, feats[3], feats[1])
    result = {"status": status, "cell_id": cell.id, **numeric}
    log_status: str | None = status
    if budget is not None:  # a snapshot's: the cell's own status is left alone
        numeric, log_status = snapshot_metrics(budget, numeric, status), None
    run = _log_probe(cell, uri, experiment, numeric, log_status) if uri else None
    if out is not None:
        write_json(out, result)  # only once logged: a failing store leaves no result file
        if run is not None:
            run.log_artifact(out)
    return result


#: a snapshot's outcome as a number (MLflow metrics are numbers): ``snapshot/<name>/status``
SNAPSHOT_STATUS = {"finished": 0.0, "collapsed": 1.0, "diverged": 2.0}


def snapshot_metrics(budget: dict, numeric: dict, status: str) -> dict:
    """A snapshot's probe metrics under ``snapshot/<name>/``, with its budget and status."""
    pre = f"snapshot/{budget['name']}/"
    out = {f"{pre}{k}": v for k, v in numeric.items()}
    out.update({f"{pre}{k}": float(budget[k]) for k in ("epochs", "steps", "images_seen")})
    out[f"{pre}status"] = SNAPSHOT_STATUS[status]
    return out


def run_evaluate(
    cell: Cell,
    checkpoint: Path,
    out_dir: Path,
    *,
    tracking_uri: str | None,
    experiment: str,
    cache: Path | None = None,
    device: str | None = None,
    features: Path | None = None,
    snapshot: str | None = None,
) -> dict:
    """Embed and the probes of one cell (:func:`cell_probes`) in one process (the features stay
    in memory; ``features``: also write them there).  Writes each probe's ``<probe>.json``
    (``knn.json``, ``linear.json``, ...) in ``out_dir``, as the separate steps do, and first ``representation.json``: what the
    representation looks like (:mod:`smallbatch.evaluation.representation`), logged to the
    cell's run as ``repr/*``.  ``snapshot``: ``checkpoint`` is the cell's snapshot of that
    budget (``ep<e>``), evaluated by the same probes (not measured: ``repr/*`` is the final
    network's); the results go to ``<snapshot>.<probe>.json`` and
    to the cell's run as ``snapshot/<snapshot>/...`` (:func:`snapshot_metrics`)."""
    from ..evaluation import embed

    _threads(cell)
    if snapshot is not None and snapshot not in snapshot_names(cell):
        known = ", ".join(snapshot_names(cell)) or "none: train.snapshot_epochs is not set"
        raise ValueError(f"cell {cell.id} has no snapshot {snapshot!r} (its snapshots: {known})")
    ck, meta = _load_cell_checkpoint(cell, checkpoint, snapshot)
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    feats: Features | None = None
    if ck.get("status") == "diverged":
        meta = {"status": "diverged", **meta}
        if features is not None:
            embed.save_status_features(features, meta)
        parts = None
    else:
        d, model, dev = _cell_model(cell, ck, cache, device)
        feats = _cell_features(cell, d, model, dev)
        meta = {"status": "finished", **meta}
        if features is not None:
            embed.save_features(features, *feats, meta)
        parts = d, model, dev
    geometry = None
    if snapshot is None:
        geometry = _representation(cell, parts, meta, out_dir / REPRESENTATION, tracking_uri, experiment)
    seconds = time.perf_counter() - t0
    budget = ck.get("budget") if snapshot is not None else None
    name = f"{snapshot}." if snapshot is not None else ""
    return {
        "embed_seconds": seconds,
        "representation": geometry,
        **{
            kind: _probe(
                kind,
                cell,
                feats,
                meta,
                out_dir / f"{name}{probe_spec(kind).file}",
                tracking_uri,
                experiment,
                budget=budget,
            )
            for kind in cell_probes(cell)
        },
    }


#: the evaluation's file of :func:`_representation`, beside the probes' ``<probe>.json``
REPRESENTATION = "representation.json"


def _representation(cell: Cell, parts, meta: dict, out: Path, uri: str | None, experiment: str) -> dict:
    """The frozen network's geometry on the fixed held-out sample (``parts``: data, model and
    device; None for a diverged cell): written to ``out`` and logged as ``repr/<metric>``
    (once: a rerun does not log the same step again)."""
    if parts is None:
        result = {"status": meta["status"], "cell_id": cell.id}
        write_json(out, result)
        return result
    from ..evaluation.representation import representation_metrics

    d, model, dev = parts
    t0, c0 = time.perf_counter(), time.process_time()
    metrics = representation_metrics(
        model, d.test_x, d.mean, d.std, dict(cell.augment), device=dev, batch_size=int(cell.eval.batch_size)
    )
    numeric = {f"repr/{k}": float(v) for k, v in metrics.items()}
    numeric["repr/seconds"] = time.perf_counter() - t0
    numeric["repr/cpu_s"] = time.process_time() - c0
    result = {"status": "finished", "cell_id": cell.id, **numeric}
    if uri:
        run = tracking.find_cell_run(uri, experiment, cell)
        run.skip_logged_steps(sorted(numeric))
        run.log(numeric, 0)
        run.flush()
    write_json(out, result)  # only once logged: a failing store leaves no result file
    if uri:
        run.log_artifact(out)
    return result


def _probe_status(kind: str, metrics: dict, meta: dict, te_y, tr_y) -> str:
    from ..training import health

    if meta.get("pretrain_status") == "collapsed":
        return "collapsed"
    n_classes = int(max(te_y.max(), tr_y.max())) + 1
    spec = probe_spec(kind)
    if spec.chance_collapses and health.at_chance(metrics[spec.metric], len(te_y), n_classes):
        return "collapsed"
    return "finished"


def _log_probe(cell: Cell, uri: str, experiment: str, numeric: dict, status: str | None):
    """The probe's metrics, once; returns the run (its result file is logged as an artifact).
    ``status`` None: a snapshot's, which leaves the cell's status alone."""
    run = tracking.find_cell_run(uri, experiment, cell)
    run.skip_logged_steps(sorted(numeric))  # a rerun of the probe logs nothing twice
    run.log(numeric, 0)
    run.flush()
    if status is None:
        return run
    if status == "collapsed":
        run.set_status("collapsed")
    _maybe_finish(run, cell)
    return run


def _maybe_finish(run, cell: Cell) -> None:
    """Mark the run finished once pretraining succeeded, every probe of the cell is logged
    and nothing marked the cell collapsed."""
    m, tags = run.metrics(), run.tags()
    if (
        all(probe_spec(p).key in m for p in cell_probes(cell))
        and tags.get(tracking.TAG_PRETRAIN) == "finished"
        and tags.get(tracking.TAG_STATUS) not in tracking.BAD_STATUSES
    ):
        run.set_status("finished")


# --------------------------------------------------------------------------- baselines
def run_baseline(
    cell: BaselineCell,
    out: Path,
    *,
    tracking_uri: str | None,
    experiment: str,
    cache: Path | None = None,
    device: str | None = None,
) -> dict:
    """Raw pixels or a random-init encoder, evaluated by the same kNN and linear probe."""
    from ..evaluation import embed
    from ..training import loop as train

    _threads(cell)
    t0, c0 = time.perf_counter(), time.process_time()
    d = load_cell_data(cell, cache)
    if cell.baseline == "raw_pixels":
        tr_f, te_f = embed.raw_pixel_features(d.train_x), embed.raw_pixel_features(d.test_x)
    elif cell.baseline == "random_init":
        import torch

        torch.manual_seed(cell.seed)
        model = train.build_model(cell, d.train_x.shape[1], d.train_x.shape[-1])
        dev = train.resolve_device(device or cell.device)
        bb = model.backbone.to(dev)
        tr_f = embed.embed(bb, d.train_x, d.mean, d.std, device=dev)
        te_f = embed.embed(bb, d.test_x, d.mean, d.std, device=dev)
    elif cell.baseline == "supervised":  # the upper bound: the same backbone trained with labels
        from ..evaluation.supervised import train_supervised

        dev = train.resolve_device(device or cell.device)
        bb = train_supervised(cell, d.train_x, d.train_y, d.num_classes, d.mean, d.std, dev)
        tr_f = embed.embed(bb, d.train_x, d.mean, d.std, device=dev)
        te_f = embed.embed(bb, d.test_x, d.mean, d.std, device=dev)
    else:
        raise ValueError(f"baseline must be raw_pixels, random_init or supervised, not {cell.baseline!r}")
    feats = (tr_f, d.train_y.numpy(), te_f, d.test_y.numpy())
    numeric, run = {}, None
    for kind in cell_probes(cell):
        m = _eval_on_features(kind, cell, feats)
        numeric.update({f"{kind}/{k}": float(v) for k, v in m.items() if isinstance(v, (int, float))})
    numeric["baseline/wall_s"] = time.perf_counter() - t0  # features and both probes (the cost table)
    numeric["baseline/cpu_s"] = time.process_time() - c0
    if tracking_uri:
        params = {"dataset": cell.dataset, "baseline": cell.baseline, "image_size": str(d.train_x.shape[-1])}
        if cell.baseline != "raw_pixels":  # raw pixels: no network and nothing random
            params.update({"seed": str(cell.seed), "train.backbone": cell.train.backbone})
        run = tracking.open_cell_run(tracking_uri, experiment, cell, kind="baseline", params=params)
        _log_data(run, cell, d)
        run.log(numeric, 0)
        run.set_status("finished")
    result = {"status": "finished", "cell_id": cell.id, **numeric}
    write_json(out, result)
    if run is not None:
        run.log_artifact(out)
    print(json.dumps(result), file=sys.stderr)
    return result
