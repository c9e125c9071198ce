"""Many jobs logging to one MLflow tracking server over HTTP.

A real ``mlflow server`` (SQLite backend, artifact root, 127.0.0.1, a free port)
is started for the session; the smoke study runs on local cores (``--cores 2``)
with ``tracking_uri: http://127.0.0.1:PORT``; ``smallbatch report
--tracking-uri`` rebuilds the tables from the server alone, and they are the
same tables as those of the same study logged to a local SQLite store (CPU
training is deterministic, so the numbers match exactly).  The local-store run
is the SLURM smoke run of test_slurm.py when the local SLURM is available (one
run serves both tests), else the smoke study on local cores.
"""

from __future__ import annotations

import io

import cluster
import pandas as pd
import pytest
from cluster import BIN, SlurmUnavailable, run

EXPERIMENT = "smallbatch-smoke"
REPORT_S = 600  # the report's hang guard; its requests to the server may wait as long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cluster.MlflowServer(tmp_path_factory.mktemp("mlflow_server"), workers=2) as s:
        yield s


def _slurm(tmp_path_factory):
    try:
        return cluster.get_local_slurm(tmp_path_factory.mktemp("slurm_daemons"))
    except SlurmUnavailable:
        return None


@pytest.fixture(scope="module")
def smoke_http(tmp_path_factory, server, request):
    wanted = {"smoke_sqlite", "smoke_slurm"}  # will a selected test need the SLURM smoke run?
    if any(wanted & set(getattr(item, "fixturenames", ())) for item in request.session.items):
        slurm = _slurm(tmp_path_factory)
        if slurm is not None:  # run it meanwhile: both mostly wait (process start-up, SLURM polling)
            cluster.smoke_through_slurm(tmp_path_factory.mktemp("smoke_slurm"), slurm, background=True)
    return cluster.smoke_local(tmp_path_factory.mktemp("smoke_http"), tracking_uri=server.uri, key="smoke_http")


@pytest.fixture(scope="module")
def smoke_sqlite(tmp_path_factory):
    """The same study logged to a local SQLite store (through SLURM when it runs here)."""
    slurm = _slurm(tmp_path_factory)
    if slurm is None:
        return cluster.smoke_local(tmp_path_factory.mktemp("smoke_sqlite"))
    return cluster.smoke_through_slurm(tmp_path_factory.mktemp("smoke_slurm"), slurm)


@pytest.mark.slow  # the server is the slow tests' (starting one costs the fast tier ~15 s of a quiet machine)
def test_server_listens_on_loopback_only(server):
    import subprocess

    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, timeout=cluster.HANG_S
    )
    if out.returncode != 0:
        pytest.skip("no `ss` to list listening sockets")
    addrs = {line.split()[3].rsplit(":", 1)[0] for line in out.stdout.splitlines() if line.strip()}
    assert addrs == {"127.0.0.1"}, addrs


@pytest.mark.slow
def test_smoke_study_logs_every_cell_to_the_server(smoke_http, server):
    r = smoke_http
    print(
        f"\nsmoke study on 2 local cores, logging over HTTP: {r['wall_s']:.0f} s wall"
        + (" (the SLURM smoke run shared the machine)" if "smoke_slurm" in cluster._BACKGROUND else "")
    )
    assert r["rc"] == 0, r["output"][-4000:]
    results = r["results"]
    assert (results / "report" / "index.md").is_file()
    assert not (results / "mlflow.db").exists(), "a local SQLite store was written instead of the server"
    from smallbatch.study.cells import baseline_cells, expand_cells
    from smallbatch.study.config import load_config
    from smallbatch.tracking import TAG_CELL, TAG_KIND, TAG_STATUS

    cfg = load_config(r["config"])
    cells, bases = expand_cells(cfg), baseline_cells(cfg)
    runs = [
        run_
        for run_ in cluster.mlflow_runs(server.uri, EXPERIMENT)
        if run_.data.tags.get(TAG_KIND) in ("cell", "baseline")
    ]
    by_cell = {}
    for run_ in runs:
        by_cell.setdefault(run_.data.tags[TAG_CELL], []).append(run_)
    assert sorted(by_cell) == sorted([*cells, *bases]), "one run per cell and baseline"
    assert all(len(v) == 1 for v in by_cell.values()), {k: len(v) for k, v in by_cell.items() if len(v) > 1}
    for cid, (run_,) in by_cell.items():
        assert run_.data.tags[TAG_STATUS] == "finished", cid
        assert "knn/top1" in run_.data.metrics and "linear/top1" in run_.data.metrics, cid
        if run_.data.tags[TAG_KIND] == "cell":
            assert "train/final_loss" in run_.data.metrics, cid
    # and they came over HTTP: the server's own access log has the REST calls
    log = (server.root / "server.log").read_text()
    assert "/api/2.0/mlflow/runs/log-batch" in log and "/api/2.0/mlflow/runs/create" in log


def _table(text: str) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(text))


@pytest.mark.slow
def test_report_from_the_server_equals_the_report_from_a_local_store(smoke_http, smoke_sqlite, server, tmp_path):
    assert smoke_http["rc"] == 0 and smoke_sqlite["rc"] == 0
    out = tmp_path / "report_http"
    res = run(
        [
            str(BIN / "smallbatch"),
            "report",
            "--tracking-uri",
            server.uri,
            "--experiment",
            EXPERIMENT,
            "--out",
            str(out),
        ],
        env=cluster.env_with_venv(server.client_env(REPORT_S)),
        timeout=REPORT_S,
        check=True,
    )
    assert (out / "index.md").is_file(), res.stdout[-2000:]
    http = cluster.report_tables(out)
    local = cluster.report_tables(smoke_sqlite["results"] / "report")
    assert http and sorted(http) == sorted(local)
    differ = {}
    timing = ("wall_s", "cpu_s", "wall_h", "cpu_h")  # the cost tables: two runs' own clocks, not the store's
    for name in http:
        a, b = _table(http[name]), _table(local[name])
        a, b = (t.drop(columns=[c for c in t.columns if str(c).endswith(timing)]) for t in (a, b))
        try:
            pd.testing.assert_frame_equal(a, b, check_exact=True)
        except AssertionError as exc:
            differ[name] = str(exc).splitlines()[:6]
    assert not differ, f"tables differ between the server's and the local store's report: {differ}"
    # the report the workflow itself built (from the server) is the same too
    assert cluster.report_tables(smoke_http["results"] / "report") == http
