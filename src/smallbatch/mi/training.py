"""Training the critics: one estimator, or several stacked in one network, and their evaluation at K."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .critics import Critic, SeparableCritic, build_critic, pair_index
from .estimates import (
    SCORE_TAU,
    batch_scores,
    check_estimator,
    dual_estimate,
    estimate_from_output,
    estimator_loss,
    mi_estimate,
    sample_groups,
    train_anchors,
)
from .gaussian import check_dim, check_k, check_mi, check_rho, rho_for_mi


@dataclass
class TrainResult:
    """Per-step training estimates (the estimator's readout on each training batch) and the critic."""

    trace: list[float]
    critic: Critic
    seconds: float
    diverged: bool = False
    cpu_s: float = 0.0  # the process's CPU seconds (every thread) of this training
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _stable_seed(*parts: Any) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


def train_estimator(
    estimator: str,
    critic: Critic | str,
    K: int,
    true_mi: float,
    d: int,
    steps: int,
    lr: float,
    seed: int,
    *,
    alpha: float | None = None,
    anchors: int = 128,
    max_pairs: int | None = 8192,
    hidden: int = 64,
    embed: int = 32,
    layers: int = 2,
    temperature: float | None = None,
) -> TrainResult:
    """Train ``critic`` by the estimator's loss on fresh batches (K negatives per anchor).

    ``critic`` is a module or a name (``separable``/``concat``/``oracle``, built
    with ``hidden``/``embed`` and initialised from ``seed``).  Adam, constant
    ``lr`` with cosine decay to 0 over ``steps`` steps; each step draws ``G``
    groups of K+1 pairs with ``train_anchors(K, anchors, max_pairs)`` anchors
    for a critic with ``pairwise = True`` (the concatenated one; ``anchors``
    for the others, see the module docstring) from a generator seeded by ``(seed, K, true_mi,
    d)``, so every estimator and critic sees the same data stream (common
    random numbers).
    Returns the per-step training estimates.  A non-finite loss stops training
    (``diverged=True``).
    """
    key = check_estimator(estimator)
    k, d, rho, steps, lr = _check_training(K, d, true_mi, steps, lr)
    if isinstance(critic, str):
        critic = _new_critic(critic, seed, d, rho, hidden, embed, layers, temperature)
    a_train = train_anchors(k, anchors, max_pairs if getattr(critic, "pairwise", False) else None)
    loss_fn = estimator_loss(key, alpha)
    gen = _train_generator(seed, k, true_mi, d)
    params = [p for p in critic.parameters() if p.requires_grad]
    opt, sched = _adam(params, lr, steps)
    trace: list[float] = []
    diverged = False
    t0, c0 = time.perf_counter(), time.process_time()
    critic.train()
    for _ in range(steps if opt is not None else 0):
        x, y = sample_groups(k, a_train, d, rho, gen)
        pos, neg = batch_scores(critic, x, y, a_train)
        out = loss_fn.from_scores(pos, neg, temperature=SCORE_TAU)
        if not bool(torch.isfinite(out.loss)):
            diverged = True
            break
        if opt is not None:
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            sched.step()
        trace.append(float(estimate_from_output(key, out, k, alpha)))
    return TrainResult(
        trace=trace,
        critic=critic,
        seconds=time.perf_counter() - t0,
        cpu_s=time.process_time() - c0,
        diverged=diverged,
        steps=len(trace),
        extra={"train_anchors": a_train},
    )


def _check_training(K, d, true_mi_value, steps, lr) -> tuple[int, int, float, int, float]:
    """Checked ``(K, d, rho, steps, lr)`` of a training run."""
    k, d = check_k(K), check_dim(d)
    mi = check_mi(true_mi_value, "true_mi")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    return k, d, rho_for_mi(mi, d), steps, lr


def _new_critic(
    name: str, seed: int, d: int, rho: float, hidden: int, embed: int, layers: int, temperature: float | None = None
) -> Critic:
    """The critic ``name`` initialised from ``seed`` (the same start for every estimator, K and MI)."""
    torch.manual_seed(_stable_seed("critic", seed, name))
    return build_critic(name, d, hidden=hidden, embed=embed, layers=layers, rho=rho, temperature=temperature)


def _train_generator(seed: int, k: int, mi: float, d: int) -> torch.Generator:
    return torch.Generator().manual_seed(_stable_seed("train", seed, k, float(mi), d))


def _adam(params: Sequence[Tensor], lr: float, steps: int):
    """Adam at ``lr`` with cosine decay to 0 over ``steps`` steps; (None, None) without parameters."""
    if not params:
        return None, None
    opt = torch.optim.Adam(params, lr=lr, foreach=True)
    sched = (
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        if steps > 0
        else None
    )
    return opt, sched


class _StackedSeparable(nn.Module):
    """M :class:`SeparableCritic` s of one shape as one module: each layer's weights stacked
    ``(M, in, out)`` / ``(M, 1, out)``, so one batched product per layer scores every critic.
    The same arithmetic per critic as the critic alone, up to the products' summation order."""

    def __init__(self, critics: Sequence[SeparableCritic]) -> None:
        super().__init__()
        self.temperature = critics[0].temperature
        self.f = self._stack([c.f for c in critics])
        self.g = self._stack([c.g for c in critics])

    @staticmethod
    def _stack(mlps: Sequence[nn.Sequential]) -> nn.ParameterList:
        linears = [[m for m in mlp if isinstance(m, nn.Linear)] for mlp in mlps]
        out = []
        for layer in zip(*linears):
            out.append(nn.Parameter(torch.stack([lin.weight.detach().T for lin in layer])))
            out.append(nn.Parameter(torch.stack([lin.bias.detach()[None] for lin in layer])))
        return nn.ParameterList(out)

    @staticmethod
    def _mlp(params: nn.ParameterList, x: Tensor) -> Tensor:
        """``x (N, d)`` -> ``(M, N, out)``: Linear, ReLU, ..., Linear per critic."""
        h = x
        for i in range(0, len(params), 2):
            h = torch.matmul(h, params[i]) + params[i + 1]
            if i + 2 < len(params):
                h = torch.relu(h)
        return h

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        """``xa (G, A, d)``, ``y (G, n, d)`` -> ``(M, G, A, n)`` (see SeparableCritic.group_scores)."""
        (g, a, d), n = xa.shape, y.shape[1]
        fx = self._mlp(self.f, xa.reshape(-1, d)).view(-1, g, a, self.f[-1].shape[-1])
        gy = self._mlp(self.g, y.reshape(-1, d)).view(-1, g, n, self.g[-1].shape[-1])
        if self.temperature is not None:
            fx, gy = F.normalize(fx, dim=-1) / self.temperature, F.normalize(gy, dim=-1)
        full = fx @ gy.transpose(-1, -2)
        return torch.gather(full, 3, pair_index(a, n, xa.device).expand(full.shape))

    def state_of(self, m: int) -> list[Tensor]:
        """Critic ``m``'s weights and biases, in its layers' order (f, then g)."""
        return [t[m].detach().clone() for t in [*self.f, *self.g]]

    @staticmethod
    def load_into(critic: SeparableCritic, state: list[Tensor]) -> None:
        linears = [m for mlp in (critic.f, critic.g) for m in mlp if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for lin, w, b in zip(linears, state[0::2], state[1::2]):
                lin.weight.copy_(w.T)
                lin.bias.copy_(b[0])


def train_estimators(
    estimators: Sequence[str],
    critic: str,
    K: int,
    true_mi: float,
    d: int,
    steps: int,
    lr: float,
    seed: int,
    *,
    alpha: float | None = None,
    anchors: int = 128,
    max_pairs: int | None = 8192,
    hidden: int = 64,
    embed: int = 32,
    layers: int = 2,
    temperature: float | None = None,
) -> list[TrainResult]:
    """:func:`train_estimator` for several estimators of one (critic, K, MI, seed) at once.

    They start from the same critic and draw the same batches, so for the separable critic
    one stacked forward (:class:`_StackedSeparable`) scores every estimator's critic; each
    estimator's loss drives its own slice (the sum of the losses has, per slice, exactly
    that estimator's gradient) and Adam is elementwise, so each result equals its
    :func:`train_estimator` up to float rounding, at a fraction of the
    per-step overhead.  An estimator whose loss turns non-finite stops there with the
    critic of that step, as alone.  Other critics train one estimator at a time."""
    keys = [check_estimator(e) for e in estimators]
    k, d, rho, steps, lr = _check_training(K, d, true_mi, steps, lr)
    critics = [_new_critic(critic, seed, d, rho, hidden, embed, layers, temperature) for _ in keys]
    separable = [c for c in critics if isinstance(c, SeparableCritic)]  # all or none: one kind
    if len(keys) < 2 or len(separable) < len(critics):
        return [
            train_estimator(e, c, K, true_mi, d, steps, lr, seed, alpha=alpha, anchors=anchors, max_pairs=max_pairs)
            for e, c in zip(keys, critics)
        ]
    stacked = _StackedSeparable(separable)
    gen, losses = _train_generator(seed, k, true_mi, d), [estimator_loss(key, alpha) for key in keys]
    opt, sched = _adam(list(stacked.parameters()), lr, steps)
    traces: list[list[float]] = [[] for _ in keys]
    stopped: dict[int, list[Tensor]] = {}  # a diverged estimator -> its critic at that step
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        x, y = sample_groups(k, anchors, d, rho, gen)
        s = stacked.group_scores(x[:, :anchors], y).reshape(len(keys), -1, k + 1)
        outs = {
            m: losses[m].from_scores(s[m, :, 0], s[m, :, 1:], temperature=SCORE_TAU)
            for m in range(len(keys))
            if m not in stopped
        }
        for m in [m for m, out in outs.items() if not bool(torch.isfinite(out.loss))]:
            stopped[m] = stacked.state_of(m)
            del outs[m]
        if not outs:
            break
        opt.zero_grad(set_to_none=True)
        sum(out.loss for out in outs.values()).backward()
        opt.step()
        sched.step()
        for m, out in outs.items():
            traces[m].append(float(estimate_from_output(keys[m], out, k, alpha)))
    seconds, cpu_s = (time.perf_counter() - t0) / len(keys), (time.process_time() - c0) / len(keys)
    for m, c in enumerate(separable):
        _StackedSeparable.load_into(c, stopped.get(m) or stacked.state_of(m))
    return [
        TrainResult(
            trace=traces[m],
            critic=c,
            seconds=seconds,
            cpu_s=cpu_s,
            diverged=m in stopped,
            steps=len(traces[m]),
            extra={"train_anchors": train_anchors(k, anchors, None)},
        )
        for m, c in enumerate(critics)
    ]


@torch.no_grad()
def evaluate_estimator(
    estimator: str,
    critic: Critic,
    K: int,
    rho: float,
    d: int,
    batches: int,
    seed: int,
    *,
    alpha: float | None = None,
    anchors: int = 128,
    eval_k: int | None = None,
) -> dict[str, Any]:
    """The estimator's readout on ``batches`` fresh batches (same layout as training).

    Returns ``estimates``/``duals`` (one per batch) and their means and
    population standard deviations (``estimate``, ``std``, ``dual_estimate``,
    ``dual_std``).  With ``eval_k`` also ``estimate_eval_k``/``std_eval_k``: the
    InfoNCE bound ``log(eval_k+1) - L_InfoNCE`` of the same critic against
    ``eval_k`` negatives per anchor, whatever the estimator and the K it trained
    with (:func:`eval_k_estimate`)."""
    key = check_estimator(estimator)
    k = check_k(K)
    d = check_dim(d)
    r = check_rho(rho)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"eval_batches must be an integer >= 1, got {batches!r}")
    loss_fn = estimator_loss(key, alpha)
    gen = torch.Generator().manual_seed(_stable_seed("eval", seed, k, r, d))
    critic.eval()
    est, dual = [], []
    for _ in range(batches):
        x, y = sample_groups(k, anchors, d, r, gen)
        pos, neg = batch_scores(critic, x, y, anchors)
        est.append(float(mi_estimate(key, pos, neg, alpha, loss=loss_fn)))
        dual.append(float(dual_estimate(pos, neg)))
    e, du = torch.tensor(est, dtype=torch.float64), torch.tensor(dual, dtype=torch.float64)
    out = {
        "estimates": est,
        "duals": dual,
        "estimate": float(e.mean()),
        "std": float(e.std(unbiased=False)),
        "dual_estimate": float(du.mean()),
        "dual_std": float(du.std(unbiased=False)),
    }
    if eval_k is not None:
        out.update(eval_k_estimate(critic, eval_k, r, d, batches, seed, anchors=anchors))
    return out


@torch.no_grad()
def eval_k_estimate(
    critic: Critic, eval_k: int, rho: float, d: int, batches: int, seed: int, *, anchors: int = 128
) -> dict[str, float]:
    """The critic's InfoNCE bound with ``eval_k`` negatives per anchor on ``batches`` fresh
    batches: ``{'estimate_eval_k': mean, 'std_eval_k': population std}``.

    This is how good a critic the training made, read with the same many negatives
    for every estimator and training K: a critic trained with few negatives that is
    as good as one trained with many reads the same here (FlatNCE's claim that its
    learner escapes the log-K curse of small batches), while its own readout at the
    training K stays capped at ``log(K+1)``.  Ceiling ``log(eval_k+1)``."""
    k, d, r = check_k(eval_k, "eval_k"), check_dim(d), check_rho(rho)
    gen = torch.Generator().manual_seed(_stable_seed("eval_k", seed, k, r, d))
    critic.eval()
    vals = []
    for _ in range(batches):
        x, y = sample_groups(k, anchors, d, r, gen)
        vals.append(float(mi_estimate("infonce", *batch_scores(critic, x, y, anchors))))
    v = torch.tensor(vals, dtype=torch.float64)
    return {"estimate_eval_k": float(v.mean()), "std_eval_k": float(v.std(unbiased=False))}
