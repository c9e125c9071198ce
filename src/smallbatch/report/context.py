"""What every section builder gets (the context) and returns (a :class:`SectionOutput`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..io import atomic_write, make_folder, write_text
from .plan import AnalysisPlan
from .tables import Block, table_files, write_table_files

#: the files the last build wrote (paths relative to the report folder, one a line): the
#: only files a later build deletes when it no longer writes them, or replaces
MANIFEST = ".smallbatch-report-files"

#: columns of a frame that hold objects for computing (per-seed values, tests), never a table's
COMPUTING_COLUMNS = (
    "values",
    "estimate",
    "values_smallest",
    "values_largest",
    "values_small",
    "values_large",
    "values_best",
    "values_worst",
)


def write_manifest(out_dir: Path, files: Iterable[str]) -> None:
    """The manifest of ``out_dir``: ``files`` (relative to it), the report's own files there."""
    write_text(out_dir / MANIFEST, "".join(f"{rel}\n" for rel in sorted(files)))


def check_claim(out_dir: Path, mine: frozenset[str] | set[str], paths: Iterable[Path]) -> None:
    """ValueError naming the first of ``paths`` that exists but is not one of ``mine`` (the
    files, relative to ``out_dir``, that the previous build's manifest lists or this build
    wrote): a file of the user's in the --out folder is never replaced."""
    for p in paths:
        if os.path.lexists(p) and p.relative_to(out_dir).as_posix() not in mine:
            raise ValueError(
                f"report output {p} exists and was not written by the report (not in "
                f"{out_dir / MANIFEST}); refused: move it, or choose another --out"
            )


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
    """Shared state handed to every section builder.

    ``reader`` is the store's :class:`smallbatch.tracking.StoreReader` (metric
    histories); ``scale`` turns the logged top-1 into percent; ``papers`` is the
    papers' reported numbers; ``runs`` every run of the experiment; ``notes`` are
    lines index.md prints after the run counts; ``plan`` the study's analysis plan (the
    config's ``analysis``; the schema's default when none is given); ``planned`` the cells the
    study planned against those that finished.
    """

    out_dir: Path
    tracking_uri: str
    experiment: str
    reader: Any
    scale: float
    papers: pd.DataFrame
    runs: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    #: the files (relative to out_dir) the previous build wrote (its manifest): the only
    #: existing files a build may replace (:meth:`claim`)
    prior: frozenset[str] = frozenset()
    #: the files (relative to out_dir) this build listed in the manifest before writing them
    claimed: set[str] = field(default_factory=set)
    plan: AnalysisPlan = field(default_factory=lambda: AnalysisPlan.from_mapping(None))
    #: the study's plan against the runs (:func:`smallbatch.report.planned.plan_status`); None
    #: where no plan was recorded
    planned: Any = None
    history_calls: int = 0
    _hist_cache: dict = field(default_factory=dict)

    @property
    def tables_dir(self) -> Path:
        return self.out_dir / "tables"

    @property
    def figures_dir(self) -> Path:
        return self.out_dir / "figures"

    def rel(self, p: Path) -> str:
        return p.relative_to(self.out_dir).as_posix()

    def claim(self, *paths: Path) -> None:
        """Refuse to write over a file of the user's (:func:`check_claim`); then list ``paths`` in
        the manifest before they are written, so a build stopped at any point (killed, Ctrl-C, a
        full disk) leaves every file it wrote listed, and the next build rewrites them."""
        mine = self.prior | self.claimed
        check_claim(self.out_dir, mine | {self.rel(p) for p in self.written}, paths)
        new = {self.rel(p) for p in paths} - mine
        if new:
            self.claimed |= new
            write_manifest(self.out_dir, self.prior | self.claimed)

    def write_table(
        self, name: str, title: str, data: pd.DataFrame, blocks: Sequence[Block] | None = None, note: str | None = None
    ) -> list[Path]:
        """Write ``tables/<name>.csv`` (``data``, tidy) and ``.md`` / ``.tex`` (``blocks`` for reading).
        Columns that hold per-seed values or estimates for computing (:data:`COMPUTING_COLUMNS`) are not written."""
        data = data.drop(columns=[c for c in COMPUTING_COLUMNS if c in data.columns])
        self.claim(*table_files(self.tables_dir, name))
        files = write_table_files(self.tables_dir, name, title, data, blocks, note)
        self.written += files
        return files

    def table_links(self, files: Sequence[Path]) -> str:
        by = {p.suffix: p for p in files}
        return " · ".join(
            f"[{lab}]({self.rel(by[s])})"
            for s, lab in ((".md", "Markdown"), (".csv", "CSV"), (".tex", "LaTeX"))
            if s in by
        )

    def save_figure(self, fig, stem: str, exact: bool = False) -> list[Path]:
        """Save ``figures/<stem>.png`` and ``.svg`` without dates or versions in them; close the figure.
        ``exact``: at the figure's own size (a paper figure laid out to its column width), else cropped
        to what is drawn."""
        import matplotlib.pyplot as plt

        make_folder(self.figures_dir)
        png, svg = self.figures_dir / f"{stem}.png", self.figures_dir / f"{stem}.svg"
        self.claim(png, svg)
        crop = {} if exact else {"bbox_inches": "tight"}
        # through the one writer (smallbatch.io.atomic_write): matplotlib gets a file, never a path
        atomic_write(
            png,
            lambda fh: fig.savefig(fh, format="png", dpi=200 if exact else 130, metadata={"Software": None}, **crop),
        )
        atomic_write(svg, lambda fh: fig.savefig(fh, format="svg", metadata={"Date": None}, **crop))
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

    def histories(self, run_ids: Iterable[str], key: str) -> pd.DataFrame:
        """Step history of ``key`` for the given runs: columns run_id, step, value.

        One store query per run (cached); runs that never logged ``key`` are
        skipped without a query.  Runs come in the order of ``runs`` (section,
        kind, cell id, start time), so the same store content gives the same
        frame whatever ids the store gave its runs.
        """
        wanted = set(run_ids)
        frames = []
        for rid, keys in zip(self.runs["run_id"], self.runs["metric_keys"]):
            if rid not in wanted or key not in keys:
                continue
            if (rid, key) not in self._hist_cache:
                hist = self.reader.history(rid, key)
                self.history_calls += 1
                self._hist_cache[(rid, key)] = pd.DataFrame(
                    {"run_id": rid, "step": [s for s, _ in hist], "value": [v for _, v in hist]}
                )
            frames.append(self._hist_cache[(rid, key)])
        if not frames:
            return pd.DataFrame(columns=["run_id", "step", "value"])
        return pd.concat(frames, ignore_index=True)
