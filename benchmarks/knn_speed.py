"""kNN evaluation speed: faiss (smallbatch.evaluate) vs scikit-learn brute force, one run.

Both sides find the k=200 nearest train features (cosine) of every test feature, on the
same random features and the same number of threads; the scikit-learn side uses
``NearestNeighbors(metric='cosine', algorithm='brute')``. We time

* search: the neighbour search alone (faiss ``IndexFlatIP`` on L2-normalised features vs
  ``NearestNeighbors.kneighbors``), and
* full:   the whole weighted-kNN evaluation at k=20 and 200 (``knn_eval`` vs the
  scikit-learn search + the same InstDisc vote in numpy),

and print them side by side with the ratio (best of ``--repeat`` interleaved runs), plus
how often the two searches agree and both sides' accuracies.

    python benchmarks/knn_speed.py                       # 50k train x 10k test x 512 dims
    python benchmarks/knn_speed.py --n-train 5000 --n-test 1000 --dim 128 --threads 2
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def sklearn_knn_eval(tr, ytr, te, yte, ks, t, num_classes, nbrs_cache=None):
    """Weighted kNN (InstDisc vote) with scikit-learn's brute-force search."""
    from sklearn.neighbors import NearestNeighbors

    k_max = min(max(ks), len(tr))
    if nbrs_cache is None:
        nn = NearestNeighbors(n_neighbors=k_max, metric="cosine", algorithm="brute").fit(tr)
        dist, idx = nn.kneighbors(te)
    else:
        dist, idx = nbrs_cache
    sims = 1.0 - dist
    w = np.exp((sims - 1.0) / t)
    labels = ytr[idx]
    out = {}
    rows = np.arange(len(te))[:, None]
    for k in ks:
        ke = min(k, k_max)
        scores = np.zeros((len(te), num_classes))
        np.add.at(scores, (np.broadcast_to(rows, (len(te), ke)), labels[:, :ke]), w[:, :ke])
        order = np.argsort(-scores, axis=1, kind="stable")
        out[f"top1_k{k}"] = float(np.mean(order[:, 0] == yte))
        out[f"top5_k{k}"] = float(np.mean((order[:, :5] == yte[:, None]).any(1)))
    return out, (dist, idx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=50_000)
    ap.add_argument("--n-test", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--k", type=int, default=200, help="largest k (k=20 is evaluated too)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--noise", type=float, default=6.0, help="noise std around unit-variance class centres")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="repeat each timing, report the minimum")
    args = ap.parse_args()

    import faiss
    import torch
    from threadpoolctl import threadpool_limits

    from smallbatch.evaluate import _faiss_search, _l2_normalize, knn_eval

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)

    # random features with some class structure so the accuracies mean something
    rng = np.random.default_rng(args.seed)
    centers = rng.normal(size=(args.classes, args.dim)).astype(np.float32)
    ytr = rng.integers(0, args.classes, args.n_train)
    yte = rng.integers(0, args.classes, args.n_test)
    tr = centers[ytr] + args.noise * rng.standard_normal((args.n_train, args.dim), dtype=np.float32)
    te = centers[yte] + args.noise * rng.standard_normal((args.n_test, args.dim), dtype=np.float32)
    ks = (20, args.k)

    print(
        f"kNN speed: {args.n_train} train x {args.n_test} test x {args.dim} dims, k={ks}, "
        f"{args.threads} thread(s), best of {args.repeat}, faiss {faiss.__version__}, GPUs seen by faiss: {faiss.get_num_gpus()}"
    )
    from sklearn.neighbors import NearestNeighbors

    k_search = min(args.k, args.n_train)
    times: dict[str, list[float]] = {"faiss_search": [], "sk_search": [], "faiss_full": [], "sk_full": []}
    with threadpool_limits(limits=args.threads):
        for _ in range(args.repeat):  # interleaved, so load from other processes hits both sides
            t0 = time.perf_counter()
            sims_f, idx_f = _faiss_search(_l2_normalize(tr), _l2_normalize(te), k_search, False, 4096)
            times["faiss_search"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            nn = NearestNeighbors(n_neighbors=k_search, metric="cosine", algorithm="brute").fit(tr)
            dist_s, idx_s = nn.kneighbors(te)
            times["sk_search"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            res_f = knn_eval(tr, ytr, te, yte, ks=ks, t=0.1, use_gpu=False)
            times["faiss_full"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            res_s, _ = sklearn_knn_eval(tr, ytr, te, yte, ks, 0.1, args.classes)
            times["sk_full"].append(time.perf_counter() - t0)
    t_faiss_search, t_sk_search, t_faiss_full, t_sk_full = (min(times[k]) for k in times)

    overlap = np.mean([len(np.intersect1d(a, b, assume_unique=True)) / len(a) for a, b in zip(idx_f, idx_s)])
    print(f"{'':28s}{'faiss':>10s}{'sklearn':>10s}{'sklearn/faiss':>15s}")
    print(f"{'search k=' + str(args.k) + ' (s)':28s}{t_faiss_search:10.2f}{t_sk_search:10.2f}{t_sk_search / t_faiss_search:15.2f}")
    print(f"{'full kNN eval k=20,' + str(args.k) + ' (s)':28s}{t_faiss_full:10.2f}{t_sk_full:10.2f}{t_sk_full / t_faiss_full:15.2f}")
    print(f"neighbour-set overlap faiss vs sklearn: {overlap:.4f}")
    for k in ks:
        print(
            f"k={k}: top1 faiss {res_f[f'top1_k{k}']:.4f} sklearn {res_s[f'top1_k{k}']:.4f}; "
            f"top5 faiss {res_f[f'top5_k{k}']:.4f} sklearn {res_s[f'top5_k{k}']:.4f}"
        )


if __name__ == "__main__":
    main()
