"""The side-experiment registry: every side experiment declared once, without torch.

A side experiment is a mini-grid of cells under ``experiments.<name>`` in the config (the
schema's ``#/$defs/section``: its losses, batch sizes, temperatures, seeds, axes and ``train``
overrides, each falling back to the main grid's), tagged ``section=<name>`` in the store, and
reported by one module of :mod:`smallbatch.report.sections`.  One :class:`SideExperiment` in
:data:`SPECS` is all the rest of the package needs to know about it:

* the config schema and CONFIGURATION.md take its key and ``description`` from here
  (:func:`experiment_schema`, filled into the schema's key marked ``x-side-experiments``);
* :mod:`smallbatch.study.cells` expands its cells (:data:`SIDE_EXPERIMENTS`);
* the report runs its ``section`` module (``build(runs, ctx) -> SectionOutput | None``), in
  the order of :data:`SPECS`: the ``main`` ones after the grid's representation section, the
  others after the papers' numbers (:func:`section_names`);
* ``snakemake --report`` captions its tables and figures with ``tables``/``figures``
  (``(file-name prefix, caption)``; :func:`smallbatch.report.captions.captions`).

A side experiment that is no grid of cells (``grid=False``: the correlated-Gaussian MI
benchmark, its own job and its own schema under ``experiments.<name>``) has an entry too: the
report and ``snakemake --report`` read it like the others; the cells and the schema's sections
leave it out.

Adding a side experiment is its entry here plus its section module (and tests); a new
*training setting* it sweeps is an axis of the schema's ``#/$defs/axes`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SideExperiment",
    "Need",
    "SPECS",
    "SIDE_EXPERIMENTS",
    "experiment_spec",
    "experiment_schema",
    "section_names",
    "needs_problem",
]

Captions = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Need:
    """What a side experiment's cells must span for it to compute what it exists for: at least
    ``at_least`` different values of ``key`` (a cell's ``batch_size``, ``temperature``, or a
    ``train.<key>``; ``plain_batch_size``: the batch sizes of its plain InfoNCE cells, no control
    set), and ``how``, one line saying how to give it them."""

    key: str
    at_least: int
    what: str
    how: str


@dataclass(frozen=True)
class SideExperiment:
    """One side experiment.  ``name``: its config key, the cells' ``experiment`` and the
    runs' ``section`` tag; ``description``: one line for the schema and CONFIGURATION.md;
    ``section``: its report module under :mod:`smallbatch.report.sections` (None: its own job
    writes its tables and figures, no section reads the store); ``tables`` and
    ``figures``: ``(file-name prefix, caption)`` of what that module writes; ``main``: reported
    with the main results (after the representation section) rather than with the side
    experiments; ``grid``: a grid of cells (False: its own job and schema, no cells)."""

    name: str
    description: str
    section: str | None
    tables: Captions = ()
    figures: Captions = ()
    main: bool = False
    needs: tuple[Need, ...] = ()
    grid: bool = True


SPECS: dict[str, SideExperiment] = {
    s.name: s
    for s in (
        SideExperiment(
            "precision",
            "FlatNCE's floating-point hypothesis: the same small-batch cells in fp64, fp32, bf16",
            "precision",
            tables=(("precision_", "Side experiment (floating-point precision)."),),
            figures=(
                (
                    "precision_top1_",
                    "Side experiment (floating-point precision): top-1 by precision (fp64, fp32, bf16).",
                ),
                (
                    "precision_grad_error_",
                    "Side experiment (floating-point precision): the gradient's rounding error over training.",
                ),
            ),
        ),
        SideExperiment(
            "ksweep",
            "EqCo's K sweep: fixed batch, negatives from a MoCo queue of K keys",
            "ksweep",
            tables=(("ksweep", "Side experiment (EqCo's K sweep)."),),
            needs=(Need("train.queue_size", 2, "queue sizes K", "give it axes: {queue_size: [...]}"),),
            figures=(
                (
                    "ksweep",
                    "Side experiment (EqCo's K sweep): top-1 against the number of negatives K (a MoCo-style queue at "
                    "a fixed batch).",
                ),
            ),
        ),
        SideExperiment(
            "ess",
            "FlatNCE Algorithm S1: temperature adapted each step so the ESS follows a schedule",
            "ess",
            tables=(("ess", "Side experiment (ESS-scheduled temperature)."),),
            figures=(
                ("ess_schedule_", "FlatNCE's ESS-scheduled temperature against a fixed temperature."),
                (
                    "ess_",
                    "Effective sample size of the negatives' weights (diag/ess) over training, one line per batch size.",
                ),
            ),
        ),
        SideExperiment(
            "tsweep",
            "SimCLR Table 5's analogue: temperature sweep at a fixed batch size",
            "tsweep",
            tables=(("tsweep", "Side experiment (temperature sweep)."),),
            needs=(Need("temperature", 2, "temperatures", "give it temperatures: [...]"),),
            figures=(
                (
                    "tsweep",
                    "Side experiment (temperature sweep, SimCLR Table 5's analogue): top-1 against the temperature at a "
                    "fixed batch.",
                ),
            ),
        ),
        SideExperiment(
            "regime",
            "where the small-batch penalty lives: batch x training length x optimiser regime (Adam/none, SGD/linear, "
            "LARS/sqrt)",
            "regime",
            tables=(("regime_", "Side experiment (regime: batch × epochs × optimiser)."),),
            figures=(
                (
                    "regime_top1_",
                    "Side experiment (regime): top-1 against batch size, per number of epochs and optimiser regime.",
                ),
                ("regime_grad_ratio_", "Side experiment (regime): the gradient noise ratio per batch size and regime."),
                (
                    "regime_update_size_",
                    "Side experiment (regime): the size of the parameter updates per batch size and regime.",
                ),
            ),
        ),
        SideExperiment(
            "lrsweep",
            "the learning rate each batch size wants: a grid of rates per batch size (axes: {lr: [...]}), the rate "
            "validated on the linear probe's validation split and its exponent k (rate ∝ N^k) against SimCLR's rules",
            "lrsweep",
            needs=(
                Need("train.lr", 2, "learning rates", "give it axes: {lr: [...]}"),
                Need("batch_size", 2, "batch sizes", "give it batch_sizes: [...] (the exponent is fitted across them)"),
            ),
            tables=(
                (
                    "lrsweep",
                    "Side experiment (learning-rate sweep): top-1 by batch size and peak rate; the validated "
                    "rate per batch size and its scaling exponent with a seed-bootstrap interval.",
                ),
            ),
            figures=(
                (
                    "lrsweep",
                    "Side experiment (learning-rate sweep): top-1 against the peak learning rate, one "
                    "panel per batch size and probe.",
                ),
            ),
        ),
        SideExperiment(
            "kcurve",
            "the negatives' dose-response (workflow/configs/k_sweep.yaml): one optimiser batch, K set by grouping "
            "(neg_group: K = 2G − 2) and above the batch by fresh no-grad negatives (extra_negatives), its knee "
            "against the coupon collector's C·H_C",
            "kcurve",
            needs=(
                Need("negatives", 3, "numbers of negatives K", "give it batch entries {size, train: {neg_group: ...}}"),
            ),
            tables=(("kcurve", "Side experiment (K dose-response): top-1 against the number of negatives K."),),
            figures=(
                (
                    "kcurve",
                    "Side experiment (K dose-response): top-1 against the number of negatives K (log scale) per probe "
                    "and budget, with 95 % intervals, the knee and the coupon collector's C·H_C.",
                ),
            ),
        ),
        SideExperiment(
            "instrument",
            "the instrument study (workflow/configs/instrument.yaml): small vs large batch with the controls that split "
            "negatives from steps (batch entries {size, train: {neg_group}}), BatchNorm over equal groups in every arm, "
            "paired by seed",
            "instrument",
            needs=(
                Need(
                    "plain_batch_size",
                    2,
                    "batch sizes of plain InfoNCE arms",
                    "give it InfoNCE at a small and a large batch size without a control (its reference arms)",
                ),
            ),
            tables=(("instrument", "The instrument arms and their contrasts."),),
            figures=(
                (
                    "instrument_arms",
                    "The instrument arms (fixed-steps budget, false-negatives oracle, learning rate per batch size) beside "
                    "the plain grid.",
                ),
                (
                    "instrument_contrasts",
                    "The instrument's claimed contrasts on the primary probe and the positive control, each with its "
                    "interval and the analysis plan's equivalence margin: one panel per data set, τ and view at its "
                    "longest budget.",
                ),
                (
                    "instrument_curves",
                    "The instrument's claimed contrasts and the positive control over training budgets, per planned "
                    "probe, each contrast's plateau (the budget its arms stopped moving at) starred.",
                ),
            ),
            main=True,
        ),
        SideExperiment(
            "mi",
            "Gaussian MI bounds: InfoNCE vs FlatNCE vs EqCo estimates against the true MI (smallbatch.mi.toy)",
            "mi",
            tables=(("mi_", "Side experiment (correlated Gaussians): the MI estimators' numbers."),),
            figures=(
                (
                    "mi_estimate_vs_true",
                    "Side experiment (correlated Gaussians): each estimator's MI estimate against the true MI, per "
                    "number of negatives K.",
                ),
                (
                    "mi_small_k",
                    "Side experiment (correlated Gaussians): the critic's quality against the K it was trained with.",
                ),
            ),
            grid=False,
        ),
        SideExperiment(
            "critical_batch",
            "the critical batch size: steps to a target kNN accuracy on a held-out validation split against batch "
            "size, per loss and a supervised cross-entropy control, fitted by S = S_min (1 + B_noise / B) "
            "(smallbatch steps-to-target)",
            None,
            grid=False,
        ),
    )
}

#: the side experiments that are grids of cells (config keys under ``experiments``), in :data:`SPECS`' order
SIDE_EXPERIMENTS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.grid)


def experiment_spec(name: str) -> SideExperiment:
    """The registry's entry for ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown side experiment {name!r}; known: {', '.join(SPECS)}") from None


def experiment_schema() -> dict[str, dict]:
    """``experiments.<name>`` of the config schema for every side experiment of the registry (one that
    is no grid: its description, laid over its own node of the schema file)."""
    return {
        s.name: {"$ref": "#/$defs/section", "description": s.description} if s.grid else {"description": s.description}
        for s in SPECS.values()
    }


def section_names(main: bool) -> list[str]:
    """The report modules of the side experiments reported with the main results (``main``) or
    with the other side experiments, in the registry's order."""
    return [s.section for s in SPECS.values() if s.main == main and s.section is not None]


#: the controls that make a cell an arm other than a plain one (the instrument's)
_CONTROLS = ("neg_group", "extra_negatives", "mask_same_class", "steps")


def _value(cell, key: str):
    """``key`` (a :class:`Need`'s) of a typed cell (:class:`smallbatch.study.cell.Cell`)."""
    if key == "plain_batch_size":
        plain = cell.loss == "infonce" and not any(getattr(cell.train, k) for k in _CONTROLS)
        return cell.batch_size if plain else None
    return getattr(cell.train, key.removeprefix("train.")) if key.startswith("train.") else getattr(cell, key)


def needs_problem(name: str, cells: list) -> str | None:
    """Why side experiment ``name``'s ``cells`` (typed: :class:`smallbatch.study.cell.Cell`) cannot compute what it exists for (its
    :class:`Need`), one line naming its key, or None."""
    for need in experiment_spec(name).needs:
        values = {v for v in (_value(c, need.key) for c in cells) if v is not None}
        if len(values) < need.at_least:
            found = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in sorted(values)) or "none"
            return (
                f"config key 'experiments.{name}' has {len(values)} of the {need.at_least} different {need.what} "
                f"it needs ({found}): {need.how}"
            )
    return None
