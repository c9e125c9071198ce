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
``curves.csv``); a rerun skips the rows already there.  This is ``smallbatch steps-to-target
--config config.yaml --config workflow/configs/critical_batch.yaml`` (:mod:`smallbatch.pipeline.steps_job`)
with this machine's data root and the flags below laid over the section, plus the load and cost.

    python benchmarks/steps_to_target.py --target 80 --out benchmarks/results/2026-12-07-steps-to-target
    python benchmarks/steps_to_target.py --pilot --batch-sizes 64 --out /tmp/pilot   # curves, no stop (target 100 %)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DATA_ROOT = "/usr/share/datasets/fashion-mnist"
REPO = Path(__file__).resolve().parents[1]
CONFIGS = [REPO / "config.yaml", REPO / "workflow" / "configs" / "critical_batch.yaml"]


def _load(prefix: str) -> str:
    return f"load average {prefix}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=float, help="kNN top-1 (percent) on the validation split; required unless --pilot")
    ap.add_argument("--pilot", action="store_true", help="no target (100 %%): every run to --max-images")
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
    ap.add_argument("--stop-by", help="HH:MM (UTC, today): start no run after it")
    args = ap.parse_args(argv)
    if (args.target is None) != args.pilot:
        ap.error("give --target (percent) or --pilot, not both")
    from smallbatch.pipeline.steps_job import run_sweep, stop_time
    from smallbatch.study.config import load_config

    section = {
        "target": 100.0 if args.pilot else args.target,
        "arms": args.arms,
        "batch_sizes": args.batch_sizes,
        "seeds": args.seeds,
        "max_images": args.max_images,
        "first_images": args.first_images,
        "per_octave": args.per_octave,
        "validation": args.val,
        "queries": args.queries,
        "threads": args.threads,
    }
    data = {"fashion_mnist": {"root": DATA_ROOT, "train_subset": 10000 + args.val}}  # 10,000 trained on
    over = {"datasets": data, "experiments": {"critical_batch": section}}
    cfg = load_config(CONFIGS, over)
    print(f"{vars(args)}\n{_load('at start')}", flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s wall, {time.process_time() - cpu0:6.0f} s CPU] {msg}", flush=True)

    run_sweep(cfg, args.out, stop_by=stop_time(args.stop_by) if args.stop_by else None, log=log)
    print(
        f"{_load('at end')}\nwall {time.perf_counter() - t0:.0f} s, CPU {time.process_time() - cpu0:.0f} s", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
