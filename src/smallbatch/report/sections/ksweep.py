"""Section 'ksweep': EqCo's K sweep (Zhu et al. 2020).

Top-1 vs the number of negatives K (a MoCo-style queue of ``queue_size`` keys) per
loss at a fixed batch.  EqCo's claim: with α fixed, EqCo's accuracy stays flat as
K shrinks, while InfoNCE's drops at small K.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...tracking import BAD_STATUSES
from ..aggregate import aggregate_cells, pivot, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, by_failure, contrast, describe, holm, support
from ..fmt import finite, join, runs_count, short, signed
from ..runs import METRIC_LABELS, param_num, select_cells
from ..tables import markdown_table
from .papers import paper_setting, run_setting
from .sweep import sweep_figure, sweep_summary

SETTING = ["dataset", "temperature", "batch_size"]
CLAIM = (
    "EqCo's claim: with α fixed, EqCo's accuracy stays flat as the number of negatives K shrinks, "
    "while InfoNCE's drops at small K."
)


def setting_text(t: float, b: int) -> str:
    return f"B={int(b)}, τ={short(t)}"


def _change(r: pd.Series):
    """small − large K of one loss, seed by seed (untested from the means where no per-seed values were kept)."""
    e = contrast([(1.0, r.get("values_small") or {}), (-1.0, r.get("values_large") or {})])
    return e if finite(e.diff) else Estimate(diff=float(r["mean_small"]) - float(r["mean_large"]))


def _compare(i: pd.Series, e: pd.Series, kmin: int) -> list[str]:
    """InfoNCE's and EqCo's changes from the largest to the smallest K, each tested seed by seed, and
    their difference (Holm over the three)."""
    ci, ce = _change(i), _change(e)
    cd = contrast(
        [
            (1.0, e.get("values_small") or {}),
            (-1.0, e.get("values_large") or {}),
            (-1.0, i.get("values_small") or {}),
            (1.0, i.get("values_large") or {}),
        ]
    )
    ti, te, tdiff = holm([ci, ce, cd if finite(cd.diff) else Estimate(diff=ce.diff - ci.diff)])
    di, de = -float(i["change_large_to_small"]), -float(e["change_large_to_small"])
    tests = (
        f"(small − large K, points, 95 % paired-t intervals over seeds, Holm over 3): InfoNCE "
        f"{describe(ti)}; {e['label']} {describe(te)}; {e['label']} − InfoNCE {describe(tdiff)}."
    )
    if round(di, 1) <= 0:
        s = [
            f"InfoNCE does not lose accuracy at small K here ({-di:+.1f} points), so the premise of the claim does "
            "not hold in our setting."
        ]
    elif not ti.significant:
        s = [
            f"InfoNCE's loss at small K ({di:.1f} points) is {'untested' if ti.significant is None else 'not significant'}"
            ", so the premise of the claim is not established in our setting."
        ]
    elif not tdiff.significant:
        s = [
            f"{e['label']} loses {de:.1f} and InfoNCE {di:.1f} points; their difference is "
            f"{'untested' if tdiff.significant is None else 'not significant'}, so these seeds do not separate them."
        ]
    elif round(de, 1) < round(di, 1):
        s = [f"{e['label']} loses less than InfoNCE ({de:.1f} vs {di:.1f} points): consistent with the claim."]
    else:
        s = [
            f"{e['label']} loses as much as or more than InfoNCE ({de:.1f} vs {di:.1f} points): "
            f"{support(False, tdiff)}."
        ]
    if finite(e["mean_small"]):
        s.append(
            "With fewer than two seeds with a spread, 'flat' is not tested."
            if te.significant is None
            else f"EqCo's change is {'not ' if te.significant else ''}significant, so it "
            f"{'is not' if te.significant else 'is'} flat within seed noise."
        )
    return s + [f"Tests {tests}"]


def _verdict(d: pd.DataFrame, kmin: int, kmax: int) -> list[str]:
    inf, eq = d[d["loss"] == "infonce"], d[d["loss"] == "eqco"]
    if inf.empty or eq.empty:
        missing = "InfoNCE" if inf.empty else "EqCo"
        return [f"The claim needs both InfoNCE and EqCo in the sweep; {missing} was not run."]
    i, e = inf.iloc[0], eq.iloc[0]
    if i["state_small"] in BAD_STATUSES and finite(e["change_large_to_small"]):
        return [
            f"InfoNCE {i['state_small']} at K={kmin} while {e['label']} changed by "
            f"{e['change_large_to_small']:+.1f} points: consistent with the claim."
        ]
    if e["state_small"] in BAD_STATUSES and finite(i["mean_small"]):
        return [f"{e['label']} {e['state_small']} at K={kmin} while InfoNCE trained: {by_failure(False)}."]
    if not (finite(i["change_large_to_small"]) and finite(e["change_large_to_small"])):
        return [f"The claim cannot be tested: InfoNCE or EqCo has no value at K={kmin} or K={kmax}."]
    return _compare(i, e, kmin)


def finding(summ: pd.DataFrame, ds: str, m: str, t: float, b: int, n_images: float) -> str:
    """EqCo's claim against the sweep of one dataset, τ, batch size and metric."""
    d = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["temperature"] == t) & (summ["batch_size"] == b)]
    s = [f"K sweep on {ds} ({setting_text(t, b)}, {METRIC_LABELS.get(m, m)}): {CLAIM}"]
    kmin, kmax = int(d["K_min"].iloc[0]), int(d["K_max"].iloc[0])
    if kmin == kmax:
        return " ".join(s + [f"Only K={kmin} was run, so the dependence on K cannot be measured."])
    ch = [
        f"{r['label']} {r['change_large_to_small']:+.1f}"
        if finite(r["change_large_to_small"])
        else f"{r['label']} — (K={kmin}: {r['state_small']}, K={kmax}: {r['state_large']})"
        for _, r in d.iterrows()
    ]
    s.append(f"We measured, from K={kmax} to K={kmin}: " + ", ".join(ch) + " points.")
    s += _verdict(d, kmin, kmax)
    if finite(n_images):
        big = sorted(int(k) for k in summ.loc[(summ["dataset"] == ds), "K_max"].unique() if k > n_images)
        over = [k for k in sorted({kmin, kmax}) if k > n_images]
        if over or big:
            s.append(
                f"K={join([str(k) for k in (over or big)])} exceeds the {int(n_images)} pretraining images: "
                "the queue then holds several older keys of the same images (an anchor's own keys are masked)."
            )
    return " ".join(s)


def _top1_blocks(agg: pd.DataFrame, summ: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for (ds, m, t, b), g in agg.groupby(["dataset", "metric", "temperature", "batch_size"], sort=False):
        disp = pivot(g.sort_values("K", kind="stable"), ["label"], "K", lambda v: f"K={int(v)}")
        disp = disp.set_index("label").loc[list(dict.fromkeys(g["label"]))].reset_index()
        sm = summ[
            (summ["dataset"] == ds) & (summ["metric"] == m) & (summ["temperature"] == t) & (summ["batch_size"] == b)
        ].set_index("label")
        kmin, kmax = int(g["K"].min()), int(g["K"].max())
        if kmax != kmin:
            disp[f"change K {kmax}→{kmin}"] = [signed(sm.loc[lab, "change_large_to_small"]) for lab in disp["label"]]
        blocks.append(
            (f"{ds}, {setting_text(t, b)}, {METRIC_LABELS.get(m, m)}", disp.rename(columns={"label": "loss"}))
        )
    return blocks


def _paper_table(cells: pd.DataFrame, ctx: ReportContext) -> tuple[list, list[str]]:
    """EqCo's reported numbers (their setting differs), when paper_results.csv has them."""
    eq = ctx.papers[ctx.papers["paper"].astype(str).str.startswith("EqCo")]
    if eq.empty:
        return [], []
    note = (
        f"EqCo's setting ({paper_setting(eq)}) differs from ours ({run_setting(cells)}): compare trends in K, "
        "not absolute numbers"
    )
    cols = [
        c
        for c in (
            "method",
            "batch_size",
            "negatives",
            "temperature",
            "epochs",
            "dataset",
            "backbone",
            "metric",
            "value",
            "source",
            "status",
        )
        if c in eq.columns
    ]
    files = ctx.write_table(
        "ksweep_eqco_paper",
        "EqCo's reported numbers (Zhu et al. 2020)",
        eq[[*cols]].assign(note=note),
        [(None, eq[cols].reset_index(drop=True))],
        note=note,
    )
    return files, [f"EqCo's reported numbers for comparison (their setting differs): {ctx.table_links(files)}\n"]


def _over_images(cells: pd.DataFrame, n_img: pd.Series) -> list[str]:
    md = []
    for ds, n in n_img.items():
        over = sorted(int(k) for k in cells.loc[cells["dataset"] == ds, "K"].unique() if k > n) if finite(n) else []
        if over:
            md.append(
                f"_On {ds}, K={join([str(k) for k in over])} exceeds the {int(n)} pretraining images: the "
                "queue then holds several older keys of the same images; an anchor's own keys are masked, "
                "the rest are repeated keys of other images._\n"
            )
    return md


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """EqCo's K sweep: top-1 vs the number of negatives K (queue length) per loss at a fixed batch."""
    cells = select_cells(runs, "ksweep", ("queue_size",), ctx.notes)
    if cells.empty:
        return None
    q, k = param_num(cells, "queue_size"), param_num(cells, "negatives")
    cells["K"] = np.where(q > 0, q, k)
    bad = ~np.isfinite(cells["K"].astype(float))
    if bad.any():
        ctx.notes.append(
            f"{int(bad.sum())} 'ksweep' run(s) log neither queue_size nor negatives and are not in the K-sweep tables."
        )
    out = SectionOutput(
        "ksweep", "Side experiment: number of negatives K (EqCo's K sweep)", "", run_ids=set(cells["run_id"])
    )
    cells = cells[~bad].copy()
    if cells.empty:
        out.markdown = "No 'ksweep' run logs its K (queue_size or negatives).\n"
        return out
    cells["K"] = cells["K"].astype(int)
    n_img = param_num(cells, "pretrain_images").groupby(cells["dataset"]).max()
    agg = sort_by_loss(
        aggregate_cells(cells, [*SETTING, "loss", "label", "K"], ctx.scale, values=True),
        ["dataset", "metric", "temperature", "batch_size", "loss", "label", "K"],
    )
    summ = sweep_summary(agg, SETTING, "K")
    blocks = _top1_blocks(agg, summ)
    f_top = ctx.write_table(
        "ksweep_top1",
        "K sweep: top-1 (%) by loss × number of negatives K (queue length)",
        agg,
        blocks,
        note="K = queue_size (MoCo-style momentum queue); mean ± sample std over seeds; '—' = one seed",
    )
    f_sum = ctx.write_table(
        "ksweep_sensitivity",
        "K sweep: top-1 change from the largest to the smallest K per loss",
        summ,
        note="change = mean at the smallest K − mean at the largest K; range = max − min of the means over K",
    )
    f_pap, md_pap = _paper_table(cells, ctx)
    out.files += f_top + f_sum + f_pap
    md = [
        f"{runs_count(len(cells))} (experiment 'ksweep'). Top-1 by K: {ctx.table_links(f_top)}; "
        f"change with K: {ctx.table_links(f_sum)}\n"
    ]
    md += [x for sub, df in blocks for x in (f"**{sub}**\n", markdown_table(df))] + md_pap + _over_images(cells, n_img)
    settings = agg.groupby(["dataset", "metric", "temperature", "batch_size"], sort=False)
    out.findings += [finding(summ, ds, m, t, b, n_img.get(ds, math.nan)) for (ds, m, t, b), _ in settings]
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = sweep_figure(
            cells[cells["dataset"] == ds],
            agg[agg["dataset"] == ds],
            ds,
            ctx,
            x="K",
            xlabel="negatives per anchor K (queue length)",
            base=2,
            stem="ksweep",
            vline=n_img.get(ds, math.nan),
            title="top-1 vs K",
        )
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out
