"""Peak memory and speed of one large contrastive batch, with and without gradient caching.

One training step (forward of both views, InfoNCE over the 2N views, backward; no
optimiser step) of the default study's model (``small_cnn`` width 32, 4x4 pooling grid,
projection head 128 -> 64, float32) on a batch of N images at 28 px:

* **whole** -- one forward of the 2N views with a graph, as ``training/step.py`` does today;
* **chunked** -- ``smallbatch.training.gradcache.cached_backward`` with chunks of C images
  (2C views per forward), the path ``train.chunk_size`` takes: BatchNorm statistics
  found layer by layer without graph, embeddings, loss and its gradient on all
  embeddings, the statistics' adjoints layer by layer, then each chunk re-run with graph.

Each variant runs in a fresh subprocess, so its peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) is its own; the step's share is the peak minus
the peak before the step (imports, model, data).  The inputs are random normalised
views (augmentation is not what is measured).  BatchNorm trains (``--bn train``, the
default: what training does; the statistics are the whole batch's in both variants), so
the two gradients and the running statistics must agree: their maximum relative
differences (max |a_whole - a_chunked| / max |a_whole|, float32 rounding) are printed
beside.  ``--bn eval`` measures frozen statistics (the paper's three passes, no
statistics sweeps).  One timed step per variant on a shared CPU: the load average
before and after is printed; re-time on a quiet machine.

    python benchmarks/large_batch.py [--batch 4096] [--chunk 256] [--image-size 28]
                                     [--threads 1] [--bn eval|train] [--loss infonce]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _model(args):
    from smallbatch.training.models import ContrastiveModel, build_backbone

    torch.manual_seed(0)
    backbone, feat = build_backbone("small_cnn", 1, args.image_size, width=args.width, pool_grid=args.pool_grid)
    return ContrastiveModel(backbone, feat, args.proj_hidden, args.proj_dim)


def run_variant(args) -> None:
    """The child: one step of ``args.variant``; prints a JSON line, saves the gradient."""
    from contextlib import nullcontext

    from smallbatch.losses import build_loss
    from smallbatch.training.gradcache import cached_backward, eval_batchnorm

    torch.set_num_threads(args.threads)
    model = _model(args).train()
    loss_fn = build_loss(args.loss)

    def loss(z1, z2):
        return loss_fn(z1, z2, temperature=0.1)

    g = torch.Generator().manual_seed(1)
    shape = (args.batch, 1, args.image_size, args.image_size)
    v1, v2 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    chunk = args.batch if args.variant == "whole" else args.chunk
    before = _peak_mib()
    t0 = time.perf_counter()
    with eval_batchnorm(model) if args.bn == "eval" else nullcontext():
        out, _ = cached_backward(model, (v1, v2), loss, chunk)
    seconds = time.perf_counter() - t0
    peak = _peak_mib()
    torch.save(
        {
            "grad": torch.cat([p.grad.flatten() for p in model.parameters()]),
            "bn": torch.cat([b.flatten().double() for b in model.buffers()]),
        },
        args.grad_out,
    )
    print(
        json.dumps(
            {
                "variant": args.variant,
                "chunk": chunk,
                "seconds": seconds,
                "images_per_s": args.batch / seconds,
                "peak_mib": peak,
                "step_mib": peak - before,
                "loss": float(out.loss),
            }
        )
    )


def _child(args, variant: str, grad_out: Path) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--grad-out", str(grad_out)]
    for key in (
        "batch",
        "chunk",
        "image_size",
        "width",
        "pool_grid",
        "proj_hidden",
        "proj_dim",
        "threads",
        "bn",
        "loss",
    ):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{variant} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4096, help="images per step (2x views)")
    p.add_argument("--chunk", type=int, default=256, help="images per chunk of the chunked variant")
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--pool-grid", type=int, default=4)
    p.add_argument("--proj-hidden", type=int, default=128)
    p.add_argument("--proj-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bn", choices=("train", "eval"), default="train")
    p.add_argument("--loss", default="infonce")
    p.add_argument("--variant", choices=("whole", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--grad-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        return run_variant(args)

    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_child(args, v, Path(tmp, f"{v}.pt")) for v in ("whole", "chunked")]
        sw, sc = (torch.load(Path(tmp, f"{v}.pt"), weights_only=True) for v in ("whole", "chunked"))
    load1 = os.getloadavg()
    diff = {k: float((sw[k] - sc[k]).abs().max() / sw[k].abs().max()) for k in ("grad", "bn")}
    print(
        f"batch {args.batch} images ({2 * args.batch} views) at {args.image_size} px, small_cnn w{args.width} "
        f"g{args.pool_grid}, {args.loss}, BN {args.bn}, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(f"{'variant':<18}{'s/step':>9}{'images/s':>11}{'peak RSS MiB':>14}{'step MiB':>10}{'loss':>12}")
    for r in rows:
        name = "whole" if r["variant"] == "whole" else f"chunked ({r['chunk']})"
        print(
            f"{name:<18}{r['seconds']:>9.2f}{r['images_per_s']:>11.1f}{r['peak_mib']:>14.0f}"
            f"{r['step_mib']:>10.0f}{r['loss']:>12.6f}"
        )
    w, c = rows
    print(
        f"memory whole/chunked: peak {w['peak_mib'] / c['peak_mib']:.2f}x, step {w['step_mib'] / c['step_mib']:.2f}x;"
        f" speed chunked/whole {c['images_per_s'] / w['images_per_s']:.2f}x"
    )
    print(f"max relative difference whole vs chunked: gradient {diff['grad']:.2e}, BatchNorm buffers {diff['bn']:.2e}")
    print(
        f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
        f"after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (on {os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
