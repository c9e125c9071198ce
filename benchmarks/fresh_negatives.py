"""The extra forward cost of fresh negatives (``train.extra_negatives``), side by side.

Three arms of the instrument study, on its data and network (Fashion-MNIST at 16 px, 10k
pretraining images, ``small_cnn`` width 32 with global average pooling, InfoNCE, Adam,
BatchNorm over groups of 16 images, one thread as a study job has):

* ``B=16``: plain batch 16 (K = 30);
* ``B=256``: plain batch 256 (K = 510);
* ``B=16+E``: batch 16 with E extra images encoded without gradient (K = 2(16+E)-2; E = 240:
  K = 510 at batch 16's steps).

Each arm trains through ``smallbatch.training.loop.one_step`` (the loop's own step, the
extra images chosen as the loop chooses them) for ``--steps`` steps after ``--warmup``
steps; the arms take turns, ``--rounds`` times, so load changes reach all three alike.
Prints per arm the median CPU seconds (``time.process_time``: this process's threads) and
wall seconds per step and per epoch (steps per epoch: 10,000 // batch), the ratio to B=16 and
to B=256, and the load average before and after.

    python benchmarks/fresh_negatives.py [--extra 240] [--steps 40] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DATA_ROOT = "/usr/share/datasets/fashion-mnist"


def _cell(batch_size: int, extra: int | None) -> dict:
    from smallbatch.study.cells import make_cell
    from smallbatch.study.config import load_config

    cfg = load_config(
        None,
        {
            "datasets": {"fashion_mnist": {"image_size": 16, "train_subset": 10000, "root": DATA_ROOT}},
            "train": {"pool_grid": 1, "bn_group": 16, "extra_negatives": extra, "log_every": 10**6},
        },
    )
    return make_cell(
        cfg, dataset="fashion_mnist", loss="infonce", loss_params={}, batch_size=batch_size, temperature=0.1, seed=0
    )


def _arm(cell: dict, d, out: Path):
    from smallbatch.study.cell import Cell
    from smallbatch.training import loop as train

    t = train.build_training(Cell.of(cell), d.pretrain_x, d.mean, d.std, torch.device("cpu"), out)
    perm = torch.randperm(d.pretrain_x.shape[0], generator=t.rng.generator("permutation", 0))
    return t, perm


def _time(t, perm, steps: int) -> tuple[float, float]:
    """CPU and wall seconds of ``steps`` steps of the loop (from where ``t`` stands)."""
    from smallbatch.training import loop as train

    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        pos = t.step % t.steps_per_epoch
        train.one_step(t, train.step_images(t, perm, pos), watch=False)
    return time.process_time() - c0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", type=int, default=240)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per arm and round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from smallbatch.data import load as data

    d = data.load_dataset("fashion_mnist", DATA_ROOT, seed=0, image_size=16, train_subset=10000)
    load0 = os.getloadavg()
    arms = {"B=16": (16, None), "B=256": (256, None), f"B=16+E={args.extra}": (16, args.extra)}
    runs, cpu, wall = {}, {k: [] for k in arms}, {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (bs, extra) in arms.items():
            runs[name] = _arm(_cell(bs, extra), d, Path(tmp) / name.replace("=", "").replace("+", "_"))
            _time(*runs[name], args.warmup)
        for _ in range(args.rounds):
            for name in arms:
                c, w = _time(*runs[name], args.steps)
                cpu[name].append(c / args.steps)
                wall[name].append(w / args.steps)
    load1 = os.getloadavg()
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs; "
        f"{args.rounds} rounds x {args.steps} steps per arm, arms in turn"
    )
    print(
        f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}"
    )
    print(
        "| arm | K | steps/epoch | CPU ms/step | wall ms/step | CPU s/epoch | wall s/epoch | CPU vs B=16 | CPU vs B=256 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    per_epoch = {}
    for name, (bs, extra) in arms.items():
        spe = d.pretrain_x.shape[0] // bs
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        per_epoch[name] = (c * spe, w * spe, 2 * (bs + (extra or 0)) - 2, spe, c, w)
    base16, base256 = per_epoch["B=16"][0], per_epoch["B=256"][0]
    for name, (ce, we, k, spe, c, w) in per_epoch.items():
        print(
            f"| {name} | {k} | {spe} | {1e3 * c:.1f} | {1e3 * w:.1f} | {ce:.1f} | {we:.1f} | "
            f"{ce / base16:.2f}x | {ce / base256:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
