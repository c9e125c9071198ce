"""Gradient caching: a contrastive batch larger than the device holds (Gao, Zhang, Han &
Callan 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"),
with BatchNorm in training mode normalising over the WHOLE batch.

A contrastive loss couples every embedding of the batch, and so does train-mode
BatchNorm: each layer normalises with the batch's mean and variance, and those depend on
every image.  :func:`cached_backward` computes exactly the gradient (and the running
statistics) of one forward of the whole batch while holding one chunk's activations:

1. **statistics** (no graph): BatchNorm layer k's input depends on the statistics of the
   layers before it, so they are found one layer at a time, in the order the forward
   meets them: sweep k runs every chunk up to layer k (the layers before it normalising
   with their now-known whole-batch statistics), takes the chunk's count, mean and
   biased variance there and stops; Chan's pooling over chunks (and, for SyncBatchNorm /
   :class:`~smallbatch.training.distributed.GlobalBatchNorm`, over processes) gives the batch's.
2. **embeddings** (no graph): every chunk forwarded with those statistics; the loss on
   all embeddings and its gradient ``g = dL/dz`` (the paper's cache).
3. **statistics' adjoints**, deepest layer first: with BatchNorm ``y = (x - mu) /
   sqrt(var + eps) * w + b``, the batch's gradient is the gradient with the statistics
   held constant plus, for every input element, ``A/M + 2 B (x - mu)/M`` (M elements per
   channel in the batch), with the batch-level sums ``A = dL/dmu`` and ``B = dL/dvar``.
   Sweep k re-runs every chunk with a graph from layer k on and accumulates
   ``A_k, B_k`` (autograd's gradient of ``g_c . z_c`` with respect to layer k's
   statistics, the deeper layers already adding their terms); summed over processes for
   shared statistics.
4. **backward**: every chunk re-run with a graph, each BatchNorm adding its ``A/M +
   2 B (x - mu)/M`` to its input's gradient, ``backward(z_c, g_c)``; the parameters'
   gradients accumulated over chunks are the whole batch's.  The running statistics
   are then updated once, as the whole batch's forward would (unbiased variance).

Cost: with L such layers, ~L/2 forwards without graph for the statistics, L forwards
with (partial) backward for the adjoints, on top of the paper's forward + forward and
backward; BatchNorm in eval mode or none at all needs neither (the paper's three passes).
Random ops (dropout) draw the same numbers in every pass of a chunk: the RNG state
before each chunk's first pass is recorded and restored before every later one (the
paper's ``RandContext``), and the state after the loss is put back at the end.  A
BatchNorm module called twice in one forward is refused (its statistics are per call).

With several processes (``smallbatch.training.distributed``) the loss gathers inside ``loss_of``
as usual (each process passes its own views, the gather runs once, after pass 2), and
``model`` may be DDP-wrapped: passes 1-3 run the unwrapped module, pass 4 runs every
chunk but the last under ``model.no_sync()``, so gradients are all-reduced once, in the
last chunk's backward.  All processes must have the same number of chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..losses import LossOutput
from .distributed import GlobalBatchNorm, batch_statistics_shared, gather, pool_moments, unwrap, update_running_stats

__all__ = ["cached_backward", "chunk_slices", "eval_batchnorm"]


def chunk_slices(n: int, chunk_size: int) -> list[slice]:
    """Consecutive slices of ``chunk_size`` rows covering ``range(n)`` (the last may be shorter)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return [slice(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]


@contextmanager
def eval_batchnorm(module: nn.Module) -> Iterator[nn.Module]:
    """Every BatchNorm of ``module`` in eval mode (normalising with, and not updating,
    its running statistics) inside the block; each one's mode is restored after.
    Then every image is embedded independently (a different model from train mode)."""
    bns = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    modes = [m.training for m in bns]
    try:
        for m in bns:
            m.eval()
        yield module
    finally:
        for m, mode in zip(bns, modes):
            m.train(mode)


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _loss_tensor(out: Any) -> Tensor:
    return out.loss if isinstance(out, LossOutput) else out


def _accumulate(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Add ``grads`` into the ``.grad`` of ``params`` (as ``backward`` would)."""
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g.detach().clone() if p.grad is None else p.grad + g


def _check_views(views: Sequence[Tensor]) -> tuple[Tensor, ...]:
    views = tuple(views)
    if not views or not all(isinstance(v, Tensor) for v in views):
        raise ValueError("views must be a non-empty sequence of tensors (one per view of the images)")
    n = views[0].shape[0]
    if n < 1 or any(v.shape[0] != n for v in views):
        raise ValueError(f"every view must have the same (>= 1) number of images, got {[v.shape[0] for v in views]}")
    return views


# --------------------------------------------------------------------------- BatchNorm over the whole batch
class _Stop(Exception):
    """Ends a statistics sweep's forward at the layer whose statistics it came for."""


class _AddStatisticsGrad(torch.autograd.Function):
    """The identity; its backward adds the batch statistics' share ``(A + 2 B (x - mu)) / M``."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, b: Tensor, mean: Tensor, count: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, a, b, mean, count)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        x, a, b, mean, count = ctx.saved_tensors
        return grad + (a + 2 * b * (x - mean)) / count, None, None, None, None


class _Layer:
    """One BatchNorm normalising with batch statistics, during one chunked step."""

    def __init__(self, module: _BatchNorm, plan: _Plan) -> None:
        self.m, self.plan, self.shared = module, plan, batch_statistics_shared(module)
        self.pieces: list[Tensor] = []  # (count, mean, biased var) of each chunk at this layer
        self.stats: tuple[Tensor, Tensor, Tensor] | None = None  # the whole batch's (count, mean, biased var), detached
        self.adj: tuple[Tensor, Tensor] | None = None  # (dL/dmean, dL/dvar) of the whole batch
        self.leaves: tuple[Tensor, Tensor] | None = None  # the statistics as leaves (adjoint sweep)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        m = self.m
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.stats is None:
            self.plan.found(self, xs)  # raises _Stop
        count, batch_mean, batch_var = self.stats
        shape = (1, x.shape[1]) + (1,) * (x.dim() - 2)
        mean, var = self.leaves if self.leaves is not None else (batch_mean, batch_var)
        if self.leaves is not None:
            torch.set_grad_enabled(True)  # the graph starts here (the sweep runs without one before)
        elif self.adj is not None and torch.is_grad_enabled():
            a, b = (t.view(shape) for t in self.adj)
            xs = _AddStatisticsGrad.apply(xs, a, b, batch_mean.view(shape), count)
        y = (xs - mean.view(shape)) * torch.rsqrt(var.view(shape) + m.eps)
        if m.affine:
            y = y * m.weight.view(shape) + m.bias.view(shape)
        return y.to(x.dtype)

    def pool(self) -> None:
        """The whole batch's statistics from the chunks' (and the processes', if shared)."""
        stats = torch.stack(self.pieces)
        self.stats = pool_moments(gather(stats) if self.shared else stats)
        self.pieces = []

    def pooled(self) -> tuple[Tensor, Tensor, Tensor]:
        """(count, mean, biased var) of the whole batch, once :meth:`pool` has run."""
        if self.stats is None:
            raise RuntimeError("a BatchNorm's batch statistics were used before a sweep pooled them")
        return self.stats

    def update_running(self) -> None:
        if self.m.training and self.m.track_running_stats:
            count, mean, var = self.pooled()
            update_running_stats(self.m, mean, var, count)


_PLAIN_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, GlobalBatchNorm)


def _batch_statistics(m: _BatchNorm) -> bool:
    """Whether ``m`` normalises with its input's statistics (as ``_BatchNorm.forward`` decides)."""
    return m.training or (m.running_mean is None and m.running_var is None)


class _Plan:
    """The batch-statistics BatchNorm layers of a module, their forwards replaced for the
    step (:meth:`patched`), and the sweeps that fill their statistics and adjoints."""

    def __init__(self, module: nn.Module) -> None:
        bns = [m for m in module.modules() if isinstance(m, _BatchNorm) and _batch_statistics(m)]
        for m in bns:
            if type(m) not in _PLAIN_BATCHNORMS:
                raise ValueError(
                    f"gradient caching normalises over the whole batch, but {type(m).__name__} computes "
                    "its own training statistics (e.g. ghost BatchNorm, train.bn_group); use one of them"
                )
        self.layers = [_Layer(m, self) for m in bns]
        self.order: list[_Layer] = []  # in the order the forward meets them
        self.target: _Layer | None = None

    @contextmanager
    def patched(self) -> Iterator[_Plan]:
        saved = [layer.m.__dict__.get("forward") for layer in self.layers]
        try:
            for layer in self.layers:  # an instance attribute, as `saved` reads and `del` removes it
                vars(layer.m)["forward"] = layer.forward
            yield self
        finally:
            for layer, fwd in zip(self.layers, saved):
                del layer.m.forward
                if fwd is not None:
                    vars(layer.m)["forward"] = fwd

    def found(self, layer: _Layer, xs: Tensor) -> NoReturn:
        """Statistics sweep: the first layer without statistics; its chunk moments, then stop."""
        if self.target not in (None, layer):
            raise RuntimeError("a statistics sweep met a second BatchNorm without statistics")
        if self.target is None:
            self.target = layer
            self.order.append(layer)
        dims = [0, *range(2, xs.dim())]
        count = xs.new_full((1,), float(xs.numel() // xs.shape[1]))
        layer.pieces.append(torch.cat([count, xs.mean(dims), xs.var(dims, unbiased=False)]))
        raise _Stop

    def statistics(self, run_chunk: Callable[[int], Tensor], n_chunks: int) -> None:
        """Pass 1: sweeps until a chunk runs to the end (every layer has its statistics)."""
        while (target := self._sweep(run_chunk, n_chunks)) is not None:
            target.pool()

    def _sweep(self, run_chunk: Callable[[int], Tensor], n_chunks: int) -> _Layer | None:
        """One statistics sweep: the layer whose chunk moments it gathered (:meth:`found`), or
        None when a chunk ran to the end."""
        self.target = None
        with torch.no_grad():
            for i in range(n_chunks):
                try:
                    run_chunk(i)
                except _Stop:
                    continue
                if self.target is None:
                    return None
                raise RuntimeError("a statistics sweep ran a chunk to the end")  # pragma: no cover
        return self.target

    def check_single_calls(self) -> None:
        for layer in self.layers:
            if layer.calls > 1:
                raise ValueError(
                    f"{type(layer.m).__name__} is called {layer.calls} times in one forward; gradient "
                    "caching needs each BatchNorm module called once (give each use its own module)"
                )
            layer.calls = 0

    def adjoints(self, run_chunk: Callable[[int], Tensor], grads: list[Tensor]) -> None:
        """Pass 3: each layer's ``(dL/dmean, dL/dvar)`` over the whole batch, deepest first."""
        for layer in reversed(self.order):
            _, mean, var = layer.pooled()
            layer.leaves = (mean.detach().clone().requires_grad_(True), var.detach().clone().requires_grad_(True))
            total = [torch.zeros_like(t) for t in layer.leaves]
            for i, g in enumerate(grads):
                with torch.no_grad():  # the graph starts at the layer (_Layer.forward)
                    z = run_chunk(i)
                if not z.requires_grad:  # the output does not depend on this layer
                    continue
                got = torch.autograd.grad(z, layer.leaves, g, allow_unused=True)
                total = [t if d is None else t + d for t, d in zip(total, got)]
            layer.leaves = None
            adj = torch.cat(total)
            if layer.shared:
                dist.all_reduce(adj, op=dist.ReduceOp.SUM)
            d_mean, d_var = adj.chunk(2)
            layer.adj = (d_mean, d_var)

    def update_running(self) -> None:
        for layer in self.order:
            layer.update_running()


class _Chunks:
    """Runs chunk i of the views through a module, with chunk i's random numbers each time."""

    def __init__(self, views: tuple[Tensor, ...], chunks: list[slice]) -> None:
        self.views, self.chunks, self.device = views, chunks, views[0].device
        self.states: dict[int, tuple] = {}  # RNG state before each chunk's first pass

    def run(self, module: nn.Module, i: int) -> Tensor:
        if i in self.states:
            _set_rng_state(self.states[i], self.device)
        else:
            self.states[i] = _rng_state(self.device)
        return module(torch.cat([v[self.chunks[i]] for v in self.views]))

    def embed(self, module: nn.Module, plan: _Plan) -> list[Tensor]:
        """Pass 2: per-view embeddings (detached) of the whole batch."""
        for layer in plan.layers:
            layer.calls = 0
        pieces = []
        with torch.no_grad():
            for i in range(len(self.chunks)):
                pieces.append(self.run(module, i).chunk(len(self.views)))
                plan.check_single_calls()
        return [torch.cat([p[j] for p in pieces]) for j in range(len(self.views))]

    def backward(self, model: nn.Module, grads: list[Tensor]) -> None:
        """Pass 4: each chunk with a graph, back-propagating its slice of the cached gradient;
        under DDP every chunk but the last under ``no_sync`` (one all-reduce per step)."""
        no_sync = getattr(model, "no_sync", None)
        for i, g in enumerate(grads):
            last = i == len(grads) - 1
            with nullcontext() if last or no_sync is None else no_sync():
                self.run(model, i).backward(g)


def cached_backward(
    model: nn.Module,
    views: Sequence[Tensor],
    loss_of: Callable[..., LossOutput | Tensor],
    chunk_size: int,
    scale: Callable[[Tensor], Tensor] | None = None,
    loss_params: Sequence[Tensor] = (),
) -> tuple[LossOutput | Tensor, tuple[Tensor, ...]]:
    """Back-propagate ``loss_of(*z)`` into ``model``'s gradients, embedding the batch in
    chunks (module docstring): the whole batch's gradient, BatchNorm statistics and
    running statistics; returns ``(loss_of's output, z)`` with ``z`` the detached
    embeddings of each view.

    ``views``: V tensors of the same N images (e.g. ``(v1, v2)``; MoCo's queries
    ``(v1,)``); a chunk is ``chunk_size`` images, i.e. one forward of
    ``model(cat(v[c] for v in views))`` over ``V * chunk_size`` inputs, as the training
    loop embeds both views in one pass (BatchNorm's statistics are over all V N inputs).
    ``loss_of(*z)`` takes the V embedding tensors ``(N, D)`` and returns a
    :class:`LossOutput` or a scalar tensor; it may gather over processes.  ``scale``:
    applied to the loss before differentiation (``GradScaler.scale`` for fp16).  Run it
    inside ``torch.autocast`` for mixed precision.  Gradients accumulate into ``.grad``
    (zero them before), also those of ``loss_params`` (a loss's own learnt parameters).
    ``chunk_size >= N``: one ordinary forward and backward.
    """
    views = _check_views(views)
    chunks = chunk_slices(views[0].shape[0], chunk_size)
    scale = scale or (lambda t: t)
    if len(chunks) == 1:
        zs = model(torch.cat(views)).chunk(len(views))
        out = loss_of(*zs)
        scale(_loss_tensor(out)).backward()
        return out, tuple(z.detach() for z in zs)
    module, runner = unwrap(model), _Chunks(views, chunks)
    plan = _Plan(module)
    with plan.patched():
        plan.statistics(lambda i: runner.run(module, i), len(chunks))
        zs = tuple(z.requires_grad_(True) for z in runner.embed(module, plan))
        out = loss_of(*zs)
        got = torch.autograd.grad(scale(_loss_tensor(out)), (*zs, *loss_params), allow_unused=True)
        _accumulate(loss_params, got[len(zs) :])
        got = tuple(torch.zeros_like(z) if g is None else g for z, g in zip(zs, got[: len(zs)]))
        grads = [torch.cat([g[sl] for g in got]) for sl in chunks]
        after_loss = _rng_state(views[0].device)
        plan.adjoints(lambda i: runner.run(module, i), grads)
        runner.backward(model, grads)
        _set_rng_state(after_loss, views[0].device)
    plan.update_running()
    return out, tuple(z.detach() for z in zs)
