"""Tests of the command line (``smallbatch ...``).

Most commands run in-process through ``smallbatch.pipeline.cli.main`` (it returns the exit
code and prints what the console script prints); two tests start the real
console script to check the process's own exit status and stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster import HANG_S
from hooks import crash_after

from smallbatch.pipeline import cli

SMALLBATCH = Path(sys.executable).with_name("smallbatch")
CELL = ["--dataset", "digits", "--loss", "infonce", "--batch-size", "32", "--temperature", "0.5"]


@pytest.fixture(autouse=True)
def keep_threads():
    """In-process commands set torch's thread count from the cell; restore it."""
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.fixture()
def study(tmp_path) -> Path:
    """A config for a tiny, fast digits cell whose outputs go under tmp_path."""
    cfg = tmp_path / "study.yaml"
    cfg.write_text(
        f"study: cli-test\nresults_dir: {tmp_path / 'results'}\n"
        "datasets: {digits: {}}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, lr: 0.003, epochs: 1, log_every: 5}\n"
        "eval: {knn_k: [5, 20], linear_iterations: 20}\n"
    )
    return cfg


def error_line(capsys, argv: list[str]) -> str:
    """Run the command in-process; it must exit 2 with exactly one stderr line."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("smallbatch: error: ")
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "argv,names",
    [
        (
            ["--dataset", "digits", "--loss", "infonse", "--batch-size", "32", "--temperature", "0.5"],
            ["infonse", "flatnce"],
        ),
        (
            ["--dataset", "digits", "--loss", "infonce", "--batch-size", "1", "--temperature", "0.5"],
            ["--batch-size", "1"],
        ),
        (["--dataset", "digits", "--loss", "infonce", "--batch-size", "32", "--temperature", "0"], ["--temperature"]),
        (
            ["--dataset", "digits", "--loss", "infonce", "--batch-size", "32", "--temperature", "-0.1"],
            ["--temperature", "-0.1"],
        ),
        (
            ["--dataset", "mnist", "--loss", "infonce", "--batch-size", "32", "--temperature", "0.5"],
            ["mnist", "digits"],
        ),
        (CELL + ["--epochs", "-1"], ["epochs", "-1"]),
        (CELL + ["--loss-param", "sigma=0.5"], ["sigma", "infonce"]),
        (["--dataset", "digits"], ["--loss", "--batch-size", "--temperature"]),
    ],
)
def test_bad_cell_arguments_exit_2_with_one_line(capsys, tmp_path, argv, names):
    line = error_line(capsys, ["pretrain", "--tracking-uri", "none", "--out", str(tmp_path / "o"), *argv])
    for n in names:
        assert n in line, line
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_missing_data_root_names_the_dataset_and_root(capsys, tmp_path):
    root = tmp_path / "empty_root"
    root.mkdir()
    line = error_line(
        capsys,
        [
            "pretrain",
            "--tracking-uri",
            "none",
            "--out",
            str(tmp_path / "o"),
            "--dataset",
            "cifar10",
            "--data-root",
            str(root),
            "--loss",
            "infonce",
            "--batch-size",
            "32",
            "--temperature",
            "0.5",
        ],
    )
    assert "cifar10" in line and str(root) in line and "download" in line


def test_typo_in_config_file(capsys, tmp_path, study):
    study.write_text(study.read_text() + "trian: {epochs: 1}\n")
    line = error_line(capsys, ["pretrain", "--tracking-uri", "none", "--config", str(study), *CELL])
    assert "'trian'" in line and "did you mean 'train'" in line


def test_unknown_cell_id(capsys, study):
    line = error_line(
        capsys,
        ["pretrain", "--tracking-uri", "none", "--config", str(study), "--cell-id", "digits/infonce/bs32-t0.5-s9"],
    )
    assert "digits/infonce/bs32-t0.5-s9" in line


def test_corrupt_checkpoint_passed_to_embed(capsys, tmp_path, study):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x04 not a torch file")
    line = error_line(
        capsys, ["embed", "--config", str(study), *CELL, "--checkpoint", str(bad), "--out", str(tmp_path / "f.npz")]
    )
    assert str(bad) in line
    assert not (tmp_path / "f.npz").exists()


def test_truncated_features_passed_to_knn(capsys, tmp_path, study):
    from smallbatch.evaluation.embed import save_features

    f = tmp_path / "features.npz"
    rng = np.random.default_rng(0)
    save_features(
        f,
        rng.normal(size=(50, 8)).astype(np.float32),
        rng.integers(0, 3, 50),
        rng.normal(size=(20, 8)).astype(np.float32),
        rng.integers(0, 3, 20),
        {"status": "finished"},
    )
    blob = f.read_bytes()
    f.write_bytes(blob[: len(blob) // 2])
    line = error_line(
        capsys,
        [
            "knn",
            "--tracking-uri",
            "none",
            "--config",
            str(study),
            *CELL,
            "--features",
            str(f),
            "--out",
            str(tmp_path / "knn.json"),
        ],
    )
    assert str(f) in line
    assert not (tmp_path / "knn.json").exists()


def test_real_process_exit_status_and_single_stderr_line(tmp_path):
    p = subprocess.run(
        [
            str(SMALLBATCH),
            "pretrain",
            "--tracking-uri",
            "none",
            "--out",
            str(tmp_path),
            "--dataset",
            "digits",
            "--loss",
            "infonce",
            "--batch-size",
            "32",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "smallbatch: error: --temperature τ = 0 is outside [0.001, 100], where the losses stop being "
        "meaningful (s/τ overflows, or every logit is ~0); choose a τ in that range"
    ]
    assert p.stdout == ""


# --------------------------------------------------------------------------- --help
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


# Options whose name (or whose listed choices) says what they do.
SELF_EXPLANATORY = {
    "--seed",
    "--epochs",
    "--precision",
    "--lr-scaling",
    "--optimizer",
    "--backbone",
    "--device",
    "--out",
    "--config",
    "--data-root",
    "--image-size",
    "--train-subset",
    "--test-subset",
    "--checkpoint",
    "--features",
    "--experiment",
    "--tracking-uri",
}


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_help_of_every_subcommand_lists_every_option(capsys, command):
    with pytest.raises(SystemExit) as ei:
        cli.main([command, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    sp = _subparsers()[command]
    for action in sp._actions:
        for opt in action.option_strings:
            assert opt in out, f"{command} --help does not list {opt}"


def _options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


#: per subcommand: flags its --help must list, and flags of other concerns it must not
HELP_TABLE = {
    "pretrain": (
        {"--lr", "--epochs", "--optimizer", "--backbone", "--restart", "--cell-id", "--tracking-uri", "--data-cache"},
        {"--knn-k", "--linear-iterations", "--checkpoint", "--features"},
    ),
    "embed": (
        {"--checkpoint", "--data-cache", "--device", "--cell-id", "--dataset"},
        {"--lr", "--optimizer", "--backbone", "--epochs", "--knn-k", "--linear-iterations", "--tracking-uri"},
    ),
    "evaluate": (
        {"--checkpoint", "--out-dir", "--features", "--tracking-uri", "--data-cache"},
        {"--lr", "--optimizer", "--backbone", "--epochs", "--knn-k", "--linear-iterations"},
    ),
    "knn": (
        {"--knn-k", "--knn-t", "--knn-backend", "--features", "--cell-id", "--tracking-uri"},
        {"--lr", "--optimizer", "--backbone", "--epochs", "--steps", "--linear-iterations", "--device"},
    ),
    "linear": (
        {"--linear-iterations", "--linear-weight-decay", "--linear-weight-decays", "--linear-optimizer", "--features"},
        {"--lr", "--optimizer", "--backbone", "--epochs", "--knn-k", "--knn-t", "--device"},
    ),
    "baseline": (
        {"--cell-json", "--cell-id", "--data-cache", "--tracking-uri", "--threads"},
        {"--lr", "--optimizer", "--backbone", "--epochs", "--dataset", "--loss", "--knn-k"},
    ),
    "export": (
        {"--cell-id", "--config", "--run-dir", "--checkpoint", "--out"},
        {"--lr", "--backbone", "--tracking-uri", "--knn-k", "--device", "--threads"},
    ),
    "report": ({"--tracking-uri", "--experiment", "--out", "--config"}, {"--cell-id", "--lr", "--dataset"}),
    "cells": ({"--config", "--write", "--baselines"}, {"--cell-id", "--lr", "--tracking-uri"}),
}


@pytest.mark.parametrize("command", sorted(HELP_TABLE))
def test_help_of_a_subcommand_lists_its_own_flags_only(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    shown = _options(capsys.readouterr().out)
    must, must_not = HELP_TABLE[command]
    assert must <= shown, f"{command} --help lacks {sorted(must - shown)}"
    assert not must_not & shown, f"{command} --help shows {sorted(must_not & shown)}"


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_subcommand_says_what_it_does(capsys, command):
    sp = _subparsers()[command]
    assert sp.description and len(sp.description) > 20, command
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert sp.description.split()[0] in capsys.readouterr().out


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as ei:
        cli.main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"smallbatch {version('smallbatch')}"


def _rule_commands() -> list[tuple[str, str, set[str]]]:
    """(rule, subcommand, the flags its shell line and its flag() params pass) of every
    workflow rule that calls the CLI."""
    rules = []
    for smk in sorted((Path(__file__).resolve().parents[2] / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"^\s*rule ", smk.read_text(), flags=re.M)[1:]:  # a layout's rules are indented
            shell = "".join(re.findall(r'^\s*"(.*)"\s*$', block.split("shell:", 1)[-1], flags=re.M))
            m = re.search(r"(?:smallbatch|\{params\.launch\}) ([a-z-]+)", shell)
            if m and "shell:" in block:
                flags = _options(shell) | set(re.findall(r'flag\("(--[a-z0-9-]+)"', block))
                rules.append((block.split(":", 1)[0].strip(), m.group(1), flags))
    return rules


def test_every_flag_a_workflow_rule_passes_is_an_option_of_its_subcommand():
    rules = _rule_commands()
    assert {c for _, c, _ in rules} >= {
        "init-store",
        "prepare-data",
        "pretrain",
        "evaluate",
        "run-cell",
        "baseline",
        "report",
    }
    for rule, command, flags in rules:
        known = {o for a in _subparsers()[command]._actions for o in a.option_strings}
        assert flags <= known, f"rule {rule}: smallbatch {command} has no {sorted(flags - known)}"


def test_top_level_help_lists_every_user_command_and_no_internal_one(capsys):
    from smallbatch.pipeline.cli_parser import INTERNAL_COMMANDS

    with pytest.raises(SystemExit) as ei:
        cli.main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    listing = out.split("positional arguments:")[1].split("options:")[0]
    assert set(re.findall(r"^    (\S+)", listing, re.M)) == set(_subparsers()) - set(INTERNAL_COMMANDS)
    # what the commands do, truthfully: not every command runs a step of a cell
    assert "cells, report and config-reference work on a whole study" in " ".join(out.split())
    assert "-v, --verbose" in out and "-q, --quiet" in out
    for command in INTERNAL_COMMANDS:  # hidden from the list, still there to call
        assert _subparsers()[command].description


@pytest.mark.parametrize("command", [None, *sorted(_subparsers())])
def test_no_help_shows_rst_markup(capsys, command):
    with pytest.raises(SystemExit):
        cli.main(["--help"] if command is None else [command, "--help"])
    out = capsys.readouterr().out
    assert "`" not in out and ":mod:" not in out


def test_loss_help_lists_every_loss_of_the_registry_and_its_parameters(capsys):
    from smallbatch.losses.registry import SPECS, loss_param_names

    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, spec in SPECS.items():
        assert f" {name}" in out, name
        for alias in spec.aliases:
            assert alias in out, alias
        for param in loss_param_names(name):
            assert param in out, (name, param)


@pytest.mark.parametrize(
    "argv, level",
    [
        (["cells"], 0),
        (["-q", "cells"], -1),
        (["cells", "--quiet"], -1),
        (["--verbose", "cells"], 1),
        (["cells", "-v"], 1),
        (["-q", "cells", "-v"], 1),  # after the command it wins
    ],
)
def test_verbosity_is_one_flag_before_or_after_the_command(argv, level):
    assert cli.build_parser().parse_args(argv).verbosity == level


def test_verbose_prints_the_traceback_of_an_error_and_quiet_does_not(capsys, monkeypatch):
    import logging

    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)  # main sets it: restored after
    bad = ["cells", "--config", "/nonexistent/config.yaml"]
    assert cli.main(["-v", *bad]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("smallbatch: error: ") and "Traceback (most recent call last)" in err
    assert cli.main(["-q", *bad]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_every_option_is_explained():
    undocumented = []
    for command, sp in _subparsers().items():
        for action in sp._actions:
            if not action.option_strings or action.dest == "help":
                continue
            name = action.option_strings[-1]
            if not action.help and name not in SELF_EXPLANATORY:
                undocumented.append(f"{command} {name}")
    assert not undocumented, ", ".join(undocumented)


# --------------------------------------------------------------------------- a whole cell, tracked
def _mlflow_runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    return client, client.search_runs([exp.experiment_id], max_results=100)


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One stand-alone digits cell through the whole pipeline, tracked in a fresh SQLite store:
    init-store; knn before pretraining (an error); pretrain crashed 7 steps into epoch 2 and
    resumed; embed; knn; linear; knn again.  Returns what each step said and where things are."""
    from smallbatch.evaluation.embed import save_features
    from smallbatch.training import loop as train

    tmp = tmp_path_factory.mktemp("tracked")
    old_threads = torch.get_num_threads()
    cfg = tmp / "study.yaml"
    cfg.write_text(
        f"study: cli-test\nresults_dir: {tmp / 'results'}\n"
        "datasets: {digits: {}}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, lr: 0.003, epochs: 2, log_every: 5}\n"
        "eval: {knn_k: [5, 20], linear_iterations: 20}\n"
    )
    uri = f"sqlite:///{tmp / 'm.db'}"
    common = ["--config", str(cfg), *CELL]
    steps: dict[str, tuple[int, str, str]] = {}
    steps["init-store"] = _in_process(["init-store", "--tracking-uri", uri, "--config", str(cfg)])

    rng = np.random.default_rng(0)
    early = tmp / "early.npz"
    save_features(
        early,
        rng.normal(size=(40, 4)).astype(np.float32),
        rng.integers(0, 2, 40),
        rng.normal(size=(10, 4)).astype(np.float32),
        rng.integers(0, 2, 10),
        {"status": "finished", "cell_id": "digits/infonce/bs32-t0.5-s0"},
    )
    steps["early-knn"] = _in_process(
        ["knn", "--tracking-uri", uri, *common, "--features", str(early), "--out", str(tmp / "early.json")]
    )

    from smallbatch.data.load import load_dataset

    n_images = load_dataset("digits", tmp).pretrain_x.shape[0]
    spe = n_images // 32
    real = train.pretrain

    def crash_once(*a, **kw):
        train.pretrain = real
        return real(*a, after_step=crash_after(spe + 7), **kw)

    train.pretrain = crash_once
    try:  # stopped as Ctrl-C stops it: exit 130
        crashed = _in_process(["pretrain", "--tracking-uri", uri, "--no-progress", *common])[0] == 130
    finally:
        train.pretrain = real
    steps["pretrain"] = _in_process(["pretrain", "--tracking-uri", uri, "--no-progress", *common])
    steps["embed"] = _in_process(["embed", *common])
    for kind in ("knn", "linear"):
        steps[kind] = _in_process([kind, "--tracking-uri", uri, *common])
    client, runs = _mlflow_runs(uri, "cli-test")
    n_before = len(runs)
    steps["knn-again"] = _in_process(["knn", "--tracking-uri", uri, *common])
    torch.set_num_threads(old_threads)
    return {
        "uri": uri,
        "steps": steps,
        "crashed": crashed,
        "runs_before_rerun": n_before,
        "spe": spe,
        "run_dir": tmp / "results" / "runs" / "digits" / "infonce" / "bs32-t0.5-s0",
    }


def test_probe_before_pretraining_names_the_missing_run(tracked):
    rc, out, err = tracked["steps"]["early-knn"]
    assert rc == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("smallbatch: error: ") and "digits/infonce/bs32-t0.5-s0" in line
    assert "smallbatch pretrain" in line


def test_standalone_cell_pipeline_logs_one_mlflow_run(tracked):
    steps = tracked["steps"]
    assert tracked["crashed"]
    for name in ("init-store", "pretrain", "embed", "knn", "linear", "knn-again"):
        assert steps[name][0] == 0, (name, steps[name][2][-500:])
    summary = json.loads(steps["pretrain"][1].strip().splitlines()[-1])
    assert summary["status"] == "finished" and summary["cell_id"] == "digits/infonce/bs32-t0.5-s0"
    assert summary["steps"] == 2 * tracked["spe"]
    assert "resuming" in steps["pretrain"][2]
    run_dir = tracked["run_dir"]
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "features.npz").is_file()
    for kind in ("knn", "linear"):
        assert json.loads((run_dir / f"{kind}.json").read_text())["status"] == "finished"

    client, runs = _mlflow_runs(tracked["uri"], "cli-test")
    assert tracked["runs_before_rerun"] == 1 and len(runs) == 1  # resumed pretrain and the rerun knn: same run
    run = runs[0]
    assert run.info.run_name == "digits/infonce/bs32-t0.5-s0"
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert tags["smallbatch.cell_id"] == "digits/infonce/bs32-t0.5-s0" and tags["smallbatch.kind"] == "cell"
    assert tags["smallbatch.status"] == "finished" and run.info.status == "FINISHED"
    for key, value in {
        "dataset": "digits",
        "loss": "infonce",
        "batch_size": "32",
        "temperature": "0.5",
        "negatives": "62",
        "train.epochs": "2",
        "train.precision": "fp32",
    }.items():
        assert params.get(key) == value, key
    inputs = run.inputs.dataset_inputs  # the UI's "Dataset": once, though the pretrain job ran twice
    assert [(i.dataset.name, i.tags[0].value) for i in inputs] == [("digits", "training")]
    profile = json.loads(inputs[0].dataset.profile)
    assert profile["classes"] == 10 and profile["test_images"] > 0 and inputs[0].dataset.digest
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps_logged = [m.step for m in history]
    assert len(history) > 1 and len(steps_logged) == len(set(steps_logged))
    assert max(steps_logged) == summary["steps"]
    assert all(math.isfinite(m.value) for m in history)
    for key in (
        "diag/mi_estimate",
        "diag/ess",
        "diag/alignment",
        "diag/uniformity",
        "train/lr",
        "train/final_loss",
        "train/wall_s",
    ):
        assert key in metrics, key
    for key in ("knn/top1", "knn/top5", "linear/top1", "linear/top5"):
        chance = 100.0 * int(key[-1]) / 10  # percent: a top-k guess among 10 classes is right k times in 10
        assert chance < metrics[key] <= 100.0, (key, metrics[key], chance)
    assert metrics["knn/top5"] >= metrics["knn/top1"]


def test_resumed_run_has_one_value_per_step_for_every_metric(tracked):
    client, (run,) = _mlflow_runs(tracked["uri"], "cli-test")
    dup = {}
    for key in run.data.metrics:
        if key.startswith(("knn/", "linear/")):
            continue  # probe results are logged per evaluation at step 0
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        if len(steps) != len(set(steps)):
            dup[key] = sorted(s for s in set(steps) if steps.count(s) > 1)
    assert not dup, dup


def test_probe_flags_override_the_cell_eval_for_that_probe_only(tracked, tmp_path):
    """--knn-k / --linear-iterations: the probe on the cell's own features with other settings,
    printed (and written to --out), neither logged to the cell's MLflow run nor written over
    its knn.json / linear.json."""
    run_dir, uri = tracked["run_dir"], tracked["uri"]
    common = ["--tracking-uri", uri, "--cell", str(run_dir / "cell.json")]
    own = {kind: (run_dir / f"{kind}.json").read_text() for kind in ("knn", "linear")}
    client, (run,) = _mlflow_runs(uri, "cli-test")
    rc, out, err = _in_process(
        ["knn", *common, "--knn-k", "3", "--knn-t", "0.5", "--knn-backend", "torch", "--out", str(tmp_path / "k3.json")]
    )
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert "knn/top1_k3" in res and "knn/top1_k5" not in res
    assert json.loads((tmp_path / "k3.json").read_text()) == res
    assert "eval.knn_k = [3], eval.knn_t = 0.5: not logged to MLflow" in err
    rc, out, err = _in_process(["linear", *common, "--linear-iterations", "2", "--linear-weight-decay", "0.1"])
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["status"] == "finished" and "not written (no --out)" in err
    assert {kind: (run_dir / f"{kind}.json").read_text() for kind in ("knn", "linear")} == own
    client, (after,) = _mlflow_runs(uri, "cli-test")
    assert after.data.metrics == run.data.metrics
    assert "knn/top1_k3" not in after.data.metrics


def test_one_weight_decay_replaces_the_cells_choice_among_several():
    parse = cli.build_parser().parse_args
    assert cli._eval_overrides("linear", parse(["linear", "--linear-weight-decay", "0.1"])) == {
        "linear_weight_decay": 0.1,
        "linear_weight_decays": None,
    }
    assert cli._eval_overrides("linear", parse(["linear", "--linear-weight-decays", "0.1", "1"])) == {
        "linear_weight_decays": [0.1, 1.0]
    }
    assert cli._eval_overrides("knn", parse(["knn", "--knn-backend", "torch"])) == {}  # the same neighbours


@pytest.mark.parametrize(
    "argv,names",
    [
        (["knn", "--knn-k", "0"], ["--knn-k", "0"]),
        (["knn", "--knn-t", "-1"], ["--knn-t", "-1"]),
        (["linear", "--linear-iterations", "0"], ["--linear-iterations", "0"]),
        (["linear", "--linear-weight-decays", "-1"], ["--linear-weight-decays", "-1"]),
    ],
)
def test_bad_probe_flags_exit_2_with_one_line(capsys, study, argv, names):
    line = error_line(capsys, [*argv, "--tracking-uri", "none", "--config", str(study), *CELL])
    for n in names:
        assert n in line, line
