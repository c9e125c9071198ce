"""Ghost BatchNorm: train-mode BatchNorm statistics over groups of G images.

The "negatives only" control (``train.bn_group``) compares a batch of B images whose loss
sees only groups of G negatives with batches of G images; BatchNorm couples the images of
a batch too, so every arm normalises over groups of the same G images (Hoffer, Hubara &
Soudry 2017, "Train longer, generalize better", ghost batch normalisation).

A forward in train mode gets ``V`` views of ``N`` images stacked view-major (the training
step embeds ``cat([v1, v2])``: V = 2; a MoCo query or key encoder: V = 1).  Group ``g`` is
images ``[gG, (g+1)G)`` of every view, i.e. the ``V G`` inputs a batch of those G images
alone would give; each group is normalised with its own statistics and updates the
running statistics in turn, group after group.  So a layer's output, its gradient and its
running statistics are those of running the groups one after the other, each as its own
batch (up to rounding: the k groups are normalised in ONE BatchNorm call, as k*C channels
side by side, because a loop of k calls is several times slower on the CPU).  Eval
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


def _channels_last(x: Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class GhostBatchNorm(_BatchNorm):
    """A BatchNorm (1d or 2d) whose train-mode statistics are per group of ``group``
    images of ``views`` stacked views (module docstring)."""

    def __init__(self, bn: _BatchNorm, group: int, views: int) -> None:
        super().__init__(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            device=bn.weight.device if bn.affine else None,
            dtype=bn.weight.dtype if bn.affine else None,
        )
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
        v, g, c, rest = self.views, self.group, x.shape[1], x.shape[2:]
        if x.shape[0] % (v * g):
            raise ValueError(
                f"ghost BatchNorm: a batch of {x.shape[0]} inputs is not {v} views of whole groups of {g} images"
            )
        k = x.shape[0] // (v * g)
        # the k groups side by side as k*C channels: one BatchNorm call normalises each group
        # by its own statistics (and updates k copies of the running statistics)
        xs = x.reshape(v, k, g, c, *rest).transpose(1, 2).reshape(v * g, k * c, *rest)
        # weight and bias exist when affine, the running statistics when track_running_stats
        weight = self.weight.repeat(k) if self.weight is not None else None
        bias = self.bias.repeat(k) if self.bias is not None else None
        run_mean = self.running_mean.repeat(k) if self.running_mean is not None else None
        run_var = self.running_var.repeat(k) if self.running_var is not None else None
        assert self.momentum is not None  # checked in __init__
        y = F.batch_norm(xs, run_mean, run_var, weight, bias, True, self.momentum, self.eps)
        if run_mean is not None and run_var is not None:
            self._update_in_turn(run_mean.view(k, c), run_var.view(k, c), k)
        y = y.reshape(v, g, k, c, *rest).transpose(1, 2).reshape(x.shape)
        return y.contiguous(memory_format=torch.channels_last) if _channels_last(x) else y

    @torch.no_grad()
    def _update_in_turn(self, mean_k: Tensor, var_k: Tensor, k: int) -> None:
        """The running statistics after the k groups one after the other: group j's update
        ``p_j = (1 - m) r + m s_j`` (made from the same r for every group) composed in turn,
        ``r_k = (1 - m)^k r + sum_j (1 - m)^(k-1-j) (p_j - (1 - m) r)``."""
        assert self.momentum is not None and self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None  # all four: forward calls this with track_running_stats
        keep = 1.0 - self.momentum
        coef = torch.tensor([keep ** (k - 1 - j) for j in range(k)], dtype=mean_k.dtype, device=mean_k.device)
        for run, upd in ((self.running_mean, mean_k), (self.running_var, var_k)):
            run.copy_(keep**k * run + (coef[:, None] * (upd - keep * run)).sum(0))
        self.num_batches_tracked.add_(k)  # as k batches would

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
