"""The study grid: expand a validated config into cells with stable ids.

A *cell* is one pretraining run and its evaluations: dataset x loss (with its
parameters) x batch size x temperature x seed (x any extra axis such as
precision).  Its id is readable and stable, e.g. ``fashion_mnist/flatnce/bs32-t0.1-s0``;
its *hash* covers its id and every resolved setting that changes the science, the
data's identity among them (data set, image size, subsets and a digest of the source
files, :mod:`smallbatch.data.digest`), but not where the data live, the device or the
thread count: a changed config is a new MLflow run, and a cell file edited to carry
another cell's id fails its hash check.

Side experiments (``experiments:`` in config.yaml) add cells under their own
prefix, e.g. ``precision/fashion_mnist/infonce/bs16-t0.1-s0-fp64``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable
from typing import Any

from ..data.digest import data_digest
from ..data.registry import base_dataset
from ..io import check_cell_id  # noqa: F401  (the one id check; import-light, for the CLI's fast paths)
from ..losses.registry import canonical_name, label_defaults, loss_param_names, loss_spec
from ..tracking import FORMAT
from .experiments import SIDE_EXPERIMENTS
from .probe_registry import carried
from .schema import load_schema

AXIS_ABBREV = {
    "precision": "",
    "lr_scaling": "lr",
    "epochs": "ep",
    "optimizer": "",
    "queue_size": "q",
    "lr": "lr",
    "steps": "st",
    "neg_group": "ng",
    "bn_group": "bn",
    "mask_same_class": "oracle",
    "extra_negatives": "xn",
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        s = f"{v:g}"
        return s
    return str(v)


#: left out of a cell's hash: the hash itself (it cannot cover itself), and where the data
#: are read from and whether they may be downloaded (``data_digest`` names which data they are)
NAME_KEYS = ("hash",)
WHERE_KEYS = ("data_root", "download")
#: a cell's sections that are a config section's settings: cell key -> the schema path of that
#: section's settings (``train.lr`` of the config is ``cell["train"]["lr"]``)
CELL_SECTIONS = {"train": ("train",), "eval": ("eval",), "dataset_options": ("datasets", "additionalProperties")}


@functools.cache
def _marked(marker: str) -> dict[str, set[str]]:
    """The schema's keys marked ``marker`` by cell section ("" for the cell's top level)."""
    props = load_schema()["properties"]
    sections = {"": props}
    for section, path in CELL_SECTIONS.items():
        node = props
        for part in path:
            node = node[part]
        sections[section] = node.get("properties", {})
    return {section: {k for k, v in keys.items() if v.get(marker)} for section, keys in sections.items()}


def execution_keys() -> dict[str, frozenset[str]]:
    """The settings of how a cell runs, not of what it computes -- the schema's keys marked
    ``x-execution: true`` -- by cell section ("" for the cell's top level): left out of the
    cell's hash, so switching them neither reruns a finished cell nor keeps a state from
    resuming.  Every other setting a cell carries is hashed: a new schema key is part of
    the hash unless the schema marks it."""
    return {section: frozenset(keys) for section, keys in _marked("x-execution").items()}


def cell_hash(cell: dict) -> str:
    """Short hash of the cell's id, its format (:data:`smallbatch.tracking.FORMAT`) and every
    setting of the cell except its execution settings (:func:`execution_keys`), the hash itself
    and the data's location (:data:`NAME_KEYS`, :data:`WHERE_KEYS`)."""
    return settings_hash(hashed_settings(cell))


def hashed_settings(cell: dict) -> dict:
    """What :func:`cell_hash` hashes: the cell less the settings it leaves out -- the payload a
    change of a hash is read from."""
    skip = execution_keys()
    skip = {**skip, "": skip[""] | set(WHERE_KEYS)}

    def kept(section: str, items) -> dict:
        return {k: v for k, v in items if k not in skip[section]}

    science = kept("", ((k, v) for k, v in cell.items() if k not in NAME_KEYS))
    for section in CELL_SECTIONS:
        if isinstance(science.get(section), dict):
            science[section] = kept(section, science[section].items())
    return science


#: the train settings that set how long a cell trains and where it keeps budgets, and nothing else
BUDGET_KEYS = ("epochs", "steps", "snapshot_epochs")


def trajectory_hash(cell: dict) -> str:
    """The hash of a cell's settings less its budget (:data:`BUDGET_KEYS`): two configs of a cell
    with the same trajectory hash take the same steps, one for longer, when their steps do not
    depend on the budget (:func:`smallbatch.study.checks.budget_dependence`)."""
    science = hashed_settings(cell)
    science["train"] = {k: v for k, v in science["train"].items() if k not in BUDGET_KEYS}
    return settings_hash(science)


def settings_hash(settings: Any) -> str:
    """The short hash (10 hex digits) of a JSON-able value: of a cell's settings
    (:func:`cell_hash`), of a data cache's (:func:`data_cache_settings`), of the MI section."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:10]


def data_cache_settings(cfg: dict, dataset: str) -> dict:
    """What a data set's cache (``smallbatch prepare-data``) holds: the data set, its options
    except where its files are (:func:`execution_keys`), and the digest of its files."""
    data = data_settings(cfg, dataset)
    where = execution_keys()["dataset_options"]
    options = {k: v for k, v in data["dataset_options"].items() if k not in where}
    return {"dataset": dataset, "options": options, "data_digest": data["data_digest"]}


def cell_negatives(train: dict, batch_size: int, loss: str = "infonce") -> int:
    """A cell's K from its train settings (its group, queue, fresh extra images), batch size and loss."""
    neg = train.get("neg_group") or batch_size
    return negatives_per_anchor(neg, train["queue_size"], train.get("extra_negatives"), loss)


def negatives_per_anchor(batch_size: int, queue_size: int, extra: int | None = None, loss: str = "infonce") -> int:
    """K in the papers' sense: 2N-2 in-batch negatives (2(N+E)-2 with E fresh extra images), or
    the queue length; 0 for a method without negatives (its registry entry's ``negatives``)."""
    if not loss_spec(loss).contrastive:
        return 0
    return int(queue_size) if queue_size else 2 * (int(batch_size) + int(extra or 0)) - 2


def _loss_variants(entry: Any, cfg: dict) -> list[tuple[str, dict, dict]]:
    """A grid `losses` entry -> [(canonical name, params, axis overrides)]."""
    if isinstance(entry, str):
        entry = {"name": entry}
    name = canonical_name(entry["name"])
    defaults = dict(cfg.get("loss_params", {}).get(name, {}))
    lists: dict[str, list] = {}
    for p in loss_param_names(name):
        if p in entry:
            v = entry[p]
            lists[p] = list(v) if isinstance(v, list) else [v]
        elif p in defaults:
            lists[p] = [defaults[p]]
    overrides = {k: entry[k] for k in ("batch_sizes", "temperatures", "seeds") if k in entry}
    keys = sorted(lists)
    out = []
    for combo in itertools.product(*(lists[k] for k in keys)):
        out.append((name, dict(zip(keys, combo)), overrides))
    return out


def loss_label(name: str, params: dict) -> str:
    """``name`` plus the parameters that differ from the paper's default, e.g. ``eqco-alpha256``
    (:func:`smallbatch.losses.registry.label_defaults`)."""
    defaults = label_defaults(name)
    return name + "".join(
        f"-{k}{_fmt(v)}" for k, v in sorted(params.items()) if v is not None and (k not in defaults or v != defaults[k])
    )


def data_settings(cfg: dict, dataset: str) -> dict:
    """A cell's data: the data set, its options, where its files are and whether they may be
    downloaded (not hashed: :data:`WHERE_KEYS`), and the digest of their content (hashed)."""
    dopts = copy.deepcopy(cfg["datasets"][dataset])
    root = dopts.get("root") or cfg["data"]["root"]
    download = bool(cfg["data"]["download"])
    return {
        "dataset": dataset,
        "dataset_options": dopts,
        "data_root": root,
        "download": download,
        "data_digest": data_digest(base_dataset(dataset), root, download),
    }


def make_cell(
    cfg: dict,
    *,
    dataset: str,
    loss: str,
    loss_params: dict,
    batch_size: int,
    temperature: float,
    seed: int,
    experiment: str = "grid",
    train_overrides: dict | None = None,
    suffix: str = "",
) -> dict:
    """Resolve one cell: every setting it needs, JSON-serialisable."""
    train = copy.deepcopy(cfg["train"])
    train.update(train_overrides or {})
    prefix = "" if experiment == "grid" else f"{experiment}/"
    cid = (
        f"{prefix}{dataset}/{loss_label(loss, loss_params)}/bs{batch_size}-t{_fmt(float(temperature))}-s{seed}{suffix}"
    )
    cell = {
        "id": cid,
        "format": FORMAT,
        "experiment": experiment,
        **data_settings(cfg, dataset),
        "loss": loss,
        "loss_params": dict(loss_params),
        "batch_size": int(batch_size),
        "temperature": float(temperature),
        "seed": int(seed),
        "negatives": cell_negatives(train, batch_size, loss),
        "train": train,
        "augment": copy.deepcopy(cfg["augment"]),
        "eval": carried(copy.deepcopy(cfg["eval"])),
        "device": cfg["device"],
        "threads": cfg["threads"],
        "tracking": copy.deepcopy(cfg.get("tracking") or {}),  # execution settings: not in the hash
    }
    cell["hash"] = cell_hash(cell)
    return cell


#: train keys a batch-size entry may set that change what a cell computes (the controls of
#: the instrument study, e.g. ``{size: 256, train: {neg_group: 16}}``): they name the cell
#: like an axis does, so two entries of one size never share an id
ENTRY_SUFFIX_KEYS = ("neg_group", "bn_group", "mask_same_class", "extra_negatives", "steps", "lr")


def _batch_entry(entry: Any) -> tuple[int, dict, str]:
    """A ``batch_sizes`` entry: a size, or ``{size, train}`` — the train keys that batch size
    needs (e.g. ``devices``, ``chunk_size`` at the large end: the cell id unchanged; a control
    of ``ENTRY_SUFFIX_KEYS``: its axis suffix added) -> (size, train keys, id suffix)."""
    if isinstance(entry, dict):
        train = dict(entry.get("train") or {})
        suffix = "".join(_axis_suffix(k, train[k]) for k in ENTRY_SUFFIX_KEYS if k in train)
        return int(entry["size"]), train, suffix
    return int(entry), {}, ""


def _axis_overrides(axis: str, value: Any) -> dict:
    """The train keys one axis value sets: the value itself, or a regime's bundle of keys
    (its name kept as ``train.regime``)."""
    if axis == "regime":
        return {**{k: v for k, v in value.items() if k != "name"}, "regime": value["name"]}
    return {axis: value}


def _axis_suffix(axis: str, value: Any) -> str:
    if axis == "regime":
        return f"-{value['name']}"
    if axis == "ess_schedule":
        return "" if value is None else f"-ess{_fmt(float(value['start']))}to{_fmt(float(value['end']))}"
    if value is None or isinstance(value, bool):  # an unset control (null, false) adds nothing; true its name
        return f"-{AXIS_ABBREV.get(axis, axis)}" if value else ""
    return f"-{AXIS_ABBREV.get(axis, axis)}{_fmt(value)}"


def _section_grid(cfg: dict, section: str, sec: dict) -> Iterable[dict]:
    """Cells of a (mini-)grid: losses x batch sizes x temperatures x seeds x axes.

    Missing keys of a side experiment fall back to the main grid's values.
    """
    grid = cfg["grid"]
    axes = sec.get("axes", grid.get("axes", {}) if section == "grid" else {}) or {}
    axis_names = sorted(axes)
    train_over = dict(sec.get("train", {}) or {})
    datasets = sec.get("datasets") or list(cfg["datasets"])
    for dataset in datasets:
        for entry in sec.get("losses", grid["losses"]):
            for loss, params, ov in _loss_variants(entry, cfg):
                bss = ov.get("batch_sizes", sec.get("batch_sizes", grid["batch_sizes"]))
                tss = loss_temperatures(loss, ov.get("temperatures", sec.get("temperatures", grid["temperatures"])))
                sss = ov.get("seeds", sec.get("seeds", grid["seeds"]))
                for combo in itertools.product(*(axes[a] for a in axis_names)):
                    tov = dict(train_over)
                    for a, v in zip(axis_names, combo):
                        tov.update(_axis_overrides(a, v))
                    suffix = "".join(_axis_suffix(a, v) for a, v in zip(axis_names, combo))
                    for entry_bs, t, s in itertools.product(bss, tss, sss):
                        bs, bs_train, bs_suffix = _batch_entry(entry_bs)
                        yield make_cell(
                            cfg,
                            dataset=dataset,
                            loss=loss,
                            loss_params=params,
                            batch_size=bs,
                            temperature=t,
                            seed=s,
                            experiment=section,
                            train_overrides={**tov, **bs_train},
                            suffix=bs_suffix + suffix,
                        )


def loss_temperatures(loss: str, taus: list) -> list:
    """The temperatures a loss's cells take: each of ``taus``; the first alone for a loss without
    a temperature (the registry's ``uses_temperature``: its cells at the others would train the
    same network under other ids, copies that could pass for independent runs)."""
    return list(taus) if loss_spec(loss).uses_temperature else list(taus[:1])


def _enabled_sections(cfg: dict) -> Iterable[tuple[str, dict]]:
    """(config key, section) of the grid and of each side experiment that plans cells."""
    if cfg["grid"]["enabled"]:
        yield "grid", cfg["grid"]
    for name in SIDE_EXPERIMENTS:
        sec = cfg.get("experiments", {}).get(name)
        if sec and sec["enabled"]:
            yield f"experiments.{name}", sec


def temperature_notes(cfg: dict) -> list[str]:
    """One line per section whose temperature axis some of its losses do not have: they are
    planned once (:func:`loss_temperatures`).  ValueError naming the key when a loss entry's own
    ``temperatures`` lists several for a loss without one (an axis written for it alone)."""
    notes = []
    for where, sec in _enabled_sections(cfg):
        taus = sec.get("temperatures", cfg["grid"]["temperatures"])
        key = f"{where}.temperatures" if "temperatures" in sec else "grid.temperatures"
        free = []
        for i, entry in enumerate(sec.get("losses", cfg["grid"]["losses"])):
            name = canonical_name(entry if isinstance(entry, str) else entry["name"])
            own = entry.get("temperatures") if isinstance(entry, dict) else None
            if loss_spec(name).uses_temperature:
                continue
            if own is not None and len(own) > 1:
                raise ValueError(_no_axis(f"{where}.losses[{i}].temperatures", own, [name]))
            if own is None:
                free.append(name)
        if free and len(taus) > 1:
            notes.append(
                f"note: {_take(free)} no temperature: planned once, at τ = {_fmt(float(taus[0]))} "
                f"(the first of {key}), not once per τ"
            )
    return notes


def _no_axis(key: str, taus: list, losses: list[str]) -> str:
    return (
        f"config key '{key}' = {taus}: {_take(losses)} no temperature, so each τ would train the same "
        f"network under another id; give one τ, e.g. [{_fmt(float(taus[0]))}]"
    )


def _take(losses: list[str]) -> str:
    names = list(dict.fromkeys(losses))
    return f"{names[0]} takes" if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]} take"


def _grid_cells(cfg: dict) -> Iterable[dict]:
    if cfg["grid"]["enabled"]:
        yield from _section_grid(cfg, "grid", cfg["grid"])


def _side_cells(name: str) -> Callable[[dict], Iterable[dict]]:
    def cells(cfg: dict) -> Iterable[dict]:
        sec = cfg.get("experiments", {}).get(name)
        if sec and sec["enabled"]:
            yield from _section_grid(cfg, name, sec)

    return cells


# The grid and each side experiment of the registry (smallbatch.study.experiments): cfg -> its cells.
SECTION_CELLS: dict[str, Callable[[dict], Iterable[dict]]] = {
    "grid": _grid_cells,
    **{name: _side_cells(name) for name in SIDE_EXPERIMENTS},
}


def expand_cells(cfg: dict) -> dict[str, dict]:
    """All cells of the study, keyed by cell id (insertion-ordered)."""
    cells: dict[str, dict] = {}
    for fn in SECTION_CELLS.values():
        for cell in fn(cfg):
            check_cell_id(cell["id"])
            if cell["id"] in cells and cells[cell["id"]]["hash"] != cell["hash"]:
                raise ValueError(f"two different cells share the id {cell['id']!r}")
            cells[cell["id"]] = cell
    return cells


def baseline_cells(cfg: dict) -> dict[str, dict]:
    """Raw-pixel and random-init encoder baselines, one per dataset (random-init per seed)."""
    out: dict[str, dict] = {}
    if not cfg["baselines"]:
        return out
    seeds = cfg["grid"]["seeds"]
    for dataset in cfg["datasets"]:
        kinds = [("raw_pixels", None)] + [("random_init", s) for s in seeds]
        sup = cfg.get("supervised_baseline") or {}
        kinds += [("supervised", s) for s in seeds] if sup.get("enabled") else []
        for kind, seed in kinds:
            cid = f"baselines/{dataset}/{kind}" + ("" if seed is None else f"-s{seed}")
            cell = {
                "id": cid,
                "format": FORMAT,
                "experiment": "baseline",
                "baseline": kind,
                **data_settings(cfg, dataset),
                "seed": 0 if seed is None else int(seed),
                "train": copy.deepcopy(cfg["train"]),
                "eval": carried(copy.deepcopy(cfg["eval"])),
                "device": cfg["device"],
                "threads": cfg["threads"],
            }
            if kind == "supervised":  # trained like a cell: its augmentations and a batch size
                cell.update(augment=copy.deepcopy(cfg["augment"]), batch_size=int(sup["batch_size"]))
            cell["hash"] = cell_hash(cell)
            out[cid] = cell
    return out


def flat_params(cell: dict) -> dict[str, str]:
    """Flatten a cell into MLflow params named by the config's dotted keys (``train.lr``,
    ``augment.crop_scale``, ``eval.knn_k``; a loss's own parameters as ``loss.<name>``, the grid's
    axes as ``loss``, ``batch_size``, ``temperature``, ``seed``); values as strings, <= 500 chars."""
    out: dict[str, str] = {}

    def rec(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                rec(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(obj)[:500]

    for k, v in cell.items():
        if k in ("id", "hash"):
            continue
        if k == "loss_params":
            for pk, pv in v.items():
                out[f"loss.{pk}"] = str(pv)
        else:
            rec(k, v)
    return out
