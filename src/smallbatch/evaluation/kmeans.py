"""The k-means probe of frozen features: how well the classes fall into clusters, without labels.

The test features (L2-normalised rows, as the kNN probe compares them) are clustered by
k-means into as many clusters as the data set has classes, with a fixed seed
(:data:`SEED`: every cell is clustered alike) and the best (least inertia) of
:data:`RESTARTS` starts -- by ``faiss.Kmeans`` where faiss imports,
else by Lloyd's algorithm in torch (:func:`torch_kmeans`, k-means++ seeding).  The probe
reports the normalised mutual information of the clusters with the labels
(:func:`sklearn.metrics.normalized_mutual_info_score`, arithmetic mean: 1 when the clusters
are the classes, about 0 when they are independent of them), logged as ``kmeans/nmi`` in
points (x 100, as the accuracies' percent).  faiss and sklearn are imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import percent
from .embed import check_features, check_labels
from .knn import _l2_normalize

__all__ = ["SEED", "RESTARTS", "kmeans_assign", "torch_kmeans", "lloyd", "kmeans_nmi", "run_probe"]

#: the clustering's seed, the same for every cell
SEED = 0
#: k-means runs from different starts; the one of least inertia (sum of squared distances) is kept
RESTARTS = 5


def torch_kmeans(x: np.ndarray, k: int, iterations: int, seed: int = SEED) -> np.ndarray:
    """Cluster of each row: the least-inertia of :data:`RESTARTS` runs of :func:`lloyd`
    (starts drawn with ``seed``, ``seed + 1``, ...)."""
    xt = torch.from_numpy(np.asarray(x, np.float64))
    runs = [lloyd(xt, k, iterations, seed + r) for r in range(RESTARTS)]
    return min(runs, key=lambda run: run[1])[0].numpy()


def lloyd(xt: torch.Tensor, k: int, iterations: int, seed: int) -> tuple[torch.Tensor, float]:
    """(cluster of each row, inertia) by Lloyd's algorithm in float64 from a k-means++ start drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    centres = xt[torch.randint(len(xt), (1,), generator=g)]
    for _ in range(1, k):  # k-means++: the next centre drawn in proportion to the squared distance
        d2 = torch.cdist(xt, centres).min(dim=1).values ** 2
        p = d2 / d2.sum() if d2.sum() > 0 else torch.full_like(d2, 1.0 / len(d2))
        centres = torch.cat([centres, xt[torch.multinomial(p, 1, generator=g)]])
    assign = torch.cdist(xt, centres).argmin(dim=1)
    for _ in range(iterations):
        for j in range(k):
            members = xt[assign == j]
            if len(members):  # an empty cluster keeps its centre
                centres[j] = members.mean(dim=0)
        new = torch.cdist(xt, centres).argmin(dim=1)
        if torch.equal(new, assign):
            break
        assign = new
    for j in range(k):  # the centres of the final assignment
        if (assign == j).any():
            centres[j] = xt[assign == j].mean(dim=0)
    return assign, float(((xt - centres[assign]) ** 2).sum())


def _faiss_kmeans(x: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray | None:
    try:
        import faiss
    except ImportError:
        return None
    km = faiss.Kmeans(
        x.shape[1],
        k,
        niter=iterations,
        nredo=RESTARTS,
        seed=seed,
        verbose=False,
        min_points_per_centroid=1,
        max_points_per_centroid=len(x),
    )
    km.train(x)
    return km.index.search(x, 1)[1][:, 0].astype(np.int64)


def kmeans_assign(features: Any, k: int, iterations: int = 50, seed: int = SEED) -> np.ndarray:
    """The cluster of each L2-normalised row of ``features`` among ``k`` (faiss, else torch)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    x = _l2_normalize(check_features(features, "features"))
    if k > len(x):
        raise ValueError(f"k = {k} clusters need at least {k} rows, got {len(x)}")
    out = _faiss_kmeans(x, int(k), int(iterations), seed)
    return torch_kmeans(x, int(k), int(iterations), seed) if out is None else out


def kmeans_nmi(features: Any, labels: Any, k: int, iterations: int = 50, seed: int = SEED) -> float:
    """NMI (a fraction) of the k-means clusters of ``features`` with ``labels``."""
    from sklearn.metrics import normalized_mutual_info_score

    x = check_features(features, "features")
    y = check_labels(labels, len(x), "labels", "features")
    return float(normalized_mutual_info_score(y, kmeans_assign(x, k, iterations, seed)))


def run_probe(features: Sequence[Any], settings: Mapping[str, Any]) -> dict[str, float]:
    """The registry's k-means probe (:mod:`smallbatch.study.probe_registry`): the test features in as
    many clusters as classes, ``kmeans_iterations`` at most; ``nmi`` in points."""
    _, ytr, te, yte = features
    k = int(max(np.max(ytr), np.max(yte))) + 1
    return {"nmi": percent(kmeans_nmi(te, yte, k, int(settings["kmeans_iterations"]))), "clusters": float(k)}
