"""The report's representation section from a real (SQLite) store with designed values: its
table reproduces each metric's mean and spread over seeds, q_B is left out for a method
without negatives (in the table and the figure), one figure per data set and τ is written and
linked with its caption, and a store without any measured representation gets no section."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from report_store import StoreBuilder

from smallbatch import report
from smallbatch.report.runs import load_runs, select_cells
from smallbatch.report.sections import representation
from smallbatch.tracking import StoreReader

LOSSES = ("infonce", "simsiam")


def _repr(loss: str, bs: int, seed: int) -> dict:
    x = math.log2(256 / bs)
    k = LOSSES.index(loss)
    return {
        "repr/projection_alignment": 0.3 + 0.05 * x + 0.1 * k + 0.01 * seed,
        "repr/projection_uniformity": -3.0 + 0.2 * x - 0.03 * seed,
        "repr/features_rankme": 30.0 - 2.0 * x + 5 * k + seed,
        "repr/projection_rankme": 12.0 - x + seed,
        "repr/projection_neg_cos_sd": 0.2 + 0.01 * x + 0.02 * seed,
        "diag/qb_mean": 0.9 - 0.05 * x + 0.01 * seed,
    }


@pytest.fixture(scope="module")
def built(store_uri, tmp_path_factory):
    b = StoreBuilder(store_uri)
    for loss in LOSSES:
        for bs in (16, 64, 256):
            for seed in (0, 1):
                b.run(
                    f"digits/{loss}/bs{bs}-t0.2-s{seed}",
                    params={"dataset": "digits", "loss": loss, "batch_size": bs, "temperature": 0.2, "seed": seed},
                    final={"knn/top1": 70.0 + seed, "linear/top1": 75.0 + seed, **_repr(loss, bs, seed)},
                )
    out = tmp_path_factory.mktemp("report") / "report"
    report.build_report(store_uri, out, experiment="smallbatch")
    return out, store_uri


def test_the_table_holds_each_metrics_mean_and_spread_over_seeds(built):
    built, _ = built
    got = pd.read_csv(built / "tables" / "representation_digits.csv")
    for loss in LOSSES:
        for bs in (16, 64, 256):
            for m, (key, _) in representation.METRICS.items():
                row = got[(got["loss"] == loss) & (got["batch_size"] == bs) & (got["metric"] == m)]
                values = [_repr(loss, bs, s).get(key) for s in (0, 1)]
                if values[0] is None or (m == "qb" and loss == "simsiam"):
                    assert row.empty, (loss, bs, m)  # not measured, or q_B of a method without negatives
                    continue
                assert row["mean"].item() == pytest.approx(np.mean(values), rel=1e-6)
                assert row["std"].item() == pytest.approx(np.std(values, ddof=1), rel=1e-5)
    md = (built / "tables" / "representation_digits.md").read_text()
    assert "| 0.2 | SimSiam | 16 |" in md and "RankMe, features" in md


def test_one_figure_per_dataset_and_tau_linked_with_its_caption(built):
    built, uri = built
    assert {p.name for p in (built / "figures").glob("representation_*")} == {
        "representation_digits_t0.2.png",
        "representation_digits_t0.2.svg",
    }
    index = (built / "index.md").read_text()
    assert "## What each representation looks like" in index
    assert "figures/representation_digits_t0.2.png" in index and "RankMe: exp of the entropy" in index
    runs, _ = load_runs(StoreReader(uri), "smallbatch")
    data = representation._long(select_cells(runs, "grid"))
    assert set(data[data["metric"] == "qb"]["loss"]) == {"infonce"}  # the figure's q_B: contrastive losses only


def test_a_store_without_measured_representations_has_no_section(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    b = StoreBuilder(uri)
    for seed in (0, 1):
        b.run(
            f"digits/infonce/bs16-t0.2-s{seed}",
            params={"dataset": "digits", "loss": "infonce", "batch_size": 16, "temperature": 0.2, "seed": seed},
            final={"knn/top1": 70.0, "linear/top1": 75.0},
        )
    index = report.build_report(uri, tmp_path / "report", experiment="smallbatch").read_text()
    assert "What each representation looks like" not in index
    assert not list((tmp_path / "report" / "tables").glob("representation_*"))


def test_a_study_whose_every_cell_failed_leaves_no_row_to_blank_and_no_traceback():
    """Every cell failed: no aggregate has a seed, so the rows to blank are none (pandas 3 gave the
    empty selection the loss column's string dtype, and the mask a TypeError)."""
    import pandas as pd

    from smallbatch.report.sections.representation import _blank_without_negatives

    empty = pd.DataFrame({"loss": pd.Series([], dtype="str"), "metric": pd.Series([], dtype="str")})
    assert _blank_without_negatives(empty).empty
