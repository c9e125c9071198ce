"""Section 'papers': the papers' reported numbers, and their small-vs-large batch gap next to ours.

Every row says who produced its number (:func:`producer`: a table or the text of
the paper, the authors' code README, a third-party reproduction or benchmark, or
a secondary source), and its status is one of a few plain words
(:func:`status_of`) with any qualification moved to ``status_note``.  Every gap
is **small − large** (top-1 at the smallest minus at the largest batch size;
negative: the small batch is behind), as everywhere in the report; ours carries
its 95 % paired-t interval over seeds.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from ...losses.registry import display_name, loss_rank, paper_family
from ..aggregate import aggregate_cells
from ..context import ReportContext, SectionOutput
from ..evidence import paired
from ..fmt import num, short_values, signed
from ..runs import METRIC_LABELS, param, select_cells
from ..tables import markdown_table

PAPER_COLUMNS = (
    "paper",
    "source",
    "dataset",
    "backbone",
    "method",
    "batch_size",
    "negatives",
    "temperature",
    "epochs",
    "lr_scaling",
    "metric",
    "value",
    "status",
)
_GAP_KEYS = ["paper", "source", "dataset", "backbone", "method", "temperature", "epochs", "lr_scaling", "metric"]
_SIDE_COLUMNS = [
    "family",
    "who",
    "paper",
    "source",
    "dataset",
    "backbone",
    "method",
    "temperature",
    "epochs",
    "lr_scaling",
    "metric",
    "small_batch_size",
    "large_batch_size",
    "top1_small",
    "top1_large",
    "gap_small_minus_large",
    "gap_ci_low",
    "gap_ci_high",
    "produced_by",
    "status",
    "status_note",
]
#: the one sentence that fixes the sign of every gap in this section
SIGN = (
    "gap = top-1 at the smallest minus at the largest batch size (small − large; negative: the small batch is "
    "behind), the sign used everywhere in this report"
)
#: (pattern on the CSV's status, status shown, note) — the CSV's hedges become a plain status and a stated fact
_STATUS = (
    (r"^confirmed$", "checked against the source", ""),
    (
        r"^confirmed \(batch size likely (\d+)\)$",
        "checked against the source",
        r"the source does not state the batch size; \1 is assumed",
    ),
    (r"^confirmed \(derived: (.*)\)$", "derived from the source", r"\1"),
    (r"^confirmed \(official code README\)$", "checked against the authors' code README", ""),
    (r"^third-party$", "third-party number", "not the paper's own number"),
    (
        r"^as stated in a paper review; unconfirmed in the paper$",
        "unconfirmed",
        "stated in a paper review, not found in the paper",
    ),
)


def status_of(raw) -> tuple[str, str]:
    """(status, note) of a CSV status: one of a few plain words, the qualification as a note."""
    text = str(raw).strip() if raw is not None and str(raw) != "nan" else ""
    for pat, status, note in _STATUS:
        m = re.match(pat, text)
        if m:
            return status, m.expand(note) if note else ""
    return (text or "unknown"), ""


def producer(paper: str, source: str) -> str:
    """Who produced a number: the paper (its table or text), the authors' code, a third party, or a review."""
    src, pap = str(source), str(paper)
    if src.startswith("third-party reproduction"):
        return "third-party reproduction (" + src.split(":", 1)[-1].strip().removesuffix(" README") + ")"
    if "benchmarks" in pap or "benchmarks" in src:
        return f"third-party benchmark ({pap})"
    if "official code" in src:
        return "the authors' code README"
    if "review" in src:
        return "a paper review (secondary)"
    if src.startswith(("Table", "Appendix", "Figure")):
        return f"paper table ({src})"
    return f"paper text ({src})"


def _labelled(p: pd.DataFrame) -> pd.DataFrame:
    """The papers' rows with ``produced_by``, a plain ``status`` and ``status_note``."""
    st = [status_of(v) for v in p["status"]]
    return p.assign(
        produced_by=[producer(a, b) for a, b in zip(p["paper"], p["source"])],
        status=[a for a, _ in st],
        status_note=[b for _, b in st],
    )


def load_papers(path: str | Path | None = None) -> pd.DataFrame:
    """The papers' reported numbers (package data ``resources/paper_results.csv`` by default)."""
    if path is None:
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
    return (
        f"{short_values(papers['dataset'])}, {short_values(papers['backbone'])}, "
        f"batch {short_values(papers['batch_size'])}, {short_values(papers['epochs'])} epochs"
    )


def run_setting(cells: pd.DataFrame) -> str:
    """Dataset, backbone, batch size and epochs of our runs, from their params."""
    return (
        f"{short_values(cells['dataset'])}, {short_values(param(cells, 'backbone'))}, "
        f"batch {short_values(cells['batch_size'])}, {short_values(param(cells, 'epochs'))} epochs"
    )


def _ours_setting(runs: pd.DataFrame) -> dict[str, str]:
    """Our dataset(s), backbone(s) and epochs, each as the sorted values joined with '/'."""
    cells = runs[runs["kind"] == "cell"]

    def vals(col: str) -> str:
        c = cells.get(f"params.{col}")
        u = sorted(set(str(v) for v in c.dropna())) if c is not None else []
        return "/".join(u) if u else "?"

    return {"dataset": vals("dataset"), "backbone": vals("backbone"), "epochs": vals("epochs")}


def _gap_row(lo: pd.Series, hi: pd.Series, lo_value: float, hi_value: float) -> dict:
    return {
        "small_batch_size": int(lo["batch_size"]),
        "large_batch_size": int(hi["batch_size"]),
        "top1_small": lo_value,
        "top1_large": hi_value,
        "gap_small_minus_large": lo_value - hi_value,
    }


def paper_gaps(p: pd.DataFrame) -> pd.DataFrame:
    """Per paper setting with two or more batch sizes: top-1 at the smallest and largest batch, the gap."""
    rows = []
    p = p if "produced_by" in p.columns else _labelled(p)
    q = p[pd.to_numeric(p["batch_size"], errors="coerce").notna()].copy()
    q["batch_size"] = pd.to_numeric(q["batch_size"]).astype(int)
    for key, g in q.groupby(_GAP_KEYS, sort=False, dropna=False):
        if g["batch_size"].nunique() < 2:
            continue
        g = g.sort_values("batch_size", kind="stable")
        lo, hi = g.iloc[0], g.iloc[-1]
        rows.append(
            {
                "family": paper_family(lo["method"]),
                "who": "paper",
                **dict(zip(_GAP_KEYS, key)),
                **_gap_row(lo, hi, float(lo["value"]), float(hi["value"])),
                "produced_by": "; ".join(dict.fromkeys(g["produced_by"])),
                "status": "; ".join(dict.fromkeys(g["status"])),
                "status_note": "; ".join(x for x in dict.fromkeys(g["status_note"]) if x),
            }
        )
    return pd.DataFrame(rows)


def our_gaps(runs: pd.DataFrame, scale: float, ours: dict[str, str]) -> pd.DataFrame:
    """The same gap for every grid loss (label) x dataset x τ x metric with two or more batch sizes."""
    cells = select_cells(runs, "grid")
    if cells.empty:
        return pd.DataFrame()
    rows = []
    agg = aggregate_cells(cells, ["dataset", "temperature", "loss", "label", "batch_size"], scale, values=True)
    for (ds, t, loss, lab, m), g in agg.groupby(["dataset", "temperature", "loss", "label", "metric"], sort=True):
        if g["batch_size"].nunique() < 2:
            continue
        g = g.sort_values("batch_size")
        lo, hi = g.iloc[0], g.iloc[-1]
        e = paired(lo["values"], hi["values"])
        rows.append(
            {
                "family": loss,
                "who": "ours",
                "paper": "this study",
                "source": "MLflow store",
                "dataset": ds,
                "backbone": ours["backbone"],
                "method": lab,
                "temperature": t,
                "epochs": ours["epochs"],
                "lr_scaling": "",
                "metric": METRIC_LABELS.get(m, m),
                **_gap_row(lo, hi, lo["mean"], hi["mean"]),
                "gap_ci_low": e.lo,
                "gap_ci_high": e.hi,
                "produced_by": "this study",
                "status": lo["state"] if lo["state"] != "ok" else hi["state"],
                "status_note": "",
            }
        )
    return pd.DataFrame(rows)


def _gap_text(side: pd.DataFrame) -> list[str]:
    """``-5.0`` (a paper's one number), ``-10.1 [-10.7, -9.4]`` (ours, with its interval), or the state."""
    out = []
    for v, lo, hi, st in zip(
        side["gap_small_minus_large"].astype(float),
        side["gap_ci_low"].astype(float),
        side["gap_ci_high"].astype(float),
        side["status"],
    ):
        if not np.isfinite(v):
            out.append(st)
        else:
            out.append(signed(v) + (f" [{signed(lo)}, {signed(hi)}]" if np.isfinite(lo) else ""))
    return out


def _b_range(side: pd.DataFrame) -> list[str]:
    return [f"{a}→{b}" for a, b in zip(side["small_batch_size"], side["large_batch_size"])]


def _family_blocks(side: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The side-by-side table for reading, one block per loss family."""
    blocks = []
    for fam in dict.fromkeys(side["family"]):
        s = side[side["family"] == fam]
        disp = pd.DataFrame(
            {
                "produced by": s["produced_by"],
                "paper": s["paper"],
                "dataset": s["dataset"],
                "backbone": s["backbone"],
                "method": s["method"],
                "epochs": s["epochs"],
                "τ": s["temperature"],
                "lr scaling": s["lr_scaling"],
                "metric": s["metric"],
                "B small→large": _b_range(s),
                "top-1 small": [num(v) for v in s["top1_small"]],
                "top-1 large": [num(v) for v in s["top1_large"]],
                "gap (small − large)": _gap_text(s),
                "status": s["status"],
                "status note": s["status_note"].fillna(""),
            }
        )
        blocks.append((display_name(str(fam)), disp.reset_index(drop=True)))
    return blocks


def _compact(side: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "loss family": side["family"].map(display_name),
            "produced by": side["produced_by"],
            "paper": side["paper"],
            "dataset": side["dataset"],
            "epochs": side["epochs"],
            "τ": side["temperature"],
            "setting": side["lr_scaling"].fillna(""),
            "metric": side["metric"],
            "B small→large": _b_range(side),
            "gap (small − large)": _gap_text(side),
            "status": side["status"],
        }
    )


def _side_by_side(p: pd.DataFrame, runs: pd.DataFrame, ctx: ReportContext, ours: dict, note: str) -> pd.DataFrame:
    side = pd.concat([paper_gaps(p), our_gaps(runs, ctx.scale, ours)], ignore_index=True)
    if side.empty:
        side = pd.DataFrame(columns=_SIDE_COLUMNS)
    for c in ("gap_ci_low", "gap_ci_high"):
        side[c] = side[c].astype(float) if c in side else np.nan
    side["status_note"] = side["status_note"].fillna("") if "status_note" in side else ""
    side["family"] = side["family"].fillna("other")
    side = side.assign(_f=side["family"].map(loss_rank), _w=(side["who"] != "paper").astype(int))
    side = side.sort_values(["_f", "_w"], kind="stable").drop(columns=["_f", "_w"]).reset_index(drop=True)
    side["note"] = note
    return side


def build(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    ours = _ours_setting(runs)
    note = (
        "the papers' settings (dataset, backbone, epochs) differ from ours "
        f"(ours: {ours['dataset']}, {ours['backbone']}, {ours['epochs']} epochs); "
        "compare trends across batch size, not absolute numbers"
    )
    out = SectionOutput("papers", "The papers' reported numbers, side by side", "")
    p = ctx.papers.rename(columns={"note": "paper_note"}) if "note" in ctx.papers.columns else ctx.papers.copy()
    p = _labelled(p)
    p["note"] = note
    cols = list(
        dict.fromkeys(
            c
            for c in ("paper", "produced_by", *PAPER_COLUMNS, "status_note", "lr_scaling", "paper_note", "note")
            if c in p.columns
        )
    )
    blocks = [
        (str(paper), p[p["paper"] == paper][[c for c in cols if c not in ("paper", "note")]].reset_index(drop=True))
        for paper in dict.fromkeys(p["paper"])
    ]
    f_rep = ctx.write_table(
        "papers_reported", "Numbers the papers report (with sources and status)", p[cols], blocks, note=note
    )
    side = _side_by_side(p, runs, ctx, ours, note)
    f_side = ctx.write_table(
        "papers_vs_ours_gap",
        "Small-batch vs large-batch gap: the papers' numbers next to ours",
        side,
        _family_blocks(side),
        note=f"{SIGN}; ours with its 95 % paired-t interval over seeds; {note}",
    )
    no_paper = [
        display_name(f)
        for f in dict.fromkeys(side.loc[side["who"] == "ours", "family"])
        if not ((side["family"] == f) & (side["who"] == "paper")).any()
    ]
    out.files += f_rep + f_side
    md = [
        f"> Note: {note}. In this section and every other, {SIGN}.\n",
        f"Reported numbers, grouped per paper with source and status: {ctx.table_links(f_rep)}\n",
        f"Small-vs-large batch gap, papers next to ours (per loss family): {ctx.table_links(f_side)}\n",
    ]
    if no_paper:
        md.append("No paper number at two batch sizes in paper_results.csv for: " + ", ".join(no_paper) + ".\n")
    if len(side):
        md.append(markdown_table(_compact(side)))
    out.markdown = "\n".join(md)
    return out
