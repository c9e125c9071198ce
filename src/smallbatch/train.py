"""Contrastive pretraining of one cell, readable top to bottom.

The whole (small) data set sits on the device as one uint8 tensor; each step
indexes a batch, draws two per-sample random views on the device, encodes both
views in one forward pass (so BatchNorm sees 2N views, as in SimCLR), and
applies the cell's loss.  Negatives are in-batch (K = 2N-2) or, with
``train.queue_size > 0``, a MoCo-style queue filled by a momentum encoder.

Learning rate: ``train.lr`` is the rate at batch 256; ``lr_scaling`` maps it to
the cell's batch size N: ``linear`` lr*N/256 (SimCLR), ``sqrt`` lr*sqrt(N/256)
(SimCLR's square-root rule, normalised at 256), ``none`` lr.  Linear warm-up
for ``warmup_epochs`` then cosine decay to zero, per step.

Precision: ``fp32`` everywhere by default; ``fp64`` runs model, views and loss
in float64 (the FlatNCE floating-point hypothesis); ``bf16`` uses autocast (CPU
or CUDA); ``fp16`` uses autocast with a GradScaler and needs CUDA.

Fault tolerance: the resumable state (weights, optimiser, queue, momentum
encoder, RNG states, the epoch's permutation and position) is written
atomically to ``state.pt`` at the end of every epoch and when SIGTERM arrives
(SLURM preemption / time limit).  A rerun continues from it and ends with the
same weights as an uninterrupted run.  ``checkpoint.pt`` (the step's declared
output) is written only when training is complete.  A non-finite loss ends the
cell as *diverged*: a result of the study, not a crash.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .augment import AugmentConfig, BatchAugment
from .errors import CheckpointError, Preempted
from .io import save_torch
from .losses import build_loss, diagnostics, in_batch_scores, queue_scores, MomentumQueue
from .models import ContrastiveModel, build_backbone

PRECISIONS = ("fp32", "bf16", "fp16", "fp64")
STATE_VERSION = 1




@dataclass
class TrainResult:
    status: str  # finished | diverged
    steps: int
    epochs: float
    final_loss: float
    wall_s: float
    images_per_s: float


# --------------------------------------------------------------------------- devices
def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use device: auto or cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    return torch.device(device)


# --------------------------------------------------------------------------- atomic I/O
def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint/state file; one-line CheckpointError if it is corrupt."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - truncated zip, pickle error, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({first[:160]})") from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise CheckpointError(f"checkpoint {path} is not a smallbatch checkpoint (no 'model' entry)")
    return obj


# --------------------------------------------------------------------------- optimisers
class LARS(torch.optim.Optimizer):
    """LARS (You et al. 2017) as used by SimCLR: SGD with momentum whose per-layer
    step is scaled by the trust ratio eta*||w||/||g + wd*w||; biases and
    normalisation parameters (1-D tensors) are excluded from adaptation and decay."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.ndim > 1:
                    g = g.add(p, alpha=group["weight_decay"])
                    w_norm, g_norm = torch.norm(p), torch.norm(g)
                    trust = torch.where((w_norm > 0) & (g_norm > 0), group["eta"] * w_norm / g_norm,
                                        torch.ones_like(w_norm))
                    g = g.mul(trust)
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.clone(g).detach()
                else:
                    buf.mul_(group["momentum"]).add_(g)
                p.add_(buf, alpha=-group["lr"])


def scaled_lr(base_lr: float, batch_size: int, rule: str) -> float:
    if rule == "linear":
        return base_lr * batch_size / 256
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_size / 256)
    if rule == "none":
        return base_lr
    raise ValueError(f"lr_scaling must be one of none, linear, sqrt, not {rule!r}")


def make_optimizer(params, name: str, lr: float, momentum: float, weight_decay: float):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "lars":
        return LARS(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be one of sgd, lars, adam, not {name!r}")


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# --------------------------------------------------------------------------- ESS-scheduled temperature
@torch.no_grad()
def ess_of(neg: torch.Tensor, tau: float, neg_mask: torch.Tensor | None = None) -> float:
    """Mean normalised effective sample size 1/(K sum_j w_j^2) of the softmax weights
    w = softmax_j(s_j/tau) over each anchor's negatives (FlatNCE); 1/K <= ESS <= 1."""
    x = neg.double() / tau
    if neg_mask is not None:
        x = x.masked_fill(~neg_mask, float("-inf"))
        k = neg_mask.sum(dim=1).double()
    else:
        k = torch.full((x.shape[0],), float(x.shape[1]), dtype=torch.float64, device=x.device)
    w = torch.softmax(x, dim=1)
    return float((1.0 / (k * (w * w).sum(dim=1))).mean())


class EssTemperature:
    """FlatNCE's ESS-scheduled temperature (Chen et al. 2021, Algorithm S1, in spirit):
    before each step, choose tau so that the ESS of the current batch's negative weights
    equals a target that moves from ``start`` (flat weights: many negatives count) to
    ``end`` (peaked: hard negatives dominate) on a cosine schedule.  ESS is monotone
    increasing in tau, so tau* is found by bisection in log tau within
    [tau_min, tau_max]; ``rate`` in (0, 1] smooths the update in log space
    (1 = jump to tau*)."""

    def __init__(self, start: float, end: float, total_steps: int, tau0: float, rate: float = 1.0,
                 tau_min: float = 0.01, tau_max: float = 10.0):
        for name, v in (("start", start), ("end", end)):
            if not 0 < v <= 1:
                raise ValueError(f"ess_schedule.{name} must be in (0, 1], not {v!r}")
        if not 0 < rate <= 1:
            raise ValueError(f"ess_schedule.rate must be in (0, 1], not {rate!r}")
        if not 0 < tau_min < tau_max:
            raise ValueError(f"ess_schedule needs 0 < tau_min < tau_max, not {tau_min!r}, {tau_max!r}")
        self.start, self.end, self.total = float(start), float(end), max(1, int(total_steps))
        self.tau, self.rate, self.tau_min, self.tau_max = float(tau0), float(rate), float(tau_min), float(tau_max)

    def target(self, step: int) -> float:
        p = min(1.0, step / self.total)
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * p))

    def solve(self, neg: torch.Tensor, target: float, neg_mask: torch.Tensor | None = None) -> float:
        lo, hi = math.log(self.tau_min), math.log(self.tau_max)
        if ess_of(neg, math.exp(lo), neg_mask) >= target:
            return math.exp(lo)
        if ess_of(neg, math.exp(hi), neg_mask) <= target:
            return math.exp(hi)
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if ess_of(neg, math.exp(mid), neg_mask) < target:
                lo = mid
            else:
                hi = mid
        return math.exp(0.5 * (lo + hi))

    def update(self, neg: torch.Tensor, step: int, neg_mask: torch.Tensor | None = None) -> float:
        star = self.solve(neg, self.target(step), neg_mask)
        self.tau = math.exp((1 - self.rate) * math.log(self.tau) + self.rate * math.log(star))
        return self.tau


# --------------------------------------------------------------------------- the loop
def _validate(cell: dict, n_images: int) -> None:
    bs = cell["batch_size"]
    if not isinstance(bs, int) or bs < 2:
        raise ValueError(f"batch_size must be an integer >= 2 (a batch of 1 has no negatives), not {bs!r}")
    if bs > n_images:
        raise ValueError(f"batch_size {bs} exceeds the {n_images} pretraining images of {cell['dataset']}")
    if not cell["temperature"] > 0:
        raise ValueError(f"temperature must be > 0, not {cell['temperature']!r}")
    tr = cell["train"]
    if tr.get("precision", "fp32") not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {tr['precision']!r}")
    if tr.get("steps") is None and not tr["epochs"] > 0:
        raise ValueError(f"epochs must be > 0, not {tr['epochs']!r}")


def build_model(cell: dict, channels: int, image_size: int) -> ContrastiveModel:
    tr = cell["train"]
    backbone, feat_dim = build_backbone(tr["backbone"], channels, image_size, width=tr["width"],
                                        pool_grid=tr.get("pool_grid", 1))
    return ContrastiveModel(backbone, feat_dim, tr["proj_hidden"], tr["proj_dim"])


def grad_rel_error(loss_fn, z1: torch.Tensor, z2: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative error ||g_dtype - g_fp64|| / ||g_fp64|| of the loss gradient w.r.t. the
    embeddings of one batch: the rounding error FlatNCE blames for InfoNCE's collapse."""
    def grad(dt):
        a = z1.detach().to(dt).requires_grad_(True)
        b = z2.detach().to(dt).requires_grad_(True)
        out = loss_fn(a, b)
        ga, gb = torch.autograd.grad(out.loss, (a, b))
        return torch.cat([ga.double().flatten(), gb.double().flatten()])

    g64 = grad(torch.float64)
    glo = grad(dtype)
    denom = torch.linalg.vector_norm(g64)
    if denom == 0:
        return 0.0
    return float(torch.linalg.vector_norm(glo - g64) / denom)


def pretrain(
    cell: dict,
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
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Pretrain the cell's encoder on ``images`` (uint8 N,C,H,W); write checkpoint.pt.

    ``log_fn(metrics, step)`` receives per-step metrics (loss, diagnostics, lr, ...).
    ``before_save()`` runs before every state save (the tracker flushes its buffer
    there, so the store never lags behind ``state.pt``: a run killed after the
    save and resumed from it has lost no logged step).
    ``stop_after_steps`` simulates a crash after that many steps (tests) by saving
    nothing extra and raising ``KeyboardInterrupt``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path, ckpt_path = out_dir / "state.pt", out_dir / "checkpoint.pt"
    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    _validate(cell, images.shape[0])
    tr = cell["train"]
    precision = tr.get("precision", "fp32")
    if precision == "fp16" and dev.type != "cuda":
        raise ValueError("precision fp16 needs CUDA (GradScaler); use bf16 or fp32 on the CPU")
    torch.manual_seed(cell["seed"])
    n, c, h, w = images.shape
    bs = cell["batch_size"]

    model = build_model(cell, c, h)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    model = model.to(dev, dtype=dtype)
    if dev.type == "cuda" and precision != "fp64":
        model = model.to(memory_format=torch.channels_last)
    loss_fn = build_loss(cell["loss"], cell["temperature"], **cell.get("loss_params", {}))
    aug = BatchAugment(AugmentConfig(**cell.get("augment", {})), image_size=h, channels=c, mean=mean, std=std)

    queue_size = int(tr.get("queue_size", 0) or 0)
    key_model = queue = None
    if queue_size:
        key_model = build_model(cell, c, h).to(dev, dtype=dtype)
        key_model.load_state_dict(model.state_dict())
        for p in key_model.parameters():
            p.requires_grad_(False)
        queue = MomentumQueue(queue_size, tr["proj_dim"], device=dev, dtype=dtype)

    steps_per_epoch = n // bs
    total_steps = int(tr["steps"]) if tr.get("steps") else max(1, math.ceil(float(tr["epochs"]) * steps_per_epoch))
    warmup = int(round(float(tr.get("warmup_epochs", 0)) * steps_per_epoch))
    peak_lr = scaled_lr(float(tr["lr"]), bs, tr.get("lr_scaling", "none"))
    opt = make_optimizer(model.parameters(), tr["optimizer"], peak_lr, tr.get("momentum", 0.9), tr["weight_decay"])
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    ess_sched = None
    if tr.get("ess_schedule"):
        es = tr["ess_schedule"]
        ess_sched = EssTemperature(es["start"], es["end"], total_steps, cell["temperature"], es.get("rate", 1.0),
                                   es.get("tau_min", 0.01), es.get("tau_max", 10.0))

    gen_perm = torch.Generator().manual_seed(cell["seed"])
    gen_aug = torch.Generator(device=dev).manual_seed(cell["seed"] + 1)
    step, perm, status, last_loss = 0, None, "running", float("nan")
    elapsed_before = 0.0

    # ---- resume ------------------------------------------------------------------
    if state_path.exists() and not restart:
        st = load_checkpoint(state_path)  # CheckpointError names the file
        if st.get("cell_hash") == cell["hash"] and st.get("version") == STATE_VERSION:
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
            if key_model is not None and st.get("key_model") is not None:
                key_model.load_state_dict(st["key_model"])
                queue.load_state_dict(st["queue"])
            if scaler is not None and st.get("scaler"):
                scaler.load_state_dict(st["scaler"])
            gen_perm.set_state(st["gen_perm"])
            gen_aug.set_state(st["gen_aug"].to(gen_aug.get_state().device) if dev.type == "cpu" else st["gen_aug"])
            step, perm, last_loss = int(st["step"]), st["perm"], float(st["last_loss"])
            loss_fn.temperature = float(st.get("tau", cell["temperature"]))
            if ess_sched is not None:
                ess_sched.tau = loss_fn.temperature
            elapsed_before = float(st.get("wall_s", 0.0))
            print(f"resuming {cell['id']} from step {step}/{total_steps} ({state_path})", file=sys.stderr)
        else:
            print(f"state {state_path} belongs to another config of this cell; starting afresh", file=sys.stderr)
    images = images.to(dev)

    def save_state() -> None:
        if before_save is not None:
            before_save()
        save_torch(state_path, {
            "version": STATE_VERSION, "cell_hash": cell["hash"], "cell_id": cell["id"],
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "key_model": key_model.state_dict() if key_model is not None else None,
            "queue": queue.state_dict() if queue is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "gen_perm": gen_perm.get_state(), "gen_aug": gen_aug.get_state().cpu(),
            "step": step, "perm": perm, "last_loss": last_loss,
            "tau": float(loss_fn.temperature),
            "wall_s": elapsed_before + (time.perf_counter() - t_start),
        })

    term = {"flag": False}

    def on_term(signum, frame):  # noqa: ARG001
        term["flag"] = True

    old_handler = signal.signal(signal.SIGTERM, on_term) if _in_main_thread() else None
    log_every = int(tr.get("log_every", 10))
    grad_every = int(tr.get("grad_error_every", 0) or 0)
    t_start = time.perf_counter()
    t_window, img_window = time.perf_counter(), 0
    bar = _progress(total_steps, step, cell["id"], progress)
    model.train()
    try:
        while step < total_steps:
            pos_in_epoch = step % steps_per_epoch
            if pos_in_epoch == 0 or perm is None:
                if pos_in_epoch == 0:
                    perm = torch.randperm(n, generator=gen_perm)
            idx = perm[pos_in_epoch * bs:(pos_in_epoch + 1) * bs]
            x = images[idx.to(dev)]
            lr = lr_at(step, total_steps, warmup, peak_lr)
            for g in opt.param_groups:
                g["lr"] = lr
            v1, v2 = aug(x, gen_aug), aug(x, gen_aug)
            if dtype == torch.float64:
                v1, v2 = v1.double(), v2.double()
            with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                if queue is None:
                    z = model(torch.cat([v1, v2]))
                    z1, z2 = z[:bs], z[bs:]
                    if ess_sched is not None:
                        _, neg_d, mask_d = in_batch_scores(z1.detach().float(), z2.detach().float())
                        loss_fn.temperature = ess_sched.update(neg_d, step, mask_d)
                    out = loss_fn(z1, z2)
                else:
                    z1 = model(v1)
                    with torch.no_grad():
                        z2 = key_model(v2)
                    negs, neg_idx = queue.negatives()
                    if ess_sched is not None and len(queue):
                        _, neg_d, mask_d = queue_scores(z1.detach().float(), z2.detach().float(), negs.float(),
                                                        idx.to(dev), neg_idx)
                        loss_fn.temperature = ess_sched.update(neg_d, step, mask_d)
                    filled = len(queue) > 0
                    out = loss_fn(z1, z2.detach(), queue=negs if filled else None,
                                  q_index=idx.to(dev) if filled else None, queue_index=neg_idx if filled else None)
            loss = out.loss
            if not torch.isfinite(loss) or not torch.isfinite(out.value):
                status = "diverged"
                last_loss = float("nan")
                if log_fn:
                    log_fn({"train/loss": float("nan"), "train/diverged": 1.0}, step)
                print(f"{cell['id']}: non-finite loss at step {step}: cell recorded as diverged", file=sys.stderr)
                break
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if key_model is not None:
                with torch.no_grad():
                    mom = float(tr.get("moco_momentum", 0.99))
                    for pk, pq in zip(key_model.parameters(), model.parameters()):
                        pk.mul_(mom).add_(pq.detach(), alpha=1 - mom)
                    for bk, bq in zip(key_model.buffers(), model.buffers()):
                        bk.copy_(bq)
            last_loss = float(out.value)
            step += 1
            img_window += bs
            if log_fn and (step % log_every == 0 or step == total_steps):
                now = time.perf_counter()
                metrics = {
                    "train/loss": last_loss, "train/infonce": float(out.infonce), "train/lr": lr,
                    "train/tau": float(loss_fn.temperature),
                    "train/images_per_s": img_window / max(now - t_window, 1e-9),
                    "epoch": step / steps_per_epoch,
                }
                with torch.no_grad():
                    a, b = z1.detach().float(), z2.detach().float()
                    if queue is None:
                        pos, neg, mask = in_batch_scores(a, b)
                        d = diagnostics(pos, neg, loss_fn.temperature, neg_mask=mask, z1=a, z2=b)
                    else:
                        negs, neg_idx = queue.negatives()
                        if len(queue):
                            pos, neg, mask = queue_scores(a, b, negs.float(), idx.to(dev), neg_idx)
                            d = diagnostics(pos, neg, loss_fn.temperature, neg_mask=mask, z1=a, z2=b)
                        else:
                            d = {}
                metrics.update({f"diag/{k}": v for k, v in d.items()})
                if ess_sched is not None:
                    metrics["diag/ess_target"] = ess_sched.target(step - 1)  # the step just taken
                if grad_every and step % grad_every == 0 and queue is None:
                    metrics["diag/grad_rel_err"] = grad_rel_error(loss_fn, z1, z2, torch.float32)
                    metrics["diag/grad_rel_err_bf16"] = grad_rel_error(loss_fn, z1, z2, torch.bfloat16)
                log_fn(metrics, step)
                t_window, img_window = now, 0
            if queue is not None:  # after the diagnostics, so they see the queue the loss saw
                queue.enqueue(F.normalize(z2.detach().to(dtype), dim=1), idx.to(dev))
            if bar is not None:
                bar.update(1)
                if step % log_every == 0:
                    bar.set_postfix(epoch=f"{step / steps_per_epoch:.2f}", loss=f"{last_loss:.4f}")
            if step % steps_per_epoch == 0 or term["flag"]:
                save_state()
            if term["flag"]:
                raise Preempted(f"SIGTERM received: {cell['id']} saved its state at step {step} to {state_path}")
            if stop_after_steps is not None and step >= stop_after_steps:
                raise KeyboardInterrupt(f"simulated crash after {step} steps")
    finally:
        if bar is not None:
            bar.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)

    wall = elapsed_before + (time.perf_counter() - t_start)
    if status == "running":
        status = "finished"
    result = TrainResult(status=status, steps=step, epochs=step / steps_per_epoch, final_loss=last_loss,
                         wall_s=wall, images_per_s=step * bs / max(wall, 1e-9))
    save_torch(ckpt_path, {
        "model": model.state_dict(), "cell": cell, "status": status, "steps": step,
        "epochs": result.epochs, "final_loss": last_loss, "wall_s": wall,
        "channels": c, "image_size": h, "mean": list(mean), "std": list(std),
    })
    return result


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _progress(total: int, initial: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                mininterval=0.5 if tty else 15.0, file=sys.stderr)
