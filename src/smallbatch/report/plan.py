"""The analysis plan of a designed study: what it claims, on which probe, within which margin and
corrected over which family -- declared in the config (key ``analysis``) before the data, and
applied by the report to every contrast row.

* ``primary``: the probe whose claimed contrasts carry the verdicts; ``secondary``: probes whose
  claimed contrasts are tested in the same family and labelled *secondary*; any other probe is
  *descriptive* (its intervals are printed, never worded as a verdict).
* ``claims``: the contrasts claimed, by key (``loss`` claims every other loss's contrast).  A
  contrast that is not claimed is descriptive on every probe.
* ``margin`` and ``margin_scale``: the equivalence margin in points (``points``), as a fraction of
  the positive control's effect on that probe at that data set, τ and budget (``control``: the
  largest negatives effect the instrument can produce), or as a fraction of that probe's
  supervised − random-init range on that data set (``span``).  It is resolved to points from the
  control and the baselines -- read with the gates, before any claimed contrast -- and printed.
* ``family``: Holm over every claimed contrast × planned probe × budget × view × τ of the whole
  study (``study``) or of each data set (``dataset``); significance and equivalence (TOST) are
  adjusted in the same family.

A claimed contrast is *resolved* when it is significant (family-adjusted p < α) or equivalent
(family-adjusted TOST p < α), and *unresolved* otherwise: stated with its interval and its MDE, no
verdict word.  :func:`apply_plan` works on contrast rows alone (the report's, or a record's
``instrument_contrasts.csv``), so a record made before a plan existed is re-analysed by the
same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import pandas as pd

from .evidence import ALPHA, Estimate, tost
from .fmt import finite, num

#: the probes a plan may name (the instrument's contrasted probes)
PROBES = ("linear", "labels10", "labels1", "knn20", "knn200")
#: the contrasts a plan may claim (the instrument's contrast keys; ``loss``: every other loss's)
CLAIMABLE = (
    "negatives",
    "steps",
    "interaction",
    "negatives_at_large",
    "negatives_at_small",
    "small_large",
    "steps_part",
    "oracle",
    "equal_steps",
    "loss",
)
SCALES = ("points", "control", "span")
FAMILIES = ("study", "dataset")
#: a claimed contrast's outcomes; ``descriptive``: not claimed, or on a probe outside the plan
RESOLVED = ("significant", "equivalent")
#: the columns that name one test: rows equal in all of them are one member of a family
SAME_TEST = ("dataset", "temperature", "budget", "metric", "key", "diff", "p")


@dataclass(frozen=True)
class AnalysisPlan:
    """One study's plan (module docstring); made from the config's ``analysis`` mapping."""

    primary: str
    secondary: tuple[str, ...]
    claims: tuple[str, ...]
    margin: float
    margin_scale: str
    family: str

    @classmethod
    def from_mapping(cls, m: dict[str, Any] | None) -> AnalysisPlan:
        """The plan of ``m`` (the config's ``analysis``), the schema's default for every key it
        leaves out; ValueError naming the key for a value outside the plan's vocabulary."""
        d = {**default_mapping(), **(m or {})}
        unknown = set(d) - set(default_mapping())
        if unknown:
            raise ValueError(f"analysis: unknown key(s) {sorted(unknown)}; allowed: {sorted(default_mapping())}")
        plan = cls(
            primary=str(d["primary"]),
            secondary=tuple(str(p) for p in d["secondary"] if p != d["primary"]),
            claims=tuple(str(c) for c in d["claims"]),
            margin=float(d["margin"]),
            margin_scale=str(d["margin_scale"]),
            family=str(d["family"]),
        )
        plan.check()
        return plan

    def check(self) -> None:
        for key, vals, allowed in (
            ("primary", [self.primary], PROBES),
            ("secondary", self.secondary, PROBES),
            ("claims", self.claims, CLAIMABLE),
            ("margin_scale", [self.margin_scale], SCALES),
            ("family", [self.family], FAMILIES),
        ):
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ValueError(f"analysis.{key}: {bad[0]!r} is not one of {', '.join(allowed)}")
        if not (finite(self.margin) and self.margin > 0):
            raise ValueError(f"analysis.margin: {self.margin!r} must be a positive number")

    def role(self, probe: str) -> str:
        """'primary', 'secondary' or 'descriptive' (a probe outside the plan)."""
        return "primary" if probe == self.primary else "secondary" if probe in self.secondary else "descriptive"

    def claims_key(self, key: str) -> bool:
        return key in self.claims or (key.startswith("loss:") and "loss" in self.claims)

    def lines(self) -> list[str]:
        """The plan in words, as the report prints it before any contrast."""
        scale = {
            "points": f"± {num(self.margin, 2)} points",
            "control": f"± {num(self.margin, 2)} × |the positive control's effect| on the same probe, data set, τ and budget",
            "span": f"± {num(self.margin, 2)} × that probe's supervised − random-init range on the data set",
        }[self.margin_scale]
        fam = "the whole study" if self.family == "study" else "each data set"
        return [
            f"primary probe: {self.primary}; secondary: {', '.join(self.secondary) or 'none'}; "
            "every other probe is descriptive (no verdict)",
            f"claimed contrasts: {', '.join(self.claims)}; every other contrast is descriptive",
            f"equivalence margin: {scale}",
            f"multiplicity: Holm over every claimed contrast × planned probe × budget × view × τ of {fam}, "
            "for significance and for equivalence (TOST) alike",
            "a claim is resolved when significant or equivalent after that correction, and only in a unit whose "
            "gates G1–G3 pass; otherwise it is stated with its interval and MDE, without a verdict",
        ]


def default_mapping() -> dict[str, Any]:
    """The schema's defaults of ``analysis`` (the one place they are written)."""
    import yaml

    path = resources.files("smallbatch") / "resources" / "config.schema.yaml"
    props = yaml.safe_load(path.read_text(encoding="utf-8"))["properties"]["analysis"]["properties"]
    return {k: v["default"] for k, v in props.items()}


# --------------------------------------------------------------------------- margins
def _spans(rows: pd.DataFrame) -> dict[tuple, float]:
    """(dataset, probe) -> supervised − random-init, from the rows' ``span`` (the report's) or
    their ``fraction_of_supervised_gap`` (a record's: diff / span)."""
    out: dict[tuple, float] = {}
    for r in rows.itertuples(index=False):
        span = getattr(r, "span", math.nan)
        if not finite(span):
            frac = getattr(r, "fraction_of_supervised_gap", math.nan)
            span = r.diff / frac if finite(frac) and frac != 0 and finite(r.diff) else math.nan
        if finite(span):
            out.setdefault((r.dataset, r.metric), float(span))
    return out


def _controls(rows: pd.DataFrame) -> dict[tuple, float]:
    """(dataset, τ, budget, probe) -> the positive control's effect (its ``control`` row)."""
    c = rows[rows["key"] == "control"]
    return {
        (r.dataset, float(r.temperature), r.budget, r.metric): float(r.diff)
        for r in c.itertuples(index=False)
        if finite(r.diff)
    }


def margins(plan: AnalysisPlan, rows: pd.DataFrame) -> pd.Series:
    """Each row's margin in points (NaN where a relative margin has no control or range to resolve it)."""
    if plan.margin_scale == "points":
        return pd.Series(plan.margin, index=rows.index, dtype=float)
    keys: list[tuple]
    if plan.margin_scale == "control":
        ref = _controls(rows)
        keys = list(zip(rows["dataset"], rows["temperature"].astype(float), rows["budget"], rows["metric"]))
    else:
        ref = _spans(rows)
        keys = list(zip(rows["dataset"], rows["metric"]))
    return pd.Series([plan.margin * abs(ref.get(k, math.nan)) for k in keys], index=rows.index, dtype=float)


# --------------------------------------------------------------------------- the plan applied
def row_estimate(r: Any) -> Estimate:
    """The contrast of one row as an :class:`Estimate`; its standard error and degrees of freedom
    from the row's ``se``/``df`` or, for a paired t, from its interval and seeds."""
    test = str(getattr(r, "test", "untested"))
    diff, lo, hi, p = (float(getattr(r, k, math.nan)) for k in ("diff", "lo", "hi", "p"))
    n = int(getattr(r, "seeds", 0) or 0)
    se, df = float(getattr(r, "se", math.nan)), float(getattr(r, "df", math.nan))
    if not finite(df) and test == "paired t" and n >= 2:
        df = n - 1.0
    if not finite(se) and finite(lo) and finite(hi) and finite(df) and df > 0:
        from scipy import stats

        se = (hi - lo) / (2 * float(stats.t.ppf(1 - ALPHA / 2, df)))
    if test == "untested" or not finite(p):
        return Estimate(diff=diff, n=n)
    return Estimate(diff=diff, lo=lo, hi=hi, p=p, p_adj=p, n=n, df=df, test=test, se=se)


def holm_p(p: pd.Series) -> pd.Series:
    """Holm-adjusted p over the finite values of ``p`` (NaN stays NaN)."""
    ok = p.dropna().sort_values(kind="stable")
    m, running, out = len(ok), 0.0, pd.Series(math.nan, index=p.index)
    for rank, (i, v) in enumerate(ok.items()):
        running = max(running, min(1.0, (m - rank) * float(v)))
        out[i] = running
    return out


def apply_plan(plan: AnalysisPlan, rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` (contrast rows: dataset, temperature, budget, view, metric, key, diff, lo, hi, p,
    seeds, test, and ``span`` or ``fraction_of_supervised_gap``) with the plan's columns: ``role``
    (the probe's), ``claimed``, ``margin`` (points), ``tost_p`` (at that margin), ``p_family`` and
    ``tost_family`` (Holm over the family), ``family`` (its size) and ``outcome``."""
    out = rows.copy()
    out["role"] = [plan.role(m) for m in out["metric"]]
    out["claimed"] = [plan.claims_key(k) and r != "descriptive" for k, r in zip(out["key"], out["role"])]
    out["margin"] = margins(plan, out)
    ests = [row_estimate(r) for r in out.itertuples(index=False)]
    out["tost_p"] = [tost(e, m) if finite(m) else math.nan for e, m in zip(ests, out["margin"])]
    p = pd.Series([e.p if e.tested else math.nan for e in ests], index=out.index)
    out["p_family"], out["tost_family"], out["family"] = math.nan, math.nan, 0
    groups = [out.index] if plan.family == "study" else [g.index for _, g in out.groupby("dataset", sort=True)]
    for idx in groups:
        fam = [i for i in idx if out.at[i, "claimed"] and finite(p[i])]
        if not fam:  # nothing tested here (one seed): no family, every claim untested
            continue
        # one test read in two views (a contrast of the reference batch's arms alone is the same
        # seeds' numbers at fixed epochs and fixed steps) is one member of the family
        twin = out.loc[fam, list(SAME_TEST)].astype(str).agg("|".join, axis=1)
        first = twin[~twin.duplicated()].index
        out.loc[first, "p_family"] = holm_p(p[first])
        # a claim whose margin could not be resolved stays in the family, at TOST p 1
        out.loc[first, "tost_family"] = holm_p(out.loc[first, "tost_p"].astype(float).fillna(1.0))
        lead = {t: i for i, t in twin[first].items()}
        for i, t in twin.items():
            out.loc[i, ["p_family", "tost_family"]] = out.loc[lead[t], ["p_family", "tost_family"]].to_numpy()
        out.loc[fam, "family"] = len(first)
    out["outcome"] = [_outcome(r) for r in out.itertuples(index=False)]
    return out


def _outcome(r: Any) -> str:
    if not r.claimed:
        return "descriptive"
    if not finite(r.p_family):
        return "untested"
    if r.p_family < ALPHA:
        return "significant"
    return "equivalent" if r.tost_family < ALPHA else "unresolved"


def family_estimate(e: Estimate, row: Any) -> Estimate:
    """``e`` with its family-adjusted p and family size (a claimed row), for the report's wording."""
    if not (row.claimed and finite(row.p_family)):
        return e
    return replace(e, p_adj=float(row.p_family), family=int(row.family))
