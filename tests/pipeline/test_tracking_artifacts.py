"""What a cell's MLflow run keeps besides numbers, against a real SQLite store: the resolved
config and the evaluation as artifacts (the backbone with ``tracking.log_checkpoint``), an
artifact root that follows a moved study folder (read by the tracking module, and served by
a real ``mlflow server`` started in the moved folder as ``mlflow ui`` is), the images-seen
axis beside the optimiser step, the CPU seconds, and the experiment's description."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cluster
import pytest
import torch
from test_reliability import TINY

from smallbatch import tracking
from smallbatch.pipeline import jobs as steps
from smallbatch.study.cell import Cell, read_cell
from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config
from smallbatch.training import loop as train
from smallbatch.training.checkpoint import load_checkpoint

EXPERIMENT = "artifacts"
ARTIFACTS = ["backbone.pt", "cell.json", "knn.json", "linear.json", "representation.json"]


def digits_cell(**top) -> dict:
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {**TINY, "epochs": 1}, **top})
    return make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=32, temperature=0.5, seed=0)


@pytest.fixture(scope="module")
def study(tmp_path_factory, cache):
    """One cell pretrained and evaluated into ``study/results`` (backbone logged); then the
    study folder is moved.  (moved results folder, cell, run id, the trained model's weights)."""
    root = tmp_path_factory.mktemp("study")
    results = root / "study" / "results"
    uri = f"sqlite:///{results / 'mlflow.db'}"
    tracking.init_store(uri, EXPERIMENT, "config.yaml")
    cell = digits_cell(tracking={"log_checkpoint": True}, eval={"monitor_every": 1})
    out = results / "runs" / "cell"
    steps.run_pretrain(Cell.of(cell), out, tracking_uri=uri, experiment=EXPERIMENT, cache=cache, progress=False)
    steps.run_evaluate(Cell.of(cell), out / "checkpoint.pt", out, tracking_uri=uri, experiment=EXPERIMENT, cache=cache)
    run_id = tracking.find_cell_run(uri, EXPERIMENT, cell).run_id
    model = load_checkpoint(out / "checkpoint.pt")["model"]
    shutil.move(root / "study", root / "moved")
    return root / "moved" / "results", cell, run_id, model


def test_log_checkpoint_is_an_execution_setting_outside_the_cell_hash():
    plain, logged = digits_cell(), digits_cell(tracking={"log_checkpoint": True})
    assert plain["tracking"] == {"log_checkpoint": False} and logged["tracking"] == {"log_checkpoint": True}
    assert logged["hash"] == plain["hash"]


def test_a_moved_study_still_reads_its_artifacts(study, tmp_path):
    results, cell, run_id, model = study
    reader = tracking.StoreReader(f"sqlite:///{results / 'mlflow.db'}")
    run = reader._client.get_run(run_id)
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # no absolute path in the store
    assert {e.artifact_location.split(":")[0] for e in reader._experiments()} == {"mlflow-artifacts"}  # 'Default' too
    assert reader.artifacts(run_id) == ARTIFACTS
    assert json.loads(reader.download_artifact(run_id, "cell.json", tmp_path).read_text()) == cell
    knn = json.loads(reader.download_artifact(run_id, "knn.json", tmp_path).read_text())
    assert knn["knn/top1"] == pytest.approx(run.data.metrics["knn/top1"])
    # the backbone: a plain state dict that loads into a fresh backbone of the cell, strictly
    weights = torch.load(reader.download_artifact(run_id, "backbone.pt", tmp_path), weights_only=True)
    fresh = train.build_model(read_cell(cell), 1, 8).backbone
    fresh.load_state_dict(weights)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, model[f"backbone.{k}"]), k


def test_a_script_finds_a_moved_studys_artifacts_in_a_local_folder(study):
    """tracking.artifact_path: the folder under the moved store's ``mlartifacts`` (MLflow's
    client cannot read a proxied root through the sqlite URI)."""
    results, cell, run_id, _ = study
    uri = f"sqlite:///{results / 'mlflow.db'}"
    folder = tracking.artifact_path(uri, run_id)
    assert folder.is_relative_to(results / tracking.ARTIFACTS_DIR)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == ARTIFACTS
    assert json.loads((folder / "cell.json").read_text()) == cell


def test_a_store_made_before_the_format_tag_is_refused_in_one_line(tmp_path):
    """A study experiment without this smallbatch's format (made by an older one, with MLflow's
    file artifact root) is neither written into nor read: one line says how to go on."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    uri = f"sqlite:///{tmp_path / 'old.db'}"
    old = SqlAlchemyStore(uri, (tmp_path / "old-artifacts").as_uri())
    old.create_experiment(EXPERIMENT)
    old.engine.dispose()
    line = (
        f"experiment '{EXPERIMENT}' of the store {uri} was written by another smallbatch (format none; this one "
        "reads and writes format 2): run the study into a new store (another results_dir or tracking_uri), or "
        "read this one with the smallbatch that wrote it"
    )
    with pytest.raises(tracking.TrackingError) as ei:
        tracking.open_cell_run(uri, EXPERIMENT, {"id": "c", "hash": "h"})
    assert str(ei.value) == line
    with pytest.raises(tracking.TrackingError) as ei:
        tracking.StoreReader(uri).experiment(EXPERIMENT)
    assert str(ei.value) == line


def test_mlflow_ui_started_in_the_moved_folder_serves_the_artifacts(study, tmp_path):
    """``mlflow server`` with MLflow's default artifact destination, started where the store is
    (as ``mlflow ui`` is): its proxy lists and downloads the run's artifacts."""
    from mlflow.tracking import MlflowClient

    results, cell, run_id, _ = study
    # the server answered its health check: this test's requests wait for their answers (hang guard only)
    with cluster.MlflowServer(results, artifacts=None) as server, cluster.client_deadline(cluster.HANG_S):
        client = MlflowClient(tracking_uri=server.uri)
        assert sorted(a.path for a in client.list_artifacts(run_id)) == ARTIFACTS
        got = client.download_artifacts(run_id, "cell.json", str(tmp_path))
        assert json.loads(Path(got).read_text())["id"] == cell["id"]
        # a study logging over HTTP to that server: its artifacts land in the same folder
        tracking.init_store(server.uri, "over-http")
        run = tracking.open_cell_run(server.uri, "over-http", {"id": "c", "hash": "h"})
        run.log_artifact(results / "runs" / "cell" / "cell.json")
        assert tracking.StoreReader(server.uri).artifacts(run.run_id) == ["cell.json"]
        assert list((results / "mlartifacts").glob(f"*/{run.run_id}/artifacts/cell.json"))
        # a changed report over HTTP replaces its run's artifacts through the server's proxy
        ids = []
        for i, name in enumerate(["a.md", "b.md"]):
            (tmp_path / f"r{i}").mkdir()
            (tmp_path / f"r{i}" / name).write_text(name)
            ids.append(
                tracking.log_report_run(server.uri, "over-http", tmp_path / f"r{i}", [tmp_path / f"r{i}" / name])
            )
        assert ids[0] == ids[1] and tracking.StoreReader(server.uri).artifacts(ids[1]) == ["b.md"]


def test_images_seen_and_cpu_seconds_are_logged_and_the_experiment_is_described(study):
    results, cell, run_id, _ = study
    reader = tracking.StoreReader(f"sqlite:///{results / 'mlflow.db'}")
    seen = reader.history(run_id, "train/images_seen")
    loss_steps = [s for s, _ in reader.history(run_id, "train/loss")]
    assert seen and [s for s, _ in seen] == loss_steps  # beside the optimiser step, at the same steps
    assert all(v == s * cell["batch_size"] for s, v in seen)
    metrics = reader._client.get_run(run_id).data.metrics
    assert metrics["train/cpu_s"] > 0 and metrics["knn/cpu_s"] >= 0 and metrics["linear/cpu_s"] > 0
    exp_id, _ = reader.experiment(EXPERIMENT)
    note = reader._client.get_experiment(exp_id).tags[tracking.TAG_NOTE]
    assert f"**{EXPERIMENT}**" in note and "config.yaml" in note


def test_the_knn_monitor_is_logged_at_each_epoch_end(study):
    results, cell, run_id, _ = study
    reader = tracking.StoreReader(f"sqlite:///{results / 'mlflow.db'}")
    top1, epoch = reader.history(run_id, "monitor/knn_top1"), reader.history(run_id, "monitor/epoch")
    steps_run = int(reader._client.get_run(run_id).data.metrics["train/steps"])
    assert [s for s, _ in top1] == [s for s, _ in epoch] == [steps_run] and [v for _, v in epoch] == [1.0]
    seen = reader.history(run_id, "monitor/images_seen")  # its x-axis beside the step: images seen by then
    assert seen == [(steps_run, float(steps_run * cell["batch_size"]))]
    assert 20 < top1[0][1] <= 100  # well above chance (10 classes) after an epoch of digits


def test_the_report_is_its_own_run_and_later_reports_leave_it_out(study, tmp_path):
    from smallbatch.report import build_report
    from smallbatch.report.runs import load_runs

    results, cell, run_id, _ = study
    uri = f"sqlite:///{results / 'mlflow.db'}"
    reader = tracking.StoreReader(uri)
    for _ in range(2):  # built twice: the same report is the same run
        build_report(uri, tmp_path / "report", experiment=EXPERIMENT, log_run=True)
    exp_id, _ = reader.experiment(EXPERIMENT)
    reports = [r for r in reader.runs(exp_id) if r["tags"][tracking.TAG_KIND] == tracking.KIND_REPORT]
    assert len(reports) == 1 and reports[0]["status"] == "finished"
    files = reader.artifacts(reports[0]["run_id"])
    assert "index.md" in files and any(f.startswith("tables/") and f.endswith(".csv") for f in files)
    assert any(f.startswith("figures/") and f.endswith(".png") for f in files)
    got = reader.download_artifact(reports[0]["run_id"], "index.md", tmp_path / "dl")
    assert got.read_text() == (tmp_path / "report" / "index.md").read_text()
    runs, _ = load_runs(reader, EXPERIMENT)
    assert list(runs["run_id"]) == [run_id]  # the report reads the cell, not its own run


def test_the_cost_table_sums_each_cells_logged_seconds(study, tmp_path):
    import pandas as pd

    from smallbatch.report import build_report

    results, cell, run_id, _ = study
    uri = f"sqlite:///{results / 'mlflow.db'}"
    build_report(uri, tmp_path / "report", experiment=EXPERIMENT)
    m = tracking.StoreReader(uri)._client.get_run(run_id).data.metrics
    per_run = pd.read_csv(tmp_path / "report" / "tables" / "cost_runs.csv")
    row = per_run[per_run["cell_id"] == cell["id"]].iloc[0]
    assert row["wall_s"] == pytest.approx(m["train/wall_s"] + m["knn/seconds"] + m["linear/seconds"], rel=1e-5)
    assert row["cpu_s"] == pytest.approx(m["train/cpu_s"] + m["knn/cpu_s"] + m["linear/cpu_s"], rel=1e-5)
    study_row = pd.read_csv(tmp_path / "report" / "tables" / "cost_study.csv").set_index("section").loc["study"]
    assert study_row["runs"] == len(per_run) and study_row["cpu_h"] == pytest.approx(
        per_run["cpu_s"].sum() / 3600, rel=1e-5
    )
    assert "## Cost: wall and CPU seconds" in (tmp_path / "report" / "index.md").read_text()
