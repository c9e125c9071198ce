"""The correlated-Gaussian pair: its true mutual information, the correlation for a given one, the log density ratio and its samples."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def check_dim(d: Any, name: str = "d") -> int:
    if isinstance(d, bool) or not isinstance(d, (int,)) and not (isinstance(d, float) and d.is_integer()):
        raise ValueError(f"{name} must be an integer >= 1 (the dimension of X and Y), got {d!r}")
    if int(d) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (the dimension of X and Y), got {d!r}")
    return int(d)


def check_rho(rho: Any) -> float:
    try:
        r = float(rho)
    except (TypeError, ValueError):
        raise ValueError(f"rho must be a number in (-1, 1), got {rho!r}") from None
    if not (-1.0 < r < 1.0):
        raise ValueError(f"rho must be in the open interval (-1, 1), got {rho!r}")
    return r


def check_k(k: Any, name: str = "K") -> int:
    if isinstance(k, bool) or not isinstance(k, int) and not (isinstance(k, float) and k.is_integer()):
        raise ValueError(f"{name} must be an integer >= 1 (negatives per anchor), got {k!r}")
    if int(k) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (negatives per anchor), got {k!r}")
    return int(k)


def check_mi(mi: Any, name: str = "mi") -> float:
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
    r = check_rho(rho)
    d = check_dim(d)
    return -0.5 * d * math.log1p(-r * r)


def rho_for_mi(mi: float, d: int) -> float:
    """The correlation ``rho >= 0`` giving true MI ``mi`` nats in dimension ``d``:
    ``rho = sqrt(1 - exp(-2 mi / d))`` (inverse of :func:`true_mi`)."""
    v = check_mi(mi)
    d = check_dim(d)
    return math.sqrt(-math.expm1(-2.0 * v / d))


def log_density_ratio(x: Tensor, y: Tensor, rho: float) -> Tensor:
    """``log p(x, y) / (p(x) p(y))`` of the correlated Gaussians, summed over coordinates::

        -d/2 log(1 - rho^2) + (rho x.y - rho^2 (|x|^2 + |y|^2)/2) / (1 - rho^2)

    Its mean over samples of the joint is the true MI (a Monte-Carlo check);
    broadcasting over leading dimensions is allowed.
    """
    r = check_rho(rho)
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
    d = check_dim(d)
    r = check_rho(rho)
    x = torch.randn(n, d, generator=generator, dtype=dtype)
    e = torch.randn(n, d, generator=generator, dtype=dtype)
    y = r * x + math.sqrt(1.0 - r * r) * e
    return x, y
