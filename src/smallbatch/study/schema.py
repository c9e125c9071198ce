"""The config schema: the YAML file shared by Snakemake and the CLI, completed with the loss
registry's names and parameters and the data-set registry's names.  Its own module so that the config checks
(:mod:`smallbatch.study.config`) and the cell expansion (:mod:`smallbatch.study.cells`)
both read it without importing each other."""

from __future__ import annotations

import copy
import difflib
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..data.registry import all_specs as dataset_specs
from ..losses.registry import config_schema
from .experiments import experiment_schema
from .probe_registry import probe_params, probe_schema


def schema_path() -> Path:
    """Path of the JSON schema (YAML) shared by Snakemake and the CLI: package data
    (``smallbatch/resources/config.schema.yaml``), so a checkout and an installed wheel read the
    same file."""
    return Path(str(resources.files("smallbatch") / "resources" / "config.schema.yaml"))


_SCHEMA_CACHE: dict[str, Any] = {}


def load_schema() -> dict:
    """The config schema: the YAML file plus the loss names and parameters of
    ``smallbatch.losses.registry.SPECS`` (filled into the keys marked ``x-loss-*``) and the
    probes of ``smallbatch.study.probe_registry.SPECS`` (their names into the key marked
    ``x-probe-names``, their own settings into the section marked ``x-probe-params``) and the side
    experiments of ``smallbatch.study.experiments.SPECS`` (into the key marked ``x-side-experiments``)
    and the data sets of ``smallbatch.data.registry.SPECS`` (their names into the key marked
    ``x-dataset-names``)."""
    path = schema_path()
    key = str(path)
    if key not in _SCHEMA_CACHE:
        with open(path) as fh:
            _SCHEMA_CACHE[key] = _with_losses(yaml.safe_load(fh))
    return copy.deepcopy(_SCHEMA_CACHE[key])


def _with_losses(schema: dict) -> dict:
    parts = config_schema()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("x-loss-names"):
                node["enum"] = list(parts["names"])
            if node.get("x-dataset-names"):
                node["enum"] = list(dataset_specs())
            if node.get("x-loss-params"):
                node["properties"] = copy.deepcopy(parts["loss_params"])
            if node.get("x-loss-entry"):
                node["properties"].update(copy.deepcopy(parts["entry_params"]))
            if node.get("x-probe-names"):
                node.update(probe_schema(node.get("description", "")))
            if node.get("x-probe-params"):
                node["properties"].update(probe_params())
            if node.get("x-side-experiments"):
                own = node["properties"]  # an experiment that is no grid: its own node, the registry's description
                node["properties"] = {n: {**own.get(n, {}), **sch} for n, sch in experiment_schema().items()}
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


#: the largest integer a key without its own maximum takes (int32: what every library's
#: sizes and counts take without overflow); larger ones are refused before any job
INT_MAX = 2**31 - 1


def validator_with_defaults(fill: bool = True):
    """The config's validator: JSON Schema 2020-12 where an integer is an integer (``8.0`` is a
    float: it would pass the schema and break reshape), every number is finite, every integer
    without a ``maximum`` is at most :data:`INT_MAX`, and (``fill``) the schema's defaults are
    filled in."""
    from jsonschema import Draft202012Validator, ValidationError, validators

    base_props = Draft202012Validator.VALIDATORS["properties"]
    base_type = Draft202012Validator.VALIDATORS["type"]

    def finite_numbers(validator, types, instance, schema):
        # JSON Schema has no "finite": YAML's .nan / .inf pass every bound (nan > 0 is False
        # both ways), so a number must also be finite; infinite only where its schema says
        # so (x-infinite: DCLW's sigma = inf is DCL)
        yield from base_type(validator, types, instance, schema)
        nonfinite = isinstance(instance, float) and not math.isfinite(instance)
        if nonfinite and (math.isnan(instance) or not schema.get("x-infinite")):
            yield ValidationError(f"{instance!r} is not a finite number", validator="finite")
        if _integer(None, instance) and abs(instance) > INT_MAX and "maximum" not in schema:
            yield ValidationError(f"{instance!r} is too large", validator="maximum", validator_value=INT_MAX)

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for prop, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and prop not in instance:
                    instance[prop] = copy.deepcopy(sub["default"])
        yield from base_props(validator, properties, instance, schema)

    def additional_with_defaults(validator, aP, instance, schema):
        # Fill defaults of free-form mappings such as ``datasets: {name: {...}}``.
        if isinstance(instance, dict) and isinstance(aP, dict) and "properties" in aP:
            known = set(schema.get("properties", {}))
            for key, value in instance.items():
                if key not in known and isinstance(value, dict):
                    for prop, sub in aP["properties"].items():
                        if isinstance(sub, dict) and "default" in sub and prop not in value:
                            value[prop] = copy.deepcopy(sub["default"])
        yield from Draft202012Validator.VALIDATORS["additionalProperties"](validator, aP, instance, schema)

    checks = {"type": finite_numbers}
    if fill:
        checks.update(properties=set_defaults, additionalProperties=additional_with_defaults)
    return validators.extend(
        Draft202012Validator, checks, type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _integer)
    )


def _integer(checker, instance) -> bool:
    """JSON Schema's integer, without the floats that happen to be whole (``8.0``)."""
    return isinstance(instance, int) and not isinstance(instance, bool)


def _path_str(path) -> str:
    parts: list[str] = []
    for p in path:
        parts.append(f"[{p}]" if isinstance(p, int) else (("." if parts else "") + str(p)))
    return "".join(parts) or "<top level>"


def _flat(err) -> list:
    """Every sub-error under ``err`` (its alternatives', recursively)."""
    out, stack = [], list(err.context or [])
    while stack:
        sub = stack.pop()
        stack.extend(sub.context or [])
        out.append(sub)
    return out


def _allowed_keys(schema: dict) -> list[str]:
    return sorted(schema.get("properties", {}))


def one_line(err, root_schema: dict, label: str | None = None, what: str = "config key") -> str:
    """Turn a jsonschema ValidationError into one readable line naming the key (or ``label``,
    e.g. a command-line flag, for a value checked on its own); ``what`` names what a key is
    (a cell file's: "key")."""
    where = _path_str(err.absolute_path)
    name = label or f"{what} '{where}'"
    v = err.validator
    if v == "additionalProperties":
        allowed = _allowed_keys(err.schema)
        extra = [k for k in err.instance if k not in allowed] if isinstance(err.instance, dict) else []
        bad = extra[0] if extra else "?"
        full = f"{where}.{bad}" if where != "<top level>" else bad
        hint = difflib.get_close_matches(str(bad), allowed, n=1)
        sugg = f" (did you mean '{hint[0]}'?)" if hint else ""
        return f"unknown {what} '{full}'{sugg}; allowed keys here: {', '.join(allowed) or 'none'}"
    if v == "propertyNames":
        allowed = err.schema.get("propertyNames", {}).get("enum", [])
        return f"unknown name under '{where}': {err.instance!r}; allowed: {', '.join(allowed)}"
    if v == "enum" and "propertyNames" in list(err.schema_path):
        return f"unknown name {err.instance!r} under '{where}'; allowed: {', '.join(map(str, err.validator_value))}"
    if v == "enum":
        return f"{name} = {err.instance!r} is not allowed; allowed values: {', '.join(map(str, err.validator_value))}"
    if v in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[v]
        return f"{name} = {err.instance!r} is out of range; it must be {op} {err.validator_value}"
    if v == "finite":
        return f"{name} = {err.instance!r} is not a finite number"
    if v == "type":
        return f"{name} = {err.instance!r} has the wrong type; expected {err.validator_value}"
    if v == "anyOf":
        # Report the most specific sub-error: the deepest (a loss entry's parameter of the wrong
        # type, not "the entry is no loss name"), at one depth a bound or name before a type
        best = None
        for sub in _flat(err):
            if sub.validator == "anyOf" or (
                sub.validator == "type" and len(sub.absolute_path) <= len(err.absolute_path)
            ):
                continue
            rank = (len(sub.absolute_path), sub.validator != "type")
            if best is None or rank > (len(best.absolute_path), best.validator != "type"):
                best = sub
        if best is not None and best.validator == "type":  # every type its alternatives take there
            types = [
                t
                for sub in reversed(_flat(err))  # in the order the schema gives them
                if sub.validator == "type" and sub.absolute_path == best.absolute_path
                for t in ([sub.validator_value] if isinstance(sub.validator_value, str) else sub.validator_value)
            ]
            sub_name = label or f"{what} '{_path_str(best.absolute_path)}'"
            return f"{sub_name} = {best.instance!r} has the wrong type; expected {' or '.join(dict.fromkeys(types))}"
        if best is not None:
            return one_line(best, root_schema, label, what)
        return f"{name} = {err.instance!r} is not valid: {err.message.splitlines()[0]}"
    if v in ("minItems", "minProperties"):
        if err.validator_value > 1:
            return f"{name} = {err.instance!r} has {len(err.instance)}; it needs at least {err.validator_value}"
        return f"{name} must not be empty"
    if v == "uniqueItems":
        return f"{name} = {err.instance!r} holds a value twice; give each once"
    if v == "required":
        return f"{name} is missing {err.message.split(' is a required')[0]}"
    return f"{name}: {err.message.splitlines()[0]}"
