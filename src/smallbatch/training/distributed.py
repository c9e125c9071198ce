"""Data-parallel contrastive training over processes (torch.distributed), negatives
gathered over all of them.

The global batch of N images is split into P equal shares of n = N/P images, one per
process (:meth:`World.share`).  Every process draws the same global permutation and the
same augmentation randomness and takes its share, so a run on P processes sees exactly
the images (and views) of a run on 1, and every piece of state (weights, optimiser,
momentum encoder, MoCo queue, generators, permutation, step) is the same on every
process and the same as on 1: a state saved by rank 0 on P processes resumes on M.

**Gradient arithmetic of the gathered in-batch loss.**  Process r embeds its n images
(two views, ``z1_r``, ``z2_r``) and gathers everybody's (:func:`gather_with_grad`); the
2N gathered views are ordered like the 1-process batch (z1 of ranks 0..P-1, then z2 of
ranks 0..P-1).  The 1-process loss is ``L = (1/2N) sum_{i<2N} l_i(z)``; process r computes
``L_r = (1/2n) sum_{i in A_r} l_i(z)`` over its 2n anchors ``A_r``
(:meth:`World.anchor_rows`) with all 2N views as candidates, so ``L = (1/P) sum_r L_r``.
Backward on r gives ``dL_r/dz`` for all 2N views (its anchors' negatives are everybody's
views); the gather's backward sums that over processes and keeps r's rows:
``g_r = sum_s dL_s/dz_r = P dL/dz_r``.  Back-propagated through r's copy of the network
this is ``P dL/dtheta|via z_r``; DDP averages over processes:
``(1/P) sum_r P dL/dtheta|via z_r = sum_r dL/dtheta|via z_r = dL/dtheta``, the 1-process
gradient.  Batch-level statistics use the whole batch: DCLW's weights take
``batch_positives(z1_all, z2_all)``; EqCo's alpha/K sees K = 2N-2 (the gathered batch's).

**MoCo queue.**  Negatives are queued keys (no gradient), identical on every process:
each process computes the loss of its n queries against the queue (``L_r``, mean over n;
DDP's average is the 1-process mean over N) and the keys of all processes are gathered
without gradient (:func:`gather`) in rank order and enqueued on every process, so the
queues stay identical to the 1-process queue (EqCo's K is the queue's length, global).

**BatchNorm.**  With :func:`sync_batchnorm` the batch statistics are those of the global
batch (every process's views), so train-mode BN is the 1-process model's.  Without it,
each process normalises its own 2n views: that is a different model, whose 1-process
equivalent computes BN statistics per share (forward each share separately); DDP then
broadcasts rank 0's running statistics at every forward (``broadcast_buffers``).

Size 1 (no launcher variables) creates no process group and every function here is the
identity, so the same code runs in one process unchanged.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from .launch import claim_gpu, launch_from_env

__all__ = [
    "World",
    "initialized",
    "gather_with_grad",
    "gather",
    "mean_over_processes",
    "any_over_processes",
    "GlobalBatchNorm",
    "pool_moments",
    "update_running_stats",
    "batch_statistics_shared",
    "sync_batchnorm",
    "data_parallel",
    "unwrap",
]

# torch >= 2.12 names the single-tensor collectives *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _device_for(device: str, local_rank: int, processes: int = 1) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is asked for (or ``auto``) and present; ``cuda:0``
    when the launcher shows each task one GPU (``--gpus-per-task``); else the CPU."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu" or not torch.cuda.is_available():
        if device == "cuda":
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if processes == 1:  # one process of its own: spread such processes over the node's GPUs
        return torch.device("cuda", claim_gpu(count))
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if count == 1:
        return torch.device("cuda", 0)
    raise ValueError(f"local rank {local_rank} has no GPU of its own: this node shows {count} GPUs")


# --------------------------------------------------------------------------- the world
@dataclass(frozen=True)
class World(AbstractContextManager):
    """This process's place among the data-parallel processes, and its device.

    ``World()`` is one process (no process group).  :meth:`from_env` joins the launch
    described by torchrun's or srun's variables (NCCL on CUDA, gloo on the CPU).
    Use it as a context manager, or call :meth:`close`, to leave the group cleanly.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (size 1)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, saves and prints."""
        return self.rank == 0

    @classmethod
    def from_env(
        cls,
        device: str = "auto",
        backend: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 1800.0,
    ) -> World:
        """Join the launch in the environment (:func:`launch_from_env`); size 1 joins nothing.

        ``backend`` overrides NCCL/gloo (e.g. gloo for several processes on one GPU).
        ``timeout_s`` bounds every collective: a process that died makes the others
        fail after it instead of hanging.  A process group that already exists (made
        by the caller) is used as it is; :meth:`close` ends it all the same.
        """
        launch = launch_from_env(env)
        dev = _device_for(device, launch.local_rank, launch.size)
        if dist.is_available() and dist.is_initialized():
            if launch.size > 1 and (dist.get_world_size(), dist.get_rank()) != (launch.size, launch.rank):
                raise RuntimeError(
                    f"the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not "
                    f"the launch's (rank {launch.rank} of {launch.size})"
                )
        elif launch.size == 1:
            return cls(device=dev)
        else:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group(
                backend or ("nccl" if dev.type == "cuda" else "gloo"),
                init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                rank=launch.rank,
                world_size=launch.size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(dist.get_rank(), dist.get_world_size(), launch.local_rank, dev, dist.get_backend())

    def close(self) -> None:
        """Leave the process group (every process must call it); size 1: nothing."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def __exit__(self, *exc) -> None:
        self.close()

    def barrier(self) -> None:
        """Wait for every process (e.g. before others read what rank 0 saved)."""
        if self.size > 1:
            dist.barrier()

    # ---- the global batch
    def share(self, n_global: int) -> slice:
        """This process's rows of a global batch of ``n_global``: the r-th of P equal shares."""
        if n_global % self.size:
            raise ValueError(
                f"the global batch ({n_global}) must be a multiple of the number of processes ({self.size})"
            )
        n = n_global // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def shard(self, x: Tensor) -> Tensor:
        """This process's share of a global tensor (dim 0): indices, images or views of the
        whole batch, drawn identically on every process."""
        return x[self.share(x.shape[0])]

    def anchor_rows(self, n_local: int, device: torch.device | str | None = None) -> Tensor:
        """This process's anchors among the 2N gathered views ``cat(z1_all, z2_all)``:
        its images' first views ``[r n, (r+1) n)`` and second views ``N + [r n, (r+1) n)``
        (N = P n), for ``in_batch_scores(z1_all, z2_all, rows=...)``."""
        own = torch.arange(self.rank * n_local, (self.rank + 1) * n_local, device=device or self.device)
        return torch.cat([own, own + self.size * n_local])


# --------------------------------------------------------------------------- collectives
def initialized() -> bool:
    """True when a process group of more than one process exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0; backward: sum the gradients over processes, keep ours."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: D102
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: D102
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM)  # = all-reduce(sum), then our slice
        return out


def gather_with_grad(x: Tensor) -> Tensor:
    """``cat`` of every process's ``x`` (same shape everywhere) along dim 0, in rank order,
    differentiable: the backward sums the incoming gradient over processes and returns
    this process's rows (a reduce-scatter), so each embedding's gradient reaches the
    process that made it, with every process's loss in it (module docstring: with DDP's
    averaging this is the 1-process gradient).  One process: ``x`` itself."""
    return _GatherWithGrad.apply(x) if initialized() else x


@torch.no_grad()
def gather(x: Tensor) -> Tensor:
    """``cat`` of every process's ``x`` along dim 0 in rank order, without gradient
    (MoCo keys and their dataset indices for the queue, diagnostics of the whole batch)."""
    if not initialized():
        return x
    x = x.detach().contiguous()
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x)
    return out


@torch.no_grad()
def mean_over_processes(x: Tensor) -> Tensor:
    """The mean of ``x`` over processes (no gradient): equal shares make the mean of the
    per-process losses the global batch's loss, the value rank 0 logs."""
    if not initialized():
        return x.detach()
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y / dist.get_world_size()


def average_gradients(params: Sequence[Tensor]) -> None:
    """Average the gradients of ``params`` over processes, in place: what DDP does for the
    module it wraps, for parameters outside it (a loss's learnt τ and bias).  Every process
    computes the loss of its share of the anchors, so the mean of their gradients is the
    whole batch's.  One all-reduce of the flattened gradients (a missing one counts as 0)."""
    if not initialized() or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p).clone()


def any_over_processes(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every process when it is true on any: decisions that end the loop (a
    non-finite loss, SIGTERM) must be taken by all processes at the same step, or the
    others wait in a collective for one that left.  ``device``: the world's (NCCL needs
    CUDA tensors)."""
    if not initialized():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


# --------------------------------------------------------------------------- BatchNorm
class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training-mode statistics are those of the global batch (every
    process's inputs): torch's ``SyncBatchNorm`` for devices it refuses (the CPU, gloo).

    Each process computes its count, mean and biased variance per channel; one
    differentiable gather (:func:`gather_with_grad`) brings every process's, and Chan's
    pooling gives the global ones: ``mean = sum n_r m_r / N``,
    ``var = sum n_r (v_r + (m_r - mean)^2) / N``.  The gradient flows back through the
    gather to every process's statistics, so the backward is the global batch's too.
    Running statistics are updated as ``nn.BatchNorm*`` does, from the global mean and
    unbiased variance (``var N/(N-1)``), so they are the same on every process.  Eval
    mode, or a single process, is plain BatchNorm.  Accepts ``(N, C, *)`` inputs.
    """

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, ...), got {tuple(x.shape)}")

    def forward(self, x: Tensor) -> Tensor:
        use_batch = self.training or not self.track_running_stats
        if not (use_batch and initialized()):
            return super().forward(x)
        self._check_input_dim(x)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        dims = [0, *range(2, x.dim())]
        count = xs.new_full((1,), float(x.numel() // x.shape[1]))
        local = torch.cat([count, xs.mean(dims), xs.var(dims, unbiased=False)])
        total, mean, var = pool_moments(gather_with_grad(local[None]))  # over P rows of (1 + 2C)
        c = x.shape[1]
        if self.training and self.track_running_stats:
            update_running_stats(self, mean.detach(), var.detach(), total)
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = (xs - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """``module`` with every BatchNorm replaced by a GlobalBatchNorm sharing its
        parameters and buffers (as ``SyncBatchNorm.convert_sync_batchnorm`` does)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, (cls, nn.SyncBatchNorm)):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert(child))
        return out


def pool_moments(stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Chan's pooling of K groups' per-channel moments: ``stats`` (K, 1 + 2C) holds each
    group's element count, mean and biased variance; returns the union's count, mean and
    biased variance, ``mean = sum n_k m_k / N``, ``var = sum n_k (v_k + (m_k - mean)^2) / N``."""
    c = (stats.shape[1] - 1) // 2
    n, m, v = stats[:, :1], stats[:, 1 : 1 + c], stats[:, 1 + c :]
    total = n.sum()
    mean = (n * m).sum(0) / total
    return total, mean, (n * (v + (m - mean) ** 2)).sum(0) / total


@torch.no_grad()
def update_running_stats(bn: _BatchNorm, mean: Tensor, var: Tensor, total: Tensor | float) -> None:
    """Move ``bn``'s running statistics as ``nn.BatchNorm*`` does after one training batch
    of ``total`` elements per channel with batch ``mean`` and biased variance ``var``: the
    running variance takes the unbiased ``var * total / (total - 1)``; momentum None is the
    cumulative average."""
    assert bn.running_mean is not None and bn.running_var is not None and bn.num_batches_tracked is not None
    bn.num_batches_tracked.add_(1)
    f = (1.0 / bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    f = torch.as_tensor(f, dtype=mean.dtype, device=mean.device)
    total = torch.as_tensor(total, dtype=var.dtype, device=var.device)
    bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), f.to(bn.running_mean.dtype))
    unbiased = var * total / (total - 1).clamp(min=1)
    bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), f.to(bn.running_var.dtype))


def batch_statistics_shared(bn: nn.Module) -> bool:
    """True when ``bn``'s training statistics are those of every process's inputs
    (:class:`GlobalBatchNorm` or torch's ``SyncBatchNorm`` inside a process group)."""
    return initialized() and isinstance(bn, (GlobalBatchNorm, nn.SyncBatchNorm))


def sync_batchnorm(module: nn.Module, world: World, enabled: bool = True) -> nn.Module:
    """BatchNorm over the global batch (call before :func:`data_parallel`, on the model
    and on a MoCo momentum encoder alike).  CUDA: torch's ``SyncBatchNorm``; other
    devices: :class:`GlobalBatchNorm` (torch's refuses CPU tensors).  ``enabled=False``
    or one process: ``module`` unchanged (per-process statistics; module docstring)."""
    if not enabled or world.size == 1:
        return module
    if world.device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return GlobalBatchNorm.convert(module)


# --------------------------------------------------------------------------- DDP
def data_parallel(model: nn.Module, world: World, **ddp_kwargs) -> nn.Module:
    """``model`` wrapped in ``DistributedDataParallel`` (gradients averaged over processes
    in backward; rank 0's weights broadcast at construction); one process: ``model``.
    Wrap after :func:`sync_batchnorm` and after moving the model to ``world.device``."""
    if world.size == 1:
        return model
    if world.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [world.device.index])
    return DistributedDataParallel(model, **ddp_kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (what to save, evaluate or run without DDP)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
