"""Tests of smallbatch.data.augment: per-sample randomness, reproducibility, each transform's effect."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from smallbatch.data.augment import RECIPES, AugmentConfig, BatchAugment, hsv_to_rgb, normalize, rgb_to_hsv

MEAN3, STD3 = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


def _images(n: int, c: int, s: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, s, s), generator=g, dtype=torch.uint8)


def _identity_cfg(**overrides) -> AugmentConfig:
    """Crop of the whole image, no other transform, unless overridden."""
    params = dict(recipe="none")
    params.update(overrides)
    return AugmentConfig(**params)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "recipe,channels,size", [("simclr", 3, 32), ("gray_small", 1, 16), ("simclr", 1, 16), ("gray_small", 3, 16)]
)
def test_output_shape_dtype_and_finite(recipe, channels, size):
    aug = BatchAugment(AugmentConfig(recipe=recipe), size, channels, [0.5] * channels, [0.25] * channels)
    x = _images(16, channels, 28)
    out = aug(x, _gen(0))
    assert out.shape == (16, channels, size, size)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    # values are normalised [0, 1] pixels
    assert out.min() >= (0 - 0.5) / 0.25 - 1e-5 and out.max() <= (1 - 0.5) / 0.25 + 1e-5


@pytest.mark.parametrize("recipe,channels", [("simclr", 3), ("gray_small", 1)])
def test_two_copies_of_one_image_get_different_views(recipe, channels):
    aug = BatchAugment(AugmentConfig(recipe=recipe), 32, channels, [0.5] * channels, [0.25] * channels)
    x = _images(1, channels, 32).repeat(8, 1, 1, 1)
    out = aug(x, _gen(1))
    flat = out.flatten(1)
    distances = torch.cdist(flat, flat)
    off_diagonal = distances[~torch.eye(8, dtype=torch.bool)]
    assert off_diagonal.min() > 1e-3  # every pair of views differs
    v1, v2 = aug.pair(x[:4], _gen(2))
    assert (v1 - v2).flatten(1).norm(dim=1).min() > 1e-3


def test_same_generator_seed_gives_same_views_and_another_seed_does_not():
    aug = BatchAugment(AugmentConfig(recipe="simclr"), 96, 3, MEAN3, STD3)  # blur active at 96 px
    x = _images(8, 3, 96)
    a = aug(x, _gen(123))
    b = aug(x, _gen(123))
    c = aug(x, _gen(124))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(5)
    d = aug(x)
    torch.manual_seed(5)
    assert torch.equal(d, aug(x))  # without a generator: the global CPU RNG


def test_full_crop_without_other_transforms_is_the_normalised_input():
    x = _images(6, 3, 20)
    cfg = AugmentConfig(
        recipe="simclr",
        crop_scale=(1.0, 1.0),
        crop_ratio=(1.0, 1.0),
        flip_p=0.0,
        jitter_p=0.0,
        grayscale_p=0.0,
        blur_p=0.0,
    )
    out = BatchAugment(cfg, 20, 3, MEAN3, STD3)(x, _gen(0))
    torch.testing.assert_close(out, normalize(x, MEAN3, STD3), atol=1e-5, rtol=0)
    none = BatchAugment(AugmentConfig(recipe="none"), 20, 3, MEAN3, STD3)(x, _gen(0))
    torch.testing.assert_close(none, normalize(x, MEAN3, STD3), atol=1e-5, rtol=0)


def test_resize_up_is_bilinear_and_down_is_area_averaged():
    x = _images(4, 1, 16)
    up = BatchAugment(_identity_cfg(), 32, 1, [0.0], [1.0])(x, _gen(0))
    ref_up = F.interpolate(x.float() / 255, size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(up, ref_up, atol=1e-5, rtol=0)
    down = BatchAugment(_identity_cfg(), 8, 1, [0.0], [1.0])(x, _gen(0))
    torch.testing.assert_close(down, F.avg_pool2d(x.float() / 255, 2), atol=1e-5, rtol=0)


def test_flip_probability_one_mirrors_every_image():
    x = _images(5, 3, 12)
    out = BatchAugment(_identity_cfg(flip_p=1.0), 12, 3, MEAN3, STD3)(x, _gen(0))
    torch.testing.assert_close(out, normalize(x, MEAN3, STD3).flip(-1), atol=1e-5, rtol=0)


def test_crop_boxes_honour_scale_and_ratio_bounds():
    cfg = AugmentConfig(recipe="simclr", crop_scale=(0.3, 0.6), crop_ratio=(0.5, 2.0))
    aug = BatchAugment(cfg, 32, 3, MEAN3, STD3)
    u = torch.rand((4000, aug._N_CROP), generator=_gen(0))
    x0, y0, w, h = aug._crop_boxes(u, 40, 30).unbind(1)  # H=40, W=30
    area = w * h / (40 * 30)
    assert area.min() >= 0.3 - 1e-5 and area.max() <= 0.6 + 1e-5
    ratio = w / h
    assert ratio.min() >= 0.5 - 1e-5 and ratio.max() <= 2.0 + 1e-5
    assert x0.min() >= 0 and y0.min() >= 0
    assert (x0 + w).max() <= 30 + 1e-4 and (y0 + h).max() <= 40 + 1e-4
    # the draws fill the allowed range rather than sticking to one value
    assert area.max() - area.min() > 0.25 and ratio.max() / ratio.min() > 3


@pytest.mark.parametrize("side", [16, 48])
def test_crop_grid_is_affine_grid_of_the_crop_and_flip(side):
    """The sampling grid of a crop + flip is F.affine_grid's for the same (shear-free) matrix,
    float for float on this CPU (the views, and so the study's numbers, did not change when
    affine_grid's batched product was replaced)."""
    from smallbatch.data.augment import _axis_aligned_grid

    g = _gen(3)
    b = 64
    sx = torch.where(torch.rand(b, generator=g) < 0.5, -1.0, 1.0) * torch.rand(b, generator=g)
    sy, tx, ty = torch.rand(b, generator=g), torch.rand(b, generator=g) - 0.5, torch.rand(b, generator=g) - 0.5
    zero = torch.zeros(b)
    theta = torch.stack((sx, zero, tx, zero, sy, ty), dim=1).view(b, 2, 3)
    expected = F.affine_grid(theta, [b, 1, side, side], align_corners=False)
    assert torch.equal(_axis_aligned_grid(sx, tx, sy, ty, side), expected)


def test_crop_scale_sets_the_zoom_of_a_ramp_image():
    # pixel value = 8 * column: a crop of half the width upsampled to the full width halves the slope
    ramp = (torch.arange(32) * 8).view(1, 1, 1, 32).expand(6, 1, 32, 32).to(torch.uint8)
    cfg = _identity_cfg(crop_scale=(0.25, 0.25), crop_ratio=(1.0, 1.0))
    out = BatchAugment(cfg, 32, 1, [0.0], [1.0 / 255])(ramp, _gen(3))  # output in 0..255 units
    slope = out[..., 2:-2, 3:-3].diff(dim=-1)
    torch.testing.assert_close(slope, torch.full_like(slope, 4.0), atol=1e-3, rtol=0)
    # crops sit at different places: the first column's value differs across samples
    assert out[:, 0, 16, 0].unique().numel() == 6


def test_brightness_factors_are_per_sample_and_in_range():
    g = _gen(0)
    x = torch.randint(60, 120, (64, 1, 8, 8), generator=g, dtype=torch.uint8)  # no clipping at factor <= 2
    cfg = _identity_cfg(jitter_p=1.0, jitter_strength=1.0, brightness=0.5)
    out = BatchAugment(cfg, 8, 1, [0.0], [1.0 / 255])(x, _gen(1))
    ratio = out / x.float()
    per_sample = ratio.flatten(1)
    assert (per_sample.max(1).values - per_sample.min(1).values).max() < 1e-4  # one factor per image
    factors = per_sample[:, 0]
    assert factors.min() >= 0.5 - 1e-5 and factors.max() <= 1.5 + 1e-5
    assert factors.unique().numel() == 64


def test_jitter_probability_zero_and_one():
    x = _images(32, 3, 8)
    cfg = _identity_cfg(jitter_p=0.0, jitter_strength=1.0, brightness=0.8, contrast=0.8, saturation=0.8, hue=0.2)
    out = BatchAugment(cfg, 8, 3, MEAN3, STD3)(x, _gen(0))
    torch.testing.assert_close(out, normalize(x, MEAN3, STD3), atol=1e-5, rtol=0)
    cfg.jitter_p = 1.0
    out = BatchAugment(cfg, 8, 3, MEAN3, STD3)(x, _gen(0))
    changed = (out - normalize(x, MEAN3, STD3)).flatten(1).abs().amax(1) > 1e-3
    assert changed.all()


def test_contrast_keeps_the_mean_of_a_gray_image():
    g = _gen(0)
    x = torch.randint(100, 156, (16, 1, 8, 8), generator=g, dtype=torch.uint8)
    cfg = _identity_cfg(jitter_p=1.0, jitter_strength=1.0, contrast=0.5)
    out = BatchAugment(cfg, 8, 1, [0.0], [1.0])(x, _gen(1))
    ref = x.float() / 255
    torch.testing.assert_close(out.mean(dim=(1, 2, 3)), ref.mean(dim=(1, 2, 3)), atol=1e-5, rtol=0)
    spread = out.std(dim=(1, 2, 3)) / ref.std(dim=(1, 2, 3))
    assert spread.min() >= 0.5 - 1e-4 and spread.max() <= 1.5 + 1e-4


def test_hsv_round_trip_and_hue_shift_match_torchvision():
    tvf = pytest.importorskip("torchvision.transforms.v2.functional")
    x = _images(8, 3, 16).float() / 255
    torch.testing.assert_close(hsv_to_rgb(rgb_to_hsv(x)), x, atol=1e-5, rtol=0)
    for shift in (-0.4, -0.1, 0.05, 0.3):
        hsv = rgb_to_hsv(x)
        hsv[:, 0] = torch.remainder(hsv[:, 0] + shift, 1.0)
        torch.testing.assert_close(hsv_to_rgb(hsv), tvf.adjust_hue(x, shift), atol=1e-5, rtol=0)


def test_grayscale_probability_one_gives_equal_channels():
    x = _images(8, 3, 8)
    out = BatchAugment(_identity_cfg(grayscale_p=1.0), 8, 3, [0.0] * 3, [1.0] * 3)(x, _gen(0))
    torch.testing.assert_close(out[:, 0], out[:, 1])
    torch.testing.assert_close(out[:, 1], out[:, 2])
    f = x.float() / 255
    torch.testing.assert_close(out[:, 0], 0.299 * f[:, 0] + 0.587 * f[:, 1] + 0.114 * f[:, 2], atol=1e-5, rtol=0)


def test_blur_smooths_per_sample_and_only_at_large_sizes():
    x = _images(6, 3, 96)
    cfg = _identity_cfg(blur_p=1.0, blur_sigma=(0.5, 2.0))
    aug = BatchAugment(cfg, 96, 3, [0.0] * 3, [1.0] * 3)
    assert aug.blur_kernel == 9  # 10 % of 96, odd
    out = aug(x, _gen(0))
    ref = x.float() / 255
    tv_ref = ref.diff(dim=-1).abs().mean(dim=(1, 2, 3))
    tv_out = out.diff(dim=-1).abs().mean(dim=(1, 2, 3))
    assert (tv_out < 0.8 * tv_ref).all()
    assert tv_out.unique().numel() == 6  # different sigmas
    torch.testing.assert_close(out.mean(dim=(2, 3)), ref.mean(dim=(2, 3)), atol=2e-3, rtol=0)
    small = BatchAugment(cfg, 32, 3, [0.0] * 3, [1.0] * 3)
    assert small.blur_kernel == 0  # below blur_min_size: no blur (SimCLR's CIFAR setting)
    y = _images(4, 3, 32)
    torch.testing.assert_close(small(y, _gen(0)), y.float() / 255, atol=1e-5, rtol=0)


def test_recipes_resolve_their_defaults_and_overrides_stick():
    simclr = AugmentConfig(recipe="simclr")
    assert simclr.crop_scale == (0.08, 1.0) and simclr.hue == 0.2 and simclr.grayscale_p == 0.2
    gray = AugmentConfig()
    assert gray.recipe == "gray_small" and gray.saturation == 0.0 and gray.hue == 0.0 and gray.blur_p == 0.0
    custom = AugmentConfig.from_dict({"recipe": "simclr", "crop_scale": [0.2, 1.0], "jitter_strength": 0.5})
    assert custom.crop_scale == (0.2, 1.0) and custom.jitter_strength == 0.5 and custom.flip_p == 0.5
    assert custom.to_dict()["crop_scale"] == [0.2, 1.0]
    assert set(RECIPES) == {"simclr", "gray_small", "none"}


def test_the_resolved_settings_are_the_configs_values_as_the_augmentation_was_made():
    cfg = AugmentConfig.from_dict({"recipe": "simclr", "hue": 0.1})
    settings = cfg.resolved()
    assert dataclasses.asdict(settings) == dataclasses.asdict(cfg)  # every key, none left None
    assert settings.hue == 0.1 and settings.crop_scale == (0.08, 1.0) and settings.blur_min_size == 96
    aug = BatchAugment(cfg, 8, 3, MEAN3, STD3)
    cfg.flip_p = 0.0  # a config changed afterwards is not the augmentation's
    assert aug.settings == settings and aug.settings.flip_p == 0.5


@pytest.mark.parametrize(
    "params,field",
    [
        ({"recipe": "autoaugment"}, "augment.recipe"),
        ({"crop_scale": (0.0, 1.0)}, "augment.crop_scale"),
        ({"crop_scale": (0.6, 0.2)}, "augment.crop_scale"),
        ({"crop_scale": (0.2, 1.5)}, "augment.crop_scale"),
        ({"crop_scale": 0.5}, "augment.crop_scale"),
        ({"crop_ratio": (-1.0, 2.0)}, "augment.crop_ratio"),
        ({"flip_p": 1.5}, "augment.flip_p"),
        ({"jitter_p": -0.1}, "augment.jitter_p"),
        ({"grayscale_p": "often"}, "augment.grayscale_p"),
        ({"jitter_strength": -1.0}, "augment.jitter_strength"),
        ({"jitter_strength": 2.0, "hue": 0.4}, "augment.hue"),
        ({"blur_sigma": (0.0, 1.0)}, "augment.blur_sigma"),
        ({"blur_kernel_frac": 0.0}, "augment.blur_kernel_frac"),
        ({"blur_min_size": 0}, "augment.blur_min_size"),
        ({"crop_sclae": (0.2, 1.0)}, "crop_sclae"),
    ],
)
def test_bad_config_values_raise_a_one_line_error_naming_the_field(params, field):
    with pytest.raises(ValueError) as info:
        AugmentConfig.from_dict(params)
    message = str(info.value)
    assert field in message and "\n" not in message


def test_bad_inputs_to_batch_augment():
    cfg = AugmentConfig()
    with pytest.raises(ValueError, match="channels"):
        BatchAugment(cfg, 16, 2, [0.5] * 2, [0.2] * 2)
    with pytest.raises(ValueError, match="image_size"):
        BatchAugment(cfg, 0, 1, [0.5], [0.2])
    with pytest.raises(ValueError, match="mean"):
        BatchAugment(cfg, 16, 3, [0.5], [0.2] * 3)
    with pytest.raises(ValueError, match="std"):
        BatchAugment(cfg, 16, 1, [0.5], [0.0])
    aug = BatchAugment(cfg, 16, 1, [0.5], [0.2])
    with pytest.raises(ValueError, match="uint8"):
        aug(torch.rand(2, 1, 16, 16))
    with pytest.raises(ValueError, match="channels"):
        aug(_images(2, 3, 16))
    assert aug(_images(0, 1, 16)).shape == (0, 1, 16, 16)


def test_normalize_is_the_eval_transform():
    x = _images(3, 3, 4)
    out = normalize(x, MEAN3, STD3)
    expected = (x.float() / 255 - torch.tensor(MEAN3).view(1, 3, 1, 1)) / torch.tensor(STD3).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="mean"):
        normalize(x, (0.5,), STD3)


def test_every_view_is_a_plausible_crop_of_its_own_image():
    # views of different images stay closer to their own image than to the others (the augmentation
    # transforms images, it does not mix them): compare low-frequency content at 4x4
    x = _images(8, 1, 32, seed=7)
    x = F.interpolate(x.float(), size=(4, 4), mode="nearest").repeat_interleave(8, -1).repeat_interleave(8, -2)
    x = x.to(torch.uint8)
    cfg = AugmentConfig(recipe="gray_small", crop_scale=(0.8, 1.0), flip_p=0.0, jitter_p=0.0)
    out = BatchAugment(cfg, 32, 1, [0.0], [1.0 / 255])(x, _gen(0))
    coarse_out = F.adaptive_avg_pool2d(out, 4).flatten(1)
    coarse_in = F.adaptive_avg_pool2d(x.float(), 4).flatten(1)
    nearest = torch.cdist(coarse_out, coarse_in).argmin(dim=1)
    assert torch.equal(nearest, torch.arange(8))
    assert math.isfinite(float(out.sum()))
