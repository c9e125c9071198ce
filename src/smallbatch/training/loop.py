"""Contrastive pretraining of one cell, readable top to bottom.

:func:`pretrain` builds the cell's parts (:func:`build_training`), resumes from
``state.pt`` when it can (:func:`resume`), runs the loop (:func:`run_loop`) and writes
``checkpoint.pt`` (:func:`finish`).  The parts live in their own modules:

* the step — views, both views through the model, scores, temperature, loss, update:
  :mod:`smallbatch.training.step` (one graph, compilable with ``train.compile``);
* where negatives come from (in-batch, fresh extra images, MoCo queue): :mod:`smallbatch.training.negatives`;
* the temperature (fixed or ESS-scheduled): :mod:`smallbatch.training.temperature`;
* optimisers and the learning-rate schedule: :mod:`smallbatch.training.optim`;
* the state, checkpoint and snapshot files, and the step's random streams: :mod:`smallbatch.training.checkpoint`;
* the collapse criteria: :mod:`smallbatch.training.health`.

The whole (small) data set sits on the device as one uint8 tensor; each epoch's
permutation and each step's augmentation uniforms are drawn on the device from
generators seeded by (seed, epoch/step), so nothing leaves the device between two
logging steps: the non-finite check, the loss readout and the diagnostics happen every
``train.log_every`` steps (and at epoch ends, before a state is saved).  A non-finite
loss ends the cell as *diverged* within ``log_every`` steps, and no state is saved after
it; a representation that collapsed without a NaN ends it as *collapsed*.

Fault tolerance: the resumable state is written atomically at the end of every epoch
and when SIGTERM arrives (SLURM preemption / time limit): one process stops after the
step it is in; several stop together at the next step where they compare flags (a
logging step or an epoch end: at most ``log_every`` steps on) whichever of them got the
signal, rank 0 saves, and every process exits (143) once the state is written.  A rerun
continues from it and ends with the same weights as an uninterrupted run (bitwise on the
CPU; on a GPU with ``train.deterministic``).  ``checkpoint.pt`` is written only when training is complete;
a snapshot (``train.snapshot_epochs``) at its step, once the loss is checked finite there.
One process trains a cell at a time: the cell's folder is locked (:class:`io.CellLock`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.augment import AugmentConfig, BatchAugment, normalize
from ..errors import Preempted
from ..io import CellLock, nullcontext_lock
from ..losses import build_loss, in_batch_scores
from ..losses.diagnostics import batch_covariance_rank, diagnostics, embedding_grad_norm, grad_rel_error
from ..losses.registry import loss_spec
from ..study.cell import BaselineCell, Cell, budget_steps
from ..study.checks import images_problem, settings_problem, snapshot_budget_problem
from ..study.lr_scaling import resolved_knobs
from . import health
from .checkpoint import (  # noqa: F401
    StepRandom,
    earlier_snapshots,
    load_checkpoint,
    read_state,
    restamp_snapshot,
    save_checkpoint,
    save_snapshot,
    save_state,
    snapshot_name,
    snapshot_path,
    snapshot_steps,
)
from .distributed import World, any_over_processes, data_parallel, gather, mean_over_processes, sync_batchnorm
from .ghostbn import ghost_batchnorm
from .models import ContrastiveModel, build_backbone
from .negatives import FreshNegatives, InBatch, QueueNegatives, Scores, Siamese, fresh_window, with_extra_views
from .optim import LARS, lr_at, make_optimizer, scaled_lr, set_lr  # noqa: F401  (public through train)
from .progress import step_progress
from .step import TrainStep, configure_backends
from .temperature import build_temperature


@dataclass
class TrainResult:
    status: str  # finished | diverged | collapsed
    steps: int
    epochs: float
    final_loss: float
    wall_s: float
    images_per_s: float
    health: dict = field(default_factory=dict)
    cpu_s: float = float("nan")  # CPU seconds of every process thread, over resumes (rank 0's)
    extended_from: str | None = None  # "<hash> at step <n>": a shorter budget's run this one continued


@dataclass
class Hooks:
    """How the caller watches a run: ``log_fn(metrics, step)``; ``before_save()`` runs
    before every state save (the tracker flushes there, so the store never lags behind
    ``state.pt``); ``meta`` is stored in the state (the MLflow run id);
    ``after_step(step)`` runs on rank 0 after each step is done (and its state saved when one
    is due): what it raises ends the run there, as a crash would; ``at_epoch_end(backbone, epoch)`` runs on
    rank 0 at each epoch's end, before the state is saved, and returns metrics to log or None
    (the kNN monitor, :mod:`smallbatch.evaluation.monitor`)."""

    log_fn: Callable[[dict, int], None] | None = None
    before_save: Callable[[], None] | None = None
    meta: dict = field(default_factory=dict)
    after_step: Callable[[int], None] | None = None
    progress: bool = True
    at_epoch_end: Callable[[torch.nn.Module, int], dict | None] | None = None


@dataclass
class Training:
    """A cell's training: its parts, schedule and progress."""

    cell: Cell
    dev: torch.device
    images: torch.Tensor
    mean: list
    std: list
    step_fn: TrainStep
    rng: StepRandom
    world: World
    out_dir: Path
    total: int
    steps_per_epoch: int
    warmup: int
    peak_lr: float
    schedule: str = "cosine"  # train.lr_schedule
    snapshots: dict = field(default_factory=dict)  # step -> its budget (train.snapshot_epochs)
    step: int = 0
    wall_before: float = 0.0
    cpu_before: float = 0.0  # CPU seconds spent before a resume (the state's)
    extends: str | None = None  # "<hash> at step <n>": the shorter budget's run this one continues
    cpu_start: float = 0.0  # time.process_time() when this process began to train
    last_value: torch.Tensor | None = None
    finite: torch.Tensor | None = None

    @property
    def state_path(self) -> Path:
        return self.out_dir / "state.pt"


# --------------------------------------------------------------------------- devices
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use device: auto or cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    return torch.device(device)


def build_model(cell: Cell | BaselineCell, channels: int, image_size: int, predictor: bool = True) -> ContrastiveModel:
    """The network of a cell or of a baseline cell (random-init, supervised), with the predictor
    its loss declares (``predictor=False``: without it, e.g. an EMA target network)."""
    settings = cell.train
    backbone, feat_dim = build_backbone(
        settings.backbone, channels, image_size, width=settings.width, pool_grid=settings.pool_grid
    )
    pred = predictor_hidden(cell) if predictor else None
    return ContrastiveModel(backbone, feat_dim, settings.proj_hidden, settings.proj_dim, pred_hidden=pred)


def predictor_hidden(cell: Cell | BaselineCell) -> int | None:
    """The hidden width of the predictor the cell's loss declares (its registry entry's
    ``predictor``), or None: a baseline, or a loss without one."""
    if not isinstance(cell, Cell) or not loss_spec(cell.loss).predictor:
        return None
    return build_loss(cell.loss, **cell.loss_params).predictor_hidden(cell.train.proj_dim, cell.train.proj_hidden)


# --------------------------------------------------------------------------- the cell
def pretrain(
    cell: Cell,
    images: torch.Tensor,
    mean,
    std,
    out_dir: Path,
    *,
    log_fn: Callable[[dict, int], None] | None = None,
    before_save: Callable[[], None] | None = None,
    device: str | torch.device = "auto",
    restart: bool = False,
    progress: bool = True,
    after_step: Callable[[int], None] | None = None,
    meta: dict | None = None,
    world: World | None = None,
    labels: torch.Tensor | None = None,
    at_epoch_end: Callable[[torch.nn.Module, int], dict | None] | None = None,
) -> TrainResult:
    """Pretrain the cell's encoder on ``images`` (uint8 N,C,H,W); write checkpoint.pt.
    See :class:`Hooks` for ``log_fn``, ``before_save``, ``meta`` and ``after_step``;
    ``restart`` ignores (and later overwrites) a saved state.  ``world``: this process's
    place among ``train.devices`` data-parallel processes (default: one process; only
    rank 0 locks, saves and logs — give the others no hooks).  ``labels``: the images'
    labels, for ``train.mask_same_class`` only."""
    out_dir = Path(out_dir)
    world = world or World(device=resolve_device(device))
    dev = world.device
    _validate(cell, images.shape[0], dev, world)
    hooks = Hooks(
        log_fn,
        before_save,
        dict(meta or {}),
        after_step if world.is_main else None,
        progress and world.is_main,
        at_epoch_end if world.is_main else None,
    )
    with CellLock(out_dir, cell.id) if world.is_main else nullcontext_lock():
        training = build_training(cell, images, mean, std, dev, out_dir, world, labels)
        if not restart:
            resume(training)
        t_start, training.cpu_start = time.perf_counter(), time.process_time()
        status = run_loop(training, hooks, t_start)
        return finish(training, status, time.perf_counter() - t_start)


def _validate(cell: Cell, n_images: int, dev: torch.device, world: World) -> None:
    """What only the run knows (the processes launched, the device), then the cell's settings
    (:func:`smallbatch.study.checks.settings_problem`) and its batch against the images read
    (:func:`smallbatch.study.checks.images_problem`)."""
    devices = cell.train.devices
    if world.size != devices:
        raise ValueError(
            f"cell {cell.id} has train.devices = {devices} but runs on {world.size} process(es); "
            f"launch it with `torchrun --nproc-per-node {devices} -m smallbatch pretrain ...` "
            "(the workflow does) or srun"
        )
    problem = settings_problem(cell) or images_problem(cell, n_images)
    if problem:
        raise ValueError(f"cell {cell.id}: {problem}")
    if cell.train.precision == "fp16" and dev.type != "cuda":
        raise ValueError("precision fp16 needs CUDA (GradScaler); use bf16 or fp32 on the CPU")


def snapshot_budgets(cell: Cell, steps_per_epoch: int, total: int) -> dict[int, dict]:
    """step -> budget (name, epochs, steps, images_seen) of each of ``train.snapshot_epochs``;
    ValueError (one line) for a budget the cell's steps cannot hold
    (:func:`smallbatch.study.checks.snapshot_budget_problem`, which the plan ran too)."""
    problem = snapshot_budget_problem(cell, steps_per_epoch, total)
    if problem:
        raise ValueError(f"cell {cell.id}: {problem}")
    out: dict[int, dict] = {}
    for e in cell.train.snapshot_epochs or ():
        step = snapshot_steps(e, steps_per_epoch)
        images = step * cell.batch_size
        out[step] = {"name": snapshot_name(e), "epochs": step / steps_per_epoch, "steps": step, "images_seen": images}
    return out


def build_training(
    cell: Cell,
    images: torch.Tensor,
    mean,
    std,
    dev: torch.device,
    out_dir: Path,
    world: World | None = None,
    labels: torch.Tensor | None = None,
) -> Training:
    """Every part of the cell's training, fresh (seeded by the cell's seed: the same on
    every process).  ``labels`` (of ``images``) reach the negatives' mask only, and only
    with ``train.mask_same_class``."""
    settings = cell.train
    world = world or World(device=dev)
    configure_backends(settings, dev)
    torch.manual_seed(cell.seed)
    n, c, h, _ = images.shape
    bs = cell.batch_size
    dtype = torch.float64 if settings.precision == "fp64" else torch.float32
    views = 1 if settings.queue_size else 2  # what one forward stacks: both views, or MoCo's queries / keys
    model = _network(cell, c, h, dev, dtype, world, views)
    if settings.mask_same_class and labels is None:
        raise ValueError(
            f"cell {cell.id} has train.mask_same_class but its pretraining images have no labels "
            f"({cell.dataset}'s pretraining split is unlabeled); set it to false"
        )
    mask_labels = labels.to(dev) if settings.mask_same_class and labels is not None else None  # None: refused above
    spe = n // bs
    total = budget_steps(cell, spe)
    peak = scaled_lr(float(settings.lr), bs, settings.lr_scaling)
    loss_fn = build_loss(cell.loss, **cell.loss_params).to(dev, dtype)  # its learnt parameters, if any
    source = _source(cell, model, loss_fn, (c, h, dev, dtype, world, views), mask_labels, total)
    loss_fn.init_state(n, dev, dtype)  # SogCLR's u, one entry per image (stateless losses: nothing)
    temperature = build_temperature(cell, total, dev, loss_fn)  # a learnt τ starts at the cell's
    opt = make_optimizer(
        trained_parameters(model, loss_fn),
        settings.optimizer,
        peak,
        settings.momentum,
        settings.weight_decay,
        dev,
        compiled=bool(settings.compile),
        beta2=resolved_knobs(settings, bs)["train.adam_beta2"],
    )
    aug = BatchAugment(AugmentConfig(**cell.augment), image_size=h, channels=c, mean=mean, std=std)
    step_fn = TrainStep(
        model,
        aug,
        source,
        loss_fn,
        temperature,
        opt,
        settings.precision,
        dev,
        net=data_parallel(model, world),
        chunk_size=settings.chunk_size,
    )
    if settings.compile:  # DDP splits the graph at its gradient buckets: full graphs on one process only
        step_fn.compile("reduce-overhead" if dev.type == "cuda" else None, fullgraph=world.size == 1)
    return Training(
        cell,
        dev,
        images.to(dev),
        list(mean),
        list(std),
        step_fn,
        StepRandom(cell.seed, dev),
        world,
        out_dir,
        total,
        spe,
        int(round(float(settings.warmup_epochs) * spe)),
        peak,
        settings.lr_schedule,
        snapshot_budgets(cell, spe, total),
    )


def _source(
    cell: Cell,
    model,
    loss_fn,
    net_args: tuple[int, int, torch.device, torch.dtype, World, int],
    mask_labels,
    total: int,
):
    """Where the step's negatives (or a method's targets) come from, as the loss's registry
    entry and the cell's settings say: in the batch, fresh extra images, a MoCo queue, or the
    two views of a method without negatives (with its EMA target network if it declares one)."""
    spec, settings, (_, _, dev, dtype, world, _) = loss_spec(cell.loss), cell.train, net_args
    if not spec.contrastive:
        if not spec.ema_target:
            return Siamese(spec.predictor)
        target = _network(cell, *net_args, predictor=False)  # the online backbone and projector, copied
        target.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("predictor.")})
        ema = resolved_knobs(settings, cell.batch_size, loss_fn.ema)["loss.ema"]  # the loss's, at the cell's batch
        return Siamese(spec.predictor, target, ema, loss_fn.ema_schedule, total)
    if settings.queue_size:
        key_model = _network(cell, *net_args)
        key_model.load_state_dict(model.state_dict())
        momentum = resolved_knobs(settings, cell.batch_size)["train.moco_momentum"]
        return QueueNegatives(
            key_model, settings.queue_size, settings.proj_dim, momentum, dev, dtype, world, labels=mask_labels
        )
    if settings.extra_negatives:
        return FreshNegatives(settings.extra_negatives, world)
    return InBatch(
        world,
        full=bool(settings.ess_schedule) and world.size > 1,
        group=settings.neg_group,
        labels=mask_labels,
        same_view=spec.negatives == "same_view",
    )


def trained_parameters(model: torch.nn.Module, loss_fn: torch.nn.Module):
    """What the optimiser trains: the network's parameters, and a loss's learnt ones (τ,
    a bias) as a second group without weight decay (CLIP's and SigLIP's practice)."""
    own = [p for p in loss_fn.parameters() if p.requires_grad]
    if not own:
        return model.parameters()
    return [{"params": list(model.parameters())}, {"params": own, "weight_decay": 0.0}]


def _network(
    cell: Cell,
    channels: int,
    size: int,
    dev: torch.device,
    dtype: torch.dtype,
    world: World,
    views: int = 2,
    predictor: bool = True,
):
    """The cell's model on the device; BatchNorm over every process's views (``sync_bn``),
    or over groups of ``train.bn_group`` images of the ``views`` a forward stacks."""
    model = build_model(cell, channels, size, predictor).to(dev, dtype=dtype)
    if dtype != torch.float64:  # NHWC: cuDNN's and oneDNN's fast convolutions (CPU: ~1.2x per step)
        model = model.to(memory_format=torch.channels_last)
    group = cell.train.bn_group
    # = the batch: plain BatchNorm, the same thing (not with fresh negatives: they come in groups too)
    if group and (group != cell.batch_size or cell.train.extra_negatives):
        ghost_batchnorm(model, group, views)
    return sync_batchnorm(model, world, cell.train.sync_bn)


# --------------------------------------------------------------------------- state
def resume(training: Training) -> None:
    """Continue from ``state.pt`` when it holds this config of the cell, or this cell's run at a
    shorter budget (:func:`smallbatch.training.checkpoint.read_state`): then the snapshots of the
    budgets it passed are taken over (stamped with this config) and the run goes on to this
    budget, as an uninterrupted run of it would have."""
    st = read_state(training.state_path, training.cell, training.total)
    if st is None:
        return
    extends = st.get("extends")  # the config whose shorter run this one continues (None: its own state)
    carried: dict[int, dict] = {}
    if extends:
        found = earlier_snapshots(training.out_dir, training.cell, st, training.snapshots)
        if isinstance(found, str):
            print(f"{training.cell.id}: {found}; starting afresh", file=sys.stderr)
            return
        carried = found
    _load_training_state(training, st)
    # a continued run names the run it continued, also once it stopped and resumed its own state
    training.extends = f"{extends} at step {training.step}" if extends else st.get("extended_from")
    if not training.world.is_main:
        return
    where = f"{training.cell.id} from step {training.step}/{training.total}"
    if extends:
        _take_over_snapshots(training, carried)
        where += f": the run of config {training.extends}, a shorter budget"
    print(f"{'continuing' if extends else 'resuming'} {where} ({training.state_path})", file=sys.stderr)


def _load_training_state(training: Training, st: dict) -> None:
    """Every part of the state into the training (model, optimiser, negatives, ..., counters)."""
    step_fn = training.step_fn
    step_fn.model.load_state_dict(st["model"])
    step_fn.opt.load_state_dict(st["optimizer"])
    for g in step_fn.opt.param_groups:  # the rate tensor comes back on the CPU: put it on the device again
        g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32).to(training.dev)
    step_fn.source.load_state_dict(st)
    step_fn.load_state_dict(st)
    step_fn.temperature.load_state_dict(st["temperature"])
    step_fn.loss_fn.load_state_dict(st.get("loss", {}))  # SogCLR's u (a stateless loss: nothing)
    training.step, training.wall_before = int(st["step"]), float(st["wall_s"])
    training.cpu_before = float(st["cpu_s"])
    training.last_value = torch.tensor(float(st["last_loss"]), device=training.dev)


def _take_over_snapshots(training: Training, carried: dict[int, dict]) -> None:
    """The continued run's snapshots as this config's, and the snapshot at the state's own step
    (the shorter run's end, which it kept as its checkpoint) from the weights just loaded."""
    for step, obj in carried.items():
        restamp_snapshot(snapshot_path(training.out_dir, training.snapshots[step]["name"]), training.cell, obj)
    if training.step in training.snapshots:
        write_snapshot(training, training.snapshots[training.step])


def save(training: Training, hooks: Hooks, elapsed: float) -> None:
    """Write ``state.pt`` (rank 0: the state is the same on every process)."""
    if not training.world.is_main:
        return
    if hooks.before_save is not None:
        hooks.before_save()
    step_fn = training.step_fn
    save_state(
        training.state_path,
        training.cell,
        model=step_fn.model.state_dict(),
        optimizer=step_fn.opt.state_dict(),
        **step_fn.source.state_dict(),
        **step_fn.state_dict(),
        temperature=step_fn.temperature.state_dict(),
        loss=dict(step_fn.loss_fn.state_dict()),
        step=training.step,
        last_loss=_last_loss(training),
        wall_s=training.wall_before + elapsed,
        cpu_s=_cpu_s(training),
        saved_on=training.dev.type,
        extended_from=training.extends,
        **hooks.meta,
    )


def _last_loss(training: Training) -> float:
    return float(training.last_value) if training.last_value is not None else float("nan")


# --------------------------------------------------------------------------- the loop
def run_loop(training: Training, hooks: Hooks, t_start: float) -> str:
    """Train until the budget is spent; return ``finished`` or ``diverged``."""
    bar = _progress(training.total, training.step, training.cell.id, hooks.progress)
    window = [time.perf_counter(), 0]  # start of the logging window, images in it
    perm = None
    try:
        with _sigterm() as term:
            stop = False  # agreed by every process: only at the steps where they all compare flags
            while training.step < training.total:
                perm, idx = next_batch(training, perm)
                out, update = one_step(
                    training, idx, watch=_log_due(training, training.step + 1) and hooks.log_fn is not None
                )
                window[1] += training.cell.batch_size
                if bar is not None:
                    bar.update(1)
                epoch_end = training.step % training.steps_per_epoch == 0
                snap = training.snapshots.get(training.step)
                if (
                    _log_due(training, training.step)
                    or epoch_end
                    or snap
                    or (term["flag"] and training.world.size == 1)
                ):
                    stop = any_over_processes(term["flag"], training.dev)  # every process stops at the same step
                    if any_over_processes(not bool(training.finite), training.dev):
                        _log_diverged(training, hooks)
                        return "diverged"
                    if hooks.log_fn is not None and _log_due(training, training.step):
                        metrics = step_metrics(training, out, update, window)
                        if training.world.is_main:
                            hooks.log_fn(metrics, training.step)
                        if bar is not None:
                            bar.set_postfix(
                                epoch=f"{training.step / training.steps_per_epoch:.2f}",
                                loss=f"{_last_loss(training):.4f}",
                            )
                if snap and training.world.is_main:
                    write_snapshot(training, snap)
                if epoch_end and hooks.at_epoch_end is not None:
                    _at_epoch_end(training, hooks)
                if epoch_end or stop:
                    save(training, hooks, time.perf_counter() - t_start)
                if stop:
                    raise _preempted(training, term["flag"])
                if hooks.after_step is not None:
                    hooks.after_step(training.step)
    finally:
        if bar is not None:
            bar.close()
    return "finished"


def next_batch(training: Training, perm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the epoch's permutation, the next step's indices): a new permutation at an epoch's
    start (seeded by the epoch), else ``perm`` kept."""
    pos = training.step % training.steps_per_epoch
    if perm is None or pos == 0:
        gen = training.rng.generator("permutation", training.step // training.steps_per_epoch)
        perm = torch.randperm(training.images.shape[0], generator=gen, device=training.dev)
    return perm, step_images(training, perm, pos)


def step_images(training: Training, perm: torch.Tensor, pos: int) -> torch.Tensor:
    """The dataset indices of step ``pos`` of the epoch whose permutation is ``perm``: its
    batch, then with fresh negatives the extra images (:func:`negatives.fresh_window`)."""
    bs, extra = training.cell.batch_size, training.step_fn.source.extra
    if extra:
        return fresh_window(perm, pos, bs, extra)
    return perm[pos * bs : (pos + 1) * bs]


def write_snapshot(training: Training, budget: dict) -> None:
    """The weights now, as the snapshot of ``budget`` (what :func:`finish` writes at the end)."""
    c, size = training.images.shape[1], training.images.shape[-1]
    save_snapshot(
        snapshot_path(training.out_dir, budget["name"]),
        training.cell,
        budget,
        model=training.step_fn.model.state_dict(),
        status="finished",
        channels=c,
        image_size=size,
        mean=training.mean,
        std=training.std,
    )


def _at_epoch_end(training: Training, hooks: Hooks) -> None:
    """Rank 0's epoch-end hook (the kNN monitor); its metrics logged at this step, with the
    images seen by then (``monitor/images_seen``: the x-axis that compares batch sizes)."""
    assert hooks.at_epoch_end is not None  # the caller calls this only with one
    m = hooks.at_epoch_end(training.step_fn.model.backbone, training.step // training.steps_per_epoch)
    if m and hooks.log_fn is not None:
        hooks.log_fn({**m, "monitor/images_seen": float(training.step * training.cell.batch_size)}, training.step)


def _preempted(training: Training, signalled: bool) -> Preempted:
    """After the agreed step's save: every process waits until rank 0 has written the state
    (a launcher ends the others when the first one exits), then each says what it did."""
    training.world.barrier()
    who = "SIGTERM received" if signalled else "SIGTERM received by another process"
    if training.world.is_main:
        return Preempted(f"{who}: {training.cell.id} saved its state at step {training.step} to {training.state_path}")
    return Preempted(
        f"{who}: rank {training.world.rank} of {training.cell.id} stopped at step {training.step} with every process "
        f"(rank 0 saved the state there)"
    )


def _log_due(training: Training, step: int) -> bool:
    """Metrics are logged every ``log_every`` steps and at the last step (the finite check
    also runs at epoch ends, before a state is saved)."""
    return step % training.cell.train.log_every == 0 or step == training.total


def one_step(training: Training, idx: torch.Tensor, watch: bool):
    """One update of the global batch ``idx`` (this process takes its share of the images
    and of the augmentation uniforms, drawn for the whole batch on every process); with
    ``watch`` also the parameter change (for the update-size diagnostic)."""
    step_fn = training.step_fn
    bs = training.cell.batch_size
    u = step_fn.aug.draw(2 * bs, training.rng.generator("augment", training.step))
    if step_fn.source.extra:  # the extras' views from their own stream: the anchors' are the plain cell's
        u = with_extra_views(
            u, step_fn.aug.draw(2 * step_fn.source.extra, training.rng.generator("extra", training.step))
        )
    if training.world.size > 1:
        share = training.world.share(bs)
        idx, u = idx[share], torch.cat([u[:bs][share], u[bs:][share]])
    lr = lr_at(training.step, training.total, training.warmup, training.peak_lr, training.schedule)
    set_lr(step_fn.opt, lr)
    step_fn.temperature.begin_step(training.step)
    before = [p.detach().clone() for p in step_fn.model.parameters()] if watch else None
    out = step_fn.run(training.images[idx], u, idx)
    step_fn.source.after_step(step_fn.model, out.z2, idx)
    ok = torch.isfinite(out.loss) & torch.isfinite(out.value)
    training.finite = ok if training.finite is None else training.finite & ok
    training.last_value = out.value.clone()
    training.step += 1
    update = None
    if before is not None:
        delta = torch._foreach_sub([p.detach() for p in step_fn.model.parameters()], before)
        update = (torch.stack(torch._foreach_norm(delta)).double().pow(2).sum().sqrt(), lr)
    return out, update


def _log_diverged(training: Training, hooks: Hooks) -> None:
    training.last_value = torch.tensor(float("nan"))
    if not training.world.is_main:
        return
    if hooks.log_fn is not None:
        hooks.log_fn({"train/loss": float("nan"), "train/diverged": 1.0}, training.step)
    print(f"{training.cell.id}: non-finite loss by step {training.step}: cell recorded as diverged", file=sys.stderr)


@contextmanager
def _sigterm():
    """A flag set by SIGTERM (SLURM's preemption / time-limit signal) while the loop runs."""
    term = {"flag": False}
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, lambda *_: term.update(flag=True)) if main else None
    try:
        yield term
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------- what is logged
def step_metrics(training: Training, out, update, window: list) -> dict:
    """The metrics of a logging step: loss, lr, τ, speed, the scores' diagnostics, the
    gradient-scale mechanism (DCL) and, every ``grad_error_every`` steps, the rounding
    error of the loss gradient (FlatNCE)."""
    step_fn, settings = training.step_fn, training.cell.train
    assert training.last_value is not None  # a logging step follows a step
    loss, infonce = float(mean_over_processes(training.last_value)), float(mean_over_processes(out.infonce))
    out = whole_batch(training, out)  # collectives: every process takes part, rank 0 reports
    if not training.world.is_main:
        return {}
    now = time.perf_counter()
    tau = float(out.tau)
    m = {
        "train/loss": loss,
        "train/infonce": infonce,
        "train/tau": tau,
        "train/lr": lr_at(training.step - 1, training.total, training.warmup, training.peak_lr, training.schedule),
        "train/images_per_s": window[1] / max(now - window[0], 1e-9),
        "epoch": training.step / training.steps_per_epoch,
        # the x-axis that compares batch sizes (the step is the optimiser's: 16x more at batch 16 than 256)
        "train/images_seen": float(training.step * training.cell.batch_size),
    }
    window[0], window[1] = now, 0
    sc = out.scores
    m.update(
        {f"diag/{k}": v for k, v in diagnostics(sc.pos, sc.neg, tau, neg_mask=sc.mask, z1=out.z1, z2=out.z2).items()}
    )
    m.update({f"diag/{k}": v for k, v in batch_covariance_rank(out.z1).items()})  # B images vs D dimensions
    m.update(mechanism_metrics(training, out, update))
    m.update({f"train/loss_{k}": float(p.detach()) for k, p in step_fn.loss_fn.named_parameters() if p.numel() == 1})
    target = step_fn.temperature.target(training.step - 1)
    if target is not None:
        m["diag/ess_target"] = target
    if step_fn.scaler is not None:
        m["train/fp16_skipped_steps"] = float(step_fn.skipped_steps)
    every = settings.grad_error_every
    if every and training.step % every == 0 and step_fn.source.kind == "in_batch":
        m["diag/grad_rel_err"] = grad_rel_error(step_fn.loss_fn, out.z1, out.z2, torch.float32, tau)
        m["diag/grad_rel_err_bf16"] = grad_rel_error(step_fn.loss_fn, out.z1, out.z2, torch.bfloat16, tau)
    return m


def whole_batch(training: Training, out):
    """With several processes, the step's embeddings of the whole batch (gathered) and,
    for in-batch negatives, the whole batch's scores, for the diagnostics (no gradient)."""
    if training.world.size == 1:
        return out
    z1, z2 = gather(out.z1), gather(out.z2)
    if training.step_fn.source.kind != "in_batch":
        return out._replace(z1=z1, z2=z2)
    return out._replace(z1=z1, z2=z2, scores=Scores(*in_batch_scores(z1, z2)))


def mechanism_metrics(training: Training, out, update) -> dict:
    """DCL's mechanism measured on the step's own embeddings: the norm of the gradient of
    the cell's loss, of InfoNCE and of DCL w.r.t. the embeddings (no backward through the
    network), their ratio (to compare with ``diag/qb_mean``), and the size of the update
    per unit of learning rate ``||Δθ|| / lr`` (Adam normalises a global gradient scale
    away, SGD/LARS do not).  Measured for in-batch negatives."""
    step_fn = training.step_fn
    if step_fn.source.kind != "in_batch":  # a queue's negatives have moved on since the step: not measured
        return {}
    norms = {}
    for name, fn in (("", step_fn.loss_fn), ("_infonce", build_loss("infonce")), ("_dcl", build_loss("dcl"))):
        norms[name] = float(embedding_grad_norm(fn, out.z1, out.z2, step_fn.source.rescore, temperature=out.tau))
    m = {f"diag/grad_norm{k}": v for k, v in norms.items()}
    m["diag/grad_ratio_infonce_dcl"] = norms["_infonce"] / norms["_dcl"] if norms["_dcl"] > 0 else float("nan")
    if update is not None:
        delta, lr = update
        m["diag/update_per_lr"] = float(delta) / lr if lr > 0 else float("nan")
    return m


# --------------------------------------------------------------------------- the end
def finish(training: Training, status: str, elapsed: float) -> TrainResult:
    """Check the representation (collapse), write ``checkpoint.pt``, return the result."""
    step_fn = training.step_fn
    wall = training.wall_before + elapsed
    if training.last_value is not None:
        training.last_value = mean_over_processes(training.last_value)
    h = {}
    if status == "finished" and training.world.is_main:
        views = normalize(training.images[: health.SAMPLE], training.mean, training.std)
        h = health.embedding_health(step_fn.model, views.to(next(step_fn.model.parameters()).dtype))
        if health.collapsed_embeddings(h):
            status = "collapsed"
            print(
                f"{training.cell.id}: embeddings collapsed (effective rank {h['effective_rank']:.2f}, "
                f"projection std {h['projection_std']:.2e}): cell recorded as collapsed",
                file=sys.stderr,
            )
    final = _last_loss(training) if status != "diverged" else float("nan")
    if status == "diverged" and training.world.is_main:  # the budgets not reached finite: each says so
        for step, budget in training.snapshots.items():
            if step >= training.step:
                save_snapshot(
                    snapshot_path(training.out_dir, budget["name"]), training.cell, budget, model={}, status="diverged"
                )
    cpu = _cpu_s(training)
    c, size = training.images.shape[1], training.images.shape[-1]
    if training.world.is_main:
        save_checkpoint(
            training.out_dir / "checkpoint.pt",
            training.cell,
            model=step_fn.model.state_dict(),
            status=status,
            steps=training.step,
            epochs=training.step / training.steps_per_epoch,
            final_loss=final,
            wall_s=wall,
            channels=c,
            image_size=size,
            mean=training.mean,
            std=training.std,
            health=h,
            extended_from=training.extends,
        )
    return TrainResult(
        status=status,
        steps=training.step,
        epochs=training.step / training.steps_per_epoch,
        final_loss=final,
        wall_s=wall,
        images_per_s=training.step * training.cell.batch_size / max(wall, 1e-9),
        health=h,
        cpu_s=cpu,
        extended_from=training.extends,
    )


def _cpu_s(training: Training) -> float:
    """CPU seconds of this cell's training so far (this process's threads, and the runs it resumed)."""
    return training.cpu_before + time.process_time() - training.cpu_start


def _progress(total: int, initial: int, desc: str, enabled: bool):
    """The steps' progress on stderr (a bar on a terminal, a line per 10 % in a log file), or None."""
    return step_progress(total, initial, desc) if enabled else None
