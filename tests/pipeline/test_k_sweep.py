"""The K dose-response's planned cells (workflow/configs/k_sweep.yaml and its tiny twin): per data set,
τ and seed, arms at one optimiser batch that differ in the number of negatives K alone, and the
BatchNorm arms that differ from their K twin in bn_group alone."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from smallbatch.study import cells, config

ROOT = Path(__file__).resolve().parents[2]
#: what only a K arm may change: its negatives and the keys that set them
K_KEYS = {"neg_group", "extra_negatives"}


def _cells(name: str, over_defaults: bool) -> dict[str, dict]:
    over = yaml.safe_load((ROOT / "workflow" / "configs" / f"{name}.yaml").read_text())
    cfg = config.load_config(ROOT / "config.yaml" if over_defaults else None, overrides=over)
    return {cid: c for cid, c in cells.expand_cells(cfg).items() if c["experiment"] == "kcurve"}


def _without(cell: dict, train_keys: set[str]) -> dict:
    """The cell's settings but its id, hash, K and ``train_keys``."""
    out = {k: v for k, v in cell.items() if k not in ("id", "hash", "negatives")}
    out["train"] = {k: v for k, v in cell["train"].items() if k not in train_keys}
    return out


@pytest.mark.parametrize(
    "name, over_defaults, datasets, taus, seeds, batch, ks, bn",
    [
        (
            "k_sweep",
            True,
            ("fashion_mnist", "fashion_mnist_pairs"),
            (0.1,),
            range(3),
            256,
            [2, 6, 14, 30, 62, 126, 254, 510, 1022, 2046],
            (16, 256),
        ),
        ("k_sweep_tiny", False, ("digits",), (0.5,), range(2), 64, [2, 6, 14, 30, 62, 126, 254], (16, 64)),
    ],
)
def test_the_k_arms_share_one_optimiser_batch_and_differ_only_in_k(
    name, over_defaults, datasets, taus, seeds, batch, ks, bn
):
    got = _cells(name, over_defaults)
    grouped, whole = bn
    n = 0
    for ds, tau, s in itertools.product(datasets, taus, seeds):
        mine = [c for c in got.values() if c["dataset"] == ds and c["temperature"] == tau and c["seed"] == s]
        k_arms = [c for c in mine if c["train"]["bn_group"] == grouped]
        assert sorted(c["negatives"] for c in k_arms) == ks, (ds, tau, s)
        assert {c["batch_size"] for c in mine} == {batch}  # equal optimiser batches: equal steps
        first = _without(k_arms[0], K_KEYS)
        assert all(_without(c, K_KEYS) == first for c in k_arms), (ds, tau, s)
        assert len({c["hash"] for c in k_arms}) == len(ks)
        # BatchNorm over the whole batch: the key contrast's two K again, each differing from its twin in bn_group alone
        bn_arms = [c for c in mine if c["train"]["bn_group"] == whole]
        assert sorted(c["negatives"] for c in bn_arms) == [30, 2 * batch - 2]
        for c in bn_arms:
            twin = next(t for t in k_arms if t["negatives"] == c["negatives"])
            assert _without(c, {"bn_group"}) == _without(twin, {"bn_group"})
        n += len(mine)
    assert n == len(got)  # no cell outside these arms
