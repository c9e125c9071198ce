"""Image data sets as whole uint8 tensors, ready to live on the device.

Every loader returns an :class:`ImageData`: ``uint8`` images of shape
``(N, C, H, W)`` and ``int64`` labels, plus the images used for contrastive
pretraining and their per-channel mean/std (in ``[0, 1]`` units). Nothing here
runs per sample in a training loop: a whole small data set is one tensor that the
training loop indexes with a batch of indices and hands to
:class:`smallbatch.data.augment.BatchAugment`.

Data sets (``DATASETS``):

``digits``
    scikit-learn's embedded 8x8 digits (1,797 images, values 0..16 scaled to
    0..255). One fixed stratified split, 1,437 train / 360 test, the same for every
    run seed so all cells share one test set. ``root`` is ignored. The tiny data
    set for unit tests and smoke runs.
``fashion_mnist``
    Fashion-MNIST (60,000 / 10,000 28x28 grayscale images) read by torchvision's
    ``FashionMNIST`` from ``<root>/FashionMNIST/raw/``. When that folder lacks the
    files, :func:`prepare_fashion_mnist` decompresses them from Debian's
    ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist/``);
    Debian recompressed the ``.gz`` files, so torchvision's md5 list does not
    match them, but the decompressed IDX files are what torchvision reads offline.
    Otherwise ``download=True`` lets torchvision download them.
``cifar10`` / ``cifar100``
    torchvision's ``CIFAR10`` / ``CIFAR100`` (``<root>/cifar-10-batches-py/``,
    ``<root>/cifar-100-python/``), md5-checked by torchvision.
``stl10``
    torchvision's ``STL10`` (``<root>/stl10_binary/``): ``unlabeled`` (100,000
    images) is the pretraining set, ``train`` (5,000) the labelled set for probes,
    ``test`` (8,000) the test set.
``fashion_mnist_pairs`` / ``fashion_mnist_triples``
    Composites of k = 2 / 3 Fashion-MNIST items stacked vertically in one square image
    (:mod:`smallbatch.data.composite`), labelled by the items' classes as a k-digit number:
    100 / 1,000 balanced classes. Train composites are built from the training split only
    and test composites from the test split only, by a generator seeded with ``seed``
    (the same composites for every run); ``train_subset`` / ``test_subset`` are the
    numbers of composites (default 60,000 / 10,000), ``image_size`` the composite's side
    (default 28: k strips of 28 / k rows). ``meta`` holds ``train_sources`` /
    ``test_sources`` (``int64 (n, k)`` tensors: the items' indices in Fashion-MNIST's
    training / test split) and ``tiles`` (k).
``imagefolder``
    An ImageNet-100-style tree ``<root>/train/<class>/<image>`` and
    ``<root>/val/<class>/<image>`` (``test/`` is accepted instead of ``val/``),
    enumerated by torchvision's ``ImageFolder``; each image is converted to RGB,
    its shorter side resized to ``image_size`` (antialiased bilinear) and centre
    cropped to a square.

Options common to all: ``image_size`` (antialiased bilinear resize of the uint8
images), ``train_subset`` / ``test_subset`` (a stratified random subset of that
many images, drawn with ``seed``; ``train_subset`` also caps STL-10's unlabeled
pretraining set with a plain random subset, so for STL-10 it may exceed the 5,000
labelled images, which are then all kept). A subset larger than its split is an
error: :func:`split_sizes` gives each split's size for the config's checks.

:func:`save_cache` / :func:`load_cache` store an :class:`ImageData` in one file;
loading it imports neither torchvision nor scikit-learn.

The files are read by :mod:`smallbatch.data.readers`; this module makes them tensors, subsets and caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..io import make_folder, read_problem, save_torch

# where Debian installs Fashion-MNIST and its files' names: one place, shared with the digest of its content
from .digest import DEBIAN_FASHION_MNIST, data_digest
from .readers import prepare_fashion_mnist, read_raw
from .registry import (
    DATASETS,
    base_dataset,
    dataset_spec,
    display_name,
    pretrain_images,
    pretrain_split,
    split_sizes,
    subset_problem,
)

__all__ = [
    "DATASETS",
    "DEBIAN_FASHION_MNIST",
    "base_dataset",
    "dataset_spec",
    "display_name",
    "split_sizes",
    "ImageData",
    "pretrain_images",
    "pretrain_split",
    "load_dataset",
    "prepare_fashion_mnist",
    "save_cache",
    "load_cache",
    "stratified_subset",
    "subset_problem",
    "resize_uint8",
    "channel_stats",
]


_CACHE_FORMAT = "smallbatch.ImageData"
_CACHE_VERSION = 1


@dataclass
class ImageData:
    """A labelled image data set as whole tensors.

    Attributes:
        name: data set name (one of :data:`DATASETS`).
        train_x: ``uint8 (N, C, H, W)`` labelled training images (probes, kNN database).
        train_y: ``int64 (N,)`` labels of ``train_x``.
        test_x: ``uint8 (M, C, H, W)`` test images.
        test_y: ``int64 (M,)`` labels of ``test_x``.
        pretrain_x: ``uint8`` images for contrastive pretraining; the very same tensor
            as ``train_x`` except for STL-10 (its unlabeled split).
        num_classes: number of classes.
        mean: per-channel mean of ``pretrain_x`` in ``[0, 1]`` units.
        std: per-channel standard deviation of ``pretrain_x`` in ``[0, 1]`` units.
        meta: how the data were loaded (source, image size, subsets, seed, class names).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    pretrain_x: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def pretrain_y(self) -> torch.Tensor | None:
        """Labels of ``pretrain_x`` (``train_y`` when it is ``train_x``; None for an unlabeled
        pretraining split such as STL-10's): for the oracle false-negative mask only."""
        return self.train_y if self.pretrain_x is self.train_x else None

    @property
    def channels(self) -> int:
        """Number of image channels."""
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        """Height (= width) of the images."""
        return int(self.train_x.shape[2])

    def to(self, device: torch.device | str) -> ImageData:
        """A copy with every tensor on ``device`` (``pretrain_x`` stays shared with ``train_x``)."""
        train_x = self.train_x.to(device)
        pretrain_x = train_x if self.pretrain_x is self.train_x else self.pretrain_x.to(device)
        return ImageData(
            self.name,
            train_x,
            self.train_y.to(device),
            self.test_x.to(device),
            self.test_y.to(device),
            pretrain_x,
            self.num_classes,
            self.mean,
            self.std,
            dict(self.meta),
        )


# --------------------------------------------------------------------------- helpers


def _check_optional_positive_int(value: Any, arg: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{arg} must be a positive integer or None, got {value!r}")
    return int(value)


def stratified_subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Sorted indices of a stratified random subset of ``n`` of ``labels``.

    Each class gets ``n * count / N`` images rounded by largest remainder (ties broken
    at random), the images within a class drawn at random with ``seed``. ``n`` at
    least ``len(labels)`` returns every index.
    """
    labels = np.asarray(labels)
    total = len(labels)
    if n >= total:
        return np.arange(total)
    rng = np.random.default_rng(seed)
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    exact = n * counts / total
    quota = np.floor(exact).astype(np.int64)
    remainder = n - int(quota.sum())
    if remainder:
        # largest fractional part first; a random key breaks ties
        order = np.lexsort((rng.random(len(classes)), -(exact - quota)))
        quota[order[:remainder]] += 1
    picked = []
    for c in range(len(classes)):
        members = np.flatnonzero(inverse == c)
        picked.append(rng.choice(members, size=int(quota[c]), replace=False))
    return np.sort(np.concatenate(picked))


def _random_subset(total: int, n: int, seed: int) -> np.ndarray:
    if n >= total:
        return np.arange(total)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(total, size=n, replace=False))


def resize_uint8(x: torch.Tensor, size: int, chunk: int = 4096) -> torch.Tensor:
    """Resize ``uint8 (N, C, H, W)`` images to ``size x size`` with antialiased bilinear.

    Works in chunks of ``chunk`` images so a large set never exists as one float tensor.
    """
    if x.shape[-2:] == (size, size):
        return x
    out = torch.empty((x.shape[0], x.shape[1], size, size), dtype=torch.uint8, device=x.device)
    for start in range(0, x.shape[0], chunk):
        block = x[start : start + chunk].float()
        block = torch.nn.functional.interpolate(
            block, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )
        out[start : start + chunk] = block.round_().clamp_(0, 255).to(torch.uint8)
    return out


def channel_stats(x: torch.Tensor, chunk: int = 8192) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation of ``uint8 (N, C, H, W)`` images, in ``[0, 1]`` units."""
    channels = x.shape[1]
    total = torch.zeros(channels, dtype=torch.float64)
    total_sq = torch.zeros(channels, dtype=torch.float64)
    for start in range(0, x.shape[0], chunk):
        block = x[start : start + chunk].to(torch.float64).div_(255.0)
        total += block.sum(dim=(0, 2, 3)).cpu()
        total_sq += block.square_().sum(dim=(0, 2, 3)).cpu()
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    var = (total_sq / count - mean.square()).clamp_min(0.0)
    std = var.sqrt().clamp_min(1e-6)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def _as_images(array: np.ndarray | torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Contiguous ``uint8 (N, C, H, W)`` tensor from an ``(N,H,W)``, ``(N,H,W,C)`` or ``(N,C,H,W)`` array."""
    t = torch.as_tensor(np.asarray(array)) if not isinstance(array, torch.Tensor) else array
    if t.ndim == 3:
        t = t.unsqueeze(1)
    elif channels_last:
        t = t.permute(0, 3, 1, 2)
    return t.to(torch.uint8).contiguous()


def _labels(values: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=torch.int64).reshape(-1)


def _check_subsets(name: str, raw: dict[str, Any], train_subset: int | None, test_subset: int | None) -> None:
    """The subsets against the images just read (the config checks them against
    :func:`split_sizes` before any job; ``imagefolder``'s size is known only here)."""
    pool = raw["pretrain_x"] if raw.get("pretrain_x") is not None else raw["train_x"]
    where = f"{name} ({raw['source']})"
    for option, value, images, split in (
        ("train_subset", train_subset, pool, pretrain_split(name)),
        ("test_subset", test_subset, raw["test_x"], "test"),
    ):
        problem = subset_problem(option, value, len(images), split, where)
        if problem:
            raise ValueError(problem)


def _load_composite(
    name: str,
    root: Path,
    download: bool,
    image_size: int | None,
    train_subset: int | None,
    test_subset: int | None,
    seed: int,
) -> dict[str, Any]:
    """Composites of ``name`` (its registry entry's ``base`` and ``items``) at their final size and count: train ones
    from the base's training split, test ones from its test split (a generator per split,
    seeded by ``(seed, split)``); the items' indices in their split go to ``meta``."""
    from .composite import make_composites

    spec = dataset_spec(name)
    base, k = str(spec.base), spec.items
    raw = read_raw(base, root, download, None)
    sizes = spec.sizes or {}  # a composite's: always fixed
    for option, value, split in (("train_subset", train_subset, "train"), ("test_subset", test_subset, "test")):
        problem = subset_problem(option, value, sizes[split], split, name)
        if problem:
            raise ValueError(problem)
    last = raw["channels_last"]
    size = image_size or int(_as_images(raw["train_x"][:1], last).shape[-1])
    c = int(raw["num_classes"])
    built: dict[str, Any] = {}
    for split, count, salt in (("train", train_subset or sizes["train"], 0), ("test", test_subset or sizes["test"], 1)):
        x, y, src = make_composites(
            _as_images(raw[f"{split}_x"], last),
            np.asarray(raw[f"{split}_y"]),
            k,
            count,
            size,
            seed=[int(seed), salt],
            base_classes=c,
        )
        built[f"{split}_x"], built[f"{split}_y"], built[f"{split}_sources"] = x, y, torch.from_numpy(src)
    names = list(raw["classes"])
    classes = ["|".join(names[(i // c ** (k - 1 - j)) % c] for j in range(k)) for i in range(c**k)]
    return {
        "train_x": built["train_x"],
        "train_y": built["train_y"],
        "test_x": built["test_x"],
        "test_y": built["test_y"],
        "channels_last": False,
        "num_classes": c**k,
        "classes": classes,
        "source": f"{k} x {raw['source']}",
        "meta": {
            "tiles": k,
            "base": base,
            "train_sources": built["train_sources"],
            "test_sources": built["test_sources"],
        },
    }


def _take_subsets(raw: dict[str, Any], train_subset: int | None, test_subset: int | None, seed: int):
    """The requested subsets of ``raw``: stratified for the labelled splits, uniform for STL-10's
    unlabeled pretraining images; returns train x, train y, test x, test y, pretrain x (or None)."""
    train_y = np.asarray(raw["train_y"]).astype(np.int64)
    test_y = np.asarray(raw["test_y"]).astype(np.int64)
    train_x, test_x, pretrain_x = raw["train_x"], raw["test_x"], raw.get("pretrain_x")
    if train_subset is not None:
        idx = stratified_subset(train_y, train_subset, seed)
        train_x, train_y = train_x[idx], train_y[idx]
        if pretrain_x is not None:
            pretrain_x = pretrain_x[_random_subset(len(pretrain_x), train_subset, seed + 1)]
    if test_subset is not None:
        idx = stratified_subset(test_y, test_subset, seed + 2)
        test_x, test_y = test_x[idx], test_y[idx]
    return train_x, train_y, test_x, test_y, pretrain_x


# --------------------------------------------------------------------------- public API


def _check_load_args(name, root, image_size, train_subset, test_subset, seed) -> tuple[Path, Any, Any, Any]:
    """:func:`load_dataset`'s arguments checked: (root as a Path, image_size, train_subset, test_subset)."""
    spec = dataset_spec(name)  # an unknown name: one line listing the known ones
    image_size = _check_optional_positive_int(image_size, "image_size")
    train_subset = _check_optional_positive_int(train_subset, "train_subset")
    test_subset = _check_optional_positive_int(test_subset, "test_subset")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if root is None and (spec.folder is not None or spec.base is not None):
        raise ValueError(f"root is required for dataset {name!r}: it reads files under a root")
    return Path(root if root is not None else ".").expanduser(), image_size, train_subset, test_subset


def _image_tensors(channels_last: bool, image_size: int | None, train_x, test_x, pretrain_x):
    """(train, test, pretraining) images as N x C x H x W uint8 tensors at ``image_size``; the
    pretraining images are the training images where the data set has no others."""
    images = [None if x is None else _as_images(x, channels_last) for x in (train_x, test_x, pretrain_x)]
    if image_size is not None:
        images = [None if t is None else resize_uint8(t, image_size) for t in images]
    train_t, test_t, pre_t = images
    return train_t, test_t, (train_t if pre_t is None else pre_t)


def load_dataset(
    name: str,
    root: str | Path | None,
    *,
    download: bool = False,
    image_size: int | None = None,
    train_subset: int | None = None,
    test_subset: int | None = None,
    seed: int = 0,
) -> ImageData:
    """Load data set ``name`` from ``root`` as uint8 tensors.

    Args:
        name: one of :data:`DATASETS`.
        root: folder holding the data set's files (ignored for ``digits``, which may pass ``None``).
        download: let torchvision download missing files (needs internet).
        image_size: resize every image to ``image_size x image_size`` (antialiased
            bilinear); ``None`` keeps the native size.
        train_subset: keep a stratified random subset of this many labelled training
            images (STL-10: also at most this many unlabeled pretraining images).
        test_subset: keep a stratified random subset of this many test images.
        seed: seed of the subset draws (the digits train/test split itself is fixed).

    Raises:
        ValueError: unknown ``name``, a bad option value, or a subset larger than its split.
        FileNotFoundError: the data set's files are not under ``root`` (the message
            names the expected layout and how to get them), or their download failed
            (the message names the URL, the reason and where to put the files instead).
    """
    root, image_size, train_subset, test_subset = _check_load_args(
        name, root, image_size, train_subset, test_subset, seed
    )
    if dataset_spec(name).base is not None:  # a composite: built at the requested counts: no subset to take
        raw = _load_composite(name, root, download, image_size, train_subset, test_subset, seed)
        train_x, train_y_np, test_x, test_y_np, pretrain_x = (
            raw["train_x"],
            raw["train_y"],
            raw["test_x"],
            raw["test_y"],
            None,
        )
    else:
        raw = read_raw(name, root, download, image_size)
        _check_subsets(name, raw, train_subset, test_subset)
        train_x, train_y_np, test_x, test_y_np, pretrain_x = _take_subsets(raw, train_subset, test_subset, seed)
    train_t, test_t, pre_t = _image_tensors(raw["channels_last"], image_size, train_x, test_x, pretrain_x)
    mean, std = channel_stats(pre_t)
    meta = {
        "source": raw["source"],
        "data_digest": data_digest(base_dataset(name), root, download),  # which data (check_cache compares)
        "classes": list(raw["classes"]),
        "image_size": int(train_t.shape[-1]),
        "train_subset": train_subset,
        "test_subset": test_subset,
        "seed": int(seed),
        **raw.get("meta", {}),
        # the options asked for, which check_cache compares with a cell's
        "options": {"image_size": image_size, "train_subset": train_subset, "test_subset": test_subset},
    }
    return ImageData(
        name=name,
        train_x=train_t,
        train_y=_labels(train_y_np),
        test_x=test_t,
        test_y=_labels(test_y_np),
        pretrain_x=pre_t,
        num_classes=int(raw["num_classes"]),
        mean=mean,
        std=std,
        meta=meta,
    )


def save_cache(data: ImageData, path: str | Path) -> Path:
    """Write ``data`` to ``path`` as one ``torch.save`` file, atomically (temp file + rename).

    ``pretrain_x`` is stored once when it is the same tensor as ``train_x``.
    """
    path = Path(path)
    make_folder(path.parent)
    shared = data.pretrain_x is data.train_x
    payload = {
        "format": _CACHE_FORMAT,
        "version": _CACHE_VERSION,
        "name": data.name,
        "train_x": data.train_x.cpu().contiguous(),
        "train_y": data.train_y.cpu().contiguous(),
        "test_x": data.test_x.cpu().contiguous(),
        "test_y": data.test_y.cpu().contiguous(),
        "pretrain_x": None if shared else data.pretrain_x.cpu().contiguous(),
        "num_classes": int(data.num_classes),
        "mean": [float(v) for v in data.mean],
        "std": [float(v) for v in data.std],
        "meta": dict(data.meta),
    }
    return save_torch(path, payload)


_CACHE_TENSORS = {"train_x": torch.uint8, "train_y": torch.int64, "test_x": torch.uint8, "test_y": torch.int64}


def check_cache(data: ImageData, cell, path: str | Path) -> None:
    """The cache holds the cell's data set at the cell's image size and subsets, read from files
    of the cell's data digest; a one-line ValueError naming both otherwise (a cache of another
    data set, size or release would train the cell on other data while its checkpoint and run
    still claim the cell's).  ``cell``: a :class:`~smallbatch.study.cell.Cell` or BaselineCell."""
    opts = cell.dataset_options
    want = {"dataset": cell.dataset, **{k: opts.get(k) for k in ("image_size", "train_subset", "test_subset")}}
    have = {"dataset": data.name, **(data.meta.get("options") or {})}
    want["data digest"], have["data digest"] = cell.data_digest, data.meta.get("data_digest")
    if "options" not in data.meta:  # a cache from before the options were recorded
        have.update({k: data.meta.get(k) for k in ("train_subset", "test_subset")})
        have["image_size"] = data.meta.get("image_size") if want["image_size"] is not None else None
    differ = [k for k in want if have.get(k) != want[k]]
    if differ:
        show = lambda d: ", ".join(f"{k} {d.get(k)}" for k in differ)  # noqa: E731
        raise ValueError(
            f"data cache {path} holds {show(have)}, not this cell's {show(want)}; delete it to rebuild, "
            "or give the cell its own --data-cache"
        )


def load_cache(path: str | Path) -> ImageData:
    """Read an :class:`ImageData` written by :func:`save_cache` (imports no torchvision).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is truncated, corrupt, or not a smallbatch data cache.
    """
    path = Path(path)
    problem = read_problem(path)
    if problem == "does not exist":
        raise FileNotFoundError(f"data cache {path} does not exist")
    if problem:
        raise ValueError(f"data cache {path} {problem}; remove it and prepare the data again")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, ...: all mean "rebuild it"
        raise ValueError(
            f"data cache {path} is corrupt or truncated ({type(exc).__name__}); delete it to rebuild"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != _CACHE_FORMAT:
        raise ValueError(f"data cache {path} is not a smallbatch data cache; delete it to rebuild")
    if payload.get("version") != _CACHE_VERSION:
        raise ValueError(
            f"data cache {path} has version {payload.get('version')!r}, expected {_CACHE_VERSION}; delete it to rebuild"
        )
    for key, dtype in _CACHE_TENSORS.items():
        value = payload.get(key)
        if not isinstance(value, torch.Tensor) or value.dtype != dtype:
            raise ValueError(
                f"data cache {path}: entry {key!r} is missing or not a {dtype} tensor; delete it to rebuild"
            )
    train_x = payload["train_x"]
    pretrain_x = payload.get("pretrain_x")
    if pretrain_x is None:
        pretrain_x = train_x
    elif not isinstance(pretrain_x, torch.Tensor) or pretrain_x.dtype != torch.uint8:
        raise ValueError(f"data cache {path}: entry 'pretrain_x' is not a torch.uint8 tensor; delete it to rebuild")
    return ImageData(
        name=str(payload["name"]),
        train_x=train_x,
        train_y=payload["train_y"],
        test_x=payload["test_x"],
        test_y=payload["test_y"],
        pretrain_x=pretrain_x,
        num_classes=int(payload["num_classes"]),
        mean=tuple(float(v) for v in payload["mean"]),
        std=tuple(float(v) for v in payload["std"]),
        meta=dict(payload.get("meta") or {}),
    )
