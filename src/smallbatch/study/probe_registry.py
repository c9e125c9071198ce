"""The probe registry: every evaluation probe's name, settings, metrics and file, without torch.

One :class:`ProbeSpec` per probe of a cell's frozen features, in :data:`SPECS` (the order the
evaluate step runs them and tables show them).  Everything that only needs to *name* a probe
-- the cell's settings and the config's check of ``eval.probes``, the evaluate step's
result files (``<cell>/<probe>.json``), the workflow's outputs, the CLI's probe commands,
the report's metric columns and labels -- reads this module, which imports nothing heavier
than the standard library (``import smallbatch.study.probe_registry`` loads no torch).  What the
probe computes lives in its function (``spec.impl``, loaded by :func:`probe_function`):
``run(features, settings) -> metrics``, where ``features`` is ``(train_x, train_y,
test_x, test_y)`` and ``settings`` maps each of the spec's ``settings`` (``eval.<key>``) to
the cell's value, plus ``seed`` (the cell's) and ``knn_backend`` (the neighbour search's).
Its metrics are logged to the cell's run as ``<probe>/<metric>``; an accuracy (a key holding
``top1`` or ``top5``) is returned as a fraction and logged in percent.

Adding a probe is its function plus its entry here: a setting of its own is declared in its
``params`` (one JSON schema per ``eval.<key>``, with its default and description), which
the config schema's ``eval`` section, CONFIGURATION.md and the cell's
:meth:`~smallbatch.study.cell.EvalSettings.setting` take from here.  Every cell carries every
probe's own settings at their values, defaults included, and its hash covers them: a new
setting moves every cell's hash, an opt-in probe without one moves none.  ``eval.probes``
chooses the probes a study runs (default: :data:`DEFAULT_PROBES`).

An installed package adds a probe without editing smallbatch: a :class:`ProbeSpec` named by an
entry point of the group :data:`PLUGIN_GROUP` (:func:`all_specs`, read once per process).  A
plugin's probe is opt-in, and only a cell that runs it carries (and hashes) its settings, so
installing one moves no cell's hash.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ..errors import PluginError, loaded_entries

__all__ = [
    "ProbeSpec",
    "SPECS",
    "all_specs",
    "DEFAULT_PROBES",
    "probe_spec",
    "probe_names",
    "probe_function",
    "probes_problem",
    "report_metrics",
    "report_labels",
    "probe_schema",
    "probe_params",
    "param_defaults",
    "carried",
]


@dataclass(frozen=True)
class ProbeSpec:
    """One probe of the registry.

    ``name``: the registry name (``eval.probes``, the CLI command, the result file
    ``<name>.json``, the metrics' prefix); ``title``: what it does (the command's help);
    ``impl``: ``"<module>:<function>"``, the module relative to :mod:`smallbatch.evaluation`
    when it starts with a dot; ``settings``: the ``eval.<key>`` it reads; ``flags``: those of
    them a probe command overrides for a look by hand; ``metric``: its headline metric
    (logged as ``<name>/<metric>``; the report's column, labelled ``label``); ``threads``:
    it sets torch's threads to the cell's; ``chance_collapses``: a headline at chance level
    marks the cell collapsed; ``default``: run by every study unless ``eval.probes`` says
    otherwise; ``params``: the schema of each setting of its own (``eval.<key>``; the settings
    it shares, or that came before the registry, are the YAML schema's); ``qualifier``: the metric
    (``<name>/<qualifier>``) that holds the headline's own setting, named beside its label in the
    report (kNN's k)."""

    name: str
    title: str
    impl: str
    metric: str
    label: str
    settings: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    threads: bool = False
    chance_collapses: bool = False
    default: bool = False
    params: dict[str, dict] = field(default_factory=dict)
    qualifier: str = ""

    def __post_init__(self) -> None:
        if set(self.params) - set(self.settings):
            raise ValueError(
                f"probe {self.name!r}: params {sorted(set(self.params) - set(self.settings))} are no setting"
            )
        if set(self.flags) - set(self.settings):
            raise ValueError(
                f"probe {self.name!r}: flags {sorted(set(self.flags) - set(self.settings))} are no setting"
            )
        if ":" not in self.impl:
            raise ValueError(f"probe {self.name!r}: impl must be '<module>:<function>', not {self.impl!r}")

    @property
    def file(self) -> str:
        """The evaluate step's result file in the cell's folder (and its status)."""
        return f"{self.name}.json"

    @property
    def key(self) -> str:
        """The MLflow metric key of the headline metric."""
        return f"{self.name}/{self.metric}"


SPECS: dict[str, ProbeSpec] = {
    s.name: s
    for s in (
        ProbeSpec(
            name="knn",
            title="weighted kNN (InstDisc) on a cell's frozen features: faiss, or torch on a GPU without faiss-gpu",
            impl=".knn:run_probe",
            metric="top1",
            label="kNN top-1",
            settings=("knn_k", "knn_t", "knn_primary_k"),
            flags=("knn_k", "knn_t"),
            chance_collapses=True,
            default=True,
            qualifier="k",
            params={
                "knn_primary_k": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "default": None,
                    "description": "the k of the kNN headline (knn/top1, the report's kNN top-1; knn/k logs it), "
                    "one of knn_k; null: the largest of knn_k (200 of the default [20, 200]; config.yaml "
                    "lists [20] alone). Every k's top-1 is logged as knn/top1_k<k>",
                }
            },
        ),
        ProbeSpec(
            name="linear",
            title="linear probe on a cell's frozen features",
            impl=".probes:run_probe",
            metric="top1",
            label="linear top-1",
            settings=(
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
            flags=("linear_iterations", "linear_weight_decay", "linear_weight_decays", "linear_optimizer"),
            threads=True,
            default=True,
        ),
        ProbeSpec(
            name="kmeans",
            title="k-means of a cell's frozen test features into as many clusters as classes: NMI with the labels",
            impl=".kmeans:run_probe",
            metric="nmi",
            label="k-means NMI",
            settings=("kmeans_iterations",),
            flags=("kmeans_iterations",),
            threads=True,
            params={
                "kmeans_iterations": {
                    "type": "integer",
                    "minimum": 1,
                    "default": 50,
                    "description": "the k-means probe's Lloyd iterations at most (it clusters the test features "
                    "into as many clusters as classes, seed 0; kmeans/nmi: NMI with the labels x 100)",
                }
            },
        ),
    )
}

#: the probes a study runs when ``eval.probes`` is not set
DEFAULT_PROBES: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.default)

# --------------------------------------------------------------------------- plugins
#: the entry-point group an installed package declares its probes in
PLUGIN_GROUP = "smallbatch.probes"
#: what a plugin's name may hold (``eval.probes``, a command, a result file, a metric prefix)
PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


@functools.cache
def plugins() -> dict[str, ProbeSpec]:
    """The probes installed packages declare in :data:`PLUGIN_GROUP`, read once per process."""
    return load_plugins(metadata.entry_points(group=PLUGIN_GROUP))


def _plugin_problem(spec: Any, name: str, taken: dict[str, str]) -> str | None:
    """Why the object an entry point ``name`` names cannot join the registry, or None."""
    if not isinstance(spec, ProbeSpec):
        return f"names a {type(spec).__name__}, not a smallbatch.study.probe_registry.ProbeSpec"
    if spec.name != name:
        return f"names the spec of {spec.name!r}; name the entry point as its spec"
    if not PLUGIN_NAME.fullmatch(name):
        return f"the name {name!r} is not lower-case letters, digits and _"
    if name in taken:
        return f"the name {name!r} is taken by {taken[name]}; rename the plugin's probe"
    if spec.default:
        return "it is a default probe; a plugin's probe is opt-in (eval.probes names it)"
    if spec.impl.startswith("."):
        return f"its impl {spec.impl!r} is relative; name its module in full"
    clash = [k for k in spec.params if k in taken]
    if clash:
        return f"its own setting eval.{clash[0]} is {taken[clash[0]]}'s; name the plugin's settings after it"
    return None


def load_plugins(entries: Iterable[metadata.EntryPoint]) -> dict[str, ProbeSpec]:
    """The :class:`ProbeSpec` each entry point names, by name, sorted; :class:`PluginError`, one line
    naming the entry point and its package, for one that cannot join (:func:`_plugin_problem`)."""
    taken = {n: "a built-in probe" for n in SPECS}
    taken |= {k: f"the probe {s.name!r}" for s in SPECS.values() for k in s.settings}
    found: dict[str, ProbeSpec] = {}
    for name, spec, where in loaded_entries(entries, "probe"):
        problem = _plugin_problem(spec, name, taken)
        if problem:
            raise PluginError(f"{where}: {problem}")
        taken |= {spec.name: f"the plugin {spec.name!r}", **{k: f"the plugin {spec.name!r}" for k in spec.params}}
        found[spec.name] = spec
    return found


def all_specs() -> dict[str, ProbeSpec]:
    """Every probe: the built-ins (:data:`SPECS`, in their order), then the plugins' by name."""
    return {**SPECS, **plugins()}


# --------------------------------------------------------------------------- look-ups
def probe_names() -> tuple[str, ...]:
    return tuple(all_specs())


def probe_spec(name: str) -> ProbeSpec:
    """The probe's spec, or a one-line ValueError naming the known ones."""
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        spec = all_specs().get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown probe {name!r}; known probes: {', '.join(all_specs())}")
    return spec


def probes_problem(names: Any) -> str | None:
    """What is wrong with an ``eval.probes`` list (an unknown or repeated probe, none), or None."""
    names, known = list(names), all_specs()
    unknown = [n for n in names if n not in known]
    if unknown:
        return f"eval.probes: unknown probe {unknown[0]!r}; known probes: {', '.join(known)}"
    if len(set(names)) != len(names):
        return f"eval.probes: {', '.join(names)} names a probe twice"
    if not names:
        return f"eval.probes is empty; name at least one of {', '.join(known)}"
    return None


def probe_function(name: str) -> Callable[..., dict]:
    """The probe's ``run(features, settings) -> metrics`` (imports its module: torch's)."""
    module, func = probe_spec(name).impl.split(":")
    package = "smallbatch.evaluation" if module.startswith(".") else None
    return getattr(importlib.import_module(module, package), func)


def report_metrics(names: Any = None) -> dict[str, str]:
    """{probe: its headline metric key} of ``names`` (default: :data:`DEFAULT_PROBES`)."""
    return {n: probe_spec(n).key for n in (DEFAULT_PROBES if names is None else names)}


def report_labels() -> dict[str, str]:
    """{probe: its headline metric's label} of every built-in probe (a plugin's: its spec's ``label``)."""
    return {n: s.label for n, s in SPECS.items()}


def probe_schema(description: str) -> dict[str, Any]:
    """The config schema's ``eval.probes`` parts generated from the registry: its default
    (:data:`DEFAULT_PROBES`) and ``description`` followed by the known probes."""
    known = "; ".join(f"{n}: {s.key}{' (default)' if s.default else ''}" for n, s in all_specs().items())
    return {"default": list(DEFAULT_PROBES), "description": f"{description}. Known probes and their metric: {known}"}


def probe_params() -> dict[str, dict]:
    """The ``eval`` keys the probes declare (their ``params``), each a JSON schema, in registry order
    (the plugins' too: the config may set them)."""
    return {k: dict(sch) for s in all_specs().values() for k, sch in s.params.items()}


def carried(eval_section: dict) -> dict:
    """A config's ``eval`` section as a cell carries it: without the settings of a plugin's probe the
    cell does not run (so installing a plugin moves no cell's hash)."""
    runs = set(eval_section.get("probes", DEFAULT_PROBES))
    idle = {k for n, s in plugins().items() if n not in runs for k in s.params}
    return {k: v for k, v in eval_section.items() if k not in idle}


def param_defaults(probes: Iterable[str] = DEFAULT_PROBES) -> dict[str, Any]:
    """{eval key: its default} of the probes' own settings a cell running ``probes`` carries: every
    built-in's (as before plugins), and a plugin's only when it runs (installing one moves no hash)."""
    specs = [*SPECS.values(), *(s for n, s in plugins().items() if n in set(probes))]
    return {k: sch.get("default") for s in specs for k, sch in s.params.items()}
