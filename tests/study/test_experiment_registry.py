"""The side-experiment registry (:mod:`smallbatch.study.experiments`): the schema, the cell
expansion, the report's sections and ``snakemake --report``'s captions all take a side
experiment from its one entry there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from smallbatch.report.captions import caption_of, captions, labels
from smallbatch.study import experiments as reg

REPO = Path(__file__).resolve().parents[2]
GOLDEN_TABLES = REPO / "tests" / "fixtures" / "report_golden" / "tables"


def test_the_schema_has_one_section_key_per_registered_experiment():
    from smallbatch.study.schema import load_schema

    props = load_schema()["properties"]["experiments"]["properties"]
    # mi: the Gaussian benchmark, an entry that is no grid of cells (its own job and schema)
    assert list(props) == [
        *("precision", "ksweep", "ess", "tsweep", "regime", "lrsweep", "kcurve", "instrument"),
        *("mi", "critical_batch"),
    ]
    assert list(reg.SPECS) == [*props]
    assert reg.SIDE_EXPERIMENTS == ("precision", "ksweep", "ess", "tsweep", "regime", "lrsweep", "kcurve", "instrument")
    assert [n for n, s in reg.SPECS.items() if not s.grid] == ["mi", "critical_batch"]
    for spec in reg.SPECS.values():
        if spec.grid:
            assert props[spec.name] == {"$ref": "#/$defs/section", "description": spec.description}
        else:
            assert props[spec.name]["description"] == spec.description


def test_enabling_a_registered_experiment_expands_its_cells_tagged_with_its_name():
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    for spec in (s for s in reg.SPECS.values() if s.grid):
        section = {"enabled": True, "losses": ["infonce"], "batch_sizes": [16, 32], "temperatures": [0.1, 0.5]}
        section |= {"seeds": [0], "axes": {"lr": [1e-3, 2e-3], "queue_size": [0, 64]}}  # what each sweeps
        cfg = load_config([REPO / "config.yaml"], {"grid": {"enabled": False}, "experiments": {spec.name: section}})
        cells = expand_cells(cfg)
        assert cells and {c["experiment"] for c in cells.values()} == {spec.name}, spec.name
        assert all(cid.startswith(f"{spec.name}/") for cid in cells), spec.name


def test_the_report_runs_each_registered_section_where_the_registry_places_it():
    import smallbatch.report as report

    names = [m.__name__.rsplit(".", 1)[1] for m in report.SECTION_MODULES]
    # index.md's order, written out: the instrument with the main results, the others after the papers
    assert names == [
        "grid",
        "representation",
        "instrument",
        "baselines",
        "diverged",
        "papers",
        "precision",
        "ksweep",
        "ess",
        "tsweep",
        "regime",
        "lrsweep",
        "kcurve",
        "mi",
        "cost",
    ]
    reported = [spec for spec in reg.SPECS.values() if spec.section is not None]
    assert [spec.name for spec in reg.SPECS.values() if spec.section is None] == ["critical_batch"]  # its own job
    for spec in reported:
        assert spec.section in names, spec.name
        assert (names.index(spec.section) < names.index("baselines")) == spec.main, spec.name
    side = [s.section for s in reported if not s.main]
    assert [n for n in names if n in side] == side  # in the registry's order


#: the file-name prefixes snakemake --report captions, written out (the registry's and the
#: report's own): a prefix misspelt in either leaves its files without a caption
CAPTIONED = {
    "tables": [
        "baselines",
        "cost_",
        "diverged_runs",
        "ess",
        "grid_dependence_",
        "grid_gain_",
        "grid_pooled_",
        "grid_temperature_",
        "grid_top1_",
        "instrument",
        "kcurve",
        "ksweep",
        "lrsweep",
        "mi_",
        "papers_reported",
        "papers_vs_ours_gap",
        "precision_",
        "regime_",
        "representation_",
        "tsweep",
    ],
    "figures": [
        "accuracy_vs_batch_",
        "accuracy_vs_images_",
        "ess_",
        "ess_",
        "ess_schedule_",
        "instrument_arms",
        "instrument_contrasts",
        "instrument_curves",
        "kcurve",
        "ksweep",
        "lrsweep",
        "mi_estimate_vs_true",
        "mi_fraction_",
        "mi_small_k",
        "precision_grad_error_",
        "precision_top1_",
        "qb_",
        "regime_grad_ratio_",
        "regime_top1_",
        "regime_update_size_",
        "representation_",
        "tsweep",
    ],
}


def test_every_registered_caption_reaches_snakemake_report_and_the_longest_prefix_wins():
    for kind in ("tables", "figures"):
        pairs = captions(kind)
        assert sorted(p for p, _ in pairs) == CAPTIONED[kind], kind
        assert [len(p) for p, _ in pairs] == sorted((len(p) for p, _ in pairs), reverse=True)
        for spec in reg.SPECS.values():
            for prefix, text in getattr(spec, kind):
                assert [prefix, text] in pairs, (spec.name, prefix)
    assert caption_of("ess_schedule_digits", "figures").startswith("FlatNCE's ESS-scheduled temperature")
    assert caption_of("ess_digits", "figures").startswith("Effective sample size")
    assert caption_of("precision_top1_digits", "figures").startswith("Side experiment (floating-point precision)")
    assert caption_of("regime_grad_ratio_digits", "figures").startswith("Side experiment (regime): the gradient")
    assert caption_of("instrument_contrasts", "figures").startswith("The instrument's claimed contrasts")
    assert caption_of("lrsweep_rates", "tables").startswith("Side experiment (learning-rate sweep)")
    assert caption_of("no_such_table", "tables") == ""
    with pytest.raises(ValueError, match="'tables' or 'figures'"):
        captions("plots")


def test_snakemake_report_labels_are_each_captions_first_sentence_cut_outside_parentheses():
    assert labels("grid_top1_digits_knn", "tables") == {
        "caption": "Top-1 accuracy per loss and batch size: mean ± sd over seeds",
        "file": "grid_top1_digits_knn.csv",
    }
    # longer than 100 characters: cut at the last comma or colon outside parentheses, none left open
    assert labels("qb_digits", "figures")["caption"] == (
        "q_B per batch size (diag/qb_mean over the second half of training, all seeds) …"
    )
    assert labels("tsweep", "figures")["caption"] == "Side experiment (temperature sweep, SimCLR Table 5's analogue) …"
    assert labels("no_such_figure", "figures") == {"caption": "no_such_figure", "file": "no_such_figure.png"}
    for kind in ("tables", "figures"):
        for prefix, _ in captions(kind):
            head = labels(prefix + "x", kind)["caption"]
            assert len(head) <= 102 and head.count("(") == head.count(")"), head


def test_every_table_of_the_golden_report_has_a_caption():
    stems = sorted(p.stem for p in GOLDEN_TABLES.glob("*.csv"))
    assert len(stems) > 20
    assert [s for s in stems if not caption_of(s, "tables")] == []


def test_an_unknown_experiment_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown side experiment 'nope'; known: precision, ksweep"):
        reg.experiment_spec("nope")
    assert reg.experiment_spec("instrument").main


def test_the_registry_and_the_captions_load_no_torch():
    code = "import sys, smallbatch.study.experiments, smallbatch.report.captions; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
