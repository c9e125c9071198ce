"""GPU check: measure and verify smallbatch's GPU path in one run (one NVIDIA H200, under 8 minutes).

Sections (each runs in its own process, under its own time limit, so a failure, a hang or
a broken CUDA context in one keeps the others' numbers; the script exits 1 if any failed):

0. machine -- Python, torch, CUDA, cuDNN, the GPU, faiss (and whether it sees a GPU).
1. throughput -- training-step images/s (``throughput.step_rate``: build + 2 warm-up steps,
   then timed steps) of the default study's cell (config.yaml: small_cnn, 16 px, 1 channel)
   at batch 16 and 256 and of cifar10.yaml's (resnet18_cifar, 32 px, 3 channels, SimCLR
   augmentations, LARS) at batch 256 and 1024, fp32 and bf16, eager and compiled
   (``train.compile``: ``torch.compile`` with CUDA graphs, ``mode="reduce-overhead"``), on
   synthetic uint8 images; each compile's seconds beside it, with the inductor FX-graph
   cache's hits/misses (a hit is a warm compile).  Compiled only where the study runs:
   small_cnn in fp32 (the default study's precision), resnet18_cifar in bf16 (cifar10.yaml's);
   the other two combinations are listed as skipped.  The compiled rows run last, cheapest
   first, and one that would overrun the run's budget is listed as skipped.
2. share -- k = 1 / 4 / 8 processes training the small_cnn batch-16 cell at once on the
   device (``throughput.share_rates``: eager, one thread each, timed windows started
   together by a barrier): summed images/s, what ``cells_per_gpu`` buys.
3. syncs -- ``torch.profiler`` over N steps of the small_cnn batch-16 cell as the training
   loop runs them between logging steps (``train.one_step``), eager and compiled: CUDA
   calls that block the host (cudaStreamSynchronize, cudaDeviceSynchronize,
   cudaEventSynchronize, synchronous cudaMemcpy, the driver's cu* forms) and
   device-to-host copies per step, with the op each came from; kernel and graph launches
   per step, and the kernels the GPU ran.  The design claims zero between logging steps.
   On the CPU the profiler sees no CUDA calls: the row says so.
4. knn -- the InstDisc kNN (``evaluate.knn_search`` / ``knn_eval``) on features of the
   default study's size (10k x 2,048 train, 2k test, random around class centres: no
   exact ties, checked) by the GPU backend (faiss-gpu if it sees the GPU, else torch on
   CUDA) and the CPU backend (faiss-cpu if installed, else torch on the CPU): identical
   neighbours (fraction), identical accuracies, the time of each.
5. cli -- two cells (InfoNCE, DCL) end to end through ``python -m smallbatch`` on a
   generated CIFAR-10 (``synthetic.write_cifar10``: 5,000 + 1,000 32x32 images in the real
   ``cifar-10-batches-py`` pickles, the class drawn as the stripes' orientation):
   ``prepare-data`` (torchvision's md5 comparison skipped: generated files cannot match
   it), ``pretrain`` and ``evaluate`` with ``--tracking-uri none`` on the device
   (cifar10.yaml's resnet18_cifar in bf16, batch 256, 10 epochs): status, seconds, kNN and
   linear top-1.  A command that fails fails the section, with its error.

Output: one markdown table per section and a summary last, to stdout, to ``--out FILE``
and to ``$OUT/gpu_check.md`` when OUT is set, rewritten after every section (a run stopped
at its limit keeps what it measured); the rows as JSON in ``$OUT/gpu_check.json``; every
section's stderr in ``$OUT/gpu_check.log``.

Options: ``--quick`` (tiny sizes, few steps, one small_cnn compile and no ResNet compile,
k = 1 / 2: for a CPU and the tests), ``--device auto|cuda|cpu``, ``--out FILE``,
``--only SECTION ...`` (rerun some sections), ``--budget SECONDS`` (the whole run, default
450, --quick 1200; each other section has a cap, --quick half the budget, and the throughput
section, run last, gets what they left).

    PYTHONPATH=src python benchmarks/gpu_check.py --quick --device cpu
    # a shared 2-core CPU: ~1.5 minutes, ~2.5 with an empty inductor cache (tests/test_gpu_check.py)

Written in a session without a GPU: the GPU path of sections 1-5 has run only here, on the
CPU, and the CUDA-call counting on a hand-written trace; the first device run is its test.

On the device machine (nvidia-h200: Python 3.12, torch 2.11; no jsonschema, mlflow,
snakemake or faiss, no index to install from).  Preparation, once, here, in the
repository's root (the checkout the session runs from):

    bash benchmarks/gpu_check_wheels.sh    # .whl/: jsonschema + attrs, jsonschema-specifications,
                                           # referencing, rpds-py; faiss-cpu (~18.5 MiB in all)

faiss-gpu 1.15.1 is not carried: its wheel alone is 129 MiB (plus the CUDA 12 runtime
wheels it needs), over the 64 MiB a run may carry; the GPU kNN side is torch on CUDA.
Then the device tool's ``run`` with ``carry: [".whl"]`` and ``timeout_s: 600``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 || exit; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv; python3 benchmarks/gpu_check.py --device cuda

About 7 minutes (the 450 s budget, plus installs); it prints the report last (the tool's
output_tail) and leaves gpu_check.md, .json and .log under $OUT.  A rerun of some sections
only, on the still-warm machine: ``... gpu_check.py --device cuda --only syncs cli --budget 200``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # throughput.py
sys.path.insert(0, str(ROOT / "tests"))  # synthetic.py: data in the real formats

#: sections in the report's order; RUN_ORDER runs the compile-heavy throughput last, with what is left
TITLES = {
    "machine": "0. Machine",
    "throughput": "1. Training-step throughput (synthetic uint8 images)",
    "share": "2. k cells sharing the device",
    "syncs": "3. Host synchronisations and launches per training step",
    "knn": "4. kNN: GPU backend vs CPU backend",
    "cli": "5. Two cells end to end through the CLI (generated CIFAR-10)",
}
RUN_ORDER = ["machine", "syncs", "knn", "share", "cli", "throughput"]
MODELS = {"small_cnn": ("fashion_mnist", 1, 16), "resnet18_cifar": ("cifar10", 3, 32)}  # dataset, channels, px
WINDOW = "gpu_check.steps"  # the profiler range around the profiled steps


# --------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Plan:
    """Every size of a run (full: the H200; quick: a CPU and the tests)."""

    quick: bool
    images: int  # synthetic images a throughput cell indexes
    batches: dict  # model -> batch sizes
    steps: dict  # (model, batch) -> timed steps
    compiled: list  # (model, batch, precision) compiled, in the order they run
    skipped: dict  # (model, precision) -> why it is not compiled
    compile_guess_s: dict  # model -> seconds a compile is assumed to take before one is seen
    share_k: tuple
    share_steps: int
    profile_steps: int
    knn: tuple  # n_train, n_test, dim, ks
    cifar: tuple  # images per training batch file (x5), test images
    cli_batch: int
    caps: dict = field(default_factory=dict)  # section -> seconds
    budget: float = 450.0


def make_plan(quick: bool, budget: float | None = None) -> Plan:
    if quick:
        budget = budget or 1200.0
        return Plan(
            quick=True,
            images=128,
            batches={"small_cnn": (16, 32), "resnet18_cifar": (2, 4)},
            steps={("small_cnn", 16): 3, ("small_cnn", 32): 2, ("resnet18_cifar", 2): 1, ("resnet18_cifar", 4): 1},
            compiled=[("small_cnn", 16, "fp32")],
            skipped={
                ("small_cnn", "bf16"): "--quick: one small_cnn compile only",
                ("resnet18_cifar", "fp32"): "--quick: no ResNet compile",
                ("resnet18_cifar", "bf16"): "--quick: no ResNet compile",
            },
            compile_guess_s={"small_cnn": 120.0, "resnet18_cifar": 600.0},
            share_k=(1, 2),
            share_steps=5,
            profile_steps=3,
            knn=(1000, 200, 64, (5, 20)),
            cifar=(40, 50),
            cli_batch=32,
            # a section may take half the run (a CPU's speed varies with its load; one hung
            # section still leaves the others half the budget)
            caps={s: budget / 2 for s in TITLES},
            budget=budget,
        )
    return Plan(
        quick=False,
        images=10000,
        batches={"small_cnn": (16, 256), "resnet18_cifar": (256, 1024)},
        steps={
            ("small_cnn", 16): 500,
            ("small_cnn", 256): 200,
            ("resnet18_cifar", 256): 40,
            ("resnet18_cifar", 1024): 15,
        },
        compiled=[
            ("small_cnn", 16, "fp32"),
            ("small_cnn", 256, "fp32"),
            ("resnet18_cifar", 256, "bf16"),
            ("resnet18_cifar", 1024, "bf16"),
        ],
        skipped={
            ("small_cnn", "bf16"): "the default study trains small_cnn in fp32",
            ("resnet18_cifar", "fp32"): "cifar10.yaml trains resnet18_cifar in bf16",
        },
        compile_guess_s={"small_cnn": 60.0, "resnet18_cifar": 150.0},
        share_k=(1, 4, 8),
        share_steps=500,
        profile_steps=20,
        knn=(10000, 2000, 2048, (20, 200)),
        cifar=(1000, 1000),
        cli_batch=256,
        caps={"machine": 30.0, "syncs": 120.0, "knn": 60.0, "share": 90.0, "cli": 120.0},
        budget=budget or 450.0,
    )


# --------------------------------------------------------------------------- section 0
def section_machine(args, plan: Plan):
    import platform

    import torch

    yield {"what": "mode", "value": f"{'quick' if plan.quick else 'full'}, device {args.device}"}
    yield {"what": "python", "value": platform.python_version()}
    yield {
        "what": "torch",
        "value": f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})",
    }
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        yield {
            "what": "GPU",
            "value": f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
            f"capability {p.major}.{p.minor}, {p.multi_processor_count} SMs",
        }
    yield {"what": "faiss", "value": _faiss_line()}
    for name in ("jsonschema", "mlflow", "snakemake"):
        yield {"what": name, "value": _version_of(name)}


def _faiss_line() -> str:
    try:
        import faiss
    except ImportError:
        return "not installed: kNN sides are torch on the GPU and on the CPU"
    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    return f"{faiss.__version__}, GPUs faiss sees: {gpus}"


def _version_of(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- section 1
def throughput_cases(plan: Plan) -> list[tuple[str, int, str, bool]]:
    """(model, batch, precision, compiled): every eager case, then the planned compiles."""
    eager = [(m, b, p, False) for m, bs in plan.batches.items() for b in bs for p in ("fp32", "bf16")]
    return eager + [(m, b, p, True) for m, b, p in plan.compiled]


def section_throughput(args, plan: Plan):
    import synthetic
    import throughput

    _threads(args.device)
    images = {m: synthetic.random_images(plan.images, c, px) for m, (_, c, px) in MODELS.items()}
    eager_rows: dict = {}  # (model, batch, precision) -> its eager row
    need = dict(plan.compile_guess_s)  # model -> seconds a compile is expected to take
    for model, bs, prec, compiled in throughput_cases(plan):
        row = {
            "model": model,
            "input": f"{MODELS[model][2]} px x {MODELS[model][1]}",
            "batch": bs,
            "precision": prec,
            "step": "compiled" if compiled else "eager",
        }
        if compiled and time.time() + need[model] > args.deadline:
            yield {**row, "note": f"skipped: a compile (~{need[model]:.0f} s) would overrun the run's budget"}
            continue
        rate, warm, cache = _step_rate(
            throughput, model, bs, prec, compiled, images[model], args.device, plan.steps[(model, bs)]
        )
        row.update({"images/s": rate, "ms/step": 1000 * bs / rate, "build + 2 steps s": warm})
        if compiled:
            eager = eager_rows.get((model, bs, prec))
            compile_s = warm - eager["build + 2 steps s"] if eager else warm
            need[model] = 1.2 * max(compile_s, 1.0)
            row.update(
                {
                    "x eager": rate / eager["images/s"] if eager else None,
                    "compile s": compile_s,
                    "FX cache hit/miss": cache,
                }
            )
        else:
            eager_rows[(model, bs, prec)] = row
        yield row
    for (model, prec), why in plan.skipped.items():
        yield {"model": model, "precision": prec, "step": "compiled", "note": f"not compiled: {why}"}


def _step_rate(throughput, model: str, bs: int, prec: str, compiled: bool, data, device: str, steps: int):
    """(images/s, build + 2 steps s, 'hits/misses' of the FX-graph cache or None) of one case."""
    import gc

    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a fresh compile per case (and no recompile limit across cases)
    before = dict(counters["inductor"])
    cell = throughput.study_cell(bs, compiled, device, MODELS[model][0], precision=prec)
    rate, warm = throughput.step_rate(cell, *data, steps)
    after = counters["inductor"]
    cache = (
        f"{after['fxgraph_cache_hit'] - before.get('fxgraph_cache_hit', 0)}/"
        f"{after['fxgraph_cache_miss'] - before.get('fxgraph_cache_miss', 0)}"
    )
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rate, warm, cache if compiled else None


def _threads(device: str) -> None:
    """One torch thread on the CPU (a shared machine); the GPU machine keeps its default."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)


# --------------------------------------------------------------------------- section 2
def section_share(args, plan: Plan):
    import throughput

    common = throughput.one_cell_args(16, plan.share_steps, 1, args.device, synthetic=True)
    base = None
    for k in plan.share_k:
        try:
            rates = throughput.share_rates(common, [k])[k]
        except SystemExit as exc:  # throughput._in_subprocess's way to fail
            raise RuntimeError(str(exc)) from None
        base = base or sum(rates) / k
        yield {
            "cells at once": k,
            "summed images/s": sum(rates),
            "per cell images/s min": min(rates),
            "per cell images/s max": max(rates),
            "x one cell": sum(rates) / base,
            "note": f"small_cnn batch-16 cells, eager, one process and thread each, {plan.share_steps} "
            "timed steps each, windows started together",
        }


# --------------------------------------------------------------------------- section 3
def section_syncs(args, plan: Plan):
    import synthetic
    import throughput
    import torch

    from smallbatch.study.cell import Cell
    from smallbatch.training import loop as train

    _threads(args.device)
    images, mean, std = synthetic.random_images(plan.images, 1, 16)
    unseen = []
    for compiled in (False, True):
        cell = throughput.study_cell(16, compiled, args.device)
        t0 = time.perf_counter()
        t = train.build_training(
            Cell.of(cell), images, mean, std, train.resolve_device(args.device), Path(tempfile.mkdtemp())
        )
        _loop_steps(t, 3)  # compile, CUDA-graph warm-up and recording happen here
        if t.dev.type == "cuda":
            torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        counts = count_cuda_calls(_profile(t, plan.profile_steps), plan.profile_steps)
        row = {
            "step": "compiled" if compiled else "eager",
            "steps profiled": plan.profile_steps,
            **counts,
            "build + 3 steps s": warm,
        }
        if args.device != "cuda":
            row["note"] = (
                "no CUDA on this run: the profiler records no CUDA calls, so the CUDA counts are 0 "
                "by construction, not a measurement of the GPU path"
            )
        elif counts["CUDA calls/step"] == 0:  # CUPTI off: zero syncs would be a false reading
            row["note"] = "the profiler recorded no CUDA calls on a CUDA run: these counts measure nothing"
            unseen.append(row["step"])
        yield row
        del t
        torch._dynamo.reset()
    if unseen:
        raise RuntimeError(f"torch.profiler saw no CUDA runtime/driver calls in the {' and '.join(unseen)} steps")


def _loop_steps(t, n: int) -> None:
    """``n`` steps as the training loop runs them between two logging steps."""
    import torch

    from smallbatch.training import loop as train

    bs = t.cell.batch_size
    perm = torch.randperm(t.images.shape[0], device=t.dev)
    for _ in range(n):
        pos = t.step % t.steps_per_epoch
        train.one_step(t, perm[pos * bs : (pos + 1) * bs], watch=False)


def _profile(t, n: int) -> list[dict]:
    """The profiler's trace events of ``n`` loop steps (the steps inside the range WINDOW)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = t.dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with record_function(WINDOW):
            _loop_steps(t, n)
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        return json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]


#: CUDA runtime/driver calls that return only once the device has caught up (cudaFree
#: synchronises the device implicitly; a synchronous cudaMemcpy waits for the stream)
SYNC_CALLS = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpy2D",
    "cudaFree",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
    "cuMemcpyDtoH",
    "cuMemcpyDtoH_v2",
    "cuMemFree",
    "cuMemFree_v2",
}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}


def count_cuda_calls(events: list[dict], steps: int) -> dict:
    """Per step: host syncs, copies (all; device-to-host and host-to-device by the copy the
    GPU ran, matched by correlation id), kernel and graph launches -- the CUDA runtime and
    driver calls inside the WINDOW range --, the kernels the GPU ran and the aten ops
    dispatched; and, for each sync or D->H copy, the call and the outermost op around it."""
    win = next((e for e in events if e.get("name") == WINDOW and e.get("cat") == "user_annotation"), None)
    if win is None:
        raise RuntimeError(f"the profiler's trace has no {WINDOW!r} range")
    lo, hi = win["ts"], win["ts"] + win["dur"]
    inside = [e for e in events if e.get("ph") == "X" and lo <= e.get("ts", -1.0) <= hi]
    calls = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    on_gpu = {e.get("args", {}).get("correlation"): e["name"] for e in events if e.get("cat") == "gpu_memcpy"}
    copies = [(e, on_gpu.get(e.get("args", {}).get("correlation"), "")) for e in calls if "emcpy" in e["name"]]
    syncs = [e for e in calls if e["name"] in SYNC_CALLS]
    d2h = [e for e, what in copies if "DtoH" in what]
    ops = [e for e in inside if e.get("cat") == "cpu_op"]
    return {
        "CUDA calls/step": len(calls) / steps,
        "host syncs/step": len(syncs) / steps,
        "D->H copies/step": len(d2h) / steps,
        "copies/step": len(copies) / steps,
        "H->D copies/step": sum("HtoD" in w for _, w in copies) / steps,
        "kernel launches/step": sum(
            e["name"].startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperative")) for e in calls
        )
        / steps,
        "graph launches/step": sum(e["name"] in GRAPH_LAUNCHES for e in calls) / steps,
        "GPU kernels/step": sum(e.get("cat") == "kernel" for e in events) / steps,
        "aten ops/step": len(ops) / steps,
        "syncs and D->H copies (in op)": _origins(syncs + d2h, ops),
    }


def _origins(calls: list[dict], ops: list[dict]) -> str:
    """'call in op xN, ...' with the outermost aten op (same thread) around each call."""
    from collections import Counter

    def outer(e: dict) -> str:
        around = [
            o
            for o in ops
            if o.get("tid") == e.get("tid")
            and o["ts"] <= e["ts"]
            and o["ts"] + o.get("dur", 0) >= e["ts"] + e.get("dur", 0)
        ]
        return max(around, key=lambda o: o.get("dur", 0))["name"] if around else "no op"

    found = Counter(f"{e['name']} in {outer(e)}" for e in calls)
    return ", ".join(f"{what} x{n}" for what, n in found.most_common()) or "none"


# --------------------------------------------------------------------------- section 4
def section_knn(args, plan: Plan):
    import synthetic

    n_train, n_test, dim, ks = plan.knn
    feats = synthetic.clustered_features(n_train, n_test, dim, seed=0)
    cpu, gpu = _cpu_knn_backend(), _gpu_knn_backend(args.device)
    ref = _knn_side(feats, ks, *cpu)
    got = _knn_side(feats, ks, *gpu)
    ties = _exact_ties(feats, max(ks), *cpu)
    for side, label in ((ref, "CPU reference"), (got, "GPU side")):
        row = {
            "side": label,
            "backend": side["backend"],
            "search s": side["search_s"],
            "kNN eval s": side["eval_s"],
            **{f"top-1 k={k} %": 100 * side["metrics"][f"top1_k{k}"] for k in ks},
        }
        if side is got:
            row.update(_agreement(got, ref))
        yield row
    yield {
        "side": "features",
        "backend": f"{n_train} x {dim} train, {n_test} test, 10 classes",
        "note": f"test rows with an exact tie among their top {max(ks) + 1} similarities: {ties} "
        f"(ties may order differently; {ref['idx'].size} neighbour entries compared)",
    }


def _agreement(got: dict, ref: dict) -> dict:
    """How far two searches agree: neighbour entries (index at each rank), whole lists,
    sets (order within a list aside: float rounding may swap near-equal similarities),
    the largest similarity difference at equal rank, and every accuracy."""
    import numpy as np

    same = got["idx"] == ref["idx"]
    sets = (np.sort(got["idx"], axis=1) == np.sort(ref["idx"], axis=1)).all(axis=1)
    return {
        "identical neighbours (entries)": float(same.mean()),
        "identical neighbour lists (rows)": float(same.all(axis=1).mean()),
        "identical neighbour sets (rows)": float(sets.mean()),
        "max abs similarity difference": float(np.abs(got["sims"] - ref["sims"]).max()),
        "identical accuracies": all(got["metrics"][m] == ref["metrics"][m] for m in ref["metrics"]),
    }


def _cpu_knn_backend() -> tuple[str, str | None]:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return "torch", "cpu"
    return "faiss-cpu", None


def _gpu_knn_backend(device: str) -> tuple[str, str | None]:
    """faiss-gpu when faiss sees a GPU, else torch on ``device`` (CUDA on the GPU machine)."""
    try:
        import faiss
    except ImportError:
        faiss = None
    if device == "cuda" and faiss is not None and getattr(faiss, "get_num_gpus", lambda: 0)() > 0:
        return "faiss-gpu", None
    return "torch", device


def _knn_side(feats, ks, backend: str, device: str | None) -> dict:
    """Neighbours (numpy), timed search and timed kNN evaluation by one backend (after a
    small warm-up call: CUDA context, cuBLAS handles)."""
    import torch

    from smallbatch.evaluation import knn

    tr, ytr, te, yte = feats
    knn.knn_search(tr[:64], te[:8], 4, backend=backend, device=device)
    t0 = time.perf_counter()
    sims, idx = knn.knn_search(tr, te, max(ks), backend=backend, device=device)
    idx = idx.cpu().numpy()  # waits for the device
    search_s = time.perf_counter() - t0
    sims = sims.cpu().numpy()
    t0 = time.perf_counter()
    metrics = knn.knn_eval(tr, ytr, te, yte, ks=ks, t=0.1, backend=backend, device=device)
    eval_s = time.perf_counter() - t0
    name = backend if device is None else f"{backend} on {torch.device(device)}"
    return {"backend": name, "idx": idx, "sims": sims, "search_s": search_s, "eval_s": eval_s, "metrics": metrics}


def _exact_ties(feats, k: int, backend: str, device: str | None) -> int:
    """Test rows whose k+1 most similar train rows include two equal similarities."""
    import numpy as np

    from smallbatch.evaluation import knn

    sims, _ = knn.knn_search(feats[0], feats[2], k + 1, backend=backend, device=device)
    return int((np.diff(sims.cpu().numpy(), axis=1) == 0).any(axis=1).sum())


# --------------------------------------------------------------------------- section 5
def section_cli(args, plan: Plan):
    with tempfile.TemporaryDirectory(prefix="gpu_check_cli_") as work:
        yield from _cli_cells(Path(work), args, plan)


def _cli_cells(work: Path, args, plan: Plan):
    """The data set, its cache, then pretrain + evaluate of each cell: one row per command."""
    import synthetic

    per_batch, test = plan.cifar
    synthetic.write_cifar10(work / "data", per_batch, test, images=synthetic.striped_images)
    config = cli_config(work, plan, args.device)
    cache = work / "cifar10.pt"
    out, s = _cli(
        ["prepare-data", "--config", str(config), "--dataset", "cifar10", "--out", str(cache)], without_md5=True
    )
    yield {
        "cell": f"cifar10 ({out['train']} train, {out['test']} test, {out['shape']})",
        "step": "prepare-data",
        "status": "written",
        "seconds": s,
    }
    for loss in ("infonce", "dcl"):
        cell = cli_cell_args(config, loss, plan)
        run = work / "runs" / loss
        common = ["--data-cache", str(cache), "--tracking-uri", "none", "--device", args.device]
        res, s = _cli(["pretrain", *cell, *common, "--out", str(run), "--no-progress"])
        yield {
            "cell": res["cell_id"],
            "step": "pretrain",
            "status": res["status"],
            "seconds": s,
            "steps": res["steps"],
            "images/s": res["images_per_s"],
            "final loss": res["final_loss"],
        }
        res, s = _cli(["evaluate", *cell, *common, "--checkpoint", str(run / "checkpoint.pt"), "--out-dir", str(run)])
        knn, lin = res["knn"], res["linear"]
        yield {
            "cell": knn["cell_id"],
            "step": "evaluate",
            "status": f"{knn['status']} / {lin['status']}",
            "seconds": s,
            **{k.replace("knn/top1_", "kNN top-1 %, "): v for k, v in knn.items() if k.startswith("knn/top1_k")},
            "linear top-1 %": lin["linear/top1"],
        }


def cli_cell_args(config: Path, loss: str, plan: Plan) -> list[str]:
    """The flags that name a section-5 cell (a stand-alone cell of ``config``)."""
    return [
        "--config",
        str(config),
        "--dataset",
        "cifar10",
        "--loss",
        loss,
        "--batch-size",
        str(plan.cli_batch),
        "--temperature",
        "0.5",
        "--seed",
        "0",
    ]


def cli_config(work: Path, plan: Plan, device: str) -> Path:
    """cifar10.yaml with a short budget (quick: a tiny small_cnn) and this run's folders."""
    import yaml

    from smallbatch.study.config import deep_merge, read_config_file

    train = {"epochs": 10, "warmup_epochs": 1}
    extra = {}
    if plan.quick:
        train = {
            "backbone": "small_cnn",
            "width": 8,
            "proj_hidden": 32,
            "proj_dim": 16,
            "precision": "fp32",
            "optimizer": "adam",
            "lr": 0.001,
            "lr_scaling": "none",
            "epochs": 1,
            "warmup_epochs": 0.1,
        }
        extra = {"eval": {"knn_k": [5, 20], "linear_iterations": 10, "batch_size": 256}}
    cfg = deep_merge(
        read_config_file(ROOT / "workflow/configs/cifar10.yaml"),
        {
            "study": "gpu-check",
            "results_dir": str(work / "results"),
            "device": device,
            "threads": 1 if device == "cpu" else 4,
            "data": {"root": str(work / "data")},
            "train": train,
            **extra,
        },
    )
    path = work / "check.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(argv: list[str], without_md5: bool = False) -> tuple[dict, float]:
    """(the JSON a ``smallbatch`` command printed last, its seconds); RuntimeError with its
    error when it fails."""
    entry = [__file__, "--cli-without-md5"] if without_md5 else ["-m", "smallbatch"]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *entry, *argv], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    if out.returncode:
        tail = "\n".join(out.stderr.strip().splitlines()[-12:])
        raise RuntimeError(f"smallbatch {argv[0]} failed (exit {out.returncode}):\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1]), seconds


def cli_without_md5(argv: list[str]) -> int:
    """``smallbatch ARGV`` with torchvision's CIFAR md5 comparison skipped (generated files)."""
    import synthetic
    import torchvision.datasets.cifar as cifar

    from smallbatch.pipeline import cli

    cifar.check_integrity = synthetic.existence_only_check
    return cli.main(argv)


SECTIONS = {
    "machine": section_machine,
    "throughput": section_throughput,
    "share": section_share,
    "syncs": section_syncs,
    "knn": section_knn,
    "cli": section_cli,
}


# --------------------------------------------------------------------------- running the sections
@dataclass
class Outcome:
    rows: list
    ok: bool
    seconds: float
    error: str = ""
    stderr: str = ""


def run_section(name: str, args, limit: float) -> Outcome:
    """Section ``name`` in a process of its own, killed (with its children) after ``limit`` s."""
    cmd = [
        sys.executable,
        __file__,
        "--section",
        name,
        "--device",
        args.device,
        "--deadline",
        str(time.time() + limit - 5),
    ] + (["--quick"] if args.quick else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=os.setpgrp
    )  # a group of its own: killed with its children
    try:
        out, err = proc.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    seconds = time.perf_counter() - t0
    if timed_out:
        return Outcome(rows, False, seconds, f"stopped after its limit of {limit:.0f} s", err)
    if proc.returncode:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        return Outcome(rows, False, seconds, last, err)
    return Outcome(rows, True, seconds, "", err)


def section_main(args) -> int:
    """(child) run one section, one ``ROW <json>`` line per row as it is measured."""
    plan = make_plan(args.quick, args.budget)
    for row in SECTIONS[args.section](args, plan):
        print("ROW " + json.dumps(row, default=str), flush=True)
    return 0


def orchestrate(args) -> int:
    from smallbatch.training.loop import resolve_device

    try:
        args.device = resolve_device(args.device).type
    except ValueError as exc:  # --device cuda without a GPU
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    plan = make_plan(args.quick, args.budget)
    names = [n for n in RUN_ORDER if not args.only or n in args.only]
    end = time.monotonic() + plan.budget
    outcomes: dict[str, Outcome] = {}
    for name in names:
        left = end - time.monotonic()
        limit = left if name == "throughput" else min(plan.caps.get(name, left), left)
        if limit < 10:
            outcomes[name] = Outcome([], False, 0.0, "not run: the run's budget is spent")
            continue
        print(f"gpu_check: {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        outcomes[name] = run_section(name, args, limit)
        o = outcomes[name]
        print(
            f"gpu_check: {name} {'ok' if o.ok else 'FAILED: ' + o.error} ({o.seconds:.0f} s, {len(o.rows)} rows)",
            file=sys.stderr,
            flush=True,
        )
        write_outputs(outcomes, args)
    print(report(outcomes, args), end="")
    return 0 if all(o.ok for o in outcomes.values()) else 1


# --------------------------------------------------------------------------- the report
def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "/")


def table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def report(outcomes: dict, args) -> str:
    """Each section's table (and a failed one's error), then the summary: last, where a
    terminal's or the device tool's tail of the output keeps it."""
    parts = [f"# smallbatch GPU check ({'quick' if args.quick else 'full'}, device {args.device})"]
    for name, o in _in_title_order(outcomes):
        parts += ["", f"## {TITLES[name]}", ""]
        if o.rows:
            parts.append(table(o.rows))
        if not o.ok:
            tail = "\n".join(o.stderr.strip().splitlines()[-15:])
            parts += ["", f"**FAILED**: {o.error}", "", "```", tail, "```"]
    parts += [
        "",
        "## Summary",
        "",
        table(
            [
                {
                    "section": TITLES[n],
                    "status": "ok" if o.ok else "FAILED",
                    "seconds": o.seconds,
                    "rows": len(o.rows),
                    "error": o.error,
                }
                for n, o in _in_title_order(outcomes)
            ]
        ),
    ]
    return "\n".join(parts) + "\n"


def _in_title_order(outcomes: dict):
    return [(n, outcomes[n]) for n in TITLES if n in outcomes]


def write_outputs(outcomes: dict, args) -> None:
    """The report to --out and $OUT/gpu_check.md, the rows to $OUT/gpu_check.json, the
    sections' stderr to $OUT/gpu_check.log."""
    text = report(outcomes, args)
    if args.out:
        Path(args.out).write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.md").write_text(text)
        Path(out, "gpu_check.json").write_text(
            json.dumps(
                {n: {"ok": o.ok, "seconds": o.seconds, "error": o.error, "rows": o.rows} for n, o in outcomes.items()},
                indent=1,
                default=str,
            )
        )
        Path(out, "gpu_check.log").write_text("".join(f"===== {n}\n{o.stderr}\n" for n, o in outcomes.items()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli-without-md5"]:
        return cli_without_md5(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (a CPU, the tests)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--only", nargs="+", choices=list(TITLES), help="run only these sections")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 450; --quick 1200)")
    p.add_argument("--section", choices=list(TITLES), help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.section:
        return section_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
