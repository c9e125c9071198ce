"""The side-experiment registry (:mod:`smallbatch.experiments`): the schema, the cell
expansion, the report's sections and ``snakemake --report``'s captions all take a side
experiment from its one entry there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from smallbatch import experiments as reg
from smallbatch.report.captions import caption_of, captions

REPO = Path(__file__).resolve().parents[2]
GOLDEN_TABLES = REPO / "tests" / "fixtures" / "report_golden" / "tables"


def test_the_schema_has_one_section_key_per_registered_experiment():
    from smallbatch.pipeline.schema import load_schema

    props = load_schema()["properties"]["experiments"]["properties"]
    assert list(props) == [*reg.SIDE_EXPERIMENTS, "mi"]  # mi: the Gaussian benchmark, not a grid of cells
    for spec in reg.SPECS:
        assert props[spec.name] == {"$ref": "#/$defs/section", "description": spec.description}


def test_enabling_a_registered_experiment_expands_its_cells_tagged_with_its_name():
    from smallbatch.pipeline.cells import expand_cells
    from smallbatch.pipeline.config import load_config

    for spec in reg.SPECS:
        section = {"enabled": True, "losses": ["infonce"], "batch_sizes": [16, 32], "temperatures": [0.1, 0.5]}
        section |= {"seeds": [0], "axes": {"lr": [1e-3, 2e-3], "queue_size": [0, 64]}}  # what each sweeps
        cfg = load_config([REPO / "config.yaml"], {"grid": {"enabled": False}, "experiments": {spec.name: section}})
        cells = expand_cells(cfg)
        assert cells and {c["experiment"] for c in cells.values()} == {spec.name}, spec.name
        assert all(cid.startswith(f"{spec.name}/") for cid in cells), spec.name


def test_the_report_runs_each_registered_section_where_the_registry_places_it():
    import smallbatch.report as report

    names = [m.__name__.rsplit(".", 1)[1] for m in report.SECTION_MODULES]
    assert len(names) == len(set(names))
    for spec in reg.SPECS:
        assert spec.section in names, spec.name
        assert (names.index(spec.section) < names.index("baselines")) == spec.main, spec.name
    side = [s.section for s in reg.SPECS if not s.main]
    assert [n for n in names if n in side] == side  # in the registry's order


def test_every_registered_caption_reaches_snakemake_report_and_the_longest_prefix_wins():
    for kind in ("tables", "figures"):
        pairs = captions(kind)
        assert [len(p) for p, _ in pairs] == sorted((len(p) for p, _ in pairs), reverse=True)
        for spec in reg.SPECS:
            for prefix, text in getattr(spec, kind):
                assert [prefix, text] in pairs, (spec.name, prefix)
    assert caption_of("ess_schedule_digits", "figures").startswith("FlatNCE's ESS-scheduled temperature")
    assert caption_of("ess_digits", "figures").startswith("Effective sample size")
    assert caption_of("no_such_table", "tables") == ""
    with pytest.raises(ValueError, match="'tables' or 'figures'"):
        captions("plots")


def test_every_table_of_the_golden_report_has_a_caption():
    stems = sorted(p.stem for p in GOLDEN_TABLES.glob("*.csv"))
    assert len(stems) > 20
    assert [s for s in stems if not caption_of(s, "tables")] == []


def test_an_unknown_experiment_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown side experiment 'nope'; known: precision, ksweep"):
        reg.experiment_spec("nope")
    assert reg.experiment_spec("instrument").main


def test_the_registry_and_the_captions_load_no_torch():
    code = "import sys, smallbatch.experiments, smallbatch.report.captions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
