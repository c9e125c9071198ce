"""Linear probes whose regularisation is chosen without the test set, few-label probes,
and gaps as a fraction of what supervision adds.

Protocol (:func:`linear_probes`), on frozen features of the training and test images:

1. The features are standardised with the mean and std of **all** training rows (no
   labels are used for that, as in :func:`smallbatch.evaluation.linear.linear_eval`).
2. A **validation split** is carved from the training rows: a stratified ``val_fraction``
   of them (:func:`validation_split`, drawn with ``seed``; the same split for every cell and
   baseline of a study, so their probes are paired). The test rows are never used to
   choose anything.
3. **Linear probe**: for each L2 weight decay of ``weight_decays`` a probe is fitted on the
   other training rows and scored on the validation rows; the best one (ties: the larger
   weight decay) is refitted on **all** training rows and scored on the test rows.
4. **Few-label probes**: for each fraction f of ``fewshot_fractions`` and each of ``draws``
   draws, a class-balanced labelled set of ``round(f * n_c)`` rows of each class c (n_c its
   training rows) is drawn from its rows outside the validation split, the weight decay
   chosen on the validation split as in 3, and that fit scored on the test rows. Reported:
   the mean and sample sd over the draws (the draws are fixed by ``seed``: the same labelled
   sets for every cell), named by f (``labels<100 f>pct``): so that the name says what was
   computed, a fraction that gives some class no labelled row, or more rows than it has
   outside the validation split, is refused (:func:`balanced_subset`), never rounded up or
   cut down.

Every probe is the default solver of :func:`smallbatch.evaluation.linear.linear_eval`
(preconditioned L-BFGS, ``epochs`` iterations at most, stopping at ``tol``).

:func:`gap_fraction` expresses a gap between two encoders as a fraction of the gap between
the supervised upper bound and the random-init encoder of the same network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..data.load import stratified_subset
from .embed import check_pair
from .gap import gap_fraction
from .linear import _linear_metrics, fit_linear, linear_eval, linear_top1, standardise

__all__ = [
    "validation_split",
    "balanced_subset",
    "fraction_tag",
    "validated_linear_probe",
    "few_label_probes",
    "linear_probes",
    "gap_fraction",
    "run_probe",
]


def validation_split(labels: np.ndarray, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, validation rows) of the training rows: a stratified ``fraction`` of them
    (at least one row, at most all but one) is the validation split, drawn with ``seed``."""
    labels = np.asarray(labels)
    if not 0 < fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {fraction!r}")
    n_val = min(len(labels) - 1, max(1, round(fraction * len(labels))))
    if n_val < 1:
        raise ValueError(f"a validation split needs at least 2 training rows, got {len(labels)}")
    val = stratified_subset(labels, n_val, seed)
    return np.setdiff1d(np.arange(len(labels)), val), val


def balanced_subset(labels: np.ndarray, rows: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted rows (of ``rows``) of a class-balanced labelled set: ``round(fraction * n_c)`` rows
    of each class c, n_c its rows among all of ``labels`` (every training row), drawn at random
    from ``rng`` among its ``rows``.  ValueError (one line) when that is no row of some class,
    or more than it has among ``rows``: the set would not be ``fraction`` of the labels."""
    if not 0 < fraction <= 1:
        raise ValueError(f"a few-label fraction must be in (0, 1], got {fraction!r}")
    labels = np.asarray(labels)
    picked = []
    for cls in np.unique(labels):
        members, n_c = rows[labels[rows] == cls], int((labels == cls).sum())
        need = round(fraction * n_c)
        if not 1 <= need <= len(members):
            raise ValueError(_unhonoured(fraction, int(cls), need, n_c, len(members)))
        picked.append(rng.choice(members, size=need, replace=False))
    return np.sort(np.concatenate(picked))


def _unhonoured(fraction: float, cls: int, need: int, n_c: int, available: int) -> str:
    where = (
        f"eval.fewshot_fractions = {fraction:g} gives class {cls} round({fraction:g} x {n_c}) = {need} labelled images"
    )
    if need < 1:
        return f"{where}: none to fit a probe on; use a fraction of at least {1 / n_c:.2g}, or leave it out"
    return (
        f"{where}, but only {available} of its {n_c} lie outside the validation split (eval.linear_val_fraction); "
        f"use at most {available / n_c:.2g} (all labels: the linear probe, linear/top1)"
    )


def fraction_tag(fraction: float) -> str:
    """The metric name part of a label fraction: 0.01 -> 'labels1pct', 0.005 -> 'labels0.5pct'."""
    return f"labels{100 * fraction:g}pct"


def _choose(x, y, c, fit_rows, val_rows, weight_decays, epochs, tol):
    """Fit on ``fit_rows`` for each weight decay, score on ``val_rows``: (best weight decay
    (ties: the larger), its fit, {weight decay: validation top-1})."""
    scores, fits = {}, {}
    xv, yv = x[val_rows], y[val_rows]
    xf, yf = x[fit_rows], y[fit_rows]
    for wd in sorted(weight_decays, reverse=True):
        fits[wd] = fit_linear(xf, yf, c, wd, epochs, tol)
        scores[wd] = linear_top1(fits[wd], xv, yv)
    best = max(scores, key=lambda wd: (scores[wd], wd))
    return best, fits[best], scores


def _check_decays(weight_decays: Sequence[float]) -> list[float]:
    decays = [float(w) for w in weight_decays]
    if not decays or any(not w >= 0 for w in decays):
        raise ValueError(f"weight_decays must be a non-empty list of numbers >= 0, got {list(weight_decays)!r}")
    return decays


def validated_linear_probe(
    x, y, xte, yte, c: int, fit_rows, val_rows, weight_decays: Sequence[float], epochs: int = 100, tol: float = 1e-5
) -> dict[str, float]:
    """Step 3 of the protocol on standardised tensors: the weight decay chosen on the
    validation rows, then refitted on every training row and scored on the test rows."""
    best, _, scores = _choose(x, y, c, fit_rows, val_rows, _check_decays(weight_decays), epochs, tol)
    final = fit_linear(x, y, c, best, epochs, tol)
    out = _linear_metrics(final, x, y, xte, yte, c, best)
    out.update({"weight_decay": best, "val_top1": scores[best]})
    out.update({f"val_top1_wd{wd:g}": s for wd, s in sorted(scores.items())})
    return out


def few_label_probes(
    x,
    y,
    xte,
    yte,
    c: int,
    fit_rows,
    val_rows,
    fractions: Sequence[float],
    draws: int,
    weight_decays: Sequence[float],
    epochs: int = 100,
    tol: float = 1e-5,
    seed: int = 0,
) -> dict[str, float]:
    """Step 4 of the protocol: per fraction, ``<tag>_top1_mean`` / ``_sd`` (sample sd; 0 for
    one draw) over the draws, ``<tag>_labels`` (labelled rows per draw) and
    ``<tag>_weight_decay`` (the median of the chosen ones)."""
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"few-label draws must be a positive integer, got {draws!r}")
    decays, y_np, out = _check_decays(weight_decays), y.cpu().numpy(), {}
    for fraction in fractions:
        tops, chosen, n = [], [], 0
        for draw in range(draws):
            rng = np.random.default_rng([int(seed), round(float(fraction) * 1e6), draw])
            rows = balanced_subset(y_np, fit_rows, float(fraction), rng)
            best, fit, _ = _choose(x, y, c, rows, val_rows, decays, epochs, tol)
            tops.append(linear_top1(fit, xte, yte))
            chosen.append(best)
            n = len(rows)
        tag = fraction_tag(float(fraction))
        out[f"{tag}_top1_mean"] = float(np.mean(tops))
        out[f"{tag}_top1_sd"] = float(np.std(tops, ddof=1)) if draws > 1 else 0.0
        out[f"{tag}_labels"] = n
        out[f"{tag}_weight_decay"] = float(np.median(chosen))
    return out


def linear_probes(
    train_f: Any,
    train_y: Any,
    test_f: Any,
    test_y: Any,
    *,
    weight_decay: float = 1e-3,
    weight_decays: Sequence[float] | None = None,
    val_fraction: float = 0.1,
    fewshot_fractions: Sequence[float] = (),
    fewshot_draws: int = 5,
    epochs: int = 100,
    tol: float = 1e-5,
    seed: int = 0,
    split_seed: int = 0,
    num_classes: int | None = None,
    device: str | torch.device = "cpu",
    **linear_kwargs: Any,
) -> dict[str, float]:
    """The protocol of the module docstring; accuracies as fractions. ``split_seed`` draws
    the validation split and the labelled sets (keep it fixed so every cell of a study is
    probed alike); ``seed`` is :func:`~smallbatch.evaluation.linear.linear_eval`'s (Adam's shuffle).

    ``weight_decays`` None: the linear probe is :func:`smallbatch.evaluation.linear.linear_eval` at
    the one ``weight_decay`` (with ``linear_kwargs``: its optimizer, lr, batch size), as
    before this module; the few-label probes (if any fractions) then use that weight decay
    alone. Else the probe and the few-label probes choose among ``weight_decays``.
    """
    tr, ytr, te, yte, c = check_pair(train_f, train_y, test_f, test_y, num_classes)
    fractions = [float(f) for f in fewshot_fractions]
    solver = linear_kwargs.get("optimizer", "lbfgs-precond")
    if (weight_decays is not None or fractions) and (
        solver != "lbfgs-precond"
        or linear_kwargs.get("lr") not in (None, 1.0)
        or linear_kwargs.get("batch_size") is not None
    ):
        raise ValueError(
            f"linear_weight_decays and fewshot_fractions use the lbfgs-precond probe at lr 1 on the "
            f"full batch; got linear_optimizer {solver!r}, linear_lr {linear_kwargs.get('lr')!r}, "
            f"linear_batch_size {linear_kwargs.get('batch_size')!r}"
        )
    if weight_decays is None:
        out = linear_eval(
            tr,
            ytr,
            te,
            yte,
            epochs=epochs,
            weight_decay=weight_decay,
            tol=tol,
            seed=seed,
            num_classes=c,
            device=device,
            **linear_kwargs,
        )
        if not fractions:
            return out
    x, xte = standardise(tr, te, device)
    yt, ytt = torch.from_numpy(ytr).to(x.device), torch.from_numpy(yte).to(x.device)
    fit_rows, val_rows = validation_split(ytr, val_fraction, split_seed)
    decays = [weight_decay] if weight_decays is None else list(weight_decays)
    if weight_decays is not None:
        out = validated_linear_probe(x, yt, xte, ytt, c, fit_rows, val_rows, decays, epochs, tol)
    out.update(
        few_label_probes(
            x, yt, xte, ytt, c, fit_rows, val_rows, fractions, fewshot_draws, decays, epochs, tol, split_seed
        )
    )
    return out


def run_probe(features: Sequence[Any], settings: Mapping[str, Any]) -> dict[str, float]:
    """The registry's linear probe (:mod:`smallbatch.study.probe_registry`): :func:`linear_probes`
    at the cell's ``linear_*`` and ``fewshot_*`` settings and its ``seed``."""
    tr, ytr, te, yte = features
    s = settings
    return linear_probes(
        tr,
        ytr,
        te,
        yte,
        epochs=s["linear_iterations"],
        lr=s["linear_lr"],
        weight_decay=s["linear_weight_decay"],
        seed=s["seed"],
        optimizer=s["linear_optimizer"],
        batch_size=s["linear_batch_size"],
        tol=s["linear_tol"],
        weight_decays=s["linear_weight_decays"],
        val_fraction=s["linear_val_fraction"],
        fewshot_fractions=s["fewshot_fractions"],
        fewshot_draws=s["fewshot_draws"],
    )
