"""Tables of a plateau stage from the report's per-seed values (instrument_seeds.csv): top-1 per arm,
budget and seed, and each seed's differences for the instrument's contrasts (small - large, points),
with their mean; and, where a pilot's table is given, whether the seeds it shares reproduce it.

    python plateau_table.py INSTRUMENT_SEEDS_CSV OUT_MD [PILOT_SEEDS_CSV]
"""

import sys
from pathlib import Path

import pandas as pd

from smallbatch.report.tables import markdown_table

PROBES = {"linear": "linear", "knn20": "kNN@20", "knn200": "kNN@200"}
ARMS = {  # (batch, group) -> label
    (256, None): "B=256, K=510",
    (256, 16): "B=256, K=30 (groups of 16)",
    (256, 2): "B=256, K=2 (control)",
    (16, None): "B=16, K=30",
}
CONTRASTS = [
    ("negatives: K 30 - 510 (B=256)", "B=256, K=30 (groups of 16)", "B=256, K=510"),
    ("control: K 2 - 510 (B=256)", "B=256, K=2 (control)", "B=256, K=510"),
    ("batch at fixed epochs: B 16 - 256", "B=16, K=30", "B=256, K=510"),
]


def load(path):
    d = pd.read_csv(path)
    d = d[(d["status"] == "finished") & d["probe"].isin(PROBES) & d["extra"].isna()].copy()
    d["arm"] = [ARMS.get((int(b), None if pd.isna(g) else int(g))) for b, g in zip(d["batch_size"], d["group"])]
    return d[d["arm"].notna() & (d["batch_size"].eq(256) | d["budget"].ne("steps"))]


d = load(sys.argv[1])
d = d[d["epochs"].isin([2, 4, 8, 16, 32, 64, 128])]
wide = d.pivot_table(index=["arm", "epochs", "seed"], columns="probe", values="value").rename(columns=PROBES)
wide = wide.reset_index().sort_values(["arm", "epochs", "seed"])
text = "## Top-1 (%) per arm, budget and seed\n\n" + markdown_table(wide.round(2))
rows = []
for label, a, b in CONTRASTS:
    for ep in sorted(d["epochs"].unique()):
        x = wide[(wide.arm == a) & (wide.epochs == ep)].set_index("seed")
        y = wide[(wide.arm == b) & (wide.epochs == ep)].set_index("seed")
        diff = (x[list(PROBES.values())] - y[list(PROBES.values())]).dropna()
        r = {"contrast": label, "epochs": ep}
        for p in PROBES.values():
            per = ", ".join(f"{v:+.2f}" for v in diff[p])
            r[p] = f"{diff[p].mean():+.2f} (seeds: {per})"
        rows.append(r)
text += "\n\n## Differences, small - large (points): mean over seeds (each seed's)\n\n" + markdown_table(
    pd.DataFrame(rows)
)
if len(sys.argv) > 3:
    pilot = load(sys.argv[3])
    pw = pilot.pivot_table(index=["arm", "epochs", "seed"], columns="probe", values="value").rename(columns=PROBES)
    both = wide.set_index(["arm", "epochs", "seed"]).join(pw.add_suffix("_pilot"), how="inner")
    worst = max((both[p] - both[p + "_pilot"]).abs().max() for p in PROBES.values())
    text += f"\n\nThe pilot's runs (same cells, seed 0): {len(both)} arm-budgets shared, largest |difference| {worst:.2g} points\n"
Path(sys.argv[2]).write_text(text + "\n")
print(text)
