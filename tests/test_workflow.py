"""End to end: the smoke study through Snakemake with --cores 2, then the report.

Checks that the outputs hold real numbers, that MLflow has exactly one run per cell,
that a rerun does nothing, that deleting one cell's output reruns that cell only, that
changing one loss's config reruns exactly its cells, that a bad config stops before
any job with a message naming the key, that `snakemake --lint` is clean, that a dry run
prints one short command per job, that a moved study folder plans no job, and that
`snakemake --report` holds the study's figures and tables with their captions.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import cluster
import pandas as pd
import pytest
import torch
from cluster import job_resources

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "workflow" / "configs" / "smoke.yaml"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


def snakemake(
    *args: str,
    results: Path | str,
    timeout: int = 600,
    configfile: Path | tuple[Path, ...] = SMOKE,
    extra_config: tuple[str, ...] = (),
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """Snakemake on the repository's Snakefile, run in ``cwd`` (its working directory, where
    it keeps its metadata in .snakemake/), with results_dir ``results``."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--configfile",
        *map(str, configfile if isinstance(configfile, tuple) else (configfile,)),
        "--workflow-profile",
        str(ROOT / "workflow/profiles/default"),
        "--config",
        f"results_dir={results}",
        *extra_config,
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def planned_jobs(proc: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from the table `snakemake -n` prints."""
    counts: dict[str, int] = {}
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def planned_cells(proc: subprocess.CompletedProcess, rule: str) -> list[str]:
    """The `cell` wildcard of every job of ``rule`` in `snakemake -n`'s job list."""
    cells, current = [], None
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        m = re.match(r"^\s*(?:local)?rule (\w+):", line)
        if m:
            current = m.group(1)
        m = re.match(r"^\s*wildcards: (.*)$", line)
        if m and current == rule:
            cells += [w.split("=", 1)[1] for w in m.group(1).split(", ") if w.startswith("cell=")]
    return cells


#: what the smoke study printed (the console `make study` shows: --logger smallbatch)
CONSOLE: dict[str, str] = {}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The smoke study on 2 local cores with the console `make study` shows (--logger smallbatch):
    the session's one run of it (tests/test_mlflow_server.py compares the report a server gives
    with its report).  The tests here only read it (dry runs and reports elsewhere; a file one of
    them deletes is put back)."""
    r = cluster.smoke_local(tmp_path_factory.mktemp("smoke_local"))
    assert r["rc"] == 0, r["output"][-6000:]
    CONSOLE["text"] = r["output"]
    return r["results"]


def test_the_console_prints_one_line_per_cell_with_an_eta_and_the_full_log_stays_in_its_file(study):
    """Snakemake's rule blocks go to its log file only; the console has one line per finished cell (the
    smoke study's 4 grid cells and 2 baselines), each with its time, and an ETA until the last."""
    text = CONSOLE["text"]
    cells = re.findall(
        r"^\[\s*(\d+)/(\d+)\] (\S+)  (\d+ s|\d+ min \d\d s)  \(elapsed [^,]+, (ETA [^)]+|all done)\)$", text, re.M
    )
    assert len(cells) == 6 == len({c[2] for c in cells}), text[-3000:]
    assert [int(c[0]) for c in cells] == list(range(1, 7)) and {c[1] for c in cells} == {"6"}
    assert {c[2] for c in cells} >= {"digits/infonce/bs16-t0.5-s0", "digits/flatnce/bs64-t0.5-s0"}
    assert all(c[4].startswith("ETA ") for c in cells[:-1]) and cells[-1][4] == "all done"
    for block in ("rule pretrain:", "localrule", "wildcards:", "Shell command:", "steps (", "Job stats"):
        assert block not in text, f"the console shows Snakemake's {block!r}"
    log = re.search(r"^Complete log\(s\): (\S+)$", text, re.M)
    assert log, text[-2000:]
    full = Path(log.group(1)).read_text()
    assert "rule pretrain:" in full and "wildcards: cell=digits/infonce/bs16-t0.5-s0" in full


def _runs(results: Path) -> pd.DataFrame:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["smallbatch-smoke"])


def test_every_cell_has_real_numbers_in_mlflow_and_files(study):
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    cfg = load_config(SMOKE)
    cells = expand_cells(cfg)
    assert len(cells) == 4
    runs = _runs(study)
    cell_runs = runs[runs["tags.smallbatch.kind"] == "cell"]
    # exactly one MLflow run per cell, finished, with probe metrics in percent
    assert sorted(cell_runs["tags.smallbatch.cell_id"]) == sorted(cells)
    assert (cell_runs["tags.smallbatch.status"] == "finished").all()
    for col in ("metrics.knn/top1", "metrics.linear/top1", "metrics.train/final_loss"):
        vals = cell_runs[col].astype(float)
        assert vals.notna().all() and vals.map(math.isfinite).all(), col
    assert cell_runs["metrics.linear/top1"].between(50, 100).all()  # digits: far above chance (10 %)
    assert cell_runs["metrics.knn/top1"].between(50, 100).all()
    assert (cell_runs["params.batch_size"].astype(int).isin([16, 64])).all()
    base = runs[runs["tags.smallbatch.kind"] == "baseline"]
    assert sorted(base["tags.smallbatch.baseline"]) == ["random_init", "raw_pixels"]
    assert base["metrics.linear/top1"].between(80, 100).all()
    raw, rnd = (base[base["tags.smallbatch.baseline"] == b].iloc[0] for b in ("raw_pixels", "random_init"))
    assert pd.isna(raw["params.seed"]) and pd.isna(raw["params.train.backbone"])  # no network, nothing random
    assert rnd["params.seed"] == "0" and rnd["params.train.backbone"] == "small_cnn"
    # accuracies are counts over 360 test images in percent, rounded to 4 decimals: no float32 digits
    for col in ("metrics.knn/top1", "metrics.linear/top1"):
        for v in pd.concat([cell_runs[col], base[col]]).astype(float):
            assert v == round(v, 4) and abs(v * 3.6 - round(v * 3.6)) < 1e-3, (col, v)
    cost = pd.read_csv(study / "report" / "tables" / "cost_study.csv").set_index("section")
    assert cost.loc["baseline", ["wall_s", "cpu_s"]].notna().all()  # the baselines' jobs are timed too
    for cid in cells:
        knn = json.loads((study / "runs" / cid / "knn.json").read_text())
        row = cell_runs[cell_runs["tags.smallbatch.cell_id"] == cid].iloc[0]
        assert knn["knn/top1"] == pytest.approx(row["metrics.knn/top1"])


def test_jobs_ran_in_the_warm_server_which_stopped_with_the_run(study):
    """A local run hands its jobs to the warm-start server (smallbatch.local.warm) once it has
    imported what they need (the first jobs may run by themselves before), one child per job,
    each exiting 0; Snakemake's onsuccess stops it and its socket is gone."""
    log = (study / "logs" / "warm_server.log").read_text().splitlines()
    socket_path = next(line.split(" ready on ")[1] for line in log if " ready on " in line)
    started = [line.split("started: ")[1] for line in log if " started: " in line]
    exited = [line.split(" s: ")[1] for line in log if " exited 0 after " in line]
    assert sorted(started) == sorted(exited) and any(w.startswith("smallbatch report") for w in started)
    assert not os.path.exists(socket_path)


def test_step_metrics_and_diagnostics_are_logged(study):
    from mlflow.tracking import MlflowClient

    runs = _runs(study)
    run_id = runs[runs["tags.smallbatch.cell_id"] == "digits/infonce/bs16-t0.5-s0"]["run_id"].iloc[0]
    client = MlflowClient(tracking_uri=f"sqlite:///{study / 'mlflow.db'}")
    hist = client.get_metric_history(run_id, "train/loss")
    steps = [m.step for m in hist]
    assert len(steps) > 5 and len(steps) == len(set(steps))
    for key in ("diag/mi_fraction", "diag/ess", "diag/qb_mean", "diag/alignment", "diag/uniformity"):
        vals = [m.value for m in client.get_metric_history(run_id, key)]
        assert vals and all(math.isfinite(v) for v in vals), key
    mi = [m.value for m in client.get_metric_history(run_id, "diag/mi_fraction")]
    assert all(-1.0 <= v <= 1.0 for v in mi)


def test_report_has_tables_and_figures_from_the_store(study):
    rep = study / "report"
    index = (rep / "index.md").read_text()
    for link in re.findall(r"\]\(([^)]+)\)", index):
        assert (rep / link).is_file(), link
    table = pd.read_csv(rep / "tables" / "grid_top1_digits_linear.csv")
    assert set(table["loss"].str.lower()) >= {"infonce", "flatnce"}
    assert table["mean"].between(50, 100).all()
    pngs = list((rep / "figures").glob("*.png"))
    assert len(pngs) >= 4 and all(p.stat().st_size > 5000 for p in pngs)
    assert (rep / "tables" / "papers_reported.csv").is_file()


def test_rerun_does_nothing(study):
    proc = snakemake("-n", results=study)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_deleting_one_cells_output_reruns_that_cell_only(study):
    target = study / "runs" / "digits" / "flatnce" / "bs64-t0.5-s0" / "knn.json"
    saved = target.read_text()
    target.unlink()
    try:
        proc = snakemake("-n", results=study)
        assert proc.returncode == 0, proc.stderr[-2000:]
        jobs = planned_jobs(proc)
        assert jobs.get("evaluate") == 1 and "pretrain" not in jobs, jobs
        assert jobs.get("report") == 1
    finally:
        target.write_text(saved)


def test_changing_one_loss_config_reruns_exactly_its_cells(study, tmp_path):
    import yaml

    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["loss_params"] = {"flatnce": {"gamma": 2.0}}
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    proc = snakemake("-n", results=study, configfile=changed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = planned_jobs(proc)
    # flatnce's two cells get new ids (flatnce-gamma2): two new pretrainings, infonce untouched
    assert jobs.get("pretrain") == 2, jobs
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    flatnce = sorted(c for c in expand_cells(load_config(changed)) if "/flatnce" in c)
    assert len(flatnce) == 2 and all("/flatnce-gamma2/" in c for c in flatnce), flatnce
    assert sorted(planned_cells(proc, "pretrain")) == flatnce


def test_default_config_lists_every_cell(tmp_path):
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    n = len(expand_cells(load_config(ROOT / "config.yaml")))
    proc = snakemake("-n", results=tmp_path / "results", configfile=ROOT / "config.yaml", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = planned_jobs(proc)
    assert jobs["pretrain"] == n and jobs["evaluate"] == n


def test_snakemake_plans_the_cells_smallbatch_cells_lists_from_the_same_overlays(tmp_path):
    """`--configfile A B C` and `smallbatch cells --config A --config B --config C` read one
    config (smallbatch.study.config.load_config): B adds Fashion-MNIST and seeds, C replaces
    the data sets (digits alone again) and the loss; Snakemake's own key-by-key merge would keep
    Fashion-MNIST."""
    add = tmp_path / "add.yaml"
    add.write_text("datasets: {fashion_mnist: {image_size: 8, train_subset: 500}}\ngrid: {seeds: [0, 1]}\n")
    only = tmp_path / "only.yaml"
    only.write_text("replace: [datasets]\ndatasets: {digits: {}}\ngrid: {losses: [dcl]}\n")
    configs = (SMOKE, add, only)
    proc = snakemake("-n", results=tmp_path / "results", configfile=configs, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = subprocess.run(
        [str(BIN / "smallbatch"), "cells", *[a for c in configs for a in ("--config", str(c))]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr
    cells = [line.split("\t")[0] for line in listed.stdout.splitlines()]
    assert sorted(set(planned_cells(proc, "pretrain"))) == sorted(cells)
    assert sorted(cells) == [f"digits/dcl/bs{n}-t0.5-s{s}" for n in (16, 64) for s in (0, 1)]
    assert "note:" not in proc.stderr, proc.stderr[-2000:]
    alone = snakemake("-n", results=tmp_path / "results", configfile=only, timeout=300)  # an overlay alone: said
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert f"smallbatch: note: {only} names no study" in alone.stderr, alone.stderr[-2000:]


def test_snakemake_config_set_overrides_dotted_keys_and_the_plan_prints_them(tmp_path):
    """`--config set='KEY=VALUE ...'` is the CLI's `--set KEY=VALUE ...` (Snakemake's --config
    takes no dotted key): laid over the config files, its values read as YAML 1.2 (a flow
    mapping's ': ' included), printed before the plan."""
    words = "grid.seeds=[1, 2] grid.losses=[dcl] datasets.digits={image_size: 8}"
    proc = snakemake("-n", results=tmp_path / "results", extra_config=(f"set={words}",), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "smallbatch: overrides: grid.seeds = [1, 2], grid.losses = [dcl], datasets.digits = {image_size: 8}"
    assert said in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert sorted(set(planned_cells(proc, "pretrain"))) == [
        f"digits/dcl/bs{n}-t0.5-s{s}" for n in (16, 64) for s in (1, 2)
    ]


def test_snakemake_config_nested_values_are_read_as_yaml_1_2(tmp_path):
    """Snakemake reads `--config grid={seeds: [3]}` with YAML's base loader (the text '3'); the
    study reads such values as YAML 1.2 does, as a file's."""
    proc = snakemake("-n", results=tmp_path / "results", extra_config=("grid={seeds: [3], batch_sizes: [16]}",))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(set(planned_cells(proc, "pretrain"))) == [
        "digits/flatnce/bs16-t0.5-s3",
        "digits/infonce/bs16-t0.5-s3",
    ]


def test_a_dry_run_writes_nothing(tmp_path):
    """The cells' settings travel as job parameters, so planning (`snakemake -n`) leaves
    the results folder as it was."""
    results = tmp_path / "results"
    proc = snakemake("-n", results=results, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = [p for p in results.rglob("*") if p.is_file()] if results.exists() else []
    assert written == []


def test_gpu_cells_ask_for_gpus_and_share_them(tmp_path):
    """device: cuda (planned on this CPU machine): pretraining and evaluation ask for a GPU
    (a GRES string for SLURM, a permille share for local runs); with cells_per_gpu 4 a cell
    takes a quarter of a GPU; a 2-device cell asks for 2 GPUs, 2 tasks and srun/torchrun."""
    proc = snakemake("-n", results=tmp_path, extra_config=("device=cuda", "cells_per_gpu=4"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = job_resources(proc.stdout)
    assert all("gres=gpu:1" in r and "gpu_permille=250" in r for r in res["pretrain"]), res["pretrain"]
    assert all("gres=gpu:1" in r for r in res["evaluate"])
    assert all(
        "gres" not in r and "gpu" not in r for rule in ("report", "baseline", "mi_bench") for r in res.get(rule, [])
    )
    import yaml

    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["train"]["devices"] = 2
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(cfg))
    proc = snakemake("-n", results=tmp_path / "two", configfile=two, extra_config=("device=cuda",), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = job_resources(proc.stdout)
    assert all(
        "gres=gpu:2" in r and "gpu_permille=2000" in r and "tasks=2" in r and "mpi=srun" in r for r in res["pretrain"]
    ), res["pretrain"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans on a machine without a GPU")
def test_device_auto_on_a_machine_without_a_gpu_plans_no_gpu_locally(tmp_path):
    """device: auto, planned here (no GPU) with the local profile, which runs the run: jobs in
    threads as a cluster executor does: no job asks for a GPU (on a cluster it would:
    tests/test_slurm.py)."""
    proc = snakemake("-n", results=tmp_path, extra_config=("device=auto",), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = job_resources(proc.stdout)
    assert res["pretrain"] and res["evaluate"]
    assert not [r for rule in res for r in res[rule] if "gres" in r or "gpu_permille" in r], res


@pytest.mark.parametrize(
    "override, key",
    [  # a bad value and an unknown key given with --config; each value's own check is in-process
        ("grid={losses: [infonce, flatnc]}", "grid.losses[1]"),  # (tests/study/test_config.py)
        ("grid={batchsizes: [16]}", "grid.batchsizes"),
        ("set=grid.sedes=[0]", "unknown config key 'grid.sedes' (did you mean 'seeds'?)"),
    ],
)
def test_bad_config_stops_before_any_job(tmp_path, override, key):
    proc = snakemake("-n", results=tmp_path, extra_config=(override,), timeout=300)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "config error" in err and key in err, err[-2000:]
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def methods_study(tmp_path_factory) -> Path:
    """SimSiam and VICReg, a digits cell each (B = 16), with ``keep_features: true``: one study
    through the workflow's rules, read by the two tests below."""
    import yaml

    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["grid"].update(losses=["simsiam", "vicreg"], batch_sizes=[16])
    cfg.update(study="smallbatch-methods", baselines=False, keep_features=True)
    cfg.setdefault("experiments", {})["mi"] = {"enabled": False}
    folder = tmp_path_factory.mktemp("methods")
    config = folder / "methods.yaml"
    config.write_text(yaml.safe_dump(cfg))
    results = folder / "results"
    proc = snakemake("--cores", "2", "--quiet", results=results, configfile=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return config


def test_keep_features_writes_the_features_file(methods_study):
    """``keep_features: true``: each cell's evaluation leaves its features file, stamped with
    its cell, beside its probes' results, and a dry run after the study plans nothing."""
    from smallbatch.evaluation.embed import load_features

    results = methods_study.parent / "results"
    for cid in ("digits/simsiam/bs16-t0.5-s0", "digits/vicreg/bs16-t0.5-s0"):
        cell = results / "runs" / cid
        assert (cell / "knn.json").exists() and (cell / "linear.json").exists() and (cell / "features.npz").exists()
        assert load_features(cell / "features.npz").meta["cell_id"] == cid
    proc = snakemake("-n", results=results, configfile=methods_study)
    assert proc.returncode == 0 and "Nothing to be done" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_methods_without_negatives_run_through_the_workflow(methods_study):
    """SimSiam and VICReg: a digits cell each, pretrained and evaluated by the workflow's rules,
    one finished MLflow run per cell with its probes and its representation logged, and the
    report's representation section built from the store."""
    import mlflow

    results = methods_study.parent / "results"
    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["smallbatch-methods"])
    cells = runs[runs["tags.smallbatch.kind"] == "cell"].set_index("tags.smallbatch.cell_id")
    assert sorted(cells.index) == ["digits/simsiam/bs16-t0.5-s0", "digits/vicreg/bs16-t0.5-s0"]
    assert (cells["tags.smallbatch.status"] == "finished").all()
    for col in ("metrics.knn/top1", "metrics.linear/top1", "metrics.repr/features_rankme", "metrics.diag/cov_rank"):
        assert cells[col].astype(float).map(math.isfinite).all(), col
    assert (cells["metrics.diag/cov_rank"].astype(float) <= 15).all()  # B = 16 images: rank <= 15
    for cid in cells.index:
        geometry = json.loads((results / "runs" / cid / "representation.json").read_text())
        assert geometry["repr/features_rankme"] == pytest.approx(cells.loc[cid, "metrics.repr/features_rankme"])
    index = (results / "report" / "index.md").read_text()
    assert "## What each representation looks like" in index and "representation_digits_t0.5.png" in index


def test_lint_is_clean():
    """`snakemake --lint` on the default config, from the repository root (as .ci/run runs it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint", "--configfile", "config.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Lints for" not in proc.stdout + proc.stderr


def test_a_dry_run_prints_one_short_line_per_job(tmp_path):
    """Each job's command is one line naming its cell file, not the cell's settings: the job
    reads <cell>/cell.json (written when the run starts), and the cell's hash, a param
    outside the command line, still reruns a changed cell (see the test above)."""
    proc = snakemake("-n", results=tmp_path / "results", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    commands = [
        line for line in out.splitlines() if line.startswith("Shell command: ") and line != "Shell command: None"
    ]
    jobs = planned_jobs(proc)
    assert len(commands) == sum(n for rule, n in jobs.items() if rule not in ("all", "settings")), jobs
    cells = [c for c in commands if " pretrain " in c or " evaluate " in c or " baseline " in c]
    assert cells and all("--cell=" in c and c.split("--cell=")[1].split()[0].endswith("/cell.json") for c in cells)
    assert not any('"augment"' in c or "--cell-json" in c for c in commands)
    # the longest, paths aside: a pretraining's (1,560 characters when it carried the cell's JSON)
    assert max(len(c.replace(str(tmp_path / "results"), "R")) for c in commands) < 450


def _tiny_study(folder: Path) -> Path:
    """A one-cell study (no baselines, no MI) in working directory ``folder``, whose
    results_dir is the relative `results` (the layout of a clone running `make study`)."""
    import yaml

    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["grid"].update(losses=["infonce"], batch_sizes=[16])
    cfg["train"].update(steps=4, log_every=2)
    cfg.update(baselines=False, results_dir="results")
    cfg.setdefault("experiments", {})["mi"] = {"enabled": False}
    folder.mkdir()
    config = folder / "study.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.fixture(scope="module")
def finished_tiny(tmp_path_factory) -> Path:
    """The one-cell study of :func:`_tiny_study`, finished once for the module in a folder of its
    own; a test works on a copy (``copytree`` keeps the files' times, as ``cp -a`` does)."""
    folder = tmp_path_factory.mktemp("tiny") / "study"
    config = _tiny_study(folder)
    proc = snakemake("--cores", "2", "--quiet", results="results", configfile=config, cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


def _two_budget_study(folder: Path, one_job_per_cell: bool) -> Path:
    """A one-cell digits study (one epoch, a snapshot at half of it) in ``folder``."""
    import yaml

    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["grid"].update(losses=["infonce"], batch_sizes=[16])
    cfg["datasets"] = {"digits": {}}
    cfg["train"].update(snapshot_epochs=[0.5], lr_schedule="constant")
    cfg.update(baselines=False, results_dir="results", one_job_per_cell=one_job_per_cell)
    cfg.setdefault("experiments", {})["mi"] = {"enabled": False}
    folder.mkdir()
    config = folder / "study.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _scores(cell_folder: Path) -> dict[str, float]:
    """Every accuracy of every probe file of the cell (final and snapshots), by file and key."""
    files = sorted(cell_folder.glob("*.json")) + sorted(cell_folder.glob("snapshots/*.json"))
    return {
        f"{f.relative_to(cell_folder)}:{k}": v
        for f in files
        if f.name != "cell.json"
        for k, v in json.loads(f.read_text()).items()
        if "top1" in k
    }


def test_one_job_per_cell_computes_what_a_job_per_step_does_and_its_rerun_repeats_the_evaluations(tmp_path):
    """The same one-cell study with a job per step and with one job per cell: one run_cell job and no
    other cell job is planned, every probe of the final checkpoint and of the snapshot scores the
    same, and the store holds both budgets; deleting a result reruns the cell's job, whose
    pretraining resumes from its finished state (no step trained again) and whose scores repeat."""
    cell = Path("results/runs/digits/infonce/bs16-t0.5-s0")
    done = {}
    for per_cell in (False, True):
        folder = tmp_path / ("per_cell" if per_cell else "per_step")
        config = _two_budget_study(folder, per_cell)
        if per_cell:
            plan = planned_jobs(snakemake("-n", results="results", configfile=config, cwd=folder))
            assert plan.get("run_cell") == 1 and not {"pretrain", "evaluate", "evaluate_snapshot"} & set(plan), plan
        proc = snakemake("--cores", "2", "--quiet", results="results", configfile=config, cwd=folder)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        done[per_cell] = _scores(folder / cell)
    assert len(done[True]) >= 4 and any(k.startswith("snapshots/ep0.5.") for k in done[True]), done[True]
    assert done[True] == done[False]
    runs = _runs(tmp_path / "per_cell" / "results")
    runs = runs[runs["tags.smallbatch.kind"] == "cell"]
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED"
    assert runs.iloc[0]["metrics.knn/top1"] == done[True]["knn.json:knn/top1"]
    assert runs.iloc[0]["metrics.snapshot/ep0.5/knn/top1"] == done[True]["snapshots/ep0.5.knn.json:knn/top1"]

    folder = tmp_path / "per_cell"
    (folder / cell / "knn.json").unlink()
    assert (
        planned_jobs(snakemake("-n", results="results", configfile=folder / "study.yaml", cwd=folder)).get("run_cell")
        == 1
    )
    proc = snakemake("--cores", "2", "--quiet", results="results", configfile=folder / "study.yaml", cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (folder / "results/logs/run_cell/digits/infonce/bs16-t0.5-s0.log").read_text()
    assert re.search(r"resuming digits/infonce/bs16-t0\.5-s0 from step (\d+)/\1 ", log), log[-2000:]
    assert _scores(folder / cell) == done[True]


def test_raising_the_budget_in_the_config_continues_the_finished_run(tmp_path):
    """The one-cell study of one epoch (a snapshot at half of it), then the same study at two epochs
    with a snapshot at one: the rerun's pretraining continues the finished run from its last step
    (its log says so), the half-epoch snapshot keeps its scores (the same weights, now the longer
    config's), and the store holds the longer budget's run, naming the run it continued."""
    import yaml

    folder = tmp_path / "study"
    config = _two_budget_study(folder, one_job_per_cell=False)
    cell = folder / "results/runs/digits/infonce/bs16-t0.5-s0"
    proc = snakemake("--cores", "2", "--quiet", results="results", configfile=config, cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    short = _scores(cell)
    short_hash = json.loads((cell / "cell.json").read_text())["hash"]
    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(epochs=2, snapshot_epochs=[0.5, 1])
    config.write_text(yaml.safe_dump(cfg))
    proc = snakemake("--cores", "2", "--quiet", results="results", configfile=config, cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (folder / "results/logs/pretrain/digits/infonce/bs16-t0.5-s0.log").read_text()
    found = re.search(r"continuing digits/infonce/bs16-t0\.5-s0 from step (\d+)/(\d+): the run of config (\w+)", log)
    assert found and 2 * int(found[1]) == int(found[2]) and found[3] == short_hash, log[-2000:]
    longer = _scores(cell)
    half = {k: v for k, v in short.items() if k.startswith("snapshots/ep0.5.")}
    assert half and {k: longer[k] for k in half} == half
    assert any(k.startswith("snapshots/ep1.") for k in longer)
    runs = _runs(folder / "results")
    runs = runs[(runs["tags.smallbatch.kind"] == "cell") & (runs["tags.smallbatch.cell_hash"] != short_hash)]
    assert len(runs) == 1 and runs.iloc[0]["tags.smallbatch.extended_from"] == f"{short_hash} at step {found[1]}"


def test_snakemake_report_lists_each_entry_by_its_caption_not_its_path(tmp_path, finished_tiny):
    """Each entry of `snakemake --report` carries labels (its caption's head and its file), which the
    report lists in place of the file's path."""
    html = tmp_path / "report.html"
    proc = snakemake("--report", str(html), results="results", configfile=finished_tiny / "study.yaml",
                     cwd=finished_tiny)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(re.search(r"var results = (\{.*?\});\n", html.read_text(), re.S).group(1))
    by_file = {Path(path).name: entry["labels"] for path, entry in results.items()}
    assert by_file["grid_top1_digits_knn.csv"] == {
        "caption": "Top-1 accuracy per loss and batch size: mean ± sd over seeds",
        "file": "grid_top1_digits_knn.csv",
    }
    assert by_file["index.md"]["caption"].startswith("The findings in plain words")
    assert all(labels["file"] == name and labels["caption"] for name, labels in by_file.items()), by_file


def test_a_moved_study_folder_plans_no_job(tmp_path, finished_tiny):
    """A finished study's folder (its results and Snakemake's metadata in .snakemake/)
    copied elsewhere with its files' times (cp -a, rsync -a, mv) plans nothing there: no
    param holds where the folder lay (the SQLite URI, the cell's folder and file are derived
    from the jobs' files), whether results_dir stays relative or names the new place."""
    import shutil

    first = tmp_path / "first"
    shutil.copytree(finished_tiny, first, symlinks=True)
    config = first / "study.yaml"
    assert (first / ".snakemake" / "metadata").is_dir() and (first / "results" / "report" / "index.md").is_file()
    proc = snakemake("-n", results="results", configfile=config, cwd=first)
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]

    moved = tmp_path / "moved"
    shutil.copytree(first, moved, symlinks=True)  # copy2: the files keep their times
    for results in ("results", moved / "results"):
        proc = snakemake("-n", results=results, configfile=moved / "study.yaml", cwd=moved)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Nothing to be done" in proc.stdout + proc.stderr, (results, planned_jobs(proc), proc.stdout[-3000:])
    shutil.rmtree(first)  # nothing of the moved copy points back at the first folder
    proc = snakemake("-n", results="results", configfile=moved / "study.yaml", cwd=moved)
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_a_results_folder_never_serves_results_of_other_settings(tmp_path, finished_tiny):
    """A finished study, Snakemake's metadata (.snakemake/) deleted, rerun with a setting of
    its cells changed (an overlay ``train: {steps: N+1}``): every cell reruns, and its
    checkpoint, results and MLflow run are those of the new settings -- no old result is
    served.  Run again with the first settings, it reruns them too (the folder now holds the
    second's)."""
    import shutil

    import yaml

    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import deep_merge, load_config, read_config_file
    from smallbatch.training.checkpoint import load_checkpoint

    folder = tmp_path / "study"
    shutil.copytree(finished_tiny, folder, symlinks=True)  # the first settings' finished study
    config = folder / "study.yaml"
    overlay = folder / "overlay.yaml"
    steps = yaml.safe_load(config.read_text())["train"]["steps"]
    overlay.write_text(yaml.safe_dump({"train": {"steps": steps + 1}}))
    for i, configs in enumerate(((config,), (config, overlay), (config,))):
        if i:
            shutil.rmtree(folder / ".snakemake", ignore_errors=True)
            planned = planned_jobs(snakemake("-n", results="results", configfile=configs, cwd=folder))
            assert planned.get("pretrain") == 1 and planned.get("evaluate") == 1, planned
            proc = snakemake("--cores", "2", "--quiet", results="results", configfile=configs, cwd=folder)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        merged = {}
        for c in configs:
            merged = deep_merge(merged, read_config_file(c))
        (cell,) = expand_cells(load_config(None, {**merged, "results_dir": str(folder / "results")})).values()
        run = folder / "results" / "runs" / cell["id"]
        ck = load_checkpoint(run / "checkpoint.pt")
        assert ck["cell_hash"] == cell["hash"] and ck["steps"] == cell["train"]["steps"], (ck["cell_hash"], ck["steps"])
        assert json.loads((run / "cell.json").read_text())["hash"] == cell["hash"]
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{folder / 'results' / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["smallbatch-smoke"])
        runs = runs[runs["tags.smallbatch.kind"] == "cell"]  # (the report is a run of its own)
        newest = runs.sort_values("start_time").iloc[-1]
        assert newest["tags.smallbatch.cell_hash"] == cell["hash"], runs[["tags.smallbatch.cell_hash", "start_time"]]


def test_snakemake_report_shows_the_figures_and_tables_with_captions(study, tmp_path):
    """`snakemake --report report.html` after the study: every figure (PNG) and table (CSV)
    of the report folder is in it, with its caption (workflow/report/*.rst)."""
    html = tmp_path / "report.html"
    proc = snakemake("--report", str(html), results=study, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = html.read_text()
    figures = sorted(p.stem for p in (study / "report" / "figures").glob("*.png"))
    tables = sorted(p.stem for p in (study / "report" / "tables").glob("*.csv"))
    assert len(figures) >= 4 and tables
    for name in figures:
        assert f"{name}.png" in text, name
    for name in tables:
        assert f"{name}.csv" in text, name
    # the captions, rendered: a figure's and a table's own sentence, the study's name
    assert "Top-1 accuracy against batch size" in text and "Top-1 accuracy per loss and batch size" in text
    assert "smallbatch-smoke" in text
