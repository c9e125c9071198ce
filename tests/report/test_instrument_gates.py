"""The instrument's validity gates (:mod:`smallbatch.report.sections.instrument_gates`), each on
seed values chosen so the gate's rule alone decides: the sign of the positive control and the lower
end of the interval over a baseline (not its mean)."""

from __future__ import annotations

from smallbatch.report.evidence import ALPHA, contrast
from smallbatch.report.sections.instrument_gates import g2, g3, passed


def test_g3_fires_only_for_a_control_significantly_worse_than_the_full_batch():
    full = {0: 80.0, 1: 81.0, 2: 80.5, 3: 80.2}
    worse = {s: v - 3.0 + 0.1 * s for s, v in full.items()}
    better = {s: v + 3.0 + 0.1 * s for s, v in full.items()}
    down, up = contrast([(1.0, worse), (-1.0, full)]), contrast([(1.0, better), (-1.0, full)])
    assert down.p < ALPHA and up.p < ALPHA  # both significant: only the sign differs
    assert g3(down, "K=2", "K=510").passed is True
    assert g3(up, "K=2", "K=510").passed is False  # a control better than the full batch sees nothing
    assert g3(None, "K=2", "K=510").passed is None


def test_g2_needs_the_lower_end_above_each_baseline_not_the_mean():
    pixels = {0: 80.0}  # one run: a constant
    random_init = {0: 79.0, 1: 79.5, 2: 78.8}
    clear = {0: 84.0, 1: 84.5, 2: 83.8}
    barely = {0: 80.2, 1: 83.0, 2: 78.0}  # mean 80.4 above pixels, its interval's lower end below
    assert g2(clear, pixels, random_init, "InfoNCE@256").passed is True
    gate = g2(barely, pixels, random_init, "InfoNCE@256")
    assert gate.passed is False and "lower ends must be above 0" in gate.text
    assert g2(clear, {}, random_init, "InfoNCE@256").passed is None  # raw pixels not run
    assert passed([g2(clear, pixels, random_init, "r")]) and not passed([])
