"""Section 'tsweep': SimCLR's Table 5 analogue.

Top-1 by loss x temperature at a fixed batch, the range of top-1 over τ per loss
(sensitivity to τ), and SimCLR's reported numbers side by side (their setting
differs).  The claim tested: the other losses depend less on τ than InfoNCE.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..aggregate import aggregate_cells, pivot, sort_by_loss
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, by_failure, contrast, describe, holm, support
from ..fmt import finite, join, num, runs_count, short
from ..runs import METRIC_LABELS, select_cells
from ..tables import markdown_table
from .papers import paper_setting, run_setting
from .sweep import sweep_figure, sweep_summary

SETTING = ["dataset", "batch_size"]
_LESS = "the claim that they depend less on τ"


def simclr_table5(papers: pd.DataFrame) -> pd.DataFrame:
    """SimCLR's Table 5 rows of the papers' CSV with a numeric τ and value."""
    p = papers[
        papers["paper"].astype(str).str.startswith("SimCLR")
        & papers["source"].astype(str).str.contains(r"\bTable 5\b", regex=True)
    ].copy()
    p["temperature"] = pd.to_numeric(p["temperature"], errors="coerce")
    p["value"] = pd.to_numeric(p["value"], errors="coerce")
    return p[np.isfinite(p["temperature"]) & np.isfinite(p["value"])].reset_index(drop=True)


def simclr_claim(t5: pd.DataFrame) -> str:
    """SimCLR Table 5 summarised from the CSV (l2-normalised rows: our embeddings are l2-normalised)."""
    if t5.empty:
        return "SimCLR's Table 5 is not in paper_results.csv, so no reported τ sensitivity to compare with."
    l2 = t5[t5["method"].astype(str).str.contains("l2-normalized", case=False)]
    l2 = l2 if len(l2) else t5
    best = l2.loc[l2["value"].idxmax()]
    taus = ", ".join(short(t) for t in sorted(l2["temperature"]))
    return (
        f"SimCLR (Table 5; {best['dataset']}, {best['backbone']}, batch {short(best['batch_size'])}, "
        f"{short(best['epochs'])} epochs, l2-normalised) found that τ matters for NT-Xent: best τ="
        f"{short(best['temperature'])} ({best['value']:.1f}%), a range of "
        f"{l2['value'].max() - l2['value'].min():.1f} points over τ ∈ {{{taus}}}."
    )


def _describe(r: pd.Series) -> str:
    if int(r["n_temperature_with_values"]) == 0:
        return f"{r['label']}: no value at any τ"
    txt = f"{r['label']} best τ={short(r['best_temperature'])} ({r['best_mean']:.1f}%), range {r['range']:.1f}"
    if int(r["n_temperature_with_values"]) < 2:
        txt += " (one τ only)"
    if r["temperature_diverged"]:
        txt += f", diverged at τ={r['temperature_diverged']}"
    return txt


def _range_tests(i: pd.Series, comparable: list) -> list:
    """Each loss's range minus InfoNCE's, seed by seed at the τ of each loss's best and worst mean
    (a difference of four cells; the τ are picked from the means), Holm over the losses."""
    out = []
    for r in comparable:
        e = contrast(
            [
                (1.0, r.get("values_best") or {}),
                (-1.0, r.get("values_worst") or {}),
                (-1.0, i.get("values_best") or {}),
                (1.0, i.get("values_worst") or {}),
            ]
        )
        out.append(e if finite(e.diff) else Estimate(diff=float(r["range"]) - float(i["range"])))
    return holm(out)


def _range_noise(i: pd.Series, comparable: list, tests: list) -> str | None:
    """The sentence when no range differs significantly from InfoNCE's; None otherwise."""
    clean = all(int(r["n_diverged_points"]) == 0 for r in [i, *comparable])
    if not (clean and finite(i["range"]) and tests) or any(e.significant for e in tests):
        return None
    worst = max(zip(comparable, tests), key=lambda p: abs(p[1].diff) if finite(p[1].diff) else -1.0)
    if not any(e.tested for e in tests):
        return (
            f"The ranges cannot be compared with InfoNCE's at these seeds (range − InfoNCE's range, largest: "
            f"{worst[0]['label']} {describe(worst[1])}), so "
            f"{support(False, None, 'the claim that the other losses depend less on τ')}."
        )
    return (
        f"No loss's range differs significantly from InfoNCE's (range − InfoNCE's range, 95 % paired-t "
        f"interval over seeds, Holm over {len(tests)}; largest: {worst[0]['label']} "
        f"{describe(worst[1])}): these seeds do not separate the losses' sensitivity to τ, so "
        f"{support(False, worst[1], 'the claim that the other losses depend less on τ')}."
    )


def _versus_infonce(d: pd.DataFrame) -> list[str]:
    """Whether the other losses are less sensitive to τ than InfoNCE."""
    inf, others = d[d["loss"] == "infonce"], d[d["loss"] != "infonce"]
    if inf.empty or int(inf.iloc[0]["n_temperature_with_values"]) < 2:
        return ["InfoNCE has values at fewer than two τ, so the other losses' sensitivity cannot be compared with it."]
    i = inf.iloc[0]
    comparable = [
        r for _, r in others.iterrows() if int(r["n_temperature_with_values"]) >= 2 or int(r["n_diverged_points"]) > 0
    ]
    if not comparable:
        return ["No other loss has values at two or more τ, so there is nothing to compare InfoNCE with."]
    tests = _range_tests(i, comparable)
    noise = _range_noise(i, comparable, tests)
    if noise:
        return [noise]
    failed = int(i["n_diverged_points"])
    less = [
        r["label"]
        for r, e in zip(comparable, tests)
        if int(r["n_diverged_points"]) <= failed
        and (int(r["n_diverged_points"]) < failed or (e.significant and e.diff < 0))
    ]
    more = [
        r["label"]
        for r, e in zip(comparable, tests)
        if int(r["n_diverged_points"]) > failed
        or (int(r["n_diverged_points"]) == failed and e.significant and e.diff > 0)
    ]
    same = [r["label"] for r in comparable if r["label"] not in less + more]
    said = (
        ([f"less sensitive to τ than InfoNCE: {join(less)}"] if less else [])
        + ([f"more sensitive: {join(more)}"] if more else [])
        + ([f"not separable from InfoNCE at these seeds: {join(same)}"] if same else [])
    )
    if less and not more and not same:
        verdict = f"consistent with {_LESS}"
    elif less:
        verdict = f"partly consistent with {_LESS}"
    elif more:
        sig = next((e for e in tests if e.significant), None)
        verdict = support(False, sig, _LESS) if sig else by_failure(False, _LESS)
    else:
        verdict = f"our numbers neither support nor refute {_LESS}"
    s = (
        f"By failed τ values first, then the range (a significant range difference): {'; '.join(said)}, so "
        f"{verdict}. Range − InfoNCE's range (95 % paired-t interval over seeds, Holm over the losses): "
        + "; ".join(f"{r['label']} {describe(e)}" for r, e in zip(comparable, tests))
        + "."
    )
    sets = {r["label"]: r["temperature_values"] for _, r in d.iterrows()}
    return [s] + (
        [
            "The losses have numbers at different sets of τ (a diverged or pending cell has none), so their "
            "ranges are not over the same values."
        ]
        if len(set(sets.values())) > 1
        else []
    )


def finding(summ: pd.DataFrame, claim: str, ds: str, m: str, b: int) -> str:
    """SimCLR's τ sensitivity next to ours, for one dataset, batch size and metric."""
    d = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["batch_size"] == b)]
    s = [f"Temperature sweep on {ds} (B={b}, {METRIC_LABELS.get(m, m)}): {claim}"]
    if not (len(d) and d["temperature_max"].iloc[0] != d["temperature_min"].iloc[0]):
        return " ".join(s + ["Only one τ was run, so sensitivity to τ cannot be measured."])
    s.append(
        "We measured: " + "; ".join(_describe(r) for _, r in d.iterrows()) + " (range = max − min of top-1 "
        "over τ, points)."
    )
    return " ".join(s + _versus_infonce(d))


def _summary(agg: pd.DataFrame) -> pd.DataFrame:
    summ = sweep_summary(agg, SETTING, "temperature")
    vals = (
        agg[np.isfinite(agg["mean"].astype(float))]
        .groupby(["dataset", "metric", "batch_size", "label"])["temperature"]
        .agg(lambda v: ", ".join(short(t) for t in sorted(v)))
    )
    summ["temperature_values"] = [
        vals.get((r["dataset"], r["metric"], r["batch_size"], r["label"]), "") for _, r in summ.iterrows()
    ]
    return summ


def _top1_blocks(agg: pd.DataFrame, summ: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Loss x τ per dataset, batch size and metric; * marks each loss's best τ; its range over τ."""
    blocks = []
    for (ds, m, b), g in agg.groupby(["dataset", "metric", "batch_size"], sort=False):
        g = g.sort_values("temperature", kind="stable").copy()
        sm = summ[(summ["dataset"] == ds) & (summ["metric"] == m) & (summ["batch_size"] == b)].set_index("label")
        g["disp"] = [
            d
            + (
                " *"
                if finite(sm.loc[lab, "best_temperature"])
                and t == sm.loc[lab, "best_temperature"]
                and int(sm.loc[lab, "n_temperature_with_values"]) > 1
                else ""
            )
            for d, lab, t in zip(g["display"], g["label"], g["temperature"])
        ]
        disp = pivot(g, ["label"], "temperature", lambda t: f"τ={short(t)}", value="disp")
        disp = disp.set_index("label").loc[list(dict.fromkeys(sort_by_loss(g, ["loss", "label"])["label"]))]
        disp = disp.reset_index()
        disp["range"] = [num(sm.loc[lab, "range"]) for lab in disp["label"]]
        blocks.append((f"{ds}, B={int(b)}, {METRIC_LABELS.get(m, m)}", disp.rename(columns={"label": "loss"})))
    return blocks


def _simclr_side(t5: pd.DataFrame, agg: pd.DataFrame, note: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(long table: SimCLR's rows and our InfoNCE cells, wide table: one column per series, rows τ)."""
    ours = agg[agg["loss"] == "infonce"]
    rows = [
        {
            "who": "paper: SimCLR Table 5",
            "dataset": r["dataset"],
            "batch_size": r["batch_size"],
            "method": r["method"],
            "temperature": r["temperature"],
            "metric": r["metric"],
            "value": r["value"],
            "display": f"{r['value']:.1f}",
            "status": r["status"],
        }
        for _, r in t5.iterrows()
    ]
    rows += [
        {
            "who": "ours",
            "dataset": r["dataset"],
            "batch_size": r["batch_size"],
            "method": r["label"],
            "temperature": r["temperature"],
            "metric": METRIC_LABELS.get(r["metric"], r["metric"]),
            "value": r["mean"],
            "display": r["display"],
            "status": r["state"],
        }
        for _, r in ours.iterrows()
    ]
    side = pd.DataFrame(rows).assign(note=note)
    taus = sorted(set(float(t) for t in side["temperature"]))
    wide = pd.DataFrame({"τ": [short(t) for t in taus]})
    for meth, g in t5.groupby("method", sort=False):
        d = dict(zip(g["temperature"].astype(float), g["value"]))
        wide[f"SimCLR T5: {meth} (B={short(g['batch_size'].iloc[0])})"] = [
            f"{d[t]:.1f}" if t in d else "" for t in taus
        ]
    for (ds, b, m), g in ours.groupby(["dataset", "batch_size", "metric"], sort=False):
        d = dict(zip(g["temperature"].astype(float), g["display"]))
        wide[f"ours: InfoNCE, {ds}, B={int(b)}, {METRIC_LABELS.get(m, m)}"] = [d.get(t, "") for t in taus]
    return side, wide


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    """SimCLR Table 5's analogue: top-1 by loss × temperature at a fixed batch; range over τ per loss."""
    cells = select_cells(runs, "tsweep", (), ctx.notes)
    if cells.empty:
        return None
    out = SectionOutput(
        "tsweep", "Side experiment: temperature sweep (SimCLR Table 5's analogue)", "", run_ids=set(cells["run_id"])
    )
    agg = sort_by_loss(
        aggregate_cells(cells, [*SETTING, "loss", "label", "temperature"], ctx.scale, values=True),
        ["dataset", "metric", "batch_size", "loss", "label", "temperature"],
    )
    summ = _summary(agg)
    blocks = _top1_blocks(agg, summ)
    f_top = ctx.write_table(
        "tsweep_top1",
        "Temperature sweep: top-1 (%) by loss × τ",
        agg,
        blocks,
        note="mean ± sample std over seeds; '—' = one seed; * = best τ for the loss; range = max − min over τ (points)",
    )
    f_sum = ctx.write_table(
        "tsweep_sensitivity",
        "Temperature sweep: best τ and range of top-1 over τ per loss",
        summ,
        note="range = max − min of the mean top-1 over the τ values with a number",
    )
    out.files += f_top + f_sum
    md = [
        f"{runs_count(len(cells))} (experiment 'tsweep'). Top-1 by τ: {ctx.table_links(f_top)}; "
        f"sensitivity to τ: {ctx.table_links(f_sum)}\n"
    ]
    md += [x for sub, df in blocks for x in (f"**{sub}**\n", markdown_table(df))]
    t5 = simclr_table5(ctx.papers)
    if len(t5):
        note = (
            f"SimCLR's setting ({paper_setting(t5)}) differs from ours ({run_setting(cells)}): "
            "compare the shape over τ, not absolute numbers"
        )
        side, wide = _simclr_side(t5, agg, note)
        f_pap = ctx.write_table(
            "tsweep_simclr_table5",
            "SimCLR Table 5 (NT-Xent top-1 by τ) next to our InfoNCE",
            side,
            [(None, wide)],
            note=note,
        )
        out.files += f_pap
        md += [
            f"SimCLR's Table 5 side by side with our InfoNCE (their setting differs): "
            f"{ctx.table_links(f_pap)}\n\n> Note: {note}.\n",
            markdown_table(wide),
        ]
    claim = simclr_claim(t5)
    out.findings += [
        finding(summ, claim, ds, m, int(b))
        for (ds, m, b), _ in agg.groupby(["dataset", "metric", "batch_size"], sort=False)
    ]
    md.append("### Figures\n")
    for ds in sorted(cells["dataset"].unique()):
        files, text = sweep_figure(
            cells[cells["dataset"] == ds],
            agg[agg["dataset"] == ds],
            ds,
            ctx,
            x="temperature",
            xlabel="temperature τ",
            base=10,
            stem="tsweep",
            title="top-1 vs temperature",
        )
        out.files += files
        md.append(text)
    out.markdown = "\n".join(md)
    return out
