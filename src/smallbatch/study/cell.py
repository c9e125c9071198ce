"""A cell as a frozen, typed value: :class:`Cell` (a study cell) or :class:`BaselineCell`, with
their training settings :class:`TrainSettings` and probe settings :class:`EvalSettings`.

A cell is made once, from the validated config, by :func:`smallbatch.study.cells.make_cell`
(a JSON object: the workflow passes it to each job, its hash names its config).  Its JSON
stays the canonical form -- :meth:`Cell.to_json` gives back exactly the text it was made
from, so hashes and ``cell.json`` files do not change -- and the typed fields are read from
it once, so a module reads ``cell.train.queue_size``, not ``cell["train"]["queue_size"]``: a
misspelt setting is an AttributeError where it is written, and the fields say which
settings exist.  :func:`read_cell` types either kind; only :mod:`smallbatch.study.cells`
(which makes the JSON) and this module read a cell by its string keys.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ..io import json_text
from .probe_registry import DEFAULT_PROBES, param_defaults


@dataclass(frozen=True)
class TrainSettings:
    """The ``train`` section of a cell (CONFIGURATION.md documents each key)."""

    backbone: str
    width: int
    proj_hidden: int
    proj_dim: int
    pool_grid: int
    optimizer: str
    lr: float
    lr_scaling: str
    momentum: float
    weight_decay: float
    epochs: float
    steps: int | None
    warmup_epochs: float
    precision: str
    queue_size: int
    moco_momentum: float
    grad_error_every: int
    log_every: int
    compile: bool
    tf32: bool
    devices: int
    sync_bn: bool
    chunk_size: int | None
    deterministic: bool
    neg_group: int | None = None
    bn_group: int | None = None
    mask_same_class: bool = False
    extra_negatives: int | None = None
    lr_schedule: str = "cosine"
    adam_beta2: float = 0.999
    beta2_scaling: str = "none"
    ema_scaling: str = "none"
    snapshot_epochs: tuple[float, ...] | None = None
    ess_schedule: Mapping[str, Any] | None = None
    regime: Any = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSettings:
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class EvalSettings:
    """The ``eval`` section of a cell: the probes' settings (CONFIGURATION.md documents each key)."""

    knn_k: tuple[int, ...]
    knn_t: float
    linear_optimizer: str
    linear_tol: float
    linear_iterations: int
    linear_lr: float | None
    linear_weight_decay: float
    linear_batch_size: int | None
    linear_weight_decays: tuple[float, ...] | None
    linear_val_fraction: float
    fewshot_fractions: tuple[float, ...]
    fewshot_draws: int
    batch_size: int
    monitor_every: int | None = None
    #: the probes the evaluate step runs (:mod:`smallbatch.study.probe_registry`)
    probes: tuple[str, ...] = DEFAULT_PROBES
    #: the probes' own settings (``params`` of the registry), read by :meth:`setting`
    probe_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EvalSettings:
        own = {k: _frozen(d.get(k, v)) for k, v in param_defaults(d.get("probes", DEFAULT_PROBES)).items()}
        return cls(**_known(cls, d), probe_params=MappingProxyType(own))

    def setting(self, key: str) -> Any:
        """The value of ``eval.<key>``: a field, or a probe's own setting."""
        if key in self.probe_params:
            return self.probe_params[key]
        return getattr(self, key)


@dataclass(frozen=True, kw_only=True)
class _CellBase:
    """What every cell has: its name and hash, its data, the network's training settings, the
    probes' settings and where it runs.  Its JSON stays the canonical form (``to_json``)."""

    id: str
    hash: str
    format: int
    experiment: str
    dataset: str
    dataset_options: Mapping[str, Any]
    data_root: str
    download: bool
    data_digest: str
    seed: int
    train: TrainSettings
    eval: EvalSettings
    device: str
    threads: int
    tracking: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    _json: str = field(default="", repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """The cell of a JSON object made by :mod:`smallbatch.study.cells` (keys beyond the
        fields are kept in its JSON, not as fields)."""
        values = {k: v for k, v in _known(cls, d).items() if k not in ("_json", "train", "eval")}
        train, ev = TrainSettings.from_dict(d["train"]), EvalSettings.from_dict(d["eval"])
        return cls(**values, train=train, eval=ev, _json=json_text(dict(d)))

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))

    def to_json(self) -> str:
        """The text the cell was made from (``io.json_text`` layout): the same bytes, the same hash."""
        return self._json

    def to_dict(self) -> dict[str, Any]:
        """A fresh, mutable JSON object of the cell (e.g. for a checkpoint's ``cell`` entry)."""
        return copy.deepcopy(json.loads(self._json))

    def replaced(self, **changes: Any):
        """The same cell with top-level JSON entries replaced (an execution setting such as
        ``threads``, or a probe's ``eval`` for a look that is not logged); the hash is kept."""
        return type(self).from_dict({**self.to_dict(), **changes})


@dataclass(frozen=True, kw_only=True)
class Cell(_CellBase):
    """One cell: dataset x loss (+ parameters) x batch size x temperature x seed (x axes)."""

    loss: str
    loss_params: Mapping[str, Any]
    batch_size: int
    temperature: float
    negatives: int
    augment: Mapping[str, Any]

    @classmethod
    def of(cls, cell: Cell | Mapping[str, Any]) -> Cell:
        """``cell`` as a Cell (a JSON object is read once)."""
        return cell if isinstance(cell, Cell) else cls.from_dict(cell)


@dataclass(frozen=True, kw_only=True)
class BaselineCell(_CellBase):
    """A baseline (``baselines/<dataset>/<kind>``): raw pixels, a random-init encoder, or the
    supervised upper bound -- no loss or τ; the supervised one has augmentations and a batch size."""

    baseline: str
    augment: Mapping[str, Any] | None = None
    batch_size: int | None = None

    @classmethod
    def of(cls, cell: Cell | BaselineCell | Mapping[str, Any]) -> BaselineCell:
        """``cell`` as a BaselineCell (a JSON object is read once); ValueError for a study cell."""
        typed = read_cell(cell)
        if not isinstance(typed, BaselineCell):
            raise ValueError(f"cell {typed.id} is not a baseline (it names no 'baseline')")
        return typed


def snapshot_name(epochs: float) -> str:
    """The name of the budget of ``epochs`` (``train.snapshot_epochs``): ``ep0.3125``, ``ep5``."""
    return f"ep{float(epochs):g}"


def snapshot_steps(epochs: float, steps_per_epoch: int) -> int:
    """The optimiser steps of a budget of ``epochs`` (fractions allowed): ``epochs x steps per
    epoch`` rounded half up, at least 1."""
    return max(1, int(float(epochs) * steps_per_epoch + 0.5))


def budget_steps(cell: Cell, steps_per_epoch: int) -> int:
    """The optimiser steps of the cell's budget: ``train.steps``, else its epochs' steps
    (at least 1)."""
    tr = cell.train
    return int(tr.steps) if tr.steps else max(1, math.ceil(float(tr.epochs) * steps_per_epoch))


def snapshot_names(cell: Cell) -> list[str]:
    """The names of a cell's snapshot budgets, in its order (none without ``train.snapshot_epochs``)."""
    return [snapshot_name(e) for e in cell.train.snapshot_epochs or ()]


def read_cell(cell: Cell | BaselineCell | Mapping[str, Any]) -> Cell | BaselineCell:
    """``cell`` typed: a Cell, or a BaselineCell when its JSON names a ``baseline``."""
    if isinstance(cell, _CellBase):
        return cell
    return (BaselineCell if "baseline" in cell else Cell).from_dict(cell)


def _known(cls, d: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``d`` that are fields of the dataclass ``cls``, read-only (:func:`_frozen`)."""
    known = {f.name for f in fields(cls)}
    return {k: _frozen(v) for k, v in d.items() if k in known}


def _frozen(v: Any) -> Any:
    """A read-only view of a JSON value (mappings become MappingProxyType, lists tuples)."""
    if isinstance(v, Mapping):
        return MappingProxyType({k: _frozen(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    return v
