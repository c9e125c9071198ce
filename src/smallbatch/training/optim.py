"""Optimisers and the learning-rate schedule of pretraining.

``train.lr`` is the rate at batch 256; :func:`scaled_lr` maps it to the cell's batch
size N: ``linear`` lr*N/256 (SimCLR), ``sqrt`` lr*sqrt(N/256) (SimCLR's square-root
rule, normalised at 256), ``none`` lr.  :func:`lr_at` is linear warm-up then, per step,
cosine decay to zero over the whole budget (``train.lr_schedule: cosine``) or the peak held
(``constant``: the rate at a step does not depend on the budget, so the first S steps of a
longer run are a run of S steps -- what evaluating snapshots of one run needs).

The learning rate lives in each parameter group as a 0-d tensor on the device
(:func:`make_optimizer`; :func:`set_lr` fills it), so a changing rate is data, not a
constant: a compiled optimiser step is not recompiled every step and, on a GPU,
setting it is an asynchronous copy, not a host synchronisation.  :class:`SGD` and
:class:`LARS` update all parameters with ``torch._foreach_*`` kernels (a few launches per
step, not a Python loop of kernels per parameter), multiplying by the rate tensor on the
device; Adam on CUDA is torch's ``capturable`` foreach Adam.  So an eager step reads
nothing back to the host with any of the three.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..study.lr_scaling import LR_SCALINGS, scaled_lr  # noqa: F401  (the rule lives in one torch-free place)

OPTIMIZERS = ("sgd", "lars", "adam")
LR_SCHEDULES = ("cosine", "constant")


class SGD(torch.optim.SGD):
    """SGD with momentum and weight decay (no dampening, no Nesterov), torch's update and
    state (``momentum_buffer``), applied with ``torch._foreach_*`` kernels and the rate as
    a tensor factor: torch's own SGD reads a tensor rate back to the host (``.item()``)
    at every eager step (``torch/optim/sgd.py``: ``alpha=-lr``), which synchronises a GPU::

        g   = grad + wd * w
        buf = momentum * buf + g      (buf = g on the first step; momentum 0: buf = g)
        w  -= lr * buf
    """

    def __init__(self, params, lr: float | torch.Tensor, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            if group["momentum"]:
                grads = _momentum_buffers(self, params, grads, group["momentum"])
            torch._foreach_sub_(params, torch._foreach_mul(grads, group["lr"]))


class LARS(torch.optim.Optimizer):
    """LARS (You et al. 2017) as used by SimCLR: SGD with momentum whose per-layer step is
    scaled by the trust ratio ``eta*||w|| / ||g + wd*w||``; biases and normalisation
    parameters (1-D tensors) are excluded from adaptation and decay::

        g_l   = grad_l + wd * w_l                          (2-D and larger tensors)
        g_l  *= eta*||w_l||/||g_l||  (1 when either norm is 0)
        buf_l = momentum * buf_l + g_l      (buf = g on the first step)
        w_l  -= lr * buf_l
    """

    def __init__(
        self, params, lr: float | torch.Tensor, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001
    ):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params if p.grad is not None]  # all of them: step() passes those with one
        adapt = [i for i, p in enumerate(params) if p.ndim > 1]
        if adapt:
            w = [params[i] for i in adapt]
            g = torch._foreach_add([grads[i] for i in adapt], w, alpha=group["weight_decay"])
            wn, gn = torch.stack(torch._foreach_norm(w)), torch.stack(torch._foreach_norm(g))
            trust = torch.where((wn > 0) & (gn > 0), group["eta"] * wn / gn, torch.ones_like(wn))
            torch._foreach_mul_(g, list(trust.unbind(0)))
            for j, i in enumerate(adapt):
                grads[i] = g[j]
        bufs = _momentum_buffers(self, params, grads, group["momentum"])
        torch._foreach_sub_(params, torch._foreach_mul(bufs, group["lr"]))


def _momentum_buffers(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], momentum: float
) -> list[torch.Tensor]:
    """``buf = momentum * buf + g`` for each parameter's ``momentum_buffer`` (a copy of
    ``g`` on its first step); the updated buffers."""
    bufs = [opt.state[p].get("momentum_buffer") for p in params]
    if any(b is None for b in bufs):
        for p, b, g in zip(params, bufs, grads):
            if b is None:
                opt.state[p]["momentum_buffer"] = g.detach().clone()
        todo = [(i, b) for i, b in enumerate(bufs) if b is not None]
        if todo:
            _momentum([b for _, b in todo], [grads[i] for i, _ in todo], momentum)
    else:
        _momentum(bufs, grads, momentum)
    return [opt.state[p]["momentum_buffer"] for p in params]


def _momentum(bufs: list[torch.Tensor], grads: list[torch.Tensor], momentum: float) -> None:
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)


def make_optimizer(
    params,
    name: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    device: torch.device | str = "cpu",
    compiled: bool = False,
    beta2: float = 0.999,
) -> torch.optim.Optimizer:
    """SGD (momentum), LARS or Adam with the rate as a 0-d float32 tensor on ``device``
    (Adam on CUDA is ``capturable``: its step counter stays on the device too; on the CPU it
    is torch's fused kernel: one pass over all parameters, faster than the loop, the same update
    up to float rounding --     except for a ``compiled`` step, where the compiler takes the plain update into its graph
    and cannot take the fused kernel)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {name!r}")
    lr_t = torch.tensor(float(lr), dtype=torch.float32, device=device)
    cuda = torch.device(device).type == "cuda"
    return build_optimizer(params, name, lr_t, momentum, weight_decay, cuda, compiled, beta2)


def build_optimizer(
    params,
    name: str,
    lr: torch.Tensor,
    momentum: float,
    weight_decay: float,
    cuda: bool,
    compiled: bool = False,
    beta2: float = 0.999,
) -> torch.optim.Optimizer:
    """:func:`make_optimizer`'s choice of code path for a rate tensor ``lr``: ``cuda``
    selects the CUDA one (Adam ``capturable`` + foreach) whatever device ``lr`` is on; ``beta2``:
    Adam's second-moment decay (β1 stays torch's 0.9)."""
    if name == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.Adam(
        params,
        lr=lr,
        betas=(0.9, beta2),
        weight_decay=weight_decay,
        capturable=cuda,
        foreach=True if cuda else None,
        fused=None if cuda or compiled else True,
    )


#: the methods of torch.optim.Optimizer that torch wraps with ``torch._disable_dynamo``
_DYNAMO_WRAPPED = ("add_param_group", "load_state_dict", "state_dict", "zero_grad")


def eager_optimizers(eager: bool = True) -> None:
    """Let torch's optimisers run without importing the compiler.  torch wraps four methods of
    every optimiser (building one included) in ``torch._disable_dynamo``, which imports
    ``torch._dynamo`` -- the compiler stack and scikit-learn with it: 2-3 s, the largest
    import of a job after torch and MLflow -- on the first call, only to mark them as not to
    be compiled.  A process that compiles nothing (``eager``) gives each wrapper its method as
    the cached result of that import (torch's ``__dynamo_disable``), so it calls the method
    directly; before a compile (``eager=False``) the wrappers get torch's behaviour back.
    Identical numbers either way; a torch whose wrapper caches
    under another name imports the compiler as before."""
    for name in _DYNAMO_WRAPPED:
        method = getattr(getattr(torch.optim.Optimizer, name), "__wrapped__", None)
        if method is None:
            continue
        if eager:
            setattr(method, "__dynamo_disable", method)
        elif getattr(method, "__dynamo_disable", None) is method:
            delattr(method, "__dynamo_disable")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every group's rate tensor (in place: no new tensor, no sync)."""
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def optimizer_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without the graph breaks torch's optimisers put around it (they exist
    to mark the update as no-grad for the compiler; the caller's ``no_grad`` does that), so
    ``torch.compile(fullgraph=True)`` takes the whole update as one graph."""
    step = inspect.unwrap(type(opt).step)  # through torch's profiling hook and its no-grad wrapper
    with torch.no_grad():
        step(opt)


def lr_at(step: int, total: int, warmup: int, peak: float, schedule: str = "cosine") -> float:
    """Linear warm-up over ``warmup`` steps ((step+1)/warmup of the peak), then cosine
    decay to 0 at ``total`` (clamped after it), or with ``schedule`` 'constant' the peak
    (``total`` unused)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, not {schedule!r}")
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
