"""Tables of the lr-edge stage: per-seed values (csv), the rate grid per batch size and budget with
the validation-chosen rate (markdown), and paired contrasts over seeds with smallbatch's own paired t
(smallbatch.report.evidence.contrast), from the stage's MLflow store.

    python lr_table.py LR_URI OUTDIR
"""

import re
import sys
from pathlib import Path

import pandas as pd

import smallbatch
from smallbatch.report.evidence import contrast

PROBES = {"linear": "linear/top1", "kNN@20": "knn/top1_k20", "kNN@200": "knn/top1_k200"}
VAL = "linear/val_top1"
BUDGETS = {2: "snapshot/ep2/", 4: "snapshot/ep4/", 8: ""}

uri, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
d = smallbatch.results(uri)
d = d[(d["section"] == "instrument") & (d["status"] == "finished")].copy()
d["lr"] = d["cell_id"].map(lambda c: float(re.search(r"-lr([0-9.e-]+)$", c).group(1)))
d["B"] = d["batch_size"].astype(int)
d["seed"] = d["seed"].astype(int)
rows = []
for budget, pre in BUDGETS.items():
    for r in d.itertuples(index=False):
        row = {
            "B": r.B,
            "lr": r.lr,
            "seed": r.seed,
            "epochs": budget,
            "val_linear": float(d.loc[d.run_id == r.run_id, f"metrics.{pre}{VAL}"].iloc[0]),
        }
        for name, m in PROBES.items():
            row[name] = float(d.loc[d.run_id == r.run_id, f"metrics.{pre}{m}"].iloc[0])
        rows.append(row)
seeds = pd.DataFrame(rows).sort_values(["epochs", "B", "lr", "seed"])
seeds.to_csv(out / "lr_seeds.csv", index=False)


def md(frame):
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in r) + " |" for r in frame.itertuples(index=False)])


def vals(B, lr, ep, col):
    g = seeds[(seeds.B == B) & (seeds.lr == lr) & (seeds.epochs == ep)]
    return dict(zip(g["seed"], g[col]))


grid, chosen = [], {}
for ep in BUDGETS:
    for B in sorted(seeds.B.unique()):
        rates = sorted(seeds[seeds.B == B].lr.unique())
        means = {
            lr: seeds[(seeds.B == B) & (seeds.lr == lr) & (seeds.epochs == ep)][["val_linear", *PROBES]].mean()
            for lr in rates
        }
        best = max(rates, key=lambda lr: means[lr]["val_linear"])
        chosen[(B, ep)] = best
        edge = "top edge" if best == rates[-1] else "bottom edge" if best == rates[0] else "interior"
        r = {"epochs": ep, "B": B, "chosen (validation)": f"{best:g} ({edge})"}
        for col in ["val_linear", *PROBES]:
            r[col] = " / ".join(f"{means[lr][col]:.2f}" for lr in rates)
        r["rates"] = " / ".join(f"{lr:g}" for lr in rates)
        grid.append(r)
text = (
    "Mean top-1 (%) over seeds at each train.lr (the rate at 256; B = 16 trains at a quarter), "
    "the rate chosen by the linear probe's validation top-1\n\n" + md(pd.DataFrame(grid))
)
cons = []
for ep in BUDGETS:
    for label, terms in [
        ("B=16: 4e-3 - 2e-3", [(1, (16, 0.004)), (-1, (16, 0.002))]),
        ("B=16: 8e-3 - 2e-3", [(1, (16, 0.008)), (-1, (16, 0.002))]),
        ("B=256: 2e-3 - 1e-3", [(1, (256, 0.002)), (-1, (256, 0.001))]),
        ("B=256: 4e-3 - 1e-3", [(1, (256, 0.004)), (-1, (256, 0.001))]),
        ("B=16 - B=256, validated rates", [(1, (16, chosen[(16, ep)])), (-1, (256, chosen[(256, ep)]))]),
        ("B=16 - B=256, old grid's choice (2e-3, 1e-3)", [(1, (16, 0.002)), (-1, (256, 0.001))]),
    ]:
        r = {"epochs": ep, "contrast": label}
        for name in ["val_linear", *PROBES]:
            e = contrast([(c, vals(B, lr, ep, name)) for c, (B, lr) in terms])
            r[name] = f"{e.diff:+.2f} [{e.lo:+.2f}, {e.hi:+.2f}], p {e.p:.2g} (n {e.n})"
        cons.append(r)
text += (
    "\n\nPaired contrasts over seeds (points, 95 % paired t, two-sided p, no correction)\n\n"
    + md(pd.DataFrame(cons))
    + "\n"
)
(out / "lr_grid.md").write_text(text)
print(text)
