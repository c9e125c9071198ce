"""Losses from installed packages (entry points of the group ``smallbatch.losses``) join the
registry like built-ins, and ``smallbatch check-loss`` checks the contract of any loss.

The entry points here are made in the test (``importlib.metadata.EntryPoint`` objects naming
this module's specs); the installed package, found by ``importlib.metadata`` itself, is the
slow test of the wheel's venv."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from smallbatch.losses import registry
from smallbatch.losses.registry import LossSpec


def _infonce_reference(z1, z2, temperature, weight=1.0):
    """InfoNCE over the 2N views, written out: every view an anchor, its other view the positive,
    the 2N - 2 other views its negatives; scaled by ``weight``."""
    import torch

    n = z1.shape[0]
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    s = z @ z.T / temperature
    s.fill_diagonal_(float("-inf"))
    positive = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    rows = torch.logsumexp(s, dim=1) - s[torch.arange(2 * n), positive]
    return weight * float(rows.mean())


def _spec(name: str, **kw) -> LossSpec:
    return LossSpec(name=name, display=name.title(), paper="a test", impl=f"{__name__}:impl_{name}", **kw)


WEIGHT = {"weight": {"type": "number", "exclusiveMinimum": 0, "default": 2.0, "description": "scales the loss"}}
#: the good plugin: InfoNCE times a weight, with its written-out reference
TOY = _spec("toy", params=WEIGHT, aliases=("toy_alias",), reference=_infonce_reference)
#: one loss per broken property of the contract (the property is the loss's name after "broken_")
BROKEN = {
    "shape": _spec("broken_shape"),
    "gradient": _spec("broken_gradient"),
    "temperature": _spec("broken_temperature"),
    "order": _spec("broken_order"),
    "reference": _spec("broken_reference", reference=lambda z1, z2, t: _infonce_reference(z1, z2, t) + 1e-3),
}
NOT_A_SPEC = {"name": "fake"}


ROOT = Path(__file__).resolve().parents[2]
#: the one line a broken plugin installed as the package "broken-plug" is refused with
BROKEN_LINE = (
    "loss plugin 'bad' (smallbatch.losses entry point 'nosuchmodule.spec:SPEC' of package 'broken-plug') "
    "does not load: ModuleNotFoundError: No module named 'nosuchmodule'"
)


def _entry(name: str, attr: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"{__name__}:{attr}", group=registry.PLUGIN_GROUP)


@pytest.fixture
def plugins(monkeypatch):
    """The toy plugin and the broken ones installed (as entry points), and their classes."""
    from smallbatch.losses import InfoNCE
    from smallbatch.study import schema as schema_mod

    entries = [_entry("toy", "TOY"), *(_entry(s.name, f"BROKEN_{k.upper()}") for k, s in BROKEN.items())]
    for key, spec in BROKEN.items():
        monkeypatch.setitem(globals(), f"BROKEN_{key.upper()}", spec)
    monkeypatch.setattr(registry, "plugin_specs", lambda: registry.load_plugins(entries))
    monkeypatch.setattr(schema_mod, "_SCHEMA_CACHE", {})

    class Toy(InfoNCE, spec="toy"):
        def _rows(self, *args):
            loss, value = super()._rows(*args)
            return self.weight * loss, self.weight * value

    class BrokenShape(InfoNCE, spec="broken_shape"):
        def _reduce(self, *args):  # the rows, not their mean
            return self._rows(*args)

    class BrokenGradient(InfoNCE, spec="broken_gradient"):
        def _reduce(self, *args):  # the value, but a loss that trains nothing
            loss, value = super()._reduce(*args)
            return loss.detach() * 0 + loss * 0, value

    class BrokenTemperature(InfoNCE, spec="broken_temperature"):
        def _rows(self, pos, neg, mask, tau, batch_pos):  # declared to use τ, computed at τ = 1
            return super()._rows(pos, neg, mask, 1.0, batch_pos)

    class BrokenOrder(InfoNCE, spec="broken_order"):
        def _reduce(self, *args):  # the first anchor counted twice
            loss, value = self._rows(*args)
            return (loss.mean() + loss[0]) / 2, (value.mean() + value[0]) / 2

    classes = {"toy": Toy, "broken_shape": BrokenShape, "broken_gradient": BrokenGradient}
    classes |= {"broken_temperature": BrokenTemperature, "broken_order": BrokenOrder}
    classes["broken_reference"] = type("BrokenReference", (InfoNCE,), {}, spec="broken_reference")
    for name, cls in classes.items():
        monkeypatch.setitem(globals(), f"impl_{name}", cls)  # where each spec's impl names it
    return classes


# --------------------------------------------------------------------------- the registry
def test_a_plugin_loss_is_named_validated_planned_and_built_like_a_built_in(plugins):
    from smallbatch.losses import build_loss, display_name
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import ConfigError, reference_markdown, validate_config

    study = {"datasets": {"digits": {}}, "grid": {"batch_sizes": [16], "temperatures": [0.1], "seeds": [0]}}
    cfg = validate_config({**study, "grid": {**study["grid"], "losses": ["infonce", {"name": "toy", "weight": 3}]}})
    assert set(expand_cells(cfg)) == {"digits/infonce/bs16-t0.1-s0", "digits/toy-weight3/bs16-t0.1-s0"}
    assert cfg["loss_params"]["toy"] == {"weight": 2.0}  # its declared default, as a built-in's
    with pytest.raises(ConfigError, match="weight"):  # its declared bounds
        validate_config({**study, "grid": {**study["grid"], "losses": [{"name": "toy", "weight": -1}]}})
    with pytest.raises(ConfigError, match="toy_alia"):  # a near miss is told the plugin's names
        validate_config({**study, "grid": {**study["grid"], "losses": ["toy_alis"]}})
    loss = build_loss("toy_alias")
    assert type(loss) is plugins["toy"] and loss.weight == 2.0 and display_name("toy") == "Toy"
    assert "scales the loss" in reference_markdown()  # CONFIGURATION.md documents its parameter
    assert registry.loss_rank("infonce") < registry.loss_rank("byol") < registry.loss_rank("toy")  # plugins after


def test_a_config_cannot_name_a_module_path_as_its_loss(plugins):
    from smallbatch.study.config import ConfigError, validate_config

    study = {"datasets": {"digits": {}}, "grid": {"losses": [f"{__name__}:TOY"], "batch_sizes": [16]}}
    with pytest.raises(ConfigError, match="not allowed|unknown"):
        validate_config(study)


@pytest.mark.parametrize(
    ("name", "attr", "says"),
    [
        ("infonce", "TOY", "names the spec of 'toy'"),  # the entry point's name is its spec's
        ("toy", "NOT_A_SPEC", "names a dict, not a smallbatch.losses.registry.LossSpec"),
        ("toy", "NO_SUCH_NAME", "does not load: AttributeError"),
    ],
)
def test_a_broken_plugin_entry_point_is_one_line_naming_it(name, attr, says):
    with pytest.raises(ValueError, match=f"^loss plugin '{name}' .*{says}") as err:
        registry.load_plugins([_entry(name, attr)])
    assert "\n" not in str(err.value)


@pytest.fixture
def broken_install(tmp_path) -> dict:
    """An environment in which the package "broken-plug" is installed (its metadata on the path)
    and declares a loss whose module does not exist."""
    info = tmp_path / "site" / "broken_plug-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[smallbatch.losses]\nbad = nosuchmodule.spec:SPEC\n")
    path = os.pathsep.join([str(ROOT / "src"), str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_a_broken_installed_plugin_stops_a_command_in_one_line(broken_install):
    argv = [sys.executable, "-m", "smallbatch", "cells", "--config", str(ROOT / "config.yaml")]
    proc = subprocess.run(argv, env=broken_install, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (2, f"smallbatch: error: {BROKEN_LINE}\n")


@pytest.mark.slow
def test_a_broken_installed_plugin_stops_the_workflow_in_one_line(broken_install, tmp_path):
    argv = [sys.executable, "-m", "snakemake", "-n", "--snakefile", str(ROOT / "Snakefile"), "-d", str(tmp_path)]
    argv += ["--configfile", str(ROOT / "config.yaml"), "--config", f"results_dir={tmp_path / 'results'}"]
    proc = subprocess.run(argv, env=broken_install, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"config error: {BROKEN_LINE}\n" in out and "registry.py" not in out, out[-3000:]  # no traceback into ours


@pytest.mark.parametrize("shadow", ["infonce", "ntxent"])
def test_a_plugin_may_not_take_a_built_in_name_or_alias(monkeypatch, shadow):
    monkeypatch.setitem(globals(), "SHADOW", _spec("mine", aliases=(shadow,)))
    with pytest.raises(ValueError, match=f"the name '{shadow}' is taken by a built-in loss; rename the plugin's loss"):
        registry.load_plugins([_entry("mine", "SHADOW")])


@pytest.mark.parametrize("name", ["Mine", "my-loss", "my/loss", "9lives"])
def test_a_plugin_name_a_cell_id_cannot_hold_is_refused(monkeypatch, name):
    monkeypatch.setitem(globals(), "ODD", _spec(name))
    with pytest.raises(ValueError, match=f"the name '{name}' is not lower-case letters, digits and _"):
        registry.load_plugins([_entry(name, "ODD")])


def test_two_plugins_may_not_share_a_name(monkeypatch):
    monkeypatch.setitem(globals(), "SHADOW", _spec("mine", aliases=("toy",)))
    with pytest.raises(ValueError, match="the name 'toy' is taken by the plugin 'mine'"):
        registry.load_plugins([_entry("toy", "TOY"), _entry("mine", "SHADOW")])


# --------------------------------------------------------------------------- the contract
@pytest.mark.parametrize("name", list(registry.SPECS))
def test_every_built_in_loss_keeps_the_contract(name):
    from smallbatch.losses.contract import contract_problems

    assert contract_problems(name) == []


def test_a_plugin_that_keeps_the_contract_passes_check_loss_with_its_reference(plugins, capsys):
    from smallbatch.pipeline.cli import main

    assert main(["check-loss", "toy"]) == 0
    assert capsys.readouterr().out == (
        "toy: keeps the contract (build, shape, finite, gradient, temperature, order, reference)\n"
    )


@pytest.mark.parametrize("prop", list(BROKEN))
def test_check_loss_names_the_broken_property(plugins, capsys, prop):
    from smallbatch.pipeline.cli import main

    assert main(["check-loss", f"broken_{prop}"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines[0].startswith(f"broken_{prop}: {prop}: "), lines
    if prop != "shape":  # a vector where a scalar is due breaks every later check's reading too
        assert len(lines) == 1, lines
