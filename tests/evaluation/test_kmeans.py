"""The k-means probe (:mod:`smallbatch.evaluation.kmeans`): its NMI against a float64
reference written out here, its two clusterings (faiss, torch), its bad input, and a digits
cell whose ``eval.probes`` asks for it logging ``kmeans/nmi`` to its run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from smallbatch.evaluation import kmeans


def reference_nmi(a: np.ndarray, b: np.ndarray) -> float:
    """NMI of two labelings in float64: I(a; b) / ((H(a) + H(b)) / 2), from the contingency table."""
    n = len(a)
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    joint = np.zeros((ai.max() + 1, bi.max() + 1), np.float64)
    np.add.at(joint, (ai, bi), 1.0)
    p = joint / n
    pa, pb = p.sum(1), p.sum(0)
    nz = p > 0
    mi = float(np.sum(p[nz] * np.log(p[nz] / np.outer(pa, pb)[nz])))
    ha, hb = -float(np.sum(pa * np.log(pa))), -float(np.sum(pb * np.log(pb)))
    return 1.0 if ha == hb == 0 else mi / ((ha + hb) / 2)


def _blobs(n_per: int, k: int, d: int, spread: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = np.eye(k, d) * 10.0
    y = np.repeat(np.arange(k), n_per)
    return (centres[y] + spread * rng.normal(size=(len(y), d))).astype(np.float32), y


def test_the_reference_is_sklearns_nmi_on_a_fixed_assignment():
    from sklearn.metrics import normalized_mutual_info_score

    rng = np.random.default_rng(3)
    y, assign = rng.integers(0, 4, 200), rng.integers(0, 5, 200)
    assign[:100] = y[:100]  # half agree: an NMI between 0 and 1
    ref = reference_nmi(y, assign)
    assert 0.05 < ref < 0.95
    assert normalized_mutual_info_score(y, assign) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("faiss", [True, False])
def test_separable_clusters_give_nmi_one(monkeypatch, faiss):
    if not faiss:
        monkeypatch.setattr(kmeans, "_faiss_kmeans", lambda *a: None)  # the torch k-means
    x, y = _blobs(40, 5, 8, 0.1)
    assign = kmeans.kmeans_assign(x, 5, 50)
    assert reference_nmi(y, assign) == pytest.approx(1.0, abs=1e-12)
    assert kmeans.kmeans_nmi(x, y, 5) == pytest.approx(1.0, abs=1e-12)


def test_random_labels_give_nmi_near_zero():
    x, _ = _blobs(100, 4, 8, 0.5)
    y = np.random.default_rng(1).integers(0, 4, len(x))
    assert abs(kmeans.kmeans_nmi(x, y, 4)) < 0.03


@pytest.mark.parametrize("faiss", [True, False])
def test_the_probes_nmi_is_the_reference_of_its_clusters(monkeypatch, faiss):
    if not faiss:
        monkeypatch.setattr(kmeans, "_faiss_kmeans", lambda *a: None)
    x, y = _blobs(60, 3, 6, 4.0, seed=2)  # overlapping blobs: an NMI strictly between 0 and 1
    assign = kmeans.kmeans_assign(x, 3, 30)
    got = kmeans.kmeans_nmi(x, y, 3, 30)
    assert 0.1 < got < 0.99 and got == pytest.approx(reference_nmi(y, assign), rel=1e-12)
    np.testing.assert_array_equal(kmeans.kmeans_assign(x, 3, 30), assign)  # the fixed seed repeats it


def test_torch_kmeans_stops_at_a_lloyd_fixed_point():
    x, _ = _blobs(50, 4, 5, 2.0, seed=4)
    xn = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    assign = kmeans.torch_kmeans(xn, 4, 200)
    centres = np.stack([xn[assign == j].mean(0) for j in range(4)])
    nearest = ((xn[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1)
    np.testing.assert_array_equal(nearest, assign)


def test_the_probe_reports_points_and_clusters_as_many_as_classes():
    x, y = _blobs(30, 3, 6, 0.1)
    out = kmeans.run_probe((x, y, x, y), {"kmeans_iterations": 20})
    assert out == {"nmi": 100.0, "clusters": 3.0}


@pytest.mark.parametrize(
    "args, words",
    [((np.ones((3, 2), np.float32), 0), "k must be"), ((np.ones((3, 2), np.float32), 5), "need at least 5 rows")],
)
def test_bad_input_is_one_line(args, words):
    with pytest.raises(ValueError, match=words) as e:
        kmeans.kmeans_assign(*args)
    assert "\n" not in str(e.value)


def test_a_digits_cell_with_the_probe_logs_its_metric(tmp_path):
    from mlflow.tracking import MlflowClient

    from smallbatch import tracking
    from smallbatch.pipeline import cli

    cfg = tmp_path / "study.yaml"
    cfg.write_text(
        f"study: kmeans-test\nresults_dir: {tmp_path / 'results'}\ndevice: cpu\nthreads: 1\n"
        "datasets: {digits: {}}\ngrid: {losses: [infonce], batch_sizes: [64], temperatures: [0.5], seeds: [0]}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, epochs: 1, log_every: 10}\n"
        "eval: {knn_k: [5], linear_iterations: 10, probes: [knn, linear, kmeans], kmeans_iterations: 10}\n"
        "experiments: {mi: {enabled: false}}\n"
    )
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    which = ["--config", str(cfg), "--cell-id", "digits/infonce/bs64-t0.5-s0", "--tracking-uri", uri]
    assert cli.main(["pretrain", *which, "--no-progress"]) == 0
    feats = tmp_path / "features.npz"
    assert cli.main(["evaluate", *which, "--features", str(feats)]) == 0
    written = json.loads(
        (tmp_path / "results" / "runs" / "digits" / "infonce" / "bs64-t0.5-s0" / "kmeans.json").read_text()
    )
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("kmeans-test").experiment_id])
    nmi = run.data.metrics["kmeans/nmi"]
    assert 0 < nmi <= 100 and math.isfinite(nmi) and nmi == written["kmeans/nmi"]
    assert run.data.metrics["kmeans/clusters"] == 10
    assert {"knn/top1", "linear/top1"} <= set(run.data.metrics)
    assert run.data.tags[tracking.TAG_STATUS] == "finished"  # finished once every probe it asked for logged
    # the probe's own command, its flag from the registry: a look by hand, not logged
    look = tmp_path / "look.json"
    assert cli.main(["kmeans", *which, "--features", str(feats), "--kmeans-iterations", "5", "--out", str(look)]) == 0
    assert 0 < json.loads(look.read_text())["kmeans/nmi"] <= 100
    assert len(client.get_metric_history(run.info.run_id, "kmeans/nmi")) == 1
    assert (
        cli.main(["kmeans", *which, "--features", str(feats), "--kmeans-iterations", "0"]) != 0
    )  # the schema's minimum
