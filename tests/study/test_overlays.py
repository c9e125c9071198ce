"""Config files laid one over another (``smallbatch.study.config.load_config``): key by key,
the keys a file's ``replace:`` names taken as written, the CLI's repeated ``--config`` in order,
a notice when an overlay is given alone, and the README's overlay example planning exactly the
cells it states.  (That ``snakemake --configfile A B`` plans what ``smallbatch cells`` lists:
tests/test_workflow.py.)"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from smallbatch.pipeline import cli
from smallbatch.study.cells import baseline_cells, expand_cells
from smallbatch.study.config import ConfigError, load_config, validate_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config.yaml"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def cells_listed(capsys, *configs: Path, baselines: bool = False) -> tuple[list[str], str]:
    """(the ids `smallbatch cells --config A --config B ...` prints, its stderr)."""
    argv = ["cells", *itertools.chain.from_iterable(("--config", str(c)) for c in configs)]
    rc = cli.main(argv + (["--baselines"] if baselines else []))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [line.split("\t")[0] for line in out.splitlines()], err


# --------------------------------------------------------------------------- replace
def test_replace_takes_the_overlays_data_sets_alone_where_a_merge_keeps_the_earlier_ones(tmp_path):
    merged = write(tmp_path, "merged.yaml", "datasets: {digits: {}}\n")
    replaced = write(tmp_path, "replaced.yaml", "replace: [datasets]\ndatasets: {digits: {}}\n")
    assert list(load_config([CONFIG, merged])["datasets"]) == ["fashion_mnist", "digits"]
    cfg = load_config([CONFIG, replaced])
    assert list(cfg["datasets"]) == ["digits"]
    assert {c["dataset"] for c in expand_cells(cfg).values()} == {"digits"}


def test_replace_takes_a_list_key_as_written_and_keeps_its_siblings(tmp_path):
    over = write(tmp_path, "o.yaml", "replace: [grid.losses]\ngrid: {losses: [dcl]}\n")
    base = load_config(CONFIG)
    cfg = load_config([CONFIG, over])
    assert [e if isinstance(e, str) else e["name"] for e in cfg["grid"]["losses"]] == ["dcl"]
    assert cfg["grid"]["batch_sizes"] == base["grid"]["batch_sizes"] == [16, 32, 64, 256]
    assert {c["loss"] for c in expand_cells(cfg).values()} == {"dcl"}


def test_replace_takes_a_section_as_written_so_its_other_keys_are_the_defaults(tmp_path):
    over = write(tmp_path, "o.yaml", "replace: [train]\ntrain: {epochs: 1}\n")
    cfg, base, default = load_config([CONFIG, over]), load_config(CONFIG), validate_config({})
    assert base["train"]["pool_grid"] == 4 != default["train"]["pool_grid"]  # config.yaml's own
    assert cfg["train"] == {**default["train"], "epochs": 1}


def test_a_replaced_key_the_overlay_leaves_out_takes_its_default(tmp_path):
    over = write(tmp_path, "o.yaml", "replace: [experiments, grid.seeds]\n")
    assert load_config(CONFIG)["experiments"]["mi"]["enabled"] is True
    cfg, default = load_config([CONFIG, over]), validate_config({})
    assert not any(sec.get("enabled") for sec in cfg["experiments"].values())
    assert cfg["grid"]["seeds"] == default["grid"]["seeds"]


@pytest.mark.parametrize(
    ("replace", "names"),
    [
        ("[grid.lossess]", "'grid.lossess', which is not a config key (did you mean 'grid.losses'?)"),
        ("[datasets.cifar]", "'datasets.cifar', which is not a config key (did you mean 'datasets.cifar10'?)"),
        ("[datasets, nope]", "'nope', which is not a config key"),
        ("datasets", "must be a list of config keys"),
    ],
)
def test_an_unknown_key_in_replace_is_refused_in_one_line_naming_it(tmp_path, replace, names):
    over = write(tmp_path, "o.yaml", f"replace: {replace}\ndatasets: {{digits: {{}}}}\n")
    with pytest.raises(ConfigError) as exc:
        load_config([CONFIG, over])
    line = str(exc.value)
    assert "\n" not in line and f"config file {over}: 'replace'" in line and names in line, line


def test_an_unknown_key_in_replace_stops_the_cli_with_one_line(capsys, tmp_path):
    over = write(tmp_path, "o.yaml", "replace: [grid.lossess]\n")
    assert cli.main(["cells", "--config", str(CONFIG), "--config", str(over)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("smallbatch: error: config file") and "'grid.lossess'" in err[0]


# --------------------------------------------------------------------------- --config, repeated
def test_repeated_config_flags_are_laid_over_one_another_in_order(capsys, tmp_path):
    a = write(tmp_path, "a.yaml", "datasets: {digits: {}}\ngrid: {losses: [dcl], seeds: [0, 1, 2]}\n")
    b = write(tmp_path, "b.yaml", "replace: [datasets]\ndatasets: {digits: {}}\ngrid: {seeds: [5]}\n")
    ab, _ = cells_listed(capsys, CONFIG, a, b)
    assert ab == list(expand_cells(load_config([CONFIG, a, b])))
    # b's data sets alone and b's seeds, a's loss, config.yaml's batch sizes and temperature
    assert ab == [f"digits/dcl/bs{n}-t0.1-s5" for n in (16, 32, 64, 256)]
    ba, _ = cells_listed(capsys, CONFIG, b, a)  # a last: its seeds, and digits beside b's digits only
    assert sorted(ba) == sorted(f"digits/dcl/bs{n}-t0.1-s{s}" for n in (16, 32, 64, 256) for s in (0, 1, 2))


def test_an_overlay_alone_says_it_was_laid_over_the_defaults_and_a_whole_config_says_nothing(capsys, tmp_path):
    over = write(tmp_path, "my.yaml", "datasets: {digits: {}}\ngrid: {seeds: [0]}\n")
    _, err = cells_listed(capsys, over)
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1 and str(over) in notes[0] and "schema's defaults" in notes[0], err
    assert "name config.yaml first" in notes[0]
    _, err = cells_listed(capsys, CONFIG, over)
    assert "note:" not in err, err
    _, err = cells_listed(capsys, REPO / "workflow" / "configs" / "smoke.yaml")
    assert "note:" not in err, err


# --------------------------------------------------------------------------- the README's example
def readme_overlay() -> tuple[str, str]:
    """(the README's overlay example, the sentence before it that says what it plans)."""
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Your own grid", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\n([^\n]*)\n```yaml\n(.*?)```", section, re.S)
    assert m, "README's 'Your own grid' section has no ```yaml block"
    return m.group(2), m.group(1)


def test_the_readmes_overlay_example_plans_exactly_the_cells_it_states(capsys, tmp_path):
    text, claim = readme_overlay()
    assert "--configfile config.yaml my.yaml" in claim, claim
    stated = re.search(r"plans (\d+) (\S+) cells and (\d+) baselines", claim)
    assert stated, claim
    my = write(tmp_path, "my.yaml", text)
    ex = yaml.safe_load(text)
    listed, err = cells_listed(capsys, CONFIG, my, baselines=True)
    cells = [c for c in listed if not c.startswith("baselines/")]
    baselines = [c for c in listed if c.startswith("baselines/")]
    # exactly the grid the example writes, on its data sets only
    g = ex["grid"]
    expected = [
        f"{ds}/{loss}/bs{n}-t{t}-s{s}"
        for ds in ex["datasets"]
        for loss in g["losses"]
        for n in g["batch_sizes"]
        for t in g["temperatures"]
        for s in g["seeds"]
    ]
    assert sorted(cells) == sorted(expected), (cells, expected)
    assert len(cells) == int(stated.group(1)) and len(baselines) == int(stated.group(3)), (claim, len(cells))
    assert stated.group(2).lower().replace("-", "") == "".join(ex["datasets"]), claim
    assert {b.split("/")[1] for b in baselines} == set(ex["datasets"])
    # the sections it replaces are as written (nothing of config.yaml's), no side experiment runs
    cfg = load_config([CONFIG, my])
    assert cfg["train"] == validate_config({"train": ex["train"]})["train"]
    assert cfg["augment"] == ex["augment"]
    assert not any(sec.get("enabled") for sec in cfg["experiments"].values())
    assert len(expand_cells(cfg)) == len(cells) and len(baseline_cells(cfg)) == len(baselines)
    assert "note:" not in err, err


# --------------------------------------------------------------------------- --set
def test_set_overrides_nested_keys_for_one_run_and_the_plan_prints_them(capsys):
    """`--set KEY=VALUE ...` lays dotted keys over the files: config.yaml's 5 losses x 4 batch
    sizes x 2 seeds become 5 x 2 x 1; the plan's stderr names each override with its value as
    read (YAML 1.2: 1e-3 is a number)."""
    rc = cli.main(
        ["cells", "--config", str(CONFIG), "--set", "grid.seeds=[1]", "grid.batch_sizes=[16, 64]", "train.lr=1e-3"]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    ids = [line.split("\t")[0] for line in out.splitlines()]
    losses = ["infonce", "flatnce", "dcl", "dclw", "eqco-alpha256"]
    assert sorted(ids) == sorted(f"fashion_mnist/{lo}/bs{n}-t0.1-s1" for lo in losses for n in (16, 64))
    assert "overrides: grid.seeds = [1], grid.batch_sizes = [16, 64], train.lr = 0.001\n" in err, err


def test_set_is_validated_like_a_file_with_the_same_did_you_mean_line(capsys, tmp_path):
    """A misspelt key given with --set gets the line the same key gets in a file."""
    rc = cli.main(["cells", "--config", str(CONFIG), "--set", "grid.sedes=[0]"])
    by_set = capsys.readouterr().err
    assert rc == 2
    in_file = write(tmp_path, "typo.yaml", "grid: {sedes: [0]}\n")
    assert cli.main(["cells", "--config", str(CONFIG), "--config", str(in_file)]) == 2
    assert by_set == capsys.readouterr().err
    assert by_set.startswith("smallbatch: error: unknown config key 'grid.sedes' (did you mean 'seeds'?)"), by_set


@pytest.mark.parametrize(
    "pair, problem",
    [
        ("grid.seeds", "override 'grid.seeds' is not KEY=VALUE"),
        ("grid..seeds=[0]", "override 'grid..seeds=[0]' is not KEY=VALUE"),
        ("grid.seeds=[0", "override 'grid.seeds' = [0 is not a YAML value"),
        ("train.epochs=zero", "config key 'train.epochs' = 'zero' has the wrong type"),
    ],
)
def test_a_bad_set_pair_is_one_line_naming_its_key(capsys, pair, problem):
    assert cli.main(["cells", "--config", str(CONFIG), "--set", pair]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and problem in err, err


def test_set_values_read_as_yaml_1_2_scalars_and_flow_collections():
    from smallbatch.study.config import read_sets

    pairs = ["a.b=[0, 1]", "a.c={x: 8}", "d=1e-3", "e=yes", "f=010", "g=true", "h='1'", "i=", "a.j=0x10"]
    assert read_sets(pairs) == {
        "a": {"b": [0, 1], "c": {"x": 8}, "j": 16},
        "d": 0.001,
        "e": "yes",
        "f": 10,
        "g": True,
        "h": "1",
        "i": None,
    }


def test_snakemakes_set_word_splits_at_blanks_outside_brackets_and_quotes():
    from smallbatch.study.config import snakemake_sets

    assert snakemake_sets("grid.seeds=[0, 1]  study='a b' datasets.digits={image_size: 8}") == [
        "grid.seeds=[0, 1]",
        "study='a b'",
        "datasets.digits={image_size: 8}",
    ]
    # Snakemake read "datasets.digits={image_size: 8}" as a one-key YAML mapping first
    assert snakemake_sets({"datasets.digits={image_size": "8}"}) == ["datasets.digits={image_size: 8}"]
    with pytest.raises(ConfigError, match=r"--config set=3 is not KEY=VALUE pairs"):
        snakemake_sets(3)


def test_every_command_that_reads_a_config_takes_set():
    from smallbatch.pipeline.cli_parser import build_parser

    (sub,) = [a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    with_config = [n for n, p in sub.choices.items() if any("--config" in a.option_strings for a in p._actions)]
    assert len(with_config) >= 10, with_config
    for name in with_config:
        assert any("--set" in a.option_strings for a in sub.choices[name]._actions), name
    args = sub.choices["pretrain"].parse_args(["--set", "grid.seeds=[0]", "train.epochs=2", "--set", "seed=1"])
    assert args.set == ["grid.seeds=[0]", "train.epochs=2", "seed=1"]


def test_missing_data_says_the_one_run_override_that_fetches_it_and_that_override_passes(tmp_path):
    """A data set whose files are not under data.root is refused in one line naming the override
    that lets torchvision fetch them; that override, given as written, passes the check."""
    from smallbatch.study.config import check_data_roots

    over = write(tmp_path, "c.yaml", f"replace: [datasets]\ndatasets: {{cifar10: {{}}}}\ndata: {{root: {tmp_path}}}\n")
    with pytest.raises(ConfigError) as exc:
        check_data_roots(load_config([CONFIG, over]))
    said = str(exc.value)
    assert "\n" not in said and said.endswith(
        "(for one run: --set data.download=true; snakemake --config set=data.download=true)"
    )
    check_data_roots(load_config([CONFIG, over], sets=["data.download=true"]))


def test_an_override_written_without_set_is_told_to_use_set(capsys):
    """`smallbatch cells grid.seeds=[0]` (Hydra's and Lightning's form) is refused saying --set."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["cells", "--config", str(CONFIG), "grid.seeds=[0]", "train.epochs=2"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "smallbatch: error: unrecognized arguments: grid.seeds=[0] train.epochs=2; to override a config key "
        "write --set grid.seeds=[0] train.epochs=2"
    )
