"""Synthetic data for tests and benchmarks, in the shapes and on-disk formats of the real
data sets, so that a check needs no download.

* :func:`random_images`: uint8 images ``(N, C, H, W)`` with their per-channel mean/std,
  as a training step takes them (throughput benchmarks);
* :func:`write_cifar10`: a ``cifar-10-batches-py`` folder in torchvision's pickle layout
  (``data_batch_1..5``, ``test_batch``, ``batches.meta``), read by the real loader;
  :func:`cifar_images` (random, the red plane encodes the row: an orientation check) or
  :func:`striped_images` (the class is the stripes' orientation: something a
  contrastive encoder learns under SimCLR's augmentations, so probes beat chance);
* :func:`existence_only_check`: torchvision's ``check_integrity`` without the md5
  comparison (generated files cannot match torchvision's md5 list of the real ones);
* :func:`clustered_features`: random features around class centres (kNN benchmarks).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from smallbatch.io import atomic_write

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def random_images(n: int, channels: int, size: int, seed: int = 0) -> tuple[torch.Tensor, tuple, tuple]:
    """(uint8 images (n, channels, size, size) uniform in 0..255, per-channel mean, std)."""
    from smallbatch.data.load import channel_stats

    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=gen)
    mean, std = channel_stats(images)
    return images, mean, std


def write_pickle(path: Path, obj) -> None:
    atomic_write(path, lambda fh: pickle.dump(obj, fh, protocol=2))


def cifar_images(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 3, 32, 32) uint8 whose red plane encodes the row (for an orientation check)."""
    images = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    images[:, 0] = (np.arange(32, dtype=np.uint8) * 7)[None, :, None]
    return images


def striped_images(labels: np.ndarray, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """(n, 3, size, size) uint8 grey stripes whose orientation is the label (0..9 -> 0..81
    degrees: a horizontal flip makes -θ, no other class's angle), at a random frequency
    and phase, with pixel noise: colour jitter, grayscale and crops keep the class."""
    n = len(labels)
    theta = np.deg2rad(9.0 * np.asarray(labels, dtype=np.float64))[:, None, None]
    freq = rng.uniform(0.08, 0.2, n)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n)[:, None, None]
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    wave = np.sin(2 * np.pi * freq * (x * np.cos(theta) + y * np.sin(theta)) + phase)
    grey = 128 + 90 * wave[:, None] + rng.normal(0, 20, (n, 3, size, size))
    return np.clip(grey, 0, 255).astype(np.uint8)


def write_cifar10(
    root: Path,
    per_batch: int = 20,
    test: int = 30,
    seed: int = 0,
    images: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """``root/cifar-10-batches-py/`` with 5 training batches of ``per_batch`` images and a
    test batch of ``test``; ``images(labels, rng)`` draws the images of the labels (default:
    :func:`cifar_images`).  Returns what was written (train_x/train_y/test_x/test_y)."""
    draw = images or (lambda labels, rng: cifar_images(len(labels), rng))
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_images, train_labels = [], []
    for b in range(1, 6):
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = draw(np.array(labels), rng)
        write_pickle(
            folder / f"data_batch_{b}",
            {
                "batch_label": f"training batch {b} of 5",
                "labels": labels,
                "data": batch.reshape(per_batch, -1),
                "filenames": [f"img{i}.png" for i in range(per_batch)],
            },
        )
        train_images.append(batch)
        train_labels += labels
    test_labels = [i % 10 for i in range(test)]
    test_images = draw(np.array(test_labels), rng)
    write_pickle(
        folder / "test_batch",
        {"batch_label": "testing batch 1 of 1", "labels": test_labels, "data": test_images.reshape(test, -1)},
    )
    write_pickle(
        folder / "batches.meta", {"num_cases_per_batch": per_batch, "label_names": CIFAR10_CLASSES, "num_vis": 3072}
    )
    return {
        "train_x": np.concatenate(train_images),
        "train_y": np.array(train_labels),
        "test_x": test_images,
        "test_y": np.array(test_labels),
    }


def existence_only_check(fpath: str, md5: str | None = None) -> bool:
    """torchvision's ``check_integrity`` less the md5 comparison: the file must exist."""
    return os.path.isfile(fpath)


def clustered_features(
    n_train: int, n_test: int, dim: int, classes: int = 10, noise: float = 6.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_f, train_y, test_f, test_y): float32 Gaussian features around unit-variance
    class centres (noise std ``noise``), so kNN accuracies mean something; continuous
    random values, so exact ties between similarities are (almost surely) absent."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim)).astype(np.float32)
    ytr = rng.integers(0, classes, n_train)
    yte = rng.integers(0, classes, n_test)
    tr = centers[ytr] + noise * rng.standard_normal((n_train, dim), dtype=np.float32)
    te = centers[yte] + noise * rng.standard_normal((n_test, dim), dtype=np.float32)
    return tr, ytr, te, yte
