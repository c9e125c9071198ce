"""The base class of every loss: scores in, :class:`LossOutput` out, τ per call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .registry import LossSpec, all_specs, params_problem
from .scores import KeyQueue, in_batch_scores, masked, prepare_scores, queue_scores, same_view_mask

__all__ = ["LossOutput", "ContrastiveLoss", "infonce_rows"]


def infonce_rows(pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor) -> Tensor:
    """Per-anchor InfoNCE: logsumexp([s_pos, s_neg]/tau) - s_pos/tau."""
    xp = pos / tau
    xn = masked(neg / tau, neg_mask)
    logits = torch.cat([xp[:, None], xn], dim=1)
    return torch.logsumexp(logits, dim=1) - xp


@dataclass
class LossOutput:
    """Result of a contrastive loss.

    ``loss``: scalar to call ``backward()`` on.  ``value``: detached scalar to
    log as "the loss" (for FlatNCE its logsumexp value, not the constant 1).
    ``infonce``: detached InfoNCE of the same scores, for logging/diagnostics.
    """

    loss: Tensor
    value: Tensor
    infonce: Tensor


def check_start_temperature(tau: float) -> None:
    """A one-line ValueError unless ``tau`` can start a temperature a loss learns (a positive
    finite number; a cell's τ is checked against its range before any job:
    :func:`smallbatch.study.checks.tau_problem`)."""
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"temperature must be a positive finite number, got {tau!r}")


class ContrastiveLoss(torch.nn.Module):
    """Base class: a contrastive loss of (pos, neg, neg_mask) scores at temperature tau.

    A subclass names its registry entry (``class DCL(ContrastiveLoss, spec="dcl")``), which
    gives it its metadata as class attributes (``name``, ``display``, ``aliases``, ``paper``,
    ``paper_pattern``, ``param_defaults``, ``param_schema`` and the properties ``stateful``,
    ``learnable``, ``owns_temperature``, ``uses_temperature``, ``negatives``,
    ``per_anchor``; see :mod:`smallbatch.losses.registry`), and implements :meth:`_rows`
    returning ``(loss_rows, value_rows)`` (a loss that is not a mean over anchors overrides
    :meth:`_reduce` instead).  :meth:`forward` builds the scores from embeddings (in-batch
    or queue) and calls :meth:`from_scores`, which averages over anchors.

    A loss that owns its temperature holds ``log_scale`` = t' (a parameter; τ = exp(-t'),
    CLIP's and SigLIP's logit scale t = exp(t')), starting at τ = :attr:`tau0` until
    :meth:`init_temperature` sets it; its other learnable parameters are its own.
    """

    spec: ClassVar[LossSpec]
    name: ClassVar[str] = "base"
    param_defaults: ClassVar[dict[str, Any]] = {}
    display: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    paper: ClassVar[str] = ""
    paper_pattern: ClassVar[str] = ""
    param_schema: ClassVar[dict[str, dict]] = {}
    #: True for a loss with per-image state across steps (SogCLR's u): the training step
    #: calls :meth:`init_state` and saves :meth:`state_dict` in ``state.pt``
    stateful: ClassVar[bool] = False
    #: the other registry properties (:class:`~smallbatch.losses.registry.LossSpec`)
    learnable: ClassVar[bool] = False
    owns_temperature: ClassVar[bool] = False
    uses_temperature: ClassVar[bool] = True
    negatives: ClassVar[str] = "all"
    per_anchor: ClassVar[bool] = True
    #: the starting τ of a loss that owns its temperature (SigLIP's t'_0 = log 10)
    tau0: ClassVar[float] = 0.1

    def __init_subclass__(cls, spec: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if spec is None:
            return
        s = all_specs()[spec]  # a built-in's or an installed plugin's
        cls.spec = s
        cls.name, cls.display, cls.aliases, cls.paper, cls.paper_pattern = (
            s.name,
            s.display,
            s.aliases,
            s.paper,
            s.paper_pattern,
        )
        cls.param_defaults, cls.param_schema, cls.stateful = dict(s.defaults), dict(s.params), s.stateful
        cls.learnable, cls.owns_temperature, cls.uses_temperature = s.learnable, s.owns_temperature, s.uses_temperature
        cls.negatives, cls.per_anchor = s.negatives, s.per_anchor

    def __init__(self, **params: Any) -> None:
        super().__init__()
        problem = params_problem(self.name, params)  # the registry's bounds, the schema's too
        if problem:
            raise ValueError(problem)
        for key, default in self.param_defaults.items():
            setattr(self, key, self._check_param(key, params.get(key, default)))
        if self.owns_temperature and self.learnable:
            self.log_scale = torch.nn.Parameter(torch.tensor(-math.log(self.tau0)))

    # a parameter as the loss keeps it (its bounds are the registry's, checked above)
    def _check_param(self, key: str, value: Any) -> Any:
        number = "number" in str(self.param_schema.get(key, {}).get("type"))
        return float(value) if number and value is not None else value

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={getattr(self, k)!r}" for k in self.param_defaults)

    def params(self) -> dict[str, Any]:
        """The loss's own parameters (its extras; the temperature is the caller's, per call), e.g. for logging."""
        return {k: getattr(self, k) for k in self.param_defaults}

    # --------------------------------------------------------------- a temperature it learns
    def learnt_temperature(self) -> Tensor:
        """τ = exp(-t') of a loss that owns its temperature (a 0-d tensor with its gradient)."""
        if not self.owns_temperature:
            raise ValueError(f"loss '{self.name}' does not learn its temperature; τ is the caller's, per call")
        return torch.exp(-self.log_scale)

    @torch.no_grad()
    def init_temperature(self, tau: float) -> None:
        """Start the learnt temperature at ``tau`` (the cell's τ): t' = -log τ."""
        check_start_temperature(tau)
        self.learnt_temperature()  # refuses a loss that does not learn it
        self.log_scale.fill_(-math.log(tau))

    def _tau(self, temperature: float | Tensor | None) -> float | Tensor:
        """The τ of a call: the caller's; else a learnt one; else 1 for a loss without τ
        (it then only scales the InfoNCE reported beside the loss)."""
        if temperature is not None:
            return temperature
        if self.owns_temperature:
            return self.learnt_temperature()
        if not self.uses_temperature:
            return 1.0
        raise ValueError(f"loss '{self.name}' takes its temperature per call: pass temperature=τ")

    def forward(
        self,
        z1: Tensor,
        z2: Tensor,
        queue: Tensor | KeyQueue | None = None,
        q_index: Tensor | None = None,
        queue_index: Tensor | None = None,
        *,
        temperature: float | Tensor | None = None,
    ) -> LossOutput:
        """Loss of two views ``z1, z2 (N, D)`` at ``temperature`` (see :meth:`from_scores`).

        Without ``queue``: in-batch negatives over the 2N views (N >= 2); a loss of
        same-view negatives (``negatives == "same_view"``) masks the other view's.  With
        ``queue`` (a ``(M, D)`` tensor or :class:`MomentumQueue`): ``z1`` are the
        queries, ``z2`` their (detached) keys and the queue supplies the
        negatives; ``q_index``/``queue_index`` mask an anchor's own old keys.
        The queue form is asymmetric (MoCo v1/v2); to symmetrise, call it twice
        with the views' roles swapped and average.
        """
        if queue is None:
            if q_index is not None or queue_index is not None:
                raise ValueError("q_index/queue_index are only meaningful with queue negatives (queue=None given)")
            pos, neg, mask = in_batch_scores(z1, z2)
            if self.negatives == "same_view":
                mask = same_view_mask(z1.shape[0], device=neg.device)
        else:
            if self.negatives == "same_view":
                raise ValueError(f"{self.display} contrasts same-view in-batch negatives, which a queue does not hold")
            pos, neg, mask = queue_scores(z1, z2, queue, q_index, queue_index)
        return self.from_scores(pos, neg, mask, temperature=temperature)

    def from_scores(
        self,
        pos: Tensor,
        neg: Tensor,
        neg_mask: Tensor | None = None,
        *,
        temperature: float | Tensor | None = None,
        batch_pos: Tensor | None = None,
        check: bool = True,
        index: Tensor | None = None,
    ) -> LossOutput:
        """Loss from scores ``pos (B,)``, ``neg (B, K)``, ``neg_mask (B, K)`` (True = valid).

        ``temperature``: τ of this call -- a float, or a 0-d tensor when it changes per step
        (ESS-scheduled, or learnt); the caller owns it (training: :mod:`smallbatch.training.temperature`)
        and a cell's τ is checked once, where the cell is made (config validation).  None:
        the loss's own learnt τ (a loss that owns its temperature), or 1 for a loss without
        τ (it sets only the reported InfoNCE).  ``batch_pos``: the positives of
        every anchor of the whole batch when ``pos`` holds only some of them (batch-level
        statistics such as DCLW's weights use it; default ``pos``).  ``check=False``:
        see :func:`prepare_scores`.  ``index``: the training step's dataset image index
        of every anchor, ``(V, N)`` with anchor ``v N + i`` a view of image
        ``index[v, i]``; a loss with per-image state (SogCLR) reads and updates its state
        there (:meth:`init_state`); the others ignore it.  Without it (diagnostics, tests)
        nothing is updated.
        """
        tau = self._tau(temperature)
        pos, neg, neg_mask = prepare_scores(pos, neg, neg_mask, check)
        bp = None if batch_pos is None else batch_pos.detach().to(pos.dtype)
        if index is None or not self.stateful:
            loss, value = self._reduce(pos, neg, neg_mask, tau, bp)
        else:
            loss_rows, value_rows = self._rows_at(pos, neg, neg_mask, tau, index)
            loss, value = loss_rows.mean(), value_rows.mean()
        with torch.no_grad():
            info = infonce_rows(pos.detach(), neg.detach(), neg_mask, tau.detach() if torch.is_tensor(tau) else tau)
        return LossOutput(loss=loss, value=value.detach(), infonce=info.mean())

    def _reduce(
        self, pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, batch_pos: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(loss, value)`` of the batch: the mean of :meth:`_rows` over anchors (a loss that
        is not a mean over anchors, ``per_anchor = False``, overrides this instead)."""
        loss_rows, value_rows = self._rows(pos, neg, neg_mask, tau, batch_pos)
        return loss_rows.mean(), value_rows.mean()

    def _rows(
        self, pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, batch_pos: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(loss_rows, value_rows)``, one entry per anchor (see :meth:`from_scores`)."""
        raise NotImplementedError

    def init_state(self, n_images: int, device: Any = None, dtype: torch.dtype = torch.float32) -> None:
        """Allocate the per-image state of a training set of ``n_images`` (stateless: nothing)."""

    def _rows_at(
        self, pos: Tensor, neg: Tensor, neg_mask: Tensor | None, tau: float | Tensor, index: Tensor
    ) -> tuple[Tensor, Tensor]:  # pragma: no cover - stateful losses override
        raise NotImplementedError
