"""Steps to a target kNN accuracy against batch size: InfoNCE, DCL and a supervised cross-entropy
control on the instrument's data and network (``workflow/configs/instrument.yaml``).

Data: Fashion-MNIST at 28 px (Debian's dataset-fashion-mnist), a stratified subset of
``10,000 + --val`` training images, of which ``--val`` (a fixed draw) are held out as the
validation split: the probe's queries (``--queries``) and bank (the rest).  The arms train on
the other 10,000 images; the test split is never read.  Network: ``small_cnn`` width 32, the
last map pooled to 2 x 2 (512-d features), crops of (0.8, 1), BatchNorm over the whole batch
(the supervised baseline's; the instrument's bn_group is left out).  Optimiser: Adam, 1e-3 at
B = 256 scaled by the square-root rule (``lr_scaling: sqrt``), warm-up 0.02 epochs, then a
constant rate (so stopping at the target does not change the trajectory).  τ = 0.1.

Each run evaluates the probe (kNN top-1, k = 20, t = 0.07) at step 0 and at the steps nearest
``--first-images * 2**(k / --per-octave)`` images up to ``--max-images``, stops at its first
evaluation at or past ``--target`` (percent), and records the interpolated first crossing.
Resumable: one row per (arm, B, seed) appended to ``runs.csv`` in ``--out`` (and its curve to
``curves.csv``); a rerun skips the rows already there.

    python benchmarks/steps_to_target.py --target 80 --out benchmarks/results/2026-12-07-steps-to-target
    python benchmarks/steps_to_target.py --pilot --batch-sizes 64 --out /tmp/pilot   # curves, no stop
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

DATA_ROOT = "/usr/share/datasets/fashion-mnist"
REPO = Path(__file__).resolve().parents[1]
TAU, K, KNN_T = 0.1, 20, 0.07
FIELDS = ["arm", "batch_size", "seed", "target", "steps", "images", "status", "peak_lr", "evals", "cpu_s", "wall_s"]


def _cell(arm: str, batch: int, seed: int, last: int):
    """The arm's cell (the supervised control trains the InfoNCE cell's network and optimiser)."""
    from smallbatch.cell import Cell
    from smallbatch.evaluation.steps_to_target import SUPERVISED
    from smallbatch.pipeline.cells import make_cell
    from smallbatch.pipeline.config import load_config

    train = {
        "pool_grid": 2,
        "width": 32,
        "warmup_epochs": 0.02,
        "lr": 1e-3,
        "lr_scaling": "sqrt",
        "lr_schedule": "constant",
        "log_every": 10**6,
    }
    over = {
        "datasets": {"fashion_mnist": {"root": DATA_ROOT, "image_size": None, "train_subset": 10000}},
        "train": train,
        "augment": {"crop_scale": [0.8, 1.0]},
    }
    cfg = load_config(str(REPO / "config.yaml"), over)
    loss = "infonce" if arm == SUPERVISED else arm
    cell = make_cell(
        cfg,
        dataset="fashion_mnist",
        loss=loss,
        loss_params={},
        batch_size=batch,
        temperature=TAU,
        seed=seed,
        train_overrides={"steps": last},
    )
    return Cell.of(cell)


def _done(path: Path) -> set[tuple[str, int, int]]:
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["arm"], int(r["batch_size"]), int(r["seed"])) for r in csv.DictReader(f)}


def _append(path: Path, fields: list[str], rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def _record(out: Path, res, wall: float) -> None:
    c = res.curve
    row = {
        "arm": res.arm,
        "batch_size": res.batch_size,
        "seed": res.seed,
        "target": res.target,
        "steps": "" if res.steps is None else f"{res.steps:.2f}",
        "images": "" if res.images is None else f"{res.images:.0f}",
        "status": res.status,
        "peak_lr": f"{res.peak_lr:.6g}",
        "evals": len(c.steps),
        "cpu_s": f"{res.cpu_s:.1f}",
        "wall_s": f"{wall:.1f}",
    }
    curve = [
        {"arm": res.arm, "batch_size": res.batch_size, "seed": res.seed, "step": s, "images": i, "accuracy": a}
        for s, i, a in zip(c.steps, c.images, c.accuracy)
    ]
    _append(out / "curves.csv", ["arm", "batch_size", "seed", "step", "images", "accuracy"], curve)
    _append(out / "runs.csv", FIELDS, [row])  # last: a row here means the run is whole


def _utc_today(hhmm: str) -> float:
    """The epoch time of ``hhmm`` (UTC) today."""
    import datetime as dt

    h, m = (int(x) for x in hhmm.split(":"))
    now = dt.datetime.now(dt.timezone.utc)
    return now.replace(hour=h, minute=m, second=0, microsecond=0).timestamp()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, help="kNN top-1 (percent) on the validation split; required unless --pilot")
    ap.add_argument("--pilot", action="store_true", help="no target: every run to --max-images")
    ap.add_argument("--arms", nargs="+", default=["infonce", "dcl", "supervised_ce"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--max-images", type=int, default=40000)
    ap.add_argument("--first-images", type=int, default=250)
    ap.add_argument("--per-octave", type=int, default=3)
    ap.add_argument("--val", type=int, default=5000, help="training images held out as the validation split")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stop-by", dest="stop_by_text", help="HH:MM (UTC, today): start no run after it")
    args = ap.parse_args(argv)
    args.stop_by = _utc_today(args.stop_by_text) if args.stop_by_text else None
    if (args.target is None) != args.pilot:
        ap.error("give --target (percent) or --pilot, not both")
    torch.set_num_threads(args.threads)
    from smallbatch import data
    from smallbatch.evaluation import steps_to_target as stt

    target = float("inf") if args.pilot else args.target
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"target: kNN@{K} top-1 >= {target} % on {args.val} held-out training images; {vars(args)}", flush=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    d = data.load_dataset("fashion_mnist", DATA_ROOT, seed=0, train_subset=10000 + args.val)
    arms_data, probe = stt.split_data(d, args.val, queries=args.queries, k=K, t=KNN_T)
    done = _done(args.out / "runs.csv")
    t0, cpu0 = time.perf_counter(), time.process_time()
    for seed in args.seeds:  # seeds outermost: a stage cut short keeps every batch size and arm
        for batch in args.batch_sizes:
            schedule = stt.eval_steps(batch, args.first_images, args.max_images, args.per_octave)
            for arm in args.arms:
                if (arm, batch, seed) in done:
                    continue
                if args.stop_by and time.time() > args.stop_by:
                    print(f"stopped: no new run after {args.stop_by_text} UTC (--stop-by)", flush=True)
                    return _end(t0, cpu0)
                w0 = time.perf_counter()
                cell = _cell(arm, batch, seed, schedule[-1])
                res = stt.run_arm(cell, arm, arms_data, probe, schedule, target, stop_at_target=not args.pilot)
                _record(args.out, res, time.perf_counter() - w0)
                print(
                    f"[{time.perf_counter() - t0:6.0f} s wall, {time.process_time() - cpu0:6.0f} s CPU] {arm} B={batch} "
                    f"s={seed}: {res.status}, steps {res.steps}, {res.cpu_s:.0f} CPU-s; "
                    f"curve {json.dumps(list(zip(res.curve.images, res.curve.accuracy)))}",
                    flush=True,
                )
    return _end(t0, cpu0)


def _end(t0: float, cpu0: float) -> int:
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"wall {time.perf_counter() - t0:.0f} s, CPU {time.process_time() - cpu0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
