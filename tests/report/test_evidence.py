"""report/evidence.py: paired and Welch t intervals, Holm, the minimum detectable effect and the
verdict wording — each on both sides of its boundary and with negative differences, the
arithmetic checked against scipy.stats and (the MDE) against a simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from smallbatch.report import evidence
from smallbatch.report.evidence import Estimate, contrast, describe, holm, mde, paired, support


# --------------------------------------------------------------------------- paired t
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_paired_interval_and_p_match_scipy(sign):
    a = {0: 80.0, 1: 81.5, 2: 79.0, 3: 82.0}
    b = {0: 79.0 + 0 * sign, 1: 80.0, 2: 78.8, 3: 80.1}
    if sign < 0:
        a, b = b, a
    d = np.array([a[s] - b[s] for s in a])
    e = paired(a, b)
    ref = stats.ttest_rel(list(a.values()), list(b.values()))
    h = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert e.test == "paired t" and e.n == 4 and e.df == 3
    assert e.diff == pytest.approx(d.mean()) and math.copysign(1, e.diff) == sign
    assert (e.lo, e.hi) == pytest.approx((d.mean() - h, d.mean() + h), rel=1e-12)
    assert e.p == pytest.approx(ref.pvalue, rel=1e-10) and e.p_adj == e.p
    assert e.sd == pytest.approx(d.std(ddof=1))


def test_paired_pairs_by_seed_not_by_position():
    a = {1: 10.0, 0: 0.0, 2: 20.0}  # same per-seed offset +1 but a shuffled order
    b = {0: -1.0, 2: 19.0, 1: 9.0, 7: 100.0}  # a seed b alone has is left out
    e = paired(a, b)
    assert e.n == 3 and e.diff == pytest.approx(1.0)
    assert not e.tested and e.sd == 0.0  # identical seed differences: no noise estimate


@pytest.mark.parametrize("diff", [2.0, -2.0])
def test_significance_on_both_sides_of_alpha(diff):
    # n = 3, seed differences diff + (-s, 0, +s): t = |diff| / (s / sqrt 3); choose s so t sits just
    # inside and just outside t_{0.975, 2}
    crit = stats.t.ppf(0.975, 2)
    for factor, expect in ((0.99, True), (1.01, False)):
        s = abs(diff) * math.sqrt(3) / crit * factor
        e = paired({0: diff - s, 1: diff, 2: diff + s}, {0: 0.0, 1: 0.0, 2: 0.0})
        assert e.significant is expect and e.within_noise is (not expect)
        assert (e.lo > 0 or e.hi < 0) is expect  # the interval excludes zero exactly when p < α
        assert (e.p < evidence.ALPHA) is expect


def test_fewer_than_two_pairs_is_untested():
    e = paired({0: 1.0}, {0: 0.0})
    assert not e.tested and e.significant is None and e.within_noise is None and e.diff == 1.0
    assert math.isnan(paired({0: 1.0}, {1: 0.0}).diff) is False  # the means still differ by 1
    assert math.isnan(paired({}, {0: 1.0}).diff)


# --------------------------------------------------------------------------- Welch and contrasts
@pytest.mark.parametrize("shift", [3.0, -3.0])
def test_welch_when_no_two_seeds_are_shared_matches_scipy(shift):
    a = {0: 1.0 + shift, 1: 2.0 + shift, 2: 4.0 + shift}
    b = {5: 0.0, 6: 1.0, 7: 0.5, 8: 2.5}
    e = paired(a, b)
    ref = stats.ttest_ind(list(a.values()), list(b.values()), equal_var=False)
    va, vb = np.var(list(a.values()), ddof=1) / 3, np.var(list(b.values()), ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    h = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert e.test == "Welch t" and e.df == pytest.approx(df)
    assert e.p == pytest.approx(ref.pvalue, rel=1e-10)
    assert (e.lo, e.hi) == pytest.approx((e.diff - h, e.diff + h))
    assert math.isnan(e.mde)  # the MDE is stated for paired contrasts only


def test_difference_of_differences_is_paired_per_seed():
    cells = [{s: 10.0 + s + k for s in range(4)} for k in range(4)]
    noise = [0.3, -0.1, 0.5, -0.2]
    cells[0] = {s: v + noise[s] for s, v in cells[0].items()}
    e = contrast([(1, cells[0]), (-1, cells[1]), (-1, cells[2]), (1, cells[3])])
    per_seed = np.array([cells[0][s] - cells[1][s] - cells[2][s] + cells[3][s] for s in range(4)])
    assert e.test == "paired t" and e.diff == pytest.approx(per_seed.mean())
    assert e.p == pytest.approx(stats.ttest_1samp(per_seed, 0.0).pvalue, rel=1e-10)


# --------------------------------------------------------------------------- Holm
def test_holm_matches_the_step_down_definition_and_skips_untested():
    ps = [0.01, 0.04, 0.03, 0.005]
    ests = [Estimate(diff=1.0, p=p, p_adj=p, test="paired t", n=3, sd=1.0) for p in ps]
    out = holm([*ests, None, Estimate(diff=-1.0)])
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4·0.005, 3·0.01, 2·0.03, 1·0.04, made monotone
    assert [e.p_adj for e in out[:4]] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert all(e.family == 4 for e in out[:4]) and out[4] is None and not out[5].tested
    # a p that passes alone fails in its family: the boundary moves with the family size
    alone = Estimate(diff=-0.5, p=0.02, p_adj=0.02, test="paired t", n=3, sd=1.0)
    assert alone.significant is True
    fam = holm(
        [
            alone,
            Estimate(diff=0.1, p=0.9, p_adj=0.9, test="paired t", n=3, sd=1.0),
            Estimate(diff=0.1, p=0.5, p_adj=0.5, test="paired t", n=3, sd=1.0),
        ]
    )
    assert fam[0].p_adj == pytest.approx(0.06) and fam[0].significant is False
    assert holm([])[:] == []


# --------------------------------------------------------------------------- minimum detectable effect
def _power(delta, sd, n, alpha=0.05):
    df, nc = n - 1, delta / (sd / math.sqrt(n))
    c = stats.t.ppf(1 - alpha / 2, df)
    return stats.nct.sf(c, df, nc) + stats.nct.cdf(-c, df, nc)


@pytest.mark.parametrize("sd, n", [(1.0, 10), (0.4, 3), (2.5, 5)])
def test_mde_has_exactly_eighty_percent_power(sd, n):
    m = mde(sd, n)
    assert _power(m, sd, n) == pytest.approx(0.8, abs=1e-8)
    assert _power(0.97 * m, sd, n) < 0.8 < _power(1.03 * m, sd, n)
    assert m == pytest.approx(sd * mde(1.0, n))  # scales with the sd of the differences


def test_mde_against_the_normal_approximation_and_a_simulation():
    # the z-test's (z_.975 + z_.8) sd / sqrt(n) is the large-n limit, and a t test needs more
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert z / 10 < mde(1.0, 100) < 1.01 * z / 10
    assert mde(1.0, 10) > z / math.sqrt(10)
    rng = np.random.default_rng(0)
    sims = rng.normal(mde(1.0, 6), 1.0, size=(40_000, 6))
    p = stats.ttest_1samp(sims, 0.0, axis=1).pvalue
    assert (p < 0.05).mean() == pytest.approx(0.8, abs=0.01)


@pytest.mark.parametrize("sd, n", [(0.0, 5), (1.0, 1), (math.nan, 4)])
def test_mde_without_a_noise_estimate_is_nan(sd, n):
    assert math.isnan(mde(sd, n))


def test_estimate_mde_uses_the_seed_differences():
    e = paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert e.mde == pytest.approx(mde(np.std([1, 2, 4], ddof=1), 3))
    assert evidence.describe_mde(e) == f"MDE at 80 % power = {e.mde:.1f}"


# --------------------------------------------------------------------------- wording
@pytest.mark.parametrize("holds", [True, False])
@pytest.mark.parametrize("p", [0.049, 0.051])
def test_support_and_within_noise_never_meet(holds, p):
    e = Estimate(diff=-1.0, lo=-2.0, hi=0.5, p=p, p_adj=p, test="paired t", n=3, sd=1.0)
    s = support(holds, e, "the claim")
    if p < 0.05:
        assert s == f"our numbers {'support' if holds else 'do not support'} the claim"
    else:
        assert s == "our numbers neither support nor refute the claim (within noise)"
    assert not ("within noise" in s and " support the claim" in s)


def test_untested_never_supports():
    for e in (None, Estimate(diff=3.0), paired({0: 1.0}, {0: 0.0})):
        s = support(True, e, "x")
        assert "cannot test" in s and "support x" not in s


def test_describe_prints_interval_test_seeds_and_holm():
    e = holm(
        [
            paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.0, 2: 0.0}),
            paired({0: -1.0, 1: -1.5, 2: -0.2}, {0: 0.0, 1: 0.0, 2: 0.0}),
        ]
    )
    s = describe(e[1], "small − large")
    assert s.startswith("small − large = -0.9 [") and "(paired t, 3 seeds, Holm p = " in s
    # a null carries its minimum detectable effect; a significant difference does not need one
    assert s.endswith(f"of 2; MDE at 80 % power = {e[1].mde:.1f})") and not e[1].significant
    assert describe(e[1], null_mde=False).endswith("of 2)")
    sig = paired({0: 3.0, 1: 3.1, 2: 2.9}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert sig.significant and "MDE" not in describe(sig)
    assert describe(paired({0: 1.0}, {0: 0.0})) == "+1.0 (one seed: no test, no interval, no p)"
    assert describe(paired({0: 1.0, 1: 1.0}, {0: 0.0, 1: 0.0})).endswith(
        "(untested: seed differences identical, no noise estimate)"
    )
    assert "-0.0" not in describe(paired({0: -0.01, 1: 0.02, 2: -0.03}, {0: 0.0, 1: 0.0, 2: 0.0}))


@pytest.mark.parametrize("mean", [1.5, -1.5])
def test_t_interval_matches_scipy_and_needs_a_spread(mean):
    lo, hi = evidence.t_interval(mean, 0.4, 3)
    assert (lo, hi) == pytest.approx(stats.t.interval(0.95, 3, loc=mean, scale=0.4), rel=1e-12)
    assert (lo > 0) == (mean > 0) and (hi < 0) == (mean < 0)  # ±1.5 with se 0.4: zero outside either way
    wide = evidence.t_interval(mean, 0.6, 3)  # t_{0.975,3} · 0.6 = 1.91 > 1.5: zero inside
    assert wide[0] < 0 < wide[1]
    for se, df in ((0.4, 0), (math.nan, 3), (0.4, math.nan)):
        assert all(math.isnan(v) for v in evidence.t_interval(mean, se, df))


def test_by_failure_names_its_ground():
    assert evidence.by_failure(False, "x") == "our numbers do not support x (every seed of one arm failed)"
    assert "within noise" not in evidence.by_failure(True, "x")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_float_rounding_of_equal_seed_differences_is_no_spread(sign):
    # 0.1 + 0.2 − 0.3 style noise: the seed differences are equal up to 1e-15, which must not read as a test
    a = {0: sign * (0.1 + 0.2), 1: sign * 0.3}
    assert a[0] != a[1]  # 0.30000000000000004 vs 0.3
    e = paired(a, {0: 0.0, 1: 0.0})
    assert not e.tested and e.sd == 0.0 and e.significant is None
    near = paired({0: 80.3, 1: 80.3 + 1e-6}, {0: 70.0, 1: 70.0})  # a real (if tiny) spread is still tested
    assert near.tested


# --------------------------------------------------------------------------- boundaries the mutants found
def test_an_adjusted_p_of_exactly_alpha_is_not_significant():
    at = Estimate(diff=1.0, lo=0.0, hi=2.0, p=evidence.ALPHA, p_adj=evidence.ALPHA, n=3, sd=1.0, df=2, test="paired t")
    below = Estimate(diff=1.0, lo=0.1, hi=1.9, p=0.049, p_adj=0.049, n=3, sd=1.0, df=2, test="paired t")
    assert at.significant is False and at.within_noise is True
    assert below.significant is True


def test_two_shared_seeds_are_enough_for_a_paired_t():
    e = paired({0: 1.0, 1: 3.0}, {0: 0.0, 1: 1.0})
    ref = stats.ttest_rel([1.0, 3.0], [0.0, 1.0])
    assert e.test == "paired t" and e.n == 2
    assert e.p == pytest.approx(ref.pvalue, rel=1e-12)


def test_mde_beyond_the_first_search_bracket_still_has_its_power():
    """Two seeds at 90 % power: the search's first bracket se*(t_crit + 4) holds only 81 % power
    at one degree of freedom, so the bracket must widen for the root to be found."""
    m = mde(1.0, 2, power=0.9)
    nc, c = m / (1.0 / math.sqrt(2)), stats.t.ppf(0.975, 1)
    lower = stats.nct.cdf(-c, 1, nc)  # NaN this far in the tail, where it is 0
    assert stats.nct.sf(c, 1, nc) + (lower if np.isfinite(lower) else 0.0) == pytest.approx(0.9, abs=1e-8)
    assert m > (c + 4.0) / math.sqrt(2)


# --------------------------------------------------------------------------- equivalence (TOST)
def test_tost_matches_a_hand_computation_with_scipys_t():
    """Six paired seeds: d = mean, se = sd/sqrt(6), df = 5; TOST p = max(P(T > (d + 0.5)/se),
    P(T < (d − 0.5)/se)), and it is below α exactly when the 90 % interval lies inside ±0.5."""
    diffs = [0.12, -0.05, 0.20, 0.02, -0.10, 0.08]
    e = paired({s: 60.0 + x for s, x in enumerate(diffs)}, {s: 60.0 for s in range(6)})
    d, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    se = sd / math.sqrt(6)
    by_hand = max(stats.t.sf((d + 0.5) / se, 5), stats.t.cdf((d - 0.5) / se, 5))
    assert e.se == pytest.approx(se, rel=1e-12)
    assert evidence.tost(e, 0.5) == pytest.approx(by_hand, rel=1e-10) and by_hand < 0.05
    lo, hi = evidence.t_interval(d, se, 5, alpha=0.10)
    assert lo > -0.5 and hi < 0.5 and evidence.equivalent(e, 0.5)
    assert evidence.outcome(e, 0.5) == "equivalent"
    assert evidence.describe_outcome(e, 0.5).startswith("equivalent within ± 0.5 points (TOST p")


@pytest.mark.parametrize("shift", [0.0, 0.3, -0.3, 0.6])
def test_tost_is_below_alpha_exactly_when_the_ninety_percent_interval_is_inside_the_margin(shift):
    diffs = [shift + x for x in (0.1, -0.2, 0.15, 0.0, -0.05)]
    e = paired({s: x for s, x in enumerate(diffs)}, {s: 0.0 for s in range(5)})
    lo, hi = evidence.t_interval(e.diff, e.se, e.df, alpha=0.10)
    assert (evidence.tost(e, 0.5) < 0.05) == (lo > -0.5 and hi < 0.5)


def test_the_three_outcomes_and_an_untested_contrast():
    sig = paired({s: 3.0 + 0.1 * s for s in range(4)}, {s: 0.0 for s in range(4)})
    assert evidence.outcome(sig, 0.5) == "significant" and evidence.describe_outcome(sig, 0.5) == "significant"
    tight = paired({s: 0.2 + 0.01 * (-1) ** s for s in range(6)}, {s: 0.0 for s in range(6)})
    assert tight.significant and evidence.describe_outcome(tight, 0.5).startswith("significant, yet within ± 0.5")
    noisy = paired({s: x for s, x in enumerate([1.0, -2.0, 1.5, -0.5])}, {s: 0.0 for s in range(4)})
    assert evidence.outcome(noisy, 0.5) == "inconclusive"
    assert "MDE at 80 % power" in evidence.describe_outcome(noisy, 0.5)
    assert evidence.outcome(paired({0: 1.0}, {0: 0.0}), 0.5) == "untested"
    assert math.isnan(evidence.tost(paired({0: 1.0}, {0: 0.0}), 0.5))


# --------------------------------------------------------------------------- pooled over losses
def _arms(diffs: dict) -> dict:
    """{loss: ({seed: small}, {seed: large})} with large = 80 and small = 80 + the designed difference."""
    return {g: ({s: 80.0 + d for s, d in v.items()}, {s: 80.0 for s in v}) for g, v in diffs.items()}


def test_pooled_difference_matches_the_hand_computed_two_way_anova():
    d = {"a": {0: 0.5, 1: 0.1}, "b": {0: 0.6, 1: 0.4}, "c": {0: 0.2, 1: 0.0}}
    # by hand: grand mean 0.3; loss means 0.3, 0.5, 0.1; seed means 0.4333, 0.1667; residual
    # d - loss mean - seed mean + grand mean = ±0.0667 (a), ±0.0333 (b, c); SSE = 0.013333 on (3-1)(2-1) = 2 df
    sse = 2 * (0.2 / 3) ** 2 + 4 * (0.1 / 3) ** 2
    se = math.sqrt(sse / 2) / math.sqrt(6)
    e = evidence.pooled_difference(_arms(d))
    assert e.test == evidence.POOLED_TEST and e.n == 6 and e.df == 2
    assert e.diff == pytest.approx(0.3, abs=1e-12) and e.se == pytest.approx(se, rel=1e-10)
    assert e.sd == pytest.approx(math.sqrt(sse / 2), rel=1e-10)
    h = stats.t.ppf(0.975, 2) * se
    assert (e.lo, e.hi) == pytest.approx((0.3 - h, 0.3 + h), rel=1e-10)
    assert e.p == pytest.approx(2 * stats.t.sf(0.3 / se, 2), rel=1e-10) and e.significant
    assert e.mde == pytest.approx(evidence.mde_se(se, 2)) and e.mde > 0
    # the same numbers as a paired t over the 6 pairs would give the mean, not the interval: the seed
    # effect (0.43 vs 0.17, shared by every loss) is taken out of the noise
    assert paired({i: v for i, v in enumerate([0.5, 0.1, 0.6, 0.4, 0.2, 0.0])}, dict.fromkeys(range(6), 0.0)).hi > e.hi
    text = describe(e, "Δ", nd=2)
    assert text.startswith("Δ = +0.30 [") and "(loss + seed model, 6 loss × seed pairs, 2 df, p = " in text


def test_pooled_difference_without_a_seed_of_one_loss_is_the_mean_of_the_fitted_cells():
    d = {"a": {0: 0.5, 1: 0.1, 2: 0.3}, "b": {0: 0.6, 1: 0.4, 2: 0.9}, "c": {0: 0.2, 2: -0.1}}
    rows = [(g, s, v) for g, vs in d.items() for s, v in vs.items()]
    losses, seeds = ["a", "b", "c"], [0, 1, 2]
    # treatment coding (another parameterisation than the code's): mu = mean over all 3 x 3 fitted cells
    x = np.array([[1.0, g == "b", g == "c", s == 1, s == 2] for g, s, _ in rows], dtype=float)
    y = np.array([v for _, _, v in rows])
    beta = np.linalg.solve(x.T @ x, x.T @ y)
    w = np.mean([[1.0, g == "b", g == "c", s == 1, s == 2] for g in losses for s in seeds], axis=0)
    resid = y - x @ beta
    df = len(rows) - 3 - 3 + 1
    se = math.sqrt(resid @ resid / df * (w @ np.linalg.inv(x.T @ x) @ w))
    e = evidence.pooled_difference(_arms(d))
    assert e.df == df == 3 and e.n == 8
    assert e.diff == pytest.approx(float(w @ beta), abs=1e-12) and e.se == pytest.approx(se, rel=1e-9)


def test_pooled_difference_untested_without_residual_noise_or_degrees_of_freedom():
    # a pure seed effect (every loss +0.2 at seed 0, -0.2 at seed 1 about its own change): no residual spread
    e = evidence.pooled_difference(_arms({"a": {0: 0.7, 1: 0.3}, "b": {0: 0.2, 1: -0.2}}))
    assert not e.tested and e.diff == pytest.approx(0.25) and e.sd == 0.0
    # one loss, two seeds: the seed effect takes the only degree of freedom
    one = evidence.pooled_difference(_arms({"a": {0: 0.7, 1: 0.1}}))
    assert not one.tested and one.diff == pytest.approx(0.4) and math.isnan(one.p)
    assert describe(one) == "+0.4 (untested: one loss, its seeds leave no residual to estimate the noise)"
    # two losses, one seed: two pairs, yet one seed gives no test (its differences are not 'identical')
    single = evidence.pooled_difference(_arms({"a": {0: 0.7}, "b": {0: 0.1}}))
    assert describe(single) == "+0.4 (one seed: no test, no interval, no p)"
    assert math.isnan(evidence.pooled_difference({}).diff)
    # a seed only one arm has is left out
    e = evidence.pooled_difference(
        {"a": ({0: 1.0, 1: 2.0, 5: 9.0}, {0: 0.0, 1: 0.0}), "b": ({0: 1.0}, {0: 0.0, 1: 3.0})}
    )
    assert e.n == 3
