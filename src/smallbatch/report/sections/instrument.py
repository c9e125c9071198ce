"""Section 'instrument': does the number of negatives matter, at which training length, learning
rate and temperature, and can the instrument see it at all?

The instrument study (``workflow/configs/instrument.yaml``) trains, per data set, τ and seed,
the arms of a 2 x 2 of the optimiser's batch (steps) and the negatives per anchor
(:mod:`.instrument_contrasts`: InfoNCE at B = 256, at 256 with negatives within groups of 16,
at 16, and at 16 with 240 fresh negatives), a positive control (negatives within groups of 2),
the earlier controls where they ran (DCL and SogCLR at 16, the oracle mask, 16 stopped at
256's steps), each batch size at a grid of learning rates, with BatchNorm over groups of the
same size in every arm, and evaluates every cell at several budgets (snapshots of its run).

The analysis plan comes first (:mod:`smallbatch.report.plan`, the config's ``analysis``).  Per
data set, τ and budget the section computes the validity gates (:mod:`.instrument_gates`), then
per view (fixed epochs, fixed steps) the contrasts at each batch size's validated learning rate
(:mod:`.instrument_budgets`), each paired by seed, each row naming its reference arm; the plan
marks the claimed ones, resolves the margin, corrects over its family and words each claim
resolved (significant / equivalent) or unresolved (interval and MDE, no verdict).  A verdict is
written only for a unit whose gates all pass; a failed gate is printed with its numbers.

Every number comes from one per-seed table (``instrument_seeds.csv``: one row per arm, rate,
seed, budget and probe, and the baselines' seeds), which the section writes and then reads back
(:func:`from_seed_table`): the contrasts can be rebuilt by anyone from that file alone
(:func:`analyse_seeds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from ...evaluation.gap import gap_fraction
from ...losses.registry import display_name
from ...tracking import BAD_STATUSES
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, describe, describe_mde, p_text
from ..fmt import finite, num, short
from ..plan import RESOLVED, AnalysisPlan, apply_plan, family_estimate
from ..runs import select_cells
from .baselines import baseline_runs
from .instrument_budgets import (
    METRICS,
    OPT_IN,
    PRIMARY,
    VAL_METRIC,
    Unit,
    arm_of,
    arm_rows,
    batch_levels,
    budget_rows,
    chosen_lrs,
    from_seed_table,
    lr_means,
    matched,
    seed_table,
    seed_values,
    units,
)
from .instrument_contrasts import unit_contrasts
from .instrument_gates import Gate, g1, g2, g3, passed, versus_baseline
from .instrument_plateau import arm_plateaus, contrast_curves, curve_display, curve_figure, plateau_display

__all__ = ["METRICS", "VAL_METRIC", "arm_of", "build", "analyse", "analyse_seeds", "findings"]

SECTION = "instrument"


@dataclass
class UnitResult:
    """One unit analysed: its rates per batch size, its arms' rows at them, its contrast rows,
    the positive control and its gates (G1-G3 of its data set, τ and budget)."""

    unit: Unit
    lrs: dict
    arms: dict
    rows: list = field(default_factory=list)
    gates: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return passed(self.gates)


def baseline_values(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str, str], dict]:
    """(dataset, baseline, metric) -> {seed: top-1 %} of the baselines (raw pixels, random-init, supervised);
    a baseline without a seed (raw pixels: nothing random) is keyed 0."""
    b = baseline_runs(runs)
    out = {}
    for (ds, name), g in b.groupby(["dataset", "baseline"], sort=True):
        ok = g[~g["status"].isin(BAD_STATUSES)]
        for m, (key, _) in METRICS.items():
            col = f"metrics.{key}"
            vals = zip(ok["seed"], ok[col]) if col in ok else ()
            out[(ds, str(name), m)] = {int(s) if pd.notna(s) else 0: float(v) * scale for s, v in vals if finite(v)}
    return out


def _mean(v: dict) -> float:
    return sum(v.values()) / len(v) if v else math.nan


def analyse(rows: pd.DataFrame, base: dict) -> list[UnitResult]:
    """Every unit with its rates, arms, contrasts and gates."""
    small, big = batch_levels(rows)
    out: list[UnitResult] = []
    if small is None or big is None:  # no plain InfoNCE arm, so no unit (units)
        return out
    for unit in units(rows):
        g = matched(rows, unit)
        lrs = chosen_lrs(g)
        res = UnitResult(unit, lrs, arm_rows(g, lrs))
        span = {
            m: _mean(base.get((unit.dataset, "supervised", m), {}))
            - _mean(base.get((unit.dataset, "random_init", m), {}))
            for m in METRICS
        }
        res.rows, control = unit_contrasts(unit, res.arms, small, big, span)
        ref = reference_label(res, big)
        res.rows = [{**r, "reference": ref} for r in res.rows]
        res.gates = _gates(res, control, base, big)
        out.append(res)
    return out


def reference_label(res: UnitResult, big: int) -> str:
    """The unit's reference arm as every contrast row names it: arm, rate, τ and seeds."""
    arm = f"infonce@{big}"
    if arm not in res.arms:
        return "—"
    a = res.arms[arm]
    n = len(seed_values(a, PRIMARY))
    return f"{arm_label(arm)}, lr {short(float(a['lr'].iloc[0]))}, τ {short(res.unit.temperature)}, {n} seeds"


def _gates(res: UnitResult, control: dict, base: dict, big: int) -> list[Gate]:
    ds, ref = res.unit.dataset, f"infonce@{big}"
    at = lambda name: base.get((ds, name, PRIMARY), {})  # noqa: E731
    ssl = seed_values(res.arms[ref], PRIMARY) if ref in res.arms else {}
    full = arm_label(ref)
    return [
        g1(at("supervised"), at("raw_pixels")),
        g2(ssl, at("raw_pixels"), at("random_init"), full),
        g3(control.get(PRIMARY), arm_label(control["arm"]) if control.get("arm") else "", full),
    ]


# --------------------------------------------------------------------------- labels
def arm_label(arm: str) -> str:
    """``InfoNCE B=256, G=16 (K=30)``, ``InfoNCE B=16, +240 fresh (K=510)``, ``... oracle mask``."""
    loss, rest = arm.split("@")
    size, *marks = rest.split("/")
    text = f"{display_name(loss)} B={size}"
    for m in marks:
        if m.startswith("G"):
            text += f", G={m[1:]} (K={2 * int(m[1:]) - 2})"
        elif m.startswith("X"):
            text += f", +{m[1:]} fresh (K={2 * (int(size) + int(m[1:])) - 2})"
        elif m == "S":
            text += ", equal steps"
        else:
            text += ", oracle mask"
    return text


def _rates(lrs: dict) -> str:
    return ", ".join(f"B={b}: lr {short(lr)}" for b, lr in sorted(lrs.items()) if lr)


def off_rate(res: UnitResult) -> list[str]:
    """The arms a unit reads at a rate other than their batch size's validated one (an arm run
    at one rate only), named with both rates."""
    out = []
    for arm, a in res.arms.items():
        bs, lr = int(a["batch_size"].iloc[0]), float(a["lr"].iloc[0])
        chosen = res.lrs.get(bs)
        if chosen is not None and not math.isclose(lr, chosen):
            out.append(f"{arm_label(arm)} at lr {short(lr)} (its only rate; B={bs}'s validated lr is {short(chosen)})")
    return out


# --------------------------------------------------------------------------- findings
def gate_findings(results: list[UnitResult], claims: pd.DataFrame, plan: AnalysisPlan) -> list[str]:
    """One line per data set, τ and budget: every gate with its numbers, then the plan's margin
    resolved to points for each planned probe (before any claim is read)."""
    out: list[str] = []
    seen: dict[tuple, UnitResult] = {}
    for r in results:
        seen.setdefault(r.unit.gate_key, r)
    for r in seen.values():
        head = r.unit.label().split(" (fixed")[0]
        out.append(f"Gates, {head}: " + "; ".join(g.line() for g in r.gates) + f"; {_margins(r, claims, plan)}.")
    return out


def _margins(res: UnitResult, claims: pd.DataFrame, plan: AnalysisPlan) -> str:
    """``margin: linear probe ± 1.50 points, kNN@20 ± 0.90 points`` of one data set, τ and budget."""
    if claims.empty:
        return "margin: no contrast"
    u = res.unit
    mine = claims[(claims["dataset"] == u.dataset) & (claims["temperature"] == u.temperature)]
    mine = mine[mine["budget"] == u.budget]
    parts = []
    for probe in (plan.primary, *plan.secondary):
        m = mine[mine["metric"] == probe]["margin"]
        v = float(m.iloc[0]) if len(m) else math.nan
        parts.append(f"{METRICS[probe][1]} ± {num(v, 2)} points" if finite(v) else f"{METRICS[probe][1]} unresolved")
    return "margin: " + ", ".join(parts)


def claim_clause(row) -> str:
    """A claimed contrast in words: its interval with the family's p, then resolved (its outcome and
    the number that decides it) or unresolved (its MDE, no verdict word)."""
    e = family_estimate(row.estimate, row)
    head = f"{row.contrast} {describe(e, null_mde=False)}"
    tp = row.tost_family
    tost = f"TOST Holm p {'< 0.001' if tp < 0.001 else '= ' + p_text(tp)}" if finite(tp) else "TOST not run"
    margin = f"± {num(row.margin, 2)} points" if finite(row.margin) else "no margin (its control did not run)"
    if row.outcome == "significant":
        return f"{head} — resolved: significant"
    if row.outcome == "equivalent":
        return f"{head} — resolved: equivalent within {margin} ({tost})"
    mde = describe_mde(e, 2)
    return f"{head} — unresolved, no verdict ({tost} within {margin}{'; ' + mde if mde else ''})"


def verdict(res: UnitResult, claims: pd.DataFrame, plan: AnalysisPlan) -> list[str]:
    """The unit's claimed contrasts in words, primary probe first (only for a unit whose gates pass)."""
    if not res.ok:
        failed = [g.name for g in res.gates if g.passed is not True]
        return [f"No verdict on negatives or steps for {res.unit.label()}: {', '.join(failed)} not passed."]
    mine = claims[(claims["unit"] == res.unit.label()) & claims["claimed"]]
    out = []
    for probe in (plan.primary, *plan.secondary):
        rows = list(mine[mine["metric"] == probe].itertuples(index=False))
        if not rows:
            continue
        role = "" if probe == plan.primary else " (secondary)"
        head = f"{res.unit.label()}, {METRICS[probe][1]}{role}" + (
            f", at the validated lr ({_rates(res.lrs)})" if _rates(res.lrs) else ""
        )
        out.append(f"{head}: " + "; ".join(claim_clause(r) for r in rows) + ".")
    off = off_rate(res)
    if out and off:
        out.append(f"{res.unit.label()}: read at another rate than the validated one: " + "; ".join(off) + ".")
    return out


def findings(results: list[UnitResult], claims: pd.DataFrame, plan: AnalysisPlan) -> list[str]:
    """The plan first, then the gates (every data set, τ and budget), then each unit's claims or
    why there is no verdict."""
    n = int(claims["claimed"].sum()) if len(claims) else 0
    resolved = int((claims["outcome"].isin(RESOLVED) & claims["gates_passed"]).sum()) if len(claims) else 0
    head = [f"Analysis plan: {line}." for line in plan.lines()]
    head.append(
        f"Claims: {n} tested in the family; {resolved} resolved (significant or equivalent) in a unit whose gates pass."
    )
    return head + gate_findings(results, claims, plan) + [s for r in results for s in verdict(r, claims, plan)]


def plateau_findings(curves: pd.DataFrame, plateaus: pd.DataFrame, plan: AnalysisPlan) -> list[str]:
    """Per data set, τ and planned probe, each arm's plateau (or that it still moves); then each claimed
    contrast at its plateau, worded as at any budget (only where the gates pass), or why it has none."""
    out: list[str] = []
    probes = (plan.primary, *plan.secondary)
    mine = plateaus[plateaus["metric"].isin(probes)] if len(plateaus) else plateaus
    for (ds, tau, m), g in mine.groupby(["dataset", "temperature", "metric"], sort=True):
        parts = [f"{arm_label(a)}: {t}" for a, t in zip(g["arm"], g["reading"])]
        out.append(f"Plateau, {ds}, τ {short(tau)}, {METRICS[m][1]}: " + "; ".join(parts) + ".")
    claimed = curves[curves["claimed"] & curves["metric"].isin(probes)] if len(curves) else curves
    for (ds, tau, m, contrast), g in claimed.groupby(["dataset", "temperature", "metric", "contrast"], sort=False):
        at = g[g["at_plateau"]]
        where = f"{ds}, τ {short(tau)}, {METRICS[m][1]}"
        if at.empty:
            longest = short(g["epochs"].max())
            out.append(f"At the plateau, {where}: {contrast} — no plateau yet at {longest} epochs, no verdict.")
        elif not bool(at["gates_passed"].iloc[0]):
            out.append(f"At the plateau, {where}: {contrast} — no verdict ({at['unit'].iloc[0]}: gates not passed).")
        else:
            r = next(at.itertuples(index=False))
            out.append(f"At the plateau ({short(r.plateau)} epochs), {where}: {claim_clause(r)}.")
    return out


# --------------------------------------------------------------------------- tables
def _gate_table(results: list[UnitResult]) -> pd.DataFrame:
    rows = []
    for r in results:
        for g in r.gates if r.unit.view == "epochs" else ():  # the gates do not depend on the view
            u = r.unit
            rows.append(
                {
                    "unit": u.label().split(" (fixed")[0],
                    "dataset": u.dataset,
                    "temperature": u.temperature,
                    "budget": u.budget,
                    "epochs": u.epochs,
                    "steps": u.steps,
                    "gate": g.name,
                    "passed": {True: "yes", False: "no", None: "not run"}[g.passed],
                    "numbers": g.text,
                }
            )
    return pd.DataFrame(rows)


def _gate_display(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for unit, g in df.groupby("unit", sort=False):
        blocks.append((unit, g[["gate", "passed", "numbers"]].reset_index(drop=True)))
    return blocks


def _arm_table(rows: pd.DataFrame, results: list[UnitResult]) -> pd.DataFrame:
    """Mean ± sd over seeds per data set, τ, budget, arm and rate; ``read``: the rate the
    fixed-epochs unit of that budget read the arm at."""
    read = {
        (r.unit.dataset, r.unit.temperature, r.unit.budget, arm, float(a["lr"].iloc[0]))
        for r in results
        if r.unit.view == "epochs"
        for arm, a in r.arms.items()
    }
    out = []
    labels = {**METRICS, **OPT_IN}  # an opt-in probe's metric is a column where some run logged it
    shown = [*METRICS, *(m for m in OPT_IN if m in rows and rows[m].notna().any())]
    keys = ["dataset", "temperature", "budget", "epochs", "steps", "images", "arm", "lr", "peak_lr"]
    for k, g in rows[~rows["status"].isin(BAD_STATUSES)].groupby(keys, sort=True, dropna=False):
        rec = dict(zip(keys, k))
        rec["label"] = arm_label(rec["arm"])
        rec["read"] = (rec["dataset"], rec["temperature"], rec["budget"], rec["arm"], rec["lr"]) in read
        for m in shown:
            v = g[m].dropna()
            out.append(
                {**rec, "metric": m, "metric_label": labels[m][1], "mean": v.mean(), "sd": v.std(), "seeds": len(v)}
            )
    return pd.DataFrame(out)


def _arm_display(arms: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for (ds, tau, budget), g in arms.groupby(["dataset", "temperature", "budget"], sort=True):
        several = g.groupby("arm")["lr"].nunique().max() > 1
        lab = [f"{lb}, lr {short(lr)}" if several else lb for lb, lr in zip(g["label"], g["lr"])]
        t = g.assign(label=lab, v=[f"{num(m)} ± {num(s)}" if finite(m) else "—" for m, s in zip(g["mean"], g["sd"])])
        t = t.pivot_table(index="label", columns="metric_label", values="v", aggfunc="first")
        order = [lab for _, lab in {**METRICS, **OPT_IN}.values() if lab in t.columns]
        t = t[order].reset_index().rename(columns={"label": "arm"})
        blocks.append((f"{ds}, τ {short(tau)}, budget {budget} (mean ± sd over seeds, top-1 %)", t))
    return blocks


def _p(x: float) -> str:
    return f"{x:.3g}" if finite(x) else "—"


def _contrast_display(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for (unit, m), g in df.groupby(["unit", "metric"], sort=False):
        t = pd.DataFrame(
            {
                "contrast": [f"{c} (claimed)" if ok else c for c, ok in zip(g["contrast"], g["claimed"])],
                "small − large [95 % CI]": [
                    f"{num(d, 2)} [{num(lo, 2)}, {num(hi, 2)}]" if finite(lo) else num(d, 2)
                    for d, lo, hi in zip(g["diff"], g["lo"], g["hi"])
                ],
                "p": [_p(x) for x in g["p"]],
                "Holm p (family)": [_p(x) for x in g["p_family"]],
                "margin": [num(x, 2) if finite(x) else "—" for x in g["margin"]],
                "TOST Holm p": [_p(x) for x in g["tost_family"]],
                "MDE (80 %)": [num(x, 2) for x in g["mde"]],
                "outcome": g["outcome"],
                "gates": ["passed" if ok else "not passed" for ok in g["gates_passed"]],
                "seeds": g["seeds"],
            }
        )
        role = g["role"].iloc[0]
        blocks.append((f"{unit}, {METRICS[m][1]} ({role}); reference: {g['reference'].iloc[0]}", t))
    return blocks


def lr_table(results: list[UnitResult], rows: pd.DataFrame) -> pd.DataFrame:
    """Per unit, the plain InfoNCE arms' validation and test top-1 at each rate; ``chosen``: the
    rate the unit reads that batch size at; ``edge``: 'top' or 'bottom' where that chosen rate is
    the highest or lowest of the batch size's grid of several rates ('' otherwise)."""
    out = []
    for r in results:
        g = matched(rows, r.unit)
        means = lr_means(g[g["arm"].str.fullmatch(r"infonce@\d+")])
        for bs, m in means.groupby("batch_size", sort=True):
            grid = sorted(set(m["lr"]))
            for _, x in m.iterrows():
                chosen = math.isclose(r.lrs.get(int(bs), math.nan), x["lr"])
                edge = _edge(x["lr"], grid) if chosen else ""
                out.append(
                    {"unit": r.unit.label(), "dataset": r.unit.dataset, **x.to_dict(), "chosen": chosen, "edge": edge}
                )
    return pd.DataFrame(out)


def _edge(lr: float, grid: list[float]) -> str:
    if len(grid) < 2:
        return ""
    return "top" if math.isclose(lr, grid[-1]) else "bottom" if math.isclose(lr, grid[0]) else ""


def grid_edge_findings(lrs: pd.DataFrame) -> list[str]:
    """One line per batch size whose validated rate is at an edge of its grid in some unit: the best
    rate may lie outside the grid, which needs a rate beyond that edge before that rate is known."""
    if lrs.empty or "edge" not in lrs:
        return []
    out = []
    edges = lrs[lrs["chosen"] & (lrs["edge"] != "")]
    for (bs, edge), g in edges.groupby(["batch_size", "edge"], sort=True):
        mine = lrs[lrs["batch_size"] == bs]
        grid = sorted(set(mine["lr"]))
        units = list(dict.fromkeys(g["unit"]))
        beyond, at = ("above", grid[-1]) if edge == "top" else ("below", grid[0])
        out.append(
            f"Learning-rate grid, B={int(bs)}: the validated rate is the {edge} of its grid "
            f"({', '.join(short(x) for x in grid)}) in {len(units)} of {mine['unit'].nunique()} units "
            f"({'; '.join(units)}): the best rate may lie {beyond} it; extend the grid {beyond} {short(at)}."
        )
    return out


def _lr_display(lrs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for unit, g in lrs.groupby("unit", sort=False):
        t = pd.DataFrame(
            {
                "batch size": g["batch_size"],
                "lr": [short(x) for x in g["lr"]],
                "validation top-1": [f"{num(m)} ± {num(s)}" for m, s in zip(g["val_mean"], g["val_sd"])],
                "test top-1": [num(x) for x in g["test_mean"]],
                "seeds": g["seeds"],
                "chosen": ["yes" if c else "" for c in g["chosen"]],
                "grid edge": [f"{e} of the grid" if e else "" for e in g["edge"]],
            }
        )
        blocks.append((f"{unit}: InfoNCE's linear probe by learning rate (mean ± sd over seeds, %)", t))
    return blocks


def ssl_rows(results: list[UnitResult], base: dict, big: int) -> list[dict]:
    """Does self-supervision learn here?  The reference arm (InfoNCE at the largest batch, at its
    validated rate) against raw pixels and the random-init encoder on every probe, per data
    set, τ and budget (:func:`.instrument_gates.versus_baseline`), and as a fraction of
    supervised − random-init."""
    out = []
    for r in (r for r in results if r.unit.view == "epochs" and f"infonce@{big}" in r.arms):
        u = r.unit
        for m in METRICS:
            ssl = seed_values(r.arms[f"infonce@{big}"], m)
            sup, rnd = base.get((u.dataset, "supervised", m), {}), base.get((u.dataset, "random_init", m), {})
            for ref in ("random_init", "raw_pixels"):
                other = base.get((u.dataset, ref, m), {})
                if not ssl or not other:
                    continue
                e = versus_baseline(ssl, other)
                frac = (
                    gap_fraction(_mean(ssl), _mean(rnd), _mean(sup))
                    if sup and rnd and ref == "random_init"
                    else math.nan
                )
                out.append(
                    {
                        "unit": u.label().split(" (fixed")[0],
                        "dataset": u.dataset,
                        "temperature": u.temperature,
                        "budget": u.budget,
                        "metric": m,
                        "metric_label": METRICS[m][1],
                        "baseline": ref,
                        "ssl": _mean(ssl),
                        "reference": _mean(other),
                        "diff": e.diff,
                        "lo": e.lo,
                        "hi": e.hi,
                        "p": e.p,
                        "test": e.test,
                        "fraction_of_supervised_gap": frac,
                        "estimate": e,
                    }
                )
    return out


def _ssl_display(rows: list[dict]) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for unit, df in pd.DataFrame(rows).groupby("unit", sort=False):
        t = pd.DataFrame(
            {
                "probe": df["metric_label"],
                "baseline": df["baseline"],
                "InfoNCE": [num(x) for x in df["ssl"]],
                "baseline top-1": [num(x) for x in df["reference"]],
                "difference [95 % CI]": [
                    f"{num(d, 2)} [{num(lo, 2)}, {num(hi, 2)}]" if finite(lo) else num(d, 2)
                    for d, lo, hi in zip(df["diff"], df["lo"], df["hi"])
                ],
                "of supervised gap": [
                    f"{num(100 * f, 0)} %" if finite(f) else "—" for f in df["fraction_of_supervised_gap"]
                ],
            }
        )
        blocks.append((unit, t))
    return blocks


# --------------------------------------------------------------------------- figures
ARMS_CAPTION = (
    "**Instrument arms at the longest budget** (seeds: points; their mean and 95 % bootstrap interval: the bar)"
)


def _figure(ctx: ReportContext, results: list[UnitResult]) -> list:
    """The primary probe of every arm (seeds and mean with its interval) at the longest budget
    of each data set (its first τ), each arm at the rate its unit reads."""
    from ..figures import LOSS_COLORS, plot_style

    last: dict[str, dict[float, UnitResult]] = {}
    for r in results:
        if r.unit.view == "epochs":
            last.setdefault(r.unit.dataset, {})[r.unit.temperature] = r  # budgets come in order: the last wins
    picks = [next(iter(sorted(t.items())))[1] for _, t in sorted(last.items())]
    d = pd.DataFrame(
        [
            {"dataset": r.unit.dataset, "label": arm_label(arm), "loss": arm.split("@")[0], "value": v}
            for r in picks
            for arm, a in r.arms.items()
            for v in seed_values(a, PRIMARY).values()
        ]
    )
    if d.empty:
        return []
    plt, sns, rc = plot_style()
    datasets, order = sorted(d["dataset"].unique()), sorted(d["label"].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            1, len(datasets), figsize=(4.4 * len(datasets) + 2.0, 0.32 * len(order) + 1.6), squeeze=False, sharey=True
        )
        pal = {lab: LOSS_COLORS.get(loss, "#777777") for loss, lab in zip(d["loss"], d["label"])}
        for ax, ds, r in zip(axes[0], datasets, picks):
            g = d[d["dataset"] == ds]
            kw = dict(data=g, y="label", x="value", order=order, ax=ax, orient="h")
            sns.stripplot(**kw, hue="label", palette=pal, size=4, alpha=0.6, jitter=0.15, legend=False)
            sns.pointplot(**kw, errorbar=("ci", 95), color="black", linestyle="none", markers="|", markersize=14)
            ax.set_title(r.unit.label(), fontsize=9)
            ax.set_ylabel("")
            ax.set_xlabel(f"{METRICS[PRIMARY][1]} top-1 (%)")
            ax.tick_params(axis="y", labelsize=8)
        fig.tight_layout()
    return ctx.save_figure(fig, "instrument_arms")


#: the most contrasts one panel of the forest plot holds (readable at a paper's width); more are split
FOREST_ROWS = 20


def forest_panels(claims: pd.DataFrame, primary: str) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) of every panel of the forest plot: the claimed contrasts of ``primary`` and the
    positive control of each data set, τ and view at its longest budget (the curves figure draws the
    others), at most :data:`FOREST_ROWS` rows a panel."""
    keep = claims["claimed"] | (claims["key"] == "control")
    d = claims[keep & (claims["metric"] == primary) & claims["diff"].map(finite)]
    panels = []
    for _, g in d.groupby(["dataset", "temperature", "view"], sort=False):
        last = g[g["unit"] == g["unit"].iloc[-1]]  # units come in budget order: the last is the longest
        chunks = range(0, len(last), FOREST_ROWS)
        for i in chunks:
            part = f" ({i // FOREST_ROWS + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            panels.append((last["unit"].iloc[0] + part, last.iloc[i : i + FOREST_ROWS]))
    return panels


def _contrast_figure(ctx: ReportContext, claims: pd.DataFrame, plan: AnalysisPlan) -> tuple[list, str]:
    """The forest plot (:func:`forest_panels`), one panel a row at two columns' width, each contrast
    with its interval, its claim's resolved margin (grey) and zero; returns (files, caption)."""
    from ..figures import PAPER_RC, PAPER_WIDTHS, plot_style

    panels = forest_panels(claims, plan.primary)
    if not panels:
        return [], ""
    plt, sns, _ = plot_style()
    heights = [len(g) + 1.6 for _, g in panels]
    with plt.rc_context(PAPER_RC), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            len(panels), 1, figsize=(PAPER_WIDTHS[2], 0.2 * sum(heights) + 0.3), squeeze=False,
            gridspec_kw={"height_ratios": heights}, layout="constrained",
        )  # fmt: skip
        for ax, (title, g) in zip(axes[:, 0], panels):
            _forest_panel(ax, g)
            ax.set_title(title, loc="right")  # over the row labels where it is longer than the panel
            ax.set_xlabel(f"{METRICS[plan.primary][1]}: small − large (points)")
    files = ctx.save_figure(fig, "instrument_contrasts", exact=True)
    caption = (
        "**Claimed contrasts and the positive control** (paired over seeds: point and 95 % t interval; grey: "
        "each claim's equivalence margin, the analysis plan's; each data set, τ and view at its longest budget, "
        "the curves below draw the others)"
    )
    return files, caption


def _forest_panel(ax, g: pd.DataFrame) -> None:
    ys = list(range(len(g)))
    for y, m in zip(ys, g["margin"]):
        if finite(m):
            ax.plot([-m, m], [y, y], color="#dddddd", lw=7, solid_capstyle="butt", zorder=0)
    err = [(g["diff"] - g["lo"]).fillna(0).to_numpy(), (g["hi"] - g["diff"]).fillna(0).to_numpy()]
    ax.axvline(0, color="#555555", lw=0.8)
    ax.errorbar(g["diff"], ys, xerr=err, fmt="o", color="black", capsize=3)
    ax.set_yticks(ys, list(g["contrast"]))
    ax.set_ylim(len(ys) - 0.5, -0.5)


# --------------------------------------------------------------------------- the section
def _write(ctx: ReportContext, out: SectionOutput, md: list[str], name: str, title: str, data, blocks, note, what):
    files = ctx.write_table(name, title, data, blocks, note=note)
    out.files += files
    md.append(f"{what}: {ctx.table_links(files)}")


def analyse_seeds(seeds: pd.DataFrame, plan: AnalysisPlan) -> tuple[list[UnitResult], pd.DataFrame]:
    """Every unit and the contrast rows with the plan applied, from a per-seed table alone
    (``instrument_seeds.csv`` read back: :func:`.instrument_budgets.seed_table`)."""
    results = analyse(*from_seed_table(seeds))
    return results, claims_of(results, plan)


def claims_of(results: list[UnitResult], plan: AnalysisPlan) -> pd.DataFrame:
    """Every unit's contrast rows, with its gates, and the plan applied over all of them at once."""
    crows = [{**c, "gates_passed": r.ok} for r in results for c in r.rows]
    return apply_plan(plan, pd.DataFrame(crows)) if crows else pd.DataFrame()


def _seed_summary(seeds: pd.DataFrame) -> list[tuple[str | None, pd.DataFrame]]:
    """The per-seed table for reading: how many seeds each arm has per data set, τ and budget."""
    if seeds.empty:
        return [(None, seeds)]
    g = seeds.fillna({"temperature": -1, "budget": "—", "lr": 0}).groupby(
        ["dataset", "temperature", "budget", "arm", "lr"], sort=True
    )
    t = g["seed"].nunique().reset_index().rename(columns={"seed": "seeds"})
    t["temperature"] = [short(x) if x >= 0 else "—" for x in t["temperature"]]
    t["lr"] = [short(x) if x else "—" for x in t["lr"]]
    return [(None, t)]


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells = select_cells(runs, SECTION, (), ctx.notes)
    if cells.empty:
        return None
    out = SectionOutput(SECTION, "The instrument: negatives × steps, gates first", "", run_ids=set(cells["run_id"]))
    plan = ctx.plan
    md: list[str] = ["Analysis plan (declared in the config's `analysis`, applied before any claim is read):", ""]
    md += [f"- {line}" for line in plan.lines()] + [""]
    seeds = seed_table(budget_rows(cells, ctx.scale), baseline_values(runs, ctx.scale))
    _write(ctx, out, md, "instrument_seeds", "Instrument: every seed's top-1 (%) by arm, rate, budget and probe", seeds,
           _seed_summary(seeds), "tidy; every table of this section is computed from this file alone "
           "(smallbatch.report.sections.instrument.analyse_seeds)", "Per-seed values")  # fmt: skip
    # the section reads back the file it wrote: what anyone re-analysing it gets, to the digit
    seeds = pd.read_csv(ctx.tables_dir / "instrument_seeds.csv")
    rows, base = from_seed_table(seeds)
    results = analyse(rows, base)
    claims = claims_of(results, plan)
    _, big = batch_levels(rows)
    if results:
        _write(ctx, out, md, "instrument_gates", "Instrument: validity gates per data set, τ and budget",
               _gate_table(results), _gate_display(_gate_table(results)), None, "Gates")  # fmt: skip
    arms = _arm_table(rows, results)
    _write(ctx, out, md, "instrument_arms", "Instrument arms: top-1 (%) by data set, τ, budget, arm and rate", arms,
           _arm_display(arms), "mean ± sample sd over seeds; read: the rate the fixed-epochs unit reads", "Arms")  # fmt: skip
    if len(claims):
        note = ("paired t over seeds; Holm over the plan's family (claimed contrasts only); TOST: equivalence within "
                "each row's margin (points), Holm over the same family; MDE: the smallest difference these seeds "
                "detect with 80 % power; descriptive: not claimed, no verdict")  # fmt: skip
        _write(ctx, out, md, "instrument_contrasts", "Instrument contrasts (small − large, points)", claims,
               _contrast_display(claims), note, "Contrasts")  # fmt: skip
    lrs = _side_tables(ctx, out, md, results, rows, base, big)
    plateaus = arm_plateaus(results)
    curves = contrast_curves(claims, plateaus)
    if len(curves):
        _write(ctx, out, md, "instrument_plateau", "Instrument: the budget each arm's probe stopped moving at", plateaus,
               plateau_display(plateaus, arm_label), "the plateau rule (smallbatch.report.plateau): the first budget "
               "from which every doubling changed the mean by less than its MDE; 'no plateau yet': the last doubling "
               "still moved it", "Plateaus")  # fmt: skip
        _write(ctx, out, md, "instrument_curves", "Instrument: contrasts over training budgets (small − large, points)",
               curves, curve_display(curves), "fixed epochs; a contrast's plateau is the latest of its arms'",
               "Contrasts over budgets")  # fmt: skip
    forest = _contrast_figure(ctx, claims, plan) if len(claims) else ([], "")
    for fig, caption, alt in (
        (*forest, "instrument contrasts"),
        (curve_figure(ctx, curves, (plan.primary, *plan.secondary)) if len(curves) else [], "", "instrument curves"),
        (_figure(ctx, results), ARMS_CAPTION, "instrument arms"),
    ):
        if fig:
            out.files += fig
            md += ["", *([caption, ""] if caption else []), ctx.figure_md(fig, alt)]
    out.findings += findings(results, claims, plan) + plateau_findings(curves, plateaus, plan)
    out.findings += grid_edge_findings(lrs)
    out.markdown = "\n".join(md + [""] + [f"- {s}" for s in out.findings]) + "\n"
    return out


def _side_tables(ctx, out, md, results, rows, base, big) -> pd.DataFrame:
    """The learning rates per batch size and the reference arm against the baselines; returns the
    learning-rate table."""
    lrs = lr_table(results, rows)
    if len(lrs) and (lrs.groupby("unit")["lr"].nunique() > 1).any():
        _write(ctx, out, md, "instrument_lr", "Instrument: learning rate per batch size (InfoNCE)", lrs, _lr_display(lrs),
               "chosen: the best validation top-1 of the linear probe (a split of the training data, never the test split)",
               "Learning rates")  # fmt: skip
    ssl = ssl_rows(results, base, big) if big else []
    if ssl:
        _write(ctx, out, md, "instrument_ssl", "Instrument: does self-supervision learn? (points)", pd.DataFrame(ssl),
               _ssl_display(ssl), "Welch t against the random-init seeds; raw pixels (one run) as a constant: one-sample t; "
               "fraction: (InfoNCE − random-init) / (supervised − random-init)", "Self-supervision against the baselines")  # fmt: skip
    return lrs


def estimate_of(rows: list[dict], unit_label: str, key: str, metric: str = PRIMARY) -> Estimate | None:
    """The estimate of contrast ``key`` in the unit labelled ``unit_label`` (tests, records)."""
    return next(
        (r["estimate"] for r in rows if r["unit"] == unit_label and r["key"] == key and r["metric"] == metric), None
    )
