"""Composite images: k items of one data set stacked into one image, k-digit labels.

A task where the number of classes is an axis (Ash et al., 2022: the negatives a
contrastive loss needs grow with the number of latent classes). From a base data set of
C classes (Fashion-MNIST, C = 10) a composite tiles k items; its label is the k-digit
base-C number of the items' classes, top item first: ``label = sum_i c_i * C**(k-1-i)``,
so k = 2 gives 100 classes (``c1*10 + c2``) and k = 3 gives 1,000.

Layout: the items are stacked **vertically** in one ``S x S`` image, item i resized
(antialiased bilinear) to a strip of full width ``S`` and height ``round((i+1)S/k) -
round(iS/k)``. Stacking vertically, not side by side, keeps the label under the
augmentations' horizontal flip: a flip mirrors each item in place instead of swapping
their order (which would turn class ``(a, b)`` into ``(b, a)``); and the image stays
square, so ``image_size`` keeps its meaning (the side of the image and of the views).

Which items (:func:`composite_sources`): the composite labels are balanced by
construction (``n`` composites hold every class ``n // C**k`` times and a random subset
of the classes once more, in a random order), and for each class the items filling its slots are drawn from repeated
random permutations of that class's source images, so every source image is used about
equally often. All draws come from a ``numpy`` generator seeded by ``seed``: the same
arguments give the same composites. Train composites are built from the training split
and test composites from the test split (:func:`smallbatch.data.load.load_dataset`), so no
test item is in any training composite; the source indices are returned to check it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["composite_labels", "composite_sources", "strip_bounds", "tile_images", "make_composites"]


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def composite_labels(item_labels: np.ndarray, base_classes: int) -> np.ndarray:
    """Labels of composites from their items' labels ``(n, k)``: the base-``base_classes``
    number whose digits are the items' classes, the top item the most significant."""
    item_labels = np.asarray(item_labels, dtype=np.int64)
    k = item_labels.shape[1]
    weights = base_classes ** np.arange(k - 1, -1, -1, dtype=np.int64)
    return item_labels @ weights


def composite_sources(
    labels: np.ndarray, k: int, n: int, seed: int | list[int], base_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Which source images make each of ``n`` composites of ``k`` items.

    Returns ``(sources, composite_labels)``: ``sources[j, i]`` indexes ``labels`` (item i,
    top to bottom, of composite j), ``int64 (n, k)``; the labels ``int64 (n,)``. Classes
    are balanced (see the module docstring); every base class needs at least one image.
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    k = _check_int(k, "k (items per composite)", 1)
    n = _check_int(n, "n (composites)", 1)
    c = int(labels.max()) + 1 if base_classes is None else _check_int(base_classes, "base_classes", 1)
    pools = [np.flatnonzero(labels == cls) for cls in range(c)]
    empty = [cls for cls, p in enumerate(pools) if len(p) == 0]
    if empty:
        raise ValueError(f"base class {empty[0]} has no images to build composites from")
    rng = np.random.default_rng(seed)
    classes = c**k  # every class n // classes times, a random subset of them once more, in a random order
    blocks = [rng.permutation(classes) for _ in range(-(-n // classes))]
    comp = rng.permutation(np.concatenate(blocks)[:n].astype(np.int64))
    digits = (comp[:, None] // c ** np.arange(k - 1, -1, -1, dtype=np.int64)) % c  # (n, k)
    sources = np.empty((n, k), dtype=np.int64)
    flat_digits, flat_sources = digits.reshape(-1), sources.reshape(-1)
    for cls, pool in enumerate(pools):
        slots = np.flatnonzero(flat_digits == cls)
        rounds = -(-len(slots) // len(pool))  # ceil
        cycle = np.concatenate([rng.permutation(pool) for _ in range(max(1, rounds))])
        flat_sources[slots] = cycle[: len(slots)]
    return sources, comp


def strip_bounds(size: int, k: int) -> list[tuple[int, int]]:
    """(top, bottom) rows of each of the ``k`` strips of an image of side ``size``."""
    edges = [round(i * size / k) for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def tile_images(images: torch.Tensor, sources: np.ndarray, size: int) -> torch.Tensor:
    """``uint8 (n, C, size, size)`` composites: item i of composite j is ``images[sources[j, i]]``
    resized (antialiased bilinear) to strip i (:func:`strip_bounds`)."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError("images must be a uint8 (N, C, H, W) tensor")
    sources = np.asarray(sources, dtype=np.int64)
    n, k = sources.shape
    bounds = strip_bounds(_check_int(size, "image_size", 1), k)
    if any(bottom <= top for top, bottom in bounds):
        raise ValueError(f"image_size {size} is too small for {k} strips (at least {k} px)")
    out = torch.empty((n, images.shape[1], size, size), dtype=torch.uint8)
    resized: dict[int, torch.Tensor] = {}
    for i, (top, bottom) in enumerate(bounds):
        h = bottom - top
        if h not in resized:  # every source image once per strip height
            resized[h] = _resize(images, h, size)
        out[:, :, top:bottom] = resized[h][torch.from_numpy(sources[:, i])]
    return out


def _resize(images: torch.Tensor, height: int, width: int, chunk: int = 8192) -> torch.Tensor:
    """Antialiased bilinear resize of uint8 images to ``height x width`` (in chunks)."""
    if tuple(images.shape[-2:]) == (height, width):
        return images
    out = torch.empty((images.shape[0], images.shape[1], height, width), dtype=torch.uint8)
    for start in range(0, images.shape[0], chunk):
        block = torch.nn.functional.interpolate(
            images[start : start + chunk].float(),
            size=(height, width),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        out[start : start + chunk] = block.round_().clamp_(0, 255).to(torch.uint8)
    return out


def make_composites(
    images: torch.Tensor, labels, k: int, n: int, size: int, seed: int | list[int], base_classes: int | None = None
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """``n`` composites of ``k`` items of ``images`` (one split): (images ``uint8 (n, C, size,
    size)``, labels ``int64 (n,)``, sources ``int64 (n, k)`` indexing ``images``)."""
    sources, comp = composite_sources(np.asarray(labels), k, n, seed, base_classes)
    return tile_images(images, sources, size), comp, sources
