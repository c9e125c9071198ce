"""One step of one cell (prepare data, pretrain, embed, kNN, linear probe, baseline).

Glue between the rooms: each function loads what its step needs, calls the
room that does the work, writes its output file atomically, and reports to the
tracking layer.  The CLI maps one command to one function here; Snakemake maps
one rule to one command.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .cells import flat_params
from .io import write_json


def _threads(cell: dict) -> None:
    import torch

    n = int(cell.get("threads") or 1)
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- data
def data_options(cell: dict) -> dict:
    o = cell.get("dataset_options", {})
    return {
        "image_size": o.get("image_size"),
        "train_subset": o.get("train_subset"),
        "test_subset": o.get("test_subset"),
    }


def prepare_data(cell: dict, out: Path) -> dict:
    """Load the cell's data set through its real loader and cache it as one tensor file."""
    from . import data

    d = data.load_dataset(cell["dataset"], cell["data_root"], download=cell.get("download", False),
                          seed=0, **data_options(cell))
    data.save_cache(d, out)
    return {"dataset": d.name, "train": int(d.train_x.shape[0]), "test": int(d.test_x.shape[0]),
            "pretrain": int(d.pretrain_x.shape[0]), "shape": list(d.train_x.shape[1:])}


def load_cell_data(cell: dict, cache: Path | None = None):
    """The cell's data: from the prepared cache when given (fast, no torchvision import)."""
    from . import data

    if cache is not None:
        return data.load_cache(cache)
    return data.load_dataset(cell["dataset"], cell["data_root"], download=cell.get("download", False),
                             seed=0, **data_options(cell))


# --------------------------------------------------------------------------- pretrain
def run_pretrain(cell: dict, out_dir: Path, *, tracking_uri: str | None, experiment: str,
                 cache: Path | None = None, restart: bool = False, progress: bool = True,
                 device: str | None = None) -> dict:
    from . import tracking, train

    _threads(cell)
    d = load_cell_data(cell, cache)
    run = None
    if tracking_uri:
        params = flat_params(cell)
        params["image_size"] = str(d.train_x.shape[-1])
        params["pretrain_images"] = str(d.pretrain_x.shape[0])
        run = tracking.open_cell_run(tracking_uri, experiment, cell, kind="cell", params=params)
        if run.resumed:  # skip the steps already logged, for every metric of the run (not only the loss)
            run.skip_logged_steps(sorted(run.metrics()))
            run.set_status("running")
    log_fn = run.log if run is not None else None
    try:
        res = train.pretrain(cell, d.pretrain_x, d.mean, d.std, Path(out_dir), log_fn=log_fn,
                             before_save=run.flush if run is not None else None,
                             device=device or cell.get("device", "auto"), restart=restart, progress=progress)
    except BaseException:
        if run is not None:
            try:
                run.flush()
            except Exception:  # noqa: BLE001 - keep the original error
                pass
        raise
    summary = {"cell_id": cell["id"], "status": res.status, "steps": res.steps, "epochs": res.epochs,
               "final_loss": res.final_loss, "wall_s": res.wall_s, "images_per_s": res.images_per_s}
    if run is not None:
        final = {"train/wall_s": res.wall_s, "train/steps": res.steps, "train/images_per_s_mean": res.images_per_s}
        if res.status == "finished":
            final["train/final_loss"] = res.final_loss
        run.log(final, res.steps)
        run.set_status(res.status if res.status == "diverged" else "running")
        run.set_tags({tracking.TAG_PRETRAIN: res.status})
        run.flush()
    return summary


# --------------------------------------------------------------------------- embed
def run_embed(cell: dict, checkpoint: Path, out: Path, *, cache: Path | None = None,
              device: str | None = None) -> dict:

    from . import evaluate, train

    _threads(cell)
    ck = train.load_checkpoint(checkpoint)
    if ck.get("status") == "diverged":
        evaluate.save_status_features(out, {"status": "diverged", "cell_id": cell["id"]})
        return {"status": "diverged"}
    d = load_cell_data(cell, cache)
    dev = train.resolve_device(device or cell.get("device", "auto"))
    model = train.build_model(ck["cell"], ck["channels"], ck["image_size"])
    model.load_state_dict(ck["model"])  # fp64 weights are cast to this float32 model; features are float32
    bb = model.backbone.to(dev)
    t0 = time.perf_counter()
    bs = int(cell["eval"].get("batch_size", 1024))
    tr_f = evaluate.embed(bb, d.train_x, d.mean, d.std, batch_size=bs, device=dev)
    te_f = evaluate.embed(bb, d.test_x, d.mean, d.std, batch_size=bs, device=dev)
    evaluate.save_features(out, tr_f, d.train_y.numpy(), te_f, d.test_y.numpy(),
                           {"status": "finished", "cell_id": cell["id"], "cell_hash": cell["hash"]})
    return {"status": "finished", "train": tr_f.shape, "test": te_f.shape, "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- probes
def _percent(metrics: dict) -> dict:
    """Accuracies (top1/top5 keys) as percentages, like the papers' tables."""
    return {k: (100.0 * v if ("top1" in k or "top5" in k) else v) for k, v in metrics.items()}


def _eval_on_features(kind: str, cell: dict, feats) -> dict:
    """kNN or linear probe; accuracies returned in percent."""
    from . import evaluate

    tr_f, tr_y, te_f, te_y = feats
    ev = cell["eval"]
    if kind == "knn":
        return _percent(evaluate.knn_eval(tr_f, tr_y, te_f, te_y, ks=tuple(ev["knn_k"]), t=ev["knn_t"]))
    return _percent(evaluate.linear_eval(tr_f, tr_y, te_f, te_y, epochs=ev["linear_epochs"], lr=ev["linear_lr"],
                                         weight_decay=ev["linear_weight_decay"], seed=cell.get("seed", 0),
                                         optimizer=ev.get("linear_optimizer", "lbfgs"),
                                         batch_size=ev.get("linear_batch_size")))


def run_probe(kind: str, cell: dict, features: Path, out: Path, *, tracking_uri: str | None,
              experiment: str) -> dict:
    """kind = 'knn' | 'linear': evaluate frozen features, write JSON, log to the cell's run."""
    from . import evaluate

    if kind in ("linear",):
        _threads(cell)
    tr_f, tr_y, te_f, te_y, meta = evaluate.load_features(features)
    if meta.get("status") == "diverged":
        result = {"status": "diverged", "cell_id": cell["id"]}
        write_json(out, result)
        return result
    t0 = time.perf_counter()
    metrics = _eval_on_features(kind, cell, (tr_f, tr_y, te_f, te_y))
    seconds = time.perf_counter() - t0
    numeric = {f"{kind}/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    numeric[f"{kind}/seconds"] = seconds
    if tracking_uri:
        from . import tracking

        run = tracking.find_cell_run(tracking_uri, experiment, cell)
        run.log(numeric, 0)
        run.flush()
        _maybe_finish(run)
    result = {"status": "finished", "cell_id": cell["id"], **numeric}
    write_json(out, result)
    return result


def _maybe_finish(run) -> None:
    """Mark the run finished once pretraining succeeded and both probes are logged."""
    from . import tracking

    m = run.metrics()
    if "knn/top1" in m and "linear/top1" in m and run.tags().get(tracking.TAG_PRETRAIN) == "finished":
        run.set_status("finished")


# --------------------------------------------------------------------------- baselines
def run_baseline(cell: dict, out: Path, *, tracking_uri: str | None, experiment: str,
                 cache: Path | None = None, device: str | None = None) -> dict:
    """Raw pixels or a random-init encoder, evaluated by the same kNN and linear probe."""
    from . import evaluate, train

    _threads(cell)
    d = load_cell_data(cell, cache)
    if cell["baseline"] == "raw_pixels":
        tr_f, te_f = evaluate.raw_pixel_features(d.train_x), evaluate.raw_pixel_features(d.test_x)
    elif cell["baseline"] == "random_init":
        import torch

        torch.manual_seed(cell["seed"])
        model = train.build_model(cell, d.train_x.shape[1], d.train_x.shape[-1])
        dev = train.resolve_device(device or cell.get("device", "auto"))
        bb = model.backbone.to(dev)
        tr_f = evaluate.embed(bb, d.train_x, d.mean, d.std, device=dev)
        te_f = evaluate.embed(bb, d.test_x, d.mean, d.std, device=dev)
    else:
        raise ValueError(f"baseline must be raw_pixels or random_init, not {cell['baseline']!r}")
    feats = (tr_f, d.train_y.numpy(), te_f, d.test_y.numpy())
    numeric = {}
    for kind in ("knn", "linear"):
        m = _eval_on_features(kind, cell, feats)
        numeric.update({f"{kind}/{k}": float(v) for k, v in m.items() if isinstance(v, (int, float))})
    if tracking_uri:
        from . import tracking

        params = {"dataset": cell["dataset"], "baseline": cell["baseline"], "seed": str(cell["seed"]),
                  "image_size": str(d.train_x.shape[-1]), "backbone": cell["train"]["backbone"]}
        run = tracking.open_cell_run(tracking_uri, experiment, cell, kind="baseline", params=params)
        run.log(numeric, 0)
        run.set_status("finished")
    result = {"status": "finished", "cell_id": cell["id"], **numeric}
    write_json(out, result)
    print(json.dumps(result), file=sys.stderr)
    return result
