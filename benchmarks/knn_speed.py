"""kNN evaluation speed: faiss and torch (smallbatch.evaluation.knn) vs scikit-learn brute force, one run.

All sides find the k=200 nearest train features (cosine) of every test feature, on the
same random features and the same number of threads; the scikit-learn side uses
``NearestNeighbors(metric='cosine', algorithm='brute')``, the torch side
``backend='torch'`` on ``--device`` (default: CUDA when torch sees it, else the CPU). We time

* search: the neighbour search alone (faiss ``IndexFlatIP`` on L2-normalised features,
  the torch chunked matmul + top-k, ``NearestNeighbors.kneighbors``), and
* full:   the whole weighted-kNN evaluation at k=20 and 200 (``knn_eval`` with each
  backend vs the scikit-learn search + the same InstDisc vote in numpy),

and print them side by side with the ratio to faiss (best of ``--repeat`` interleaved
runs), plus how often the searches agree and every side's accuracies.

    python benchmarks/knn_speed.py                       # 50k train x 10k test x 512 dims
    python benchmarks/knn_speed.py --n-train 5000 --n-test 1000 --dim 128 --threads 2
    python benchmarks/knn_speed.py --n-train 10000 --n-test 2000 --dim 2048   # the default study's size
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # synthetic.py: clustered features


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


def _time_sides(args, tr, ytr, te, yte, ks, k_search, dev, sync):
    """Every side's search and full evaluation, interleaved --repeat times: (times, last results)."""
    from sklearn.neighbors import NearestNeighbors
    from threadpoolctl import threadpool_limits

    from smallbatch.evaluation.knn import _faiss_search, _l2_normalize, _torch_search, knn_eval

    times: dict[str, list[float]] = {
        k: [] for k in ("faiss_search", "torch_search", "sk_search", "faiss_full", "torch_full", "sk_full")
    }
    with threadpool_limits(limits=args.threads):
        for _ in range(args.repeat):  # interleaved, so load from other processes hits every side
            t0 = time.perf_counter()
            sims_f, idx_f = _faiss_search(_l2_normalize(tr), _l2_normalize(te), k_search, False, 4096)
            times["faiss_search"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            sims_t, idx_t = _torch_search(_l2_normalize(tr), _l2_normalize(te), k_search, dev, 4096)
            sync()
            times["torch_search"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            nn = NearestNeighbors(n_neighbors=k_search, metric="cosine", algorithm="brute").fit(tr)
            _, idx_s = nn.kneighbors(te)
            times["sk_search"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            res_f = knn_eval(tr, ytr, te, yte, ks=ks, t=0.1, backend="faiss-cpu")
            times["faiss_full"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            res_t = knn_eval(tr, ytr, te, yte, ks=ks, t=0.1, backend="torch", device=dev)
            times["torch_full"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            res_s, _ = sklearn_knn_eval(tr, ytr, te, yte, ks, 0.1, args.classes)
            times["sk_full"].append(time.perf_counter() - t0)
    return times, ((sims_f, idx_f), (sims_t, idx_t), idx_s, res_f, res_t, res_s)


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
    ap.add_argument("--device", default=None, help="the torch backend's device (default: cuda if available, else cpu)")
    args = ap.parse_args()

    import faiss
    import torch
    from synthetic import clustered_features

    from smallbatch.evaluation.knn import _resolve_knn_backend

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)

    # random features with some class structure so the accuracies mean something
    tr, ytr, te, yte = clustered_features(args.n_train, args.n_test, args.dim, args.classes, args.noise, args.seed)
    ks = (20, args.k)

    print(
        f"kNN speed: {args.n_train} train x {args.n_test} test x {args.dim} dims, k={ks}, "
        f"{args.threads} thread(s), best of {args.repeat}, faiss {faiss.__version__}, GPUs seen by faiss: {faiss.get_num_gpus()}"
    )
    k_search = min(args.k, args.n_train)
    _, dev = _resolve_knn_backend("torch", args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"torch backend on {dev}")
    times, out = _time_sides(args, tr, ytr, te, yte, ks, k_search, dev, sync)
    (sims_f, idx_f), (sims_t, idx_t), idx_s, res_f, res_t, res_s = out
    best = {k: min(v) for k, v in times.items()}
    idx_f, idx_t = idx_f.numpy(), idx_t.cpu().numpy()
    overlap = np.mean([len(np.intersect1d(a, b, assume_unique=True)) / len(a) for a, b in zip(idx_f, idx_s)])
    print(f"{'':28s}{'faiss':>10s}{'torch':>10s}{'sklearn':>10s}{'torch/faiss':>13s}{'sklearn/faiss':>15s}")
    for what, label in (("search", f"search k={args.k} (s)"), ("full", f"full kNN eval k=20,{args.k} (s)")):
        f, t_, sk = best[f"faiss_{what}"], best[f"torch_{what}"], best[f"sk_{what}"]
        print(f"{label:28s}{f:10.2f}{t_:10.2f}{sk:10.2f}{t_ / f:13.2f}{sk / f:15.2f}")
    print(
        f"neighbour-set overlap faiss vs sklearn: {overlap:.4f}; "
        f"torch indices equal to faiss's: {np.mean(idx_t == idx_f):.4f} of entries, "
        f"max |sim difference| {np.abs(sims_t.cpu().numpy() - sims_f.numpy()).max():.1e}"
    )
    for k in ks:
        print(
            f"k={k}: top1 faiss {res_f[f'top1_k{k}']:.4f} torch {res_t[f'top1_k{k}']:.4f} sklearn {res_s[f'top1_k{k}']:.4f}; "
            f"top5 faiss {res_f[f'top5_k{k}']:.4f} torch {res_t[f'top5_k{k}']:.4f} sklearn {res_s[f'top5_k{k}']:.4f}"
        )


if __name__ == "__main__":
    main()
