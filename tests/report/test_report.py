"""The report rebuilt from a real (SQLite) MLflow store with designed synthetic values.

The fixture logs runs exactly per the tracking schema (tags smallbatch.*, dotted
params, per-step diag/* histories, final knn/linear metrics in percent), then the
test recomputes every checked number independently from the designed values.
"""

from __future__ import annotations

import math
import re
import time
from itertools import takewhile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from report_store import StoreBuilder
from scipy import stats

from smallbatch import report
from smallbatch.losses import display_name
from smallbatch.report.figures import fraction_done
from smallbatch.report.sections import grid_findings

ALL_LOSSES = ("infonce", "flatnce", "dcl")


def _acc(loss: str, bs: int, t: float, seed: int, metric: str, slopes: dict[str, float]) -> float:
    """Designed top-1 (%): linear in log2(batch size) with a per-loss slope, seed noise that differs between
    losses and batch sizes (so seed-paired differences have a spread to test)."""
    base = {"infonce": 80.0, "flatnce": 78.0, "dcl": 79.0, "eqco": 77.0}[loss]
    val = base - slopes[loss] * math.log2(256 / bs) - (3.0 if metric == "knn" else 0.0) - 4.0 * (t - 0.1)
    rank = {"infonce": 0, "flatnce": 1, "dcl": 2, "eqco": 3, "dclw": 4}[loss]
    return val + (0.4 if seed == 0 else -0.3) + 0.05 * seed * ((bs * (rank + 1)) % 7)


def _cell_params(dataset: str, loss: str, bs: int, t: float, seed: int) -> dict:
    return {
        "dataset": dataset,
        "loss": loss,
        "batch_size": bs,
        "temperature": t,
        "seed": seed,
        "negatives": 2 * bs - 2,
        "precision": "fp32",
        "lr_scaling": "sqrt",
        "epochs": 20,
        "backbone": "small_cnn",
        "queue_size": 0,
        "image_size": 8,
        "pretrain_images": 1437,
        "loss.sigma": 0.5 if loss == "dclw" else None,
    }


def _history(loss: str, bs: int, seed: int, steps: int = 12) -> dict:
    k = 2 * bs - 2
    x = np.linspace(0, 1, steps)
    return {
        "train/loss": np.log(k + 1) * (1 - 0.5 * x),
        "diag/mi_fraction": np.clip(0.2 + 0.7 * x * (1 + 0.1 * seed) * (64 / bs) ** 0.3, 0, 1),
        "diag/qb_mean": 1 - 0.5 * (16 / bs) ** 0.5 * (0.5 + 0.5 * x) + 0.01 * seed,
        "diag/ess": k * (0.2 + 0.5 * x) + seed,
        "epoch": 20 * x,
    }


def build_grid(
    b: StoreBuilder,
    dataset: str,
    losses,
    bss,
    temps,
    seeds,
    slopes,
    *,
    diverged: set = frozenset(),
    skip_linear: set = frozenset(),
    history: bool = True,
) -> list[dict]:
    """Grid runs; returns the designed values [{loss, bs, t, seed, status, knn, linear}]."""
    design = []
    for loss in losses:
        for bs in bss:
            for t in temps:
                for seed in seeds:
                    cid = f"{dataset}/{loss}/bs{bs}-t{t:g}-s{seed}"
                    status = "diverged" if (loss, bs, t, seed) in diverged else "finished"
                    final = {"train/final_loss": 1.0, "train/wall_s": 3.0}
                    vals = {m: _acc(loss, bs, t, seed, m, slopes) for m in ("knn", "linear")}
                    if status == "finished":
                        final["knn/top1"] = vals["knn"]
                        if (loss, bs, t, seed) not in skip_linear:
                            final["linear/top1"] = vals["linear"]
                        else:
                            vals["linear"] = math.nan
                    else:
                        vals = {"knn": math.nan, "linear": math.nan}
                    b.run(
                        cid,
                        status=status,
                        params=_cell_params(dataset, loss, bs, t, seed),
                        final=final,
                        history=_history(loss, bs, seed) if history else None,
                    )
                    design.append({"loss": loss, "bs": bs, "t": t, "seed": seed, "status": status, **vals})
    return design


STEEP = {"infonce": 2.5, "flatnce": 0.0, "dcl": 1.0, "eqco": 1.0}
FLIPPED = {"infonce": 0.0, "flatnce": 2.5, "dcl": 1.0, "eqco": 1.0}


@pytest.fixture(scope="module")
def main_store(store_uri, tmp_path_factory):
    uri = store_uri
    d = tmp_path_factory.mktemp("main")
    b = StoreBuilder(uri)
    # an older run of a cell that a newer run supersedes (changed config): must not count
    b.run(
        "digits/infonce/bs16-t0.1-s0",
        params=_cell_params("digits", "infonce", 16, 0.1, 0),
        final={"knn/top1": 1.0, "linear/top1": 1.0},
    )
    diverged = {("dcl", 16, 0.5, 0), ("dcl", 16, 0.5, 1), ("infonce", 64, 0.5, 1)}
    design = build_grid(b, "digits", ALL_LOSSES, (16, 64, 256), (0.1, 0.5), (0, 1), STEEP, diverged=diverged)
    # EqCo: one seed, two batch sizes, linear probe not run yet at batch 256
    design += build_grid(b, "digits", ("eqco",), (16, 256), (0.1,), (0,), STEEP, skip_linear={("eqco", 256, 0.1, 0)})
    base = {("raw_pixels", 0): (71.0, 74.0), ("random_init", 0): (60.0, 76.5), ("random_init", 1): (61.0, 75.5)}
    for (name, seed), (knn, lin) in base.items():
        b.run(
            f"baselines/digits/{name}-s{seed}",
            kind="baseline",
            section="baseline",
            baseline=name,
            params={"dataset": "digits", "baseline": name, "seed": seed},
            final={"knn/top1": knn, "linear/top1": lin},
        )
    b.run("mi/gauss-k16", kind="mi", section="mi", params={"k": 16}, final={"mi/true": 1.0})
    b.run(
        "custom/digits/infonce/bs16-t0.1-s0-fp64",
        section="custom",
        params={**_cell_params("digits", "infonce", 16, 0.1, 0), "precision": "fp64"},
        final={"knn/top1": 50.0},
    )
    out = d / "report"
    t0 = time.perf_counter()
    index = report.build_report(uri, out, experiment="smallbatch")
    seconds = time.perf_counter() - t0
    print(f"\nreport build: {seconds:.2f} s for {len(b.logged)} runs")
    return {"uri": uri, "out": out, "index": index, "design": pd.DataFrame(design), "base": base, "seconds": seconds}


def _expected(design: pd.DataFrame, metric: str) -> pd.DataFrame:
    g = design[design["status"] == "finished"].dropna(subset=[metric])
    return g.groupby(["loss", "t", "bs"])[metric].agg(
        mean="mean", std=lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else math.nan, n="count"
    )


def test_files_exist_and_index_links_resolve(main_store):
    out, index = main_store["out"], main_store["index"]
    assert index == out / "index.md"
    text = index.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links
    for link in links:
        p = out / link
        assert p.is_file() and p.stat().st_size > 0, link
    produced = sorted(p for sub in ("tables", "figures") for p in (out / sub).iterdir())
    linked = {(out / link).resolve() for link in links}
    for p in produced:
        assert p.stat().st_size > 0, p
        assert p.resolve() in linked, f"{p} is not linked from index.md"
    names = {p.name for p in produced}
    for stem in ("accuracy_vs_batch_digits", "mi_fraction_digits", "qb_digits", "ess_digits"):
        assert {f"{stem}.png", f"{stem}.svg"} <= names
    for m in ("knn", "linear"):
        for kind in ("top1", "temperature", "dependence", "gain"):
            assert {f"grid_{kind}_digits_{m}.{e}" for e in ("csv", "md", "tex")} <= names
    assert {"baselines.csv", "diverged_runs.csv", "papers_reported.csv", "papers_vs_ours_gap.csv"} <= names


@pytest.mark.parametrize("metric", ["knn", "linear"])
def test_main_table_reproduces_designed_values(main_store, metric):
    got = pd.read_csv(main_store["out"] / "tables" / f"grid_top1_digits_{metric}.csv")
    exp = _expected(main_store["design"], metric)
    got_ok = got[got["n_seeds"] > 0].set_index(["loss", "temperature", "batch_size"])
    assert len(got_ok) == len(exp)
    for (loss, t, bs), row in exp.iterrows():
        g = got_ok.loc[(loss, t, bs)]
        assert g["mean"] == pytest.approx(row["mean"], rel=1e-6)  # the CSV keeps 7 significant digits
        assert g["n_seeds"] == row["n"]
        if row["n"] > 1:
            assert g["std"] == pytest.approx(row["std"], rel=1e-6)
        else:
            assert math.isnan(g["std"]) and "± —" in g["display"]
    # the superseded run (top-1 1.0) does not count: newest run per cell id
    assert got_ok.loc[("infonce", 0.1, 16), "n_seeds"] == 2
    states = got.set_index(["loss", "temperature", "batch_size"])["display"]
    assert states[("dcl", 0.5, 16)] == "diverged"
    assert states[("infonce", 0.5, 64)].endswith("(1/2 diverged)")
    if metric == "linear":
        assert states[("eqco", 0.1, 256)] == "pending"
    md = (main_store["out"] / "tables" / f"grid_top1_digits_{metric}.md").read_text()
    assert "diverged" in md and "± —" in md
    tex = (main_store["out"] / "tables" / f"grid_top1_digits_{metric}.tex").read_text()
    assert r"\begin{tabular}" in tex and r"$\pm$" in tex and "diverged" in tex


def test_dependence_table_and_gain(main_store):
    exp = _expected(main_store["design"], "linear")["mean"]
    dep = pd.read_csv(main_store["out"] / "tables" / "grid_dependence_digits_linear.csv")
    row = dep[(dep["loss"] == "infonce") & (dep["temperature"] == 0.1)].iloc[0]
    best = max(exp[("infonce", 0.1, b)] for b in (16, 64, 256))
    assert row["best_mean"] == pytest.approx(best)
    assert row["drop_bs16"] == pytest.approx(best - exp[("infonce", 0.1, 16)])
    assert row["change_small_minus_large"] == pytest.approx(exp[("infonce", 0.1, 16)] - exp[("infonce", 0.1, 256)])
    # its test recomputed: seed-paired differences, Student t, Holm over the losses of τ = 0.1 with a test
    d = main_store["design"].set_index(["loss", "t", "bs", "seed"])["linear"]
    p_raw = {}
    for loss in ALL_LOSSES:
        diffs = [d[(loss, 0.1, 16, s)] - d[(loss, 0.1, 256, s)] for s in (0, 1)]
        p_raw[loss] = stats.ttest_1samp(diffs, 0.0).pvalue
        if loss == "infonce":
            h = stats.t.ppf(0.975, 1) * np.std(diffs, ddof=1) / math.sqrt(2)
            assert (row["ci_low"], row["ci_high"]) == pytest.approx((np.mean(diffs) - h, np.mean(diffs) + h))
    order = sorted(p_raw, key=p_raw.get)
    holm = np.maximum.accumulate([min(1.0, (3 - i) * p_raw[k]) for i, k in enumerate(order)])
    assert row["p_holm"] == pytest.approx(holm[order.index("infonce")]) and row["holm_family"] == 3
    assert row["test"] == "paired t" and row["n_pairs"] == 2
    md = (main_store["out"] / "tables" / "grid_dependence_digits_linear.md").read_text()
    assert "diverged" in md  # DCL at batch 16, tau 0.5
    # gain over the best baseline (linear: raw_pixels 74.0 vs random_init mean 76.0 -> random_init)
    gain = pd.read_csv(main_store["out"] / "tables" / "grid_gain_digits_linear.csv")
    g = gain[(gain["loss"] == "flatnce") & (gain["temperature"] == 0.5) & (gain["batch_size"] == 64)].iloc[0]
    assert g["best_baseline"] == "random_init"
    assert g["gain_vs_best_baseline"] == pytest.approx(exp[("flatnce", 0.5, 64)] - 76.0)
    base = pd.read_csv(main_store["out"] / "tables" / "baselines.csv")
    ri = base[(base["baseline"] == "random_init") & (base["metric"] == "knn")].iloc[0]
    assert ri["mean"] == pytest.approx(60.5) and ri["std"] == pytest.approx(np.std([60, 61], ddof=1))


def test_temperature_table_marks_best_temperature(main_store):
    md = (main_store["out"] / "tables" / "grid_temperature_digits_linear.md").read_text()
    exp = _expected(main_store["design"], "linear")["mean"]
    # designed: tau 0.1 beats 0.5 by 1.6 points everywhere both have values
    v = exp[("flatnce", 0.1, 64)]
    assert f"{v:.1f} ± " in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| FlatNCE | 0.1"))
    assert line.count(" *") == 3


def _batch_finding(text: str, head: str) -> list[str]:
    """The lines of the finding (a list item of index.md) whose first line starts with ``head``."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(f"- {head}"))
    return [lines[i]] + list(takewhile(lambda ln: not ln.startswith(("- ", "#")), lines[i + 1 :]))


def test_findings_name_the_least_dependent_loss(main_store):
    text = main_store["index"].read_text()
    for t in ("0.1", "0.5"):
        block = _batch_finding(text, f"On digits at τ = {t}, pooled over ")
        for m in ("kNN top-1", "linear top-1"):
            para = next(ln for ln in block if ln.startswith(f"  {m}: "))
            assert "**InfoNCE** depends" in para and "**FlatNCE** least" in para, para
    block = _batch_finding(text, "On digits at τ = 0.1, pooled over ")
    lin01 = next(ln for ln in block if ln.startswith("  linear top-1: "))
    assert "**InfoNCE** depends most on batch size" in lin01 and "(paired t, 2 seeds, Holm p = " in lin01
    assert "EqCo is left out of the ranking (batch 16: ok, batch 256: pending)" in lin01
    # the table: each loss's change with its interval, the linear probe in the fourth column
    exp = _expected(main_store["design"], "linear")["mean"]
    row = next(ln for ln in block if ln.startswith("  | InfoNCE |")).split("|")
    assert row[4].strip().startswith(f"{exp[('infonce', 0.1, 16)] - exp[('infonce', 0.1, 256)]:+.1f} [")
    # the headline names the steps: 20 epochs of 1,437 images, 90 steps each at batch 16, 6 at 256
    assert "at a fixed 20 epochs batch 16 took 15.0× the optimiser steps of batch 256 (1,800 against 120)" in block[0]
    block05 = _batch_finding(text, "On digits at τ = 0.5, pooled over ")
    lin05 = next(ln for ln in block05 if ln.startswith("  linear top-1: "))
    assert "**DCL** depends most on batch size: it diverged at batch 16" in lin05
    assert "**InfoNCE** depends more on batch size and **FlatNCE** least" in lin05
    assert "| DCL | diverged |" in "\n".join(block05)

    # baseline comparison counted independently (diverged and pending cells count as not beating)
    exp_all = _expected(main_store["design"], "linear")
    n_cells = len(main_store["design"].groupby(["loss", "t", "bs"]))
    beat = int((exp_all["mean"] > 76.0).sum())
    line = next(ln for ln in text.splitlines() if "grid cells have a mean above the best baseline's linear" in ln)
    assert line.startswith(
        f"- On digits, {beat} of {n_cells} grid cells have a mean above the best baseline's "
        "linear top-1 (random_init, 76.0%)"
    )
    # each cell tested against random_init's seeds (paired by seed), Holm over the tested cells
    base = {0: 76.5, 1: 75.5}
    d = main_store["design"].dropna(subset=["linear"]).groupby(["loss", "t", "bs"])
    ps, ds = [], []
    for _, g in d:
        diffs = [v - base[s] for s, v in zip(g["seed"], g["linear"])]
        if len(diffs) == 2 and np.std(diffs) > 0:
            ps.append(stats.ttest_1samp(diffs, 0.0).pvalue)
            ds.append(np.mean(diffs))
    order = np.argsort(ps)
    adj = np.maximum.accumulate([min(1.0, (len(ps) - i) * ps[j]) for i, j in enumerate(order)])
    up = sum(1 for a, j in zip(adj, order) if a < 0.05 and ds[j] > 0)
    assert f"(cell − baseline, paired t by seed, Holm over {len(ps)} cells), {up} are significantly above" in line
    assert "diverged" in text and "| diverged |" in (main_store["out"] / "tables" / "diverged_runs.md").read_text()
    # runs of other study sections are counted, not dropped silently
    assert "of experiment 'mi' (kind 'mi')" in text and "of experiment 'custom' (kind 'cell')" in text
    assert "superseded" in text


def test_the_pooled_change_is_the_hand_computed_loss_and_seed_model(main_store):
    """linear top-1 at τ = 0.1: InfoNCE, FlatNCE and DCL at both batch sizes with 2 seeds (EqCo is pending at
    256): d = small − large per loss and seed, d = μ + loss + seed + ε, μ = the mean of the 6 differences,
    σ² = Σ (d − loss mean − seed mean + grand mean)² / ((3 − 1)(2 − 1))."""
    d = main_store["design"].set_index(["loss", "t", "bs", "seed"])["linear"]
    diffs = {(loss, s): d[(loss, 0.1, 16, s)] - d[(loss, 0.1, 256, s)] for loss in ALL_LOSSES for s in (0, 1)}
    grand = np.mean(list(diffs.values()))
    by_loss = {g: np.mean([diffs[(g, s)] for s in (0, 1)]) for g in ALL_LOSSES}
    by_seed = {s: np.mean([diffs[(g, s)] for g in ALL_LOSSES]) for s in (0, 1)}
    sse = sum((v - by_loss[g] - by_seed[s] + grand) ** 2 for (g, s), v in diffs.items())
    se = math.sqrt(sse / 2 / 6)
    pool = pd.read_csv(main_store["out"] / "tables" / "grid_pooled_digits.csv")
    row = pool[(pool["metric"] == "linear") & (pool["temperature"] == 0.1)].iloc[0]
    assert row["losses"] == 3 and row["n_pairs"] == 6 and row["df"] == 2 and row["left_out"] == "EqCo"
    assert row["change_small_minus_large"] == pytest.approx(grand, abs=1e-5)
    h = stats.t.ppf(0.975, 2) * se
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((grand - h, grand + h), abs=1e-5)
    assert row["p"] == pytest.approx(2 * stats.t.sf(abs(grand) / se, 2), rel=1e-5)
    # Holm over the dataset's 4 pooled tests (2 metrics x 2 τ)
    ps = pool["p"].sort_values().to_numpy()
    adj = np.maximum.accumulate([min(1.0, (len(ps) - i) * p) for i, p in enumerate(ps)])
    assert row["p_holm"] == pytest.approx(adj[list(ps).index(row["p"])], rel=1e-5) and row["holm_family"] == 4
    md = (main_store["out"] / "tables" / "grid_pooled_digits.md").read_text()
    assert "additive effect of the loss and one of the seed" in md and "independent given loss and seed" in md


def test_default_experiment_and_training_fraction(main_store):
    from smallbatch.tracking import StoreReader

    assert StoreReader(main_store["uri"]).experiment(None)[1] == "smallbatch"
    runs = pd.DataFrame({"metrics.epoch": [10.0, 20.0, math.nan, 5.0], "params.epochs": ["20", "20", "20", None]})
    assert fraction_done(runs).tolist() == [0.5, 1.0, 1.0, 1.0]


def test_diverged_runs_listed(main_store):
    d = pd.read_csv(main_store["out"] / "tables" / "diverged_runs.csv")
    assert sorted(d["cell_id"]) == ["digits/dcl/bs16-t0.5-s0", "digits/dcl/bs16-t0.5-s1", "digits/infonce/bs64-t0.5-s1"]
    assert set(d["status"]) == {"diverged"}


def test_paper_tables_carry_sources_status_and_note(main_store):
    out = main_store["out"] / "tables"
    src = pd.read_csv(Path(report.__file__).parent.parent / "resources" / "paper_results.csv")
    rep = pd.read_csv(out / "papers_reported.csv")
    assert len(rep) == len(src)
    assert {"paper", "source", "status", "note", "paper_note", "value"} <= set(rep.columns)
    assert (rep["source"] == src["source"]).all()
    # one plain status per row; the CSV's qualifications kept as a stated fact in status_note
    assert set(rep["status"]) <= {
        "checked against the source",
        "derived from the source",
        "third-party number",
        "checked against the authors' code README",
        "unconfirmed",
    }
    likely = src["status"].str.contains("likely")
    assert (rep.loc[likely, "status_note"] == "the source does not state the batch size; 256 is assumed").all()
    assert rep.loc[src["status"] == "third-party", "produced_by"].str.startswith("third-party").all()
    assert rep["note"].str.contains("differ from ours").all()
    assert rep["note"].str.contains("digits, small_cnn, 20 epochs").all()
    md = (out / "papers_reported.md").read_text()
    assert md.count("> Note:") == 1 and "differ from ours" in md
    for paper in src["paper"].unique():
        assert f"## {paper}" in md
    tex = (out / "papers_reported.tex").read_text()
    assert r"\caption{" in tex and "differ from ours" in tex
    side = pd.read_csv(out / "papers_vs_ours_gap.csv")
    assert side["note"].str.contains("differ from ours").all()
    # SimCLR Table B.1, 100 epochs, linear lr scaling: 256 -> 8192 recomputed from the CSV
    q = src[
        (src["method"] == "SimCLR (NT-Xent)") & (src["epochs"] == 100) & (src["lr_scaling"] == "linear: lr=0.3*bs/256")
    ]
    expected_gap = q.loc[q["batch_size"].idxmin(), "value"] - q.loc[q["batch_size"].idxmax(), "value"]
    simclr = side[
        (side["who"] == "paper")
        & (side["method"] == "SimCLR (NT-Xent)")
        & (side["epochs"].astype(str) == "100")
        & (side["lr_scaling"] == "linear: lr=0.3*bs/256")
    ]
    assert len(simclr) == 1 and simclr["gap_small_minus_large"].iloc[0] == pytest.approx(expected_gap)
    assert simclr["family"].iloc[0] == "infonce" and simclr["status"].iloc[0] == "checked against the source"
    assert simclr["produced_by"].iloc[0] == "paper table (Table B.1 (= Figure 9))"
    # a third-party reproduction is labelled as one, never as the paper's number
    third = side[side["source"].astype(str).str.startswith("third-party reproduction")]
    assert (
        len(third)
        and (third["produced_by"] == "third-party reproduction (raminnakhli/Decoupled-Contrastive-Learning)").all()
    )
    assert (third["status"] == "third-party number").all()
    # SimCo's README table (CIFAR-100, B = 64 ... 1024): the authors' code README, its family from the method
    simco = rep[rep["paper"] == "SimCo (Zhang et al. 2022)"]
    assert len(simco) == 15 and (simco["produced_by"] == "the authors' code README").all()
    assert (simco["status"] == "checked against the authors' code README").all()
    dual = side[(side["who"] == "paper") & (side["method"] == "SimCo")]
    assert len(dual) == 1 and dual["family"].iloc[0] == "simco"
    assert dual["gap_small_minus_large"].iloc[0] == pytest.approx(58.04 - 55.34)
    assert not side["status"].astype(str).str.contains("likely").any()
    exp = _expected(main_store["design"], "linear")["mean"]
    ours = side[
        (side["who"] == "ours")
        & (side["family"] == "flatnce")
        & (side["temperature"] == 0.1)
        & (side["metric"] == "linear top-1")
    ]
    assert ours["gap_small_minus_large"].iloc[0] == pytest.approx(
        exp[("flatnce", 0.1, 16)] - exp[("flatnce", 0.1, 256)]
    )
    assert ours["gap_ci_low"].iloc[0] < ours["gap_small_minus_large"].iloc[0] < ours["gap_ci_high"].iloc[0]
    assert set(side[side["who"] == "paper"]["family"]) >= {"infonce", "dcl", "dclw"}
    gap_md = (out / "papers_vs_ours_gap.md").read_text()
    assert "> Note:" in gap_md and "## DCL" in gap_md and "small − large; negative: the small batch is behind" in gap_md
    assert "large − small" not in gap_md


def test_flipped_data_flips_the_finding(store_uri, tmp_path, monkeypatch):
    """Same design with InfoNCE flat and FlatNCE steep: the sentence follows the data.

    Also: a temperature with a single batch size and a single seed.
    """
    uri = store_uri
    b = StoreBuilder(uri, experiment="flipped")
    # no per-step histories here: the history figures are skipped, and index.md says so
    build_grid(b, "digits", ALL_LOSSES, (32, 128), (0.1,), (0, 1), FLIPPED, history=False)
    build_grid(b, "digits", ("infonce", "flatnce"), (32,), (0.2,), (0,), FLIPPED, history=False)
    b.run(
        "custom/digits/infonce/bs32-t0.1-s0-fp64",
        section="custom",
        params={**_cell_params("digits", "infonce", 32, 0.1, 0), "precision": "fp64"},
        final={"knn/top1": 50.0},
    )
    index = report.build_report(uri, tmp_path / "rep", experiment="flipped")
    text = index.read_text()
    assert "1 of experiment 'custom' (kind 'cell')" in text
    assert "no `diag/mi_fraction` history for InfoNCE runs; MI-saturation figure skipped" in text
    assert (tmp_path / "rep" / "figures" / "accuracy_vs_batch_digits.png").stat().st_size > 0
    block = _batch_finding(text, "On digits at τ = 0.1, pooled over 3 losses, batch 32 − batch 128 = ")
    para = next(ln for ln in block if ln.startswith("  linear top-1: "))
    assert "**FlatNCE** depends most on batch size and **InfoNCE** least" in para, para
    assert "On digits at τ = 0.2 only batch size 32 was run" in text
    assert "no baseline" in text
    got = pd.read_csv(tmp_path / "rep" / "tables" / "grid_top1_digits_linear.csv")
    single = got[got["temperature"] == 0.2]
    assert single["std"].isna().all() and single["display"].str.endswith("± —").all()
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (tmp_path / "rep" / link).is_file(), link
    # a section registered by another module reports the 'custom' runs; the rebuild into the
    # same folder reproduces every earlier table byte for byte
    before = {p.name: p.read_bytes() for p in (tmp_path / "rep" / "tables").iterdir()}

    def precision_section(runs: pd.DataFrame, ctx: report.ReportContext) -> report.SectionOutput:
        r = runs[runs["section"] == "custom"]
        agg = report.aggregate_cells(r, ["loss", "batch_size", "params.precision"], ctx.scale)
        files = ctx.write_table("precision", "Precision", agg)
        return report.SectionOutput(
            "precision",
            "Precision study",
            ctx.table_links(files),
            files,
            [f"{len(r)} precision run(s)."],
            set(r["run_id"]),
        )

    monkeypatch.setattr(report, "SECTIONS", [*report.SECTIONS, precision_section])
    report.build_report(uri, tmp_path / "rep", experiment="flipped")
    after = {p.name: p.read_bytes() for p in (tmp_path / "rep" / "tables").iterdir()}
    assert set(after) == set(before) | {"precision.csv", "precision.md", "precision.tex"}
    assert {k: after[k] for k in before} == before
    text2 = index.read_text()
    assert "## Precision study" in text2 and "- 1 precision run(s)." in text2
    assert "of experiment 'custom'" not in text2
    prec = pd.read_csv(tmp_path / "rep" / "tables" / "precision.csv").set_index("metric")
    assert prec.loc["knn", "mean"] == 50.0 and prec.loc["linear", "state"] == "pending"


def test_empty_or_missing_experiment_is_a_clear_error(store_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=store_uri).create_experiment("empty", tags={"smallbatch.format": "2"})
    with pytest.raises(ValueError, match=r"no runs in experiment 'empty' at URI 'sqlite:///.*mlflow\.db'$"):
        report.build_report(store_uri, tmp_path / "rep", experiment="empty")
    with pytest.raises(ValueError, match=r"no runs in experiment 'nope' at URI .*available: Default, empty"):
        report.build_report(store_uri, tmp_path / "rep", experiment="nope")
    assert not (tmp_path / "rep").exists()


def test_bad_paper_csv_names_missing_columns(tmp_path):
    p = tmp_path / "papers.csv"
    p.write_text("paper,value\nX,1\n")
    with pytest.raises(ValueError, match="paper_csv lacks column.*source"):
        report.load_papers(p)


def test_tex_and_markdown_escaping():
    assert report.tex_escape("a_b & 50% ± —") == r"a\_b \& 50\% $\pm$ ---"
    md = report.markdown_table(pd.DataFrame({"x": ["a|b"], "B=16": ["1.0 ± —"]}))
    assert "a\\|b" in md and "---:" in md


def _synthetic_runs(values: dict[tuple[str, int], list[float]]) -> pd.DataFrame:
    """Run rows as load_runs returns them, without a store: {(loss, bs): [linear top-1 per seed]}."""
    rows = []
    for (loss, bs), vals in values.items():
        for seed, v in enumerate(vals):
            rows.append(
                {
                    "run_id": f"{loss}{bs}{seed}",
                    "status": "finished",
                    "dataset": "d",
                    "loss": loss,
                    "label": display_name(loss),
                    "batch_size": bs,
                    "temperature": 0.1,
                    "seed": seed,
                    "metrics.linear/top1": v,
                }
            )
    return pd.DataFrame(rows)


def _sentence(values) -> str:
    agg = report.aggregate_cells(
        _synthetic_runs(values),
        ["dataset", "temperature", "loss", "label", "batch_size"],
        1.0,
        {"linear": "linear/top1"},
        values=True,
    )
    dep = grid_findings.dependence(agg)
    return grid_findings.batch_finding(dep, grid_findings.pooled_changes(dep), "d", 0.1)


def test_finding_sentence_ranks_only_with_a_test():
    # equal changes: no ranking, the largest pair is called indistinguishable with its MDE
    tie = _sentence(
        {
            ("infonce", 16): [70.0, 72.0, 71.0],
            ("infonce", 64): [75.0, 77.0, 75.5],
            ("flatnce", 16): [60.0, 62.0, 61.2],
            ("flatnce", 64): [65.0, 67.0, 66.5],
        }
    )
    assert "**" not in tie and "indistinguishable at these seeds" in tie and "MDE at 80 % power = " in tie
    assert "| InfoNCE | -4.8 [" in tie and "| FlatNCE | -5.1 [" in tie and "|Δ FlatNCE| − |Δ InfoNCE| = +0.3 [" in tie
    # the small batch ahead: a positive Δ, the same sign convention (small − large)
    small_best = _sentence(
        {
            ("infonce", 16): [75.0, 77.0, 76.0],
            ("infonce", 64): [70.0, 72.0, 71.5],
            ("flatnce", 16): [65.0, 67.0, 66.0],
            ("flatnce", 64): [64.0, 66.0, 64.6],
        }
    )
    assert "| InfoNCE | +4.8 [" in small_best and "| FlatNCE | +1.1 [" in small_best
    # FlatNCE −1.0, DCL −1.5, InfoNCE −5.0 with little seed noise in the changes: a ranking with its test
    clear = _sentence(
        {
            ("infonce", 16): [68.0, 72.0, 70.1],
            ("infonce", 64): [73.0, 77.0, 75.3],
            ("flatnce", 16): [67.0, 71.0, 69.1],
            ("flatnce", 64): [68.0, 72.0, 70.0],
            ("dcl", 16): [66.5, 70.5, 68.6],
            ("dcl", 64): [68.0, 72.0, 70.0],
        }
    )
    assert "**InfoNCE** depends most on batch size and **FlatNCE** least" in clear
    assert "|Δ InfoNCE| − |Δ FlatNCE| = +4.1 [" in clear and "(paired t, 3 seeds, Holm p = " in clear
    # the same means with noisy seed differences: not ranked
    noisy = _sentence(
        {
            ("infonce", 16): [68.0, 72.0, 70.0],
            ("infonce", 64): [71.0, 79.0, 75.0],
            ("flatnce", 16): [67.0, 71.0, 69.0],
            ("flatnce", 64): [70.0, 70.0, 70.0],
            ("dcl", 16): [66.5, 70.5, 68.5],
            ("dcl", 64): [68.0, 72.0, 70.0],
        }
    )
    assert "**" not in noisy and "indistinguishable at these seeds" in noisy and "MDE at 80 % power" in noisy
    # one seed: nothing is tested, nothing ranked
    one = _sentence(
        {("infonce", 16): [68.0], ("infonce", 64): [73.0], ("flatnce", 16): [67.0], ("flatnce", 64): [68.0]}
    )
    assert "cannot be ranked" in one and "(one seed: no test, no interval, no p)" in one and "**" not in one


def test_one_seed_says_it_gives_no_test_and_prints_no_interval():
    # two losses at two batch sizes, one seed each: the pooled change has two pairs but one seed
    one = _sentence(
        {("infonce", 16): [68.0], ("infonce", 64): [73.0], ("flatnce", 16): [67.0], ("flatnce", 64): [68.0]}
    )
    head = one.splitlines()[0]
    assert head == (
        "On d at τ = 0.1, pooled over 2 losses, batch 16 − batch 64 = -3.00 (one seed: no test, no interval, no p) "
        "by linear top-1."
    )
    assert "identical" not in one and "[" not in one.replace("[95 % CI]", "") and "p =" not in one


def test_numbers_are_rounded_once_without_negative_zero_or_float_noise():
    from smallbatch.report import fmt, tables

    assert fmt.signed(-0.04) == "+0.0" and fmt.num(-0.04) == "0.0" and fmt.signed(-0.06) == "-0.1"
    assert fmt.num(86.94999814) == "86.9" and fmt.signed(2.25, 2) == "+2.25" and fmt.num(1234.5) == "1.23e+03"
    assert (
        fmt.csv_number(86.94999814) == "86.95" and fmt.csv_number(-0.0) == "0" and fmt.csv_number(1.99e-7) == "1.99e-07"
    )
    # the CSV writer and the Markdown/LaTeX cells use the same rule
    assert tables.cell_text(86.94999814) == "86.95" and tables.cell_text(-0.0) == "0"
    frame = pd.DataFrame({"x": [86.94999814, -0.0, 77.2]})
    assert tables.markdown_table(frame).splitlines()[2:] == ["| 86.95 |", "| 0 |", "| 77.2 |"]


def test_the_knn_headline_label_names_the_k_it_was_read_at():
    """kNN top-1 is read at one k of eval.knn_k (knn/k logs it): the report's label says which; a
    store without knn/k (written before it was logged) keeps the plain label."""
    from smallbatch.report.runs import metric_label

    assert metric_label(pd.DataFrame({"metrics.knn/k": [20.0, 20.0, np.nan]}), "knn") == "kNN top-1 (k = 20)"
    assert metric_label(pd.DataFrame({"metrics.knn/k": [200.0, 20.0]}), "knn") == "kNN top-1 (k = 20, 200)"
    assert metric_label(pd.DataFrame({"metrics.linear/top1": [50.0]}), "knn") == "kNN top-1"
    assert metric_label(pd.DataFrame({"metrics.knn/k": [20.0]}), "linear") == "linear top-1"


def test_a_newer_failed_run_keeps_the_finished_run_and_is_listed_as_failed(store_uri, tmp_path):
    """A finished cell rerun that crashed (a newer failed run, no metrics): the tables keep the
    finished run's seed, and the failed attempt is listed with the failed runs."""
    b = StoreBuilder(store_uri, experiment="crashed-rerun")
    design = build_grid(b, "digits", ("infonce",), (16,), (0.1,), (0, 1), STEEP, history=False)
    crashed = b.run(
        "digits/infonce/bs16-t0.1-s1", status="failed", params=_cell_params("digits", "infonce", 16, 0.1, 1)
    )
    index = report.build_report(store_uri, tmp_path / "rep", experiment="crashed-rerun")
    top1 = pd.read_csv(tmp_path / "rep" / "tables" / "grid_top1_digits_knn.csv")
    assert top1[["n_seeds", "n_failed", "state"]].values.tolist() == [[2, 0, "ok"]], "the finished seed dropped out"
    assert top1["mean"].tolist() == pytest.approx([(design[0]["knn"] + design[1]["knn"]) / 2], abs=1e-6)
    failed = pd.read_csv(tmp_path / "rep" / "tables" / "diverged_runs.csv")
    assert failed[["cell_id", "status", "run_id"]].values.tolist() == [
        ["digits/infonce/bs16-t0.1-s1", "failed", crashed]
    ]
    assert "No run diverged or failed" not in index.read_text()
