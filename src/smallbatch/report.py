"""The study's report, rebuilt from the MLflow store alone.

``build_report(tracking_uri, out_dir)`` reads every run of one experiment (the
config's ``study``) with ``MlflowClient`` and writes

* ``tables/*.csv`` (tidy, full precision), ``tables/*.md`` and ``tables/*.tex``
  (the same numbers laid out for reading; LaTeX needs ``booktabs``);
* ``figures/*.png`` and ``figures/*.svg`` (seaborn);
* ``index.md``: the findings in plain words, computed from the numbers, and a
  relative link to every table and figure.

Conventions
-----------
* Top-1 accuracies are in percent (the pipeline logs percent; a store whose
  accuracies all lie in [0, 1] is read as fractions and scaled by 100).
* A *cell* is dataset x loss (+ any parameter that tells two otherwise equal
  cells apart, e.g. DCLW's sigma or an ``epochs`` axis) x temperature x batch
  size; its value is the mean and sample standard deviation (ddof=1) over seeds.
  One seed gives ``—`` for the deviation.
* A run tagged ``smallbatch.status=diverged`` (or ``failed``) never contributes a
  number; its cell reads ``diverged`` (``failed``) when all its seeds did, and
  ``mean ± std (k/n diverged)`` when only some did.  A cell whose runs exist but
  have not logged the metric yet reads ``pending``.
* When several runs carry the same cell id (a changed config is a new run), the
  newest one is used and the count of superseded runs is stated in index.md.

Sections
--------
``SECTIONS`` is a list of builders ``f(runs, ctx) -> SectionOutput | None``;
``register_section`` appends one, so a study section (``smallbatch.experiment``
in 'precision', 'ksweep', 'ess', 'tsweep', 'mi') can add its own tables and
figures with ``ctx.write_table`` / ``ctx.save_figure`` / ``ctx.histories``.  Runs
no section reported are counted in index.md, never silently dropped.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

__all__ = [
    "build_report", "load_runs", "aggregate_cells", "ReportContext", "SectionOutput",
    "SECTIONS", "register_section", "LOSS_NAMES", "METRICS",
]

# --------------------------------------------------------------------------- names
LOSS_ALIASES = {"ntxent": "infonce", "nt_xent": "infonce", "nt-xent": "infonce", "simclr": "infonce"}
LOSS_ORDER = ("infonce", "flatnce", "dcl", "dclw", "eqco")
LOSS_NAMES = {"infonce": "InfoNCE", "flatnce": "FlatNCE", "dcl": "DCL", "dclw": "DCLW", "eqco": "EqCo"}
#: short metric name -> MLflow metric key of the final top-1 accuracy
METRICS = {"knn": "knn/top1", "linear": "linear/top1"}
METRIC_LABELS = {"knn": "kNN top-1", "linear": "linear top-1"}
TAG = {
    "cell_id": "smallbatch.cell_id", "kind": "smallbatch.kind", "status": "smallbatch.status",
    "experiment": "smallbatch.experiment", "baseline": "smallbatch.baseline",
}
#: params that never tell two cells apart on their own (grid axes, seed, derived values)
_NOT_VARIANT = {"dataset", "loss", "batch_size", "temperature", "seed", "negatives", "experiment",
                "device", "threads", "pretrain_images", "data_root", "download"}
#: figure loss sets (the DCL paper's Figure 1 is about SimCLR/InfoNCE's q_B)
MI_LOSSES = ("infonce",)
QB_LOSSES = ("infonce",)
ESS_LOSSES = ("infonce", "flatnce")
PAPER_COLUMNS = ("paper", "source", "dataset", "backbone", "method", "batch_size", "negatives",
                 "temperature", "epochs", "lr_scaling", "metric", "value", "status")
_HISTORY_BINS = 40
_STALE_SUFFIXES = {".csv", ".md", ".tex", ".png", ".svg"}


def canonical_loss(name: Any) -> str:
    s = str(name).strip().lower()
    return LOSS_ALIASES.get(s, s)


def loss_name(loss: str) -> str:
    return LOSS_NAMES.get(loss, loss)


def _loss_rank(loss: str) -> tuple[int, str]:
    return (LOSS_ORDER.index(loss) if loss in LOSS_ORDER else len(LOSS_ORDER), loss)


def _slug(s: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", str(s)).strip("-").lower() or "x"


def _fmt_t(t: float) -> str:
    return f"{float(t):g}"


def _num(x: float, nd: int = 1) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _signed(x: float, nd: int = 1) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:+.{nd}f}"


# --------------------------------------------------------------------------- reading MLflow
def _resolve_experiment(client, experiment: str | None, uri: str) -> Any:
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise ValueError(f"no runs in experiment {experiment!r} at URI {uri!r} "
                             f"(no such experiment; available: {', '.join(names) or 'none'})")
        return exp
    exps = [e for e in client.search_experiments() if e.name != "Default"]
    for e in exps:
        if e.name == "smallbatch":
            return e
    if len(exps) == 1:
        return exps[0]
    names = sorted(e.name for e in exps)
    raise ValueError(f"experiment must be given: the store at URI {uri!r} holds "
                     f"{len(names)} experiments ({', '.join(names) or 'none'}) and none is named 'smallbatch'")


def load_runs(client, experiment: str | None, uri: str) -> tuple[pd.DataFrame, str]:
    """All active runs of one experiment as a DataFrame, one row per run.

    Columns: ``run_id, run_name, cell_id, kind, status, section, baseline, start_time,
    metric_keys`` (frozenset of logged metric keys), ``params.<key>`` (strings),
    ``metrics.<key>`` (latest value), and typed ``dataset, loss, batch_size,
    temperature, seed``.
    """
    exp = _resolve_experiment(client, experiment, uri)
    runs: list = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=5000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    if not runs:
        raise ValueError(f"no runs in experiment {exp.name!r} at URI {uri!r}")
    rows = []
    for r in runs:
        tags, params, metrics = r.data.tags, r.data.params, r.data.metrics
        status = tags.get(TAG["status"]) or {"FINISHED": "finished", "RUNNING": "running",
                                             "SCHEDULED": "running", "FAILED": "failed",
                                             "KILLED": "failed"}.get(r.info.status, r.info.status.lower())
        row = {
            "run_id": r.info.run_id, "run_name": r.info.run_name,
            "cell_id": tags.get(TAG["cell_id"]) or r.info.run_name or r.info.run_id,
            "kind": tags.get(TAG["kind"]) or "cell", "status": status,
            "section": tags.get(TAG["experiment"]) or "grid",
            "baseline": tags.get(TAG["baseline"]) or params.get("baseline"),
            "start_time": r.info.start_time or 0, "metric_keys": frozenset(metrics),
        }
        row.update({f"params.{k}": v for k, v in params.items()})
        row.update({f"metrics.{k}": v for k, v in metrics.items()})
        rows.append(row)
    df = pd.DataFrame(rows)
    df["dataset"] = df.get("params.dataset", pd.Series(index=df.index, dtype=object))
    df["loss"] = df.get("params.loss", pd.Series(index=df.index, dtype=object)).map(
        lambda v: canonical_loss(v) if isinstance(v, str) else None)
    for col, typ in (("batch_size", "Int64"), ("seed", "Int64"), ("temperature", "float")):
        raw = df.get(f"params.{col}", pd.Series(index=df.index, dtype=object))
        num = pd.to_numeric(raw, errors="coerce")
        df[col] = num.round().astype("Int64") if typ == "Int64" else num.astype(float)
    df = df.sort_values(["section", "kind", "cell_id", "start_time", "run_id"], kind="stable")
    return df.reset_index(drop=True), exp.name


def _accuracy_scale(runs: pd.DataFrame) -> float:
    cols = [c for c in runs.columns if c.startswith("metrics.") and re.search(r"/top[15]", c)]
    vals = pd.concat([runs[c] for c in cols]) if cols else pd.Series(dtype=float)
    vals = vals[np.isfinite(vals.astype(float))] if len(vals) else vals
    return 100.0 if len(vals) and float(vals.max()) <= 1.0 else 1.0


def _dedupe(runs: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Newest run per (kind, section, cell id); returns (runs, number superseded)."""
    if runs.empty:
        return runs, 0
    keep = runs.sort_values("start_time", kind="stable").groupby(
        ["kind", "section", "cell_id"], sort=False).tail(1)
    return runs.loc[sorted(keep.index)], len(runs) - len(keep)


_GREEK = {"alpha": "α", "sigma": "σ", "gamma": "γ"}
_ABSENT = {"", "none", "nan", "null"}


def _absent(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or str(v).strip().lower() in _ABSENT


def _is_default(loss: Any, key: str, v: Any) -> bool:
    from .losses import loss_param_names

    try:
        default = loss_param_names(str(loss)).get(key, "∅")
    except ValueError:  # a loss the registry does not know: no defaults
        return False
    if default is None or _absent(v):
        return default is None and _absent(v)
    try:
        return float(v) == float(default)
    except (TypeError, ValueError):
        return str(v) == str(default)


def cell_labels(cells: pd.DataFrame, axes: Sequence[str] = ()) -> pd.Series:
    """Display label per run, one rule for every table: the loss's display name, then in
    parentheses its parameters that differ from the registry's default or vary between
    otherwise equal cells (``σ=1``, ``α=256``), then any other param that varies between
    cells equal in dataset, loss, batch size, temperature, seed and ``axes`` (an extra
    axis such as ``epochs=40``); ``axes`` are the params a section varies on purpose."""
    def is_axis(c: str) -> bool:
        k = c[len("params."):]
        return any(k == a or k.startswith(f"{a}.") for a in axes)

    pcols = [c for c in cells.columns if c.startswith("params.") and c[len("params."):] not in _NOT_VARIANT
             and not is_axis(c)]
    keys = ["dataset", "loss", "batch_size", "temperature", "seed", *(f"params.{a}" for a in axes
                                                                       if f"params.{a}" in cells.columns)]
    labels = pd.Series(index=cells.index, dtype=object)
    for loss, grp in cells.groupby("loss", sort=True, dropna=False):
        varying = set()
        if len(grp) > 1:
            filled = grp[pcols].fillna("∅").astype(str)
            kg = grp[keys].astype(object).fillna("∅").astype(str).agg("|".join, axis=1)
            varying = {c for c in pcols if filled[c].groupby(kg).nunique().max() > 1}
        loss_cols = sorted(c for c in pcols if c.startswith("params.loss."))
        other = sorted(c for c in varying if not c.startswith("params.loss."))
        for idx, row in grp.iterrows():
            extra = []
            for c in loss_cols:
                p = c[len("params.loss."):]
                if not _absent(row[c]) and (c in varying or not _is_default(loss, p, row[c])):
                    extra.append(f"{_GREEK.get(p, p)}={float(row[c]):g}" if _number(row[c]) else f"{p}={row[c]}")
            extra += [f"{c[len('params.'):]}={row[c]}" for c in other]
            base = loss_name(loss) if isinstance(loss, str) else "?"
            labels[idx] = f"{base} ({', '.join(extra)})" if extra else base
    return labels


def _number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- aggregation
_BAD_STATUS = ("diverged", "failed")


def aggregate_cells(runs: pd.DataFrame, keys: Sequence[str], scale: float,
                    metrics: dict[str, str] = METRICS) -> pd.DataFrame:
    """Mean / sample std over seeds of each final metric per group of ``keys``.

    Returns one row per group and metric with columns ``*keys, metric, mean, std,
    n_seeds, n_runs, n_diverged, n_failed, state, display`` where state is 'ok',
    'partial' (some seeds diverged/failed), 'diverged', 'failed' or 'pending'.
    """
    out = []
    if runs.empty:
        return pd.DataFrame(columns=[*keys, "metric", "mean", "std", "n_seeds", "n_runs",
                                     "n_diverged", "n_failed", "state", "display"])
    for gkey, grp in runs.groupby(list(keys), sort=False, dropna=False):
        gkey = gkey if isinstance(gkey, tuple) else (gkey,)
        n_div = int((grp["status"] == "diverged").sum())
        n_fail = int((grp["status"] == "failed").sum())
        good = grp[~grp["status"].isin(_BAD_STATUS)]
        for m, key in metrics.items():
            col = f"metrics.{key}"
            vals = (good[col] if col in good else pd.Series(dtype=float)).astype(float) * scale
            vals = vals[np.isfinite(vals)]
            n = len(vals)
            mean = float(vals.mean()) if n else math.nan
            std = float(vals.std(ddof=1)) if n > 1 else math.nan
            if n and not (n_div or n_fail):
                state = "ok"
            elif n:
                state = "partial"
            elif n_div:
                state = "diverged"
            elif n_fail:
                state = "failed"
            else:
                state = "pending"
            out.append({**dict(zip(keys, gkey)), "metric": m, "mean": mean, "std": std, "n_seeds": n,
                        "n_runs": len(grp), "n_diverged": n_div, "n_failed": n_fail, "state": state,
                        "display": _display(mean, std, state, n_div + n_fail, len(grp), n_div)})
    return pd.DataFrame(out)


def _display(mean: float, std: float, state: str, n_bad: int, n_runs: int, n_div: int) -> str:
    if state in ("diverged", "failed", "pending"):
        return state
    s = f"{mean:.1f} ± {_num(std)}"
    if state == "partial":
        s += f" ({n_bad}/{n_runs} {'diverged' if n_div else 'failed'})"
    return s


def _sort_cells(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    df = df.assign(_lr=df["loss"].map(lambda v: _loss_rank(v if isinstance(v, str) else "~")))
    by = [c for c in ("dataset", "metric", "temperature", "_lr", "label", "batch_size") if c in df.columns]
    return df.sort_values(by, kind="stable").drop(columns="_lr").reset_index(drop=True)


# --------------------------------------------------------------------------- writers
def _md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame, numeric_right: bool = True) -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(_md_escape(c) for c in cols) + " |"]
    aligns = []
    for c in df.columns:
        right = numeric_right and (pd.api.types.is_numeric_dtype(df[c]) or str(c).startswith("B=")
                                   or str(c).startswith("drop@"))
        aligns.append("---:" if right else ":---")
    lines.append("| " + " | ".join(aligns) + " |")
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_md_escape(_cell_str(v)) for v in row.tolist()) + " |")
    return "\n".join(lines) + "\n"


def _cell_str(v: Any) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return ""
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


_TEX_SUBS = [("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
             ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\^{}")]
_TEX_UNICODE = {"±": r"$\pm$", "—": "---", "–": "--", "τ": r"$\tau$", "→": r"$\to$", "×": r"$\times$",
                "≥": r"$\geq$", "≤": r"$\leq$", "∅": r"$\emptyset$", "σ": r"$\sigma$", "α": r"$\alpha$",
                "γ": r"$\gamma$", "≈": r"$\approx$", "−": "-"}


def tex_escape(s: Any) -> str:
    out = []
    for ch in _cell_str(s):
        if ch in _TEX_UNICODE:
            out.append(_TEX_UNICODE[ch])
            continue
        for a, b in _TEX_SUBS:
            if ch == a:
                ch = b
                break
        out.append(ch)
    return "".join(out)


def latex_table(blocks: Sequence[tuple[str | None, pd.DataFrame]], caption: str, label: str) -> str:
    parts = ["% generated by smallbatch.report from the MLflow store; needs \\usepackage{booktabs}"]
    for i, (sub, df) in enumerate(blocks):
        cap = caption if sub is None else f"{caption} --- {sub}"
        align = "".join("r" if (pd.api.types.is_numeric_dtype(df[c]) or str(c).startswith(("B=", "drop@")))
                        else "l" for c in df.columns)
        parts += ["\\begin{table}[ht]", "\\centering", "\\small" if len(df.columns) <= 8 else "\\scriptsize",
                  f"\\caption{{{tex_escape(cap)}}}",
                  f"\\label{{tab:{label}{'' if len(blocks) == 1 else f'-{i + 1}'}}}",
                  f"\\begin{{tabular}}{{{align}}}", "\\toprule",
                  " & ".join(tex_escape(c) for c in df.columns) + r" \\", "\\midrule"]
        for _, row in df.iterrows():
            parts.append(" & ".join(tex_escape(v) for v in row.tolist()) + r" \\")
        parts += ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- context
@dataclass
class SectionOutput:
    """What a section builder returns.

    ``markdown`` goes into index.md under ``## title`` (links relative to out_dir);
    ``files`` are every table/figure file written; ``findings`` are plain-language
    sentences collected at the top of index.md; ``run_ids`` the runs it reported.
    """

    name: str
    title: str
    markdown: str
    files: list[Path] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)


@dataclass
class ReportContext:
    """Shared state handed to every section builder."""

    out_dir: Path
    tracking_uri: str
    experiment: str
    client: Any
    scale: float
    papers: pd.DataFrame
    runs: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    _hist_cache: dict = field(default_factory=dict)
    history_calls: int = 0

    @property
    def tables_dir(self) -> Path:
        return self.out_dir / "tables"

    @property
    def figures_dir(self) -> Path:
        return self.out_dir / "figures"

    def rel(self, p: Path) -> str:
        return p.relative_to(self.out_dir).as_posix()

    # ---- tables
    def write_table(self, name: str, title: str, data: pd.DataFrame,
                    blocks: Sequence[tuple[str | None, pd.DataFrame]] | None = None,
                    note: str | None = None) -> list[Path]:
        """Write ``tables/<name>.csv`` (``data``, tidy) and ``.md`` / ``.tex`` (``blocks`` for reading)."""
        self.tables_dir.mkdir(parents=True, exist_ok=True)
        blocks = list(blocks) if blocks is not None else [(None, data)]
        csv = self.tables_dir / f"{name}.csv"
        data.to_csv(csv, index=False, float_format="%.10g")
        md_parts = [f"# {title}\n"]
        if note:
            md_parts.append(f"> Note: {note}\n")
        for sub, df in blocks:
            if sub:
                md_parts.append(f"## {sub}\n")
            md_parts.append(markdown_table(df) if len(df) else "_(no rows)_\n")
        md = self.tables_dir / f"{name}.md"
        md.write_text("\n".join(md_parts), encoding="utf-8")
        tex = self.tables_dir / f"{name}.tex"
        caption = title if not note else f"{title}. Note: {note}"
        tex.write_text(latex_table([(s, d) for s, d in blocks if len(d)] or [(None, data.head(0))],
                                   caption, _slug(name)), encoding="utf-8")
        files = [csv, md, tex]
        self.written += files
        return files

    def table_links(self, files: Sequence[Path]) -> str:
        by = {p.suffix: p for p in files}
        return " · ".join(f"[{lab}]({self.rel(by[s])})" for s, lab in
                          ((".md", "Markdown"), (".csv", "CSV"), (".tex", "LaTeX")) if s in by)

    # ---- figures
    def save_figure(self, fig, stem: str) -> list[Path]:
        import matplotlib.pyplot as plt

        self.figures_dir.mkdir(parents=True, exist_ok=True)
        png, svg = self.figures_dir / f"{stem}.png", self.figures_dir / f"{stem}.svg"
        fig.savefig(png, dpi=130, bbox_inches="tight", metadata={"Software": None})
        fig.savefig(svg, bbox_inches="tight", metadata={"Date": None})
        plt.close(fig)
        self.written += [png, svg]
        return [png, svg]

    def figure_md(self, files: Sequence[Path], alt: str) -> str:
        png = next(p for p in files if p.suffix == ".png")
        svg = next((p for p in files if p.suffix == ".svg"), None)
        s = f"![{alt}]({self.rel(png)})"
        if svg is not None:
            s += f"\n\n[{alt} (PNG)]({self.rel(png)}) · [SVG]({self.rel(svg)})"
        return s + "\n"

    # ---- metric histories
    def histories(self, run_ids: Iterable[str], key: str) -> pd.DataFrame:
        """Step history of ``key`` for the given runs: columns run_id, step, value.

        One ``get_metric_history`` query per run (cached); runs that never logged
        ``key`` are skipped without a query.
        """
        logged = dict(zip(self.runs["run_id"], self.runs["metric_keys"]))
        frames = []
        for rid in sorted(set(run_ids)):
            if key not in logged.get(rid, ()):
                continue
            if (rid, key) not in self._hist_cache:
                hist = self.client.get_metric_history(rid, key)
                self.history_calls += 1
                self._hist_cache[(rid, key)] = pd.DataFrame(
                    {"run_id": rid, "step": [m.step for m in hist], "value": [m.value for m in hist]})
            frames.append(self._hist_cache[(rid, key)])
        if not frames:
            return pd.DataFrame(columns=["run_id", "step", "value"])
        return pd.concat(frames, ignore_index=True)


SectionBuilder = Callable[[pd.DataFrame, ReportContext], "SectionOutput | None"]
SECTIONS: list[SectionBuilder] = []


def register_section(fn: SectionBuilder) -> SectionBuilder:
    """Append a section builder (usable as a decorator); index.md keeps this order."""
    if fn not in SECTIONS:
        SECTIONS.append(fn)
    return fn


# --------------------------------------------------------------------------- baselines
def _baseline_runs(runs: pd.DataFrame) -> pd.DataFrame:
    b, _ = _dedupe(runs[runs["kind"] == "baseline"])
    return b.assign(baseline=b["baseline"].fillna("baseline"))


def _baseline_table(runs: pd.DataFrame, scale: float) -> pd.DataFrame:
    b = _baseline_runs(runs)
    agg = aggregate_cells(b, ["dataset", "baseline"], scale)
    return agg.sort_values(["dataset", "metric", "baseline"], kind="stable").reset_index(drop=True)


def _best_baselines(runs: pd.DataFrame, scale: float) -> dict[tuple[str, str], tuple[str, float]]:
    """(dataset, metric) -> (baseline name, mean top-1) of the best baseline."""
    agg = _baseline_table(runs, scale)
    best: dict[tuple[str, str], tuple[str, float]] = {}
    for (ds, m), g in agg.groupby(["dataset", "metric"], sort=True):
        g = g[np.isfinite(g["mean"])]
        if len(g):
            row = g.sort_values(["mean", "baseline"], ascending=[False, True], kind="stable").iloc[0]
            best[(ds, m)] = (str(row["baseline"]), float(row["mean"]))
    return best


# --------------------------------------------------------------------------- the main grid
def _grid_cells(runs: pd.DataFrame) -> tuple[pd.DataFrame, int, int]:
    cells = runs[(runs["kind"] == "cell") & (runs["section"] == "grid")]
    cells, superseded = _dedupe(cells)
    ok = cells["dataset"].notna() & cells["loss"].notna() & cells["batch_size"].notna() & \
        cells["temperature"].notna()
    bad = int((~ok).sum())
    cells = cells[ok].copy()
    cells["label"] = cell_labels(cells) if len(cells) else pd.Series(dtype=object)
    return cells, superseded, bad


def _pivot_display(agg: pd.DataFrame, index: list[str], value: str = "display") -> pd.DataFrame:
    bss = sorted(agg["batch_size"].dropna().unique())
    rows = []
    for key, g in agg.groupby(index, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(index, key))
        vals = dict(zip(g["batch_size"], g[value]))
        for b in bss:
            v = vals.get(b, "")
            row[f"B={int(b)}"] = v if isinstance(v, str) else _num(v) if pd.notna(v) else ""
        rows.append(row)
    df = pd.DataFrame(rows)
    return df.rename(columns={"temperature": "τ", "label": "loss"})


def _dependence(agg: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, metric, temperature, label): best batch size, drops, small-vs-large gap."""
    rows = []
    for (ds, m, t, lab), g in agg.groupby(["dataset", "metric", "temperature", "label"], sort=False):
        bss_all = sorted(agg[(agg["dataset"] == ds) & (agg["temperature"] == t)]["batch_size"].unique())
        g = g.set_index("batch_size")
        num = g[np.isfinite(g["mean"])]
        row: dict[str, Any] = {"dataset": ds, "metric": m, "temperature": t, "loss": g["loss"].iloc[0],
                               "label": lab}
        if len(num):
            best_b = int(num["mean"].idxmax())
            row["best_batch_size"], row["best_mean"] = best_b, float(num["mean"].max())
        else:
            row["best_batch_size"], row["best_mean"] = pd.NA, math.nan
        for b in bss_all:
            if b in g.index and np.isfinite(g.loc[b, "mean"]):
                row[f"drop_bs{int(b)}"] = row["best_mean"] - float(g.loc[b, "mean"])
            else:
                row[f"drop_bs{int(b)}"] = math.nan
        bmin, bmax = int(bss_all[0]), int(bss_all[-1])
        row["smallest_batch_size"], row["largest_batch_size"] = bmin, bmax
        for tag, b in (("smallest", bmin), ("largest", bmax)):
            if b in g.index:
                row[f"mean_{tag}"] = float(g.loc[b, "mean"])
                row[f"std_{tag}"] = float(g.loc[b, "std"])
                row[f"n_{tag}"] = int(g.loc[b, "n_seeds"])
                row[f"state_{tag}"] = str(g.loc[b, "state"])
            else:
                row[f"mean_{tag}"], row[f"std_{tag}"], row[f"n_{tag}"] = math.nan, math.nan, 0
                row[f"state_{tag}"] = "not run"
        row["loss_large_to_small"] = row["mean_largest"] - row["mean_smallest"] if bmax != bmin else math.nan
        row["drop_at_smallest"] = row.get(f"drop_bs{bmin}", math.nan)
        row["states"] = {int(b): str(s) for b, s in g["state"].items()}
        rows.append(row)
    return pd.DataFrame(rows)


def _dependence_display(dep: pd.DataFrame) -> pd.DataFrame:
    drop_cols = sorted((c for c in dep.columns if c.startswith("drop_bs")), key=lambda c: int(c[7:]))
    out = []
    for _, r in dep.iterrows():
        row = {"τ": r["temperature"], "loss": r["label"],
               "best B": "" if pd.isna(r["best_batch_size"]) else int(r["best_batch_size"]),
               "best top-1": _num(r["best_mean"])}
        for c in drop_cols:
            b = int(c[7:])
            st = r["states"].get(b)
            row[f"drop@{b}"] = st if st in ("diverged", "failed", "pending") else (
                "" if st is None else _num(r[c]))
        st = r["state_smallest"]
        gap = _signed(-r["loss_large_to_small"]) if np.isfinite(r["loss_large_to_small"]) else (
            st if st in ("diverged", "failed", "pending") else "—")
        row[f"Δ B={int(r['largest_batch_size'])}→{int(r['smallest_batch_size'])}"] = gap
        out.append(row)
    return pd.DataFrame(out)


def _findings(dep: pd.DataFrame, ds: str, m: str, t: float) -> str:
    """One paragraph for (dataset, metric, τ), every number from ``dep``."""
    d = dep[(dep["dataset"] == ds) & (dep["metric"] == m) & (dep["temperature"] == t)]
    if d.empty:
        return ""
    mlabel = METRIC_LABELS.get(m, m)
    bmin, bmax = int(d["smallest_batch_size"].iloc[0]), int(d["largest_batch_size"].iloc[0])
    head = f"On {ds} at τ={_fmt_t(t)} ({mlabel})"
    if bmin == bmax:
        return f"{head}: only batch size {bmin} was run, so batch-size dependence cannot be measured."
    rankable, diverged, missing = [], [], []
    for _, r in d.iterrows():
        if np.isfinite(r["mean_smallest"]) and np.isfinite(r["mean_largest"]) and np.isfinite(r["drop_at_smallest"]):
            rankable.append(r)
        elif r["state_smallest"] in ("diverged", "failed"):
            diverged.append(r)
        else:
            missing.append(r)
    s = [head + ":"]
    if rankable:
        changes = ", ".join(f"{r['label']} {_signed(r['mean_smallest'] - r['mean_largest'])}" for r in rankable)
        s.append(f"going from batch {bmax} to batch {bmin} the top-1 changes by {changes} points.")
    for r in diverged:
        s.append(f"{r['label']} {r['state_smallest']} at batch {bmin} (all seeds).")
    for r in missing:
        s.append(f"{r['label']} is left out of the ranking (batch {bmin}: {r['state_smallest']}, "
                 f"batch {bmax}: {r['state_largest']}).")
    ranked = sorted(rankable, key=lambda r: (round(float(r["drop_at_smallest"]), 9), _loss_rank(r["loss"]),
                                             r["label"]))

    def shown(r) -> float:  # the drop as the sentence prints it
        return round(float(r["drop_at_smallest"]), 1)

    def names(rs) -> str:
        b = [f"**{r['label']}**" for r in rs]
        return b[0] if len(b) == 1 else ", ".join(b[:-1]) + " and " + b[-1]

    lead = f"Measured as the drop from each loss's best batch size to batch {bmin}, "
    if len(ranked) + len(diverged) < 2:
        if len(ranked) == 1:
            s.append("Only one loss has values at both batch sizes, so there is nothing to rank.")
        elif not ranked:
            s.append("No loss has values at both batch sizes yet, so there is nothing to rank.")
    elif not ranked:
        s.append("No loss has values at both batch sizes yet, so there is nothing to rank.")
    elif not diverged and shown(ranked[-1]) == 0.0:
        s.append(f"Every loss is at its best at batch {bmin} (to 0.1 points), so none loses accuracy at the "
                 "smallest batch size and there is no dependence to rank.")
    elif not diverged and shown(ranked[0]) == shown(ranked[-1]):
        s.append(lead + f"all {len(ranked)} losses lose the same {shown(ranked[0]):.1f} points at this precision, "
                 "so no loss depends less on batch size than another.")
    else:
        least = [r for r in ranked if shown(r) == shown(ranked[0])]
        rest = [r for r in ranked if shown(r) != shown(ranked[0])]
        if len(least) == 1:
            s.append(lead + f"the loss that depends least on batch size is {names(least)} "
                     f"({shown(least[0]):.1f} points)")
        else:
            s.append(lead + f"the losses that depend least on batch size are {names(least)} "
                     f"(tied at {shown(least[0]):.1f} points)")
        if diverged:
            s[-1] += (f" and the one that depends most is **{diverged[0]['label']}**, which "
                      f"{diverged[0]['state_smallest']} at batch {bmin}.")
        else:
            most = [r for r in rest if shown(r) == shown(ranked[-1])]
            s[-1] += (f" and the one that depends most is {names(most)} ({shown(most[0]):.1f} points)."
                      if len(most) == 1 else
                      f" and the ones that depend most are {names(most)} (tied at {shown(most[0]):.1f} points).")
        if len(least) == 1 and rest:
            first, second = least[0], rest[0]
            margin = float(second["drop_at_smallest"] - first["drop_at_smallest"])
            n1, n2 = int(first["n_smallest"]), int(second["n_smallest"])
            if n1 < 2 or n2 < 2:
                s.append(f"With a single seed in a cell there is no error estimate: the {margin:.1f}-point lead "
                         f"over {second['label']} is not tested.")
            else:
                se = math.sqrt(first["std_smallest"] ** 2 / n1 + second["std_smallest"] ** 2 / n2)
                verdict = ("is within two standard errors of the seed spread at batch "
                           f"{bmin} ({2 * se:.1f}), so these seeds do not separate the two" if margin < 2 * se else
                           f"exceeds two standard errors of the seed spread at batch {bmin} ({2 * se:.1f})")
                s.append(f"Its lead over {second['label']} ({margin:.1f} points) {verdict}.")
    return " ".join(s)


def _baseline_finding(agg: pd.DataFrame, best: dict, ds: str, m: str) -> tuple[str, pd.Series]:
    a = agg[(agg["dataset"] == ds) & (agg["metric"] == m)]
    mlabel = METRIC_LABELS.get(m, m)
    if (ds, m) not in best:
        return (f"On {ds} there is no baseline with a {mlabel}, so the pretraining gain cannot be computed.",
                pd.Series(math.nan, index=a.index))
    name, val = best[(ds, m)]
    gain = a["mean"] - val
    beat = int((gain > 0).sum())
    n_div = int(a["state"].isin(["diverged", "failed"]).sum())
    n_pend = int((a["state"] == "pending").sum())
    extra = []
    if n_div:
        extra.append(f"{n_div} diverged or failed")
    if n_pend:
        extra.append(f"{n_pend} pending")
    tail = f" ({'; '.join(extra)})" if extra else ""
    return (f"On {ds}, {beat} of {len(a)} grid cells beat the best baseline's {mlabel} "
            f"({name}, {val:.1f}%){tail}.", gain)


def _grid_section(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    cells, superseded, bad = _grid_cells(runs)
    out = SectionOutput("grid", "Main grid: loss × batch size × temperature", "")
    if superseded:
        ctx.notes.append(f"{superseded} grid run(s) were superseded by a newer run of the same cell id "
                         "(changed config) and are not in the tables.")
    if bad:
        ctx.notes.append(f"{bad} grid run(s) lack one of the params dataset/loss/batch_size/temperature "
                         "and are not in the tables.")
    if cells.empty:
        out.markdown = "No grid cells (runs with kind 'cell' and experiment 'grid') in this experiment.\n"
        return out
    out.run_ids = set(cells["run_id"])
    keys = ["dataset", "temperature", "loss", "label", "batch_size"]
    agg = _sort_cells(aggregate_cells(cells, keys, ctx.scale))
    best = _best_baselines(runs, ctx.scale)
    agg["best_baseline"] = [best.get((d, m), ("", math.nan))[0] for d, m in zip(agg["dataset"], agg["metric"])]
    agg["best_baseline_top1"] = [best.get((d, m), ("", math.nan))[1] for d, m in zip(agg["dataset"], agg["metric"])]
    agg["gain_vs_best_baseline"] = agg["mean"] - agg["best_baseline_top1"]
    dep = _dependence(agg)
    seeds = cells.groupby(keys, dropna=False)["seed"].nunique()
    n_lo, n_hi = int(seeds.min()), int(seeds.max())
    n_seeds = f"{n_lo} seed{'s' if n_lo != 1 else ''}" if n_lo == n_hi else f"{n_lo}–{n_hi} seeds"
    seed_note = (f"mean ± sample std (ddof=1) over seeds ({n_seeds} per cell); "
                 "'—' = one seed; diverged/failed runs give no number; 'pending' = not evaluated yet")
    md = [f"{len(cells)} runs, {len(agg) // max(len(METRICS), 1)} cells. Top-1 in percent, {seed_note}.\n"]
    figs_md = []
    for ds in sorted(agg["dataset"].unique()):
        a_ds = agg[agg["dataset"] == ds]
        md.append(f"### {ds}\n")
        for m in METRICS:
            a = a_ds[a_ds["metric"] == m]
            if a.empty:
                continue
            mlabel = METRIC_LABELS[m]
            tidy_cols = ["dataset", "metric", "temperature", "loss", "label", "batch_size", "mean", "std",
                         "n_seeds", "n_runs", "n_diverged", "n_failed", "state", "display", "best_baseline",
                         "best_baseline_top1", "gain_vs_best_baseline"]
            # 1. loss x batch size (temperature as the outer row level)
            f1 = ctx.write_table(
                f"grid_top1_{_slug(ds)}_{m}", f"{ds}: {mlabel} (%) by loss × batch size", a[tidy_cols],
                [(None, _pivot_display(a, ["temperature", "label"]))], note=seed_note)
            # 2. temperature x batch size per loss
            a2 = a.copy()
            a2["disp2"] = a2["display"]
            for _, g in a2.groupby(["label", "batch_size"]):
                g = g[np.isfinite(g["mean"])]
                if g["temperature"].nunique() > 1:
                    i = g["mean"].idxmax()
                    a2.loc[i, "disp2"] = a2.loc[i, "display"] + " *"
            a2 = a2.assign(_lr=a2["loss"].map(_loss_rank)).sort_values(
                ["_lr", "label", "temperature", "batch_size"], kind="stable").drop(columns="_lr")
            f2 = ctx.write_table(
                f"grid_temperature_{_slug(ds)}_{m}", f"{ds}: {mlabel} (%), temperature × batch size per loss",
                a2[tidy_cols], [(None, _pivot_display(a2, ["label", "temperature"], "disp2"))],
                note=seed_note + "; * = best temperature for this loss and batch size")
            # 3. batch-size dependence
            d = dep[(dep["dataset"] == ds) & (dep["metric"] == m)]
            f3 = ctx.write_table(
                f"grid_dependence_{_slug(ds)}_{m}",
                f"{ds}: {mlabel} batch-size dependence (points lost from each loss's best batch size)",
                d.drop(columns=["states"]), [(None, _dependence_display(d))],
                note="drop@B = best mean top-1 over batch sizes minus mean top-1 at B; "
                     "Δ = mean at the smallest minus mean at the largest batch size")
            # 5b. pretraining gain
            if np.isfinite(a["best_baseline_top1"]).any():
                a5 = a.assign(gain_disp=[("" if not np.isfinite(v) else _signed(v)) if st not in
                                         ("diverged", "failed", "pending") else st
                                         for v, st in zip(a["gain_vs_best_baseline"], a["state"])])
                bname, bval = best[(ds, m)]
                f5 = ctx.write_table(
                    f"grid_gain_{_slug(ds)}_{m}",
                    f"{ds}: pretraining gain in {mlabel} over the best baseline ({bname}, {bval:.1f}%)",
                    a[tidy_cols], [(None, _pivot_display(a5, ["temperature", "label"], "gain_disp"))],
                    note="gain = cell mean top-1 minus the best baseline's mean top-1 (points)")
            else:
                f5 = []
            out.files += f1 + f2 + f3 + f5
            md.append(f"**{mlabel}** — loss × batch size: {ctx.table_links(f1)}; temperature × batch size: "
                      f"{ctx.table_links(f2)}; batch-size dependence: {ctx.table_links(f3)}"
                      + (f"; gain over best baseline: {ctx.table_links(f5)}" if f5 else "") + "\n")
            md.append(markdown_table(_dependence_display(d)))
            for t in sorted(a["temperature"].unique()):
                out.findings.append(_findings(dep, ds, m, t))
            sent, _ = _baseline_finding(a, best, ds, m)
            out.findings.append(sent)
        for fig_fn in (_fig_accuracy, _fig_mi_fraction, _fig_qb, _fig_ess):
            files, text = fig_fn(cells[cells["dataset"] == ds], agg[agg["dataset"] == ds], ds, ctx)
            out.files += files
            figs_md.append(text)
    md.append("### Figures\n")
    md += figs_md
    out.markdown = "\n".join(md)
    return out


# --------------------------------------------------------------------------- figures
def _plot_style():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    rc = {"svg.hashsalt": "smallbatch", "figure.max_open_warning": 0}
    return plt, sns, rc


def _palette(labels: Sequence[str]) -> dict:
    import seaborn as sns

    return dict(zip(labels, sns.color_palette("tab10", max(len(labels), 1))))


def _label_order(df: pd.DataFrame) -> list[str]:
    pairs = df[["loss", "label"]].drop_duplicates()
    return [lab for _, lab in sorted(zip(pairs["loss"], pairs["label"]), key=lambda p: (_loss_rank(p[0]), p[1]))]


def _fig_accuracy(cells: pd.DataFrame, agg: pd.DataFrame, ds: str, ctx: ReportContext) -> tuple[list[Path], str]:
    plt, sns, rc = _plot_style()
    rows = []
    good = cells[~cells["status"].isin(_BAD_STATUS)]
    for m, key in METRICS.items():
        col = f"metrics.{key}"
        if col not in good:
            continue
        v = good[col].astype(float) * ctx.scale
        ok = np.isfinite(v)
        rows.append(pd.DataFrame({"label": good.loc[ok, "label"], "loss": good.loc[ok, "loss"],
                                  "batch size": good.loc[ok, "batch_size"].astype(int),
                                  "τ": good.loc[ok, "temperature"].map(_fmt_t),
                                  "metric": METRIC_LABELS[m], "top-1 (%)": v[ok]}))
    data = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    if data.empty:
        return [], f"_{ds}: no kNN/linear top-1 logged yet; accuracy figure skipped._\n"
    labels = _label_order(data)
    pal = _palette(labels)
    taus = [_fmt_t(t) for t in sorted(cells["temperature"].unique())]
    metrics = [METRIC_LABELS[m] for m in METRICS if METRIC_LABELS[m] in set(data["metric"])]
    bss = sorted(int(b) for b in cells["batch_size"].unique())
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=data, kind="line", x="batch size", y="top-1 (%)", hue="label", hue_order=labels,
                        style="label", style_order=labels, markers=True, dashes=False, palette=pal,
                        errorbar="sd", err_style="bars", col="τ", col_order=taus, row="metric",
                        row_order=metrics, height=3.0, aspect=1.25,
                        facet_kws={"sharey": "row", "margin_titles": True})
        for ax in g.axes.flat:
            ax.set_xscale("log", base=2)
            ax.set_xticks(bss)
            ax.set_xticklabels([str(b) for b in bss])
            ax.minorticks_off()
        bad = agg[agg["state"].isin(_BAD_STATUS)]
        for _, r in bad.iterrows():
            ax = g.axes_dict.get((METRIC_LABELS.get(r["metric"]), _fmt_t(r["temperature"])))
            if ax is not None:
                y0 = ax.get_ylim()[0]
                ax.scatter([int(r["batch_size"])], [y0], marker="v", s=80, facecolors="none",
                           edgecolors=[pal.get(r["label"], "k")], linewidths=1.5, clip_on=False, zorder=5)
        g.set_titles(row_template="{row_name}", col_template="τ = {col_name}")
        g.legend.set_title("loss")
        g.figure.suptitle(f"{ds}: top-1 vs batch size (mean ± sd over seeds; ▽ on the x axis = "
                          "all seeds diverged)", y=1.02)
        files = ctx.save_figure(g.figure, f"accuracy_vs_batch_{_slug(ds)}")
    return files, f"**{ds}: accuracy vs batch size**\n\n" + ctx.figure_md(files, f"{ds} accuracy vs batch size")


def _history_frame(cells: pd.DataFrame, key: str, ctx: ReportContext, losses: Sequence[str]) -> pd.DataFrame:
    sub = cells[cells["loss"].isin(losses)]
    h = ctx.histories(sub["run_id"], key)
    if h.empty:
        return h
    h = h[np.isfinite(h["value"].astype(float))]
    if h.empty:
        return h
    meta = sub.set_index("run_id")[["label", "loss", "batch_size", "temperature", "seed"]].assign(
        done=_fraction_done(sub).to_numpy())
    h = h.join(meta, on="run_id")
    mx = h.groupby("run_id")["step"].transform("max").replace(0, 1)
    h["progress"] = h["step"] / mx * h["done"]
    h["τ"] = h["temperature"].map(_fmt_t)
    h["B"] = h["batch_size"].astype(int).astype(str)
    return h


def _fraction_done(runs: pd.DataFrame) -> pd.Series:
    """Share of the planned training a run's last logged step reached: last ``epoch`` / ``epochs``.

    1.0 where either is missing, so a history's x axis is then step / last step.
    """
    ep = runs.get("metrics.epoch", pd.Series(math.nan, index=runs.index)).astype(float)
    total = pd.to_numeric(runs.get("params.epochs", pd.Series(math.nan, index=runs.index)), errors="coerce")
    frac = (ep / total).where(np.isfinite(ep / total) & (total > 0), 1.0)
    return frac.clip(lower=1e-9, upper=1.0)


def _binned(h: pd.DataFrame) -> pd.DataFrame:
    b = np.minimum((h["progress"] * _HISTORY_BINS).astype(int), _HISTORY_BINS - 1)
    h = h.assign(progress=(b + 0.5) / _HISTORY_BINS)
    return h.groupby(["run_id", "label", "loss", "τ", "B", "batch_size", "progress"], as_index=False)["value"].mean()


def _b_order(h: pd.DataFrame) -> list[str]:
    return [str(b) for b in sorted(h["batch_size"].astype(int).unique())]


def _missing_fig(ds: str, what: str, key: str, losses: Sequence[str]) -> str:
    names = ", ".join(loss_name(x) for x in losses)
    return f"_{ds}: no `{key}` history for {names} runs; {what} figure skipped._\n"


def _fig_mi_fraction(cells, agg, ds, ctx) -> tuple[list[Path], str]:
    key = "diag/mi_fraction"
    h = _history_frame(cells, key, ctx, MI_LOSSES)
    if h.empty:
        return [], _missing_fig(ds, "MI-saturation", key, MI_LOSSES)
    plt, sns, rc = _plot_style()
    hb = _binned(h)
    border = _b_order(hb)
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=hb, kind="line", x="progress", y="value", hue="B", hue_order=border,
                        palette=sns.color_palette("viridis", len(border)), errorbar="sd",
                        col="τ", col_order=[_fmt_t(t) for t in sorted(hb["τ"].astype(float).unique())],
                        row="label", height=3.0, aspect=1.3)
        g.set_titles("{row_name} | τ = {col_name}")
        for ax in g.axes.flat:
            ax.axhline(1.0, ls="--", lw=1, color="grey")
        g.set_axis_labels("fraction of training (epoch / epochs)", "MI estimate / log(K+1)")
        g.legend.set_title("batch size")
        g.figure.suptitle(f"{ds}: InfoNCE's MI estimate as a fraction of its ceiling log(K+1)", y=1.02)
        files = ctx.save_figure(g.figure, f"mi_fraction_{_slug(ds)}")
    return files, (f"**{ds}: InfoNCE's MI bound saturation** (`{key}` over training, one line per batch size, "
                   "mean ± sd over seeds)\n\n" + ctx.figure_md(files, f"{ds} MI fraction"))


def _fig_qb(cells, agg, ds, ctx) -> tuple[list[Path], str]:
    key = "diag/qb_mean"
    h = _history_frame(cells, key, ctx, QB_LOSSES)
    if h.empty:
        return [], _missing_fig(ds, "q_B", key, QB_LOSSES)
    h = h[h["progress"] >= 0.5]
    plt, sns, rc = _plot_style()
    border = _b_order(h)
    with plt.rc_context(rc), sns.axes_style("whitegrid"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # seaborn 0.13 passes boxplot(vert=) to mpl 3.11
        g = sns.catplot(data=h, kind="box", x="B", order=border, y="value", hue="B", hue_order=border,
                        palette=sns.color_palette("viridis", len(border)), legend=False,
                        col="τ", col_order=[_fmt_t(t) for t in sorted(h["τ"].astype(float).unique())],
                        row="label", height=3.0, aspect=1.1, fliersize=2)
        g.set_titles("{row_name} | τ = {col_name}")
        g.set_axis_labels("batch size", "q_B (mean over the batch)")
        g.figure.suptitle(f"{ds}: distribution of q_B over the second half of training (DCL, Fig. 1)", y=1.02)
        files = ctx.save_figure(g.figure, f"qb_{_slug(ds)}")
    return files, (f"**{ds}: q_B per batch size** (`{key}` logged over the second half of training, all seeds; "
                   "the negative-positive coupling DCL removes)\n\n" + ctx.figure_md(files, f"{ds} q_B"))


def _fig_ess(cells, agg, ds, ctx) -> tuple[list[Path], str]:
    key = "diag/ess"
    h = _history_frame(cells, key, ctx, ESS_LOSSES)
    if h.empty:
        return [], _missing_fig(ds, "ESS", key, ESS_LOSSES)
    plt, sns, rc = _plot_style()
    hb = _binned(h)
    border = _b_order(hb)
    rows = _label_order(hb)
    with plt.rc_context(rc), sns.axes_style("whitegrid"):
        g = sns.relplot(data=hb, kind="line", x="progress", y="value", hue="B", hue_order=border,
                        palette=sns.color_palette("viridis", len(border)), errorbar="sd",
                        col="τ", col_order=[_fmt_t(t) for t in sorted(hb["τ"].astype(float).unique())],
                        row="label", row_order=rows, height=3.0, aspect=1.3, facet_kws={"sharey": True})
        v = hb["value"]
        if (v > 0).all() and v.max() / v.min() > 20:
            for ax in g.axes.flat:
                ax.set_yscale("log")
        g.set_titles("{row_name} | τ = {col_name}")
        g.set_axis_labels("fraction of training (epoch / epochs)", "ESS / K = 1 / (K Σ w²)")
        g.legend.set_title("batch size")
        g.figure.suptitle(f"{ds}: normalised effective sample size of the softmax weights over negatives", y=1.02)
        files = ctx.save_figure(g.figure, f"ess_{_slug(ds)}")
    return files, (f"**{ds}: ESS over training** (`{key}`, " + ", ".join(loss_name(x) for x in ESS_LOSSES)
                   + ", one line per batch size)\n\n" + ctx.figure_md(files, f"{ds} ESS"))


# --------------------------------------------------------------------------- baselines section
def _baselines_section(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    b = _baseline_runs(runs)
    out = SectionOutput("baselines", "Baselines: raw pixels and a random-init encoder", "")
    if b.empty:
        out.markdown = "No baseline runs (kind 'baseline') in this experiment.\n"
        return out
    out.run_ids = set(b["run_id"])
    agg = _baseline_table(runs, ctx.scale)
    disp = []
    for (ds, name), g in agg.groupby(["dataset", "baseline"], sort=True):
        row = {"dataset": ds, "baseline": name}
        for m in METRICS:
            gm = g[g["metric"] == m]
            row[METRIC_LABELS[m]] = gm["display"].iloc[0] if len(gm) else ""
        row["seeds"] = int(g["n_runs"].max())
        disp.append(row)
    files = ctx.write_table("baselines", "Baselines: top-1 (%) of the same kNN and linear probes",
                            agg, [(None, pd.DataFrame(disp))],
                            note="mean ± sample std over seeds; pretraining gain tables are in the grid section")
    out.files += files
    for (ds, m), g in agg.groupby(["dataset", "metric"], sort=True):
        g = g[np.isfinite(g["mean"])].sort_values(["mean", "baseline"], ascending=[False, True], kind="stable")
        if len(g):
            out.findings.append(f"Best baseline on {ds} ({METRIC_LABELS.get(m, m)}): {g['baseline'].iloc[0]} "
                                f"at {g['mean'].iloc[0]:.1f}%.")
    out.markdown = f"Baseline top-1: {ctx.table_links(files)}\n\n" + markdown_table(pd.DataFrame(disp))
    return out


# --------------------------------------------------------------------------- diverged section
def _diverged_section(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    d, _ = _dedupe(runs)
    d = d[d["status"].isin(_BAD_STATUS)]
    cols = ["cell_id", "status", "section", "kind", "dataset", "loss", "temperature", "batch_size", "seed",
            "last_train_loss", "run_id"]
    d = d.assign(last_train_loss=d.get("metrics.train/loss", pd.Series(math.nan, index=d.index)))[cols]
    d = d.sort_values(["section", "cell_id"], kind="stable").reset_index(drop=True)
    out = SectionOutput("diverged", "Diverged and failed runs", "")
    files = ctx.write_table("diverged_runs", "Runs that diverged or failed (they count as results)", d,
                            note="a diverged run gives no accuracy; its cell reads 'diverged' in every table")
    out.files += files
    if d.empty:
        out.markdown = f"No run diverged or failed. ({ctx.table_links(files)})\n"
    else:
        out.findings.append(f"{int((d['status'] == 'diverged').sum())} run(s) diverged and "
                            f"{int((d['status'] == 'failed').sum())} failed; they are listed, not dropped.")
        out.markdown = f"{len(d)} run(s): {ctx.table_links(files)}\n\n" + markdown_table(
            d.drop(columns=["run_id"]).rename(columns={"temperature": "τ"}))
    return out


# --------------------------------------------------------------------------- papers section
def load_papers(path: str | Path | None = None) -> pd.DataFrame:
    """The papers' reported numbers (package data by default)."""
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
        num = pd.to_numeric(df[col], errors="coerce")
        if (num.dropna() % 1 == 0).all():
            df[col] = num.round().astype("Int64")
    return df


def paper_family(method: Any) -> str | None:
    s = str(method).lower()
    if "flatnce" in s:
        return "flatnce"
    if "dclw" in s:
        return "dclw"
    if re.search(r"\bdcl\b", s):
        return "dcl"
    if "eqco" in s or "simo" in s:
        return "eqco"
    if any(k in s for k in ("nt-xent", "simclr", "infonce", "cross-entropy", "moco")):
        return "infonce"
    return None


def _ours_setting(runs: pd.DataFrame) -> dict[str, str]:
    cells = runs[runs["kind"] == "cell"]

    def vals(col: str) -> str:
        c = cells.get(f"params.{col}")
        if c is None:
            return "?"
        u = sorted(set(str(v) for v in c.dropna()))
        return "/".join(u) if u else "?"

    return {"dataset": vals("dataset"), "backbone": vals("backbone"), "epochs": vals("epochs")}


def _paper_gaps(p: pd.DataFrame) -> pd.DataFrame:
    rows = []
    keys = ["paper", "source", "dataset", "backbone", "method", "temperature", "epochs", "lr_scaling", "metric"]
    q = p[pd.to_numeric(p["batch_size"], errors="coerce").notna()].copy()
    q["batch_size"] = pd.to_numeric(q["batch_size"]).astype(int)
    for key, g in q.groupby(keys, sort=False, dropna=False):
        if g["batch_size"].nunique() < 2:
            continue
        g = g.sort_values("batch_size", kind="stable")
        lo, hi = g.iloc[0], g.iloc[-1]
        rows.append({"family": paper_family(lo["method"]), "who": "paper", **dict(zip(keys, key)),
                     "small_batch_size": int(lo["batch_size"]), "large_batch_size": int(hi["batch_size"]),
                     "top1_small": float(lo["value"]), "top1_large": float(hi["value"]),
                     "gap_large_minus_small": float(hi["value"]) - float(lo["value"]),
                     "status": "; ".join(sorted(set(str(s) for s in g["status"])))})
    return pd.DataFrame(rows)


def _papers_section(runs: pd.DataFrame, ctx: ReportContext) -> SectionOutput | None:
    p = ctx.papers.copy()
    ours = _ours_setting(runs)
    note = ("the papers' settings (dataset, backbone, epochs) differ from ours "
            f"(ours: {ours['dataset']}, {ours['backbone']}, {ours['epochs']} epochs); "
            "compare trends across batch size, not absolute numbers")
    out = SectionOutput("papers", "The papers' reported numbers, side by side", "")
    if "note" in p.columns:
        p = p.rename(columns={"note": "paper_note"})
    p["note"] = note
    cols = [c for c in (*PAPER_COLUMNS, "lr_scaling", "paper_note", "note") if c in p.columns]
    cols = list(dict.fromkeys(cols))
    blocks = []
    for paper in dict.fromkeys(p["paper"]):
        sub = p[p["paper"] == paper][[c for c in cols if c not in ("paper", "note")]]
        blocks.append((str(paper), sub.reset_index(drop=True)))
    f_rep = ctx.write_table("papers_reported", "Numbers the papers report (with sources and status)",
                            p[cols], blocks, note=note)
    # side by side: small-vs-large batch gap, papers vs ours
    gaps = _paper_gaps(p)
    cells, _, _ = _grid_cells(runs)
    ours_rows = []
    if len(cells):
        agg = aggregate_cells(cells, ["dataset", "temperature", "loss", "label", "batch_size"], ctx.scale)
        for (ds, t, loss, lab, m), g in agg.groupby(["dataset", "temperature", "loss", "label", "metric"],
                                                    sort=True):
            if g["batch_size"].nunique() < 2:
                continue
            g = g.sort_values("batch_size")
            lo, hi = g.iloc[0], g.iloc[-1]
            ours_rows.append({"family": loss, "who": "ours", "paper": "this study", "source": "MLflow store",
                              "dataset": ds, "backbone": ours["backbone"], "method": lab, "temperature": t,
                              "epochs": ours["epochs"], "lr_scaling": "", "metric": METRIC_LABELS.get(m, m),
                              "small_batch_size": int(lo["batch_size"]), "large_batch_size": int(hi["batch_size"]),
                              "top1_small": lo["mean"], "top1_large": hi["mean"],
                              "gap_large_minus_small": hi["mean"] - lo["mean"],
                              "status": lo["state"] if lo["state"] != "ok" else hi["state"]})
    side = pd.concat([gaps, pd.DataFrame(ours_rows)], ignore_index=True)
    if side.empty:
        side = pd.DataFrame(columns=["family", "who", "paper", "source", "dataset", "backbone", "method",
                                     "temperature", "epochs", "lr_scaling", "metric", "small_batch_size",
                                     "large_batch_size", "top1_small", "top1_large", "gap_large_minus_small",
                                     "status"])
    side["family"] = side["family"].fillna("other")
    side = side.assign(_f=side["family"].map(_loss_rank), _w=(side["who"] != "paper").astype(int))
    side = side.sort_values(["_f", "_w"], kind="stable").drop(columns=["_f", "_w"]).reset_index(drop=True)
    side["note"] = note
    disp_blocks = []
    for fam in dict.fromkeys(side["family"]):
        s = side[side["family"] == fam]
        disp = pd.DataFrame({
            "who": [f"{w}: {pp}" for w, pp in zip(s["who"], s["paper"])], "source": s["source"],
            "dataset": s["dataset"], "backbone": s["backbone"], "method": s["method"],
            "epochs": s["epochs"], "τ": s["temperature"], "lr scaling": s["lr_scaling"], "metric": s["metric"],
            "B small→large": [f"{a}→{b}" for a, b in zip(s["small_batch_size"], s["large_batch_size"])],
            "top-1 small": [_num(v) for v in s["top1_small"]], "top-1 large": [_num(v) for v in s["top1_large"]],
            "gap (large − small)": [_signed(v) if np.isfinite(v) else st
                                    for v, st in zip(s["gap_large_minus_small"].astype(float), s["status"])],
            "status": s["status"]})
        disp_blocks.append((loss_name(str(fam)), disp.reset_index(drop=True)))
    f_side = ctx.write_table("papers_vs_ours_gap",
                             "Small-batch vs large-batch gap: the papers' numbers next to ours",
                             side, disp_blocks, note=note)
    no_paper = [loss_name(f) for f in dict.fromkeys(side.loc[side["who"] == "ours", "family"])
                if not ((side["family"] == f) & (side["who"] == "paper")).any()]
    out.files += f_rep + f_side
    md = [f"> Note: {note}.\n",
          f"Reported numbers, grouped per paper with source and status: {ctx.table_links(f_rep)}\n",
          f"Small-vs-large batch gap, papers next to ours (per loss family): {ctx.table_links(f_side)}\n"]
    if no_paper:
        md.append("No paper number at two batch sizes in paper_results.csv for: " + ", ".join(no_paper) + ".\n")
    if len(side):
        compact = pd.DataFrame({
            "loss family": side["family"].map(loss_name), "who": side["paper"], "dataset": side["dataset"],
            "epochs": side["epochs"], "τ": side["temperature"], "setting": side["lr_scaling"].fillna(""),
            "metric": side["metric"],
            "B small→large": [f"{a}→{b}" for a, b in zip(side["small_batch_size"], side["large_batch_size"])],
            "gap (large − small)": [_signed(v) if np.isfinite(v) else st for v, st in
                                    zip(side["gap_large_minus_small"].astype(float), side["status"])],
            "status": side["status"]})
        md.append(markdown_table(compact))
    out.markdown = "\n".join(md)
    return out


register_section(_grid_section)
register_section(_baselines_section)
register_section(_diverged_section)
register_section(_papers_section)


# --------------------------------------------------------------------------- build
def build_report(tracking_uri: str, out_dir: str | Path = "results/report", experiment: str | None = None,
                 paper_csv: str | Path | None = None) -> Path:
    """Rebuild every table and figure from the MLflow store; return the path of index.md.

    ``experiment`` is the MLflow experiment (the config's ``study``); None picks
    'smallbatch' or the store's only experiment.  ``paper_csv`` defaults to the
    package's ``resources/paper_results.csv``.  Raises ValueError for an empty
    or missing experiment.
    """
    import matplotlib

    matplotlib.use("Agg")
    from mlflow.tracking import MlflowClient

    out = Path(out_dir)
    papers = load_papers(paper_csv)
    client = MlflowClient(tracking_uri=str(tracking_uri))
    runs, exp_name = load_runs(client, experiment, str(tracking_uri))
    ctx = ReportContext(out_dir=out, tracking_uri=str(tracking_uri), experiment=exp_name, client=client,
                        scale=_accuracy_scale(runs), papers=papers, runs=runs)
    out.mkdir(parents=True, exist_ok=True)
    outputs = [o for o in (fn(runs, ctx) for fn in SECTIONS) if o is not None]
    # stale outputs of an earlier build (e.g. a dataset no longer in the store)
    keep = {p.resolve() for p in ctx.written}
    for sub in (ctx.tables_dir, ctx.figures_dir):
        if sub.is_dir():
            for p in sorted(sub.iterdir()):
                if p.is_file() and p.suffix in _STALE_SUFFIXES and p.resolve() not in keep:
                    p.unlink()
    index = out / "index.md"
    index.write_text(_index_markdown(runs, ctx, outputs), encoding="utf-8")
    return index


def _index_markdown(runs: pd.DataFrame, ctx: ReportContext, outputs: list[SectionOutput]) -> str:
    covered = set().union(*(o.run_ids for o in outputs)) if outputs else set()
    counts = runs.groupby(["section", "kind", "status"], sort=True).size().reset_index(name="runs")
    md = ["# smallbatch report", "",
          f"Experiment `{ctx.experiment}` at `{ctx.tracking_uri}`: {len(runs)} runs. Everything below is "
          "computed from the MLflow store alone; rebuild with "
          f"`smallbatch report --tracking-uri {ctx.tracking_uri} --out {ctx.out_dir.as_posix()}`.", ""]
    md += ["## Findings", ""]
    for o in outputs:
        md += [f"- {f}" for f in o.findings if f]
    if not any(o.findings for o in outputs):
        md.append("- Too few runs with results to state a finding.")
    md.append("")
    for o in outputs:
        md += [f"## {o.title}", "", o.markdown, ""]
    md += ["## Runs in the store", "", markdown_table(counts), ""]
    uncovered = runs[~runs["run_id"].isin(covered)]
    if len(uncovered):
        g = uncovered.groupby(["section", "kind"], sort=True).size()
        md.append("Runs no report section covers yet (no builder registered in `smallbatch.report.SECTIONS`, "
                  "or superseded/incomplete): " + "; ".join(f"{n} of experiment '{s}' (kind '{k}')"
                                                           for (s, k), n in g.items()) + ".")
        md.append("")
    for n in ctx.notes:
        md += [f"- {n}"]
    md += ["", "## All files", ""]
    for o in outputs:
        for p in o.files:
            md.append(f"- [{ctx.rel(p)}]({ctx.rel(p)})")
    md.append("")
    return "\n".join(md)
from . import report_sections as _report_sections  # noqa: E402,F401  (registers the side-experiment sections)
from . import report_mi  # noqa: E402,F401  (registers the "mi" section)
