"""Section 'ess': FlatNCE's Algorithm S1 (Chen et al. 2021).

The temperature chosen at every step so the effective sample size (ESS) of the
negatives' softmax weights follows a schedule, versus a fixed temperature, at
small and large batch: top-1, the scheduled − fixed effect, and the ESS and τ the
runs logged over training.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from ...tracking import BAD_STATUSES
from ..aggregate import aggregate_cells, display, pivot, shown, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, by_failure, describe, paired, support
from ..figures import binned, history, plot_style
from ..fmt import finite, runs_count, short, signed, slug
from ..runs import METRIC_LABELS, param_num, select_cells
from ..tables import markdown_table

FIXED = "fixed τ"
CLAIM = (
    "FlatNCE's Algorithm S1 claim: choosing τ at every step so that the effective sample size (ESS) of "
    "the negatives' softmax weights follows a schedule helps, in particular at small batch."
)
_KEYS = ["dataset", "loss", "label", "temperature", "batch_size", "schedule"]


def schedule_labels(cells: pd.DataFrame) -> pd.Series:
    """'ESS 0.9→0.3' from the ess_schedule params (or the cell id), 'fixed τ' without a schedule."""
    start, end = param_num(cells, "ess_schedule.start"), param_num(cells, "ess_schedule.end")
    out = []
    for cid, s, e in zip(cells["cell_id"], start, end):
        if not (finite(s) and finite(e)):
            mt = re.search(r"-ess([0-9.eE+-]+?)to([0-9.eE+-]+)(?:-|$)", str(cid))
            if mt:
                s, e = float(mt.group(1)), float(mt.group(2))
        out.append(f"ESS {s:g}→{e:g}" if finite(s) and finite(e) else FIXED)
    return pd.Series(out, index=cells.index, dtype=object)


def effect(agg: pd.DataFrame) -> pd.DataFrame:
    """Scheduled minus fixed-τ top-1 per cell, tested seed by seed (95 % paired-t interval, p; ``estimate``)."""
    keys = ["dataset", "metric", "loss", "label", "temperature", "batch_size"]
    rows = []
    for key, g in agg.groupby(keys, sort=False):
        fixed = g[g["schedule"] == FIXED]
        f = fixed.iloc[0] if len(fixed) else None
        for _, sch in g[g["schedule"] != FIXED].iterrows():
            rows.append(
                {
                    **dict(zip(keys, key)),
                    "schedule": sch["schedule"],
                    "fixed_mean": f["mean"] if f is not None else math.nan,
                    "fixed_std": f["std"] if f is not None else math.nan,
                    "fixed_n": int(f["n_seeds"]) if f is not None else 0,
                    "fixed_state": f["state"] if f is not None else "not run",
                    "scheduled_mean": sch["mean"],
                    "scheduled_std": sch["std"],
                    "scheduled_n": int(sch["n_seeds"]),
                    "scheduled_state": sch["state"],
                    "scheduled_minus_fixed": (sch["mean"] - f["mean"]) if f is not None else math.nan,
                    **_test_columns(
                        paired(sch.get("values") or {}, f.get("values") or {})
                        if f is not None
                        else Estimate(diff=math.nan)
                    ),
                }
            )
    return pd.DataFrame(rows)


def _test_columns(e: Estimate) -> dict[str, Any]:
    return {"ci_low": e.lo, "ci_high": e.hi, "test": e.test, "n_pairs": e.n, "p": e.p, "estimate": e}


def _run_stats(rid: str, meta: dict, hs: dict[str, pd.DataFrame]) -> dict[str, Any]:
    """One run's ESS, ESS-target and τ statistics over training."""
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
        row.update(
            {
                "tau_first": float(tau["value"].iloc[0]),
                "tau_last": float(tau["value"].iloc[-1]),
                "tau_min": float(tau["value"].min()),
                "tau_max": float(tau["value"].max()),
            }
        )
    return row


def dynamics(cells: pd.DataFrame, ctx: ReportContext) -> pd.DataFrame:
    """Per cell: means over seeds of the runs' ESS / ESS-target / τ statistics (empty without histories)."""
    cols = [*_KEYS, "seed"]
    hs = {k: history(cells, k, ctx, cols) for k in ("diag/ess", "diag/ess_target", "train/tau")}
    per_run = [
        row
        for rid in cells["run_id"]
        if len(row := _run_stats(rid, cells.loc[cells["run_id"] == rid, cols].iloc[0].to_dict(), hs)) > len(cols) + 1
    ]
    if not per_run:
        return pd.DataFrame()
    pr = pd.DataFrame(per_run)
    stats = [
        c
        for c in (
            "ess_mean",
            "ess_first",
            "ess_last",
            "ess_abs_dev_from_target",
            "target_first",
            "target_last",
            "tau_first",
            "tau_last",
            "tau_min",
            "tau_max",
        )
        if c in pr.columns
    ]
    dyn = pr.groupby(_KEYS, sort=False)[stats].mean().reset_index()
    dyn["n_runs"] = pr.groupby(_KEYS, sort=False)["run_id"].nunique().to_numpy()
    return sort_by_loss(dyn, _KEYS)


def _smallest_batch(r0: pd.Series) -> list[str]:
    """The verdict at the smallest batch: scheduled − fixed against seed noise."""
    bmin = int(r0["batch_size"])
    if not finite(r0["scheduled_minus_fixed"]):
        if r0["scheduled_state"] in BAD_STATUSES and finite(r0["fixed_mean"]):
            return [f"At the smallest batch ({bmin}) the scheduled runs {r0['scheduled_state']}: {by_failure(False)}."]
        if r0["fixed_state"] in BAD_STATUSES and finite(r0["scheduled_mean"]):
            return [
                f"At the smallest batch ({bmin}) the fixed-τ runs {r0['fixed_state']} and the scheduled ones "
                "did not: consistent with the claim."
            ]
        return [f"At the smallest batch ({bmin}) the claim cannot be tested yet."]
    diff, e = float(r0["scheduled_minus_fixed"]), r0.get("estimate")
    e = e if isinstance(e, Estimate) else Estimate(diff=diff)
    test = f"scheduled − fixed (points, 95 % paired-t interval over seeds) = {describe(e)}"
    if e.within_noise:
        return [
            f"At the smallest batch ({bmin}) {test}: these seeds do not separate the schedule from a fixed "
            f"τ, so {support(round(diff, 1) > 0, e)}."
        ]
    better = round(diff, 1) > 0
    return [
        f"At the smallest batch ({bmin}) the schedule is {'better' if better else 'not better'} than a "
        f"fixed τ: {support(better, e)}; {test}."
    ]


def _ci_text(r: pd.Series) -> str:
    """The difference's 95 % paired-t interval, or why it has none."""
    if finite(r.get("ci_low")):
        return f"95 % paired-t interval [{signed(r['ci_low'])}, {signed(r['ci_high'])}]"
    return "untested: fewer than two seeds with a spread"


def _held(dyn: pd.DataFrame, where: dict) -> list[str]:
    """How far the schedule moved τ and how closely it held the ESS target at the smallest batch."""
    if not len(dyn) or "tau_min" not in dyn.columns:
        return []
    dd = dyn
    for k, v in where.items():
        dd = dd[dd[k] == v]
    if not len(dd) or not finite(dd["tau_min"].iloc[0]):
        return []
    r = dd.iloc[0]
    txt = f"At B={where['batch_size']} the schedule moved τ within {r['tau_min']:.3g}–{r['tau_max']:.3g}"
    if "ess_abs_dev_from_target" in dd.columns and finite(r["ess_abs_dev_from_target"]):
        txt += f" and held the ESS within {r['ess_abs_dev_from_target']:.3g} of its target on average"
    return [txt + "."]


def finding(eff: pd.DataFrame, dyn: pd.DataFrame, ds: str, m: str, label: str, t: float, sched: str) -> str:
    """The schedule's effect per batch size and the verdict at the smallest batch, for one cell set."""
    d = eff[
        (eff["dataset"] == ds)
        & (eff["metric"] == m)
        & (eff["label"] == label)
        & (eff["temperature"] == t)
        & (eff["schedule"] == sched)
    ].sort_values("batch_size")
    parts = [
        f"at B={int(r['batch_size'])} the {sched} schedule changes top-1 by {r['scheduled_minus_fixed']:+.1f} "
        f"points ({r['scheduled_mean']:.1f} vs {r['fixed_mean']:.1f}; {_ci_text(r)})"
        if finite(r["scheduled_minus_fixed"])
        else f"at B={int(r['batch_size'])} no comparison (scheduled: {r['scheduled_state']}, fixed: {r['fixed_state']})"
        for _, r in d.iterrows()
    ]
    s = [
        f"ESS schedule on {ds} ({label}, fixed τ={short(t)}, {METRIC_LABELS.get(m, m)}): {CLAIM}",
        "We measured: " + "; ".join(parts) + ".",
    ]
    s += _smallest_batch(d.iloc[0])
    where = {
        "dataset": ds,
        "label": label,
        "temperature": t,
        "schedule": sched,
        "batch_size": int(d.iloc[0]["batch_size"]),
    }
    return " ".join(s + _held(dyn, where))


def _effect_blocks(eff: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    def shown_cell(r: pd.Series, who: str) -> str:
        return display(r[f"{who}_mean"], r[f"{who}_std"], r[f"{who}_state"])

    return [
        (
            f"{ds}, {METRIC_LABELS.get(m, m)}",
            pd.DataFrame(
                {
                    "loss": g["label"],
                    "τ": g["temperature"],
                    "schedule": g["schedule"],
                    "B": g["batch_size"].astype(int),
                    "fixed": [shown_cell(r, "fixed") for _, r in g.iterrows()],
                    "scheduled": [shown_cell(r, "scheduled") for _, r in g.iterrows()],
                    "scheduled − fixed": [signed(v) for v in g["scheduled_minus_fixed"]],
                    "95 % CI": [
                        f"[{signed(lo)}, {signed(hi)}]" if finite(lo) else "untested"
                        for lo, hi in zip(g["ci_low"], g["ci_high"])
                    ],
                }
            ).reset_index(drop=True),
        )
        for (ds, m), g in eff.groupby(["dataset", "metric"], sort=False)
    ]


def _tables(cells: pd.DataFrame, agg: pd.DataFrame, ctx: ReportContext, out: SectionOutput) -> list[str]:
    """The effect and dynamics tables and their findings; index.md's lines about them."""
    eff = effect(agg)
    md = []
    if len(eff):
        eblocks = _effect_blocks(eff)
        f_eff = ctx.write_table(
            "ess_effect",
            "ESS schedule: scheduled minus fixed temperature (points)",
            eff,
            eblocks,
            note="95 % CI = paired-t interval of scheduled − fixed over seeds (needs ≥ 2 seeds in "
            "common with a spread)",
        )
        out.files += f_eff
        md.append(f"Scheduled − fixed: {ctx.table_links(f_eff)}\n")
        md += [x for sub, df in eblocks for x in (f"**{sub}**\n", markdown_table(df))]
    else:
        md.append("_No pair of scheduled and fixed-τ cells: nothing to compare._\n")
    dyn = dynamics(cells, ctx)
    if len(dyn):
        f_dyn = ctx.write_table(
            "ess_dynamics",
            "ESS schedule: effective sample size and temperature over training",
            dyn,
            note="means over seeds of per-run statistics of diag/ess, diag/ess_target and "
            "train/tau (ESS normalised: 1/(K sum_j w_j^2), between 1/K and 1)",
        )
        out.files += f_dyn
        md.append(f"ESS and τ over training, per cell: {ctx.table_links(f_dyn)}\n")
    if len(eff):
        out.findings += [
            finding(eff, dyn, ds, m, lab, t, sch)
            for (ds, m, lab, t, sch), _ in eff.groupby(
                ["dataset", "metric", "label", "temperature", "schedule"], sort=False
            )
        ]
    return md


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """FlatNCE's Algorithm S1: ESS-scheduled temperature vs a fixed temperature at small and large batch."""
    cells = select_cells(runs, "ess", ("ess_schedule",), ctx.notes)
    if cells.empty:
        return None
    cells["schedule"] = schedule_labels(cells)
    out = SectionOutput(
        "ess", "Side experiment: ESS-scheduled temperature (FlatNCE, Algorithm S1)", "", run_ids=set(cells["run_id"])
    )
    agg = aggregate_cells(cells, _KEYS, ctx.scale, values=True)
    agg = sort_by_loss(
        agg.assign(_s=(agg["schedule"] != FIXED).astype(int)),
        ["dataset", "metric", "loss", "label", "temperature", "_s", "schedule", "batch_size"],
    ).drop(columns="_s")
    blocks = [
        (
            f"{ds}, {METRIC_LABELS.get(m, m)}",
            shown(pivot(g, ["label", "temperature", "schedule"], "batch_size", lambda b: f"B={int(b)}")),
        )
        for (ds, m), g in agg.groupby(["dataset", "metric"], sort=False)
    ]
    f_top = ctx.write_table(
        "ess_top1",
        "ESS schedule: top-1 (%) of ESS-scheduled vs fixed temperature",
        agg,
        blocks,
        note="τ = the fixed temperature (and the scheduled runs' starting value); mean ± sample "
        "std over seeds; '—' = one seed",
    )
    out.files += f_top
    md = [f"{runs_count(len(cells))} (experiment 'ess'). Top-1: {ctx.table_links(f_top)}\n"]
    md += _tables(cells, agg, ctx, out)
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = schedule_figure(cells[cells["dataset"] == ds], ds, ctx)
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out


def _draw(
    ax, sns, frames: dict, name: str, b: int, scheds: list, pal: dict, multi: bool, legend: bool, first_col: bool
) -> None:
    """One panel: ``name`` (ESS or τ) over training at batch size ``b``, one line per schedule."""
    d = frames[name][frames[name]["batch_size"] == b].copy()
    if multi:
        d["run"] = [f"{lab}, τ0={short(t)}" for lab, t in zip(d["label"], d["temperature"])]
    if len(d):
        sns.lineplot(
            data=d,
            x="progress",
            y="value",
            hue="schedule",
            hue_order=scheds,
            palette=pal,
            style="run" if multi else None,
            errorbar="sd",
            ax=ax,
            legend=legend,
        )
    if name == "ESS" and "ESS target" in frames:
        tg = frames["ESS target"][frames["ESS target"]["batch_size"] == b]
        if len(tg):
            sns.lineplot(
                data=tg,
                x="progress",
                y="value",
                color="k",
                ls="--",
                lw=1,
                errorbar=None,
                ax=ax,
                label="ESS target" if first_col else None,
            )
    v = frames[name]["value"]
    if name == "τ" and (v > 0).all() and v.max() / v.min() > 5:
        from matplotlib.ticker import FormatStrFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_title(f"{name} | batch size {b}")
    ax.set_xlabel("fraction of training (epoch / epochs)")
    ax.set_ylabel("ESS / K = 1/(K Σ w²)" if name == "ESS" else "temperature τ")


def schedule_figure(cells: pd.DataFrame, ds: str, ctx: ReportContext) -> tuple[list, str]:
    """ESS and τ over training, scheduled vs fixed, one column per batch size."""
    cols = ["label", "loss", "temperature", "batch_size", "schedule"]
    frames = {
        name: binned(h, cols)
        for key, name in (("diag/ess", "ESS"), ("diag/ess_target", "ESS target"), ("train/tau", "τ"))
        if len(h := history(cells, key, ctx, cols))
    }
    if "ESS" not in frames and "τ" not in frames:
        return [], f"_{ds}: no `diag/ess` or `train/tau` history for the ess runs; figure skipped._\n"
    plt, sns, rc = plot_style()
    bss = [int(b) for b in sorted(cells["batch_size"].unique())]
    rows = [n for n in ("ESS", "τ") if n in frames]
    scheds = sorted(cells["schedule"].unique(), key=lambda s: (s != FIXED, s))
    pal = dict(zip(scheds, sns.color_palette("tab10", len(scheds))))
    multi = cells["label"].nunique() > 1 or cells["temperature"].nunique() > 1
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(rows), len(bss), figsize=(3.6 * len(bss), 2.8 * len(rows)), squeeze=False, sharex=True
        )
        for i, name in enumerate(rows):
            for j, b in enumerate(bss):
                _draw(axes[i][j], sns, frames, name, b, scheds, pal, multi, i == 0 and j == 0, j == 0)
        fig.suptitle(f"{ds}: ESS schedule vs fixed τ over training", y=1.02)
        fig.tight_layout()
        files = ctx.save_figure(fig, f"ess_schedule_{slug(ds)}")
    return files, (
        f"**{ds}: ESS and τ over training** (`diag/ess`, dashed: `diag/ess_target`; `train/tau`; mean ± sd "
        "over seeds)\n\n" + ctx.figure_md(files, f"{ds} ESS schedule")
    )
