"""Frozen features of a backbone: embedding, the feature files, and the input checks of
feature arrays that the probes share.

* :func:`embed` runs a frozen backbone (eval mode, no grad) over uint8 images with the
  deterministic eval-time normalisation ``(x/255 - mean) / std`` (``augment.normalize``).
* :func:`save_features` / :func:`load_features` store train/test features in one ``.npz``
  (atomic write).
* :func:`raw_pixel_features` is the raw-pixel baseline; the random-init baseline is
  :func:`embed` on an untrained backbone.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from smallbatch.data.augment import normalize
from smallbatch.io import atomic_write

# ----------------------------------------------------------------------------- helpers


def as_numpy(a: Any, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    try:
        return np.asarray(a)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise ValueError(f"{name} must be array-like, got {type(a).__name__}") from exc


def as_uint8_images(x: Any, name: str = "x_uint8") -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(as_numpy(x, name)))
    if t.dtype != torch.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {t.dtype}")
    if t.ndim != 4:
        raise ValueError(f"{name} must have shape (N, C, H, W), got {tuple(t.shape)}")
    return t


def check_features(f: Any, name: str) -> np.ndarray:
    a = as_numpy(f, name)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name} must be a non-empty 2-D array (N, F), got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be numeric, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or inf")
    return a


def check_labels(y: Any, n: int, name: str, feat_name: str) -> np.ndarray:
    a = as_numpy(y, name)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} labels but {feat_name} has {n} rows")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integer class labels, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name} must hold labels >= 0, got min {a.min()}")
    return a.astype(np.int64)


def check_pair(train_f, train_y, test_f, test_y, num_classes):
    tr = check_features(train_f, "train_f")
    te = check_features(test_f, "test_f")
    if tr.shape[1] != te.shape[1]:
        raise ValueError(f"test_f has {te.shape[1]} feature dims but train_f has {tr.shape[1]}")
    ytr = check_labels(train_y, tr.shape[0], "train_y", "train_f")
    yte = check_labels(test_y, te.shape[0], "test_y", "test_f")
    return tr, ytr, te, yte, check_num_classes(num_classes, int(max(ytr.max(), yte.max())) + 1)


def check_num_classes(num_classes: Any, seen: int) -> int:
    if num_classes is None:
        return seen
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < seen:
        raise ValueError(f"num_classes must be an integer >= max label + 1 = {seen}, got {num_classes!r}")
    return int(num_classes)


ROW_BLOCK = 1024  # rows per block of the float64 passes over a feature matrix


def mean_std(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and (population) standard deviation in float64, as numpy's two-pass
    ``mean`` / ``std(dtype=float64)`` define them, summed ``ROW_BLOCK`` rows at a time (numpy's std
    makes a full-size float64 copy: 0.37 of the default probe's 3.3 s)."""
    mu = a.mean(axis=0, dtype=np.float64)
    ss = np.zeros(a.shape[1], np.float64)
    for i in range(0, a.shape[0], ROW_BLOCK):
        d = a[i : i + ROW_BLOCK].astype(np.float64) - mu
        ss += np.einsum("ij,ij->j", d, d)
    return mu, np.sqrt(ss / max(1, a.shape[0]))


def rowwise_float32(a: np.ndarray, fn) -> np.ndarray:
    """``fn`` applied to ``ROW_BLOCK`` rows of ``a`` at a time, results stored as float32: float64
    arithmetic inside ``fn`` without full-size float64 temporaries (and their page faults)."""
    out = np.empty(a.shape, np.float32)
    for i in range(0, a.shape[0], ROW_BLOCK):
        out[i : i + ROW_BLOCK] = fn(a[i : i + ROW_BLOCK])
    return out


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
    x = as_uint8_images(x_uint8)
    if len(mean) != x.shape[1] or len(std) != x.shape[1]:
        raise ValueError(f"mean/std must have one entry per channel ({x.shape[1]}), got {len(mean)} and {len(std)}")
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
    weights: list[torch.Tensor] = [p for p in backbone.parameters() if p.dim() == 4]
    if not weights or any(p.dtype == torch.float64 for p in weights):
        return None
    nchw = [p for p in weights if not p.is_contiguous(memory_format=torch.channels_last)]
    for p in nchw:
        p.data = p.data.contiguous(memory_format=torch.channels_last)
    return nchw


def raw_pixel_features(x_uint8: Any) -> np.ndarray:
    """Raw-pixel baseline: uint8 images ``(N, C, H, W)`` -> float32 ``(N, C*H*W)`` in [0, 1]."""
    x = as_uint8_images(x_uint8)
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
    tr, ytr, te, yte, _ = check_pair(train_f, train_y, test_f, test_y, None)
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
    return atomic_write(
        path, lambda fh: np.savez(fh, train_f=tr, train_y=ytr, test_f=te, test_y=yte, meta_json=np.array(meta_json))
    )


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
