"""The README's quoted numbers against the reports they come from.

* The default study's block (its table, the batch effect and the claim that two seeds
  cannot detect it) against the report of a default study run on this machine
  (``results/report``, or ``$SMALLBATCH_REPORT``).  ``.ci/run`` runs ``make study`` first
  and sets ``SMALLBATCH_REQUIRE_REPORT=1``, so there a missing report fails; elsewhere it
  skips with the reason.  Another CPU's floats change a study's training as other seeds
  would, so each quoted number is checked within :data:`K_SE` standard errors of the
  difference between two studies' values, the standard error computed from the fresh
  study's seeds: their spread pooled over the grid (20 cells, 20 degrees of freedom), never
  one cell's 1-degree-of-freedom spread (that moves several-fold between machines).
* The instrument's findings are bound to rows: each row of the README's claims table names a
  record's claims table (``instrument_claims.csv``, the analysis plan applied by
  ``tools/record_claims.py``), a unit, a contrast and a probe; the row must exist, be claimed on
  that probe's role, quote its interval to the README's rounding, state its outcome word, and
  come from a unit whose gates pass.  No interval of the paragraph stands outside that table.
* Every relative link of the top-level documents and of every record under benchmarks/results
  names a file of the repository.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: standard errors a quoted default-study number may be from a fresh study's (t with 20 df
#: beyond 4: 0.07 % per number; 10 numbers are checked)
K_SE = 4
#: the README's one decimal, and float arithmetic
ROUNDING = 0.05 + 1e-9
#: "under half of what two seeds can detect": the smallest detectable effect is at least this
#: many times the largest batch effect
DETECTABLE_OVER_EFFECT = 2.0
NUM = r"[−+-]?\d+(?:\.\d+)?"


def _f(s: str) -> float:
    return float(s.replace("−", "-"))


def _block(title: str) -> str:
    m = re.search(rf"\*\*{re.escape(title)}\*\*(.*?)(?=\n\*\*|\n## )", README, re.S)
    assert m, f"README has no paragraph starting with **{title}**"
    return m.group(1)


def _report() -> Path:
    rep = Path(os.environ.get("SMALLBATCH_REPORT", ROOT / "results" / "report"))
    if not (rep / "tables" / "baselines.csv").is_file():
        reason = f"no default-study report at {rep} (run `make study` first)"
        if os.environ.get("SMALLBATCH_REQUIRE_REPORT", "") not in ("", "0"):
            pytest.fail(f"SMALLBATCH_REQUIRE_REPORT is set but: {reason}")
        pytest.skip(f"{reason}; SMALLBATCH_REQUIRE_REPORT=1 makes this a failure")
    return rep / "tables"


def pooled_sd(sd: pd.Series, n: pd.Series) -> float:
    """The spread of single seeds pooled over cells: sqrt(sum (n-1) sd^2 / sum (n-1)) over the
    cells with at least two seeds (each cell's 1-df spread alone is no estimate to compare by)."""
    ok = (n >= 2) & sd.notna()
    dof = (n[ok] - 1).sum()
    assert dof >= 10, f"only {dof} degrees of freedom for the seeds' spread"
    return math.sqrt(((n[ok] - 1) * sd[ok] ** 2).sum() / dof)


def _close(quoted: float, measured: float, se: float, what: str) -> None:
    """``quoted`` (the README's study) within K_SE standard errors of two studies' difference."""
    tol = K_SE * se + ROUNDING
    assert abs(quoted - measured) <= tol, (
        f"README quotes {what} {quoted}, the report has {measured:.2f}: more than {K_SE} standard errors "
        f"({se:.2f} points, from the seeds' pooled spread) apart"
    )


def test_readme_states_the_tolerance_this_test_checks():
    block = " ".join(_block("The default study").split())
    assert f"within {K_SE} standard errors of its seeds' pooled spread" in block, "the README must state it"


def test_the_default_study_table_matches_the_report():
    tables = _report()
    pattern = rf"^\| ([^|]+?) \| ({NUM}(?:–{NUM})?) \| ({NUM}(?:–{NUM})?) \|$"
    rows = {r[0]: r[1:] for r in re.findall(pattern, _block("The default study"), re.M)}
    cells = next(k for k in rows if k.endswith("pretrained cells"))
    base = pd.read_csv(tables / "baselines.csv")
    for col, metric in enumerate(("knn", "linear")):
        grid = pd.read_csv(tables / f"grid_top1_fashion_mnist_{metric}.csv")
        assert int(cells.split()[0]) == len(grid), "the README's cell count"
        sd = pooled_sd(grid["std"], grid["n_seeds"])
        se = sd * math.sqrt(2 / grid["n_seeds"].min())  # two studies' means of n seeds each
        lo, hi = (_f(x) for x in rows[cells][col].split("–"))
        _close(lo, grid["mean"].min(), se, f"the lowest {metric} cell")
        _close(hi, grid["mean"].max(), se, f"the highest {metric} cell")
        for label, name in (("raw pixels", "raw_pixels"), ("random-init encoder", "random_init")):
            row = next(k for k in rows if k.startswith(label))
            b = base[(base["baseline"] == name) & (base["metric"] == metric)].iloc[0]
            _close(_f(rows[row][col]), b["mean"], sd * math.sqrt(2 / b["n_seeds"]), f"{label} {metric}")


def test_the_default_study_batch_effect_matches_the_report():
    from smallbatch.report.evidence import mde

    tables = _report()
    block = " ".join(_block("The default study").split())
    dep = pd.concat([pd.read_csv(tables / f"grid_dependence_fashion_mnist_{m}.csv") for m in ("knn", "linear")])
    assert (dep["smallest_batch_size"] == 16).all() and (dep["largest_batch_size"] == 256).all()
    tested = dep[dep["test"] == "paired t"]
    sd = pooled_sd(tested["sd_of_differences"], tested["n_pairs"])  # the per-seed differences' spread
    n = int(tested["n_pairs"].min())
    se = sd * math.sqrt(2 / n)  # two studies' paired means of n seeds each
    lo, hi = (_f(x) for x in re.search(rf"[Bb]atch 16 − 256: ({NUM}) to ({NUM}) points", block).groups())
    _close(lo, dep["change_small_minus_large"].min(), se, "the smallest batch effect")
    _close(hi, dep["change_small_minus_large"].max(), se, "the largest batch effect")
    assert f"under half of what {n_words(n)} seeds can detect" in block
    largest, detectable = dep["change_small_minus_large"].abs().max(), mde(sd, n)
    assert detectable >= DETECTABLE_OVER_EFFECT * largest, (
        f"the README says the batch effects are under half of what {n} seeds detect, but the largest is "
        f"{largest:.2f} points and the detectable effect at the seeds' pooled spread is {detectable:.2f}"
    )


def n_words(n: int) -> str:
    return {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}.get(n, str(n))


def test_the_default_study_pooled_batch_effect_matches_the_report():
    """The pooled change and its interval within K_SE standard errors of a fresh study's: the
    change's standard error from the fresh study's own interval (t on its df); a bound also moves
    with the interval's half-width, whose relative spread is 1/sqrt(2 df)."""
    from scipy import stats

    tables = _report()
    block = " ".join(_block("The default study").split())
    pool = pd.read_csv(tables / "grid_pooled_fashion_mnist.csv").set_index("metric")
    iv = rf"({NUM}) \[({NUM}), ({NUM})\]"
    m = re.search(
        rf"batch 16 is ahead, {iv} by kNN and {iv} by the linear probe, with (\d+)× the optimiser steps", block
    )
    assert m, "the README states the pooled batch effect and the steps it took"
    for i, metric in enumerate(("knn", "linear")):
        row = pool.loc[metric]
        half = (row["ci_high"] - row["ci_low"]) / 2
        se = half / stats.t.ppf(0.975, row["df"])
        two = se * math.sqrt(2)  # two studies' difference
        bound = math.sqrt(two**2 + 2 * (half / math.sqrt(2 * row["df"])) ** 2)
        for quoted, col, tol in zip(
            m.groups()[3 * i : 3 * i + 3], ("change_small_minus_large", "ci_low", "ci_high"), (two, bound, bound)
        ):
            _close(_f(quoted), row[col], tol, f"the pooled {metric} {col}")
        assert row["change_small_minus_large"] > 0, f"'ahead' by {metric}"
    assert int(m.group(7)) == round(pool["steps_smallest"].iloc[0] / pool["steps_largest"].iloc[0])


#: one row of the README's claims table: | [record](path) | unit | contrast | probe | d [lo, hi] | outcome |
CLAIM_ROW = re.compile(
    rf"^\| \[[^]]+\]\((?P<path>[^)]+)\) \| (?P<unit>[^|]+?) \| (?P<key>[^|]+?) \| (?P<probe>[^|]+?) \| "
    rf"(?P<d>{NUM}) \[(?P<lo>{NUM}), (?P<hi>{NUM})\] \| (?P<outcome>[^|]+?) \|$",
    re.M,
)
SECONDARY = " (secondary)"


def _rounded(quoted: str, value: float) -> bool:
    """``quoted`` is ``value`` to the README's rounding (half a unit of its last digit)."""
    return abs(_f(quoted) - value) <= 0.5 * 10 ** -len(quoted.partition(".")[2]) + 1e-9


def _row_problems(m: re.Match, root: Path) -> list[str]:
    path = root / m["path"]
    if not path.is_file():
        return [f"{m['path']}: no such claims table"]
    t = pd.read_csv(path)
    probe = m["probe"].removesuffix(SECONDARY)
    hit = t[(t["unit"] == m["unit"]) & (t["key"] == m["key"]) & (t["metric"] == probe)]
    where = f"{m['path']}: {m['unit']} / {m['key']} / {probe}"
    if hit.empty:
        return [f"{where}: no such row"]
    r, out = hit.iloc[0], []
    if not all(_rounded(m[k], float(r[c])) for k, c in (("d", "diff"), ("lo", "lo"), ("hi", "hi"))):
        out.append(
            f"{where}: quoted {m['d']} [{m['lo']}, {m['hi']}], the row has {r['diff']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"
        )
    if m["outcome"] != r["outcome"]:
        out.append(f"{where}: the README says {m['outcome']!r}, the plan {r['outcome']!r}")
    if not bool(r["gates_passed"]):
        out.append(f"{where}: its unit's gates did not pass (no verdict there)")
    role = "secondary" if m["probe"].endswith(SECONDARY) else "primary"
    if not bool(r["claimed"]) or r["role"] != role:
        out.append(f"{where}: quoted as a {role} claim, the plan has it {r['role']}, claimed={r['claimed']}")
    return out


def claim_problems(block: str, root: Path = ROOT) -> list[str]:
    """What is wrong with a paragraph's claims table against the rows it names (empty: nothing)."""
    rows = list(CLAIM_ROW.finditer(block))
    out = [] if rows else ["the paragraph has no claims table"]
    for m in rows:
        out += _row_problems(m, root)
    free = re.sub(CLAIM_ROW, "", block)
    out += [
        f"an interval outside the claims table: {q.group(0)}" for q in re.finditer(rf"{NUM} \[{NUM}, {NUM}\]", free)
    ]
    return out


def test_every_instrument_finding_is_a_row_of_its_record_with_its_outcome_and_passed_gates():
    assert claim_problems(_block("The instrument")) == []


def _claims_csv(folder: Path, **row) -> str:
    base = {
        "unit": "ds, τ 0.1, 8 epochs (fixed epochs)",
        "key": "negatives",
        "metric": "linear",
        "diff": -0.41,
        "lo": -0.63,
        "hi": -0.18,
        "role": "primary",
        "claimed": True,
        "outcome": "unresolved",
        "gates_passed": True,
    }
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{**base, **row}]).to_csv(folder / "instrument_claims.csv", index=False)
    return "| [r](rec/instrument_claims.csv) | ds, τ 0.1, 8 epochs (fixed epochs) | negatives | linear | −0.41 [−0.63, −0.18] | {} |"


@pytest.mark.parametrize(
    "row,readme_outcome,problem",
    [
        ({}, "unresolved", None),
        ({}, "significant", "the README says 'significant', the plan 'unresolved'"),
        ({"gates_passed": False}, "unresolved", "gates did not pass"),
        ({"outcome": "significant", "gates_passed": False}, "significant", "gates did not pass"),
        ({"claimed": False, "role": "primary", "outcome": "descriptive"}, "descriptive", "claimed=False"),
        ({"hi": -0.10}, "unresolved", "the row has"),
        ({"key": "steps"}, "unresolved", "no such row"),
    ],
    ids=[
        "bound",
        "verdict-on-unresolved",
        "gates-failed",
        "verdict-where-gates-failed",
        "not-claimed",
        "other-interval",
        "no-row",
    ],
)
def test_the_claims_check_fails_a_verdict_the_plan_or_the_gates_withhold(tmp_path, row, readme_outcome, problem):
    line = _claims_csv(tmp_path / "rec", **row).format(readme_outcome)
    got = claim_problems(f"Some words.\n\n{line}\n", tmp_path)
    assert (got == []) if problem is None else any(problem in g for g in got), got


def test_the_claims_check_fails_an_interval_quoted_outside_the_table(tmp_path):
    line = _claims_csv(tmp_path / "rec").format("unresolved")
    got = claim_problems(f"Fewer negatives cost a little: −0.41 [−0.63, −0.18].\n\n{line}\n", tmp_path)
    assert got == ["an interval outside the claims table: −0.41 [−0.63, −0.18]"]


def _record_tables(title: str) -> Path:
    """The folder of tables of the record the paragraph ``title`` links."""
    (record,) = set(re.findall(r"\]\((benchmarks/results/[^)]+\.md)\)", _block(title)))
    folder = (ROOT / record).with_suffix("")
    assert folder.is_dir(), f"the record {record} keeps its tables in {folder.name}/"
    return folder


def test_the_default_study_numbers_are_those_of_its_record():
    """Every number of the default study's table, batch effect and pooled effect is its record's, to
    the README's rounding (a fresh study is held to the seeds' tolerance by the tests above)."""
    tables, block = _record_tables("The default study"), " ".join(_block("The default study").split())
    base = pd.read_csv(tables / "baselines.csv")
    pattern = rf"\| ([^|]+?) \| ({NUM}(?:–{NUM})?) \| ({NUM}(?:–{NUM})?) \|"
    rows = {r[0]: r[1:] for r in re.findall(pattern, _block("The default study"))}
    for col, metric in enumerate(("knn", "linear")):
        grid = pd.read_csv(tables / f"grid_top1_fashion_mnist_{metric}.csv")
        lo, hi = rows[next(k for k in rows if k.endswith("pretrained cells"))][col].split("–")
        assert _rounded(lo, grid["mean"].min()) and _rounded(hi, grid["mean"].max()), metric
        for label, name in (("raw pixels", "raw_pixels"), ("random-init encoder", "random_init")):
            b = base[(base["baseline"] == name) & (base["metric"] == metric)]["mean"].iloc[0]
            assert _rounded(rows[next(k for k in rows if k.startswith(label))][col], b), (label, metric)
    dep = pd.concat([pd.read_csv(tables / f"grid_dependence_fashion_mnist_{m}.csv") for m in ("knn", "linear")])
    lo, hi = re.search(rf"[Bb]atch 16 − 256: ({NUM}) to ({NUM}) points", block).groups()
    assert _rounded(lo, dep["change_small_minus_large"].min()) and _rounded(hi, dep["change_small_minus_large"].max())
    pool = pd.read_csv(tables / "grid_pooled_fashion_mnist.csv").set_index("metric")
    quoted = re.findall(rf"({NUM}) \[({NUM}), ({NUM})\] by (kNN|the linear probe)", block)
    assert len(quoted) == 2
    for (d, lo, hi, _), metric in zip(quoted, ("knn", "linear")):
        row = pool.loc[metric]
        assert (
            _rounded(d, row["change_small_minus_large"])
            and _rounded(lo, row["ci_low"])
            and _rounded(hi, row["ci_high"])
        )


def test_the_mi_toy_number_is_that_of_its_record():
    tables, block = _record_tables("The MI toy"), " ".join(_block("The MI toy").split())
    (quoted,) = re.findall(rf"FlatNCE − InfoNCE = ({NUM} \[{NUM}, {NUM}\]) nats", block)
    measured = " ".join(pd.read_csv(tables / "mi_claims.csv")["measured"].astype(str))
    assert f"FlatNCE - InfoNCE = {quoted}".replace("−", "-") in measured.replace("−", "-")


def _fit_rows(fit_md: Path) -> dict[str, tuple[str, str]]:
    """{arm: (B_noise, its interval as "lo, hi")} of a steps-to-target record's ``fit.md``."""
    rows = {}
    for line in fit_md.read_text(encoding="utf-8").splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = (cells[3], cells[4].replace(" – ", ", "))
    return rows


def test_every_critical_batch_number_is_that_of_its_record():
    """Each arm's B_noise and interval in the README is its row of the record's fit table, and every
    arm of the table is quoted."""
    block = " ".join(_block("The critical batch").split())
    rows = _fit_rows(_record_tables("The critical batch") / "fit.md")
    arms = "|".join(map(re.escape, rows))
    quoted = {arm: (value, interval) for arm, value, interval in re.findall(rf"({arms}) ({NUM}) \[([^\]]+)\]", block)}
    assert quoted == rows


#: a Markdown link or image, inline (``[text](target "title")``) or a reference definition (``[name]: target``)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def _relative_links(md: Path) -> list[str]:
    """The relative link targets of ``md`` outside code (fenced blocks and inline code), anchors dropped."""
    text = re.sub(r"```.*?```|`[^`\n]*`", "", md.read_text(encoding="utf-8"), flags=re.S)
    targets = [a or b for a, b in _LINK.findall(text)]
    return [t.split("#")[0] for t in targets if t.split("#")[0] and not re.match(r"^[a-zA-Z][\w+.-]*:", t)]


def test_every_relative_link_of_the_docs_and_records_points_at_a_file_of_the_repository():
    docs = sorted(ROOT.glob("*.md")) + sorted((ROOT / "benchmarks" / "results").rglob("*.md"))
    assert {"README.md", "ARCHITECTURE.md", "MAINTAINING.md", "CONFIGURATION.md"} <= {p.name for p in docs}
    missing = [
        f"{md.relative_to(ROOT)} -> {t}" for md in docs for t in _relative_links(md) if not (md.parent / t).exists()
    ]
    assert not missing, "links to files not in the repository:\n" + "\n".join(missing)


def test_the_link_check_reads_inline_reference_and_image_links_but_not_code_or_urls(tmp_path):
    md = tmp_path / "r.md"
    md.write_text(
        '[a](a.md) ![fig](f/x.png "t") [b](b.md#part) [web](https://x.org/y) [top](#top)\n'
        "`[c](c.md)`\n```\n[d](d.md)\n```\n[ref]: e/f.csv\n",
        encoding="utf-8",
    )
    assert _relative_links(md) == ["a.md", "f/x.png", "b.md", "e/f.csv"]
