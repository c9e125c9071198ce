"""Section 'instrument': can the study see a small-batch penalty, and which mechanism is it?

The instrument study (``workflow/configs/instrument.yaml``) trains, per data set and
seed, the *arms*

* InfoNCE at B = 16 (``small``) and at B = 256 (``large``);
* InfoNCE at B = 256 with each anchor's negatives restricted to its group of G images
  (``grouped``, ``train.neg_group``): the large batch's steps with the small batch's K;
* DCL and SogCLR at B = 16; optionally any arm with the oracle same-class mask;
* the *fixed-steps budget*: InfoNCE at B = 16 stopped after the large batch's number of
  optimiser steps (``train.steps``; the other arms share a fixed-epochs budget);
* the *learning rate per batch size*: InfoNCE at B = 16 and 256 at further learning rates
  (``train.lr``); the one with the best validation accuracy of the linear probe (a split of
  the training data, never the test split) is each batch size's validated learning rate;

with BatchNorm over groups of the same size in every arm (``train.bn_group``), so the
arms differ only where their names say.  The decomposition, every term small − large
(one sign convention; negative = the smaller configuration is worse)::

    small − large  =  (grouped − large)   +   (small − grouped)
                      negatives part          steps part
                      (fewer negatives,       (same K, 16x the steps
                       same steps)             and their gradient noise)

Each contrast is paired by seed (the arms of one seed share data order and
augmentations) and tested with :mod:`.evidence` (paired t, Holm over the contrasts of
one metric, the minimum detectable effect at 80 % power).  A null result says
whether its interval *bounds* the effect below :data:`BOUND` points.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from ...evaluation.probes import gap_fraction
from ...losses.registry import display_name
from ...tracking import BAD_STATUSES
from ..context import ReportContext, SectionOutput
from ..evidence import Estimate, contrast, describe, describe_mde, holm
from ..fmt import finite, num
from ..runs import param, select_cells
from .baselines import baseline_runs

SECTION = "instrument"
#: an effect whose whole interval lies within ± BOUND points is called bounded (negligible)
BOUND = 0.5
#: short name -> (MLflow metric key, label), in the tables' order; the first is the primary metric
METRICS = {
    "linear": ("linear/top1", "linear probe"),
    "labels10": ("linear/labels10pct_top1_mean", "10 % labels"),
    "labels1": ("linear/labels1pct_top1_mean", "1 % labels"),
    "knn20": ("knn/top1_k20", "kNN@20"),
    "knn200": ("knn/top1_k200", "kNN@200"),
}
#: the contrasts the section states: name -> [(coefficient, arm)]
CONTRASTS = {
    "small − large": [(1.0, "infonce@16"), (-1.0, "infonce@256")],
    "negatives part (grouped − large)": [(1.0, "infonce@256/G"), (-1.0, "infonce@256")],
    "steps part (small − grouped)": [(1.0, "infonce@16"), (-1.0, "infonce@256/G")],
    "DCL@16 − InfoNCE@256": [(1.0, "dcl@16"), (-1.0, "infonce@256")],
    "SogCLR@16 − InfoNCE@256": [(1.0, "sogclr@16"), (-1.0, "infonce@256")],
    "oracle − plain, InfoNCE@16": [(1.0, "infonce@16/oracle"), (-1.0, "infonce@16")],
    "small − large, equal steps": [(1.0, "infonce@16/S"), (-1.0, "infonce@256")],
}
#: the contrast made per data set from the learning rates chosen on the validation split
VALIDATED_LR = "small − large, each at its validated lr"
#: the metric the learning rate is chosen on: the linear probe's top-1 on the validation split
VAL_METRIC = "linear/val_top1"


def _is_set(v: Any) -> bool:
    return str(v).strip().lower() not in ("", "none", "nan", "null", "false", "0")


def base_lr(cells: pd.DataFrame) -> float | None:
    """The study's common learning rate: the one most cells use (ties: the smaller)."""
    if "params.lr" not in cells:
        return None
    lrs = pd.to_numeric(cells["params.lr"], errors="coerce").dropna()
    if lrs.empty:
        return None
    counts = lrs.value_counts()
    return float(min(counts.index[counts == counts.max()]))


def arm_of(row: pd.Series, common_lr: float | None = None) -> str:
    """``infonce@256/G`` (grouped negatives), ``infonce@16/oracle``, ``infonce@16/S`` (a
    fixed number of steps), ``infonce@16/lr0.003`` (a learning rate other than
    ``common_lr``), ``dcl@16``."""
    arm = f"{row['loss']}@{int(row['batch_size'])}"
    if _is_set(row.get("params.neg_group")):
        arm += "/G"
    if _is_set(row.get("params.mask_same_class")):
        arm += "/oracle"
    if _is_set(row.get("params.steps")):
        arm += "/S"
    lr = pd.to_numeric(pd.Series([row.get("params.lr")]), errors="coerce").iloc[0]
    if common_lr is not None and finite(lr) and not math.isclose(float(lr), common_lr):
        arm += f"/lr{float(lr):g}"
    return arm


def _mark_label(mark: str, group: Any) -> str:
    if mark == "G":
        return f", G={group}"
    if mark == "S":
        return ", equal steps"
    if mark.startswith("lr"):
        return f", lr {mark[2:]}"
    return ", oracle mask"


def arm_label(arm: str, group: Any) -> str:
    loss, rest = arm.split("@")
    size, *marks = rest.split("/")
    return f"{display_name(loss)} B={size}{''.join(_mark_label(m, group) for m in marks)}"


def _values(runs: pd.DataFrame, key: str, scale: float) -> dict[Any, float]:
    col = f"metrics.{key}"
    if col not in runs:
        return {}
    good = runs[~runs["status"].isin(BAD_STATUSES)]
    return {int(s): float(v) * scale for s, v in zip(good["seed"], good[col]) if finite(v)}


def arm_values(cells: pd.DataFrame, scale: float) -> dict[tuple[str, str, str], dict]:
    """(dataset, arm, metric) -> {seed: top-1 %}."""
    out = {}
    for (ds, arm), g in cells.groupby(["dataset", "arm"], sort=True):
        for m, (key, _) in METRICS.items():
            out[(ds, arm, m)] = _values(g, key, scale)
    return out


def _baseline_values(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str, str], dict]:
    b = baseline_runs(runs)
    out = {}
    for (ds, name), g in b.groupby(["dataset", "baseline"], sort=True):
        for m, (key, _) in METRICS.items():
            out[(ds, str(name), m)] = _values(g, key, scale)
    return out


def _mean(v: dict) -> float:
    return sum(v.values()) / len(v) if v else math.nan


def _sd(v: dict) -> float:
    if len(v) < 2:
        return math.nan
    m = _mean(v)
    return math.sqrt(sum((x - m) ** 2 for x in v.values()) / (len(v) - 1))


def bounded(e: Estimate) -> bool:
    """The interval lies within ± BOUND: the effect is bounded below BOUND points."""
    return e.tested and -BOUND <= e.lo and e.hi <= BOUND


def contrast_rows(vals: dict, base: dict, datasets: list[str], extra: dict | None = None) -> list[dict]:
    """Every stated contrast of every data set and metric, Holm-adjusted within a metric;
    ``extra``: data set -> {name: terms}, contrasts made for one data set (the validated lr)."""
    rows = []
    for m, (_, mlabel) in METRICS.items():
        fam, keys = [], []
        for ds in datasets:
            for name, terms in {**CONTRASTS, **(extra or {}).get(ds, {})}.items():
                cells = [(c, vals.get((ds, arm, m), {})) for c, arm in terms]
                if any(not v for _, v in cells):
                    continue
                fam.append(contrast(cells))
                keys.append((ds, name))
        for (ds, name), e in zip(keys, holm(fam)):
            span = _mean(base.get((ds, "supervised", m), {})) - _mean(base.get((ds, "random_init", m), {}))
            rows.append(
                {
                    "dataset": ds,
                    "metric": m,
                    "metric_label": mlabel,
                    "contrast": name,
                    "diff": e.diff,
                    "lo": e.lo,
                    "hi": e.hi,
                    "p": e.p,
                    "p_holm": e.p_adj,
                    "seeds": e.n,
                    "test": e.test,
                    "mde": e.mde,
                    "bounded": bounded(e),
                    "significant": e.significant,
                    "fraction_of_supervised_gap": gap_fraction(e.diff, 0.0, span) if finite(span) else math.nan,
                    "estimate": e,
                }
            )
    return rows


def _part(name: str, e: Estimate) -> str:
    if e.significant:
        verdict = "significant"
    elif bounded(e):
        verdict = f"bounded below {num(BOUND)} points"
    else:
        verdict = "within noise, not bounded"
    return f"its {name.split(' (')[0]} {describe(e)} — {verdict}"


def _verdict(ds: str, by: dict[str, Estimate], mlabel: str) -> str:
    e = by.get("small − large")
    if e is None:
        return f"On {ds} the small−large contrast was not run."
    head = f"On {ds} ({mlabel}), InfoNCE small − large {describe(e, null_mde=False)}"  # its MDE: below
    if e.significant and e.diff < 0:
        head += ": a small-batch penalty"
    elif e.significant:
        head += ": the small batch is ahead, no penalty"
    elif bounded(e):
        head += f": no penalty, and the interval bounds it below {num(BOUND)} points"
    else:
        mde = describe_mde(e)
        head += f": within noise but not bounded below {num(BOUND)} points{f' ({mde})' if mde else ''}"
    parts = [_part(p, by[p]) for p in ("negatives part (grouped − large)", "steps part (small − grouped)") if p in by]
    return head + ("; " + "; ".join(parts) if parts else "") + "."


def findings(rows: list[dict]) -> list[str]:
    """One verdict per data set on the primary metric, plus the fixes at B=16 against InfoNCE at B=256."""
    primary = next(iter(METRICS))
    out = []
    prim = [r for r in rows if r["metric"] == primary]
    for ds in dict.fromkeys(r["dataset"] for r in prim):
        by = {r["contrast"]: r["estimate"] for r in prim if r["dataset"] == ds}
        out.append(_verdict(ds, by, METRICS[primary][1]))
        fixes = [
            f"{name.split(' −')[0]} {describe(by[name])}"
            for name in ("DCL@16 − InfoNCE@256", "SogCLR@16 − InfoNCE@256")
            if name in by
        ]
        if fixes:
            out.append(
                f"On {ds}, the small-batch fixes against InfoNCE at B=256 ({METRICS[primary][1]}, "
                "each at B=16 − InfoNCE at B=256): " + "; ".join(fixes) + "."
            )
    return out


def _lr_of(g: pd.DataFrame) -> float:
    return float(pd.to_numeric(g["params.lr"], errors="coerce").iloc[0]) if "params.lr" in g else math.nan


def lr_table(cells: pd.DataFrame, scale: float) -> pd.DataFrame:
    """InfoNCE's plain arms (no G, S or oracle mark) per data set, batch size and learning
    rate: the linear probe's validation and test top-1 (mean over seeds), and ``chosen``:
    the best validation mean where a batch size was run at more than one learning rate."""
    plain = cells[cells["arm"].str.fullmatch(r"infonce@\d+(/lr[^/]+)?")]
    rows = []
    for (ds, bs, arm), g in plain.groupby(["dataset", "batch_size", "arm"], sort=True):
        val, test = _values(g, VAL_METRIC, scale), _values(g, "linear/top1", scale)
        rows.append(
            {
                "dataset": ds,
                "batch_size": int(bs),
                "arm": arm,
                "lr": _lr_of(g),
                "val_mean": _mean(val),
                "val_sd": _sd(val),
                "test_mean": _mean(test),
                "seeds": len(val),
                "chosen": False,
            }
        )
    df = pd.DataFrame(rows)
    for _, g in df.groupby(["dataset", "batch_size"]) if len(df) else []:
        if len(g) > 1 and g["val_mean"].notna().any():
            df.loc[g["val_mean"].idxmax(), "chosen"] = True
    return df


def validated_contrasts(lrs: pd.DataFrame) -> dict[str, dict[str, list]]:
    """data set -> {VALIDATED_LR: InfoNCE@16 at its chosen lr − InfoNCE@256 at its chosen lr},
    where both batch sizes were run at more than one learning rate."""
    out = {}
    for ds, g in lrs[lrs["chosen"]].groupby("dataset") if len(lrs) else []:
        arms = dict(zip(g["batch_size"], g["arm"]))
        if 16 in arms and 256 in arms:
            out[ds] = {VALIDATED_LR: [(1.0, arms[16]), (-1.0, arms[256])]}
    return out


def control_findings(rows: list[dict], lrs: pd.DataFrame) -> list[str]:
    """The controls on the primary metric: the fixed-steps budget, the oracle mask and the
    learning rate chosen per batch size."""
    primary = next(iter(METRICS))
    mlabel, out = METRICS[primary][1], []
    prim = [r for r in rows if r["metric"] == primary]
    for ds in dict.fromkeys(r["dataset"] for r in prim):
        by = {r["contrast"]: r["estimate"] for r in prim if r["dataset"] == ds}
        if "small − large, equal steps" in by:
            out.append(
                f"On {ds} ({mlabel}), at equal optimiser steps (InfoNCE B=16 stopped after B=256's steps) "
                f"small − large {describe(by['small − large, equal steps'])}."
            )
        if "oracle − plain, InfoNCE@16" in by:
            out.append(
                f"On {ds}, masking same-class negatives at B=16 (oracle − plain): "
                f"{describe(by['oracle − plain, InfoNCE@16'])}."
            )
        chosen = lrs[(lrs["dataset"] == ds) & lrs["chosen"]] if len(lrs) else lrs
        if VALIDATED_LR in by and len(chosen):
            picks = ", ".join(f"B={b}: lr {lr:g}" for b, lr in zip(chosen["batch_size"], chosen["lr"]))
            out.append(
                f"On {ds}, with the learning rate chosen on the validation split ({picks}), "
                f"small − large {describe(by[VALIDATED_LR])}."
            )
    return out


def _lr_display(lrs: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for ds, g in lrs.groupby("dataset", sort=True):
        t = pd.DataFrame(
            {
                "batch size": g["batch_size"],
                "lr": [f"{x:g}" for x in g["lr"]],
                "validation top-1": [f"{num(m)} ± {num(s)}" for m, s in zip(g["val_mean"], g["val_sd"])],
                "test top-1": [num(x) for x in g["test_mean"]],
                "seeds": g["seeds"],
                "chosen": ["yes" if c else "" for c in g["chosen"]],
            }
        )
        blocks.append((f"{ds}: InfoNCE's linear probe by learning rate (mean ± sd over seeds, %)", t))
    return blocks


def ssl_rows(vals: dict, base: dict, datasets: list[str]) -> list[dict]:
    """Does self-supervision learn here? InfoNCE@256 against the random-init encoder and raw
    pixels on every probe (unpaired: Welch t over their seeds; raw pixels: one run, no test),
    and as a fraction of supervised − random-init."""
    rows = []
    for ds, m, ref in ((ds, m, ref) for ds in datasets for m in METRICS for ref in ("random_init", "raw_pixels")):
        ssl, other = vals.get((ds, "infonce@256", m), {}), base.get((ds, ref, m), {})
        if not ssl or not other:
            continue
        e = contrast([(1.0, ssl), (-1.0, {f"r{k}": v for k, v in other.items()})])
        sup, rnd = base.get((ds, "supervised", m), {}), base.get((ds, "random_init", m), {})
        frac = gap_fraction(_mean(ssl), _mean(rnd), _mean(sup)) if sup and rnd and ref == "random_init" else math.nan
        rows.append(
            {
                "dataset": ds,
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
    return rows


def ssl_vs_random(rows: list[dict]) -> list[str]:
    """The 10 %-label probe's rows against the random-init encoder, as sentences."""
    out = []
    for r in rows:
        if r["metric"] != "labels10" or r["baseline"] != "random_init":
            continue
        frac = r["fraction_of_supervised_gap"]
        where = f"; {num(100 * frac, 0)} % of the way from random-init to supervised" if finite(frac) else ""
        out.append(
            f"Self-supervision on {r['dataset']} (10 % labels, InfoNCE B=256 − random-init encoder): "
            f"{describe(r['estimate'])}{where}."
        )
    return out


def _ssl_display(rows: list[dict]) -> list[tuple[str, pd.DataFrame]]:
    df = pd.DataFrame(rows)
    t = pd.DataFrame(
        {
            "data set": df["dataset"],
            "probe": df["metric_label"],
            "baseline": df["baseline"],
            "InfoNCE B=256": [num(x) for x in df["ssl"]],
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
    return [("InfoNCE B=256 against the baselines (Welch t over seeds; raw pixels: one run, untested)", t)]


def _arm_table(cells: pd.DataFrame, vals: dict) -> pd.DataFrame:
    rows = []
    for (ds, arm), g in cells.groupby(["dataset", "arm"], sort=True):
        groups = param(g, "neg_group").dropna().astype(str) if "params.neg_group" in g else pd.Series(dtype=str)
        group = groups.iloc[0] if len(groups) else ""
        for m, (_, mlabel) in METRICS.items():
            v = vals.get((ds, arm, m), {})
            rows.append(
                {
                    "dataset": ds,
                    "arm": arm,
                    "label": arm_label(arm, group),
                    "metric": m,
                    "metric_label": mlabel,
                    "mean": _mean(v),
                    "sd": _sd(v),
                    "seeds": len(v),
                }
            )
    return pd.DataFrame(rows)


def _display(arms: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    for ds, g in arms.groupby("dataset", sort=True):
        t = g.assign(v=[f"{num(m)} ± {num(s)}" if finite(m) else "—" for m, s in zip(g["mean"], g["sd"])])
        t = t.pivot(index="label", columns="metric_label", values="v")
        t = t[[lab for _, lab in METRICS.values() if lab in t.columns]].reset_index().rename(columns={"label": "arm"})
        blocks.append((f"{ds} (mean ± sd over seeds, top-1 %)", t))
    return blocks


def _contrast_display(rows: list[dict]) -> list[tuple[str, pd.DataFrame]]:
    blocks = []
    df = pd.DataFrame(rows)
    for (ds, m), g in df.groupby(["dataset", "metric"], sort=False):
        t = pd.DataFrame(
            {
                "contrast": g["contrast"],
                "small − large [95 % CI]": [
                    f"{num(d, 2)} [{num(lo, 2)}, {num(hi, 2)}]" if finite(lo) else num(d, 2)
                    for d, lo, hi in zip(g["diff"], g["lo"], g["hi"])
                ],
                "Holm p": [f"{p:.3g}" if finite(p) else "—" for p in g["p_holm"]],
                "MDE (80 %)": [num(x, 2) for x in g["mde"]],
                "seeds": g["seeds"],
            }
        )
        blocks.append((f"{ds}, {METRICS[m][1]}", t))
    return blocks


def _figure(ctx: ReportContext, arms_long: pd.DataFrame) -> list:
    from ..figures import LOSS_COLORS, plot_style

    plt, sns, rc = plot_style()
    metric = next(iter(METRICS))
    d = arms_long[arms_long["metric"] == metric]
    datasets = sorted(d["dataset"].unique())
    n_arms = d["label"].nunique()
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            1, len(datasets), figsize=(4.4 * len(datasets) + 1.6, 0.32 * n_arms + 1.6), squeeze=False, sharey=True
        )
        order = list(dict.fromkeys(d.sort_values(["loss", "batch_size", "label"])["label"]))
        pal = {lab: LOSS_COLORS.get(loss, "#777777") for loss, lab in zip(d["loss"], d["label"])}
        for ax, ds in zip(axes[0], datasets):
            g = d[d["dataset"] == ds]
            sns.stripplot(
                data=g,
                y="label",
                x="value",
                hue="label",
                order=order,
                palette=pal,
                ax=ax,
                size=4,
                alpha=0.6,
                jitter=0.15,
                legend=False,
                orient="h",
            )
            sns.pointplot(
                data=g,
                y="label",
                x="value",
                order=order,
                errorbar=("ci", 95),
                color="black",
                linestyle="none",
                markers="|",
                markersize=14,
                ax=ax,
                orient="h",
            )
            ax.set_title(ds, fontsize=10)
            ax.set_ylabel("")
            ax.set_xlabel(f"{METRICS[metric][1]} top-1 (%)")
            ax.tick_params(axis="y", labelsize=8)
        fig.suptitle("Instrument arms\nseeds (points), mean and 95 % bootstrap interval (bar)", fontsize=10)
        fig.tight_layout()
    return ctx.save_figure(fig, "instrument_arms")


def _contrast_figure(ctx: ReportContext, rows: list[dict]) -> list:
    """The paired contrasts of the primary probe with their intervals, the ± BOUND band and zero."""
    from ..figures import plot_style

    plt, sns, rc = plot_style()
    metric = next(iter(METRICS))
    d = pd.DataFrame([r for r in rows if r["metric"] == metric and finite(r["diff"])])
    if d.empty:
        return []
    datasets = list(dict.fromkeys(d["dataset"]))
    names = list(dict.fromkeys([n for n in CONTRASTS if n in set(d["contrast"])] + list(d["contrast"])))
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        fig, axes = plt.subplots(
            1, len(datasets), figsize=(4.6 * len(datasets), 0.45 * len(names) + 1.4), squeeze=False, sharey=True
        )
        for ax, ds in zip(axes[0], datasets):
            g = d[d["dataset"] == ds].set_index("contrast")
            ys = [i for i, n in enumerate(names) if n in g.index]
            g = g.loc[[names[i] for i in ys]]
            err = [(g["diff"] - g["lo"]).fillna(0).to_numpy(), (g["hi"] - g["diff"]).fillna(0).to_numpy()]
            ax.axvspan(-BOUND, BOUND, color="#dddddd", zorder=0)
            ax.axvline(0, color="#555555", lw=0.8)
            ax.errorbar(g["diff"], ys, xerr=err, fmt="o", color="black", capsize=3)
            ax.set_yticks(range(len(names)), names, fontsize=8)
            ax.invert_yaxis()
            ax.set_title(ds, fontsize=10)
            ax.set_xlabel(f"{METRICS[metric][1]}: small − large (points)")
        fig.suptitle(f"Paired contrasts (95 % t intervals)\ngrey: ± {num(BOUND)} points", fontsize=10)
        fig.tight_layout()
    return ctx.save_figure(fig, "instrument_contrasts")


def _ssl_table(ctx: ReportContext, ssl: list[dict], out: SectionOutput) -> list[str]:
    """The SSL-vs-baselines table written (its files added to ``out``); its markdown lines."""
    if not ssl:
        return []
    f_ssl = ctx.write_table(
        "instrument_ssl",
        "Instrument: does self-supervision learn? (points)",
        pd.DataFrame(ssl).drop(columns="estimate"),
        _ssl_display(ssl),
        note="fraction: (InfoNCE − random-init) / (supervised − random-init)",
    )
    out.files += f_ssl
    return [f"Self-supervision against the baselines: {ctx.table_links(f_ssl)}"]


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells = select_cells(runs, SECTION, (), ctx.notes)
    if cells.empty:
        return None
    common = base_lr(cells)
    cells = cells.assign(arm=[arm_of(r, common) for _, r in cells.iterrows()])
    out = SectionOutput(
        SECTION, "The instrument: small vs large batch, negatives vs steps", "", run_ids=set(cells["run_id"])
    )
    vals, base = arm_values(cells, ctx.scale), _baseline_values(runs, ctx.scale)
    datasets = sorted(cells["dataset"].unique())
    arms = _arm_table(cells, vals)
    lrs = lr_table(cells, ctx.scale)
    rows = contrast_rows(vals, base, datasets, validated_contrasts(lrs))
    f_arms = ctx.write_table(
        "instrument_arms",
        "Instrument arms: top-1 (%) by data set, arm and probe",
        arms,
        _display(arms),
        note="mean ± sample sd over seeds",
    )
    out.files += f_arms
    md = [f"Arms: {ctx.table_links(f_arms)}", ""]
    if rows:
        f_con = ctx.write_table(
            "instrument_contrasts",
            "Instrument contrasts (small − large, points)",
            pd.DataFrame(rows),
            _contrast_display(rows),
            note="paired t over seeds; Holm over the contrasts of one probe; MDE: the smallest "
            "difference these seeds detect with 80 % power",
        )
        out.files += f_con
        md.append(f"Contrasts: {ctx.table_links(f_con)}")
        if len(lrs) and lrs["chosen"].any():
            f_lr = ctx.write_table(
                "instrument_lr",
                "Instrument: learning rate per batch size (InfoNCE)",
                lrs,
                _lr_display(lrs),
                note="chosen: the best validation top-1 of the linear probe "
                "(a split of the training data, never the test split)",
            )
            out.files += f_lr
            md.append(f"Learning rates: {ctx.table_links(f_lr)}")
        cfig = _contrast_figure(ctx, rows)
        if cfig:
            out.files += cfig
            md += ["", ctx.figure_md(cfig, "instrument contrasts")]
    long = pd.DataFrame(
        [
            {
                "dataset": ds,
                "arm": arm,
                "metric": m,
                "seed": s,
                "value": v,
                "loss": arm.split("@")[0],
                "batch_size": int(arm.split("@")[1].split("/")[0]),
                "label": arms.loc[(arms["dataset"] == ds) & (arms["arm"] == arm), "label"].iloc[0],
            }
            for (ds, arm, m), sv in vals.items()
            for s, v in sv.items()
        ]
    )
    if len(long):
        figs = _figure(ctx, long)
        out.files += figs
        md += ["", ctx.figure_md(figs, "instrument arms")]
    ssl = ssl_rows(vals, base, datasets)
    md += _ssl_table(ctx, ssl, out)
    out.findings += ssl_vs_random(ssl) + findings(rows) + control_findings(rows, lrs)
    out.markdown = "\n".join(md + [""] + [f"- {s}" for s in out.findings]) + "\n"
    return out
