"""A study stopped early: its report, given the plan the workflow recorded, says it is partial --
planned against finished cells in index.md's header and findings, and atop each section with cells
missing -- instead of reading as a smaller plan; a study whose planned cells all finished says nothing."""

from __future__ import annotations

import json

import pytest
from report_store import StoreBuilder, _params

from smallbatch import report

EXPERIMENT = "stopped-early"
S0, S1 = "digits/infonce/bs16-t0.1-s0", "digits/infonce/bs16-t0.1-s1"
RAW = "baselines/digits/raw_pixels-s0"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """Two grid cells and a baseline finished (hashes h0, h1, h2: StoreBuilder numbers them)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    b = StoreBuilder(uri, EXPERIMENT)
    for cid, seed in ((S0, 0), (S1, 1)):
        b.run(cid, params=_params("grid", "digits", "infonce", 16, 0.1, seed), final={"knn/top1": 80.0 + seed})
    b.run(
        RAW,
        kind="baseline",
        section="baseline",
        baseline="raw_pixels",
        params={"dataset": "digits", "baseline": "raw_pixels", "seed": 0},
        final={"knn/top1": 70.0, "linear/top1": 72.0},
    )
    return uri


def cell(cid: str, h: str, loss: str, bs: int) -> dict:
    return {
        "id": cid,
        "hash": h,
        "kind": "cell",
        "section": "grid",
        "dataset": "digits",
        "loss": loss,
        "batch_size": bs,
    }


def build(uri: str, tmp_path, entries: list[dict]) -> str:
    results = tmp_path / "results"
    results.mkdir()
    (results / "plan.json").write_text(json.dumps({"study": EXPERIMENT, "cells": entries}))
    return report.build_report(uri, results / "report", experiment=EXPERIMENT).read_text()


def test_a_report_of_a_study_stopped_early_says_planned_against_finished_cells(store, tmp_path):
    plan = [
        cell(S0, "h0", "infonce", 16),
        cell(S1, "hX", "infonce", 16),  # its run in the store computed other settings: not this plan's cell
        cell("digits/infonce/bs64-t0.1-s0", "h7", "infonce", 64),
        cell("digits/dcl/bs256-t0.1-s0", "h8", "dcl", 256),
        {"id": RAW, "hash": "h2", "kind": "baseline", "section": "baseline", "dataset": "digits"},
        {"id": "baselines/digits/random_init-s0", "hash": "h9", "kind": "baseline", "section": "baseline"},
    ]
    index = build(store, tmp_path, plan)
    header, findings = index.split("## Findings")[0], index.split("## Findings")[1].split("\n## ")[0]
    assert (
        "**Partial study: 2 of 6 planned cells finished**; 4 never ran or did not finish (data set digits; "
        "losses dcl and infonce; batch sizes 16, 64 and 256)."
    ) in header
    assert "- The study is partial: 2 of 6 planned cells finished" in findings
    grid = index.split("## Main grid")[1].split("\n## ")[0]
    assert "*Partial: 1 of 4 planned cells of this section finished.*" in grid
    baselines = index.split("## Baselines")[1].split("\n## ")[0]
    assert "*Partial: 1 of 2 planned cells of this section finished.*" in baselines


def test_a_report_of_a_study_whose_planned_cells_all_finished_says_nothing_of_a_plan(store, tmp_path):
    plan = [
        cell(S0, "h0", "infonce", 16),
        cell(S1, "h1", "infonce", 16),
        {"id": RAW, "hash": "h2", "kind": "baseline", "section": "baseline", "dataset": "digits"},
    ]
    assert "partial" not in build(store, tmp_path, plan).lower()
