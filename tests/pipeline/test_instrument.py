"""The instrument study's cells: its config expands into paired arms whose ids and hashes
differ exactly where their settings do."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from smallbatch.study import cells, config
from smallbatch.training.checkpoint import snapshot_steps

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
    """The 2 x 2 (256 / 256 grouped by 16 / 16 / 16 with 240 fresh negatives) and the positive
    control, per data set, τ and seed: BatchNorm over 16 images everywhere, the constant rate the
    snapshots need, K as designed, the grouped arm differing from the plain one in its negatives
    only, and the fresh arm from the small one in its negatives and in training only to budgets
    the small arm also reaches."""
    got = _instrument_cells()
    for dataset, tau, s in itertools.product(("fashion_mnist", "fashion_mnist_pairs"), (0.1, 0.5), range(6)):
        base = f"instrument/{dataset}/infonce/bs{{}}-t{tau}-s{s}"
        arms = {
            "large": got[base.format(256)],
            "grouped": got[base.format(256) + "-ng16"],
            "control": got[base.format(256) + "-ng2"],
            "small": got[base.format(16)],
            "fresh": got[base.format(16) + "-xn240"],
        }
        assert {k: c["negatives"] for k, c in arms.items()} == {
            "large": 510,
            "grouped": 30,
            "control": 2,
            "small": 30,
            "fresh": 510,
        }
        assert {c["train"]["bn_group"] for c in arms.values()} == {16}
        assert {c["train"]["lr_schedule"] for c in arms.values()} == {"constant"}
        assert {c["seed"] for c in arms.values()} == {s}
        assert arms["fresh"]["train"]["extra_negatives"] == 240 and arms["small"]["train"]["extra_negatives"] is None
        drop = {"id", "hash", "batch_size", "negatives", "train"}
        same = lambda c, drop=drop: {k: v for k, v in c.items() if k not in drop}  # noqa: E731
        large, grouped = arms["large"], arms["grouped"]
        assert same(large) == same(grouped)
        assert {k: v for k, v in large["train"].items() if k != "neg_group"} == {
            k: v for k, v in grouped["train"].items() if k != "neg_group"
        }
        small, fresh = arms["small"], arms["fresh"]
        budget = {"extra_negatives", "epochs", "snapshot_epochs"}  # the fresh arm trains 2 epochs only
        assert {k: v for k, v in small["train"].items() if k not in budget} == {
            k: v for k, v in fresh["train"].items() if k not in budget
        }
        fresh_budgets = {*fresh["train"]["snapshot_epochs"], fresh["train"]["epochs"]}
        assert fresh_budgets <= {*small["train"]["snapshot_epochs"], small["train"]["epochs"]}
    assert len({c["hash"] for c in got.values()}) == len(got)


def test_the_small_batch_snapshots_are_the_large_batch_budgets_in_steps():
    """B=16's snapshots land on B=256's step counts exactly (the fixed-steps view) on 10,000 images:
    B=256's budgets of 2, 4 and 8 epochs are 78, 156 and 312 steps."""
    got = _instrument_cells()
    small = got["instrument/fashion_mnist/infonce/bs16-t0.1-s0"]
    large = got["instrument/fashion_mnist/infonce/bs256-t0.1-s0"]
    images = small["dataset_options"]["train_subset"]
    steps = lambda c, e: snapshot_steps(e, images // c["batch_size"])  # noqa: E731
    big = {steps(large, e) for e in [*large["train"]["snapshot_epochs"], large["train"]["epochs"]]}
    small_steps = {steps(small, e) for e in small["train"]["snapshot_epochs"]}
    assert big == {78, 156, 312} and big <= small_steps
    tiny = cells.expand_cells(config.load_config(ROOT / "workflow/configs/instrument_tiny.yaml"))
    s16, s64 = tiny["instrument/digits/infonce/bs16-t0.5-s0"], tiny["instrument/digits/infonce/bs64-t0.5-s0"]
    n = 1437  # digits' pretraining images
    twin = snapshot_steps(s64["train"]["epochs"], n // 64)
    assert snapshot_steps(s16["train"]["snapshot_epochs"][0], n // 16) == twin == 22


@pytest.mark.slow
def test_the_tiny_instrument_study_runs_through_snakemake_and_its_report_states_the_gates(tmp_path):
    """Every cell and every snapshot evaluated, the snapshot metrics in the cell's run, the
    report's instrument section with its gates first, and a rerun that plans nothing."""
    from test_workflow import planned_jobs, snakemake

    tiny = ROOT / "workflow/configs/instrument_tiny.yaml"
    proc = snakemake("--cores", "2", "--quiet", results=tmp_path, configfile=tiny, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    snaps = sorted(tmp_path.glob("runs/instrument/digits/infonce/*/snapshots/*.linear.json"))
    assert len(snaps) == 24  # one snapshot per cell (24 cells)
    assert all(json.loads(p.read_text())["status"] in ("finished", "collapsed") for p in snaps)
    index = (tmp_path / "report" / "index.md").read_text()
    assert "Gates, digits, τ 0.1, 1 epoch: G1 supervised − raw pixels" in index
    gates = pd.read_csv(tmp_path / "report" / "tables" / "instrument_gates.csv")
    assert set(gates["gate"]) == {"G1", "G2", "G3"}
    # the config's analysis plan reaches the report through the workflow, printed before the gates
    assert "Analysis plan: equivalence margin: ± 0.50 × |the positive control's effect|" in index
    assert index.index("Analysis plan:") < index.index("Gates, digits")
    seeds = pd.read_csv(tmp_path / "report" / "tables" / "instrument_seeds.csv")
    assert {"arm", "seed", "budget", "probe", "value"} <= set(seeds.columns)
    contrasts = pd.read_csv(tmp_path / "report" / "tables" / "instrument_contrasts.csv")
    assert {"negatives", "steps", "interaction", "control"} <= set(contrasts["key"])
    assert set(contrasts["view"]) == {"epochs", "steps"} and set(contrasts["temperature"]) == {0.1, 0.5}
    assert planned_jobs(snakemake("-n", results=tmp_path, configfile=tiny, timeout=300)) == {}
