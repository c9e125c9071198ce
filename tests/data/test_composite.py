"""The composite task (smallbatch.data.composite, data sets fashion_mnist_pairs / _triples):
labels, layout, balance, determinism and split hygiene, on Fashion-MNIST files written in
the real IDX format (tiny, random pixels) and read by the real loader."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import smallbatch.data.load as data_mod
from smallbatch.data.composite import composite_labels, composite_sources, make_composites, strip_bounds, tile_images
from smallbatch.data.load import load_cache, load_dataset, save_cache

N_TRAIN, N_TEST = 60, 30


def _write_fashion(root: Path) -> dict[str, np.ndarray]:
    """Decompressed IDX files under root/FashionMNIST/raw/: each image one grey level, its
    index in its split for training images (0..59) and 128 + its index for test images, so
    a composite's pixels tell which images it holds (a constant image resizes to itself)."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n, offset in (("train", N_TRAIN, 0), ("t10k", N_TEST, 128)):
        images = np.broadcast_to((np.arange(n) + offset).astype(np.uint8)[:, None, None], (n, 28, 28)).copy()
        labels = (np.arange(n) * 7) % 10
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
        )
        arrays[split] = (images, labels)
    return arrays


@pytest.fixture()
def fashion_root(tmp_path):
    return tmp_path, _write_fashion(tmp_path)


def test_composite_label_is_the_items_classes_as_digits():
    assert composite_labels(np.array([[3, 7], [0, 0], [9, 9]]), 10).tolist() == [37, 0, 99]
    assert composite_labels(np.array([[1, 2, 3]]), 10).tolist() == [123]


def test_sources_have_the_labelled_classes_and_balanced_labels():
    labels = np.arange(200) % 10
    sources, comp = composite_sources(labels, 2, 1000, seed=0)
    assert sources.shape == (1000, 2) and comp.shape == (1000,)
    assert np.array_equal(composite_labels(labels[sources], 10), comp)  # each item is of its digit's class
    assert np.bincount(comp, minlength=100).tolist() == [10] * 100  # balanced
    uses = np.bincount(sources.ravel(), minlength=200)
    assert uses.min() == uses.max() == 10  # every source image used equally often


def test_fewer_composites_than_classes_still_draw_from_every_class():
    sources, comp = composite_sources(np.arange(100) % 10, 3, 500, seed=1)
    assert len(np.unique(comp)) == 500 and comp.max() >= 900  # 500 distinct classes of 1,000, not the first 500


def test_sources_are_deterministic_and_seeded():
    labels = np.arange(50) % 10
    a, b, c = (composite_sources(labels, 2, 300, seed=s) for s in (0, 0, 1))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def test_tiles_are_stacked_top_to_bottom_in_strips_of_the_full_width():
    assert strip_bounds(16, 2) == [(0, 8), (8, 16)] and strip_bounds(16, 3) == [(0, 5), (5, 11), (11, 16)]
    images = torch.arange(4, dtype=torch.uint8).mul(60).view(4, 1, 1, 1).expand(4, 1, 6, 6).contiguous()
    out = tile_images(images, np.array([[1, 3], [2, 2]]), size=8)
    assert out.shape == (2, 1, 8, 8) and out.dtype == torch.uint8
    assert (out[0, 0, :4] == 60).all() and (out[0, 0, 4:] == 180).all() and (out[1] == 120).all()
    with pytest.raises(ValueError, match="too small"):
        tile_images(images, np.array([[0, 1, 2]]), size=2)


def test_composites_of_one_split_reuse_nothing_of_another():
    images = torch.zeros(20, 1, 4, 4, dtype=torch.uint8)
    _, comp, src = make_composites(images, np.arange(20) % 10, 2, 40, 4, seed=0)
    assert src.max() < 20 and len(comp) == 40


def test_pairs_data_set_split_hygiene_labels_and_determinism(fashion_root):
    root, arrays = fashion_root
    d = load_dataset("fashion_mnist_pairs", root, image_size=16, train_subset=200, test_subset=100)
    assert d.num_classes == 100 and d.train_x.shape == (200, 1, 16, 16) and d.test_x.shape == (100, 1, 16, 16)
    assert d.pretrain_x is d.train_x and d.meta["tiles"] == 2
    tr_src, te_src = d.meta["train_sources"].numpy(), d.meta["test_sources"].numpy()
    # labels: the source items' classes, top item first
    assert np.array_equal(d.train_y.numpy(), composite_labels(arrays["train"][1][tr_src], 10))
    assert np.array_equal(d.test_y.numpy(), composite_labels(arrays["t10k"][1][te_src], 10))
    assert d.meta["classes"][37] == "Dress|Sneaker"
    # split hygiene: the bookkeeping and the pixels agree, and no test image is in any training composite
    assert tr_src.max() < N_TRAIN and te_src.max() < N_TEST
    assert np.array_equal(d.train_x[:, 0, [0, 8], 0].numpy(), tr_src)  # each strip is its source's grey level
    assert np.array_equal(d.test_x[:, 0, [0, 8], 0].numpy(), te_src + 128)
    assert int(d.train_x.max()) < 128 <= int(d.test_x.min())
    again = load_dataset("fashion_mnist_pairs", root, image_size=16, train_subset=200, test_subset=100)
    assert torch.equal(again.train_x, d.train_x) and torch.equal(again.test_y, d.test_y)


def test_each_strip_is_its_source_image_resized():
    images = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = tile_images(images, np.array([[4, 1]]), size=28)  # strips of 14 x 28
    for strip, src in ((out[0, 0, :14], 4), (out[0, 0, 14:], 1)):
        expected = torch.nn.functional.interpolate(
            images[src : src + 1].float(), size=(14, 28), mode="bilinear", antialias=True, align_corners=False
        )
        assert torch.equal(strip, expected.round().clamp(0, 255).to(torch.uint8)[0, 0])


def test_triples_have_a_thousand_classes_and_the_default_test_count(fashion_root):
    root, _ = fashion_root
    d = load_dataset("fashion_mnist_triples", root, image_size=12, train_subset=50)
    assert d.num_classes == 1000 and d.test_x.shape[0] == data_mod.split_sizes("fashion_mnist_triples")["test"]
    assert len(d.meta["classes"]) == 1000 and d.meta["tiles"] == 3


def test_composite_counts_beyond_the_table_are_one_line(fashion_root):
    root, _ = fashion_root
    with pytest.raises(ValueError, match="train_subset = 60001 is larger than the 60,000 train images"):
        load_dataset("fashion_mnist_pairs", root, train_subset=60001)


def test_cache_round_trip_keeps_the_sources(fashion_root, tmp_path):
    root, _ = fashion_root
    d = load_dataset("fashion_mnist_pairs", root, image_size=8, train_subset=40, test_subset=20)
    back = load_cache(save_cache(d, tmp_path / "c.pt"))
    assert torch.equal(back.meta["train_sources"], d.meta["train_sources"]) and back.num_classes == 100


def test_config_accepts_composites_and_checks_their_root(tmp_path):
    from smallbatch.study.config import ConfigError, check_data_roots, validate_config

    cfg = validate_config(
        {
            "datasets": {"fashion_mnist_pairs": {"image_size": 16, "train_subset": 1000}},
            "data": {"root": str(tmp_path / "nowhere")},
        }
    )
    if not data_mod.DEBIAN_FASHION_MNIST.is_dir():
        with pytest.raises(ConfigError, match="FashionMNIST/raw"):
            check_data_roots(cfg)
    _write_fashion(tmp_path / "nowhere")
    check_data_roots(cfg)


def test_the_schema_lists_every_registered_data_set():
    from smallbatch.study.schema import load_schema

    assert set(load_schema()["properties"]["datasets"]["propertyNames"]["enum"]) == set(data_mod.DATASETS)
    assert data_mod.base_dataset("fashion_mnist_triples") == "fashion_mnist" == data_mod.base_dataset("fashion_mnist")


def test_prepare_data_caches_composites_for_the_workflow(fashion_root, tmp_path, capsys):
    from smallbatch.pipeline.cli import main

    root, _ = fashion_root
    out = tmp_path / "cache" / "fashion_mnist_pairs.pt"
    assert (
        main(
            [
                "prepare-data",
                "--dataset",
                "fashion_mnist_pairs",
                "--data-root",
                str(root),
                "--image-size",
                "8",
                "--train-subset",
                "40",
                "--test-subset",
                "20",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    cached = load_cache(out)
    assert cached.train_x.shape == (40, 1, 8, 8) and cached.test_x.shape == (20, 1, 8, 8) and cached.num_classes == 100
    assert '"train": 40' in capsys.readouterr().out
