"""Tables of the knobs stage: per-seed values (csv) and paired contrasts (markdown), each with
smallbatch's own paired t (smallbatch.report.evidence.contrast), from two MLflow stores: the knobs
stage's (B = 16, regimes adam and adam_b2samples) and the K stage's (its plain B = 256 arm, K 510,
the same settings and seeds: the reference at which the beta2 rule is the identity).

    python knobs_table.py KNOBS_URI K_URI OUTDIR
"""

import sys
from pathlib import Path

import pandas as pd

import smallbatch
from smallbatch.report.evidence import contrast

PROBES = {"linear": "metrics.linear/top1", "kNN@20": "metrics.knn/top1_k20", "kNN@200": "metrics.knn/top1_k200"}

knobs_uri, k_uri, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
knobs = smallbatch.results(knobs_uri)
knobs = knobs[(knobs["section"] == "regime") & (knobs["status"] == "finished")]
ref = smallbatch.results(k_uri)
ref = ref[(ref["section"] == "kcurve") & (ref["status"] == "finished")]
ref = ref[ref["cell_id"].str.fullmatch(r"kcurve/fashion_mnist/infonce/bs256-t0\.1-s\d+")]
arms = {
    "B=16, beta2 0.999 (none)": knobs[knobs["params.regime"] == "adam"],
    "B=16, beta2 0.999^(1/16) (samples)": knobs[knobs["params.regime"] == "adam_b2samples"],
    "B=256, beta2 0.999 (K stage's plain arm)": ref,
}
seeds = pd.concat([g.assign(arm=a) for a, g in arms.items()])
cols = [
    "arm",
    "cell_id",
    "seed",
    *[c for c in seeds.columns if c.startswith("params.") and "beta2" in c],
    *PROBES.values(),
]
seeds[cols].sort_values(["arm", "seed"]).to_csv(out / "knobs_seeds.csv", index=False)


def vals(arm, col):
    g = arms[arm]
    return dict(zip(g["seed"].astype(int), g[col].astype(float)))


def md(frame):
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in r) + " |" for r in frame.itertuples(index=False)])


means = []
for arm in arms:
    r = {"arm": arm}
    for name, col in PROBES.items():
        v = vals(arm, col)
        e = contrast([(1.0, v)])
        r[name] = f"{e.diff:.2f} [{e.lo:.2f}, {e.hi:.2f}] (n {len(v)})"
    means.append(r)
a16, b16, a256 = list(arms)
rows = []
for label, terms in [
    ("beta2 rule at B=16: samples - none", [(1, b16), (-1, a16)]),
    ("B=16 - B=256, beta2 none (the instrument's setting)", [(1, a16), (-1, a256)]),
    ("B=16 - B=256, beta2 samples", [(1, b16), (-1, a256)]),
]:
    r = {"contrast": label}
    for name, col in PROBES.items():
        e = contrast([(c, vals(arm, col)) for c, arm in terms])
        r[name] = f"{e.diff:+.2f} [{e.lo:+.2f}, {e.hi:+.2f}], p {e.p:.2g} (n {e.n})"
    rows.append(r)
text = "Top-1 (%) per arm: mean [95 % t interval over seeds]\n\n" + md(pd.DataFrame(means))
text += (
    "\n\nPaired contrasts over seeds (points, 95 % paired t, two-sided p, no correction)\n\n"
    + md(pd.DataFrame(rows))
    + "\n"
)
(out / "knobs_contrasts.md").write_text(text)
print(text)
