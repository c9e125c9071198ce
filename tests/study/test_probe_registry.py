"""The probe registry (:mod:`smallbatch.study.probe_registry`): what derives from it, the check of
``eval.probes``, and that naming a probe loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from smallbatch.study import probe_registry as reg


def test_the_default_probes_are_the_ones_every_study_ran():
    assert reg.DEFAULT_PROBES == ("knn", "linear")
    assert reg.report_metrics() == {"knn": "knn/top1", "linear": "linear/top1"}
    assert reg.report_labels()["knn"] == "kNN top-1" and reg.report_labels()["linear"] == "linear top-1"
    assert [reg.probe_spec(p).file for p in reg.probe_names()] == ["knn.json", "linear.json", "kmeans.json"]


#: every probe of the registry, written out (not read from it): name -> (metric, label, the
#: eval settings it reads, those a probe command overrides, sets torch's threads, chance level
#: marks a cell collapsed, run by default, the default of each setting of its own)
PROBE_TABLE = {
    "knn": (
        "top1",
        "kNN top-1",
        ("knn_k", "knn_t", "knn_primary_k"),
        ("knn_k", "knn_t"),
        False,
        True,
        True,
        {"knn_primary_k": None},
    ),
    "linear": (
        "top1",
        "linear top-1",
        (
            "linear_iterations",
            "linear_lr",
            "linear_weight_decay",
            "linear_optimizer",
            "linear_batch_size",
            "linear_tol",
            "linear_weight_decays",
            "linear_val_fraction",
            "fewshot_fractions",
            "fewshot_draws",
        ),
        ("linear_iterations", "linear_weight_decay", "linear_weight_decays", "linear_optimizer"),
        True,
        False,
        True,
        {},
    ),
    "kmeans": (
        "nmi",
        "k-means NMI",
        ("kmeans_iterations",),
        ("kmeans_iterations",),
        True,
        False,
        False,
        {"kmeans_iterations": 50},
    ),
}


def test_every_probes_registry_entry_is_the_one_written_out_here():
    """The registry's probes, in its order, with what each reads, logs and how the report
    treats it: a flag flipped by mistake (a collapsed cell no longer marked) fails here."""
    fields = ("metric", "label", "settings", "flags", "threads", "chance_collapses", "default")
    assert list(reg.SPECS) == list(PROBE_TABLE)
    for name, spec in reg.SPECS.items():
        *expected, params = PROBE_TABLE[name]
        assert {f: getattr(spec, f) for f in fields} == dict(zip(fields, expected)), name
        assert {k: sch["default"] for k, sch in spec.params.items()} == params, name


def test_the_report_the_cli_and_the_schema_read_the_registry():
    from smallbatch.pipeline.cli_parser import build_parser
    from smallbatch.report.runs import METRIC_LABELS, METRICS
    from smallbatch.study.schema import load_schema

    assert reg.report_metrics() == METRICS and reg.report_labels() == METRIC_LABELS
    ev = load_schema()["properties"]["eval"]["properties"]
    assert ev["probes"]["default"] == list(reg.DEFAULT_PROBES)
    for name, spec in reg.SPECS.items():
        assert set(spec.settings) <= set(ev), name  # every setting a probe reads is a config key
        args = build_parser().parse_args([name, "--cell-id", "x"])
        assert args.func == "cmd_probe" and args.probe == name


@pytest.mark.parametrize(
    "names, words",
    [
        (["knn", "nope"], "unknown probe 'nope'; known probes: knn, linear, kmeans"),
        (["knn", "knn"], "names a probe twice"),
        ([], "eval.probes is empty"),
    ],
)
def test_a_bad_probe_list_is_one_line_naming_the_known_ones(names, words):
    assert words in reg.probes_problem(names)
    from smallbatch.study.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.probes") as e:
        load_config(None, {"datasets": {"digits": {}}, "eval": {"probes": names}})
    assert "\n" not in str(e.value)


def test_an_opt_in_probe_keeps_the_default_cells_hash():
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    def hashes(ev):
        cfg = load_config(None, {"datasets": {"digits": {}}, "grid": {"seeds": [0]}, "eval": ev})
        return {c: v["hash"] for c, v in expand_cells(cfg).items()}

    assert hashes({}) == hashes({"probes": ["knn", "linear"]})
    assert hashes({}) != hashes({"probes": ["knn", "linear", "kmeans"]})  # more results: another cell


def test_an_unknown_probe_and_a_bad_spec_are_refused():
    with pytest.raises(ValueError, match="unknown probe 'x'; known probes"):
        reg.probe_spec("x")
    with pytest.raises(ValueError, match="flags"):
        reg.ProbeSpec("p", "t", ".m:f", "m", "l", settings=("a",), flags=("b",))
    with pytest.raises(ValueError, match="params"):
        reg.ProbeSpec("p", "t", ".m:f", "m", "l", settings=("a",), params={"b": {"type": "integer"}})


def test_a_probes_own_setting_is_a_config_key_and_a_cell_setting_from_the_registry_alone():
    from smallbatch.study.cell import EvalSettings
    from smallbatch.study.config import ConfigError, load_config

    cfg = load_config(None, {"datasets": {"digits": {}}, "eval": {"kmeans_iterations": 7}})
    assert cfg["eval"]["kmeans_iterations"] == 7
    assert EvalSettings.from_dict(cfg["eval"]).setting("kmeans_iterations") == 7
    assert EvalSettings.from_dict(cfg["eval"]).setting("knn_t") == cfg["eval"]["knn_t"]
    with pytest.raises(ConfigError, match="kmeans_iterations"):
        load_config(None, {"datasets": {"digits": {}}, "eval": {"kmeans_iterations": 0}})


def test_each_probe_function_loads_and_the_registry_loads_no_torch():
    assert all(callable(reg.probe_function(n)) for n in reg.SPECS)
    code = "import sys, smallbatch.study.probe_registry as r; r.report_metrics(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
