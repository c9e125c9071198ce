"""The report of a fixed synthetic store is byte-identical to the committed golden files.

``report_store.build_golden_store`` logs a store that exercises every section
(grid with a τ axis, seeds, loss parameters and an extra axis; baselines; the
papers; diverged/failed runs; precision; ksweep; ess; tsweep; mi).  Its tables
(CSV, Markdown, LaTeX) and index.md, with run ids replaced by stable names, must
equal ``tests/fixtures/report_golden/`` byte for byte.  Figures are not compared
(their bytes carry renderer metadata).  An intended change of the output
regenerates the golden files (``python tests/report_store.py --write``) in a
commit of its own.
"""

from __future__ import annotations

import difflib

from report_store import GOLDEN, build_golden_report


def test_report_matches_golden_files(tmp_path):
    got = build_golden_report(tmp_path)
    # bytes decoded, not read_text(), which would turn a \r\n into \n and hide a change of line ends
    want = {
        p.relative_to(GOLDEN).as_posix(): p.read_bytes().decode("utf-8")
        for p in sorted(GOLDEN.rglob("*"))
        if p.is_file()
    }
    assert sorted(got) == sorted(want), "the report writes other tables than the golden files"
    differ = [name for name in want if got[name] != want[name]]
    if differ:
        first = differ[0]
        diff = "\n".join(
            list(
                difflib.unified_diff(
                    want[first].splitlines(), got[first].splitlines(), "golden/" + first, "built/" + first, lineterm=""
                )
            )[:40]
        )
        raise AssertionError(f"{len(differ)} file(s) differ from the golden files: {differ}\n{diff}")
    assert (tmp_path / "report" / "figures" / "accuracy_vs_batch_digits.png").stat().st_size > 0
