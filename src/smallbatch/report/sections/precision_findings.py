"""FlatNCE's floating-point claims read from the precision experiment's tables.

* the hypothesis: if rounding error causes InfoNCE's small-batch collapse, InfoNCE
  trained in fp64 should close most of its gap to FlatNCE (:func:`gap_finding`,
  from :func:`gaps`);
* the measurement: InfoNCE's fp32 gradient carries a large rounding error at small
  batch and small τ, FlatNCE's a small one (:func:`grad_finding`,
  :func:`grad_tau_finding`, from the gradient-error summary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from ...tracking import BAD_STATUSES
from ..aggregate import NO_NUMBER, first_row
from ..evidence import describe, paired, support
from ..fmt import finite, join, sci, short
from ..runs import METRIC_LABELS

PRECISION_ORDER = ("fp64", "fp32", "bf16", "fp16")
#: A relative gradient error below this is rounding noise, not the "large" error FlatNCE blames
#: (a saturated batch gives 1e-1 in fp32; training-time batches here gave 1e-7 .. 1e-6).
GRAD_ERR_LARGE = 1e-3
_GAP_COLUMNS = [
    "infonce_label",
    "flatnce_label",
    "infonce_mean",
    "infonce_std",
    "infonce_n",
    "infonce_state",
    "flatnce_mean",
    "flatnce_std",
    "flatnce_n",
    "flatnce_state",
    "gap_flatnce_minus_infonce",
    "gap_ci_low",
    "gap_ci_high",
    "gap_test",
    "gap_p",
    "gap_fp32",
    "closed_fraction_of_fp32_gap",
    "infonce_change_vs_fp32",
]


def precision_order(values: Iterable[Any]) -> list[str]:
    """Precisions in the order fp64, fp32, bf16, fp16, then any other alphabetically."""
    vals = list(dict.fromkeys(str(v) for v in values))
    return [p for p in PRECISION_ORDER if p in vals] + sorted(v for v in vals if v not in PRECISION_ORDER)


def gaps(agg: pd.DataFrame) -> pd.DataFrame:
    """FlatNCE − InfoNCE top-1 gap per (dataset, metric, τ, B, precision) and its closure vs fp32."""
    keys = ["dataset", "metric", "temperature", "batch_size", "precision"]
    rows = []
    for key, g in agg.groupby(keys, sort=False):
        for _, i in g[g["loss"] == "infonce"].iterrows():
            for _, f in g[g["loss"] == "flatnce"].iterrows():
                rows.append(
                    {
                        **dict(zip(keys, key)),
                        "infonce_label": i["label"],
                        "flatnce_label": f["label"],
                        **{
                            f"{w}_{c}": r[s]
                            for w, r in (("infonce", i), ("flatnce", f))
                            for c, s in (("mean", "mean"), ("std", "std"), ("n", "n_seeds"), ("state", "state"))
                        },
                        "gap_flatnce_minus_infonce": float(f["mean"]) - float(i["mean"]),
                        **_gap_test(paired(f.get("values") or {}, i.get("values") or {})),
                    }
                )
    if not rows:
        return pd.DataFrame(columns=[*keys, *_GAP_COLUMNS])
    df = pd.DataFrame(rows)
    ref_keys = ["dataset", "metric", "temperature", "batch_size", "infonce_label", "flatnce_label"]
    ref = df[df["precision"] == "fp32"].set_index(ref_keys)
    idx = pd.MultiIndex.from_frame(df[ref_keys])
    df["gap_fp32"] = ref["gap_flatnce_minus_infonce"].reindex(idx).to_numpy() if len(ref) else math.nan
    inf32 = ref["infonce_mean"].reindex(idx).to_numpy() if len(ref) else math.nan
    g32 = df["gap_fp32"].astype(float)
    df["closed_fraction_of_fp32_gap"] = np.where(g32 > 0, 1.0 - df["gap_flatnce_minus_infonce"] / g32, math.nan)
    df["infonce_change_vs_fp32"] = df["infonce_mean"].astype(float) - inf32
    return df[[*keys, *_GAP_COLUMNS]]


def _gap_test(e) -> dict:
    return {"gap_ci_low": e.lo, "gap_ci_high": e.hi, "gap_test": e.test, "gap_p": e.p}


def _gap_phrase(r: pd.Series, p: str) -> str:
    if not finite(r["gap_flatnce_minus_infonce"]):
        bad = [
            f"{lab} {st}"
            for lab, st in (("InfoNCE", r["infonce_state"]), ("FlatNCE", r["flatnce_state"]))
            if st in NO_NUMBER
        ]
        return f"not computable in {p} ({', '.join(bad) or 'no value'})"
    ci = f" [{r['gap_ci_low']:+.1f}, {r['gap_ci_high']:+.1f}]" if finite(r.get("gap_ci_low")) else " (untested)"
    s = f"{r['gap_flatnce_minus_infonce']:+.1f}{ci} in {p}"
    c = r["closed_fraction_of_fp32_gap"]
    if p != "fp32" and finite(c):
        s += (
            f" ({p} closes {100 * c:.0f}% of the fp32 gap)"
            if c >= 0
            else f" ({p} widens the fp32 gap by {-100 * c:.0f}%)"
        )
    return s


def _measured(d: pd.DataFrame, bss: list[int]) -> str:
    parts = []
    for b in bss:
        db = d[d["batch_size"] == b]
        phrases = [_gap_phrase(db[db["precision"] == p].iloc[0], p) for p in precision_order(db["precision"])]
        parts.append(f"at B={b} the FlatNCE − InfoNCE gap is " + ", ".join(phrases))
    return "We measured: " + "; ".join(parts) + " (points; [95 % paired-t interval over seeds])."


def _failed_in_fp32(r32: pd.Series, r64: pd.Series, bmin: int) -> str | None:
    """The verdict when InfoNCE's seeds all failed in fp32 while FlatNCE trained; None otherwise."""
    if not (r32["infonce_state"] in BAD_STATUSES and finite(r32["flatnce_mean"])):
        return None
    if finite(r64["gap_flatnce_minus_infonce"]):
        return (
            f"At the smallest batch ({bmin}) InfoNCE {r32['infonce_state']} in fp32 (all seeds) but trained in "
            f"fp64 (gap to FlatNCE {r64['gap_flatnce_minus_infonce']:+.1f}): consistent with the hypothesis "
            "that rounding error causes the collapse."
        )
    if r64["infonce_state"] in BAD_STATUSES:
        return (
            f"At the smallest batch ({bmin}) InfoNCE {r32['infonce_state']} in fp32 and in fp64 alike: "
            "our numbers do not support the hypothesis."
        )
    return None


def _closure_verdict(agg: pd.DataFrame, r32: pd.Series, r64: pd.Series, where: dict) -> list[str]:
    """Whether fp64 closes most of the fp32 gap at the smallest batch, and InfoNCE's change against seed noise."""
    bmin = where["batch_size"]
    if not (finite(r32["gap_flatnce_minus_infonce"]) and finite(r64["gap_flatnce_minus_infonce"])):
        st = {
            f"{w} {p}": r[f"{w.lower()}_state"]
            for w in ("InfoNCE", "FlatNCE")
            for p, r in (("fp32", r32), ("fp64", r64))
        }
        bad = ", ".join(f"{k} {v}" for k, v in st.items() if v in NO_NUMBER)
        return [f"At the smallest batch ({bmin}) the hypothesis cannot be tested ({bad})."]
    g32 = float(r32["gap_flatnce_minus_infonce"])
    if round(g32, 1) <= 0:
        return [
            f"At the smallest batch ({bmin}) InfoNCE is not behind FlatNCE in fp32 (gap {g32:+.1f}), so there "
            "is no small-batch gap for fp64 to close and the hypothesis is not tested by these runs."
        ]
    closed = float(r64["closed_fraction_of_fp32_gap"])
    i32, i64 = (first_row(agg, **where, precision=p, loss="infonce") for p in ("fp32", "fp64"))
    noise, e = [], None
    if i32 is not None and i64 is not None and finite(i32["mean"]) and finite(i64["mean"]):
        e = paired(i64.get("values") or {}, i32.get("values") or {})
        noise = [
            f"The change of InfoNCE's top-1 from fp32 to fp64 (points, 95 % paired-t interval over seeds) is "
            f"{describe(e)}."
        ]
    # the verdict rests on InfoNCE's change: within seed noise it is neither support nor refutation
    verdict = support(closed >= 0.5, e, "the hypothesis")
    return [
        f"At the smallest batch ({bmin}) fp64 closes {100 * closed:.0f}% of the gap, most of it: {verdict}."
        if closed >= 0.5
        else f"At the smallest batch ({bmin}) fp64 closes only {100 * closed:.0f}% of the gap, not most of it: "
        f"{verdict}."
    ] + noise


def gap_finding(gaps: pd.DataFrame, agg: pd.DataFrame, ds: str, m: str, t: float) -> str:
    """The hypothesis, the measured gaps, and whether fp64 closes most of the gap at the smallest batch."""
    d = gaps[(gaps["dataset"] == ds) & (gaps["metric"] == m) & (gaps["temperature"] == t)]
    claim = (
        "FlatNCE's floating-point hypothesis: if rounding error causes InfoNCE's small-batch collapse, "
        "InfoNCE trained in fp64 should close most of its gap to FlatNCE."
    )
    head = f"Precision on {ds} at τ={short(t)} ({METRIC_LABELS.get(m, m)}): {claim}"
    if d.empty:
        return f"{head} It cannot be tested: InfoNCE and FlatNCE were not both run at any batch size and precision."
    bss = sorted(int(b) for b in d["batch_size"].unique())
    s = [head, _measured(d, bss)]
    bmin = bss[0]
    r32, r64 = (d[(d["batch_size"] == bmin) & (d["precision"] == p)] for p in ("fp32", "fp64"))
    if r32.empty or r64.empty:
        missing = [p for p, r in (("fp32", r32), ("fp64", r64)) if r.empty]
        return " ".join(
            s
            + [
                f"At the smallest batch ({bmin}) the hypothesis cannot be tested: no "
                f"{' or '.join(missing)} pair of InfoNCE and FlatNCE runs."
            ]
        )
    failed = _failed_in_fp32(r32.iloc[0], r64.iloc[0], bmin)
    if failed:
        return " ".join(s + [failed])
    where = {"dataset": ds, "metric": m, "temperature": t, "batch_size": bmin}
    return " ".join(s + _closure_verdict(agg, r32.iloc[0], r64.iloc[0], where))


# --------------------------------------------------------------------------- gradient rounding error
def _grad_value(d: pd.DataFrame, loss: str, b: int, dt: str) -> float:
    r = d[(d["loss"] == loss) & (d["batch_size"] == b) & (d["dtype"] == dt)]
    return float(r["mean"].iloc[0]) if len(r) else math.nan


def _grad_measured(d: pd.DataFrame, bss: list[int]) -> list[str]:
    parts = []
    for b in bss:
        i, f = _grad_value(d, "infonce", b, "fp32"), _grad_value(d, "flatnce", b, "fp32")
        parts.append(
            f"at B={b} {sci(i)} for InfoNCE vs {sci(f)} for FlatNCE"
            + (f" (InfoNCE {i / f:.3g}× FlatNCE's)" if finite(i) and finite(f) and f > 0 else "")
        )
    s = ["Mean relative error of the fp32 loss gradient w.r.t. the embeddings (vs fp64): " + "; ".join(parts) + "."]
    bf = [
        f"B={b}: {sci(_grad_value(d, 'infonce', b, 'bf16'))} vs {sci(_grad_value(d, 'flatnce', b, 'bf16'))}"
        for b in bss
        if finite(_grad_value(d, "infonce", b, "bf16")) or finite(_grad_value(d, "flatnce", b, "bf16"))
    ]
    return s + (["In bf16 (InfoNCE vs FlatNCE): " + "; ".join(bf) + "."] if bf else [])


def _grad_verdict(larger: bool, grows: bool | None, i_min: float, bmin: int) -> str:
    if larger and i_min < GRAD_ERR_LARGE:
        return (
            f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's, but both are "
            f"below {GRAD_ERR_LARGE:g}, i.e. at the level of fp32's own rounding (unit roundoff 6e-8), not the "
            "large error of a saturated batch (q_B < 2^-24): these runs "
            "never reach the regime the claim is about, so they do not support it."
        )
    if larger and grows is not False:
        return (
            f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's: "
            "our measurement supports the claim."
        )
    if larger:
        return (
            f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error exceeds FlatNCE's, but it does not "
            "grow as the batch shrinks: our measurement supports the claim only in part."
        )
    return (
        f"At the smallest batch ({bmin}) InfoNCE's fp32 gradient error does not exceed FlatNCE's: "
        "our measurement does not support the claim."
    )


def grad_finding(summ: pd.DataFrame, ds: str, t: float) -> str:
    """FlatNCE's claim on the fp32 gradient's rounding error, at the smallest batch, from the summary."""
    d = summ[(summ["dataset"] == ds) & (summ["temperature"] == t)]
    claim = (
        "FlatNCE's claim: InfoNCE's fp32 gradient carries a large rounding error at small batch and small τ, "
        "FlatNCE's a small one."
    )
    bss = sorted(int(b) for b in d["batch_size"].unique())
    s = [f"Gradient rounding error on {ds} at τ={short(t)}: {claim}", *_grad_measured(d, bss)]
    bmin, bmax = bss[0], bss[-1]
    i_min, f_min = _grad_value(d, "infonce", bmin, "fp32"), _grad_value(d, "flatnce", bmin, "fp32")
    if not (finite(i_min) and finite(f_min)):
        s.append(
            f"The claim cannot be tested at B={bmin}: the fp32 gradient error of "
            f"{join([n for n, v in (('InfoNCE', i_min), ('FlatNCE', f_min)) if not finite(v)])} was not logged."
        )
        return " ".join(s)
    grows = None
    i_max = _grad_value(d, "infonce", bmax, "fp32")
    if bmax != bmin and finite(i_max):
        grows = i_min > i_max
        s.append(
            f"InfoNCE's error {'grows' if grows else 'does not grow'} as the batch shrinks "
            f"(B={bmax}→{bmin}: {sci(i_max)}→{sci(i_min)})."
        )
    return " ".join(s + [_grad_verdict(i_min > f_min, grows, i_min, bmin)])


def grad_tau_finding(summ: pd.DataFrame, ds: str) -> str:
    """Whether InfoNCE's fp32 gradient error at the smallest batch is larger at the smallest τ."""
    d = summ[(summ["dataset"] == ds) & (summ["loss"] == "infonce") & (summ["dtype"] == "fp32")]
    taus = sorted(d["temperature"].unique())
    if len(taus) < 2:
        return ""
    bmin = int(d["batch_size"].min())
    lo, hi = (d[(d["temperature"] == t) & (d["batch_size"] == bmin)]["mean"] for t in (taus[0], taus[-1]))
    if lo.empty or hi.empty:
        return ""
    lo, hi = float(lo.iloc[0]), float(hi.iloc[0])
    return (
        f"On {ds} at B={bmin}, InfoNCE's fp32 gradient error at the smallest τ ({short(taus[0])}: {sci(lo)}) "
        f"is {'larger' if lo > hi else 'not larger'} than at the largest τ ({short(taus[-1])}: {sci(hi)}); "
        "the claim expects it larger."
    )
