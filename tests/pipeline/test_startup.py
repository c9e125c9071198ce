"""A job imports what it needs and nothing more (each job is a process of its own).

A training or evaluation job needs torch and, to log, MLflow; it needs neither the compiler
stack (``torch._dynamo``, which torch's optimisers import on first use only to mark their
methods as not compiled: 2-3 s of a job's start-up), nor the report's plotting stack, nor
pandas (which MLflow itself imports, so it is checked where the job logs to no store).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from smallbatch.study.cells import make_cell
from smallbatch.study.config import load_config

NOT_NEEDED = ("torch._dynamo", "sklearn", "matplotlib", "seaborn", "pandas")
RUN_AND_LIST = (
    "import json, sys; from smallbatch.pipeline.cli import main; rc = main(sys.argv[2:]); "
    "print(json.dumps([rc, sorted(m for m in json.loads(sys.argv[1]) if m in sys.modules)]))"
)


def job(args: list[str], watch: tuple[str, ...]) -> list[str]:
    """The modules of ``watch`` a ``smallbatch`` job imported (it must succeed)."""
    res = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST, json.dumps(watch), *args], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rc, imported = json.loads(res.stdout.strip().splitlines()[-1])
    assert rc == 0, res.stderr[-3000:]
    return imported


@pytest.fixture(scope="module")
def cell_file(tmp_path_factory):
    cfg = load_config(None, {"datasets": {"digits": {}}, "train": {"epochs": 1, "width": 4, "log_every": 5}})
    cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=64, temperature=0.5, seed=0)
    path = tmp_path_factory.mktemp("cell") / "cell.json"
    path.write_text(json.dumps(cell))
    return path


@pytest.mark.slow  # several of the package's processes (pyproject: markers)
@pytest.mark.parametrize("store", ["none", "sqlite"])
def test_a_training_and_an_evaluation_job_import_no_compiler_and_no_report_stack(tmp_path, cache, cell_file, store):
    uri = "none" if store == "none" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    watch = NOT_NEEDED if store == "none" else tuple(m for m in NOT_NEEDED if m != "pandas")  # MLflow's own
    common = ["--cell", str(cell_file), "--data-cache", str(cache), "--tracking-uri", uri, "--experiment", "e"]
    assert job(["pretrain", *common, "--out", str(tmp_path), "--no-progress"], watch) == []
    ckpt = str(tmp_path / "checkpoint.pt")
    assert job(["evaluate", *common, "--checkpoint", ckpt, "--out-dir", str(tmp_path / "eval")], watch) == []


def test_eager_optimisers_call_torchs_methods_and_give_the_compiler_its_marks_back():
    """eager_optimizers() gives each of torch's dynamo-disabled Optimizer methods itself as its
    cached "disabled" version (no import of the compiler on the first call); eager_optimizers(False)
    takes it back, so a compile sees torch's own marks."""
    import torch

    from smallbatch.training.optim import _DYNAMO_WRAPPED, eager_optimizers

    methods = [getattr(torch.optim.Optimizer, n).__wrapped__ for n in _DYNAMO_WRAPPED]
    try:
        eager_optimizers()
        assert all(getattr(m, "__dynamo_disable", None) is m for m in methods)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        opt.zero_grad()
        assert opt.state_dict()["param_groups"][0]["lr"] == 0.1
    finally:
        eager_optimizers(False)
    assert all(getattr(m, "__dynamo_disable", None) is not m for m in methods)


@pytest.mark.slow  # the workflow, planned (pyproject: markers)
def test_snakemake_plans_a_cpu_study_without_importing_torch(tmp_path, monkeypatch):
    """Snakemake imports the package to plan a study (workflow/rules/common.smk), at every start
    and in every job's own Snakemake process on a cluster: planning a CPU study needs no torch
    (2-3 s of each start), only the launch command (smallbatch.training.launch)."""
    from test_workflow import snakemake

    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # Python lists every module it imports on stderr
    proc = snakemake("-n", results=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert "smallbatch.training.launch" in imported and "smallbatch.pipeline.plan" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
