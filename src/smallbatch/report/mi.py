"""Section 'mi': MI bounds on correlated Gaussians, from the runs of kind ``mi``.

One run per estimator x critic x K x true MI x seed (logged by
:mod:`smallbatch.mi_step`).  Writes

* ``tables/mi_bias_variance.{csv,md,tex}``: estimate, bias (estimate - true MI)
  and variance (over evaluation batches) per estimator x critic x K x true MI,
  with the estimator's ceiling and the dual (FLO) readout;
* ``tables/mi_claims.{csv,md,tex}``: each paper's claim next to what we measured
  and whether our numbers support it (:mod:`.mi_findings`);
* ``figures/mi_estimate_vs_true.{png,svg}``: estimate vs true MI, one panel per K,
  hue = estimator, style = critic, with the identity line, the InfoNCE ceiling
  ``log(K+1)`` and EqCo's ``log(alpha+1)`` drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..losses import display_name
from ..mi import CRITICS, ESTIMATORS
from .aggregate import pivot
from .context import ReportContext, SectionOutput
from .fmt import num, short, signed
from .figures import plot_style
from .mi_findings import CRITIC_NAMES, mi_findings
from .runs import newest
from .tables import markdown_table

_PARAMS = ("dim", "steps", "lr", "hidden", "embed", "layers", "anchors", "max_pairs", "eval_batches")
_METRICS = ("estimate", "std", "bias", "variance", "ceiling", "dual_estimate", "dual_std", "seconds")
_TIDY = ["estimator", "critic", "K", "true_mi", "ceiling", "estimate", "bias", "variance", "std", "seed_sd",
         "dual_estimate", "alpha", "seeds"]
_INTRO = (
    "Estimators (scores s = critic outputs, temperature 1; K negatives per anchor): "
    "InfoNCE `log(K+1) - L_InfoNCE` (ceiling log(K+1)); EqCo `log(α+1) - L_EqCo` (ceiling log(α+1), "
    "independent of K); FlatNCE trains the critic with its own loss and is read out like the authors' code "
    "does, by the InfoNCE bound (ceiling log(K+1)). The table's `dual_estimate` column is FlatNCE's "
    "loss read as an MI estimate, `log K - mean log Σ_j exp(s_j - s_+)` (the FLO bound at its self-normalised "
    "optimum; no ceiling, not a guaranteed lower bound). Critic `oracle` is the true log density ratio "
    "(no training): it separates the bound's own bias from the learned critic's deficit. "
    "Bias = estimate − true MI; variance = over the evaluation batches.")


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
    variance, ceiling, dual_estimate, dual_std, seconds`` and the setup params.
    Runs without a finite ``mi/estimate`` (still running, or diverged) are
    counted as pending and left out.
    """
    r, superseded = newest(runs[runs["kind"] == "mi"] if "kind" in runs else runs.iloc[0:0])
    if r.empty:
        return pd.DataFrame(), 0, 0
    df = pd.DataFrame({
        "run_id": r["run_id"], "cell_id": r["cell_id"], "status": r["status"],
        "estimator": _col(r, "params.estimator", False), "critic": _col(r, "params.critic", False),
        "K": _col(r, "params.K"), "true_mi": _col(r, "params.true_mi"), "seed": _col(r, "params.seed"),
        "alpha": _col(r, "params.alpha"), **{m: _col(r, f"metrics.mi/{m}") for m in _METRICS},
        **{p: _col(r, f"params.{p}") for p in _PARAMS}})
    ok = np.isfinite(df["estimate"]) & df["estimator"].notna() & np.isfinite(df["K"]) & np.isfinite(df["true_mi"])
    df = df[ok].copy()
    df["K"] = df["K"].round().astype(int)
    df["variance"] = df["variance"].where(np.isfinite(df["variance"]), df["std"] ** 2)
    return df.reset_index(drop=True), superseded, int((~ok).sum())


def aggregate_mi(df: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per estimator x critic x K x true MI.

    ``estimate`` is the mean over seeds, ``bias = estimate - true_mi``,
    ``variance`` the mean over seeds of the per-run variance over evaluation
    batches (``std`` its square root), ``seed_sd`` the standard deviation of
    the estimate over seeds (ddof 1; NaN for one seed).
    """
    if df.empty:
        return pd.DataFrame()
    rows = []
    for (est, critic, k, mi), g in df.groupby(["estimator", "critic", "K", "true_mi"], sort=False):
        est_mean, var = float(g["estimate"].mean()), float(g["variance"].mean())
        rows.append({
            "estimator": est, "critic": critic, "K": int(k), "true_mi": float(mi),
            "ceiling": float(g["ceiling"].iloc[0]), "log_k1": math.log(k + 1),
            "estimate": est_mean, "bias": est_mean - float(mi), "variance": var, "std": math.sqrt(var),
            "seed_sd": float(g["estimate"].std(ddof=1)) if len(g) > 1 else math.nan,
            "dual_estimate": float(g["dual_estimate"].mean()),
            "alpha": float(g["alpha"].iloc[0]) if np.isfinite(g["alpha"].iloc[0]) else math.nan, "seeds": len(g)})
    a = pd.DataFrame(rows)
    rank = {"_e": (a["estimator"], ESTIMATORS), "_c": (a["critic"], CRITICS)}
    a = a.assign(**{k: col.map(lambda v, known=known: known.index(v) if v in known else 99)
                    for k, (col, known) in rank.items()})
    return a.sort_values(["_c", "_e", "K", "true_mi"], kind="stable").drop(columns=["_e", "_c"]).reset_index(drop=True)


def _by_k(a: pd.DataFrame, critic: str, fmt) -> pd.DataFrame:
    """Estimator x true MI rows, one column per K, cells ``fmt(row)``, for one critic."""
    sub = a[a["critic"] == critic]
    order = {e: i for i, e in enumerate(_order(sub["estimator"], ESTIMATORS))}
    sub = sub.assign(_e=sub["estimator"].map(order)).sort_values(["_e", "true_mi"], kind="stable")
    sub = sub.assign(**{"estimator": sub["estimator"].map(display_name), "true MI": sub["true_mi"].map(short),
                        "cell": [fmt(r) for _, r in sub.iterrows()]})
    return pivot(sub, ["estimator", "true MI"], "K", lambda k: f"K={k}", "cell", sorted(sub["K"].unique()))


def _figure(a: pd.DataFrame, ctx: ReportContext) -> tuple[list[Path], str]:
    plt, sns, rc = plot_style()
    data = a.copy()
    mis = sorted(data["true_mi"].unique())
    eq_ceil = sorted(data.loc[data["estimator"] == "eqco", "ceiling"].unique())
    lo, hi = -1.0, max(max(mis), float(np.nanmax(data["log_k1"]))) + 1.0
    if eq_ceil:
        hi = max(hi, min(max(eq_ceil), float(np.nanmax(data["estimate"]))) + 0.5)
    clipped = int(((data["estimate"] < lo) | (data["estimate"] > hi)).sum())
    data["estimate (nats)"], data["true MI (nats)"] = data["estimate"].clip(lo, hi), data["true_mi"]
    hue_order = [display_name(e) for e in _order(data["estimator"], ESTIMATORS)]
    style_order = [CRITIC_NAMES.get(c, c) for c in _order(data["critic"], CRITICS)]
    data["estimator"], data["critic"] = data["estimator"].map(display_name), data["critic"].map(
        lambda c: CRITIC_NAMES.get(c, c))
    ks = sorted(data["K"].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=data, kind="line", x="true MI (nats)", y="estimate (nats)", hue="estimator",
                        hue_order=hue_order, style="critic", style_order=style_order, markers=True,
                        col="K", col_order=ks, col_wrap=min(len(ks), 5), height=3.0, aspect=0.95,
                        errorbar=None, facet_kws={"sharey": True})
        for k, ax in zip(ks, g.axes.flat):
            ax.plot([0, max(mis)], [0, max(mis)], color="black", lw=0.8, ls=":", label="true MI")
            ax.axhline(math.log(k + 1), color="grey", lw=1.0, ls="--")
            ax.text(0.02, math.log(k + 1), "log(K+1)", color="grey", fontsize=7, va="bottom",
                    transform=ax.get_yaxis_transform())
            for c in (c for c in eq_ceil if lo <= c <= hi):
                ax.axhline(c, color="tab:green", lw=0.8, ls="-.")
                ax.text(0.98, c, "EqCo log(α+1)", color="tab:green", fontsize=7, va="bottom", ha="right",
                        transform=ax.get_yaxis_transform())
            ax.set_ylim(lo - 0.2, hi + 0.2)
            ax.set_title(f"K = {k}")
        g.figure.suptitle("MI estimate vs true MI (correlated Gaussians); dotted: identity", y=1.03, fontsize=10)
        files = ctx.save_figure(g.figure, "mi_estimate_vs_true")
    cap = ("**MI estimate vs true MI**, one panel per K (negatives per anchor); dashed: log(K+1), InfoNCE's "
           "ceiling; dash-dotted: EqCo's log(α+1); dotted: the true MI")
    if clipped:
        cap += f"; {clipped} estimate(s) outside [{lo:g}, {hi:g}] nats are drawn at the edge (see the table)"
    return files, cap + ".\n\n" + ctx.figure_md(files, "MI estimate vs true MI")


def _setup_text(df: pd.DataFrame) -> str:
    trained = df[df["critic"] != "oracle"]
    trained = trained if len(trained) else df

    def one(col: str, frame: pd.DataFrame = trained) -> str:
        vals = sorted({v for v in frame[col].dropna().unique()})
        return "/".join(short(float(v)) for v in vals) if vals else "?"

    return (f"Setup: X, Y in R^{one('dim', df)} with per-coordinate correlation set for each true MI; learned "
            f"critics trained {one('steps')} Adam steps (lr {one('lr')}, cosine decay), MLP width {one('hidden')}; "
            f"evaluation on {one('eval_batches', df)} fresh batches of {one('anchors', df)} anchors, each against "
            f"its K negatives (the concatenated critic trains on at most {one('max_pairs')} pairs per step).")


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """The 'mi' section; None when the store holds no MI runs."""
    df, superseded, pending = mi_frame(runs)
    if df.empty and not pending:
        return None
    out = SectionOutput("mi", "Mutual information bounds on correlated Gaussians", "",
                        run_ids=set(df["run_id"]) if len(df) else set())
    if superseded:
        ctx.notes.append(f"{superseded} MI run(s) were superseded by a newer run of the same cell id and are not "
                         "reported.")
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
        blocks.append((f"estimate ± sd, {name} critic",
                       _by_k(a, critic, lambda r: f"{num(r['estimate'], 2)} ± {num(r['std'], 2)}")))
        blocks.append((f"bias / variance, {name} critic",
                       _by_k(a, critic, lambda r: f"{signed(r['bias'], 2)} / {num(r['variance'], 3)}")))
    f_tab = ctx.write_table("mi_bias_variance", "MI estimates on correlated Gaussians: bias and variance "
                            "per estimator, critic, K and true MI (nats)", a[_TIDY], blocks=blocks)
    findings, claims = mi_findings(a)
    f_claims = ctx.write_table("mi_claims", "MI toy: the papers' claims next to what we measured", claims)
    out.files += f_tab + f_claims
    md.append(f"Bias and variance: {ctx.table_links(f_tab)}\n")
    md += [x for sub, table in blocks if sub.startswith("estimate") for x in (f"**{sub}**\n", markdown_table(table))]
    md.append(f"\n**The papers' claims next to our numbers** ({ctx.table_links(f_claims)})\n")
    md.append(markdown_table(claims) if len(claims) else "_(no estimator with enough settings)_\n")
    files, fig_md = _figure(a, ctx)
    out.files += files
    out.markdown = "\n".join(md + ["", fig_md])
    out.findings = findings
    return out
