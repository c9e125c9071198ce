"""The registry's classes: each spec's loss class loaded, and :func:`build_loss`."""

from __future__ import annotations

import importlib
from typing import Any

from .base import ContrastiveLoss
from .registry import SPECS, LossSpec, all_specs, loss_names, loss_spec

__all__ = ["REGISTRY", "LOSSES", "loss_class", "build_loss"]


def loss_class(spec: LossSpec) -> type[ContrastiveLoss]:
    """The class that computes ``spec``'s loss: ``spec.impl``, ``"<module>:<class>"`` (a module
    path relative to :mod:`smallbatch.losses` when it starts with a dot; a plugin's is absolute,
    its module imported here, when the loss is first built)."""
    module, _, attr = spec.impl.partition(":")
    cls = getattr(importlib.import_module(module, package=__package__), attr)
    if getattr(cls, "spec", None) is not spec:
        raise TypeError(f"{spec.impl} does not declare spec={spec.name!r}")
    return cls


#: registry name -> the loss class of every built-in loss, in the registry's order (a plugin's
#: class is loaded by :func:`build_loss`)
REGISTRY: dict[str, type[ContrastiveLoss]] = {name: loss_class(spec) for name, spec in SPECS.items()}
#: every accepted name of a built-in loss (canonical names and aliases) -> the loss class
LOSSES: dict[str, type[ContrastiveLoss]] = {
    alias: REGISTRY[name] for alias, name in loss_names().items() if name in REGISTRY
}


def build_loss(name: str, **params: Any) -> ContrastiveLoss:
    """Build a loss by registry name (``infonce``/``ntxent``/``simclr``, ``flatnce``,
    ``dcl``, ``dclw``, ``eqco``, ``sogclr``, ...: :data:`smallbatch.losses.registry.SPECS`,
    and an installed plugin's: :func:`smallbatch.losses.registry.all_specs`)
    with its parameters; ValueError on an unknown name or parameter.

    Examples:
        >>> import torch
        >>> from smallbatch.losses import build_loss
        >>> z1, z2 = torch.randn(8, 16), torch.randn(8, 16)
        >>> out = build_loss("dcl")(z1, z2, temperature=0.1)
        >>> out.loss.shape, out.value.requires_grad
        (torch.Size([]), False)
    """
    key = loss_spec(name).name
    cls = REGISTRY.get(key) or loss_class(all_specs()[key])
    return cls(**params)
