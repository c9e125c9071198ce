"""One report run per experiment, against a real SQLite store: a changed report replaces the
run's artifacts in the same run, the same report leaves it as it is, and the several report
runs a store kept from before are reduced to the newest, their artifacts deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from smallbatch import tracking

EXPERIMENT = "e"


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.init_store(uri, EXPERIMENT)
    tracking.open_cell_run(uri, EXPERIMENT, {"id": "c", "hash": "h"}).set_status("finished")  # a result run
    return uri


def build(folder: Path, files: dict[str, str]) -> list[Path]:
    """A report folder holding ``files`` (relative path -> text)."""
    out = []
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
        out.append(folder / rel)
    return out


def report_runs(uri: str) -> list[dict]:
    reader = tracking.StoreReader(uri)
    exp_id, _ = reader.experiment(EXPERIMENT)
    return [r for r in reader.runs(exp_id) if r["tags"][tracking.TAG_KIND] == tracking.KIND_REPORT]


def test_a_changed_report_replaces_the_artifacts_of_the_one_report_run(store, tmp_path):
    first = build(tmp_path / "r1", {"index.md": "# first", "figures/a.png": "png", "tables/old.csv": "x\n1\n"})
    second = build(tmp_path / "r2", {"index.md": "# second", "tables/b.csv": "y\n2\n"})
    run_id = tracking.log_report_run(store, EXPERIMENT, tmp_path / "r1", first)
    assert tracking.log_report_run(store, EXPERIMENT, tmp_path / "r2", second) == run_id
    runs = report_runs(store)
    assert [r["run_id"] for r in runs] == [run_id] and runs[0]["status"] == "finished"
    reader = tracking.StoreReader(store)
    assert reader.artifacts(run_id) == ["index.md", "tables/b.csv"]  # nothing left of the first build
    assert reader.download_artifact(run_id, "index.md", tmp_path / "dl").read_text() == "# second"
    assert len(tracking.StoreReader(store).runs(reader.experiment(EXPERIMENT)[0])) == 2  # the result run stays


def test_the_same_report_again_leaves_its_run_as_it_is(store, tmp_path):
    files = build(tmp_path / "r", {"index.md": "# same"})
    run_id = tracking.log_report_run(store, EXPERIMENT, tmp_path / "r", files)
    ended = tracking.StoreReader(store)._client.get_run(run_id).info.end_time
    assert tracking.log_report_run(store, EXPERIMENT, tmp_path / "r", files) == run_id
    assert tracking.StoreReader(store)._client.get_run(run_id).info.end_time == ended


def test_report_runs_kept_from_before_are_reduced_to_one(store, tmp_path):
    olds = []
    for i in range(2):  # what earlier versions left: one run per distinct report
        run = tracking.open_cell_run(store, EXPERIMENT, {"id": "report", "hash": f"old{i}"}, kind="report")
        run.log_artifact(build(tmp_path / f"o{i}", {"index.md": f"# old {i}"})[0])
        run.set_status("finished")
        olds.append(run.run_id)
    files = build(tmp_path / "r", {"index.md": "# new"})
    run_id = tracking.log_report_run(store, EXPERIMENT, tmp_path / "r", files)
    assert [r["run_id"] for r in report_runs(store)] == [run_id] and run_id in olds
    gone = next(i for i in olds if i != run_id)
    assert not list(tracking.artifacts_root(store).glob(f"*/{gone}/artifacts/*"))  # its artifacts deleted
