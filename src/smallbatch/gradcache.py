"""Gradient caching: a contrastive batch larger than the device holds (Gao, Zhang, Han &
Callan 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup").

A contrastive loss couples every embedding of the batch, so the batch cannot simply be
split into independent micro-batches; but the encoder is applied to each image alone, so
its graph can be.  :func:`cached_backward` does the paper's three passes:

1. embed the batch in chunks of ``chunk_size`` images without a graph (memory: one
   chunk's activations);
2. compute the loss on all embeddings at once and its gradient with respect to them,
   ``g = dL/dz`` (the "cache"; memory: the loss's, N x N scores);
3. re-run each chunk with a graph and back-propagate its slice of the cache,
   ``backward(z_c, g_c)``, accumulating parameter gradients; since
   ``dL/dtheta = sum_c (dz_c/dtheta)^T g_c`` this is the whole batch's gradient.

What is true, and what differs from one forward over the whole batch:

* Exact when the encoder maps each image independently of the others: BatchNorm in eval
  mode (:func:`eval_batchnorm`, frozen running statistics) or no BatchNorm.  Random ops
  (dropout) draw the same numbers in pass 3 as in pass 1: the RNG state before each
  chunk is recorded and restored (the paper's ``RandContext``), and the state after the
  loss is put back at the end.
* Train-mode BatchNorm normalises each chunk with its own statistics ("ghost BN"),
  a different model from the whole batch's: the gradient is then exactly that of
  forwarding the chunks one by one (``tests/test_gradcache.py`` checks both).  Running
  statistics are updated once per chunk, in pass 3 only: pass 1 runs with them
  saved and restored, so it leaves them untouched.
* Memory: peak ~ one chunk's activations + the loss's; time: one extra forward.

With several processes (``smallbatch.distributed``) the loss gathers inside ``loss_of``
as usual (each process passes its own views, the gather runs once, in pass 2), and
``model`` may be DDP-wrapped: pass 1 runs the unwrapped module, pass 3 runs every chunk
but the last under ``model.no_sync()``, so gradients are all-reduced once, in the last
chunk's backward.  With SyncBatchNorm, chunk c's statistics are those of every
process's chunk c (all processes have the same number of chunks).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .distributed import unwrap
from .losses import LossOutput

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
    Then every image is embedded independently and chunking is exact."""
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


def _check_views(views: Sequence[Tensor]) -> tuple[Tensor, ...]:
    views = tuple(views)
    if not views or not all(isinstance(v, Tensor) for v in views):
        raise ValueError("views must be a non-empty sequence of tensors (one per view of the images)")
    n = views[0].shape[0]
    if n < 1 or any(v.shape[0] != n for v in views):
        raise ValueError(f"every view must have the same (>= 1) number of images, got {[v.shape[0] for v in views]}")
    return views


def _embed_without_graph(module: nn.Module, views: tuple[Tensor, ...], chunks: list[slice]):
    """Pass 1: per-view embeddings (detached) and the RNG state before each chunk; the
    BatchNorm running statistics are restored afterwards (pass 3 updates them)."""
    device = views[0].device
    buffers = [b for m in module.modules() if isinstance(m, _BatchNorm) for b in m.buffers()]
    saved = [b.clone() for b in buffers]
    states, pieces = [], []
    with torch.no_grad():
        for sl in chunks:
            states.append(_rng_state(device))
            pieces.append(module(torch.cat([v[sl] for v in views])).chunk(len(views)))
        for b, s in zip(buffers, saved):
            b.copy_(s)
    return states, [torch.cat([p[i] for p in pieces]) for i in range(len(views))]


def _backward_chunks(model: nn.Module, views: tuple[Tensor, ...], chunks: list[slice],
                     grads: tuple[Tensor, ...], states: list) -> None:
    """Pass 3: each chunk with a graph, back-propagating its slice of the cached gradient;
    under DDP every chunk but the last under ``no_sync`` (one all-reduce per step)."""
    device = views[0].device
    no_sync = getattr(model, "no_sync", None)
    for i, sl in enumerate(chunks):
        last = i == len(chunks) - 1
        with nullcontext() if last or no_sync is None else no_sync():
            _set_rng_state(states[i], device)
            z = model(torch.cat([v[sl] for v in views]))
            z.backward(torch.cat([g[sl] for g in grads]))


def cached_backward(
    model: nn.Module,
    views: Sequence[Tensor],
    loss_of: Callable[..., LossOutput | Tensor],
    chunk_size: int,
    scale: Callable[[Tensor], Tensor] | None = None,
) -> tuple[LossOutput | Tensor, tuple[Tensor, ...]]:
    """Back-propagate ``loss_of(*z)`` into ``model``'s gradients, embedding the batch in
    chunks (module docstring); returns ``(loss_of's output, z)`` with ``z`` the detached
    embeddings of each view.

    ``views``: V tensors of the same N images (e.g. ``(v1, v2)``; MoCo's queries
    ``(v1,)``); a chunk is ``chunk_size`` images, i.e. one forward of
    ``model(cat(v[c] for v in views))`` over ``V * chunk_size`` inputs, as the training
    loop embeds both views in one pass.  ``loss_of(*z)`` takes the V embedding tensors
    ``(N, D)`` and returns a :class:`LossOutput` or a scalar tensor; it may gather over
    processes.  ``scale``: applied to the loss before differentiation (``GradScaler.scale``
    for fp16).  Run it inside ``torch.autocast`` for mixed precision.  Gradients
    accumulate into ``.grad`` (zero them before).  ``chunk_size >= N``: one ordinary
    forward and backward (no extra pass).
    """
    views = _check_views(views)
    chunks = chunk_slices(views[0].shape[0], chunk_size)
    scale = scale or (lambda t: t)
    if len(chunks) == 1:
        zs = model(torch.cat(views)).chunk(len(views))
        out = loss_of(*zs)
        scale(_loss_tensor(out)).backward()
        return out, tuple(z.detach() for z in zs)
    states, embedded = _embed_without_graph(unwrap(model), views, chunks)
    zs = tuple(z.requires_grad_(True) for z in embedded)
    out = loss_of(*zs)
    grads = torch.autograd.grad(scale(_loss_tensor(out)), zs, allow_unused=True)
    grads = tuple(torch.zeros_like(z) if g is None else g for z, g in zip(zs, grads))
    after_loss = _rng_state(views[0].device)
    _backward_chunks(model, views, chunks, grads, states)
    _set_rng_state(after_loss, views[0].device)
    return out, tuple(z.detach() for z in zs)
