"""Pretraining throughput: smallbatch's batched on-device pipeline vs a per-sample DataLoader.

Both sides train the same model (``small_cnn`` + SimCLR projection head, built by
``train.build_model`` from one cell) with the same loss (InfoNCE / NT-Xent) and
Adam, on the same uint8 images, with the same augmentation recipe
(``gray_small``: random resized crop (0.2, 1), flip, brightness/contrast jitter
0.4 with p=0.8):

* **batched** -- ``smallbatch.training.loop.pretrain`` itself: the whole uint8 tensor on the
  device, a batch indexed per step, two views drawn per sample by ``BatchAugment``,
  one forward pass over the 2N views.  Its rate is read from the loop's own
  ``train/images_per_s`` metric over the second half of the run (``log_every`` =
  half the steps), so model building and the first (warm-up) steps are excluded.
* **per-sample** -- what users usually write: a torchvision ``FashionMNIST``-like
  ``Dataset`` over the same uint8 tensor (PIL image per sample, as
  ``torchvision.datasets.FashionMNIST.__getitem__`` does), a ``transforms.v2``
  SimCLR-style pipeline applied twice per sample, ``DataLoader(num_workers=2,
  shuffle=True, drop_last=True)``; timed over the same number of steps after the
  same number of warm-up steps.

Prints images/s (N per step; views/s = 2N) of both, side by side, and the ratio
batched / per-sample, per batch size, measured in this one run, plus the load
average before and after (other processes sharing the CPU lower both sides).

    python benchmarks/throughput.py [--batch-sizes 16 256] [--image-size 16] [--steps 20]
                                    [--threads 1] [--dataset fashion_mnist] [--data-root results/data]

Two more comparisons of the training step itself (the default study's cell: small_cnn
width 32, ``pool_grid`` 4, 16 px, InfoNCE, Adam), each side by side in one run:

* ``--mode compile``: eager vs ``train.compile`` (``torch.compile`` of the step: one graph
  for views + model + loss, its backward, one for the optimiser update; CUDA graphs on a
  GPU), images/s per batch size, with the compile time beside it -- cold (an empty
  inductor cache) and warm (the cache a previous cell left, as the next cells of a
  study find it), each in a fresh process;
* ``--mode share``: k cells training at once on one device (k processes, each one cell,
  one thread; their timed windows start together, after every process has warmed up),
  their summed images/s for k = 1, 2, 4: what ``cells_per_gpu`` buys.

``benchmarks/gpu_check.py`` uses both on a GPU, with synthetic images of the study's shape.

``--device auto`` uses CUDA when torch sees it.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synthetic.py: images in the real formats


def _cell(dataset: str, batch_size: int, steps: int, width: int, temperature: float) -> dict:
    from smallbatch.study.cells import make_cell
    from smallbatch.study.config import load_config

    cfg = load_config(
        None,
        {
            "datasets": {dataset: {}},
            "train": {
                "backbone": "small_cnn",
                "width": width,
                "optimizer": "adam",
                "lr": 1e-3,
                "lr_scaling": "none",
                "warmup_epochs": 0,
                "steps": 2 * steps,
                "log_every": steps,
                "precision": "fp32",
            },
            "augment": {"recipe": "gray_small"},
        },
    )
    return make_cell(
        cfg, dataset=dataset, loss="infonce", loss_params={}, batch_size=batch_size, temperature=temperature, seed=0
    )


def batched_rate(cell: dict, images: torch.Tensor, mean, std) -> float:
    """images/s of train.pretrain over its second ``log_every`` window."""
    from smallbatch.study.cell import Cell
    from smallbatch.training import loop as train

    logs: list[tuple[int, dict]] = []
    with tempfile.TemporaryDirectory() as out:
        train.pretrain(
            Cell.of(cell),
            images,
            mean,
            std,
            Path(out),
            device="cpu",
            progress=False,
            log_fn=lambda m, s: logs.append((s, m)),
        )
    return float(logs[-1][1]["train/images_per_s"])


class PerSampleImages(torch.utils.data.Dataset):
    """A torchvision-FashionMNIST-like dataset over a uint8 (N, 1, H, W) tensor:
    each item is a PIL image passed through ``transform`` (which returns two views)."""

    def __init__(self, images: torch.Tensor, transform) -> None:
        self.images = images[:, 0].contiguous()  # (N, H, W) like FashionMNIST.data
        self.transform = transform

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.fromarray(self.images[i].numpy(), mode="L")
        return self.transform(img)


class TwoViews:
    def __init__(self, t) -> None:
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


def simclr_transform(size: int, mean, std):
    """The gray_small recipe as a per-sample torchvision transforms.v2 pipeline."""
    from torchvision.transforms import v2

    return TwoViews(
        v2.Compose(
            [
                v2.RandomResizedCrop(size, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
                v2.RandomHorizontalFlip(p=0.5),
                v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4)], p=0.8),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(list(mean), list(std)),
            ]
        )
    )


def per_sample_rate(cell, images: torch.Tensor, mean, std, steps: int, workers: int) -> float:
    """images/s of a per-sample DataLoader pipeline with the same model, loss and optimiser."""
    from smallbatch.losses import build_loss
    from smallbatch.study.cell import Cell
    from smallbatch.training import loop as train

    cell = Cell.of(cell)
    torch.manual_seed(0)
    bs = cell.batch_size
    size = images.shape[-1]
    model = train.build_model(cell, images.shape[1], size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=cell.train.weight_decay)
    loss_fn = build_loss("infonce")
    ds = PerSampleImages(images, simclr_transform(size, mean, std))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=bs, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0
    )
    model.train()
    done, t0 = 0, None
    while done < 2 * steps:
        for v1, v2 in loader:
            z = model(torch.cat([v1, v2]))
            out = loss_fn(z[:bs], z[bs:], temperature=cell.temperature)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            done += 1
            if done == steps:  # warm-up done (workers started, first batches made)
                t0 = time.perf_counter()
            if done == 2 * steps:
                break
    rate = steps * bs / (time.perf_counter() - t0)
    del loader
    return rate


# --------------------------------------------------------------------------- the step itself
#: the study config whose cell :func:`study_cell` builds, per data set
STUDY_CONFIGS = {"fashion_mnist": "config.yaml", "cifar10": "workflow/configs/cifar10.yaml"}


def study_cell(batch_size: int, compile_step: bool, device: str, dataset: str = "fashion_mnist", **train) -> dict:
    """The InfoNCE cell of a study at ``batch_size``, eager or compiled: the default study's
    (config.yaml: small_cnn, 16 px) or, for ``cifar10``, cifar10.yaml's (resnet18_cifar,
    SimCLR augmentations, LARS, bf16); ``train``: more train settings (e.g. precision)."""
    from smallbatch.study.cells import make_cell
    from smallbatch.study.config import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / STUDY_CONFIGS[dataset], {"train": {"compile": compile_step, **train}, "device": device})
    return make_cell(
        cfg, dataset=dataset, loss="infonce", loss_params={}, batch_size=batch_size, temperature=0.1, seed=0
    )


def step_rate(cell, images, mean, std, steps: int, ready=None) -> tuple[float, float]:
    """(images/s over ``steps`` steps, seconds of building + the first two steps: the
    compile time when the step is compiled).  ``ready()``, when given, runs between the
    two (a barrier, so that cells sharing a device time the same window)."""
    from smallbatch.study.cell import Cell
    from smallbatch.training import loop as train

    cell = Cell.of(cell)
    t0 = time.perf_counter()
    dev = train.resolve_device(cell.device)
    t = train.build_training(cell, images, mean, std, dev, Path(tempfile.mkdtemp()))
    bs, n = cell.batch_size, images.shape[0]
    perm = torch.randperm(n, device=dev)

    def one(i: int) -> None:
        idx = perm[(i * bs) % (n - bs) :][:bs]
        u = t.step_fn.aug.draw(2 * bs, t.rng.generator("augment", i))
        t.step_fn.run(t.images[idx], u, idx)

    one(0), one(1)
    _sync(dev)
    warm = time.perf_counter() - t0
    if ready is not None:
        ready()
    t1 = time.perf_counter()
    for i in range(2, steps + 2):
        one(i)
    _sync(dev)
    return steps * bs / (time.perf_counter() - t1), warm


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _in_subprocess(args: list[str], env: dict | None = None) -> dict:
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=1800,
    )
    if out.returncode:
        raise SystemExit(f"throughput.py {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _one_cell(args) -> int:
    """(internal) one cell's step rate in this process, as JSON."""
    import json

    import synthetic

    from smallbatch.data import load as data

    torch.set_num_threads(args.threads)
    if args.synthetic:  # the images' shape and size, no data set needed (a bare GPU machine)
        images, mean, std = synthetic.random_images(10000, 1, 16)
    else:
        d = data.load_dataset("fashion_mnist", args.data_root, image_size=16, train_subset=10000)
        images, mean, std = d.pretrain_x, d.mean, d.std
    ready = (lambda: barrier(Path(args.barrier), args.parties)) if args.barrier else None
    rate, warm = step_rate(
        study_cell(args.batch_sizes[0], args.compiled, args.device), images, mean, std, args.steps, ready
    )
    print(json.dumps({"rate": rate, "warm_s": warm}))
    return 0


def barrier(folder: Path, parties: int, timeout: float = 600.0) -> None:
    """Wait until ``parties`` processes have reached this point (each leaves a file in
    ``folder``); RuntimeError after ``timeout`` seconds (a party died)."""
    (folder / str(os.getpid())).touch()
    t0 = time.monotonic()
    while len(list(folder.iterdir())) < parties:
        if time.monotonic() - t0 > timeout:
            arrived = len(list(folder.iterdir()))
            raise RuntimeError(f"barrier: {arrived} of {parties} processes arrived in {timeout:.0f} s")
        time.sleep(0.01)


def one_cell_args(
    batch_size: int, steps: int, threads: int, device: str, data_root: str = "results/data", synthetic: bool = False
) -> list[str]:
    """The arguments of a process that times one cell (:func:`_one_cell`)."""
    return [
        "--one-cell",
        "--batch-sizes",
        str(batch_size),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--device",
        device,
        "--data-root",
        data_root,
    ] + (["--synthetic"] if synthetic else [])


def share_rates(common: list[str], ks) -> dict[int, list[float]]:
    """For each k in ``ks``: k processes (``common``: :func:`one_cell_args`) training one
    cell each on one device at once, their timed windows started together by a barrier;
    each process's images/s."""
    import concurrent.futures as cf

    rates = {}
    for k in ks:
        with tempfile.TemporaryDirectory() as meet, cf.ThreadPoolExecutor(k) as ex:
            args = [*common, "--barrier", meet, "--parties", str(k)]
            rates[k] = list(ex.map(lambda _, args=args: _in_subprocess(args)["rate"], range(k)))
    return rates


def compare_compile(args) -> None:
    """Per batch size, four processes in turn: eager, compiled (cold cache), eager,
    compiled (warm cache), so a load that changes during the run weighs on both sides;
    the better of the two processes on each side, and the 1-minute load average as the
    row started (other processes on the CPU lower both sides, not always equally)."""
    print(
        f"{'batch':>6} {'eager img/s':>12} {'compiled img/s':>15} {'ratio':>6} {'compile cold s':>15} "
        f"{'compile warm s':>15} {'load':>5}"
    )
    for bs in args.batch_sizes:
        load = os.getloadavg()[0]
        common = one_cell_args(bs, args.steps, args.threads, args.device, args.data_root)
        with tempfile.TemporaryDirectory() as cache:
            env = {"TORCHINDUCTOR_CACHE_DIR": cache}
            eager, compiled = [], []
            for _ in range(2):  # the first compiled process compiles cold, the second finds the cache
                eager.append(_in_subprocess(common, env))
                compiled.append(_in_subprocess([*common, "--compiled"], env))
        e_rate, rate = max(r["rate"] for r in eager), max(r["rate"] for r in compiled)
        build = min(r["warm_s"] for r in eager)
        print(
            f"{bs:>6} {e_rate:>12.0f} {rate:>15.0f} {rate / e_rate:>5.2f}x "
            f"{compiled[0]['warm_s'] - build:>15.1f} {compiled[1]['warm_s'] - build:>15.1f} {load:>5.1f}",
            flush=True,
        )
        print(
            "       each process (img/s): eager "
            + ", ".join(f"{r['rate']:.0f}" for r in eager)
            + "; compiled "
            + ", ".join(f"{r['rate']:.0f}" for r in compiled),
            flush=True,
        )


def compare_share(args) -> None:
    """k processes, one cell each, on one device at once: summed images/s."""
    print(f"{'batch':>6} " + " ".join(f"{f'k={k} img/s':>12}" for k in args.share))
    for bs in args.batch_sizes:
        rates = share_rates(one_cell_args(bs, args.steps, args.threads, args.device, args.data_root), args.share)
        print(f"{bs:>6} " + " ".join(f"{sum(rates[k]):>12.0f}" for k in args.share), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 256], help="N images per step")
    p.add_argument(
        "--image-size", type=int, default=16, help="images are resized to this side (Fashion-MNIST: 28 native)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per side, after as many warm-up steps")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training process (both sides)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the per-sample side")
    p.add_argument("--width", type=int, default=32, help="small_cnn base width (the study's default is 32)")
    p.add_argument("--repeats", type=int, default=1, help="repeat both sides and report medians")
    p.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "digits"])
    p.add_argument(
        "--data-root", default="results/data", help="where Fashion-MNIST is (or is unpacked from Debian's package)"
    )
    p.add_argument("--train-subset", type=int, default=10000, help="images to load (the study's default 10,000)")
    p.add_argument(
        "--mode",
        choices=["pipeline", "compile", "share"],
        default="pipeline",
        help="pipeline: batched vs per-sample DataLoader; compile: eager vs compiled step; "
        "share: k cells on one device at once",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="compile/share modes")
    p.add_argument("--share", type=int, nargs="+", default=[1, 2, 4], help="share mode: cells at once")
    p.add_argument("--one-cell", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--synthetic", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--barrier", help=argparse.SUPPRESS)
    p.add_argument("--parties", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_cell:
        return _one_cell(args)
    if args.mode != "pipeline":
        load0 = os.getloadavg()
        print(
            f"{args.mode}: default study cell (fashion_mnist 16 px, 10k images, small_cnn w32 g4, InfoNCE, Adam), "
            f"{args.steps} timed steps, {args.threads} thread(s), device {args.device}; "
            f"load average {load0[0]:.2f}"
        )
        (compare_compile if args.mode == "compile" else compare_share)(args)
        load1 = os.getloadavg()
        print(f"load average after: {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min) on {os.cpu_count()} CPUs")
        return 0

    from smallbatch.data import load as data

    torch.set_num_threads(args.threads)
    subset = args.train_subset if args.dataset != "digits" else None
    d = data.load_dataset(args.dataset, args.data_root, image_size=args.image_size, train_subset=subset)
    images, mean, std = d.pretrain_x, d.mean, d.std
    if images.shape[1] != 1:
        raise SystemExit("throughput.py: the per-sample side is written for grayscale images")
    load0 = os.getloadavg()
    print(
        f"{d.name}: {images.shape[0]} images {tuple(images.shape[1:])}, small_cnn width {args.width}, InfoNCE, "
        f"Adam; {args.steps} timed steps after {args.steps} warm-up; torch threads {args.threads}, "
        f"{args.workers} DataLoader workers; {os.cpu_count()} CPUs; load average {load0[0]:.2f}"
    )
    print(f"{'batch':>6} {'batched img/s':>14} {'per-sample img/s':>17} {'ratio':>7}   (views/s = 2 x img/s)")
    for bs in args.batch_sizes:
        cell = _cell(d.name, bs, args.steps, args.width, 0.1)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(batched_rate(cell, images, mean, std))
            theirs.append(per_sample_rate(cell, images, mean, std, args.steps, args.workers))
            torch.set_num_threads(args.threads)
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{bs:>6} {a:>14.0f} {b:>17.0f} {a / b:>6.1f}x", flush=True)
    load1 = os.getloadavg()
    print(f"load average after: {load1[0]:.2f} (1 min), {load1[1]:.2f} (5 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
