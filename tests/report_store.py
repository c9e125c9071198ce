"""Synthetic MLflow stores for the report's tests (no training: every value is designed).

``StoreBuilder`` logs runs through ``MlflowClient`` exactly per the tracking
schema (tags ``smallbatch.*``, params as ``cells.flat_params`` writes them,
per-step histories, final kNN/linear top-1 in percent).

``build_golden_store`` logs one store that exercises every report section
(grid with a τ axis, two seeds, loss parameters and an extra axis; baselines;
the papers; diverged and failed runs; precision; ksweep; ess; tsweep; mi).  The
report built from it is committed under ``tests/fixtures/report_golden/``
(tables and index.md, run ids replaced by ``run-NNN``) and
``tests/report/test_report_golden.py`` rebuilds both and compares bytes.

Regenerate the golden files (only when a change of the report's output is
intended, in its own commit that says which bytes changed and why)::

    PYTHONPATH=src python tests/report_store.py --write
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "report_golden"
#: the store and the report, relative to the working directory the golden build runs in
GOLDEN_URI, GOLDEN_OUT, GOLDEN_EXPERIMENT = "sqlite:///mlflow.db", "report", "golden"


class StoreBuilder:
    """Logs runs through MlflowClient the way smallbatch.tracking does (one log_batch per run).

    Histories are logged at steps ``first_step, first_step + 1, ...``; final metrics
    one step after the last history step.
    """

    def __init__(self, uri: str, experiment: str = "smallbatch", first_step: int = 0):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.exp = self.client.create_experiment(experiment, tags={"smallbatch.format": "2"})  # the current format
        self.clock = 1_700_000_000_000
        self.first_step = first_step
        self.logged: list[dict] = []

    def run(
        self,
        cell_id: str,
        *,
        kind: str = "cell",
        section: str = "grid",
        status: str = "finished",
        params: dict | None = None,
        final: dict | None = None,
        history: dict | None = None,
        baseline: str | None = None,
        tags: dict | None = None,
    ) -> str:
        from mlflow.entities import Metric, Param, RunTag

        self.clock += 1000
        tags = {
            "smallbatch.cell_id": cell_id,
            "smallbatch.cell_hash": f"h{len(self.logged)}",
            "smallbatch.kind": kind,
            "smallbatch.status": status,
            "smallbatch.experiment": section,
            "smallbatch.git_commit": "test",
            **(tags or {}),
        }
        if baseline:
            tags["smallbatch.baseline"] = baseline
        r = self.client.create_run(self.exp, run_name=cell_id, start_time=self.clock, tags=tags)
        rid = r.info.run_id
        metrics = []
        for key, values in (history or {}).items():
            metrics += [Metric(key, float(v), self.clock + s, s) for s, v in enumerate(values, self.first_step)]
        n = len(next(iter(history.values()))) + self.first_step if history else 1
        metrics += [Metric(k, float(v), self.clock + n, n) for k, v in (final or {}).items()]
        ps = [Param(k, str(v)) for k, v in (params or {}).items()]
        for i in range(0, max(len(metrics), 1), 1000):
            self.client.log_batch(
                rid,
                metrics=metrics[i : i + 1000],
                params=ps if i == 0 else [],
                tags=[RunTag("mlflow.note.content", "synthetic")] if i == 0 else [],
            )
        self.client.set_terminated(rid, status="FINISHED")
        self.logged.append(
            {
                "run_id": rid,
                "cell_id": cell_id,
                "kind": kind,
                "section": section,
                "status": status,
                "params": params or {},
                "final": final or {},
            }
        )
        return rid


# --------------------------------------------------------------------------- the golden store's design
N_IMAGES = 1797
LOSS_PARAMS = {
    "infonce": {},
    "flatnce": {"loss.gamma": 1.0},
    "dcl": {},
    "dclw": {"loss.sigma": 0.5},
    "dclw-sigma1": {"loss.sigma": 1.0},
    "eqco-alpha256": {"loss.alpha": 256},
}
BASE = {"infonce": 80.0, "flatnce": 78.0, "dcl": 79.0, "dclw": 79.5, "eqco": 77.0}


def _loss(variant: str) -> str:
    return variant.split("-")[0]


def _params(section: str, dataset: str, variant: str, bs: int, t: float, seed: int, **train) -> dict:
    p = {
        "experiment": section,
        "dataset": dataset,
        "loss": _loss(variant),
        "batch_size": bs,
        "temperature": t,
        "seed": seed,
        "negatives": train.get("queue_size") or 2 * bs - 2,
        "queue_size": 0,
        "precision": "fp32",
        "epochs": 20,
        "backbone": "small_cnn",
        "lr_scaling": "sqrt",
        "pretrain_images": N_IMAGES,
        **LOSS_PARAMS.get(variant, {}),
    }
    p.update(train)
    return p


def _top1(variant: str, bs: int, t: float, seed: int, slope: float) -> dict:
    lin = BASE[_loss(variant)] - slope * math.log2(256 / bs) - 4.0 * (t - 0.1) + (0.4 if seed == 0 else -0.3)
    lin += 0.05 * seed * (bs % 7) + (0.7 if variant == "dclw-sigma1" else 0.0)
    return {"linear/top1": lin, "knn/top1": lin - 3.0 + 0.1 * seed}


def _representation(variant: str, bs: int, t: float, seed: int) -> dict:
    """Designed ``repr/*`` values of a cell (what the evaluation measures): smoother, lower-rank
    representations at a small batch, a seed's offset, a loss's own level."""
    x = math.log2(256 / bs) / 4  # 0 at B = 256, 1 at B = 16
    k = list(LOSS_PARAMS).index(variant)
    out = {
        "projection_alignment": 0.40 + 0.15 * x + 0.02 * k + 0.01 * seed,
        "projection_uniformity": -3.2 + 0.6 * x + 0.05 * k - 0.02 * seed + t,
        "features_rankme": 40.0 - 12.0 * x + k + 0.5 * seed,
        "projection_rankme": 20.0 - 6.0 * x + 0.5 * k + 0.25 * seed,
        "projection_neg_cos_sd": 0.20 + 0.05 * x + 0.01 * k + 0.005 * seed,
        "projection_neg_cos_mean": 0.02 * k + 0.01 * seed,
        "features_alignment": 0.30 + 0.1 * x + 0.01 * k,
        "features_uniformity": -2.8 + 0.5 * x + 0.02 * seed,
        "features_neg_cos_sd": 0.15 + 0.04 * x + 0.01 * seed,
    }
    return {f"repr/{key}": v for key, v in out.items()}


def _grid_history(bs: int, seed: int, steps: int = 12) -> dict:
    k = 2 * bs - 2
    x = np.linspace(0, 1, steps)
    return {
        "train/loss": np.log(k + 1) * (1 - 0.5 * x),
        "diag/mi_fraction": np.clip(0.2 + 0.7 * x * (1 + 0.1 * seed) * (64 / bs) ** 0.3, 0, 1),
        "diag/qb_mean": 1 - 0.5 * (16 / bs) ** 0.5 * (0.5 + 0.5 * x) + 0.01 * seed,
        "diag/ess": k * (0.2 + 0.5 * x) + seed,
        "diag/cov_rank": np.full(steps, float(min(bs - 1, 64))),
        "epoch": 20 * x,
    }


def _grid_digits(b: StoreBuilder) -> None:
    slopes = {"infonce": 2.5, "flatnce": 0.0, "dcl": 1.0, "dclw": 0.8, "eqco": 1.2}
    bad = {
        ("dcl", 16, 0.5, 0): "diverged",
        ("dcl", 16, 0.5, 1): "diverged",
        ("infonce", 64, 0.5, 1): "diverged",
        ("flatnce", 256, 0.5, 1): "failed",
    }
    # an older run of a cell that a newer run supersedes (changed config): must not count
    b.run(
        "digits/infonce/bs16-t0.1-s0",
        params=_params("grid", "digits", "infonce", 16, 0.1, 0),
        final={"knn/top1": 1.0, "linear/top1": 1.0},
    )
    for variant in LOSS_PARAMS:
        for bs in (16, 64, 256):
            for t in (0.1, 0.5):
                for seed in (0, 1):
                    status = bad.get((variant, bs, t, seed), "finished")
                    final = _top1(variant, bs, t, seed, slopes[_loss(variant)]) if status == "finished" else {}
                    if variant.startswith("eqco") and bs == 256 and t == 0.1:
                        final.pop("linear/top1")  # linear probe not run yet: pending
                    if status == "finished":
                        final.update(_representation(variant, bs, t, seed))
                    b.run(
                        f"digits/{variant}/bs{bs}-t{t:g}-s{seed}",
                        status=status,
                        final=final,
                        params=_params("grid", "digits", variant, bs, t, seed),
                        history=_grid_history(bs, seed),
                    )
    # an extra axis (epochs) for InfoNCE at tau 0.1
    for bs in (16, 256):
        for seed in (0, 1):
            fin = _top1("infonce", bs, 0.1, seed, 1.0)
            cost = {
                "train/wall_s": 3.0 * 256 / bs,
                "train/cpu_s": 5.0 * 256 / bs,
                "knn/seconds": 0.5,
                "knn/cpu_s": 0.75,
                "linear/seconds": 1.0,
                "linear/cpu_s": 1.5,
            }  # the cost table's numbers
            b.run(
                f"digits/infonce/bs{bs}-t0.1-s{seed}-ep40",
                final={**{k: v + 1.5 for k, v in fin.items()}, **cost},
                params=_params("grid", "digits", "infonce", bs, 0.1, seed, epochs=40),
                history=_grid_history(bs, seed),
            )
    # a run without a dataset param: counted in a note, not in the tables
    b.run(
        "digits/infonce/bs16-t0.1-s9",
        params={"loss": "infonce", "batch_size": 16, "temperature": 0.1},
        final={"knn/top1": 50.0},
    )


def _grid_fashion(b: StoreBuilder) -> None:
    """Flipped slopes, no histories, no baselines; one τ with a single batch size and seed."""
    slopes = {"infonce": 0.0, "flatnce": 2.5, "dcl": 1.0}
    for loss in slopes:
        for bs in (32, 128):
            for seed in (0, 1):
                b.run(
                    f"fashion_mnist/{loss}/bs{bs}-t0.1-s{seed}",
                    final=_top1(loss, bs, 0.1, seed, slopes[loss]),
                    params=_params("grid", "fashion_mnist", loss, bs, 0.1, seed),
                )
    for loss in ("infonce", "flatnce"):
        b.run(
            f"fashion_mnist/{loss}/bs32-t0.2-s0",
            final=_top1(loss, 32, 0.2, 0, slopes[loss]),
            params=_params("grid", "fashion_mnist", loss, 32, 0.2, 0),
        )


def _baselines(b: StoreBuilder) -> None:
    for (name, seed), (knn, lin) in {
        ("raw_pixels", 0): (71.0, 74.0),
        ("random_init", 0): (60.0, 76.5),
        ("random_init", 1): (61.0, 75.5),
    }.items():
        b.run(
            f"baselines/digits/{name}-s{seed}",
            kind="baseline",
            section="baseline",
            baseline=name,
            params={"dataset": "digits", "baseline": name, **({"seed": seed} if name != "raw_pixels" else {})},
            final={"knn/top1": knn, "linear/top1": lin, "baseline/wall_s": 2.0, "baseline/cpu_s": 3.0},
        )


def _epochs(steps: int = 6) -> np.ndarray:
    return np.linspace(20 / steps, 20, steps)


def _precision(b: StoreBuilder) -> None:
    """InfoNCE at B=16: fp32 70, bf16 66, fp64 78 (closes 80% of FlatNCE's 10-point lead)."""
    for loss in ("infonce", "flatnce"):
        for bs in (16, 256):
            for prec in ("fp64", "fp32", "bf16"):
                for seed in (0, 1):
                    noise = 0.3 if seed == 0 else -0.3
                    lin = (
                        80.0 + 5 * noise / 3
                        if loss == "flatnce"
                        else 79.0 + noise
                        if bs == 256
                        else {"fp32": 70.0, "bf16": 66.0, "fp64": 78.0}[prec] + noise
                    )
                    status = "diverged" if (loss, bs, prec, seed) == ("infonce", 16, "bf16", 1) else "finished"
                    err = (1e-2 if bs == 16 else 1e-6) if loss == "infonce" else 1e-7
                    err = err * (1 + 0.13 * np.arange(6)) * (1 + seed)  # means away from rounding ties
                    hist = {
                        "diag/grad_rel_err": err,
                        "diag/grad_rel_err_bf16": 1000 * err,
                        "epoch": _epochs(),
                        "train/loss": np.linspace(4, 3, 6),
                    }
                    b.run(
                        f"precision/digits/{loss}/bs{bs}-t0.1-s{seed}-{prec}",
                        section="precision",
                        status=status,
                        history=hist,
                        final={"linear/top1": lin, "knn/top1": lin - 3.0} if status == "finished" else {},
                        params=_params("precision", "digits", loss, bs, 0.1, seed, precision=prec, grad_error_every=20),
                    )


def _ksweep(b: StoreBuilder) -> None:
    drop = {"infonce": (0.0, 5.0, 10.0), "eqco-alpha256": (0.0, 0.3, 0.6), "dcl": (0.0, 1.0, 3.0)}
    base = {"infonce": 75.0, "eqco-alpha256": 74.0, "dcl": 74.5}
    for variant, drops in drop.items():
        for k, d in zip((4096, 256, 16), drops):
            for seed in (0,) if variant == "dcl" else (0, 1):
                lin = base[variant] - d + (0.2 if seed == 0 else -0.2)
                final = {"linear/top1": lin, "knn/top1": lin - 3.0}
                if (variant, k) == ("dcl", 256):
                    final.pop("linear/top1")
                b.run(
                    f"ksweep/digits/{variant}/bs32-t0.1-s{seed}-q{k}",
                    section="ksweep",
                    final=final,
                    history={"epoch": _epochs()},
                    params=_params("ksweep", "digits", variant, 32, 0.1, seed, queue_size=k),
                )


def _ess(b: StoreBuilder) -> None:
    x = np.linspace(0, 1, 6)
    for bs in (16, 256):
        for sched in (False, True):
            for seed in (0, 1):
                lin = (70.0 if bs == 16 else 80.0) + ((4.0 if bs == 16 else -0.5) if sched else 0.0) + seed
                if sched:
                    hist = {
                        "diag/ess": 0.9 - 0.6 * x + 0.001,
                        "diag/ess_target": 0.9 - 0.6 * x,
                        "train/tau": 0.5 - 0.45 * x,
                    }
                    extra = {"ess_schedule.start": 0.9, "ess_schedule.end": 0.3, "ess_schedule.rate": 1.0}
                else:
                    hist, extra = {"diag/ess": 0.5 - 0.2 * x, "train/tau": np.full(6, 0.1)}, {"ess_schedule": None}
                hist["epoch"] = _epochs()
                b.run(
                    f"ess/digits/flatnce/bs{bs}-t0.1-s{seed}" + ("-ess0.9to0.3" if sched else ""),
                    section="ess",
                    final={"linear/top1": lin, "knn/top1": lin - 3.0},
                    history=hist,
                    params=_params("ess", "digits", "flatnce", bs, 0.1, seed, **extra),
                )


def _tsweep(b: StoreBuilder) -> None:
    design = {"infonce": [60, 66, 70, 65, 62], "flatnce": [70, 71, 72, 71.5, 70.5], "dcl": [None, 72, 72.5, 72.2, 72.1]}
    for loss, vals in design.items():
        for t, v in zip((0.05, 0.1, 0.2, 0.5, 1.0), vals):
            b.run(
                f"tsweep/digits/{loss}/bs64-t{t:g}-s0",
                section="tsweep",
                history={"epoch": _epochs()},
                status="finished" if v is not None else "diverged",
                final={"linear/top1": v, "knn/top1": v - 3.0} if v is not None else {},
                params=_params("tsweep", "digits", loss, 64, t, 0),
            )


def _mi_estimate(est: str, critic: str, k: int, mi: float) -> tuple[float, float]:
    """(estimate, dual estimate) in nats: InfoNCE capped below log(K+1), EqCo above it, FlatNCE collapsing once."""
    cap = math.log(k + 1)
    if critic == "oracle":
        return min(mi, cap) * 0.97, math.nan
    if est == "infonce":
        return min(mi, cap) * 0.9 - 0.05, math.nan
    if est == "eqco":
        return (mi + 0.4 if k == 4 else mi * 0.95), math.nan
    return (-0.5 if (k, mi) == (64, 6.0) else min(mi, cap) * 0.85), mi + 0.5


def _mi(b: StoreBuilder) -> None:
    setup = {
        "dim": 4,
        "steps": 40,
        "lr": 0.005,
        "hidden": 16,
        "embed": 8,
        "layers": 2,
        "anchors": 32,
        "max_pairs": 1024,
        "eval_batches": 2,
    }
    rows = [(e, "separable") for e in ("infonce", "flatnce", "eqco")] + [("infonce", "oracle")]
    for est, critic in rows:
        for k in (4, 64):
            for mi in (1.0, 6.0):
                for seed in (0, 1) if (est, critic) == ("infonce", "separable") else (0,):
                    value, dual = _mi_estimate(est, critic, k, mi)
                    value += 0.02 * seed
                    ceiling = math.log(1025) if est == "eqco" else math.log(k + 1)
                    params = {
                        "estimator": est,
                        "critic": critic,
                        "K": k,
                        "negatives": k,
                        "true_mi": mi,
                        "seed": seed,
                        **setup,
                        **({"alpha": 1024.0} if est == "eqco" else {}),
                    }
                    final = {
                        "mi/estimate": value,
                        "mi/std": 0.05 + 0.01 * k / 64,
                        "mi/bias": value - mi,
                        "mi/variance": (0.05 + 0.01 * k / 64) ** 2,
                        "mi/ceiling": ceiling,
                        "mi/dual_estimate": dual,
                        "mi/dual_std": 0.1,
                        "mi/seconds": 1.5,
                        "mi/cpu_s": 2.5,
                    }
                    b.run(
                        f"mi/{est}/{critic}/K{k}-mi{mi:g}-s{seed}",
                        kind="mi",
                        section="mi",
                        params=params,
                        final={key: v for key, v in final.items() if np.isfinite(v)},
                        history={"mi/train_estimate": np.linspace(0, value, 5)},
                    )
    # a run that has not logged its estimate yet
    b.run(
        "mi/infonce/separable/K256-mi1-s0",
        kind="mi",
        section="mi",
        params={"estimator": "infonce", "critic": "separable", "K": 256, "true_mi": 1.0, "seed": 0},
    )


def build_golden_store(uri: str = GOLDEN_URI, experiment: str = GOLDEN_EXPERIMENT) -> dict[str, str]:
    """Log the golden store; return {run id: stable name ``run-NNN`` in logging order}."""
    b = StoreBuilder(uri, experiment, first_step=1)
    for part in (_grid_digits, _grid_fashion, _baselines, _precision, _ksweep, _ess, _tsweep, _mi):
        part(b)
    b.run(
        "custom/digits/infonce/bs16-t0.1-s0-fp64",
        section="custom",
        final={"knn/top1": 50.0},
        params=_params("custom", "digits", "infonce", 16, 0.1, 0, precision="fp64"),
    )
    # runs that hold no result, which the report leaves out: its own run and a parent of nested runs
    b.run("report", kind="report", section="report", final={"knn/top1": 1.0})
    b.run("mi", kind="parent", section="mi")
    return {r["run_id"]: f"run-{i:03d}" for i, r in enumerate(b.logged)}


def stable_text(path: Path, run_names: dict[str, str]) -> str:
    """A report file's text with every run id replaced by its stable name."""
    text = path.read_bytes().decode("utf-8")  # not read_text: it would turn \r\n into \n
    for rid, name in run_names.items():
        text = text.replace(rid, name)
    return text


def golden_outputs(report_dir: Path, run_names: dict[str, str]) -> dict[str, str]:
    """{relative path: stable text} of the files the golden test compares: tables/* and index.md."""
    files = sorted((report_dir / "tables").iterdir()) + [report_dir / "index.md"]
    return {p.relative_to(report_dir).as_posix(): stable_text(p, run_names) for p in files}


def build_golden_report(workdir: Path) -> dict[str, str]:
    """Log the golden store in ``workdir``, build its report there, return its golden outputs."""
    from smallbatch.report import build_report

    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        names = build_golden_store()
        build_report(GOLDEN_URI, GOLDEN_OUT, experiment=GOLDEN_EXPERIMENT)
        return golden_outputs(workdir / GOLDEN_OUT, names)
    finally:
        os.chdir(cwd)


def write_golden() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outputs = build_golden_report(Path(tmp))
    shutil.rmtree(GOLDEN, ignore_errors=True)
    for rel, text in outputs.items():
        (GOLDEN / rel).parent.mkdir(parents=True, exist_ok=True)
        (GOLDEN / rel).write_text(text, encoding="utf-8")
    print(f"wrote {len(outputs)} golden files to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=src python tests/report_store.py --write")
    write_golden()
