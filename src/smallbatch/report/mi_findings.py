"""The papers' claims about MI bounds, read from the aggregated MI toy (one function per claim).

Each claim function takes the aggregate of :func:`.mi.aggregate_mi` and returns
``(finding, claim row)``: a plain-words sentence for index.md and a row of the
claims table (claim, source, measured, verdict), or ``None`` where the store has
no runs for it.  Every number is computed from the table.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .fmt import num, short, signed

#: an estimate at least this fraction of its ceiling counts as saturated
SATURATION = 0.9
CRITIC_NAMES = {"separable": "separable", "concat": "concatenated", "oracle": "oracle"}
CLAIM_COLUMNS = ["claim", "source", "measured", "verdict"]
Claim = tuple[str, dict | None] | None


def _learned(a: pd.DataFrame, estimator: str) -> pd.DataFrame:
    return a[(a["critic"] != "oracle") & (a["estimator"] == estimator)]


def _example(df: pd.DataFrame) -> pd.Series | None:
    """The most telling setting: smallest K, then largest true MI."""
    if df.empty:
        return None
    return df.sort_values(["K", "true_mi"], ascending=[True, False], kind="stable").iloc[0]


def _saturated(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["estimate"] >= SATURATION * df["log_k1"]]


def _infonce_verdict(ratio: float, over: pd.DataFrame, per_k, orc_over: pd.DataFrame) -> str:
    if ratio > 1 + 1e-6:
        return "not supported (an estimate exceeded log(K+1))"
    if len(over) == 0:
        return "not tested (no setting with true MI above log(K+1))"
    if per_k is None or not float(per_k.iloc[0]) >= SATURATION:
        return "partly: the ceiling held, but even at the largest true MI the estimate stayed well below it"
    if len(_saturated(over)) >= len(over) / 2:
        tail = ""
    elif len(orc_over) and len(_saturated(orc_over)) < len(orc_over) / 2:
        tail = "; closer to the ceiling the bound approaches it only slowly, with the oracle critic too"
    else:
        tail = "; elsewhere the learned critic stayed below it"
    return "supported: capped at log(K+1), and pinned to it where the true MI is far above it" + tail


def infonce_cap(a: pd.DataFrame) -> Claim:
    """InfoNCE's estimate log(K+1) - L cannot exceed log(K+1), so it saturates when the true MI is larger."""
    nce = _learned(a, "infonce")
    if nce.empty:
        return None
    ratio = float((nce["estimate"] / nce["log_k1"]).max())
    over = nce[nce["true_mi"] > nce["log_k1"]]
    orc = a[(a["critic"] == "oracle") & (a["estimator"] == "infonce")]
    orc_over = orc[orc["true_mi"] > orc["log_k1"]]
    top = over[over["true_mi"] == over["true_mi"].max()] if len(over) else over
    per_k = top.groupby("K")["estimate"].mean() / top.groupby("K")["log_k1"].first() if len(top) else None
    measured = (f"largest estimate / log(K+1) = {ratio:.3f}; {len(_saturated(over))} of {len(over)} settings with "
                f"true MI above log(K+1) came within {100 * (1 - SATURATION):.0f}% of it")
    if len(orc_over):
        measured += f" (oracle critic: {len(_saturated(orc_over))} of {len(orc_over)})"
    if per_k is not None and len(per_k):
        measured += (f"; at true MI {short(top['true_mi'].iloc[0])} the estimate reached "
                     + ", ".join(f"{v:.0%} (K={k})" for k, v in per_k.items()) + " of log(K+1)")
    claim = {"claim": "InfoNCE's estimate log(K+1) - L cannot exceed log(K+1), so it saturates when the true MI "
                      "is larger",
             "source": "van den Oord et al. 2018; Poole et al. 2019 (motivation of EqCo, FlatNCE)",
             "measured": measured, "verdict": _infonce_verdict(ratio, over, per_k, orc_over)}
    sent = f"MI toy, InfoNCE: never above log(K+1) (largest estimate/ceiling {ratio:.3f})"
    ex = _example(over)
    if ex is not None:
        sent += (f"; where the true MI exceeds log(K+1) it stays capped, e.g. {num(ex['estimate'], 2)} nats at "
                 f"K={ex['K']} for a true {short(ex['true_mi'])} (ceiling {num(ex['log_k1'], 2)})")
    if per_k is not None and len(per_k) > 1:
        sent += (f"; at true MI {short(top['true_mi'].iloc[0])} it reached {float(per_k.iloc[0]):.0%} of log(K+1) "
                 f"at K={per_k.index[0]} but {float(per_k.iloc[-1]):.0%} at K={per_k.index[-1]}")
    return sent + ".", claim


def _mean_gap_to(rows: pd.DataFrame, ref: pd.DataFrame) -> tuple[float, int]:
    """Mean |estimate − the reference's estimate| at the same critic and true MI; (gap, settings)."""
    m = rows.merge(ref[["critic", "true_mi", "estimate"]], on=["critic", "true_mi"], suffixes=("", "_ref"))
    return (float((m["estimate"] - m["estimate_ref"]).abs().mean()) if len(m) else math.nan), len(m)


def _eqco_verdict(n_small: int, gap_eq: float, gap_nce: float, above: int, over: int, overest: int) -> str:
    if n_small and np.isfinite(gap_nce):
        if gap_eq < 0.5 * gap_nce:
            return "supported" if overest == 0 else (
                "partly: closer to InfoNCE with alpha negatives than plain InfoNCE is, but it overshoots the true "
                "MI where K << alpha (not a lower bound)")
        return "not supported: EqCo with K negatives did not read like InfoNCE with alpha negatives"
    if over:
        if above >= over / 2:
            return ("supported (exceeds log(K+1))" if overest == 0 else
                    "partly: exceeds log(K+1) but overshoots the true MI")
        return "not supported"
    return "not tested (no InfoNCE run at K = alpha and no true MI above log(K+1))"


def eqco_equivalence(a: pd.DataFrame) -> Claim:
    """K negatives rescaled by alpha/K act like alpha negatives: the bound is log(alpha+1), not log(K+1)."""
    eq = _learned(a, "eqco")
    if eq.empty:
        return None
    alpha = float(eq["alpha"].dropna().iloc[0]) if eq["alpha"].notna().any() else math.nan
    over = eq[eq["true_mi"] > eq["log_k1"]]
    above = over[over["estimate"] > over["log_k1"]]
    overest = eq[eq["estimate"] > eq["true_mi"] + 2 * eq["std"]]
    worst = eq.loc[eq["bias"].idxmax()]
    # the equivalence: EqCo at K < alpha against InfoNCE actually run with K = alpha
    nce = _learned(a, "infonce")
    ref = nce[nce["K"] == alpha]
    gap_eq, n_small = _mean_gap_to(eq[eq["K"] < alpha], ref)
    gap_nce, _ = _mean_gap_to(nce[nce["K"] < alpha], ref)
    worst_text = f"worst {signed(float(worst['bias']), 2)} nats at K={worst['K']}, true MI {short(worst['true_mi'])}"
    measured = (f"above log(K+1) in {len(above)} of {len(over)} settings with true MI above it; "
                f"overestimated the true MI by > 2 sd in {len(overest)} of {len(eq)} settings ({worst_text})")
    if n_small:
        measured += (f"; mean |EqCo(K) - InfoNCE(K = alpha)| = {num(gap_eq, 2)} nats over {n_small} settings "
                     f"with K < alpha, against {num(gap_nce, 2)} for plain InfoNCE(K)")
    claim = {"claim": f"K negatives rescaled by alpha/K act like alpha negatives: the MI bound is "
                      f"log(alpha+1) (alpha = {short(alpha)}) at every K, not log(K+1)",
             "source": "Zhu et al. 2020 (EqCo)", "measured": measured,
             "verdict": _eqco_verdict(n_small, gap_eq, gap_nce, len(above), len(over), len(overest))}
    sent = (f"MI toy, EqCo (alpha = {short(alpha)}): above the InfoNCE ceiling log(K+1) in {len(above)} of "
            f"{len(over)} settings whose true MI exceeds it")
    if n_small:
        sent += (f"; {num(gap_eq, 2)} nats from InfoNCE run with K = alpha on average (plain InfoNCE at the "
                 f"same K: {num(gap_nce, 2)})")
    sent += f"; above the true MI itself (by > 2 sd) in {len(overest)} of {len(eq)} settings"
    sent += (f" ({worst_text}), so with alpha > K its readout is not a lower bound." if len(overest) else
             ", i.e. it behaved as a lower bound here.")
    return sent, claim


def flatnce_logk(a: pd.DataFrame) -> Claim:
    """FlatNCE breaks the log-K curse (its estimate is not capped by log(K+1))."""
    fl = _learned(a, "flatnce")
    if fl.empty:
        return None
    ratio = float((fl["estimate"] / fl["log_k1"]).max())
    collapsed = fl[fl["estimate"] < 0]
    coll_over = collapsed[collapsed["true_mi"] > collapsed["log_k1"]]
    over = fl[fl["true_mi"] > fl["log_k1"]]
    dual_above = over[over["dual_estimate"] > over["log_k1"]]
    dual_err = float((dual_above["dual_estimate"] - dual_above["true_mi"]).abs().median()) if len(dual_above) \
        else math.nan
    merged = fl.merge(_learned(a, "infonce"), on=["critic", "K", "true_mi"], suffixes=("", "_nce"))
    fine = merged[merged["estimate"] >= 0]
    diff = float((fine["estimate"] - fine["estimate_nce"]).mean()) if len(fine) else math.nan
    measured = (f"readout (InfoNCE bound of the FlatNCE critic) / log(K+1) at most {ratio:.2f}; "
                f"readout below 0 (critic scores blew up) in {len(collapsed)} of {len(fl)} settings "
                f"({len(coll_over)} with true MI above log(K+1)); elsewhere {signed(diff, 2)} nats vs InfoNCE "
                f"on average; dual readout above log(K+1) in {len(dual_above)} of {len(over)} settings "
                f"with true MI above it" + (f", but a median {num(dual_err, 2)} nats away from the true MI there"
                                            if len(dual_above) else ""))
    verdict = ("supported (an estimate exceeded log(K+1))" if ratio > 1 + 1e-6 else
               "not supported by its own readout (capped at log(K+1) by construction)"
               + ("; the dual readout does exceed log(K+1), but it is not a lower bound" if len(dual_above) else ""))
    claim = {"claim": "FlatNCE breaks the log-K curse (its estimate is not capped by log(K+1))",
             "source": "Chen et al. 2021 (FlatNCE); readout as in the authors' code",
             "measured": measured, "verdict": verdict}
    sent = (f"MI toy, FlatNCE: its MI readout (the authors' InfoNCE bound) stayed ≤ log(K+1) (at most "
            f"{ratio:.2f} of it), so it did not break the log-K ceiling; the critic's scores blew up (readout "
            f"below 0, worse than a constant critic) in {len(collapsed)} of {len(fl)} settings, "
            f"{len(coll_over)} of them with true MI above log(K+1)")
    if np.isfinite(diff):
        sent += f"; elsewhere it read {signed(diff, 2)} nats relative to InfoNCE on average"
    return sent + ".", claim


def oracle_share(a: pd.DataFrame) -> Claim:
    """The bound's own bias (oracle critic) against the learned critics' training deficit; no claim row."""
    orc = a[(a["critic"] == "oracle") & (a["estimator"] == "infonce")]
    nce = _learned(a, "infonce")
    if orc.empty or nce.empty:
        return None
    gaps = []
    for critic, g in nce.groupby("critic", sort=False):
        m = g.merge(orc, on=["K", "true_mi"], suffixes=("", "_o"))
        if len(m):
            gap = float((m["estimate"] - m["estimate_o"]).mean())
            gaps.append(f"{CRITIC_NAMES.get(critic, critic)} {signed(gap, 2)}")
    big = orc.sort_values(["K", "true_mi"], ascending=[False, False]).iloc[0]
    return (f"MI toy, oracle critic (the true log density ratio): InfoNCE still reads "
            f"{num(big['estimate'], 2)} for a true {short(big['true_mi'])} nats at K={big['K']} (the bound's "
            f"own bias); the learned critics differ from the oracle by {', '.join(gaps)} nats on "
            f"average (the learned critics' share of the bias).", None)


CLAIMS = (infonce_cap, eqco_equivalence, flatnce_logk, oracle_share)


def mi_findings(a: pd.DataFrame) -> tuple[list[str], pd.DataFrame]:
    """Plain-words findings and the claims table (claim, source, measured, verdict), from the aggregate."""
    results = [r for r in (claim(a) for claim in CLAIMS) if r is not None]
    return ([sent for sent, _ in results],
            pd.DataFrame([row for _, row in results if row is not None], columns=CLAIM_COLUMNS))
