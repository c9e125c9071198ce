"""The data-set registry: every data set's name, display name, split sizes, classes, folder,
checksum and reader, without torch.

One :class:`DatasetSpec` per data set, in :data:`SPECS` (the order the config schema and the
CLI list them).  Everything that only needs to *name* a data set or know its facts -- the
config schema's ``datasets`` keys (:mod:`smallbatch.study.schema`), the config's checks of
sizes, classes and data roots, the CLI's help, the digest of its files
(:mod:`smallbatch.data.digest`) and the report's labels -- reads this module, which imports
nothing but the standard library.  How a data set's files are read is its reader's, in
:data:`smallbatch.data.readers.READERS` under the entry's ``reader`` key.

Adding a data set is its entry here plus its reader (a function of ``(spec, root, download,
image_size)`` in :mod:`smallbatch.data.readers`, or the key of one that reads its layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

#: every data set's name, in the registry's order
DATASETS: tuple[str, ...] = tuple(SPECS)
#: images per split of every data set whose sizes are fixed: the config checks ``train_subset``
#: / ``test_subset`` and every batch size against them before any job
SPLIT_SIZES: dict[str, dict[str, int]] = {n: dict(s.sizes) for n, s in SPECS.items() if s.sizes is not None}
#: classes of every data set whose classes are fixed (the few-label probes' check before any job)
NUM_CLASSES: dict[str, int] = {n: s.classes for n, s in SPECS.items() if s.classes is not None}


def dataset_spec(name: str) -> DatasetSpec:
    """The registry's entry of ``name``; a one-line ValueError listing the known ones."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {name!r}") from None


def display_name(name: str) -> str:
    """The name a reader sees (``fashion_mnist`` -> ``Fashion-MNIST``); an unknown name unchanged."""
    spec = SPECS.get(str(name))
    return spec.display if spec is not None else str(name)


def base_dataset(name: str) -> str:
    """The data set whose files ``name`` reads: a composite's base, else ``name`` itself."""
    spec = SPECS.get(name)
    return spec.base if spec is not None and spec.base else name


def pretrain_split(name: str) -> str:
    """The split pretraining draws from (and ``train_subset`` caps): STL-10's ``unlabeled``,
    every other data set's labelled ``train``."""
    spec = SPECS.get(name)
    return spec.pretrain_split if spec is not None else "train"


def pretrain_images(name: str, train_subset: int | None = None) -> int | None:
    """How many images pretraining draws from: the pretraining split capped by
    ``train_subset``; None where that is known only once read (``imagefolder``)."""
    sizes = SPLIT_SIZES.get(name)
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
