"""Data sets from installed packages (entry points of the group ``smallbatch.datasets``) join the
registry like built-ins: the config's schema and checks know them, a cell's hash holds their own
digest, and their reader is what the data loader reads.

The entry points here are made in the test (``importlib.metadata.EntryPoint`` objects naming this
module's plugins); the installed package, found by ``importlib.metadata`` itself, is the slow test
of the wheel's venv (``tests/test_wheel.py``)."""

from __future__ import annotations

import hashlib
from importlib.metadata import EntryPoint

import numpy as np
import pytest

from smallbatch.data import registry
from smallbatch.data.registry import DatasetPlugin, DatasetSpec
from smallbatch.errors import PluginError

N_TRAIN, N_TEST = 96, 32


def _images(n: int, offset: int) -> np.ndarray:
    """Stripes whose row is the class: a data set any reader of it can check by eye."""
    x = np.zeros((n, 8, 8), dtype=np.uint8)
    for i in range(n):
        x[i, (i + offset) % 4 * 2, :] = 255
    return x


def _read(spec, root, download, image_size):
    return {
        "train_x": _images(N_TRAIN, 0),
        "train_y": np.arange(N_TRAIN) % 4,
        "test_x": _images(N_TEST, 0),
        "test_y": np.arange(N_TEST) % 4,
        "channels_last": False,
        "num_classes": 4,
        "classes": ["a", "b", "c", "d"],
        "source": "stripes",
    }


def _digest(root):
    return "sha256:" + hashlib.sha256(_images(N_TRAIN, 0).tobytes()).hexdigest()[:16]


def _plugin(name: str = "stripes", **kw) -> DatasetPlugin:
    spec = DatasetSpec(
        **{
            "name": name,
            "display": "Stripes",
            "reader": name,
            "sizes": {"train": N_TRAIN, "test": N_TEST},
            "classes": 4,
            **kw,
        }
    )
    return DatasetPlugin(spec=spec, read=_read, digest=_digest)


STRIPES = _plugin()
NOT_A_PLUGIN = object()
NAMED_OTHERWISE = _plugin("other")
BUILT_IN_NAME = _plugin("digits")
BAD_NAME = _plugin("Stripes-2")
BORROWED_READER = DatasetPlugin(
    spec=DatasetSpec(name="borrowed", display="B", reader="sklearn_digits", sizes={"train": 1, "test": 1}),
    read=_read,
    digest=_digest,
)


def _ep(name: str, attr: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"{__name__}:{attr}", group=registry.PLUGIN_GROUP)


@pytest.mark.parametrize(
    ("name", "attr", "says"),
    [
        ("stripes", "NOT_A_PLUGIN", "names a object, not a smallbatch.data.registry.DatasetPlugin"),
        ("stripes", "NAMED_OTHERWISE", "names the spec of 'other'; name the entry point as its spec"),
        ("digits", "BUILT_IN_NAME", "the name 'digits' is a built-in data set's"),
        ("Stripes-2", "BAD_NAME", "is not lower-case letters, digits and _"),
        ("borrowed", "BORROWED_READER", "its spec's reader is 'sklearn_digits': give its own name"),
        ("gone", "NO_SUCH_ATTRIBUTE", "does not load: AttributeError"),
    ],
)
def test_a_plugin_that_cannot_join_is_refused_in_one_line_naming_its_entry_point(name, attr, says):
    with pytest.raises(PluginError) as err:
        registry.load_plugins([_ep(name, attr)])
    message = str(err.value)
    assert "\n" not in message and says in message, message
    assert message.startswith(f"data-set plugin {name!r} (smallbatch.datasets entry point '{__name__}:{attr}' of ")


@pytest.fixture
def stripes(monkeypatch):
    """The stripes plugin installed: the registry reads it from an entry point."""
    from smallbatch.study import schema as schema_mod

    monkeypatch.setattr(registry, "plugins", lambda: registry.load_plugins([_ep("stripes", "STRIPES")]))
    monkeypatch.setattr(schema_mod, "_SCHEMA_CACHE", {})
    return STRIPES


def test_a_plugin_data_set_is_validated_planned_digested_and_read_like_a_built_in(stripes, tmp_path):
    from smallbatch.data.load import load_dataset
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import ConfigError, validate_config

    assert list(registry.all_specs())[-1] == "stripes" and registry.dataset_spec("stripes") is stripes.spec
    base = {"study": "s", "results_dir": str(tmp_path / "r"), "baselines": False}
    grid = {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.1], "seeds": [0]}
    cfg = validate_config({**base, "datasets": {"stripes": {}}, "grid": grid, "eval": {"knn_k": [5]}})
    (cell,) = expand_cells(cfg).values()
    assert cell["data_digest"] == _digest(None)  # the plugin's own digest names its data in the hash
    with pytest.raises(ConfigError, match="train_subset. = 97 is larger than the 96 train images of stripes"):
        validate_config({**base, "datasets": {"stripes": {"train_subset": 97}}, "grid": grid, "eval": {"knn_k": [5]}})
    data = load_dataset("stripes", root=tmp_path, image_size=None)
    assert data.train_x.shape[0] == N_TRAIN and data.num_classes == 4
    assert data.meta["data_digest"] == _digest(None)


def test_a_plugin_whose_digest_is_no_token_stops_the_plan_in_one_line(monkeypatch, tmp_path):
    from smallbatch.data.digest import data_digest

    bad = DatasetPlugin(spec=STRIPES.spec, read=_read, digest=lambda root: "two words")
    monkeypatch.setattr(registry, "plugins", lambda: {"stripes": bad})
    with pytest.raises(
        ValueError, match=r"data-set plugin 'stripes': its digest of .* is 'two words', not one short token"
    ):
        data_digest("stripes", tmp_path)
