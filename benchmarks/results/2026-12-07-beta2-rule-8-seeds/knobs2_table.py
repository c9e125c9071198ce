"""Tables of the knobs stage with 8 seeds: per-seed values (csv) and paired contrasts (markdown), each
with smallbatch's own paired t (smallbatch.report.evidence.contrast), from the knobs store alone: B = 16
and B = 256, each with Adam's beta2 at 0.999 (none) and by the samples rule (at 256 the identity, so its
two arms must agree run for run: checked here).

    python knobs2_table.py KNOBS_URI OUTDIR
"""

import sys
from pathlib import Path

import pandas as pd

import smallbatch
from smallbatch.report.evidence import contrast

PROBES = {"linear": "metrics.linear/top1", "kNN@20": "metrics.knn/top1_k20", "kNN@200": "metrics.knn/top1_k200"}

uri, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
d = smallbatch.results(uri)
d = d[(d["section"] == "regime") & (d["status"] == "finished")].copy()
d["B"] = d["batch_size"].astype(int)
d["seed"] = d["seed"].astype(int)
arms = {
    "B=16, beta2 0.999 (none)": d[(d.B == 16) & (d["params.regime"] == "adam")],
    "B=16, beta2 0.999^(1/16) (samples)": d[(d.B == 16) & (d["params.regime"] == "adam_b2samples")],
    "B=256, beta2 0.999 (none)": d[(d.B == 256) & (d["params.regime"] == "adam")],
    "B=256, samples rule (the identity)": d[(d.B == 256) & (d["params.regime"] == "adam_b2samples")],
}
seeds = pd.concat([g.assign(arm=a) for a, g in arms.items()])
b2 = [c for c in seeds.columns if c.startswith("params.") and "beta2" in c]
seeds[["arm", "cell_id", "seed", *b2, *PROBES.values()]].sort_values(["arm", "seed"]).to_csv(
    out / "knobs_seeds.csv", index=False
)


def vals(arm, col):
    g = arms[arm]
    return dict(zip(g["seed"], g[col].astype(float)))


def md(frame):
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in r) + " |" for r in frame.itertuples(index=False)])


a16, b16, a256, b256 = list(arms)
same = {name: max(abs(vals(a256, c)[s] - vals(b256, c)[s]) for s in vals(a256, c)) for name, c in PROBES.items()}
means = []
for arm in arms:
    r = {"arm": arm}
    for name, col in PROBES.items():
        v = vals(arm, col)
        e = contrast([(1.0, v)])
        r[name] = f"{e.diff:.2f} [{e.lo:.2f}, {e.hi:.2f}] (n {len(v)})"
    means.append(r)
rows = []
for label, terms, subset in [
    ("beta2 rule at B=16: samples - none", [(1, b16), (-1, a16)], None),
    ("B=16 - B=256, beta2 none (the instrument's setting)", [(1, a16), (-1, a256)], None),
    ("B=16 - B=256, beta2 samples", [(1, b16), (-1, a256)], None),
    ("beta2 rule at B=16, seeds 0-3 (the first part)", [(1, b16), (-1, a16)], range(4)),
    ("beta2 rule at B=16, seeds 4-7 (new)", [(1, b16), (-1, a16)], range(4, 8)),
]:
    r = {"contrast": label}
    for name, col in PROBES.items():
        pick = [(c, {s: v for s, v in vals(arm, col).items() if subset is None or s in subset}) for c, arm in terms]
        e = contrast(pick)
        r[name] = f"{e.diff:+.2f} [{e.lo:+.2f}, {e.hi:+.2f}], p {e.p:.2g} (n {e.n})"
    rows.append(r)
text = "Top-1 (%) per arm: mean [95 % t interval over seeds]\n\n" + md(pd.DataFrame(means))
text += "\n\nB = 256 under both rules, largest |difference| over seeds (the rule is the identity there): " + ", ".join(
    f"{k} {v:.3g}" for k, v in same.items()
)
text += (
    "\n\nPaired contrasts over seeds (points, 95 % paired t, two-sided p, no correction)\n\n"
    + md(pd.DataFrame(rows))
    + "\n"
)
(out / "knobs_contrasts.md").write_text(text)
print(text)
