"""The loss registry: every loss's names, paper, parameters and properties, without torch.

One :class:`LossSpec` per loss, in :data:`SPECS` (the order tables show them).  Everything
that only needs to *name* a loss -- the config schema and its checks, cells and their ids,
the report's labels and colours, the papers table -- reads this module, which imports
nothing heavier than the standard library (``import smallbatch.losses.registry`` loads no
torch).  The formula lives in the loss's class (``spec.impl``, loaded by
:func:`smallbatch.losses.build_loss`), its paper and formula in that class's docstring.

Adding a loss is its class (a subclass of :class:`smallbatch.losses.base.ContrastiveLoss`
declaring ``spec="<name>"``) plus its entry here; cells, the config schema, the CLI,
CONFIGURATION.md (``smallbatch config-reference``) and the report follow from the two.

A loss of another, *installed* package joins the registry as a plugin: its distribution
declares an entry point in the group :data:`PLUGIN_GROUP` (``smallbatch.losses``) whose name
is the loss's name and whose object is its :class:`LossSpec` (in a module that imports no
torch; ``impl`` names its class by an absolute module path, imported only when the loss is
built).  :func:`all_specs` is the built-ins followed by the plugins, read once per process;
every look-up below reads it, so a plugin is named, validated, planned and reported like a
built-in.  A config names a loss by its entry point's name only, never by a module path:
what runs is what is installed.  A plugin may not take a built-in's name or alias.

A spec's properties say how the training loop treats the loss:

* ``stateful`` -- per-image state across steps (SogCLR's ``u``): ``init_state`` allocates
  it, ``state.pt`` saves it, and it runs on one process;
* ``learnable`` -- the loss has parameters the optimiser trains (SigLIP's ``t'`` and
  ``b``): they join the optimiser (no weight decay), move to the device, are saved and
  restored with the loss's ``state_dict``, and their gradients are averaged over processes;
* ``owns_temperature`` -- τ is one of those parameters, or of its state (iSogCLR's τ per
  image): the cell's τ initialises it and ``train/tau`` logs its current value
  (``learnt_temperature()``; per image: their mean);
* ``uses_temperature`` -- False when the loss has no τ at all (a kernel loss): the cell's τ
  only sets the InfoNCE it reports beside its value;
* ``negatives`` -- ``"all"`` (every in-batch or queued negative) or ``"same_view"`` (only the
  anchor's own view of the other images: DHEL's and the kernel losses' uniformity), built
  as a mask from shapes; same-view negatives exist in the batch only (no queue);
* ``per_anchor`` -- the loss is a mean over anchors, so a process's share of the anchors
  computes its share of the loss (several processes); False: one process.

A *method* is more than a loss.  The methods without negatives (SimSiam, VICReg, BYOL) are
entries here too, with ``negatives = "none"``: their class (a
:class:`smallbatch.losses.siamese.SiameseLoss`) takes the two views' outputs and targets,
not scores, and two more properties declare what else the method needs:

* ``predictor`` -- an MLP on the projection (SimSiam's, BYOL's): the model carries it
  (:class:`smallbatch.training.models.ContrastiveModel`, its hidden width from the loss's
  ``predictor_hidden``), the optimiser trains it and ``state.pt`` / ``checkpoint.pt`` save it
  with the network; the online branch's output is the prediction;
* ``ema_target`` -- the targets come from an exponential moving average of the online
  network (BYOL): the training step's source keeps that target network, updates it after
  every step at the loss's ``ema`` schedule, and saves it in ``state.pt``.

From ``negatives = "none"`` the training takes its views source (no negatives: the scores it
logs are diagnostics of the projections only) and refuses, in one line, what needs
negatives or several processes (a queue, negatives' groups, the same-class mask, an ESS
schedule, gradient caching, ``train.devices`` > 1).  Nothing outside this module names a
method.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ..errors import PluginError, loaded_entries

__all__ = [
    "LossSpec",
    "SPECS",
    "NEGATIVES",
    "PLUGIN_GROUP",
    "PluginError",
    "all_specs",
    "plugin_specs",
    "loss_spec",
    "canonical_name",
    "display_name",
    "loss_rank",
    "paper_family",
    "loss_param_names",
    "label_defaults",
    "loss_names",
    "config_schema",
    "params_problem",
]

#: which negatives a loss contrasts (see the module docstring; "none": a method without negatives)
NEGATIVES = ("all", "same_view", "none")
#: the widest layer a network of the study may have (a projector's, a predictor's)
MAX_WIDTH = 65536
#: the schedules of an EMA target's momentum (see :class:`smallbatch.losses.siamese.BYOL`)
EMA_SCHEDULES = ("cosine", "fixed")
#: the entry-point group in which an installed package declares its losses (module docstring)
PLUGIN_GROUP = "smallbatch.losses"
#: a plugin's names (and aliases): what a cell id and a results folder can hold, as the built-ins'
PLUGIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class LossSpec:
    """One loss of the registry (see the module docstring for the properties).

    ``name``: the registry name (cell ids, configs); ``display``: the name tables show;
    ``paper``: who proposed it; ``impl``: ``"<module>:<class>"``, the module relative to
    :mod:`smallbatch.losses` when it starts with a dot; ``aliases``: other accepted names; ``paper_pattern``: a regex
    that recognises the loss in the papers' method names (``paper_results.csv``);
    ``params``: one JSON schema per parameter, whose ``default`` is every door's default (the
    config schema's, CONFIGURATION.md's and the constructor's: ``build_loss(name)``);
    ``defaults``: the parameters and their defaults, filled from ``params`` (a parameter the
    config cannot set may be declared here alone); ``unlabelled``: values a cell id leaves
    out where they are not the default (EqCo's alpha = K, the paper's plain form, where the
    default 256 is written into the id); ``reference``: optionally, the loss's value computed
    independently, ``reference(z1, z2, temperature, **params) -> float`` on float64 views
    ``[N, d]``, which ``smallbatch check-loss`` compares with the class's value."""

    name: str
    display: str
    paper: str
    impl: str
    aliases: tuple[str, ...] = ()
    paper_pattern: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    params: dict[str, dict] = field(default_factory=dict)
    unlabelled: dict[str, Any] = field(default_factory=dict)
    stateful: bool = False
    learnable: bool = False
    owns_temperature: bool = False
    uses_temperature: bool = True
    negatives: str = "all"
    per_anchor: bool = True
    predictor: bool = False
    ema_target: bool = False
    #: relations between parameters: ``(a, b)`` pairs with a < b, parameters not all 0 (the loss
    #: would be 0), and the parameter the cell's τ may not be below (a floor of learnt τs)
    below: tuple[tuple[str, str], ...] = ()
    not_all_zero: tuple[str, ...] = ()
    tau_floor: str | None = None
    reference: Callable[..., float] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.negatives not in NEGATIVES:
            raise ValueError(f"loss {self.name!r}: negatives must be one of {NEGATIVES}, not {self.negatives!r}")
        if (self.predictor or self.ema_target) and self.contrastive:
            raise ValueError(f"loss {self.name!r}: a predictor or an EMA target belongs to a method without negatives")
        self._fill_defaults()
        needs = ({"pred_hidden"} if self.predictor else set()) | ({"ema", "ema_schedule"} if self.ema_target else set())
        if needs - set(self.defaults):
            raise ValueError(
                f"loss {self.name!r}: its method needs the parameters {sorted(needs - set(self.defaults))}"
            )
        if self.owns_temperature and not (self.learnable or self.stateful):
            raise ValueError(f"loss {self.name!r}: a loss that owns its temperature learns it or keeps it as state")

    def _fill_defaults(self) -> None:
        """``defaults`` completed from ``params``' defaults (one value per parameter: a second,
        different one is a ValueError naming it)."""
        declared = {key: sch["default"] for key, sch in self.params.items() if "default" in sch}
        missing = sorted(set(self.params) - set(declared))
        if missing:
            raise ValueError(f"loss {self.name!r}: schema parameters {missing} have no default")
        for key, value in self.defaults.items():
            if key in declared and value != declared[key]:
                raise ValueError(
                    f"loss {self.name!r}: parameter {key!r} has two defaults ({value!r} and the schema's "
                    f"{declared[key]!r}); declare it once, in params"
                )
        object.__setattr__(self, "defaults", {**self.defaults, **declared})
        if set(self.unlabelled) - set(self.defaults):
            raise ValueError(
                f"loss {self.name!r}: unlabelled names {sorted(set(self.unlabelled) - set(self.defaults))}, not parameters"
            )

    @property
    def label_defaults(self) -> dict[str, Any]:
        """The parameter values a cell id and a report label leave out: the defaults, but for
        ``unlabelled``."""
        return {**self.defaults, **self.unlabelled}

    @property
    def contrastive(self) -> bool:
        """The loss contrasts negatives (False: a method without negatives)."""
        return self.negatives != "none"

    @property
    def one_process(self) -> str | None:
        """Why the loss runs on one process only (a stateful or whole-batch loss, a method
        without negatives), or None."""
        if not self.contrastive:
            return f"{self.display} (a method without negatives)"
        if self.stateful:
            return f"{self.display}'s per-image state"
        if not self.per_anchor:
            return f"{self.display}'s whole-batch mean"
        return None


def _number(description: str, default: Any, **bounds: Any) -> dict:
    return {"type": "number", **bounds, "default": default, "description": description}


def _PRED_HIDDEN(default: str) -> dict:  # noqa: N802 - a schema template, read as a constant
    return {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": MAX_WIDTH,
        "default": None,
        "description": f"hidden width of the predictor MLP (null: {default})",
    }


#: kernel losses' largest t: exp(-t ||z - z'||^2) of the farthest pair, exp(-4t), stays a float32
#: above 0 up to t = 20 (beyond, the kernel and its gradient underflow, and t overflows to NaN)
_KERNEL_T = _number(
    "kernel losses: t of the Gaussian kernel exp(-t ||z - z'||^2), at most 20 (beyond, float32 underflows)",
    2.0,
    exclusiveMinimum=0,
    maximum=20,
)
#: SigLIP's largest |bias_init| (the paper starts at -10)
BIAS_BOUND = 100.0

_TAU_PLUS = "Debiased, HCL: the class prior tau+ (the chance a negative shares the anchor's class; 0 = no debiasing)"


#: The one list of losses, in the order tables show them.
SPECS: dict[str, LossSpec] = {
    s.name: s
    for s in (
        LossSpec(
            name="infonce",
            display="InfoNCE",
            paper="van den Oord et al. 2018; Chen et al. 2020 (SimCLR)",
            impl=".softmax:InfoNCE",
            aliases=("ntxent", "simclr"),
            paper_pattern=r"nt-xent|simclr|infonce|cross-entropy|moco",
        ),
        LossSpec(
            name="flatnce",
            display="FlatNCE",
            paper="Chen et al. 2021 (FlatNCE)",
            impl=".flatnce:FlatNCE",
            paper_pattern=r"flatnce",
            params={"gamma": _number("Hölder-mean exponent (1 = FlatNCE, 0 = the geometric mean)", 1.0, minimum=0)},
        ),
        LossSpec(
            name="dcl",
            display="DCL",
            paper="Yeh et al. 2021 (DCL)",
            impl=".decoupled:DCL",
            paper_pattern=r"\bdcl\b",
        ),
        LossSpec(
            name="dclw",
            display="DCLW",
            paper="Yeh et al. 2021 (DCLW)",
            impl=".decoupled:DCLW",
            paper_pattern=r"dclw",
            params={
                "sigma": _number(
                    "width of the von Mises-Fisher weights of the positives (inf = DCL)",
                    0.5,
                    exclusiveMinimum=0,
                    **{"x-infinite": True},
                )
            },
        ),
        LossSpec(
            name="eqco",
            display="EqCo",
            paper="Zhu et al. 2020 (EqCo)",
            impl=".softmax:EqCo",
            paper_pattern=r"eqco|simo",
            params={
                "alpha": {
                    "type": ["number", "null"],
                    "exclusiveMinimum": 0,
                    "default": 256,
                    "description": "the negatives' term is scaled by alpha/K (null: alpha = K, i.e. InfoNCE)",
                }
            },
            unlabelled={"alpha": None},
        ),
        LossSpec(
            name="sogclr",
            display="SogCLR",
            paper="Yuan et al. 2022 (SogCLR)",
            impl=".sogclr:SogCLR",
            paper_pattern=r"sogclr",
            params={
                "gamma": _number(
                    "SogCLR: weight of the batch in u's moving average (1 = no memory: DCL's gradient)",
                    0.9,
                    exclusiveMinimum=0,
                    maximum=1,
                )
            },
            stateful=True,
        ),
        LossSpec(
            name="isogclr",
            display="iSogCLR",
            paper="Qiu et al. 2023 (iSogCLR)",
            impl=".sogclr:ISogCLR",
            paper_pattern=r"isogclr",
            params={
                "gamma": _number(
                    "iSogCLR: weight of the batch in u's moving average", 0.9, exclusiveMinimum=0, maximum=1
                ),
                "rho": _number("iSogCLR: rho, the size of the KL ball of its robust objective", 0.3, minimum=0),
                "eta": _number("iSogCLR: step size of the per-image temperatures", 0.01, minimum=0),
                "beta": _number(
                    "iSogCLR: weight of the new gradient in the temperatures' momentum",
                    0.9,
                    exclusiveMinimum=0,
                    maximum=1,
                ),
                "tau_min": _number("iSogCLR: lower bound of the per-image temperatures", 0.05, exclusiveMinimum=0),
                "tau_max": _number("iSogCLR: upper bound of the per-image temperatures", 0.7, exclusiveMinimum=0),
            },
            stateful=True,
            owns_temperature=True,
            below=(("tau_min", "tau_max"),),
            tau_floor="tau_min",
        ),
        LossSpec(
            name="siglip",
            display="SigLIP",
            paper="Zhai et al. 2023 (SigLIP); Çağatan 2024 (SigCLR)",
            impl=".sigmoid:SigLIP",
            aliases=("sigclr",),
            paper_pattern=r"siglip|sigclr",
            params={
                "bias_init": {
                    "type": "number",
                    "minimum": -BIAS_BOUND,
                    "maximum": BIAS_BOUND,
                    "default": -10.0,
                    "description": "SigLIP: the learnt bias b at the start (the learnt t = 1/τ starts at the cell's τ); "
                    f"within ±{BIAS_BOUND:g}, beyond which softplus is linear and the loss its size",
                }
            },
            learnable=True,
            owns_temperature=True,
        ),
        LossSpec(
            name="dhel",
            display="DHEL",
            paper="Koromilas et al. 2024 (DHEL)",
            impl=".decoupled:DHEL",
            paper_pattern=r"dhel",
            negatives="same_view",
        ),
        LossSpec(
            name="kcl",
            display="KCL",
            paper="Koromilas et al. 2024 (KCL)",
            impl=".kernel:KCL",
            paper_pattern=r"\bkcl\b",
            params={
                "t": _KERNEL_T,
                "gamma": _number("KCL: weight of the energy (negatives') term", 16.0, exclusiveMinimum=0),
            },
            uses_temperature=False,
            negatives="same_view",
        ),
        LossSpec(
            name="simco",
            display="SimCo",
            paper="Zhang et al. 2022 (SimCo, dual temperature)",
            impl=".softmax:DualTemperature",
            paper_pattern=r"simco|simmoco",
            params={"m": _number("SimCo: the inter-anchor temperature is tau * m (1 = InfoNCE)", 10.0, minimum=1)},
        ),
        LossSpec(
            name="align_uniform",
            display="Align+Uniform",
            paper="Wang & Isola 2020 (alignment and uniformity)",
            impl=".kernel:AlignUniform",
            paper_pattern=r"uniformity",
            params={
                "lam": _number(
                    "align_uniform: weight of the uniformity term (0: alignment alone, which collapses)",
                    1.0,
                    exclusiveMinimum=0,
                ),
                "alpha": _number("align_uniform: the alignment's power of ||z - z+||", 2.0, exclusiveMinimum=0),
                "t": _KERNEL_T,
            },
            uses_temperature=False,
            negatives="same_view",
            per_anchor=False,
        ),
        LossSpec(
            name="debiased",
            display="Debiased",
            paper="Chuang et al. 2020 (debiased contrastive learning)",
            impl=".debiased:Debiased",
            paper_pattern=r"debiased",
            params={"tau_plus": _number(_TAU_PLUS, 0.1, minimum=0, exclusiveMaximum=1)},
        ),
        LossSpec(
            name="hcl",
            display="HCL",
            paper="Robinson et al. 2021 (hard negatives, HCL)",
            impl=".debiased:HardNegatives",
            paper_pattern=r"\bhcl\b|hard negative",
            params={
                "tau_plus": _number(_TAU_PLUS, 0.1, minimum=0, exclusiveMaximum=1),
                "beta": _number("HCL: hardness, negatives weighted by exp(beta s/tau) (0 = Debiased)", 1.0, minimum=0),
            },
        ),
        LossSpec(
            name="infonce_lt",
            display="InfoNCE (learnt τ)",
            paper="Radford et al. 2021 (CLIP's learnt temperature)",
            impl=".softmax:LearntTemperatureInfoNCE",
            learnable=True,
            owns_temperature=True,
        ),
        LossSpec(
            name="simsiam",
            display="SimSiam",
            paper="Chen & He 2021 (SimSiam)",
            impl=".siamese:SimSiam",
            paper_pattern=r"simsiam",
            params={"pred_hidden": _PRED_HIDDEN("train.proj_dim / 4, SimSiam's bottleneck (2048 -> 512)")},
            uses_temperature=False,
            negatives="none",
            per_anchor=False,
            predictor=True,
        ),
        LossSpec(
            name="vicreg",
            display="VICReg",
            paper="Bardes, Ponce & LeCun 2022 (VICReg)",
            impl=".siamese:VICReg",
            paper_pattern=r"vicreg",
            params={
                "lam": _number("VICReg: weight of the invariance (mean squared error) term", 25.0, minimum=0),
                "mu": _number("VICReg: weight of the variance (hinge on each dimension's std) term", 25.0, minimum=0),
                "nu": _number("VICReg: weight of the covariance (off-diagonal) term", 1.0, minimum=0),
            },
            uses_temperature=False,
            negatives="none",
            per_anchor=False,
            not_all_zero=("lam", "mu", "nu"),
        ),
        LossSpec(
            name="byol",
            display="BYOL",
            paper="Grill et al. 2020 (BYOL)",
            impl=".siamese:BYOL",
            paper_pattern=r"\bbyol\b",
            params={
                "pred_hidden": _PRED_HIDDEN("train.proj_hidden, as wide as the projector (BYOL: 4096 and 4096)"),
                "ema": _number(
                    "BYOL: the target network's EMA momentum at the first step (its schedule's start); below 1 "
                    "(at 1 the target never moves)",
                    0.99,
                    minimum=0,
                    exclusiveMaximum=1,
                ),
                "ema_schedule": {
                    "type": "string",
                    "enum": list(EMA_SCHEDULES),
                    "default": "cosine",
                    "description": "BYOL: cosine = the momentum rises from ema to 1 over training "
                    "(1 - (1 - ema)(cos(pi k/K) + 1)/2); fixed = ema at every step",
                },
            },
            uses_temperature=False,
            negatives="none",
            per_anchor=False,
            predictor=True,
            ema_target=True,
        ),
    )
}


# --------------------------------------------------------------------------- plugins
def all_specs() -> dict[str, LossSpec]:
    """Every loss: the built-ins (:data:`SPECS`, in their order), then the installed plugins'
    (:func:`plugin_specs`, by name)."""
    return {**SPECS, **plugin_specs()}


@functools.cache
def plugin_specs() -> dict[str, LossSpec]:
    """The losses installed packages declare in the entry-point group :data:`PLUGIN_GROUP`,
    read once per process (:func:`load_plugins`)."""
    return load_plugins(metadata.entry_points(group=PLUGIN_GROUP))


def load_plugins(entries: Iterable[metadata.EntryPoint]) -> dict[str, LossSpec]:
    """The :class:`LossSpec` each entry point names, by name, sorted; :class:`PluginError`, one line
    naming the entry point and its package, for one that does not load, is not a spec, is
    not named like its spec, has a name a cell id cannot hold, or takes a built-in's name or
    alias, or another plugin's name."""
    taken = {n: "a built-in loss" for n in _names_of(SPECS)}
    found: dict[str, LossSpec] = {}
    for name, spec, where in loaded_entries(entries, "loss"):
        if not isinstance(spec, LossSpec):
            raise PluginError(f"{where} names a {type(spec).__name__}, not a smallbatch.losses.registry.LossSpec")
        if spec.name != name:
            raise PluginError(f"{where} names the spec of {spec.name!r}; name the entry point as its spec")
        for n in (spec.name, *spec.aliases):
            if not PLUGIN_NAME.fullmatch(n):
                raise PluginError(
                    f"{where}: the name {n!r} is not lower-case letters, digits and _ (a cell id holds it)"
                )
            if n in taken:
                raise PluginError(f"{where}: the name {n!r} is taken by {taken[n]}; rename the plugin's loss")
            taken[n] = f"the plugin {spec.name!r}"
        found[spec.name] = spec
    return found


def _names_of(specs: dict[str, LossSpec]) -> dict[str, str]:
    return {**{n: n for n in specs}, **{a: s.name for s in specs.values() for a in s.aliases}}


# --------------------------------------------------------------------------- look-ups
def loss_names() -> dict[str, str]:
    """Every accepted name (registry names and aliases, the plugins' too) -> its registry name."""
    return _names_of(all_specs())


def loss_spec(name: str) -> LossSpec:
    """The spec of ``name`` (any accepted name, any case); ValueError naming the allowed names."""
    names = loss_names()
    key = str(name).strip().lower()
    if key not in names:
        raise ValueError(f"unknown loss {name!r}; allowed: {', '.join(sorted(names))}")
    return all_specs()[names[key]]


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (an alias such as ``ntxent`` -> ``infonce``);
    ValueError naming the allowed names for an unknown one."""
    return loss_spec(name).name


def display_name(name: str) -> str:
    """The name tables show (``InfoNCE``); an unknown name is returned unchanged."""
    key = loss_names().get(str(name).strip().lower())
    return all_specs()[key].display if key is not None else str(name)


def loss_rank(name: str) -> tuple[int, str]:
    """Sort key: registry order first, unknown names after, alphabetically."""
    order = list(all_specs())
    return (order.index(name) if name in order else len(order), str(name))


def paper_family(method: Any) -> str | None:
    """The loss a paper's method name belongs to (``'SimCLR (NT-Xent)'`` -> ``infonce``),
    matched by each loss's ``paper_pattern``; the most specific loss wins (the registry
    is searched from its end, so DCLW before DCL and every fix before InfoNCE)."""
    s = str(method).lower()
    for spec in reversed(list(all_specs().values())):
        if spec.paper_pattern and re.search(spec.paper_pattern, s):
            return spec.name
    return None


def loss_param_names(name: str) -> dict[str, Any]:
    """The extra parameters loss ``name`` accepts, with defaults (temperature excluded)."""
    return dict(loss_spec(name).defaults)


def label_defaults(name: str) -> dict[str, Any]:
    """The parameter values of loss ``name`` that a cell id or a report label leaves out
    (:attr:`LossSpec.label_defaults`)."""
    return loss_spec(name).label_defaults


def config_schema() -> dict[str, Any]:
    """The config schema's loss parts, generated from the registry:
    ``names`` (enum of accepted names), ``loss_params`` (one object per loss with its
    parameters and the study's defaults) and ``entry_params`` (a grid entry's
    parameter may be a value or a list of values to sweep)."""
    loss_params: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for name, spec in all_specs().items():
        loss_params[name] = {
            "type": "object",
            "default": {},
            "additionalProperties": False,
            "description": f"{spec.display} ({spec.paper})",
            "properties": {k: dict(v) for k, v in spec.params.items()},
        }
        for key, sch in spec.params.items():
            scalar = {k: v for k, v in sch.items() if k != "default"}
            if scalar not in scalars.setdefault(key, []):
                scalars[key].append(scalar)
    entry_params = {}
    for key, alts in scalars.items():  # a name shared by losses (gamma: FlatNCE, SogCLR) takes either's values
        scalar = alts[0] if len(alts) == 1 else {"anyOf": alts}
        entry_params[key] = {"anyOf": [scalar, {"type": "array", "minItems": 1, "items": scalar}]}
    return {"names": sorted(loss_names()), "loss_params": loss_params, "entry_params": entry_params}


# --------------------------------------------------------------------------- the parameters' checks
def params_problem(name: str, params: dict[str, Any], temperature: float | None = None) -> str | None:
    """The first problem of loss ``name``'s parameters ``params`` (its defaults fill the rest),
    one line, or None: each against its schema's bounds, then the spec's relations between
    them (and the cell's ``temperature``, when given).  The one check of a loss's parameters:
    the loss's constructor and the config's cells both call it, and the config schema holds
    the same bounds (:func:`config_schema`)."""
    spec = loss_spec(name)
    unknown = sorted(set(params) - set(spec.defaults))
    if unknown:
        return f"unknown parameter(s) {unknown} for loss '{spec.name}'; allowed: {', '.join(spec.defaults) or 'none'}"
    for key, value in params.items():
        problem = param_problem(spec, key, value)
        if problem:
            return problem
    return _relations_problem(spec, {**spec.defaults, **params}, temperature)


def param_problem(spec: LossSpec, key: str, value: Any) -> str | None:
    """``value`` of ``spec``'s parameter ``key`` against its schema (type, bounds, finite
    unless the schema allows infinity), one line naming the parameter, or None."""
    sch = spec.params.get(key)
    if sch is None:
        return None
    types = sch.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    if value is None:
        return None if "null" in types else f"{key} must be {_bound_text(sch)}, got None"
    if "enum" in sch:
        return None if value in sch["enum"] else f"{key} must be {_bound_text(sch)}, got {value!r}"
    integer = "integer" in types
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return f"{key} must be {_bound_text(sch)}, got {value!r}"
    v = float(value)
    tests = {
        "minimum": lambda b: v >= b,
        "maximum": lambda b: v <= b,
        "exclusiveMinimum": lambda b: v > b,
        "exclusiveMaximum": lambda b: v < b,
    }
    ok = v == v and (abs(v) != float("inf") or bool(sch.get("x-infinite")))
    ok = ok and all(test(sch[bound]) for bound, test in tests.items() if bound in sch)
    return None if ok else f"{key} must be {_bound_text(sch)}, got {value!r}"


def _bound_text(sch: dict) -> str:
    """What a parameter's schema allows, in words: ``a finite number in (0, 1]``."""
    types = sch.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    if "enum" in sch:
        return "one of " + ", ".join(map(str, sch["enum"]))
    what = "an integer" if "integer" in types else "a number" if sch.get("x-infinite") else "a finite number"
    lo = (
        ("[", sch["minimum"])
        if "minimum" in sch
        else ("(", sch["exclusiveMinimum"])
        if "exclusiveMinimum" in sch
        else None
    )
    hi = (
        ("]", sch["maximum"])
        if "maximum" in sch
        else (")", sch["exclusiveMaximum"])
        if "exclusiveMaximum" in sch
        else None
    )
    if lo and hi:
        what += f" in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    elif lo:
        what += f" {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
    elif hi:
        what += f" {'<=' if hi[0] == ']' else '<'} {hi[1]:g}"
    return what + (" or null" if "null" in types else "")


def _relations_problem(spec: LossSpec, params: dict[str, Any], temperature: float | None) -> str | None:
    """The spec's relations between its parameters (and the cell's τ)."""
    for a, b in spec.below:
        if not params[a] < params[b]:
            return f"{a} must be below {b}, got {params[a]!r} and {params[b]!r}"
    if spec.not_all_zero and not any(params[k] for k in spec.not_all_zero):
        keys = ", ".join(spec.not_all_zero)
        return f"{spec.display}'s {keys} are all 0 (the loss is 0 and nothing trains); give one of them a weight"
    if spec.tau_floor and temperature is not None and temperature < params[spec.tau_floor]:
        return (
            f"{spec.display} starts its learnt τ at the cell's temperature {temperature:g}, below its "
            f"{spec.tau_floor} = {params[spec.tau_floor]:g}, which it never goes under; choose a temperature "
            f">= {params[spec.tau_floor]:g} or a lower {spec.tau_floor}"
        )
    return None
