"""The instrument's contrasts in one unit (a data set, τ, budget and view) and their outcomes.

The factorial crosses the optimiser's batch B_opt (steps) with the negatives per anchor K, with
B_s the smallest and B_l the largest plain InfoNCE batch (16 and 256)::

                      K = 2 B_s − 2                  K = 2 B_l − 2
    B_opt = B_l   b: infonce@B_l/G{B_s} (grouped)   a: infonce@B_l (plain)
    B_opt = B_s   c: infonce@B_s (plain)            d: infonce@B_s/X{B_l − B_s} (fresh negatives)

and states, every term small − large (negative: the smaller is worse), paired by seed:

* the negatives main effect ``((b − a) + (c − d)) / 2`` (K small − large, averaged over B_opt);
* the B_opt main effect ``((c − b) + (d − a)) / 2``: at fixed epochs the small batch takes
  B_l/B_s times the steps, at fixed steps it sees B_s/B_l of the images;
* the interaction ``(c − d) − (b − a)``: the negatives effect at B_s minus that at B_l;
* both simple negatives effects, ``b − a`` (the negatives part of earlier reports) and ``c − d``.

At fixed epochs also the earlier contrasts where their arms ran: small − large ``c − a``, the
steps part ``c − b``, DCL and SogCLR at B_s against InfoNCE at B_l, the oracle mask at B_s and
B_s stopped at B_l's steps (``train.steps``).  The positive control (``infonce@B_l/G{g}``, K =
2g − 2 at most ``CONTROL_MAX_K``) against ``a`` is gate G3's test, outside the family.

Each row names its arms (``arms``, joined by ``|``: the plateau of a contrast is its arms') and
carries its raw test (p, interval, standard error and degrees of freedom); which rows are
claimed, the margin, the family's correction and the outcome are the analysis plan's
(:func:`smallbatch.report.plan.apply_plan`), applied over the whole study at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ...evaluation.gap import gap_fraction
from ...losses import display_name
from ..evidence import contrast
from ..fmt import finite
from .instrument_budgets import METRICS, Unit, seed_values
from .instrument_gates import CONTROL_MAX_K


def factorial_arms(small: int, big: int) -> dict[str, str]:
    """The four cells of the 2 x 2 (module docstring), by letter."""
    return {
        "a": f"infonce@{big}",
        "b": f"infonce@{big}/G{small}",
        "c": f"infonce@{small}",
        "d": f"infonce@{small}/X{big - small}",
    }


def control_arm(arms, big: int) -> str | None:
    """The positive control: the grouped arm at the reference batch with the smallest K <= CONTROL_MAX_K."""
    groups = []
    for arm in arms:
        head, _, mark = arm.partition("/")
        if head == f"infonce@{big}" and mark.startswith("G") and mark[1:].isdigit():
            groups.append(int(mark[1:]))
    ok = [g for g in groups if 2 * g - 2 <= CONTROL_MAX_K]
    return f"infonce@{big}/G{min(ok)}" if ok else None


def other_losses(arms: Iterable[str], small: int) -> list[str]:
    """The arms of losses other than InfoNCE at the small batch, plain (``dcl@16``,
    ``debiased-tau_plus0.01@16``): each is set against InfoNCE at the large batch."""
    return sorted(a for a in arms if a.endswith(f"@{small}") and not a.startswith("infonce@"))


def definitions(small: int, big: int, view: str, others: Iterable[str] = ()) -> list[tuple[str, str, list]]:
    """(key, name, terms) of every contrast of a unit's view; ``terms``: [(coefficient, arm)];
    ``others``: the arms of :func:`other_losses`, each a contrast keyed ``loss:<arm>``."""
    f = factorial_arms(small, big)
    a, b, c, d = f["a"], f["b"], f["c"], f["d"]
    ks, kl, r = 2 * small - 2, 2 * big - 2, big // small
    steps = f"B_opt {small} − {big}: " + (
        f"{r}x the steps at equal epochs" if view == "epochs" else f"1/{r} of the images at equal steps"
    )
    out: list[tuple[str, str, list]] = [
        ("negatives", f"negatives main effect (K {ks} − {kl})", [(0.5, b), (-0.5, a), (0.5, c), (-0.5, d)]),
        ("steps", f"steps main effect ({steps})", [(0.5, c), (-0.5, b), (0.5, d), (-0.5, a)]),
        (
            "interaction",
            f"interaction (negatives effect at B_opt {small} − at {big})",
            [(1, c), (-1, d), (-1, b), (1, a)],
        ),
        ("negatives_at_large", f"negatives at B_opt {big} (K {ks} − {kl}: grouped − plain)", [(1, b), (-1, a)]),
        ("negatives_at_small", f"negatives at B_opt {small} (K {ks} − {kl}: plain − fresh)", [(1, c), (-1, d)]),
    ]
    if view == "epochs":
        out += [
            ("small_large", "small − large", [(1, c), (-1, a)]),
            ("steps_part", "steps part (small − grouped)", [(1, c), (-1, b)]),
            *((f"loss:{arm}", f"{_arm_display(arm)} − InfoNCE@{big}", [(1, arm), (-1, a)]) for arm in others),
            ("oracle", f"oracle − plain, InfoNCE@{small}", [(1, f"infonce@{small}/oracle"), (-1, c)]),
            ("equal_steps", "small − large, equal steps", [(1, f"infonce@{small}/S"), (-1, a)]),
        ]
    return out


def _arm_display(arm: str) -> str:
    """``debiased-tau_plus0.01@16`` -> ``Debiased (tau_plus0.01)@16``."""
    head, size = arm.rsplit("@", 1)
    loss, _, params = head.partition("-")
    return f"{display_name(loss)}{f' ({params})' if params else ''}@{size}"


def _row(unit: Unit, metric: str, key: str, name: str, e, span: float, arms: list[str]) -> dict:
    return {
        "dataset": unit.dataset,
        "temperature": unit.temperature,
        "budget": unit.budget,
        "epochs": unit.epochs,
        "steps": unit.steps,
        "view": unit.view,
        "unit": unit.label(),
        "metric": metric,
        "metric_label": METRICS[metric][1],
        "key": key,
        "contrast": name,
        "arms": "|".join(arms),
        "diff": e.diff,
        "lo": e.lo,
        "hi": e.hi,
        "p": e.p,
        "se": e.se,
        "df": e.df,
        "seeds": e.n,
        "test": e.test,
        "mde": e.mde,
        "span": span,
        "fraction_of_supervised_gap": gap_fraction(e.diff, 0.0, span) if finite(span) else math.nan,
        "estimate": e,
    }


def unit_contrasts(unit: Unit, arms: dict, small: int, big: int, span: dict) -> tuple[list[dict], dict]:
    """The unit's contrast rows (every probe; raw tests: the plan corrects them) and, per probe,
    the positive control's estimate (G3).  ``arms``: arm -> its rows at the unit's rates;
    ``span``: probe -> supervised − random-init (for the fraction of that gap)."""
    rows, controls = [], {}
    pc = control_arm(arms, big)
    for m in METRICS:
        vals = {arm: seed_values(a, m) for arm, a in arms.items()}
        for key, name, terms in definitions(small, big, unit.view, other_losses(arms, small)):
            cells = [(c, vals.get(arm, {})) for c, arm in terms]
            if all(v for _, v in cells):
                arms_of = [arm for _, arm in terms]
                rows.append(_row(unit, m, key, name, contrast(cells), span.get(m, math.nan), arms_of))
        if pc and vals.get(pc) and vals.get(f"infonce@{big}"):
            e = contrast([(1.0, vals[pc]), (-1.0, vals[f"infonce@{big}"])])
            controls[m] = e
            k = 2 * int(pc.rsplit("G", 1)[1]) - 2
            name = f"positive control (K {k} − {2 * big - 2}, B_opt {big})"
            rows.append(_row(unit, m, "control", name, e, math.nan, [pc, f"infonce@{big}"]))
    return rows, {"arm": pc, **controls}
