"""How long the default study takes, and where the time goes.

    python benchmarks/study_time.py run [--ref REV ...] [--repeat N] [--results DIR] [--cores 2] [--config config.yaml]
    python benchmarks/study_time.py compare DIR_BEFORE DIR_AFTER

``run`` deletes ``--results`` (a scratch folder, never the project's ``results/``) and runs
the study in it with Snakemake, as ``make study`` does, from a clean state (data
preparation included); with ``--ref`` it runs that git revision of the workflow and the
package (checked out into a temporary worktree and put first on PYTHONPATH), so the
before and after of a change are timed the same way, one after the other on a quiet
machine (several ``--ref`` take turns, ``--repeat`` rounds of them, and the median wall time of
each is printed last: on this 2-core VM the same study's jobs took 1,074 to 1,243 CPU-s in
three runs within an hour).  It prints the wall time, the load average before and after, and per rule: the
number of jobs, their summed wall time (the CPU time the study asks of the cores, as
each job has one thread) and, for the steps that report it, the time of the work itself
-- training (``wall_s`` of each checkpoint), embedding, kNN and the linear probe (the
``seconds`` they log) -- so ``job time - work`` is what each process spends starting up
(imports, reading data, opening the MLflow run) and finishing; last, the CPU seconds of all
the study's processes (Snakemake and the warm-start server included): against twice the wall
time, how busy the two cores were.

``compare`` reads the ``tables/grid_top1_*.csv`` of two reports and prints, per cell, the
difference of the means against the two runs' seed spread (2 standard errors of the
difference), and how many cells differ beyond it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- running
def run_study(tree: Path, config: Path, results: Path, cores: int, env: dict) -> tuple[float, float]:
    """Snakemake on ``tree``'s Snakefile into a clean ``results``; returns the wall seconds and
    the CPU seconds of every process it ran (Snakemake, the warm server and the jobs)."""
    if results.exists():
        shutil.rmtree(results)
    results.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(tree / "Snakefile"),
        "--directory",
        str(results),
        "--configfile",
        str(config),
        "--config",
        f"results_dir={results}",
        "--cores",
        str(cores),
        "--workflow-profile",
        str(tree / "workflow" / "profiles" / "default"),
    ]
    t0, cpu0 = time.monotonic(), _children_cpu()
    with open(results / "snakemake.log", "w") as log:
        proc = subprocess.run(cmd, cwd=results, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if proc.returncode:
        raise SystemExit(f"the study failed; see {results / 'snakemake.log'}")
    return wall, cpu


def _children_cpu() -> float:
    """User + system seconds of this process's finished descendants."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def checkout(ref: str) -> tuple[Path, tempfile.TemporaryDirectory]:
    tmp = tempfile.TemporaryDirectory(prefix="study-time-")
    tree = Path(tmp.name) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True, capture_output=True
    )
    return tree, tmp


# --------------------------------------------------------------------------- where the time goes
_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_START = re.compile(r"^(?:local)?rule (\w+):$")
_JOBID = re.compile(r"^\s+jobid: (\d+)$")
_DONE = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def job_times(log: Path) -> dict[str, list[float]]:
    """Wall seconds of every job, per rule, from Snakemake's log (1-s timestamps)."""
    stamp, pending, started, out = None, None, {}, defaultdict(list)
    for line in log.read_text().splitlines():
        if m := _STAMP.match(line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := _START.match(line):
            pending = m.group(1)
        elif (m := _JOBID.match(line)) and pending:
            started[m.group(1)] = stamp
            pending = None
        elif (m := _DONE.match(line)) and m.group(1) in started:
            out[m.group(2)].append((stamp - started[m.group(1)]).total_seconds())
    return out


def _summary(log: Path) -> dict:
    """The JSON summary line a step prints last ({} if none)."""
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


#: the folder into which revisions before 2026-12-01 evaluated a cell ahead, in its pretraining process
EVALUATED_AHEAD = "evaluated"


def work_times(results: Path) -> dict[tuple[str, str], float]:
    """Seconds of the work itself, summed per (rule, part): training (``wall_s`` of each
    checkpoint) and the embedding, kNN and linear probe of each cell (the seconds they
    log), under ``pretrain`` where its process evaluated ahead (the evaluate job adopted
    the files: ``"adopted"`` in its summary), else under ``evaluate`` (or ``embed``,
    ``knn``, ``linear`` for revisions with one job per step)."""
    import torch

    work = defaultdict(float)
    for ck in results.glob("runs/**/checkpoint.pt"):
        work["pretrain", "pretrain"] += float(torch.load(ck, map_location="cpu", weights_only=True).get("wall_s", 0.0))
    evaluated = set()
    for log in results.glob("logs/evaluate/**/*.log"):
        res = _summary(log)
        cell = results / "runs" / log.relative_to(results / "logs" / "evaluate").with_suffix("")
        rule = "pretrain" if res.get("adopted") else "evaluate"
        work[rule, "embed"] += float(res.get("embed_seconds") or 0.0)
        for kind in ("knn", "linear"):
            if (cell / f"{kind}.json").is_file():
                evaluated.add(cell / f"{kind}.json")
                work[rule, kind] += float(json.loads((cell / f"{kind}.json").read_text()).get(f"{kind}/seconds", 0.0))
    for log in results.glob("logs/embed/**/*.log"):
        work["embed", "embed"] += float(_summary(log).get("seconds", 0.0) or 0.0)
    for kind in ("knn", "linear"):  # (not the copies a pretraining process evaluated ahead into)
        for f in {f for f in results.glob(f"runs/**/{kind}.json") if f.parent.name != EVALUATED_AHEAD} - evaluated:
            work[kind, kind] += float(json.loads(f.read_text()).get(f"{kind}/seconds", 0.0))
    return dict(work)


def breakdown(results: Path, wall: float, cpu: float) -> str:
    jobs, work = job_times(results / "snakemake.log"), work_times(results)
    lines = [f"{'rule':<14} {'jobs':>5} {'job s':>9} {'work s':>9} {'start-up+rest s':>16}"]
    for rule, times in sorted(jobs.items(), key=lambda kv: -sum(kv[1])):
        w = sum(v for (r, _), v in work.items() if r == rule)
        lines.append(f"{rule:<14} {len(times):>5} {sum(times):>9.0f} {w:>9.0f} {sum(times) - w:>16.0f}")
    total = sum(sum(t) for t in jobs.values())
    parts = defaultdict(float)
    for (_, part), v in work.items():
        parts[part] += v
    lines.append(f"{'all jobs':<14} {sum(len(t) for t in jobs.values()):>5} {total:>9.0f}")
    lines.append(
        f"wall {wall:.0f} s ({wall / 60:.1f} min); work split: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(parts.items()))
    )
    lines.append(f"CPU of all its processes {cpu:.0f} s (Snakemake and the warm server included)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- comparing two reports
def compare(before: Path, after: Path) -> str:
    import pandas as pd

    def tables(d: Path) -> Path:  # a results folder or a report folder
        return d / "report" / "tables" if (d / "report" / "tables").is_dir() else d / "tables"

    rows = []
    for f in sorted(tables(after).glob("grid_top1_*.csv")):
        other = tables(before) / f.name
        if not other.exists():
            continue
        a, b = pd.read_csv(other), pd.read_csv(f)
        keys = [c for c in ("loss", "batch_size", "temperature") if c in a.columns and c in b.columns]
        if a.duplicated(keys).any() or b.duplicated(keys).any():  # several variants of a loss: by label
            keys.append("label")
        m = a.merge(b, on=keys, suffixes=("_before", "_after"))
        m = m[(m["n_seeds_before"] > 0) & (m["n_seeds_after"] > 0)].fillna({"std_before": 0.0, "std_after": 0.0})
        for _, r in m.iterrows():
            se = ((r["std_before"] ** 2 / r["n_seeds_before"]) + (r["std_after"] ** 2 / r["n_seeds_after"])) ** 0.5
            rows.append(
                (
                    f.stem,
                    *(r[k] for k in keys),
                    r["mean_before"],
                    r["mean_after"],
                    r["mean_after"] - r["mean_before"],
                    2 * se,
                )
            )
    out = [f"{'table':<28} {'cell':<22} {'before':>7} {'after':>7} {'diff':>6} {'2 SE':>6}"]
    for table, *cell, mb, ma, d, two_se in rows:
        flag = " *" if abs(d) > two_se else ""
        out.append(f"{table:<28} {' '.join(map(str, cell)):<22} {mb:>7.2f} {ma:>7.2f} {d:>+6.2f} {two_se:>6.2f}{flag}")
    beyond = sum(abs(r[-2]) > r[-1] for r in rows)
    out.append(f"{len(rows)} cells; {beyond} differ by more than two standard errors of the seed spread (*)")
    return "\n".join(out)


def _time_one(ref: str | None, config: str, results: Path, cores: int) -> float:
    """One study of ``ref`` (None: the working tree) into ``results``; prints its breakdown."""
    if results.resolve() == (ROOT / "results").resolve():
        raise SystemExit("--results must be a scratch folder: it is deleted first")
    tree, tmp = checkout(ref) if ref else (ROOT, None)
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    load0 = os.getloadavg()[0]
    try:
        wall, cpu = run_study(tree, tree / config, results.resolve(), cores, env)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
            tmp.cleanup()
    print(
        f"study of {ref or 'the working tree'} ({config}), --cores {cores}, into {results}; "
        f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(breakdown(results.resolve(), wall, cpu), flush=True)
    return wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument(
        "--ref",
        action="append",
        help="a git revision to time instead of the working tree (repeatable: the revisions take turns)",
    )
    r.add_argument("--repeat", type=int, default=1, help="rounds of turns; each study into RESULTS-<n>-<ref>")
    r.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "smallbatch-study-time")
    r.add_argument("--cores", type=int, default=2)
    r.add_argument("--config", default="config.yaml", help="relative to the (checked-out) tree")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        print(compare(args.before, args.after))
        return 0
    refs = args.ref or [None]
    if len(refs) == 1 and args.repeat == 1:
        _time_one(refs[0], args.config, args.results, args.cores)
        return 0
    walls = defaultdict(list)
    for n in range(args.repeat):
        for ref in refs:
            out = args.results.with_name(f"{args.results.name}-{n + 1}-{ref or 'tree'}")
            walls[ref].append(_time_one(ref, args.config, out, args.cores))
    for ref, ws in walls.items():  # the machine's speed drifts: the median of the turns, and their range
        print(
            f"{ref or 'the working tree'}: median {statistics.median(ws):.0f} s over {len(ws)} "
            f"(range {min(ws):.0f}-{max(ws):.0f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
