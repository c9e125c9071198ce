"""The augmentation's parameters (the config's ``augment``): its recipes, what each key means
and :class:`AugmentConfig`, which checks them.  Torch-free, so the config is checked without
loading the augmentation itself (:mod:`smallbatch.data.augment`, which re-exports every name here)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

#: Default parameter values of each recipe.
RECIPES: dict[str, dict[str, Any]] = {
    "simclr": dict(
        crop_scale=(0.08, 1.0),
        crop_ratio=(3 / 4, 4 / 3),
        flip_p=0.5,
        jitter_p=0.8,
        jitter_strength=1.0,
        brightness=0.8,
        contrast=0.8,
        saturation=0.8,
        hue=0.2,
        grayscale_p=0.2,
        blur_p=0.5,
        blur_sigma=(0.1, 2.0),
        blur_kernel_frac=0.1,
        blur_min_size=96,
    ),
    "gray_small": dict(
        crop_scale=(0.08, 1.0),
        crop_ratio=(3 / 4, 4 / 3),
        flip_p=0.5,
        jitter_p=0.8,
        jitter_strength=0.5,
        brightness=0.8,
        contrast=0.8,
        saturation=0.0,
        hue=0.0,
        grayscale_p=0.0,
        blur_p=0.0,
        blur_sigma=(0.1, 2.0),
        blur_kernel_frac=0.1,
        blur_min_size=96,
    ),
    "none": dict(
        crop_scale=(1.0, 1.0),
        crop_ratio=(1.0, 1.0),
        flip_p=0.0,
        jitter_p=0.0,
        jitter_strength=0.0,
        brightness=0.0,
        contrast=0.0,
        saturation=0.0,
        hue=0.0,
        grayscale_p=0.0,
        blur_p=0.0,
        blur_sigma=(0.1, 2.0),
        blur_kernel_frac=0.1,
        blur_min_size=96,
    ),
}


#: What each parameter of :class:`AugmentConfig` (the config's ``augment.<key>``) means
MEANINGS: dict[str, str] = {
    "recipe": "'gray_small', 'simclr' or 'none' (smallbatch.data.augment); its values fill the keys left unset",
    "crop_scale": "(min, max) area fraction of the random resized crop, 0 < min <= max <= 1",
    "crop_ratio": "(min, max) aspect ratio w/h of the crop, 0 < min <= max",
    "flip_p": "probability of a horizontal flip",
    "jitter_p": "probability of applying colour jitter",
    "jitter_strength": "SimCLR's colour strength s: the jitter ranges are brightness, contrast, saturation and hue times s",
    "brightness": "brightness factor f: drawn from [max(0, 1 - f s), 1 + f s]",
    "contrast": "contrast factor f: drawn from [max(0, 1 - f s), 1 + f s]",
    "saturation": "saturation factor f: drawn from [max(0, 1 - f s), 1 + f s] (3-channel images)",
    "hue": "hue shift drawn from [-f s, f s], f s <= 0.5 (3-channel images)",
    "grayscale_p": "probability of converting to grayscale (3-channel images)",
    "blur_p": "probability of a Gaussian blur",
    "blur_sigma": "(min, max) of the blur's standard deviation in pixels",
    "blur_kernel_frac": "the blur kernel's size as a fraction of the image size",
    "blur_min_size": "blur only images of at least this many pixels",
}


@dataclass(frozen=True)
class AugmentSettings:
    """:class:`AugmentConfig`'s parameters once its recipe has filled the unset ones and they are
    checked (:meth:`AugmentConfig.resolved`): every one set, so typed without ``None``."""

    recipe: str
    crop_scale: tuple[float, float]
    crop_ratio: tuple[float, float]
    flip_p: float
    jitter_p: float
    jitter_strength: float
    brightness: float
    contrast: float
    saturation: float
    hue: float
    grayscale_p: float
    blur_p: float
    blur_sigma: tuple[float, float]
    blur_kernel_frac: float
    blur_min_size: int


@dataclass
class AugmentConfig:
    """Parameters of the augmentation (:data:`MEANINGS`); ``None`` takes the value of ``recipe``."""

    recipe: str = "gray_small"
    crop_scale: tuple[float, float] | None = None
    crop_ratio: tuple[float, float] | None = None
    flip_p: float | None = None
    jitter_p: float | None = None
    jitter_strength: float | None = None
    brightness: float | None = None
    contrast: float | None = None
    saturation: float | None = None
    hue: float | None = None
    grayscale_p: float | None = None
    blur_p: float | None = None
    blur_sigma: tuple[float, float] | None = None
    blur_kernel_frac: float | None = None
    blur_min_size: int | None = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"augment.recipe must be one of {', '.join(RECIPES)}; got {self.recipe!r}")
        for key, default in RECIPES[self.recipe].items():
            if getattr(self, key) is None:
                setattr(self, key, default)
        self._validate()

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> AugmentConfig:
        """Build from a config mapping; an unknown key raises ``ValueError`` naming the allowed ones."""
        params = dict(params or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f"augment: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return cls(**params)

    @staticmethod
    def reference() -> list[tuple[str, Any, str, dict[str, Any]]]:
        """(key, default, meaning, {recipe: its value}) of every parameter; only ``recipe`` has a default of its own."""
        rows = []
        for f in fields(AugmentConfig):
            per = {} if f.name == "recipe" else {r: v[f.name] for r, v in RECIPES.items()}
            rows.append(
                (
                    f.name,
                    f.default,
                    MEANINGS[f.name],
                    {r: list(v) if isinstance(v, tuple) else v for r, v in per.items()},
                )
            )
        return rows

    def resolved(self) -> AugmentSettings:
        """The parameters as they stand (each one set since ``__post_init__``), typed so."""
        return AugmentSettings(**asdict(self))

    def to_dict(self) -> dict[str, Any]:
        """The resolved parameters (tuples as lists), e.g. for logging."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def _validate(self) -> None:
        def pair(name: str, lo_min: float, hi_max: float | None, lo_open: bool = True) -> None:
            value = getattr(self, name)
            try:
                lo, hi = (float(v) for v in value)
            except (TypeError, ValueError):
                raise ValueError(f"augment.{name} must be a pair [min, max] of numbers; got {value!r}") from None
            ok = (lo > lo_min if lo_open else lo >= lo_min) and lo <= hi and (hi_max is None or hi <= hi_max)
            if not ok or not all(math.isfinite(v) for v in (lo, hi)):
                upper = f" <= max <= {hi_max}" if hi_max is not None else " <= max"
                raise ValueError(f"augment.{name} must satisfy {lo_min} < min{upper}; got {value!r}")
            setattr(self, name, (lo, hi))

        def number(name: str, lo: float, hi: float | None) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"augment.{name} must be a number; got {value!r}")
            if value < lo or (hi is not None and value > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ValueError(f"augment.{name} must be {bound}; got {value!r}")
            setattr(self, name, float(value))
            return float(value)

        pair("crop_scale", 0.0, 1.0)
        pair("crop_ratio", 0.0, None)
        pair("blur_sigma", 0.0, None)
        for name in ("flip_p", "jitter_p", "grayscale_p", "blur_p"):
            number(name, 0.0, 1.0)
        jitter = {
            name: number(name, 0.0, None) for name in ("jitter_strength", "brightness", "contrast", "saturation", "hue")
        }
        if jitter["hue"] * jitter["jitter_strength"] > 0.5:
            raise ValueError(
                f"augment.hue * augment.jitter_strength must be <= 0.5; got {self.hue} * {self.jitter_strength}"
            )
        number("blur_kernel_frac", 0.0, 1.0)
        if self.blur_kernel_frac == 0.0:
            raise ValueError("augment.blur_kernel_frac must be in (0, 1]; got 0.0")
        size = self.blur_min_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"augment.blur_min_size must be a positive integer; got {size!r}")
