"""benchmarks/gpu_check.py, the one prepared device check, in its --quick CPU mode.

The device machine has no mlflow, snakemake or faiss-gpu: the runs here hide mlflow and
snakemake the same way (a package on PYTHONPATH that refuses to import), so a check that
needs them fails here first.  What only a GPU can show (CUDA calls, graph launches) is
checked on a hand-written trace in the profiler's format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

#: the quick run: 1.5 minutes on a shared 2-core CPU, 2.5 with an empty inductor cache
slow = pytest.mark.slow
#: its hang guard: 900 s ran out at load 12-25 on the 2-core machine (the run was alive)
QUICK_HANG_S = 1800
#: the run's own budget (--budget), inside the hang guard: a section may take half of it (its
#: default, 1,200 s, capped the profiled-steps section at 300 s, which a compile at load 8 overran)
QUICK_BUDGET_S = QUICK_HANG_S - 120


def _blocked(folder: Path, *names: str) -> Path:
    """A folder of packages that refuse to import (what the device machine lacks)."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden: the device has none')\n")
    return folder


def _run(tmp: Path, *args: str, hide=("mlflow", "snakemake")) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{_blocked(tmp / 'hidden', *hide)}"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--budget", str(QUICK_BUDGET_S), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=QUICK_HANG_S,
    )
    rows = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else {}
    return proc, rows


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    proc, sections = _run(tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, sections, tmp / "out"


def _numbers(row: dict, *keys: str) -> bool:
    return all(isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool) for k in keys)


@slow
def test_every_section_ran_and_the_report_is_printed_and_written(quick):
    proc, sections, out = quick
    assert set(sections) == set(gpu_check.TITLES)
    assert all(s["ok"] and s["rows"] for s in sections.values())
    assert proc.stdout.startswith("# smallbatch GPU check (quick, device cpu)")
    for title in gpu_check.TITLES.values():
        assert f"## {title}" in proc.stdout
    assert (out / "gpu_check.md").read_text() == proc.stdout
    assert "===== syncs" in (out / "gpu_check.log").read_text()


@slow
def test_throughput_measures_every_case_and_states_what_it_does_not_compile(quick):
    rows = quick[1]["throughput"]["rows"]
    measured = [r for r in rows if "images/s" in r]
    cases = {(r["model"], r["batch"], r["precision"], r["step"]) for r in measured}
    plan = gpu_check.make_plan(quick=True)
    assert cases == {(m, b, p, "compiled" if c else "eager") for m, b, p, c in gpu_check.throughput_cases(plan)}
    assert all(_numbers(r, "images/s", "ms/step", "build + 2 steps s") and r["images/s"] > 0 for r in measured)
    compiled = [r for r in measured if r["step"] == "compiled"]
    assert compiled and all(_numbers(r, "compile s", "x eager") and "/" in r["FX cache hit/miss"] for r in compiled)
    skipped = [r for r in rows if r.get("note", "").startswith("not compiled")]
    assert {(r["model"], r["precision"]) for r in skipped} == set(plan.skipped)


@slow
def test_share_sums_k_cells(quick):
    rows = quick[1]["share"]["rows"]
    assert [r["cells at once"] for r in rows] == [1, 2]
    assert all(_numbers(r, "summed images/s", "x one cell") and r["summed images/s"] > 0 for r in rows)


@slow
def test_sync_counts_run_on_the_cpu_count_its_ops_and_say_they_are_not_the_gpu_path(quick):
    """On the CPU the profiler sees aten ops and no CUDA at all, so the zeros below only show
    that CPU events are not counted as CUDA calls; that CUDA calls, syncs and launches are
    counted is tested on a GPU trace (test_cuda_calls_are_counted_per_step_and_traced_to_their_op)."""
    rows = quick[1]["syncs"]["rows"]
    assert [r["step"] for r in rows] == ["eager", "compiled"]
    for r in rows:
        assert _numbers(
            r,
            "CUDA calls/step",
            "host syncs/step",
            "D->H copies/step",
            "kernel launches/step",
            "graph launches/step",
            "aten ops/step",
        )
        assert r["CUDA calls/step"] == r["host syncs/step"] == 0 and r["aten ops/step"] > 0
        assert "no CUDA" in r["note"] and "not a measurement of the GPU path" in r["note"]


@slow
def test_knn_sides_find_identical_neighbours_and_accuracies(quick):
    rows = {r["side"]: r for r in quick[1]["knn"]["rows"]}
    assert rows["CPU reference"]["backend"] == "faiss-cpu"
    gpu = rows["GPU side"]
    assert gpu["backend"] == "torch on cpu"
    assert gpu["identical neighbours (entries)"] == 1.0 and gpu["identical neighbour lists (rows)"] == 1.0
    assert gpu["identical neighbour sets (rows)"] == 1.0 and gpu["max abs similarity difference"] < 1e-5
    assert gpu["identical accuracies"] is True
    assert _numbers(gpu, "search s", "kNN eval s", "top-1 k=20 %")
    assert "exact tie among their top 21 similarities: 0 " in rows["features"]["note"]


@slow
def test_cli_cells_pretrain_and_evaluate(quick):
    rows = quick[1]["cli"]["rows"]
    assert [r["step"] for r in rows] == ["prepare-data"] + ["pretrain", "evaluate"] * 2
    pre = [r for r in rows if r["step"] == "pretrain"]
    assert [r["cell"].split("/")[1] for r in pre] == ["infonce", "dcl"]
    assert all(r["status"] in ("finished", "collapsed") and r["steps"] > 0 and _numbers(r, "seconds") for r in pre)
    ev = [r for r in rows if r["step"] == "evaluate"]
    assert all(_numbers(r, "kNN top-1 %, k20", "linear top-1 %", "seconds") for r in ev)


@slow
def test_a_failing_section_fails_the_run_and_keeps_the_others(tmp_path):
    """Without torchvision, `smallbatch prepare-data` fails: the cli section says so with
    the command's error, the machine section still reports, the run exits 1."""
    proc, sections = _run(tmp_path, "--only", "machine", "cli", hide=("mlflow", "snakemake", "torchvision"))
    assert proc.returncode == 1
    assert sections["machine"]["ok"] and sections["machine"]["rows"]
    cli = sections["cli"]
    assert not cli["ok"] and not cli["rows"]
    assert "smallbatch prepare-data failed" in (tmp_path / "out" / "gpu_check.log").read_text()
    assert "| 5. Two cells end to end through the CLI (generated CIFAR-10) | FAILED |" in proc.stdout


@slow
def test_knn_without_faiss_uses_torch_on_the_cpu_as_reference(tmp_path):
    proc, sections = _run(tmp_path, "--only", "knn", hide=("mlflow", "snakemake", "faiss"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["side"]: r for r in sections["knn"]["rows"]}
    assert rows["CPU reference"]["backend"] == "torch on cpu"
    assert rows["GPU side"]["identical accuracies"] is True


# --------------------------------------------------------------------------- what a GPU trace holds
def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


@pytest.mark.parametrize("steps", [1, 2])
def test_cuda_calls_are_counted_per_step_and_traced_to_their_op(steps):
    """An .item() (D->H copy + stream sync) inside aten::item, an H->D copy, two kernel
    launches (runtime and driver), a graph replay; a sync outside the window is not counted."""
    events = [
        _x("user_annotation", gpu_check.WINDOW, 100, 1000),
        _x("cpu_op", "aten::item", 200, 100),
        _x("cpu_op", "aten::_local_scalar_dense", 210, 80),
        _x("cuda_runtime", "cudaMemcpyAsync", 220, 10, corr=7),
        _x("cuda_runtime", "cudaStreamSynchronize", 240, 30),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 250, 2, tid=7, corr=7),
        _x("cuda_runtime", "cudaMemcpyAsync", 400, 5, corr=8),
        _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 410, 2, tid=7, corr=8),
        _x("cuda_runtime", "cudaLaunchKernel", 500, 5, corr=9),
        _x("cuda_driver", "cuLaunchKernel", 510, 5, corr=10),
        _x("cuda_runtime", "cudaGraphLaunch", 600, 5, corr=11),
        _x("kernel", "void add_kernel", 520, 3, tid=7, corr=9),
        _x("kernel", "triton_poi_fused", 530, 3, tid=7, corr=10),
        _x("cuda_runtime", "cudaDeviceSynchronize", 1200, 50),  # after the window: the profiler's own
    ]
    c = gpu_check.count_cuda_calls(events, steps)
    assert c["CUDA calls/step"] == 6 / steps
    assert c["host syncs/step"] == 1 / steps and c["D->H copies/step"] == 1 / steps
    assert c["H->D copies/step"] == 1 / steps and c["copies/step"] == 2 / steps
    assert c["kernel launches/step"] == 2 / steps and c["graph launches/step"] == 1 / steps
    assert c["GPU kernels/step"] == 2 / steps and c["aten ops/step"] == 2 / steps
    assert c["syncs and D->H copies (in op)"] == (
        "cudaStreamSynchronize in aten::item x1, cudaMemcpyAsync in aten::item x1"
    )


def test_a_trace_without_the_window_is_an_error():
    with pytest.raises(RuntimeError, match="no 'gpu_check.steps' range"):
        gpu_check.count_cuda_calls([_x("cpu_op", "aten::add", 0, 1)], 1)


# --------------------------------------------------------------------------- the full (GPU) plan, checked here
def test_the_full_plans_cells_are_valid_cells_of_the_study_configs(tmp_path):
    """What the device run builds without a GPU to build it on: every throughput cell
    (cifar10.yaml's resnet18_cifar at 1024 in bf16 too) and the CLI's two cells."""
    import throughput

    from smallbatch.pipeline import cli

    plan = gpu_check.make_plan(quick=False)
    for model, bs, prec, compiled in gpu_check.throughput_cases(plan):
        cell = throughput.study_cell(bs, compiled, "cuda", gpu_check.MODELS[model][0], precision=prec)
        assert (cell["train"]["backbone"], cell["batch_size"], cell["train"]["precision"]) == (model, bs, prec)
        assert cell["train"]["compile"] is compiled and cell["device"] == "cuda"
    config = gpu_check.cli_config(tmp_path, plan, "cuda")
    for loss in ("infonce", "dcl"):
        args = cli.build_parser().parse_args(["pretrain", *gpu_check.cli_cell_args(config, loss, plan)])
        cell, _ = cli.resolve_cell(args)
        assert (cell.train.backbone, cell.train.precision, cell.augment["recipe"]) == (
            "resnet18_cifar",
            "bf16",
            "simclr",
        )
        assert cell.batch_size == 256 and cell.train.epochs == 10 and cell.device == "cuda"


def test_the_documented_device_command_fits_the_tool():
    """The run command in the docstring: one line of at most 2,000 characters that installs
    the carried wheels and runs the full check on CUDA."""
    line = next(x.strip() for x in gpu_check.__doc__.splitlines() if x.strip().startswith("python3 -m pip install"))
    assert len(line) <= 2000
    assert ".whl/*.whl" in line and line.endswith("python3 benchmarks/gpu_check.py --device cuda")
