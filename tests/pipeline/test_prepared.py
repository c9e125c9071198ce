"""The evaluation a cell's pretraining process runs ahead (``pretrain --evaluate-ahead``)
and the evaluate step's adoption of it (smallbatch.pipeline.prepared): the same files and MLflow
metrics as a separate evaluation, adopted only for the same checkpoint, cell and store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_reliability import EXPERIMENT, SMALLBATCH, _store, digits_cell

from smallbatch import tracking
from smallbatch.pipeline import jobs as steps
from smallbatch.pipeline import prepared

TIMINGS = ("knn/seconds", "linear/seconds", "knn/cpu_s", "linear/cpu_s")


def evaluate_cli(cell: dict, out: Path, uri: str, *extra: str) -> subprocess.CompletedProcess:
    """`smallbatch evaluate` as the workflow's evaluate rule calls it."""
    return subprocess.run(
        [
            str(SMALLBATCH),
            "evaluate",
            "--cell-json",
            json.dumps(cell),
            "--checkpoint",
            str(out / "checkpoint.pt"),
            "--out-dir",
            str(out),
            "--tracking-uri",
            uri,
            "--experiment",
            EXPERIMENT,
            "--threads",
            "1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def untimed(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in TIMINGS}


@pytest.fixture(scope="module")
def ahead(tmp_path_factory, cache):
    """One cell pretrained with --evaluate-ahead into a fresh store."""
    root = tmp_path_factory.mktemp("ahead")
    cell, out, uri = digits_cell(epochs=1), root / "cell", _store(root / "mlflow.db")
    res = steps.run_pretrain(
        cell, out, tracking_uri=uri, experiment=EXPERIMENT, cache=cache, progress=False, evaluate_ahead=True
    )
    assert res["evaluated_ahead"] is True
    return cell, out, uri


def test_the_evaluation_ahead_equals_a_separate_evaluation_and_is_logged_once(ahead, cache, tmp_path):
    cell, out, uri = ahead
    files = prepared.eval_dir(out)
    assert sorted(p.name for p in files.iterdir()) == ["knn.json", "linear.json", prepared.STAMP]
    separate = steps.run_evaluate(
        cell, out / "checkpoint.pt", tmp_path, tracking_uri=uri, experiment=EXPERIMENT, cache=cache
    )
    for kind in prepared.PROBES:  # the same numbers (only the probes' timings differ)
        assert untimed(files / f"{kind}.json") == untimed(tmp_path / f"{kind}.json")
        assert separate[kind]["status"] == "finished"
    run = tracking.find_cell_run(uri, EXPERIMENT, cell)
    assert run.tags()[tracking.TAG_STATUS] == "finished"  # the pretraining process finished the run
    for key in ("knn/top1", "linear/top1"):  # and the separate evaluation logged nothing twice
        assert len(run.client.get_metric_history(run.run_id, key)) == 1, key


def test_the_evaluate_step_adopts_the_files_without_torch(ahead):
    cell, out, uri = ahead
    res = evaluate_cli(cell, out, uri, "--data-cache", "/nonexistent.pt")  # a full evaluation would need it
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["adopted"] == str(prepared.eval_dir(out))
    for kind in prepared.PROBES:
        assert (out / f"{kind}.json").read_bytes() == (prepared.eval_dir(out) / f"{kind}.json").read_bytes()
        assert summary[kind] == json.loads((out / f"{kind}.json").read_text())
    # the fast path imports neither torch nor mlflow
    code = (
        "import sys; from smallbatch.pipeline import cli; sys.argv = ['smallbatch'] + sys.argv[1:]; rc = cli.main();"
        "assert 'torch' not in sys.modules and 'mlflow' not in sys.modules, 'imported'; sys.exit(rc)"
    )
    args = [
        "evaluate",
        "--cell-json",
        json.dumps(cell),
        "--checkpoint",
        str(out / "checkpoint.pt"),
        "--out-dir",
        str(out),
        "--tracking-uri",
        uri,
        "--experiment",
        EXPERIMENT,
    ]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("change", ["checkpoint", "cell", "store", "stamp"])
def test_the_files_are_not_adopted_for_another_checkpoint_cell_or_store(ahead, cache, tmp_path, change):
    cell, out, uri = ahead
    work = tmp_path / "cell"
    subprocess.run(["cp", "-r", str(out), str(work)], check=True)
    for kind in prepared.PROBES:  # the evaluate step's outputs (an earlier test may have adopted them)
        (work / f"{kind}.json").unlink(missing_ok=True)
    if change == "checkpoint":  # a checkpoint trained again (here: re-saved with one weight changed)
        ck = torch.load(work / "checkpoint.pt", weights_only=False)
        first = next(iter(ck["model"]))
        ck["model"][first] = ck["model"][first] + 1
        torch.save(ck, work / "checkpoint.pt")
    elif change == "cell":  # another evaluation setting of the same cell
        cell = json.loads(json.dumps(cell))
        cell["eval"]["knn_k"] = [5]
    elif change == "store":
        uri = _store(tmp_path / "other.db")
    else:  # no stamp: the evaluation ahead did not finish
        (prepared.eval_dir(work) / prepared.STAMP).unlink()
    fake = {"status": "finished", "cell_id": cell["id"], "knn/top1": -1.0}
    (prepared.eval_dir(work) / "knn.json").write_text(json.dumps(fake))
    res = evaluate_cli(cell, work, uri, "--data-cache", str(cache))
    if change == "cell":  # edited by hand, its hash no longer its settings': refused before anything is read
        assert res.returncode == 2 and "says hash" in res.stderr and not (work / "knn.json").exists()
        return
    if change == "store":  # evaluated afresh, which needs the cell's run in that store
        assert res.returncode == 2 and "not adopted (they were logged to another tracking store" in res.stderr
        assert "no MLflow run for cell" in res.stderr and not (work / "knn.json").exists()
        return
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert "adopted" not in summary and summary["knn"]["knn/top1"] > 0
    if change != "stamp":
        assert "not adopted" in res.stderr
    assert json.loads((work / "knn.json").read_text())["knn/top1"] > 0


def test_a_failed_evaluation_ahead_leaves_the_pretraining_done(tmp_path, cache, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(steps, "run_evaluate", broken)
    cell, out = digits_cell(epochs=0.5), tmp_path / "cell"
    res = steps.run_pretrain(
        cell, out, tracking_uri=None, experiment=EXPERIMENT, cache=cache, progress=False, evaluate_ahead=True
    )
    assert res["status"] == "finished" and res["evaluated_ahead"] is False
    assert (out / "checkpoint.pt").is_file() and not (prepared.eval_dir(out) / prepared.STAMP).exists()
    assert (
        "the evaluation ahead failed (RuntimeError: disk full); the evaluate step will run it"
        in capsys.readouterr().err
    )
