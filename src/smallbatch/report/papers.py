"""Section 'papers': the papers' reported numbers, and their small-vs-large batch gap next to ours."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..losses import display_name, loss_rank, paper_family
from .aggregate import aggregate_cells
from .context import ReportContext, SectionOutput
from .fmt import num, short_values, signed
from .runs import METRIC_LABELS, param, select_cells
from .tables import markdown_table

PAPER_COLUMNS = ("paper", "source", "dataset", "backbone", "method", "batch_size", "negatives",
                 "temperature", "epochs", "lr_scaling", "metric", "value", "status")
_GAP_KEYS = ["paper", "source", "dataset", "backbone", "method", "temperature", "epochs", "lr_scaling", "metric"]
_SIDE_COLUMNS = ["family", "who", "paper", "source", "dataset", "backbone", "method", "temperature", "epochs",
                 "lr_scaling", "metric", "small_batch_size", "large_batch_size", "top1_small", "top1_large",
                 "gap_large_minus_small", "status"]


def load_papers(path: str | Path | None = None) -> pd.DataFrame:
    """The papers' reported numbers (package data ``resources/paper_results.csv`` by default)."""
    if path is None:
        from importlib import resources

        ref = resources.files("smallbatch").joinpath("resources", "paper_results.csv")
        with resources.as_file(ref) as p:
            df = pd.read_csv(p)
    else:
        df = pd.read_csv(path)
    missing = [c for c in PAPER_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"paper_csv lacks column(s) {', '.join(missing)}; needs {', '.join(PAPER_COLUMNS)}")
    for col in ("batch_size", "negatives", "epochs"):  # whole numbers, blank where the paper gives none
        vals = pd.to_numeric(df[col], errors="coerce")
        if (vals.dropna() % 1 == 0).all():
            df[col] = vals.round().astype("Int64")
    return df


def paper_setting(papers: pd.DataFrame) -> str:
    """Dataset, backbone, batch size and epochs of paper rows, from the CSV."""
    return (f"{short_values(papers['dataset'])}, {short_values(papers['backbone'])}, "
            f"batch {short_values(papers['batch_size'])}, {short_values(papers['epochs'])} epochs")


def run_setting(cells: pd.DataFrame) -> str:
    """Dataset, backbone, batch size and epochs of our runs, from their params."""
    return (f"{short_values(cells['dataset'])}, {short_values(param(cells, 'backbone'))}, "
            f"batch {short_values(cells['batch_size'])}, {short_values(param(cells, 'epochs'))} epochs")


def _ours_setting(runs: pd.DataFrame) -> dict[str, str]:
    """Our dataset(s), backbone(s) and epochs, each as the sorted values joined with '/'."""
    cells = runs[runs["kind"] == "cell"]

    def vals(col: str) -> str:
        c = cells.get(f"params.{col}")
        u = sorted(set(str(v) for v in c.dropna())) if c is not None else []
        return "/".join(u) if u else "?"

    return {"dataset": vals("dataset"), "backbone": vals("backbone"), "epochs": vals("epochs")}


def _gap_row(lo: pd.Series, hi: pd.Series, lo_value: float, hi_value: float) -> dict:
    return {"small_batch_size": int(lo["batch_size"]), "large_batch_size": int(hi["batch_size"]),
            "top1_small": lo_value, "top1_large": hi_value, "gap_large_minus_small": hi_value - lo_value}


def paper_gaps(p: pd.DataFrame) -> pd.DataFrame:
    """Per paper setting with two or more batch sizes: top-1 at the smallest and largest batch, the gap."""
    rows = []
    q = p[pd.to_numeric(p["batch_size"], errors="coerce").notna()].copy()
    q["batch_size"] = pd.to_numeric(q["batch_size"]).astype(int)
    for key, g in q.groupby(_GAP_KEYS, sort=False, dropna=False):
        if g["batch_size"].nunique() < 2:
            continue
        g = g.sort_values("batch_size", kind="stable")
        lo, hi = g.iloc[0], g.iloc[-1]
        rows.append({"family": paper_family(lo["method"]), "who": "paper", **dict(zip(_GAP_KEYS, key)),
                     **_gap_row(lo, hi, float(lo["value"]), float(hi["value"])),
                     "status": "; ".join(sorted(set(str(s) for s in g["status"])))})
    return pd.DataFrame(rows)


def our_gaps(runs: pd.DataFrame, scale: float, ours: dict[str, str]) -> pd.DataFrame:
    """The same gap for every grid loss (label) x dataset x τ x metric with two or more batch sizes."""
    cells = select_cells(runs, "grid")
    if cells.empty:
        return pd.DataFrame()
    rows = []
    agg = aggregate_cells(cells, ["dataset", "temperature", "loss", "label", "batch_size"], scale)
    for (ds, t, loss, lab, m), g in agg.groupby(["dataset", "temperature", "loss", "label", "metric"], sort=True):
        if g["batch_size"].nunique() < 2:
            continue
        g = g.sort_values("batch_size")
        lo, hi = g.iloc[0], g.iloc[-1]
        rows.append({"family": loss, "who": "ours", "paper": "this study", "source": "MLflow store",
                     "dataset": ds, "backbone": ours["backbone"], "method": lab, "temperature": t,
                     "epochs": ours["epochs"], "lr_scaling": "", "metric": METRIC_LABELS.get(m, m),
                     **_gap_row(lo, hi, lo["mean"], hi["mean"]),
                     "status": lo["state"] if lo["state"] != "ok" else hi["state"]})
    return pd.DataFrame(rows)


def _gap_text(side: pd.DataFrame) -> list[str]:
    return [signed(v) if np.isfinite(v) else st
            for v, st in zip(side["gap_large_minus_small"].astype(float), side["status"])]


def _b_range(side: pd.DataFrame) -> list[str]:
    return [f"{a}→{b}" for a, b in zip(side["small_batch_size"], side["large_batch_size"])]


def _family_blocks(side: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The side-by-side table for reading, one block per loss family."""
    blocks = []
    for fam in dict.fromkeys(side["family"]):
        s = side[side["family"] == fam]
        disp = pd.DataFrame({
            "who": [f"{w}: {pp}" for w, pp in zip(s["who"], s["paper"])], "source": s["source"],
            "dataset": s["dataset"], "backbone": s["backbone"], "method": s["method"],
            "epochs": s["epochs"], "τ": s["temperature"], "lr scaling": s["lr_scaling"], "metric": s["metric"],
            "B small→large": _b_range(s), "top-1 small": [num(v) for v in s["top1_small"]],
            "top-1 large": [num(v) for v in s["top1_large"]], "gap (large − small)": _gap_text(s),
            "status": s["status"]})
        blocks.append((display_name(str(fam)), disp.reset_index(drop=True)))
    return blocks


def _compact(side: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "loss family": side["family"].map(display_name), "who": side["paper"], "dataset": side["dataset"],
        "epochs": side["epochs"], "τ": side["temperature"], "setting": side["lr_scaling"].fillna(""),
        "metric": side["metric"], "B small→large": _b_range(side), "gap (large − small)": _gap_text(side),
        "status": side["status"]})


def _side_by_side(p: pd.DataFrame, runs: pd.DataFrame, ctx: ReportContext, ours: dict, note: str) -> pd.DataFrame:
    side = pd.concat([paper_gaps(p), our_gaps(runs, ctx.scale, ours)], ignore_index=True)
    if side.empty:
        side = pd.DataFrame(columns=_SIDE_COLUMNS)
    side["family"] = side["family"].fillna("other")
    side = side.assign(_f=side["family"].map(loss_rank), _w=(side["who"] != "paper").astype(int))
    side = side.sort_values(["_f", "_w"], kind="stable").drop(columns=["_f", "_w"]).reset_index(drop=True)
    side["note"] = note
    return side


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    ours = _ours_setting(runs)
    note = ("the papers' settings (dataset, backbone, epochs) differ from ours "
            f"(ours: {ours['dataset']}, {ours['backbone']}, {ours['epochs']} epochs); "
            "compare trends across batch size, not absolute numbers")
    out = SectionOutput("papers", "The papers' reported numbers, side by side", "")
    p = ctx.papers.rename(columns={"note": "paper_note"}) if "note" in ctx.papers.columns else ctx.papers.copy()
    p["note"] = note
    cols = list(dict.fromkeys(c for c in (*PAPER_COLUMNS, "lr_scaling", "paper_note", "note") if c in p.columns))
    blocks = [(str(paper), p[p["paper"] == paper][[c for c in cols if c not in ("paper", "note")]]
               .reset_index(drop=True)) for paper in dict.fromkeys(p["paper"])]
    f_rep = ctx.write_table("papers_reported", "Numbers the papers report (with sources and status)",
                            p[cols], blocks, note=note)
    side = _side_by_side(p, runs, ctx, ours, note)
    f_side = ctx.write_table("papers_vs_ours_gap", "Small-batch vs large-batch gap: the papers' numbers next to ours",
                             side, _family_blocks(side), note=note)
    no_paper = [display_name(f) for f in dict.fromkeys(side.loc[side["who"] == "ours", "family"])
                if not ((side["family"] == f) & (side["who"] == "paper")).any()]
    out.files += f_rep + f_side
    md = [f"> Note: {note}.\n",
          f"Reported numbers, grouped per paper with source and status: {ctx.table_links(f_rep)}\n",
          f"Small-vs-large batch gap, papers next to ours (per loss family): {ctx.table_links(f_side)}\n"]
    if no_paper:
        md.append("No paper number at two batch sizes in paper_results.csv for: " + ", ".join(no_paper) + ".\n")
    if len(side):
        md.append(markdown_table(_compact(side)))
    out.markdown = "\n".join(md)
    return out
