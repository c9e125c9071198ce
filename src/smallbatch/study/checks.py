"""Every check of a cell's settings, in one torch-free place.

A cell's settings are checked before any job runs (the config's cells, a cell file, a cell
on the command line: :mod:`smallbatch.study.cellcheck`) and again when it trains
(:func:`smallbatch.training.loop.pretrain`, which adds what only the run knows: the
processes launched, the images read, the device).  Each check returns one line naming the
key and what to do, or None; what a loss needs of the training is read from its registry
entry (:mod:`smallbatch.losses.registry`: stateful, negatives, per anchor, ...), never
from its name.  Each bound is checked here once, beside its value: the config schema
states the same bounds declaratively (its one-line errors name the config key), and the
command line's flags are checked by the functions here, named by their flags.

* :func:`any_problem` -- all of them, for a cell whose data set's size is known;
* :func:`settings_problem` -- those that need no data set size (the training loop's);
* :func:`control_problem` -- the controls and the loss's needs of the training;
* :func:`batch_problem`, :func:`tau_problem` -- a batch size and a temperature alone (the
  command line's ``--batch-size`` and ``--temperature``, a cell's).
"""

from __future__ import annotations

from ..data.registry import num_classes, pretrain_images, pretrain_split, split_sizes
from ..losses.registry import loss_spec, params_problem
from .cell import Cell, budget_steps, snapshot_steps
from .lr_scaling import REFERENCE_BATCH, resolved_knobs

#: the numeric precisions a cell may train in (``train.precision``)
PRECISIONS = ("fp32", "bf16", "fp16", "fp64")

#: the temperatures a cell may train at: below, s/tau overflows float32's exp range (loss ~1e7 at
#: tau = 1e-9); above, every logit is ~0 and the loss is constant (nothing is learnt)
TAU_RANGE = (1e-3, 1e2)
#: the smallest batch a cell may train at: a batch of 1 has no negatives
MIN_BATCH = 2


def batch_problem(bs: object) -> str | None:
    """Why ``bs`` is no batch size (the caller names its key), or None."""
    if isinstance(bs, bool) or not isinstance(bs, int):
        return f"must be an integer >= {MIN_BATCH}, not {bs!r}"
    if bs < MIN_BATCH:
        return f"must be >= {MIN_BATCH} (a batch of 1 has no negatives), not {bs}"
    return None


def tau_problem(tau: object) -> str | None:
    """Why ``tau`` is no temperature a cell may train at (outside :data:`TAU_RANGE`, not a
    finite number), or None; the caller names its key."""
    lo, hi = TAU_RANGE
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        return f"must be a number in [{lo:g}, {hi:g}], not {tau!r}"
    if not lo <= tau <= hi:  # nan too
        return (
            f"τ = {tau:g} is outside [{lo:g}, {hi:g}], where the losses stop being meaningful "
            "(s/τ overflows, or every logit is ~0); choose a τ in that range"
        )
    return None


def any_problem(cell: Cell) -> str | None:
    """The first problem of a typed cell (:class:`~smallbatch.study.cell.Cell`) that the
    schema cannot see: its batch against its images and devices, τ, k, the controls, the
    warm-up, its loss's parameters."""
    return (
        images_problem(cell)
        or extreme_problem(cell)
        or settings_problem(cell)
        or warmup_problem(cell)
        or budgets_problem(cell)
        or run_problem(cell)
        or decays_problem(cell)
        or loss_params_problem(cell)
    )


def run_problem(cell: Cell) -> str | None:
    """What the job would find only once it runs, known from the cell already: fp16 on a cell
    that names the CPU (GradScaler needs CUDA), the same-class mask on a data set whose
    pretraining split has no labels."""
    tr = cell.train
    if tr.precision == "fp16" and cell.device == "cpu":
        return "precision fp16 needs CUDA (GradScaler), and the cell's device is cpu; use bf16 or fp32, or device: cuda"
    if tr.mask_same_class and pretrain_split(cell.dataset) == "unlabeled":
        return (
            f"train.mask_same_class needs labels, and {cell.dataset}'s pretraining split ({pretrain_split(cell.dataset)}) "
            "has none; set it to false"
        )
    es = tr.ess_schedule
    if es and {"tau_min", "tau_max"} <= set(es) and not es["tau_min"] < es["tau_max"]:
        return (
            f"train.ess_schedule.tau_min = {es['tau_min']:g} is not below its tau_max = {es['tau_max']:g}; "
            "give the scheduled τ a range"
        )
    return None


#: the setting that maps each batch-dependent decay to the cell's batch (:func:`resolved_knobs`' keys)
_DECAY_RULES = {"train.adam_beta2": "beta2_scaling", "train.moco_momentum": "ema_scaling", "loss.ema": "ema_scaling"}


def decays_problem(cell: Cell) -> str | None:
    """Each decay (Adam's β2, an EMA momentum) below 1 at the cell's batch as well as at the
    batch it is stated at: ``samples`` raises it to N/256, which rounds a value a hair below 1 up
    to 1 at a small batch (torch's Adam refuses β2 = 1; an EMA target at 1 never moves)."""
    for key, value in resolved_knobs(cell.train, cell.batch_size, cell.loss_params.get("ema")).items():
        if value >= 1:
            rule, name = _DECAY_RULES[key], key if key.startswith("train.") else f"{cell.loss}'s ema"
            return (
                f"{name} at batch {cell.batch_size} is 1 under train.{rule} samples (its value at batch "
                f"{REFERENCE_BATCH} to the power {cell.batch_size}/{REFERENCE_BATCH}, rounded); "
                f"choose a value farther below 1 or train.{rule}: none"
            )
    return None


def budgets_problem(cell: Cell) -> str | None:
    """The snapshot budgets against the cell's steps, where its data set's size gives its
    steps per epoch before it is read (the job checks the same once it has the images)."""
    images = pretrain_images(cell.dataset, cell.dataset_options.get("train_subset"))
    if not cell.train.snapshot_epochs or images is None or images < cell.batch_size:
        return None
    spe = images // cell.batch_size
    return snapshot_budget_problem(cell, spe, budget_steps(cell, spe))


def snapshot_budget_problem(cell: Cell, steps_per_epoch: int, total: int) -> str | None:
    """Each snapshot budget is a step of its own in 1..total: a budget of less than half a step
    would save the untrained weights, one past the budget would never be saved, and two on one
    step would save one run twice under two names."""
    seen: dict[int, float] = {}
    for e in cell.train.snapshot_epochs or ():
        step = snapshot_steps(e, steps_per_epoch)
        if float(e) * steps_per_epoch < 0.5:
            return (
                f"train.snapshot_epochs {e:g} is less than half of one of the cell's {steps_per_epoch} steps per "
                f"epoch (it would save the untrained weights); use at least {0.5 / steps_per_epoch:.3g}"
            )
        if step > total:
            return f"train.snapshot_epochs {e:g} is step {step}, past the cell's {total} steps; use budgets within it"
        if step in seen:
            return (
                f"train.snapshot_epochs {seen[step]:g} and {e:g} are both step {step} ({steps_per_epoch} steps "
                "per epoch); give each budget a step of its own"
            )
        seen[step] = float(e)
    return None


def images_problem(cell: Cell, images: int | None = None) -> str | None:
    """A step's images (the batch and its fresh negatives) against the pretraining images of
    the cell's data set: ``images`` when read (the training job's), else their number where the
    data-set registry knows it before they are read."""
    name, subset = cell.dataset, cell.dataset_options.get("train_subset")
    if images is None:
        images = pretrain_images(name, subset)
    tr = cell.train
    step_images = cell.batch_size + (tr.extra_negatives or 0)
    if images is None or step_images <= images:
        return None
    capped = f" (datasets.{name}.train_subset)" if subset is not None and subset == images else ""
    what = f"batch size {cell.batch_size}" + (
        f" with {tr.extra_negatives} extra negatives" if step_images > cell.batch_size else ""
    )
    return f"{what} is larger than the {images:,} pretraining images of {name}{capped}"


def settings_problem(cell: Cell) -> str | None:
    """The checks that need no data set size: the batch against the devices, the precision,
    the budget, the controls and the loss's needs."""
    bs, tr = cell.batch_size, cell.train
    problem = batch_problem(bs)
    if problem:
        return f"batch_size {problem}"
    if bs % tr.devices:
        return f"batch size {bs} is not a multiple of train.devices = {tr.devices}"
    if tr.precision not in PRECISIONS:
        return f"precision must be one of {', '.join(PRECISIONS)}, not {tr.precision!r}"
    if tr.steps is None and not tr.epochs > 0:
        return f"epochs must be > 0, not {tr.epochs!r}"
    return control_problem(cell)


def warmup_problem(cell: Cell) -> str | None:
    """A warm-up longer than the budget.  With train.steps the budget is in steps and the
    warm-up in epochs of a data set whose size may be unknown (imagefolder): not compared
    (CONFIGURATION.md, train.warmup_epochs)."""
    tr = cell.train
    if not tr.steps and tr.warmup_epochs > tr.epochs:
        return (
            f"train.warmup_epochs = {tr.warmup_epochs:g} is longer than train.epochs = {tr.epochs:g} "
            "(the learning rate would never finish warming up)"
        )
    return None


def loss_params_problem(cell: Cell) -> str | None:
    """The loss's parameters against the registry's bounds and relations, the cell's τ
    among them (:func:`smallbatch.losses.registry.params_problem`: the loss's constructor
    runs the same check)."""
    return params_problem(cell.loss, dict(cell.loss_params), cell.temperature)


def extreme_problem(cell: Cell) -> str | None:
    """A temperature outside :data:`TAU_RANGE`, a kNN headline k that is not one of the k
    computed, or a kNN k above the images the probe votes over (it would be clamped, yet
    labelled with the k asked for)."""
    problem = tau_problem(cell.temperature)
    if problem:
        return f"temperature {problem}"
    primary, ks = cell.eval.setting("knn_primary_k"), cell.eval.knn_k
    if primary is not None and primary not in ks:
        return (
            f"eval.knn_primary_k = {primary} is not one of eval.knn_k ({', '.join(map(str, ks))}); "
            "name one of them, or null for the largest"
        )
    name, subset = cell.dataset, cell.dataset_options.get("train_subset")
    sizes = split_sizes(name)
    if sizes is None:
        return None
    n = sizes["train"] if subset is None or pretrain_split(name) != "train" else min(sizes["train"], subset)
    big = [k for k in cell.eval.knn_k if k > n]
    if big:
        return (
            f"eval.knn_k = {big[0]} is more than the {n:,} train images of {name} the kNN probe votes over; "
            f"use k <= {n}"
        )
    classes = num_classes(name)
    return fewshot_problem(cell.eval, n / classes if classes else None)


def fewshot_problem(ev, per_class: float | None) -> str | None:
    """A few-label fraction the probe cannot honour (smallbatch.evaluation.probes.balanced_subset
    checks each class exactly; here, before any job, what no class can meet): more than the
    share of each class outside the validation split, or no image of a class of average size."""
    outside = 1 - ev.linear_val_fraction
    for f in ev.fewshot_fractions:
        if f > outside:
            return (
                f"eval.fewshot_fractions = {f:g} is more than the {outside:g} of each class's training images "
                f"outside the validation split (eval.linear_val_fraction = {ev.linear_val_fraction:g}); use at "
                "most that (all labels: the linear probe, linear/top1)"
            )
        if per_class is not None and round(f * per_class) < 1:
            return (
                f"eval.fewshot_fractions = {f:g} gives a class of {per_class:,.0f} training images no labelled "
                f"image (round({f:g} x {per_class:.0f}) = 0); use a fraction of at least {1 / per_class:.2g}"
            )
    return None


def control_problem(cell: Cell) -> str | None:
    """One line naming what is wrong with a cell's control settings (``train.neg_group``,
    ``bn_group``, ``mask_same_class``) or with its loss's needs (its registry properties:
    one process for a stateful or whole-batch loss, in-batch negatives for same-view ones,
    no ESS schedule for a learnt τ), or None."""
    tr, bs = cell.train, cell.batch_size
    for key in ("neg_group", "bn_group"):
        g = getattr(tr, key)
        if g and bs % g:
            return f"train.{key} = {g} does not divide batch_size {bs}; use a divisor of the batch size or null"
        if g and tr.devices > 1:
            return f"train.{key} runs on one process; set train.devices = 1 or {key}: null"
    if tr.neg_group and tr.queue_size:
        return "train.neg_group groups in-batch negatives; set queue_size: 0 or neg_group: null"
    if tr.bn_group and tr.chunk_size and tr.bn_group != bs:
        return (
            "train.bn_group normalises over groups of images, train.chunk_size over the whole batch; "
            "set one of them to null"
        )
    if tr.mask_same_class and tr.devices > 1:
        return "train.mask_same_class runs on one process; set train.devices = 1"
    return _extra_problem(cell) or _snapshot_problem(cell) or _loss_problem(cell)


def _loss_problem(cell: Cell) -> str | None:
    """What the cell's loss needs of the training, from its registry entry."""
    spec, tr = loss_spec(cell.loss), cell.train
    if tr.devices > 1 and spec.one_process:
        return f"{spec.one_process} runs on one process; set train.devices = 1"
    if not spec.contrastive:
        return _no_negatives_problem(spec.display, tr)
    if spec.negatives == "same_view" and tr.queue_size:
        return f"{spec.display} contrasts same-view in-batch negatives, which a queue does not hold; set queue_size: 0"
    if spec.owns_temperature and tr.ess_schedule:
        return f"{spec.display} learns its temperature; set train.ess_schedule: null"
    return None


def _no_negatives_problem(display: str, tr) -> str | None:
    """A method without negatives against the settings that need negatives or chunks."""
    needs = {
        "queue_size": "a queue of negatives; set queue_size: 0",
        "neg_group": "groups of negatives; set neg_group: null",
        "mask_same_class": "the same-class mask of negatives; set mask_same_class: false",
        "ess_schedule": "a temperature scheduled on its negatives' weights; set ess_schedule: null",
        "chunk_size": "gradient caching, which chunks a contrastive loss's embeddings; set chunk_size: null",
    }
    for key, what in needs.items():
        if getattr(tr, key):
            return f"{display} has no negatives: train.{key} asks for {what}"
    return None


def _extra_problem(cell: Cell) -> str | None:
    """What fresh negatives (``train.extra_negatives``) cannot be combined with, in one line."""
    tr = cell.train
    e = tr.extra_negatives
    if not e:
        return None
    for key, on in (
        ("queue_size", tr.queue_size),
        ("neg_group", tr.neg_group),
        ("mask_same_class", tr.mask_same_class),
        ("chunk_size", tr.chunk_size),
    ):
        if on:
            return f"train.extra_negatives adds in-batch negatives; set train.{key} off or extra_negatives: null"
    if tr.devices > 1:
        return "train.extra_negatives runs on one process; set train.devices = 1"
    spec = loss_spec(cell.loss)
    if spec.stateful or spec.negatives != "all" or not spec.per_anchor:
        return (
            f"train.extra_negatives scores each anchor against every other view; {spec.display} "
            "(per-image state, same-view negatives or a whole-batch loss) does not take them: set extra_negatives: null"
        )
    if tr.bn_group and e % tr.bn_group:
        return (
            f"train.bn_group = {tr.bn_group} does not divide train.extra_negatives = {e} (the extra images are "
            "normalised in groups too); use a multiple of bn_group"
        )
    return None


def budget_dependence(cell: Cell) -> str | None:
    """What a cell needs for its steps not to depend on its whole budget, or None when they do
    not: then the run to S steps is the first S steps of any longer run -- a snapshot is a
    shorter run, and a longer budget continues a shorter one's state.  Each schedule over the
    whole budget is named with the setting that removes it."""
    tr = cell.train
    if tr.lr_schedule != "constant":
        return f"train.lr_schedule: constant ({tr.lr_schedule} depends on the whole budget)"
    if tr.ess_schedule:
        return "a fixed tau (ess_schedule follows the whole budget)"
    if loss_spec(cell.loss).ema_target and cell.loss_params.get("ema_schedule") != "fixed":
        return "loss_params.ema_schedule: fixed (the cosine schedule raises the target's momentum to 1 over the budget)"
    return None


def _snapshot_problem(cell: Cell) -> str | None:
    """Snapshots are shorter runs only when nothing depends on the budget's length."""
    tr = cell.train
    if not tr.snapshot_epochs:
        return None
    need = budget_dependence(cell)
    if need:
        return (
            f"train.snapshot_epochs needs {need}, so that a snapshot is a shorter run; set it or snapshot_epochs: null"
        )
    if not tr.steps and max(tr.snapshot_epochs) > tr.epochs:
        return f"train.snapshot_epochs {max(tr.snapshot_epochs):g} is past train.epochs = {tr.epochs:g}"
    return None
