"""The report's one place for statistics: differences by seed, their intervals and tests, a
family-wise correction, the smallest effect the seeds could have shown, and verdict wording.

Every comparison the report states is a *contrast* of cells — a difference
``a − b`` or a difference of differences — computed **seed by seed**: the arms of
one seed share data order and augmentations, so the per-seed contrasts are
paired observations and their mean is tested with a one-sample Student t
(``paired t``).  Only where fewer than two seeds are common to every cell but
each cell has two or more does :func:`contrast` fall back to Welch's unpaired t
(Welch–Satterthwaite degrees of freedom).  With fewer than two pairs, or seed
contrasts that are all identical (a spread of exactly 0 is no noise estimate),
the contrast is *untested*.

:func:`pooled_difference` pools one change (small − large, say) over several losses: the
per-seed differences of every loss and seed, fitted by least squares with an additive loss
effect and seed effect; it tests their mean over the losses (:data:`POOLED_ASSUMPTIONS`).

:func:`holm` adjusts a family of comparisons (Holm 1979, step-down, strong
family-wise control): a section passes every comparison it states into one
family and words each by its adjusted p.  :func:`mde` is the smallest true
difference a two-sided paired t at level α detects with probability ``power``
given the observed sd of the seed contrasts and their number (noncentral t).

"Costs nothing" is an equivalence claim, tested by :func:`tost` (Schuirmann 1987, two
one-sided tests at level α against a margin ±Δ stated before the data): the larger of the
p values of ``H0: d <= -Δ`` and ``H0: d >= +Δ``, each a one-sided t on the contrast's own
standard error and degrees of freedom.  ``tost(e, Δ) < α`` exactly when the (1 − 2α)
interval lies inside ``(-Δ, +Δ)`` (:func:`equivalent`).  :func:`outcome` names the three
results a contrast can have: *significant* (its adjusted p below α), *equivalent* (not
significant, TOST p below α) and *inconclusive* (neither: the MDE says what the seeds
could have seen).

Wording: a difference is *significant* when its (adjusted) p is below α; a
verdict from :func:`support` says "support" / "do not support" only then and
"neither support nor refute … within noise" otherwise, so the two never meet.
:func:`describe` prints ``d [lo, hi] (paired t, n seeds, Holm p = …)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, overload

from .fmt import finite, num, signed

#: two-sided level of every interval and test
ALPHA = 0.05
#: the power at which the minimum detectable effect is stated
POWER = 0.8

Values = Mapping[Any, float]
#: what a contrast of one seed says in place of its test
ONE_SEED = "one seed: no test, no interval, no p"
#: a spread below this (relative to the difference, at least 1) is rounding noise of equal seed differences,
#: not a noise estimate: accuracies resolve 0.01 points at best, so 1e-9 can only be float arithmetic
SPREAD_TOL = 1e-9


@dataclass(frozen=True)
class Estimate:
    """A contrast with its test.  ``lo``/``hi`` is the (1 − α) interval, ``p`` the raw
    two-sided p, ``p_adj`` the Holm-adjusted p within its family (= p until :func:`holm`),
    ``family`` the family's size, ``sd`` the sd of the seed contrasts (paired) and
    ``n`` the pairs (paired) or the smallest arm (Welch).  ``test`` is 'paired t',
    'Welch t' or 'untested' (then only ``diff`` may be finite)."""

    diff: float
    lo: float = math.nan
    hi: float = math.nan
    p: float = math.nan
    p_adj: float = math.nan
    family: int = 1
    n: int = 0
    sd: float = math.nan
    df: float = math.nan
    test: str = "untested"
    se: float = math.nan  # the standard error of ``diff`` (its t statistic's denominator)
    why: str = ""  # why it is untested, in a finding's words, where ``n`` cannot tell (the pooled model counts pairs)

    @property
    def tested(self) -> bool:
        return self.test != "untested" and finite(self.p_adj)

    @property
    def significant(self) -> bool | None:
        """True when the adjusted p is below α; None when untested."""
        return bool(self.p_adj < ALPHA) if self.tested else None

    @property
    def within_noise(self) -> bool | None:
        """The negation of :attr:`significant` (None when untested)."""
        return None if not self.tested else not self.significant

    @property
    def mde(self) -> float:
        """Minimum detectable effect at :data:`POWER` (paired t and the pooled model; NaN otherwise)."""
        if self.test == POOLED_TEST:
            return mde_se(self.se, self.df)
        return mde(self.sd, self.n) if self.test == "paired t" else math.nan


def _t():
    from scipy import stats

    return stats.t


def t_interval(mean: float, se: float, df: float, alpha: float = ALPHA) -> tuple[float, float]:
    """The two-sided (1 − alpha) Student-t interval ``mean ± t_{1−α/2, df} · se``."""
    if not (finite(mean) and finite(se) and finite(df) and df > 0):
        return math.nan, math.nan
    h = float(_t().ppf(1 - alpha / 2, df)) * se
    return mean - h, mean + h


def _t_test(diff: float, se: float, df: float, n: int, sd: float, test: str) -> Estimate:
    if not (finite(se) and se > 0 and finite(df) and df > 0):
        return Estimate(diff=diff, n=n, sd=sd)
    lo, hi = t_interval(diff, se, df)
    p = float(2 * _t().sf(abs(diff) / se, df))
    return Estimate(diff=diff, lo=lo, hi=hi, p=p, p_adj=p, n=n, sd=sd, df=df, test=test, se=se)


def _clean(v: Values) -> dict:
    return {k: float(x) for k, x in dict(v).items() if finite(x)}


def contrast(terms: Sequence[tuple[float, Values]]) -> Estimate:
    """Σ coef · mean(cell) with its test; each cell given as {seed: value}.

    Paired t over the seeds every cell has (at least two, and seed contrasts that
    are not all equal); else Welch's t over each cell's own seeds (every cell at
    least two seeds with a spread); else untested, with the difference of the
    cell means (NaN when a cell has no value).
    """
    cells = [(float(c), _clean(v)) for c, v in terms]
    means = [sum(v.values()) / len(v) if v else math.nan for _, v in cells]
    diff = sum(c * m for (c, _), m in zip(cells, means)) if all(finite(m) for m in means) else math.nan
    common = sorted(set.intersection(*(set(v) for _, v in cells)), key=str) if cells else []
    if len(common) >= 2:
        per_seed = [sum(c * v[s] for c, v in cells) for s in common]
        n = len(per_seed)
        d = sum(per_seed) / n
        sd = math.sqrt(sum((x - d) ** 2 for x in per_seed) / (n - 1))
        if sd > SPREAD_TOL * max(1.0, abs(d)):
            return _t_test(d, sd / math.sqrt(n), n - 1, n, sd, "paired t")
        return Estimate(diff=d, n=n, sd=0.0)
    if not all(len(v) >= 2 for _, v in cells):
        return Estimate(diff=diff, n=len(common))
    parts = [(c * c * _var(v) / len(v), len(v)) for c, v in cells]
    if all(finite(w) for w, _ in parts) and math.sqrt(sum(w for w, _ in parts)) > SPREAD_TOL * max(1.0, abs(diff)):
        se2 = sum(w for w, _ in parts)
        df = se2**2 / sum(w * w / (k - 1) for w, k in parts)
        return _t_test(diff, math.sqrt(se2), df, min(k for _, k in parts), math.nan, "Welch t")
    return Estimate(diff=diff, n=len(common))


def _var(v: dict) -> float:
    if len(v) < 2:
        return math.nan
    m = sum(v.values()) / len(v)
    return sum((x - m) ** 2 for x in v.values()) / (len(v) - 1)


def paired(a: Values, b: Values) -> Estimate:
    """``mean(a) − mean(b)`` tested seed by seed (see :func:`contrast`)."""
    return contrast([(1.0, a), (-1.0, b)])


#: the test name of :func:`pooled_difference`
POOLED_TEST = "loss + seed model"
#: what :func:`pooled_difference` assumes, in the words a finding states them
POOLED_ASSUMPTIONS = (
    "the seed-paired differences of every loss and seed, fitted with an additive effect of the loss and one of "
    "the seed (least squares); the test is of their mean over the losses, with the residual degrees of freedom "
    "(pairs − losses − seeds + 1); it assumes the differences are independent given loss and seed, normal, and "
    "equally noisy for every loss"
)


def pooled_difference(groups: Mapping[Any, tuple[Values, Values]]) -> Estimate:
    """The mean over groups (losses) of ``mean(a) − mean(b)``, from every group's seed-paired differences.

    ``groups``: {loss: ({seed: value of arm a}, {seed: value of arm b})}.  Each loss's differences
    ``d_ls = a_ls − b_ls`` (the seeds both arms have) are fitted by least squares with
    ``d_ls = μ + α_l + β_s + ε_ls`` (effect coding: Σ α = Σ β = 0, so μ is the unweighted mean over
    losses of their changes, and a seed's shared data order moves every loss's difference alike);
    ``μ̂`` is tested with a Student t on the residual degrees of freedom ``N − L − S + 1``.  With
    every loss at the same seeds, μ̂ is the mean of all differences and its standard error
    ``σ̂ / √N``.  ``n`` is N (the pairs), ``sd`` the residual σ̂, ``se`` the standard error.
    Untested (with the mean) without a residual degree of freedom or a residual spread."""
    rows = []
    for g, (a, b) in groups.items():
        a, b = _clean(a), _clean(b)
        rows += [(g, s, a[s] - b[s]) for s in sorted(set(a) & set(b), key=str)]
    losses = sorted({g for g, _, _ in rows}, key=str)
    seeds = sorted({s for _, s, _ in rows}, key=str)
    if not rows:
        return Estimate(diff=math.nan)
    by_loss = {g: [d for h, _, d in rows if h == g] for g in losses}
    mean = sum(sum(v) / len(v) for v in by_loss.values()) / len(losses)
    df = len(rows) - len(losses) - len(seeds) + 1
    if df < 1:
        why = ONE_SEED if len(seeds) == 1 else "untested: one loss, its seeds leave no residual to estimate the noise"
        return Estimate(diff=mean, n=len(rows), why=why)
    import numpy as np

    def coding(levels: list, value) -> list[float]:  # effect coding: the last level is minus the others
        return [1.0 if value == lv else (-1.0 if value == levels[-1] else 0.0) for lv in levels[:-1]]

    x = np.array([[1.0, *coding(losses, g), *coding(seeds, s)] for g, s, _ in rows])
    y = np.array([d for _, _, d in rows])
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ beta
    sd = math.sqrt(float(resid @ resid) / df)
    if not sd > SPREAD_TOL * max(1.0, abs(float(beta[0]))):
        return Estimate(diff=float(beta[0]), n=len(rows), sd=0.0)
    se = sd * math.sqrt(float(np.linalg.inv(x.T @ x)[0, 0]))
    return _t_test(float(beta[0]), se, df, len(rows), sd, POOLED_TEST)


@overload
def holm(estimates: Iterable[Estimate]) -> list[Estimate]: ...
@overload
def holm(estimates: Iterable[Estimate | None]) -> list[Any]: ...
def holm(estimates: Iterable[Estimate | None]) -> list[Any]:
    """The same estimates with Holm-adjusted p over the tested ones (the family); untested and
    None pass through.  ``family`` is set to the number of tested estimates."""
    out = list(estimates)
    tested = sorted(((i, e) for i, e in enumerate(out) if e is not None and e.tested), key=lambda ie: ie[1].p)
    m, running = len(tested), 0.0
    for rank, (i, e) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * e.p))
        out[i] = replace(e, p_adj=running, family=m)
    return out


@lru_cache(maxsize=4096)
def mde(sd: float, n: int, power: float = POWER, alpha: float = ALPHA) -> float:
    """Smallest true mean difference a two-sided paired t test (level ``alpha``, ``n`` pairs,
    sd of the differences ``sd``) detects with probability ``power``; NaN for n < 2 or no sd.  Cached: one root
    search (~70 ms of noncentral-t evaluations) per distinct (sd, n)."""
    if not (finite(sd) and finite(n) and int(n) >= 2 and sd > 0):
        return math.nan
    return mde_se(sd / math.sqrt(int(n)), int(n) - 1, power, alpha)


@lru_cache(maxsize=4096)
def mde_se(se: float, df: float, power: float = POWER, alpha: float = ALPHA) -> float:
    """Smallest true difference a two-sided t test of an estimate with standard error ``se`` on ``df``
    degrees of freedom detects with probability ``power``; NaN without a standard error or a degree of freedom."""
    if not (finite(se) and finite(df) and df >= 1 and se > 0):
        return math.nan
    from scipy import optimize, stats

    crit = float(stats.t.ppf(1 - alpha / 2, df))

    def short_of(delta: float) -> float:
        nc = delta / se
        lower = float(stats.nct.cdf(-crit, df, nc))  # NaN far in the tail, where it is 0
        return float(stats.nct.sf(crit, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    hi = se * (crit + 4.0)
    while short_of(hi) < 0:
        hi *= 2
    return float(optimize.brentq(short_of, 0.0, hi, xtol=1e-10 * se))


def tost(e: Estimate | None, margin: float) -> float:
    """The two one-sided tests' p of equivalence within ``± margin``: the larger of
    ``P(T >= (d + Δ)/se)`` and ``P(T <= (d − Δ)/se)`` (T: Student t with the contrast's
    degrees of freedom); NaN when the contrast is untested."""
    if e is None or not (finite(e.diff) and finite(e.se) and e.se > 0 and finite(e.df) and e.df > 0):
        return math.nan
    t = _t()
    p_low = float(t.sf((e.diff + margin) / e.se, e.df))  # H0: d <= -margin
    p_high = float(t.cdf((e.diff - margin) / e.se, e.df))  # H0: d >= +margin
    return max(p_low, p_high)


def equivalent(e: Estimate | None, margin: float, alpha: float = ALPHA) -> bool | None:
    """TOST at level ``alpha``: the effect lies within ``± margin`` (None when untested)."""
    p = tost(e, margin)
    return None if not finite(p) else bool(p < alpha)


def outcome(e: Estimate | None, margin: float) -> str:
    """'significant', 'equivalent' (not significant, TOST p < α), 'inconclusive' or 'untested'."""
    if e is None or not e.tested:
        return "untested"
    if e.significant:
        return "significant"
    return "equivalent" if equivalent(e, margin) else "inconclusive"


def describe_outcome(e: Estimate | None, margin: float, nd: int = 2) -> str:
    """The outcome in words with the number that decides it: ``significant`` (and, where its
    interval is narrow enough, ``yet within ± Δ (TOST p = …)``), ``equivalent within ± Δ (TOST
    p = …; MDE at 80 % power = …)``, ``inconclusive (TOST p = …; MDE at 80 % power = …)``: the
    MDE stated for every null."""
    kind = outcome(e, margin)
    if kind == "untested":
        return "untested"
    p = tost(e, margin)
    tp = f"TOST p {'< 0.001' if p < 0.001 else '= ' + p_text(p)}"
    if kind == "significant":
        return f"significant, yet within ± {num(margin)} points ({tp})" if p < ALPHA else "significant"
    m = describe_mde(e, nd)
    m = f"; {m}" if m else ""
    if kind == "equivalent":
        return f"equivalent within ± {num(margin)} points ({tp}{m})"
    return f"inconclusive ({tp}{m})"


def describe(e: Estimate | None, what: str = "", nd: int = 1, null_mde: bool = True) -> str:
    """``small − large = -0.4 [-1.2, +0.4] (paired t, 3 seeds, Holm p = 0.31 of 6; MDE at 80 % power = 1.1)``:
    the minimum detectable effect is added to a null (a tested, non-significant paired contrast) unless
    ``null_mde`` is False; untested contrasts say why (one seed: no test, no interval, no p; or identical
    seed differences) and print no interval."""
    head = f"{what} = " if what else ""
    if e is None or not finite(e.diff):
        return f"{head}— (no value)"
    if not e.tested:
        why = e.why or (
            "untested: seed differences identical, no noise estimate"
            if e.n >= 2
            else (ONE_SEED if e.n == 1 else "untested: fewer than two seeds in common")
        )
        return f"{head}{signed(e.diff, nd)} ({why})"
    seeds = (
        f"{e.n} seeds"
        if e.test == "paired t"
        else f"{e.n} loss × seed pairs, {e.df:g} df"
        if e.test == POOLED_TEST
        else f"≥{e.n} seeds per arm"
    )
    pt = p_text(e.p_adj)
    pt = pt if pt.startswith("<") else f"= {pt}"
    p = f"Holm p {pt} of {e.family}" if e.family > 1 else f"p {pt}"
    m = describe_mde(e, nd) if null_mde and not e.significant else ""
    mde_ = f"; {m}" if m else ""
    return f"{head}{signed(e.diff, nd)} [{signed(e.lo, nd)}, {signed(e.hi, nd)}] ({e.test}, {seeds}, {p}{mde_})"


def describe_mde(e: Estimate | None, nd: int = 1) -> str:
    """``MDE at 80 % power = 1.3`` for a paired contrast; '' otherwise."""
    if e is None or not finite(e.mde):
        return ""
    return f"MDE at {round(POWER * 100)} % power = {num(e.mde, nd)}"


def p_text(p: float) -> str:
    """A p value as the report prints it: ``< 0.001``, ``0.004``, ``0.31``."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def support(holds: bool, e: Estimate | None, claim: str = "the claim") -> str:
    """'our numbers support <claim>' / 'do not support' only when ``e`` is significant;
    'neither support nor refute <claim> (within noise)' when it is not; 'cannot test' when untested."""
    if e is None or not e.tested:
        return f"our numbers cannot test {claim} (no noise estimate)"
    if not e.significant:
        return f"our numbers neither support nor refute {claim} (within noise)"
    return f"our numbers {'support' if holds else 'do not support'} {claim}"


def by_failure(holds: bool, claim: str = "the claim") -> str:
    """A verdict that rests on every seed of one arm diverging, collapsing or failing while the other trained
    (no interval is needed to tell a number from none)."""
    return f"our numbers {'support' if holds else 'do not support'} {claim} (every seed of one arm failed)"
