"""The instrument's validity gates and every threshold its verdicts use, in one place.

A verdict about negatives or steps is written for a task and budget only where the instrument
can see what it is asked about (R4 and R8 of the literature review):

* **G1** the supervised network (same architecture) beats raw pixels by at least
  :data:`SUPERVISED_OVER_PIXELS` points on the linear probe: the network can represent the task;
* **G2** InfoNCE at the reference batch (the largest plain batch, at its validated learning
  rate) beats raw pixels and the random-init encoder on the linear probe, the lower end of
  its 95 % interval above each (Welch t against the random-init seeds; raw pixels, one run,
  as a constant: a one-sample t): self-supervision has learnt something worth studying;
* **G3** the positive control (InfoNCE at the reference batch with negatives within groups of
  G images, K = 2G-2 <= :data:`CONTROL_MAX_K`) is significantly worse than the full batch
  (paired t, p < α, one pre-stated test): the instrument can see a negatives effect;
Whether the seeds are precise enough is no gate of the unit but a property of each claim: the
analysis plan (:mod:`smallbatch.report.plan`) words a claimed contrast only when it is resolved
(significant or equivalent after the family's correction) and states it with its interval and MDE
otherwise.

A gate that cannot be computed (its arm or baseline was not run) does not pass.  G1 is a
property of the data set; G2 and G3 of a data set, τ and budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..evidence import ALPHA, Estimate, contrast, describe
from ..fmt import finite, num, signed

#: G1: the supervised network's lead over raw pixels on the linear probe (points)
SUPERVISED_OVER_PIXELS = 5.0
#: G3: an arm at the reference batch with K at most this is the positive control
CONTROL_MAX_K = 6


@dataclass(frozen=True)
class Gate:
    """One gate: ``passed`` None when it could not be computed; ``text`` its numbers in words."""

    name: str
    passed: bool | None
    text: str

    def line(self) -> str:
        verdict = {True: "passed", False: "FAILED", None: "not run"}[self.passed]
        return f"{self.name} {self.text}: {verdict}"


def _mean(v: dict) -> float:
    return sum(v.values()) / len(v) if v else float("nan")


def g1(supervised: dict, pixels: dict) -> Gate:
    """Supervised (mean over its seeds) − raw pixels on the linear probe >= SUPERVISED_OVER_PIXELS."""
    what = "supervised − raw pixels (linear probe)"
    if not supervised or not pixels:
        return Gate("G1", None, f"{what}: {'supervised baseline' if not supervised else 'raw pixels'} not run")
    d = _mean(supervised) - _mean(pixels)
    return Gate(
        "G1", d >= SUPERVISED_OVER_PIXELS, f"{what} = {signed(d)} points (needs ≥ {num(SUPERVISED_OVER_PIXELS)})"
    )


def versus_baseline(ssl: dict, base: dict) -> Estimate:
    """InfoNCE's seeds − a baseline: Welch t against a baseline of several seeds (their seeds are
    other networks, never pairs), a one-sample t against one run taken as a constant."""
    if len(base) == 1:
        c = next(iter(base.values()))
        return contrast([(1.0, {s: v - c for s, v in ssl.items()})])
    return contrast([(1.0, ssl), (-1.0, {f"b{k}": v for k, v in base.items()})])


def g2(ssl: dict, pixels: dict, random_init: dict, ref: str) -> Gate:
    """The reference arm's linear probe above raw pixels and random-init, lower ends above 0."""
    if not ssl:
        return Gate("G2", None, f"{ref}: not run at this budget")
    parts: list[str] = []
    results: list[bool | None] = []
    for name, base in (("raw pixels", pixels), ("random-init", random_init)):
        if not base:
            parts.append(f"− {name}: not run")
            results.append(None)
            continue
        e = versus_baseline(ssl, base)
        results.append(bool(e.tested and e.lo > 0))
        parts.append(f"− {name} = {describe(e, null_mde=False)}")
    ok = False if False in results else (None if None in results else True)
    return Gate("G2", ok, f"{ref} (linear probe) " + "; ".join(parts) + " (lower ends must be above 0)")


def g3(e: Estimate | None, control: str, full: str) -> Gate:
    """The positive control − the full batch: negative and p < α."""
    if e is None or not finite(e.diff):
        return Gate("G3", None, "positive control (K ≤ 6 at the reference batch): not run")
    fired = bool(e.tested and e.diff < 0 and e.p < ALPHA)
    return Gate("G3", fired, f"{control} − {full} = {describe(e, null_mde=False)} (must be below 0, p < {ALPHA:g})")


def passed(gates: list[Gate]) -> bool:
    return bool(gates) and all(g.passed is True for g in gates)
