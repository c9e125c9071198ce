"""Ghost BatchNorm: train-mode BatchNorm statistics over groups of G images.

The "negatives only" control (``train.bn_group``) compares a batch of B images whose loss
sees only groups of G negatives with batches of G images; BatchNorm couples the images of
a batch too, so every arm normalises over groups of the same G images (Hoffer, Hubara &
Soudry 2017, "Train longer, generalize better", ghost batch normalisation).

A forward in train mode gets ``V`` views of ``N`` images stacked view-major (the training
step embeds ``cat([v1, v2])``: V = 2; a MoCo query or key encoder: V = 1).  Group ``g`` is
images ``[gG, (g+1)G)`` of every view, i.e. the ``V G`` inputs a batch of those G images
alone would give; each group is normalised by :func:`torch.nn.functional.batch_norm` with
its own statistics and updates the running statistics in turn, group after group.  So a
layer's output, its gradient and its running statistics are those of running the groups
one after the other, each as its own batch (``tests/test_controls.py`` checks it).  Eval
mode is plain BatchNorm (the running statistics), so a checkpoint's weights load into the
ordinary model the probes build: :class:`GhostBatchNorm` keeps BatchNorm's parameter and
buffer names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["GhostBatchNorm", "ghost_batchnorm"]


class GhostBatchNorm(_BatchNorm):
    """A BatchNorm (1d or 2d) whose train-mode statistics are per group of ``group``
    images of ``views`` stacked views (module docstring)."""

    def __init__(self, bn: _BatchNorm, group: int, views: int) -> None:
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                         device=bn.weight.device if bn.affine else None,
                         dtype=bn.weight.dtype if bn.affine else None)
        if bn.momentum is None:
            raise ValueError("ghost BatchNorm needs a BatchNorm with a momentum (not the cumulative average)")
        self.group, self.views = int(group), int(views)
        self.load_state_dict(bn.state_dict())

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() not in (2, 3, 4, 5):
            raise ValueError(f"expected a 2-D to 5-D input, got {x.dim()}-D")

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return super().forward(x)
        self._check_input_dim(x)
        v, g = self.views, self.group
        if x.shape[0] % (v * g):
            raise ValueError(f"ghost BatchNorm: a batch of {x.shape[0]} inputs is not {v} views of whole groups "
                             f"of {g} images")
        k = x.shape[0] // (v * g)
        xs = x.reshape(v, k, g, *x.shape[1:])
        outs = []
        for i in range(k):
            xi = xs[:, i].reshape(v * g, *x.shape[1:])
            outs.append(F.batch_norm(xi, self.running_mean, self.running_var, self.weight, self.bias, True,
                                     self.momentum, self.eps).reshape(v, g, *x.shape[1:]))
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(k)  # as k batches would
        return torch.stack(outs, dim=1).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}, views={self.views}"


def ghost_batchnorm(model: nn.Module, group: int, views: int) -> nn.Module:
    """``model`` with every BatchNorm replaced, in place, by a :class:`GhostBatchNorm` of
    the same parameters and statistics (the state-dict keys are unchanged)."""
    for name, child in list(model.named_children()):
        if isinstance(child, _BatchNorm) and not isinstance(child, GhostBatchNorm):
            setattr(model, name, GhostBatchNorm(child, group, views))
        else:
            ghost_batchnorm(child, group, views)
    return model
