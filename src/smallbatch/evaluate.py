"""Evaluation of frozen representations: embedding, weighted kNN (faiss), linear probe.

* :func:`embed` runs a frozen backbone (eval mode, no grad) over uint8 images with the
  deterministic eval-time normalisation ``(x/255 - mean) / std`` (``augment.normalize``).
* :func:`save_features` / :func:`load_features` store train/test features in one ``.npz``
  (atomic write).
* :func:`knn_eval` is the weighted kNN classifier of InstDisc (Wu et al., 2018,
  "Unsupervised Feature Learning via Non-Parametric Instance Discrimination"), the
  monitor used by lightly's ``knn_predict`` and solo-learn's ``WeightedKNNClassifier``,
  with the exact neighbour search done by faiss (CPU or GPU index) or, where faiss has no
  GPU support but torch sees CUDA, by a chunked matmul + top-k in torch (:func:`knn_search`).
* :func:`linear_eval` trains a multinomial logistic regression on frozen, standardised
  features (preconditioned L-BFGS by default).
* :func:`raw_pixel_features` is the raw-pixel baseline; the random-init baseline is
  :func:`embed` on an untrained backbone.

faiss is imported lazily, by the kNN functions only.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from smallbatch.augment import normalize
from smallbatch.io import atomic_write

__all__ = [
    "embed",
    "save_features",
    "load_features",
    "FeatureSet",
    "knn_search",
    "knn_predict",
    "knn_eval",
    "linear_eval",
    "standardise",
    "fit_linear",
    "linear_top1",
    "raw_pixel_features",
]


# ----------------------------------------------------------------------------- helpers


def _as_numpy(a: Any, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    try:
        return np.asarray(a)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise ValueError(f"{name} must be array-like, got {type(a).__name__}") from exc


def _as_uint8_images(x: Any, name: str = "x_uint8") -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(_as_numpy(x, name)))
    if t.dtype != torch.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {t.dtype}")
    if t.ndim != 4:
        raise ValueError(f"{name} must have shape (N, C, H, W), got {tuple(t.shape)}")
    return t


def _check_features(f: Any, name: str) -> np.ndarray:
    a = _as_numpy(f, name)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name} must be a non-empty 2-D array (N, F), got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be numeric, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or inf")
    return a


def _check_labels(y: Any, n: int, name: str, feat_name: str) -> np.ndarray:
    a = _as_numpy(y, name)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} labels but {feat_name} has {n} rows")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integer class labels, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name} must hold labels >= 0, got min {a.min()}")
    return a.astype(np.int64)


def _check_pair(train_f, train_y, test_f, test_y, num_classes):
    tr = _check_features(train_f, "train_f")
    te = _check_features(test_f, "test_f")
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    ytr = _check_labels(train_y, tr.shape[0], "train_y", "train_f")
    yte = _check_labels(test_y, te.shape[0], "test_y", "test_f")
    return tr, ytr, te, yte, _check_num_classes(num_classes, int(max(ytr.max(), yte.max())) + 1)


def _check_num_classes(num_classes: Any, seen: int) -> int:
    if num_classes is None:
        return seen
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < seen:
        raise ValueError(f"num_classes must be an integer >= max label + 1 = {seen}, got {num_classes!r}")
    return int(num_classes)


# ----------------------------------------------------------------------------- embed


@torch.no_grad()
def embed(
    backbone: nn.Module,
    x_uint8: Any,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 1024,
    device: str | torch.device = "cpu",
) -> np.ndarray:
    """Frozen backbone features of uint8 images ``(N, C, H, W)`` -> float32 ``(N, F)``.

    The backbone runs in eval mode (BatchNorm uses its running statistics and they are
    not updated) under ``torch.no_grad``; every submodule's training flag and the
    backbone's device are restored afterwards. Images are normalised deterministically, ``(x/255-mean)/std``.
    """
    x = _as_uint8_images(x_uint8)
    if len(mean) != x.shape[1] or len(std) != x.shape[1]:
        raise ValueError(
            f"mean/std must have one entry per channel ({x.shape[1]}), got {len(mean)} and {len(std)}"
        )
    if any(s <= 0 for s in std):
        raise ValueError(f"std must be positive, got {tuple(std)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    device = torch.device(device)
    first = next(backbone.parameters(), None)
    old_device = first.device if first is not None else None
    modes = [(m, m.training) for m in backbone.modules()]
    backbone.to(device).eval()
    nchw = _to_channels_last(backbone)
    try:
        chunks = []
        for i in range(0, x.shape[0], batch_size):
            xb = normalize(x[i : i + batch_size].to(device, non_blocking=True), mean, std)
            if nchw is not None:
                xb = xb.contiguous(memory_format=torch.channels_last)
            chunks.append(backbone(xb).float().cpu())
        out = torch.cat(chunks).numpy() if chunks else np.zeros((0, 0), np.float32)
    finally:
        for m, mode in modes:
            m.training = mode
        for p in nchw or []:
            p.data = p.data.contiguous()
        if old_device is not None:
            backbone.to(old_device)
    return np.ascontiguousarray(out, dtype=np.float32)


def _to_channels_last(backbone: nn.Module) -> list[torch.Tensor] | None:
    """Put the backbone's 4-D weights in NHWC, the layout of oneDNN's and cuDNN's fast
    convolutions (as training does; the default cell embeds in 0.8 instead of 1.9 s, features
    equal to ~1e-6); returns the weights that were NCHW (for the caller to restore), or None
    for a float64 backbone (kept NCHW, as in training) or one without 4-D weights."""
    weights = [p for p in backbone.parameters() if p.dim() == 4]
    if not weights or any(p.dtype == torch.float64 for p in weights):
        return None
    nchw = [p for p in weights if not p.is_contiguous(memory_format=torch.channels_last)]
    for p in nchw:
        p.data = p.data.contiguous(memory_format=torch.channels_last)
    return nchw


def raw_pixel_features(x_uint8: Any) -> np.ndarray:
    """Raw-pixel baseline: uint8 images ``(N, C, H, W)`` -> float32 ``(N, C*H*W)`` in [0, 1]."""
    x = _as_uint8_images(x_uint8)
    return x.reshape(x.shape[0], -1).numpy().astype(np.float32) / np.float32(255.0)


# ----------------------------------------------------------------------------- feature files


class FeatureSet(NamedTuple):
    train_f: np.ndarray
    train_y: np.ndarray
    test_f: np.ndarray
    test_y: np.ndarray
    meta: dict


_FEATURE_KEYS = ("train_f", "train_y", "test_f", "test_y", "meta_json")


def save_features(
    path: str | Path,
    train_f: Any,
    train_y: Any,
    test_f: Any,
    test_y: Any,
    meta: dict | None = None,
) -> Path:
    """Write train/test features, labels and a JSON-able ``meta`` dict to one ``.npz``.

    The file is written to a temporary file in the same directory and moved into place
    with ``os.replace``, so a reader never sees a half-written file.
    """
    path = Path(path)
    tr, ytr, te, yte, _ = _check_pair(train_f, train_y, test_f, test_y, None)
    return _write_features(path, tr, ytr, te, yte, meta or {})


def save_status_features(path: str | Path, meta: dict) -> Path:
    """Write a features file with no rows, only ``meta`` (e.g. ``{"status": "diverged"}``).

    A diverged cell has no features, but its ``embed`` step still has an output, in the
    same layout, so :func:`load_features` reads it and the probes record the status.
    """
    empty_f, empty_y = np.zeros((0, 1), np.float32), np.zeros(0, np.int64)
    return _write_features(Path(path), empty_f, empty_y, empty_f, empty_y, meta)


def _write_features(path: Path, tr, ytr, te, yte, meta: dict) -> Path:
    """Write the features file through the one atomic writer (:func:`smallbatch.io.atomic_write`)."""
    try:
        meta_json = json.dumps(meta, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"meta must be JSON-serialisable: {exc}") from exc
    return atomic_write(path, lambda fh: np.savez(fh, train_f=tr, train_y=ytr, test_f=te, test_y=yte,
                                                 meta_json=np.array(meta_json)))


def load_features(path: str | Path) -> FeatureSet:
    """Read a file written by :func:`save_features`.

    Raises ``FileNotFoundError`` if it is missing and a one-line ``ValueError`` naming the
    file if it is truncated, corrupt or lacks a key.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"features file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in _FEATURE_KEYS if k not in z.files]
            if missing:
                raise KeyError(f"missing keys {missing}")
            arrays = {k: z[k] for k in _FEATURE_KEYS}  # reading checks each member's CRC
        meta = json.loads(str(arrays["meta_json"]))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, io.UnsupportedOperation) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not a readable features file ({msg})") from None
    return FeatureSet(arrays["train_f"], arrays["train_y"], arrays["test_f"], arrays["test_y"], meta)


# ----------------------------------------------------------------------------- kNN

KNN_BACKENDS = ("auto", "faiss-cpu", "faiss-gpu", "torch")
TORCH_TRAIN_CHUNK = 65536  # train rows per similarity block of the torch search


def _import_faiss(backend: str):
    try:
        import faiss  # lazy: a GPU build initialises CUDA on import
    except ImportError:
        raise ValueError(f"backend={backend!r} needs faiss, which is not installed: pip install -e '.[cpu]' "
                         "(or '.[gpu]'), or use backend='torch'") from None
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
            raise ValueError("backend='faiss-gpu' but faiss sees no GPU (faiss.get_num_gpus() == 0); "
                             "use backend='auto' or 'torch'")
        return backend, None
    try:
        import faiss
    except ImportError:
        faiss = None
    if faiss is not None and _faiss_gpus(faiss) > 0:
        return "faiss-gpu", None
    if torch.cuda.is_available() or faiss is None:
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

    index = faiss.IndexFlatIP(train.shape[1])
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
    train: np.ndarray, test: np.ndarray, k: int, device: torch.device, batch_size: int,
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
            if best_s is not None:
                s, ix = torch.cat([best_s, s], 1), torch.cat([best_i, ix], 1)
                s, pos = torch.topk(s, min(k, s.shape[1]), dim=1)
                ix = ix.gather(1, pos)
            best_s, best_i = s, ix
        best_i, pos = torch.sort(best_i, dim=1)  # ties by index: sort by index, then stably by similarity
        best_s, pos2 = torch.sort(best_s.gather(1, pos), dim=1, descending=True, stable=True)
        sims.append(best_s)
        idx.append(best_i.gather(1, pos2))
    return torch.cat(sims), torch.cat(idx)


ROW_BLOCK = 1024  # rows per block of the float64 passes over a feature matrix


def _mean_std(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and (population) standard deviation in float64, as numpy's two-pass
    ``mean`` / ``std(dtype=float64)`` define them, summed ``ROW_BLOCK`` rows at a time (numpy's std
    makes a full-size float64 copy: 0.37 of the default probe's 3.3 s)."""
    mu = a.mean(axis=0, dtype=np.float64)
    ss = np.zeros(a.shape[1], np.float64)
    for i in range(0, a.shape[0], ROW_BLOCK):
        d = a[i : i + ROW_BLOCK].astype(np.float64) - mu
        ss += np.einsum("ij,ij->j", d, d)
    return mu, np.sqrt(ss / max(1, a.shape[0]))


def _rowwise_float32(a: np.ndarray, fn) -> np.ndarray:
    """``fn`` applied to ``ROW_BLOCK`` rows of ``a`` at a time, results stored as float32: float64
    arithmetic inside ``fn`` without full-size float64 temporaries (and their page faults)."""
    out = np.empty(a.shape, np.float32)
    for i in range(0, a.shape[0], ROW_BLOCK):
        out[i : i + ROW_BLOCK] = fn(a[i : i + ROW_BLOCK])
    return out


def _l2_normalize(a: np.ndarray) -> np.ndarray:
    """Rows divided by their L2 norm (computed in float64; zero rows stay zero), float32."""

    def unit(blk: np.ndarray) -> np.ndarray:
        norm = np.sqrt(np.einsum("ij,ij->i", blk, blk, dtype=np.float64))[:, None]
        return blk / np.maximum(norm, 1e-12)

    return _rowwise_float32(a, unit)


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
    tr = _l2_normalize(_check_features(train_f, "train_f"))
    te = _l2_normalize(_check_features(test_f, "test_f"))
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    name, dev = _resolve_knn_backend(backend, device)
    k = min(int(k), tr.shape[0])
    if name == "torch":
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
    tr = _check_features(train_f, "train_f")
    ytr = _check_labels(train_y, tr.shape[0], "train_y", "train_f")
    c = _check_num_classes(num_classes, int(ytr.max()) + 1)
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
) -> dict[str, float]:
    """Weighted kNN accuracy (InstDisc vote, see :func:`knn_predict`) on frozen features.

    Returns a flat dict of numbers (loggable as metrics):

    * ``top1_k{k}``, ``top5_k{k}`` for every requested k (top-5 is trivially 1.0 with
      fewer than 6 classes: the true class is among the min(5, C) best);
    * ``top1``, ``top5``: the values at the largest requested k (k=200 by default, the
      InstDisc setting);
    * ``k``: that largest k; ``k_effective_k{k}``: the k actually used, which is smaller
      than the requested one when the train set has fewer than k rows (clamped).
    """
    tr, ytr, te, yte, c = _check_pair(train_f, train_y, test_f, test_y, num_classes)
    ranks = knn_predict(tr, ytr, te, ks=ks, t=t, num_classes=c, backend=backend, device=device, batch_size=batch_size)
    result: dict[str, float] = {}
    for k, r in ranks.items():
        result[f"top1_k{k}"] = float(np.mean(r[:, 0] == yte))
        result[f"top5_k{k}"] = float(np.mean((r[:, :5] == yte[:, None]).any(axis=1)))
        result[f"k_effective_k{k}"] = min(k, tr.shape[0])
    k_main = max(ranks)
    result["top1"] = result[f"top1_k{k_main}"]
    result["top5"] = result[f"top5_k{k_main}"]
    result["k"] = k_main
    return result


# ----------------------------------------------------------------------------- linear probe

LINEAR_OPTIMIZERS = ("lbfgs-precond", "lbfgs", "adam")

# Preconditioner of 'lbfgs-precond': the second moment of (a strided subset of) the
# standardised train rows plus PRECOND_MU * I. Measured on one default-study cell
# (infonce bs256), objective minus its minimum after ~100 / ~250 iterations: 1-2e-4 / 6e-6..2e-5
# for mu 0.1, 0.3 and 1 (1 best) with all rows; mu 1 with 2,500 or 5,000 of the 10k rows as
# good as with all (and 2,500 rows cost a fifth of the product over all).
PRECOND_ROWS = 2500
PRECOND_MU = 1.0


class LinearFit(NamedTuple):
    """A fitted probe on standardised features: logits = x @ weight.T + bias."""

    weight: torch.Tensor  # (C, F)
    bias: torch.Tensor  # (C,)
    iterations: int  # L-BFGS iterations, or Adam optimizer steps


def _check_linear_args(epochs, optimizer, lr, weight_decay, batch_size, tol) -> float:
    """Validate the probe's settings; returns lr with its per-optimizer default filled in."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if optimizer not in LINEAR_OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(LINEAR_OPTIMIZERS)}, got {optimizer!r}")
    if lr is None:
        lr = 1e-3 if optimizer == "adam" else 1.0
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if optimizer != "adam":
            raise ValueError(f"batch_size must be None with optimizer={optimizer!r} (full-batch); use optimizer='adam'")
    return float(lr)


def _standardise(tr: np.ndarray, te: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test features standardised with the train set's per-dimension mean and std
    (float64 statistics; a dimension with std < 1e-8 is only centred), as float32 tensors."""
    mu, sd = _mean_std(tr)
    sd = np.where(sd < 1e-8, 1.0, sd)
    return tuple(torch.from_numpy(_rowwise_float32(a, lambda blk: (blk - mu) / sd)).to(device) for a in (tr, te))


def _softmax_loss_grad(x, x_t, y, weight, bias, weight_decay):
    """Mean cross-entropy of softmax(x @ weight.T + bias) + weight_decay/2 * ||weight||^2, and
    its gradients (weight, bias). The two products with the features run in their dtype
    (float32), everything else in ``weight``'s (float64); ``x_t`` is ``x.T`` made contiguous
    (the faster layout for the logits' product on MKL)."""
    n = x.shape[0]
    z = (weight.to(x.dtype) @ x_t).T.to(weight.dtype) + bias
    lse = torch.logsumexp(z, dim=1)
    rows = torch.arange(n, device=x.device)
    loss = (lse - z[rows, y]).mean() + 0.5 * weight_decay * (weight * weight).sum()
    dz = torch.exp(z - lse[:, None])
    dz[rows, y] -= 1.0
    dz /= n
    g_weight = (dz.T.to(x.dtype) @ x).to(weight.dtype) + weight_decay * weight
    return loss, g_weight, dz.sum(dim=0)


def _precond_factor(x: torch.Tensor, mu: float, rows: int) -> torch.Tensor:
    """Lower Cholesky factor (float64) of S + mu*I, S the second moment of every
    ``n // rows``-th standardised train row (the data term of the loss's Hessian, up to the
    softmax weights)."""
    xs = x[:: max(1, x.shape[0] // rows)]
    s = (xs.T @ xs).double() / xs.shape[0]
    s.diagonal().add_(mu)
    return torch.linalg.cholesky(s)


def _lbfgs(params: list[torch.Tensor], lr: float, max_iter: int, max_eval: int | None = None) -> torch.optim.LBFGS:
    """The probe's L-BFGS: history 20, strong-Wolfe line search (max_eval None: 1.25 * max_iter)."""
    return torch.optim.LBFGS(params, lr=lr, max_iter=max_iter, max_eval=max_eval, history_size=20,
                             tolerance_grad=1e-9, tolerance_change=1e-12, line_search_fn="strong_wolfe")


def _fit_lbfgs_precond(x, y, c, epochs, lr, weight_decay, tol) -> LinearFit:
    """L-BFGS on v = weight @ L, L the Cholesky factor of :func:`_precond_factor`: the same
    objective and optimum as on ``weight``, with the features' correlations divided out of
    its curvature. Runs in blocks of 10 iterations and stops after ``epochs`` iterations, or
    once a block lowered the objective by no more than ``tol`` times its value."""
    x_t = x.T.contiguous()
    chol = _precond_factor(x, PRECOND_MU, PRECOND_ROWS).to(x.dtype)  # mu keeps L well-conditioned: float32 solves
    v = torch.zeros(c, x.shape[1], dtype=torch.float64, device=x.device, requires_grad=True)
    b = torch.zeros(c, dtype=torch.float64, device=x.device, requires_grad=True)
    cache: dict[str, Any] = {}

    def weight_of(v_: torch.Tensor) -> torch.Tensor:  # weight = v L^-1
        return torch.linalg.solve_triangular(chol.T, v_.T.to(x.dtype), upper=True).T.double()

    def closure() -> torch.Tensor:  # a block starts where the last one ended: reuse that evaluation
        with torch.no_grad():
            if not (cache and torch.equal(cache["v"], v) and torch.equal(cache["b"], b)):
                loss, g_w, g_b = _softmax_loss_grad(x, x_t, y, weight_of(v), b, weight_decay)
                g_v = torch.linalg.solve_triangular(chol, g_w.T.to(x.dtype), upper=False).T.double()  # g_w L^-T
                cache.update(v=v.detach().clone(), b=b.detach().clone(), out=(loss, g_v, g_b))
            loss, v.grad, b.grad = cache["out"][0], cache["out"][1].clone(), cache["out"][2].clone()
        return loss

    opt = _lbfgs([v, b], lr, 10, max_eval=10**6)  # a block ends on iterations, not on evaluations
    state = opt.state[v]
    last = None
    while state.get("n_iter", 0) < epochs:
        done = state.get("n_iter", 0)
        opt.param_groups[0]["max_iter"] = min(10, epochs - done)
        loss = float(opt.step(closure))  # the objective where this block starts
        if last is not None and last - loss <= tol * abs(loss):
            break
        if state["n_iter"] - done < opt.param_groups[0]["max_iter"]:  # L-BFGS's own tolerances
            break
        last = loss
    with torch.no_grad():
        return LinearFit(weight_of(v).float(), b.float(), int(state.get("n_iter", 0)))


def _fit_lbfgs(x, y, c, epochs, lr, weight_decay) -> LinearFit:
    """The first probe solver: ``epochs`` L-BFGS iterations (at most 1.25 * epochs
    evaluations) on the float32 objective by autograd, tolerances that float32 never meets."""
    layer = nn.Linear(x.shape[1], c).to(x.device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    ce = nn.CrossEntropyLoss()
    opt = _lbfgs(list(layer.parameters()), lr, epochs)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ce(layer(x), y) + 0.5 * weight_decay * layer.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearFit(layer.weight.detach(), layer.bias.detach(), int(opt.state[layer.weight].get("n_iter", 0)))


def _fit_adam(x, y, c, epochs, lr, weight_decay, batch_size, seed) -> LinearFit:
    """Adam with a cosine schedule over ``epochs`` passes of mini-batches of ``batch_size``
    rows (full batch when None), shuffled by a generator seeded with ``seed``."""
    layer = nn.Linear(x.shape[1], c).to(x.device)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    ce = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    n = x.shape[0]
    bs = n if batch_size is None else min(batch_size, n)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * ((n + bs - 1) // bs))
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen).to(x.device) if bs < n else None
        for j in range(0, n, bs):
            sel = slice(None) if perm is None else perm[j : j + bs]
            opt.zero_grad()
            (ce(layer(x[sel]), y[sel]) + 0.5 * weight_decay * layer.weight.pow(2).sum()).backward()
            opt.step()
            sched.step()
            steps += 1
    return LinearFit(layer.weight.detach(), layer.bias.detach(), steps)


@torch.no_grad()
def _linear_metrics(fit: LinearFit, xtr, ytr, xte, yte, c: int, weight_decay: float) -> dict[str, float]:
    """Test top-1/top-5, train top-1, the float32 objective on the train set, iterations."""
    logits_tr = nn.functional.linear(xtr, fit.weight, fit.bias)
    logits = nn.functional.linear(xte, fit.weight, fit.bias)
    loss = nn.functional.cross_entropy(logits_tr, ytr) + 0.5 * weight_decay * fit.weight.pow(2).sum()
    top5_idx = logits.topk(min(5, c), dim=1).indices
    return {
        "top1": (logits.argmax(1) == yte).float().mean().item(),
        "top5": (top5_idx == yte[:, None]).any(dim=1).float().mean().item(),
        "train_top1": (logits_tr.argmax(1) == ytr).float().mean().item(),
        "train_loss": loss.item(),
        "iterations": fit.iterations,
    }


def linear_eval(
    train_f: Any,
    train_y: Any,
    test_f: Any,
    test_y: Any,
    epochs: int = 100,
    lr: float | None = None,
    weight_decay: float = 1e-3,
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    optimizer: str = "lbfgs-precond",
    num_classes: int | None = None,
    tol: float = 1e-5,
) -> dict[str, float]:
    """Linear probe: multinomial logistic regression on frozen, standardised features.

    Protocol: features are standardised with the train set's per-dimension mean and std
    (the same transform applied to test); a linear layer W h + b (zero-initialised) is
    trained to minimise cross-entropy + ``weight_decay``/2 * ||W||^2; we report test
    top-1/top-5, train top-1, the objective (``train_loss``) and ``iterations``. Optimizers:

    * ``'lbfgs-precond'`` (default): full-batch L-BFGS (``lr`` defaults to 1.0) on a
      preconditioned parametrisation of the same convex objective (:func:`_fit_lbfgs_precond`),
      at most ``epochs`` iterations, stopping once 10 iterations lower the objective by no
      more than ``tol`` times its value. ``batch_size`` must be None.
    * ``'lbfgs'``: the first solver, kept for comparison: exactly ``epochs`` plain L-BFGS
      iterations (float32, autograd); ``tol`` is not used.
    * ``'adam'``: Adam (``lr`` defaults to 1e-3) with a cosine schedule over ``epochs``
      passes of shuffled mini-batches of ``batch_size`` rows (full batch when None),
      shuffled by a generator seeded with ``seed``.

    What was measured (benchmarks/linear_probe.py, one thread, load average 1-1.8; 8 cells
    of the default study (10k x 2,048 features, ``pool_grid: 4``; infonce/dcl/flatnce at
    bs16/bs256, dclw bs32, eqco bs64) and its raw-pixel and two random-init baselines): the
    objective is badly conditioned (the standardised features' covariance has eigenvalues
    0.004..300, weight_decay is 1e-3), so 100 plain L-BFGS iterations stop well short of the
    minimum. Against the minimum (this solver run to 600 iterations with tol 0; on one cell
    checked against float64 scipy L-BFGS-B run to convergence, 2,965 iterations: same test
    predictions), per file, 2,000 test images:

        solver                   time / old   predictions != minimum's   |top-1 - minimum's|
        'lbfgs', 100 it (old)       1.00            18..42                  0..8 images
        'lbfgs-precond', 60 it      0.66 (max 0.74)  7..13                  0..6 images
        'lbfgs-precond', 100 it     0.98 (max 1.06)  1..8                   0..4 images
        'lbfgs-precond', 300 it     2.38 (max 2.80)  0..2                   0..1 image
          (tol 1e-5: stopped after 140-300 iterations)

    Preconditioning makes each iteration worth about three plain ones (100 preconditioned
    iterations end where 300 plain ones do). Reaching the minimum, which the first solver
    never did, takes ~300 of them.

    How this differs from SimCLR's linear evaluation (Chen et al., 2020, Appendix B.6:
    90 epochs of SGD/LARS with Nesterov momentum on ImageNet, with random-crop and
    flip augmentation, i.e. the backbone runs every epoch): here the features are
    computed once, without augmentation, and the probe is a convex problem solved on
    them -- much cheaper and deterministic, typically a little below the augmented
    protocol's accuracy. Within a run the test set is not used (no early stopping, no
    per-run tuning). L-BFGS and weight_decay 1e-3 were chosen once, on 10k Fashion-MNIST
    16x16 images (random-init small_cnn 128-d features and raw pixels, 5k test images): 100
    plain L-BFGS iterations matched or beat Adam (mini-batch 256 for 20 or 100 epochs, or
    full-batch for 100) by 0-5 points top-1; weight_decay 1e-3 scored like 1e-4 and above 1e-2.
    """
    tr, ytr, te, yte, c = _check_pair(train_f, train_y, test_f, test_y, num_classes)
    lr = _check_linear_args(epochs, optimizer, lr, weight_decay, batch_size, tol)
    return _linear_probe(tr, ytr, te, yte, c, optimizer=optimizer, epochs=epochs, lr=lr, weight_decay=weight_decay,
                         batch_size=batch_size, seed=seed, tol=tol, device=torch.device(device))[0]


def standardise(train_f: Any, test_f: Any, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test features standardised with the train rows' per-dimension mean and std
    (the linear probe's transform; it uses no labels), as float32 tensors on ``device``."""
    tr, te = _check_features(train_f, "train_f"), _check_features(test_f, "test_f")
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    return _standardise(tr, te, torch.device(device))


def fit_linear(x: torch.Tensor, y: torch.Tensor, num_classes: int, weight_decay: float, epochs: int = 100,
               tol: float = 1e-5) -> LinearFit:
    """The default probe's fit ('lbfgs-precond', :func:`linear_eval`) on rows already
    standardised (:func:`standardise`): ``y`` int64 labels on ``x``'s device."""
    _check_linear_args(epochs, "lbfgs-precond", None, weight_decay, None, tol)
    return _fit_lbfgs_precond(x, y, int(num_classes), epochs, 1.0, float(weight_decay), tol)


@torch.no_grad()
def linear_top1(fit: LinearFit, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy (a fraction) of a fitted probe on standardised rows ``x``."""
    return (nn.functional.linear(x, fit.weight, fit.bias).argmax(1) == y).float().mean().item()


def _linear_probe(tr, ytr, te, yte, c, *, optimizer, epochs, lr, weight_decay, batch_size, seed, tol, device):
    """:func:`linear_eval` on checked arguments; also returns the fit and the standardised
    train/test tensors, for benchmarks/linear_probe.py."""
    xtr, xte = _standardise(tr, te, device)
    ytr_t, yte_t = torch.from_numpy(ytr).to(device), torch.from_numpy(yte).to(device)
    if optimizer == "lbfgs-precond":
        fit = _fit_lbfgs_precond(xtr, ytr_t, c, epochs, lr, weight_decay, tol)
    elif optimizer == "lbfgs":
        fit = _fit_lbfgs(xtr, ytr_t, c, epochs, lr, weight_decay)
    else:
        fit = _fit_adam(xtr, ytr_t, c, epochs, lr, weight_decay, batch_size, seed)
    return _linear_metrics(fit, xtr, ytr_t, xte, yte_t, c, weight_decay), fit, (xtr, ytr_t, xte, yte_t)
