"""Load and validate a study configuration (``config.yaml``).

The schema lives in ``src/smallbatch/resources/config.schema.yaml`` (package data, so an
installed wheel has it; the workflow validates through this module); this module validates against the same file, fills the schema's
defaults, and turns the first schema violation into a one-line error that names
the offending key and the allowed values, so a typo stops the study before any
job runs.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ..data import augment_config as _aug
from ..data.registry import base_dataset, dataset_spec, pretrain_split, split_sizes, subset_problem
from ..io import add_results_folder, read_problem, text_problem
from ..losses.registry import canonical_name, loss_param_names
from ..tracking import tracking_uri_problem
from .cell import Cell
from .cellcheck import cell_problem
from .cells import expand_cells, temperature_notes
from .experiments import SIDE_EXPERIMENTS, SPECS, needs_problem
from .probe_registry import probes_problem
from .schema import load_schema
from .schema import one_line as _one_line
from .schema import validator_with_defaults as _validator_with_defaults
from .yaml12 import ambiguities, too_large, yaml12


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming the key."""


def validate_config(cfg: dict) -> dict:
    """Validate ``cfg`` in place against the schema, fill defaults, return it.

    Raises :class:`ConfigError` with one line naming the first offending key.
    """
    schema = load_schema()
    errors = list(_validator_with_defaults()(schema).iter_errors(cfg))
    if errors:
        # the deepest error is the most specific one (jsonschema's best_match prefers shallow ones)
        raise ConfigError(_one_line(max(errors, key=lambda e: len(e.absolute_path)), schema))
    _check_texts(cfg)
    _check_loss_entries(cfg)
    _check_probes(cfg)
    _check_sections(cfg)
    _check_augment(cfg)
    _check_tracking_uri(cfg)
    _check_subsets(cfg)
    _check_cells(cfg)
    return cfg


def check_value(node: dict, value: Any, label: str) -> None:
    """Validate one value (e.g. a command-line flag's) against a schema node such as a
    loss parameter's; ConfigError naming ``label``."""
    errors = list(_validator_with_defaults()(node).iter_errors(value))
    if errors:
        raise ConfigError(_one_line(errors[0], node, label))


def _check_texts(cfg: dict) -> None:
    """Every path, name and URI of the config by the one rule of text
    (:func:`smallbatch.io.text_problem`); ``results_dir`` also without braces (the workflow's
    file patterns)."""
    texts = [("study", cfg.get("study"), "name"), ("results_dir", cfg.get("results_dir"), "path")]
    texts += [("data.root", (cfg.get("data") or {}).get("root"), "path")]
    texts += [
        (f"datasets.{n}.root", o.get("root"), "path") for n, o in cfg["datasets"].items() if o.get("root") is not None
    ]
    texts += [("tracking_uri", cfg["tracking_uri"], "uri")] if cfg.get("tracking_uri") is not None else []
    for key, value, kind in texts:
        problem = text_problem(value, kind)
        if problem:
            raise ConfigError(f"config key '{key}' {problem}")
    bad = sorted({c for c in cfg["results_dir"] if c in "{}"})
    if bad:
        raise ConfigError(
            f"config key 'results_dir' = {cfg['results_dir']!r} holds {', '.join(map(repr, bad))}, which a results "
            "path may not hold (braces name the workflow's wildcards); rename the folder"
        )


def _check_loss_entries(cfg: dict) -> None:
    """A loss entry ``{name: dclw, sigma: ...}`` holds only parameters of its own loss (the
    schema accepts every loss's parameters on every entry)."""
    sections = [("grid", cfg.get("grid") or {})]
    sections += [
        (f"experiments.{n}", sec) for n, sec in (cfg.get("experiments") or {}).items() if isinstance(sec, dict)
    ]
    for where, sec in sections:
        for i, entry in enumerate(sec.get("losses") or []):
            if not isinstance(entry, dict):
                continue
            name = canonical_name(entry["name"])
            allowed = loss_param_names(name)
            for key in entry:
                if key not in ("name", "batch_sizes", "temperatures", "seeds") and key not in allowed:
                    raise ConfigError(
                        f"config key '{where}.losses[{i}].{key}' is not a parameter of {name}; "
                        f"its parameters: {', '.join(allowed) or 'none'}"
                    )


def _check_probes(cfg: dict) -> None:
    """``eval.probes`` names probes of the registry, each once (:mod:`smallbatch.study.probe_registry`)."""
    problem = probes_problem(cfg["eval"]["probes"])
    if problem:
        raise ConfigError(problem)


def _check_sections(cfg: dict) -> None:
    """The side experiments' train overrides and data sets (free-form in the schema)."""
    for name, sec in cfg.get("experiments", {}).items():
        if name not in SIDE_EXPERIMENTS or not isinstance(sec, dict):
            continue
        tr = sec.get("train", {}) or {}
        known = set(load_schema()["properties"]["train"]["properties"])
        for k in tr:
            if k not in known:
                hint = difflib.get_close_matches(k, sorted(known), n=1)
                sugg = f" (did you mean '{hint[0]}'?)" if hint else ""
                raise ConfigError(
                    f"unknown config key 'experiments.{name}.train.{k}'{sugg}; allowed: {', '.join(sorted(known))}"
                )
        for ds in sec.get("datasets", []) or []:
            if ds not in cfg.get("datasets", {}):
                raise ConfigError(
                    f"config key 'experiments.{name}.datasets' names {ds!r}, which is not under 'datasets' ({', '.join(cfg.get('datasets', {}))})"
                )


def _check_augment(cfg: dict) -> None:
    try:
        _aug.AugmentConfig(**cfg.get("augment", {}))
    except TypeError as exc:
        fields = sorted(_aug.AugmentConfig.__dataclass_fields__)
        m = re.search(r"argument '(\w+)'", str(exc))
        bad = m.group(1) if m else "?"
        raise ConfigError(f"unknown config key 'augment.{bad}'; allowed keys here: {', '.join(fields)}") from None
    except ValueError as exc:
        raise ConfigError(f"config key 'augment': {exc}") from None


def _check_tracking_uri(cfg: dict) -> None:
    uri = cfg.get("tracking_uri")
    problem = tracking_uri_problem(uri) if uri else None
    if problem:
        raise ConfigError(f"config key 'tracking_uri' = {uri!r}: {problem}")


def _check_subsets(cfg: dict) -> None:
    """``train_subset`` / ``test_subset`` against the size of the split they subset
    (data.split_sizes; imagefolder's size is checked when it is read)."""
    for name, opts in cfg["datasets"].items():
        sizes = split_sizes(name)
        if sizes is None:
            continue
        for option, split in (("train_subset", pretrain_split(name)), ("test_subset", "test")):
            problem = subset_problem(
                f"config key 'datasets.{name}.{option}'", opts.get(option), sizes[split], split, name
            )
            if problem:
                raise ConfigError(problem)


def _check_cells(cfg: dict) -> None:
    """Each cell's batch size against its pretraining images (where their number is
    known), its warm-up against its budget, and its loss's own checks of its parameters."""
    try:
        temperature_notes(cfg)  # a temperature axis of no loss
        cells = expand_cells(cfg)
    except ValueError as exc:  # that, or two cells with one id
        raise ConfigError(str(exc)) from None

    for cid, cell in cells.items():
        problem = cell_problem(Cell.of(cell))
        if problem:
            raise ConfigError(f"cell '{cid}': {problem}")
    _check_side_needs(cfg, cells)


def _check_side_needs(cfg: dict, cells: dict[str, dict]) -> None:
    """A study plans cells, and each enabled side experiment's cells span what it computes
    (its registry entry's needs: two rates to fit an exponent, two τ to sweep, ...)."""
    own_jobs = [n for n, s in SPECS.items() if not s.grid and (cfg.get("experiments", {}).get(n) or {}).get("enabled")]
    if not cells and not own_jobs:
        raise ConfigError(
            "the study plans 0 cells: config key 'grid.enabled' is false and no side experiment is enabled; "
            "enable the grid or a side experiment"
        )
    for name in SIDE_EXPERIMENTS:
        sec = cfg.get("experiments", {}).get(name) or {}
        mine = [Cell.of(c) for c in cells.values() if c["experiment"] == name]
        problem = needs_problem(name, mine) if sec.get("enabled") else None
        if problem:
            raise ConfigError(problem)


def check_data_roots(cfg: dict) -> None:
    """Every data set of a validated study has its files under its root (or
    ``data.download`` is on); otherwise a one-line ConfigError naming the key.
    The workflow calls this so a wrong root stops ``snakemake -n``, before any job."""
    if cfg["data"].get("download"):
        return
    for name, opts in cfg["datasets"].items():
        spec = dataset_spec(base_dataset(name))  # composites read their base's files
        if spec.folder is None:  # no files of its own (digits ships inside scikit-learn)
            continue
        key = f"datasets.{name}.root" if opts.get("root") else "data.root"
        root = Path(opts.get("root") or cfg["data"]["root"]).expanduser()
        ok = (root / spec.folder).is_dir()
        need = f"{root}/{spec.folder}/" + (f" ({spec.files})" if spec.files else "")
        if spec.apt_folder is not None:
            ok = ok or Path(spec.apt_folder).is_dir()
            need += f" or {spec.apt_folder}/ (apt-get install {spec.apt_package})"
        if not ok:
            raise ConfigError(
                f"config key '{key}' = '{root}': no {name} files there (expected {need}); "
                "fix the root or set data.download: true (for one run: --set data.download=true; "
                "snakemake --config set=data.download=true)"
            )


def check_results_dir(cfg: dict) -> None:
    """``results_dir`` is a folder this process can write in, or can be created where its
    nearest existing parent is; otherwise a one-line ConfigError.  Nothing is left behind
    (a dry run writes nothing): the check writes one temporary file and removes it."""
    path = Path(cfg["results_dir"]).expanduser()
    key = f"config key 'results_dir' = '{path}'"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} is a file, not a folder")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key} is not writable: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"{key} is not writable: {exc.strerror or exc}") from None


def read_config_file(path: str | Path) -> dict:
    """The mapping in YAML file ``path``; ConfigError naming the file (and for a syntax
    error its line and column) when it is missing, not YAML, empty or not a mapping."""
    p = Path(path)
    problem = read_problem(p)
    if problem == "does not exist":
        raise ConfigError(f"config file not found: {p}")
    if problem:
        raise ConfigError(f"config file {p} {problem}; name a YAML file")
    try:
        with open(p) as fh:
            cfg = yaml.load(fh, Loader=_UniqueKeyLoader)
    except _DuplicateKey as exc:
        raise ConfigError(
            f"config file {p} has the key {exc.key!r} twice in one mapping (line {exc.first} and "
            f"line {exc.line}); YAML would keep only the second: merge them"
        ) from None
    except _Ambiguous as exc:
        raise ConfigError(f"config file {p}: {exc}") from None
    except RecursionError:
        raise ConfigError(
            f"config file {p} nests its values too deep to be read; no config key nests so deep"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {p} is not valid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if cfg is None:
        raise ConfigError(
            f"config file {p} is empty (no settings, only blanks or comments); write {{}} for a study of every default"
        )
    if not isinstance(cfg, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, not a {type(cfg).__name__}")
    return cfg


class _DuplicateKey(ValueError):
    def __init__(self, key: Any, first: int, line: int) -> None:
        super().__init__(key)
        self.key, self.first, self.line = key, first, line


class _Ambiguous(ValueError):
    """A form YAML 1.1 and YAML 1.2 read differently, or a tree too large once its aliases are
    expanded (:mod:`.yaml12`): refused before its values are built."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error, not a silent override,
    and so is a form that YAML 1.1 and 1.2 read differently (:func:`.yaml12.ambiguities`)."""

    def construct_document(self, node):
        problem = too_large(node) or next(ambiguities(self, node), None)
        if problem:
            raise _Ambiguous(problem)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_PLAIN = "tag:smallbatch,2026:yaml12-plain"


class _Yaml12Loader(_UniqueKeyLoader):
    """One ``--set`` value: every plain scalar read by YAML 1.2's rules (:func:`.yaml12.yaml12`);
    quoted and explicitly tagged ones as YAML reads them; a key given twice is an error."""

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0]:
            return _PLAIN
        return super().resolve(kind, value, implicit)

    def construct_document(self, node):  # YAML 1.2 alone reads it: no 1.1 reading to differ from
        problem = too_large(node)  # an alias bomb is refused on the command line as in a file
        if problem:
            raise _Ambiguous(problem)
        return yaml.SafeLoader.construct_document(self, node)


_Yaml12Loader.add_constructor(_PLAIN, lambda loader, node: yaml12(node.value))


#: what load_config reads: one config file, several (laid over one another in order), or none
ConfigFiles = str | Path | list[str | Path] | tuple[str | Path, ...] | None


@functools.lru_cache(maxsize=1)
def _default_config() -> dict:
    """The validated empty config, made once per process (callers get copies)."""
    return validate_config({})


def load_config(path: ConfigFiles = None, overrides: dict | None = None, sets: list[str] | None = None) -> dict:
    """The validated study config of YAML file ``path``, or of a list of files laid one over
    another in order (:func:`_lay_over`), then the ``KEY=VALUE`` overrides ``sets``
    (:func:`read_sets`) laid over them as one more file, then ``overrides`` (a mapping); the
    schema's defaults fill what none sets.  The one reader of config files: the CLI's repeated
    ``--config`` and ``--set`` and the workflow's ``--configfile A B`` and ``--config set=...``
    all come here (and print :func:`base_notice` when the first file names no study).  The empty
    config's validation (its 80 default cells are checked) is done once per process (every
    ``--cell-json`` step reads it; the warm server does it before it forks).  Its ``results_dir``
    is held (:func:`smallbatch.io.add_results_folder`): nothing is written there through a link."""
    paths = _paths(path)
    if not paths and not overrides and not sets:
        cfg = copy.deepcopy(_default_config())
    else:
        cfg = {}
        for p in paths:
            cfg = _lay_over(cfg, read_config_file(p), p)
        if sets:
            cfg = _lay_over(cfg, read_sets(sets), "--set")
        cfg = _validated(deep_merge(cfg, overrides) if overrides else cfg, paths)
    if cfg.get("results_dir"):
        add_results_folder(cfg["results_dir"])
    return cfg


def _validated(cfg: dict, paths: list) -> dict:
    """:func:`validate_config` of ``cfg``, read from ``paths``; a value nested too deep to be
    walked is a ConfigError naming the files instead of Python's recursion error."""
    try:
        return validate_config(cfg)
    except RecursionError:
        where = f"config file {', '.join(map(str, paths))}" if paths else "the config"
        raise ConfigError(f"{where} nests its values too deep to be checked; no config key nests so deep") from None


#: the key of Snakemake's ``--config`` that carries the ``--set`` pairs: ``--config set='grid.seeds=[0] train.epochs=2'``
SET_KEY = "set"
#: a dotted config key as ``--set`` takes it: names of letters, digits, '_' and '-' joined by dots
_SET_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z0-9_][\w-]*)*")


def read_sets(pairs: list[str]) -> dict:
    """The overlay that ``--set`` pairs ``KEY=VALUE`` make: ``grid.seeds=[0]`` is
    ``{grid: {seeds: [0]}}``; each VALUE a YAML 1.2 scalar or flow collection (:func:`read_set_value`),
    later pairs merged into earlier ones.  ConfigError naming the pair when it is not
    ``KEY=VALUE`` or its key is given twice."""
    doc: dict = {}
    seen: set[str] = set()
    for pair in pairs:
        key, _, text = pair.partition("=")
        key = key.strip()
        if not looks_like_override(pair):
            raise ConfigError(
                f"override {pair!r} is not KEY=VALUE with a dotted config key; write e.g. grid.seeds=[0] train.epochs=2"
            )
        if key in seen:
            raise ConfigError(f"override '{key}' is given twice; give each key once")
        seen.add(key)
        value: Any = read_set_value(text, key)
        for part in reversed(key.split(".")):
            value = {part: value}
        doc = deep_merge(doc, value)
    return doc


def looks_like_override(text: str) -> bool:
    """``text`` is ``KEY=VALUE`` with a dotted config key (what ``--set`` takes)."""
    key, eq, _ = text.partition("=")
    return bool(eq) and _SET_KEY.fullmatch(key.strip()) is not None


def snakemake_settings(settings: dict) -> dict:
    """Snakemake's ``--config KEY=VALUE`` pairs (but ``set``) as YAML 1.2 reads their values:
    Snakemake reads a value that is no number with YAML's base loader, every scalar as text, so
    ``grid={seeds: [0]}`` would hold the text '0' and ``keep_features=true`` the text 'true'."""

    def typed(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: typed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [typed(v) for v in value]
        return yaml12(value) if isinstance(value, str) else value

    return {k: typed(v) for k, v in settings.items() if k != SET_KEY}


def snakemake_sets(value: Any) -> list[str]:
    """The pairs of Snakemake's ``--config set='KEY=VALUE KEY=VALUE'``: split at the blanks outside
    brackets and quotes (:func:`split_pairs`).  Snakemake has read the word as YAML 1.1 first: a
    pair holding ': ' (``datasets.digits={image_size: 8}``) came back as a one-key mapping, put
    back here; any other non-text is a ConfigError saying how to write it."""
    if isinstance(value, dict) and len(value) == 1 and all(isinstance(x, str) for x in (*value, *value.values())):
        value = "".join(f"{k}: {v}" for k, v in value.items())
    if not isinstance(value, str):
        raise ConfigError(
            f"--config {SET_KEY}={value!r} is not KEY=VALUE pairs; write them as one quoted word, "
            f"e.g. --config {SET_KEY}='grid.seeds=[0] train.epochs=2'"
        )
    return split_pairs(value)


def split_pairs(text: str) -> list[str]:
    """``text`` split at its blanks outside brackets and quotes: ``a=[0, 1] b='x y'`` is
    ``["a=[0, 1]", "b='x y'"]`` (no shell reads it)."""
    pairs, word, depth, quote = [], "", 0, ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c.isspace() and depth <= 0:
            pairs.append(word)
            word = ""
            continue
        word += c
    return [p for p in [*pairs, word] if p]


def read_set_value(text: str, key: str) -> Any:
    """``--set KEY=TEXT``'s value: ``text`` read as YAML 1.2 reads it (``1e-3`` a number, ``yes``
    and ``010`` what they say), a flow collection (``[0, 1]``, ``{image_size: 8}``) too; no shell
    and no other reader sees it.  ConfigError naming ``key`` when it is not YAML."""
    loader = _Yaml12Loader(text)
    try:
        return loader.get_single_data()
    except _DuplicateKey as exc:
        raise ConfigError(f"override '{key}': the key {exc.key!r} is given twice in one mapping") from None
    except _Ambiguous as exc:
        raise ConfigError(f"override '{key}': {exc}") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"override '{key}' = {text} is not a YAML value ({problem}); quote text, e.g. {key}='{text}'"
        ) from None
    finally:
        loader.dispose()


def sets_line(sets: list[str] | None) -> str | None:
    """The one line a plan prints for its ``--set`` overrides (each key with its value as read),
    e.g. ``overrides: grid.seeds = [0], train.epochs = 2``; None without any."""
    if not sets:
        return None
    shown = []
    for pair in sets:
        key, _, text = pair.partition("=")
        shown.append(f"{key.strip()} = {_yaml_flow(read_set_value(text, key.strip()))}")
    return "overrides: " + ", ".join(shown)


def base_notice(path: ConfigFiles) -> str | None:
    """The one line to print once config files ``path`` (as :func:`load_config` takes them) have
    been used, when the first names no ``study`` (an overlay given alone, most likely): what it
    was laid over.  None otherwise."""
    paths = _paths(path)
    if not paths or "study" in read_config_file(paths[0]):
        return None
    return (
        f"note: {paths[0]} names no study, so it was laid over the schema's defaults (CONFIGURATION.md), "
        "not over config.yaml; to overlay config.yaml, name config.yaml first"
    )


def _paths(path: ConfigFiles) -> list[str | Path]:
    return [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)


#: the top-level key of a config file that lists the keys it sets whole (not merged key by key)
REPLACE = "replace"


def _lay_over(base: dict, doc: dict, source: str | Path) -> dict:
    """Config file ``source``'s mapping ``doc`` laid over ``base``: merged key by key (a
    mapping into the mapping before it; a list or a value replaces the one before), except the
    keys its top-level ``replace:`` list names (dotted, e.g. ``[datasets, grid.losses]``): those
    are taken from ``doc`` as they are -- or, absent from it, dropped, so the schema's default
    applies.  An unknown key in ``replace`` is a ConfigError naming it."""
    doc = dict(doc)
    keys = doc.pop(REPLACE, [])
    _check_replace(keys, source)
    out = deep_merge(base, doc)
    for key in keys:
        *parents, last = key.split(".")
        here: Any = out
        there: Any = doc
        for part in parents:
            here = here.get(part) if isinstance(here, dict) else None
            there = there.get(part) if isinstance(there, dict) else None
        if not isinstance(here, dict):  # no mapping holds it (the schema names a wrong type)
            continue
        if isinstance(there, dict) and last in there:
            here[last] = copy.deepcopy(there[last])
        else:
            here.pop(last, None)
    return out


def _check_replace(keys: Any, source: str | Path) -> None:
    """ConfigError naming config file ``source`` when its ``replace:`` is not a list of config
    keys (dotted paths of the schema; a free-form name such as ``datasets.cifar10`` too)."""
    where = f"config file {source}: '{REPLACE}'"
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{where} must be a list of config keys, e.g. [datasets, grid.losses], not {keys!r}")
    schema = load_schema()
    for key in keys:
        node = schema
        done: list[str] = []
        for part in key.split("."):
            node = _resolve_ref(schema, node)
            props, extra = node.get("properties", {}), node.get("additionalProperties")
            names = node.get("propertyNames", {}).get("enum")
            if part in props:
                node = props[part]
            elif isinstance(extra, dict) and (names is None or part in names):
                node = extra
            else:
                hint = difflib.get_close_matches(part, sorted(props) + list(names or []), n=1)
                near = f" (did you mean '{'.'.join([*done, hint[0]])}'?)" if hint else ""
                raise ConfigError(
                    f"{where} names '{key}', which is not a config key{near}; every key: CONFIGURATION.md"
                )
            done.append(part)


def _resolve_ref(schema: dict, node: dict) -> dict:
    """A schema node with its ``$ref`` to ``#/$defs/...`` filled in (its own keys win)."""
    ref = node.get("$ref", "")
    return {**schema["$defs"][ref.rsplit("/", 1)[-1]], **node} if ref.startswith("#/$defs/") else node


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve_tracking_uri(cfg: dict) -> str:
    """config ``tracking_uri`` > ``$MLFLOW_TRACKING_URI`` > SQLite under results_dir."""
    uri = cfg.get("tracking_uri")
    if uri:
        return str(uri)
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        problem = tracking_uri_problem(env)
        if problem:
            raise ConfigError(f"$MLFLOW_TRACKING_URI = {env!r}: {problem}")
        return env
    db = Path(cfg["results_dir"]).resolve() / "mlflow.db"
    return f"sqlite:///{db}"


# --------------------------------------------------------------------------- the reference
def reference_rows(schema: dict | None = None) -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every configuration key, from the schema's descriptions
    and defaults (CONFIGURATION.md is generated from these; a test keeps it so)."""
    schema = schema or load_schema()
    rows: list[tuple[str, str, str]] = []
    done: set[str] = set()

    def walk(node: dict, path: str) -> None:
        props = node.get("properties", {})
        refs = [sub.get("$ref") for sub in props.values()]
        shared = {r for r in refs if r and refs.count(r) > 1}  # e.g. the side experiments' sections
        for key, sub in props.items():
            ref = sub.get("$ref")
            sub = _resolve_ref(schema, sub)
            name = f"{path}.{key}" if path else key
            default = _yaml_flow(sub["default"]) if "default" in sub else ""
            rows.append((name, default, " ".join(str(sub.get("description", "")).split())))
            if ref in shared:
                if ref not in done:  # their common keys once, as <path>.<name>.<key>
                    done.add(ref)
                    walk(sub, f"{path}.<{ref.rsplit('/', 1)[-1]}>")
            else:
                walk(sub, name)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and "properties" in extra:  # free-form names, e.g. datasets.<name>
            walk(extra, f"{path}.<name>")

    walk(schema, "")
    at = next((i for i, r in enumerate(rows) if r[0] == "augment"), None)
    return rows if at is None else rows[: at + 1] + _augment_rows() + rows[at + 1 :]


def _augment_rows() -> list[tuple[str, str, str]]:
    """The augment.<key> rows, from :class:`smallbatch.data.augment.AugmentConfig` (the schema leaves the section
    to it): a key left unset takes its recipe's value, each recipe's listed."""
    from ..data.augment import AugmentConfig

    return [
        (
            f"augment.{key}",
            _yaml_flow(default) if default is not None else "",
            meaning + ("" if not per else "; unset: " + ", ".join(f"{r} {_yaml_flow(_g(v))}" for r, v in per.items())),
        )
        for key, default, meaning, per in AugmentConfig.reference()
    ]


def _g(v: Any) -> Any:
    """A float (or a list of them) to 4 significant digits: 4/3 as 1.333."""
    if isinstance(v, list):
        return [_g(x) for x in v]
    return float(f"{v:.4g}") if isinstance(v, float) else v


def _yaml_flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def reference_markdown() -> str:
    """CONFIGURATION.md: the table of every key (``smallbatch config-reference`` prints it)."""
    head = (
        "# Configuration reference\n\n"
        "Generated from `src/smallbatch/resources/config.schema.yaml` (and the loss registry in "
        "`smallbatch.losses`, the probe registry `smallbatch.study.probe_registry`) by `smallbatch config-reference > CONFIGURATION.md`; "
        "a test fails when this file and the schema differ.\n\n"
        "## Several files\n\n"
        "`snakemake --configfile A B C` and `smallbatch <command> --config A --config B --config C` "
        "read the same config: the files laid one over another in order, then the one-off overrides "
        "`smallbatch <command> --set grid.seeds=[0] train.epochs=2` (`snakemake --config "
        "set='grid.seeds=[0] train.epochs=2'`) as one more file (dotted keys, values read as YAML 1.2, "
        "printed with the plan), then Snakemake's other `--config KEY=VALUE` pairs (their values read as YAML 1.2) "
        "(`smallbatch.study.config.load_config`).\n\n"
        "- A later file is merged into the earlier ones key by key: a mapping (`datasets`, `train`, "
        "`experiments.mi`, ...) keeps the earlier file's keys it does not set; a list or a value replaces "
        "the earlier one whole.\n"
        f"- A file's top-level `{REPLACE}:` lists keys (dotted, e.g. `[datasets, train, grid.losses]`) "
        "that it sets whole: each is taken from this file as written, or, when this file leaves it out, "
        "dropped to its default below. So `datasets: {cifar10: {}}` with `replace: [datasets]` studies "
        "CIFAR-10 alone; without it, the earlier files' data sets stay. A name that is no config key is refused.\n"
        "- The first file is laid over the defaults below, not over `config.yaml`: name `config.yaml` first "
        "to overlay it. A first file that names no `study` (an overlay given alone) gets a one-line notice "
        "on stderr.\n\n"
        "## Every key\n\n"
        "| key | default | meaning |\n|---|---|---|\n"
    )
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731
    return head + "".join(
        f"| `{k}` | {('`' + cell(d) + '`') if d else ''} | {cell(m)} |\n" for k, d, m in reference_rows()
    )
