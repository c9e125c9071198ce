"""Cells as the tables show them: mean and spread over seeds, states, sorting and pivots.

A cell's runs give a mean and a sample standard deviation (ddof=1) over the
seeds that logged the metric.  A run with a bad status (``tracking.BAD_STATUSES``:
diverged, collapsed, failed) never contributes a number; a cell whose runs all
had one reads that status, one where some did reads ``mean ± std (k/n diverged)``;
a cell whose runs have not logged the metric yet reads ``pending``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..losses.registry import loss_rank
from ..tracking import BAD_STATUSES
from .fmt import finite, num
from .runs import METRICS

#: states shown in place of a number
NO_NUMBER = (*BAD_STATUSES, "pending")
#: column renames of display tables
_SHOWN = {"temperature": "τ", "label": "loss", "batch_size": "B"}


def bad_counts(status: pd.Series) -> dict[str, int]:
    """{bad status: number of runs}, in BAD_STATUSES order, for the statuses that occur."""
    counts = status.value_counts()
    return {s: int(counts[s]) for s in BAD_STATUSES if s in counts.index}


def display(mean: float, std: float, state: str, bad: dict[str, int] | None = None, n_runs: int = 0) -> str:
    """``72.5 ± 0.7``, ``72.5 ± —`` (one seed), ``72.5 ± 0.7 (1/2 diverged)``, or the state."""
    if not finite(mean):
        return str(state)
    s = f"{num(mean)} ± {num(std)}"
    if bad:
        s += " (" + ", ".join(f"{n}/{n_runs} {st}" for st, n in bad.items()) + ")"
    return s


def _state(n_values: int, bad: dict[str, int]) -> str:
    if n_values:
        return "partial" if bad else "ok"
    return next(iter(bad), "pending")


def _count_columns(runs: pd.DataFrame) -> list[str]:
    """``n_diverged, n_failed``, and ``n_collapsed`` between them where a run collapsed."""
    return ["n_diverged", *(["n_collapsed"] if (runs["status"] == "collapsed").any() else []), "n_failed"]


def aggregate_cells(
    runs: pd.DataFrame, keys: Sequence[str], scale: float, metrics: dict[str, str] = METRICS, values: bool = False
) -> pd.DataFrame:
    """Mean / sample std over seeds of each final metric per group of ``keys``.

    Returns one row per group and metric with columns ``*keys, metric, mean, std,
    n_seeds, n_runs, n_diverged, [n_collapsed,] n_failed, state, display`` where
    state is 'ok', 'partial' (some seeds had a bad status), 'diverged',
    'collapsed', 'failed' or 'pending' (``n_collapsed`` only where a run collapsed).
    ``values=True`` adds ``values``: {seed: top-1} of the seeds that gave a number (what
    :mod:`.evidence` pairs by seed; not a column for a CSV).
    """
    counts = _count_columns(runs) if len(runs) else ["n_diverged", "n_failed"]
    if runs.empty:
        return pd.DataFrame(columns=[*keys, "metric", "mean", "std", "n_seeds", "n_runs", *counts, "state", "display"])
    out = []
    for gkey, grp in runs.groupby(list(keys), sort=False, dropna=False):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        bad = bad_counts(grp["status"])
        good = grp[~grp["status"].isin(BAD_STATUSES)]
        for m, key in metrics.items():
            col = f"metrics.{key}"
            vals = (good[col] if col in good else pd.Series(dtype=float)).astype(float) * scale
            vals = vals[np.isfinite(vals)]
            n = len(vals)
            extra = (
                {"values": dict(zip(good.loc[vals.index, "seed"] if "seed" in good else vals.index, vals.tolist()))}
                if values
                else {}
            )
            mean = float(vals.mean()) if n else math.nan
            std = float(vals.std(ddof=1)) if n > 1 else math.nan
            state = _state(n, bad)
            out.append(
                {
                    **dict(zip(keys, gkey)),
                    "metric": m,
                    "mean": mean,
                    "std": std,
                    "n_seeds": n,
                    "n_runs": len(grp),
                    **{c: bad.get(c[2:], 0) for c in counts},
                    "state": state,
                    "display": display(mean, std, state, bad if n else None, len(grp)),
                    **extra,
                }
            )
    return pd.DataFrame(out)


def seed_values(agg: pd.DataFrame, **where: Any) -> dict:
    """{seed: value} of the first row of an aggregate made with ``values=True`` matching ``where``; {} if none."""
    r = first_row(agg, **where)
    return dict(r["values"]) if r is not None and isinstance(r.get("values"), dict) else {}


def sort_by_loss(df: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Stable sort by ``by``, where 'loss' sorts in the registry's order."""
    if df.empty:
        return df
    df = df.assign(_lr=df["loss"].map(loss_rank))
    return (
        df.sort_values([("_lr" if c == "loss" else c) for c in by], kind="stable")
        .drop(columns="_lr")
        .reset_index(drop=True)
    )


def label_order(df: pd.DataFrame) -> list[str]:
    """The distinct labels of ``df`` in loss order, then alphabetically."""
    pairs = df[["loss", "label"]].drop_duplicates()
    return [lab for _, lab in sorted(zip(pairs["loss"], pairs["label"]), key=lambda p: (loss_rank(p[0]), p[1]))]


def pivot(
    df: pd.DataFrame,
    index: Sequence[str],
    column: str,
    header: Callable[[Any], str],
    value: str = "display",
    columns: Sequence[Any] | None = None,
) -> pd.DataFrame:
    """Wide table: one row per ``index`` group (in order of appearance), one column per
    value of ``column`` (``columns``, default in order of appearance) named ``header(v)``;
    '' where a group has no such value."""
    cols = list(dict.fromkeys(df[column])) if columns is None else list(columns)
    rows = []
    for key, g in df.groupby(list(index), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(index, key))
        vals = dict(zip(g[column], g[value]))
        for c in cols:
            row[header(c)] = vals.get(c, "")
        rows.append(row)
    return pd.DataFrame(rows)


def shown(df: pd.DataFrame) -> pd.DataFrame:
    """Display column names: τ, loss (the label), B."""
    return df.rename(columns=_SHOWN)


def first_row(df: pd.DataFrame, **where: Any) -> pd.Series | None:
    """The first row whose columns equal ``where``; None if there is none."""
    m = np.ones(len(df), dtype=bool)
    for k, v in where.items():
        m &= (df[k] == v).to_numpy()
    sub = df[m]
    return sub.iloc[0] if len(sub) else None
