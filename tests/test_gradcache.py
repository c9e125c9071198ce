"""Gradient caching (smallbatch.gradcache) gives the whole batch's gradient, in float64 on
the CPU, with a small_cnn + projection head:

* BatchNorm on frozen statistics (eval mode): chunked == one forward of the whole batch,
  for every loss, in-batch and with a MoCo queue, chunks that divide the batch or not;
* train-mode BatchNorm: chunked == forwarding the chunks one by one (per-chunk
  statistics), and the running statistics are updated once per chunk;
* dropout draws the same masks in the re-run (RNG replay);
* with 2 gloo processes under DDP (the loss gathering inside): chunked == 1 process with
  the whole batch, gradients all-reduced once per step (the other chunks under no_sync),
  and with SyncBatchNorm each chunk is normalised over every process's chunk.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from smallbatch.distributed import World, data_parallel, mean_over_processes, sync_batchnorm
from smallbatch.gradcache import cached_backward, chunk_slices, eval_batchnorm
from smallbatch.losses import REGISTRY, MomentumQueue
from test_distributed import (
    TOL,
    assert_results,
    bn_buffers,
    embed,
    grads,
    make_batch,
    make_loss,
    make_model,
    rel,
    run_spawned,
    share_in_batch_loss,
)

torch.set_num_threads(1)

N = 6  # images


def _whole(model, loss, v1, v2):
    z1, z2 = model(torch.cat([v1, v2])).chunk(2)
    out = loss(z1, z2)
    out.loss.backward()
    return out, (z1, z2)


def _queue(dim: int = 8) -> MomentumQueue:
    g = torch.Generator().manual_seed(5)
    qu = MomentumQueue(16, dim, dtype=torch.float64)
    qu.enqueue(torch.randn(16, dim, generator=g, dtype=torch.float64), torch.arange(16))
    return qu


# --------------------------------------------------------------------------- one process
def test_chunk_slices():
    assert chunk_slices(6, 4) == [slice(0, 4), slice(4, 6)]
    assert chunk_slices(4, 2) == [slice(0, 2), slice(2, 4)]
    assert chunk_slices(3, 8) == [slice(0, 3)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_slices(6, bad)


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("name", list(REGISTRY))
def test_chunked_gradient_equals_the_whole_batch_with_frozen_batchnorm(name, chunk):
    loss = make_loss(name)
    v1, v2, _ = make_batch(3, N)
    ref, model = make_model(), make_model()
    with eval_batchnorm(ref):
        out_ref, z_ref = _whole(ref, loss, v1, v2)
    with eval_batchnorm(model):
        out, z = cached_backward(model, (v1, v2), loss, chunk)
    assert rel(out.loss, out_ref.loss) < TOL and rel(out.value, out_ref.value) < TOL
    assert rel(list(z), list(z_ref)) < TOL
    assert rel(grads(model), grads(ref)) < TOL
    assert model.training and all(m.training for m in model.modules())  # eval_batchnorm restored the modes


@pytest.mark.parametrize("name", list(REGISTRY))
def test_chunked_gradient_with_a_queue_equals_the_whole_batch(name):
    """MoCo: the queries are chunked (keys come from the momentum encoder without graph)."""
    loss = make_loss(name)
    v1, v2, idx = make_batch(4, N)
    idx = idx % 16  # some queued keys are old keys of batch images: masked
    key = make_model(1).requires_grad_(False)
    with torch.no_grad(), eval_batchnorm(key):
        k = key(v2)
    ref, model = make_model(), make_model()
    with eval_batchnorm(ref):
        out_ref = loss(ref(v1), k, queue=_queue(), q_index=idx)
        out_ref.loss.backward()
    with eval_batchnorm(model):
        out, _ = cached_backward(model, (v1,), lambda q: loss(q, k, queue=_queue(), q_index=idx), 4)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL


def test_train_mode_batchnorm_is_per_chunk_and_updates_running_stats_once_per_chunk():
    loss = make_loss("infonce")
    v1, v2, _ = make_batch(5, N)
    ref, model = make_model(), make_model()
    tracked = int(model.head.net[1].num_batches_tracked)
    z1, z2 = embed(ref, (v1, v2), parts=3)  # chunks of 2 images, each forwarded on its own
    out_ref = loss(z1, z2)
    out_ref.loss.backward()
    out, _ = cached_backward(model, (v1, v2), loss, 2)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL
    assert rel(bn_buffers(model), bn_buffers(ref)) < TOL  # pass 1 left them alone
    assert int(model.head.net[1].num_batches_tracked) == tracked + 3


def test_one_chunk_is_an_ordinary_step():
    loss = make_loss("dcl")
    v1, v2, _ = make_batch(6, N)
    ref, model = make_model(), make_model()
    out_ref, _ = _whole(ref, loss, v1, v2)
    out, _ = cached_backward(model, (v1, v2), loss, N)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL
    assert rel(bn_buffers(model), bn_buffers(ref)) < TOL


def test_dropout_draws_the_same_masks_in_the_rerun():
    """Without the RNG replay, pass 3 would draw new masks and the gradient would differ."""
    loss = make_loss("infonce")
    v1, v2, _ = make_batch(7, N)
    ref, model = (nn.Sequential(make_model(), nn.Dropout(0.5)) for _ in range(2))
    with eval_batchnorm(ref):
        torch.manual_seed(11)
        z1, z2 = embed(ref, (v1, v2), parts=3)
        loss(z1, z2).loss.backward()
        state_ref = torch.get_rng_state()
    with eval_batchnorm(model):
        torch.manual_seed(11)
        cached_backward(model, (v1, v2), loss, 2)
    assert rel(grads(model), grads(ref)) < TOL
    assert torch.equal(torch.get_rng_state(), state_ref)  # the stream continues as after one pass


def test_scale_multiplies_the_cached_gradient():
    loss = make_loss("eqco")
    v1, v2, _ = make_batch(8, N)
    ref, model = make_model(), make_model()
    with eval_batchnorm(ref), eval_batchnorm(model):
        cached_backward(ref, (v1, v2), loss, 2)
        cached_backward(model, (v1, v2), loss, 2, scale=lambda t: 8.0 * t)
    assert rel([g / 8 for g in grads(model)], grads(ref)) < TOL


def test_bad_views_are_refused():
    model = make_model()
    v = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="same"):
        cached_backward(model, (v, v[:3]), make_loss("dcl"), 2)
    with pytest.raises(ValueError, match="non-empty"):
        cached_backward(model, (), make_loss("dcl"), 2)


# --------------------------------------------------------------------------- 2 processes
def _counted_ddp(model, world):
    """DDP whose gradient all-reduces are counted (a comm hook around the default one)."""
    ddp = data_parallel(model, world)
    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls


def check_ddp_frozen_bn(world: World, name: str) -> dict:
    """Chunks of 2 of each process's 4 images, frozen BN: the 1-process whole batch."""
    loss = make_loss(name)
    v1, v2, _ = make_batch(1)
    ref = make_model()
    with eval_batchnorm(ref):
        out_ref, _ = _whole(ref, loss, v1, v2)
    model = make_model()
    ddp, calls = _counted_ddp(model, world)
    views = (world.shard(v1), world.shard(v2))
    with eval_batchnorm(model):
        out, z = cached_backward(ddp, views, lambda a, b: share_in_batch_loss(loss, a, b, world), 2)
        chunked_grad, chunked_calls = [g.clone() for g in grads(model)], calls[0]
        model.zero_grad()
        cached_backward(ddp, views, lambda a, b: share_in_batch_loss(loss, a, b, world), 4)  # unchunked
    return {"loss": rel(mean_over_processes(out.loss), out_ref.loss),
            "grad": rel(chunked_grad, grads(ref)),
            "allreduces_beyond_one_step": float(chunked_calls != calls[0] - chunked_calls or chunked_calls < 1)}


def check_ddp_sync_bn(world: World) -> dict:
    """SyncBN + chunks: chunk c is normalised over every process's chunk c; reference: one
    process forwarding those images together, chunk by chunk."""
    loss = make_loss("infonce")
    v1, v2, _ = make_batch(2)
    n, c = v1.shape[0] // world.size, 2
    ref = make_model()
    order, za, zb = [], [], []
    for start in range(0, n, c):
        rows = [r * n + start + i for r in range(world.size) for i in range(c)]
        a, b = ref(torch.cat([v1[rows], v2[rows]])).chunk(2)
        order, za, zb = order + rows, za + [a], zb + [b]
    back = torch.argsort(torch.tensor(order))  # global image order
    out_ref = loss(torch.cat(za)[back], torch.cat(zb)[back])
    out_ref.loss.backward()
    model = sync_batchnorm(make_model(), world)
    out, _ = cached_backward(data_parallel(model, world), (world.shard(v1), world.shard(v2)),
                             lambda a, b: share_in_batch_loss(loss, a, b, world), c)
    return {"loss": rel(mean_over_processes(out.loss), out_ref.loss), "grad": rel(grads(model), grads(ref)),
            "bn_running_stats": rel(bn_buffers(model), bn_buffers(ref))}


def checks():
    return [("ddp_frozen_bn/infonce", lambda w: check_ddp_frozen_bn(w, "infonce")),
            ("ddp_frozen_bn/dclw", lambda w: check_ddp_frozen_bn(w, "dclw")),
            ("ddp_sync_bn/infonce", check_ddp_sync_bn)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_spawned("test_gradcache:checks", tmp_path_factory.mktemp("gradcache"))


@pytest.mark.parametrize("key", [k for k, _ in checks()])
def test_chunked_ddp_on_2_processes_equals_1_process(spawned, key):
    assert_results(spawned, key)
