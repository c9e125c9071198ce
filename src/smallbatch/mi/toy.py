"""Mutual-information bounds on correlated Gaussians (torch only, no I/O).

The toy of EqCo (Zhu et al. 2020) and FlatNCE (Chen et al. 2021), in the form
of Poole et al. 2019 ("On Variational Bounds of Mutual Information"):
``X, Y`` in ``R^d`` with ``Y = rho X + sqrt(1 - rho^2) E``, ``X, E ~ N(0, I)``,
so every coordinate pair has correlation ``rho`` and the true mutual
information is known in closed form::

    I(X; Y) = -d/2 * log(1 - rho^2)            (nats)

A learned critic ``s(x, y)`` scores pairs; it is trained by one of the study's
contrastive losses (InfoNCE, FlatNCE, EqCo, through
:meth:`smallbatch.losses.ContrastiveLoss.from_scores` at temperature 1, so the
same loss code as the image experiments is exercised) and then read out as an
MI estimate on fresh samples.

Batches.  One *group* is K+1 pairs ``(x_i, y_i)``; anchor ``x_i`` scores its
own ``y_i`` (the positive) against the K other ``y_j`` of its group (the
negatives), exactly "each x against its own y and K others".  To keep the
number of anchors per batch (and so the noise) comparable across K, a batch
holds ``G = ceil(A / (K+1))`` independent groups for ``A`` anchors, and when
``K+1 > A`` only the first ``A`` pairs of the (single) group act as anchors
(their negatives are still all K other ``y`` of the group).  Every anchor row
is an ordinary K-negative term, so the estimates stay unbiased; only their
per-batch noise depends on ``A``.

* Evaluation batches use ``A = anchors`` (default 128) at every K, so the
  reported std is comparable across K and critics.
* Training batches of the concatenated critic use
  ``A = min(anchors, max_pairs // (K+1))`` anchors (at least 1): its cost is
  one MLP evaluation per scored pair, so the pairs per step are capped at
  about ``max_pairs`` (default 8192) instead of ``anchors * (K+1)``; this is
  what keeps it CPU-fast at K = 1024 (7 anchors per step, each against 1024
  negatives).  The separable critic scores all pairs of a group with one
  matrix product, where extra anchors cost little, so it trains with
  ``A = anchors`` at every K (with 7 anchors per step it learned markedly
  worse in our measurements; the concatenated critic did not).  Both critics
  draw the same data stream for a given (seed, K, MI).

Estimators (per anchor, ``s_+`` its positive score, ``s_j`` its K negatives;
means over anchors; L denotes the loss values of :mod:`smallbatch.losses`):

* InfoNCE (van den Oord et al. 2018)::

      I_NCE = log(K+1) - L_InfoNCE,   L_InfoNCE = log(1 + sum_j exp(s_j - s_+))

  Since ``L_InfoNCE >= 0`` it never exceeds its ceiling ``log(K+1)``.
* EqCo (Zhu et al. 2020, "EqCo: Equivalent Rules for Self-supervised
  Contrastive Learning", arXiv:2010.01929): the negatives' sum is rescaled by
  ``alpha/K``, which the paper motivates by keeping the InfoNCE mutual
  information bound steady when K changes, i.e. the bound is written with
  alpha in place of K::

      I_EqCo = log(alpha+1) - L_EqCo,
      L_EqCo = log(1 + (alpha/K) sum_j exp(s_j - s_+))

  Ceiling ``log(alpha+1)``: it depends on alpha, not on K.  We use the
  ``+1`` of the K+1-candidate convention so that ``alpha = K`` gives back
  ``I_NCE`` exactly (texts that count all K candidates, positive included,
  write the same bound as ``log K - L``).  For ``alpha > K`` this is not a
  proven lower bound: the sum over ``alpha`` negatives is extrapolated from K
  samples (``log`` of an unbiased sum is biased, so the readout can overshoot).
* FlatNCE (Chen et al. 2021, "Simpler, Faster, Stronger: Breaking The log-K
  Curse On Contrastive Learners With FlatNCE", arXiv:2107.01152): trains the
  critic with ``exp(l - stopgrad(l))``, ``l = logsumexp_j(s_j - s_+)``, whose
  gradient is InfoNCE's divided by InfoNCE's vanishing factor ``1 - softmax_+``.
  Its *MI readout* is the one of the authors' official code (github.com/
  qingguo666/FLO, ``Jupyter-Notebook/FlatNCE-code-snippet.ipynb``, computes
  ``res['mi'] = log(n2) - CrossEntropy(similarity)`` with n2 = K+1
  candidates): the InfoNCE bound ``I_NCE`` evaluated with the FlatNCE-trained
  critic, ceiling ``log(K+1)`` *by construction*, so that readout cannot show
  the curse broken.  The paper's claim is about training ("contrastive learners
  fail in the small-batch regime ... FlatNCE fixes this"): what a small K does
  to the critic that is learnt.  That is tested by :func:`eval_k_estimate`,
  every trained critic's InfoNCE bound against ``eval_k`` (default: the largest
  K) negatives: a FlatNCE critic trained with K = 4 that is as good as one
  trained with K = 1024 reads the same there, uncapped by its training K.
  Every row also carries the *dual* (FLO) readout :func:`dual_estimate` =
  ``log K - mean_i logsumexp_j(s_j - s_+)``, FlatNCE's own loss value read as
  an MI estimate (the FLO bound of Guo et al. 2021 with its second critic set
  to the batch's self-normalised optimum): no log-K ceiling, but not a lower
  bound (it reads far above the true MI once scores saturate).

Bounded scores.  FlatNCE's ``l`` has no lower bound for an unbounded critic:
once the critic ranks every positive above its K negatives, scaling the scores
up drives ``l`` to ``-inf``, and training follows that direction.  With the
unbounded dot-product critic FlatNCE's readout fell below 0 (to -1.1e8 nats)
in 15 of the 25 settings of the former default grid (K 4-1024 x true MI
2-10 nats, 500 steps, seed 0); a 5x smaller learning rate (11 of 25) or
gradient-norm clipping at 1 (14 of 25) did not stop it; bounded scores did (0
of 25).  So the learned critics score ``cos(f(x), g(y)) / critic_temperature``
(the paper's own parameterisation: l2-normalised embeddings and an inverse
temperature), for every estimator alike; with 0.05 the score gap can reach 40
nats, far above every ``log(K+1)`` and true MI of the grid, and InfoNCE's
estimates were no lower than with the unbounded critic in that grid.  A row
whose training still turns non-finite, or an unbounded critic's whose readout is
below 0, is a setup
failure (:func:`failed`), reported as such and never as a measurement; a
bounded critic's readout below 0 is a measurement (FlatNCE's critic, pushed to
the bound, is overconfident where the positives cannot be told apart).

Critics: :class:`SeparableCritic` ``f(x)^T g(y)`` and :class:`ConcatCritic`
``h([x, y])`` (Poole et al.'s two families), and :class:`GaussianRatioCritic`,
the true log density ratio (no parameters, no training: the *oracle*, in the
default grid as the reference that separates a bound's own bias from the
learned critic's shortfall).

The computation is in :mod:`~smallbatch.mi.gaussian` (the pair and its true MI),
:mod:`~smallbatch.mi.critics`, :mod:`~smallbatch.mi.estimates` (batches, bounds, readouts)
and :mod:`~smallbatch.mi.training`; this module is the experiment (its grid, rows and
run) and re-exports them, so ``from smallbatch.mi import toy`` reaches the whole benchmark.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .critics import ConcatCritic, Critic, GaussianRatioCritic, SeparableCritic, build_critic
from .estimates import batch_scores, dual_estimate, estimator_loss, group_layout, mi_ceiling, mi_estimate, train_anchors
from .gaussian import log_density_ratio, rho_for_mi, sample_correlated_gaussians, true_mi
from .names import CRITICS, ESTIMATORS
from .training import TrainResult, eval_k_estimate, evaluate_estimator, train_estimator, train_estimators

__all__ = [
    "ESTIMATORS",
    "CRITICS",
    "true_mi",
    "rho_for_mi",
    "log_density_ratio",
    "sample_correlated_gaussians",
    "SeparableCritic",
    "ConcatCritic",
    "GaussianRatioCritic",
    "build_critic",
    "group_layout",
    "train_anchors",
    "batch_scores",
    "estimator_loss",
    "mi_estimate",
    "mi_ceiling",
    "dual_estimate",
    "TrainResult",
    "train_estimator",
    "train_estimators",
    "evaluate_estimator",
    "eval_k_estimate",
    "failed",
    "grid",
    "run_mi_experiment",
]


def _thin(trace: Sequence[float], points: int) -> list[tuple[int, float]]:
    """``points`` window means of a per-step trace, as ``(last step of window (1-based), mean)``."""
    n = len(trace)
    if n == 0:
        return []
    w = max(1, math.ceil(n / points))
    out = []
    for start in range(0, n, w):
        chunk = trace[start : start + w]
        out.append((start + len(chunk), float(sum(chunk) / len(chunk))))
    return out


def grid(section: dict) -> list[dict]:
    """The rows' keys (estimator, critic, K, true_mi, seed) of a validated section, in run order
    (the concatenated critic only up to ``concat_max_k`` when that is set)."""
    out = []
    for seed in section["seeds"]:
        for critic in section["critics"]:
            for k in section["ks"]:
                if critic == "concat" and section.get("concat_max_k") is not None and k > section["concat_max_k"]:
                    continue
                for mi in section["mi_values"]:
                    for est in section["estimators"]:
                        out.append({"estimator": est, "critic": critic, "K": k, "true_mi": mi, "seed": seed})
    return out


def _same_data(keys: list[dict]) -> list[list[dict]]:
    """The grid's keys in runs of consecutive keys that differ only in the estimator (they
    train on the same batches: :func:`train_estimators`)."""
    groups: list[list[dict]] = []
    for key in keys:
        if groups and all(groups[-1][0][f] == key[f] for f in ("critic", "K", "true_mi", "seed")):
            groups[-1].append(key)
        else:
            groups.append([key])
    return groups


def _row(sec: dict, key: dict, res: TrainResult, oracle_eval_k: dict) -> dict:
    """One row of the experiment: the trained critic read out on fresh batches.  The
    oracle's readout at ``eval_k`` is the same for every K and estimator of one (seed,
    true MI): ``oracle_eval_k`` keeps it, so it is computed once."""
    t0, c0 = time.perf_counter(), time.process_time()
    est, k, mi, d = key["estimator"], key["K"], key["true_mi"], sec["dim"]
    rho, alpha = rho_for_mi(mi, d), (sec["eqco_alpha"] if key["estimator"] == "eqco" else None)
    eval_k = sec["eval_k"] if sec.get("eval_k") is not None else max(sec["ks"])
    ev = evaluate_estimator(
        est, res.critic, k, rho, d, sec["eval_batches"], key["seed"], alpha=alpha, anchors=sec["anchors"]
    )
    if isinstance(res.critic, GaussianRatioCritic):
        cached = (key["seed"], float(mi), eval_k)
        if cached not in oracle_eval_k:
            oracle_eval_k[cached] = eval_k_estimate(
                res.critic, eval_k, rho, d, sec["eval_batches"], key["seed"], anchors=sec["anchors"]
            )
        ev.update(oracle_eval_k[cached])
    else:
        ev.update(eval_k_estimate(res.critic, eval_k, rho, d, sec["eval_batches"], key["seed"], anchors=sec["anchors"]))
    tail = res.trace[-max(1, len(res.trace) // 10) :] if res.trace else []
    return {
        **key,
        "dim": d,
        "rho": rho,
        "alpha": alpha,
        "estimate": ev["estimate"],
        "std": ev["std"],
        "variance": ev["std"] ** 2,
        "bias": ev["estimate"] - mi,
        "ceiling": mi_ceiling(est, k, alpha),
        "dual_estimate": ev["dual_estimate"],
        "dual_std": ev["dual_std"],
        "eval_k": eval_k,
        "estimate_eval_k": ev["estimate_eval_k"],
        "std_eval_k": ev["std_eval_k"],
        "train_final": float(sum(tail) / len(tail)) if tail else None,
        "steps": res.steps,
        "diverged": res.diverged,
        "failed": failed(res.diverged, ev["estimate"], _bounded(res.critic)),
        "anchors": sec["anchors"],
        "train_anchors": res.extra["train_anchors"],
        "hidden": sec["hidden"],
        "embed": sec["embed"],
        "layers": sec["layers"],
        "lr": sec["lr"],
        "critic_temperature": sec["critic_temperature"],
        "seconds": res.seconds + time.perf_counter() - t0,
        "cpu_s": res.cpu_s + time.process_time() - c0,
    }


def failed(diverged: bool, estimate: float, bounded: bool) -> bool:
    """A row is a failure of the setup, not a measurement, when training hit a non-finite
    loss, or when an unbounded critic reads below 0 nats, worse than the constant critic:
    its scores blew up (the dot-product FlatNCE critics that read -1e8 nats had scores
    beyond 1e3).  A bounded critic's scores cannot blow up, so its readout, negative or
    not, is a measurement (FlatNCE's critic at small K and low MI is overconfident)."""
    return bool(diverged) or not math.isfinite(estimate) or (not bounded and estimate < 0.0)


def _bounded(critic: Critic) -> bool:
    """Scores that cannot blow up: a learned critic with a temperature, or the (untrained) oracle."""
    return isinstance(critic, GaussianRatioCritic) or getattr(critic, "temperature", None) is not None


def _print_row(i: int, n: int, row: dict) -> None:
    print(
        f"[mi {i}/{n}] {row['estimator']:8s} {row['critic']:9s} K={row['K']:<5d} I={row['true_mi']:g}: "
        f"estimate {row['estimate']:.3f} ± {row['std']:.3f} (ceiling {row['ceiling']:.2f}, "
        f"dual {row['dual_estimate']:.2f}, at K={row['eval_k']} {row['estimate_eval_k']:.2f}) "
        f"{row['seconds']:.1f}s{' SETUP FAILURE' if row['failed'] else ''}",
        file=sys.stderr,
        flush=True,
    )


def run_mi_experiment(
    section: dict,
    *,
    log_fn: Callable[[dict, list[tuple[int, float]]], None] | None = None,
    progress: bool = True,
) -> list[dict]:
    """Run the grid of an ``experiments.mi`` section (validated:
    :func:`smallbatch.pipeline.mi_job.validate_section`); one row per
    (estimator, critic, K, true MI, seed).

    Row keys: ``estimator, critic, K, true_mi, seed, dim, rho, alpha`` (EqCo's,
    else None), ``estimate`` (mean over the final ``eval_batches`` evaluation
    batches), ``std`` (their population std), ``variance``, ``bias``
    (estimate - true MI), ``ceiling``, ``dual_estimate``, ``dual_std``,
    ``eval_k``, ``estimate_eval_k``, ``std_eval_k`` (the critic's InfoNCE bound
    with ``eval_k`` negatives, :func:`eval_k_estimate`), ``train_final`` (mean
    training estimate over the last 10% of steps; None without training, i.e. for
    the oracle critic), ``train_anchors``, ``steps``, ``diverged``, ``failed``
    (:func:`failed`: a setup failure, never a measurement), ``critic_temperature``,
    ``seconds``.  ``log_fn(row, trace)`` is called
    after each row with the thinned training trace ``[(step, estimate), ...]``.
    """
    sec = section
    old_threads = torch.get_num_threads()
    torch.set_num_threads(sec["threads"])
    rows: list[dict] = []
    oracle_eval_k: dict = {}
    keys = grid(sec)
    t_all = time.perf_counter()
    try:
        for group in _same_data(keys):
            first = group[0]
            alpha = sec["eqco_alpha"] if "eqco" in [g["estimator"] for g in group] else None
            results = train_estimators(
                [g["estimator"] for g in group],
                first["critic"],
                first["K"],
                first["true_mi"],
                sec["dim"],
                sec["steps"],
                sec["lr"],
                first["seed"],
                alpha=alpha,
                anchors=sec["anchors"],
                max_pairs=sec["max_pairs"],
                hidden=sec["hidden"],
                embed=sec["embed"],
                layers=sec["layers"],
                temperature=sec["critic_temperature"],
            )
            for key, res in zip(group, results):
                rows.append(_row(sec, key, res, oracle_eval_k))
                if log_fn is not None:
                    log_fn(rows[-1], _thin(res.trace, sec["trace_points"]))
                if progress:
                    _print_row(len(rows), len(keys), rows[-1])
    finally:
        torch.set_num_threads(old_threads)
    if progress:
        print(f"[mi] {len(rows)} rows in {time.perf_counter() - t_all:.1f}s", file=sys.stderr, flush=True)
    return rows
