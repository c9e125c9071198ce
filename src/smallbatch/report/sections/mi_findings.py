"""The papers' claims about MI bounds, read from the MI toy (one function per claim).

Each claim function takes the aggregate of :func:`.mi.aggregate_mi` (means over the
seeds that did not fail) and the per-run frame of :func:`.mi.mi_frame` (one row per
seed, ``failed`` marking setup failures) and returns ``(finding, claim row)``: a
plain-words sentence for index.md and a row of the claims table (claim, source,
measured, verdict), or ``None`` where the store has no runs for it.  Every number is
computed from the runs; a verdict says "supported" / "not supported" only when the
95 % seed interval of the measured contrast excludes 0, and "within noise" otherwise,
so every claim can fail.  Failed runs (:func:`smallbatch.mi.toy.failed`) are counted as
failures of the setup, never used as measurements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from ...mi.names import CRITICS
from .. import evidence
from ..fmt import num, short, signed

#: an estimate at least this fraction of its ceiling counts as saturated
SATURATION = 0.9
CRITIC_NAMES = {"separable": "separable", "concat": "concatenated", "oracle": "oracle"}
CLAIM_COLUMNS = ["claim", "source", "measured", "verdict"]
Claim = tuple[str, dict | None] | None


# --------------------------------------------------------------------------- seed intervals
def seed_interval(values: Iterable[float]) -> tuple[float, float, float, int]:
    """``(mean, lo, hi, n)``: the mean over seeds and its two-sided 95 % Student-t interval
    (:func:`.evidence.t_interval`, ``mean ± t_{0.975, n-1} · sd / sqrt(n)``); lo/hi are NaN
    with fewer than two finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    lo, hi = evidence.t_interval(mean, float(v.std(ddof=1)) / math.sqrt(n), n - 1)
    return mean, lo, hi, n


def _sign(e: evidence.Estimate | None) -> int | None:
    """+1 / -1 when the difference is significant (its interval above / below 0), 0 when
    within noise, None when untested."""
    if e is None or not e.tested:
        return None
    return 0 if not e.significant else (1 if e.diff > 0 else -1)


# --------------------------------------------------------------------------- shared pieces
def _learned(a: pd.DataFrame, estimator: str) -> pd.DataFrame:
    return a[(a["critic"] != "oracle") & (a["estimator"] == estimator)]


def _first_learned_critic(df: pd.DataFrame) -> str | None:
    learned = [c for c in CRITICS if c != "oracle" and c in set(df["critic"])]
    return learned[0] if learned else None


def _per_seed(df: pd.DataFrame, mask: pd.Series, column: str) -> dict:
    """``{seed: mean of column}`` over the runs in ``mask``, only for seeds none of whose runs failed."""
    sub = df[mask]
    bad = set(sub.loc[sub["failed"], "seed"])
    ok = sub[~sub["seed"].isin(bad)]
    return {s: float(g[column].mean()) for s, g in ok.groupby("seed") if g[column].notna().all()}


# --------------------------------------------------------------------------- claims
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


def _saturated(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["estimate"] >= SATURATION * df["log_k1"]]


def infonce_cap(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """InfoNCE's estimate log(K+1) - L cannot exceed log(K+1), so it saturates when the true MI is larger."""
    nce = _learned(a, "infonce").dropna(subset=["estimate"])
    if nce.empty:
        return None
    ratio = float((nce["estimate"] / nce["log_k1"]).max())
    over = nce[nce["true_mi"] > nce["log_k1"]]
    orc = a[(a["critic"] == "oracle") & (a["estimator"] == "infonce")]
    orc_over = orc[orc["true_mi"] > orc["log_k1"]]
    top = over[over["true_mi"] == over["true_mi"].max()] if len(over) else over
    per_k = top.groupby("K")["estimate"].mean() / top.groupby("K")["log_k1"].first() if len(top) else None
    measured = (
        f"largest estimate / log(K+1) = {ratio:.3f}; {len(_saturated(over))} of {len(over)} settings with "
        f"true MI above log(K+1) came within {100 * (1 - SATURATION):.0f}% of it"
    )
    if len(orc_over):
        measured += f" (oracle critic: {len(_saturated(orc_over))} of {len(orc_over)})"
    if per_k is not None and len(per_k):
        measured += (
            f"; at true MI {short(top['true_mi'].iloc[0])} the estimate reached "
            + ", ".join(f"{v:.0%} (K={k})" for k, v in per_k.items())
            + " of log(K+1)"
        )
    claim = {
        "claim": "InfoNCE's estimate log(K+1) - L cannot exceed log(K+1), so it saturates when the true MI is larger",
        "source": "van den Oord et al. 2018; Poole et al. 2019 (motivation of EqCo, FlatNCE)",
        "measured": measured,
        "verdict": _infonce_verdict(ratio, over, per_k, orc_over),
    }
    sent = f"MI toy, InfoNCE: never above log(K+1) (largest estimate/ceiling {ratio:.3f})"
    ex = over.sort_values(["K", "true_mi"], ascending=[True, False], kind="stable").iloc[0] if len(over) else None
    if ex is not None:
        sent += (
            f"; where the true MI exceeds log(K+1) it stays capped, e.g. {num(ex['estimate'], 2)} nats at "
            f"K={ex['K']} for a true {short(ex['true_mi'])} (ceiling {num(ex['log_k1'], 2)})"
        )
    if per_k is not None and len(per_k) > 1:
        first, last = float(per_k.iloc[0]), float(per_k.iloc[-1])
        sent += (
            f"; at true MI {short(top['true_mi'].iloc[0])} it reached {first:.0%} of log(K+1) at "
            f"K={per_k.index[0]} and {last:.0%} at K={per_k.index[-1]}"
        )
    return sent + ".", claim


def _mean_gap_to(rows: pd.DataFrame, ref: pd.DataFrame) -> tuple[float, int]:
    """Mean |estimate − the reference's estimate| at the same critic and true MI; (gap, settings)."""
    m = rows.merge(ref[["critic", "true_mi", "estimate"]], on=["critic", "true_mi"], suffixes=("", "_ref"))
    return (float((m["estimate"] - m["estimate_ref"]).abs().mean()) if len(m) else math.nan), len(m)


def _eqco_verdict(n_small: int, gap_eq: float, gap_nce: float, above: int, over: int, overest: int) -> str:
    if n_small and np.isfinite(gap_nce):
        if gap_eq < 0.5 * gap_nce:
            return (
                "supported"
                if overest == 0
                else (
                    "partly: closer to InfoNCE with alpha negatives than plain InfoNCE is, but it overshoots the true "
                    "MI where K << alpha (not a lower bound)"
                )
            )
        return "not supported: EqCo with K negatives did not read like InfoNCE with alpha negatives"
    if over:
        if above >= over / 2:
            return (
                "supported (exceeds log(K+1))"
                if overest == 0
                else "partly: exceeds log(K+1) but overshoots the true MI"
            )
        return "not supported"
    return "not tested (no InfoNCE run at K = alpha and no true MI above log(K+1))"


def eqco_equivalence(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """K negatives rescaled by alpha/K act like alpha negatives: the bound is log(alpha+1), not log(K+1)."""
    eq = _learned(a, "eqco").dropna(subset=["estimate"])
    if eq.empty:
        return None
    alpha = float(eq["alpha"].dropna().iloc[0]) if eq["alpha"].notna().any() else math.nan
    over = eq[eq["true_mi"] > eq["log_k1"]]
    above = over[over["estimate"] > over["log_k1"]]
    overest = eq[eq["estimate"] > eq["true_mi"] + 2 * eq["std"]]
    worst = eq.loc[eq["bias"].idxmax()]
    nce = _learned(a, "infonce").dropna(subset=["estimate"])
    ref = nce[nce["K"] == alpha]
    gap_eq, n_small = _mean_gap_to(eq[eq["K"] < alpha], ref)
    gap_nce, _ = _mean_gap_to(nce[nce["K"] < alpha], ref)
    worst_text = f"worst {signed(float(worst['bias']), 2)} nats at K={worst['K']}, true MI {short(worst['true_mi'])}"
    measured = (
        f"above log(K+1) in {len(above)} of {len(over)} settings with true MI above it; "
        f"overestimated the true MI by > 2 sd in {len(overest)} of {len(eq)} settings ({worst_text})"
    )
    if n_small:
        measured += (
            f"; mean |EqCo(K) - InfoNCE(K = alpha)| = {num(gap_eq, 2)} nats over {n_small} settings "
            f"with K < alpha, against {num(gap_nce, 2)} for plain InfoNCE(K)"
        )
    claim = {
        "claim": f"K negatives rescaled by alpha/K act like alpha negatives: the MI bound is "
        f"log(alpha+1) (alpha = {short(alpha)}) at every K, not log(K+1)",
        "source": "Zhu et al. 2020 (EqCo)",
        "measured": measured,
        "verdict": _eqco_verdict(n_small, gap_eq, gap_nce, len(above), len(over), len(overest)),
    }
    sent = (
        f"MI toy, EqCo (alpha = {short(alpha)}): above the InfoNCE ceiling log(K+1) in {len(above)} of "
        f"{len(over)} settings whose true MI exceeds it"
    )
    if n_small:
        sent += (
            f"; {num(gap_eq, 2)} nats from InfoNCE run with K = alpha on average (plain InfoNCE at the "
            f"same K: {num(gap_nce, 2)})"
        )
    sent += f"; above the true MI itself (by > 2 sd) in {len(overest)} of {len(eq)} settings"
    sent += (
        f" ({worst_text}), so with alpha > K its readout is not a lower bound."
        if len(overest)
        else ", i.e. it behaved as a lower bound here."
    )
    return sent, claim


def _small_k_verdict(delta: evidence.Estimate, curse: evidence.Estimate | None) -> str:
    sign, curse_sign = _sign(delta), _sign(curse)
    if sign is None:
        return "not tested (fewer than two seeds without a setup failure)"
    if sign > 0:
        return "supported: trained with few negatives, the FlatNCE critic is the better one"
    if sign < 0:
        return "not supported: trained with few negatives, the FlatNCE critic is the worse one"
    if curse_sign == 1:
        return (
            "neither supported nor refuted: small-K training costs InfoNCE's critic, but FlatNCE's critic "
            "is within noise of it"
        )
    return "neither supported nor refuted (within noise)"


def flatnce_small_k(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """FlatNCE breaks the log-K curse of small-batch training: with few negatives (small K) its
    critic ends up better than InfoNCE's, read by both critics' InfoNCE bound at ``eval_k``.

    Contrasts, each paired by seed (same initial critic and data stream for both losses) with
    Holm over the three: FlatNCE − InfoNCE at the smallest K (the claim), and for scale the
    change of InfoNCE's and of FlatNCE's readout from the smallest to the largest training K."""
    if df.empty or "estimate_eval_k" not in df or not (df["estimator"] == "flatnce").any():
        return None
    critic = _first_learned_critic(df)
    if critic is None:
        return None
    d = df[df["critic"] == critic]
    kmin, kmax = int(d["K"].min()), int(d["K"].max())
    eval_k = int(d["eval_k"].dropna().iloc[0]) if d["eval_k"].notna().any() else kmax
    curse_mis = sorted(v for v in d["true_mi"].unique() if v > math.log(kmin + 1)) or sorted(d["true_mi"].unique())
    in_mi = d["true_mi"].isin(curse_mis)

    def arm(est: str, k: int) -> dict:
        return _per_seed(d, in_mi & (d["estimator"] == est) & (d["K"] == k), "estimate_eval_k")

    if not arm("flatnce", kmin) or not arm("infonce", kmin):
        return (
            "MI toy, FlatNCE against the log-K curse: not tested (no run has the InfoNCE readout at "
            "eval_k, or every seed had a setup failure).",
            None,
        )

    def one_mi(est: str, mi: float) -> dict:
        return _per_seed(d, (d["true_mi"] == mi) & (d["estimator"] == est) & (d["K"] == kmin), "estimate_eval_k")

    pairs = [(arm("flatnce", kmin), arm("infonce", kmin))]
    if kmax > kmin:
        pairs += [(arm("infonce", kmax), arm("infonce", kmin)), (arm("flatnce", kmax), arm("flatnce", kmin))]
    pairs += [(one_mi("flatnce", mi), one_mi("infonce", mi)) for mi in curse_mis] if len(curse_mis) > 1 else []
    ests = evidence.holm([evidence.paired(x, y) for x, y in pairs])
    delta, curse = ests[0], (ests[1] if kmax > kmin else None)
    mis = ", ".join(short(v) for v in curse_mis)
    measured = (
        f"critics trained with K={kmin} negatives, read by the InfoNCE bound with {eval_k} negatives, "
        f"nats (mean over true MI {mis}, {CRITIC_NAMES.get(critic, critic)} critic): "
        f"{evidence.describe(delta, 'FlatNCE − InfoNCE', 2)}"
    )
    if len(curse_mis) > 1:
        measured += "; by true MI: " + ", ".join(
            evidence.describe(e, short(mi), 2) for mi, e in zip(curse_mis, ests[len(ests) - len(curse_mis) :])
        )
    if kmax > kmin:
        measured += (
            f"; training with K={kmax} instead of {kmin} changes this readout by "
            f"{evidence.describe(ests[1], 'InfoNCE', 2)}, {evidence.describe(ests[2], 'FlatNCE', 2)}"
        )
    claim = {
        "claim": "FlatNCE breaks the log-K curse: contrastive learners trained with few negatives fail, "
        "FlatNCE fixes this (its critic learnt with small K is better than InfoNCE's)",
        "source": "Chen et al. 2021 (FlatNCE); tested on what the critic learnt, read at a common K",
        "measured": measured,
        "verdict": _small_k_verdict(delta, curse),
    }
    sent = (
        f"MI toy, FlatNCE against the log-K curse, in nats: critics trained with K={kmin} and read by the "
        f"InfoNCE bound with {eval_k} negatives (mean over true MI {mis}): "
        f"{evidence.describe(delta, 'FlatNCE − InfoNCE', 2)}"
    )
    if kmax > kmin:
        sent += f"; for scale, training InfoNCE with K={kmax} instead changes it by {evidence.describe(curse, '', 2)}"
    return sent + f" — {claim['verdict']}.", claim


def flatnce_dual(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """FlatNCE's own loss value read as MI, ``log K - mean logsumexp_j(s_j - s_+)``, is not capped by
    log(K+1); is it an estimate of the MI there (between log(K+1) and the true MI)?"""
    fl = _learned(a, "flatnce").dropna(subset=["dual_estimate"])
    if fl.empty or df.empty:
        return None
    over = fl[fl["true_mi"] > fl["log_k1"]]
    ratio = float((fl["estimate"] / fl["log_k1"]).max())
    if over.empty:
        return None
    d = df[(df["estimator"] == "flatnce") & (df["critic"] != "oracle") & (df["true_mi"] > np.log(df["K"] + 1))]
    gap = evidence.contrast(
        [(1.0, {s: float((g["dual_estimate"] - g["true_mi"]).mean()) for s, g in d[~d["failed"]].groupby("seed")})]
    )
    above = int((over["dual_estimate"] > over["log_k1"]).sum())
    measured = (
        f"dual readout above log(K+1) in {above} of {len(over)} settings with true MI above it; dual − "
        f"true MI there {evidence.describe(gap, '', 2)}; the authors' readout (the InfoNCE bound of the FlatNCE "
        f"critic) is capped at log(K+1) by construction (at most {ratio:.2f} of it), so it cannot test this"
    )
    sign = _sign(gap)
    verdict = (
        "not tested (fewer than two seeds)"
        if sign is None
        else "not an MI estimate: the dual reads above the true MI (no lower bound)"
        if sign > 0
        else "supported: above log(K+1) and below the true MI"
        if sign < 0 and above >= len(over) / 2
        else "not supported: mostly at or below log(K+1)"
        if sign < 0
        else "neither supported nor refuted (within noise of the true MI)"
    )
    claim = {
        "claim": "FlatNCE's objective, read as an MI estimate (log K − L_FlatNCE), is not capped by log(K+1)",
        "source": "Chen et al. 2021 (FlatNCE); the FLO bound of Guo et al. 2021 at its self-normalised optimum",
        "measured": measured,
        "verdict": verdict,
    }
    sent = (
        f"MI toy, FlatNCE's loss read as MI (log K − L): above log(K+1) in {above} of {len(over)} settings "
        f"whose true MI exceeds it; dual − true MI = {evidence.describe(gap, '', 2)} nats there — {verdict}."
    )
    return sent, claim


def setup_failures(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """How many learned-critic runs failed (non-finite loss, or readout below 0); no claim row."""
    learned = df[df["critic"] != "oracle"] if len(df) else df
    if learned.empty:
        return None
    n_bad = int(learned["failed"].sum())
    if n_bad == 0:
        return (
            f"MI toy: no setup failure in {len(learned)} learned-critic runs (every training loss finite, "
            "no critic's scores blew up).",
            None,
        )
    by = learned[learned["failed"]].groupby("estimator").size()
    parts = ", ".join(f"{k}: {v} of {int((learned['estimator'] == k).sum())}" for k, v in by.items())
    return (
        f"MI toy: {n_bad} of {len(learned)} learned-critic runs were setup failures ({parts}; a non-finite "
        "loss, or an unbounded critic whose scores blew up); they are left out of every estimate and "
        "finding, and marked in the table and figure.",
        None,
    )


def oracle_share(a: pd.DataFrame, df: pd.DataFrame) -> Claim:
    """The bound's own bias (oracle critic) against the learned critics' training deficit; no claim row."""
    orc = a[(a["critic"] == "oracle") & (a["estimator"] == "infonce")].dropna(subset=["estimate"])
    nce = _learned(a, "infonce").dropna(subset=["estimate"])
    if orc.empty or nce.empty:
        return None
    gaps = []
    for critic, g in nce.groupby("critic", sort=False):
        m = g.merge(orc, on=["K", "true_mi"], suffixes=("", "_o"))
        if len(m):
            gap = float((m["estimate"] - m["estimate_o"]).mean())
            word = "below" if gap < 0 else "above"
            gaps.append(f"the {CRITIC_NAMES.get(critic, critic)} critic reads {num(abs(gap), 2)} nats {word} it")
    big = orc.sort_values(["K", "true_mi"], ascending=[False, False]).iloc[0]
    return (
        f"MI toy, oracle critic (the true log density ratio): InfoNCE still reads "
        f"{num(big['estimate'], 2)} for a true {short(big['true_mi'])} nats at K={big['K']} (the bound's "
        f"own bias); on average {', '.join(gaps)} (the learned critic's share of the bias).",
        None,
    )


CLAIMS = (infonce_cap, eqco_equivalence, flatnce_small_k, flatnce_dual, setup_failures, oracle_share)


def mi_findings(a: pd.DataFrame, df: pd.DataFrame) -> tuple[list[str], pd.DataFrame]:
    """Plain-words findings and the claims table (claim, source, measured, verdict), from the
    aggregate ``a`` and the per-run frame ``df``."""
    results = [r for r in (claim(a, df) for claim in CLAIMS) if r is not None]
    return (
        [sent for sent, _ in results],
        pd.DataFrame([row for _, row in results if row is not None], columns=CLAIM_COLUMNS),
    )
