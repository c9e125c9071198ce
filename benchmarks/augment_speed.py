"""Batched augmentation speed: smallbatch's own tensor code vs kornia's AugmentationSequential.

Both sides apply the same transforms with per-sample random parameters to the same
uint8 batch and return normalised float32 views:

* 3x32x32 (CIFAR-like), SimCLR recipe at s=0.5: random resized crop (0.08, 1), flip,
  colour jitter (0.4, 0.4, 0.4, 0.1) p=0.8, grayscale p=0.2;
* 1x16x16 (Fashion-MNIST at 16 px), gray_small recipe: crop (0.08, 1), flip,
  brightness/contrast jitter 0.4 p=0.8;
* optionally 3x96x96 (STL-10-like, ``--stl``): SimCLR recipe with Gaussian blur p=0.5.

Prints one line per case with both median times and their ratio (kornia / own),
measured in this one run. kornia is optional: without it only the own times print.

    python benchmarks/augment_speed.py [--batch 256] [--repeats 20] [--threads 1] [--device cpu] [--stl]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from smallbatch.data.augment import AugmentConfig, BatchAugment


def _time(fns: list[Callable[[], torch.Tensor]], repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each of ``fns`` over ``repeats`` rounds after two warm-up rounds.

    The functions are called in turn within each round, so a change in machine load
    affects all of them alike.
    """
    times: list[list[float]] = [[] for _ in fns]
    for round_ in range(repeats + 2):
        for fn, record in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_ >= 2:
                record.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _kornia_pipeline(cfg: AugmentConfig, size: int, channels: int, mean, std) -> torch.nn.Module | None:
    try:
        import kornia.augmentation as K
    except ImportError:
        return None
    s = cfg.jitter_strength
    ops: list[torch.nn.Module] = [
        K.RandomResizedCrop((size, size), scale=cfg.crop_scale, ratio=cfg.crop_ratio),
        K.RandomHorizontalFlip(p=cfg.flip_p),
    ]
    if channels == 3:
        ops.append(K.ColorJitter(cfg.brightness * s, cfg.contrast * s, cfg.saturation * s, cfg.hue * s, p=cfg.jitter_p))
        if cfg.grayscale_p > 0:
            ops.append(K.RandomGrayscale(p=cfg.grayscale_p))
    else:
        ops.append(K.ColorJitter(cfg.brightness * s, cfg.contrast * s, 0.0, 0.0, p=cfg.jitter_p))
    if cfg.blur_p > 0 and size >= cfg.blur_min_size:
        k = max(3, int(cfg.blur_kernel_frac * size))
        k += 1 - k % 2
        ops.append(K.RandomGaussianBlur((k, k), cfg.blur_sigma, p=cfg.blur_p))
    ops.append(K.Normalize(mean=torch.tensor(mean), std=torch.tensor(std)))
    return K.AugmentationSequential(*ops)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stl", action="store_true", help="also time 3x96x96 with blur (slow on a CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    cases = [
        ("3x32x32 simclr s=0.5", AugmentConfig(recipe="simclr", jitter_strength=0.5), 3, 32),
        ("1x16x16 gray_small", AugmentConfig(recipe="gray_small"), 1, 16),
    ]
    if args.stl:
        cases.append(("3x96x96 simclr s=1 +blur", AugmentConfig(recipe="simclr"), 3, 96))

    print(f"batch {args.batch}, device {device}, threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'case':28s} {'own ms':>9s} {'kornia ms':>10s} {'kornia/own':>11s}")
    for label, cfg, channels, size in cases:
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (args.batch, channels, size, size), generator=gen, dtype=torch.uint8).to(device)
        mean, std = [0.5] * channels, [0.25] * channels
        own = BatchAugment(cfg, size, channels, mean, std)
        kornia = _kornia_pipeline(cfg, size, channels, mean, std)
        if kornia is None:
            (own_s,) = _time([lambda own=own, x=x, gen=gen: own(x, gen)], args.repeats, device)
            print(f"{label:28s} {own_s * 1e3:9.2f} {'n/a':>10s} {'(no kornia)':>11s}")
            continue
        kornia = kornia.to(device)

        def run_kornia(kornia=kornia, x=x) -> torch.Tensor:
            with torch.no_grad():
                return kornia(x.float() / 255.0)

        own_s, kornia_s = _time([lambda own=own, x=x, gen=gen: own(x, gen), run_kornia], args.repeats, device)
        print(f"{label:28s} {own_s * 1e3:9.2f} {kornia_s * 1e3:10.2f} {kornia_s / own_s:10.2f}x")


if __name__ == "__main__":
    main()
