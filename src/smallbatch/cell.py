"""A cell as a frozen, typed value: :class:`Cell` and its training settings :class:`TrainSettings`.

A cell is made once, from the validated config, by :func:`smallbatch.pipeline.cells.make_cell`
(a JSON object: the workflow passes it to each job, its hash names its config).  Its JSON
stays the canonical form -- :meth:`Cell.to_json` gives back exactly the text it was made
from, so hashes and ``cell.json`` files do not change -- and the typed fields are read from
it once, so a module reads ``cell.train.queue_size``, not ``cell["train"]["queue_size"]``: a
misspelt setting is an AttributeError where it is written, and the fields say which
settings exist.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from .io import json_text


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
    ess_schedule: Mapping[str, Any] | None = None
    regime: Any = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSettings:
        known = {f.name for f in fields(cls)}
        return cls(**{k: _frozen(v) for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Cell:
    """One cell: dataset x loss (+ parameters) x batch size x temperature x seed (x axes)."""

    id: str
    hash: str
    experiment: str
    dataset: str
    dataset_options: Mapping[str, Any]
    data_root: str
    download: bool
    loss: str
    loss_params: Mapping[str, Any]
    batch_size: int
    temperature: float
    seed: int
    negatives: int
    train: TrainSettings
    augment: Mapping[str, Any]
    eval: Mapping[str, Any]
    device: str
    threads: int
    tracking: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    _json: str = field(default="", repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cell:
        """The cell of a JSON object made by ``make_cell`` (keys beyond the fields are kept in
        its JSON, not as fields)."""
        known = {f.name for f in fields(cls)} - {"_json", "train"}
        values = {k: _frozen(v) for k, v in d.items() if k in known}
        return cls(**values, train=TrainSettings.from_dict(d["train"]), _json=json_text(dict(d)))

    @classmethod
    def from_json(cls, text: str) -> Cell:
        return cls.from_dict(json.loads(text))

    @classmethod
    def of(cls, cell: Cell | Mapping[str, Any]) -> Cell:
        """``cell`` as a Cell (a JSON object is read once)."""
        return cell if isinstance(cell, Cell) else cls.from_dict(cell)

    @staticmethod
    def train_of(cell: Cell | Mapping[str, Any]) -> TrainSettings:
        """The training settings of a cell, or of a baseline cell (no loss, τ or batch size:
        not a Cell, but its network is built from the same settings)."""
        return cell.train if isinstance(cell, Cell) else TrainSettings.from_dict(cell["train"])

    def to_json(self) -> str:
        """The text the cell was made from (``io.json_text`` layout): the same bytes, the same hash."""
        return self._json

    def to_dict(self) -> dict[str, Any]:
        """A fresh, mutable JSON object of the cell (e.g. for a checkpoint's ``cell`` entry)."""
        return copy.deepcopy(json.loads(self._json))


def _frozen(v: Any) -> Any:
    """A read-only view of a JSON value (mappings become MappingProxyType, lists tuples)."""
    if isinstance(v, Mapping):
        return MappingProxyType({k: _frozen(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    return v
