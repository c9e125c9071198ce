"""The regime experiment's numbers and claims: where InfoNCE's small-batch penalty lives
(batch size x training length x optimiser regime), and whether DCL's gradient-scale
mechanism reaches the update.

The tables' numbers:

* :func:`gap_summary` -- per setting (dataset, τ, regime, epochs), metric and loss:
  top-1 at the smallest and the largest batch, the gap small − large with its
  95 % paired-t interval over seeds and its p, Holm-adjusted over the settings of
  one loss (:mod:`.evidence`), and a verdict (:data:`PENALTY` when the small
  batch is significantly behind);
* :func:`ratio_summary` -- the logged ``‖∇InfoNCE‖/‖∇DCL‖`` against ``q_B`` per
  (regime, batch size, loss);
* :func:`update_summary` -- the update size per unit lr of InfoNCE vs DCL per
  (regime, batch size, epochs): their ratio, tested against 1 (the scale divided
  out) and against ``q_B`` (the scale passed on) on the log scale, paired by seed.

The findings, one function per claim: :func:`penalty_finding` (where the penalty
appears), :func:`dcl_finding` (whether DCL removes it there), :func:`ratio_finding`
and :func:`update_finding` (whether the mechanism shows), :func:`length_finding`
(SimCLR's claim that the gap shrinks with training length).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from ...losses.registry import loss_rank
from ..evidence import Estimate, contrast, describe, holm, support
from ..fmt import finite, join, num, short, signed
from ..runs import METRIC_LABELS
from .sweep import sweep_summary

#: what defines a regime cell besides loss and batch size (optimizer and lr_scaling follow from regime)
SETTING = ["dataset", "temperature", "regime", "optimizer", "lr_scaling", "epochs"]
#: verdicts of a small − large gap
PENALTY, AHEAD, WITHIN, NO_SE, NO_NUMBER, ONE_B = (
    "penalty",
    "small batch ahead",
    "within noise",
    "untested",
    "no number",
    "one batch size",
)
#: verdicts of an update-size ratio
FOLLOWS, CANCELS, BOTH, NEITHER = (
    "follows q_B",
    "≈ 1, scale divided out",
    "q_B and 1 within noise",
    "neither q_B nor 1",
)
#: each anchor's InfoNCE gradient is its DCL gradient times its own q, and an embedding collects gradients from
#: many anchors, so the logged norm ratio equals the batch's mean q_B only when every anchor has the same q; it
#: is said to track q_B when its mean is within this relative distance of the mean q_B
TRACK_TOL = 0.10
#: Spearman's rank correlation over the cells from which the ratio is said to rise with q_B (in order, if not in value)
RANK_FOLLOWS = 0.8
#: what each optimiser does to a global scale of the gradient: the predicted verdict (None: no clean
#: prediction) and why; the update sizes test it
EXPECTED = {
    "sgd": (FOLLOWS, "SGD applies the gradient as it is"),
    "adam": (CANCELS, "Adam divides each parameter's step by its gradient's RMS"),
    "lars": (
        None,
        "LARS divides each weight tensor's step by its gradient's norm (trust ratio) but applies "
        "the gradients of biases and normalisation parameters as they are",
    ),
}
_DCL_CLAIM = "DCL's claim that removing the coupling factor q_B removes InfoNCE's small-batch penalty"
_LENGTH_CLAIM = "SimCLR's claim that the small-batch gap shrinks with training length"
_TEST_COLUMNS = ["gap_ci_low", "gap_ci_high", "gap_p_holm", "gap_mde_80"]
_GAP_COLUMNS = [
    "batch_size_min",
    "batch_size_max",
    "mean_small",
    "std_small",
    "n_small",
    "state_small",
    "mean_large",
    "std_large",
    "n_large",
    "state_large",
]


# --------------------------------------------------------------------------- order and words
def regime_order(regimes: Iterable, optimizers: Iterable) -> list[str]:
    """Regimes with Adam first (the default study's optimiser), then by name."""
    opt = dict(zip((str(r) for r in regimes), (str(o) for o in optimizers)))
    return sorted(opt, key=lambda r: (opt[r] != "adam", r))


def regime_text(r: pd.Series) -> str:
    """``sgd_linear (sgd, lr scaling linear)``."""
    return f"{r['regime']} ({r['optimizer']}, lr scaling {r['lr_scaling']})"


def gap_text(r: pd.Series) -> str:
    """``-6.0 [-7.4, -4.6]`` (gap and its 95 % interval), ``+0.5 (untested)``, the cells' states, or
    ``— (only B=16)``."""
    g = r["gap_small_minus_large"]
    if r["verdict"] == ONE_B:
        return f"— (only B={int(r['batch_size_min'])})"
    if not finite(g):
        return f"— (B={int(r['batch_size_min'])}: {r['state_small']}, B={int(r['batch_size_max'])}: {r['state_large']})"
    return (
        f"{signed(g)} [{signed(r['gap_ci_low'])}, {signed(r['gap_ci_high'])}]"
        if finite(r["gap_ci_low"])
        else f"{signed(g)} (untested)"
    )


def _span(values: Iterable[float], nd: int = 2) -> str:
    v = [float(x) for x in values if finite(x)]
    if not v:
        return "—"
    lo, hi = num(min(v), nd), num(max(v), nd)
    return lo if lo == hi else f"{lo}–{hi}"


# --------------------------------------------------------------------------- gaps
def _mde_clause(tested: pd.DataFrame) -> str:
    m = [float(x) for x in tested.get("gap_mde_80", pd.Series(dtype=float)) if finite(x)]
    return f"; MDE at 80 % power {_span(m, 1)} points" if m else ""


def gap_verdict(e: Estimate) -> str:
    """PENALTY / AHEAD when significant (Holm-adjusted), WITHIN noise, NO_SE (untested), or NO_NUMBER."""
    if not finite(e.diff):
        return NO_NUMBER
    if not e.tested:
        return NO_SE
    return WITHIN if e.within_noise else (PENALTY if e.diff < 0 else AHEAD)


def gap_summary(agg: pd.DataFrame) -> pd.DataFrame:
    """Per setting × metric × loss: top-1 at the smallest and the largest batch (mean, sd, seeds, state),
    ``gap_small_minus_large`` with ``gap_ci_low``/``gap_ci_high``, ``gap_p_holm`` (Holm over the settings of
    one dataset, τ, metric and loss) and ``verdict``; regimes Adam first, epochs ascending."""
    keys = [*SETTING, "metric", "loss", "label"]
    s = sweep_summary(agg, SETTING, "batch_size")
    if s.empty:
        return pd.DataFrame(columns=[*keys, *_GAP_COLUMNS, "gap_small_minus_large", *_TEST_COLUMNS, "verdict"])
    s = s[[*keys, *_GAP_COLUMNS, "values_small", "values_large"]].copy()
    one = s["batch_size_min"] == s["batch_size_max"]
    s["gap_small_minus_large"] = (s["mean_small"] - s["mean_large"]).where(~one)
    est = pd.Series(
        [
            Estimate(diff=math.nan) if o else contrast([(1.0, a), (-1.0, b)])
            for o, a, b in zip(one, s["values_small"], s["values_large"])
        ],
        index=s.index,
        dtype=object,
    )
    for _, g in s.groupby(["dataset", "temperature", "metric", "loss", "label"], sort=False):
        est[g.index] = pd.Series(holm(est[g.index]), index=g.index, dtype=object)
    s["gap_ci_low"], s["gap_ci_high"] = [e.lo for e in est], [e.hi for e in est]
    s["gap_p_holm"], s["gap_mde_80"], s["estimate"] = [e.p_adj for e in est], [e.mde for e in est], est
    s["verdict"] = [ONE_B if o else gap_verdict(e) for o, e in zip(one, est)]
    rank = {r: i for i, r in enumerate(regime_order(s["regime"], s["optimizer"]))}
    s = s.assign(_r=s["regime"].map(rank), _l=s["loss"].map(loss_rank))
    s = s.sort_values(["dataset", "temperature", "metric", "_l", "label", "_r", "epochs"], kind="stable")
    return s.drop(columns=["_r", "_l"]).reset_index(drop=True)


def _rows(gap: pd.DataFrame, ds: str, t: float, m: str, loss: str) -> pd.DataFrame:
    return gap[(gap["dataset"] == ds) & (gap["temperature"] == t) & (gap["metric"] == m) & (gap["loss"] == loss)]


def _head(gap: pd.DataFrame, ds: str, t: float, m: str) -> str:
    d = gap[(gap["dataset"] == ds) & (gap["temperature"] == t) & (gap["metric"] == m)]
    return (
        f"Regime experiment on {ds} (τ={short(t)}, {METRIC_LABELS.get(m, m)}; gap = top-1 at "
        f"B={int(d['batch_size_min'].min())} − at B={int(d['batch_size_max'].max())} [95 % paired-t interval over "
        "seeds], points; a penalty is a gap below zero with Holm-adjusted p < 0.05 over the loss's settings):"
    )


def penalty_finding(gap: pd.DataFrame, ds: str, t: float, m: str) -> str:
    """(i) In which regime and at which training length InfoNCE's small batch is significantly behind."""
    d = _rows(gap, ds, t, m, "infonce")
    head = _head(gap, ds, t, m) + " where does InfoNCE's small-batch penalty appear?"
    if d.empty:
        return f"{head} InfoNCE was not run."
    pen = d[d["verdict"] == PENALTY]
    tested = d[d["verdict"].isin([PENALTY, AHEAD, WITHIN])]
    untested = d[~d.index.isin(tested.index)]
    if pen.empty:
        gaps = _span(tested["gap_small_minus_large"], 1)
        s = [
            f"{head} Nowhere on this data: in none of the {len(tested)} tested regime × training-length settings "
            f"is InfoNCE's small batch significantly behind (gaps {gaps}){_mde_clause(tested)}."
            if len(tested)
            else f"{head} It cannot be told: no setting has a gap with an error estimate."
        ]
    else:
        where = "; ".join(
            f"under {regime_text(r)} at {short(r['epochs'])} epochs ({gap_text(r)})" for _, r in pen.iterrows()
        )
        s = [f"{head} It appears {where}; in the other {len(tested) - len(pen)} tested settings it does not."]
    if len(untested):
        s.append(
            f"Not tested ({len(untested)}): "
            + "; ".join(
                f"{r['regime']} at {short(r['epochs'])} epochs ({r['verdict']})" for _, r in untested.iterrows()
            )
            + "."
        )
    return " ".join(s)


def _dcl_versus(i: pd.Series, dr: pd.Series) -> str:
    """DCL's gap and DCL − InfoNCE at the smallest batch in one setting where InfoNCE has the penalty."""
    where = f"Under {i['regime']} at {short(i['epochs'])} epochs"
    e = contrast([(1.0, dr["values_small"]), (-1.0, i["values_small"])])
    head = (
        f"{where} {dr['label']}'s gap is {gap_text(dr)} and {dr['label']} − InfoNCE at "
        f"B={int(i['batch_size_min'])} is {describe(e)}"
    )
    if dr["verdict"] == PENALTY:
        return f"{head}: {dr['label']} keeps a significant penalty, so {support(False, dr['estimate'], _DCL_CLAIM)}."
    if not e.tested or dr["verdict"] not in (WITHIN, AHEAD):
        return f"{head}: without numbers and error estimates at both batch sizes the claim is not tested there."
    return f"{head}: {support(e.diff > 0, e, _DCL_CLAIM)}."


def dcl_finding(gap: pd.DataFrame, ds: str, t: float, m: str) -> str:
    """(ii) Whether DCL removes InfoNCE's penalty where it appears: DCL's gap and DCL − InfoNCE at the small batch."""
    inf, dcl = _rows(gap, ds, t, m, "infonce"), _rows(gap, ds, t, m, "dcl")
    head = _head(gap, ds, t, m) + " does DCL remove InfoNCE's small-batch penalty?"
    if inf.empty or dcl.empty:
        return f"{head} It cannot be tested: {'InfoNCE' if inf.empty else 'DCL'} was not run."
    pen = inf[inf["verdict"] == PENALTY]
    own = dcl[dcl["verdict"] == PENALTY]
    own_text = (
        "DCL itself has a penalty "
        + "; ".join(f"under {r['regime']} at {short(r['epochs'])} epochs ({gap_text(r)})" for _, r in own.iterrows())
        + "."
        if len(own)
        else "DCL itself has none."
    )
    if pen.empty:
        return f"{head} InfoNCE has no significant penalty here, so there is nothing to remove; {own_text}"
    parts = []
    for _, i in pen.iterrows():
        match = dcl[(dcl["regime"] == i["regime"]) & (dcl["epochs"] == i["epochs"])]
        parts.append(
            _dcl_versus(i, match.iloc[0])
            if len(match)
            else f"DCL was not run under {i['regime']} at {short(i['epochs'])} epochs."
        )
    return " ".join([head, *parts])


def _length_verdict(d: pd.DataFrame) -> str | None:
    """SimCLR's claim in one regime, from InfoNCE's gaps at the shortest and the longest training; None when
    neither end has a penalty (nothing to shrink)."""
    lo, hi = d.iloc[0], d.iloc[-1]
    e = contrast(
        [(1.0, hi["values_small"]), (-1.0, hi["values_large"]), (-1.0, lo["values_small"]), (1.0, lo["values_large"])]
    )
    ch = f"the gap moves by {describe(e)} from {short(lo['epochs'])} to {short(hi['epochs'])} epochs"
    if not e.tested:
        return "no gap with an error estimate at both ends, so the claim is not tested there"
    if lo["verdict"] == PENALTY:
        moved = "within noise" if e.within_noise else f"the penalty {'shrinks' if e.diff > 0 else 'grows'}"
        return f"{ch}, {moved}: {support(e.diff > 0, e, _LENGTH_CLAIM)}"
    if hi["verdict"] == PENALTY:
        return (
            f"no penalty at {short(lo['epochs'])} epochs but one at {short(hi['epochs'])}: it appears with longer "
            f"training; {ch}: {support(False, e, _LENGTH_CLAIM)}"
        )
    return None


def _simclr_text(simclr: pd.DataFrame) -> str:
    if simclr.empty:
        return "SimCLR's Table B.1 is not in paper_results.csv."
    parts = []
    for rule, g in simclr.groupby("lr_scaling", sort=False):
        g = g.sort_values("epochs")
        lo, hi = g.iloc[0], g.iloc[-1]
        parts.append(
            f"{signed(lo['gap_small_minus_large'])} at {short(lo['epochs'])} → "
            f"{signed(hi['gap_small_minus_large'])} at {short(hi['epochs'])} epochs ({rule})"
        )
    r = simclr.iloc[0]
    return (
        f"{r['paper']}, {join(list(dict.fromkeys(simclr['source'])))}, on {r['dataset']} with {r['backbone']}, "
        f"reports the gap B={int(r['small_batch_size'])} vs {int(r['large_batch_size'])}: " + "; ".join(parts) + "."
    )


def length_finding(gap: pd.DataFrame, simclr: pd.DataFrame, ds: str, t: float, m: str) -> str:
    """(iv) SimCLR's claim that the gap shrinks with training length: InfoNCE's gap per epochs in each regime."""
    d = _rows(gap, ds, t, m, "infonce")
    head = _head(gap, ds, t, m) + f" {_LENGTH_CLAIM[0].upper()}{_LENGTH_CLAIM[1:]}. {_simclr_text(simclr)}"
    if d.empty:
        return f"{head} InfoNCE was not run."
    gaps, verdicts, quiet = [], [], []
    for reg in dict.fromkeys(d["regime"]):
        dr = d[d["regime"] == reg].sort_values("epochs", kind="stable")
        gaps.append(f"{reg} " + ", ".join(f"{gap_text(r)} at {short(r['epochs'])}" for _, r in dr.iterrows()))
        v = "only one training length was run" if dr["epochs"].nunique() < 2 else _length_verdict(dr)
        if v is None:
            quiet.append(reg)
        else:
            verdicts.append(f"Under {reg}: {v}.")
    s = [head, "Ours (InfoNCE, by epochs): " + "; ".join(gaps) + ".", *verdicts]
    if quiet:
        s.append(
            f"Under {join(quiet)} there is no penalty at the shortest or the longest training, so no gap to "
            "shrink: the claim is not tested there."
        )
    return " ".join(s)


# --------------------------------------------------------------------------- the mechanism
def ratio_summary(points: pd.DataFrame) -> pd.DataFrame:
    """Means of ``qb`` and ``ratio`` over the logged steps per (dataset, τ, regime, batch size, loss), pooled over
    training lengths and seeds; their relative distance ``ratio/qb − 1``; the numbers of steps and runs."""
    keys = ["dataset", "temperature", "regime", "optimizer", "lr_scaling", "batch_size", "loss", "label"]
    cols = [*keys, "qb_mean", "ratio_mean", "ratio_over_qb_minus_1", "n_points", "n_runs"]
    if points.empty:
        return pd.DataFrame(columns=cols)
    s = (
        points.groupby(keys, sort=False)
        .agg(
            qb_mean=("qb", "mean"), ratio_mean=("ratio", "mean"), n_points=("qb", "size"), n_runs=("run_id", "nunique")
        )
        .reset_index()
    )
    s["ratio_over_qb_minus_1"] = s["ratio_mean"] / s["qb_mean"] - 1.0
    rank = {r: i for i, r in enumerate(regime_order(s["regime"], s["optimizer"]))}
    s = s.assign(_r=s["regime"].map(rank), _l=s["loss"].map(loss_rank))
    s = s.sort_values(["dataset", "temperature", "_r", "batch_size", "_l", "label"], kind="stable")
    return s[cols].reset_index(drop=True)


def ratio_finding(rs: pd.DataFrame, ds: str, t: float) -> str:
    """(iii a) Whether the logged gradient ratio InfoNCE/DCL tracks q_B, within :data:`TRACK_TOL`."""
    d = rs[(rs["dataset"] == ds) & (rs["temperature"] == t)]
    head = (
        f"Gradient scale on {ds} (τ={short(t)}): DCL's mechanism makes InfoNCE's gradient DCL's times q_B, so the "
        "logged ratio ‖∇InfoNCE‖/‖∇DCL‖ (w.r.t. the step's embeddings) should track q_B."
    )
    d = d[np.isfinite(d["ratio_over_qb_minus_1"].astype(float))]
    if d.empty:
        return f"{head} Not measured: no run logged both diag/grad_ratio_infonce_dcl and diag/qb_mean."
    dev = d["ratio_over_qb_minus_1"].astype(float).abs()
    w = d.loc[dev.idxmax()]
    s = [
        f"{head} Over {len(d)} (regime, batch size, loss) cells ({int(d['n_points'].sum())} logged steps), q_B "
        f"spans {_span(d['qb_mean'])} and the mean ratio is at most {100 * dev.max():.0f}% from the mean q_B "
        f"(largest under {w['regime']} at B={int(w['batch_size'])} for {w['label']}: ratio "
        f"{num(w['ratio_mean'], 3)} vs q_B {num(w['qb_mean'], 3)})."
    ]
    if float(d["qb_mean"].min()) > 1 - TRACK_TOL:
        return " ".join(
            s
            + [f"q_B stays within {100 * TRACK_TOL:.0f}% of 1, so tracking q_B cannot be told from a ratio of 1 here."]
        )
    off = d[dev > TRACK_TOL]
    if off.empty:
        return " ".join(s + [f"The ratio tracks q_B (every cell within {100 * TRACK_TOL:.0f}%)."])
    return " ".join(
        s
        + [
            f"The ratio does not track q_B: {len(off)} of {len(d)} cells are more than {100 * TRACK_TOL:.0f}% away.",
            _ordering(d),
        ]
    )


def _ordering(d: pd.DataFrame) -> str:
    """Whether the cells' mean ratio rises with their mean q_B (Spearman's rank correlation over the cells):
    with unequal anchors the norm ratio is a gradient-weighted mean of the anchors' q, not their plain mean,
    so it can follow q_B in order while missing it in value."""
    rho = float(d["qb_mean"].rank().corr(d["ratio_mean"].rank())) if len(d) > 2 else math.nan
    if not math.isfinite(rho):
        return "Nor does it vary with q_B across the cells: the logged gradients do not show the coupling factor."
    if rho < RANK_FOLLOWS:
        return (
            f"Nor does it rise with q_B across the cells (rank correlation {num(rho, 2)}): the logged gradients "
            "do not show the coupling factor."
        )
    q = (d["ratio_mean"] / d["qb_mean"]).astype(float)
    return (
        f"But across the cells it rises with q_B (rank correlation {num(rho, 2)}), at {num(q.min(), 2)}–"
        f"{num(q.max(), 2)} times the mean q_B: the identity holds per anchor, and the norm ratio weights each "
        "anchor by its gradient, so anchors with large q count more than the plain mean gives them."
    )


def _stats(v) -> tuple[float, float, int]:
    """Mean, sample sd (NaN for one value) and count of the finite values."""
    v = pd.Series(v, dtype=float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else math.nan, float(v.std(ddof=1)) if len(v) > 1 else math.nan, len(v)


def _log(v: pd.Series) -> pd.Series:
    v = v.astype(float)
    return np.log(v.where(v > 0))


def update_verdict(one: Estimate, q: Estimate) -> str:
    """FOLLOWS q_B, CANCELS (≈ 1), BOTH within noise, NEITHER, or NO_SE: log(ratio) tested against 0 (``one``)
    and against log q_B (``q``)."""
    if not (one.tested and q.tested):
        return NO_SE
    return {(False, True): FOLLOWS, (True, False): CANCELS, (True, True): BOTH, (False, False): NEITHER}[
        (bool(one.within_noise), bool(q.within_noise))
    ]


def _by_seed(runs: pd.DataFrame, v: pd.Series) -> dict:
    """{seed: value} of the finite values (the first run of a seed; runs without a seed keyed by index)."""
    keys = runs["seed"] if "seed" in runs else pd.Series(runs.index, index=runs.index)
    out: dict = {}
    for k, x in zip(keys, v):
        if finite(x) and k not in out:
            out[k] = float(x)
    return out


def _update_row(i: pd.DataFrame, d: pd.DataFrame) -> dict:
    """InfoNCE vs DCL runs of one cell: geometric-mean update sizes, their ratio, q_B, the two tests (paired by
    seed on the log scale)."""
    li, sdi, ni = _stats(_log(i["update"]))
    ld, sdd, nd = _stats(_log(d["update"]))
    lq = _stats(_log(i["qb"]))[0]
    inf, dcl = _by_seed(i, _log(i["update"])), _by_seed(d, _log(d["update"]))
    one = contrast([(1.0, inf), (-1.0, dcl)])
    q = contrast([(1.0, inf), (-1.0, _by_seed(i, _log(i["qb"]))), (-1.0, dcl)])  # per InfoNCE run: its own q_B
    return {
        "infonce_update": math.exp(li) if finite(li) else math.nan,
        "infonce_log_sd": sdi,
        "infonce_n": ni,
        "dcl_update": math.exp(ld) if finite(ld) else math.nan,
        "dcl_log_sd": sdd,
        "dcl_n": nd,
        "ratio": math.exp(li - ld) if finite(li - ld) else math.nan,
        "log_ratio_ci_low": one.lo,
        "log_ratio_ci_high": one.hi,
        "qb": math.exp(lq) if finite(lq) else math.nan,
        "log_ratio_minus_log_qb": q.diff,
        "log_ratio_minus_log_qb_ci_low": q.lo,
        "log_ratio_minus_log_qb_ci_high": q.hi,
        "verdict": update_verdict(one, q),
    }


def update_summary(per_run: pd.DataFrame) -> pd.DataFrame:
    """InfoNCE vs DCL update size per unit lr per setting x batch size, from one row per run (columns
    ``*SETTING, batch_size, loss, update, qb``: the run's mean ``diag/update_per_lr`` and ``diag/qb_mean``).

    Sizes are geometric means over seeds; ``ratio`` = InfoNCE's / DCL's; ``qb`` = InfoNCE runs' q_B; the
    verdict tests log(ratio) against 0 and against log(q_B) (95 % paired-t intervals over seeds)."""
    keys = [*SETTING, "batch_size"]
    rows = []
    for key, g in per_run.groupby(keys, sort=False):
        i, d = g[g["loss"] == "infonce"], g[g["loss"] == "dcl"]
        if len(i) and len(d):
            rows.append({**dict(zip(keys, key)), **_update_row(i, d)})
    if not rows:
        return pd.DataFrame(columns=[*keys, "ratio", "qb", "verdict"])
    s = pd.DataFrame(rows)
    rank = {r: n for n, r in enumerate(regime_order(s["regime"], s["optimizer"]))}
    s = s.assign(_r=s["regime"].map(rank)).sort_values(
        ["dataset", "temperature", "_r", "batch_size", "epochs"], kind="stable"
    )
    return s.drop(columns="_r").reset_index(drop=True)


def _regime_update(d: pd.DataFrame) -> tuple[str, str | None]:
    """One regime at its smallest batch: the sentence part and its verdict when every budget agrees."""
    r = d.iloc[0]
    verdicts = list(dict.fromkeys(d["verdict"]))
    by = "; ".join(f"{v} at {join([short(e) for e in d.loc[d['verdict'] == v, 'epochs']])} epochs" for v in verdicts)
    return (
        f"{regime_text(r)} at B={int(r['batch_size'])}: InfoNCE/DCL {_span(d['ratio'])} against q_B "
        f"{_span(d['qb'])}, {by}",
        verdicts[0] if len(verdicts) == 1 else None,
    )


def update_finding(us: pd.DataFrame, ds: str, t: float) -> str:
    """(iii b) Whether the update size per unit lr follows q_B (the scale reaches the update) or stays ≈ 1
    (the optimiser divides it out), per regime at the smallest batch, against what each optimiser predicts."""
    d = us[(us["dataset"] == ds) & (us["temperature"] == t)]
    head = (
        f"Update size on {ds} (τ={short(t)}): if the gradient scale q_B reaches the update, InfoNCE's "
        "‖Δθ‖/lr is DCL's times about q_B at small batch; if the optimiser divides it out, about equal."
    )
    if d.empty:
        return f"{head} Not measured: no regime has InfoNCE and DCL runs that logged diag/update_per_lr."
    parts, got = [], {}
    for reg in dict.fromkeys(d["regime"]):
        dr = d[d["regime"] == reg]
        text, got[reg] = _regime_update(dr[dr["batch_size"] == dr["batch_size"].min()])
        parts.append(text)
    opt = dict(zip(d["regime"], d["optimizer"]))
    return " ".join([head, "Measured: " + "; ".join(parts) + ".", *_update_verdicts(got, opt)])


def _update_verdicts(got: dict[str, str | None], opt: dict[str, str]) -> list[str]:
    """Where the scale reaches the update and where it is divided out, against each optimiser's prediction."""
    decided = [reg for reg in got if got[reg] in (FOLLOWS, CANCELS)]
    follows, cancels = [r for r in decided if got[r] == FOLLOWS], [r for r in decided if got[r] == CANCELS]
    said = ([f"reaches the update under {join(follows)}"] if follows else []) + (
        [f"is divided out under {join(cancels)}"] if cancels else []
    )
    s = [f"The gradient scale {'; it '.join(said)}."] if said else []
    pred = [r for r in decided if EXPECTED.get(opt[r], (None,))[0] is not None]
    if pred:
        why = "; ".join(dict.fromkeys(EXPECTED[opt[r]][1] for r in pred))
        agree = [r for r in pred if got[r] == EXPECTED[opt[r]][0]]
        wrong = [r for r in pred if r not in agree]
        s.append(
            f"Predicted from the optimisers ({why}): the measurement "
            + " and ".join(
                ([f"disagrees in {join(wrong)}"] if wrong else []) + ([f"agrees in {join(agree)}"] if agree else [])
            )
            + "."
        )
    s += [
        f"No clean prediction for {r} ({EXPECTED[opt[r]][1]})."
        for r in decided
        if opt[r] in EXPECTED and EXPECTED[opt[r]][0] is None
    ]
    undecided = [reg for reg in got if reg not in decided]
    if undecided:
        s.append(f"No single verdict (q_B too close to 1, too few seeds, or budgets disagreeing) in {join(undecided)}.")
    return s
