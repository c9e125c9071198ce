"""Section 'lrsweep': the learning rate each batch size wants, against SimCLR's scaling rules.

SimCLR scales the rate with the batch (linear: lr·N/256 for SGD/LARS; square root:
lr·sqrt(N/256), its recommendation for LARS at small batches), and a small-batch penalty
measured at one rule may be a tuning artefact of that rule.  The experiment runs a grid of
rates per batch size (``axes: {lr: [...]}``); each cell's *peak rate* is ``train.lr`` scaled
to its batch by ``train.lr_scaling`` (what the optimiser used).  Per data set, loss and τ
this section gives

* top-1 by batch size × peak rate (mean ± sd over seeds; * marks the validated rate);
* the validated rate of each batch size: the best mean validation top-1 of the linear probe
  (``linear/val_top1``, on a split of the training features; never the test split), flagged
  when it is the smallest or largest rate its grid tried (the optimum may lie beyond);
* the exponent k of rate ∝ N^k through the validated rates (least squares on log2), with a
  95 % seed-bootstrap interval (the seeds resampled together, as they pair the cells) widened
  by what the grid's spacing alone can move k (each validated rate is known to half a step),
  set against the rules: constant k = 0, square root 0.5, linear 1.

Example (an overlay; the rates are train.lr at 256, here with lr_scaling none)::

    experiments:
      lrsweep: {enabled: true, losses: [infonce], batch_sizes: [16, 64, 256], seeds: [0, 1, 2],
                axes: {lr: [2.5e-4, 5.0e-4, 1.0e-3, 2.0e-3]}, train: {lr_scaling: none}}
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...study.lr_scaling import RULE_EXPONENTS, scaled_lr
from ...tracking import BAD_STATUSES
from ..aggregate import aggregate_cells, pivot, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..fmt import finite, runs_count, short
from ..runs import METRIC_LABELS, METRICS, param, param_num, select_cells
from ..tables import markdown_table
from .instrument_budgets import VAL_METRIC
from .sweep import sweep_figure

GROUP = ["dataset", "loss", "label", "temperature"]
DRAWS = 2000  # bootstrap draws of the seeds (fixed generator: the report is reproducible)


def exponent(batch_sizes: np.ndarray, rates: np.ndarray) -> float:
    """Slope of log2(rate) against log2(batch size); NaN below two batch sizes."""
    ok = np.isfinite(rates)
    if ok.sum() < 2:
        return math.nan
    x, y = np.log2(batch_sizes[ok].astype(float)), np.log2(rates[ok])
    return float(np.polyfit(x, y, 1)[0])


def _val_cube(g: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch sizes, rates, V[batch, rate, seed] of validation top-1, NaN where not logged)."""
    bss, lrs, seeds = (np.array(sorted(g[c].unique())) for c in ("batch_size", "peak_lr", "seed"))
    cube = np.full((len(bss), len(lrs), len(seeds)), np.nan)
    for _, r in g.iterrows():
        cube[
            np.searchsorted(bss, r["batch_size"]), np.searchsorted(lrs, r["peak_lr"]), np.searchsorted(seeds, r["seed"])
        ] = r["val"]
    return bss, lrs, cube


def _best(lrs: np.ndarray, cube: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per batch size, the rate of the best weighted mean over seeds (NaN where no rate has a value)."""
    w = np.where(np.isfinite(cube), weights, 0.0)
    total = w.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(total > 0, np.nansum(np.nan_to_num(cube) * w, axis=-1) / total, -np.inf)
    has = np.isfinite(means).any(axis=-1)
    return np.where(has, lrs[np.argmax(means, axis=-1)], np.nan)


def scaling(g: pd.DataFrame) -> dict:
    """One (dataset, loss, τ): validated rate per batch size, its edge flags, k and its bootstrap interval."""
    bss, lrs, cube = _val_cube(g)
    n_seeds = cube.shape[-1]
    best = _best(lrs, cube, np.ones(n_seeds))
    tried = [sorted(g[(g["batch_size"] == b) & g["val"].notna()]["peak_lr"].unique()) for b in bss]
    edges = [int(b) for b, r, t in zip(bss, best, tried) if finite(r) and len(t) > 1 and r in (t[0], t[-1])]
    k, lo, hi = exponent(bss, best), math.nan, math.nan
    if finite(k) and n_seeds >= 3:
        rng = np.random.default_rng(0)
        counts = np.stack([np.bincount(rng.integers(0, n_seeds, n_seeds), minlength=n_seeds) for _ in range(DRAWS)])
        ks = np.array([exponent(bss, _best(lrs, cube, c.astype(float))) for c in counts])
        lo, hi = (float(q) for q in np.nanpercentile(ks, [2.5, 97.5]))
    res = resolution(bss, tried)
    inside = [rule for rule, e in RULE_EXPONENTS.items() if finite(lo) and lo - res - 1e-9 <= e <= hi + res + 1e-9]
    return {
        "validated": {int(b): float(r) for b, r in zip(bss, best) if finite(r)},
        "at_edge": edges,
        "k": k,
        "k_low": lo,
        "k_high": hi,
        "k_resolution": res,
        "n_seeds": n_seeds,
        "rules_inside": ", ".join(inside),
    }


def resolution(bss: np.ndarray, tried: list[list[float]]) -> float:
    """How far the grid alone can move k: the widest step between neighbouring rates (log2) over
    the log2 span of the batch sizes (each validated rate is only known to within half a step)."""
    steps = [float(np.diff(np.log2(t)).max()) for t in tried if len(t) > 1]
    span = math.log2(float(bss.max()) / float(bss.min())) if len(bss) > 1 else 0.0
    return max(steps) / span if steps and span > 0 else math.nan


def _rows(cells: pd.DataFrame, ctx: ReportContext) -> pd.DataFrame:
    """The cells with ``peak_lr`` (the rate each trained at) and ``val`` (validation top-1 %)."""
    lr, rule = param_num(cells, "lr"), param(cells, "lr_scaling").fillna("none")
    cells = cells.assign(
        peak_lr=[scaled_lr(a, int(b), r) if finite(a) else math.nan for a, b, r in zip(lr, cells["batch_size"], rule)]
    )
    val = cells[f"metrics.{VAL_METRIC}"] if f"metrics.{VAL_METRIC}" in cells else pd.Series(np.nan, cells.index)
    return cells[np.isfinite(cells["peak_lr"])].assign(
        val=pd.to_numeric(val, errors="coerce").astype(float) * ctx.scale
    )


def _summary(rows: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """(one row per dataset, loss and τ; {(dataset, label, τ, batch size): its validated rate})."""
    out, chosen = [], {}
    for key, g in rows.groupby(GROUP, sort=False):
        s = scaling(g[~g["status"].isin(BAD_STATUSES)])
        chosen.update({(key[0], key[2], key[3], b): r for b, r in s["validated"].items()})
        s["validated_rates"] = "; ".join(f"B={b}: {short(r)}" for b, r in s.pop("validated").items())
        s["at_edge"] = ", ".join(str(b) for b in s["at_edge"])
        out.append({**dict(zip(GROUP, key)), **s})
    return pd.DataFrame(out), chosen


def finding(s: pd.Series) -> str:
    """What the validated rates say about the scaling rules, for one data set, loss and τ."""
    head = f"Learning-rate sweep on {s['dataset']} ({s['label']}, τ={short(s['temperature'])})"
    if not s["validated_rates"]:
        return f"{head}: no run logged a validation score ({VAL_METRIC}), so no rate is validated."
    said = f"{head}: the validated peak rate (best mean {VAL_METRIC} over seeds) is {s['validated_rates']}"
    if not finite(s["k"]):
        return said + "; one batch size only, so no scaling exponent."
    said += f"; rate ∝ N^k with k = {s['k']:.2f}"
    if finite(s["k_low"]):
        rules, res = s["rules_inside"], s["k_resolution"]
        said += (
            f" (95 % seed bootstrap over {s['n_seeds']} seeds: [{s['k_low']:.2f}, {s['k_high']:.2f}]; the grid of "
            f"rates resolves k to ±{res:.2f}, so [{s['k_low'] - res:.2f}, {s['k_high'] + res:.2f}]); SimCLR's rules: "
            "constant k = 0, square root 0.5, linear 1 -- "
            + (f"consistent with {rules}, the others outside it" if rules else "none inside it")
        )
    else:
        said += " (fewer than 3 seeds: no interval, so no rule is tested)"
    if s["at_edge"]:
        said += (
            f". At B = {s['at_edge']} the validated rate is the edge of the rates tried: the optimum may lie outside "
            "the grid, so k is not pinned down there"
        )
    return said + "."


def _blocks(agg: pd.DataFrame, chosen: dict) -> list[tuple[str, pd.DataFrame]]:
    """Batch size × peak rate per (dataset, loss, τ, metric); * marks the validated rate."""
    blocks = []
    for (ds, lab, t, m), g in agg.groupby(["dataset", "label", "temperature", "metric"], sort=False):
        g = g.sort_values(["batch_size", "peak_lr"])
        g["disp"] = [
            x + (" *" if chosen.get((ds, lab, t, int(b))) == r else "")
            for x, b, r in zip(g["display"], g["batch_size"], g["peak_lr"])
        ]
        wide = pivot(
            g,
            ["batch_size"],
            "peak_lr",
            lambda r: f"lr={short(r)}",
            value="disp",
            columns=sorted(g["peak_lr"].unique()),
        )
        blocks.append(
            (f"{ds}, {lab}, τ={short(t)}, {METRIC_LABELS.get(m, m)}", wide.rename(columns={"batch_size": "B"}))
        )
    return blocks


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """The learning rate each batch size wants: top-1 by peak rate, validated rates, their scaling exponent."""
    cells = select_cells(runs, "lrsweep", ("lr",), ctx.notes)
    if cells.empty:
        return None
    rows = _rows(cells, ctx)
    out = SectionOutput(
        "lrsweep",
        "Side experiment: learning rate per batch size (SimCLR's scaling rules)",
        "",
        run_ids=set(cells["run_id"]),
    )
    agg = sort_by_loss(
        aggregate_cells(rows, [*GROUP, "batch_size", "peak_lr"], ctx.scale, metrics={**METRICS, "val": VAL_METRIC}),
        [*GROUP, "metric", "batch_size", "peak_lr"],
    )
    summ, chosen = _summary(rows)
    blocks = _blocks(agg[agg["metric"] != "val"], chosen)
    f_top = ctx.write_table(
        "lrsweep_top1",
        "Learning-rate sweep: top-1 (%) by batch size × peak rate",
        agg,
        blocks,
        note="mean ± sample std over seeds; peak rate = train.lr scaled to the batch by train.lr_scaling; "
        f"* = the validated rate (best mean {VAL_METRIC}); metric val = that validation top-1",
    )
    f_sc = ctx.write_table(
        "lrsweep_scaling",
        "Learning-rate sweep: validated rate per batch size and its scaling exponent",
        summ,
        note="k: slope of log2(validated rate) on log2(batch size); k_low, k_high: 95 % percentile interval over "
        f"{DRAWS} bootstrap draws of the seeds (3 or more seeds); k_resolution: the widest step between rates (log2) "
        "over the span of log2(batch size); rules_inside: SimCLR's rules (constant 0, sqrt 0.5, linear 1) inside "
        "[k_low - k_resolution, k_high + k_resolution]; at_edge: batch sizes whose validated rate is the smallest or "
        "largest tried",
    )
    out.files += f_top + f_sc
    out.findings += [finding(r) for _, r in summ.iterrows()]
    md = [
        f"{runs_count(len(cells))} (experiment 'lrsweep'). Top-1 by rate: {ctx.table_links(f_top)}; "
        f"validated rates and scaling: {ctx.table_links(f_sc)}\n",
        *(x for sub, df in blocks for x in (f"**{sub}**\n", markdown_table(df))),
        "### Figures\n",
    ]
    for ds in sorted(rows["dataset"].unique()):
        files, text = sweep_figure(
            rows[rows["dataset"] == ds],
            agg[(agg["dataset"] == ds) & (agg["metric"] != "val")],
            ds,
            ctx,
            x="peak_lr",
            xlabel="peak learning rate",
            base=2,
            stem="lrsweep",
            title="top-1 vs learning rate",
        )
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out
