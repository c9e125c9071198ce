"""The main grid's batch-size dependence table and the findings read from it.

``dependence`` turns the aggregated grid (one row per cell and metric, made with
``values=True``) into one row per dataset x metric x τ x loss: the best batch
size, the drop from it at every batch size, and the change **small − large**
(mean top-1 at the smallest minus at the largest batch size) tested seed by
seed (:mod:`.evidence`: paired t, Holm over the losses of one dataset, metric
and τ).  A loss's batch-size dependence is the size of that change; a ranking
of losses is stated only where the difference of two losses' changes is
significant (paired t, Holm over every pair), else they are called
indistinguishable with the minimum detectable effect.  ``pooled_changes`` pools the
losses' changes of one dataset, metric and τ in a model with loss and seed effects
(:func:`.evidence.pooled_difference`, Holm over the metrics and τs of a dataset), which
sees a shared pattern that a 2-seed test per loss cannot.  Every number in a sentence
comes from these tables.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ...data.registry import display_name as dataset_name
from ...losses.registry import loss_rank
from ...tracking import BAD_STATUSES
from ..aggregate import NO_NUMBER
from ..evidence import POOLED_ASSUMPTIONS, Estimate, contrast, describe, holm, p_text, pooled_difference
from ..fmt import finite, num, short, signed
from ..runs import METRIC_LABELS, METRICS
from ..tables import markdown_table

#: {(dataset, τ, loss label, batch size): (optimiser steps, epochs)} of the grid's runs (medians over seeds)
Budget = dict


def _at(g: pd.DataFrame, b: Any, tag: str) -> dict[str, Any]:
    """mean/std/n/state of the cell at batch size ``b`` (``g`` indexed by batch size)."""
    if b not in g.index:
        return {
            f"mean_{tag}": math.nan,
            f"std_{tag}": math.nan,
            f"n_{tag}": 0,
            f"state_{tag}": "not run",
            f"values_{tag}": {},
        }
    r = g.loc[b]
    return {
        f"mean_{tag}": float(r["mean"]),
        f"std_{tag}": float(r["std"]),
        f"n_{tag}": int(r["n_seeds"]),
        f"state_{tag}": str(r["state"]),
        f"values_{tag}": dict(r.get("values", {}) or {}),
    }


def budget(cells: pd.DataFrame, steps: pd.Series) -> Budget:
    """:data:`Budget` of the grid's runs: the median optimiser steps and epochs over a cell's seeds."""
    from ..runs import param_num

    b = cells.assign(_steps=steps.to_numpy(), _epochs=param_num(cells, "epochs").to_numpy())
    keys = ["dataset", "temperature", "label", "batch_size"]
    med = b.groupby(keys, dropna=False)[["_steps", "_epochs"]].median()
    return {
        (ds, float(t), lab, int(bs)): (float(r["_steps"]), float(r["_epochs"]))
        for (ds, t, lab, bs), r in med.iterrows()
    }


def dependence(agg: pd.DataFrame, spent: Budget | None = None) -> pd.DataFrame:
    """Per (dataset, metric, temperature, label): best batch size, drops, small-vs-large gap, and the
    optimiser steps at the smallest and largest batch size (``spent``, NaN where unknown)."""
    rows, spent = [], spent or {}
    for (ds, m, t, lab), g in agg.groupby(["dataset", "metric", "temperature", "label"], sort=False):
        bss_all = sorted(agg[(agg["dataset"] == ds) & (agg["temperature"] == t)]["batch_size"].unique())
        g = g.set_index("batch_size")
        vals = g[np.isfinite(g["mean"])]
        row: dict[str, Any] = {
            "dataset": ds,
            "metric": m,
            "temperature": t,
            "loss": g["loss"].iloc[0],
            "label": lab,
            "best_batch_size": pd.NA,
            "best_mean": math.nan,
        }
        if len(vals):
            row["best_batch_size"], row["best_mean"] = int(vals["mean"].idxmax()), float(vals["mean"].max())
        for b in bss_all:
            ok = b in g.index and np.isfinite(g.loc[b, "mean"])
            row[f"drop_bs{int(b)}"] = row["best_mean"] - float(g.loc[b, "mean"]) if ok else math.nan
        bmin, bmax = int(bss_all[0]), int(bss_all[-1])
        row["smallest_batch_size"], row["largest_batch_size"] = bmin, bmax
        row.update(_at(g, bmin, "smallest"))
        row.update(_at(g, bmax, "largest"))
        for tag, b in (("smallest", bmin), ("largest", bmax)):
            row[f"steps_{tag}"], row[f"epochs_{tag}"] = spent.get((ds, float(t), lab, int(b)), (math.nan, math.nan))
        row["drop_at_smallest"] = row.get(f"drop_bs{bmin}", math.nan)
        e = change(row) if bmax != bmin else Estimate(diff=math.nan)
        row.update(_estimate_columns(e))
        row["states"] = {int(b): str(s) for b, s in g["state"].items()}
        rows.append(row)
    return _holm_per_setting(pd.DataFrame(rows))


#: the columns of an :class:`.evidence.Estimate` in the dependence table
EST_COLUMNS = (
    "change_small_minus_large",
    "ci_low",
    "ci_high",
    "test",
    "n_pairs",
    "sd_of_differences",
    "p",
    "p_holm",
    "holm_family",
    "mde_80",
)
#: columns that are for computing, not for a CSV
HIDDEN = ["states", "values_smallest", "values_largest", "estimate"]


def change(row) -> Estimate:
    """small − large of one loss, seed by seed (paired t; Welch or untested where pairing is impossible);
    untested from the means where no per-seed values were kept."""
    e = contrast([(1.0, row["values_smallest"]), (-1.0, row["values_largest"])])
    if not finite(e.diff) and finite(row["mean_smallest"]) and finite(row["mean_largest"]):
        return Estimate(diff=row["mean_smallest"] - row["mean_largest"])
    return e


def _estimate_columns(e: Estimate) -> dict:
    return {
        "change_small_minus_large": e.diff,
        "ci_low": e.lo,
        "ci_high": e.hi,
        "test": e.test,
        "n_pairs": e.n,
        "sd_of_differences": e.sd,
        "p": e.p,
        "p_holm": e.p_adj,
        "holm_family": e.family,
        "mde_80": e.mde,
        "estimate": e,
    }


def _holm_per_setting(dep: pd.DataFrame) -> pd.DataFrame:
    """Holm over the losses' changes of each dataset x metric x τ (one paragraph's family)."""
    if dep.empty:
        return dep
    dep = dep.copy()
    for _, g in dep.groupby(["dataset", "metric", "temperature"], sort=False):
        for i, e in zip(g.index, holm(g["estimate"])):
            for k, v in _estimate_columns(e).items():
                dep.at[i, k] = v
    return dep


def dependence_display(dep: pd.DataFrame) -> pd.DataFrame:
    """The dependence table for reading: best B, drop@B per batch size, small − large with its
    interval and Holm-adjusted p."""
    drop_cols = sorted((c for c in dep.columns if c.startswith("drop_bs")), key=lambda c: int(c[7:]))
    out = []
    for _, r in dep.iterrows():
        row = {
            "τ": r["temperature"],
            "loss": r["label"],
            "best B": "" if pd.isna(r["best_batch_size"]) else int(r["best_batch_size"]),
            "best top-1": num(r["best_mean"]),
        }
        for c in drop_cols:
            st = r["states"].get(int(c[7:]))
            row[f"drop@{int(c[7:])}"] = st if st in NO_NUMBER else ("" if st is None else num(r[c]))
        st, e = r["state_smallest"], r["estimate"]
        bs, bl = int(r["smallest_batch_size"]), int(r["largest_batch_size"])
        head = "Δ small − large"
        row["B small→large"] = f"{bs}→{bl}" if bs != bl else f"{bs} only"
        if bs == bl:
            row[head], row["95 % CI"], row["Holm p"] = "—", "", ""
        elif finite(e.diff):
            row[head] = signed(e.diff)
            row["95 % CI"] = f"[{signed(e.lo)}, {signed(e.hi)}]" if e.tested else "untested"
            row["Holm p"] = p_text(e.p_adj) if e.tested else ""
        else:
            row[head], row["95 % CI"], row["Holm p"] = (st if st in NO_NUMBER else "—"), "", ""
        out.append(row)
    return pd.DataFrame(out)


# --------------------------------------------------------------------------- findings
def _size(r) -> float:
    """A loss's batch-size dependence: |small − large|."""
    return abs(float(r["estimate"].diff))


def _dependence_gap(a, b) -> Estimate:
    """|Δ_a| − |Δ_b| seed by seed, each change taken with the sign of its mean (a linear contrast)."""
    sa, sb = math.copysign(1.0, a["estimate"].diff), math.copysign(1.0, b["estimate"].diff)
    return contrast(
        [(sa, a["values_smallest"]), (-sa, a["values_largest"]), (-sb, b["values_smallest"]), (sb, b["values_largest"])]
    )


def _ranking(ranked: list, bad: list, bmin: int, bmax: int) -> list[str]:
    """Which loss depends most and least on batch size, stated only with a significant test."""
    lead = (
        [f"**{bad[0]['label']}** depends most on batch size: it {bad[0]['state_smallest']} at batch {bmin}."]
        if bad
        else []
    )
    if len(ranked) < 2:
        return lead + (
            []
            if bad
            else [
                f"{'Only one loss has' if ranked else 'No loss has'} values at both batch "
                "sizes, so there is nothing to rank."
            ]
        )
    ranked = sorted(ranked, key=lambda r: (-_size(r), loss_rank(r["loss"]), r["label"]))
    pairs = [(i, j) for i in range(len(ranked)) for j in range(i + 1, len(ranked))]
    tests = holm([_dependence_gap(ranked[i], ranked[j]) for i, j in pairs])
    most, least = ranked[0], ranked[-1]
    e = tests[pairs.index((0, len(ranked) - 1))]
    what = f"|Δ {most['label']}| − |Δ {least['label']}|"
    fam = " (Holm over every pair of losses)" if len(pairs) > 1 else ""
    if e.significant:
        return lead + [
            f"Measured as |Δ|, **{most['label']}** depends {'more' if bad else 'most'} on batch size "
            f"and **{least['label']}** least{fam}: {describe(e, what)}."
        ]
    if not e.tested:
        return lead + [
            ("The other losses" if bad else "The losses") + " cannot be ranked by their dependence on "
            f"batch size (|Δ|) at these seeds: the largest against the smallest, {describe(e, what)}."
        ]
    return lead + [
        ("The other losses'" if bad else "The losses'") + " dependence on batch size (|Δ|) is "
        f"indistinguishable at these seeds: the largest against the smallest, {describe(e, what)}."
    ]


def _rankable(d: pd.DataFrame) -> tuple[list, list, list]:
    """The rows of one setting with a change (rankable), with every seed bad at the small batch, and the rest."""
    rankable: list = []
    bad: list = []
    missing: list = []
    for _, r in d.iterrows():
        if finite(r["estimate"].diff):
            rankable.append(r)
        else:
            (bad if r["state_smallest"] in BAD_STATUSES else missing).append(r)
    return rankable, bad, missing


def dependence_finding(dep: pd.DataFrame, ds: str, m: str, t: float) -> str:
    """Which loss depends most and least on batch size at (dataset, metric, τ), stated only where a test
    separates them (the changes themselves are in :func:`batch_finding`'s table); '' when only one batch
    size was run."""
    d = dep[(dep["dataset"] == ds) & (dep["metric"] == m) & (dep["temperature"] == t)]
    if d.empty or int(d["smallest_batch_size"].iloc[0]) == int(d["largest_batch_size"].iloc[0]):
        return ""
    bmin, bmax = int(d["smallest_batch_size"].iloc[0]), int(d["largest_batch_size"].iloc[0])
    rankable, bad, missing = _rankable(d)
    s = [f"{r['label']} {r['state_smallest']} at batch {bmin} (all seeds)." for r in bad]
    s += [
        f"{r['label']} is left out of the ranking (batch {bmin}: {r['state_smallest']}, "
        f"batch {bmax}: {r['state_largest']})."
        for r in missing
    ]
    return f"{METRIC_LABELS.get(m, m)}: " + " ".join(s + _ranking(rankable, bad, bmin, bmax))


# --------------------------------------------------------------------------- pooled over losses
#: the pooled table's columns beyond an estimate's
POOLED_KEYS = ["dataset", "metric", "temperature", "smallest_batch_size", "largest_batch_size", "losses", "left_out"]


_BUDGET = ("steps_smallest", "steps_largest", "epochs_smallest", "epochs_largest")


def _common_budget(rows: list) -> dict:
    """The steps and epochs at either end that most of ``rows`` share, and how many share them (``budget_losses``)."""
    seen: dict = {}
    for r in rows:
        key = tuple(float(r.get(k, math.nan)) for k in _BUDGET)
        if all(finite(v) for v in key):
            seen[key] = seen.get(key, 0) + 1
    if not seen:
        return {**dict.fromkeys(_BUDGET, math.nan), "budget_losses": 0}
    key = max(seen, key=lambda k: (seen[k], k))
    return {**dict(zip(_BUDGET, key)), "budget_losses": seen[key]}


def pooled_changes(dep: pd.DataFrame) -> pd.DataFrame:
    """One row per dataset x metric x τ with two batch sizes: small − large pooled over the losses with a change
    (:func:`.evidence.pooled_difference`), Holm over the metrics and τs of a dataset; the optimiser steps of
    the pooled losses at either end (a single value where they agree, else NaN)."""
    rows = []
    for (ds, m, t), d in dep.groupby(["dataset", "metric", "temperature"], sort=False):
        bmin, bmax = int(d["smallest_batch_size"].iloc[0]), int(d["largest_batch_size"].iloc[0])
        if bmin == bmax:
            continue
        ok, bad, missing = _rankable(d)
        e = pooled_difference({r["label"]: (r["values_smallest"], r["values_largest"]) for r in ok})
        row = dict(zip(POOLED_KEYS, (ds, m, t, bmin, bmax, len(ok), ", ".join(r["label"] for r in bad + missing))))
        row.update(_common_budget(ok))
        rows.append({**row, **_estimate_columns(e), "df": e.df})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    for _, g in out.groupby("dataset", sort=False):
        for i, e in zip(g.index, holm(g["estimate"])):
            for k, v in _estimate_columns(e).items():
                out.at[i, k] = v
    return out


def pooled_display(pool: pd.DataFrame) -> pd.DataFrame:
    """The pooled table for reading: one row per metric and τ."""
    rows = []
    for _, r in pool.iterrows():
        e = r["estimate"]
        rows.append(
            {
                "metric": METRIC_LABELS.get(r["metric"], r["metric"]),
                "τ": r["temperature"],
                "B small→large": f"{int(r['smallest_batch_size'])}→{int(r['largest_batch_size'])}",
                "losses": int(r["losses"]),
                "pairs": int(e.n),
                "Δ small − large": signed(e.diff, 2),
                "95 % CI": f"[{signed(e.lo, 2)}, {signed(e.hi, 2)}]" if e.tested else "untested",
                "df": "" if not finite(e.df) else f"{e.df:g}",
                "Holm p": p_text(e.p_adj) if e.tested else "",
                "MDE (80 %)": num(e.mde, 2) if finite(e.mde) else "",
            }
        )
    return pd.DataFrame(rows)


#: how the pooled test is described under the table (its assumptions)
POOLED_NOTE = (
    "pooled Δ = mean over the losses of small − large, from " + POOLED_ASSUMPTIONS + "; Holm over the metrics and "
    "temperatures of the dataset; losses without a value at both batch sizes are left out"
)


def _interval_cell(e: Estimate, state: str) -> tuple[str, str]:
    """(Δ [lo, hi], Holm p) of one loss for the finding's table; the state where there is no number."""
    if not finite(e.diff):
        return (state if state in NO_NUMBER else "—"), ""
    if not e.tested:
        return f"{signed(e.diff)} (untested)", ""
    return f"{signed(e.diff)} [{signed(e.lo)}, {signed(e.hi)}]", p_text(e.p_adj)


def _finding_table(dep: pd.DataFrame, pool: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """Loss rows × (Δ [95 % CI], Holm p) per metric, then the pooled row."""
    labels = list(dict.fromkeys(dep["label"]))
    rows = []
    for lab in labels:
        row = {"loss": lab}
        for m in metrics:
            r = dep[(dep["label"] == lab) & (dep["metric"] == m)]
            cell = ("—", "") if r.empty else _interval_cell(r["estimate"].iloc[0], str(r["state_smallest"].iloc[0]))
            row[f"{METRIC_LABELS[m]}: Δ [95 % CI]"], row[f"{METRIC_LABELS[m]}: Holm p"] = cell
        rows.append(row)
    row = {"loss": "pooled (loss + seed model)"}
    for m in metrics:
        r = pool[pool["metric"] == m]
        cell = ("—", "") if r.empty else _interval_cell(r["estimate"].iloc[0], "")
        row[f"{METRIC_LABELS[m]}: Δ [95 % CI]"], row[f"{METRIC_LABELS[m]}: Holm p"] = cell
    return pd.DataFrame([*rows, row])


def _steps_clause(pool: pd.DataFrame, bmin: int, bmax: int) -> str:
    """'at a fixed 3 epochs batch 16 took 15.6× the optimiser steps of batch 256 (1,875 against 120)', or ''."""
    r = pool.iloc[0]
    small, large, ep_s, ep_l = (r[k] for k in _BUDGET)
    if not (finite(small) and finite(large) and large > 0):
        return ""
    at = f"at a fixed {short(ep_s)} epochs " if ep_s == ep_l else ""
    some = (
        ""
        if r["budget_losses"] == r["losses"]
        else f" (for {int(r['budget_losses'])} of the {int(r['losses'])} losses)"
    )
    return (
        f"{at}batch {bmin} took {small / large:.1f}× the optimiser steps of batch {bmax} "
        f"({int(small):,} against {int(large):,}){some}, so the difference is one of steps as much as of batch size"
    )


def _pooled_clause(pool: pd.DataFrame, metrics: list[str], bmin: int) -> str:
    """'+0.33 [+0.24, +0.42] (loss + seed model, …) by kNN top-1, batch 16 ahead, and …'"""
    parts = []
    for m in metrics:
        r = pool[pool["metric"] == m]
        if r.empty:
            continue
        e = r["estimate"].iloc[0]
        verdict = (
            (f", batch {bmin} ahead" if e.diff > 0 else f", batch {bmin} behind")
            if e.significant
            else (", within noise" if e.tested else "")
        )
        parts.append(f"{describe(e, nd=2)} by {METRIC_LABELS[m]}{verdict}")
    return ", and ".join(parts)


def batch_finding(dep: pd.DataFrame, pool: pd.DataFrame, ds: str, t: float) -> str:
    """The grid's batch-size finding for (dataset, τ): one sentence of conclusion (the change pooled over the
    losses, per metric, and the optimiser steps the two batch sizes took), the table of every loss's change
    with its interval, and the ranking of the losses per metric where a test allows one."""
    d = dep[(dep["dataset"] == ds) & (dep["temperature"] == t)]
    if d.empty:
        return ""
    bmin, bmax = int(d["smallest_batch_size"].iloc[0]), int(d["largest_batch_size"].iloc[0])
    head = f"On {dataset_name(ds)} at τ = {short(t)}"
    if bmin == bmax:
        return f"{head} only batch size {bmin} was run, so batch-size dependence cannot be measured."
    pool = pool[(pool["dataset"] == ds) & (pool["temperature"] == t)] if len(pool) else pool
    metrics = [m for m in METRICS if m in set(d["metric"])]
    n = int(pool["losses"].max()) if len(pool) else 0
    steps = _steps_clause(pool, bmin, bmax) if len(pool) else ""
    sentence = (
        f"{head}, pooled over {n} loss{'es' if n != 1 else ''}, batch {bmin} − batch {bmax} = "
        + _pooled_clause(pool, metrics, bmin)
        + (f"; {steps}" if steps else "")
        + "."
    )
    note = (
        f"Δ = top-1 at batch {bmin} − at batch {bmax} (points), 95 % paired-t interval over seeds, p Holm-adjusted "
        "over the losses; the pooled row fits the loss × seed differences with loss and seed effects "
        "(its assumptions: Main grid)."
    )
    ranking = [x for x in (dependence_finding(dep, ds, m, t) for m in metrics) if x]
    return "\n\n".join([sentence, markdown_table(_finding_table(d, pool, metrics)).rstrip("\n"), note, *ranking])


def baseline_finding(agg: pd.DataFrame, best: dict, ds: str, m: str, base_values: dict | None = None) -> str:
    """How many grid cells of (dataset, metric) beat the best baseline, each tested (cell − baseline,
    paired by seed; a one-seed baseline is a constant), Holm over the cells."""
    a = agg[(agg["dataset"] == ds) & (agg["metric"] == m)]
    mlabel = METRIC_LABELS.get(m, m)
    if (ds, m) not in best:
        return (
            f"On {dataset_name(ds)} there is no baseline with a {mlabel}, so the pretraining gain cannot be computed."
        )
    name, val = best[(ds, m)]
    base = dict(base_values or {})
    const = len(base) < 2
    tests = holm([(_versus(r.get("values") or {}, base, val, const)) for _, r in a.iterrows()])
    up = sum(1 for e in tests if e is not None and e.significant and e.diff > 0)
    down = sum(1 for e in tests if e is not None and e.significant and e.diff < 0)
    same = sum(1 for e in tests if e is not None and e.tested and not e.significant)
    untested = sum(1 for e in tests if e is not None and finite(e.diff) and not e.tested)
    beat = int(((a["mean"] - val) > 0).sum())
    n_bad = int(a["state"].isin(BAD_STATUSES).sum())
    n_pend = int((a["state"] == "pending").sum())
    words = "diverged, collapsed or failed" if (a["state"] == "collapsed").any() else "diverged or failed"
    extra = ([f"{n_bad} {words}"] if n_bad else []) + ([f"{n_pend} pending"] if n_pend else [])
    tail = f" ({'; '.join(extra)})" if extra else ""
    how = "one-sample t against its one value" if const else "paired t by seed"
    fam = sum(1 for e in tests if e is not None and e.tested)
    head = (
        f"On {dataset_name(ds)}, {beat} of {len(a)} grid cells have a mean above the best baseline's {mlabel} "
        f"({name}, {val:.1f}%){tail}"
    )
    if not fam:  # no test to state (not 'Holm over 0 cells, 0 significantly above')
        return f"{head}; none can be tested (one seed, or no spread across seeds)."
    return (
        f"{head}; tested (cell − baseline, {how}, Holm over {fam} cells), "
        f"{up} are significantly above it, {down} significantly below and {same} indistinguishable"
        + (f", {untested} untested (one seed or no spread)" if untested else "")
        + "."
    )


def _versus(cell: dict, base: dict, val: float, const: bool) -> Estimate | None:
    if not cell:
        return None
    return contrast([(1.0, cell), (-1.0, {s: val for s in cell} if const else base)])
