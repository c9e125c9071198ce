"""The main grid's batch-size dependence table and the findings read from it.

``dependence`` turns the aggregated grid (one row per cell and metric) into one
row per dataset x metric x τ x loss: the best batch size, the drop from it at
every batch size, and the change from the largest to the smallest batch.  Each
finding below is a function of that table (or of the aggregate) for one
dataset, metric and τ; every number in a sentence comes from it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ..losses import loss_rank
from ..tracking import BAD_STATUSES
from .aggregate import NO_NUMBER
from .evidence import two_se, within_noise
from .fmt import join, num, short, signed
from .runs import METRIC_LABELS


def _at(g: pd.DataFrame, b: Any, tag: str) -> dict[str, Any]:
    """mean/std/n/state of the cell at batch size ``b`` (``g`` indexed by batch size)."""
    if b not in g.index:
        return {f"mean_{tag}": math.nan, f"std_{tag}": math.nan, f"n_{tag}": 0, f"state_{tag}": "not run"}
    r = g.loc[b]
    return {f"mean_{tag}": float(r["mean"]), f"std_{tag}": float(r["std"]), f"n_{tag}": int(r["n_seeds"]),
            f"state_{tag}": str(r["state"])}


def dependence(agg: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, metric, temperature, label): best batch size, drops, small-vs-large gap."""
    rows = []
    for (ds, m, t, lab), g in agg.groupby(["dataset", "metric", "temperature", "label"], sort=False):
        bss_all = sorted(agg[(agg["dataset"] == ds) & (agg["temperature"] == t)]["batch_size"].unique())
        g = g.set_index("batch_size")
        vals = g[np.isfinite(g["mean"])]
        row: dict[str, Any] = {"dataset": ds, "metric": m, "temperature": t, "loss": g["loss"].iloc[0],
                               "label": lab, "best_batch_size": pd.NA, "best_mean": math.nan}
        if len(vals):
            row["best_batch_size"], row["best_mean"] = int(vals["mean"].idxmax()), float(vals["mean"].max())
        for b in bss_all:
            ok = b in g.index and np.isfinite(g.loc[b, "mean"])
            row[f"drop_bs{int(b)}"] = row["best_mean"] - float(g.loc[b, "mean"]) if ok else math.nan
        bmin, bmax = int(bss_all[0]), int(bss_all[-1])
        row["smallest_batch_size"], row["largest_batch_size"] = bmin, bmax
        row.update(_at(g, bmin, "smallest"))
        row.update(_at(g, bmax, "largest"))
        row["loss_large_to_small"] = row["mean_largest"] - row["mean_smallest"] if bmax != bmin else math.nan
        row["drop_at_smallest"] = row.get(f"drop_bs{bmin}", math.nan)
        row["states"] = {int(b): str(s) for b, s in g["state"].items()}
        rows.append(row)
    return pd.DataFrame(rows)


def dependence_display(dep: pd.DataFrame) -> pd.DataFrame:
    """The dependence table for reading: best B, drop@B per batch size, Δ largest→smallest."""
    drop_cols = sorted((c for c in dep.columns if c.startswith("drop_bs")), key=lambda c: int(c[7:]))
    out = []
    for _, r in dep.iterrows():
        row = {"τ": r["temperature"], "loss": r["label"],
               "best B": "" if pd.isna(r["best_batch_size"]) else int(r["best_batch_size"]),
               "best top-1": num(r["best_mean"])}
        for c in drop_cols:
            st = r["states"].get(int(c[7:]))
            row[f"drop@{int(c[7:])}"] = st if st in NO_NUMBER else ("" if st is None else num(r[c]))
        st = r["state_smallest"]
        gap = signed(-r["loss_large_to_small"]) if np.isfinite(r["loss_large_to_small"]) else (
            st if st in NO_NUMBER else "—")
        row[f"Δ B={int(r['largest_batch_size'])}→{int(r['smallest_batch_size'])}"] = gap
        out.append(row)
    return pd.DataFrame(out)


# --------------------------------------------------------------------------- findings
def _shown(r) -> float:
    """A loss's drop at the smallest batch as the sentences print it."""
    return round(float(r["drop_at_smallest"]), 1)


def _names(rs) -> str:
    return join([f"**{r['label']}**" for r in rs])


def _lead_sentence(first: pd.Series, second: pd.Series, bmin: int) -> str:
    """The least dependent loss's lead over the next one, read against the seed spread at batch bmin."""
    margin = float(second["drop_at_smallest"] - first["drop_at_smallest"])
    tse = two_se((first["std_smallest"], first["n_smallest"]), (second["std_smallest"], second["n_smallest"]))
    within = within_noise(margin, tse)
    if within is None:
        return (f"With a single seed in a cell there is no error estimate: the {margin:.1f}-point lead "
                f"over {second['label']} is not tested.")
    verdict = (f"is within two standard errors of the seed spread at batch {bmin} ({tse:.1f}), so these seeds do "
               "not separate the two" if within else
               f"exceeds two standard errors of the seed spread at batch {bmin} ({tse:.1f})")
    return f"Its lead over {second['label']} ({margin:.1f} points) {verdict}."


def _ranking(ranked: list, bad: list, bmin: int) -> list[str]:
    """Which loss depends least and most on batch size (a loss whose seeds all failed at bmin: most)."""
    if not ranked:
        return ["No loss has values at both batch sizes yet, so there is nothing to rank."]
    if len(ranked) == 1 and not bad:
        return ["Only one loss has values at both batch sizes, so there is nothing to rank."]
    if not bad and _shown(ranked[-1]) == 0.0:
        return [f"Every loss is at its best at batch {bmin} (to 0.1 points), so none loses accuracy at the "
                "smallest batch size and there is no dependence to rank."]
    lead = f"Measured as the drop from each loss's best batch size to batch {bmin}, "
    if not bad and _shown(ranked[0]) == _shown(ranked[-1]):
        return [lead + f"all {len(ranked)} losses lose the same {_shown(ranked[0]):.1f} points at this precision, "
                "so no loss depends less on batch size than another."]
    least = [r for r in ranked if _shown(r) == _shown(ranked[0])]
    rest = [r for r in ranked if _shown(r) != _shown(ranked[0])]
    s = lead + (f"the loss that depends least on batch size is {_names(least)} ({_shown(least[0]):.1f} points)"
                if len(least) == 1 else
                f"the losses that depend least on batch size are {_names(least)} (tied at {_shown(least[0]):.1f} "
                "points)")
    if bad:
        s += (f" and the one that depends most is **{bad[0]['label']}**, which {bad[0]['state_smallest']} at "
              f"batch {bmin}.")
    else:
        most = [r for r in rest if _shown(r) == _shown(ranked[-1])]
        s += (f" and the one that depends most is {_names(most)} ({_shown(most[0]):.1f} points)." if len(most) == 1
              else f" and the ones that depend most are {_names(most)} (tied at {_shown(most[0]):.1f} points).")
    return [s] + ([_lead_sentence(least[0], rest[0], bmin)] if len(least) == 1 and rest else [])


def dependence_finding(dep: pd.DataFrame, ds: str, m: str, t: float) -> str:
    """One paragraph for (dataset, metric, τ): the change from the largest to the smallest batch
    per loss, and which loss depends least and most on batch size."""
    d = dep[(dep["dataset"] == ds) & (dep["metric"] == m) & (dep["temperature"] == t)]
    if d.empty:
        return ""
    bmin, bmax = int(d["smallest_batch_size"].iloc[0]), int(d["largest_batch_size"].iloc[0])
    head = f"On {ds} at τ={short(t)} ({METRIC_LABELS.get(m, m)})"
    if bmin == bmax:
        return f"{head}: only batch size {bmin} was run, so batch-size dependence cannot be measured."
    rankable, bad, missing = [], [], []
    for _, r in d.iterrows():
        if all(np.isfinite(r[c]) for c in ("mean_smallest", "mean_largest", "drop_at_smallest")):
            rankable.append(r)
        else:
            (bad if r["state_smallest"] in BAD_STATUSES else missing).append(r)
    s = [head + ":"]
    if rankable:
        changes = ", ".join(f"{r['label']} {signed(r['mean_smallest'] - r['mean_largest'])}" for r in rankable)
        s.append(f"going from batch {bmax} to batch {bmin} the top-1 changes by {changes} points.")
    s += [f"{r['label']} {r['state_smallest']} at batch {bmin} (all seeds)." for r in bad]
    s += [f"{r['label']} is left out of the ranking (batch {bmin}: {r['state_smallest']}, "
          f"batch {bmax}: {r['state_largest']})." for r in missing]
    ranked = sorted(rankable, key=lambda r: (round(float(r["drop_at_smallest"]), 9), loss_rank(r["loss"]),
                                             r["label"]))
    return " ".join(s + _ranking(ranked, bad, bmin))


def baseline_finding(agg: pd.DataFrame, best: dict, ds: str, m: str) -> str:
    """How many grid cells of (dataset, metric) beat the best baseline."""
    a = agg[(agg["dataset"] == ds) & (agg["metric"] == m)]
    mlabel = METRIC_LABELS.get(m, m)
    if (ds, m) not in best:
        return f"On {ds} there is no baseline with a {mlabel}, so the pretraining gain cannot be computed."
    name, val = best[(ds, m)]
    beat = int(((a["mean"] - val) > 0).sum())
    n_bad = int(a["state"].isin(BAD_STATUSES).sum())
    n_pend = int((a["state"] == "pending").sum())
    words = "diverged, collapsed or failed" if (a["state"] == "collapsed").any() else "diverged or failed"
    extra = ([f"{n_bad} {words}"] if n_bad else []) + ([f"{n_pend} pending"] if n_pend else [])
    tail = f" ({'; '.join(extra)})" if extra else ""
    return f"On {ds}, {beat} of {len(a)} grid cells beat the best baseline's {mlabel} ({name}, {val:.1f}%){tail}."
