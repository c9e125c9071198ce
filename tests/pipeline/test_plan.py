"""The workflow's plan (:mod:`smallbatch.pipeline.plan`), which ``workflow/rules/common.smk``
calls: the settings stamps, the cells' outputs, the results folder's run lock and the jobs'
resources, read without Snakemake."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smallbatch.pipeline.plan import StudyPlan, gpu_permille, hold_results_folder, pretrain_priority
from smallbatch.study.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan(tmp_path) -> StudyPlan:
    overlay = {"results_dir": str(tmp_path / "results"), "train": {"snapshot_epochs": [1], "lr_schedule": "constant"}}
    return StudyPlan.from_config(load_config([REPO / "config.yaml"], overlay))


def test_every_cell_baseline_and_data_cache_folder_has_one_planned_stamp(plan):
    cfg = load_config([REPO / "config.yaml"])
    assert len(plan.cells) == 40 and plan.baselines
    assert len(plan.settings) == len(plan.cells) + len(plan.baselines) + len(cfg["datasets"])
    cid, cell = next(iter(plan.cells.items()))
    assert plan.settings_stamp(f"runs/{cid}") == f"{plan.results_dir}/runs/{cid}/.settings-{cell.hash}"
    assert plan.stamped[f"runs/{cid}"] == f"{plan.results_dir}/runs/{cid}/checkpoint.pt"
    assert plan.settings[f"runs/{cid}"][1] == cell.to_json()


def test_an_output_without_its_stamp_is_stale_and_the_settings_job_writes_the_stamp(plan):
    cid = next(iter(plan.cells))
    folder = f"runs/{cid}"
    out = Path(plan.stamped[folder])
    assert plan.stale_output(folder) is None  # nothing computed yet
    out.parent.mkdir(parents=True)
    out.write_bytes(b"a checkpoint of other settings")
    old = out.parent / ".settings-0123456789"
    old.write_text("{}")
    assert plan.stale_output(folder) == str(out)
    log = out.parent / "settings.log"
    plan.write_settings(folder, plan.settings_stamp(folder), log)
    assert plan.stale_output(folder) is None and not old.exists()
    assert "removed .settings-0123456789: results of other settings" in log.read_text()
    with pytest.raises(ValueError, match="no such settings are planned"):
        plan.write_settings(folder, out.parent / ".settings-ffffffffff", log)


def test_a_settings_stamp_replaced_by_a_folder_is_not_taken_as_the_stamp(plan):
    cid = next(iter(plan.cells))
    folder = f"runs/{cid}"
    out = Path(plan.stamped[folder])
    out.parent.mkdir(parents=True)
    out.write_bytes(b"a checkpoint of other settings")
    Path(plan.settings_stamp(folder)).mkdir()
    with pytest.raises(ValueError) as err:
        plan.stale_output(folder)
    assert str(err.value) == (
        f"settings stamp {plan.settings_stamp(folder)} is a folder, not the file the workflow writes; remove it "
        f"(the jobs of {folder} then run again)"
    )


def test_the_outputs_are_every_probe_of_every_cell_and_snapshot(plan):
    outs = plan.cell_outputs()
    per_cell = len(plan.probe_files) * 2  # the final checkpoint and the snapshot at epoch 1
    assert len(outs) == len(plan.cells) * per_cell and len(set(outs)) == len(outs)
    cid = next(iter(plan.cells))
    assert f"{plan.results_dir}/runs/{cid}/snapshots/ep1.knn.json" in outs
    assert plan.baseline_outputs()[0].endswith("/result.json")
    with pytest.raises(ValueError, match="unknown cell 'nope': not in the config's grid"):
        plan.cell("nope")


def test_one_job_per_cell_makes_the_final_probe_files_the_cells_outputs_and_stamps(tmp_path):
    """Under one_job_per_cell a cell's one job writes its snapshots' files before its final ones,
    which alone are its outputs (and what a stamp guards: no checkpoint.pt is an output)."""
    overlay = {
        "results_dir": str(tmp_path / "results"),
        "one_job_per_cell": True,
        "train": {"snapshot_epochs": [1], "lr_schedule": "constant"},
    }
    plan = StudyPlan.from_config(load_config([REPO / "config.yaml"], overlay))
    cid = next(iter(plan.cells))
    first = next(iter(plan.probe_files.values()))
    assert plan.stamped[f"runs/{cid}"] == f"{plan.results_dir}/runs/{cid}/{first}"
    outs = plan.cell_outputs()
    assert len(outs) == len(plan.cells) * len(plan.probe_files)
    assert not any("/snapshots/" in o for o in outs)
    assert plan.one_process_problem() is None


def test_one_job_per_cell_refuses_a_cell_on_several_processes(tmp_path):
    overlay = {"results_dir": str(tmp_path / "results"), "one_job_per_cell": True, "train": {"devices": 2}}
    plan = StudyPlan.from_config(load_config([REPO / "config.yaml"], overlay))
    problem = plan.one_process_problem()
    assert problem is not None and problem.startswith("one_job_per_cell runs each cell in one process, but cell ")
    assert problem.endswith("has train.devices = 2; set one_job_per_cell: false (a job per step) or train.devices: 1")
    overlay["one_job_per_cell"] = False
    assert StudyPlan.from_config(load_config([REPO / "config.yaml"], overlay)).one_process_problem() is None


def test_a_second_run_on_a_results_folder_is_refused_naming_the_first(tmp_path):
    fd = hold_results_folder(str(tmp_path / "r"))
    try:
        with pytest.raises(ValueError, match=rf"in use by another Snakemake run \(process {os.getpid()}\)"):
            hold_results_folder(str(tmp_path / "r"))
    finally:
        os.close(fd)
    os.close(hold_results_folder(str(tmp_path / "r")))  # released with its descriptor
    (tmp_path / "s").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "s" / ".snakemake-run.lock")
    with pytest.raises(ValueError, match="run lock of results folder"):
        hold_results_folder(str(tmp_path / "s"))
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("linked", ["logs", "runs/digits", "data/cache/digits.pt"])
def test_a_run_on_a_results_folder_holding_a_link_outside_it_is_refused(linked, tmp_path):
    """A link planted in the results folder (a folder, or a file) to a place outside it: the run
    stops before any job (Snakemake would write the jobs' logs and outputs through it)."""
    results, elsewhere = tmp_path / "r", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (results / linked).parent.mkdir(parents=True)
    (results / linked).symlink_to(elsewhere)
    with pytest.raises(ValueError) as err:
        hold_results_folder(str(results))
    assert str(err.value) == (
        f"results folder {results} holds the link {results / linked} -> {elsewhere}, which leads outside it; "
        "refused (smallbatch writes nothing outside its results folder): remove the link"
    )
    assert list(elsewhere.iterdir()) == []


def test_a_results_folder_that_is_a_link_is_held(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "r").symlink_to(tmp_path / "disk")
    os.close(hold_results_folder(str(tmp_path / "r")))
    assert (tmp_path / "disk" / ".snakemake-run.lock").is_file()


def test_longer_cells_start_first_and_share_gpus_by_permille(plan):
    prio = {int(c.batch_size): pretrain_priority(c) for c in plan.cells.values()}
    assert prio[16] > prio[256] and all(1 <= p <= 9 for p in prio.values())
    assert gpu_permille(1, 4) == 250 and gpu_permille(2, 4) == 2000
