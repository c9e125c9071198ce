"""Contrastive augmentations, batched on the device and random per sample.

:class:`BatchAugment` turns a ``uint8 (B, C, H, W)`` batch into a float32
``(B, C, S, S)`` batch of normalised random views. Every image gets its own random
parameters (two copies of one image in a batch get different views), all drawn in
one ``torch.rand`` call from an explicit ``torch.Generator`` so that the same
generator seed gives the same views. torchvision's v2 transforms draw one set of
parameters per call, i.e. per batch, so they are not used here.

The work per batch:

1. random resized crop + horizontal flip + resize to ``S``: one per-sample affine
   matrix each, applied by a single ``F.affine_grid`` + ``F.grid_sample``
   (bilinear; when the input is larger than ``S`` the grid is sampled at ``k*S``
   and average pooled by ``k``, so downscaling is antialiased);
2. colour jitter (brightness, contrast, saturation, hue as in torchvision's
   ``ColorJitter``: factors drawn per sample, the four ops in a random order per
   sample, hue by RGB -> HSV -> RGB tensor math), applied with probability
   ``jitter_p``;
3. random grayscale (ITU-R 601 luma) with probability ``grayscale_p``;
4. Gaussian blur, sigma per sample, kernel ``blur_kernel_frac * S`` (odd), as two
   grouped 1-D convolutions, with probability ``blur_p`` and only for
   ``S >= blur_min_size`` (SimCLR blurs ImageNet/STL-10 but not CIFAR);
5. normalisation ``(x / 255 - mean) / std``.

Saturation, hue and grayscale act on 3-channel images only.

Recipes (the parameters of :class:`AugmentConfig` left ``None`` take the recipe's
values):

``simclr``
    SimCLR (Chen et al., 2020, appendix A): crop scale (0.08, 1), ratio (3/4, 4/3),
    flip p=0.5, colour jitter of strength ``s`` (brightness 0.8s, contrast 0.8s,
    saturation 0.8s, hue 0.2s) with p=0.8, grayscale p=0.2, Gaussian blur p=0.5
    (sigma in [0.1, 2], kernel 10 % of the image) for images of at least 96 px.
    ``s`` = 1.0 (the paper's ImageNet setting; its CIFAR-10 runs used 0.5).
``gray_small``
    For small grayscale images (Fashion-MNIST, digits): crop scale (0.08, 1), ratio
    (3/4, 4/3), flip p=0.5, brightness/contrast jitter (0.8s each, s = 0.5) with
    p=0.8; no saturation, hue, grayscale or blur. A milder crop did not help on
    these images: NT-Xent (batch 256, tau 0.2, a 3-layer CNN, Adam) then 20-NN
    top-1 on Fashion-MNIST at 16 px (10k/2k subsets) gave, for crop scale
    (0.08, 1) / (0.2, 1) / (0.4, 1) / (0.6, 1): 79.9 / 79.0 / 79.4 / 79.3 % after
    300 steps (mean of 2 seeds), 80.7 / 80.6 / 80.0 % after 1,000 steps (1 seed);
    digits at 8 px, 150 steps: 98.1 / 97.5 / 97.4 / 96.9 % (random init: 75.3 % and
    94.4 %). With global average pooling the crop lower bound barely matters at these
    budgets, so the recipe keeps the SimCLR value. Once the features keep the map's
    layout (``train.pool_grid: 4``) a milder crop helps, and config.yaml sets (0.5, 1):
    NT-Xent, batch 64, tau 0.1, 3 epochs, seed 0, 20-NN / linear top-1 for crop scale
    (0.08, 1) / (0.3, 1) / (0.5, 1) / (0.7, 1): 82.9 / 83.1 / 83.5 / 83.8 % and
    86.7 / 86.8 / 87.2 / 87.1 %; (0.5, 1) with seed 1: 84.4 / 87.6 %.
``none``
    No augmentation (only the resize to ``S`` and normalisation); a control.

Implementation choice: this module's own tensor code, not kornia's ``AugmentationSequential``,
which was slower on the CPU for every recipe measured and draws one jitter order per batch
(the comparison is a benchmark record, ``benchmarks/augment_speed.py``); so kornia is not a
dependency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .augment_config import MEANINGS, RECIPES, AugmentConfig, AugmentSettings

__all__ = [
    "AugmentConfig",
    "AugmentSettings",
    "BatchAugment",
    "MEANINGS",
    "RECIPES",
    "normalize",
    "rgb_to_hsv",
    "hsv_to_rgb",
]

_CROP_TRIES = 10  # torchvision's RandomResizedCrop tries this many (scale, ratio) draws


def _stats(values: Sequence[float], channels: int, name: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if len(values) != channels:
        raise ValueError(f"{name} must have one value per channel ({channels}); got {len(values)}")
    if name == "std" and any(not v > 0 for v in values):
        raise ValueError(f"std must be positive; got {values}")
    return values


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """The deterministic eval-time transform: ``uint8 (B, C, H, W)`` -> float32 ``(x/255 - mean)/std``."""
    if x.ndim != 4:
        raise ValueError(f"x must be a (B, C, H, W) tensor; got shape {tuple(x.shape)}")
    channels = x.shape[1]
    m = torch.tensor(_stats(mean, channels, "mean"), dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(_stats(std, channels, "std"), dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return (x.to(torch.float32) / 255.0 - m) / s


def _gray(x: torch.Tensor) -> torch.Tensor:
    """Luma (n, 1, H, W) of (n, 3, H, W) RGB in [0, 1], torchvision's weights."""
    return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]


def rgb_to_hsv(x: torch.Tensor) -> torch.Tensor:
    """(n, 3, H, W) RGB in [0, 1] -> HSV with hue in [0, 1) (torchvision's convention)."""
    r, g, b = x.unbind(1)
    maxc = x.amax(dim=1)
    chroma = maxc - x.amin(dim=1)
    safe = torch.where(chroma == 0, torch.ones_like(chroma), chroma)
    sat = chroma / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    is_r = maxc == r
    is_g = (maxc == g) & ~is_r
    # hue in sixths: (g-b)/c if max is r, 2+(b-r)/c if g, 4+(r-g)/c if b (0 when chroma is 0)
    hue = torch.where(is_r, g - b, torch.where(is_g, b - r + 2 * safe, r - g + 4 * safe)) / safe
    hue = torch.where(chroma == 0, torch.zeros_like(hue), hue)
    hue = torch.remainder(hue / 6.0, 1.0)
    return torch.stack((hue, sat, maxc), dim=1)


_HSV_OFFSETS = (5.0, 3.0, 1.0)


def hsv_to_rgb(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rgb_to_hsv`: channel n of (5, 3, 1) is v - v*s*clamp(min(k, 4-k), 0, 1), k = (n + 6h) mod 6."""
    h, s, v = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    offsets = torch.tensor(_HSV_OFFSETS, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    k = torch.remainder(offsets + 6.0 * h, 6.0)
    ramp = torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)
    return (v - v * s * ramp).clamp_(0.0, 1.0)


def _brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (x * f.view(-1, 1, 1, 1)).clamp_(0.0, 1.0)


def _contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    gray = _gray(x) if x.shape[1] == 3 else x
    mean = gray.mean(dim=(1, 2, 3), keepdim=True)
    f = f.view(-1, 1, 1, 1)
    return (f * x + (1.0 - f) * mean).clamp_(0.0, 1.0)


def _saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    f = f.view(-1, 1, 1, 1)
    return (f * x + (1.0 - f) * _gray(x)).clamp_(0.0, 1.0)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    hsv = rgb_to_hsv(x)
    hue = torch.remainder(hsv[:, 0] + shift.view(-1, 1, 1), 1.0)
    return hsv_to_rgb(torch.stack((hue, hsv[:, 1], hsv[:, 2]), dim=1))


_JITTER_OPS = (_brightness, _contrast, _saturation, _hue)


def _axis_aligned_grid(
    sx: torch.Tensor, tx: torch.Tensor, sy: torch.Tensor, ty: torch.Tensor, side: int
) -> torch.Tensor:
    """``F.affine_grid`` (``align_corners=False``) of the per-sample maps x' = sx x + tx,
    y' = sy y + ty on a ``side`` x ``side`` output, ``(B, side, side, 2)``: a crop + flip
    has no shear, so two products and sums per row/column instead of affine_grid's batched
    (B, side², 3) x (3, 2) product (the same floats as affine_grid's)."""
    base = torch.linspace(-1.0, 1.0, side, dtype=sx.dtype, device=sx.device) * (side - 1) / side  # as affine_grid
    b = sx.shape[0]
    gx = (base.view(1, 1, side) * sx.view(b, 1, 1) + tx.view(b, 1, 1)).expand(b, side, side)
    gy = (base.view(1, side, 1) * sy.view(b, 1, 1) + ty.view(b, 1, 1)).expand(b, side, side)
    return torch.stack((gx, gy), dim=-1)


class BatchAugment:
    """Random augmentation of a whole batch on its device, random per sample.

    Args:
        cfg: the augmentation parameters.
        image_size: side ``S`` of the square output views.
        channels: number of image channels (1 or 3).
        mean, std: per-channel normalisation statistics in ``[0, 1]`` units.
    """

    def __init__(
        self, cfg: AugmentConfig, image_size: int, channels: int, mean: Sequence[float], std: Sequence[float]
    ) -> None:
        if not isinstance(cfg, AugmentConfig):
            raise ValueError(f"cfg must be an AugmentConfig; got {type(cfg).__name__}")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive integer; got {image_size!r}")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3; got {channels!r}")
        self.cfg = cfg
        #: the parameters as they were when this augmentation was made (each one set)
        self.settings = st = cfg.resolved()
        self.size = image_size
        self.channels = channels
        self.mean = _stats(mean, channels, "mean")
        self.std = _stats(std, channels, "std")
        s = st.jitter_strength
        self._ranges = (
            (max(0.0, 1.0 - st.brightness * s), 1.0 + st.brightness * s),
            (max(0.0, 1.0 - st.contrast * s), 1.0 + st.contrast * s),
            (max(0.0, 1.0 - st.saturation * s), 1.0 + st.saturation * s),
            (-st.hue * s, st.hue * s),
        )
        colour_ops = (0, 1, 2, 3) if channels == 3 else (0, 1)
        identity = (1.0, 1.0, 1.0, 0.0)
        # ops whose range is not a single identity point
        self._active_ops = tuple(o for o in colour_ops if self._ranges[o] != (identity[o], identity[o]))
        self.blur_kernel = 0
        if st.blur_p > 0 and image_size >= st.blur_min_size:
            k = max(3, int(st.blur_kernel_frac * image_size))
            self.blur_kernel = k if k % 2 == 1 else k + 1
        self._constants: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __repr__(self) -> str:
        return f"BatchAugment(size={self.size}, channels={self.channels}, cfg={self.cfg})"

    # number of uniform draws per sample, in this order
    _N_CROP = 2 * _CROP_TRIES + 2
    _COLUMNS = _N_CROP + 1 + 1 + 4 + 4 + 1 + 1 + 1

    def prepare(self, device: torch.device | str) -> None:
        """Make the device constants now, outside any compiled step: made inside one run with
        CUDA graphs they would be that graph's outputs, overwritten by its next run (measured
        on an H200)."""
        self._device_constants(torch.empty(0, device=device).device)  # the device with its index, as x.device

    def _device_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(mean, std, jitter lows, jitter highs, active op ids) as tensors on ``device``, made once."""
        if device not in self._constants:
            self._constants[device] = (
                torch.tensor(self.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1),
                torch.tensor(self.std, dtype=torch.float32, device=device).view(1, -1, 1, 1),
                torch.tensor([r[0] for r in self._ranges], dtype=torch.float32, device=device),
                torch.tensor([r[1] for r in self._ranges], dtype=torch.float32, device=device),
                torch.tensor(self._active_ops, dtype=torch.long, device=device),
            )
        return self._constants[device]

    def _crop_boxes(self, u: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Per-sample crop (x0, y0, w, h) in pixels, torchvision's RandomResizedCrop rule, continuous."""
        cfg = self.settings
        area = float(height * width)
        lo_s, hi_s = cfg.crop_scale
        lo_r, hi_r = math.log(cfg.crop_ratio[0]), math.log(cfg.crop_ratio[1])
        target = area * (lo_s + (hi_s - lo_s) * u[:, :_CROP_TRIES])
        ratio = torch.exp(lo_r + (hi_r - lo_r) * u[:, _CROP_TRIES : 2 * _CROP_TRIES])
        w = torch.sqrt(target * ratio)
        h = torch.sqrt(target / ratio)
        tol = 1e-6
        valid = (w <= width * (1 + tol)) & (h <= height * (1 + tol)) & (w > 0) & (h > 0)
        first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)
        any_valid = valid.any(dim=1)
        w = w.gather(1, first).squeeze(1).clamp(max=float(width))
        h = h.gather(1, first).squeeze(1).clamp(max=float(height))
        # fallback (no valid try): the largest centred crop with the ratio clamped to the range
        in_ratio = width / height
        if in_ratio < cfg.crop_ratio[0]:
            fw, fh = float(width), width / cfg.crop_ratio[0]
        elif in_ratio > cfg.crop_ratio[1]:
            fw, fh = height * cfg.crop_ratio[1], float(height)
        else:
            fw, fh = float(width), float(height)
        w = torch.where(any_valid, w, torch.full_like(w, fw))
        h = torch.where(any_valid, h, torch.full_like(h, fh))
        pos = u[:, 2 * _CROP_TRIES : 2 * _CROP_TRIES + 2]
        x0 = torch.where(any_valid, (width - w) * pos[:, 0], (width - w) / 2)
        y0 = torch.where(any_valid, (height - h) * pos[:, 1], (height - h) / 2)
        return torch.stack((x0, y0, w, h), dim=1)

    def draw(
        self, batch: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """All random numbers of a batch of ``batch`` images in one draw: ``(batch, COLUMNS)``
        uniforms on ``device`` (default: the generator's), from ``generator``."""
        gen_device = generator.device if generator is not None else torch.device("cpu")
        u = torch.rand((batch, self._COLUMNS), generator=generator, device=gen_device, dtype=torch.float32)
        return u if device is None else u.to(device)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random views of ``x`` (``uint8 (B, C, H, W)``) as normalised float32 ``(B, C, S, S)``."""
        self._check_input(x)
        return self.apply(x, self.draw(x.shape[0], generator, x.device))

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.dtype != torch.uint8:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a uint8 (B, C, H, W) tensor; got {got}")
        if x.shape[1] != self.channels:
            raise ValueError(f"x has {x.shape[1]} channels; this BatchAugment was built for {self.channels}")

    def apply(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The views of ``x`` for the uniforms ``u`` (from :meth:`draw`): a pure tensor function
        whose every step is shaped by the sizes alone (per-sample choices are masks, never
        index lists), so on a GPU it never waits for the device and ``torch.compile`` sees
        one graph."""
        cfg = self.settings
        device = x.device
        batch, channels, height, width = x.shape
        size = self.size
        if batch == 0:
            return torch.empty((0, channels, size, size), dtype=torch.float32, device=device)
        col = 0
        u_crop = u[:, col : col + self._N_CROP]
        col += self._N_CROP  # noqa: E702
        u_flip = u[:, col]
        col += 1  # noqa: E702
        u_jit = u[:, col]
        col += 1  # noqa: E702
        u_fac = u[:, col : col + 4]
        col += 4  # noqa: E702
        u_order = u[:, col : col + 4]
        col += 4  # noqa: E702
        u_gray = u[:, col]
        col += 1  # noqa: E702
        u_blur = u[:, col]
        col += 1  # noqa: E702
        u_sigma = u[:, col]
        col += 1  # noqa: E702

        out = self._crop_flip_resize(x, u_crop, u_flip)
        if cfg.jitter_p > 0 and self._active_ops:
            out = self._jitter(out, u_jit < cfg.jitter_p, u_fac, u_order)
        if channels == 3 and cfg.grayscale_p > 0:
            gray = u_gray < cfg.grayscale_p
            out = torch.where(gray.view(-1, 1, 1, 1), _gray(out).expand(-1, 3, -1, -1), out)
        if self.blur_kernel:  # identity kernel for the samples not blurred
            out = self._blur(out, u_blur < cfg.blur_p, u_sigma)
        mean, std = self._device_constants(device)[:2]
        return out.sub_(mean).div_(std)

    def _crop_flip_resize(self, x: torch.Tensor, u_crop: torch.Tensor, u_flip: torch.Tensor) -> torch.Tensor:
        """Random resized crop + flip + resize to ``S``: one sampling grid for the batch."""
        height, width = x.shape[-2:]
        size = self.size
        box = self._crop_boxes(u_crop, height, width)
        x0, y0, w, h = box.unbind(1)
        flip = torch.where(u_flip < self.settings.flip_p, -1.0, 1.0)
        k = max(1, math.ceil(max(height, width) / size))
        grid = _axis_aligned_grid(
            flip * w / width, (2 * x0 + w) / width - 1, h / height, (2 * y0 + h) / height - 1, size * k
        )
        img = x.to(torch.float32).div_(255.0)
        out = F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return F.avg_pool2d(out, k) if k > 1 else out

    def _jitter(
        self, out: torch.Tensor, jitter: torch.Tensor, u_fac: torch.Tensor, u_order: torch.Tensor
    ) -> torch.Tensor:
        """Colour jitter with per-sample factors and a per-sample order of the ops: at each
        position every active op is computed for the whole batch and kept (``torch.where``)
        for the samples whose order puts it there."""
        lows, highs, active = self._device_constants(out.device)[2:]
        factors = lows + (highs - lows) * u_fac  # (B, 4)
        order = active[u_order[:, : len(self._active_ops)].argsort(dim=1)]  # (B, n_ops) op ids
        for position in range(len(self._active_ops)):
            new = out
            for op in self._active_ops:
                take = (jitter & (order[:, position] == op)).view(-1, 1, 1, 1)
                new = torch.where(take, _JITTER_OPS[op](out, factors[:, op]), new)
            out = new
        return out

    def pair(self, x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Two independent random views of each image of ``x`` (one augmentation call on 2B images)."""
        views = self(torch.cat((x, x), dim=0), generator)
        return views[: x.shape[0]], views[x.shape[0] :]

    def _blur(self, x: torch.Tensor, blurred: torch.Tensor, u_sigma: torch.Tensor) -> torch.Tensor:
        lo, hi = self.settings.blur_sigma
        sigma = lo + (hi - lo) * u_sigma
        ksize = self.blur_kernel
        half = ksize // 2
        taps = torch.arange(ksize, device=x.device, dtype=torch.float32) - half
        kernel = torch.exp(-(taps.view(1, -1) ** 2) / (2 * sigma.view(-1, 1) ** 2))
        kernel = kernel / kernel.sum(dim=1, keepdim=True)
        delta = (taps == 0).to(torch.float32).expand_as(kernel)
        kernel = torch.where(blurred.view(-1, 1), kernel, delta)  # (B, K)
        batch, channels, height, width = x.shape
        weight = kernel.repeat_interleave(channels, dim=0)  # (B*C, K)
        flat = x.reshape(1, batch * channels, height, width)
        flat = F.conv2d(
            F.pad(flat, (half, half, 0, 0), mode="reflect"), weight.view(-1, 1, 1, ksize), groups=batch * channels
        )
        flat = F.conv2d(
            F.pad(flat, (0, 0, half, half), mode="reflect"), weight.view(-1, 1, ksize, 1), groups=batch * channels
        )
        return flat.view(batch, channels, height, width)
