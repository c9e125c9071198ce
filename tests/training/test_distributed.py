"""Data-parallel training is the 1-process training: smallbatch.training.distributed with real gloo
processes on the CPU, in float64.

One spawn of 2 processes (``torch.multiprocessing``, torchrun's environment variables,
a free port) runs every check below; each check builds the 1-process reference itself
(the same seeds: a small_cnn + SimCLR projection head, a global batch of 8 images) and
reports relative differences, which the tests then hold to 1e-10.

* every loss of the registry that is a mean over anchors with in-batch negatives gathered
  over processes (a same-view loss's mask from the rows alone), and each that takes a MoCo
  queue with one (keys gathered and enqueued in the same order: the queues stay identical),
  each with SyncBatchNorm (reference: the whole batch in one forward) and without it
  (reference: BatchNorm statistics per share, each share forwarded separately); a loss's
  learnt parameters (τ, a bias) get the 1-process gradient once averaged over processes;
* one optimiser step (SGD with momentum, LARS, Adam), twice: the same updates,
  BatchNorm statistics and optimiser state on 2 processes as on 1;
* the gather's gradient, the global batch's views, and the collective helpers.

Launchers' environments (torchrun, srun) are checked without processes.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import cluster
import pytest
import torch
import torch.multiprocessing as mp
from loss_at_tau import at_tau

from smallbatch.data.augment import AugmentConfig, BatchAugment
from smallbatch.losses import REGISTRY, batch_positives, build_loss, in_batch_scores, queue_scores, same_view_mask
from smallbatch.training.distributed import (
    GlobalBatchNorm,
    World,
    any_over_processes,
    average_gradients,
    data_parallel,
    gather,
    gather_with_grad,
    initialized,
    mean_over_processes,
    sync_batchnorm,
    unwrap,
)
from smallbatch.training.launch import claim_gpu, first_host, launch_from_env
from smallbatch.training.loop import make_optimizer
from smallbatch.training.models import ContrastiveModel, build_backbone
from smallbatch.training.negatives import MomentumQueue

torch.set_num_threads(1)

TOL = 1e-10
N_IMAGES, PX = 8, 8  # global batch: 8 images of 8x8 px, 4 per process
LOSS_PARAMS = {"eqco": {"alpha": 4.0}, "dclw": {"sigma": 0.5}, "flatnce": {"gamma": 1.0}}


# --------------------------------------------------------------------------- shared helpers (also test_gradcache)
def make_loss(name: str):
    """Loss ``name`` at τ = 0.2: given per call, or, for a loss that learns it, its own
    (started at 0.2, float64: its parameters then get gradients)."""
    loss = build_loss(name, **LOSS_PARAMS.get(name, {})).double()
    if loss.owns_temperature:
        loss.init_temperature(0.2)
        return loss
    return at_tau(loss, 0.2)


def loss_grads(loss) -> list[torch.Tensor]:
    """The gradients of a loss's own learnt parameters (none: [])."""
    return [p.grad for p in loss.parameters()]


def make_model(seed: int = 0) -> ContrastiveModel:
    """small_cnn (width 4) + projection head (16 -> 8), float64, BatchNorm in train mode
    with running statistics already moved off their initial values."""
    torch.manual_seed(seed)
    backbone, feat = build_backbone("small_cnn", 1, PX, width=4)
    model = ContrastiveModel(backbone, feat, 16, 8).double()
    with torch.no_grad():
        model(torch.randn(6, 1, PX, PX, dtype=torch.float64) * 2 + 0.5)
    return model


def make_batch(seed: int, n: int = N_IMAGES):
    """Two views of n images and their dataset indices, the same on every process."""
    g = torch.Generator().manual_seed(seed)
    v1 = torch.randn(n, 1, PX, PX, generator=g, dtype=torch.float64)
    v2 = torch.randn(n, 1, PX, PX, generator=g, dtype=torch.float64)
    return v1, v2, torch.randperm(40, generator=g)[:n]


def embed(model, views, parts: int = 1):
    """``model(cat(views))`` over ``parts`` consecutive groups of images, each forwarded on
    its own (parts = P: BatchNorm statistics per process share), split per view."""
    n = views[0].shape[0] // parts
    out = [model(torch.cat([v[i * n : (i + 1) * n] for v in views])).chunk(len(views)) for i in range(parts)]
    return tuple(torch.cat([o[j] for o in out]) for j in range(len(views)))


def share_in_batch_loss(loss, z1, z2, world: World):
    """A process's loss: its anchors against the gathered batch (the negatives source; a
    loss of same-view negatives masks the other view's)."""
    z1a, z2a = gather_with_grad(z1), gather_with_grad(z2)
    rows = world.anchor_rows(z1.shape[0])
    pos, neg, mask = in_batch_scores(z1a, z2a, rows=rows)
    if loss.negatives == "same_view":
        mask = same_view_mask(z1a.shape[0], rows=rows)
    return loss.from_scores(pos, neg, mask, batch_pos=batch_positives(z1a, z2a))


def share_queue_loss(loss, q, k, queue, q_index):
    """A process's loss with queue negatives: its queries; batch statistics (DCLW) over all."""
    pos, neg, mask = queue_scores(q, k, queue, q_index)
    return loss.from_scores(pos, neg, mask, batch_pos=gather(pos))


def rel(a, b) -> float:
    """max |a - b| / max |b| over tensors (or lists of tensors, flattened)."""
    if isinstance(a, (list, tuple)):
        a, b = torch.cat([x.flatten() for x in a]), torch.cat([x.flatten() for x in b])
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def grads(model) -> list[torch.Tensor]:
    return [p.grad for p in unwrap(model).parameters()]


def bn_buffers(model) -> list[torch.Tensor]:
    return [b.double() for b in unwrap(model).buffers()]


def _spawned(rank: int, size: int, port: int, out: str, checks: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    module, name = checks.split(":")
    results = {}
    with World.from_env(device="cpu", timeout_s=cluster.HANG_S) as world:
        for key, fn in getattr(importlib.import_module(module), name)():
            try:
                results[key] = fn(world)
            except Exception:  # noqa: BLE001 - reported by the test of that check
                results[key] = {"error": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run_spawned(checks: str, out: Path, size: int = 2, timeout: float = 600) -> list[dict]:
    """Run ``module:function``'s checks ``[(name, fn(world) -> dict)]`` on ``size`` gloo
    processes; each rank's ``{name: result}``.  A hung process fails after ``timeout``."""
    ctx = mp.start_processes(
        _spawned, args=(size, cluster.free_port(), str(out), checks), nprocs=size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {size} spawned processes did not finish within {timeout} s")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(size)]


def assert_results(results: list[dict], key: str, tol: float = TOL) -> None:
    for rank, res in enumerate(results):
        r = res[key]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        bad = {k: v for k, v in r.items() if not v <= tol}
        assert not bad, f"rank {rank}: {key} differs from 1 process: {bad}"


# --------------------------------------------------------------------------- the checks (run in each process)
def check_in_batch(world: World, name: str, sync_bn: bool) -> dict:
    loss_ref, loss = make_loss(name), make_loss(name)
    v1, v2, _ = make_batch(1)
    ref = make_model()
    z1, z2 = embed(ref, (v1, v2), 1 if sync_bn else world.size)
    out = loss_ref(z1, z2)
    out.loss.backward()
    model = sync_batchnorm(make_model(), world, enabled=sync_bn)
    ddp = data_parallel(model, world)
    a, b = ddp(torch.cat([world.shard(v1), world.shard(v2)])).chunk(2)
    mine = share_in_batch_loss(loss, a, b, world)
    mine.loss.backward()
    res = {
        "embeddings": rel(gather(torch.cat([a, b], 1)), torch.cat([z1, z2], 1)),
        "loss": rel(mean_over_processes(mine.loss), out.loss),
        "value": rel(mean_over_processes(mine.value), out.value),
        "infonce": rel(mean_over_processes(mine.infonce), out.infonce),
        "grad": rel(grads(model), grads(ref)),
    }
    if loss_grads(loss):  # a loss's learnt parameters: averaged as the training step does
        average_gradients(list(loss.parameters()))
        res["loss_param_grad"] = rel(loss_grads(loss), loss_grads(loss_ref))
    if sync_bn:
        res["bn_running_stats"] = rel(bn_buffers(model), bn_buffers(ref))
    return res


def _queue(idx: torch.Tensor) -> MomentumQueue:
    """A queue of 12 slots holding 10 random keys, three of them old keys of batch images."""
    g = torch.Generator().manual_seed(7)
    qu = MomentumQueue(12, 8, dtype=torch.float64)
    own = torch.cat([idx[[0, 3, 5]], torch.arange(100, 107)])
    qu.enqueue(torch.randn(10, 8, generator=g, dtype=torch.float64), own)
    return qu


def check_queue(world: World, name: str, sync_bn: bool) -> dict:
    loss_ref, loss = make_loss(name), make_loss(name)
    v1, v2, idx = make_batch(2)
    parts = 1 if sync_bn else world.size
    ref, key_ref, queue_ref = make_model(), make_model().requires_grad_(False), _queue(idx)
    (q,) = embed(ref, (v1,), parts)
    with torch.no_grad():
        (k,) = embed(key_ref, (v2,), parts)
    out = loss_ref(q, k, queue=queue_ref, q_index=idx)
    out.loss.backward()
    queue_ref.enqueue(k, idx)

    model, queue = sync_batchnorm(make_model(), world, sync_bn), _queue(idx)
    key = sync_batchnorm(make_model(), world, sync_bn).requires_grad_(False)
    ddp = data_parallel(model, world)
    qm = ddp(world.shard(v1))
    with torch.no_grad():
        km = key(world.shard(v2))
    mine = share_queue_loss(loss, qm, km, queue, world.shard(idx))
    mine.loss.backward()
    queue.enqueue(gather(km), gather(world.shard(idx)))
    same_slots = torch.equal(queue.indices, queue_ref.indices) and (queue.ptr, queue.count) == (
        queue_ref.ptr,
        queue_ref.count,
    )
    res = {
        "loss": rel(mean_over_processes(mine.loss), out.loss),
        "value": rel(mean_over_processes(mine.value), out.value),
        "grad": rel(grads(model), grads(ref)),
        "queue_keys": rel(queue.keys, queue_ref.keys),
        "queue_slots_differ": 0.0 if same_slots else 1.0,
    }
    if loss_grads(loss):
        average_gradients(list(loss.parameters()))
        res["loss_param_grad"] = rel(loss_grads(loss), loss_grads(loss_ref))
    return res


def check_steps(world: World, opt_name: str) -> dict:
    """Two optimiser steps (SyncBN, DCLW): the same updates and state on P processes as on 1."""
    loss = make_loss("dclw")
    ref, model = make_model(), sync_batchnorm(make_model(), world)
    w0 = [p.detach().clone() for p in ref.parameters()]
    ddp = data_parallel(model, world)
    opt_ref = make_optimizer(ref.parameters(), opt_name, 0.05, 0.9, 1e-4)
    opt = make_optimizer(model.parameters(), opt_name, 0.05, 0.9, 1e-4)
    for step in range(2):
        v1, v2, _ = make_batch(10 + step)
        opt_ref.zero_grad()
        loss(*ref(torch.cat([v1, v2])).chunk(2)).loss.backward()
        opt_ref.step()
        opt.zero_grad()
        a, b = ddp(torch.cat([world.shard(v1), world.shard(v2)])).chunk(2)
        share_in_batch_loss(loss, a, b, world).loss.backward()
        opt.step()

    def state(o):
        return [t.double() for s in o.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]

    return {
        "update": rel(
            [p.detach() - w for p, w in zip(model.parameters(), w0)],
            [p.detach() - w for p, w in zip(ref.parameters(), w0)],
        ),
        "bn_running_stats": rel(bn_buffers(model), bn_buffers(ref)),
        "optimizer_state": rel(state(opt), state(opt_ref)),
    }


def check_gather(world: World) -> dict:
    """gather_with_grad: forward = cat in rank order; backward = sum over processes, own rows."""

    def x_of(r):
        return torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * r

    def w_of(r):
        return torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(6, 2) * (r + 2)

    x = x_of(world.rank).requires_grad_(True)
    y = gather_with_grad(x)
    (y * w_of(world.rank)).sum().backward()
    rows = slice(3 * world.rank, 3 * world.rank + 3)
    want = sum(w_of(r)[rows] for r in range(world.size))
    return {
        "forward": rel(y, torch.cat([x_of(r) for r in range(world.size)])),
        "backward": rel(x.grad, want),
        "gather_indices": float(not torch.equal(gather(torch.arange(3) + 3 * world.rank), torch.arange(6))),
    }


def check_global_batch(world: World) -> dict:
    """Every process draws the global permutation and views and takes its share: the
    gathered shares are the 1-process batch, and the anchor rows tile the 2N views."""
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (20, 1, PX, PX), generator=g, dtype=torch.uint8)
    idx = torch.randperm(20, generator=g)[:N_IMAGES]
    aug = BatchAugment(AugmentConfig(), image_size=PX, channels=1, mean=[0.5], std=[0.25])
    views = aug(images[idx], torch.Generator().manual_seed(4))
    mine, my_idx = world.shard(views), world.shard(idx)
    rows = gather(world.anchor_rows(N_IMAGES // world.size))
    return {
        "views": rel(gather(mine), views),
        "indices": float(not torch.equal(gather(my_idx), idx)),
        "anchor_rows": float(not torch.equal(rows.sort().values, torch.arange(2 * N_IMAGES))),
    }


def check_world(world: World) -> dict:
    ok = (
        world.size == 2
        and world.backend == "gloo"
        and world.device == torch.device("cpu")
        and world.is_main == (world.rank == 0)
        and initialized()
    )
    return {
        "world": 0.0 if ok else 1.0,
        "mean": rel(mean_over_processes(torch.tensor(float(world.rank))), torch.tensor(0.5)),
        "any_true": float(not any_over_processes(world.rank == 1)),
        "any_false": float(any_over_processes(False)),
    }


#: the losses that are a mean over anchors, so a process's share computes its share (a whole-batch
#: loss is not: training runs it on one process; SogCLR's state does too, its loss here is its gamma = 1 form)
MULTI_PROCESS = [n for n, cls in REGISTRY.items() if cls.per_anchor]
#: ... and those of them that take a queue's negatives (same-view negatives are in-batch only)
WITH_QUEUE = [n for n in MULTI_PROCESS if REGISTRY[n].negatives == "all"]


def checks() -> list[tuple[str, Callable[[World], dict]]]:
    out = [("world", check_world), ("gather", check_gather), ("global_batch", check_global_batch)]
    for bn in ("syncbn", "localbn"):
        for name in MULTI_PROCESS:
            out.append((f"in_batch/{name}/{bn}", lambda w, n=name, s=bn == "syncbn": check_in_batch(w, n, s)))
        for name in WITH_QUEUE:
            out.append((f"queue/{name}/{bn}", lambda w, n=name, s=bn == "syncbn": check_queue(w, n, s)))
    for opt in ("sgd", "lars", "adam"):
        out.append((f"steps/{opt}", lambda w, o=opt: check_steps(w, o)))
    return out


CHECK_NAMES = [name for name, _ in checks()]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    return run_spawned("test_distributed:checks", tmp_path_factory.mktemp("dist"))


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("key", [k for k in CHECK_NAMES if k.startswith("in_batch/")])
def test_in_batch_loss_on_2_processes_equals_1_process(spawned, key):
    """Loss value and parameter gradients (after DDP's averaging) of the gathered batch."""
    assert_results(spawned, key)


@pytest.mark.parametrize("key", [k for k in CHECK_NAMES if k.startswith("queue/")])
def test_queue_loss_on_2_processes_equals_1_process_and_queues_stay_identical(spawned, key):
    assert_results(spawned, key)


@pytest.mark.parametrize("key", [k for k in CHECK_NAMES if k.startswith("steps/")])
def test_optimiser_steps_on_2_processes_equal_1_process(spawned, key):
    assert_results(spawned, key)


@pytest.mark.parametrize("key", ["world", "gather", "global_batch"])
def test_collectives_and_global_batch_slicing(spawned, key):
    assert_results(spawned, key)


def test_every_check_ran_on_both_processes(spawned):
    assert [sorted(r) for r in spawned] == [sorted(CHECK_NAMES)] * 2


# --------------------------------------------------------------------------- one process, launchers
def test_one_process_needs_no_process_group_and_changes_nothing():
    world = World.from_env(device="cpu", env={})
    assert (world.rank, world.size, world.backend, world.is_main) == (0, 1, None, True)
    assert not initialized()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    assert gather_with_grad(x) is x and torch.equal(gather(x), x)
    assert torch.equal(world.shard(x), x) and world.share(4) == slice(0, 4)
    assert torch.equal(world.anchor_rows(4), torch.arange(8))
    model = make_model()
    assert sync_batchnorm(model, world) is model and data_parallel(model, world) is model
    assert unwrap(model) is model and any_over_processes(True) and not any_over_processes(False)
    world.close()


def test_shares_of_a_global_batch():
    worlds = [World(rank=r, size=4) for r in range(4)]
    assert [w.share(12) for w in worlds] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert worlds[2].anchor_rows(3).tolist() == [6, 7, 8, 18, 19, 20]
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        worlds[0].share(10)


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "29400",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }  # torchrun inside an srun step: torchrun's wins
    launch = launch_from_env(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank) == ("torchrun", 3, 8, 1)
    assert (launch.master_addr, launch.master_port) == ("10.0.0.2", 29400)


def test_srun_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-10],cpu1",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.9",
    }
    launch = launch_from_env(env)
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank) == ("srun", 5, 8, 1)
    assert launch.master_addr == "gpu07" and launch.master_port == 10000 + (4242 * 64) % 20000
    assert 10000 <= launch.master_port < 30000
    assert launch_from_env({**env, "SLURM_STEP_NODELIST": "gpu[08-09]"}).master_addr == "gpu08"
    assert launch_from_env({**env, "SLURM_STEP_ID": "1"}).master_port != launch.master_port
    no_list = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    assert launch_from_env(no_list).master_addr == "10.1.1.9"
    override = launch_from_env({**env, "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (override.master_addr, override.master_port) == ("h", 1234)
    assert launch_from_env({**env, "SLURM_STEP_NUM_TASKS": "1"}).size == 1  # one task: no group
    assert launch_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("n1", "n1"),
        ("n1,n2", "n1"),
        ("gpu[03-05,07],cpu1", "gpu03"),
        ("rack[2-3]-node[010-020]", "rack2-node010"),
        ("a[9],b", "a9"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_global_batchnorm_is_batchnorm_in_one_process():
    bn = torch.nn.BatchNorm2d(3).double()
    conv = GlobalBatchNorm.convert(torch.nn.Sequential(torch.nn.Identity(), bn))
    assert isinstance(conv[1], GlobalBatchNorm) and conv[1].weight is bn.weight
    assert conv[1].running_mean is bn.running_mean
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    ref = torch.nn.BatchNorm2d(3).double()
    torch.testing.assert_close(conv(x), ref(x))
    torch.testing.assert_close(bn.running_var, ref.running_var)


def test_a_converted_model_saves_the_plain_models_state():
    """Checkpoints of a SyncBN model load into the plain model that evaluation builds."""
    plain, converted = make_model(), GlobalBatchNorm.convert(make_model())
    assert sum(isinstance(m, GlobalBatchNorm) for m in converted.modules()) == 4
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state)


def _hold_a_gpu_slot(slots_dir: str, conn) -> None:
    """A one-process cell's claim: send the GPU claimed, hold its slot until told to end."""
    conn.send(claim_gpu(4, slots_dir=slots_dir))
    conn.recv()


def test_one_process_cells_spread_over_a_nodes_gpus(tmp_path):
    """k processes per GPU on a node showing 4 GPUs (cells_per_gpu): each claims a slot file
    (held for its life), slot j of every GPU before slot j+1, so 8 processes use each GPU
    twice; a process that ends frees its slot for the next.  (The processes are forked from
    this one: each a process of its own, as flock needs, without importing torch again.)"""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = []

    def start():
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_hold_a_gpu_slot, args=(str(tmp_path), theirs))
        p.start()
        assert ours.poll(cluster.HANG_S), "the process claimed no GPU"
        procs.append((p, ours, ours.recv()))

    try:
        for _ in range(8):
            start()
        assert sorted(g for _, _, g in procs) == [0, 0, 1, 1, 2, 2, 3, 3]
        ending, conn, gpu = next(p for p in procs if p[2] == 2)  # not GPU 0, where slot 2 would go
        conn.send("end")
        ending.join(cluster.HANG_S)
        assert ending.exitcode == 0
        start()
        assert procs[-1][2] == gpu  # the freed slot
    finally:
        for p, conn, _ in procs:
            if p.is_alive():
                conn.send("end")
                p.join(cluster.HANG_S)
