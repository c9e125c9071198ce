"""Two jobs of one study write the same store at once: what one stores between the other's look-up
and its insert does not fail the other (a real SQLite store; the other job's write is placed
inside MLflow's own window, so no timing decides whether the two meet)."""

from __future__ import annotations

from smallbatch import tracking

DIGEST = "d" * 64
PROFILE = {"train": 100, "test": 10}


def _cell(n: int) -> dict:
    return {"id": f"d/infonce/bs{n}-t0.1-s0", "hash": f"h{n}"}


def test_a_data_set_a_parallel_job_stores_first_is_linked_not_refused(tmp_path, monkeypatch):
    import mlflow.store.tracking.sqlalchemy_store as sql
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, "e")
    mine, other = (tracking.open_cell_run(uri, "e", _cell(n)) for n in (16, 64))
    real_uuid4, calls = sql.uuid.uuid4, []

    class Uuid:  # MLflow draws the new data set's id after its look-up found none, before its insert
        @staticmethod
        def uuid4():
            if not calls:
                calls.append(1)
                other.log_dataset("digits", DIGEST, "/data", PROFILE, context="training")
            return real_uuid4()

    monkeypatch.setattr(sql, "uuid", Uuid)
    mine.log_dataset("digits", DIGEST, "/data", PROFILE, context="training")
    assert calls  # the other job's write did land inside the window
    client = MlflowClient(tracking_uri=uri)
    for run in (mine, other):
        inputs = client.get_run(run.run_id).inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("digits", DIGEST[:36])]
