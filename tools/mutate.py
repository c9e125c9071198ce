"""Mutation testing: does the suite notice a one-operator change of the code it guards?

Each mutant is one exact snippet of a source file replaced by a mutated one (a dropped
``abs()``, ``<=`` for ``<``, a sign, a factor, a key left out of the hash).  The script
checks out the commit (HEAD by default) into a temporary git worktree in /tmp, so the
working tree -- and anybody's uncommitted work in it -- is never touched; then, per
mutant, it writes the mutated file there, runs the fast tests of that file against the
worktree's package (PYTHONPATH=<worktree>/src), and writes the original back (always:
also on a failing run, a timeout or Ctrl-C).  A mutant is *caught* when the tests fail.

    python tools/mutate.py                 # every mutant, on HEAD
    python tools/mutate.py --only cells    # the mutants whose file or name contains "cells"
    python tools/mutate.py --list          # the mutants, nothing run

The tests of every file are first run unmutated; a test that fails there is left out of
that file's runs and named (a mutant can only be judged by tests that pass without it).  A snippet that is not in the file exactly once
is reported as *stale* (the code moved on: update the list), never as caught.  Exit
status: 0 when every mutant was caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # the venv's: its pytest, torch, ... (the package comes from the worktree)


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    mutated: str
    what: str


#: the fast tests that guard each file (files missing at the commit are left out)
TESTS = {
    **{
        f"src/smallbatch/losses/{f}.py": ["tests/losses/test_losses.py", "tests/losses/test_losses_precision.py"]
        for f in ("base", "scores", "softmax", "flatnce", "decoupled")
    },
    "src/smallbatch/study/cells.py": ["tests/study/test_config.py", "tests/study/test_cell_hashes.py"],
    "src/smallbatch/report/evidence.py": ["tests/report/test_evidence.py"],
    "src/smallbatch/training/gradcache.py": ["tests/training/test_gradcache.py"],
    "src/smallbatch/training/negatives.py": [
        "tests/training/test_controls.py",
        "tests/training/test_fresh_negatives.py",
        "tests/training/test_train.py::test_queue_cell_trains_with_k_equal_to_queue_size",
        "tests/training/test_train.py::test_momentum_encoder_is_the_ema_of_the_query_encoder_and_its_keys_are_queued",
    ],
    # added with the instrument, the new losses and the registries
    "src/smallbatch/losses/kernel.py": ["tests/losses/test_kernel_losses.py"],
    "src/smallbatch/losses/sogclr.py": ["tests/losses/test_sogclr.py"],
    "src/smallbatch/losses/sigmoid.py": ["tests/losses/test_siglip.py"],
    "src/smallbatch/report/plan.py": ["tests/report/test_analysis_plan.py", "tests/report/test_report_instrument.py"],
    "src/smallbatch/report/sections/instrument_gates.py": [
        "tests/report/test_instrument_gates.py",
        "tests/report/test_report_instrument.py",
    ],
    "src/smallbatch/report/sections/lrsweep.py": ["tests/report/test_report_lrsweep.py"],
    "src/smallbatch/study/lr_scaling.py": ["tests/report/test_report_lrsweep.py", "tests/training/test_batch_knobs.py"],
    "src/smallbatch/study/probe_registry.py": [
        "tests/study/test_probe_registry.py",
        "tests/study/test_cell_hashes.py",
    ],
    # the schema and the loss registry: the tests whose expectation is written out, not read from them
    "src/smallbatch/resources/config.schema.yaml": [
        "tests/study/test_config.py",
        "tests/study/test_cell_hashes.py",
    ],
    "src/smallbatch/losses/registry.py": [
        "tests/losses/test_losses.py::test_every_losss_registry_entry_is_the_one_written_out_here",
        "tests/losses/test_losses.py::test_registry_names_aliases_and_params",
        "tests/study/test_config.py::test_every_loss_parameter_is_resolved_into_the_cell",
        "tests/study/test_cell_hashes.py",
        "tests/losses/test_loss_plugins.py",
    ],
    "src/smallbatch/study/experiments.py": ["tests/study/test_experiment_registry.py"],
    "src/smallbatch/report/captions.py": ["tests/study/test_experiment_registry.py"],
    "src/smallbatch/pipeline/plan.py": ["tests/pipeline/test_plan.py"],
    "src/smallbatch/io.py": [
        "tests/core/test_permissions.py",
        "tests/pipeline/test_trust.py::test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched",
        "tests/pipeline/test_trust.py::test_report_outputs_refuse_links_and_delete_only_files_the_report_wrote",
        "tests/pipeline/test_trust.py::test_a_report_table_replaces_a_hard_linked_file_and_never_writes_through_it",
    ],
}

LB, LS, LX, LF, LD = (f"src/smallbatch/losses/{f}.py" for f in ("base", "scores", "softmax", "flatnce", "decoupled"))
C, E, G, N = (
    f"src/smallbatch/{f}"
    for f in ("study/cells.py", "report/evidence.py", "training/gradcache.py", "training/negatives.py")
)
MUTANTS = [
    # losses: the formulas, the scores, the mask
    Mutant(
        LB,
        "    logits = torch.cat([xp[:, None], xn], dim=1)\n    return torch.logsumexp(logits, dim=1) - xp",
        "    logits = torch.cat([xp[:, None], xn], dim=1)\n    return torch.logsumexp(logits, dim=1) + xp",
        "InfoNCE rows: + s_p/tau instead of -",
    ),
    Mutant(
        LS,
        "sim = z[rows] @ z.T\n    partner = (rows + n) % m",
        "sim = z[rows] @ z.T\n    partner = (rows + n - 1) % m",
        "in-batch positive: the neighbouring view",
    ),
    Mutant(
        LS,
        "z = F.normalize(torch.cat([z1, z2], dim=0).to(dt), dim=1)",
        "z = F.normalize(torch.cat([z1, z2], dim=0).to(dt), dim=0)",
        "scores: normalised over the batch axis",
    ),
    Mutant(
        LS,
        'x.masked_fill(~neg_mask, float("-inf"))',
        'x.masked_fill(neg_mask, float("-inf"))',
        "mask: the valid negatives removed instead of the invalid",
    ),
    Mutant(
        LD,
        "rows = torch.logsumexp(masked(neg / tau, neg_mask), dim=1) - pos / tau",
        "rows = torch.logsumexp(masked(neg / tau, neg_mask), dim=1) - pos",
        "DCL: the positive not divided by tau",
    ),
    Mutant(
        LD,
        "return 2.0 - p.shape[0] * torch.softmax(p / self.sigma, dim=0)",
        "return 1.0 - p.shape[0] * torch.softmax(p / self.sigma, dim=0)",
        "DCLW weights: 1 - ... (mean 0)",
    ),
    Mutant(
        LX,
        "xn = xn + torch.log(self.alpha / k)[:, None]",
        "xn = xn + torch.log(k / self.alpha)[:, None]",
        "EqCo: K/alpha instead of alpha/K",
    ),
    Mutant(
        LF,
        "l = (torch.logsumexp(masked(g * x, neg_mask), dim=1) - logk) / g + logk",
        "l = (torch.logsumexp(masked(g * x, neg_mask), dim=1) - logk) / g - logk",
        "FlatNCE Hoelder: - log K instead of +",
    ),
    Mutant(LF, "x = (neg - pos[:, None]) / tau", "x = (neg - pos[:, None]) * tau", "FlatNCE: logits times tau"),
    Mutant(
        LB,
        "        return loss_rows.mean(), value_rows.mean()",
        "        return loss_rows.sum(), value_rows.mean()",
        "loss: summed over anchors, not averaged",
    ),
    # cells: what the hash covers, K, the ids
    Mutant(
        C,
        "return {k: v for k, v in items if k not in skip[section]}",
        "return {k: v for k, v in items}",
        "hash: execution settings hashed",
    ),
    Mutant(
        C,
        "return {k: v for k, v in items if k not in skip[section]}",
        'return {k: v for k, v in items if k not in skip[section] and k != "weight_decay"}',
        "hash: weight_decay left out",
    ),
    Mutant(
        C,
        'science = kept("", ((k, v) for k, v in cell.items() if k not in NAME_KEYS))',
        'science = kept("", ((k, v) for k, v in cell.items() if k not in (*NAME_KEYS, "format")))',
        "hash: the cell's format left out",
    ),
    Mutant(
        C,
        "return int(queue_size) if queue_size else 2 * (int(batch_size) + int(extra or 0)) - 2",
        "return int(queue_size) if queue_size else 2 * (int(batch_size) + int(extra or 0)) - 1",
        "K = 2N-1",
    ),
    Mutant(
        C,
        "if v is not None and (k not in defaults or v != defaults[k])",
        "if v is not None and (k not in defaults or v == defaults[k])",
        "id names the default parameters",
    ),
    Mutant(C, '"seed": int(seed),', '"seed": 0,', "the seed dropped from the cell"),
    # evidence: the t tests, Holm, the verdicts
    Mutant(
        E,
        "p = float(2 * _t().sf(abs(diff) / se, df))",
        "p = float(2 * _t().sf(diff / se, df))",
        "t test: abs() lost (a negative difference never significant)",
    ),
    Mutant(
        E, "p = float(2 * _t().sf(abs(diff) / se, df))", "p = float(_t().sf(abs(diff) / se, df))", "t test: one-sided p"
    ),
    Mutant(
        E,
        "h = float(_t().ppf(1 - alpha / 2, df)) * se",
        "h = float(_t().ppf(1 - alpha, df)) * se",
        "interval: 90 % instead of 95 %",
    ),
    Mutant(
        E,
        "return bool(self.p_adj < ALPHA) if self.tested else None",
        "return bool(self.p_adj <= ALPHA) if self.tested else None",
        "significance: boundary included",
    ),
    Mutant(
        E,
        "sd = math.sqrt(sum((x - d) ** 2 for x in per_seed) / (n - 1))",
        "sd = math.sqrt(sum((x - d) ** 2 for x in per_seed) / n)",
        "paired sd: biased (n, not n - 1)",
    ),
    Mutant(E, "if len(common) >= 2:", "if len(common) >= 3:", "paired t: needs three shared seeds"),
    Mutant(
        E,
        "running = max(running, min(1.0, (m - rank) * e.p))",
        "running = max(running, min(1.0, (m - rank - 1) * e.p))",
        "Holm: one test too few",
    ),
    Mutant(
        E,
        "running = max(running, min(1.0, (m - rank) * e.p))",
        "running = min(1.0, (m - rank) * e.p)",
        "Holm: not monotone (step-down max lost)",
    ),
    Mutant(
        E,
        "df = se2**2 / sum(w * w / (k - 1) for w, k in parts)",
        "df = se2**2 / sum(w * w / k for w, k in parts)",
        "Welch-Satterthwaite df: k instead of k - 1",
    ),
    Mutant(
        E,
        "hi = se * (crit + 4.0)\n    while short_of(hi) < 0:",
        "hi = se * (crit + 4.0)\n    while False:",
        "MDE: search bracket never widened",
    ),
    # gradient caching: BatchNorm statistics and their gradient, the chunks
    Mutant(
        G,
        "return grad + (a + 2 * b * (x - mean)) / count",
        "return grad + (a + b * (x - mean)) / count",
        "BatchNorm statistics' gradient: B instead of 2B",
    ),
    Mutant(G, "xs.var(dims, unbiased=False)", "xs.var(dims, unbiased=True)", "chunk variance unbiased"),
    Mutant(
        G,
        "return [slice(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]",
        "return [slice(i, min(i + chunk_size, n - 1)) for i in range(0, n, chunk_size)]",
        "last row dropped",
    ),
    Mutant(G, "torch.rsqrt(var.view(shape) + m.eps)", "torch.rsqrt(var.view(shape))", "BatchNorm eps dropped"),
    # negatives: the momentum encoder, the masks
    Mutant(
        N,
        "torch._foreach_add_(keys_p, query_p, alpha=1 - mom)",
        "torch._foreach_add_(keys_p, query_p, alpha=mom)",
        "momentum encoder: EMA weights swapped",
    ),
    Mutant(
        N,
        "mask = mask & (self.labels[idx][:, None] != self.labels[key_idx][None, :])",
        "mask = mask & (self.labels[idx][:, None] == self.labels[key_idx][None, :])",
        "queue: same-class keys kept, others masked",
    ),
    Mutant(
        N,
        "return grouped_rows(lab[:, rows % g][:, :, None] != lab[:, cols])",
        "return grouped_rows(lab[:, rows % g][:, :, None] == lab[:, cols])",
        "in-batch: same-class negatives kept, others masked",
    ),
    # fresh negatives: the window never holds an anchor
    Mutant(
        N,
        "perm[start + k + n * (k >= a0 - start).long()]",
        "perm[start + k]",
        "fresh negatives: the window's anchors taken as extra negatives",
    ),
    # the losses published since the four papers
    Mutant(
        "src/smallbatch/losses/kernel.py",
        "self.gamma * k_neg.sum(dim=1) / row_counts(neg, neg_mask)",
        "self.gamma * k_neg.sum(dim=1)",
        "KCL: negatives' kernel summed, not averaged (depends on the batch size)",
    ),
    Mutant(
        "src/smallbatch/losses/kernel.py",
        "align = (2 - 2 * pos).clamp_min(0).pow(self.alpha / 2).mean()",
        "align = (2 - 2 * pos).clamp_min(0).pow(self.alpha).mean()",
        "alignment: squared distance to the power alpha, not alpha / 2",
    ),
    Mutant(
        "src/smallbatch/losses/sogclr.py",
        "moved = torch.logaddexp(old + keep, log_g + math.log(self.gamma))",
        "moved = torch.logaddexp(old, log_g + math.log(self.gamma))",
        "SogCLR: the moving average keeps all of the old u",
    ),
    Mutant(
        "src/smallbatch/losses/sigmoid.py",
        "rows = F.softplus(-(pos / tau + b)) + x_neg.sum(dim=1)",
        "rows = F.softplus(pos / tau + b) + x_neg.sum(dim=1)",
        "SigLIP: the positive's label sign flipped",
    ),
    # the instrument's validity gates
    Mutant(
        "src/smallbatch/report/sections/instrument_gates.py",
        "fired = bool(e.tested and e.diff < 0 and e.p < ALPHA)",
        "fired = bool(e.tested and e.p < ALPHA)",
        "G3: a positive control better than the full batch counts as fired",
    ),
    # the analysis plan: its family, its margin and its outcome words
    Mutant(
        "src/smallbatch/report/plan.py",
        "running = max(running, min(1.0, (m - rank) * float(v)))",
        "running = max(running, min(1.0, (m - rank - 1) * float(v)))",
        "plan: Holm's factor one short (the family shrinks by one)",
    ),
    Mutant(
        "src/smallbatch/report/plan.py",
        'fam = [i for i in idx if out.at[i, "claimed"] and finite(p[i])]',
        "fam = [i for i in idx if finite(p[i])]",
        "plan: the descriptive contrasts enter the family",
    ),
    Mutant(
        "src/smallbatch/report/plan.py",
        "return pd.Series([plan.margin * abs(ref.get(k, math.nan)) for k in keys], index=rows.index, dtype=float)",
        "return pd.Series([plan.margin for k in keys], index=rows.index, dtype=float)",
        "plan: a relative margin read as points",
    ),
    Mutant(
        "src/smallbatch/report/plan.py",
        'return "equivalent" if r.tost_family < ALPHA else "unresolved"',
        'return "equivalent" if r.tost_p < ALPHA else "unresolved"',
        "plan: equivalence judged on the unadjusted TOST p",
    ),
    Mutant(
        "src/smallbatch/report/sections/instrument_gates.py",
        "results.append(bool(e.tested and e.lo > 0))",
        "results.append(bool(e.tested and e.diff > 0))",
        "G2: the mean above the baseline, not its interval's lower end",
    ),
    # the learning-rate sweep and its rules
    Mutant(
        "src/smallbatch/report/sections/lrsweep.py",
        "lo - res - 1e-9 <= e <= hi + res + 1e-9",
        "lo - 1e-9 <= e <= hi + 1e-9",
        "lrsweep: the rules tested against the bootstrap interval alone (grid resolution ignored)",
    ),
    Mutant(
        "src/smallbatch/report/sections/lrsweep.py",
        "np.bincount(rng.integers(0, n_seeds, n_seeds), minlength=n_seeds)",
        "np.ones(n_seeds, dtype=int)",
        "lrsweep: the bootstrap never resamples the seeds",
    ),
    Mutant(
        "src/smallbatch/study/lr_scaling.py",
        "return base_lr * batch_size / REFERENCE_BATCH",
        "return base_lr * REFERENCE_BATCH / batch_size",
        "linear rule inverted",
    ),
    Mutant(
        "src/smallbatch/study/lr_scaling.py",
        "return decay ** (batch_size / REFERENCE_BATCH)",
        "return decay ** (REFERENCE_BATCH / batch_size)",
        "a decay's horizon rule inverted",
    ),
    # the registries and the workflow's plan
    Mutant(
        "src/smallbatch/study/probe_registry.py",
        "if len(set(names)) != len(names):",
        "if len(set(names)) > len(names):",
        "eval.probes: a repeated probe accepted",
    ),
    Mutant(
        "src/smallbatch/study/experiments.py",
        "return [s.section for s in SPECS.values() if s.main == main and s.section is not None]",
        "return [s.section for s in SPECS.values() if s.section is not None]",
        "every side experiment's section placed twice in the report",
    ),
    Mutant(
        "src/smallbatch/report/captions.py",
        "sorted(pairs, key=lambda p: -len(p[0]))",
        "sorted(pairs, key=lambda p: len(p[0]))",
        "captions: the shortest prefix wins",
    ),
    Mutant(
        "src/smallbatch/study/probe_registry.py",
        "chance_collapses=True,",
        "chance_collapses=False,",
        "kNN at chance no longer marks a cell collapsed",
    ),
    Mutant(
        "src/smallbatch/study/experiments.py",
        '"precision_top1_",',
        '"precision_top_",',
        "a side experiment's figure prefix misspelt: its figures lose their caption",
    ),
    Mutant(
        "src/smallbatch/report/captions.py",
        '"qb_",',
        '"qB_",',
        "captions: the q_B figures' prefix misspelt",
    ),
    Mutant(
        "src/smallbatch/resources/config.schema.yaml",
        "weight_decay: {type: number, minimum: 0, default: 1.0e-6,",
        "weight_decay: {x-execution: true, type: number, minimum: 0, default: 1.0e-6,",
        "schema: train.weight_decay marked an execution setting (left out of the hash)",
    ),
    Mutant(
        "src/smallbatch/losses/registry.py",
        'uses_temperature=False,\n            negatives="same_view",\n        ),\n        LossSpec(\n            name="simco",',
        'uses_temperature=True,\n            negatives="same_view",\n        ),\n        LossSpec(\n            name="simco",',
        "loss registry: KCL declared to take a temperature",
    ),
    Mutant(
        "src/smallbatch/losses/registry.py",
        "    return {**SPECS, **plugin_specs()}",
        "    return {**plugin_specs(), **SPECS}",
        "loss plugins: a plugin listed before the built-ins (tables and the report order it first)",
    ),
    Mutant(
        "src/smallbatch/losses/registry.py",
        "            if n in taken:\n",
        "            if n in taken and n in found:\n",
        "loss plugins: a plugin may take a built-in's name",
    ),
    Mutant(
        "src/smallbatch/pipeline/plan.py",
        "return output if os.path.exists(output) and kind is None else None",
        "return None",
        "an output of other settings is never rerun",
    ),
    Mutant(
        "src/smallbatch/pipeline/plan.py",
        "if old.name != stamp.name and not old.is_dir()",
        "if False",
        "the stamps of other settings are kept",
    ),
    # the atomic writer's refusals
    Mutant(
        "src/smallbatch/io.py",
        "    if not stat.S_ISREG(mode):\n        raise UnsafeTarget(",
        "    if stat.S_ISDIR(mode):\n        raise UnsafeTarget(",
        "a link or a FIFO accepted as a target",
    ),
]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def run_tests(
    tree: Path, tests: list[str], timeout: float, first_failure: bool = True, deselect: tuple[str, ...] = ()
) -> tuple[bool, str, list[str]]:
    """(passed, a line saying how, the failed test ids) of the tests, against the tree's own package."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("SMALLBATCH_WARM", None)
    cmd = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE", *tests]
    cmd += ["-x"] if first_failure else []
    for node in deselect:
        cmd += ["--deselect", node]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", []
    lines = [ln for ln in (p.stdout + p.stderr).strip().splitlines() if ln.strip()]
    failed = [ln.split()[1] for ln in lines if ln.startswith(("FAILED ", "ERROR ")) and len(ln.split()) > 1]
    return p.returncode == 0, " ".join(([f"first failure {failed[0]};"] if failed else []) + lines[-1:]), failed


def tests_of(tree: Path, file: str) -> list[str]:
    return [t for t in TESTS[file] if (tree / t.split("::")[0]).is_file()]


def check_imports_from(tree: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    where = subprocess.run(
        [PYTHON, "-c", "import smallbatch; print(smallbatch.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not where.startswith(str(tree)):
        sys.exit(f"mutate: the tests would import smallbatch from {where}, not from the worktree {tree}")


def mutate(tree: Path, mutants: list[Mutant], timeout: float, red: dict[str, list[str]]) -> dict[str, list]:
    result: dict[str, list] = {"caught": [], "missed": [], "stale": []}
    for i, m in enumerate(mutants, 1):
        path = tree / m.file
        text = path.read_text()
        if text.count(m.original) != 1:
            result["stale"].append(m)
            print(f"[{i}/{len(mutants)}] STALE  {m.file}: {m.what} (snippet found {text.count(m.original)} times)")
            continue
        t0 = time.monotonic()
        try:
            path.write_text(text.replace(m.original, m.mutated))
            passed, how, _ = run_tests(tree, tests_of(tree, m.file), timeout, deselect=tuple(red[m.file]))
        finally:
            path.write_text(text)  # also on Ctrl-C or a crash
        verdict = "missed" if passed else "caught"
        result[verdict].append(m)
        print(
            f"[{i}/{len(mutants)}] {verdict.upper():6} {m.file}: {m.what} ({time.monotonic() - t0:.0f} s; {how})",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="commit to mutate (default HEAD)")
    ap.add_argument("--only", default="", help="only mutants whose file or description contains this")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run (default 900)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if args.only in m.file or args.only in m.what]
    if args.list or not mutants:
        for m in mutants:
            print(f"{m.file}: {m.what}\n  - {m.original}\n  + {m.mutated}")
        return 0 if mutants else 1
    tree = Path(tempfile.mkdtemp(prefix="smallbatch-mutate-"))
    git("worktree", "add", "--detach", str(tree), args.rev)
    try:
        check_imports_from(tree)
        print(f"mutating {git('rev-parse', '--short', args.rev).strip()} in {tree}", flush=True)
        red: dict[str, list[str]] = {}
        for file in sorted({m.file for m in mutants}):
            t0 = time.monotonic()
            _, how, red[file] = run_tests(tree, tests_of(tree, file), args.timeout, first_failure=False)
            print(
                f"baseline {file}: {' '.join(tests_of(tree, file))}: {how} ({time.monotonic() - t0:.0f} s)", flush=True
            )
            for node in red[file]:  # a mutant is judged by the tests that pass without it
                print(f"  left out (fails unmutated): {node}")
        result = mutate(tree, mutants, args.timeout, red)
    finally:
        git("worktree", "remove", "--force", str(tree))
    n = len(mutants)
    print(
        f"\n{len(result['caught'])} of {n} mutants caught, {len(result['missed'])} missed, {len(result['stale'])} stale"
    )
    for m in result["missed"]:
        print(f"  MISSED {m.file}: {m.what}")
    for m in result["stale"]:
        print(f"  STALE  {m.file}: {m.what}")
    return 0 if len(result["caught"]) == n else 1


if __name__ == "__main__":
    sys.exit(main())
