"""A cell read from a file or the command line, checked whole before it is typed.

A cell's JSON (``cell.json``, ``--cell-json``) may have been edited by hand.  Before it
becomes a :class:`~smallbatch.study.cell.Cell` it must be a cell in every part: every key a cell
of its kind has and no other (:func:`cell_schema`: the config schema's own nodes for
``train``, ``eval``, the data set's options, ``tracking``, seeds, threads and device, every
key required), its derived values its settings' (``negatives``), its hash the hash of its
settings and id, then the checks a config's cells get (:func:`cell_problem`).  The
first problem is one line naming the source and the key.

:func:`cell_problem` is the one check of a typed cell, for the config's cells and a cell file
alike: its ``train`` settings against the schema (an axis, a side experiment or a batch-size
entry may have set them), then every check of :mod:`smallbatch.study.checks`.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import MISSING, fields

from ..io import text_problem
from ..tracking import format_problem
from . import checks
from .cell import BaselineCell, Cell
from .cells import cell_negatives
from .schema import load_schema, one_line, schema_path, validator_with_defaults

BASELINE_KINDS = ("raw_pixels", "random_init", "supervised")


def _required(node: dict) -> dict:
    """``node`` (an object's schema) with every one of its properties required."""
    return {**node, "required": sorted(node.get("properties", {}))}


def _field_names(cls, with_defaults: bool) -> list[str]:
    return [
        f.name
        for f in fields(cls)
        if not f.name.startswith("_") and (with_defaults or (f.default is MISSING and f.default_factory is MISSING))
    ]


@functools.lru_cache(maxsize=2)
def cell_schema(baseline: bool) -> dict:
    """The JSON schema of a study cell (or a baseline cell): its keys are the fields of
    :class:`~smallbatch.study.cell.Cell` (:class:`~smallbatch.study.cell.BaselineCell`), each typed by the
    config schema's node for it where the config has one."""
    root = load_schema()
    props, defs = root["properties"], root["$defs"]
    keys = {
        "id": {"type": "string"},
        "hash": {"type": "string"},
        "format": {"type": "integer"},
        "experiment": {"type": "string"},
        "dataset": {"type": "string", "enum": props["datasets"]["propertyNames"]["enum"]},
        "dataset_options": _required(props["datasets"]["additionalProperties"]),
        "data_root": {"type": "string"},
        "download": {"type": "boolean"},
        "data_digest": {"type": "string"},
        "seed": defs["seeds"]["items"],
        "train": _required(props["train"]),
        "eval": _required(props["eval"]),
        "device": props["device"],
        "threads": props["threads"],
        "tracking": props["tracking"],
        "augment": {"type": "object"},
        "batch_size": {"type": "integer"},  # its bound: smallbatch.study.checks, as a config's cell
    }
    if baseline:
        keys["baseline"] = {"type": "string", "enum": list(BASELINE_KINDS)}
    else:
        keys.update(
            loss={"$ref": "#/$defs/loss_name"},
            loss_params={"type": "object"},
            temperature={"type": "number"},  # its range: smallbatch.study.checks, as a config's cell
            negatives={"type": "integer", "minimum": 0},  # 0: a method without negatives
        )
    cls = BaselineCell if baseline else Cell
    return {
        "type": "object",
        "properties": {k: keys[k] for k in _field_names(cls, True)},
        "required": _field_names(cls, False),
        "additionalProperties": False,
        "$defs": defs,
    }


def cell_json_problem(obj: dict, baseline: bool) -> str | None:
    """The first problem of a cell's JSON object (see the module docstring), one line without
    its source, or None; the hash is checked by the caller, after this."""

    schema = cell_schema(baseline)
    errors = list(validator_with_defaults(fill=False)(schema).iter_errors(obj))
    missing = [e for e in errors if e.validator == "required"]
    # a cell of another smallbatch: refused by its format, whatever else it lacks; a file that
    # lacks more than the format is no cell of any
    if "format" in obj or [n for e in missing for n in _absent(e)] == ["format"]:
        stale = format_problem("", obj.get("format"), "write it again with `smallbatch cells --write`")
        if stale:
            return stale.lstrip()
    if missing:
        keys = [_dotted(e.absolute_path, name) for e in missing for name in _absent(e)]
        kind = "baseline cell" if baseline else "cell"
        more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
        return f"lacks the key {keys[0]!r} of a {kind}{more}; write it with `smallbatch cells --write`"
    if errors:
        err = max(errors, key=lambda e: len(e.absolute_path))
        return one_line(err, schema, what="key")
    text = text_problem(obj["data_root"])  # the rule of text, as for the config's data.root
    if text:
        return f"key 'data_root' {text}"
    if not baseline:
        return _loss_params_problem(obj) or _derived_problem(obj)
    if obj["baseline"] == "supervised" and obj.get("batch_size") is None:
        return "a supervised baseline lacks its batch_size; write it with `smallbatch cells --write`"
    return None


def _absent(err) -> list[str]:
    return [k for k in err.validator_value if isinstance(err.instance, dict) and k not in err.instance]


def _dotted(path, name: str) -> str:
    return ".".join([*(str(p) for p in path), name])


def _loss_params_problem(obj: dict) -> str | None:
    """The cell's loss parameters against its loss's schema (the registry's)."""

    node = load_schema()["properties"]["loss_params"]["properties"][obj["loss"]]
    wrapped = {"type": "object", "properties": {"loss_params": node}}
    errors = list(validator_with_defaults(fill=False)(wrapped).iter_errors({"loss_params": obj["loss_params"]}))
    return one_line(errors[0], wrapped, what="key") if errors else None


def _derived_problem(obj: dict) -> str | None:
    """A value a cell derives from its settings that is not theirs (``negatives``: K)."""
    k = cell_negatives(obj["train"], obj["batch_size"], obj["loss"])
    if obj["negatives"] != k:
        return (
            f"key 'negatives' = {obj['negatives']!r} is not the K of its settings ({k}: batch size, "
            "train.neg_group, train.queue_size, train.extra_negatives); write it with `smallbatch cells --write`"
        )
    return None


def cell_problem(cell: Cell) -> str | None:
    """The first problem of a typed cell, one line without its source:
    its ``train`` settings against the schema, then :func:`smallbatch.study.checks.any_problem`."""
    return train_problem(cell.to_dict()["train"]) or checks.any_problem(cell)


def train_problem(train: dict) -> str | None:
    """One line naming the first wrong key or value of a cell's ``train`` settings."""

    validator, node = _train_validator(str(schema_path()))
    errors = sorted(validator.iter_errors({"train": copy.deepcopy(train)}), key=lambda e: -len(e.absolute_path))
    return one_line(errors[0], node) if errors else None


@functools.lru_cache(maxsize=4)
def _train_validator(path: str):
    """The validator of a ``{train: ...}`` object and its schema, built once per schema file (a
    full study checks every one of its ~1,400 cells with it)."""

    schema = load_schema()
    node = {"type": "object", "properties": {"train": schema["properties"]["train"]}, "$defs": schema["$defs"]}
    return validator_with_defaults()(node), node
