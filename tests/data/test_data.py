"""Tests of smallbatch.data.load on files written in each data set's real on-disk format.

CIFAR and STL-10 files generated here are real-format but tiny, so torchvision's md5
list cannot match them. Those tests monkeypatch ``check_integrity`` inside
torchvision's cifar/stl10 modules to the same check without the md5 comparison (the
file must still exist); everything else (torchvision's readers, our loader) runs
unchanged. ``test_cifar_files_failing_md5_give_a_clear_error`` runs without the
patch and shows what production code does with such files.
"""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cluster import HANG_S
from synthetic import cifar_images, existence_only_check, write_cifar10, write_pickle

import smallbatch.data.load as data_mod
from smallbatch.data import readers
from smallbatch.data.load import (
    DATASETS,
    ImageData,
    load_cache,
    load_dataset,
    prepare_fashion_mnist,
    save_cache,
    stratified_subset,
)


def _no_md5(monkeypatch, module_name: str) -> None:
    """Drop only the md5 comparison of torchvision's integrity check (existence still checked)."""
    import importlib

    module = importlib.import_module(module_name)
    monkeypatch.setattr(module, "check_integrity", existence_only_check)


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- CIFAR


def test_cifar10_loads_through_torchvision_in_nchw_order(tmp_path, monkeypatch):
    _no_md5(monkeypatch, "torchvision.datasets.cifar")
    ref = write_cifar10(tmp_path)
    data = load_dataset("cifar10", tmp_path)
    assert data.train_x.shape == (100, 3, 32, 32) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (30, 3, 32, 32)
    assert torch.equal(data.train_x, torch.from_numpy(ref["train_x"]))
    assert torch.equal(data.test_y, torch.from_numpy(ref["test_y"]).long()) and data.test_y.dtype == torch.int64
    assert data.num_classes == 10 and data.meta["classes"][0] == "airplane"
    assert data.pretrain_x is data.train_x
    f = ref["train_x"].astype(np.float64) / 255
    np.testing.assert_allclose(data.mean, f.mean(axis=(0, 2, 3)), atol=1e-9)
    np.testing.assert_allclose(data.std, f.std(axis=(0, 2, 3)), atol=1e-9)


def test_cifar100_loads_fine_labels(tmp_path, monkeypatch):
    _no_md5(monkeypatch, "torchvision.datasets.cifar")
    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train, test = cifar_images(50, rng), cifar_images(20, rng)
    fine = [i % 100 for i in range(50)]
    write_pickle(folder / "train", {"data": train.reshape(50, -1), "fine_labels": fine, "coarse_labels": [0] * 50})
    write_pickle(
        folder / "test", {"data": test.reshape(20, -1), "fine_labels": list(range(20)), "coarse_labels": [0] * 20}
    )
    write_pickle(folder / "meta", {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": ["x"] * 20})
    data = load_dataset("cifar100", tmp_path, image_size=16)
    assert data.num_classes == 100
    assert data.train_x.shape == (50, 3, 16, 16) and data.test_x.shape == (20, 3, 16, 16)
    assert data.train_y.tolist() == fine
    # the red plane encodes the row: after resizing it still increases down the image
    red = data.train_x[:, 0].float().mean(dim=(0, 2))
    assert (red.diff() > 0).all()


def test_cifar_files_failing_md5_give_a_clear_error(tmp_path):
    write_cifar10(tmp_path)  # tiny files: torchvision's md5 check rejects them
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("cifar10", tmp_path)
    message = _one_line(info.value)
    assert str(tmp_path) in message and "md5" in message and "download: true" in message


# --------------------------------------------------------------------------- STL-10


def _write_stl_images(path: Path, images: np.ndarray) -> None:
    # STL-10 stores each image channel by channel, each channel column-major
    path.write_bytes(np.ascontiguousarray(images.transpose(0, 1, 3, 2)).tobytes())


def test_stl10_uses_unlabeled_for_pretraining(tmp_path, monkeypatch):
    _no_md5(monkeypatch, "torchvision.datasets.stl10")
    rng = np.random.default_rng(2)
    folder = tmp_path / "stl10_binary"
    folder.mkdir()

    def images(n):
        x = rng.integers(0, 256, size=(n, 3, 96, 96), dtype=np.uint8)
        x[:, 1] = (np.arange(96) * 2).astype(np.uint8)[None, None, :]  # green encodes the column
        return x

    train, test, unlabeled = images(20), images(10), images(30)
    train_y = (np.arange(20) % 10 + 1).astype(np.uint8)  # 1-based on disk
    test_y = (np.arange(10) % 10 + 1).astype(np.uint8)
    _write_stl_images(folder / "train_X.bin", train)
    _write_stl_images(folder / "test_X.bin", test)
    _write_stl_images(folder / "unlabeled_X.bin", unlabeled)
    (folder / "train_y.bin").write_bytes(train_y.tobytes())
    (folder / "test_y.bin").write_bytes(test_y.tobytes())
    (folder / "class_names.txt").write_text("\n".join(f"class{i}" for i in range(10)) + "\n")

    data = load_dataset("stl10", tmp_path)
    assert torch.equal(data.train_x, torch.from_numpy(train))
    assert torch.equal(data.test_x, torch.from_numpy(test))
    assert torch.equal(data.pretrain_x, torch.from_numpy(unlabeled))
    assert data.train_y.tolist() == (train_y.astype(int) - 1).tolist()
    assert data.num_classes == 10 and data.meta["classes"][3] == "class3"
    f = unlabeled.astype(np.float64) / 255
    np.testing.assert_allclose(data.mean, f.mean(axis=(0, 2, 3)), atol=1e-9)

    small = load_dataset("stl10", tmp_path, image_size=32, train_subset=10, test_subset=5, seed=3)
    assert small.train_x.shape == (10, 3, 32, 32) and small.pretrain_x.shape == (10, 3, 32, 32)
    assert small.test_x.shape == (5, 3, 32, 32)
    assert sorted(small.train_y.tolist()) == list(range(10))  # stratified: one per class
    # train_subset caps the unlabeled pretraining split: more than the labelled images is fine
    more = load_dataset("stl10", tmp_path, train_subset=25)
    assert more.train_x.shape[0] == 20 and more.pretrain_x.shape[0] == 25
    with pytest.raises(ValueError) as info:
        load_dataset("stl10", tmp_path, train_subset=31)
    assert _one_line(info.value).startswith("train_subset = 31 is larger than the 30 unlabeled images of stl10 (")


# --------------------------------------------------------------------------- ImageFolder


def _make_folder(root: Path, sizes=((40, 30), (30, 40)), classes=("cat", "dog", "eel")) -> None:
    from PIL import Image

    for split, count in (("train", 4), ("val", 2)):
        for c, name in enumerate(classes):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(count):
                w, h = sizes[i % len(sizes)]
                pixels = np.zeros((h, w, 3), dtype=np.uint8)
                pixels[..., c] = 200  # class colour
                pixels[:, : w // 2, :] //= 2  # left half darker: an orientation check
                Image.fromarray(pixels).save(d / f"{i}.png")


def test_imagefolder_resizes_centre_crops_and_labels_by_folder(tmp_path):
    _make_folder(tmp_path)
    data = load_dataset("imagefolder", tmp_path, image_size=16)
    assert data.train_x.shape == (12, 3, 16, 16) and data.test_x.shape == (6, 3, 16, 16)
    assert data.train_y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert data.meta["classes"] == ["cat", "dog", "eel"]
    for x, y in zip(data.train_x, data.train_y):
        assert x[y].float().mean() > 90 and x[(y + 1) % 3].max() == 0
        assert x[y, :, :4].float().mean() < x[y, :, -4:].float().mean()  # left half darker


def test_imagefolder_without_image_size_needs_square_images(tmp_path):
    _make_folder(tmp_path)
    with pytest.raises(ValueError, match="image_size"):
        load_dataset("imagefolder", tmp_path)
    square = tmp_path / "square"
    _make_folder(square, sizes=((12, 12),))
    assert load_dataset("imagefolder", square).train_x.shape == (12, 3, 12, 12)


def test_imagefolder_val_classes_must_match_train(tmp_path):
    _make_folder(tmp_path)
    (tmp_path / "val" / "fox").mkdir()
    (tmp_path / "val" / "cat" / "0.png").rename(tmp_path / "val" / "fox" / "0.png")
    with pytest.raises(ValueError, match="differ"):
        load_dataset("imagefolder", tmp_path, image_size=8)


# --------------------------------------------------------------------------- Fashion-MNIST


def _idx_images(images: np.ndarray) -> bytes:
    return struct.pack(">IIII", 2051, *images.shape) + images.tobytes()


def _idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes()


def _make_fashion_source(folder: Path, n_train: int = 50, n_test: int = 20) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    folder.mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.arange(n_test) % 10,
    }
    for name, array in arrays.items():
        payload = _idx_images(array) if "images" in name else _idx_labels(array)
        with gzip.open(folder / f"{name}.gz", "wb") as fh:
            fh.write(payload)
    return arrays


def test_prepare_fashion_mnist_decompresses_a_gz_source_for_torchvision(tmp_path):
    arrays = _make_fashion_source(tmp_path / "src")
    root = tmp_path / "root"
    raw = prepare_fashion_mnist(root, source=tmp_path / "src")
    assert raw == root / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(arrays)  # no .gz, no temp files left
    data = load_dataset("fashion_mnist", root, image_size=14)
    assert data.train_x.shape == (50, 1, 14, 14) and data.test_x.shape == (20, 1, 14, 14)
    assert data.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    full = load_dataset("fashion_mnist", root)
    assert torch.equal(full.train_x[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert full.meta["classes"][9] == "Ankle boot"


def test_prepare_fashion_mnist_leaves_no_partial_file_when_a_source_is_broken(tmp_path):
    _make_fashion_source(tmp_path / "src")
    broken = tmp_path / "src" / "t10k-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:100])  # truncated gzip
    root = tmp_path / "root"
    with pytest.raises(EOFError):
        prepare_fashion_mnist(root, source=tmp_path / "src")
    names = sorted(p.name for p in (root / "FashionMNIST" / "raw").iterdir())
    assert "t10k-images-idx3-ubyte" not in names and not any(n.endswith(".tmp") for n in names)


def test_fashion_mnist_without_files_names_both_ways_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian-here")
    assert prepare_fashion_mnist(tmp_path / "root") is None
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("fashion_mnist", tmp_path / "root")
    message = _one_line(info.value)
    assert "dataset-fashion-mnist" in message and "download: true" in message and str(tmp_path / "root") in message


@pytest.mark.skipif(
    not (data_mod.DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (apt-get install dataset-fashion-mnist)",
)
def test_fashion_mnist_from_the_debian_package(tmp_path):
    data = load_dataset("fashion_mnist", tmp_path, test_subset=1000)
    assert data.train_x.shape == (60000, 1, 28, 28) and data.test_x.shape == (1000, 1, 28, 28)
    assert data_mod.split_sizes("fashion_mnist")["train"] == 60000  # the table the config checks sizes with
    assert torch.bincount(data.train_y).tolist() == [6000] * 10
    assert torch.bincount(data.test_y).tolist() == [100] * 10
    assert data.train_y[0].item() == 9  # the first training image is an ankle boot
    # the published statistics of Fashion-MNIST's training set
    assert data.mean[0] == pytest.approx(0.2860, abs=1e-4) and data.std[0] == pytest.approx(0.3530, abs=1e-4)
    assert (tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").stat().st_size == 47040016
    small = load_dataset("fashion_mnist", tmp_path, image_size=16, train_subset=2000)  # reads the raw files now there
    assert small.train_x.shape == (2000, 1, 16, 16) and torch.bincount(small.train_y).tolist() == [200] * 10


# --------------------------------------------------------------------------- digits, subsets, resize


def test_digits_split_is_fixed_stratified_and_seed_independent():
    a = load_dataset("digits", "unused", seed=0)
    b = load_dataset("digits", "unused", seed=7)
    assert a.train_x.shape == (1437, 1, 8, 8) and a.test_x.shape == (360, 1, 8, 8)
    assert a.train_x.dtype == torch.uint8 and a.train_y.dtype == torch.int64
    assert torch.equal(a.test_x, b.test_x) and torch.equal(a.train_y, b.train_y)
    counts = torch.bincount(a.test_y, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # 360 / 10 classes, stratified
    assert int(a.train_x.max()) == 255 and int(a.train_x.min()) == 0
    assert a.num_classes == 10 and a.pretrain_x is a.train_x
    # no image in both splits
    train_set = {bytes(x.numpy()) for x in a.train_x}
    assert sum(bytes(x.numpy()) in train_set for x in a.test_x) < 5  # a few digits are pixel-identical duplicates


def test_split_sizes_table_matches_the_loader_and_subsets_beyond_it_are_one_line():
    full = load_dataset("digits", None)
    assert data_mod.split_sizes("digits") == {"train": len(full.train_x), "test": len(full.test_x)}
    assert data_mod.pretrain_images("digits") == 1437 and data_mod.pretrain_images("digits", 100) == 100
    assert data_mod.pretrain_images("stl10") == 100000 and data_mod.pretrain_images("imagefolder", 100) is None
    for kwargs, message in (
        ({"train_subset": 1438}, "train_subset = 1438 is larger than the 1,437 train images"),
        ({"test_subset": 361}, "test_subset = 361 is larger than the 360 test images"),
    ):
        with pytest.raises(ValueError) as info:
            load_dataset("digits", None, **kwargs)
        assert _one_line(info.value).startswith(message + " of digits ("), info.value
    assert len(load_dataset("digits", None, train_subset=1437, test_subset=360).train_x) == 1437  # the whole split


def test_subsets_are_stratified_seeded_and_resize_matches_interpolate():
    full = load_dataset("digits", "unused")
    a = load_dataset("digits", "unused", train_subset=200, test_subset=50, image_size=4, seed=1)
    b = load_dataset("digits", "unused", train_subset=200, test_subset=50, image_size=4, seed=1)
    c = load_dataset("digits", "unused", train_subset=200, test_subset=50, image_size=4, seed=2)
    assert a.train_x.shape == (200, 1, 4, 4) and a.test_x.shape == (50, 1, 4, 4)
    assert torch.bincount(a.train_y).tolist() == [20] * 10
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_x, c.train_x)
    # every subset image is a resized full-split image
    resized = F.interpolate(full.train_x.float(), size=(4, 4), mode="bilinear", antialias=True, align_corners=False)
    resized = resized.round().clamp(0, 255).to(torch.uint8)
    members = {bytes(x.numpy()) for x in resized}
    assert all(bytes(x.numpy()) in members for x in a.train_x)
    # statistics come from the (subset, resized) pretraining images
    assert a.mean[0] == pytest.approx(float(a.train_x.float().mean() / 255), abs=1e-6)


def test_stratified_subset_allocates_by_largest_remainder():
    labels = np.array([0] * 50 + [1] * 30 + [2] * 20)
    idx = stratified_subset(labels, 10, seed=0)
    assert np.bincount(labels[idx]).tolist() == [5, 3, 2]
    idx = stratified_subset(labels, 7, seed=0)  # 3.5, 2.1, 1.4 -> 4, 2, 1
    assert np.bincount(labels[idx]).tolist() == [4, 2, 1]
    assert len(np.unique(idx)) == len(idx) and (np.diff(idx) > 0).all()
    assert stratified_subset(labels, 500, seed=0).tolist() == list(range(100))


# --------------------------------------------------------------------------- cache


def test_cache_round_trip_keeps_everything(tmp_path):
    data = load_dataset("digits", "unused", train_subset=100)
    path = save_cache(data, tmp_path / "sub" / "digits.pt")
    assert [p.name for p in path.parent.iterdir()] == ["digits.pt"]  # no temp file left
    back = load_cache(path)
    assert isinstance(back, ImageData) and back.name == "digits"
    for key in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(back, key), getattr(data, key))
    assert back.pretrain_x is back.train_x
    assert back.mean == data.mean and back.std == data.std and back.num_classes == 10
    assert back.meta == data.meta


def test_cache_keeps_a_separate_pretraining_set(tmp_path):
    data = load_dataset("digits", "unused")
    other = ImageData(
        data.name,
        data.train_x,
        data.train_y,
        data.test_x,
        data.test_y,
        data.train_x[:10].clone(),
        10,
        data.mean,
        data.std,
    )
    back = load_cache(save_cache(other, tmp_path / "c.pt"))
    assert back.pretrain_x.shape[0] == 10 and back.pretrain_x is not back.train_x


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", "empty"])
def test_corrupt_cache_gives_one_line_value_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "cache.pt"
    save_cache(load_dataset("digits", "unused", train_subset=50), path)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a torch file at all" * 10)
    elif damage == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    else:
        path.write_bytes(b"")
    with pytest.raises(ValueError) as info:
        load_cache(path)
    assert str(path) in _one_line(info.value)


def test_load_cache_does_not_import_torchvision(tmp_path):
    path = save_cache(load_dataset("digits", "unused", train_subset=50), tmp_path / "c.pt")
    code = (
        "import sys; from smallbatch.data.load import load_cache; d = load_cache(sys.argv[1]); "
        "assert d.train_x.shape[0] == 50; "
        "bad = [m for m in ('torchvision', 'sklearn') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stdout + result.stderr


def test_missing_cache_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_cache(tmp_path / "nope.pt")


# --------------------------------------------------------------------------- bad input


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        load_dataset("mnist", "x")
    message = _one_line(info.value)
    assert all(name in message for name in DATASETS)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "stl10", "imagefolder"])
def test_missing_root_names_root_and_layout(tmp_path, name):
    root = tmp_path / "empty"
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, root)
    message = _one_line(info.value)
    assert str(root) in message
    expected = {
        "cifar10": "cifar-10-batches-py",
        "cifar100": "cifar-100-python",
        "stl10": "stl10_binary",
        "imagefolder": "train/<class>",
    }[name]
    assert expected in message


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"image_size": 0}, "image_size"),
        ({"image_size": 2.5}, "image_size"),
        ({"train_subset": -3}, "train_subset"),
        ({"test_subset": True}, "test_subset"),
        ({"seed": "one"}, "seed"),
    ],
)
def test_bad_options_raise_value_error_naming_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        load_dataset("digits", "unused", **kwargs)


def test_image_data_to_device_keeps_pretrain_shared():
    data = load_dataset("digits", "unused", train_subset=20)
    moved = data.to("cpu")
    assert moved.pretrain_x is moved.train_x and moved.channels == 1 and moved.image_size == 8


def test_root_may_be_none_only_for_digits():
    assert load_dataset("digits", None, train_subset=10).train_x.shape[0] == 10
    with pytest.raises(ValueError, match="root"):
        load_dataset("cifar10", None)


# --------------------------------------------------------------------------- which data: the digest in a cell's hash
def test_the_pinned_md5s_of_the_data_digest_are_torchvisions():
    """A release torchvision checks on every load (CIFAR, STL-10) or on download
    (Fashion-MNIST's archives) is named by torchvision's own MD5."""
    from torchvision.datasets import CIFAR10, CIFAR100, STL10, FashionMNIST

    from smallbatch.data.digest import FASHION_MNIST_MD5
    from smallbatch.data.registry import SPECS

    pinned = {name: spec.md5 for name, spec in SPECS.items() if spec.md5 is not None}
    assert {"cifar10": CIFAR10.tgz_md5, "cifar100": CIFAR100.tgz_md5, "stl10": STL10.tgz_md5} == pinned
    assert dict(FashionMNIST.resources) == FASHION_MNIST_MD5


def test_fashion_mnists_digest_is_its_content_wherever_it_is_read_from(tmp_path, monkeypatch):
    """Debian's archives and the files unpacked from them give one digest (a study that
    unpacked its data plans the same cells after); other content gives another."""
    import gzip

    from smallbatch.data import digest as datadigest

    debian = tmp_path / "debian"
    debian.mkdir()
    for i, name in enumerate(datadigest.FASHION_FILES):
        with gzip.open(debian / f"{name}.gz", "wb") as fh:
            fh.write(bytes([i]) * 100)
    monkeypatch.setattr(datadigest, "DEBIAN_FASHION_MNIST", debian)
    archived = datadigest.data_digest("fashion_mnist", tmp_path / "fresh")
    assert prepare_fashion_mnist(tmp_path / "unpacked", debian) is not None
    assert datadigest.data_digest("fashion_mnist", tmp_path / "unpacked") == archived
    (tmp_path / "unpacked" / "FashionMNIST" / "raw" / datadigest.FASHION_FILES[0]).write_bytes(b"other")
    assert datadigest.data_digest("fashion_mnist", tmp_path / "unpacked" / ".." / "unpacked") != archived
    assert archived.startswith("sha256:")
