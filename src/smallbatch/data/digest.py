"""Which data a data set's files hold: :func:`data_digest`, part of every cell's hash.

A cell computes from images, not from the folder they are read from: its hash names the
data set, its image size and subsets (the cell's ``dataset_options``) and this digest of
the source files, never ``data.root``.  Pointing a study at another copy of the same files
keeps every hash; other files (another release, an edited image) change them.  The rule is
the data set's registry entry's (:mod:`smallbatch.data.registry`): its ``md5``, else its reader's.

=====================  =====================================================================
data set               digest
=====================  =====================================================================
digits                 SHA-256 of scikit-learn's ``digits.csv.gz``
fashion_mnist (and     SHA-256 of the four IDX files as the loader reads them: from
its composites)        ``<root>/FashionMNIST/raw/`` or decompressed from Debian's package,
                       the same bytes either way; ``torchvision-md5`` when the folder holds
                       torchvision's downloaded archives (their MD5 is checked on download)
                       or when they are still to be downloaded
cifar10, cifar100,     torchvision's MD5 of the release (the registry entry's ``md5``):
stl10                  torchvision refuses files that do not match it, so no other content
                       can be read
imagefolder            SHA-256 of the listing of its image files (path and size of each):
                       reading every image would take as long as loading the data set
a plugin's data set    what its plugin's ``digest(root)`` returns (one token)
=====================  =====================================================================

Computed once per process and data set (a SHA-256 of Fashion-MNIST's 55 MB: ~0.2 s).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from .registry import SPECS, dataset_spec, plugin

#: torchvision's MD5 of each archive of Fashion-MNIST it downloads (FashionMNIST.resources)
FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
_CHUNK = 1 << 20
#: Where Debian's ``dataset-fashion-mnist`` package installs the IDX ``.gz`` files, and their names
DEBIAN_FASHION_MNIST = Path(str(dataset_spec("fashion_mnist").apt_folder))
#: where under the data root torchvision keeps Fashion-MNIST's files (its registry entry's folder)
FASHION_RAW = str(dataset_spec("fashion_mnist").folder)
FASHION_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def data_digest(base: str, root: str | Path | None, download: bool = False) -> str:
    """A short name of the content of the files data set ``base`` (a composite's base data
    set: :func:`smallbatch.data.load.base_dataset`) reads under ``root`` (see the module
    docstring), e.g. ``sha256:14410854cf7a2894``; ``missing`` when there are none to read
    (the config's data-root check refuses such a study before any job)."""
    where = Path(root).expanduser().resolve() if root is not None else Path()
    spec = dataset_spec(base)
    if base not in SPECS:  # an installed plugin's: its own rule
        return _plugin_digest(base, where)
    if spec.md5 is not None:  # torchvision refuses any other content
        return f"torchvision-md5:{spec.md5}"
    if spec.reader == "image_folder":  # its listing is its digest: nothing to cache
        return _folder_listing(where)
    return _digest(str(spec.reader), str(where), bool(download), _stats(str(spec.reader), where))


def _plugin_digest(name: str, root: Path) -> str:
    """The digest an installed data set's plugin gives of its files under ``root``: one token (it
    is part of every cell's hash and of its cache's name), else a one-line ValueError."""
    value = plugin(name).digest(root)
    if not isinstance(value, str) or not value or len(value) > 200 or any(c.isspace() for c in value):
        raise ValueError(f"data-set plugin {name!r}: its digest of {root} is {value!r}, not one short token (sha256:…)")
    return value


def _stats(reader: str, root: Path) -> tuple:
    """(path, size, mtime) of every file the digest of a data set read by ``reader`` may read:
    the cache's key, so a file changed in a long-lived process (the warm server) is read again."""
    if reader != "torchvision_fashion_mnist":
        return ()
    raw = root / FASHION_RAW
    paths = [raw / n for n in (*FASHION_FILES, *FASHION_MNIST_MD5)]
    paths += [DEBIAN_FASHION_MNIST / f"{n}.gz" for n in FASHION_FILES]
    out = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _digest(reader: str, root: str, download: bool, stats: tuple) -> str:
    """The digest of the files a data set read by ``reader`` reads (one rule per reader)."""
    if reader == "sklearn_digits":
        return _sha256([_sklearn_digits()])
    if reader == "torchvision_fashion_mnist":
        return _fashion_mnist(Path(root), download)
    raise ValueError(f"no digest rule for the data sets read by {reader!r}: add one to smallbatch.data.digest")


def _sha256(streams: Iterable[BinaryIO | gzip.GzipFile]) -> str:
    h = hashlib.sha256()
    for stream in streams:
        with stream:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
    return f"sha256:{h.hexdigest()[:16]}"


def _sklearn_digits() -> BinaryIO:
    spec = importlib.util.find_spec("sklearn")  # the file's place without importing scikit-learn
    places = spec.submodule_search_locations if spec else None
    folder = Path(next(iter(places))) if places else Path(".")
    return open(folder / "datasets" / "data" / "digits.csv.gz", "rb")


def _fashion_mnist(root: Path, download: bool) -> str:
    raw = root / FASHION_RAW
    archives = [raw / name for name in FASHION_MNIST_MD5]
    if all(p.is_file() for p in archives) and all(_md5(p) == FASHION_MNIST_MD5[p.name] for p in archives):
        return "torchvision-md5:fashion-mnist"
    if all((raw / name).is_file() for name in FASHION_FILES):
        return _sha256(open(raw / name, "rb") for name in FASHION_FILES)
    if all((DEBIAN_FASHION_MNIST / f"{name}.gz").is_file() for name in FASHION_FILES):
        return _sha256(gzip.open(DEBIAN_FASHION_MNIST / f"{name}.gz", "rb") for name in FASHION_FILES)
    return "torchvision-md5:fashion-mnist" if download else "missing"


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _folder_listing(root: Path) -> str:
    """An image folder's identity: the relative path and size of every file under its splits."""
    h = hashlib.sha256()
    files = 0
    for split in ("train", "val", "test"):
        for dirpath, dirnames, filenames in os.walk(root / split):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\n".encode())
                files += 1
    return f"listing-sha256:{h.hexdigest()[:16]}" if files else "missing"
