"""Linear-probe solvers side by side on real features files (``features.npz``), one run.

For every file, each solver runs the whole probe of ``smallbatch.evaluation.linear.linear_eval``
(standardise, fit, score) on one thread, the solvers one after the other per file (so load
from other processes hits both), and the table gives per solver:

* ``s``: seconds of the whole probe (best of ``--repeat``); ``it``: L-BFGS iterations;
* ``loss``: the regularised objective at the returned weights, in float64, and ``gap``:
  its excess over the converged reference's (``--reference`` iterations, ``tol`` 0);
* ``|g|``: the L2 norm of the objective's gradient there (float64);
* ``top1``, ``top5``, ``tr_top1``: test top-1/top-5 and train top-1 (percent);
* ``d_old``: test images whose predicted class differs from the first old row's, and
  ``dtop1``: correct test images minus that row's (the top-1 difference in images);
* ``d_ref``: test images whose predicted class differs from the converged reference's.

    python benchmarks/linear_probe.py results/runs/*/*/*/features.npz
    python benchmarks/linear_probe.py F.npz --solvers old@100,new@60,new@100,new@300 --reference 0
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

SOLVERS = {"old": "lbfgs", "new": "lbfgs-precond"}


def _probe(fs, c, optimizer, epochs, tol, weight_decay, repeat):
    """The probe of linear_eval, timed; returns seconds, metrics, fit, float64 train tensors."""
    import torch

    from smallbatch.evaluation.linear import _linear_probe

    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        metrics, fit, (xtr, ytr, xte, yte) = _linear_probe(
            fs.train_f,
            fs.train_y.astype(np.int64),
            fs.test_f,
            fs.test_y.astype(np.int64),
            c,
            optimizer=optimizer,
            epochs=epochs,
            lr=1.0,
            weight_decay=weight_decay,
            batch_size=None,
            seed=0,
            tol=tol,
            device=torch.device("cpu"),
        )
        secs = time.perf_counter() - t0
        best = secs if best is None else min(best, secs)
    return best, metrics, fit, (xtr, ytr, xte, yte)


def _exact(fit, tensors, weight_decay):
    """Float64 objective, gradient norm and test predictions at the fit's weights."""
    import torch

    from smallbatch.evaluation.linear import _softmax_loss_grad

    xtr, ytr, xte, _ = tensors
    x = xtr.double()
    w, b = fit.weight.double(), fit.bias.double()
    loss, g_w, g_b = _softmax_loss_grad(x, x.T.contiguous(), ytr, w, b, weight_decay)
    gnorm = torch.sqrt((g_w * g_w).sum() + (g_b * g_b).sum()).item()
    pred = (xte.double() @ w.T + b).argmax(1).numpy()
    return loss.item(), gnorm, pred


def _warm_up() -> None:
    """One tiny probe per solver first: one-time costs (lazy imports, first allocations) are
    paid by every probe process alike and are not what the table compares."""
    from smallbatch.evaluation.linear import linear_eval

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype(np.float32), np.arange(64) % 4
    for optimizer in SOLVERS.values():
        linear_eval(x, y, x, y, epochs=3, optimizer=optimizer)


def _runs(args):
    """(label, optimizer, epochs, tol) for every solver row, the reference last."""
    runs = []
    for spec in args.solvers.split(","):
        name, _, epochs = spec.partition("@")
        if name not in SOLVERS or not epochs.isdigit():
            raise SystemExit(f"--solvers: {spec!r} is not old@N or new@N")
        runs.append((spec, SOLVERS[name], int(epochs), args.tol))
    if args.reference:
        runs.append(("ref", SOLVERS["new"], args.reference, 0.0))
    return runs


def _print_rows(name, rows, yte, with_ref: bool, summary: dict) -> None:
    """One file's table rows; adds (time ratio to old, d_ref, |top-1 - ref's| in images) per label to ``summary``."""
    ref = rows[-1] if with_ref else None
    old = next((r for r in rows if r[0].startswith("old")), None)
    for label, secs, m, loss, gnorm, pred in rows:
        gap = f"{loss - ref[3]:9.1e}" if ref else f"{'':9s}"
        d_old = f"{(pred != old[5]).sum():6d}{(pred == yte).sum() - (old[5] == yte).sum():6d}" if old else f"{'':12s}"
        d_ref = f"{(pred != ref[5]).sum():6d}" if ref else ""
        print(
            f"{name:44s} {label:10s}{secs:7.2f}{m['iterations']:5d}{loss:11.7f}{gap}{gnorm:9.1e}"
            f"{100 * m['top1']:7.2f}{100 * m['top5']:7.2f}{100 * m['train_top1']:8.2f}{d_old}{d_ref}"
        )
        summary.setdefault(label, []).append(
            (
                secs / old[1] if old else np.nan,
                (pred != ref[5]).sum() if ref else np.nan,
                abs(int((pred == yte).sum()) - int((ref[5] == yte).sum())) if ref else np.nan,
            )
        )


def _print_summary(summary: dict, with_ref: bool) -> None:
    print(
        f"{'solver':10s}{'time/old (median, max)':>24s}"
        + (f"{'d_ref max':>11s}{'|top1-ref| max (images)':>25s}" if with_ref else "")
    )
    for label, vals in summary.items():
        t, d, dt = (np.array(v, float) for v in zip(*vals))
        line = f"{label:10s}{np.nanmedian(t):14.2f}{np.nanmax(t):10.2f}"
        print(line + (f"{np.nanmax(d):11.0f}{np.nanmax(dt):25.0f}" if with_ref else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument(
        "--solvers",
        default="old@100,new@100",
        help="comma-separated SOLVER@ITERATIONS, SOLVER old (plain L-BFGS) or new (preconditioned); "
        "the first old row is the one d_old compares with",
    )
    ap.add_argument("--tol", type=float, default=1e-5, help="the new solver's stopping tolerance")
    ap.add_argument("--reference", type=int, default=600, help="iterations of the converged reference (0: none)")
    ap.add_argument("--weight-decay", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    import torch

    from smallbatch.evaluation.embed import load_features

    torch.set_num_threads(args.threads)
    _warm_up()
    print(f"linear probe: {args.threads} thread(s), load average at start {os.getloadavg()}, torch {torch.__version__}")
    head = (
        f"{'file':44s} {'solver':10s}{'s':>7s}{'it':>5s}{'loss':>11s}{'gap':>9s}{'|g|':>9s}"
        f"{'top1':>7s}{'top5':>7s}{'tr_top1':>8s}{'d_old':>6s}{'dtop1':>6s}{'d_ref':>6s}"
    )
    print(head)
    summary: dict[str, list] = {}
    for path in args.files:
        fs = load_features(path)
        c = int(max(fs.train_y.max(), fs.test_y.max())) + 1
        rows = []
        for label, optimizer, epochs, tol in _runs(args):
            secs, m, fit, tensors = _probe(fs, c, optimizer, epochs, tol, args.weight_decay, args.repeat)
            loss, gnorm, pred = _exact(fit, tensors, args.weight_decay)
            rows.append((label, secs, m, loss, gnorm, pred))
        _print_rows(str(path.parent)[-44:], rows, fs.test_y, args.reference > 0, summary)
    _print_summary(summary, args.reference > 0)
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
