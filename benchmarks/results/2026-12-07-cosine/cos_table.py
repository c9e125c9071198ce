"""Tables of the cosine stage: per-seed values (csv) and paired contrasts (markdown), each with
smallbatch's own paired t (smallbatch.report.evidence.contrast), from the stage's store alone: B = 16
(train.lr 2e-3) and B = 256 (1e-3) on the pairs at 8 epochs, each under a constant rate and a cosine
decay (two regimes of the regime side experiment).

    python cos_table.py COS_URI OUTDIR
"""

import sys
from pathlib import Path

import pandas as pd

import smallbatch
from smallbatch.report.evidence import contrast
from smallbatch.report.tables import markdown_table

PROBES = {
    "linear": "metrics.linear/top1",
    "kNN@20": "metrics.knn/top1_k20",
    "kNN@200": "metrics.knn/top1_k200",
}

uri, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
d = smallbatch.results(uri)
d = d[(d["section"] == "regime") & (d["status"] == "finished")].copy()
d["B"] = d["batch_size"].astype(int)
d["seed"] = d["seed"].astype(int)
arms = {
    f"B={b}, {sched}": d[(b == d.B) & (d["params.regime"] == sched)]
    for b in (16, 256)
    for sched in ("constant", "cosine")
}
seeds = pd.concat([g.assign(arm=a) for a, g in arms.items()])
cols = ["arm", "cell_id", "seed", "params.lr_schedule", "params.lr", *PROBES.values()]
seeds[[c for c in cols if c in seeds]].sort_values(["arm", "seed"]).to_csv(out / "cos_seeds.csv", index=False)


def vals(arm, col):
    g = arms[arm]
    return dict(zip(g["seed"], g[col].astype(float)))


c16, k16, c256, k256 = list(arms)
means = []
for arm in arms:
    r = {"arm": arm}
    for name, col in PROBES.items():
        v = vals(arm, col)
        e = contrast([(1.0, v)])
        r[name] = f"{e.diff:.2f} [{e.lo:.2f}, {e.hi:.2f}] (n {len(v)})"
    means.append(r)
rows = []
for label, terms in [
    ("B=16 - B=256, constant rate (the records' setting)", [(1, c16), (-1, c256)]),
    ("B=16 - B=256, cosine decay", [(1, k16), (-1, k256)]),
    ("cosine - constant at B=16", [(1, k16), (-1, c16)]),
    ("cosine - constant at B=256", [(1, k256), (-1, c256)]),
    ("interaction: (B=16 - B=256) cosine - constant", [(1, k16), (-1, k256), (-1, c16), (1, c256)]),
]:
    r = {"contrast": label}
    for name, col in PROBES.items():
        e = contrast([(c, vals(arm, col)) for c, arm in terms])
        r[name] = f"{e.diff:+.2f} [{e.lo:+.2f}, {e.hi:+.2f}], p {e.p:.2g} (n {e.n})"
    rows.append(r)
text = "Top-1 (%) per arm at 8 epochs: mean [95 % t interval over seeds]\n\n" + markdown_table(pd.DataFrame(means))
text += (
    "\n\nPaired contrasts over seeds (points, 95 % paired t, two-sided p, no correction)\n\n"
    + markdown_table(pd.DataFrame(rows))
    + "\n"
)
(out / "cos_contrasts.md").write_text(text)
print(text)
