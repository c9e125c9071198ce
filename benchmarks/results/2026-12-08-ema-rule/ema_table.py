"""Tables of the EMA stage: per-seed values (csv) and paired contrasts (markdown), each with smallbatch's
own paired t (smallbatch.report.evidence.contrast), from the stores alone. The EMA store: InfoNCE with a MoCo
queue of 510 keys at B = 16 and B = 256, the key encoder's momentum 0.99 per step (none) or by the samples
rule (0.99^(B/256); at 256 the identity, so its two arms must agree run for run: checked here). The knobs
store (optional) holds the same cells without a queue (in-batch negatives, regime `adam`), same seeds: the
queue's contrasts against in-batch negatives pair across the two stores.

    python ema_table.py EMA_URI OUTDIR [KNOBS_URI]
"""

import sys
from pathlib import Path

import pandas as pd

import smallbatch
from smallbatch.report.evidence import contrast
from smallbatch.report.tables import markdown_table

PROBES = {"linear": "metrics.linear/top1", "kNN@20": "metrics.knn/top1_k20", "kNN@200": "metrics.knn/top1_k200"}


def load(uri):
    d = smallbatch.results(uri)
    d = d[(d["section"] == "regime") & (d["status"] == "finished")].copy()
    d["B"] = d["batch_size"].astype(int)
    d["seed"] = d["seed"].astype(int)
    return d


uri, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
d = load(uri)
arms = {
    "B=16, queue 510, momentum 0.99 (none)": d[(d.B == 16) & (d["params.regime"] == "adam")],
    "B=16, queue 510, momentum 0.99^(1/16) (samples)": d[(d.B == 16) & (d["params.regime"] == "adam_emasamples")],
    "B=256, queue 510, momentum 0.99 (none)": d[(d.B == 256) & (d["params.regime"] == "adam")],
    "B=256, queue 510, samples rule (the identity)": d[(d.B == 256) & (d["params.regime"] == "adam_emasamples")],
}
if len(sys.argv) > 3:
    k = load(sys.argv[3])
    arms["B=16, in-batch K 30 (knobs store)"] = k[(k.B == 16) & (k["params.regime"] == "adam")]
    arms["B=256, in-batch K 510 (knobs store)"] = k[(k.B == 256) & (k["params.regime"] == "adam")]
seeds = pd.concat([g.assign(arm=a) for a, g in arms.items()])
knobs = [c for c in seeds.columns if c.startswith("params.") and ("momentum" in c or "ema" in c or "queue" in c)]
seeds[["arm", "cell_id", "seed", *knobs, *PROBES.values()]].sort_values(["arm", "seed"]).to_csv(
    out / "ema_seeds.csv", index=False
)


def vals(arm, col):
    g = arms[arm]
    return dict(zip(g["seed"], g[col].astype(float)))


a16, b16, a256, b256 = list(arms)[:4]
same = {name: max(abs(vals(a256, c)[s] - vals(b256, c)[s]) for s in vals(a256, c)) for name, c in PROBES.items()}
means = []
for arm in arms:
    r = {"arm": arm}
    for name, col in PROBES.items():
        v = vals(arm, col)
        e = contrast([(1.0, v)])
        r[name] = f"{e.diff:.2f} [{e.lo:.2f}, {e.hi:.2f}] (n {len(v)})"
    means.append(r)
plan = [
    ("EMA rule at B=16: samples - none", [(1, b16), (-1, a16)]),
    ("B=16 - B=256, momentum per step (none)", [(1, a16), (-1, a256)]),
    ("B=16 - B=256, samples rule", [(1, b16), (-1, a256)]),
]
if len(arms) > 4:
    i16, i256 = list(arms)[4:]
    plan += [
        ("queue - in-batch at B=16 (K 510 - 30), none", [(1, a16), (-1, i16)]),
        ("queue - in-batch at B=256 (K 510 both), none", [(1, a256), (-1, i256)]),
        ("B=16 - B=256 in-batch (the knobs record's contrast)", [(1, i16), (-1, i256)]),
    ]
rows = []
for label, terms in plan:
    r = {"contrast": label}
    for name, col in PROBES.items():
        e = contrast([(c, vals(arm, col)) for c, arm in terms])
        r[name] = f"{e.diff:+.2f} [{e.lo:+.2f}, {e.hi:+.2f}], p {e.p:.2g} (n {e.n})"
    rows.append(r)
text = "Top-1 (%) per arm: mean [95 % t interval over seeds]\n\n" + markdown_table(pd.DataFrame(means))
text += "\n\nB = 256 under both rules, largest |difference| over seeds (the rule is the identity there): " + ", ".join(
    f"{k} {v:.3g}" for k, v in same.items()
)
text += (
    "\n\nPaired contrasts over seeds (points, 95 % paired t, two-sided p, no correction)\n\n"
    + markdown_table(pd.DataFrame(rows))
    + "\n"
)
(out / "ema_contrasts.md").write_text(text)
print(text)
