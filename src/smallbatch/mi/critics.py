"""The critics scoring a pair (x, y): separable f(x)^T g(y), concatenated h([x, y]) and the Gaussian oracle."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .gaussian import check_dim, check_rho, log_density_ratio
from .names import CRITICS


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


def pair_index(a: int, n: int, device: Any = None) -> Tensor:
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
        d = check_dim(d)
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
        idx = pair_index(a, n, xa.device).expand(xa.shape[0], a, n)
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
        d = check_dim(d)
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
        idx = pair_index(a, n, xa.device)
        pre = hx[:, :, None, :] + hy[:, idx, :]  # (G, A, n, H)
        return self._bound(self.rest(torch.relu(pre)).squeeze(-1))


class GaussianRatioCritic(Critic):
    """The oracle critic: the true log density ratio :func:`log_density_ratio` (no parameters)."""

    def __init__(self, rho: float) -> None:
        super().__init__()
        self.rho = check_rho(rho)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return log_density_ratio(x, y, self.rho)

    def group_scores(self, xa: Tensor, y: Tensor) -> Tensor:
        a, n = xa.shape[1], y.shape[1]
        idx = pair_index(a, n, xa.device)
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
