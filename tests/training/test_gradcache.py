"""Gradient caching (smallbatch.training.gradcache) gives the whole batch's gradient with BatchNorm
in training mode, in float64 on the CPU, with a small_cnn + projection head:

* train-mode BatchNorm: chunked == one forward of the whole batch (statistics over the
  whole batch, their gradient terms included), for every loss, in-batch and with a MoCo
  queue, chunks that divide the batch or not; the running statistics are updated once,
  as the whole batch's forward does (momentum and cumulative averages); a residual
  block (BatchNorm on both branches) too;
* BatchNorm on frozen statistics (eval mode) and no BatchNorm: chunked == whole;
* dropout draws the same masks in every pass of a chunk (RNG replay);
* the training step itself (``TrainStep`` with ``train.chunk_size``, fp64): three steps
  chunked == three steps whole, in-batch and with a queue;
* with 2 gloo processes under DDP (the loss gathering inside): chunked == 1 process with
  the whole batch for every loss, in-batch and with a queue, with SyncBatchNorm (the
  global batch's statistics) and without (each process's own), gradients all-reduced
  once per step (the other chunks under no_sync).
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import (
    MULTI_PROCESS,
    TOL,
    WITH_QUEUE,
    assert_results,
    bn_buffers,
    embed,
    grads,
    loss_grads,
    make_batch,
    make_loss,
    make_model,
    rel,
    run_spawned,
    share_in_batch_loss,
    share_queue_loss,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from smallbatch.losses import REGISTRY
from smallbatch.study.cell import Cell
from smallbatch.training.distributed import World, data_parallel, mean_over_processes, sync_batchnorm
from smallbatch.training.gradcache import cached_backward, chunk_slices, eval_batchnorm
from smallbatch.training.negatives import MomentumQueue

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


def _tracked(model) -> list[int]:
    return [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --------------------------------------------------------------------------- one process
def test_chunk_slices():
    assert chunk_slices(6, 4) == [slice(0, 4), slice(4, 6)]
    assert chunk_slices(4, 2) == [slice(0, 2), slice(2, 4)]
    assert chunk_slices(3, 8) == [slice(0, 3)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_slices(6, bad)


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("name", [n for n, cls in REGISTRY.items() if cls.spec.contrastive])
def test_chunked_gradient_with_train_mode_batchnorm_equals_the_whole_batch(name, chunk):
    loss_ref, loss = make_loss(name), make_loss(name)
    v1, v2, _ = make_batch(3, N)
    ref, model = make_model(), make_model()
    out_ref, z_ref = _whole(ref, loss_ref, v1, v2)
    out, z = cached_backward(model, (v1, v2), loss, chunk, loss_params=list(loss.parameters()))
    assert rel(out.loss, out_ref.loss) < TOL and rel(out.value, out_ref.value) < TOL
    assert rel(list(z), list(z_ref)) < TOL
    assert rel(grads(model), grads(ref)) < TOL
    assert rel(loss_grads(loss), loss_grads(loss_ref)) < TOL if loss_grads(loss_ref) else not loss_grads(loss)
    assert rel(bn_buffers(model), bn_buffers(ref)) < TOL  # running statistics: updated once, as the whole's
    assert _tracked(model) == _tracked(ref)
    assert all(m.training for m in model.modules()) and all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", WITH_QUEUE)
def test_chunked_gradient_with_a_queue_equals_the_whole_batch(name):
    """MoCo: the queries are chunked (keys come from the momentum encoder without graph)."""
    loss = make_loss(name)
    v1, v2, idx = make_batch(4, N)
    idx = idx % 16  # some queued keys are old keys of batch images: masked
    key = make_model(1).requires_grad_(False)
    with torch.no_grad():
        k = key(v2)
    ref, model = make_model(), make_model()
    out_ref = loss(ref(v1), k, queue=_queue(), q_index=idx)
    out_ref.loss.backward()
    out, _ = cached_backward(model, (v1,), lambda q: loss(q, k, queue=_queue(), q_index=idx), 4)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL
    assert rel(bn_buffers(model), bn_buffers(ref)) < TOL


def test_cumulative_running_statistics_and_batchnorm_without_them():
    """momentum=None (cumulative average) and track_running_stats=False (batch statistics
    in eval mode too) behave as in the whole batch's forward."""
    loss = make_loss("infonce")
    v1, v2, _ = make_batch(9, N)
    ref, model = make_model(), make_model()
    for m in (ref, model):
        m.head.net[1].momentum = None
        bn = m.backbone.features[1]
        bn.track_running_stats, bn.running_mean, bn.running_var, bn.num_batches_tracked = False, None, None, None
        m.eval()  # the untracked layer still normalises with batch statistics
        m.head.net[1].train()
    _whole(ref, loss, v1, v2)
    cached_backward(model, (v1, v2), loss, 2)
    assert rel(grads(model), grads(ref)) < TOL and rel(bn_buffers(model), bn_buffers(ref)) < TOL


class _Residual(nn.Module):
    """A ResNet-style block: BatchNorm on the main branch and on the shortcut, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.BatchNorm2d(4),
        )
        self.short = nn.Sequential(nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        out = self.main(x)
        out += self.short(x)
        return self.head(torch.relu(out))


def test_a_residual_block_with_batchnorm_on_both_branches():
    loss = make_loss("dcl")
    v1, v2, _ = make_batch(10, N)
    torch.manual_seed(0)
    ref = _Residual().double()
    model = _Residual().double()
    model.load_state_dict(ref.state_dict())
    _whole(ref, loss, v1, v2)
    cached_backward(model, (v1, v2), loss, 4)
    assert rel(grads(model), grads(ref)) < TOL and rel(bn_buffers(model), bn_buffers(ref)) < TOL


@pytest.mark.parametrize("name", ["infonce", "dclw"])
def test_chunked_gradient_with_frozen_batchnorm_equals_the_whole_batch(name):
    loss = make_loss(name)
    v1, v2, _ = make_batch(3, N)
    ref, model = make_model(), make_model()
    with eval_batchnorm(ref):
        out_ref, _ = _whole(ref, loss, v1, v2)
    with eval_batchnorm(model):
        out, _ = cached_backward(model, (v1, v2), loss, 4)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL
    assert model.training and all(m.training for m in model.modules())  # eval_batchnorm restored the modes


def test_one_chunk_is_an_ordinary_step():
    loss = make_loss("dcl")
    v1, v2, _ = make_batch(6, N)
    ref, model = make_model(), make_model()
    out_ref, _ = _whole(ref, loss, v1, v2)
    out, _ = cached_backward(model, (v1, v2), loss, N)
    assert rel(out.loss, out_ref.loss) < TOL and rel(grads(model), grads(ref)) < TOL
    assert rel(bn_buffers(model), bn_buffers(ref)) < TOL


def test_dropout_draws_the_same_masks_in_the_rerun():
    """Without the RNG replay, a later pass would draw new masks and the gradient would
    differ from forwarding the chunks one by one (BatchNorm frozen: one pass per chunk)."""
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


def test_dropout_before_batchnorm_uses_one_mask_per_chunk_in_every_pass():
    """Train-mode BatchNorm after dropout: the statistics, the embeddings and the gradient
    are those of one set of masks (the re-runs do not draw new ones): chunked twice from
    the same seed gives the same gradient, and z matches a forward with those statistics."""
    loss = make_loss("infonce")
    v1, v2, _ = make_batch(12, N)
    runs = []
    for _ in range(2):
        model = nn.Sequential(nn.Dropout(0.3), make_model())
        torch.manual_seed(3)
        out, _ = cached_backward(model, (v1, v2), loss, 2)
        runs.append((out.loss, grads(model), bn_buffers(model)))
    assert rel(runs[0][1], runs[1][1]) == 0 and rel(runs[0][2], runs[1][2]) == 0
    assert torch.isfinite(runs[0][0])


def test_scale_multiplies_the_cached_gradient():
    loss = make_loss("eqco")
    v1, v2, _ = make_batch(8, N)
    ref, model = make_model(), make_model()
    cached_backward(ref, (v1, v2), loss, 2)
    cached_backward(model, (v1, v2), loss, 2, scale=lambda t: 8.0 * t)
    assert rel([g / 8 for g in grads(model)], grads(ref)) < TOL


def test_a_batchnorm_called_twice_in_one_forward_is_refused():
    bn = nn.BatchNorm1d(8).double()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 8).double(), bn, nn.ReLU(), bn)
    v1, v2, _ = make_batch(2, N)
    with pytest.raises(ValueError, match="called 2 times in one forward"):
        cached_backward(model, (v1, v2), make_loss("dcl"), 2)


class _GroupBatchNorm(nn.BatchNorm1d):
    """A BatchNorm subclass with statistics of its own (as ghost BatchNorm's per group)."""

    def forward(self, x):
        return torch.cat([super(_GroupBatchNorm, self).forward(p) for p in x.chunk(2)])


def test_a_batchnorm_with_its_own_statistics_is_refused():
    """A BatchNorm that defines its own statistics (ghost BatchNorm, train.bn_group) is
    not silently turned into whole-batch BatchNorm by chunking."""
    model = make_model()
    model.head.net[1] = _GroupBatchNorm(16).double()
    v1, v2, _ = make_batch(2, N)
    with pytest.raises(ValueError, match="_GroupBatchNorm computes its own training statistics"):
        cached_backward(model, (v1, v2), make_loss("dcl"), 2)


def test_bad_views_are_refused():
    model = make_model()
    v = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="same"):
        cached_backward(model, (v, v[:3]), make_loss("dcl"), 2)
    with pytest.raises(ValueError, match="non-empty"):
        cached_backward(model, (), make_loss("dcl"), 2)


# --------------------------------------------------------------------------- the training step
def _train_step_updates(chunk_size, queue_size: int, steps: int = 3):
    """``steps`` real training steps (fp64, digits, batch 16) of train.build_training's parts."""
    from smallbatch.data import load as data
    from smallbatch.study.cells import make_cell
    from smallbatch.study.config import load_config
    from smallbatch.training import loop as train

    cfg = load_config(
        None,
        {
            "datasets": {"digits": {}},
            "train": {
                "width": 4,
                "proj_hidden": 16,
                "proj_dim": 8,
                "lr": 0.05,
                "precision": "fp64",
                "optimizer": "sgd",
                "chunk_size": chunk_size,
                "queue_size": queue_size,
                "steps": steps,
            },
        },
    )
    cell = make_cell(cfg, dataset="digits", loss="dclw", loss_params={}, batch_size=16, temperature=0.5, seed=0)
    d = data.load_dataset("digits", None)
    t = train.build_training(Cell.of(cell), d.pretrain_x[:64], d.mean, d.std, torch.device("cpu"), out_dir=None)
    w0 = [p.detach().clone() for p in t.step_fn.model.parameters()]
    for step in range(steps):
        train.one_step(t, torch.arange(16 * step, 16 * step + 16), watch=False)
    m = t.step_fn.model
    return [p.detach() - w for p, w in zip(m.parameters(), w0)], bn_buffers(m), float(t.last_value)


@pytest.mark.parametrize("queue_size", [0, 32])
def test_training_steps_with_chunk_size_equal_the_whole_batch(queue_size):
    update, buffers, loss = _train_step_updates(None, queue_size)
    update_c, buffers_c, loss_c = _train_step_updates(5, queue_size)  # chunks of 5, 5, 5, 1 images
    assert rel(update_c, update) < TOL and rel(buffers_c, buffers) < TOL
    assert abs(loss_c - loss) <= TOL * abs(loss)


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


def check_in_batch(world: World, name: str, sync_bn: bool) -> dict:
    """Chunks of 2 of each process's 4 images, train-mode BatchNorm: the 1-process whole
    batch (SyncBN), or each process's share forwarded on its own (per-process BN)."""
    loss = make_loss(name)
    v1, v2, _ = make_batch(1)
    ref = make_model()
    out_ref = loss(*embed(ref, (v1, v2), 1 if sync_bn else world.size))
    out_ref.loss.backward()
    model = sync_batchnorm(make_model(), world, enabled=sync_bn)
    ddp, calls = _counted_ddp(model, world)
    views = (world.shard(v1), world.shard(v2))
    out, _ = cached_backward(ddp, views, lambda a, b: share_in_batch_loss(loss, a, b, world), 2)
    chunked_calls = calls[0]
    res = {
        "loss": rel(mean_over_processes(out.loss), out_ref.loss),
        "grad": rel(grads(model), grads(ref)),
        "allreduces_beyond_one_step": 0.0,
    }
    if sync_bn:
        res["bn_running_stats"] = rel(bn_buffers(model), bn_buffers(ref))
        model.zero_grad()
        cached_backward(ddp, views, lambda a, b: share_in_batch_loss(loss, a, b, world), 4)  # unchunked
        res["allreduces_beyond_one_step"] = float(chunked_calls != calls[0] - chunked_calls or chunked_calls < 1)
    return res


def check_queue(world: World, name: str) -> dict:
    """MoCo queries chunked by 2 of each process's 4, SyncBN: the 1-process whole batch."""
    loss = make_loss(name)
    v1, v2, idx = make_batch(2)
    idx = idx % 16
    key = make_model(1).requires_grad_(False)
    with torch.no_grad():
        k = key(v2)
    ref = make_model()
    out_ref = loss(ref(v1), k, queue=_queue(), q_index=idx)
    out_ref.loss.backward()
    model = sync_batchnorm(make_model(), world)
    km, my_idx = world.shard(k), world.shard(idx)
    out, _ = cached_backward(
        data_parallel(model, world), (world.shard(v1),), lambda q: share_queue_loss(loss, q, km, _queue(), my_idx), 2
    )
    return {
        "loss": rel(mean_over_processes(out.loss), out_ref.loss),
        "grad": rel(grads(model), grads(ref)),
        "bn_running_stats": rel(bn_buffers(model), bn_buffers(ref)),
    }


def checks():
    out = [(f"in_batch/{n}/syncbn", lambda w, n=n: check_in_batch(w, n, True)) for n in MULTI_PROCESS]
    out += [(f"queue/{n}/syncbn", lambda w, n=n: check_queue(w, n)) for n in WITH_QUEUE]
    out.append(("in_batch/infonce/localbn", lambda w: check_in_batch(w, "infonce", False)))
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_spawned("test_gradcache:checks", tmp_path_factory.mktemp("gradcache"))


@pytest.mark.parametrize("key", [k for k, _ in checks()])
def test_chunked_ddp_with_train_mode_batchnorm_on_2_processes_equals_1_process(spawned, key):
    assert_results(spawned, key)
