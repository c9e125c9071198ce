"""The instrument study's cells: its config expands into paired arms whose ids and hashes
differ exactly where their settings do."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from smallbatch.pipeline import cells, config

ROOT = Path(__file__).resolve().parents[2]


def _instrument_cells() -> dict[str, dict]:
    over = yaml.safe_load((ROOT / "workflow/configs/instrument.yaml").read_text())
    return cells.expand_cells(config.load_config(ROOT / "config.yaml", overrides=over))


def test_a_batch_entry_control_names_the_cell_and_sets_only_its_key():
    cfg = config.load_config(
        None,
        overrides={
            "grid": {
                "losses": ["infonce"],
                "batch_sizes": [16, {"size": 16, "train": {"neg_group": 8}}],
                "temperatures": [0.1],
                "seeds": [0],
            }
        },
    )
    got = cells.expand_cells(cfg)
    plain, grouped = got["fashion_mnist/infonce/bs16-t0.1-s0"], got["fashion_mnist/infonce/bs16-t0.1-s0-ng8"]
    assert grouped["train"]["neg_group"] == 8 and plain["train"]["neg_group"] is None
    assert grouped["hash"] != plain["hash"] and len(got) == 2


def test_two_entries_of_one_size_without_a_control_collide_loudly():
    """chunk_size keeps the id (it changes how, not what): two such entries are refused, never merged."""
    with pytest.raises(config.ConfigError, match="share the id"):
        config.load_config(
            None,
            overrides={
                "grid": {
                    "losses": ["infonce"],
                    "batch_sizes": [16, {"size": 16, "train": {"chunk_size": 8}}],
                    "temperatures": [0.1],
                    "seeds": [0],
                }
            },
        )


def test_the_instrument_arms_are_paired_by_seed_and_differ_only_in_their_control():
    got = _instrument_cells()
    for dataset in ("fashion_mnist", "fashion_mnist_pairs"):
        for s in range(6):
            base = f"instrument/{dataset}/infonce/bs{{}}-t0.1-s{s}"
            small, large = got[base.format(16)], got[base.format(256)]
            grouped = got[base.format(256) + "-ng16"]
            assert {c["train"]["bn_group"] for c in (small, large, grouped)} == {16}
            assert grouped["train"]["neg_group"] == 16 and large["train"]["neg_group"] is None
            assert (small["negatives"], large["negatives"], grouped["negatives"]) == (30, 510, 30)  # K = 2N-2, 2G-2
            assert small["seed"] == large["seed"] == grouped["seed"] == s
            for other in ("dcl", "sogclr"):
                assert got[f"instrument/{dataset}/{other}/bs16-t0.1-s{s}"]["train"]["bn_group"] == 16
            drop = {"id", "hash", "batch_size", "negatives", "train"}
            same = lambda c: {k: v for k, v in c.items() if k not in drop}  # noqa: E731
            assert same(large) == same(grouped)
            assert {k: v for k, v in large["train"].items() if k != "neg_group"} == {
                k: v for k, v in grouped["train"].items() if k != "neg_group"
            }
    assert len({c["hash"] for c in got.values()}) == len(got)
