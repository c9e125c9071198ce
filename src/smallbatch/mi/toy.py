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
"""

from __future__ import annotations

import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..losses import build_loss
from .names import CRITICS, ESTIMATORS

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


# --------------------------------------------------------------------------- analytic part
def _check_dim(d: Any, name: str = "d") -> int:
    if isinstance(d, bool) or not isinstance(d, (int,)) and not (isinstance(d, float) and d.is_integer()):
        raise ValueError(f"{name} must be an integer >= 1 (the dimension of X and Y), got {d!r}")
    if int(d) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (the dimension of X and Y), got {d!r}")
    return int(d)


def _check_rho(rho: Any) -> float:
    try:
        r = float(rho)
    except (TypeError, ValueError):
        raise ValueError(f"rho must be a number in (-1, 1), got {rho!r}") from None
    if not (-1.0 < r < 1.0):
        raise ValueError(f"rho must be in the open interval (-1, 1), got {rho!r}")
    return r


def _check_k(k: Any, name: str = "K") -> int:
    if isinstance(k, bool) or not isinstance(k, int) and not (isinstance(k, float) and k.is_integer()):
        raise ValueError(f"{name} must be an integer >= 1 (negatives per anchor), got {k!r}")
    if int(k) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (negatives per anchor), got {k!r}")
    return int(k)


def _check_mi(mi: Any, name: str = "mi") -> float:
    try:
        v = float(mi)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number >= 0 (nats), got {mi!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 (nats), got {mi!r}")
    return v


def true_mi(rho: float, d: int) -> float:
    """Mutual information (nats) of ``d`` independent coordinate pairs with correlation ``rho``:
    ``I = -d/2 * log(1 - rho^2)``."""
    r = _check_rho(rho)
    d = _check_dim(d)
    return -0.5 * d * math.log1p(-r * r)


def rho_for_mi(mi: float, d: int) -> float:
    """The correlation ``rho >= 0`` giving true MI ``mi`` nats in dimension ``d``:
    ``rho = sqrt(1 - exp(-2 mi / d))`` (inverse of :func:`true_mi`)."""
    v = _check_mi(mi)
    d = _check_dim(d)
    return math.sqrt(-math.expm1(-2.0 * v / d))


def log_density_ratio(x: Tensor, y: Tensor, rho: float) -> Tensor:
    """``log p(x, y) / (p(x) p(y))`` of the correlated Gaussians, summed over coordinates::

        -d/2 log(1 - rho^2) + (rho x.y - rho^2 (|x|^2 + |y|^2)/2) / (1 - rho^2)

    Its mean over samples of the joint is the true MI (a Monte-Carlo check);
    broadcasting over leading dimensions is allowed.
    """
    r = _check_rho(rho)
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must have the same last dimension, got {tuple(x.shape)} and {tuple(y.shape)}")
    d = x.shape[-1]
    one_m = 1.0 - r * r
    quad = (r * (x * y).sum(-1) - 0.5 * r * r * ((x * x).sum(-1) + (y * y).sum(-1))) / one_m
    return quad - 0.5 * d * math.log(one_m)


def sample_correlated_gaussians(
    n: int, d: int, rho: float, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """``n`` pairs ``(x, y)`` of shape ``(n, d)``: ``x ~ N(0, I)``, ``y = rho x + sqrt(1-rho^2) e``.

    Reproducible under a seeded ``generator`` (CPU generator; tensors on the CPU).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (number of pairs), got {n!r}")
    d = _check_dim(d)
    r = _check_rho(rho)
    x = torch.randn(n, d, generator=generator, dtype=dtype)
    e = torch.randn(n, d, generator=generator, dtype=dtype)
    y = r * x + math.sqrt(1.0 - r * r) * e
    return x, y


# --------------------------------------------------------------------------- critics
def _mlp(inp: int, hidden: int, out: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    width = inp
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, out))
    return nn.Sequential(*mods)


def _check_width(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    return v


def _check_temperature(t: Any) -> float | None:
    """None (unbounded scores) or a finite number > 0."""
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"critic_temperature must be a number > 0 (or null for unbounded scores), got {t!r}")
    return float(t)


def _pair_index(a: int, n: int, device: Any = None) -> Tensor:
    """``(a, n)`` indices: anchor i's candidates are ``y_{(i+m) mod n}``, m = 0 (its positive) .. n-1."""
    return (torch.arange(a, device=device)[:, None] + torch.arange(n, device=device)[None, :]) % n


class Critic(nn.Module):
    """What every critic has: ``group_scores(xa (G, A, d), y (G, n, d)) -> (G, A, n)``, column
    m the score of anchor i with ``y_{(i+m) mod n}`` (m = 0: its positive)."""

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError


class SeparableCritic(Critic):
    """Separable critic ``s(x, y) = f(x)^T g(y)`` (Poole et al. 2019), f and g MLPs
    ``d -> hidden -> hidden -> embed`` (ReLU).  All anchor-candidate scores of a
    group come from one ``(A, E) x (E, n)`` matrix product.

    With ``temperature`` set the scores are bounded, ``cos(f(x), g(y)) / temperature``
    (l2-normalised embeddings and an inverse temperature, the parameterisation of
    FlatNCE's official code and of the image experiments); ``None``: the unbounded dot
    product."""

    def __init__(
        self, d: int, hidden: int = 64, embed: int = 32, layers: int = 2, temperature: float | None = None
    ) -> None:
        super().__init__()
        d = _check_dim(d)
        hidden, embed = _check_width(hidden, "hidden"), _check_width(embed, "embed")
        self.temperature = _check_temperature(temperature)
        self.f = _mlp(d, hidden, embed, layers)
        self.g = _mlp(d, hidden, embed, layers)

    def _embed(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        fx, gy = self.f(x), self.g(y)
        if self.temperature is None:
            return fx, gy
        return F.normalize(fx, dim=-1) / self.temperature, F.normalize(gy, dim=-1)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Scores of matching rows: ``x, y (..., d) -> (...)``."""
        fx, gy = self._embed(x, y)
        return (fx * gy).sum(-1)

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        """``xa (G, A, d)`` anchors, ``y (G, n, d)`` -> ``(G, A, n)``: column m is ``y_{(i+m) mod n}``."""
        a, n = xa.shape[1], y.shape[1]
        fx, gy = self._embed(xa, y)
        full = fx @ gy.transpose(1, 2)  # (G, A, n)
        idx = _pair_index(a, n, xa.device).expand(xa.shape[0], a, n)
        return torch.gather(full, 2, idx)


class ConcatCritic(Critic):
    """Concatenated critic ``s(x, y) = h([x, y])`` (Poole et al. 2019), h an MLP
    ``2d -> hidden -> hidden -> 1`` (ReLU), evaluated on every anchor-candidate pair.

    Exactly the MLP on the concatenation, computed cheaply: its first layer
    ``W [x; y] + b = W_x x + W_y y + b`` is applied to each x and each y once and
    the two halves are added per pair; the cost per pair is then the rest of
    the MLP (one ``hidden x hidden`` layer), and the number of pairs per step is
    capped by the anchor subsampling described in the module docstring.
    With ``temperature`` set the scores are bounded the same way as the separable
    critic's, ``tanh(h) / temperature`` in ``(-1/temperature, 1/temperature)``.
    """

    #: one MLP evaluation per scored pair: training caps the pairs per step (max_pairs)
    pairwise = True

    def __init__(self, d: int, hidden: int = 64, layers: int = 2, temperature: float | None = None) -> None:
        super().__init__()
        d = _check_dim(d)
        hidden = _check_width(hidden, "hidden")
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers!r}")
        self.d = d
        self.temperature = _check_temperature(temperature)
        self.first = nn.Linear(2 * d, hidden)
        self.rest = _mlp(hidden, hidden, 1, layers - 1) if layers > 1 else nn.Linear(hidden, 1)

    def _halves(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        w = self.first.weight
        return x @ w[:, : self.d].T + self.first.bias, y @ w[:, self.d :].T

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Scores of matching rows: ``x, y (..., d) -> (...)`` (``h(cat[x, y])``)."""
        return self._bound(self.rest(torch.relu(self.first(torch.cat([x, y], dim=-1)))).squeeze(-1))

    def _bound(self, h: Tensor) -> Tensor:
        return h if self.temperature is None else torch.tanh(h) / self.temperature

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        """``xa (G, A, d)`` anchors, ``y (G, n, d)`` -> ``(G, A, n)``: column m is ``y_{(i+m) mod n}``."""
        a, n = xa.shape[1], y.shape[1]
        hx, hy = self._halves(xa, y)  # (G, A, H), (G, n, H)
        idx = _pair_index(a, n, xa.device)
        pre = hx[:, :, None, :] + hy[:, idx, :]  # (G, A, n, H)
        return self._bound(self.rest(torch.relu(pre)).squeeze(-1))


class GaussianRatioCritic(Critic):
    """The oracle critic: the true log density ratio :func:`log_density_ratio` (no parameters)."""

    def __init__(self, rho: float) -> None:
        super().__init__()
        self.rho = _check_rho(rho)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return log_density_ratio(x, y, self.rho)

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        a, n = xa.shape[1], y.shape[1]
        idx = _pair_index(a, n, xa.device)
        return log_density_ratio(xa[:, :, None, :], y[:, idx, :], self.rho)


def build_critic(
    name: str,
    d: int,
    *,
    hidden: int = 64,
    embed: int = 32,
    layers: int = 2,
    rho: float | None = None,
    temperature: float | None = None,
) -> Critic:
    """``separable`` | ``concat`` | ``oracle`` (the oracle needs ``rho``; ``temperature``
    bounds the learned critics' scores, see :class:`SeparableCritic`)."""
    key = str(name).strip().lower()
    if key == "separable":
        return SeparableCritic(d, hidden, embed, layers, temperature)
    if key == "concat":
        return ConcatCritic(d, hidden, layers, temperature)
    if key == "oracle":
        if rho is None:
            raise ValueError("rho is required for the oracle critic")
        return GaussianRatioCritic(rho)
    raise ValueError(f"critic must be one of {', '.join(CRITICS)}, got {name!r}")


# --------------------------------------------------------------------------- batches and estimates
def group_layout(k: int, anchors: int) -> tuple[int, int, int]:
    """``(G, n, A)``: groups per batch, pairs per group (K+1), anchors per group."""
    k = _check_k(k)
    anchors = _check_k(anchors, "anchors")
    n = k + 1
    a = min(n, anchors)
    g = max(1, math.ceil(anchors / n))
    return g, n, a


def train_anchors(k: int, anchors: int, max_pairs: int | None) -> int:
    """Anchors per training batch: ``min(anchors, max_pairs // (K+1))``, at least 1 (no cap if None)."""
    k = _check_k(k)
    anchors = _check_k(anchors, "anchors")
    if max_pairs is None:
        return anchors
    max_pairs = _check_k(max_pairs, "max_pairs")
    return max(1, min(anchors, max_pairs // (k + 1)))


def _sample_groups(k: int, anchors: int, d: int, rho: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    g, n, _ = group_layout(k, anchors)
    x, y = sample_correlated_gaussians(g * n, d, rho, generator)
    return x.view(g, n, d), y.view(g, n, d)


def batch_scores(critic: Critic, x: Tensor, y: Tensor, anchors: int) -> tuple[Tensor, Tensor]:
    """Scores of a batch ``x, y (G, n, d)`` (n = K+1 pairs per group):
    ``pos (G*A,)`` and ``neg (G*A, K)`` for the first ``A = min(n, anchors)`` anchors of each group."""
    n = x.shape[1]
    a = min(n, int(anchors))
    s = critic.group_scores(x[:, :a], y)  # (G, A, n)
    s = s.reshape(-1, n)
    return s[:, 0], s[:, 1:]


def _check_estimator(name: str) -> str:
    key = str(name).strip().lower()
    if key not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {name!r}")
    return key


#: the τ every estimator's loss is called at: the critics' scores are the logits themselves
#: (not cosines to be divided by a temperature; a bounded critic has its own, critic_temperature)
SCORE_TAU = 1.0


def estimator_loss(estimator: str, alpha: float | None = None):
    """The study's loss for an estimator (called at :data:`SCORE_TAU`: scores are critic outputs)."""
    key = _check_estimator(estimator)
    if key == "eqco":
        if alpha is None:
            raise ValueError("alpha is required for the eqco estimator (eqco_alpha in the mi section)")
        return build_loss("eqco", alpha=float(alpha))
    return build_loss(key)


def mi_ceiling(estimator: str, k: int, alpha: float | None = None) -> float:
    """The largest value the estimator can report: ``log(K+1)`` (InfoNCE, FlatNCE's
    readout) or ``log(alpha+1)`` (EqCo)."""
    key = _check_estimator(estimator)
    k = _check_k(k)
    if key == "eqco":
        if alpha is None or not float(alpha) > 0:
            raise ValueError(f"alpha must be > 0 for the eqco estimator, got {alpha!r}")
        return math.log1p(float(alpha))
    return math.log1p(k)


def mi_estimate(estimator: str, pos: Tensor, neg: Tensor, alpha: float | None = None, loss=None) -> Tensor:
    """The estimator's MI estimate (detached scalar) from scores ``pos (B,)``, ``neg (B, K)``.

    ``infonce``/``flatnce``: ``log(K+1) - L_InfoNCE``; ``eqco``: ``log(alpha+1) - L_EqCo``
    (see the module docstring).  The loss values come from the losses module
    (``from_scores`` at temperature 1); ``loss`` may pass a prebuilt loss.
    """
    key = _check_estimator(estimator)
    k = neg.shape[1]
    loss = loss if loss is not None else estimator_loss(key, alpha)
    with torch.no_grad():
        out = loss.from_scores(pos.detach(), neg.detach(), temperature=SCORE_TAU)
    return _estimate_from_output(key, out, k, alpha)


def _estimate_from_output(key: str, out, k: int, alpha: float | None) -> Tensor:
    if key == "eqco":
        assert alpha is not None  # estimator_loss gave EqCo its alpha
        return math.log1p(float(alpha)) - out.value
    return math.log1p(k) - out.infonce


def dual_estimate(pos: Tensor, neg: Tensor) -> Tensor:
    """FLO/FlatNCE dual readout ``log K - mean_i logsumexp_j(s_j - s_+)`` (no log-K ceiling;
    not a guaranteed lower bound).  Uses FlatNCE's loss value from the losses module."""
    with torch.no_grad():
        out = build_loss("flatnce").from_scores(pos.detach(), neg.detach(), temperature=SCORE_TAU)
    return math.log(neg.shape[1]) - out.value


# --------------------------------------------------------------------------- training
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
    true_mi: float,  # noqa: F811 - the argument shadows the function on purpose (the brief's signature)
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
    key = _check_estimator(estimator)
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
        x, y = _sample_groups(k, a_train, d, rho, gen)
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
        trace.append(float(_estimate_from_output(key, out, k, alpha)))
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
    k, d = _check_k(K), _check_dim(d)
    mi = _check_mi(true_mi_value, "true_mi")
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
        return torch.gather(full, 3, _pair_index(a, n, xa.device).expand(full.shape))

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
    d: int,  # noqa: F811
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
    :func:`train_estimator` up to float rounding (tests/mi/test_mi.py), at a fraction of the
    per-step overhead.  An estimator whose loss turns non-finite stops there with the
    critic of that step, as alone.  Other critics train one estimator at a time."""
    keys = [_check_estimator(e) for e in estimators]
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
        x, y = _sample_groups(k, anchors, d, rho, gen)
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
            traces[m].append(float(_estimate_from_output(keys[m], out, k, alpha)))
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
    key = _check_estimator(estimator)
    k = _check_k(K)
    d = _check_dim(d)
    r = _check_rho(rho)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"eval_batches must be an integer >= 1, got {batches!r}")
    loss_fn = estimator_loss(key, alpha)
    gen = torch.Generator().manual_seed(_stable_seed("eval", seed, k, r, d))
    critic.eval()
    est, dual = [], []
    for _ in range(batches):
        x, y = _sample_groups(k, anchors, d, r, gen)
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
    k, d, r = _check_k(eval_k, "eval_k"), _check_dim(d), _check_rho(rho)
    gen = torch.Generator().manual_seed(_stable_seed("eval_k", seed, k, r, d))
    critic.eval()
    vals = []
    for _ in range(batches):
        x, y = _sample_groups(k, anchors, d, r, gen)
        vals.append(float(mi_estimate("infonce", *batch_scores(critic, x, y, anchors))))
    v = torch.tensor(vals, dtype=torch.float64)
    return {"estimate_eval_k": float(v.mean()), "std_eval_k": float(v.std(unbiased=False))}


# --------------------------------------------------------------------------- the experiment
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
