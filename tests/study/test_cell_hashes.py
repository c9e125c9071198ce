"""The default study's cell hashes are pinned: a change of what a hash covers (a key left out
or added, a default changed, the data's digest) moves finished results out of reach or keeps
results of other settings, so it must be a deliberate edit of the golden file
(``tests/cell_hashes.py --write``), never a side effect."""

from __future__ import annotations

import json

import pytest
from cell_hashes import GOLDEN, default_cells, golden_entries, moved_keys

from smallbatch.data.digest import DEBIAN_FASHION_MNIST


@pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (apt-get install dataset-fashion-mnist)",
)
def test_the_default_studys_cell_hashes_are_the_golden_ones(tmp_path):
    """Every cell and baseline of config.yaml keeps the hash written down in the golden file;
    a moved hash is reported with the hashed keys whose change moved it."""
    golden = json.loads(GOLDEN.read_text())
    now = golden_entries(default_cells(tmp_path))
    assert len(golden) == 43  # 5 losses x 4 batch sizes x 1 temperature x 2 seeds, and 3 baselines
    assert sorted(now) == sorted(golden), (
        f"cells added: {sorted(set(now) - set(golden))}; cells gone: {sorted(set(golden) - set(now))}"
    )
    moved: dict[str, list[str]] = {}  # what moved them -> the cells whose hash moved
    for cid in golden:
        if now[cid]["hash"] != golden[cid]["hash"]:
            why = "; ".join(moved_keys(golden[cid]["hashed"], now[cid]["hashed"]))
            moved.setdefault(why or "no hashed key differs (the hash function changed)", []).append(cid)
    assert not moved, (
        f"{sum(map(len, moved.values()))} of {len(golden)} hashes moved (intended? regenerate with "
        "`PYTHONPATH=src python tests/cell_hashes.py --write`): "
        + " | ".join(f"{why} [{len(ids)} cells, e.g. {ids[0]}]" for why, ids in moved.items())
    )


def test_a_moved_hash_names_the_keys_that_moved_it():
    """The failure message of the test above names each key added to, left out of or changed
    in the hashed payload, with its value then and now."""
    old = {"train": {"lr": 0.001, "weight_decay": 1e-06}, "seed": 0}
    new = {"train": {"lr": 0.002}, "seed": 0, "data_digest": "sha256:ab"}
    assert moved_keys(old, new) == [
        'data_digest: (not hashed) -> "sha256:ab"',
        "train.lr: 0.001 -> 0.002",
        "train.weight_decay: 1e-06 -> (not hashed)",
    ]
