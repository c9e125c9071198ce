"""Did a cell's representation collapse?  The criteria, in one place.

A cell can train to garbage without a single non-finite number (e.g. Adam at lr 1e6:
the loss stays finite, the kNN probe ends below chance).  Such a cell is recorded as
**collapsed** — a result the report shows beside *diverged*, as the papers discuss
collapse at small batch — by two tests:

* at the end of pretraining, :func:`embedding_health` on a fixed sample of the
  pretraining images: the effective rank (Roy & Vetterli 2007: ``exp`` of the entropy of
  the normalised singular values of the centred features) of the backbone features
  and the spread of the L2-normalised projections.  :func:`collapsed_embeddings` is true
  when every image maps to (almost) one direction: projections' per-dimension standard
  deviation below ``STD_FLOOR``, or backbone features of effective rank below
  ``RANK_FLOOR``.
* after the kNN probe, :func:`at_chance`: top-1 not above chance ``1/C`` by more than
  two binomial standard errors of the test set (``sqrt(p(1-p)/n)``, p = 1/C): the
  features carry no class information the probe can find.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .models import ContrastiveModel

STD_FLOOR = 1e-3  # mean per-dimension std of unit-length projections: 0 = one point
RANK_FLOOR = 1.5  # effective rank of the backbone features: 1 = one direction
SAMPLE = 1024  # images the end-of-training check embeds


def effective_rank(features: torch.Tensor, centre: bool = True) -> float:
    """``exp(H(p))``, ``p`` = singular values of the centred ``(N, F)`` features / their sum
    (Roy & Vetterli 2007); ``centre=False``: of the features as they are -- RankMe (Garrido et
    al. 2023, "RankMe: Assessing the Downstream Performance of Pretrained Self-Supervised
    Representations by Their Rank", ICML) without its ``p_k + eps`` (eps = 1e-7), which adds at
    most ``-F eps log eps`` ~ 1.6e-6 F nats to the entropy: under 0.4 % of the rank at F <= 2048."""
    x = features.double()
    if centre:
        x = x - x.mean(dim=0, keepdim=True)
    # singular values as the square roots of the smaller Gram matrix's eigenvalues: the same rank
    # as svdvals (to float64 rounding), at the cost of one small symmetric eigenproblem
    gram = x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x
    s = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    if not torch.isfinite(s).all() or float(s.sum()) <= 0:
        return 0.0
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


@torch.no_grad()
def embedding_health(model: ContrastiveModel, views: torch.Tensor) -> dict[str, float]:
    """Effective rank of the backbone features and the mean per-dimension std of the
    L2-normalised projections of ``views`` (normalised images), in eval mode (the model's
    modes are restored)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        h = model.backbone(views)
        z = F.normalize(model.head(h).double(), dim=1)
    finally:
        for m, mode in modes:
            m.training = mode
    finite = bool(torch.isfinite(h).all() and torch.isfinite(z).all())
    return {
        "effective_rank": effective_rank(h) if finite else 0.0,
        "projection_std": float(z.std(dim=0).mean()) if finite and z.shape[0] > 1 else 0.0,
    }


def collapsed_embeddings(health: dict[str, float]) -> bool:
    """Every image maps to (almost) one direction (see the module docstring)."""
    return health["projection_std"] < STD_FLOOR or health["effective_rank"] < RANK_FLOOR


def at_chance(top1_percent: float, n_test: int, n_classes: int) -> bool:
    """kNN top-1 (percent) within two binomial standard errors of chance, or below it."""
    p = 1.0 / n_classes
    return top1_percent / 100.0 <= p + 2.0 * math.sqrt(p * (1 - p) / max(1, n_test))
