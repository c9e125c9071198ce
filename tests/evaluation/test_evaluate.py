from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from smallbatch.evaluation.embed import embed, load_features, raw_pixel_features, save_features
from smallbatch.evaluation.knn import knn_eval, knn_predict, knn_search
from smallbatch.evaluation.linear import linear_eval
from smallbatch.training.models import build_backbone

# ----------------------------------------------------------------------------- kNN reference


def reference_knn_ranking(train_f, train_y, test_f, k, t, num_classes, topn=5):
    """InstDisc weighted vote written out in float64 numpy, one test point at a time."""
    tr = np.asarray(train_f, np.float64)
    te = np.asarray(test_f, np.float64)
    tr = tr / np.linalg.norm(tr, axis=1, keepdims=True)
    te = te / np.linalg.norm(te, axis=1, keepdims=True)
    k = min(k, len(tr))
    out = []
    for q in te:
        sims = tr @ q
        nn_idx = np.argsort(-sims, kind="stable")[:k]
        scores = np.zeros(num_classes)
        for j in nn_idx:
            scores[train_y[j]] += np.exp(sims[j] / t)
        # rank by score, ties -> lower class index
        out.append(np.argsort(-scores, kind="stable")[: min(topn, num_classes)])
    return np.array(out)


@pytest.fixture(scope="module")
def knn_case():
    rng = np.random.default_rng(0)
    c, d = 8, 16
    centers = rng.normal(size=(c, d))
    ytr = rng.integers(0, c, 300)
    yte = rng.integers(0, c, 60)
    tr = (centers[ytr] + 1.5 * rng.normal(size=(300, d))).astype(np.float32)
    te = (centers[yte] + 1.5 * rng.normal(size=(60, d))).astype(np.float32)
    return tr, ytr, te, yte, c


@pytest.mark.parametrize("t", [0.1, 0.5])
def test_knn_matches_reference(knn_case, t: float) -> None:
    tr, ytr, te, yte, c = knn_case
    ks = (1, 5, 20, 200)
    ranks = knn_predict(tr, ytr, te, ks=ks, t=t, num_classes=c, backend="faiss-cpu", batch_size=16)
    res = knn_eval(tr, ytr, te, yte, ks=ks, t=t, backend="faiss-cpu", batch_size=16)
    for k in ks:
        ref = reference_knn_ranking(tr, ytr, te, k, t, c)
        np.testing.assert_array_equal(ranks[k], ref)
        assert res[f"top1_k{k}"] == pytest.approx(np.mean(ref[:, 0] == yte))
        assert res[f"top5_k{k}"] == pytest.approx(np.mean((ref == yte[:, None]).any(1)))
        assert res[f"top5_k{k}"] >= res[f"top1_k{k}"]
        assert res[f"k_effective_k{k}"] == k
    # the problem is learnable but not trivial: accuracies are informative
    assert 0.3 < res["top1_k20"] < 1.0
    assert res["top1"] == res["top1_k200"] and res["top5"] == res["top5_k200"] and res["k"] == 200


def test_knn_small_temperature_does_not_overflow(knn_case) -> None:
    tr, ytr, te, yte, c = knn_case
    ranks = knn_predict(tr, ytr, te, ks=(20,), t=0.001, backend="faiss-cpu")
    # exp(1/0.001) overflows float64; the vote must still follow the nearest neighbour
    top1 = knn_predict(tr, ytr, te, ks=(1,), backend="faiss-cpu")[1][:, 0]
    np.testing.assert_array_equal(ranks[20][:, 0], top1)


def test_knn_vote_ties_go_to_lower_class() -> None:
    # two train points at equal cosine similarity from each test point, different labels
    train = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    train_y = np.array([3, 1, 0])
    test = np.array([[1, 1, 0], [1, 1, -0.1]], np.float32)
    test_y = np.array([3, 1])
    ranks = knn_predict(train, train_y, test, ks=(2,), num_classes=4, backend="faiss-cpu")[2]
    np.testing.assert_array_equal(ranks[:, :2], [[1, 3], [1, 3]])
    # classes with no votes rank after, in index order
    np.testing.assert_array_equal(ranks[:, 2:], [[0, 2], [0, 2]])
    res = knn_eval(train, train_y, test, test_y, ks=(2,), backend="faiss-cpu")
    assert res["top1"] == 0.5 and res["top5"] == 1.0


def test_knn_headline_is_the_declared_primary_k_and_names_it() -> None:
    """One test image on class 0's single neighbour (cosine 1) and three of class 1 at cosine
    0.9: k = 1 votes class 0; k = 4 votes class 1 (3 e^9 > e^10 at T = 0.1).  The headline is the
    declared k's (eval.knn_primary_k), the largest only when none is declared, and names it."""
    c = math.sqrt(1 - 0.81)
    train = torch.tensor([[1.0, 0.0], [0.9, c], [0.9, c], [0.9, -c]])
    train_y, test, test_y = torch.tensor([0, 1, 1, 1]), torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    declared = knn_eval(train, train_y, test, test_y, ks=(1, 4), t=0.1, backend="faiss-cpu", primary_k=1)
    assert (declared["top1"], declared["k"]) == (1.0, 1)
    largest = knn_eval(train, train_y, test, test_y, ks=(1, 4), t=0.1, backend="faiss-cpu")
    assert (largest["top1"], largest["k"]) == (0.0, 4)
    assert (declared["top1_k4"], largest["top1_k1"]) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"eval.knn_primary_k = 2 is not one of eval.knn_k \(1, 4\)"):
        knn_eval(train, train_y, test, test_y, ks=(1, 4), t=0.1, backend="faiss-cpu", primary_k=2)


def test_knn_clamps_k_to_train_size(knn_case) -> None:
    tr, ytr, te, yte, c = knn_case
    tr, ytr = tr[:12], ytr[:12]
    res = knn_eval(tr, ytr, te, yte, ks=(5, 50), num_classes=c, backend="faiss-cpu")
    assert res["k_effective_k50"] == 12 and res["k_effective_k5"] == 5
    ref = reference_knn_ranking(tr, ytr, te, 12, 0.1, c)
    assert res["top1_k50"] == pytest.approx(np.mean(ref[:, 0] == yte))
    assert res["top1"] == res["top1_k50"]


def test_knn_separated_clusters_perfect() -> None:
    rng = np.random.default_rng(1)
    centers = np.eye(10, 32) * 10
    ytr, yte = np.repeat(np.arange(10), 30), np.repeat(np.arange(10), 5)
    tr = centers[ytr] + rng.normal(size=(300, 32))
    te = centers[yte] + rng.normal(size=(50, 32))
    res = knn_eval(torch.from_numpy(tr), torch.from_numpy(ytr), te, yte, backend="auto")
    assert res["top1"] == 1.0 and res["top1_k20"] == 1.0


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(ks=(0,)), "ks"),
        (dict(ks=()), "ks"),
        (dict(t=0.0), "t "),
        (dict(t=-0.1), "t "),
        (dict(backend="yes"), "backend"),
        (dict(num_classes=3), "num_classes"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_knn_bad_arguments(knn_case, kwargs: dict, arg: str) -> None:
    tr, ytr, te, yte, _ = knn_case
    with pytest.raises(ValueError, match=arg):
        knn_eval(tr, ytr, te, yte, **kwargs)


def test_knn_bad_shapes(knn_case) -> None:
    tr, ytr, te, yte, _ = knn_case
    with pytest.raises(ValueError, match="test_f has 15 feature dims"):
        knn_eval(tr, ytr, te[:, :15], yte)
    with pytest.raises(ValueError, match="train_y has 299 labels"):
        knn_eval(tr, ytr[:-1], te, yte)
    with pytest.raises(ValueError, match="test_y"):
        knn_eval(tr, ytr, te, yte.astype(float))
    with pytest.raises(ValueError, match="train_f"):
        knn_eval(tr[0], ytr, te, yte)


def test_knn_faiss_gpu_without_gpu(knn_case) -> None:
    import faiss

    if faiss.get_num_gpus() > 0:
        pytest.skip("faiss sees a GPU here")
    tr, ytr, te, yte, _ = knn_case
    with pytest.raises(ValueError, match="backend='faiss-gpu' but faiss sees no GPU"):
        knn_eval(tr, ytr, te, yte, backend="faiss-gpu")


# ----------------------------------------------------------------------------- kNN: torch path


def _four_squares(m: int) -> tuple[int, int, int, int]:
    """Integers a >= b >= c >= d >= 0 with a^2 + b^2 + c^2 + d^2 = m (Lagrange), by search."""
    for a in range(math.isqrt(m), -1, -1):
        for b in range(min(a, math.isqrt(m - a * a)), -1, -1):
            r = m - a * a - b * b
            for c in range(min(b, math.isqrt(r)), -1, -1):
                d = math.isqrt(r - c * c)
                if d * d == r - c * c and d <= c:
                    return a, b, c, d
    raise AssertionError(m)  # unreachable: every m >= 0 is a sum of four squares


def exact_unit_rows(rng, centers, labels, p: int = 12) -> np.ndarray:
    """Rows of norm exactly 1 whose entries are integers / 2^p (p <= 12): L2-normalising
    leaves them unchanged, and every product and partial sum of a dot product is an
    integer / 4^p of magnitude <= 1 (Cauchy-Schwarz), i.e. at most 2^24 / 4^p: exact in
    float32, so any summation order (faiss's BLAS, torch's) gives the same bits."""
    rows = []
    for lab in labels:
        while True:
            a = np.round(centers[lab] + rng.normal(scale=480, size=centers.shape[1])).astype(np.int64)
            rest = 4**p - int((a * a).sum())
            if rest >= 0:
                break
        tail = np.array(_four_squares(rest)) * rng.choice([-1, 1], size=4)
        rows.append(np.concatenate([a, tail]) / 2**p)
    return np.array(rows, np.float32)


@pytest.fixture(scope="module")
def exact_case():
    rng = np.random.default_rng(3)
    c, d = 6, 28
    centers = rng.normal(scale=360, size=(c, d))
    ytr, yte = rng.integers(0, c, 400), rng.integers(0, c, 50)
    return exact_unit_rows(rng, centers, ytr), ytr, exact_unit_rows(rng, centers, yte), yte, c


def test_exact_case_is_exact_and_tie_free(exact_case) -> None:
    """The fixture the equality tests rely on: unit rows, float32 dot products equal to
    float64 ones, and no two train rows at the same similarity to any test row."""
    tr, _, te, _, _ = exact_case
    np.testing.assert_array_equal(np.einsum("ij,ij->i", tr.astype(np.float64), tr.astype(np.float64)), 1.0)
    sims64 = te.astype(np.float64) @ tr.astype(np.float64).T
    np.testing.assert_array_equal((te @ tr.T).astype(np.float64), sims64)
    assert all(len(np.unique(row)) == len(row) for row in sims64)


@pytest.mark.parametrize("k", [1, 20, 400])
def test_torch_search_returns_faiss_neighbours(exact_case, k: int) -> None:
    tr, _, te, _, _ = exact_case
    s_f, i_f = knn_search(tr, te, k, backend="faiss-cpu", batch_size=16)
    s_t, i_t = knn_search(tr, te, k, backend="torch", device="cpu", batch_size=16)
    assert s_t.device.type == "cpu" and s_t.dtype == torch.float32 and i_t.dtype == torch.int64
    np.testing.assert_array_equal(i_t.numpy(), i_f.numpy())
    np.testing.assert_array_equal(s_t.numpy(), s_f.numpy())
    # and both are the exact top-k (float64, no ties in this fixture)
    order = np.argsort(-(te.astype(np.float64) @ tr.astype(np.float64).T), axis=1)[:, :k]
    np.testing.assert_array_equal(i_f.numpy(), order)


def test_torch_search_chunks_merge_to_the_same_neighbours(exact_case) -> None:
    from smallbatch.evaluation.knn import _torch_search

    tr, _, te, _, _ = exact_case
    whole = _torch_search(tr, te, 30, torch.device("cpu"), batch_size=64, train_chunk=10_000)
    chunked = _torch_search(tr, te, 30, torch.device("cpu"), batch_size=7, train_chunk=37)
    tiny = _torch_search(tr, te, 30, torch.device("cpu"), batch_size=50, train_chunk=3)  # chunks < k
    for got in (chunked, tiny):
        np.testing.assert_array_equal(got[1].numpy(), whole[1].numpy())
        np.testing.assert_array_equal(got[0].numpy(), whole[0].numpy())


@pytest.mark.parametrize("case", ["exact_case", "knn_case"])
def test_torch_backend_gives_faiss_accuracies(case: str, request) -> None:
    tr, ytr, te, yte, c = request.getfixturevalue(case)
    kw = dict(ks=(1, 5, 20, 200), t=0.1, num_classes=c, batch_size=16)
    res_f = knn_eval(tr, ytr, te, yte, backend="faiss-cpu", **kw)
    res_t = knn_eval(tr, ytr, te, yte, backend="torch", device="cpu", **kw)
    assert res_t == res_f
    assert 0.3 < res_f["top1_k20"] < 1.0  # informative, not trivial
    ranks_f = knn_predict(tr, ytr, te, backend="faiss-cpu", **kw)
    ranks_t = knn_predict(tr, ytr, te, backend="torch", device="cpu", **kw)
    for k in kw["ks"]:
        np.testing.assert_array_equal(ranks_t[k], ranks_f[k])


def test_torch_search_orders_equal_similarities_by_index() -> None:
    base = np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32)
    tr = np.repeat(base, 3, axis=0)  # rows 3i, 3i+1, 3i+2 are equal
    s, i = knn_search(tr, base[:4], 30, backend="torch", device="cpu")
    s, i = s.numpy(), i.numpy()
    assert (np.diff(s, axis=1) <= 0).all()
    for row_s, row_i in zip(s, i):
        for v in np.unique(row_s):
            same = row_i[row_s == v]
            np.testing.assert_array_equal(same, np.sort(same))


def test_auto_backend_choice(monkeypatch) -> None:
    import faiss

    from smallbatch.evaluation import knn

    def choose(faiss_gpus: int, cuda: bool):
        monkeypatch.setattr(faiss, "get_num_gpus", lambda: faiss_gpus, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return knn._resolve_knn_backend("auto", None)

    assert choose(1, True) == ("faiss-gpu", None)
    assert choose(0, True) == ("torch", torch.device("cuda"))
    assert choose(0, False) == ("faiss-cpu", None)
    assert knn._resolve_knn_backend("faiss-cpu", None) == ("faiss-cpu", None)  # explicit overrides
    assert knn._resolve_knn_backend("torch", "cpu") == ("torch", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "faiss", None)  # faiss not installed
    assert knn._resolve_knn_backend("auto", None) == ("torch", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend='faiss-cpu' needs faiss"):
        knn._resolve_knn_backend("faiss-cpu", None)


# ----------------------------------------------------------------------------- linear probe


def _blobs(seed: int, n_per: int = 60, c: int = 4, d: int = 32):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(c, d)) * 4
    y = np.repeat(np.arange(c), n_per)
    return (centers[y] + rng.normal(size=(len(y), d))).astype(np.float32), y


def test_linear_probe_separable() -> None:
    xtr, ytr = _blobs(0)
    xte, yte = _blobs(0, n_per=20)
    xte = xte + np.random.default_rng(5).normal(size=xte.shape).astype(np.float32) * 0.1
    for opt, kw in [("lbfgs-precond", {}), ("lbfgs", {}), ("adam", dict(batch_size=32, epochs=50, lr=1e-2))]:
        res = linear_eval(xtr, ytr, xte, yte, optimizer=opt, **kw)
        assert res["train_top1"] == 1.0 and res["top1"] >= 0.99 and res["top5"] == 1.0


def test_linear_probe_deterministic() -> None:
    xtr, ytr = _blobs(0)
    xte, yte = _blobs(1, n_per=20)
    for kw in [dict(), dict(optimizer="lbfgs"), dict(optimizer="adam", batch_size=16, epochs=5)]:
        a = linear_eval(xtr, ytr, xte, yte, seed=3, **kw)
        b = linear_eval(xtr, ytr, xte, yte, seed=3, **kw)
        assert a == b


def test_linear_probe_not_better_than_chance_on_shuffled_labels() -> None:
    xtr, ytr = _blobs(0, c=4)
    xte, yte = _blobs(1, n_per=50, c=4)
    rng = np.random.default_rng(0)
    res = linear_eval(xtr, rng.permutation(ytr), xte, yte)
    assert res["top1"] < 0.5  # chance is 0.25


def test_linear_probe_digits_raw_pixels() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    imgs = np.round(digits.images * (255 / 16)).astype(np.uint8)[:, None]  # (N,1,8,8) uint8
    xtr, xte, ytr, yte = train_test_split(imgs, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    res = linear_eval(raw_pixel_features(xtr), ytr, raw_pixel_features(xte), yte)
    assert res["top1"] >= 0.95
    assert res["top5"] >= res["top1"]


def _ill_conditioned(n_train: int = 400, n_test: int = 200, d: int = 24, c: int = 5):
    """Overlapping classes seen through a mixing map with singular values 1..1e-3:
    standardising rescales each dimension but keeps the correlations, so the probe's
    objective is badly conditioned, like on the default study's features."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(c, d))
    mix = rng.normal(size=(d, d)) @ np.diag(np.logspace(0, -3, d))
    y = rng.integers(0, c, n_train + n_test)
    x = ((centers[y] + rng.normal(size=(len(y), d))) @ mix.T).astype(np.float32)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _probe_minimum(xtr, ytr, xte, c: int, weight_decay: float):
    """The probe's objective minimised in float64 by scipy's L-BFGS-B to a tight tolerance,
    on linear_eval's standardisation: (minimum, test predictions)."""
    from scipy.optimize import minimize

    from smallbatch.evaluation.linear import _standardise

    xs, xt = (a.double().numpy() for a in _standardise(xtr, xte, torch.device("cpu")))
    onehot = np.eye(c)[ytr]

    def fun(theta):
        w, b = theta[: c * xs.shape[1]].reshape(c, -1), theta[c * xs.shape[1] :]
        z = xs @ w.T + b
        z = z - z.max(1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        loss = -np.log(p[np.arange(len(ytr)), ytr]).mean() + 0.5 * weight_decay * (w * w).sum()
        g = (p - onehot) / len(ytr)
        return loss, np.concatenate([(g.T @ xs + weight_decay * w).ravel(), g.sum(0)])

    res = minimize(
        fun,
        np.zeros(c * (xs.shape[1] + 1)),
        jac=True,
        method="L-BFGS-B",
        options=dict(maxiter=20_000, maxfun=40_000, gtol=1e-12, ftol=1e-15),
    )
    w, b = res.x[: c * xs.shape[1]].reshape(c, -1), res.x[c * xs.shape[1] :]
    return res.fun, (xt @ w.T + b).argmax(1)


def test_precond_lbfgs_reaches_the_minimum() -> None:
    xtr, ytr, xte, yte = _ill_conditioned()
    minimum, pred = _probe_minimum(xtr, ytr, xte, 5, 1e-3)
    res = linear_eval(xtr, ytr, xte, yte, epochs=500, tol=0.0, weight_decay=1e-3)
    assert res["train_loss"] == pytest.approx(minimum, rel=1e-5)
    assert res["top1"] == pytest.approx(np.mean(pred == yte))
    # the default stopping rule (tol) ends well before the cap, at the same test accuracy
    stopped = linear_eval(xtr, ytr, xte, yte, epochs=500, weight_decay=1e-3)
    assert stopped["iterations"] < 500
    assert stopped["train_loss"] == pytest.approx(minimum, rel=1e-4) and stopped["top1"] == res["top1"]


def test_linear_probe_iterations() -> None:
    xtr, ytr, _, _ = _ill_conditioned()
    plain = linear_eval(xtr, ytr, xtr, ytr, epochs=7, optimizer="lbfgs")
    assert plain["iterations"] == 7  # the first solver: exactly `epochs` iterations
    capped = linear_eval(xtr, ytr, xtr, ytr, epochs=25, tol=0.0)
    assert capped["iterations"] == 25  # the cap, in blocks of 10 and a last one of 5
    tight = linear_eval(xtr, ytr, xtr, ytr, epochs=500)
    loose = linear_eval(xtr, ytr, xtr, ytr, epochs=500, tol=0.05)
    assert loose["iterations"] < tight["iterations"] < 500
    assert loose["train_loss"] > tight["train_loss"]


def test_preconditioning_is_what_converges_fast() -> None:
    """Why 'lbfgs-precond' is the default: on a badly conditioned probe, 20 iterations of
    it get 50x closer to the minimum than 20 of plain L-BFGS (measured: 2.7e-4 vs 1.7e-2)."""
    xtr, ytr, xte, _ = _ill_conditioned()
    minimum, _ = _probe_minimum(xtr, ytr, xte, 5, 1e-3)
    gap = {
        opt: linear_eval(xtr, ytr, xtr, ytr, epochs=20, tol=0.0, optimizer=opt)["train_loss"] - minimum
        for opt in ("lbfgs", "lbfgs-precond")
    }
    assert 0 < 10 * gap["lbfgs-precond"] < gap["lbfgs"]


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(epochs=0), "epochs"),
        (dict(lr=-1.0), "lr"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(batch_size=32), "batch_size"),  # L-BFGS is full-batch
        (dict(optimizer="adam", batch_size=0), "batch_size"),
        (dict(optimizer="sgd"), "optimizer"),
        (dict(tol=-1e-3), "tol"),
        (dict(optimizer="lbfgs-precond", batch_size=8), "batch_size"),
    ],
)
def test_linear_probe_bad_arguments(kwargs: dict, arg: str) -> None:
    xtr, ytr = _blobs(0, n_per=5)
    with pytest.raises(ValueError, match=arg):
        linear_eval(xtr, ytr, xtr, ytr, **kwargs)


# ----------------------------------------------------------------------------- embed


MEAN, STD = (0.3,), (0.25,)


@pytest.fixture()
def cnn_and_images():
    torch.manual_seed(0)
    net, feat = build_backbone("small_cnn", 1, 8, width=8)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (10, 1, 8, 8), dtype=torch.uint8, generator=g)
    return net, feat, x


def test_embed_shape_dtype_and_values(cnn_and_images) -> None:
    net, feat, x = cnn_and_images
    f = embed(net, x, MEAN, STD, batch_size=4)
    assert f.shape == (10, feat) and f.dtype == np.float32
    net.eval()
    with torch.no_grad():
        expected = net((x.float() / 255 - MEAN[0]) / STD[0]).numpy()
    np.testing.assert_allclose(f, expected, rtol=1e-5, atol=1e-6)
    # numpy input, other batch size: same features
    np.testing.assert_allclose(embed(net, x.numpy(), MEAN, STD, batch_size=10), f, rtol=1e-5, atol=1e-6)


def test_embed_eval_mode_and_determinism(cnn_and_images) -> None:
    net, _, x = cnn_and_images
    net.train()
    # give BN non-trivial running stats, as after training
    with torch.no_grad():
        net(torch.randn(16, 1, 8, 8) * 3 + 1)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    a = embed(net, x, MEAN, STD)
    b = embed(net, x, MEAN, STD)
    np.testing.assert_array_equal(a, b)
    assert net.training  # mode restored
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed during embed"
    # eval mode: a sample's features do not depend on the rest of its batch
    np.testing.assert_allclose(embed(net, x[:1], MEAN, STD), a[:1], rtol=1e-5, atol=1e-6)
    # mixed modes (e.g. a frozen BN inside a training model) come back as they were
    frozen_bn = net.features[1]
    frozen_bn.eval()
    embed(net, x, MEAN, STD)
    assert net.training and not frozen_bn.training and net.features[4].training


def test_embed_runs_nhwc_and_leaves_the_weights_layout_as_it_was(cnn_and_images) -> None:
    """embed runs the convolutions in NHWC (oneDNN's fast layout) and gives the NCHW
    features to float rounding; an NCHW backbone comes back NCHW, an NHWC one (a model in
    training) NHWC, with the same parameter objects."""
    net, _, x = cnn_and_images
    params = list(net.parameters())
    net.eval()
    with torch.no_grad():  # the NCHW reference in float64
        ref64 = net.double()((x.double() / 255 - MEAN[0]) / STD[0]).numpy()
    net.float()
    np.testing.assert_allclose(embed(net, x, MEAN, STD), ref64, rtol=1e-5, atol=1e-5)
    assert all(p.is_contiguous() for p in net.parameters()) and list(net.parameters()) == params
    net.to(memory_format=torch.channels_last)
    np.testing.assert_allclose(embed(net, x, MEAN, STD), ref64, rtol=1e-5, atol=1e-5)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in net.parameters() if p.dim() == 4)


def test_embed_bad_inputs(cnn_and_images) -> None:
    net, _, x = cnn_and_images
    with pytest.raises(ValueError, match="x_uint8 must have dtype uint8"):
        embed(net, x.float(), MEAN, STD)
    with pytest.raises(ValueError, match="x_uint8 must have shape"):
        embed(net, x[0], MEAN, STD)
    with pytest.raises(ValueError, match="mean/std"):
        embed(net, x, (0.1, 0.2, 0.3), (0.2, 0.2, 0.2))
    with pytest.raises(ValueError, match="batch_size"):
        embed(net, x, MEAN, STD, batch_size=0)


def test_raw_pixel_features() -> None:
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.uint8).reshape(2, 3, 2, 2)
    f = raw_pixel_features(x)
    assert f.shape == (2, 12) and f.dtype == np.float32
    np.testing.assert_allclose(f, x.reshape(2, 12).numpy() / 255.0, rtol=1e-6)
    with pytest.raises(ValueError, match="x_uint8"):
        raw_pixel_features(x.float())


# ----------------------------------------------------------------------------- feature files


def _features():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(20, 6)).astype(np.float32),
        rng.integers(0, 3, 20),
        rng.normal(size=(7, 6)).astype(np.float32),
        rng.integers(0, 3, 7),
    )


def test_features_round_trip(tmp_path: Path) -> None:
    tr, ytr, te, yte = _features()
    meta = {"cell": "digits/infonce/bs32-t0.1-s0", "feat_dim": 6, "note": None}
    path = save_features(tmp_path / "sub" / "features.npz", tr, ytr, te, yte, meta)
    assert path.exists()
    assert os.listdir(path.parent) == ["features.npz"]  # no temporary file left behind
    fs = load_features(path)
    np.testing.assert_array_equal(fs.train_f, tr)
    np.testing.assert_array_equal(fs.train_y, ytr)
    np.testing.assert_array_equal(fs.test_f, te)
    np.testing.assert_array_equal(fs.test_y, yte)
    assert fs.meta == meta
    a, b, c, d, m = fs  # unpacks like a tuple
    assert m == meta


def test_corrupt_features_file_names_the_file(tmp_path: Path) -> None:
    tr, ytr, te, yte = _features()
    good = save_features(tmp_path / "good.npz", tr, ytr, te, yte, {})
    data = good.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    incomplete = tmp_path / "incomplete.npz"
    np.savez(incomplete, train_f=tr)
    for p in (truncated, garbage, incomplete):
        with pytest.raises(ValueError) as info:
            load_features(p)
        msg = str(info.value)
        assert str(p) in msg and "\n" not in msg
    with pytest.raises(FileNotFoundError):
        load_features(tmp_path / "missing.npz")


def test_save_features_rejects_bad_input(tmp_path: Path) -> None:
    tr, ytr, te, yte = _features()
    with pytest.raises(ValueError, match="test_f"):
        save_features(tmp_path / "f.npz", tr, ytr, te[:, :3], yte, {})
    with pytest.raises(ValueError, match="meta"):
        save_features(tmp_path / "f.npz", tr, ytr, te, yte, {"x": object()})
    assert not any(tmp_path.iterdir())


def test_importing_the_probes_does_not_import_faiss() -> None:
    code = "import sys, smallbatch.evaluation.knn, smallbatch.evaluation.linear; sys.exit('faiss' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_status_features_file_round_trips_meta_with_no_rows(tmp_path):
    from smallbatch.evaluation import embed

    path = embed.save_status_features(tmp_path / "f.npz", {"status": "diverged", "cell_id": "x"})
    fs = embed.load_features(path)
    assert fs.train_f.shape == (0, 1) and fs.test_y.shape == (0,)
    assert fs.meta == {"status": "diverged", "cell_id": "x"}
    assert not list(tmp_path.glob(".*tmp"))
