"""The data-set registry: every data set's name, display name, split sizes, classes, folder,
checksum and reader, without torch.

One :class:`DatasetSpec` per data set, in :data:`SPECS` (the order the config schema and the
CLI list them).  Everything that only needs to *name* a data set or know its facts -- the
config schema's ``datasets`` keys (:mod:`smallbatch.study.schema`), the config's checks of
sizes, classes and data roots, the CLI's help, the digest of its files
(:mod:`smallbatch.data.digest`) and the report's labels -- reads this module, which imports
nothing but the standard library and :mod:`smallbatch.errors`.  How a data set's files are read
is its reader's, in :data:`smallbatch.data.readers.READERS` under the entry's ``reader`` key.

Adding a data set is its entry here plus its reader (a function of ``(spec, root, download,
image_size)`` in :mod:`smallbatch.data.readers`, or the key of one that reads its layout).  An
installed package adds one without editing smallbatch: a :class:`DatasetPlugin` (its spec, its
reader and the digest of its files) named by an entry point of the group :data:`PLUGIN_GROUP`
(:func:`all_specs`; read once per process, when a name is not a built-in's).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import PluginError, loaded_entries


@dataclass(frozen=True)
class DatasetSpec:
    """One data set of the registry.

    ``name``: its key in the config and in cell ids; ``display``: what tables, figures and
    messages call it; ``reader``: the key of its reader in
    :data:`smallbatch.data.readers.READERS` (None: a composite, built from ``base``);
    ``sizes``: images per split (None: known only once read, ``imagefolder``; a composite's:
    how many are built, ``train_subset`` / ``test_subset`` set fewer); ``classes``: its
    number of classes (None: known only once read); ``pretrain_split``: the split
    pretraining draws from and ``train_subset`` caps; ``folder``: where its files lie under
    the data root, as its reader expects them (None: no files, or a composite's base's), and
    ``files``: what that folder holds, for messages; ``md5``: torchvision's MD5 of the
    release where torchvision checks one on every load (it names the data in a cell's hash);
    ``apt_package`` / ``apt_folder``: a Debian package that installs the files, and where;
    ``base`` / ``items``: a composite's base data set and its items per image
    (:mod:`smallbatch.data.composite`)."""

    name: str
    display: str
    reader: str | None
    sizes: dict[str, int] | None = field(default=None)
    classes: int | None = None
    pretrain_split: str = "train"
    folder: str | None = None
    files: str = ""
    md5: str | None = None
    apt_package: str | None = None
    apt_folder: str | None = None
    base: str | None = None
    items: int = 1

    def __post_init__(self) -> None:
        if (self.reader is None) == (self.base is None):
            raise ValueError(f"data set {self.name!r}: give a reader, or a base for a composite (not both)")
        if self.sizes is not None and self.pretrain_split not in self.sizes:
            raise ValueError(f"data set {self.name!r}: its pretraining split {self.pretrain_split!r} has no size")


_FASHION_SIZES = {"train": 60000, "test": 10000}

#: The one list of data sets, in the order the schema and the CLI list them.
SPECS: dict[str, DatasetSpec] = {
    s.name: s
    for s in (
        DatasetSpec(
            name="fashion_mnist",
            display="Fashion-MNIST",
            reader="torchvision_fashion_mnist",
            sizes=_FASHION_SIZES,
            classes=10,
            folder="FashionMNIST/raw",
            files="the four IDX files",
            apt_package="dataset-fashion-mnist",
            apt_folder="/usr/share/datasets/fashion-mnist",
        ),
        DatasetSpec(
            name="digits",
            display="digits",
            reader="sklearn_digits",
            sizes={"train": 1437, "test": 360},
            classes=10,
        ),
        DatasetSpec(
            name="cifar10",
            display="CIFAR-10",
            reader="torchvision_cifar10",
            sizes={"train": 50000, "test": 10000},
            classes=10,
            folder="cifar-10-batches-py",
            files="data_batch_1..5, test_batch, batches.meta",
            md5="c58f30108f718f92721af3b95e74349a",
        ),
        DatasetSpec(
            name="cifar100",
            display="CIFAR-100",
            reader="torchvision_cifar100",
            sizes={"train": 50000, "test": 10000},
            classes=100,
            folder="cifar-100-python",
            files="train, test, meta",
            md5="eb9058c3a382ffc7106e4002c42a8d85",
        ),
        DatasetSpec(
            name="stl10",
            display="STL-10",
            reader="torchvision_stl10",
            sizes={"train": 5000, "test": 8000, "unlabeled": 100000},
            classes=10,
            pretrain_split="unlabeled",
            folder="stl10_binary",
            files="train_X.bin, train_y.bin, unlabeled_X.bin, test_X.bin, test_y.bin",
            md5="91f7769df0f17e558f3565bffb0c7dfb",
        ),
        DatasetSpec(
            name="imagefolder",
            display="ImageFolder",
            reader="image_folder",
            folder="train",
            files="<class>/<image>, and val/<class>/<image> beside it",
        ),
        DatasetSpec(
            name="fashion_mnist_pairs",
            display="Fashion-MNIST pairs",
            reader=None,
            sizes=_FASHION_SIZES,
            classes=100,
            base="fashion_mnist",
            items=2,
        ),
        DatasetSpec(
            name="fashion_mnist_triples",
            display="Fashion-MNIST triples",
            reader=None,
            sizes=_FASHION_SIZES,
            classes=1000,
            base="fashion_mnist",
            items=3,
        ),
    )
}

#: every built-in data set's name, in the registry's order (:func:`all_specs` adds the plugins')
DATASETS: tuple[str, ...] = tuple(SPECS)


# --------------------------------------------------------------------------- plugins
#: the entry-point group an installed package declares its data sets in
PLUGIN_GROUP = "smallbatch.datasets"
#: what a plugin's name may hold (it is a config key, a folder and part of every cell id)
PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class DatasetPlugin:
    """A data set from an installed package: ``spec`` (its ``reader`` is its own name, so no
    built-in reader is taken), ``read`` (called as the built-in readers are, with ``(spec, root,
    download, image_size)``, and returning their dict: ``train_x``, ``train_y``, ``test_x``,
    ``test_y``, ``num_classes``, ``classes``, ``channels_last``, ``source``) and ``digest``
    (``digest(root)``: a short name of the content of the files it reads there, such as
    ``sha256:…``; every cell's hash holds it, so other files mean other cells)."""

    spec: DatasetSpec
    read: Callable[..., dict[str, Any]]
    digest: Callable[[Path], str]


@functools.cache
def plugins() -> dict[str, DatasetPlugin]:
    """The data sets installed packages declare in :data:`PLUGIN_GROUP`, read once per process."""
    return load_plugins(metadata.entry_points(group=PLUGIN_GROUP))


def load_plugins(entries: Iterable[metadata.EntryPoint]) -> dict[str, DatasetPlugin]:
    """The :class:`DatasetPlugin` each entry point names, by name, sorted; :class:`PluginError`,
    one line naming the entry point and its package, for one that does not load, is no plugin,
    is not named like its spec, has a name a cell id cannot hold or a built-in's, reads another
    reader's key, or is a composite (a composite's base is a built-in's files)."""
    found: dict[str, DatasetPlugin] = {}
    for name, plugin, where in loaded_entries(entries, "data-set"):
        if not isinstance(plugin, DatasetPlugin):
            raise PluginError(f"{where} names a {type(plugin).__name__}, not a smallbatch.data.registry.DatasetPlugin")
        spec = plugin.spec
        problem = (
            f"names the spec of {spec.name!r}; name the entry point as its spec"
            if spec.name != name
            else f"the name {spec.name!r} is not lower-case letters, digits and _ (a cell id holds it)"
            if not PLUGIN_NAME.fullmatch(spec.name)
            else f"the name {spec.name!r} is a built-in data set's; rename the plugin's"
            if spec.name in SPECS
            else f"its spec's reader is {spec.reader!r}: give its own name (its reader is the plugin's read)"
            if spec.reader != spec.name
            else None
        )
        if problem:
            raise PluginError(f"{where}: {problem}")
        found[spec.name] = plugin
    return found


def plugin(name: str) -> DatasetPlugin:
    """The installed plugin of the data set ``name`` (KeyError for any other name)."""
    return plugins()[name]


def all_specs() -> dict[str, DatasetSpec]:
    """Every data set: the built-ins (:data:`SPECS`, in their order), then the plugins' by name."""
    return {**SPECS, **{n: p.spec for n, p in plugins().items()}}


def _spec_or_none(name: str) -> DatasetSpec | None:
    """The entry of ``name``: a built-in's without reading the entry points, else a plugin's."""
    return SPECS.get(name) or all_specs().get(name)


# --------------------------------------------------------------------------- look-ups
def split_sizes(name: str) -> dict[str, int] | None:
    """Images per split of ``name`` when fixed (the config checks ``train_subset`` / ``test_subset``
    and every batch size against them before any job); None when known only once read."""
    spec = _spec_or_none(name)
    return dict(spec.sizes) if spec is not None and spec.sizes is not None else None


def num_classes(name: str) -> int | None:
    """Classes of ``name`` when fixed (the few-label probes' check before any job), else None."""
    spec = _spec_or_none(name)
    return spec.classes if spec is not None else None


def dataset_spec(name: str) -> DatasetSpec:
    """The registry's entry of ``name``; a one-line ValueError listing the known ones."""
    spec = _spec_or_none(name)
    if spec is None:
        raise ValueError(f"dataset must be one of {', '.join(all_specs())}; got {name!r}")
    return spec


def display_name(name: str) -> str:
    """The name a reader sees (``fashion_mnist`` -> ``Fashion-MNIST``); an unknown name unchanged."""
    spec = _spec_or_none(str(name))
    return spec.display if spec is not None else str(name)


def base_dataset(name: str) -> str:
    """The data set whose files ``name`` reads: a composite's base, else ``name`` itself."""
    spec = _spec_or_none(name)
    return spec.base if spec is not None and spec.base else name


def pretrain_split(name: str) -> str:
    """The split pretraining draws from (and ``train_subset`` caps): STL-10's ``unlabeled``,
    every other data set's labelled ``train``."""
    spec = _spec_or_none(name)
    return spec.pretrain_split if spec is not None else "train"


def pretrain_images(name: str, train_subset: int | None = None) -> int | None:
    """How many images pretraining draws from: the pretraining split capped by
    ``train_subset``; None where that is known only once read (``imagefolder``)."""
    sizes = split_sizes(name)
    if sizes is None:
        return None
    n = sizes[pretrain_split(name)]
    return n if train_subset is None else min(n, train_subset)


def subset_problem(option: str, value: int | None, available: int, split: str, name: str) -> str | None:
    """Why a ``train_subset`` / ``test_subset`` of ``value`` images cannot be drawn from a
    split of ``available`` images (one line naming ``option``), or None when it can."""
    if value is None or value <= available:
        return None
    return f"{option} = {value} is larger than the {available:,} {split} images of {name}"
