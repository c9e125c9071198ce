"""Probes from installed packages (entry points of the group ``smallbatch.probes``) join the
registry: ``eval.probes`` names them, a cell that runs one carries (and hashes) its own settings,
and installing one moves no other cell's hash.

The entry points here are made in the test (``importlib.metadata.EntryPoint`` objects naming this
module's specs); the installed package, found by ``importlib.metadata`` itself, runs its probe in
a cell through the workflow in the wheel's venv (``tests/test_wheel.py``)."""

from __future__ import annotations

import dataclasses
from importlib.metadata import EntryPoint

import numpy as np
import pytest

from smallbatch.errors import PluginError
from smallbatch.study import probe_registry as reg
from smallbatch.study.probe_registry import ProbeSpec


def run_centroid(features, settings):
    """Nearest class mean of the training features, top-1 as a fraction (the step logs it in percent;
    ``centroid_norm``: L2-normalised first)."""
    xtr, ytr, xte, yte = (np.asarray(f, dtype=np.float64) for f in features)
    if settings["centroid_norm"]:
        xtr, xte = (x / np.linalg.norm(x, axis=1, keepdims=True) for x in (xtr, xte))
    classes = np.unique(ytr)
    means = np.stack([xtr[ytr == c].mean(axis=0) for c in classes])
    guess = classes[np.argmin(((xte[:, None, :] - means[None]) ** 2).sum(-1), axis=1)]
    return {"top1": float(np.mean(guess == yte))}


NORM = {"type": "boolean", "default": True, "description": "centroid: L2-normalise the features first"}
CENTROID = ProbeSpec(
    name="centroid",
    title="nearest class mean",
    impl=f"{__name__}:run_centroid",
    metric="top1",
    label="centroid top-1",
    settings=("centroid_norm",),
    params={"centroid_norm": NORM},
)
NOT_A_SPEC = object()
DEFAULT_ON = dataclasses.replace(CENTROID, default=True)
RELATIVE = dataclasses.replace(CENTROID, impl=".knn:run_probe")
CLASHING = dataclasses.replace(CENTROID, settings=("knn_t",), params={"knn_t": NORM})
BUILT_IN_NAME = dataclasses.replace(CENTROID, name="kmeans")


def _ep(name: str, attr: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"{__name__}:{attr}", group=reg.PLUGIN_GROUP)


@pytest.mark.parametrize(
    ("name", "attr", "says"),
    [
        ("centroid", "NOT_A_SPEC", "names a object, not a smallbatch.study.probe_registry.ProbeSpec"),
        ("nearest", "CENTROID", "names the spec of 'centroid'; name the entry point as its spec"),
        ("kmeans", "BUILT_IN_NAME", "the name 'kmeans' is taken by a built-in probe"),
        ("centroid", "DEFAULT_ON", "a plugin's probe is opt-in (eval.probes names it)"),
        ("centroid", "RELATIVE", "its impl '.knn:run_probe' is relative"),
        ("centroid", "CLASHING", "its own setting eval.knn_t is the probe 'knn''s"),
        ("centroid", "NO_SUCH_ATTRIBUTE", "does not load: AttributeError"),
    ],
)
def test_a_probe_plugin_that_cannot_join_is_refused_in_one_line(name, attr, says):
    with pytest.raises(PluginError) as err:
        reg.load_plugins([_ep(name, attr)])
    message = str(err.value)
    assert "\n" not in message and says in message, message
    assert message.startswith(f"probe plugin {name!r} (smallbatch.probes entry point '{__name__}:{attr}' of ")


def _cells(tmp_path, **eval_section):
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import validate_config

    grid = {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.1], "seeds": [0]}
    cfg = {"study": "s", "results_dir": str(tmp_path), "baselines": False, "datasets": {"digits": {}}, "grid": grid}
    return expand_cells(validate_config({**cfg, "eval": {"knn_k": [5], **eval_section}}))


@pytest.fixture
def install(monkeypatch):
    """``install()``: the centroid plugin installed from here on (the schema read anew)."""
    from smallbatch.study import schema as schema_mod

    monkeypatch.setattr(schema_mod, "_SCHEMA_CACHE", {})

    def install():
        monkeypatch.setattr(reg, "plugins", lambda: reg.load_plugins([_ep("centroid", "CENTROID")]))
        monkeypatch.setattr(schema_mod, "_SCHEMA_CACHE", {})

    return install


def test_installing_a_probe_moves_no_hash_and_a_cell_that_runs_it_carries_its_settings(install, tmp_path):
    from smallbatch.study.cell import Cell

    before = {cid: c["hash"] for cid, c in _cells(tmp_path).items()}
    install()
    assert {cid: c["hash"] for cid, c in _cells(tmp_path).items()} == before
    (cell,) = _cells(tmp_path, probes=["knn", "centroid"], centroid_norm=False).values()
    assert cell["eval"]["centroid_norm"] is False and cell["hash"] not in before.values()
    settings = Cell.of(cell).eval
    assert settings.probes == ("knn", "centroid") and settings.setting("centroid_norm") is False
    features = ([[0.0, 1.0], [0.0, 2.0], [3.0, 0.0]], [0, 0, 1], [[0.0, 5.0], [4.0, 0.5]], [0, 1])
    assert reg.probe_function("centroid")(features, {"centroid_norm": True}) == {"top1": 1.0}


def test_a_probe_plugin_s_name_is_known_to_eval_probes_only_once_installed(install, tmp_path):
    from smallbatch.study.config import ConfigError

    with pytest.raises(ConfigError, match="unknown probe 'centroid'"):
        _cells(tmp_path, probes=["knn", "centroid"])
    install()
    assert reg.probe_names() == ("knn", "linear", "kmeans", "centroid")
    assert _cells(tmp_path, probes=["centroid"])
