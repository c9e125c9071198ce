"""A study's store as MLflow's UI and search read it, against a real SQLite store: the experiment opens
in MLflow 3's model-training view (not its GenAI view), a cell's numeric settings sort as numbers (MLflow
sorts params as text: 128 before 16), and cells, baselines and the report are told apart by a tag."""

from __future__ import annotations

import pytest

from smallbatch import tracking

#: MLflow 3's experiment tag and value for a model-training experiment (its UI's ExperimentKind)
KIND_TAG, TRAINING = "mlflow.experimentKind", "custom_model_development"


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "e")
    return uri


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_a_new_study_opens_in_mlflows_model_training_view(store):
    assert client(store).get_experiment_by_name("e").tags[KIND_TAG] == TRAINING


def test_a_study_made_before_opens_in_the_training_view_once_its_store_is_initialised_again(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "other")  # builds the store
    # a study experiment of this format made before the view tag existed
    MlflowClient(tracking_uri=uri).create_experiment("old", tags={tracking.TAG_FORMAT: str(tracking.FORMAT)})
    tracking.init_store(uri, "old")
    assert client(uri).get_experiment_by_name("old").tags[KIND_TAG] == TRAINING


def test_numeric_settings_sort_as_numbers_and_kinds_tell_cells_from_baselines(store):
    for bs in (16, 128, 32):
        params = {"batch_size": str(bs), "temperature": "0.1", "seed": "0", "loss": "infonce", "eval.knn_k": "[20]"}
        tracking.open_cell_run(store, "e", {"id": f"d/infonce/bs{bs}-t0.1-s0", "hash": f"h{bs}"}, params=params)
    tracking.open_cell_run(store, "e", {"id": "baselines/d/raw_pixels", "hash": "hb"}, kind="baseline")
    c = client(store)
    eid = c.get_experiment_by_name("e").experiment_id
    by_text = c.search_runs([eid], "tags.`smallbatch.kind` = 'cell'", order_by=["params.batch_size ASC"])
    assert [r.data.params["batch_size"] for r in by_text] == ["128", "16", "32"]  # why params alone do not do
    runs = c.search_runs([eid], "tags.`smallbatch.kind` = 'cell'", order_by=["metrics.`setting/batch_size` ASC"])
    assert [r.data.metrics["setting/batch_size"] for r in runs] == [16.0, 32.0, 128.0]
    assert runs[0].data.metrics["setting/temperature"] == 0.1 and runs[0].data.metrics["setting/seed"] == 0.0
    baselines = c.search_runs([eid], "tags.`smallbatch.kind` = 'baseline'")
    assert [r.data.tags["smallbatch.cell_id"] for r in baselines] == ["baselines/d/raw_pixels"]
