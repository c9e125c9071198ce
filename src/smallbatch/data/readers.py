"""Each data set's files read into raw arrays: scikit-learn's digits, and torchvision's own
loaders for Fashion-MNIST (decompressed from Debian's package when present), CIFAR-10/100,
STL-10 and an ImageFolder tree; a failed download or unreadable file as one line.

Each reader is a function of ``(spec, root, download, image_size)`` in :data:`READERS`, under
the key a data set's registry entry names (:mod:`smallbatch.data.registry`: its folder and
files come from there), and returns a dict: ``train_x``, ``train_y``, ``test_x``, ``test_y``
(numpy or torch, native size, ``channels_last`` saying the layout), optional ``pretrain_x``,
``num_classes``, ``classes``, ``source``.  :mod:`smallbatch.data.load` makes tensors, subsets
and caches of them.
"""

from __future__ import annotations

import errno
import gzip
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_write
from .digest import DEBIAN_FASHION_MNIST, FASHION_RAW
from .digest import FASHION_FILES as _FASHION_FILES
from .registry import SPECS, DatasetSpec, dataset_spec, display_name, plugin

# Fixed split of the digits data set, independent of the run seed.
_DIGITS_SPLIT_SEED = 0


#: how the data sets torchvision downloads are called in messages
#: a download that failed with one of these had no network to use
_NETWORK_ERRNOS = {
    socket.EAI_NONAME,
    socket.EAI_AGAIN,
    errno.ECONNREFUSED,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    errno.ETIMEDOUT,
}


def _download_reason(exc: Exception) -> str:
    """Why a download failed: "no network (<the system's words>)" when it was the network,
    else the error's last line (an HTTP error, an archive failing its md5 check)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, OSError):  # urllib's URLError wraps the socket's error
        code, text = reason.errno, reason.strerror or str(reason) or type(reason).__name__
        if isinstance(reason, TimeoutError):
            code = errno.ETIMEDOUT
    else:  # torchvision's MNIST keeps only the text of each mirror's error
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = lines[-1] if lines else type(exc).__name__
        m = re.search(r"\[Errno (-?\d+)\] ([^>]+)", text)
        code, text = (int(m.group(1)), m.group(2).strip()) if m else (None, text)
    return f"no network ({text})" if code in _NETWORK_ERRNOS else text


def _failed_download(name: str, url: str, where: str, exc: Exception) -> FileNotFoundError:
    """One line for a torchvision download that failed: the URL, why, and where to put
    the files by hand instead."""
    return FileNotFoundError(
        f"{name}: could not download {display_name(name)} from {url}: {_download_reason(exc)}; put the files under {where}"
    )


@contextmanager
def _torchvision_errors(
    name: str, downloading: bool, url: str, where: str, unreadable: Callable[[Exception], str]
) -> Iterator[None]:
    """torchvision's failures as one line: a failed download names the URL, why and where
    the files go; files that fail to load (md5 check, truncated) get ``unreadable(exc)``."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if downloading:
            raise _failed_download(name, url, where, exc) from exc
        if isinstance(exc, OSError):
            raise
        raise FileNotFoundError(unreadable(exc)) from exc


# --------------------------------------------------------------------------- loaders
# Each takes (spec, root, download, image_size) and returns a dict: train_x, train_y, test_x,
# test_y (numpy or torch, any layout with `channels_last` saying the layout), optional
# pretrain_x, num_classes, classes, source.


def _load_digits(spec: DatasetSpec, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)  # (1797, 8, 8)
    target = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(target)), test_size=(spec.sizes or {})["test"], stratify=target, random_state=_DIGITS_SPLIT_SEED
    )
    train_idx, test_idx = np.sort(train_idx), np.sort(test_idx)
    return {
        "train_x": images[train_idx],
        "train_y": target[train_idx],
        "test_x": images[test_idx],
        "test_y": target[test_idx],
        "channels_last": False,
        "num_classes": 10,
        "classes": [str(i) for i in range(10)],
        "source": "sklearn.datasets.load_digits",
    }


def prepare_fashion_mnist(root: str | Path, source: str | Path | None = None) -> Path | None:
    """Make sure ``<root>/FashionMNIST/raw/`` holds the four decompressed IDX files.

    Returns that folder when the files are there or could be decompressed from
    ``source`` (default: Debian's ``/usr/share/datasets/fashion-mnist/``, package
    ``dataset-fashion-mnist``); ``None`` when neither is the case. Each file is
    written to a temporary name in the same folder and renamed into place, so an
    interrupted run never leaves a half-written file under the final name.
    """
    raw = Path(root) / FASHION_RAW
    if all((raw / name).is_file() for name in _FASHION_FILES):
        return raw
    src = Path(source) if source is not None else DEBIAN_FASHION_MNIST
    if not all((src / f"{name}.gz").is_file() for name in _FASHION_FILES):
        return None
    raw.mkdir(parents=True, exist_ok=True)
    for name in _FASHION_FILES:
        target = raw / name
        if target.is_file():
            continue
        with gzip.open(src / f"{name}.gz", "rb") as gz:
            atomic_write(target, lambda out: shutil.copyfileobj(gz, out, length=1 << 20))
    return raw


def _load_fashion_mnist(spec: DatasetSpec, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    from torchvision.datasets import FashionMNIST

    raw = prepare_fashion_mnist(root)
    if raw is None and not download:
        raise FileNotFoundError(
            f"{spec.name}: no IDX files under {root}/{spec.folder}/ and none in {DEBIAN_FASHION_MNIST}; "
            f"install the apt package {spec.apt_package} or set download: true"
        )
    with _torchvision_errors(
        spec.name,
        raw is None,
        FashionMNIST.mirrors[0],
        f"{root}/{spec.folder}/",
        lambda exc: f"{spec.name}: could not read {root}/{spec.folder}/ ({exc})",
    ):
        train = FashionMNIST(str(root), train=True, download=download)
        test = FashionMNIST(str(root), train=False, download=download)
    return {
        "train_x": train.data,
        "train_y": train.targets,
        "test_x": test.data,
        "test_y": test.targets,
        "channels_last": False,
        "num_classes": len(train.classes),
        "classes": list(train.classes),
        "source": str(raw) if raw is not None else "torchvision download",
    }


def _load_cifar(spec: DatasetSpec, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    from torchvision.datasets import CIFAR10, CIFAR100

    name, folder, files = spec.name, spec.folder, spec.files
    if not download and not (root / str(folder)).is_dir():
        raise FileNotFoundError(
            f"{name}: no {root}/{folder}/ (expected the python pickles {files}); set download: true to fetch them"
        )
    cls = CIFAR10 if spec.reader == "torchvision_cifar10" else CIFAR100
    with _torchvision_errors(
        name,
        download,
        cls.url,
        f"{root}/{folder}/ ({files})",
        lambda exc: (
            f"{name}: files under {root}/{folder}/ missing or failing torchvision's md5 "
            f"check (expected {files}); set download: true to fetch them"
        ),
    ):
        train = cls(str(root), train=True, download=download)
        test = cls(str(root), train=False, download=download)
    return {
        "train_x": train.data,
        "train_y": train.targets,
        "test_x": test.data,
        "test_y": test.targets,
        "channels_last": True,
        "num_classes": len(train.classes),
        "classes": list(train.classes),
        "source": str(root / str(folder)),
    }


def _load_stl10(spec: DatasetSpec, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    from torchvision.datasets import STL10

    name, folder, files = spec.name, spec.folder, spec.files
    if not download and not (root / str(folder)).is_dir():
        raise FileNotFoundError(f"{name}: no {root}/{folder}/ (expected {files}); set download: true to fetch it")
    with _torchvision_errors(
        name,
        download,
        STL10.url,
        f"{root}/{folder}/ ({files})",
        lambda exc: (
            f"{name}: files under {root}/{folder}/ missing or failing torchvision's "
            f"md5 check (expected {files}); set download: true to fetch them"
        ),
    ):
        train = STL10(str(root), split="train", download=download)
        test = STL10(str(root), split="test", download=False)
        unlabeled = STL10(str(root), split="unlabeled", download=False)
    classes = list(getattr(train, "classes", [])) or [str(i) for i in range(10)]
    return {
        # STL10 already transposes its column-major binaries to (N, 3, 96, 96) row-major views
        "train_x": train.data,
        "train_y": train.labels,
        "test_x": test.data,
        "test_y": test.labels,
        "pretrain_x": unlabeled.data,
        "channels_last": False,
        "num_classes": 10,
        "classes": classes,
        "source": str(root / str(folder)),
    }


def _read_square_rgb(path: str, size: int | None) -> np.ndarray:
    """One image as ``uint8 (3, S, S)``: RGB, shorter side resized to ``size``, centre crop."""
    from PIL import Image

    with Image.open(path) as opened:
        img = opened.convert("RGB")
        w, h = img.size
        if size is None:
            if w != h:
                raise ValueError(f"imagefolder: {path} is {w}x{h}, not square; set image_size")
            size = w
        if (w, h) != (size, size):
            scale = size / min(w, h)
            nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
            img = img.resize((nw, nh), Image.Resampling.BILINEAR)  # PIL's bilinear is antialiased
            left, top = (nw - size) // 2, (nh - size) // 2
            img = img.crop((left, top, left + size, top + size))
        return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


def _read_folder(
    split_dir: Path, classes: list[str] | None, size: int | None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from concurrent.futures import ThreadPoolExecutor

    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    found, class_to_idx = find_classes(split_dir)
    if classes is not None and found != classes:
        raise ValueError(
            f"imagefolder: classes in {split_dir} ({len(found)}) differ from those in train/ ({len(classes)})"
        )
    samples = make_dataset(str(split_dir), class_to_idx, extensions=IMG_EXTENSIONS)
    paths = [p for p, _ in samples]
    labels = np.array([y for _, y in samples], dtype=np.int64)
    if size is None and paths:
        # all images must share the first one's (square) size
        size = _read_square_rgb(paths[0], None).shape[-1]
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        images = list(pool.map(lambda p: _read_square_rgb(p, size), paths, chunksize=64))
    return np.stack(images), labels, found


def _load_imagefolder(spec: DatasetSpec, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    train_dir = root / "train"
    test_dir = root / "val" if (root / "val").is_dir() else root / "test"
    if not train_dir.is_dir() or not test_dir.is_dir():
        raise FileNotFoundError(
            f"imagefolder: expected {root}/train/<class>/<image> and {root}/val/<class>/<image> "
            "(download is not supported for imagefolder)"
        )
    try:
        train_x, train_y, classes = _read_folder(train_dir, None, image_size)
        test_x, test_y, _ = _read_folder(test_dir, classes, train_x.shape[-1])
    except FileNotFoundError as exc:  # torchvision: no class folders / no images in a class
        raise FileNotFoundError(f"imagefolder: {exc}".replace("\n", " ")) from exc
    return {
        "train_x": train_x,
        "train_y": train_y,
        "test_x": test_x,
        "test_y": test_y,
        "channels_last": False,
        "num_classes": len(classes),
        "classes": classes,
        "source": str(root),
    }


#: every reader, under the key a data set's registry entry names (:attr:`DatasetSpec.reader`)
READERS: dict[str, Callable[[DatasetSpec, Path, bool, int | None], dict[str, Any]]] = {
    "sklearn_digits": _load_digits,
    "torchvision_fashion_mnist": _load_fashion_mnist,
    "torchvision_cifar10": _load_cifar,
    "torchvision_cifar100": _load_cifar,
    "torchvision_stl10": _load_stl10,
    "image_folder": _load_imagefolder,
}


def read_raw(name: str, root: Path, download: bool, image_size: int | None) -> dict[str, Any]:
    """The data set's images and labels as its reader returns them (numpy or tensors, native size)."""
    spec = dataset_spec(name)
    if spec.reader is None:
        raise ValueError(f"{name} is a composite of {spec.base}: it is built from its base's images, not read")
    read = READERS[spec.reader] if name in SPECS else plugin(name).read  # a plugin's: its own
    return read(spec, root, download, image_size)
