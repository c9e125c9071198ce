"""The config schema: the YAML file shared by Snakemake and the CLI, completed with the loss
registry's names and parameters.  Its own module so that the config checks
(:mod:`smallbatch.pipeline.config`) and the cell expansion (:mod:`smallbatch.pipeline.cells`)
both read it without importing each other."""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def schema_path() -> Path:
    """Path of the JSON schema (YAML) shared by Snakemake and the CLI: package data
    (``smallbatch/resources/config.schema.yaml``), so a checkout and an installed wheel read the
    same file."""
    return Path(str(resources.files("smallbatch") / "resources" / "config.schema.yaml"))


_SCHEMA_CACHE: dict[str, Any] = {}


def load_schema() -> dict:
    """The config schema: the YAML file plus the loss names and parameters of
    ``smallbatch.losses.registry.SPECS`` (filled into the keys marked ``x-loss-*``)."""
    path = schema_path()
    key = str(path)
    if key not in _SCHEMA_CACHE:
        with open(path) as fh:
            _SCHEMA_CACHE[key] = _with_losses(yaml.safe_load(fh))
    return copy.deepcopy(_SCHEMA_CACHE[key])


def _with_losses(schema: dict) -> dict:
    from ..losses.registry import config_schema

    parts = config_schema()
    # a loss parameter may be infinite where its loss allows it (DCLW's sigma = inf is
    # DCL); the loss's own check decides (_check_cells), not the finite-number rule
    for node in [*parts["loss_params"].values(), *parts["entry_params"].values()]:
        for sub in [*node.get("properties", {}).values(), *node.get("anyOf", [])]:
            (sub.get("items") or sub)["x-loss-param"] = True

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
