"""Section 'mi': MI bounds on correlated Gaussians, from the runs of kind ``mi``.

One run per estimator x critic x K x true MI x seed (logged by
:mod:`smallbatch.pipeline.mi_job`).  Writes

* ``tables/mi_bias_variance.{csv,md,tex}``: per estimator x critic x K x true MI,
  the mean over seeds of the estimate with its 95 % t-interval over seeds, bias
  (estimate - true MI), variance (over evaluation batches), the estimator's
  ceiling, the dual (FLO) readout and the InfoNCE readout at ``eval_k``; cells
  whose every seed was a setup failure say so, and the failed seeds are counted;
* ``tables/mi_claims.{csv,md,tex}``: each paper's claim next to what we measured
  and whether our numbers support it (:mod:`.mi_findings`);
* ``figures/mi_estimate_vs_true.{png,svg}``: estimate vs true MI, one panel per K;
* ``figures/mi_small_k.{png,svg}``: every trained critic read by the InfoNCE bound
  at ``eval_k`` against the K it trained with (FlatNCE's log-K-curse claim).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ...losses.registry import display_name
from ...mi.names import CRITICS, ESTIMATORS
from ..aggregate import pivot
from ..context import ReportContext, SectionOutput
from ..figures import LOSS_COLORS, palette, plot_style
from ..fmt import num, short, signed
from ..runs import newest
from ..tables import markdown_table
from .mi_findings import CRITIC_NAMES, mi_findings, seed_interval

_PARAMS = (
    "dim",
    "steps",
    "lr",
    "hidden",
    "embed",
    "layers",
    "anchors",
    "max_pairs",
    "eval_batches",
    "critic_temperature",
    "eval_k",
)
_METRICS = ("estimate", "std", "bias", "variance", "ceiling", "dual_estimate", "dual_std", "estimate_eval_k", "seconds")
_TIDY = [
    "estimator",
    "critic",
    "K",
    "true_mi",
    "ceiling",
    "estimate",
    "estimate_lo",
    "estimate_hi",
    "bias",
    "variance",
    "std",
    "seed_sd",
    "dual_estimate",
    "eval_k",
    "estimate_eval_k",
    "alpha",
    "seeds",
    "failed",
]
#: one marker per estimator, so that curves that coincide stay visible
_MARKERS = {"infonce": "o", "flatnce": "s", "eqco": "^"}
_INTRO = (
    "Estimators (scores s = critic outputs, temperature 1; K negatives per anchor): "
    "InfoNCE `log(K+1) - L_InfoNCE` (ceiling log(K+1)); EqCo `log(α+1) - L_EqCo` (ceiling log(α+1), "
    "independent of K); FlatNCE trains the critic with its own loss and is read out like the authors' code "
    "does, by the InfoNCE bound (ceiling log(K+1) by construction, so this readout cannot show the log-K curse "
    "broken). FlatNCE's claim is tested on what the critic learnt: every trained critic is also read by the "
    "InfoNCE bound with `eval_k` negatives (`estimate_eval_k`), the same for every estimator and training K. "
    "`dual_estimate` is FlatNCE's loss read as an MI estimate, `log K - mean log Σ_j exp(s_j - s_+)` (the FLO "
    "bound at its self-normalised optimum; no ceiling, not a guaranteed lower bound). Critic `oracle` is the "
    "true log density ratio (no training): it separates the bound's own bias from the learned critic's "
    "deficit. Estimates are means over seeds ± the half-width of their 95 % t-interval; bias = estimate − "
    "true MI; variance = over the evaluation batches. A run whose training loss turned non-finite, or whose "
    "unbounded critic read below 0 (its scores blew up), is a *setup failure*: counted, never averaged in."
)


def _col(df: pd.DataFrame, name: str, numeric: bool = True) -> pd.Series:
    s = df[name] if name in df else pd.Series(np.nan, index=df.index)
    return pd.to_numeric(s, errors="coerce") if numeric else s


def _order(values, known) -> list:
    """``values`` in the order of ``known``, then any other alphabetically."""
    vals = set(values)
    return [v for v in known if v in vals] + sorted(vals - set(known))


def mi_frame(runs: pd.DataFrame) -> tuple[pd.DataFrame, int, int]:
    """One row per MI run (newest run per cell id).

    Returns ``(frame, superseded, pending)``; the frame has ``run_id, cell_id,
    status, estimator, critic, K, true_mi, seed, alpha, estimate, std, bias,
    variance, ceiling, dual_estimate, dual_std, estimate_eval_k, seconds``, the
    setup params and ``failed`` (status ``diverged``: a setup failure,
    :func:`smallbatch.mi.toy.failed`).  Runs without a finite ``mi/estimate``
    and not diverged (still running) are counted as pending and left out.
    """
    r, superseded = newest(runs[runs["kind"] == "mi"] if "kind" in runs else runs.iloc[0:0])
    if r.empty:
        return pd.DataFrame(), 0, 0
    df = pd.DataFrame(
        {
            "run_id": r["run_id"],
            "cell_id": r["cell_id"],
            "status": r["status"],
            "estimator": _col(r, "params.estimator", False),
            "critic": _col(r, "params.critic", False),
            "K": _col(r, "params.K"),
            "true_mi": _col(r, "params.true_mi"),
            "seed": _col(r, "params.seed"),
            "alpha": _col(r, "params.alpha"),
            **{m: _col(r, f"metrics.mi/{m}") for m in _METRICS},
            **{p: _col(r, f"params.{p}") for p in _PARAMS},
        }
    )
    keyed = df["estimator"].notna() & np.isfinite(df["K"]) & np.isfinite(df["true_mi"])
    diverged = df["status"].astype(str).eq("diverged")
    ok = keyed & (np.isfinite(df["estimate"]) | diverged)
    df = df[ok].copy()
    df["K"] = df["K"].round().astype(int)
    df["seed"] = df["seed"].fillna(0)
    df["failed"] = df["status"].astype(str).eq("diverged")
    df["variance"] = df["variance"].where(np.isfinite(df["variance"]), df["std"] ** 2)
    return df.reset_index(drop=True), superseded, int((~ok).sum())


def _cell(est: str, critic: str, k: int, mi: float, g: pd.DataFrame) -> dict:
    """One aggregated cell from its runs ``g`` (setup failures counted, not averaged)."""
    good = g[~g["failed"]]
    mean, lo, hi, n = seed_interval(good["estimate"])
    var = float(good["variance"].mean()) if n else math.nan
    alpha = g["alpha"].dropna()
    return {
        "estimator": est,
        "critic": critic,
        "K": int(k),
        "true_mi": float(mi),
        "ceiling": float(g["ceiling"].dropna().iloc[0]) if g["ceiling"].notna().any() else math.nan,
        "log_k1": math.log(k + 1),
        "estimate": mean,
        "estimate_lo": lo,
        "estimate_hi": hi,
        "bias": mean - float(mi),
        "variance": var,
        "std": math.sqrt(var) if np.isfinite(var) else math.nan,
        "seed_sd": float(good["estimate"].std(ddof=1)) if n > 1 else math.nan,
        "dual_estimate": float(good["dual_estimate"].mean()) if n else math.nan,
        "eval_k": float(g["eval_k"].dropna().iloc[0]) if g["eval_k"].notna().any() else math.nan,
        "estimate_eval_k": float(good["estimate_eval_k"].mean()) if n else math.nan,
        "alpha": float(alpha.iloc[0]) if len(alpha) else math.nan,
        "seeds": n,
        "failed": int(g["failed"].sum()),
    }


def aggregate_mi(df: pd.DataFrame) -> pd.DataFrame:
    """Mean over the seeds without a setup failure per estimator x critic x K x true MI.

    ``estimate`` is that mean and ``estimate_lo``/``estimate_hi`` its 95 % t-interval over
    seeds (NaN for one seed), ``bias = estimate - true_mi``, ``variance`` the mean over
    seeds of the per-run variance over evaluation batches (``std`` its square root),
    ``seed_sd`` the standard deviation over seeds (ddof 1), ``seeds`` the seeds averaged
    and ``failed`` the seeds that were setup failures (a cell of only failures has NaN
    estimates).
    """
    if df.empty:
        return pd.DataFrame()
    rows = [
        _cell(est, critic, k, mi, g)
        for (est, critic, k, mi), g in df.groupby(["estimator", "critic", "K", "true_mi"], sort=False)
    ]
    a = pd.DataFrame(rows)
    rank = {"_e": (a["estimator"], ESTIMATORS), "_c": (a["critic"], CRITICS)}
    a = a.assign(
        **{k: col.map(lambda v, known=known: known.index(v) if v in known else 99) for k, (col, known) in rank.items()}
    )
    return a.sort_values(["_c", "_e", "K", "true_mi"], kind="stable").drop(columns=["_e", "_c"]).reset_index(drop=True)


def _by_k(a: pd.DataFrame, critic: str, fmt) -> pd.DataFrame:
    """Estimator x true MI rows, one column per K, cells ``fmt(row)``, for one critic."""
    sub = a[a["critic"] == critic]
    order = {e: i for i, e in enumerate(_order(sub["estimator"], ESTIMATORS))}
    sub = sub.assign(_e=sub["estimator"].map(order)).sort_values(["_e", "true_mi"], kind="stable")
    sub = sub.assign(
        **{
            "estimator": sub["estimator"].map(display_name),
            "true MI": sub["true_mi"].map(short),
            "cell": [fmt(r) for _, r in sub.iterrows()],
        }
    )
    return pivot(sub, ["estimator", "true MI"], "K", lambda k: f"K={k}", "cell", sorted(sub["K"].unique()))


def _with_failures(text: str, r: pd.Series) -> str:
    if not np.isfinite(r["estimate"]):
        return f"setup failure ({int(r['failed'])} of {int(r['failed'])} seeds)"
    return text + (f" ({int(r['failed'])} failed)" if r["failed"] else "")


def _estimate_cell(r: pd.Series) -> str:
    half = (r["estimate_hi"] - r["estimate_lo"]) / 2
    return _with_failures(
        f"{num(r['estimate'], 2)} ± {num(half, 2)}" if np.isfinite(half) else num(r["estimate"], 2), r
    )


def _bias_cell(r: pd.Series) -> str:
    return _with_failures(f"{signed(r['bias'], 2)} / {num(r['variance'], 3)}", r)


# --------------------------------------------------------------------------- figures
def _colors() -> dict:
    """One colour per estimator: its loss's colour in every figure of the report (:data:`.figures.LOSS_COLORS`)."""
    generic = palette(list(ESTIMATORS))
    return {e: LOSS_COLORS.get(e, generic[e]) for e in ESTIMATORS}


def _offsets(estimators: list[str], step: float) -> dict:
    """Side-by-side x offsets so that estimators at the same x do not hide each other."""
    mid = (len(estimators) - 1) / 2
    return {e: (i - mid) * step for i, e in enumerate(estimators)}


def _draw_cells(ax, cells: pd.DataFrame, x: str, y: str, est: str, color, shift, clip_lo: float | None = None) -> None:
    """Seeds as small dots, their mean as a marker on a line, the 95 % t-interval as an error bar.
    ``cells``: per-run rows of one estimator (failed ones left out); ``shift(x)`` offsets x.  Means and
    intervals come from the values themselves; only the drawing stops at ``clip_lo``, where a seed or a
    mean below it is drawn on the edge with its value written beside it (a marked clip)."""

    def at(v: float) -> float:
        return v if clip_lo is None or not np.isfinite(v) else max(v, clip_lo)

    def mark(xv: float, v: float) -> None:
        if clip_lo is not None and np.isfinite(v) and v < clip_lo:
            ax.annotate(
                f"{v:.3g}",
                (xv, clip_lo),
                xytext=(3, 2),
                textcoords="offset points",
                fontsize=6,
                color=color,
                rotation=90,
                va="bottom",
                ha="left",
            )

    stats = []
    for xv, g in cells.groupby(x, sort=True):
        m, lo, hi, _ = seed_interval(g[y])
        stats.append((shift(xv), at(m), at(lo), at(hi)))
        ax.scatter([shift(xv)] * len(g), [at(v) for v in g[y]], s=9, color=color, alpha=0.45, linewidths=0, zorder=3)
        for v in list(g[y]) + [m]:
            mark(shift(xv), v)
    if not stats:
        return
    xs, ms, los, his = map(np.asarray, zip(*stats))
    err = np.vstack([ms - np.where(np.isfinite(los), los, ms), np.where(np.isfinite(his), his, ms) - ms])
    ax.errorbar(
        xs,
        ms,
        yerr=err,
        color=color,
        marker=_MARKERS.get(est, "o"),
        ms=5,
        mfc="white",
        mew=1.3,
        lw=1.2,
        capsize=2.5,
        zorder=4,
    )


def _mark_failures(ax, xs: list[float], y: float) -> None:
    if xs:
        ax.scatter(xs, [y] * len(xs), marker="X", s=55, color="crimson", clip_on=False, zorder=6)


def _legend(fig, colors: dict, estimators: list[str], extra: list) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=colors[e], marker=_MARKERS.get(e, "o"), mfc="white", mew=1.3, label=display_name(e))
        for e in estimators
    ]
    handles += [Line2D([], [], color="grey", marker="o", ls="", ms=3, alpha=0.6, label="one seed")]
    handles += [Line2D([], [], **kw) for kw in extra]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=min(len(handles), 5),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, -0.02),
    )


def _figure_vs_true(a: pd.DataFrame, df: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], str]:
    """Estimate vs true MI, one panel per K: every seed, mean and 95 % t-interval per estimator
    (learned critic), the oracle's InfoNCE bound, identity, log(K+1), EqCo's log(α+1)."""
    plt, _, rc = plot_style()
    learned = df[df["critic"] != "oracle"]
    critic = next((c for c in CRITICS if c != "oracle" and c in set(learned["critic"])), None)
    runs = learned[learned["critic"] == critic] if critic else df
    ests = _order(runs["estimator"], ESTIMATORS)
    colors, ks, mis = _colors(), sorted(runs["K"].unique()), sorted(df["true_mi"].unique())
    shift = _offsets(ests, 0.06 * max(max(mis) - min(mis), 1.0))
    orc = a[(a["critic"] == "oracle") & (a["estimator"] == "infonce")]
    eq_ceil = sorted(a.loc[a["estimator"] == "eqco", "ceiling"].dropna().unique())
    good = runs[~runs["failed"]]
    vals = pd.concat([good["estimate"], orc["estimate"], pd.Series([0.0, max(mis)])]).dropna()
    lo, hi = float(vals.min()), float(vals.max())
    clip_lo = -1.0 if lo < -3.0 else None  # an extreme value is drawn at a marked edge, not silently clamped
    ylo = (clip_lo if clip_lo is not None else lo) - 0.4
    with plt.rc_context(rc):
        fig, axes = plt.subplots(1, len(ks), figsize=(max(2.3 * len(ks) + 0.4, 7.5), 3.3), sharey=True, squeeze=False)
        for k, ax in zip(ks, axes[0]):
            ax.plot([0, max(mis)], [0, max(mis)], color="black", lw=0.8, ls=":")
            ax.axhline(math.log(k + 1), color="grey", lw=1.0, ls="--")
            for c in (c for c in eq_ceil if abs(c - math.log(k + 1)) > 1e-6 and c <= hi + 0.5):
                ax.axhline(c, color=colors.get("eqco"), lw=0.9, ls="-.")
            o = orc[orc["K"] == k].sort_values("true_mi")
            ax.plot(o["true_mi"], o["estimate"], color="dimgrey", lw=0.9, marker="D", ms=3)
            fails = []
            for e in ests:
                cells = runs[(runs["estimator"] == e) & (runs["K"] == k)]
                _draw_cells(
                    ax,
                    cells[~cells["failed"]],
                    "true_mi",
                    "estimate",
                    e,
                    colors[e],
                    lambda v, e=e: v + shift[e],
                    clip_lo,
                )
                fails += [v + shift[e] for v in cells.loc[cells["failed"], "true_mi"]]
            ax.set_ylim(ylo, hi + 0.6)
            _mark_failures(ax, fails, ylo)
            if clip_lo is not None:
                ax.axhline(clip_lo, color="crimson", lw=0.6, ls=(0, (1, 3)))
            ax.set_title(f"K = {k}", fontsize=9)
            ax.set_xlabel("true MI (nats)", fontsize=8)
            ax.set_xticks(mis)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("estimate (nats)", fontsize=8)
        extra = [
            dict(color="dimgrey", marker="D", ms=3, lw=0.9, label="oracle critic (InfoNCE bound)"),
            dict(color="black", ls=":", lw=0.8, label="true MI"),
            dict(color="grey", ls="--", lw=1.0, label="log(K+1)"),
        ]
        if eq_ceil:
            extra.append(dict(color=colors.get("eqco"), ls="-.", lw=0.9, label="EqCo log(α+1) (where ≠ log(K+1))"))
        if runs["failed"].any():
            extra.append(dict(color="crimson", marker="X", ls="", label="setup failure (no value)"))
        if clip_lo is not None:
            extra.append(dict(color="crimson", ls=(0, (1, 3)), lw=0.6, label=f"values below {clip_lo:g} drawn here"))
        _legend(fig, colors, ests, extra)
        fig.suptitle(
            f"MI estimate vs true MI, {CRITIC_NAMES.get(critic, critic) if critic else critic} critic: mean over seeds, 95 % t-interval",
            fontsize=10,
        )
        fig.tight_layout(rect=(0, 0.13, 1, 1))
        files = ctx.save_figure(fig, "mi_estimate_vs_true")
    cap = (
        "**MI estimate vs true MI**, one panel per K (negatives per anchor): each estimator's readout of its "
        "own trained critic (markers side by side, dots = seeds, bars = 95 % t-interval over seeds); grey "
        "diamonds: the oracle critic's InfoNCE bound; dashed: log(K+1), the ceiling of InfoNCE and of "
        "FlatNCE's readout; dotted: the true MI"
    )
    if clip_lo is not None:
        cap += f"; values below {clip_lo:g} nats are drawn on the dotted red line with their value written"
    return files, cap + ".\n\n" + ctx.figure_md(files, "MI estimate vs true MI")


def _figure_small_k(a: pd.DataFrame, df: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], str] | None:
    """Every trained critic read by the InfoNCE bound at eval_k against its training K, one panel per
    true MI: FlatNCE's claim is that its small-K critic does not fall behind."""
    runs = df[(df["critic"] != "oracle") & df["estimate_eval_k"].notna()]
    if runs.empty or not df["eval_k"].notna().any():
        return None
    plt, _, rc = plot_style()
    critic = next(c for c in CRITICS if c != "oracle" and c in set(runs["critic"]))
    runs = runs[runs["critic"] == critic]
    eval_k = int(df["eval_k"].dropna().iloc[0])
    ests, colors = _order(runs["estimator"], ESTIMATORS), _colors()
    mis, ks = sorted(runs["true_mi"].unique()), sorted(runs["K"].unique())
    factor = _offsets(ests, 0.12)
    orc = df[(df["critic"] == "oracle") & (df["estimator"] == "infonce") & ~df["failed"]]
    good = runs[~runs["failed"]]
    with plt.rc_context(rc):
        fig, axes = plt.subplots(1, len(mis), figsize=(max(2.9 * len(mis) + 0.4, 7.5), 3.3), sharey=True, squeeze=False)
        for mi, ax in zip(mis, axes[0]):
            ax.axhline(math.log(eval_k + 1), color="grey", lw=1.0, ls="--")
            ax.axhline(mi, color="black", lw=0.8, ls=":")
            o = orc.loc[orc["true_mi"] == mi, "estimate_eval_k"]
            if len(o):  # wide and pale, so that the true-MI line drawn over it stays visible
                ax.axhline(float(o.mean()), color="dimgrey", lw=3.0, alpha=0.35, ls="-")
            fails = []
            for e in ests:
                cells = runs[(runs["estimator"] == e) & (runs["true_mi"] == mi)]
                _draw_cells(
                    ax, cells[~cells["failed"]], "K", "estimate_eval_k", e, colors[e], lambda v, e=e: v * 2 ** factor[e]
                )
                fails += [v * 2 ** factor[e] for v in cells.loc[cells["failed"], "K"]]
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks)
            ax.set_xticklabels([str(k) for k in ks], fontsize=8)
            ax.minorticks_off()
            ax.set_title(f"true MI = {short(mi)} nats", fontsize=9)
            ax.set_xlabel("K the critic trained with", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            _mark_failures(ax, fails, ax.get_ylim()[0])
        axes[0][0].set_ylabel(f"InfoNCE bound at K = {eval_k} (nats)", fontsize=8)
        extra = [
            dict(color="dimgrey", lw=3.0, alpha=0.35, label="oracle critic"),
            dict(color="black", ls=":", lw=0.8, label="true MI"),
            dict(color="grey", ls="--", lw=1.0, label=f"log({eval_k}+1)"),
        ]
        if runs["failed"].any():
            extra.append(dict(color="crimson", marker="X", ls="", label="setup failure (no value)"))
        _legend(fig, colors, ests, extra)
        fig.suptitle(f"What the critic learnt with K negatives, read with {eval_k}", fontsize=10)
        fig.tight_layout(rect=(0, 0.13, 1, 1))
        files = ctx.save_figure(fig, "mi_small_k")
    del good
    cap = (
        f"**What a small K does to the critic**: every trained {CRITIC_NAMES.get(critic, critic)} critic read "
        f"by the InfoNCE bound with {eval_k} negatives, against the K it trained with (markers side by side, "
        "dots = seeds, bars = 95 % t-interval); FlatNCE's claim is that its critic trained with few negatives "
        "does not fall behind; grey: the oracle critic; dashed: the readout's ceiling; dotted: the true MI"
    )
    return files, cap + ".\n\n" + ctx.figure_md(files, "MI critic quality vs training K")


def _setup_text(df: pd.DataFrame) -> str:
    trained = df[df["critic"] != "oracle"]
    trained = trained if len(trained) else df

    def one(col: str, frame: pd.DataFrame = trained) -> str:
        vals = sorted({v for v in frame[col].dropna().unique()})
        return "/".join(short(float(v)) for v in vals) if vals else "?"

    temp = one("critic_temperature")
    scores = f"scores bounded as cos/{temp}" if temp != "?" else "unbounded scores"
    n_seeds = int(df["seed"].nunique())
    return (
        f"Setup: X, Y in R^{one('dim', df)} with per-coordinate correlation set for each true MI; learned "
        f"critics trained {one('steps')} Adam steps (lr {one('lr')}, cosine decay), MLP width {one('hidden')}, "
        f"{scores}; {n_seeds} seed{'s' if n_seeds != 1 else ''} per setting; "
        f"evaluation on {one('eval_batches', df)} fresh batches of {one('anchors', df)} anchors, each against "
        f"its K negatives (the concatenated critic trains on at most {one('max_pairs')} pairs per step)."
    )


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """The 'mi' section; None when the store holds no MI runs."""
    df, superseded, pending = mi_frame(runs)
    if df.empty and not pending:
        return None
    out = SectionOutput(
        "mi", "Mutual information bounds on correlated Gaussians", "", run_ids=set(df["run_id"]) if len(df) else set()
    )
    if superseded:
        ctx.notes.append(
            f"{superseded} MI run(s) were superseded by a newer run of the same cell id and are not reported."
        )
    if df.empty:
        out.markdown = f"{pending} MI run(s) have not logged an estimate yet.\n"
        return out
    a = aggregate_mi(df)
    md = [_INTRO, "", _setup_text(df), ""]
    if pending:
        md.append(f"{pending} MI run(s) have not logged an estimate yet and are left out.\n")
    blocks = []
    for critic in _order(a["critic"], CRITICS):
        name = CRITIC_NAMES.get(critic, critic)
        blocks.append((f"estimate ± 95 % t-interval over seeds, {name} critic", _by_k(a, critic, _estimate_cell)))
        blocks.append((f"bias / variance, {name} critic", _by_k(a, critic, _bias_cell)))
    f_tab = ctx.write_table(
        "mi_bias_variance",
        "MI estimates on correlated Gaussians: bias and variance per estimator, critic, K and true MI (nats)",
        a[_TIDY].rename(columns={"estimate": "estimate_mean"}),
        blocks=blocks,
    )
    findings, claims = mi_findings(a, df)
    f_claims = ctx.write_table("mi_claims", "MI toy: the papers' claims next to what we measured", claims)
    out.files += f_tab + f_claims
    md.append(f"Bias and variance: {ctx.table_links(f_tab)}\n")
    md += [x for sub, table in blocks if sub.startswith("estimate") for x in (f"**{sub}**\n", markdown_table(table))]
    md.append(f"\n**The papers' claims next to our numbers** ({ctx.table_links(f_claims)})\n")
    md.append(markdown_table(claims) if len(claims) else "_(no estimator with enough settings)_\n")
    figs = [f for f in (_figure_vs_true(a, df, ctx), _figure_small_k(a, df, ctx)) if f is not None]
    out.files += [p for files, _ in figs for p in files]
    out.markdown = "\n".join(md + [x for _, fig_md in figs for x in ("", fig_md)])
    out.findings = findings
    return out
