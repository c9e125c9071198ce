"""Report sections of the papers' side experiments, built from the MLflow store.

Each builder below reads the runs of one study section (tag
``smallbatch.experiment``) from the DataFrame ``report.load_runs`` returns, writes
its tables (``ctx.write_table``: CSV + Markdown + LaTeX) and seaborn figures
(``ctx.save_figure``: PNG + SVG), and states in plain words the paper's claim
next to what we measured.  Every number in a sentence is computed from the
store; a claim our numbers do not support is said to be unsupported.  A
section whose runs are absent is left out of the report (the builder returns
None).

* ``precision`` -- FlatNCE's floating-point hypothesis (Chen et al. 2021): if
  rounding error causes InfoNCE's small-batch collapse, InfoNCE in fp64 should
  close most of its gap to FlatNCE; and the measured gradient rounding error
  (``diag/grad_rel_err`` = fp32 vs fp64, ``diag/grad_rel_err_bf16``) should be
  large for InfoNCE at small batch / small tau and small for FlatNCE.
* ``ksweep`` -- EqCo (Zhu et al. 2020): with alpha fixed, accuracy stays flat
  in the number of negatives K (MoCo-style queue of ``queue_size`` keys) while
  InfoNCE's drops at small K.
* ``ess`` -- FlatNCE's Algorithm S1: the temperature chosen at every step so the
  effective sample size (ESS) of the negatives' softmax weights follows a
  schedule, versus a fixed temperature, at small and large batch.
* ``tsweep`` -- SimCLR's Table 5 analogue: top-1 by loss x temperature at a
  fixed batch, SimCLR's reported numbers side by side (their setting differs),
  and the range of top-1 over tau per loss (sensitivity to tau).

Conventions are those of :mod:`smallbatch.report` (top-1 in percent, mean and
sample std over seeds, diverged/failed runs give no number, newest run per
cell id).  Registration: ``report.py`` imports this module at its end.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from . import report as R

__all__ = ["precision_section", "ksweep_section", "ess_section", "tsweep_section", "SIDE_SECTIONS"]

PRECISION_ORDER = ("fp64", "fp32", "bf16", "fp16")
GRAD_KEYS = {"fp32": "diag/grad_rel_err", "bf16": "diag/grad_rel_err_bf16"}
#: the params each side experiment varies on purpose (not an extra axis of its labels)
_AXES = {"precision": ("precision",), "ksweep": ("queue_size",), "ess": ("ess_schedule",)}
_NONE = {"", "none", "nan", "null"}
_BAD = ("diverged", "failed", "pending")


# --------------------------------------------------------------------------- shared helpers
def _param(df: pd.DataFrame, key: str) -> pd.Series:
    """Param column as strings, None where absent or logged as 'None'."""
    col = df.get(f"params.{key}")
    if col is None:
        return pd.Series([None] * len(df), index=df.index, dtype=object)
    return col.map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                   or str(v).strip().lower() in _NONE else str(v)).astype(object)


def _param_num(df: pd.DataFrame, key: str) -> pd.Series:
    return pd.to_numeric(_param(df, key), errors="coerce").astype(float)


def _fmt_num(v: Any) -> str:
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


def _side_cells(runs: pd.DataFrame, ctx: R.ReportContext, section: str) -> pd.DataFrame:
    """Newest run per cell id of one side experiment, with a display ``label``; notes what was dropped."""
    c = runs[(runs["kind"] == "cell") & (runs["section"] == section)]
    c, superseded = R._dedupe(c)
    ok = c["dataset"].notna() & c["loss"].notna() & c["batch_size"].notna() & c["temperature"].notna()
    if superseded:
        ctx.notes.append(f"{superseded} '{section}' run(s) were superseded by a newer run of the same cell id "
                         "(changed config) and are not in the tables.")
    if int((~ok).sum()):
        ctx.notes.append(f"{int((~ok).sum())} '{section}' run(s) lack one of the params "
                         "dataset/loss/batch_size/temperature and are not in the tables.")
    c = c[ok].copy()
    c["label"] = R.cell_labels(c, _AXES.get(section, ())) if len(c) else []
    c["batch_size"] = c["batch_size"].astype(int)
    return c


def _sorted(agg: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    if agg.empty:
        return agg
    agg = agg.assign(_lr=agg["loss"].map(R._loss_rank))
    cols = [("_lr" if c == "loss" else c) for c in by]
    return agg.sort_values(cols, kind="stable").drop(columns="_lr").reset_index(drop=True)


def _label_order(df: pd.DataFrame) -> list[str]:
    pairs = df[["loss", "label"]].drop_duplicates()
    return [lab for _, lab in sorted(zip(pairs["loss"], pairs["label"]), key=lambda p: (R._loss_rank(p[0]), p[1]))]


def _cell(agg: pd.DataFrame, **where: Any) -> pd.Series | None:
    m = np.ones(len(agg), dtype=bool)
    for k, v in where.items():
        m &= (agg[k] == v).to_numpy()
    sub = agg[m]
    return sub.iloc[0] if len(sub) else None


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _state_of(row: pd.Series | None) -> str:
    return "not run" if row is None else str(row["state"])


def _value_or_state(row: pd.Series | None, nd: int = 1) -> str:
    if row is None:
        return "not run"
    return f"{row['mean']:.{nd}f}%" if _finite(row["mean"]) else str(row["state"])


def _two_se(a: pd.Series, b: pd.Series) -> float:
    """Two standard errors of a difference of two cell means (NaN when a cell has < 2 seeds)."""
    if int(a["n_seeds"]) < 2 or int(b["n_seeds"]) < 2:
        return math.nan
    return 2.0 * math.sqrt(float(a["std"]) ** 2 / int(a["n_seeds"]) + float(b["std"]) ** 2 / int(b["n_seeds"]))


def _noise_clause(diff: float, a: pd.Series, b: pd.Series, what: str) -> str:
    tse = _two_se(a, b)
    if not _finite(tse):
        return f"With a single seed in a cell there is no error estimate: the {what} is not tested against seed noise."
    verdict = "exceeds" if abs(diff) > tse else "is within"
    return f"The {what} ({diff:+.1f} points) {verdict} two standard errors of the seed spread ({tse:.1f})."


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _join(items: Sequence[str]) -> str:
    items = list(items)
    if not items:
        return ""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _pivot(agg: pd.DataFrame, index: Sequence[str], column: str, fmt, value: str = "display") -> pd.DataFrame:
    """Wide display table: one row per ``index`` group, one column per value of ``column``."""
    cols = list(dict.fromkeys(agg[column]))
    rows = []
    for key, g in agg.groupby(list(index), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(index, key))
        vals = dict(zip(g[column], g[value]))
        for c in cols:
            row[fmt(c)] = vals.get(c, "")
        rows.append(row)
    return pd.DataFrame(rows)


def _rename(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns={"temperature": "τ", "label": "loss", "batch_size": "B"})


def _history(cells: pd.DataFrame, key: str, ctx: R.ReportContext, cols: Sequence[str]) -> pd.DataFrame:
    """Step history of ``key`` joined with run columns; ``progress`` = fraction of planned training."""
    h = ctx.histories(cells["run_id"], key)
    if h.empty:
        return pd.DataFrame(columns=["run_id", "step", "value", "progress", *cols])
    h = h.assign(value=h["value"].astype(float))
    h = h[np.isfinite(h["value"])]
    if h.empty:
        return pd.DataFrame(columns=["run_id", "step", "value", "progress", *cols])
    meta = cells.set_index("run_id")[list(cols)].assign(_done=R._fraction_done(cells).to_numpy())
    h = h.join(meta, on="run_id")
    mx = h.groupby("run_id")["step"].transform("max").replace(0, 1)
    h["progress"] = h["step"] / mx * h["_done"]
    return h.drop(columns="_done").reset_index(drop=True)


def _binned(h: pd.DataFrame, group: Sequence[str]) -> pd.DataFrame:
    b = np.minimum((h["progress"].astype(float) * R._HISTORY_BINS).astype(int), R._HISTORY_BINS - 1)
    h = h.assign(progress=(b + 0.5) / R._HISTORY_BINS)
    return h.groupby(["run_id", *group, "progress"], as_index=False, dropna=False)["value"].mean()


def _setting(t: float, b: int) -> str:
    return f"B={int(b)}, τ={R._fmt_t(t)}"


def _good(cells: pd.DataFrame) -> pd.DataFrame:
    return cells[~cells["status"].isin(R._BAD_STATUS)]


def _accuracy_long(cells: pd.DataFrame, scale: float, extra: Sequence[str]) -> pd.DataFrame:
    """One row per (finished run, metric) with a finite top-1: for figures."""
    good = _good(cells)
    rows = []
    for m, key in R.METRICS.items():
        col = f"metrics.{key}"
        if col not in good:
            continue
        v = good[col].astype(float) * scale
        ok = np.isfinite(v)
        if ok.any():
            sub = good.loc[ok, ["loss", "label", *extra]].copy()
            sub["metric"] = R.METRIC_LABELS[m]
            sub["top-1 (%)"] = v[ok].to_numpy()
            rows.append(sub)
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def _mark_bad(ax, xs: Iterable[float], color) -> None:
    """▽ on the x axis where every seed of a cell diverged or failed."""
    xs = list(xs)
    if xs:
        y0 = ax.get_ylim()[0]
        ax.scatter(xs, [y0] * len(xs), marker="v", s=80, facecolors="none", edgecolors=[color],
                   linewidths=1.5, clip_on=False, zorder=5)


# --------------------------------------------------------------------------- 1. precision
def _precision_gaps(agg: pd.DataFrame) -> pd.DataFrame:
    """FlatNCE − InfoNCE top-1 gap per (dataset, metric, τ, B, precision) and its closure vs fp32."""
    keys = ["dataset", "metric", "temperature", "batch_size", "precision"]
    rows = []
    for key, g in agg.groupby(keys, sort=False):
        inf, fl = g[g["loss"] == "infonce"], g[g["loss"] == "flatnce"]
        for _, i in inf.iterrows():
            for _, f in fl.iterrows():
                gap = float(f["mean"]) - float(i["mean"])
                rows.append({**dict(zip(keys, key)), "infonce_label": i["label"], "flatnce_label": f["label"],
                             "infonce_mean": i["mean"], "infonce_std": i["std"], "infonce_n": i["n_seeds"],
                             "infonce_state": i["state"], "flatnce_mean": f["mean"], "flatnce_std": f["std"],
                             "flatnce_n": f["n_seeds"], "flatnce_state": f["state"], "gap_flatnce_minus_infonce": gap,
                             "gap_two_se": _two_se(i, f)})
    cols = [*keys, "infonce_label", "flatnce_label", "infonce_mean", "infonce_std", "infonce_n", "infonce_state",
            "flatnce_mean", "flatnce_std", "flatnce_n", "flatnce_state", "gap_flatnce_minus_infonce", "gap_two_se",
            "gap_fp32", "closed_fraction_of_fp32_gap", "infonce_change_vs_fp32"]
    if not rows:
        return pd.DataFrame(columns=cols)
    df = pd.DataFrame(rows)
    ref_keys = ["dataset", "metric", "temperature", "batch_size", "infonce_label", "flatnce_label"]
    ref = df[df["precision"] == "fp32"].set_index(ref_keys)
    idx = pd.MultiIndex.from_frame(df[ref_keys])
    df["gap_fp32"] = ref["gap_flatnce_minus_infonce"].reindex(idx).to_numpy() if len(ref) else math.nan
    inf32 = ref["infonce_mean"].reindex(idx).to_numpy() if len(ref) else math.nan
    g32 = df["gap_fp32"].astype(float)
    df["closed_fraction_of_fp32_gap"] = np.where(g32 > 0, 1.0 - df["gap_flatnce_minus_infonce"] / g32, math.nan)
    df["infonce_change_vs_fp32"] = df["infonce_mean"].astype(float) - inf32
    return df[cols]


def _precision_finding(gaps: pd.DataFrame, agg: pd.DataFrame, ds: str, m: str, t: float) -> str:
    d = gaps[(gaps["dataset"] == ds) & (gaps["metric"] == m) & (gaps["temperature"] == t)]
    mlabel = R.METRIC_LABELS.get(m, m)
    claim = ("FlatNCE's floating-point hypothesis: if rounding error causes InfoNCE's small-batch collapse, "
             "InfoNCE trained in fp64 should close most of its gap to FlatNCE.")
    head = f"Precision on {ds} at τ={R._fmt_t(t)} ({mlabel}): {claim}"
    if d.empty:
        return f"{head} It cannot be tested: InfoNCE and FlatNCE were not both run at any batch size and precision."
    bss = sorted(int(b) for b in d["batch_size"].unique())
    parts = []
    for b in bss:
        db = d[d["batch_size"] == b]
        phrases = []
        for p in _precision_order(db["precision"]):
            r = db[db["precision"] == p].iloc[0]
            if _finite(r["gap_flatnce_minus_infonce"]):
                s = f"{r['gap_flatnce_minus_infonce']:+.1f} in {p}"
                c = r["closed_fraction_of_fp32_gap"]
                if p != "fp32" and _finite(c):
                    s += (f" ({p} closes {100 * c:.0f}% of the fp32 gap)" if c >= 0 else
                          f" ({p} widens the fp32 gap by {-100 * c:.0f}%)")
            else:
                bad = [f"{lab} {st}" for lab, st in (("InfoNCE", r["infonce_state"]), ("FlatNCE", r["flatnce_state"]))
                       if st in _BAD]
                s = f"not computable in {p} ({', '.join(bad) or 'no value'})"
            phrases.append(s)
        parts.append(f"at B={b} the FlatNCE − InfoNCE gap is " + ", ".join(phrases))
    s = [head, "We measured: " + "; ".join(parts) + " (points)."]
    bmin = bss[0]
    r32 = d[(d["batch_size"] == bmin) & (d["precision"] == "fp32")]
    r64 = d[(d["batch_size"] == bmin) & (d["precision"] == "fp64")]
    i32 = _cell(agg, dataset=ds, metric=m, temperature=t, batch_size=bmin, precision="fp32", loss="infonce")
    i64 = _cell(agg, dataset=ds, metric=m, temperature=t, batch_size=bmin, precision="fp64", loss="infonce")
    if r32.empty or r64.empty:
        missing = [p for p, r in (("fp32", r32), ("fp64", r64)) if r.empty]
        s.append(f"At the smallest batch ({bmin}) the hypothesis cannot be tested: no {' or '.join(missing)} "
                 "pair of InfoNCE and FlatNCE runs.")
        return " ".join(s)
    r32, r64 = r32.iloc[0], r64.iloc[0]
    div = ("diverged", "failed")
    if r32["infonce_state"] in div and _finite(r32["flatnce_mean"]):
        if _finite(r64["gap_flatnce_minus_infonce"]):
            s.append(f"At the smallest batch ({bmin}) InfoNCE {r32['infonce_state']} in fp32 (all seeds) but trained "
                     f"in fp64 (gap to FlatNCE {r64['gap_flatnce_minus_infonce']:+.1f}): consistent with the "
                     "hypothesis that rounding error causes the collapse.")
            return " ".join(s)
        if r64["infonce_state"] in div:
            s.append(f"At the smallest batch ({bmin}) InfoNCE {r32['infonce_state']} in fp32 and in fp64 alike: "
                     "our numbers do not support the hypothesis.")
            return " ".join(s)
    if not (_finite(r32["gap_flatnce_minus_infonce"]) and _finite(r64["gap_flatnce_minus_infonce"])):
        st = {f"InfoNCE {p}": r["infonce_state"] for p, r in (("fp32", r32), ("fp64", r64))}
        st.update({f"FlatNCE {p}": r["flatnce_state"] for p, r in (("fp32", r32), ("fp64", r64))})
        bad = ", ".join(f"{k} {v}" for k, v in st.items() if v in _BAD)
        s.append(f"At the smallest batch ({bmin}) the hypothesis cannot be tested ({bad}).")
        return " ".join(s)
    g32 = float(r32["gap_flatnce_minus_infonce"])
    if round(g32, 1) <= 0:
        s.append(f"At the smallest batch ({bmin}) InfoNCE is not behind FlatNCE in fp32 (gap {g32:+.1f}), so there "
                 "is no small-batch gap for fp64 to close and the hypothesis is not tested by these runs.")
        return " ".join(s)
    closed = float(r64["closed_fraction_of_fp32_gap"])
    if closed >= 0.5:
        s.append(f"At the smallest batch ({bmin}) fp64 closes {100 * closed:.0f}% of the gap, most of it: "
                 "our numbers support the hypothesis.")
    else:
        s.append(f"At the smallest batch ({bmin}) fp64 closes only {100 * closed:.0f}% of the gap, not most of it: "
                 "our numbers do not support the hypothesis.")
    if i32 is not None and i64 is not None and _finite(i32["mean"]) and _finite(i64["mean"]):
        s.append(_noise_clause(float(i64["mean"]) - float(i32["mean"]), i64, i32,
                               "change of InfoNCE's top-1 from fp32 to fp64"))
    return " ".join(s)


def _precision_order(values: Iterable[Any]) -> list[str]:
    vals = list(dict.fromkeys(str(v) for v in values))
    known = [p for p in PRECISION_ORDER if p in vals]
    return known + sorted(v for v in vals if v not in PRECISION_ORDER)


def _grad_errors(cells: pd.DataFrame, ctx: R.ReportContext) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-point histories with a 'dtype' column, summary per dataset × τ × loss × B × dtype)."""
    cols = ["dataset", "temperature", "loss", "label", "batch_size", "precision", "seed"]
    frames = []
    for dt, key in GRAD_KEYS.items():
        h = _history(cells, key, ctx, cols)
        if len(h):
            frames.append(h.assign(dtype=dt))
    if not frames:
        return pd.DataFrame(), pd.DataFrame()
    h = pd.concat(frames, ignore_index=True)
    keys = ["dataset", "temperature", "loss", "label", "batch_size", "dtype"]
    summ = h.groupby(keys, sort=False).agg(mean=("value", "mean"), median=("value", "median"),
                                           p90=("value", lambda v: float(np.quantile(v, 0.9))),
                                           n_points=("value", "size"), n_runs=("run_id", "nunique")).reset_index()
    summ["key"] = summ["dtype"].map(GRAD_KEYS)
    return h, _sorted(summ, ["dataset", "temperature", "loss", "label", "batch_size", "dtype"])


def _sci(x: Any) -> str:
    return f"{float(x):.2e}" if _finite(x) else "—"


#: A relative gradient error below this is rounding noise, not the "large" error FlatNCE blames
#: (a saturated batch gives 1e-1 in fp32; training-time batches here gave 1e-7 .. 1e-6).
GRAD_ERR_LARGE = 1e-3


def _grad_finding(summ: pd.DataFrame, ds: str, t: float) -> str:
    d = summ[(summ["dataset"] == ds) & (summ["temperature"] == t)]
    claim = ("FlatNCE's claim: InfoNCE's fp32 gradient carries a large rounding error at small batch and small τ, "
             "FlatNCE's a small one.")
    head = f"Gradient rounding error on {ds} at τ={R._fmt_t(t)}: {claim}"

    def val(loss: str, b: int, dt: str) -> float:
        r = d[(d["loss"] == loss) & (d["batch_size"] == b) & (d["dtype"] == dt)]
        return float(r["mean"].iloc[0]) if len(r) else math.nan

    bss = sorted(int(b) for b in d["batch_size"].unique())
    parts = []
    for b in bss:
        i, f = val("infonce", b, "fp32"), val("flatnce", b, "fp32")
        p = f"at B={b} {_sci(i)} for InfoNCE vs {_sci(f)} for FlatNCE"
        if _finite(i) and _finite(f) and f > 0:
            p += f" (InfoNCE {i / f:.3g}× FlatNCE's)"
        parts.append(p)
    s = [head, "Mean relative error of the fp32 loss gradient w.r.t. the embeddings (vs fp64): "
         + "; ".join(parts) + "."]
    bf = [f"B={b}: {_sci(val('infonce', b, 'bf16'))} vs {_sci(val('flatnce', b, 'bf16'))}" for b in bss
          if _finite(val("infonce", b, "bf16")) or _finite(val("flatnce", b, "bf16"))]
    if bf:
        s.append("In bf16 (InfoNCE vs FlatNCE): " + "; ".join(bf) + ".")
    bmin, bmax = bss[0], bss[-1]
    i_min, f_min = val("infonce", bmin, "fp32"), val("flatnce", bmin, "fp32")
    if not (_finite(i_min) and _finite(f_min)):
        s.append(f"The claim cannot be tested at B={bmin}: the fp32 gradient error of "
                 f"{_join([n for n, v in (('InfoNCE', i_min), ('FlatNCE', f_min)) if not _finite(v)])} was not logged.")
        return " ".join(s)
    larger = i_min > f_min
    grow = None
    if bmax != bmin and _finite(val("infonce", bmax, "fp32")):
        i_max = val("infonce", bmax, "fp32")
        grow = i_min > i_max
        s.append(f"InfoNCE's error {'grows' if grow else 'does not grow'} as the batch shrinks "
                 f"(B={bmax}→{bmin}: {_sci(i_max)}→{_sci(i_min)}).")
    if larger and i_min < GRAD_ERR_LARGE:
        s.append(f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's, but both are "
                 f"below {GRAD_ERR_LARGE:g}, i.e. at the level of fp32's own rounding (unit roundoff 6e-8), not the "
                 "large error of a saturated batch (~1e-1 at q_B < 2^-24, benchmarks/loss_precision.py): these runs "
                 "never reach the regime the claim is about, so they do not support it.")
    elif larger and grow is not False:
        s.append(f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's: "
                 "our measurement supports the claim.")
    elif larger:
        s.append(f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's, but it does not "
                 "grow as the batch shrinks: our measurement supports the claim only in part.")
    else:
        s.append(f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error does not exceed FlatNCE's: "
                 "our measurement does not support the claim.")
    return " ".join(s)


def _grad_tau_finding(summ: pd.DataFrame, ds: str) -> str:
    d = summ[(summ["dataset"] == ds) & (summ["loss"] == "infonce") & (summ["dtype"] == "fp32")]
    taus = sorted(d["temperature"].unique())
    if len(taus) < 2:
        return ""
    bmin = int(d["batch_size"].min())
    lo = d[(d["temperature"] == taus[0]) & (d["batch_size"] == bmin)]["mean"]
    hi = d[(d["temperature"] == taus[-1]) & (d["batch_size"] == bmin)]["mean"]
    if lo.empty or hi.empty:
        return ""
    lo, hi = float(lo.iloc[0]), float(hi.iloc[0])
    word = "larger" if lo > hi else "not larger"
    return (f"On {ds} at B={bmin}, InfoNCE's fp32 gradient error at the smallest τ ({R._fmt_t(taus[0])}: {_sci(lo)}) "
            f"is {word} than at the largest τ ({R._fmt_t(taus[-1])}: {_sci(hi)}); the claim expects it larger.")


def precision_section(runs: pd.DataFrame, ctx: R.ReportContext) -> R.SectionOutput | None:
    """FlatNCE's floating-point hypothesis: top-1 per loss × batch × precision, the gap, gradient error."""
    cells = _side_cells(runs, ctx, "precision")
    if cells.empty:
        return None
    cells["precision"] = _param(cells, "precision").fillna("fp32").astype(str)
    out = R.SectionOutput("precision", "Side experiment: floating-point precision (FlatNCE's hypothesis)", "",
                          run_ids=set(cells["run_id"]))
    keys = ["dataset", "temperature", "loss", "label", "batch_size", "precision"]
    agg = R.aggregate_cells(cells, keys, ctx.scale)
    order = {p: i for i, p in enumerate(_precision_order(agg["precision"]))}
    agg = _sorted(agg.assign(_p=agg["precision"].map(order)),
                  ["dataset", "metric", "temperature", "loss", "label", "batch_size", "_p"]).drop(columns="_p")
    seed_note = ("mean ± sample std (ddof=1) over seeds; '—' = one seed; diverged/failed runs give no number; "
                 "'pending' = not evaluated yet")
    blocks = []
    for (ds, m), g in agg.groupby(["dataset", "metric"], sort=False):
        disp = _pivot(g, ["temperature", "label", "batch_size"], "precision", str)
        blocks.append((f"{ds}, {R.METRIC_LABELS.get(m, m)}", _rename(disp)))
    f_top = ctx.write_table("precision_top1", "Precision: top-1 (%) by loss × batch size × training precision",
                            agg, blocks, note=seed_note)
    gaps = _precision_gaps(agg)
    gblocks = []
    for (ds, m), g in gaps.groupby(["dataset", "metric"], sort=False):
        rows = []
        for (t, b), gb in g.groupby(["temperature", "batch_size"], sort=False):
            row: dict[str, Any] = {"τ": t, "B": int(b)}
            for p in _precision_order(gb["precision"]):
                r = gb[gb["precision"] == p].iloc[0]
                row[f"gap {p}"] = R._signed(r["gap_flatnce_minus_infonce"]) if _finite(
                    r["gap_flatnce_minus_infonce"]) else "—"
            r64 = gb[gb["precision"] == "fp64"]
            row["fp64 closes"] = (f"{100 * r64['closed_fraction_of_fp32_gap'].iloc[0]:.0f}%"
                                  if len(r64) and _finite(r64["closed_fraction_of_fp32_gap"].iloc[0]) else "—")
            rows.append(row)
        gblocks.append((f"{ds}, {R.METRIC_LABELS.get(m, m)}", pd.DataFrame(rows)))
    f_gap = ctx.write_table(
        "precision_gap", "Precision: FlatNCE − InfoNCE top-1 gap (points) per precision and batch size", gaps,
        gblocks or None, note="gap = FlatNCE mean − InfoNCE mean; 'fp64 closes' = 1 − gap(fp64)/gap(fp32), "
                              "defined where the fp32 gap is positive")
    out.files += f_top + f_gap
    md = [f"{_runs(len(cells))} (experiment 'precision'). Top-1 by precision: {ctx.table_links(f_top)}; "
          f"FlatNCE − InfoNCE gap: {ctx.table_links(f_gap)}\n"]
    if gblocks:
        for sub, df in gblocks:
            md += [f"**Gap, {sub}**\n", R.markdown_table(df)]
    else:
        md.append("_InfoNCE and FlatNCE were not both run at a common precision and batch size: no gap to show._\n")
    for (ds, m, t), _ in agg.groupby(["dataset", "metric", "temperature"], sort=False):
        out.findings.append(_precision_finding(gaps, agg, ds, m, t))
    # gradient rounding error
    hist, summ = _grad_errors(cells, ctx)
    if summ.empty:
        md.append("_No `diag/grad_rel_err` history logged (set `experiments.precision.train.grad_error_every` > 0); "
                  "gradient-error table and figure skipped._\n")
    else:
        wide = []
        for key, g in summ.groupby(["dataset", "temperature", "loss", "label", "batch_size"], sort=False):
            row = dict(zip(["dataset", "temperature", "loss", "label", "batch_size"], key))
            for dt in GRAD_KEYS:
                r = g[g["dtype"] == dt]
                for stat in ("mean", "median", "p90", "n_points"):
                    row[f"{dt}_{stat}"] = r[stat].iloc[0] if len(r) else math.nan
            row["n_runs"] = int(g["n_runs"].max())
            wide.append(row)
        wide = pd.DataFrame(wide)
        gd = []
        for ds, g in wide.groupby("dataset", sort=False):
            disp = pd.DataFrame({"τ": g["temperature"], "loss": g["label"], "B": g["batch_size"].astype(int),
                                 "fp32 mean": g["fp32_mean"].map(_sci), "fp32 median": g["fp32_median"].map(_sci),
                                 "bf16 mean": g["bf16_mean"].map(_sci), "bf16 median": g["bf16_median"].map(_sci),
                                 "points": g["fp32_n_points"].map(lambda v: "" if not _finite(v) else str(int(v))),
                                 "runs": g["n_runs"]})
            gd.append((str(ds), disp.reset_index(drop=True)))
        f_grad = ctx.write_table(
            "precision_grad_error", "Precision: relative rounding error of the loss gradient w.r.t. the embeddings",
            wide, gd, note="||g_dtype − g_fp64|| / ||g_fp64|| on the training batches where it was logged "
                           "(diag/grad_rel_err for fp32, diag/grad_rel_err_bf16 for bf16), pooled over seeds and "
                           "the runs' training precisions")
        out.files += f_grad
        md.append(f"Gradient rounding error (`diag/grad_rel_err`, `diag/grad_rel_err_bf16`): "
                  f"{ctx.table_links(f_grad)}\n")
        for sub, df in gd:
            md.append(R.markdown_table(df))
        for (ds, t), _ in summ.groupby(["dataset", "temperature"], sort=False):
            out.findings.append(_grad_finding(summ, ds, t))
        for ds in dict.fromkeys(summ["dataset"]):
            out.findings.append(_grad_tau_finding(summ, ds))
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = _fig_precision_top1(cells[cells["dataset"] == ds], agg[agg["dataset"] == ds], ds, ctx)
        out.files += files
        md.append(text)
        if len(hist):
            files, text = _fig_grad_error(hist[hist["dataset"] == ds], ds, ctx)
            out.files += files
            md.append(text)
    out.findings = [f for f in out.findings if f]
    out.markdown = "\n".join(md)
    return out


def _fig_precision_top1(cells, agg, ds, ctx) -> tuple[list[Path], str]:
    data = _accuracy_long(cells, ctx.scale, ["batch_size", "temperature", "precision"])
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged for the precision runs yet; figure skipped._\n"
    plt, sns, rc = R._plot_style()
    multi_t = data["temperature"].nunique() > 1
    data["series"] = [f"{lab}, τ={R._fmt_t(t)}" if multi_t else lab for lab, t in zip(data["label"],
                                                                                     data["temperature"])]
    order = _label_order(data)
    series = sorted(data["series"].unique(), key=lambda s: (order.index(s.split(", τ=")[0]), s))
    porder = _precision_order(cells["precision"])
    bss = [int(b) for b in sorted(cells["batch_size"].unique())]
    metrics = [R.METRIC_LABELS[m] for m in R.METRICS if R.METRIC_LABELS[m] in set(data["metric"])]
    data["B"] = data["batch_size"].astype(int)
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.catplot(data=data, kind="point", x="precision", order=porder, y="top-1 (%)", hue="series",
                        hue_order=series, palette=R._palette(series), dodge=0.3 if len(series) > 1 else False,
                        errorbar="sd", markers="o",
                        col="B", col_order=bss, row="metric", row_order=metrics, height=3.0, aspect=1.1,
                        sharey="row", margin_titles=True)
        g.set_titles(row_template="{row_name}", col_template="batch size {col_name}")
        if g.legend is not None:
            g.legend.set_title("loss")
        g.figure.suptitle(f"{ds}: top-1 vs training precision (mean ± sd over seeds; a missing point = "
                          "diverged or not evaluated)", y=1.02)
        files = ctx.save_figure(g.figure, f"precision_top1_{R._slug(ds)}")
    return files, (f"**{ds}: top-1 vs precision** (one panel per batch size)\n\n"
                   + ctx.figure_md(files, f"{ds} top-1 vs precision"))


def _fig_grad_error(hist: pd.DataFrame, ds: str, ctx) -> tuple[list[Path], str]:
    h = hist[hist["value"] > 0].copy()
    if h.empty:
        return [], f"_{ds}: every logged gradient error is 0; figure skipped._\n"
    plt, sns, rc = R._plot_style()
    h["B"] = h["batch_size"].astype(int).astype(str)
    h["τ"] = h["temperature"].map(R._fmt_t)
    border = [str(b) for b in sorted(h["batch_size"].astype(int).unique())]
    labels = _label_order(h)
    taus = [R._fmt_t(t) for t in sorted(h["temperature"].unique())]
    dts = [d for d in GRAD_KEYS if d in set(h["dtype"])]
    with plt.rc_context(rc), sns.axes_style("whitegrid"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # seaborn 0.13 passes boxplot(vert=) to mpl 3.11
        g = sns.catplot(data=h, kind="box", x="B", order=border, y="value", hue="label", hue_order=labels,
                        palette=R._palette(labels), col="dtype", col_order=dts, row="τ", row_order=taus,
                        height=3.0, aspect=1.2, fliersize=2, log_scale=(False, True), sharey=False)
        g.set_titles("{col_name} vs fp64 | τ = {row_name}")
        g.set_axis_labels("batch size", "relative gradient error")
        if g.legend is not None:
            g.legend.set_title("loss")
        g.figure.suptitle(f"{ds}: rounding error of the loss gradient w.r.t. the embeddings (all logged steps)",
                          y=1.02)
        files = ctx.save_figure(g.figure, f"precision_grad_error_{R._slug(ds)}")
    return files, (f"**{ds}: gradient rounding error** (distribution over logged steps and seeds, log scale)\n\n"
                   + ctx.figure_md(files, f"{ds} gradient error"))


# --------------------------------------------------------------------------- 2. K sweep
def _sweep_summary(agg: pd.DataFrame, setting: Sequence[str], x: str) -> pd.DataFrame:
    """Per setting × metric × label: values at the smallest/largest x, change, range, best x."""
    rows = []
    for key, g in agg.groupby([*setting, "metric", "loss", "label"], sort=False):
        kd = dict(zip([*setting, "metric", "loss", "label"], key))
        allx = agg
        for c in [*setting, "metric"]:
            allx = allx[allx[c] == kd[c]]
        xs = sorted(allx[x].unique())
        xmin, xmax = xs[0], xs[-1]
        g = g.set_index(x)
        num = g[np.isfinite(g["mean"].astype(float))]
        row = {**kd, f"{x}_min": xmin, f"{x}_max": xmax}
        for tag, xv in (("small", xmin), ("large", xmax)):
            if xv in g.index:
                r = g.loc[xv]
                row[f"mean_{tag}"], row[f"std_{tag}"] = float(r["mean"]), float(r["std"])
                row[f"n_{tag}"], row[f"state_{tag}"] = int(r["n_seeds"]), str(r["state"])
            else:
                row[f"mean_{tag}"], row[f"std_{tag}"], row[f"n_{tag}"], row[f"state_{tag}"] = (
                    math.nan, math.nan, 0, "not run")
        row["change_large_to_small"] = row["mean_small"] - row["mean_large"]
        row["range"] = float(num["mean"].max() - num["mean"].min()) if len(num) else math.nan
        row[f"best_{x}"] = num["mean"].astype(float).idxmax() if len(num) else math.nan
        row["best_mean"] = float(num["mean"].max()) if len(num) else math.nan
        row[f"worst_{x}"] = num["mean"].astype(float).idxmin() if len(num) else math.nan
        row["worst_mean"] = float(num["mean"].min()) if len(num) else math.nan
        row[f"n_{x}_with_values"] = len(num)
        seeded = num[num["n_seeds"].astype(int) >= 2]
        sd = seeded["std"].astype(float)
        row["pooled_sd"] = float(np.sqrt((sd ** 2).mean())) if len(seeded) else math.nan
        row["n_seeds_min"] = int(seeded["n_seeds"].min()) if len(seeded) else 1
        bad = g[g["state"].isin(("diverged", "failed"))]
        row[f"{x}_diverged"] = ", ".join(_fmt_num(v) for v in bad.index)
        row["n_diverged_points"] = len(bad)
        rows.append(row)
    return pd.DataFrame(rows)


def _change_se(r: pd.Series) -> float:
    """Standard error of a sweep row's change (small − large x); NaN with fewer than 2 seeds at either end."""
    if int(r["n_small"]) < 2 or int(r["n_large"]) < 2:
        return math.nan
    return math.sqrt(r["std_small"] ** 2 / r["n_small"] + r["std_large"] ** 2 / r["n_large"])


def _ksweep_finding(summ: pd.DataFrame, ds: str, m: str, t: float, b: int, n_images: float) -> str:
    d = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["temperature"] == t)
             & (summ["batch_size"] == b)]
    mlabel = R.METRIC_LABELS.get(m, m)
    claim = ("EqCo's claim: with α fixed, EqCo's accuracy stays flat as the number of negatives K shrinks, "
             "while InfoNCE's drops at small K.")
    head = f"K sweep on {ds} ({_setting(t, b)}, {mlabel}): {claim}"
    kmin, kmax = int(d["K_min"].iloc[0]), int(d["K_max"].iloc[0])
    s = [head]
    if kmin == kmax:
        s.append(f"Only K={kmin} was run, so the dependence on K cannot be measured.")
        return " ".join(s)
    ch = []
    for _, r in d.iterrows():
        if _finite(r["change_large_to_small"]):
            ch.append(f"{r['label']} {r['change_large_to_small']:+.1f}")
        else:
            ch.append(f"{r['label']} — (K={kmin}: {r['state_small']}, K={kmax}: {r['state_large']})")
    s.append(f"We measured, from K={kmax} to K={kmin}: " + ", ".join(ch) + " points.")
    inf, eq = d[d["loss"] == "infonce"], d[d["loss"] == "eqco"]
    if inf.empty or eq.empty:
        s.append("The claim needs both InfoNCE and EqCo in the sweep; "
                 f"{'InfoNCE' if inf.empty else 'EqCo'} was not run.")
    else:
        i, e = inf.iloc[0], eq.iloc[0]
        if i["state_small"] in ("diverged", "failed") and _finite(e["change_large_to_small"]):
            s.append(f"InfoNCE {i['state_small']} at K={kmin} while {e['label']} changed by "
                     f"{e['change_large_to_small']:+.1f} points: consistent with the claim.")
        elif e["state_small"] in ("diverged", "failed") and _finite(i["mean_small"]):
            s.append(f"{e['label']} {e['state_small']} at K={kmin} while InfoNCE trained: our numbers do not "
                     "support the claim.")
        elif not (_finite(i["change_large_to_small"]) and _finite(e["change_large_to_small"])):
            s.append(f"The claim cannot be tested: InfoNCE or EqCo has no value at K={kmin} or K={kmax}.")
        else:
            di, de = -float(i["change_large_to_small"]), -float(e["change_large_to_small"])
            se_i, se_e = _change_se(i), _change_se(e)
            if round(di, 1) <= 0:
                s.append(f"InfoNCE does not lose accuracy at small K here ({-di:+.1f} points), so the premise of the "
                         "claim does not hold in our setting.")
            elif _finite(se_i) and di <= 2 * se_i:
                s.append(f"InfoNCE's loss at small K ({di:.1f} points) is within two standard errors of the seed "
                         f"spread ({2 * se_i:.1f}), so the premise of the claim is not established in our setting.")
            elif _finite(se_i) and _finite(se_e) and abs(di - de) <= 2 * math.hypot(se_i, se_e):
                s.append(f"{e['label']} loses {de:.1f} and InfoNCE {di:.1f} points; the difference is within two "
                         f"standard errors ({2 * math.hypot(se_i, se_e):.1f}), so these seeds do not separate them.")
            elif round(de, 1) < round(di, 1):
                s.append(f"{e['label']} loses less than InfoNCE ({de:.1f} vs {di:.1f} points): consistent with "
                         "the claim.")
            else:
                s.append(f"{e['label']} loses as much as or more than InfoNCE ({de:.1f} vs {di:.1f} points): our "
                         "numbers do not support the claim.")
            if _finite(e["mean_small"]):
                if _finite(se_e):
                    tse = 2 * se_e
                    flat = abs(de) <= tse
                    s.append(f"EqCo's change is {'within' if flat else 'beyond'} two standard errors of the seed "
                             f"spread ({tse:.1f}), so it {'is' if flat else 'is not'} flat within seed noise.")
                else:
                    s.append("With a single seed per cell there is no error estimate, so 'flat' is not tested "
                             "against seed noise.")
    if _finite(n_images):
        big = sorted(int(k) for k in summ.loc[(summ["dataset"] == ds), "K_max"].unique() if k > n_images)
        ks = sorted(set(int(k) for k in (kmin, kmax)))
        over = [k for k in ks if k > n_images]
        if over or big:
            s.append(f"K={_join([str(k) for k in (over or big)])} exceeds the {int(n_images)} pretraining images: "
                     "the queue then holds several older keys of the same images (an anchor's own keys are masked).")
    return " ".join(s)


def ksweep_section(runs: pd.DataFrame, ctx: R.ReportContext) -> R.SectionOutput | None:
    """EqCo's K sweep: top-1 vs the number of negatives K (queue length) per loss at a fixed batch."""
    cells = _side_cells(runs, ctx, "ksweep")
    if cells.empty:
        return None
    q, k = _param_num(cells, "queue_size"), _param_num(cells, "negatives")
    cells["K"] = np.where(q > 0, q, k)
    bad = ~np.isfinite(cells["K"].astype(float))
    if bad.any():
        ctx.notes.append(f"{int(bad.sum())} 'ksweep' run(s) log neither queue_size nor negatives and are not in "
                         "the K-sweep tables.")
    out = R.SectionOutput("ksweep", "Side experiment: number of negatives K (EqCo's K sweep)", "",
                          run_ids=set(cells["run_id"]))
    cells = cells[~bad].copy()
    if cells.empty:
        out.markdown = "No 'ksweep' run logs its K (queue_size or negatives).\n"
        return out
    cells["K"] = cells["K"].astype(int)
    n_img = _param_num(cells, "pretrain_images").groupby(cells["dataset"]).max()
    setting = ["dataset", "temperature", "batch_size"]
    agg = _sorted(R.aggregate_cells(cells, [*setting, "loss", "label", "K"], ctx.scale),
                  ["dataset", "metric", "temperature", "batch_size", "loss", "label", "K"])
    summ = _sweep_summary(agg, setting, "K")
    blocks = []
    for (ds, m, t, b), g in agg.groupby(["dataset", "metric", "temperature", "batch_size"], sort=False):
        disp = _pivot(g.sort_values("K", kind="stable"), ["label"], "K", lambda v: f"K={int(v)}")
        disp = disp.set_index("label").loc[list(dict.fromkeys(g["label"]))].reset_index()
        sm = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["temperature"] == t)
                  & (summ["batch_size"] == b)].set_index("label")
        kmin, kmax = int(g["K"].min()), int(g["K"].max())
        if kmax != kmin:
            disp[f"change K {kmax}→{kmin}"] = [R._signed(sm.loc[lab, "change_large_to_small"])
                                               for lab in disp["label"]]
        blocks.append((f"{ds}, {_setting(t, b)}, {R.METRIC_LABELS.get(m, m)}", disp.rename(columns={"label": "loss"})))
    f_top = ctx.write_table("ksweep_top1", "K sweep: top-1 (%) by loss × number of negatives K (queue length)",
                            agg, blocks, note="K = queue_size (MoCo-style momentum queue); mean ± sample std over "
                                              "seeds; '—' = one seed")
    f_sum = ctx.write_table("ksweep_sensitivity", "K sweep: top-1 change from the largest to the smallest K per loss",
                            summ, note="change = mean at the smallest K − mean at the largest K; range = max − min "
                                       "of the means over K")
    out.files += f_top + f_sum
    md = [f"{_runs(len(cells))} (experiment 'ksweep'). Top-1 by K: {ctx.table_links(f_top)}; "
          f"change with K: {ctx.table_links(f_sum)}\n"]
    for sub, df in blocks:
        md += [f"**{sub}**\n", R.markdown_table(df)]
    eq = ctx.papers[ctx.papers["paper"].astype(str).str.startswith("EqCo")]
    if len(eq):
        note = (f"EqCo's setting ({_setting_of(eq)}) differs from ours ({_setting_of_runs(cells)}): compare "
                "trends in K, not absolute numbers")
        cols = [c for c in ("method", "batch_size", "negatives", "temperature", "epochs", "dataset", "backbone",
                            "metric", "value", "source", "status") if c in eq.columns]
        f_pap = ctx.write_table("ksweep_eqco_paper", "EqCo's reported numbers (Zhu et al. 2020)",
                                eq[[*cols]].assign(note=note), [(None, eq[cols].reset_index(drop=True))], note=note)
        out.files += f_pap
        md.append(f"EqCo's reported numbers for comparison (their setting differs): {ctx.table_links(f_pap)}\n")
    for ds, n in n_img.items():
        if _finite(n):
            over = sorted(int(k) for k in cells.loc[cells["dataset"] == ds, "K"].unique() if k > n)
            if over:
                md.append(f"_On {ds}, K={_join([str(k) for k in over])} exceeds the {int(n)} pretraining images: the "
                          "queue then holds several older keys of the same images; an anchor's own keys are masked, "
                          "the rest are repeated keys of other images._\n")
    for (ds, m, t, b), _ in agg.groupby(["dataset", "metric", "temperature", "batch_size"], sort=False):
        out.findings.append(_ksweep_finding(summ, ds, m, t, b, n_img.get(ds, math.nan)))
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = _fig_sweep(cells[cells["dataset"] == ds], agg[agg["dataset"] == ds], ds, ctx, x="K",
                                 xlabel="negatives per anchor K (queue length)", base=2, stem="ksweep",
                                 vline=n_img.get(ds, math.nan), title="top-1 vs K")
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out


def _fig_sweep(cells, agg, ds, ctx, *, x: str, xlabel: str, base: int, stem: str, title: str,
               vline: float = math.nan) -> tuple[list[Path], str]:
    """Top-1 vs a swept value (log x) per loss; one column per metric, one row per other setting."""
    extra = ["batch_size", "temperature"] + ([x] if x not in ("temperature",) else [])
    data = _accuracy_long(cells, ctx.scale, list(dict.fromkeys(extra)))
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged for the {stem} runs yet; figure skipped._\n"
    plt, sns, rc = R._plot_style()
    swept = "temperature" if x == "temperature" else x
    fixed = [c for c in ("batch_size", "temperature") if c != swept]
    data["setting"] = [", ".join(f"{'B' if c == 'batch_size' else 'τ'}={R._fmt_t(v) if c == 'temperature' else int(v)}"
                                 for c, v in zip(fixed, vals)) for vals in zip(*(data[c] for c in fixed))]
    agg = agg.assign(setting=[", ".join(f"{'B' if c == 'batch_size' else 'τ'}="
                                        f"{R._fmt_t(v) if c == 'temperature' else int(v)}" for c, v in zip(fixed, vals))
                              for vals in zip(*(agg[c] for c in fixed))])
    labels = _label_order(data)
    pal = R._palette(labels)
    settings = sorted(data["setting"].unique())
    metrics = [R.METRIC_LABELS[m] for m in R.METRICS if R.METRIC_LABELS[m] in set(data["metric"])]
    xs = sorted(float(v) for v in cells[swept].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=data, kind="line", x=swept, y="top-1 (%)", hue="label", hue_order=labels,
                        style="label", style_order=labels, markers=True, dashes=False, palette=pal, errorbar="sd",
                        err_style="bars", col="metric", col_order=metrics, row="setting", row_order=settings,
                        height=3.0, aspect=1.3, facet_kws={"sharey": False, "margin_titles": True})
        for ax in g.axes.flat:
            ax.set_xscale("log", base=base)
            ax.set_xticks(xs)
            ax.set_xticklabels([_fmt_num(v) for v in xs])
            ax.minorticks_off()
            if _finite(vline) and xs[0] / 2 <= vline <= xs[-1] * 2:
                ax.axvline(vline, ls="--", lw=1, color="grey")
        for _, r in agg[agg["state"].isin(("diverged", "failed"))].iterrows():
            ax = g.axes_dict.get((r["setting"], R.METRIC_LABELS.get(r["metric"])))
            if ax is not None:
                _mark_bad(ax, [float(r[swept])], pal.get(r["label"], "k"))
        g.set_titles(row_template="{row_name}", col_template="{col_name}")
        g.set_axis_labels(xlabel, "top-1 (%)")
        if g.legend is not None:
            g.legend.set_title("loss")
        shown = _finite(vline) and xs[0] / 2 <= vline <= xs[-1] * 2
        extra_t = "; dashed line = number of pretraining images" if shown else ""
        g.figure.suptitle(f"{ds}: {title} (mean ± sd over seeds; ▽ on the x axis = all seeds diverged{extra_t})",
                          y=1.02)
        files = ctx.save_figure(g.figure, f"{stem}_{R._slug(ds)}")
    return files, f"**{ds}: {title}**\n\n" + ctx.figure_md(files, f"{ds} {title}")


# --------------------------------------------------------------------------- 3. ESS schedule
def _schedule_labels(cells: pd.DataFrame) -> pd.Series:
    start, end = _param_num(cells, "ess_schedule.start"), _param_num(cells, "ess_schedule.end")
    out = []
    for cid, s, e in zip(cells["cell_id"], start, end):
        if not (_finite(s) and _finite(e)):
            mt = re.search(r"-ess([0-9.eE+-]+?)to([0-9.eE+-]+)(?:-|$)", str(cid))
            if mt:
                s, e = float(mt.group(1)), float(mt.group(2))
        out.append(f"ESS {s:g}→{e:g}" if _finite(s) and _finite(e) else "fixed τ")
    return pd.Series(out, index=cells.index, dtype=object)


def _ess_effect(agg: pd.DataFrame) -> pd.DataFrame:
    keys = ["dataset", "metric", "loss", "label", "temperature", "batch_size"]
    rows = []
    for key, g in agg.groupby(keys, sort=False):
        fixed = g[g["schedule"] == "fixed τ"]
        for _, sch in g[g["schedule"] != "fixed τ"].iterrows():
            f = fixed.iloc[0] if len(fixed) else None
            rows.append({**dict(zip(keys, key)), "schedule": sch["schedule"],
                         "fixed_mean": f["mean"] if f is not None else math.nan,
                         "fixed_std": f["std"] if f is not None else math.nan,
                         "fixed_n": int(f["n_seeds"]) if f is not None else 0,
                         "fixed_state": f["state"] if f is not None else "not run",
                         "scheduled_mean": sch["mean"], "scheduled_std": sch["std"], "scheduled_n": int(sch["n_seeds"]),
                         "scheduled_state": sch["state"],
                         "scheduled_minus_fixed": (sch["mean"] - f["mean"]) if f is not None else math.nan,
                         "two_se": _two_se(sch, f) if f is not None else math.nan})
    return pd.DataFrame(rows)


def _ess_dynamics(cells: pd.DataFrame, ctx) -> pd.DataFrame:
    cols = ["dataset", "loss", "label", "temperature", "batch_size", "schedule", "seed"]
    hs = {k: _history(cells, k, ctx, cols) for k in ("diag/ess", "diag/ess_target", "train/tau")}
    per_run = []
    for rid in cells["run_id"]:
        meta = cells.loc[cells["run_id"] == rid, cols].iloc[0].to_dict()
        row: dict[str, Any] = {"run_id": rid, **meta}
        e, tg, tau = (hs[k][hs[k]["run_id"] == rid] if len(hs[k]) else pd.DataFrame() for k in hs)
        if len(e):
            e = e.sort_values("step")
            row["ess_mean"] = float(e["value"].mean())
            row["ess_first"], row["ess_last"] = float(e["value"].iloc[0]), float(e["value"].iloc[-1])
        if len(e) and len(tg):
            j = e.merge(tg[["step", "value"]], on="step", suffixes=("", "_target"))
            if len(j):
                row["ess_abs_dev_from_target"] = float((j["value"] - j["value_target"]).abs().mean())
        if len(tg):
            tg = tg.sort_values("step")
            row["target_first"], row["target_last"] = float(tg["value"].iloc[0]), float(tg["value"].iloc[-1])
        if len(tau):
            tau = tau.sort_values("step")
            row.update({"tau_first": float(tau["value"].iloc[0]), "tau_last": float(tau["value"].iloc[-1]),
                        "tau_min": float(tau["value"].min()), "tau_max": float(tau["value"].max())})
        if len(row) > len(cols) + 1:
            per_run.append(row)
    if not per_run:
        return pd.DataFrame()
    pr = pd.DataFrame(per_run)
    stats = [c for c in ("ess_mean", "ess_first", "ess_last", "ess_abs_dev_from_target", "target_first",
                         "target_last", "tau_first", "tau_last", "tau_min", "tau_max") if c in pr.columns]
    keys = ["dataset", "loss", "label", "temperature", "batch_size", "schedule"]
    dyn = pr.groupby(keys, sort=False)[stats].mean().reset_index()
    dyn["n_runs"] = pr.groupby(keys, sort=False)["run_id"].nunique().to_numpy()
    return _sorted(dyn, ["dataset", "loss", "label", "temperature", "batch_size", "schedule"])


def _ess_finding(eff: pd.DataFrame, dyn: pd.DataFrame, ds: str, m: str, label: str, t: float, sched: str) -> str:
    d = eff[(eff["dataset"] == ds) & (eff["metric"] == m) & (eff["label"] == label) & (eff["temperature"] == t)
            & (eff["schedule"] == sched)].sort_values("batch_size")
    mlabel = R.METRIC_LABELS.get(m, m)
    claim = ("FlatNCE's Algorithm S1 claim: choosing τ at every step so that the effective sample size (ESS) of "
             "the negatives' softmax weights follows a schedule helps, in particular at small batch.")
    head = f"ESS schedule on {ds} ({label}, fixed τ={R._fmt_t(t)}, {mlabel}): {claim}"
    parts = []
    for _, r in d.iterrows():
        b = int(r["batch_size"])
        if _finite(r["scheduled_minus_fixed"]):
            parts.append(f"at B={b} the {sched} schedule changes top-1 by {r['scheduled_minus_fixed']:+.1f} points "
                         f"({r['scheduled_mean']:.1f} vs {r['fixed_mean']:.1f})")
        else:
            parts.append(f"at B={b} no comparison (scheduled: {r['scheduled_state']}, fixed: {r['fixed_state']})")
    s = [head, "We measured: " + "; ".join(parts) + "."]
    r0 = d.iloc[0]
    bmin = int(r0["batch_size"])
    if not _finite(r0["scheduled_minus_fixed"]):
        if r0["scheduled_state"] in ("diverged", "failed") and _finite(r0["fixed_mean"]):
            s.append(f"At the smallest batch ({bmin}) the scheduled runs {r0['scheduled_state']}: our numbers do "
                     "not support the claim.")
        elif r0["fixed_state"] in ("diverged", "failed") and _finite(r0["scheduled_mean"]):
            s.append(f"At the smallest batch ({bmin}) the fixed-τ runs {r0['fixed_state']} and the scheduled ones "
                     "did not: consistent with the claim.")
        else:
            s.append(f"At the smallest batch ({bmin}) the claim cannot be tested yet.")
    else:
        diff = float(r0["scheduled_minus_fixed"])
        tse = r0["two_se"]
        if _finite(tse) and abs(diff) <= tse:
            s.append(f"At the smallest batch ({bmin}) the difference ({diff:+.1f} points) is within two standard "
                     f"errors of the seed spread ({tse:.1f}): these seeds do not separate the schedule from a fixed "
                     "τ, so our numbers neither support nor refute the claim.")
        else:
            better = round(diff, 1) > 0
            s.append(f"At the smallest batch ({bmin}) the schedule is {'better' if better else 'not better'} than a "
                     f"fixed τ: our numbers {'support' if better else 'do not support'} the claim.")
            if _finite(tse):
                s.append(f"The difference ({diff:+.1f} points) exceeds two standard errors of the seed spread "
                         f"({tse:.1f}).")
            else:
                s.append("With a single seed in a cell there is no error estimate: the difference is not tested "
                         "against seed noise.")
    if len(dyn) and "tau_min" in dyn.columns:
        dd = dyn[(dyn["dataset"] == ds) & (dyn["label"] == label) & (dyn["temperature"] == t)
                 & (dyn["schedule"] == sched) & (dyn["batch_size"] == bmin)]
        if len(dd) and _finite(dd["tau_min"].iloc[0]):
            r = dd.iloc[0]
            txt = f"At B={bmin} the schedule moved τ within {r['tau_min']:.3g}–{r['tau_max']:.3g}"
            if "ess_abs_dev_from_target" in dd.columns and _finite(r["ess_abs_dev_from_target"]):
                txt += f" and held the ESS within {r['ess_abs_dev_from_target']:.3g} of its target on average"
            s.append(txt + ".")
    return " ".join(s)


def ess_section(runs: pd.DataFrame, ctx: R.ReportContext) -> R.SectionOutput | None:
    """FlatNCE's Algorithm S1: ESS-scheduled temperature vs a fixed temperature at small and large batch."""
    cells = _side_cells(runs, ctx, "ess")
    if cells.empty:
        return None
    cells["schedule"] = _schedule_labels(cells)
    out = R.SectionOutput("ess", "Side experiment: ESS-scheduled temperature (FlatNCE, Algorithm S1)", "",
                          run_ids=set(cells["run_id"]))
    keys = ["dataset", "loss", "label", "temperature", "batch_size", "schedule"]
    agg = R.aggregate_cells(cells, keys, ctx.scale)
    agg = _sorted(agg.assign(_s=(agg["schedule"] != "fixed τ").astype(int)),
                  ["dataset", "metric", "loss", "label", "temperature", "_s", "schedule", "batch_size"]
                  ).drop(columns="_s")
    blocks = []
    for (ds, m), g in agg.groupby(["dataset", "metric"], sort=False):
        disp = _pivot(g, ["label", "temperature", "schedule"], "batch_size", lambda b: f"B={int(b)}")
        blocks.append((f"{ds}, {R.METRIC_LABELS.get(m, m)}", _rename(disp)))
    f_top = ctx.write_table("ess_top1", "ESS schedule: top-1 (%) of ESS-scheduled vs fixed temperature", agg, blocks,
                            note="τ = the fixed temperature (and the scheduled runs' starting value); mean ± sample "
                                 "std over seeds; '—' = one seed")
    eff = _ess_effect(agg)
    out.files += f_top
    md = [f"{_runs(len(cells))} (experiment 'ess'). Top-1: {ctx.table_links(f_top)}\n"]
    if len(eff):
        eblocks = []
        for (ds, m), g in eff.groupby(["dataset", "metric"], sort=False):
            eblocks.append((f"{ds}, {R.METRIC_LABELS.get(m, m)}", pd.DataFrame({
                "loss": g["label"], "τ": g["temperature"], "schedule": g["schedule"], "B": g["batch_size"].astype(int),
                "fixed": [_display(r, "fixed") for _, r in g.iterrows()],
                "scheduled": [_display(r, "scheduled") for _, r in g.iterrows()],
                "scheduled − fixed": [R._signed(v) for v in g["scheduled_minus_fixed"]],
                "2 SE": [R._num(v) for v in g["two_se"]]}).reset_index(drop=True)))
        f_eff = ctx.write_table("ess_effect", "ESS schedule: scheduled minus fixed temperature (points)", eff, eblocks,
                                note="2 SE = two standard errors of the difference (needs ≥ 2 seeds per cell)")
        out.files += f_eff
        md.append(f"Scheduled − fixed: {ctx.table_links(f_eff)}\n")
        for sub, df in eblocks:
            md += [f"**{sub}**\n", R.markdown_table(df)]
    else:
        md.append("_No pair of scheduled and fixed-τ cells: nothing to compare._\n")
    dyn = _ess_dynamics(cells, ctx)
    if len(dyn):
        f_dyn = ctx.write_table("ess_dynamics", "ESS schedule: effective sample size and temperature over training",
                                dyn, note="means over seeds of per-run statistics of diag/ess, diag/ess_target and "
                                          "train/tau (ESS normalised: 1/(K sum_j w_j^2), between 1/K and 1)")
        out.files += f_dyn
        md.append(f"ESS and τ over training, per cell: {ctx.table_links(f_dyn)}\n")
    if len(eff):
        for (ds, m, lab, t, sch), _ in eff.groupby(["dataset", "metric", "label", "temperature", "schedule"],
                                                   sort=False):
            out.findings.append(_ess_finding(eff, dyn, ds, m, lab, t, sch))
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = _fig_ess(cells[cells["dataset"] == ds], ds, ctx)
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out


def _display(r: pd.Series, who: str) -> str:
    if not _finite(r[f"{who}_mean"]):
        return str(r[f"{who}_state"])
    return f"{r[f'{who}_mean']:.1f} ± {R._num(r[f'{who}_std'])}"


def _fig_ess(cells: pd.DataFrame, ds: str, ctx) -> tuple[list[Path], str]:
    cols = ["label", "loss", "temperature", "batch_size", "schedule"]
    frames = {}
    for key, name in (("diag/ess", "ESS"), ("diag/ess_target", "ESS target"), ("train/tau", "τ")):
        h = _history(cells, key, ctx, cols)
        if len(h):
            frames[name] = _binned(h, cols)
    if "ESS" not in frames and "τ" not in frames:
        return [], f"_{ds}: no `diag/ess` or `train/tau` history for the ess runs; figure skipped._\n"
    plt, sns, rc = R._plot_style()
    bss = [int(b) for b in sorted(cells["batch_size"].unique())]
    rows = [n for n in ("ESS", "τ") if n in frames]
    scheds = sorted(cells["schedule"].unique(), key=lambda s: (s != "fixed τ", s))
    pal = dict(zip(scheds, sns.color_palette("tab10", len(scheds))))
    multi = cells["label"].nunique() > 1 or cells["temperature"].nunique() > 1
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(len(rows), len(bss), figsize=(3.6 * len(bss), 2.8 * len(rows)), squeeze=False,
                                 sharex=True)
        for i, name in enumerate(rows):
            for j, b in enumerate(bss):
                ax = axes[i][j]
                d = frames[name][frames[name]["batch_size"] == b].copy()
                if multi:
                    d["run"] = [f"{lab}, τ0={R._fmt_t(t)}" for lab, t in zip(d["label"], d["temperature"])]
                if len(d):
                    sns.lineplot(data=d, x="progress", y="value", hue="schedule", hue_order=scheds, palette=pal,
                                 style="run" if multi else None, errorbar="sd", ax=ax, legend=(i == 0 and j == 0))
                if name == "ESS" and "ESS target" in frames:
                    tg = frames["ESS target"][frames["ESS target"]["batch_size"] == b]
                    if len(tg):
                        sns.lineplot(data=tg, x="progress", y="value", color="k", ls="--", lw=1, errorbar=None,
                                     ax=ax, label="ESS target" if j == 0 else None)
                if name == "τ":
                    v = frames[name]["value"]
                    if (v > 0).all() and v.max() / v.min() > 5:
                        from matplotlib.ticker import FormatStrFormatter

                        ax.set_yscale("log")
                        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
                ax.set_title(f"{name} | batch size {b}")
                ax.set_xlabel("fraction of training (epoch / epochs)")
                ax.set_ylabel("ESS / K = 1/(K Σ w²)" if name == "ESS" else "temperature τ")
        fig.suptitle(f"{ds}: ESS-scheduled vs fixed temperature over training (mean ± sd over seeds)", y=1.02)
        fig.tight_layout()
        files = ctx.save_figure(fig, f"ess_schedule_{R._slug(ds)}")
    return files, (f"**{ds}: ESS and τ over training** (`diag/ess`, dashed: `diag/ess_target`; `train/tau`)\n\n"
                   + ctx.figure_md(files, f"{ds} ESS schedule"))


# --------------------------------------------------------------------------- 4. temperature sweep
def _uniq(values: Iterable[Any]) -> str:
    vals = [_fmt_num(v) for v in pd.Series(list(values)).dropna()]
    vals = [v for v in dict.fromkeys(vals) if v.strip().lower() not in _NONE]
    return "/".join(vals) if vals else "?"


def _setting_of(papers: pd.DataFrame) -> str:
    """Dataset, backbone, batch size and epochs of paper rows, from the CSV."""
    return (f"{_uniq(papers['dataset'])}, {_uniq(papers['backbone'])}, batch {_uniq(papers['batch_size'])}, "
            f"{_uniq(papers['epochs'])} epochs")


def _setting_of_runs(cells: pd.DataFrame) -> str:
    return (f"{_uniq(cells['dataset'])}, {_uniq(_param(cells, 'backbone'))}, batch {_uniq(cells['batch_size'])}, "
            f"{_uniq(_param(cells, 'epochs'))} epochs")


def _simclr_table5(papers: pd.DataFrame) -> pd.DataFrame:
    p = papers[papers["paper"].astype(str).str.startswith("SimCLR")
               & papers["source"].astype(str).str.contains(r"\bTable 5\b", regex=True)].copy()
    p["temperature"] = pd.to_numeric(p["temperature"], errors="coerce")
    p["value"] = pd.to_numeric(p["value"], errors="coerce")
    return p[np.isfinite(p["temperature"]) & np.isfinite(p["value"])].reset_index(drop=True)


def _simclr_claim(t5: pd.DataFrame) -> str:
    """SimCLR Table 5 summarised from the CSV (l2-normalised rows: our embeddings are l2-normalised)."""
    if t5.empty:
        return "SimCLR's Table 5 is not in paper_results.csv, so no reported τ sensitivity to compare with."
    l2 = t5[t5["method"].astype(str).str.contains("l2-normalized", case=False)]
    l2 = l2 if len(l2) else t5
    best = l2.loc[l2["value"].idxmax()]
    taus = ", ".join(R._fmt_t(t) for t in sorted(l2["temperature"]))
    return (f"SimCLR (Table 5; {best['dataset']}, {best['backbone']}, batch {_fmt_num(best['batch_size'])}, "
            f"{_fmt_num(best['epochs'])} epochs, l2-normalised) found that τ matters for NT-Xent: best τ="
            f"{R._fmt_t(best['temperature'])} ({best['value']:.1f}%), a range of "
            f"{l2['value'].max() - l2['value'].min():.1f} points over τ ∈ {{{taus}}}.")


def _tsweep_finding(summ: pd.DataFrame, claim: str, ds: str, m: str, b: int) -> str:
    d = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["batch_size"] == b)]
    mlabel = R.METRIC_LABELS.get(m, m)
    head = f"Temperature sweep on {ds} (B={b}, {mlabel}): {claim}"
    s = [head]
    ntau = int(d["temperature_max"].iloc[0] != d["temperature_min"].iloc[0]) if len(d) else 0
    if not ntau:
        s.append("Only one τ was run, so sensitivity to τ cannot be measured.")
        return " ".join(s)

    def desc(r) -> str:
        if int(r["n_temperature_with_values"]) == 0:
            return f"{r['label']}: no value at any τ"
        txt = (f"{r['label']} best τ={R._fmt_t(r['best_temperature'])} ({r['best_mean']:.1f}%), "
               f"range {r['range']:.1f}")
        if int(r["n_temperature_with_values"]) < 2:
            txt += " (one τ only)"
        if r["temperature_diverged"]:
            txt += f", diverged at τ={r['temperature_diverged']}"
        return txt

    s.append("We measured: " + "; ".join(desc(r) for _, r in d.iterrows()) + " (range = max − min of top-1 over "
             "τ, points).")
    inf = d[d["loss"] == "infonce"]
    others = d[d["loss"] != "infonce"]
    if inf.empty or int(inf.iloc[0]["n_temperature_with_values"]) < 2:
        s.append("InfoNCE has values at fewer than two τ, so the other losses' sensitivity cannot be compared "
                 "with it.")
        return " ".join(s)
    i = inf.iloc[0]

    def key(r) -> tuple[int, float]:
        return (int(r["n_diverged_points"]), round(float(r["range"]), 1) if _finite(r["range"]) else math.inf)

    comparable = [r for _, r in others.iterrows() if int(r["n_temperature_with_values"]) >= 2
                  or int(r["n_diverged_points"]) > 0]
    if not comparable:
        s.append("No other loss has values at two or more τ, so there is nothing to compare InfoNCE with.")
        return " ".join(s)
    less = [r["label"] for r in comparable if key(r) < key(i)]
    more = [r["label"] for r in comparable if key(r) >= key(i)]
    # A range is the difference of two cell means, so a difference of two ranges involves four:
    # its standard error is about 2·sd/√n, with sd the seed spread pooled over the sweep's cells.
    sds = [float(r["pooled_sd"]) for r in [i, *comparable] if _finite(r["pooled_sd"])]
    n = min(int(r["n_seeds_min"]) for r in [i, *comparable])
    clean = all(int(r["n_diverged_points"]) == 0 for r in [i, *comparable])
    gaps = [abs(float(r["range"]) - float(i["range"])) for r in comparable if _finite(r["range"])]
    if sds and n >= 2 and clean and gaps and _finite(i["range"]):
        two_se = 2 * 2 * float(np.sqrt(np.mean(np.square(sds)))) / math.sqrt(n)
        if max(gaps) <= two_se:
            s.append(f"The ranges differ from InfoNCE's by at most {max(gaps):.1f} points, within two standard "
                     f"errors of seed noise ({two_se:.1f}; pooled seed sd, {n} seeds): these seeds do not separate "
                     "the losses' sensitivity to τ, so our numbers neither support nor refute the claim that the "
                     "other losses depend less on τ.")
            return " ".join(s)
    if less and not more:
        s.append(f"All {len(comparable)} other losses are less sensitive to τ than InfoNCE (smaller range"
                 f"{', no divergence' if i['n_diverged_points'] else ''}): consistent with the claim that they "
                 "depend less on τ.")
    elif less:
        s.append(f"{len(less)} of {len(comparable)} other losses are less sensitive to τ than InfoNCE "
                 f"({_join(less)}); {_join(more)} {'is' if len(more) == 1 else 'are'} not: partly consistent with "
                 "the claim that they depend less on τ.")
    else:
        s.append(f"None of the {len(comparable)} other losses is less sensitive to τ than InfoNCE: our numbers do "
                 "not support the claim that they depend less on τ.")
    sets = {r["label"]: r["temperature_values"] for _, r in d.iterrows()}
    if len(set(sets.values())) > 1:
        s.append("The losses have numbers at different sets of τ (a diverged or pending cell has none), so their "
                 "ranges are not over the same values.")
    return " ".join(s)


def tsweep_section(runs: pd.DataFrame, ctx: R.ReportContext) -> R.SectionOutput | None:
    """SimCLR Table 5's analogue: top-1 by loss × temperature at a fixed batch; range over τ per loss."""
    cells = _side_cells(runs, ctx, "tsweep")
    if cells.empty:
        return None
    out = R.SectionOutput("tsweep", "Side experiment: temperature sweep (SimCLR Table 5's analogue)", "",
                          run_ids=set(cells["run_id"]))
    setting = ["dataset", "batch_size"]
    agg = _sorted(R.aggregate_cells(cells, [*setting, "loss", "label", "temperature"], ctx.scale),
                  ["dataset", "metric", "batch_size", "loss", "label", "temperature"])
    summ = _sweep_summary(agg, setting, "temperature")
    vals = agg[np.isfinite(agg["mean"].astype(float))].groupby(["dataset", "metric", "batch_size", "label"])[
        "temperature"].agg(lambda v: ", ".join(R._fmt_t(t) for t in sorted(v)))
    summ["temperature_values"] = [vals.get((r["dataset"], r["metric"], r["batch_size"], r["label"]), "")
                                  for _, r in summ.iterrows()]
    blocks = []
    for (ds, m, b), g in agg.groupby(["dataset", "metric", "batch_size"], sort=False):
        g = g.sort_values("temperature", kind="stable").copy()
        sm = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["batch_size"] == b)].set_index("label")
        g["disp"] = [d + (" *" if _finite(sm.loc[lab, "best_temperature"]) and t == sm.loc[lab, "best_temperature"]
                          and int(sm.loc[lab, "n_temperature_with_values"]) > 1 else "")
                     for d, lab, t in zip(g["display"], g["label"], g["temperature"])]
        disp = _pivot(g, ["label"], "temperature", lambda t: f"τ={R._fmt_t(t)}", value="disp")
        disp = disp.set_index("label").loc[list(dict.fromkeys(_sorted(g, ["loss", "label"])["label"]))].reset_index()
        disp["range"] = [R._num(sm.loc[lab, "range"]) for lab in disp["label"]]
        blocks.append((f"{ds}, B={int(b)}, {R.METRIC_LABELS.get(m, m)}", disp.rename(columns={"label": "loss"})))
    f_top = ctx.write_table("tsweep_top1", "Temperature sweep: top-1 (%) by loss × τ", agg, blocks,
                            note="mean ± sample std over seeds; '—' = one seed; * = best τ for the loss; "
                                 "range = max − min over τ (points)")
    f_sum = ctx.write_table("tsweep_sensitivity", "Temperature sweep: best τ and range of top-1 over τ per loss",
                            summ,
                            note="range = max − min of the mean top-1 over the τ values with a number")
    out.files += f_top + f_sum
    md = [f"{_runs(len(cells))} (experiment 'tsweep'). Top-1 by τ: {ctx.table_links(f_top)}; "
          f"sensitivity to τ: {ctx.table_links(f_sum)}\n"]
    for sub, df in blocks:
        md += [f"**{sub}**\n", R.markdown_table(df)]
    t5 = _simclr_table5(ctx.papers)
    claim = _simclr_claim(t5)
    if len(t5):
        note = (f"SimCLR's setting ({_setting_of(t5)}) differs from ours ({_setting_of_runs(cells)}): "
                "compare the shape over τ, not absolute numbers")
        long_rows = [{"who": "paper: SimCLR Table 5", "dataset": r["dataset"], "batch_size": r["batch_size"],
                      "method": r["method"], "temperature": r["temperature"], "metric": r["metric"],
                      "value": r["value"], "display": f"{r['value']:.1f}", "status": r["status"]}
                     for _, r in t5.iterrows()]
        ours = agg[agg["loss"] == "infonce"]
        for _, r in ours.iterrows():
            long_rows.append({"who": "ours", "dataset": r["dataset"], "batch_size": r["batch_size"],
                              "method": r["label"], "temperature": r["temperature"],
                              "metric": R.METRIC_LABELS.get(r["metric"], r["metric"]), "value": r["mean"],
                              "display": r["display"], "status": r["state"]})
        side = pd.DataFrame(long_rows)
        side["note"] = note
        taus = sorted(set(float(t) for t in side["temperature"]))
        wide = pd.DataFrame({"τ": [R._fmt_t(t) for t in taus]})
        for meth, g in t5.groupby("method", sort=False):
            d = dict(zip(g["temperature"].astype(float), g["value"]))
            wide[f"SimCLR T5: {meth} (B={_fmt_num(g['batch_size'].iloc[0])})"] = [
                f"{d[t]:.1f}" if t in d else "" for t in taus]
        for (ds, b, m), g in ours.groupby(["dataset", "batch_size", "metric"], sort=False):
            d = dict(zip(g["temperature"].astype(float), g["display"]))
            wide[f"ours: InfoNCE, {ds}, B={int(b)}, {R.METRIC_LABELS.get(m, m)}"] = [d.get(t, "") for t in taus]
        f_pap = ctx.write_table("tsweep_simclr_table5", "SimCLR Table 5 (NT-Xent top-1 by τ) next to our InfoNCE",
                                side, [(None, wide)], note=note)
        out.files += f_pap
        md.append(f"SimCLR's Table 5 side by side with our InfoNCE (their setting differs): "
                  f"{ctx.table_links(f_pap)}\n\n> Note: {note}.\n")
        md.append(R.markdown_table(wide))
    for (ds, m, b), _ in agg.groupby(["dataset", "metric", "batch_size"], sort=False):
        out.findings.append(_tsweep_finding(summ, claim, ds, m, int(b)))
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = _fig_sweep(cells[cells["dataset"] == ds], agg[agg["dataset"] == ds], ds, ctx, x="temperature",
                                 xlabel="temperature τ", base=10, stem="tsweep", title="top-1 vs temperature")
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out


SIDE_SECTIONS = (precision_section, ksweep_section, ess_section, tsweep_section)
for _fn in SIDE_SECTIONS:
    R.register_section(_fn)
