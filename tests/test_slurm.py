"""The SLURM profile (workflow/profiles/slurm), dry and for real.

Dry: Snakemake accepts the profile with the installed snakemake-executor-plugin-slurm,
GPU steps ask for a GPU and CPU steps for none, partition/account come from the
environment, and grouping turns four jobs per cell into one.

Real: a single-node SLURM (Debian's slurm-wlm + munge, started by this session
on localhost, see tests/cluster.py and .ci/setup-slurm.sh) runs the smoke study:
every job that is not a `localrule` is a SLURM job, pretraining jobs are granted
a GPU, the report is built.  A pretraining job signalled like a preempted or
timed-out SLURM job resumes on Snakemake's retry.

Without root or without the packages, the real tests skip with the reason
(in CI, where the daemons must run, they fail instead).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import cluster
import pytest
import yaml
from cluster import SLURM_PROFILE, SlurmUnavailable, job_resources, res_value, run, snakemake_cmd, write_config


def _smoke_shape(cfg: Path) -> tuple[int, int]:
    """(cells, baselines) of a config, from the package's own expansion."""
    from smallbatch.study.cells import baseline_cells, expand_cells
    from smallbatch.study.config import load_config

    c = load_config(cfg)
    return len(expand_cells(c)), len(baseline_cells(c))


def dry_run(tmp_path: Path, profile: Path, env: dict | None = None, config: Path | None = None) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = config or write_config(tmp_path / "config.yaml", results_dir=str(tmp_path / "results"))
    res = run(
        snakemake_cmd(tmp_path, cfg, profile, "-n"),
        cwd=tmp_path,
        env=cluster.env_with_venv(env),
        timeout=cluster.HANG_S,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    return res.stdout


# --------------------------------------------------------------------------- the profile, dry
@pytest.fixture(scope="module")
def smoke_dry(tmp_path_factory) -> tuple[Path, str]:
    """The smoke study's dry run through the slurm profile without SBATCH_PARTITION/ACCOUNT
    (its config, its output): read by two tests (each dry run costs seconds of start-up)."""
    root = tmp_path_factory.mktemp("smoke_dry")
    cfg = write_config(root / "config.yaml", results_dir=str(root / "results"))
    return cfg, dry_run(
        root / "g", SLURM_PROFILE.parent, env={"SBATCH_PARTITION": "", "SBATCH_ACCOUNT": ""}, config=cfg
    )


def test_profile_has_no_hard_coded_account_or_partition():
    prof = yaml.safe_load(SLURM_PROFILE.read_text())
    assert prof["executor"] == "slurm"
    dr = prof["default-resources"]
    for key, var in (("slurm_partition", "SBATCH_PARTITION"), ("slurm_account", "SBATCH_ACCOUNT")):
        assert f"environ.get('{var}'" in str(dr[key]), f"{key} must come from ${var}, not {dr[key]!r}"
    assert {"runtime", "mem_mb"} <= set(dr)
    assert all("gpu" not in res for res in prof["set-resources"].values())  # the rules ask for GPUs themselves
    assert set(prof["groups"]) == {"pretrain", "evaluate", "evaluate_snapshot", "run_cell"}


def test_dry_run_requests_gpus_only_for_gpu_steps_and_takes_partition_from_env(tmp_path, smoke_dry):
    """device auto on a cluster (its login node may have no GPU): the cells' pretraining
    and evaluation ask for one GPU each, as a GRES string; nothing else asks for one."""
    cfg = write_config(tmp_path / "config.yaml", results_dir=str(tmp_path / "results"), device="auto")
    dry = dry_run(
        tmp_path, SLURM_PROFILE.parent, env={"SBATCH_PARTITION": "gpu-test", "SBATCH_ACCOUNT": "proj-test"}, config=cfg
    )
    res = job_resources(dry)
    want_gres = {"pretrain": "gpu:1", "evaluate": "gpu:1", "report": None, "baseline": None, "prepare_data": None}
    for rule, gres in want_gres.items():
        assert rule in res, f"no {rule} job in the dry run"
        for line in res[rule]:
            assert res_value(line, "gres") == gres and res_value(line, "gpu") in (None, "0"), f"{rule}: {line}"
            assert res_value(line, "slurm_partition") == "gpu-test", line
            assert res_value(line, "slurm_account") == "proj-test", line
    # a time-limit retry asks for more time: runtime scales with the attempt
    assert all(res_value(line, "runtime") == "240" for line in res["pretrain"])
    # without the variables the plugin chooses (empty = the cluster's default partition)
    for line in job_resources(smoke_dry[1])["pretrain"]:
        assert res_value(line, "slurm_partition") == "", line


def test_grouping_submits_one_job_per_cell(tmp_path, smoke_dry):
    """Measured with `snakemake -n`: the profile's groups bundle pretrain, embed,
    kNN and linear of a cell into one SLURM job."""
    cfg, dry = smoke_dry
    n_cells, n_base = _smoke_shape(cfg)
    grouped = cluster.count_submissions(dry)
    prof = yaml.safe_load(SLURM_PROFILE.read_text())
    prof.pop("groups"), prof.pop("group-components")
    (tmp_path / "nogroups").mkdir()
    (tmp_path / "nogroups" / "profile.yaml").write_text(yaml.safe_dump(prof))
    ungrouped = cluster.count_submissions(dry_run(tmp_path / "u", tmp_path / "nogroups", config=cfg))
    print(
        f"\nsmoke study ({n_cells} cells): {ungrouped['total']} SLURM jobs without grouping, "
        f"{grouped['total']} with the profile's groups"
    )
    other = grouped["single_jobs"]  # data preparation, baselines, report, ...: not grouped
    assert other >= 1 + n_base + 1
    assert ungrouped == {"group_jobs": 0, "single_jobs": 2 * n_cells + other, "total": 2 * n_cells + other}
    assert grouped == {"group_jobs": n_cells, "single_jobs": other, "total": n_cells + other}


def test_cells_per_gpu_groups_of_cells_share_one_gpu_and_devices_ask_for_tasks(tmp_path):
    """cells_per_gpu 2 with --group-components cell=2: each SLURM job holds two cells and
    asks for ONE GPU (a GRES string is not summed over the group's cells); a cell on 2
    devices asks for 2 GPUs, 2 tasks (one per GPU) and runs through srun."""
    cfg = write_config(tmp_path / "config.yaml", results_dir=str(tmp_path / "results"), device="auto", cells_per_gpu=2)
    n_cells, _ = _smoke_shape(cfg)
    out = run(
        snakemake_cmd(tmp_path / "k2", cfg, SLURM_PROFILE.parent, "-n", "--group-components", "cell=2"),
        cwd=tmp_path,
        env=cluster.env_with_venv(),
        timeout=cluster.HANG_S,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    groups = re.findall(r"Group job .*?\n(?:.*\n)*?.*?resources: ([^\n]*)", out.stdout)
    assert cluster.count_submissions(out.stdout)["group_jobs"] == n_cells // 2
    assert groups and all(res_value("resources: " + g, "gres") == "gpu:1" for g in groups), groups
    two = write_config(
        tmp_path / "two.yaml", results_dir=str(tmp_path / "results2"), device="auto", train={"devices": 2}
    )
    res = job_resources(dry_run(tmp_path / "t", SLURM_PROFILE.parent, config=two))
    for line in res["pretrain"]:
        assert (res_value(line, "gres"), res_value(line, "tasks"), res_value(line, "mpi")) == ("gpu:2", "2", "srun")
        assert res_value(line, "tasks_per_gpu") == "1", line


# --------------------------------------------------------------------------- a real SLURM
@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    try:
        s = cluster.get_local_slurm(tmp_path_factory.mktemp("slurm_daemons"))
    except SlurmUnavailable as exc:
        cluster.skip_or_fail(f"no local SLURM: {exc}")
    yield s
    cluster.stop_local_slurm()


@pytest.fixture(scope="session")
def smoke_slurm(tmp_path_factory, slurm):
    return cluster.smoke_through_slurm(tmp_path_factory.mktemp("smoke_slurm"), slurm)


@pytest.mark.slow
def test_smoke_study_runs_as_slurm_jobs_and_builds_the_report(smoke_slurm, slurm, tmp_path):
    r = smoke_slurm
    print(
        f"\nsmoke study through the local SLURM: {r['wall_s']:.0f} s wall, {len(r['jobids'])} SLURM jobs"
        + (" (alongside the HTTP smoke run)" if r.get("concurrent") else "")
    )
    assert r["rc"] == 0, r["output"][-4000:]
    results = r["results"]
    assert (results / "report" / "index.md").is_file()
    assert list((results / "report" / "tables").glob("*.csv"))
    # every job that is not a localrule went through sbatch: as many SLURM jobs as the dry run plans
    n_cells, n_base = _smoke_shape(r["config"])
    planned = cluster.count_submissions(r["output"])  # the jobs Snakemake scheduled, grouped
    assert planned["group_jobs"] == n_cells // 2  # two cells per job (--group-components cell=2)
    assert len(r["jobids"]) == planned["total"], r["output"][-3000:]
    local_only = re.findall(r"^localrule (\w+):", r["output"], re.M)
    assert set(local_only) <= cluster.local_rules(), local_only
    # what SLURM says about them (kept MinJobAge = 3600 s after they end: .ci/setup-slurm.sh)
    kinds: dict[str, str] = {}
    for m in re.finditer(r"submitted with SLURM jobid (\d+) \(log: ([^)]+)\)", r["output"]):
        rel = Path(m.group(2)).relative_to(r["root"] / "slurm_logs")
        kinds[m.group(1)] = rel.parts[0]  # group_cell_embed_knn_linear_pretrain | rule_report | ...
    asked_gpu = []
    for jid in r["jobids"]:
        job = slurm.job(jid)
        if not job:
            continue  # aged out of slurmctld (a very slow machine): the Snakemake result above stands
        assert job["JobState"] == "COMPLETED", (jid, job.get("JobState"), kinds.get(jid))
        assert job["NodeList"] == "localhost" and job["Partition"] == "local"
        # what was asked for: --gres=gpu:1 reads TresPerNode=gres:gpu:1 (--gpus=1 would be TresPerJob)
        request = ",".join(filter(None, (job.get("TresPerNode"), job.get("TresPerJob"))))
        if kinds[jid].startswith("group_cell"):  # two cells, cells_per_gpu 2: one GPU for both
            assert request == "gres:gpu:1", (jid, kinds[jid], request)
            asked_gpu.append(jid)
        else:
            assert "gpu" not in request, (jid, kinds[jid], request)
    assert asked_gpu, "no cell job was seen asking for a GPU"
    # every cell's MLflow run (local SQLite store on this shared file system) is finished
    from smallbatch.tracking import TAG_KIND, TAG_STATUS

    runs = [
        run_
        for run_ in cluster.mlflow_runs(f"sqlite:///{results / 'mlflow.db'}", "smallbatch-smoke")
        if run_.data.tags.get(TAG_KIND) in ("cell", "baseline")
    ]
    assert len(runs) == n_cells + n_base
    assert {run_.data.tags[TAG_STATUS] for run_ in runs} == {"finished"}


@pytest.mark.slow
def test_preempted_slurm_job_resumes_on_retry(tmp_path, slurm):
    """SIGTERM to the running job, as SLURM sends at a time limit or preemption:
    the pretraining saves its state and exits 143, the job fails, Snakemake's
    retry submits it again and it resumes from state.pt."""
    cell = "digits/infonce/bs16-t0.5-s0"
    results = tmp_path / "results"
    cfg = write_config(
        tmp_path / "config.yaml",
        results_dir=str(results),
        study="slurm-preempt",
        grid={"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.5], "seeds": [0]},
        train={"epochs": 8, "width": 8, "proj_hidden": 32, "proj_dim": 16, "log_every": 5},
        baselines=False,
    )
    prof = cluster.slurm_test_profile(tmp_path / "profile", logdir=tmp_path / "slurm_logs")
    env = cluster.env_with_venv({"SBATCH_PARTITION": "local"})
    target = str(results / "runs" / cell / "checkpoint.pt")
    log = tmp_path / "snakemake.out"
    # the child writes to its own copy of the descriptor: ours closes once it has started
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            snakemake_cmd(tmp_path, cfg, prof, target),
            cwd=tmp_path,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    state = results / "runs" / cell / "state.pt"
    try:
        cluster.wait_until(lambda: state.exists() or proc.poll() is not None, 600, "the first state.pt", 0.05)
        assert proc.poll() is None, log.read_text()[-3000:]
        jobs = cluster.submitted_slurm_jobs(log.read_text())
        assert jobs, log.read_text()[-3000:]
        jid = jobs[-1]
        # the trainer (the cell lock's holder, on this one-node cluster) stopped: its job cannot
        # end before the preemption signal has reached it, however slow SLURM is to deliver it
        trainer = int((results / "runs" / cell / ".lock").read_text().split()[0])
        os.kill(trainer, signal.SIGSTOP)
        try:
            assert slurm.job(jid).get("JobState") == "RUNNING"
            subprocess.run(["scancel", "--signal=TERM", "--full", jid], check=True, timeout=cluster.HANG_S)
            cluster.wait_until(
                lambda: cluster.signal_pending(trainer, signal.SIGTERM), 120, "SLURM's SIGTERM to reach the trainer"
            )
        finally:
            os.kill(trainer, signal.SIGCONT)
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        cluster.kill_group(proc)
        slurm.cancel(cluster.submitted_slurm_jobs(log.read_text()))
        raise AssertionError(f"snakemake did not finish after the preemption:\n{log.read_text()[-3000:]}") from None
    finally:
        if proc.poll() is None:
            cluster.kill_group(proc)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    jobs = cluster.submitted_slurm_jobs(out)
    assert jid in jobs and len(jobs) >= 3, jobs  # prepare_data, the signalled group job, its retry
    assert slurm.job(jid).get("JobState") in ("FAILED", "CANCELLED", ""), slurm.job(jid)
    plog = (results / "logs" / "pretrain" / f"{cell}.log").read_text()
    assert f"resuming {cell} from step" in plog
    from smallbatch import tracking

    uri = f"sqlite:///{results / 'mlflow.db'}"
    assert tracking.count_cell_runs(uri, "slurm-preempt", cell) == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run_,) = cluster.mlflow_runs(uri, "slurm-preempt")
    steps = [m.step for m in client.get_metric_history(run_.info.run_id, "train/loss")]
    total = int(__import__("torch").load(target, weights_only=False)["steps"])
    assert sorted(steps) == sorted(set(steps)) == sorted(set(list(range(5, total + 1, 5)) + [total])), (
        "the loss history has gaps or duplicates after the preemption"
    )


@pytest.mark.slow
def test_a_two_task_cell_runs_through_srun_with_gloo(tmp_path, slurm):
    """train.devices 2 on the CPU: the cell's SLURM job asks for 2 tasks, its pretraining
    runs as `srun --ntasks=2 smallbatch pretrain` (two processes, gloo, negatives gathered
    over both), logs one MLflow run and equals the one-process run of the same cell."""
    import torch

    cell = "digits/dcl/bs32-t0.5-s0"
    train = {"steps": 12, "width": 4, "proj_hidden": 16, "proj_dim": 8, "log_every": 4, "precision": "fp64"}
    grid = {"losses": ["dcl"], "batch_sizes": [32], "temperatures": [0.5], "seeds": [0]}
    results = tmp_path / "results"
    cfg = write_config(
        tmp_path / "config.yaml",
        results_dir=str(results),
        study="slurm-ddp",
        device="cpu",
        grid=grid,
        train={**train, "devices": 2},
        baselines=False,
        experiments={"mi": {"enabled": False}},
    )
    prof = cluster.slurm_test_profile(tmp_path / "profile", logdir=tmp_path / "slurm_logs")
    env = cluster.env_with_venv({"SBATCH_PARTITION": "local"})
    target = str(results / "runs" / cell / "checkpoint.pt")
    res = run(
        snakemake_cmd(tmp_path, cfg, prof, target), cwd=tmp_path, env=env, timeout=900, log=tmp_path / "snakemake.out"
    )
    assert res.returncode == 0, res.stdout[-4000:]
    plog = (results / "logs" / "pretrain" / f"{cell}.log").read_text()
    assert '"processes": 2' in plog, plog[-2000:]
    from smallbatch import tracking

    assert tracking.count_cell_runs(f"sqlite:///{results / 'mlflow.db'}", "slurm-ddp", cell) == 1
    one = write_config(
        tmp_path / "one.yaml",
        results_dir=str(tmp_path / "one"),
        device="cpu",
        grid=grid,
        train={**train, "devices": 1},
        baselines=False,
    )
    ref = run(
        [
            str(cluster.BIN / "smallbatch"),
            "pretrain",
            "--config",
            str(one),
            "--cell-id",
            cell,
            "--tracking-uri",
            "none",
            "--no-progress",
        ],
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    a = torch.load(target, weights_only=False)["model"]
    b = torch.load(tmp_path / "one" / "runs" / cell / "checkpoint.pt", weights_only=False)["model"]
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12)
