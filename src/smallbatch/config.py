"""Load and validate a study configuration (``config.yaml``).

The schema lives in ``workflow/schemas/config.schema.yaml`` (the Snakemake
convention); this module validates against the same file, fills the schema's
defaults, and turns the first schema violation into a one-line error that names
the offending key and the allowed values, so a typo stops the study before any
job runs.
"""

from __future__ import annotations

import copy
import difflib
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming the key."""


def schema_path() -> Path:
    """Path of the JSON schema (YAML) shared by Snakemake and the CLI."""
    here = Path(__file__).resolve()
    # Source checkout (editable install): <repo>/src/smallbatch/config.py
    for parent in here.parents:
        cand = parent / "workflow" / "schemas" / "config.schema.yaml"
        if cand.is_file():
            return cand
    # Installed wheel: the schema is shipped as package data.
    res = resources.files("smallbatch") / "resources" / "config.schema.yaml"
    return Path(str(res))


_SCHEMA_CACHE: dict[str, Any] = {}


def load_schema() -> dict:
    """The config schema: the YAML file plus the loss names and parameters of
    ``smallbatch.losses.REGISTRY`` (filled into the keys marked ``x-loss-*``)."""
    path = schema_path()
    key = str(path)
    if key not in _SCHEMA_CACHE:
        with open(path) as fh:
            _SCHEMA_CACHE[key] = _with_losses(yaml.safe_load(fh))
    return copy.deepcopy(_SCHEMA_CACHE[key])


def _with_losses(schema: dict) -> dict:
    from .losses import config_schema

    parts = config_schema()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("x-loss-names"):
                node["enum"] = list(parts["names"])
            if node.get("x-loss-params"):
                node["properties"] = copy.deepcopy(parts["loss_params"])
            if node.get("x-loss-entry"):
                node["properties"].update(copy.deepcopy(parts["entry_params"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


def _validator_with_defaults():
    from jsonschema import Draft202012Validator, validators

    base_props = Draft202012Validator.VALIDATORS["properties"]

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
        yield from Draft202012Validator.VALIDATORS["additionalProperties"](
            validator, aP, instance, schema
        )

    return validators.extend(
        Draft202012Validator,
        {"properties": set_defaults, "additionalProperties": additional_with_defaults},
    )


def _path_str(path) -> str:
    parts = []
    for p in path:
        parts.append(f"[{p}]" if isinstance(p, int) else (("." if parts else "") + str(p)))
    return "".join(parts) or "<top level>"


def _allowed_keys(schema: dict) -> list[str]:
    return sorted(schema.get("properties", {}))


def _one_line(err, root_schema: dict) -> str:
    """Turn a jsonschema ValidationError into one readable line naming the key."""
    where = _path_str(err.absolute_path)
    v = err.validator
    if v == "additionalProperties":
        allowed = _allowed_keys(err.schema)
        extra = [k for k in err.instance if k not in allowed] if isinstance(err.instance, dict) else []
        bad = extra[0] if extra else "?"
        full = f"{where}.{bad}" if where != "<top level>" else bad
        hint = difflib.get_close_matches(str(bad), allowed, n=1)
        sugg = f" (did you mean '{hint[0]}'?)" if hint else ""
        return f"unknown config key '{full}'{sugg}; allowed keys here: {', '.join(allowed)}"
    if v == "propertyNames":
        allowed = err.schema.get("propertyNames", {}).get("enum", [])
        return f"unknown name under '{where}': {err.instance!r}; allowed: {', '.join(allowed)}"
    if v == "enum" and "propertyNames" in list(err.schema_path):
        return f"unknown name {err.instance!r} under '{where}'; allowed: {', '.join(map(str, err.validator_value))}"
    if v == "enum":
        return f"config key '{where}' = {err.instance!r} is not allowed; allowed values: {', '.join(map(str, err.validator_value))}"
    if v in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[v]
        return f"config key '{where}' = {err.instance!r} is out of range; it must be {op} {err.validator_value}"
    if v == "type":
        return f"config key '{where}' = {err.instance!r} has the wrong type; expected {err.validator_value}"
    if v == "anyOf":
        # Report the most specific sub-error (e.g. an unknown loss name).
        best = None
        stack = list(err.context or [])
        while stack:
            sub = stack.pop()
            stack.extend(sub.context or [])
            if sub.validator in ("anyOf", "type"):
                continue
            if best is None or len(sub.absolute_path) > len(best.absolute_path):
                best = sub
        if best is not None:
            return _one_line(best, root_schema)
        return f"config key '{where}' = {err.instance!r} is not valid: {err.message.splitlines()[0]}"
    if v in ("minItems", "minProperties"):
        return f"config key '{where}' must not be empty"
    if v == "required":
        return f"config key '{where}' is missing {err.message.split(' is a required')[0]}"
    return f"config key '{where}': {err.message.splitlines()[0]}"


def validate_config(cfg: dict) -> dict:
    """Validate ``cfg`` in place against the schema, fill defaults, return it.

    Raises :class:`ConfigError` with one line naming the first offending key.
    """
    from jsonschema import exceptions

    schema = load_schema()
    cls = _validator_with_defaults()
    validator = cls(schema)
    errors = list(validator.iter_errors(cfg))
    if errors:
        err = exceptions.best_match(errors, key=lambda e: (-len(e.absolute_path),))
        # best_match prefers shallow errors; we want the deepest (most specific) one.
        deepest = max(errors, key=lambda e: len(e.absolute_path))
        raise ConfigError(_one_line(deepest if deepest is not None else err, schema))
    _check_semantics(cfg)
    return cfg


def _check_semantics(cfg: dict) -> None:
    """Checks the schema cannot express."""
    for name, sec in cfg.get("experiments", {}).items():
        if name == "mi" or not isinstance(sec, dict):
            continue
        tr = sec.get("train", {}) or {}
        known = set(load_schema()["properties"]["train"]["properties"])
        for k in tr:
            if k not in known:
                hint = difflib.get_close_matches(k, sorted(known), n=1)
                sugg = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise ConfigError(f"unknown config key 'experiments.{name}.train.{k}'{sugg}; allowed: {', '.join(sorted(known))}")
        for ds in sec.get("datasets", []) or []:
            if ds not in cfg.get("datasets", {}):
                raise ConfigError(f"config key 'experiments.{name}.datasets' names {ds!r}, which is not under 'datasets' ({', '.join(cfg.get('datasets', {}))})")
    from . import augment as _aug  # light module (torch only)

    try:
        _aug.AugmentConfig(**cfg.get("augment", {}))
    except TypeError as exc:
        import re

        fields = sorted(_aug.AugmentConfig.__dataclass_fields__)
        m = re.search(r"argument '(\w+)'", str(exc))
        bad = m.group(1) if m else "?"
        raise ConfigError(f"unknown config key 'augment.{bad}'; allowed keys here: {', '.join(fields)}") from None
    except ValueError as exc:
        raise ConfigError(f"config key 'augment': {exc}") from None


_DATA_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python", "stl10": "stl10_binary"}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def check_data_roots(cfg: dict) -> None:
    """Every data set of a validated study has its files under its root (or
    ``data.download`` is on); otherwise a one-line ConfigError naming the key.
    The workflow calls this so a wrong root stops ``snakemake -n``, before any job."""
    if cfg["data"].get("download"):
        return
    for name, opts in cfg["datasets"].items():
        if name == "digits":  # ships inside scikit-learn
            continue
        key = f"datasets.{name}.root" if opts.get("root") else "data.root"
        root = Path(opts.get("root") or cfg["data"]["root"]).expanduser()
        if name == "fashion_mnist":
            ok = (root / "FashionMNIST" / "raw").is_dir() or DEBIAN_FASHION_MNIST.is_dir()
            need = f"{root}/FashionMNIST/raw/ or {DEBIAN_FASHION_MNIST}/ (apt-get install dataset-fashion-mnist)"
        elif name == "imagefolder":
            ok = (root / "train").is_dir()
            need = f"{root}/train/<class>/<image> and {root}/val/<class>/<image>"
        else:
            ok = (root / _DATA_DIRS[name]).is_dir()
            need = f"{root}/{_DATA_DIRS[name]}/"
        if not ok:
            raise ConfigError(f"config key '{key}' = '{root}': no {name} files there (expected {need}); "
                              "fix the root or set data.download: true")


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> dict:
    """Read YAML ``path`` (or an empty config), apply ``overrides``, validate."""
    cfg: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        with open(p) as fh:
            try:
                cfg = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                first = str(exc).splitlines()[0]
                raise ConfigError(f"config file {p} is not valid YAML: {first}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    if overrides:
        cfg = deep_merge(cfg, overrides)
    return validate_config(cfg)


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve_tracking_uri(cfg: dict) -> str:
    """config ``tracking_uri`` > ``$MLFLOW_TRACKING_URI`` > SQLite under results_dir."""
    uri = cfg.get("tracking_uri")
    if uri:
        return str(uri)
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    db = Path(cfg.get("results_dir", "results")).resolve() / "mlflow.db"
    return f"sqlite:///{db}"
