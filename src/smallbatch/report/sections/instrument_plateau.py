"""The instrument over training budgets: each arm's plateau per probe, each contrast as a curve.

Per data set, τ, arm and probe, the arm's seeds at every fixed-epochs budget of the reference arm
(each read at the rate its unit reads it: the validated one) make a curve, and the plateau rule
(:mod:`smallbatch.report.plateau`) gives the budget at which it stopped moving, or says that it
still moves.  A contrast's plateau on a probe is the latest of its arms' (none when one of its arms
has none): its row at that budget is the instrument's answer at convergence, and a claim is worded
there only when every arm it compares has stopped moving.
"""

from __future__ import annotations

import math

import pandas as pd

from ..fmt import finite, num, short, signed
from ..plateau import plateau
from .instrument_budgets import METRICS, seed_values

__all__ = ["arm_curves", "arm_plateaus", "contrast_curves", "plateau_display", "curve_display", "curve_figure"]

#: the marker of a contrast's plateau budget in the tables
MARK = "◆"


def arm_curves(results) -> dict[tuple, dict[float, dict[int, float]]]:
    """(dataset, τ, arm, probe) -> {epochs: {seed: value}} over the fixed-epochs units of ``results``."""
    out: dict[tuple, dict[float, dict[int, float]]] = {}
    for r in results:
        u = r.unit
        if u.view != "epochs" or not finite(u.epochs):
            continue
        for arm, a in r.arms.items():
            for m in METRICS:
                v = seed_values(a, m)
                if v:
                    out.setdefault((u.dataset, u.temperature, arm, m), {})[float(u.epochs)] = v
    return out


def arm_plateaus(results) -> pd.DataFrame:
    """One row per data set, τ, arm and probe: its budgets, its plateau (epochs; NaN without one),
    the rule's status, its last doubling's change and MDE, and the rule's reading in words."""
    rows = []
    for (ds, tau, arm, m), curve in sorted(arm_curves(results).items()):
        p = plateau(curve)
        last = p.steps[-1] if p.steps else None
        rows.append(
            {
                "dataset": ds,
                "temperature": tau,
                "arm": arm,
                "metric": m,
                "metric_label": METRICS[m][1],
                "budgets": "/".join(short(b) for b in sorted(curve)),
                "longest": max(curve),
                "plateau": p.epochs,
                "status": p.status,
                "last_change": last.change if last else math.nan,
                "last_mde": last.mde if last else math.nan,
                "reading": p.text(),
            }
        )
    return pd.DataFrame(rows)


def contrast_curves(claims: pd.DataFrame, plateaus: pd.DataFrame) -> pd.DataFrame:
    """The fixed-epochs contrast rows, each with ``plateau`` (its contrast's on that probe: the
    latest of its arms'; NaN when one of them has none) and ``at_plateau`` (the row at it)."""
    if claims.empty or plateaus.empty:
        return pd.DataFrame()
    c = claims[claims["view"] == "epochs"].copy()
    known = {(r.dataset, r.temperature, r.arm, r.metric): r.plateau for r in plateaus.itertuples(index=False)}

    def of(r) -> float:
        ps = [known.get((r.dataset, r.temperature, arm, r.metric), math.nan) for arm in str(r.arms).split("|")]
        return max(ps) if ps and all(finite(p) for p in ps) else math.nan

    c["plateau"] = [of(r) for r in c.itertuples(index=False)]
    c["at_plateau"] = [finite(p) and math.isclose(e, p) for e, p in zip(c["epochs"], c["plateau"])]
    return c


# --------------------------------------------------------------------------- tables
def plateau_display(plateaus: pd.DataFrame, label) -> list[tuple[str, pd.DataFrame]]:
    """Per data set and τ: arm × probe, each cell its plateau (epochs) or 'moving', with the last
    doubling's change and MDE.  ``label``: arm -> its name in words."""
    blocks = []
    for (ds, tau), g in plateaus.groupby(["dataset", "temperature"], sort=True):
        cell = [
            f"{short(p) if finite(p) else s} ({signed(c, 2)}; MDE {num(d, 2)})"
            for p, s, c, d in zip(g["plateau"], g["status"], g["last_change"], g["last_mde"])
        ]
        t = g.assign(arm_label=[label(a) for a in g["arm"]], v=cell)
        t = t.pivot_table(index="arm_label", columns="metric_label", values="v", aggfunc="first")
        t = (
            t[[lab for _, lab in METRICS.values() if lab in t.columns]]
            .reset_index()
            .rename(columns={"arm_label": "arm"})
        )
        blocks.append((f"{ds}, τ {short(tau)}: plateau (epochs) per arm and probe (last doubling: change; MDE)", t))
    return blocks


def curve_display(curves: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Per data set, τ and probe: each contrast over the budgets (small − large [95 % CI]), its
    plateau budget marked, and its outcome there."""
    blocks = []
    for (ds, tau, m), g in curves.groupby(["dataset", "temperature", "metric"], sort=True):
        cols: dict[str, dict[str, str]] = {}
        for r in g.sort_values("epochs").itertuples(index=False):
            v = f"{signed(r.diff, 2)} [{signed(r.lo, 2)}, {signed(r.hi, 2)}]" if finite(r.lo) else signed(r.diff, 2)
            cols.setdefault(f"{short(r.epochs)} ep", {})[r.contrast] = f"{MARK} {v}" if r.at_plateau else v
        t = pd.DataFrame(cols)
        first = g.drop_duplicates("contrast").set_index("contrast")
        at = g[g["at_plateau"]].set_index("contrast")
        t["plateau (epochs)"] = [
            short(first.at[c, "plateau"]) if finite(first.at[c, "plateau"]) else "none yet" for c in t.index
        ]
        t["outcome at plateau"] = [at.at[c, "outcome"] if c in at.index else "—" for c in t.index]
        blocks.append(
            (
                f"{ds}, τ {short(tau)}, {METRICS[m][1]}: contrasts over budgets ({MARK}: plateau)",
                t.reset_index(names="contrast"),
            )
        )
    return blocks


# --------------------------------------------------------------------------- the figure
def curve_figure(ctx, curves: pd.DataFrame, probes: tuple[str, ...]) -> list:
    """The claimed contrasts and the positive control over the budgets (log₂ epochs), one panel per
    probe of ``probes`` (rows) and data set and τ (columns), with 95 % intervals; a contrast's plateau
    is a star, and a dotted line of its colour."""
    from ..figures import plot_style

    keep = (curves["claimed"] | (curves["key"] == "control")) & curves["metric"].isin(probes) if len(curves) else []
    d = curves[keep & curves["diff"].map(finite)] if len(curves) else curves
    if d.empty:
        return []
    plt, sns, rc = plot_style()
    panels = list(dict.fromkeys(zip(d["dataset"], d["temperature"])))
    rows = [p for p in probes if p in set(d["metric"])]
    names = list(dict.fromkeys(d["contrast"]))
    pal = dict(zip(names, sns.color_palette("tab10", len(names))))
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(rows), len(panels), figsize=(4.6 * len(panels) + 3.2, 3.0 * len(rows)), squeeze=False, sharex=True
        )
        for i, m in enumerate(rows):
            for j, (ds, tau) in enumerate(panels):
                ax = axes[i][j]
                g = d[(d["metric"] == m) & (d["dataset"] == ds) & (d["temperature"] == tau)].sort_values("epochs")
                _panel(ax, g, pal)
                ax.set_xscale("log", base=2)
                ticks = sorted(set(d["epochs"]))
                ax.set_xticks(ticks, [short(t) for t in ticks])
                ax.minorticks_off()
                ax.set_title(f"{ds}, τ {short(tau)}: {METRICS[m][1]}", fontsize=9)
                ax.set_xlabel("budget (epochs)")
                ax.set_ylabel("small − large (points)")
        handles = [plt.Line2D([], [], color=pal[n], marker="o", label=n) for n in names]
        handles.append(plt.Line2D([], [], color="black", marker="*", markersize=11, linestyle="none", label="plateau"))
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
        fig.suptitle(
            "Contrasts over training budgets (paired, 95 % t intervals); ★ the contrast's plateau", fontsize=10
        )
        fig.tight_layout()
    return ctx.save_figure(fig, "instrument_curves")


def _panel(ax, g: pd.DataFrame, pal: dict) -> None:
    ax.axhline(0, color="#555555", lw=0.8)
    for name, c in g.groupby("contrast", sort=False):
        col = pal[name]
        err = [(c["diff"] - c["lo"]).fillna(0).to_numpy(), (c["hi"] - c["diff"]).fillna(0).to_numpy()]
        ax.errorbar(c["epochs"], c["diff"], yerr=err, color=col, marker="o", markersize=4, capsize=3, lw=1.2)
        at = c[c["at_plateau"]]
        if len(at):
            ax.plot(at["epochs"], at["diff"], marker="*", color=col, markersize=14, markeredgecolor="black", zorder=5)
            ax.axvline(float(at["epochs"].iloc[0]), color=col, lw=0.8, ls=":")
