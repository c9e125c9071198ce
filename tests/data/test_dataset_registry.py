"""The data-set registry (:mod:`smallbatch.data.registry`): its entries, and that the schema's
``datasets`` keys, the CLI's help, the data-root check, the digest and the readers follow it."""

from __future__ import annotations

import dataclasses

import pytest

from smallbatch.data import registry as reg

#: every data set of the registry, written out (not read from it), in its order: name ->
#: (display name, classes, split sizes, pretraining split, folder under the data root,
#: torchvision's MD5 of the release, composite's base and items per image)
DATASET_TABLE = {
    "fashion_mnist": ("Fashion-MNIST", 10, {"train": 60000, "test": 10000}, "train", "FashionMNIST/raw", None, None, 1),
    "digits": ("digits", 10, {"train": 1437, "test": 360}, "train", None, None, None, 1),
    "cifar10": (
        "CIFAR-10",
        10,
        {"train": 50000, "test": 10000},
        "train",
        "cifar-10-batches-py",
        "c58f30108f718f92721af3b95e74349a",
        None,
        1,
    ),
    "cifar100": (
        "CIFAR-100",
        100,
        {"train": 50000, "test": 10000},
        "train",
        "cifar-100-python",
        "eb9058c3a382ffc7106e4002c42a8d85",
        None,
        1,
    ),
    "stl10": (
        "STL-10",
        10,
        {"train": 5000, "test": 8000, "unlabeled": 100000},
        "unlabeled",
        "stl10_binary",
        "91f7769df0f17e558f3565bffb0c7dfb",
        None,
        1,
    ),
    "imagefolder": ("ImageFolder", None, None, "train", "train", None, None, 1),
    "fashion_mnist_pairs": (
        "Fashion-MNIST pairs",
        100,
        {"train": 60000, "test": 10000},
        "train",
        None,
        None,
        "fashion_mnist",
        2,
    ),
    "fashion_mnist_triples": (
        "Fashion-MNIST triples",
        1000,
        {"train": 60000, "test": 10000},
        "train",
        None,
        None,
        "fashion_mnist",
        3,
    ),
}


def _row(spec: reg.DatasetSpec) -> tuple:
    return (
        spec.display,
        spec.classes,
        spec.sizes,
        spec.pretrain_split,
        spec.folder,
        spec.md5,
        spec.base,
        spec.items,
    )


def test_the_registry_holds_every_data_set_as_written_out():
    assert list(reg.SPECS) == list(DATASET_TABLE)
    assert {name: _row(spec) for name, spec in reg.SPECS.items()} == DATASET_TABLE


def test_every_data_set_has_a_reader_or_is_a_composite_of_one_that_has():
    from smallbatch.data.readers import READERS

    for name, spec in reg.SPECS.items():
        if spec.base is None:
            assert spec.reader in READERS, name
        else:
            assert spec.reader is None and reg.SPECS[spec.base].reader in READERS, name


def test_an_unknown_data_set_is_one_line_listing_the_known_ones():
    with pytest.raises(ValueError) as info:
        reg.dataset_spec("mnist")
    assert "\n" not in str(info.value) and all(name in str(info.value) for name in DATASET_TABLE)


@pytest.fixture
def toy(monkeypatch):
    """A data set added to the registry alone: an entry, its folder and its MD5."""
    spec = dataclasses.replace(
        reg.SPECS["cifar10"], name="toy_set", display="Toy", folder="toy-set-files", files="toy.bin", md5="0" * 32
    )
    monkeypatch.setitem(reg.SPECS, "toy_set", spec)
    return spec


def test_the_schemas_data_sets_are_the_registrys(toy):
    import yaml

    from smallbatch.study.schema import _with_losses, schema_path

    schema = _with_losses(yaml.safe_load(schema_path().read_text()))
    assert schema["properties"]["datasets"]["propertyNames"]["enum"] == [*DATASET_TABLE, "toy_set"]


def test_the_cli_help_lists_the_registrys_data_sets(toy):
    from smallbatch.pipeline.cli_parser import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    action = next(a for a in sub.choices["prepare-data"]._actions if a.dest == "dataset")
    assert action.help == " | ".join([*DATASET_TABLE, "toy_set"])


def test_the_data_root_check_and_the_digest_read_the_registrys_folder_and_md5(toy, tmp_path):
    from smallbatch.data.digest import data_digest
    from smallbatch.study.config import ConfigError, check_data_roots

    cfg = {"data": {"root": str(tmp_path), "download": False}, "datasets": {"toy_set": {}}}
    with pytest.raises(ConfigError, match=r"no toy_set files there \(expected .*/toy-set-files/ \(toy\.bin\)\)"):
        check_data_roots(cfg)
    (tmp_path / "toy-set-files").mkdir()
    check_data_roots(cfg)
    assert data_digest("toy_set", tmp_path) == "torchvision-md5:" + "0" * 32
