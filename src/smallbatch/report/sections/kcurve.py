"""Section 'kcurve': the negatives' dose-response at one optimiser batch (``workflow/configs/k_sweep.yaml``).

Every arm trains InfoNCE at the same batch, rate and steps; only the negatives per anchor K change:
by grouping (``train.neg_group`` G: K = 2G − 2) and, above the batch, by fresh negatives encoded
without gradient (``train.extra_negatives``).  Per data set, τ, budget (snapshots of each run),
BatchNorm setting and probe the section gives accuracy against K with a 95 % interval over seeds,
and the *knee*: the smallest K from which every larger K is equivalent to the largest (its paired
difference within the analysis plan's margin by TOST, Holm over the curve's K).  The knee is set
beside the coupon collector's C·H_C (Nozawa & Sato 2021): the expected draws until every one of
C classes has been drawn, H_C the C-th harmonic number -- how many negatives an anchor needs to
meet every other class.  The margin is the plan's (``analysis``): in points, relative to the
K = 2 arm's effect on the same probe (``control``) or to the probe's supervised − random-init
range (``span``).  Arms whose BatchNorm runs over the whole batch (``train.bn_group`` unset or the
batch) are a curve of their own, set against the grouped BatchNorm at each K both ran.
"""

from __future__ import annotations

import math

import pandas as pd

from ...data.registry import num_classes
from ..context import ReportContext, SectionOutput
from ..evidence import ALPHA, contrast, describe, tost
from ..fmt import finite, num, short
from ..plan import AnalysisPlan, holm_p, margins
from ..plateau import plateau
from ..runs import param_num, select_cells
from .instrument import baseline_values
from .instrument_budgets import METRICS, budget_rows, good
from .instrument_gates import CONTROL_MAX_K

__all__ = [
    "SECTION",
    "WHOLE",
    "coupon_draws",
    "k_rows",
    "knee_table",
    "k_plateaus",
    "plateau_findings",
    "bn_rows",
    "findings",
    "figure",
    "build",
]

SECTION = "kcurve"
#: the BatchNorm label of an arm normalising over its whole batch
WHOLE = "the whole batch"
#: a curve's columns (one K curve: every arm alike but K)
CURVE = ["dataset", "temperature", "batch_size", "lr", "budget", "epochs", "bn", "metric"]


def coupon_draws(classes: int) -> float:
    """C·H_C: the expected number of draws (with replacement, classes equally likely) until each of
    ``classes`` has been drawn at least once."""
    return classes * sum(1.0 / i for i in range(1, classes + 1))


def _epochs(e: float) -> str:
    return f"{short(e)} epoch{'' if e == 1 else 's'}"


def _bn(group: float, batch: int) -> str:
    return f"groups of {int(group)}" if finite(group) and int(group) < batch else WHOLE


def k_rows(cells: pd.DataFrame, scale: float) -> pd.DataFrame:
    """The budget rows of the cells (:func:`.instrument_budgets.budget_rows`) with ``K`` (the cell's
    negatives per anchor) and ``bn`` (its BatchNorm: ``groups of G`` or :data:`WHOLE`), long by probe:
    one row per cell, budget and probe (``metric``, ``value``)."""
    rows = good(budget_rows(cells, scale))
    if rows.empty:
        return rows
    ks = dict(zip(cells["run_id"], param_num(cells, "negatives")))
    bns = dict(zip(cells["run_id"], param_num(cells, "bn_group")))
    rows = rows.assign(
        K=[ks.get(r) for r in rows["run_id"]],
        bn=[_bn(bns.get(r, math.nan), b) for r, b in zip(rows["run_id"], rows["batch_size"])],
    )
    keep = ["dataset", "temperature", "batch_size", "lr", "budget", "epochs", "bn", "K", "seed"]
    long = rows.melt(id_vars=keep, value_vars=list(METRICS), var_name="metric", value_name="value")
    return long.dropna(subset=["value", "K"])


def _points(g: pd.DataFrame) -> dict[int, dict[int, float]]:
    """K -> {seed: value} of one curve's rows."""
    return {int(k): dict(zip(a["seed"].astype(int), a["value"].astype(float))) for k, a in g.groupby("K")}


def _curve_rows(key: tuple, pts: dict[int, dict[int, float]], span: float) -> list[dict]:
    """One curve: each K's mean with its interval and its paired difference from the largest K."""
    top = max(pts)
    out = []
    for k in sorted(pts):
        mean = contrast([(1.0, pts[k])])
        d = contrast([(1.0, pts[k]), (-1.0, pts[top])]) if k != top else None
        control = k == min(pts) and k <= CONTROL_MAX_K
        out.append(
            {
                **dict(zip(CURVE, key)),
                "K": k,
                "K_max": top,
                "mean": mean.diff,
                "mean_lo": mean.lo,
                "mean_hi": mean.hi,
                "seeds": len(pts[k]),
                "key": "control" if control else f"K{k}",
                "diff": d.diff if d else 0.0,
                "lo": d.lo if d else math.nan,
                "hi": d.hi if d else math.nan,
                "p": d.p if d else math.nan,
                "span": span,
                "estimate": d,
            }
        )
    return out


def knee_table(long: pd.DataFrame, plan: AnalysisPlan, spans: dict[tuple[str, str], float]) -> pd.DataFrame:
    """Every K of every curve: mean [95 % CI], difference from the largest K, the margin (the plan's,
    in points), TOST p and its Holm over the curve, ``equivalent``, and per curve its ``knee`` and C·H_C."""
    rows = []
    for key, g in long.groupby(CURVE, sort=True, dropna=False):
        pts = _points(g)
        if len(pts) >= 2:
            rows += _curve_rows(key, pts, spans.get((key[0], key[-1]), math.nan))
    if not rows:
        return pd.DataFrame()
    t = pd.DataFrame(rows)
    t["margin"] = margins(plan, t)
    t["tost_p"] = [tost(e, m) if e is not None and finite(m) else math.nan for e, m in zip(t["estimate"], t["margin"])]
    t["tost_holm"] = math.nan
    for _, g in t.groupby(CURVE, sort=False, dropna=False):
        below = g[g["K"] < g["K_max"]]
        t.loc[below.index, "tost_holm"] = holm_p(below["tost_p"].astype(float).fillna(1.0))
    t["equivalent"] = t["tost_holm"] < ALPHA
    t["knee"] = math.nan
    for _, g in t.groupby(CURVE, sort=False, dropna=False):
        t.loc[g.index, "knee"] = _knee(g)
    t["classes"] = [num_classes(ds) or 0 for ds in t["dataset"]]
    t["coupon"] = [coupon_draws(c) if c else math.nan for c in t["classes"]]
    return t


def _knee(g: pd.DataFrame) -> float:
    """The smallest K from which every K up to the largest is equivalent to it; NaN when even the
    next-largest is not (or the curve has fewer than three K)."""
    if len(g) < 3:
        return math.nan
    knee = math.nan
    for k, eq in sorted(zip(g["K"], g["equivalent"]), reverse=True):
        if k == g["K_max"].iloc[0]:
            continue
        if not eq:
            break
        knee = k
    return knee


def bn_rows(long: pd.DataFrame) -> list[dict]:
    """BatchNorm over the whole batch − over groups, per K both ran (paired by seed)."""
    out = []
    keys = [c for c in CURVE if c != "bn"]
    for key, g in long.groupby(keys, sort=True, dropna=False):
        if WHOLE not in set(g["bn"]) or g["bn"].nunique() < 2:
            continue
        grouped = next(b for b in sorted(set(g["bn"])) if b != WHOLE)
        for k in sorted(set(g[g["bn"] == WHOLE]["K"]) & set(g[g["bn"] == grouped]["K"])):
            w, b = (_points(g[g["bn"] == x]).get(int(k), {}) for x in (WHOLE, grouped))
            e = contrast([(1.0, w), (-1.0, b)])
            out.append({**dict(zip(keys, key)), "K": int(k), "versus": grouped, "diff": e.diff, "lo": e.lo, "hi": e.hi,
                        "p": e.p, "estimate": e})  # fmt: skip
    return out


def k_plateaus(long: pd.DataFrame) -> pd.DataFrame:
    """Per data set, τ, batch, rate, BatchNorm and probe: each K arm's plateau over the budgets (the
    plateau rule) and the K curve's (``curve_plateau``: the latest of its arms'; NaN while one of them
    still moves), with the arms still moving."""
    keys = [c for c in CURVE if c not in ("budget", "epochs")]
    rows = []
    for key, g in long[long["epochs"].map(finite)].groupby(keys, sort=True, dropna=False):
        arms = {
            int(k): plateau({float(e): dict(zip(b["seed"].astype(int), b["value"])) for e, b in a.groupby("epochs")})
            for k, a in g.groupby("K")
        }
        moving = [k for k, p in sorted(arms.items()) if not p.reached]
        top = max((p.epochs for p in arms.values()), default=math.nan)
        rows.append({**dict(zip(keys, key)), "curve_plateau": math.nan if moving else top,
                     "moving": moving, "longest": float(g["epochs"].max())})  # fmt: skip
    return pd.DataFrame(rows)


def plateau_findings(pl: pd.DataFrame, probes: tuple[str, ...]) -> list[str]:
    """Per K curve of ``probes``: the budget from which every K arm stopped moving, or the arms that still move."""
    out = []
    for r in pl[pl["metric"].isin(probes)].itertuples(index=False) if len(pl) else ():
        where = f"{r.dataset}, τ {short(r.temperature)}, BatchNorm over {r.bn}, {METRICS[r.metric][1]}"
        if finite(r.curve_plateau):
            out.append(f"K curve's plateau, {where}: every K stopped moving by {_epochs(r.curve_plateau)}.")
        else:
            ks = ", ".join(str(k) for k in r.moving)
            out.append(f"K curve's plateau, {where}: none yet at {_epochs(r.longest)} (still moving: K {ks}).")
    return out


# --------------------------------------------------------------------------- words, tables, figure
def _where(r) -> str:
    return f"{r.dataset}, τ {short(r.temperature)}, {_epochs(r.epochs)}, BatchNorm over {r.bn}, {METRICS[r.metric][1]}"


def findings(t: pd.DataFrame, bn: list[dict], probes: tuple[str, ...] = tuple(METRICS)) -> list[str]:
    """Per curve of ``probes`` (the plan's): its range over K, its knee (or why none) beside C·H_C; then
    each BatchNorm contrast on them."""
    out = []
    for _, g in t[t["metric"].isin(probes)].groupby(CURVE, sort=True, dropna=False):
        if len(g) < 3:
            continue
        r, lo, hi = g.iloc[0], g.iloc[0], g.iloc[-1]
        rng = f"top-1 {num(lo['mean'])} at K {int(lo['K'])} to {num(hi['mean'])} at K {int(hi['K'])}"
        m = f"± {num(r['margin'], 2)} points" if finite(r["margin"]) else "no margin (no K ≤ 6 arm)"
        knee = (
            f"knee at K {int(r['knee'])} (the smallest K from which every larger K is within {m} of K {int(r['K_max'])}, "
            "TOST Holm over the curve)"
            if finite(r["knee"])
            else f"no knee: K {int(g.iloc[-2]['K'])} is not shown within {m} of K {int(r['K_max'])}"
        )
        chc = f"C·H_C = {num(r['coupon'])} for {int(r['classes'])} classes" if finite(r["coupon"]) else "C unknown"
        out.append(f"K dose-response, {_where(next(g.itertuples()))}: {rng}; {knee}; {chc}.")
    for b in (b for b in bn if b["metric"] in probes):
        where = f"{b['dataset']}, τ {short(b['temperature'])}, {_epochs(b['epochs'])}, {METRICS[b['metric']][1]}"
        what = f"whole batch − {b['versus']}"
        out.append(f"BatchNorm, {where}, K {b['K']}: {describe(b['estimate'], what)}.")
    return out


def _display(t: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for (ds, tau, budget, bn), g in t.groupby(["dataset", "temperature", "budget", "bn"], sort=True):
        cols = {}
        for m in (m for m in METRICS if m in set(g["metric"])):
            h = g[g["metric"] == m]
            cols[METRICS[m][1]] = [
                f"{'◆ ' if k == knee else ''}{num(v)} [{num(a)}, {num(b)}]"
                for k, v, a, b, knee in zip(h["K"], h["mean"], h["mean_lo"], h["mean_hi"], h["knee"])
            ]
        ks = sorted(set(g["K"]))
        frame = pd.DataFrame({"K": ks, **{c: v for c, v in cols.items() if len(v) == len(ks)}})
        ep = _epochs(g["epochs"].iloc[0])
        chc = num(g["coupon"].iloc[0])
        blocks.append((f"{ds}, τ {short(tau)}, {ep} ({budget}), BatchNorm over {bn}; C·H_C = {chc} (◆: knee)", frame))
    return blocks


def figure(ctx: ReportContext, t: pd.DataFrame) -> list:
    """Top-1 against K (log₂) per probe (colour), one panel per data set (columns) and budget (rows),
    with 95 % intervals; the knee starred, C·H_C a dashed line; the whole-batch BatchNorm arms hollow."""
    from ..figures import plot_style

    plt, sns, rc = plot_style()
    panels = list(dict.fromkeys(zip(t["dataset"], t["temperature"])))
    budgets = sorted(set(t["epochs"]))
    pal = dict(zip(METRICS, sns.color_palette("tab10", len(METRICS))))
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(budgets), len(panels), figsize=(4.8 * len(panels) + 2.4, 3.2 * len(budgets)), squeeze=False
        )
        for i, ep in enumerate(budgets):
            for j, (ds, tau) in enumerate(panels):
                ax = axes[i][j]
                g = t[(t["epochs"] == ep) & (t["dataset"] == ds) & (t["temperature"] == tau)]
                for (m, bn), c in g.groupby(["metric", "bn"], sort=False):
                    c = c.sort_values("K")
                    hollow = bn == WHOLE and g["bn"].nunique() > 1
                    err = [(c["mean"] - c["mean_lo"]).fillna(0), (c["mean_hi"] - c["mean"]).fillna(0)]
                    ax.errorbar(c["K"], c["mean"], yerr=err, color=pal[m], marker="o", capsize=3, markersize=5,
                                mfc="white" if hollow else pal[m], ls=":" if hollow else "-", lw=1.2)  # fmt: skip
                    knee = c[c["K"] == c["knee"]]
                    ax.plot(knee["K"], knee["mean"], "*", color=pal[m], markersize=15, markeredgecolor="black")
                if len(g) and finite(g["coupon"].iloc[0]):
                    ax.axvline(float(g["coupon"].iloc[0]), color="#555555", ls="--", lw=1)
                ax.set_xscale("log", base=2)
                ks = sorted(set(g["K"]))
                ax.set_xticks(ks, [str(int(k)) for k in ks], fontsize=7)
                ax.minorticks_off()
                ax.set_title(f"{ds}, τ {short(tau)}, {_epochs(ep)}", fontsize=9)
                ax.set_xlabel("negatives per anchor K")
                ax.set_ylabel("top-1 (%)")
        handles = [
            plt.Line2D([], [], color=pal[m], marker="o", label=METRICS[m][1]) for m in METRICS if m in set(t["metric"])
        ]
        handles += [
            plt.Line2D([], [], color="black", marker="*", markersize=12, ls="none", label="knee"),
            plt.Line2D([], [], color="#555555", ls="--", label="C·H_C (coupon collector)"),
            plt.Line2D([], [], color="black", marker="o", mfc="white", ls=":", label=f"BatchNorm over {WHOLE}"),
        ]
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
        fig.suptitle(
            "Top-1 against the number of negatives K at one optimiser batch (mean, 95 % t interval)", fontsize=10
        )
        fig.tight_layout()
    return ctx.save_figure(fig, "kcurve")


def _spans(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str], float]:
    """(dataset, probe) -> supervised − random-init (means over their seeds), for a ``span`` margin."""
    base = baseline_values(runs, scale)
    mean = lambda v: sum(v.values()) / len(v) if v else math.nan  # noqa: E731
    return {
        (ds, m): mean(base.get((ds, "supervised", m), {})) - mean(base.get((ds, "random_init", m), {}))
        for (ds, _, m) in base
    }


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells = select_cells(runs, SECTION, (), ctx.notes)
    if cells.empty:
        return None
    out = SectionOutput(SECTION, "The negatives' dose-response (K at one batch)", "", run_ids=set(cells["run_id"]))
    long = k_rows(cells, ctx.scale)
    t = knee_table(long, ctx.plan, _spans(runs, ctx.scale))
    if t.empty:
        return None
    files = ctx.write_table("kcurve", "K dose-response: top-1 (%) against the negatives per anchor K", t, _display(t),
                            note="mean [95 % t interval] over seeds; knee: the smallest K from which every larger K is "
                            "equivalent to the largest (TOST within the analysis plan's margin, Holm over the curve)")  # fmt: skip
    out.files += files
    md = [f"K dose-response: {ctx.table_links(files)}"]
    fig = figure(ctx, t)
    out.files += fig
    md += ["", ctx.figure_md(fig, "K dose-response")]
    probes = (ctx.plan.primary, *ctx.plan.secondary)
    out.findings += findings(t, bn_rows(long), probes) + plateau_findings(k_plateaus(long), probes)
    out.markdown = "\n".join(md + [""] + [f"- {s}" for s in out.findings]) + "\n"
    return out
