"""The steps-to-target sweep as a job (smallbatch.pipeline.steps_job, `smallbatch steps-to-target`)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from smallbatch.pipeline import steps_job
from smallbatch.pipeline.cli import main
from smallbatch.study.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "workflow" / "configs" / "critical_batch_tiny.yaml"
SMALL = {"arms": ["infonce", "supervised_ce"], "batch_sizes": [32, 64], "seeds": [0, 1], "max_images": 128}


def _cfg(**section):
    return load_config([REPO / "config.yaml", TINY], {"experiments": {"critical_batch": section}})


@pytest.mark.parametrize(
    "section, key",
    [
        ({"target": None}, "experiments.critical_batch.target"),
        ({"arms": ["infonce", "supervised"]}, "experiments.critical_batch.arms"),
        ({"queries": 81}, "experiments.critical_batch.queries"),  # a fifth of 400 is 80
        ({"dataset": "cifar10"}, "experiments.critical_batch.dataset"),
    ],
)
def test_a_bad_section_is_refused_before_any_run_naming_its_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        steps_job.section_of(_cfg(**section))


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_the_sweep_appends_one_row_per_run_and_a_rerun_skips_them(tmp_path):
    cfg = _cfg(**SMALL)
    assert steps_job.run_sweep(cfg, tmp_path, log=lambda _: None) == 8  # 2 arms x 2 batch sizes x 2 seeds
    rows = _rows(tmp_path / "runs.csv")
    assert [(r["arm"], r["batch_size"], r["seed"]) for r in rows[:4]] == [
        ("infonce", "32", "0"),
        ("supervised_ce", "32", "0"),
        ("infonce", "64", "0"),
        ("supervised_ce", "64", "0"),
    ]  # seeds outermost
    assert all(r["target"] == "94.0" for r in rows)
    assert steps_job.run_sweep(cfg, tmp_path, log=lambda _: None) == 0
    assert len(_rows(tmp_path / "runs.csv")) == 8


def test_no_run_starts_after_the_stop_time(tmp_path):
    assert steps_job.run_sweep(_cfg(**SMALL), tmp_path, stop_by=0.0, log=lambda _: None) == 0
    assert not (tmp_path / "runs.csv").exists()


def test_the_command_runs_the_sweep_and_writes_the_fit_and_figures(tmp_path, capsys):
    sets = ["experiments.critical_batch.max_images=128", "experiments.critical_batch.batch_sizes=[32,64]"]
    args = ["steps-to-target", "--config", str(REPO / "config.yaml"), "--config", str(TINY), "--set", *sets]
    assert main([*args, "--out", str(tmp_path / "sweep"), "--replicas", "20"]) == 0
    for name in ("runs.csv", "curves.csv", "fit.md", "steps_to_target.png", "images_to_target.png"):
        assert (tmp_path / "sweep" / name).is_file(), name
    assert "| InfoNCE |" in capsys.readouterr().out


def test_the_command_refuses_a_config_without_the_sweep(tmp_path, capsys):
    assert main(["steps-to-target", "--config", str(REPO / "config.yaml"), "--out", str(tmp_path / "x")]) == 2
    assert "'experiments.critical_batch.enabled' is false" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
