"""What a representation looks like: geometry of the frozen network on held-out images.

Measured once per cell at evaluation time (``smallbatch evaluate``), on a bounded, fixed sample:
the first :data:`SAMPLE` images of a permutation of the test split seeded by :data:`SEED` (the
same images for every cell of a data set), two augmented views of each with the cell's own
augmentation recipe and uniforms from a generator seeded by :data:`SEED` (the same views for
every cell of one recipe), and the images themselves.  The network runs in eval mode (BatchNorm's
running statistics), in float32, on the backbone's features ``h`` and the projection ``z = g(h)``
(the space the loss saw).  For each of the two spaces (``features_*``, ``projection_*``):

* ``alignment`` -- Wang & Isola (2020): ``E ||f(x) - f(y)||^2`` over the two views of an image,
  on L2-normalised embeddings (alpha = 2; 0 = views map to one point, 4 = opposite);
* ``uniformity`` -- Wang & Isola: ``log E exp(-2 ||f(x) - f(x')||^2)`` over pairs of different
  images within a view (t = 2), the mean of the two views' (0 = collapsed to one point; lower is
  more uniform, about -4 for points spread over many dimensions);
* ``rankme`` -- RankMe (Garrido et al. 2023): ``exp`` of the entropy of the normalised singular
  values of the clean images' embeddings (not centred), between 1 (one direction) and
  ``min(n, D)``: dimensional collapse;
* ``neg_cos_mean``, ``neg_cos_sd`` -- the mean and spread of the cosines between views of
  different images (every in-batch negative pair of the sample taken as one batch).

The contrastive losses' positive weight in the gradient, DCL's ``q_B``, is measured during
training on each step's batch (``diag/qb_mean``, at the cell's B and τ) and not repeated here.
Cost on the default cell (16 px, small CNN, F = 2048): 2.5 CPU-seconds on one core, beside 2.0
for embedding its 20,000 training and test images (logged per cell as ``repr/cpu_s``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..data.augment import AugmentConfig, BatchAugment, normalize
from ..losses.diagnostics import alignment_uniformity, negative_cosines
from ..training.health import effective_rank

#: images of the test split measured per cell (fewer when the split is smaller)
SAMPLE = 2000
#: seed of the sample's permutation and of its views' uniforms (the same for every cell)
SEED = 20201212
SPACES = ("features", "projection")


def held_out_sample(n_test: int, size: int = SAMPLE) -> torch.Tensor:
    """The indices of the measured test images: the first ``size`` of a fixed permutation."""
    return torch.randperm(n_test, generator=torch.Generator().manual_seed(SEED))[: min(size, n_test)]


@torch.no_grad()
def _embed_views(
    model, views: Sequence[torch.Tensor], batch_size: int, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(h, z)`` of each normalised image batch in ``views``, float64 on the CPU."""
    out = []
    for x in views:
        hs, zs = [], []
        for i in range(0, x.shape[0], batch_size):
            h, z = model.forward_both(x[i : i + batch_size].to(device))
            hs.append(h.double().cpu())
            zs.append(z.double().cpu())
        out.append((torch.cat(hs), torch.cat(zs)))
    return out


def space_metrics(clean: torch.Tensor, v1: torch.Tensor, v2: torch.Tensor) -> dict[str, float]:
    """The metrics of one space (module docstring) from the clean images' and two views' embeddings."""
    alignment, uniformity = alignment_uniformity(v1, v2)
    return {
        "alignment": alignment,
        "uniformity": uniformity,
        "rankme": effective_rank(clean, centre=False),
        **negative_cosines(v1, v2),
    }


@torch.no_grad()
def representation_metrics(
    model,
    test_x: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    augment: dict,
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    size: int = SAMPLE,
) -> dict[str, float]:
    """``{"<space>_<metric>": value, "images": n}`` of a frozen model (a
    :class:`~smallbatch.training.models.ContrastiveModel`) on the fixed sample of the uint8 test images
    ``test_x`` with the cell's ``augment`` settings (see the module docstring)."""
    x = test_x[held_out_sample(test_x.shape[0], size)]
    n, channels, height = x.shape[0], x.shape[1], x.shape[-1]
    aug = BatchAugment(AugmentConfig(**augment), image_size=height, channels=channels, mean=mean, std=std)
    u = aug.draw(2 * n, torch.Generator().manual_seed(SEED))
    views = aug.apply(torch.cat([x, x]), u)
    images = [normalize(x, mean, std), views[:n], views[n:]]
    dev = torch.device(device)
    modes = [(m, m.training) for m in model.modules()]
    first = next(model.parameters())
    old_device, dtype = first.device, first.dtype
    model.to(dev, torch.float32).eval()
    try:
        embedded = _embed_views(model, images, batch_size, dev)
    finally:
        model.to(old_device, dtype)
        for m, mode in modes:
            m.training = mode
    out: dict[str, float] = {"images": float(n)}
    for k, space in enumerate(SPACES):
        clean, v1, v2 = (e[k] for e in embedded)
        out.update({f"{space}_{key}": value for key, value in space_metrics(clean, v1, v2).items()})
    return out
