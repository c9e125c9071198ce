"""The contract every loss of the registry keeps, checked on small random views.

What the training loop, the report and the other losses' comparisons take for granted of a
loss, a built-in's or an installed plugin's (``smallbatch check-loss NAME`` runs it):

* ``shape`` -- two views ``[N, d]`` give a scalar loss and a scalar value;
* ``finite`` / ``gradient`` -- the value is finite, and so is the gradient of the loss with
  respect to both views (and it reaches them);
* ``temperature`` -- τ is handled as the registry says: a loss that uses τ changes with it, a
  loss without τ (``uses_temperature = False``) does not, a loss that owns its τ starts it
  where :meth:`~smallbatch.losses.base.ContrastiveLoss.init_temperature` says;
* ``order`` -- the value does not depend on the order of the batch (the same permutation of
  both views' rows);
* ``reference`` -- where the spec supplies one, its ``reference`` callable and the class agree
  in float64.

Each broken property is one line naming it; an empty list is a loss that keeps the contract.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .base import ContrastiveLoss
from .build import build_loss
from .registry import LossSpec, loss_spec

__all__ = ["contract_problems", "PROPERTIES"]

#: the properties checked, in order (each failure's line starts with its name)
PROPERTIES = ("build", "shape", "finite", "gradient", "temperature", "order", "reference")
#: two τs a loss that uses τ must tell apart, and where a learnt τ is started
TAUS = (0.1, 0.5)
TAU_START = 0.3
#: the float64 agreement asked of a reordered batch and of the author's reference
RTOL, ATOL = 1e-9, 1e-12


def contract_problems(name: str, n: int = 8, d: int = 16, seed: int = 0) -> list[str]:
    """The contract's broken properties of loss ``name`` on ``n`` pairs of ``d``-dimensional
    views (a fixed draw of ``seed``), one line each (``"<property>: what"``); [] when kept."""
    spec = loss_spec(name)
    g = torch.Generator().manual_seed(seed)
    z1 = torch.randn(n, d, generator=g, dtype=torch.float64)
    z2 = z1 + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    try:
        loss = build_loss(spec.name)
    except Exception as exc:  # a plugin's constructor may raise anything: reported, not raised
        return [f"build: build_loss({spec.name!r}) raised {type(exc).__name__}: {exc}"]
    problems: list[str] = []
    checks = (("shape", _shape_finite_gradient), ("temperature", _temperature), ("order", _order))
    for what, check in (*checks, ("reference", _reference)):
        try:
            problems += check(spec, loss, z1, z2)
        except Exception as exc:  # the check's own call failed: that property is broken
            problems.append(f"{what}: the call raised {type(exc).__name__}: {_first_line(exc)}")
    return problems


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _value(spec: LossSpec, loss: ContrastiveLoss, z1: Tensor, z2: Tensor, tau: float | None) -> Any:
    """The loss's output on the views ``z1, z2`` at ``tau``; a method whose predictor or EMA
    target supplies targets gets the views themselves as its targets."""
    targets = (z1.detach(), z2.detach()) if not spec.contrastive and (spec.predictor or spec.ema_target) else ()
    return loss(z1, z2, *targets, temperature=tau)


def _first_tau(spec: LossSpec) -> float | None:
    """The τ the checks call with: none for a loss that owns its τ (it uses its learnt one)."""
    return None if spec.owns_temperature else TAUS[0]


def _shape_finite_gradient(spec: LossSpec, loss: ContrastiveLoss, z1: Tensor, z2: Tensor) -> list[str]:
    a, b = z1.float().requires_grad_(True), z2.float().requires_grad_(True)
    out = _value(spec, loss, a, b, _first_tau(spec))
    shapes = {"loss": tuple(out.loss.shape), "value": tuple(out.value.shape)}
    if any(shapes.values()):
        return [f"shape: two views [N, d] must give a scalar loss and value, got shapes {shapes}"]
    if not math.isfinite(float(out.value)):
        return [f"finite: the value is {float(out.value)} on random views"]
    out.loss.backward()
    grads = [t.grad for t in (a, b)]
    if any(gr is None for gr in grads) or not any(bool(gr.abs().sum() > 0) for gr in grads if gr is not None):
        return ["gradient: the loss does not reach the views (no gradient, or zero on both)"]
    if not all(bool(torch.isfinite(gr).all()) for gr in grads if gr is not None):
        return ["gradient: the gradient with respect to the views is not finite"]
    return []


def _temperature(spec: LossSpec, loss: ContrastiveLoss, z1: Tensor, z2: Tensor) -> list[str]:
    if spec.owns_temperature:
        loss.init_temperature(TAU_START)
        got = float(loss.learnt_temperature().detach().double().mean())
        if not math.isclose(got, TAU_START, rel_tol=1e-6):
            return [f"temperature: it owns its τ, but init_temperature({TAU_START}) left it at {got:g}"]
        return []
    lo, hi = (float(_value(spec, loss, z1, z2, tau).value) for tau in TAUS)
    same = math.isclose(lo, hi, rel_tol=RTOL, abs_tol=ATOL)
    if spec.uses_temperature and same:
        return [f"temperature: the registry says it uses τ, but its value is {lo:.6g} at τ = {TAUS[0]} and {TAUS[1]}"]
    if not spec.uses_temperature and not same:
        return [
            f"temperature: the registry says it has no τ (uses_temperature = False), but its value is {lo:.6g} "
            f"at τ = {TAUS[0]} and {hi:.6g} at τ = {TAUS[1]}"
        ]
    return []


def _order(spec: LossSpec, loss: ContrastiveLoss, z1: Tensor, z2: Tensor) -> list[str]:
    perm = torch.randperm(z1.shape[0], generator=torch.Generator().manual_seed(1))
    tau = _first_tau(spec)
    before, after = (float(_value(spec, loss, a, b, tau).value) for a, b in ((z1, z2), (z1[perm], z2[perm])))
    if not math.isclose(before, after, rel_tol=RTOL, abs_tol=ATOL):
        return [f"order: the same pairs in another order give {after!r}, not {before!r}"]
    return []


def _reference(spec: LossSpec, loss: ContrastiveLoss, z1: Tensor, z2: Tensor) -> list[str]:
    if spec.reference is None:
        return []
    tau = TAUS[0]
    if spec.owns_temperature:
        loss.init_temperature(tau)
    got = float(_value(spec, loss, z1, z2, None if spec.owns_temperature else tau).value)
    want = float(spec.reference(z1.clone(), z2.clone(), tau, **loss.params()))
    if not math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL):
        return [f"reference: float64 value {got!r}, the spec's reference {want!r} (τ = {tau}, default parameters)"]
    return []
