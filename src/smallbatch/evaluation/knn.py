"""The weighted kNN probe of frozen features.

:func:`knn_eval` is the weighted kNN classifier of InstDisc (Wu et al., 2018,
"Unsupervised Feature Learning via Non-Parametric Instance Discrimination"), the
monitor used by lightly's ``knn_predict`` and solo-learn's ``WeightedKNNClassifier``,
with the exact neighbour search done by faiss (CPU or GPU index) or, where faiss has no
GPU support but torch sees CUDA, by a chunked matmul + top-k in torch (:func:`knn_search`).

faiss is imported lazily, by the kNN functions only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from smallbatch.evaluation.embed import check_features, check_labels, check_num_classes, check_pair, rowwise_float32

KNN_BACKENDS = ("auto", "faiss-cpu", "faiss-gpu", "torch")
TORCH_TRAIN_CHUNK = 65536  # train rows per similarity block of the torch search


def _import_faiss(backend: str):
    try:
        import faiss  # lazy: a GPU build initialises CUDA on import
    except ImportError:
        raise ValueError(
            f"backend={backend!r} needs faiss, which is not installed: pip install -e '.[cpu]' "
            "(or '.[gpu]'), or use backend='torch'"
        ) from None
    return faiss


def _faiss_gpus(faiss) -> int:
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def _resolve_knn_backend(backend: str, device: Any) -> tuple[str, torch.device | None]:
    """(backend, torch device) that ``backend`` names. 'auto': faiss's GPU index when faiss
    sees a GPU; else torch on CUDA when torch sees CUDA; else faiss on the CPU (torch on
    the CPU when faiss is not installed). ``device`` is the torch backend's device (None:
    CUDA when torch sees it, else the CPU)."""
    if backend == "torch":
        return "torch", torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "faiss-cpu":
        _import_faiss(backend)
        return backend, None
    if backend == "faiss-gpu":
        if _faiss_gpus(_import_faiss(backend)) == 0:
            raise ValueError(
                "backend='faiss-gpu' but faiss sees no GPU (faiss.get_num_gpus() == 0); use backend='auto' or 'torch'"
            )
        return backend, None
    try:
        import faiss
    except ImportError:
        return _resolve_knn_backend("torch", device)
    if _faiss_gpus(faiss) > 0:
        return "faiss-gpu", None
    if torch.cuda.is_available():
        return _resolve_knn_backend("torch", device)
    return "faiss-cpu", None


def _faiss_search(
    train: np.ndarray, test: np.ndarray, k: int, gpu: bool, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inner-product top-k of each test row among train rows (both already L2-normalised) by
    faiss's exact ``IndexFlatIP`` (on GPU 0 when ``gpu``): (sims, train indices), CPU tensors,
    each row by decreasing similarity. Among equal similarities the order is faiss's: on the
    CPU the heap keeps the first-seen (lowest) indices at the k-th place, in no stated order."""
    import faiss  # lazy

    index: faiss.Index = faiss.IndexFlatIP(train.shape[1])
    if gpu:
        res = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(res, 0, index)
    index.add(train)
    sims = np.empty((test.shape[0], k), np.float32)
    idx = np.empty((test.shape[0], k), np.int64)
    for i in range(0, test.shape[0], batch_size):
        sims[i : i + batch_size], idx[i : i + batch_size] = index.search(test[i : i + batch_size], k)
    return torch.from_numpy(sims), torch.from_numpy(idx)


def _torch_search(
    train: np.ndarray,
    test: np.ndarray,
    k: int,
    device: torch.device,
    batch_size: int,
    train_chunk: int = TORCH_TRAIN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same exact inner-product top-k as :func:`_faiss_search`, by matmul + ``torch.topk``
    on ``device``: (sims, train indices) on ``device``, each row by decreasing similarity and
    equal similarities by increasing train index. The train matrix is copied to ``device``
    once; beyond it, memory is one ``batch_size`` x ``train_chunk`` block of similarities
    (float32) at a time, each block's top-k merged into the running top-k. Which of several
    train rows tied at the k-th similarity is kept is torch.topk's choice."""
    tr = torch.from_numpy(train).to(device)
    sims, idx = [], []
    for i in range(0, test.shape[0], batch_size):
        q = torch.from_numpy(test[i : i + batch_size]).to(device)
        best_s = best_i = None
        for j in range(0, tr.shape[0], train_chunk):
            block = q @ tr[j : j + train_chunk].T
            s, ix = torch.topk(block, min(k, block.shape[1]), dim=1)
            ix += j
            if best_s is not None and best_i is not None:  # set together
                s, ix = torch.cat([best_s, s], 1), torch.cat([best_i, ix], 1)
                s, pos = torch.topk(s, min(k, s.shape[1]), dim=1)
                ix = ix.gather(1, pos)
            best_s, best_i = s, ix
        assert best_s is not None and best_i is not None  # the train set has rows (check_features)
        best_i, pos = torch.sort(best_i, dim=1)  # ties by index: sort by index, then stably by similarity
        best_s, pos2 = torch.sort(best_s.gather(1, pos), dim=1, descending=True, stable=True)
        sims.append(best_s)
        idx.append(best_i.gather(1, pos2))
    return torch.cat(sims), torch.cat(idx)


def _l2_normalize(a: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (computed in float64; zero rows stay zero), float32."""

    def unit(blk: np.ndarray) -> np.ndarray:
        norm = np.sqrt(np.einsum("ij,ij->i", blk, blk, dtype=np.float64))[:, None]
        return blk / np.maximum(norm, 1e-12)

    return rowwise_float32(a, unit)


def _check_knn_args(ks: Any, t: Any, backend: Any, batch_size: Any) -> tuple[int, ...]:
    if isinstance(ks, (int, np.integer)):
        ks = (ks,)
    ks = tuple(ks)
    if not ks:
        raise ValueError("ks must name at least one k")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"ks must hold integers >= 1, got {k!r}")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or not np.isfinite(t):
        raise ValueError(f"t (temperature) must be a finite number > 0, got {t!r}")
    if backend not in KNN_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(KNN_BACKENDS)}, got {backend!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return tuple(int(k) for k in ks)


def knn_search(
    train_f: Any, test_f: Any, k: int, backend: str = "auto", device: Any = None, batch_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most cosine-similar train rows of every test row: (similarities float32,
    train indices int64), each ``(N_test, min(k, N_train))``, by decreasing similarity, as
    tensors on the device that searched (the CPU for faiss). ``backend`` as in
    :func:`knn_predict`; features are L2-normalised first (float64 norms)."""
    _check_knn_args((k,), 1.0, backend, batch_size)
    tr = _l2_normalize(check_features(train_f, "train_f"))
    te = _l2_normalize(check_features(test_f, "test_f"))
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    name, dev = _resolve_knn_backend(backend, device)
    k = min(int(k), tr.shape[0])
    if name == "torch":
        assert dev is not None  # the torch backend always comes with its device
        return _torch_search(tr, te, k, dev, batch_size)
    return _faiss_search(tr, te, k, name == "faiss-gpu", batch_size)


def knn_predict(
    train_f: Any,
    train_y: Any,
    test_f: Any,
    ks: Sequence[int] | int = (20, 200),
    t: float = 0.1,
    num_classes: int | None = None,
    backend: str = "auto",
    device: Any = None,
    batch_size: int = 4096,
    topn: int = 5,
) -> dict[int, np.ndarray]:
    """Class rankings of the InstDisc weighted kNN vote, ``{k: (N_test, min(topn, C)) int64}``.

    Features are L2-normalised, so inner product = cosine similarity s. For each test
    point the k most similar train points vote for their labels with weight exp(s / t)
    (Wu et al., 2018, Eq. 9; lightly ``knn_predict``; solo-learn ``WeightedKNNClassifier``):

        score_c(x) = sum_{i in N_k(x)} exp(s_i / t) * [y_i = c]

    and classes are ranked by score, ties broken towards the lower class index. The exact
    search (:func:`knn_search`) runs once with the largest k; smaller ks reuse the first k
    neighbours. A k larger than the train set is clamped to its size. ``backend``:

    * ``'auto'`` (default): faiss's GPU index when faiss sees a GPU; else torch on CUDA
      when torch sees CUDA (faiss without GPU support); else faiss on the CPU (torch on
      the CPU when faiss is not installed);
    * ``'faiss-cpu'`` / ``'faiss-gpu'``: faiss ``IndexFlatIP`` (its GPU search allows
      k <= 2048); ``'faiss-gpu'`` without a GPU that faiss sees is an error;
    * ``'torch'``: chunked matmul + top-k in torch on ``device`` (None: CUDA when torch sees
      it, else the CPU); the vote then runs there too.

    ``batch_size`` test rows are searched and voted at a time. The weights are computed as
    exp((s - 1) / t), a constant factor exp(-1/t) away from exp(s / t): the ranking is the
    same and small t cannot overflow.
    """
    ks = _check_knn_args(ks, t, backend, batch_size)
    if isinstance(topn, bool) or not isinstance(topn, int) or topn < 1:
        raise ValueError(f"topn must be a positive integer, got {topn!r}")
    tr = check_features(train_f, "train_f")
    ytr = check_labels(train_y, tr.shape[0], "train_y", "train_f")
    c = check_num_classes(num_classes, int(ytr.max()) + 1)
    sims, idx = knn_search(tr, test_f, max(ks), backend=backend, device=device, batch_size=batch_size)
    return _vote(sims, torch.from_numpy(ytr).to(sims.device)[idx], ks, t, c, min(topn, c), batch_size)


def _vote(sims: torch.Tensor, nb_labels: torch.Tensor, ks, t: float, c: int, n_rank: int, batch_size: int):
    """The InstDisc vote of :func:`knn_predict` on the searched neighbours, on their device."""
    k_max = sims.shape[1]
    out = {k: np.empty((sims.shape[0], n_rank), np.int64) for k in ks}
    for i in range(0, sims.shape[0], batch_size):
        w = torch.exp((sims[i : i + batch_size].double() - 1.0) / t)  # shifted by the max cosine: no overflow
        lab = nb_labels[i : i + batch_size]
        for k in ks:
            ke = min(k, k_max)
            scores = torch.zeros(w.shape[0], c, dtype=torch.float64, device=w.device)
            scores.scatter_add_(1, lab[:, :ke], w[:, :ke])
            order = torch.sort(scores, dim=1, descending=True, stable=True).indices
            out[k][i : i + batch_size] = order[:, :n_rank].cpu().numpy()
    return out


def knn_eval(
    train_f: Any,
    train_y: Any,
    test_f: Any,
    test_y: Any,
    ks: Sequence[int] | int = (20, 200),
    t: float = 0.1,
    num_classes: int | None = None,
    backend: str = "auto",
    device: Any = None,
    batch_size: int = 4096,
    primary_k: int | None = None,
) -> dict[str, float]:
    """Weighted kNN accuracy (InstDisc vote, see :func:`knn_predict`) on frozen features.

    Returns a flat dict of numbers (loggable as metrics):

    * ``top1_k{k}``, ``top5_k{k}`` for every requested k (top-5 is trivially 1.0 with
      fewer than 6 classes: the true class is among the min(5, C) best);
    * ``top1``, ``top5``: the values at ``primary_k`` (one of ``ks``; ``eval.knn_primary_k``),
      None: at the largest requested k (k=200 by default, the InstDisc setting);
    * ``k``: that k (the headline names it); ``k_effective_k{k}``: the k actually used, which is smaller
      than the requested one when the train set has fewer than k rows (clamped).
    """
    tr, ytr, te, yte, c = check_pair(train_f, train_y, test_f, test_y, num_classes)
    ranks = knn_predict(tr, ytr, te, ks=ks, t=t, num_classes=c, backend=backend, device=device, batch_size=batch_size)
    result: dict[str, float] = {}
    for k, r in ranks.items():
        result[f"top1_k{k}"] = float(np.mean(r[:, 0] == yte))
        result[f"top5_k{k}"] = float(np.mean((r[:, :5] == yte[:, None]).any(axis=1)))
        result[f"k_effective_k{k}"] = min(k, tr.shape[0])
    if primary_k is not None and primary_k not in ranks:
        raise ValueError(f"eval.knn_primary_k = {primary_k} is not one of eval.knn_k ({', '.join(map(str, ranks))})")
    k_main = max(ranks) if primary_k is None else primary_k
    result["top1"] = result[f"top1_k{k_main}"]
    result["top5"] = result[f"top5_k{k_main}"]
    result["k"] = k_main
    return result


def run_probe(features: Sequence[Any], settings: Mapping[str, Any]) -> dict[str, float]:
    """The registry's kNN probe (:mod:`smallbatch.study.probe_registry`): :func:`knn_eval` at the
    cell's ``knn_k`` and ``knn_t`` with the ``knn_backend`` search."""
    tr, ytr, te, yte = features
    ks = tuple(settings["knn_k"])
    primary = settings.get("knn_primary_k")
    return knn_eval(tr, ytr, te, yte, ks=ks, t=settings["knn_t"], backend=settings["knn_backend"], primary_k=primary)
