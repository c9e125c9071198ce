"""``smallbatch.results``: the public table of a study's runs, read from the golden store
(``report_store.build_golden_store``) and compared with the report's own CSV tables of that
store (``tests/fixtures/report_golden/tables``, which test_report_golden keeps equal to the
report)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from report_store import GOLDEN, GOLDEN_EXPERIMENT, build_golden_store

import smallbatch
from smallbatch.report.runs import newest
from smallbatch.tracking import TrackingError

TABLES = GOLDEN / "tables"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('golden') / 'mlflow.db'}"
    build_golden_store(uri, GOLDEN_EXPERIMENT)
    return uri


@pytest.fixture(scope="module")
def runs(store) -> pd.DataFrame:
    return smallbatch.results(store, experiment=GOLDEN_EXPERIMENT)


def test_results_has_one_row_per_cell_and_baseline_run(runs):
    cost = pd.read_csv(TABLES / "cost_runs.csv")  # the report's one row per cell (its newest run)
    assert set(runs["cell_id"]) == set(cost["cell_id"])
    assert {"cell", "baseline"} <= set(runs["kind"])
    assert not {"report", "parent"} & set(runs["kind"])  # the runs that hold no result are left out
    latest, superseded = newest(runs)
    assert superseded == 1 and len(runs) == len(cost) + 1  # a rerun cell: both its runs are rows
    got = latest.set_index("cell_id").loc[cost["cell_id"]]
    assert list(got["status"]) == list(cost["status"])
    assert list(got["batch_size"].astype("Float64")) == list(cost["batch_size"].astype("Float64"))


def test_results_settings_and_metrics_equal_the_report_tables(runs):
    latest, _ = newest(runs)
    base = pd.read_csv(TABLES / "baselines.csv")
    for row in base.itertuples():
        sel = latest[(latest["baseline"] == row.baseline) & (latest["dataset"] == row.dataset)]
        assert len(sel) == row.n_runs
        assert sel[f"metrics.{row.metric}/top1"].mean() == pytest.approx(row.mean, rel=1e-6)
    top1 = pd.read_csv(TABLES / "grid_top1_digits_knn.csv")
    checked = 0
    for row in top1[top1["label"].isin(["DCL", "FlatNCE", "InfoNCE (epochs=20)"]) & (top1["n_runs"] > 0)].itertuples():
        cell = latest[
            (latest["section"] == "grid")
            & (latest["dataset"] == row.dataset)
            & (latest["loss"] == row.loss)
            & (latest["batch_size"] == row.batch_size)
            & (latest["temperature"] == row.temperature)
            & (latest["params.epochs"] == "20")
        ]
        assert len(cell) == row.n_runs, row
        ok = cell[cell["status"] == "finished"]
        assert len(ok) == row.n_runs - row.n_diverged - row.n_failed
        if len(ok):
            assert ok["metrics.knn/top1"].mean() == pytest.approx(row.mean, rel=1e-6), row
            checked += 1
    assert checked >= 6


def test_results_names_a_missing_experiment(store):
    with pytest.raises(ValueError, match=f"no such experiment; available: .*{GOLDEN_EXPERIMENT}"):
        smallbatch.results(store, experiment="no-such-study")


def test_import_smallbatch_stays_light():
    code = "import sys, smallbatch; print(sorted({'pandas', 'mlflow', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert callable(smallbatch.results) and "results" in dir(smallbatch)


def test_train_settings_read_alike_with_and_without_their_config_prefix():
    """Runs log the config's dotted keys (``train.lr``); stores logged before that wrote ``lr``:
    the report's table reads both as one column, so an old store's report does not change."""
    from smallbatch.report.runs import run_frame

    def record(params):
        tags = {"smallbatch.cell_id": "d/infonce/bs16-t0.1-s0", "smallbatch.kind": "cell"}
        base = {"dataset": "digits", "loss": "infonce", "batch_size": "16", "temperature": "0.1", "seed": "0"}
        return {"run_id": "r", "run_name": "n", "status": "FINISHED", "start_time": 0, "tags": tags,
                "params": {**base, **params}, "metrics": {"knn/top1": 90.0}}  # fmt: skip

    new = run_frame([record({"train.lr": "0.001", "train.epochs": "4", "augment.crop_scale": "[0.8, 1.0]"})])
    old = run_frame([record({"lr": "0.001", "epochs": "4", "augment.crop_scale": "[0.8, 1.0]"})])
    pd.testing.assert_frame_equal(new, old)
    assert new.loc[0, "params.lr"] == "0.001" and "params.train.lr" not in new.columns


def _deleted(store: str, tmp_path) -> tuple[str, str]:
    """A store copy whose experiment was deleted (its runs kept by MLflow until garbage-collected)."""
    import shutil

    from mlflow.tracking import MlflowClient

    db = tmp_path / "copy.db"
    shutil.copy(store[len("sqlite:///") :], db)
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    client.delete_experiment(client.get_experiment_by_name(GOLDEN_EXPERIMENT).experiment_id)
    return f"sqlite:///{db}", GOLDEN_EXPERIMENT


#: (case, (store, tmp_path) -> (tracking_uri, experiment), the one line expected)
BAD_RESULTS = [
    ("a deleted experiment", _deleted, rf"experiment '{GOLDEN_EXPERIMENT}' at URI .* was deleted; restore it .*"),
    (
        "the store's database as a Path",
        lambda store, tmp: (Path(store[len("sqlite:///") :]), GOLDEN_EXPERIMENT),
        r"no MLflow store at .*/mlflow\.db: .*/mlflow\.db is a file, and a URI without a scheme names a folder "
        r"store; for an SQLite database use sqlite:////.*/mlflow\.db",
    ),
    ("None", lambda store, tmp: (None, None), r"smallbatch\.results needs the study's tracking URI, .* not None"),
    ("''", lambda store, tmp: ("", None), r"no MLflow store at '': the tracking URI is empty; .*"),
]


@pytest.mark.parametrize("case,make,expect", BAD_RESULTS, ids=[r[0] for r in BAD_RESULTS])
def test_results_refuses_what_names_no_study_in_one_line(case, make, expect, store, tmp_path):
    uri, experiment = make(store, tmp_path)
    with pytest.raises((ValueError, TrackingError)) as err:
        smallbatch.results(uri, experiment=experiment)
    assert "\n" not in str(err.value) and re.fullmatch(expect, str(err.value)), str(err.value)
