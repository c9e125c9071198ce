"""The data sets' names, split sizes, classes and display names: torch-free facts, so the
config checks (:mod:`smallbatch.study.checks`) and the report read them without loading the loaders
of :mod:`smallbatch.data.load` (which re-exports every name here)."""

from __future__ import annotations

DATASETS: tuple[str, ...] = (
    "fashion_mnist",
    "digits",
    "cifar10",
    "cifar100",
    "stl10",
    "imagefolder",
    "fashion_mnist_pairs",
    "fashion_mnist_triples",
)

#: composite data sets (:mod:`smallbatch.data.composite`): name -> (base data set, items per image)
COMPOSITES: dict[str, tuple[str, int]] = {
    "fashion_mnist_pairs": ("fashion_mnist", 2),
    "fashion_mnist_triples": ("fashion_mnist", 3),
}

#: Images per split of every data set whose size is fixed (``imagefolder``'s is known only
#: once its folders are read: :func:`load_dataset` checks the subsets against what it read).
#: The config checks ``train_subset`` / ``test_subset`` and every batch size against it
#: before any job runs.
SPLIT_SIZES: dict[str, dict[str, int]] = {
    "digits": {"train": 1437, "test": 360},
    "fashion_mnist": {"train": 60000, "test": 10000},
    "cifar10": {"train": 50000, "test": 10000},
    "cifar100": {"train": 50000, "test": 10000},
    "stl10": {"train": 5000, "test": 8000, "unlabeled": 100000},
    # composites: how many are built (train_subset / test_subset set fewer)
    "fashion_mnist_pairs": {"train": 60000, "test": 10000},
    "fashion_mnist_triples": {"train": 60000, "test": 10000},
}


#: classes of every data set whose classes are fixed (the few-label probes' check before any job)
NUM_CLASSES: dict[str, int] = {
    "digits": 10,
    "fashion_mnist": 10,
    "cifar10": 10,
    "cifar100": 100,
    "stl10": 10,
    "fashion_mnist_pairs": 100,
    "fashion_mnist_triples": 1000,
}


#: what tables, figures and messages call each data set (its key in the config is the name on the left)
DISPLAY_NAMES: dict[str, str] = {
    "fashion_mnist": "Fashion-MNIST",
    "cifar10": "CIFAR-10",
    "cifar100": "CIFAR-100",
    "stl10": "STL-10",
    "imagefolder": "ImageFolder",
    "fashion_mnist_pairs": "Fashion-MNIST pairs",
    "fashion_mnist_triples": "Fashion-MNIST triples",
}


def display_name(name: str) -> str:
    """The name a reader sees (``fashion_mnist`` -> ``Fashion-MNIST``); an unknown name unchanged."""
    return DISPLAY_NAMES.get(str(name), str(name))


def base_dataset(name: str) -> str:
    """The data set whose files ``name`` reads: a composite's base, else ``name`` itself."""
    return COMPOSITES[name][0] if name in COMPOSITES else name


def pretrain_split(name: str) -> str:
    """The split pretraining draws from (and ``train_subset`` caps): STL-10's ``unlabeled``,
    every other data set's labelled ``train``."""
    return "unlabeled" if name == "stl10" else "train"


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
