"""One pretraining step as a function of tensors, and its parts.

:class:`TrainStep` holds what a step uses (model, augmentation, negatives source, loss,
temperature, optimiser, precision) and does one update in two calls:

* :meth:`TrainStep.forward` ``(x, u, idx) -> StepOut`` — the views from the images ``x``
  and the step's uniforms ``u``, both views through the model, the scores (once), the
  temperature and the loss.  It is a pure function of tensors with every shape fixed
  by the batch size: no ``.item()``, no data-dependent shape, no Python branch on a
  tensor — what would synchronise a GPU.  ``torch.compile(fullgraph=True)`` takes it as
  ONE graph for every loss and both augmentation recipes with in-batch negatives (the
  test suite checks it with ``torch._dynamo.explain``); AOTAutograd compiles its
  backward as a second graph.
* :meth:`TrainStep.update` — backward, then the optimiser update as a third graph
  (``optim.optimizer_step``; with ``train.compile`` compiled with ``fullgraph=True``).

Precision: the model runs under autocast for ``bf16``/``fp16``; the embeddings are cast
to float32 and the scores and the loss are computed OUTSIDE autocast (under autocast
``z @ z.T`` would run in bf16 even after ``.float()``, ~2^-8 error in the similarities:
0.08 in a logit at τ = 0.05).  ``fp64`` runs views, model and loss in float64.  ``fp16``
scales the loss with a GradScaler (torch's GradScaler reads its overflow flag on the
host, so an fp16 step synchronises once; the skipped steps are counted).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..data.augment import BatchAugment
from ..study.cell import TrainSettings
from ..study.checks import PRECISIONS
from .distributed import average_gradients
from .negatives import Scores
from .optim import eager_optimizers, optimizer_step

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class StepOut(NamedTuple):
    """What a step returns: the loss to back-propagate, its logged value and InfoNCE
    (detached), the scores (detached), the embeddings (detached) and the τ used."""

    loss: Tensor
    value: Tensor
    infonce: Tensor
    scores: Scores
    z1: Tensor
    z2: Tensor
    tau: float | Tensor


class TrainStep:
    """The parts of a step (see the module docstring).  ``model`` is the network itself
    (what is saved, evaluated and copied into a momentum encoder), ``net`` the one that
    is called: ``model`` or its DistributedDataParallel wrapper.  ``chunk_size``: embed
    this process's images in chunks of that many with gradient caching
    (:mod:`smallbatch.training.gradcache`; None = the whole batch in one pass)."""

    def __init__(
        self,
        model,
        aug: BatchAugment,
        source,
        loss_fn,
        temperature,
        opt,
        precision: str,
        device: torch.device,
        net=None,
        chunk_size: int | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
        self.model, self.net = model, model if net is None else net
        self.aug, self.source, self.loss_fn = aug, source, loss_fn
        self.loss_params = [p for p in loss_fn.parameters() if p.requires_grad] if loss_fn is not None else []
        self.temperature, self.opt, self.device, self.chunk_size = temperature, opt, device, chunk_size
        self.fp64 = precision == "fp64"
        self.loss_dtype = torch.float64 if self.fp64 else torch.float32
        self.autocast_dtype = _AUTOCAST.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.skipped_steps = 0  # fp16 steps the GradScaler skipped (overflow)
        self._opt_step: Callable[[], None] = functools.partial(optimizer_step, opt)
        self.cuda_graphs = False  # compiled with CUDA graphs (compile(mode="reduce-overhead"))

    def _views(self, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        views = self.aug.apply(torch.cat([x, x]), u)
        if self.fp64:
            views = views.double()
        return views[: x.shape[0]], views[x.shape[0] :]

    def _autocast(self):
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
        )

    def _loss(self, z1: Tensor, z2: Tensor, idx: Tensor, pairs: tuple | None = None):
        """Scores (once), τ and the loss of the embeddings, in fp32 (fp64) outside autocast.
        ``pairs``: a method without negatives' outputs and targets (``Siamese.outputs``), which
        its loss takes instead of the scores (these are then diagnostics only)."""
        z1, z2 = z1.to(self.loss_dtype), z2.to(self.loss_dtype)
        sc = self.source.scores(z1, z2, idx)
        tau = self.temperature(sc.neg.detach() if sc.tau_neg is None else sc.tau_neg, sc.mask)
        if pairs is not None:
            out = self.loss_fn(*(t.to(self.loss_dtype) for t in pairs), temperature=tau)
            return out, sc, tau
        out = self.loss_fn.from_scores(
            sc.pos, sc.neg, sc.mask, temperature=tau, batch_pos=sc.batch_pos, check=False, index=sc.index
        )
        return out, sc, tau

    def forward(self, x: Tensor, u: Tensor, idx: Tensor) -> StepOut:
        """Views, embeddings, scores, τ and loss of the images ``x`` (uint8, B images)."""
        v1, v2 = self._views(x, u)
        with self._autocast():
            z1, z2 = self.source.embed(self.net, v1, v2)
            pairs = self.source.outputs(self.net, v1, v2, z1, z2) if self.source.kind == "siamese" else None
        out, sc, tau = self._loss(z1, z2, idx, pairs)
        return StepOut(
            out.loss,
            out.value,
            out.infonce,
            sc.detached(),
            z1.detach().to(self.loss_dtype),
            z2.detach().to(self.loss_dtype),
            _detached(tau),
        )

    def run(self, x: Tensor, u: Tensor, idx: Tensor) -> StepOut:
        """One whole update of the images ``x``: forward, backward, optimiser step."""
        if self.cuda_graphs:  # a new iteration: the graphs may reuse the last step's output memory
            torch.compiler.cudagraph_mark_step_begin()
        if self.chunk_size is None or self.chunk_size >= x.shape[0]:
            out = self.forward(x, u, idx)
            self.update(out.loss)
            return out
        self.opt.zero_grad(set_to_none=True)
        out = self._chunked(x, u, idx, self.chunk_size)
        self._apply_update()
        return out

    def _chunked(self, x: Tensor, u: Tensor, idx: Tensor, chunk_size: int) -> StepOut:
        """Forward and backward with gradient caching (the gradient, BatchNorm statistics and
        running statistics of the whole batch, see :mod:`smallbatch.training.gradcache`)."""
        from .gradcache import cached_backward

        v1, v2 = self._views(x, u)
        in_batch = self.source.kind == "in_batch"
        keep = {}
        with self._autocast():
            keys = None if in_batch else self._keys(v2)  # MoCo: keys from the momentum encoder, no graph

            def loss_of(*zs):
                with torch.autocast(self.device.type, enabled=False):
                    z2 = zs[1] if in_batch else keys
                    keep["out"], keep["sc"], keep["tau"] = self._loss(zs[0], z2, idx)
                    keep["z2"] = z2
                return keep["out"]

            scale = self.scaler.scale if self.scaler is not None else None
            _, zs = cached_backward(
                self.net, (v1, v2) if in_batch else (v1,), loss_of, chunk_size, scale, self.loss_params
            )
        out = keep["out"]
        return StepOut(
            out.loss.detach(),
            out.value,
            out.infonce,
            keep["sc"].detached(),
            zs[0].detach().to(self.loss_dtype),
            keep["z2"].detach().to(self.loss_dtype),
            _detached(keep["tau"]),
        )

    def _keys(self, v2: Tensor) -> Tensor:
        with torch.no_grad():
            return self.source.key_model(v2)

    def update(self, loss: Tensor) -> None:
        """Backward and the optimiser update (through the GradScaler in fp16)."""
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()
        self._apply_update()

    def _apply_update(self) -> None:
        average_gradients(self.loss_params)  # outside the DDP module: averaged here (one process: nothing)
        if self.scaler is None:
            self._opt_step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.skipped_steps += int(self.scaler.get_scale() < before)

    def compile(self, mode: str | None = None, fullgraph: bool = True) -> None:
        """``torch.compile`` the forward (one graph with in-batch negatives; a queue's
        filling changes shapes, so it may take several) and the optimiser update."""
        eager_optimizers(False)  # the compiler's own marks on torch's optimiser methods
        fullgraph = fullgraph and self.source.kind in ("in_batch", "siamese")
        self.aug.prepare(self.device)
        self.forward = torch.compile(self.forward, fullgraph=fullgraph, mode=mode)  # type: ignore[method-assign]  # in place
        self._opt_step = torch.compile(self._opt_step, fullgraph=True, mode=mode)
        # CUDA graph trees need each training iteration marked (measured on an H200: without
        # it the second step fails, "accessing tensor output of CUDAGraphs that has been
        # overwritten by a subsequent run")
        self.cuda_graphs = mode == "reduce-overhead"

    def state_dict(self) -> dict:
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _detached(tau: float | Tensor) -> float | Tensor:
    """The step's τ as reported: a learnt τ without its graph."""
    return tau.detach() if isinstance(tau, Tensor) else tau


def configure_backends(train_cfg: TrainSettings, device: torch.device) -> None:
    """Numerics switches that are settings of the study, not defaults of the machine:
    ``tf32`` (TF32 matmuls/convolutions on GPUs; off unless asked, so ``fp32`` means
    float32) and ``deterministic`` (cuDNN deterministic algorithms, no autotuning, and
    deterministic cuBLAS: bitwise-repeatable GPU runs at some speed cost)."""
    tf32 = bool(train_cfg.tf32)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    det = bool(train_cfg.deterministic)
    torch.backends.cudnn.deterministic = det
    torch.backends.cudnn.benchmark = device.type == "cuda" and not det
    if det and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
