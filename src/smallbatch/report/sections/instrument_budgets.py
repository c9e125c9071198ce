"""The instrument's numbers, one row per cell and training budget, and the units they are compared in.

A cell of the instrument study is evaluated at its end (its final checkpoint) and, with
``train.snapshot_epochs``, at each snapshot of its run (``snapshot/<name>/...`` metrics of the
same MLflow run): each is a *budget* row with its epochs, optimiser steps and images seen.  A
snapshot at the final step is the final checkpoint and is not counted twice.

Arms are named from their settings (:func:`arm_of`): ``infonce@256`` (plain), ``infonce@256/G16``
(negatives within groups of 16, ``train.neg_group``), ``infonce@16/X240`` (240 fresh extra
negatives, ``train.extra_negatives``), ``infonce@16/oracle`` (same-class negatives masked),
``infonce@16/S`` (a fixed number of steps, ``train.steps``); the learning rate is a column of
its own.

A *unit* is what one verdict is about: a data set, a temperature, a budget of the reference
arm (InfoNCE at the largest plain batch) and a *view* -- ``epochs`` (every arm at that many
epochs) or ``steps`` (every arm at that many optimiser steps: the small batch's snapshot at the
large batch's step count).  In a unit each batch size's learning rate is the one whose plain
InfoNCE arm has the best mean validation accuracy of the linear probe (a split of the training
data, never the test split) among those it was run at, at that unit's budget
(:func:`chosen_lrs`); every arm of that batch size is read at it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ...study.lr_scaling import scaled_lr
from ...study.probe_registry import SPECS as PROBE_SPECS
from ...tracking import BAD_STATUSES
from ..fmt import finite, short

#: short name -> (MLflow metric key, label), in the tables' order; the first is the primary metric
METRICS = {
    "linear": ("linear/top1", "linear probe"),
    "labels10": ("linear/labels10pct_top1_mean", "10 % labels"),
    "labels1": ("linear/labels1pct_top1_mean", "1 % labels"),
    "knn20": ("knn/top1_k20", "kNN@20"),
    "knn200": ("knn/top1_k200", "kNN@200"),
}
PRIMARY = next(iter(METRICS))
#: the opt-in probes' headline metrics (smallbatch.study.probe_registry: not run unless eval.probes names
#: them), short name -> (MLflow key, label): a column of the arms table where runs logged them, never contrasted
OPT_IN = {n: (s.key, s.label) for n, s in PROBE_SPECS.items() if not s.default}
#: the metric the learning rate is chosen on: the linear probe's top-1 on the validation split
VAL_METRIC = "linear/val_top1"
#: a snapshot's ``snapshot/<name>/status`` code -> its outcome (``smallbatch.pipeline.jobs.SNAPSHOT_STATUS``)
SNAPSHOT_STATUS = {0: "finished", 1: "collapsed", 2: "diverged"}
_SNAPSHOT_KEY = re.compile(r"^metrics\.snapshot/(?P<name>[^/]+)/steps$")


def _is_set(v: Any) -> bool:
    return str(v).strip().lower() not in ("", "none", "nan", "null", "false", "0")


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def arm_of(row: pd.Series) -> str:
    """``infonce@256/G16``, ``infonce@16/X240``, ``infonce@16/oracle``, ``infonce@16/S``, ``dcl@16``;
    a loss with parameters set in its cell id keeps them (``debiased-tau_plus0.01@16``)."""
    arm = f"{_loss_label(row)}@{int(row['batch_size'])}"
    if _is_set(row.get("params.neg_group")):
        arm += f"/G{int(_num(row['params.neg_group']))}"
    if _is_set(row.get("params.extra_negatives")):
        arm += f"/X{int(_num(row['params.extra_negatives']))}"
    if _is_set(row.get("params.mask_same_class")):
        arm += "/oracle"
    if _is_set(row.get("params.steps")):
        arm += "/S"
    return arm


def _loss_label(row: pd.Series) -> str:
    """The loss as the cell id names it (with its parameters), else the registry name."""
    parts = str(row.get("cell_id") or "").split("/")
    named = parts[-2] if len(parts) >= 3 else ""
    return named if named.partition("-")[0] == row["loss"] else str(row["loss"])


def peak_lr(lr: float, batch_size: int, rule: Any) -> float:
    """The rate the cell trained at (``train.lr`` scaled to its batch, ``train.lr_scaling``)."""
    return scaled_lr(lr, batch_size, str(rule).strip().lower() if _is_set(rule) else "none")


def _final_budget(row: pd.Series) -> dict:
    bs = int(row["batch_size"])
    images = _num(row.get("params.pretrain_images"))
    spe = int(images) // bs if finite(images) else math.nan
    steps = _num(row.get("metrics.train/steps"))
    if not finite(steps) and _is_set(row.get("params.steps")):
        steps = _num(row["params.steps"])
    if not finite(steps) and finite(spe):
        steps = math.ceil(_num(row.get("params.epochs")) * spe)
    epochs = steps / spe if finite(steps) and finite(spe) else _num(row.get("params.epochs"))
    return {"budget": "final", "epochs": epochs, "steps": steps, "images": steps * bs}


def _values(row: pd.Series, prefix: str) -> dict:
    out = {m: _num(row.get(f"metrics.{prefix}{key}")) for m, (key, _) in {**METRICS, **OPT_IN}.items()}
    out["val"] = _num(row.get(f"metrics.{prefix}{VAL_METRIC}"))
    return out


def _snapshots(row: pd.Series, final_steps: float) -> list[dict]:
    out = []
    for col in row.index:
        m = _SNAPSHOT_KEY.match(col)
        if not m or not finite(row[col]):
            continue
        name, pre = m["name"], f"snapshot/{m['name']}/"
        steps = float(row[col])
        if finite(final_steps) and steps == final_steps:
            continue  # the final checkpoint itself
        code = _num(row.get(f"metrics.{pre}status"))
        status = SNAPSHOT_STATUS.get(int(code), "failed") if finite(code) else "finished"
        budget = {
            "budget": name,
            "epochs": _num(row.get(f"metrics.{pre}epochs")),
            "steps": steps,
            "images": _num(row.get(f"metrics.{pre}images_seen")),
        }
        out.append({**budget, "status": status, **_values(row, pre)})
    return out


def budget_rows(cells: pd.DataFrame, scale: float) -> pd.DataFrame:
    """One row per cell and budget: ``dataset, temperature, arm, loss, batch_size, group, extra,
    lr, peak_lr, seed, status, budget, epochs, steps, images`` and the metrics (top-1 %) of
    :data:`METRICS` and :data:`OPT_IN` plus ``val`` (:data:`VAL_METRIC`)."""
    rows = []
    for _, r in cells.iterrows():
        lr, bs = _num(r.get("params.lr")), int(r["batch_size"])
        lr = lr if finite(lr) else 0.0  # not logged: one rate, 0, so the rate is a plain key
        base = {
            "run_id": r.get("run_id"),
            "dataset": r["dataset"],
            "temperature": float(r["temperature"]),
            "arm": arm_of(r),
            "loss": r["loss"],
            "batch_size": bs,
            "group": _num(r.get("params.neg_group")),
            "extra": _num(r.get("params.extra_negatives")),
            "lr": lr,
            "peak_lr": peak_lr(lr, bs, r.get("params.lr_scaling")),
            "seed": int(r["seed"]),
        }
        final = {**_final_budget(r), "status": r["status"], **_values(r, "")}
        rows += [{**base, **b} for b in [final, *_snapshots(r, final["steps"])]]
    df = pd.DataFrame(rows)
    if len(df):
        cols = [*METRICS, *OPT_IN, "val"]
        df[cols] = df[cols].astype(float) * scale
    return df


# --------------------------------------------------------------------------- units
@dataclass(frozen=True)
class Unit:
    """What one verdict is about (module docstring): ``budget`` names the reference arm's
    budget ('final' or a snapshot's ``ep<e>``), ``epochs``/``steps`` its length, ``view`` 'epochs'
    or 'steps'."""

    dataset: str
    temperature: float
    budget: str
    epochs: float
    steps: float
    view: str = "epochs"

    @property
    def gate_key(self) -> tuple:
        """The gates G1-G3 do not depend on the view."""
        return (self.dataset, self.temperature, self.budget)

    def label(self) -> str:
        tau = f"τ {short(self.temperature)}"
        if not finite(self.epochs):
            return f"{self.dataset}, {tau}, final budget"
        ep = f"{short(self.epochs)} epoch{'' if self.epochs == 1 else 's'}"
        if self.view == "steps":
            return f"{self.dataset}, {tau}, {int(self.steps):,} steps (fixed steps: the reference's {ep})"
        return f"{self.dataset}, {tau}, {ep} (fixed epochs)"


def batch_levels(rows: pd.DataFrame) -> tuple[int | None, int | None]:
    """(the smallest, the largest) batch size of plain InfoNCE arms; None where there is none."""
    plain = rows[rows["arm"].str.fullmatch(r"infonce@\d+")] if len(rows) else rows
    sizes = sorted(set(plain["batch_size"])) if len(plain) else []
    return (sizes[0], sizes[-1]) if sizes else (None, None)


def units(rows: pd.DataFrame) -> list[Unit]:
    """Every unit: per data set and τ of the reference arm, each of its budgets in the epochs
    view and, where the small batch has a budget at the same number of steps, the steps view."""
    small, big = batch_levels(rows)
    if big is None:
        return []
    ref = rows[rows["arm"] == f"infonce@{big}"]
    out = []
    for (ds, tau), g in ref.groupby(["dataset", "temperature"], sort=True):
        budgets = g.drop_duplicates("budget").sort_values(["epochs", "budget"], na_position="last")
        small_steps = set(rows[(rows["dataset"] == ds) & (rows["batch_size"] == small)]["steps"].dropna())
        for _, b in budgets.iterrows():
            out.append(Unit(ds, float(tau), b["budget"], b["epochs"], b["steps"], "epochs"))
            if small != big and finite(b["steps"]) and b["steps"] in small_steps:
                out.append(Unit(ds, float(tau), b["budget"], b["epochs"], b["steps"], "steps"))
    return out


def matched(rows: pd.DataFrame, unit: Unit) -> pd.DataFrame:
    """The rows of the unit's data set and τ at its budget: in the epochs view those at its
    epochs (a fixed-steps arm, ``/S``, at its steps), in the steps view those at its steps; where
    the budget's length is unknown (no ``train/steps`` logged), the final rows."""
    g = rows[(rows["dataset"] == unit.dataset) & (rows["temperature"] == unit.temperature)]
    if not finite(unit.epochs):
        return g[g["budget"] == "final"]
    at_steps = g["steps"] == unit.steps
    if unit.view == "steps":
        return g[at_steps]
    at_epochs = (g["epochs"] - unit.epochs).abs() <= 1e-6 * max(1.0, abs(unit.epochs))
    return g[(at_epochs & ~g["arm"].str.endswith("/S")) | (at_steps & g["arm"].str.endswith("/S"))]


def good(g: pd.DataFrame) -> pd.DataFrame:
    return g[~g["status"].isin(BAD_STATUSES)]


def lr_means(g: pd.DataFrame) -> pd.DataFrame:
    """Per (batch size, arm, lr) of ``g``: the mean validation and test top-1 over the seeds
    that have a test top-1 (a run still training at this budget is no seed of it)."""
    ok = good(g).dropna(subset=[PRIMARY])
    agg = ok.groupby(["batch_size", "arm", "lr"], sort=True).agg(
        val_mean=("val", "mean"), val_sd=("val", "std"), test_mean=(PRIMARY, "mean"), seeds=("seed", "nunique")
    )
    return agg.reset_index()


def chosen_lrs(g: pd.DataFrame) -> dict[int, float]:
    """batch size -> its learning rate in these rows: the best validation mean of its plain
    InfoNCE arm; without a validation score (no ``eval.linear_weight_decays``) the rate most of
    that batch size's rows use (ties: the smaller), never one chosen on the test split."""
    out = {}
    means = lr_means(g[g["arm"].str.fullmatch(r"infonce@\d+")])
    for bs, m in means.groupby("batch_size"):
        if m["val_mean"].notna().any():
            out[int(bs)] = float(m.loc[m["val_mean"].idxmax(), "lr"])
        else:
            counts = good(g[g["batch_size"] == bs])["lr"].value_counts()
            out[int(bs)] = float(min(counts.index[counts == counts.max()]))
    return out


def arm_rows(g: pd.DataFrame, lrs: dict[int, float]) -> dict[str, pd.DataFrame]:
    """arm -> its rows at its batch size's chosen rate (``lrs``), or at its one rate; an arm run
    at several rates none of which was chosen is left out."""
    out = {}
    for arm, a in g.groupby("arm", sort=True):
        bs = int(a["batch_size"].iloc[0])
        rates = sorted(set(a["lr"]))
        pick = lrs.get(bs)
        if pick is not None and any(math.isclose(r, pick) for r in rates):
            out[arm] = a[[math.isclose(r, pick) for r in a["lr"]]]
        elif len(rates) == 1:
            out[arm] = a
    return out


def seed_values(a: pd.DataFrame, metric: str) -> dict[int, float]:
    """{seed: value} of one arm's rows for ``metric`` (failed, diverged and collapsed rows left out)."""
    ok = good(a)
    return {int(s): float(v) for s, v in zip(ok["seed"], ok[metric]) if finite(v)}


# --------------------------------------------------------------------------- the per-seed table
#: what one budget row of one cell is, in the per-seed table (every column of :func:`budget_rows` but the run id)
SEED_META = (
    "dataset",
    "temperature",
    "arm",
    "loss",
    "batch_size",
    "group",
    "extra",
    "lr",
    "peak_lr",
    "seed",
    "status",
    "budget",
    "epochs",
    "steps",
    "images",
)
#: the probes a budget row carries (``val``: the linear probe on the validation split, which picks the rate)
PROBE_COLUMNS = (*METRICS, *OPT_IN, "val")
#: the prefix of a baseline's arm in the per-seed table (``baseline:random_init``)
BASELINE_ARM = "baseline:"


def seed_table(rows: pd.DataFrame, base: dict[tuple[str, str, str], dict]) -> pd.DataFrame:
    """The tidy per-seed table: one row per cell, budget and probe (``obs`` numbers a cell's budget row,
    ``probe``/``value`` its top-1 %), then one per baseline, seed and probe (arm ``baseline:<name>``).
    Everything the section computes is a function of this table (:func:`from_seed_table`)."""
    cols = ["obs", *SEED_META, "probe", "value"]
    parts = []
    if len(rows):
        wide = rows.reset_index(drop=True).reindex(columns=[*SEED_META, *PROBE_COLUMNS])
        long = wide.assign(obs=range(len(wide))).melt(
            id_vars=["obs", *SEED_META], value_vars=list(PROBE_COLUMNS), var_name="probe", value_name="value"
        )
        order = {p: i for i, p in enumerate(PROBE_COLUMNS)}
        long = long.dropna(subset=["value"]).sort_values(
            ["obs", "probe"], key=lambda c: c.map(order) if c.name == "probe" else c
        )
        parts.append(long[cols])
    brows = [
        {"dataset": ds, "arm": f"{BASELINE_ARM}{name}", "seed": seed, "probe": m, "value": v}
        for (ds, name, m), vals in sorted(base.items())
        for seed, v in sorted(vals.items())
    ]
    if brows:
        parts.append(pd.DataFrame(brows).reindex(columns=cols))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)


def from_seed_table(seeds: pd.DataFrame) -> tuple[pd.DataFrame, dict[tuple[str, str, str], dict]]:
    """(the budget rows, the baselines' values) of a per-seed table (:func:`seed_table`, or its CSV read
    back): the section's inputs, so its every table can be rebuilt from that file alone."""
    is_base = seeds["arm"].astype(str).str.startswith(BASELINE_ARM)
    base: dict[tuple[str, str, str], dict] = {}
    for (ds, arm, m), g in seeds[is_base].groupby(["dataset", "arm", "probe"], sort=True):
        base[(str(ds), str(arm)[len(BASELINE_ARM) :], str(m))] = {
            int(s): float(v) for s, v in zip(g["seed"], g["value"]) if finite(v)
        }
    cells = seeds[~is_base]
    if cells.empty:
        return pd.DataFrame(columns=[*SEED_META, *PROBE_COLUMNS]), base
    meta = cells.groupby("obs", sort=True)[list(SEED_META)].first()
    vals = cells.pivot(index="obs", columns="probe", values="value").reindex(columns=list(PROBE_COLUMNS))
    rows = meta.join(vals.astype(float)).reset_index(drop=True)
    types = {"batch_size": int, "seed": int, "temperature": float, "lr": float, "peak_lr": float}
    types.update({c: float for c in ("group", "extra", "epochs", "steps", "images")})
    types.update({c: str for c in ("dataset", "arm", "loss", "status", "budget")})
    return rows.astype(types), base
