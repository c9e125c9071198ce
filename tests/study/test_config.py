"""Tests of the study configuration (``smallbatch.study.config``) and its expansion into cells
(``smallbatch.study.cells``): defaults, one-line errors naming the key, cell ids and hashes."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
from loss_at_tau import at_tau

from smallbatch.study.cells import cell_hash, expand_cells, flat_params, make_cell, negatives_per_anchor
from smallbatch.study.config import ConfigError, load_config, validate_config
from smallbatch.study.schema import load_schema

REPO = Path(__file__).resolve().parents[2]


def grid(**kw) -> dict:
    """A small digits study with the given grid keys."""
    g = {"losses": ["infonce"], "batch_sizes": [16], "temperatures": [0.1], "seeds": [0]}
    g.update(kw)
    return {"datasets": {"digits": {}}, "grid": g}


# --------------------------------------------------------------------------- defaults
def test_defaults_are_filled_from_the_schema():
    cfg = validate_config({})
    props = load_schema()["properties"]
    for section in ("train", "eval", "grid", "data"):
        for key, sub in props[section]["properties"].items():
            if "default" in sub:
                assert cfg[section][key] == sub["default"], f"{section}.{key}"
    for key in ("study", "results_dir", "device", "threads", "baselines", "tracking_uri"):
        assert cfg[key] == props[key]["default"]
    assert list(cfg["datasets"]) == list(props["datasets"]["default"])


def test_dataset_options_defaults_and_user_values_kept():
    cfg = validate_config({"datasets": {"digits": {"train_subset": 500}}, "train": {"epochs": 2}})
    assert cfg["datasets"]["digits"] == {"train_subset": 500, "image_size": None, "test_subset": None, "root": None}
    assert cfg["train"]["epochs"] == 2 and cfg["train"]["lr"] == 0.001  # the schema's default


def test_load_config_file_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("study: s1\ntrain:\n  epochs: 5\n  lr: 0.01\n")
    cfg = load_config(p, {"train": {"epochs": 1}})
    assert cfg["study"] == "s1" and cfg["train"]["epochs"] == 1 and cfg["train"]["lr"] == 0.01


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found.*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml.*YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "cfg,key,extra",
    [
        ({"grid": {"losses": ["infonse"]}}, "grid.losses[0]", "flatnce"),  # unknown loss: allowed values listed
        ({"grid": {"losses": [{"name": "flatnse"}]}}, "grid.losses[0].name", "flatnce"),
        ({"grid": {"batch_sizes": [16, 1]}}, "grid.batch_sizes[1]", ">= 2"),
        ({"grid": {"temperatures": [-0.1]}}, "grid.temperatures[0]", "> 0"),
        ({"grid": {"temperatures": [0]}}, "grid.temperatures[0]", "> 0"),
        ({"grid": {"losses": [{"name": "dclw", "sigma": [0.5, -1]}]}}, "grid.losses[0].sigma", "> 0"),
        ({"train": {"precision": "fp8"}}, "train.precision", "fp64"),
        ({"train": {"epochs": -1}}, "train.epochs", "> 0"),
        ({"train": {"lr_scaling": "cubic"}}, "train.lr_scaling", "sqrt"),
        ({"datasets": {"mnist": {}}}, "mnist", "fashion_mnist"),  # unknown dataset
        ({"device": "tpu"}, "device", "cuda"),
        ({"threads": 0}, "threads", ">= 1"),
        ({"augment": {"crop_scal": [0.2, 1.0]}}, "augment.crop_scal", "crop_scale"),  # augment typo
        ({"augment": {"recipe": "simclrr"}}, "augment", "simclr"),
        ({"augment": {"crop_scale": [0.9, 0.2]}}, "augment", "crop_scale"),
        ({"train": {"ess_schedule": {"start": 0.9}}}, "train.ess_schedule", "end"),
        ({"train": {"ess_schedule": {"start": 1.5, "end": 0.3}}}, "train.ess_schedule.start", "<= 1"),
    ],
)
def test_bad_values_give_one_line_naming_the_key(cfg, key, extra):
    with pytest.raises(ConfigError) as ei:
        validate_config(cfg)
    msg = str(ei.value)
    assert "\n" not in msg
    assert key in msg and extra in msg, msg


@pytest.mark.parametrize(
    "cfg,bad,suggestion",
    [
        ({"studdy": "x"}, "'studdy'", "study"),
        ({"trian": {"epochs": 1}}, "'trian'", "train"),
        ({"grid": {"batch_size": [16]}}, "'grid.batch_size'", "batch_sizes"),
        ({"train": {"epoch": 3}}, "'train.epoch'", "epochs"),
        ({"datasets": {"digits": {"image_sze": 8}}}, "'datasets.digits.image_sze'", "image_size"),
        ({"grid": {"losses": [{"name": "dclw", "sigmaa": 1}]}}, "'grid.losses[0].sigmaa'", "sigma"),
        ({"train": {"ess_schedule": {"start": 0.9, "end": 0.3, "rat": 1}}}, "'train.ess_schedule.rat'", "rate"),
    ],
)
def test_typos_get_did_you_mean(cfg, bad, suggestion):
    with pytest.raises(ConfigError) as ei:
        validate_config(cfg)
    msg = str(ei.value)
    assert "\n" not in msg
    assert bad in msg and f"did you mean '{suggestion}'" in msg, msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- cells of the default study
def test_default_config_expands_to_the_full_grid():
    cfg = load_config(REPO / "config.yaml")
    cells = expand_cells(cfg)
    g = cfg["grid"]
    expected = (
        len(cfg["datasets"]) * len(g["losses"]) * len(g["batch_sizes"]) * len(g["temperatures"]) * len(g["seeds"])
    )
    assert len(cells) == expected
    pattern = re.compile(r"^(\w+)/([a-z]+(?:-[a-z]+[0-9.e+-]+)*)/bs(\d+)-t([0-9.e-]+)-s(\d+)$")
    for cid, cell in cells.items():
        m = pattern.match(cid)
        assert m, cid
        assert cell["id"] == cid and m.group(1) == cell["dataset"]
        assert int(m.group(3)) == cell["batch_size"] and float(m.group(4)) == cell["temperature"]
        assert int(m.group(5)) == cell["seed"] and m.group(2).split("-")[0] == cell["loss"]
    from smallbatch.study.cells import loss_label

    ds = next(iter(cfg["datasets"]))
    sigma = cfg["loss_params"]["dclw"]["sigma"]
    for cid in (
        f"{ds}/infonce/bs{g['batch_sizes'][0]}-t{g['temperatures'][0]:g}-s{g['seeds'][0]}",
        f"{ds}/{loss_label('dclw', {'sigma': sigma})}/bs{g['batch_sizes'][-1]}-t{g['temperatures'][-1]:g}-s{g['seeds'][-1]}",
    ):
        assert cid in cells, cid
    hashes = [c["hash"] for c in cells.values()]
    assert len(set(hashes)) == len(hashes)


def test_ids_and_hashes_are_stable():
    a = expand_cells(load_config(REPO / "config.yaml"))
    b = expand_cells(load_config(REPO / "config.yaml"))
    assert list(a) == list(b)
    assert [c["hash"] for c in a.values()] == [c["hash"] for c in b.values()]
    for c in a.values():
        assert cell_hash(c) == c["hash"] and re.fullmatch(r"[0-9a-f]{10}", c["hash"])


def _one_cell(overrides: dict) -> dict:
    cfg = validate_config({**grid(), **overrides})
    (cell,) = expand_cells(cfg).values()
    return cell


# --------------------------------------------------------------------------- the hash, key by key from the schema
#: the config's top-level keys that no cell carries: where results go, what runs around the
#: cells, the side experiments' own lists (their cells are made by make_cell like the grid's)
NOT_IN_A_CELL = (
    "study",
    "tracking_uri",
    "results_dir",
    "baselines",
    "keep_features",
    "warm_start",
    "one_job_per_cell",
    "cells_per_gpu",
    "experiments",
    "analysis",  # the report's plan: read when the store is, never by a cell
    "supervised_baseline",
)  # the last: baseline cells' only
#: sections a cell carries key by key: config path of the section -> its schema node's path
SETTING_SECTIONS = {
    ("train",): ("train",),
    ("eval",): ("eval",),
    ("data",): ("data",),
    ("datasets", "digits"): ("datasets", "additionalProperties"),
}
#: the settings of how a cell runs, not of what it computes: left out of every cell's hash.
#: Written out here, not read from the schema: marking a key ``x-execution`` there is a
#: deliberate edit of this list too (a science key marked by mistake would let a study on a
#: reused folder keep the results of other settings without a word). ``*``: any data set.
EXECUTION_SETTINGS = frozenset(
    {
        "tracking",
        "device",
        "threads",
        "data.root",
        "data.download",
        "datasets.*.root",
        "train.log_every",
        "train.compile",
        "train.devices",
        "train.deterministic",
        "eval.monitor_every",
    }
)
#: a valid other value for settings whose generic one (_other_value) the config would refuse
OTHER_VALUE = {
    ("tracking",): {"log_checkpoint": True},
    ("analysis",): {"margin": 0.25, "margin_scale": "points"},
    ("train", "ess_schedule"): {"start": 0.9, "end": 0.3},
    ("datasets", "digits", "train_subset"): 500,
    ("datasets", "digits", "test_subset"): 200,
    ("datasets", "digits", "image_size"): 16,
    ("eval", "knn_primary_k"): 20,  # one of the default knn_k [20, 200]
}
#: settings valid only beside another one: that one is set in both cells compared
COMPANIONS = {("train", "snapshot_epochs"): {"train": {"lr_schedule": "constant"}}}


def _schema_node(path: tuple) -> dict:
    node = load_schema()["properties"]
    for part in path:
        node = node[part]
    return node


def schema_settings() -> list[tuple[tuple, dict]]:
    """Every setting a cell carries, enumerated from the schema: (config path, schema node).
    Top-level keys marked x-execution, every key of the SETTING_SECTIONS, every parameter of
    every loss (loss_params.<loss>.<param>, filled in from the registry)."""
    props = load_schema()["properties"]
    out = [((k,), node) for k, node in props.items() if node.get("x-execution")]
    for path, schema_path in SETTING_SECTIONS.items():
        out += [((*path, k), node) for k, node in _schema_node(schema_path)["properties"].items()]
    for loss, node in props["loss_params"]["properties"].items():
        out += [(("loss_params", loss, k), sub) for k, sub in node["properties"].items()]
    return out


def _resolve(node: dict) -> dict:
    defs = load_schema()["$defs"]
    if "$ref" in node:
        node = {**defs[node["$ref"].rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _other_value(path: tuple, node: dict, value):
    """A valid value of the setting other than ``value`` (its default here)."""
    if path in OTHER_VALUE:
        return OTHER_VALUE[path]
    node = _resolve(node)
    if "enum" in node:
        return next(v for v in node["enum"] if v != value)
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if isinstance(value, bool) or types == ["boolean"]:
        return not value
    if (value is None or value == []) and "array" in types:
        return [_other_value(path, node["items"], None)]
    if value is None:
        if "integer" in types:
            return max(int(node.get("minimum", 1)), 2)
        if "number" in types:
            return 0.5
        if "string" in types:
            return "other"
        raise AssertionError(f"no generic value for {'.'.join(path)}: add one to OTHER_VALUE")
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        other = value * 2 if value else 0.5
        return (
            value / 2 if other > min(node.get("maximum", math.inf), node.get("exclusiveMaximum", math.inf)) else other
        )
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return value[:-1] if len(value) > 1 else value * 2
    raise AssertionError(f"no generic value for {'.'.join(path)}: add one to OTHER_VALUE")


def _nested(path: tuple, value) -> dict:
    for part in reversed(path):
        value = {part: value}
    return value


def _digits_cell(overrides: dict, loss: str = "infonce") -> dict:
    cfg = validate_config({**grid(losses=[loss]), **overrides})
    (cell,) = expand_cells(cfg).values()
    return cell


def _changed_cells(path: tuple, node: dict) -> tuple[dict, dict]:
    """(the default digits cell, the cell with the setting at ``path`` changed)."""
    loss = path[1] if path[0] == "loss_params" else "infonce"
    companion = COMPANIONS.get(path, {})
    base = _digits_cell(companion, loss)
    default = validate_config(grid(losses=[loss]))
    for part in path:
        default = default[part]
    changed = _nested(path, _other_value(path, node, default))
    for key, sub in companion.items():
        changed[key] = {**sub, **changed.get(key, {})}
    return base, _digits_cell(changed, loss)


SETTINGS = schema_settings()


def _dotted(path: tuple) -> str:
    """A setting's config path as named in EXECUTION_SETTINGS: ``datasets.digits.root`` -> ``datasets.*.root``."""
    return ".".join(("datasets", "*", *path[2:]) if path[0] == "datasets" else path)


def _schema_marked(marker: str) -> dict[str, object]:
    """Every key of the schema marked ``marker``, at any depth: {dotted config path: its default}."""
    out: dict[str, object] = {}

    def walk(node: dict, prefix: tuple) -> None:
        for key, sub in (node.get("properties") or {}).items():
            if sub.get(marker):
                out[".".join((*prefix, key))] = sub.get("default")
            walk(sub, (*prefix, key))
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], (*prefix, "*"))

    walk(load_schema(), ())
    return out


def test_the_schema_marks_exactly_the_listed_execution_settings():
    """Marking a science key ``x-execution`` (e.g. train.weight_decay) would drop it from the
    hash: the schema must mark exactly the keys written out above, no more, no fewer."""
    marked = set(_schema_marked("x-execution"))
    assert marked == EXECUTION_SETTINGS, (
        f"marked x-execution but not listed: {sorted(marked - EXECUTION_SETTINGS)}; "
        f"listed but not marked: {sorted(EXECUTION_SETTINGS - marked)}"
    )


def test_no_schema_key_is_hashed_only_when_set_or_under_a_former_name():
    """Every science key is hashed at every value under its own name: the schema marks no key
    hashed-only-when-set or renamed (stores of another format are refused, not read alike)."""
    assert _schema_marked("x-hash-when-set") == {}
    assert _schema_marked("x-renamed-from") == {}


def test_every_top_level_key_is_a_cell_setting_or_is_not_in_a_cell():
    """A new top-level key must be placed: in a cell (a section above, or marked x-execution)
    or in NOT_IN_A_CELL -- so nothing reaches a cell unseen by the hash tests below."""
    placed = {p[0] for p, _ in SETTINGS} | set(NOT_IN_A_CELL) | {"grid", "loss_params", "augment", "datasets"}
    assert set(load_schema()["properties"]) - placed == set(), "place these keys"


@pytest.mark.parametrize("path,node", SETTINGS, ids=[".".join(p) for p, _ in SETTINGS])
def test_hash_changes_with_every_science_setting_and_no_execution_setting(path, node):
    """Every setting of the schema a cell carries changes the cell; the hash changes with it
    unless the schema marks the key ``x-execution`` (how a cell runs, not what it computes)."""
    base, other = _changed_cells(path, node)
    if path[0] != "loss_params":  # (a loss parameter off its default is also named in the id)
        assert other["id"] == base["id"]
    assert other != base, f"{'.'.join(path)} does not reach the cell"
    if _dotted(path) in EXECUTION_SETTINGS:
        assert other["hash"] == base["hash"], f"execution setting {'.'.join(path)} changed the hash"
    else:
        assert other["hash"] != base["hash"], f"{'.'.join(path)} changes the cell but not its hash"


def test_a_cells_id_is_in_its_hash():
    """A cell file whose id was edited to another cell's id fails its hash check."""
    cell = _digits_cell({})
    assert cell_hash({**cell, "id": cell["id"].replace("-s0", "-s1")}) != cell["hash"]


def _fashion_root(root: Path, tweak: bool = False) -> Path:
    """Four small files in Fashion-MNIST's layout (only their content is read: the digest)."""
    from smallbatch.data.digest import FASHION_FILES as _FASHION_FILES

    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for i, name in enumerate(_FASHION_FILES):
        (raw / name).write_bytes(bytes([i]) * 64 + (b"!" if tweak and i == 2 else b""))
    return root


def test_the_datas_content_is_in_the_hash_not_where_it_lies(tmp_path):
    """Another copy of the same files (data.root or datasets.<name>.root) keeps every hash;
    other content (one byte) changes every hash: the data's identity is hashed, not its place."""
    a, b, other = (_fashion_root(tmp_path / n, tweak=n == "other") for n in ("a", "b", "other"))

    def hashes(data: dict, dataset: dict | None = None) -> list[str]:
        cfg = {**grid(seeds=[0, 1]), "datasets": {"fashion_mnist": dataset or {}}, "data": data}
        return [c["hash"] for c in expand_cells(validate_config(cfg)).values()]

    first = hashes({"root": str(a)})
    assert len(first) == 2
    assert hashes({"root": str(b)}) == first
    assert hashes({"root": str(tmp_path / "none")}, {"root": str(b)}) == first
    assert set(hashes({"root": str(other)})).isdisjoint(first)


def test_a_cells_format_is_in_its_hash():
    """A cell carries this smallbatch's format, and its hash covers it: a cell of another
    format is another cell, never a finished result of this one."""
    from smallbatch.tracking import FORMAT

    cell = _digits_cell({})
    assert cell["format"] == FORMAT == 2
    assert cell_hash({**cell, "format": 1}) != cell["hash"]


@pytest.mark.parametrize("key", [k for k in NOT_IN_A_CELL if k not in ("experiments", "supervised_baseline")])
def test_keys_outside_cells_leave_the_cell_as_it_is(key):
    node = load_schema()["properties"][key]
    default = validate_config(grid())[key]
    value = "http://mlflow:5000" if key == "tracking_uri" else _other_value((key,), node, default)
    assert _digits_cell({key: value}) == _digits_cell({})


def test_every_augmentation_parameter_changes_the_hash():
    """augment is free-form in the schema: its keys are AugmentConfig's fields."""
    import dataclasses

    from smallbatch.data.augment import RECIPES, AugmentConfig

    base = _digits_cell({})
    for f in dataclasses.fields(AugmentConfig):
        default = RECIPES["gray_small"].get(f.name, f.default)
        value = (
            "simclr"
            if f.name == "recipe"
            else [default[0] / 2, default[1]]
            if isinstance(default, (list, tuple))
            else default + 1
            if isinstance(default, int) and not isinstance(default, bool)
            else default / 2
            if default
            else 0.1
        )
        other = _digits_cell({"augment": {f.name: value}})
        assert other["id"] == base["id"] and other["hash"] != base["hash"], f"augment.{f.name}"


def test_every_axis_of_the_grid_changes_the_hash():
    """What the grid varies (and the experiment a cell belongs to) is part of the hash too."""
    cfg = validate_config(
        grid(losses=["infonce", "dcl"], batch_sizes=[16, 32], temperatures=[0.1, 0.5], seeds=[0, 1])
        | {"datasets": {"digits": {}, "fashion_mnist": {}}}
    )
    axes = dict(dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.1, seed=0)
    base = make_cell(cfg, **axes)
    for key, value in (
        ("dataset", "fashion_mnist"),
        ("loss", "dcl"),
        ("batch_size", 32),
        ("temperature", 0.5),
        ("seed", 1),
        ("experiment", "tsweep"),
    ):
        assert make_cell(cfg, **{**axes, key: value})["hash"] != base["hash"], key


def test_the_hash_tests_cover_every_part_of_a_cell():
    """Each part of a cell is changed by one of the tests above (the cell's own name aside)."""
    from smallbatch.study.cells import NAME_KEYS

    base = _digits_cell({})
    covered = {
        p[0] if p[0] in ("device", "threads") else {"data": "data_root", "datasets": "dataset_options"}.get(p[0], p[0])
        for p, _ in SETTINGS
    }
    covered |= {
        "download",
        "augment",
        "dataset",
        "loss",
        "batch_size",
        "temperature",
        "seed",
        "experiment",
        "negatives",
        "id",
        "data_digest",
        "format",
    }  # data.download, the augmentation test, the axes (negatives: 2N-2), the id, data and format tests
    assert set(base) - set(NAME_KEYS) == covered


def test_hash_changes_with_loss_parameters_and_id_names_them():
    a = _one_cell({"grid": {**grid()["grid"], "losses": [{"name": "dclw", "sigma": 0.5}]}})
    b = _one_cell({"grid": {**grid()["grid"], "losses": [{"name": "dclw", "sigma": 1.0}]}})
    # the paper's default (sigma 0.5) keeps the plain name; other values are named
    assert a["id"] == "digits/dclw/bs16-t0.1-s0" and b["id"] == "digits/dclw-sigma1/bs16-t0.1-s0"
    assert a["hash"] != b["hash"]


# --------------------------------------------------------------------------- grid features
def test_per_loss_overrides_expand_and_restrict():
    cfg = validate_config(
        grid(
            losses=["infonce", {"name": "dclw", "sigma": [0.5, 2]}, {"name": "flatnce", "batch_sizes": [64]}],
            batch_sizes=[16, 32],
            temperatures=[0.1, 0.5],
        )
    )
    cells = expand_cells(cfg)
    by_loss: dict[str, list[dict]] = {}
    for c in cells.values():
        by_loss.setdefault(c["loss"], []).append(c)
    assert len(by_loss["infonce"]) == 2 * 2
    assert len(by_loss["dclw"]) == 2 * 2 * 2
    assert sorted({c["loss_params"]["sigma"] for c in by_loss["dclw"]}) == [0.5, 2]
    assert "digits/dclw-sigma2/bs32-t0.5-s0" in cells and "digits/dclw/bs16-t0.1-s0" in cells
    assert {c["batch_size"] for c in by_loss["flatnce"]} == {64} and len(by_loss["flatnce"]) == 2
    assert len(cells) == 4 + 8 + 2


def test_loss_params_defaults_and_grid_entry_override():
    cfg = validate_config(
        grid(losses=["dclw", {"name": "dclw", "sigma": 2.0}]) | {"loss_params": {"dclw": {"sigma": 0.3}}}
    )
    cells = expand_cells(cfg)
    assert set(cells) == {"digits/dclw-sigma0.3/bs16-t0.1-s0", "digits/dclw-sigma2/bs16-t0.1-s0"}


def test_aliases_map_to_one_canonical_cell():
    cells = expand_cells(validate_config(grid(losses=["infonce", "ntxent", "simclr"])))
    assert list(cells) == ["digits/infonce/bs16-t0.1-s0"]
    assert cells["digits/infonce/bs16-t0.1-s0"]["loss"] == "infonce"


def test_every_loss_parameter_is_resolved_into_the_cell():
    """A cell carries every parameter of its loss (so the hash and the MLflow params cover it),
    with the schema's default when the config does not set it."""
    cells = expand_cells(validate_config(grid(losses=["flatnce", "dclw", "eqco", "dcl"])))
    expected = {"flatnce": {"gamma": 1.0}, "dclw": {"sigma": 0.5}, "eqco": {"alpha": 256}, "dcl": {}}
    assert {c["loss"]: c["loss_params"] for c in cells.values()} == expected


def test_extra_axes_add_suffixes_and_train_settings():
    cells = expand_cells(validate_config(grid(axes={"precision": ["fp32", "fp64"], "queue_size": [0, 128]})))
    assert set(cells) == {f"digits/infonce/bs16-t0.1-s0-{p}-q{q}" for p in ("fp32", "fp64") for q in (0, 128)}
    for cid, c in cells.items():
        assert cid.endswith(f"-{c['train']['precision']}-q{c['train']['queue_size']}")


def test_negatives_are_2n_minus_2_in_batch_and_queue_size_with_a_queue():
    cells = expand_cells(validate_config(grid(batch_sizes=[16, 256], axes={"queue_size": [0, 4096]})))
    for c in cells.values():
        q = c["train"]["queue_size"]
        assert c["negatives"] == (q if q else 2 * c["batch_size"] - 2)
    assert negatives_per_anchor(32, 0) == 62 and negatives_per_anchor(32, 65536) == 65536
    cell = _one_cell({"train": {"queue_size": 512}})
    assert cell["negatives"] == 512


def test_a_disabled_grid_plans_only_the_side_experiments_and_a_study_of_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"^the study plans 0 cells: config key 'grid\.enabled' is false"):
        validate_config(grid(enabled=False))
    cfg = {**grid(enabled=False), "experiments": {"tsweep": {"enabled": True, "temperatures": [0.1, 0.5]}}}
    assert {c["experiment"] for c in expand_cells(validate_config(cfg)).values()} == {"tsweep"}


def test_flat_params_has_the_documented_keys():
    cell = _one_cell({"grid": {**grid()["grid"], "losses": [{"name": "dclw", "sigma": 0.5}]}})
    p = flat_params(cell)
    for key in (
        "dataset",
        "loss",
        "batch_size",
        "temperature",
        "seed",
        "train.precision",
        "train.lr_scaling",
        "train.epochs",
        "negatives",
        "train.queue_size",
        "loss.sigma",
        "train.backbone",
        "eval.knn_k",
    ):
        assert key in p, key  # the config's dotted keys: what a user searches the MLflow UI for
    assert p["loss.sigma"] == "0.5" and p["negatives"] == "30" and p["batch_size"] == "16"
    assert all(isinstance(v, str) and len(v) <= 500 for v in p.values())
    assert "id" not in p and "hash" not in p


def test_make_cell_is_json_serialisable_and_deep_copied():
    import json

    cfg = validate_config(grid())
    cell = make_cell(cfg, dataset="digits", loss="infonce", loss_params={}, batch_size=16, temperature=0.1, seed=0)
    before = copy.deepcopy(cell)
    cfg["train"]["lr"] = 123.0  # mutating the config afterwards must not change the cell
    assert cell == before
    assert json.loads(json.dumps(cell)) == cell


def test_schema_loss_names_and_parameters_come_from_the_registry():
    from smallbatch.losses import LOSSES, REGISTRY

    schema = load_schema()
    assert sorted(schema["$defs"]["loss_name"]["enum"]) == sorted(LOSSES)
    lp = schema["properties"]["loss_params"]["properties"]
    assert list(lp) == list(REGISTRY)
    for name, cls in REGISTRY.items():
        assert sorted(lp[name]["properties"]) == sorted(cls.param_defaults), name


class _ToyLoss:
    """Made (by the test below) a DCL with a scaled positive, registered as "toy"."""


def test_a_new_loss_needs_only_the_registry(monkeypatch):
    """Adding a loss is its registry entry plus its class: the config schema, cells, labels
    and build_loss pick it up from the registry (no other file lists loss names)."""
    from smallbatch import losses
    from smallbatch.losses import registry
    from smallbatch.study import schema as schema_mod

    spec = registry.LossSpec(
        name="toy",
        display="Toy",
        paper="a test",
        impl=f"{__name__}:_ToyLoss",
        params={"beta": {"type": "number", "exclusiveMinimum": 0, "default": 2.0}},
    )
    monkeypatch.setitem(registry.SPECS, "toy", spec)

    class Toy(losses.DCL, spec="toy"):
        def _check_param(self, key, value):
            return float(value)

    monkeypatch.setitem(globals(), "_ToyLoss", Toy)
    monkeypatch.setattr(schema_mod, "_SCHEMA_CACHE", {})
    cfg = validate_config(grid(losses=["infonce", {"name": "toy", "beta": [2.0, 3.0]}]))
    cells = expand_cells(cfg)
    assert set(cells) == {
        "digits/infonce/bs16-t0.1-s0",
        "digits/toy/bs16-t0.1-s0",
        "digits/toy-beta3/bs16-t0.1-s0",
    }
    assert cfg["loss_params"]["toy"] == {"beta": 2.0}
    built = losses.build_loss("toy", beta=3.0)
    assert isinstance(built, Toy) and at_tau(built, 0.1).beta == 3.0
    assert losses.build_loss("toy").beta == 2.0  # the schema's default is the API's
    assert losses.display_name("toy") == "Toy"
    with pytest.raises(ConfigError, match="beta"):
        validate_config(grid(losses=[{"name": "toy", "beta": -1}]))


def test_a_loss_without_a_temperature_is_planned_once_per_other_axes_with_a_note():
    """VICReg and KCL have no τ: with temperatures [0.1, 0.5] each is planned at 0.1 alone (a cell at
    0.5 would train the same network under another id); InfoNCE at both."""
    from smallbatch.study.cells import temperature_notes

    cfg = validate_config(grid(losses=["infonce", "vicreg", "kcl"], temperatures=[0.1, 0.5], batch_sizes=[16, 32]))
    assert sorted(expand_cells(cfg)) == [
        "digits/infonce/bs16-t0.1-s0",
        "digits/infonce/bs16-t0.5-s0",
        "digits/infonce/bs32-t0.1-s0",
        "digits/infonce/bs32-t0.5-s0",
        "digits/kcl/bs16-t0.1-s0",
        "digits/kcl/bs32-t0.1-s0",
        "digits/vicreg/bs16-t0.1-s0",
        "digits/vicreg/bs32-t0.1-s0",
    ]
    assert temperature_notes(cfg) == [
        "note: vicreg and kcl take no temperature: planned once, at τ = 0.1 (the first of grid.temperatures), "
        "not once per τ"
    ]
    assert temperature_notes(validate_config(grid(temperatures=[0.1, 0.5]))) == []


def test_a_temperature_axis_written_for_a_loss_without_one_is_one_line():
    """A loss entry's own temperatures list for BYOL (no τ) is an axis of nothing: refused; a grid
    of losses without τ alone keeps the grid's (default) temperatures, each planned once."""
    from smallbatch.study.cells import temperature_notes

    losses = ["infonce", {"name": "byol", "temperatures": [0.1, 0.5]}]
    with pytest.raises(ConfigError) as exc:
        validate_config(grid(losses=losses, temperatures=[0.1, 0.5]))
    assert str(exc.value) == (
        "config key 'grid.losses[1].temperatures' = [0.1, 0.5]: byol takes no temperature, so each τ would "
        "train the same network under another id; give one τ, e.g. [0.1]"
    )
    cfg = validate_config(grid(losses=["vicreg", "simsiam"], temperatures=[0.1, 0.5]))
    assert sorted(expand_cells(cfg)) == ["digits/simsiam/bs16-t0.1-s0", "digits/vicreg/bs16-t0.1-s0"]
    assert temperature_notes(cfg)[0].startswith("note: vicreg and simsiam take no temperature: planned once")


def test_a_knn_headline_k_outside_knn_k_is_one_line_before_any_job():
    cfg = validate_config({**grid(), "eval": {"knn_k": [5, 20], "knn_primary_k": 5}})
    assert cfg["eval"]["knn_primary_k"] == 5
    assert validate_config(grid())["eval"]["knn_primary_k"] is None  # the default: the largest k, as before
    with pytest.raises(ConfigError, match=r"eval.knn_primary_k = 50 is not one of eval.knn_k \(5, 20\); name one"):
        validate_config({**grid(), "eval": {"knn_k": [5, 20], "knn_primary_k": 50}})


def test_a_loss_parameter_with_two_defaults_is_refused():
    """A parameter's default is declared once (its schema's), which the config and build_loss share."""
    from smallbatch.losses import registry

    with pytest.raises(ValueError, match=r"loss 'toy': parameter 'beta' has two defaults \(1.0 and the schema's 2.0\)"):
        registry.LossSpec(
            name="toy",
            display="Toy",
            paper="a test",
            impl="x:y",
            defaults={"beta": 1.0},
            params={"beta": {"type": "number", "default": 2.0}},
        )


def test_loss_label_names_only_non_default_parameters():
    from smallbatch.study.cells import loss_label

    assert loss_label("flatnce", {"gamma": 1.0}) == "flatnce"
    assert loss_label("flatnce", {"gamma": 2.0}) == "flatnce-gamma2"
    assert loss_label("dclw", {"sigma": 0.5}) == "dclw"
    assert loss_label("eqco", {"alpha": 256}) == "eqco-alpha256"


# --------------------------------------------------------------------------- what the new checks let through
def test_an_infinite_loss_parameter_is_left_to_its_loss():
    # DCLW's sigma = inf is DCL (every weight 1): its loss accepts it, so the config does
    cfg = validate_config(grid(losses=[{"name": "dclw", "sigma": float("inf")}]))
    assert [c["loss_params"] for c in expand_cells(cfg).values()] == [{"sigma": float("inf")}]
    with pytest.raises(ConfigError, match=r"'grid\.losses\[0\]\.sigma' = nan is not a finite number"):
        validate_config(grid(losses=[{"name": "dclw", "sigma": float("nan")}]))


def test_warmup_is_compared_with_epochs_only_when_the_budget_is_in_epochs():
    validate_config({**grid(), "train": {"epochs": 1, "warmup_epochs": 1}})  # warm-up for the whole run
    validate_config({**grid(), "train": {"steps": 5, "epochs": 1, "warmup_epochs": 2}})  # steps: not compared
    with pytest.raises(ConfigError, match=r"train\.warmup_epochs = 2 is longer than train\.epochs = 1"):
        validate_config({**grid(), "train": {"epochs": 1, "warmup_epochs": 2}})


def test_batch_size_equal_to_the_pretraining_images_and_unknown_sizes_pass():
    small = {"datasets": {"digits": {"train_subset": 100}}, "eval": {"knn_k": [20]}}  # k within the subset
    cfg = validate_config({**grid(batch_sizes=[100]), **small})
    assert [c["batch_size"] for c in expand_cells(cfg).values()] == [100]
    with pytest.raises(ConfigError, match="batch size 101 is larger than the 100 pretraining images of digits"):
        validate_config({**grid(batch_sizes=[101]), **small})  # one over
    cfg = validate_config({**grid(batch_sizes=[4096]), "datasets": {"imagefolder": {}}})  # checked once read
    assert [c["batch_size"] for c in expand_cells(cfg).values()] == [4096]


def test_a_batch_size_entry_carries_the_train_keys_that_size_needs():
    """The large end: {size, train} entries set devices / chunk_size for one batch size;
    the cell id stays bs<N> (the batch-size axis extends) and wrong keys or values, or a
    batch not divisible by its devices, stop with one line naming the cell."""
    cfg = validate_config(grid(batch_sizes=[16, {"size": 64, "train": {"devices": 2, "chunk_size": 16}}]))
    cells = expand_cells(cfg)
    assert [(c["batch_size"], c["train"]["devices"], c["train"]["chunk_size"]) for c in cells.values()] == [
        (16, 1, None),
        (64, 2, 16),
    ]
    assert list(cells)[1].endswith("/bs64-t0.1-s0")
    for bad, msg in (
        ({"size": 64, "train": {"devices": "two"}}, r"'train.devices' = 'two' has the wrong type"),
        ({"size": 63, "train": {"devices": 2}}, "not a multiple of train.devices = 2"),
        ({"size": 64, "train": {"devicez": 2}}, r"unknown config key 'train.devicez'"),
        ({"size": 1}, r"grid.batch_sizes\[0\]"),
    ):
        with pytest.raises(ConfigError, match=msg):
            validate_config(grid(batch_sizes=[bad]))


def test_the_large_batch_study_fits_its_devices():
    cfg = load_config(Path(__file__).resolve().parents[2] / "workflow" / "configs" / "large_batch.yaml")
    cells = expand_cells(cfg)
    assert len(cells) == 60
    by_size = {c["batch_size"]: (c["train"]["devices"], c["train"]["chunk_size"]) for c in cells.values()}
    assert by_size == {
        256: (1, None),
        512: (1, None),
        1024: (1, None),
        2048: (1, None),
        4096: (1, 1024),
        8192: (8, None),
    }


def test_the_configuration_reference_is_generated_from_the_schema():
    """CONFIGURATION.md is `smallbatch config-reference`'s output: every key with its
    default and its description, so the reference cannot drift from the schema."""
    from smallbatch.study.config import reference_markdown, reference_rows

    doc = Path(__file__).resolve().parents[2] / "CONFIGURATION.md"
    assert doc.read_text() == reference_markdown(), "regenerate: smallbatch config-reference > CONFIGURATION.md"
    rows = {k: (d, m) for k, d, m in reference_rows()}
    assert all(m for _, m in rows.values()), [k for k, (_, m) in rows.items() if not m]
    assert rows["train.devices"][0] == "1" and rows["loss_params.eqco.alpha"][0] == "256"


def test_default_config_validated_once_and_copied(monkeypatch):
    """load_config(None) validates the empty config once per process (the warm server does it
    before it forks) and hands out copies: a caller's change never reaches the next caller."""
    from smallbatch.study import config as C

    first = C.load_config(None)
    calls = []
    monkeypatch.setattr(C, "validate_config", lambda cfg: calls.append(cfg) or cfg)
    second = C.load_config(None)
    assert calls == [] and second == first and second is not first
    second["train"]["epochs"] = -1
    second["grid"]["losses"].append("nope")
    assert C.load_config(None) == first
    C.load_config(None, {"train": {"epochs": 2}})  # overrides are validated every time
    assert len(calls) == 1
