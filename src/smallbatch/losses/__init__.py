"""Contrastive losses as pure functions of embeddings (no I/O), usable as a library.

Losses: InfoNCE / NT-Xent (SimCLR), FlatNCE (+ its Hölder-mean generalisation),
DCL, DCLW, EqCo, SogCLR (per-image state across steps) and iSogCLR (with a τ per image), SigLIP/SigCLR (learnt scale and
bias), DHEL and KCL (same-view negatives), SimCo's dual temperature, alignment + uniformity,
debiased and hard-negative InfoNCE, and InfoNCE at a learnt τ; each usable with in-batch
negatives (SimCLR style) and, unless it contrasts same-view negatives, with negatives from
a MoCo-style FIFO queue of momentum-encoder keys
(:class:`smallbatch.training.negatives.MomentumQueue`).  The quantities the study tracks
on the same similarities (InfoNCE MI estimate vs its ``log(K+1)`` ceiling, FlatNCE's ESS,
DCL's coupling ``q_B``, alignment, uniformity, ...) are :mod:`smallbatch.losses.diagnostics`.
The registry also holds three methods without negatives (SimSiam, VICReg, BYOL,
:mod:`~smallbatch.losses.siamese`): functions of the views' outputs and targets, not of scores.

Conventions used throughout
---------------------------
* Embeddings are L2-normalised before use; the *scores* ``s`` are cosine
  similarities and ``x = s / tau`` are the logits (tau = temperature, beta = 1/tau
  in FlatNCE's notation).
* ``pos`` is a vector ``(B,)`` of anchor-positive scores, ``neg`` a matrix
  ``(B, K)`` of anchor-negative scores.  ``neg_mask`` (optional, bool,
  ``(B, K)``) is **True for a valid negative** and False for an entry to
  ignore (set to ``-inf`` before any logsumexp); with a mask, K differs per
  row and every "K" below means that row's own number of valid negatives.
* In-batch (SimCLR): N images give 2N views; each of the 2N views is an anchor
  with one positive (the other view of its image) and the 2N-2 other views as
  negatives (K = 2N-2).  Losses average over all 2N anchors, so they are
  symmetric in the two views.
* Queue (MoCo): anchors are the N queries ``q = z1``, positives their keys
  ``k = z2`` (detached by the caller, who runs the momentum encoder), negatives
  the M queued keys (K = M, independent of the batch size).  Queue entries
  whose dataset index equals the anchor's index are masked out (see
  :class:`~smallbatch.training.negatives.MomentumQueue` for the CIFAR pitfall this guards against).
* :meth:`ContrastiveLoss.from_scores` accepts any real-valued scores (e.g. a
  critic's outputs in the Gaussian MI benchmark), not only cosines.
* Precision: float16/bfloat16 inputs are computed internally in float32;
  float32 stays float32 and float64 stays float64 (never downcast — the
  precision experiment relies on float64 being really float64).
* Losses use ``logsumexp`` everywhere; a row without any valid negative is a
  ``ValueError``.

The package, by seam
--------------------
* :mod:`~smallbatch.losses.registry` -- names, papers, parameters and properties of every
  loss, the config schema's loss parts; imports no torch (the report and config planning
  read loss names through it);
* :mod:`~smallbatch.losses.scores` -- the score builders (in-batch, grouped, queue) and the
  shared checks;
* :mod:`~smallbatch.losses.base` -- :class:`ContrastiveLoss` and :class:`LossOutput`;
* one module per family (``softmax``, ``flatnce``, ``decoupled``, ``sogclr``, ``sigmoid``,
  ``kernel``, ``debiased``), and ``siamese`` for the methods without negatives;
* :mod:`~smallbatch.losses.build` -- :data:`REGISTRY` (name -> class) and :func:`build_loss`.

``import smallbatch.losses`` loads only the registry; the first use of any other name
(``build_loss``, ``InfoNCE``, ``in_batch_scores``, ...) imports torch and the losses.

Examples:
    >>> import torch
    >>> from smallbatch.losses import build_loss, display_name
    >>> display_name("ntxent")
    'InfoNCE'
    >>> z1 = torch.randn(16, 32)
    >>> z2 = z1 + 0.1 * torch.randn(16, 32)
    >>> out = build_loss("flatnce")(z1, z2, temperature=0.1)
    >>> float(out.loss)  # FlatNCE's objective is the constant 1; its value is logged
    1.0
"""

from __future__ import annotations

import importlib
from typing import Any

from .registry import (
    SPECS,
    LossSpec,
    canonical_name,
    config_schema,
    display_name,
    loss_names,
    loss_param_names,
    loss_rank,
    loss_spec,
    paper_family,
)

#: the names of the torch side, by module (loaded on first use, :func:`__getattr__`)
_LAZY = {
    "scores": (
        "compute_dtype",
        "check_views",
        "check_group",
        "row_counts",
        "prepare_scores",
        "masked",
        "in_batch_scores",
        "grouped_in_batch_scores",
        "grouped_rows",
        "in_batch_columns",
        "same_view_mask",
        "batch_positives",
        "KeyQueue",
        "queue_scores",
    ),
    "base": ("LossOutput", "ContrastiveLoss", "infonce_rows"),
    "softmax": ("InfoNCE", "EqCo", "DualTemperature", "LearntTemperatureInfoNCE"),
    "flatnce": ("FlatNCE",),
    "decoupled": ("DCL", "DCLW", "DHEL"),
    "sogclr": ("SogCLR", "ISogCLR"),
    "sigmoid": ("SigLIP",),
    "kernel": ("KCL", "AlignUniform"),
    "debiased": ("HardNegatives", "Debiased"),
    "siamese": ("SiameseLoss", "SimSiam", "VICReg", "BYOL", "vicreg_terms"),
    "build": ("REGISTRY", "LOSSES", "loss_class", "build_loss"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "SPECS",
    "LossSpec",
    "canonical_name",
    "config_schema",
    "display_name",
    "loss_names",
    "loss_param_names",
    "loss_rank",
    "loss_spec",
    "paper_family",
    *_WHERE,
]


def __getattr__(name: str) -> Any:
    """The torch side's names, imported on first use (PEP 562) so that the registry's
    readers (report, config planning) never load torch."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
