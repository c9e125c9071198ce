"""What a representation looks like (:mod:`smallbatch.evaluation.representation`): each metric
against a brute-force float64 reference, the fixed held-out sample, and the evaluate step
writing ``representation.json`` and logging ``repr/*`` to the cell's MLflow run once."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from smallbatch.evaluation.representation import SAMPLE, held_out_sample, representation_metrics, space_metrics
from smallbatch.losses.diagnostics import alignment_uniformity, negative_cosines
from smallbatch.training.health import effective_rank
from smallbatch.training.models import ContrastiveModel, build_backbone


def _views(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g, dtype=torch.float64)
    return a, a + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64)


def test_negative_cosines_are_the_pairs_of_different_images_among_the_two_views():
    z1, z2 = _views(7, 5, seed=0)
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1).numpy()
    n = 7
    negs = [float(z[a] @ z[b]) for a in range(2 * n) for b in range(2 * n) if a % n != b % n]
    got = negative_cosines(z1, z2)
    assert len(negs) == 4 * n * n - 4 * n
    assert got["neg_cos_mean"] == pytest.approx(np.mean(negs), rel=1e-12, abs=1e-14)
    assert got["neg_cos_sd"] == pytest.approx(np.std(negs), rel=1e-10)


def test_alignment_and_uniformity_are_wang_and_isolas_definitions():
    z1, z2 = _views(6, 4, seed=1)
    a = torch.nn.functional.normalize(z1, dim=1).numpy()
    b = torch.nn.functional.normalize(z2, dim=1).numpy()
    align = np.mean([np.sum((a[i] - b[i]) ** 2) for i in range(6)])

    def unif(x):
        return math.log(np.mean([math.exp(-2 * np.sum((x[i] - x[j]) ** 2)) for i in range(6) for j in range(i + 1, 6)]))

    got = alignment_uniformity(z1, z2)
    assert got[0] == pytest.approx(align, rel=1e-12) and got[1] == pytest.approx((unif(a) + unif(b)) / 2, rel=1e-12)


def test_rankme_is_the_entropy_of_the_uncentred_singular_values():
    x = _views(30, 8, seed=2)[0] + 3.0  # an offset: centring would change the spectrum
    s = np.linalg.svd(x.numpy(), compute_uv=False)
    p = s / s.sum()
    assert effective_rank(x, centre=False) == pytest.approx(math.exp(-np.sum(p * np.log(p))), rel=1e-10)
    eps = p + 1e-7  # RankMe's own epsilon changes it by far less than its 0.4 % bound
    assert effective_rank(x, centre=False) == pytest.approx(math.exp(-np.sum(eps * np.log(eps))), rel=1e-5)
    assert effective_rank(x, centre=False) != pytest.approx(effective_rank(x), rel=1e-3)
    one = torch.ones(20, 6, dtype=torch.float64) * torch.arange(1.0, 7.0, dtype=torch.float64)
    assert effective_rank(one, centre=False) == pytest.approx(1.0)  # every image on one direction


def test_a_collapsed_space_reads_as_collapsed():
    z = torch.ones(10, 4, dtype=torch.float64)
    m = space_metrics(z, z, z)
    assert m["alignment"] == 0 and m["uniformity"] == 0 and m["rankme"] == pytest.approx(1.0)
    assert m["neg_cos_mean"] == pytest.approx(1.0) and m["neg_cos_sd"] == pytest.approx(0.0, abs=1e-6)


def test_the_sample_is_fixed_and_bounded_and_the_metrics_repeat(digits):
    assert torch.equal(held_out_sample(10_000), held_out_sample(10_000)) and len(held_out_sample(10_000)) == SAMPLE
    assert sorted(held_out_sample(50).tolist()) == list(range(50))
    torch.manual_seed(0)
    backbone, f = build_backbone("small_cnn", 1, 8, width=4)
    model = ContrastiveModel(backbone, f, 16, 8).train()
    aug = {"recipe": "gray_small"}
    a = representation_metrics(model, digits.test_x, digits.mean, digits.std, aug, size=100)
    b = representation_metrics(model, digits.test_x, digits.mean, digits.std, aug, size=100)
    assert a == b and a["images"] == 100 and all(math.isfinite(v) for v in a.values())
    assert all(m.training for m in model.modules())  # its modes restored
    assert 1 <= a["features_rankme"] <= 16 and 1 <= a["projection_rankme"] <= 8


def test_evaluate_writes_the_representation_and_logs_it_once(tmp_path):
    from mlflow.tracking import MlflowClient

    from smallbatch import tracking
    from smallbatch.pipeline import cli

    cfg = tmp_path / "study.yaml"
    cfg.write_text(
        f"study: repr-test\nresults_dir: {tmp_path / 'results'}\ndevice: cpu\nthreads: 1\n"
        "datasets: {digits: {}}\ngrid: {losses: [vicreg], batch_sizes: [32], temperatures: [0.5], seeds: [0]}\n"
        "train: {width: 4, proj_hidden: 16, proj_dim: 8, epochs: 1, log_every: 10}\n"
        "eval: {knn_k: [5], linear_iterations: 20}\nexperiments: {mi: {enabled: false}}\n"
    )
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    which = ["--config", str(cfg), "--cell-id", "digits/vicreg/bs32-t0.5-s0", "--tracking-uri", uri]
    assert cli.main(["pretrain", *which, "--no-progress"]) == 0
    assert cli.main(["evaluate", *which]) == 0
    run_dir = tmp_path / "results" / "runs" / "digits" / "vicreg" / "bs32-t0.5-s0"
    written = json.loads((run_dir / "representation.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("repr-test").experiment_id])
    logged = {k: v for k, v in run.data.metrics.items() if k.startswith("repr/")}
    assert logged and logged == {k: v for k, v in written.items() if k.startswith("repr/")}
    assert "representation.json" in tracking.StoreReader(uri).artifacts(run.info.run_id)
    assert cli.main(["evaluate", *which]) == 0  # a rerun logs nothing twice
    assert len(client.get_metric_history(run.info.run_id, "repr/features_rankme")) == 1
