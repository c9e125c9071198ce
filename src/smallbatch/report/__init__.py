"""The study's report, rebuilt from the MLflow store alone.

``build_report(tracking_uri, out_dir)`` reads every run of one experiment (the
config's ``study``) through :class:`smallbatch.tracking.StoreReader` and writes

* ``tables/*.csv`` (tidy, full precision), ``tables/*.md`` and ``tables/*.tex``
  (the same numbers laid out for reading; LaTeX needs ``booktabs``);
* ``figures/*.png`` and ``figures/*.svg`` (seaborn);
* ``index.md``: the findings in plain words, computed from the numbers, and a
  relative link to every table and figure.

Conventions
-----------
* Top-1 accuracies are in percent, read by the unit each run records
  (``smallbatch.accuracy_unit``; the pipeline logs percent), never guessed from the
  values; a run with an accuracy that is not a finite number in [0, 100] is a failed
  run, listed as one (:func:`.runs.checked_accuracies`).
* A *cell* is dataset x loss (+ its parameters that differ from the registry's
  default, and any extra axis such as ``epochs``) x temperature x batch size; its
  value is the mean and sample standard deviation (ddof=1) over seeds.  One seed
  gives ``—`` for the deviation.  One rule names a loss in every table
  (:func:`.runs.cell_labels`).
* A run tagged ``smallbatch.status`` diverged, collapsed or failed never
  contributes a number; its cell reads that status when all its seeds had it, and
  ``mean ± std (k/n diverged)`` when only some did.  A cell whose runs exist but
  have not logged the metric yet reads ``pending``.  The bad runs are listed.
* When several runs carry the same cell id (a changed config is a new run), the
  newest one that holds results is used and the count of superseded runs is stated in
  index.md; a newer run that failed (a rerun that crashed) is listed with the failed runs.
* The folder: every file is listed in its manifest before it is written, and a build
  holds the folder's lock (:data:`LOCK`), so a build stopped at any point leaves a folder
  the next build completes, and two builds never write one folder at once.

Layers
------
:mod:`.runs` (loading, the newest-run rule, the cell selection and labels) and
:mod:`.aggregate` (cells over seeds); :mod:`.fmt`, :mod:`.tables`,
:mod:`.context` and :mod:`.figures` (rendering); one module per section, each
with ``build(runs, ctx) -> SectionOutput | None``, listed in
:data:`SECTION_MODULES` in index.md's order; :mod:`.evidence` (the one place for
statistics: seed-paired t intervals, Holm, the minimum detectable effect, verdict
wording); :mod:`.index` (index.md).  Runs no
section reported are counted in index.md, never silently dropped.
"""

from __future__ import annotations

import glob
import importlib
import sys
from pathlib import Path

from ..io import FolderLock, add_results_folder, make_folder, write_text
from ..study.experiments import section_names
from ..tracking import StoreReader, TrackingError, log_report_run, recorded_plan
from .aggregate import aggregate_cells
from .context import MANIFEST, ReportContext, SectionOutput, check_claim, write_manifest
from .index import index_markdown
from .plan import AnalysisPlan
from .planned import plan_status
from .runs import METRICS, load_runs
from .sections import baselines, cost, diverged, grid, papers, representation
from .sections.papers import load_papers
from .tables import latex_table, markdown_table, tex_escape

__all__ = [
    "build_report",
    "load_runs",
    "aggregate_cells",
    "ReportContext",
    "SectionOutput",
    "SECTIONS",
    "SECTION_MODULES",
    "METRICS",
    "load_papers",
    "markdown_table",
    "latex_table",
    "tex_escape",
]


def _side_sections(main: bool) -> tuple:
    """The report modules of the side experiments of :mod:`smallbatch.study.experiments`."""
    return tuple(importlib.import_module(f".sections.{name}", __name__) for name in section_names(main))


#: the report's sections in index.md's order: each a module of :mod:`.sections` with
#: ``build(runs, ctx) -> SectionOutput | None``.  A side experiment's section comes from its
#: entry in :data:`smallbatch.study.experiments.SPECS`; any other section is a module plus its entry here.
SECTION_MODULES = (
    grid,
    representation,
    *_side_sections(main=True),
    baselines,
    diverged,
    papers,
    *_side_sections(main=False),
    cost,
)
SECTIONS = [section.build for section in SECTION_MODULES]


_OUTPUT_DIRS = ("tables", "figures")


def _check_out_dir(out: Path) -> None:
    """ValueError naming ``out`` when it, or a folder it would be made in, is an existing file,
    or when it, its tables/ or figures/ folder, or a file the report writes there is a
    symbolic link (a write or delete would follow it out of the folder)."""
    for p in (out, *out.parents):
        if p.exists():
            if p == out and not p.is_dir():
                raise ValueError(f"report folder {out} is a file, not a folder")
            if not p.is_dir():
                raise ValueError(f"report folder {out} cannot be made: {p} is a file, not a folder")
            break
    inside = [out / sub for sub in _OUTPUT_DIRS if (out / sub).is_dir() and not (out / sub).is_symlink()]
    for p in (
        out,
        *(out / sub for sub in _OUTPUT_DIRS),
        out / "index.md",
        out / MANIFEST,
        *(f for d in inside for f in sorted(d.iterdir())),
    ):
        if p.is_symlink():
            raise ValueError(
                f"report output {p} is a symbolic link; refused (the report writes only real "
                "files and folders inside --out): remove the link or choose another --out"
            )


def read_manifest(out: Path) -> frozenset[str]:
    """The files the previous build wrote into ``out`` (its manifest; none without one);
    ValueError naming the manifest when it cannot be read as UTF-8 text -- before anything
    of the folder is rewritten."""
    manifest = out / MANIFEST
    if not manifest.is_file():
        return frozenset()
    try:
        return frozenset(manifest.read_text(encoding="utf-8").splitlines())
    except (UnicodeDecodeError, OSError) as exc:
        reason = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"cannot be read ({exc.strerror})"
        raise ValueError(
            f"report manifest {manifest} {reason}; nothing was rewritten: remove it (the report then treats "
            "every file already in the folder as not its own) or choose another --out"
        ) from None


def _remove_stale(out: Path, written: list[Path], before: frozenset[str]) -> None:
    """Delete what the previous build wrote (``before``, its manifest) and this one did not,
    then record this build's files: a file the report never wrote (a user's) is never deleted."""
    now = {p.relative_to(out).as_posix() for p in written}
    for rel in sorted(before):
        p = out / rel
        parts = Path(rel).parts
        if (
            rel not in now
            and len(parts) == 2
            and parts[0] in _OUTPUT_DIRS
            and not p.parent.is_symlink()
            and p.is_file()
            and not p.is_symlink()
        ):
            p.unlink()
    write_manifest(out, now)


def _remove_leftovers(out: Path, before: frozenset[str]) -> None:
    """Delete the temporary files a killed build's writes left beside its files (``before``
    lists every file a build claimed before writing it: :meth:`ReportContext.claim`)."""
    for rel in before:
        p = out / rel
        if len(Path(rel).parts) == 2 and Path(rel).parts[0] in _OUTPUT_DIRS and not p.parent.is_symlink():
            for tmp in p.parent.glob(f".{glob.escape(p.name)}.*.tmp"):
                if tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink()


def build_report(
    tracking_uri: str,
    out_dir: str | Path = "results/report",
    experiment: str | None = None,
    paper_csv: str | Path | None = None,
    log_run: bool = False,
    analysis: dict | None = None,
) -> Path:
    """Rebuild every table and figure from the MLflow store; return the path of index.md.

    ``experiment`` is the MLflow experiment (the config's ``study``); None picks
    'smallbatch' or the store's only experiment.  ``paper_csv`` defaults to the
    package's ``resources/paper_results.csv``.  Raises ValueError for an empty or
    missing experiment or an ``out_dir`` that is a file, and
    :class:`smallbatch.tracking.TrackingError` for a store that does not exist or
    cannot be read; nothing is written then.  ``log_run``: also log the report as a run of
    its experiment (:func:`smallbatch.tracking.log_report_run`: one run per experiment, replaced
    by a changed build), which later builds leave out.  ``analysis``: the study's analysis plan (the
    config's ``analysis`` mapping; None: the schema's default), checked before the store is read.
    The study's plan, where the workflow recorded one (``plan.json`` beside a SQLite store or in
    ``out_dir``'s parent, the results folder), marks a study with planned cells not finished as
    partial (:mod:`smallbatch.report.planned`).
    """
    out = Path(out_dir)
    _check_out_dir(out)
    add_results_folder(out)  # nothing written below it through a link planted later
    check_claim(out, read_manifest(out), [out / "index.md"])  # a user's index.md: refused before the store is read
    plan = AnalysisPlan.from_mapping(analysis)
    papers = load_papers(paper_csv)
    reader = StoreReader(str(tracking_uri))
    notes: list[str] = []
    runs, exp_name = load_runs(reader, experiment, notes)
    ctx = ReportContext(
        out_dir=out,
        tracking_uri=str(tracking_uri),
        experiment=exp_name,
        reader=reader,
        scale=1.0,  # load_runs gave every accuracy in percent
        papers=papers,
        runs=runs,
        notes=notes,
        plan=plan,
        planned=plan_status(runs, recorded_plan(str(tracking_uri), exp_name, out.parent)),
    )
    make_folder(out)
    with FolderLock(out / LOCK, f"report folder {out}", "being written"):  # one build at a time
        index = _write(ctx)
    if log_run:
        _log_run(str(tracking_uri), exp_name, out, [*ctx.written, index])
    return index


#: the lock a build holds on its folder (:class:`smallbatch.io.FolderLock`)
LOCK = ".smallbatch-report.lock"


def _write(ctx: ReportContext) -> Path:
    """Every section's files and index.md into ``ctx.out_dir``, under its lock: the previous
    build's manifest read again (a build that just ended may have changed it), its leftovers
    removed, its stale files deleted once this build's are written."""
    out, index = ctx.out_dir, ctx.out_dir / "index.md"
    ctx.prior = before = read_manifest(out)
    _remove_leftovers(out, before)
    outputs = [o for o in (build(ctx.runs, ctx) for build in SECTIONS) if o is not None]
    ctx.claim(index)
    write_text(index, index_markdown(ctx.runs, ctx, outputs))
    _remove_stale(out, [*ctx.written, index], before)
    return index


def _log_run(uri: str, experiment: str, out: Path, files: list[Path]) -> None:
    """The report as its own run; a store that takes no writes (read-only) is one line on
    stderr: the report itself is written."""
    try:
        log_report_run(uri, experiment, out, files)
    except TrackingError as exc:
        print(f"the report is written but not logged as a run: {exc}", file=sys.stderr)
