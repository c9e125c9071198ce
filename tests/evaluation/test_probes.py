"""smallbatch.evaluation.probes: the validated linear probe, few-label probes and gap fractions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from synthetic import clustered_features

from smallbatch.evaluation import probes
from smallbatch.evaluation.linear import fit_linear, linear_eval, linear_top1, standardise
from smallbatch.study.cell import read_cell

DECAYS = [1e-3, 1e-1, 10.0]


@pytest.fixture(scope="module")
def feats():
    return clustered_features(600, 300, 16, classes=5, noise=1.5, seed=3)


def test_validation_split_is_stratified_disjoint_and_fixed():
    y = np.repeat(np.arange(4), 50)
    fit, val = probes.validation_split(y, 0.1, seed=0)
    assert len(val) == 20 and np.bincount(y[val]).tolist() == [5] * 4
    assert len(np.intersect1d(fit, val)) == 0 and len(fit) + len(val) == 200
    assert np.array_equal(val, probes.validation_split(y, 0.1, seed=0)[1])
    with pytest.raises(ValueError, match="val_fraction"):
        probes.validation_split(y, 1.0)


def test_balanced_subset_takes_the_same_share_of_each_class_from_the_given_rows():
    y = np.repeat(np.arange(3), [100, 40, 20])
    rows = np.arange(0, len(y), 2)  # 50, 20, 10 rows per class
    picked = probes.balanced_subset(y, rows, 0.1, np.random.default_rng(0))
    assert np.isin(picked, rows).all()
    assert np.bincount(y[picked]).tolist() == [10, 4, 2]  # round(0.1 n_c) of each class's rows of all


@pytest.mark.parametrize(
    "fraction,expect",
    [
        (
            0.02,
            r"gives class 2 round\(0\.02 x 20\) = 0 labelled images: none to fit a probe on; use a fraction of at least 0\.05",
        ),
        (
            0.6,
            r"gives class 0 round\(0\.6 x 100\) = 60 labelled images, but only 50 of its 100 lie outside the validation split",
        ),
    ],
)
def test_a_fraction_the_labelled_set_cannot_be_is_refused_not_rounded(fraction, expect):
    """The metric is named by the fraction: a set that is not that fraction of each class (one
    row where round gives none, fewer than asked where the fit rows run out) is refused."""
    y = np.repeat(np.arange(3), [100, 40, 20])
    with pytest.raises(ValueError, match=expect):
        probes.balanced_subset(y, np.arange(0, len(y), 2), fraction, np.random.default_rng(0))


def test_the_weight_decay_is_chosen_without_the_test_set_and_refitted_on_all_training_rows(feats):
    tr, ytr, te, yte = feats
    a = probes.linear_probes(tr, ytr, te, yte, weight_decays=DECAYS, epochs=30)
    rng = np.random.default_rng(0)
    b = probes.linear_probes(
        tr, ytr, rng.standard_normal(te.shape).astype(np.float32), rng.permutation(yte), weight_decays=DECAYS, epochs=30
    )
    assert a["weight_decay"] == b["weight_decay"]  # other test rows, same choice
    assert {k: v for k, v in a.items() if k.startswith("val_top1")} == {
        k: v for k, v in b.items() if k.startswith("val_top1")
    }
    best = max(DECAYS, key=lambda wd: (a[f"val_top1_wd{wd:g}"], wd))
    assert a["weight_decay"] == best and a["val_top1"] == a[f"val_top1_wd{best:g}"]
    x, xte = standardise(tr, te)
    refit = fit_linear(x, torch.from_numpy(ytr), 5, best, 30)
    assert a["top1"] == pytest.approx(linear_top1(refit, xte, torch.from_numpy(yte)))


def test_the_best_validation_score_wins():
    # separable classes: the weakest penalty fits them; a huge one cannot
    tr, ytr, te, yte = clustered_features(400, 100, 8, classes=4, noise=0.3, seed=1)
    out = probes.linear_probes(tr * 0.05, ytr, te * 0.05, yte, weight_decays=[1e-4, 1e4], epochs=30)
    assert out["weight_decay"] == 1e-4 and out["val_top1_wd0.0001"] > out["val_top1_wd10000"]


def test_few_label_probes_report_mean_and_sd_of_their_draws(feats):
    tr, ytr, te, yte = feats
    out = probes.linear_probes(
        tr, ytr, te, yte, weight_decays=DECAYS, fewshot_fractions=[0.05], fewshot_draws=3, epochs=30
    )
    x, xte = standardise(tr, te)
    y, yt = torch.from_numpy(ytr), torch.from_numpy(yte)
    fit_rows, val_rows = probes.validation_split(ytr, 0.1, 0)
    tops = []
    for draw in range(3):
        rows = probes.balanced_subset(ytr, fit_rows, 0.05, np.random.default_rng([0, 50000, draw]))
        assert not np.isin(rows, val_rows).any()
        scores = {
            wd: linear_top1(f, x[val_rows], y[val_rows])
            for wd, f in ((wd, fit_linear(x[rows], y[rows], 5, wd, 30)) for wd in DECAYS)
        }
        best = max(scores, key=lambda wd: (scores[wd], wd))
        tops.append(linear_top1(fit_linear(x[rows], y[rows], 5, best, 30), xte, yt))
    assert out["labels5pct_top1_mean"] == pytest.approx(np.mean(tops))
    assert out["labels5pct_top1_sd"] == pytest.approx(np.std(tops, ddof=1))
    assert out["labels5pct_labels"] == len(rows)
    again = probes.linear_probes(
        tr, ytr, te, yte, weight_decays=DECAYS, fewshot_fractions=[0.05], fewshot_draws=3, epochs=30
    )
    assert again == out


def test_without_a_decay_list_the_probe_is_the_plain_linear_eval(feats):
    tr, ytr, te, yte = feats
    assert probes.linear_probes(tr, ytr, te, yte, weight_decay=1e-2, epochs=20) == linear_eval(
        tr, ytr, te, yte, weight_decay=1e-2, epochs=20
    )
    few = probes.linear_probes(tr, ytr, te, yte, weight_decay=1e-2, epochs=20, fewshot_fractions=[0.1], fewshot_draws=1)
    assert few["labels10pct_weight_decay"] == 1e-2 and few["labels10pct_top1_sd"] == 0.0


def test_validated_probes_refuse_another_solver(feats):
    tr, ytr, te, yte = feats
    with pytest.raises(ValueError, match="lbfgs-precond"):
        probes.linear_probes(tr, ytr, te, yte, weight_decays=DECAYS, optimizer="adam")
    with pytest.raises(ValueError, match="linear_lr 0.5"):
        probes.linear_probes(tr, ytr, te, yte, fewshot_fractions=[0.1], lr=0.5)


def test_fraction_tags():
    assert [probes.fraction_tag(f) for f in (0.01, 0.1, 0.005, 1.0)] == [
        "labels1pct",
        "labels10pct",
        "labels0.5pct",
        "labels100pct",
    ]


def test_gap_fraction_places_a_value_between_random_init_and_supervised():
    assert probes.gap_fraction(70.0, 60.0, 80.0) == pytest.approx(0.5)
    assert probes.gap_fraction(80.0, 60.0, 80.0) == 1.0 and probes.gap_fraction(60.0, 60.0, 80.0) == 0.0
    assert probes.gap_fraction(2.0, 0.0, 20.0) == pytest.approx(0.1)  # a difference of 2 points of a 20-point range
    assert math.isnan(probes.gap_fraction(70.0, 80.0, 80.0))


def test_the_evaluation_step_writes_the_probes_in_percent(feats):
    from smallbatch.pipeline.jobs import _eval_on_features
    from smallbatch.study.cells import expand_cells
    from smallbatch.study.config import load_config

    tr, ytr, te, yte = feats
    ev = {
        "linear_iterations": 20,
        "linear_lr": None,
        "linear_weight_decay": 1e-3,
        "linear_optimizer": "lbfgs-precond",
        "linear_batch_size": None,
        "linear_tol": 1e-5,
        "linear_weight_decays": DECAYS,
        "linear_val_fraction": 0.1,
        "fewshot_fractions": [0.1],
        "fewshot_draws": 2,
    }
    cfg = load_config(None, {"datasets": {"digits": {}}, "grid": {"seeds": [0]}, "device": "cpu", "eval": ev})
    cell = next(iter(expand_cells(cfg).values()))  # a cell of a config with these probe settings
    out = _eval_on_features("linear", read_cell(cell), (tr, ytr, te, yte))
    raw = probes.linear_probes(
        tr, ytr, te, yte, weight_decays=DECAYS, fewshot_fractions=[0.1], fewshot_draws=2, epochs=20
    )
    assert out["top1"] == pytest.approx(100 * raw["top1"])
    assert out["labels10pct_top1_mean"] == pytest.approx(100 * raw["labels10pct_top1_mean"])
    assert out["weight_decay"] == raw["weight_decay"] and out["labels10pct_labels"] == raw["labels10pct_labels"]


def test_the_linear_probe_reads_batchnorm_standardised_features():
    """The linear probe is already the BatchNorm-standardised one (a BatchNorm without affine on the
    training features before the linear layer): each dimension centred and divided by its population
    sd over the training rows, checked by hand in float64, so a dimension scaled 1000x leaves every
    number of the probe as it was, while the same solver on the raw rows predicts differently."""
    tr = np.array([[1.0, 10.0], [3.0, 30.0], [5.0, 20.0]], np.float32)
    te = np.array([[3.0, 40.0]], np.float32)
    x, xt = standardise(tr, te)
    sd0, sd1 = math.sqrt(8.0 / 3.0), math.sqrt(200.0 / 3.0)  # ((−2)² + 0² + 2²)/3, ((−10)² + 10² + 0²)/3
    want = [[-2.0 / sd0, -10.0 / sd1], [0.0, 10.0 / sd1], [2.0 / sd0, 0.0]]
    np.testing.assert_allclose(x.double().numpy(), want, atol=1e-6)
    np.testing.assert_allclose(xt.double().numpy(), [[0.0, 20.0 / sd1]], atol=1e-6)

    rng = np.random.default_rng(0)
    c, d, n = 4, 12, 600
    y = rng.integers(0, c, n + 300)
    feats = (rng.normal(size=(c, d))[y] + 1.5 * rng.normal(size=(len(y), d))).astype(np.float32)
    xtr, ytr, xte, yte = feats[:n], y[:n], feats[n:], y[n:]
    big_tr, big_te = xtr.copy(), xte.copy()
    big_tr[:, 0] *= 1000
    big_te[:, 0] *= 1000
    kw = dict(weight_decays=[1e-3, 1e-1], epochs=100)
    plain = probes.linear_probes(xtr, ytr, xte, yte, **kw)
    scaled = probes.linear_probes(big_tr, ytr, big_te, yte, **kw)
    for key in ("top1", "val_top1", "val_top1_wd0.001", "val_top1_wd0.1", "weight_decay"):
        assert scaled[key] == plain[key], key
    assert scaled["train_loss"] == pytest.approx(plain["train_loss"], abs=1e-5)

    def raw_predictions(a, b):
        fit = fit_linear(torch.from_numpy(a), torch.from_numpy(ytr), c, 1e-1)
        return (torch.from_numpy(b) @ fit.weight.T.float() + fit.bias.float()).argmax(1).numpy()

    assert (raw_predictions(xtr, xte) != raw_predictions(big_tr, big_te)).any()
