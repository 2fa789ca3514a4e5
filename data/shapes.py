"""Shapes-HR: procedural shapes on real photo backgrounds, rendered at any resolution with true detail.

Each sample is a resolution-independent description (:class:`ShapeSpec`) drawn from a per-index seed:
the shape class, its centre, size (diameter of its circumscribed circle as a fraction of the image
side), rotation and colour, and a square crop of a real photo as the background. :func:`render`
rasterises a description at any resolution R, so the same sample exists at 1x ... 4.57x the training
size with real high-resolution detail (the analogue of ImageNet-HR for the LookHere protocol), not an
upsampled copy:

* the shape's coverage of each pixel is estimated on an ``s x s`` supersampled grid with an exact
  inside test (polygons, discs, an implicit heart curve), i.e. a box filter of the ideal shape;
* the background is the photo crop reconstructed bilinearly (tent functions over its pixels) and
  integrated exactly over each output pixel, so a render at 2R average-pooled 2x2 gives the render
  at R (exactly for the background, up to supersampling error at shape edges).

Backgrounds are scikit-image's bundled images whose docstrings state CC0 or public domain:
astronaut, rocket, hubble_deep_field (NASA / SpaceX, public domain), coffee, chelsea, camera, retina
(CC0) and the brick, grass, gravel textures (CC0). They are read from the installed package at run
time, never copied into the project.

Object size: ``size_range`` bounds the drawn size (uniform), and ``size_bin`` splits that range into
``size_bins`` equal parts (quintiles of the size distribution by default), for LookHere's accuracy by
object-size quintile.
"""

from __future__ import annotations

import colorsys
import math
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._util import check_choice, check_positive_int, sample_rng
from .shapes_geometry import SHAPE_CLASSES, inside
from .shapes_render import BACKGROUNDS, ShapeSpec, render

__all__ = [
    "SHAPE_CLASSES",
    "BACKGROUNDS",
    "ShapeSpec",
    "inside",
    "render",
    "sample_spec",
    "Shapes",
]

_SPLITS = {"train": 0, "test": 1, "val": 2}


# ----------------------------------------------------------------------------- descriptions
def sample_spec(
    rng: np.random.Generator,
    shape: str,
    *,
    size_range: tuple[float, float] = (0.15, 0.6),
    backgrounds: Sequence[str] | None = tuple(BACKGROUNDS),
    size_bins: int = 5,
    rotation: float = math.pi,
) -> ShapeSpec:
    """Draw a description of a ``shape`` (the whole shape stays inside the image), turned by an angle drawn
    uniformly from ``[-rotation, rotation]`` radians (``pi``, the default: any orientation)."""
    check_choice("shape", shape, SHAPE_CLASSES)
    lo, hi = size_range
    size = float(rng.uniform(lo, hi))
    size_bin = min(int(size_bins * (size - lo) / (hi - lo)) if hi > lo else 0, size_bins - 1)
    r = size / 2
    cy, cx = (float(c) for c in rng.uniform(r, 1 - r, size=2))
    # one uniform draw either way, so the rest of the description is the same whatever the rotation range
    turn = float(rng.uniform(0, 2 * math.pi))
    if rotation < math.pi:
        turn = (turn / math.pi - 1.0) * rotation  # [0, 2 pi) mapped onto [-rotation, rotation)
    h, s, v = rng.uniform(0, 1), rng.uniform(0.6, 1.0), rng.uniform(0.65, 1.0)
    color = tuple(float(c) for c in colorsys.hsv_to_rgb(h, s, v))
    if backgrounds:
        bg = str(backgrounds[int(rng.integers(len(backgrounds)))])
        crop = (float(rng.uniform()), float(rng.uniform()), float(rng.uniform(0.5, 1.0)))
        flip = bool(rng.integers(2))
    else:
        bg, crop, flip = None, (0.0, 0.0, 1.0), False
    return ShapeSpec(shape, (cy, cx), size, turn, color, bg, crop, flip, size_bin)


# ----------------------------------------------------------------------------- dataset
class Shapes(Dataset):
    """Shapes-HR classification: sample ``i`` is ``render(spec(i), resolution)`` with label ``i % num_classes``.

    Args:
        num_samples: dataset length (samples are generated on access; any length is free).
        resolution: output side in pixels; :meth:`at` gives the same samples at another resolution.
        split: "train", "test" or "val": independent seed streams.
        seed: base seed; sample ``i`` depends only on ``(seed, split, i)``.
        classes: shape class names to use (a subset of :data:`SHAPE_CLASSES`, in label order).
        size_range: (min, max) shape diameter as a fraction of the image side, within (0, 1].
        size_bins: number of equal size bins for ``size_bin`` (5 = quintiles).
        backgrounds: background photo names (keys of :data:`BACKGROUNDS`); None or () for plain grey.
        supersample: samples per pixel side for antialiasing.
        background_contrast: see :func:`render`.
        rotation: each shape turns by an angle uniform in ``[-rotation, rotation]`` radians, within ``[0, pi]``
            (``pi``: any orientation; ``0``: upright).
        transform: optional albumentations-style callable on the float32 HWC image.
        mean, std: optional per-channel normalisation of the output tensor.
    """

    def __init__(
        self,
        num_samples: int = 10000,
        *,
        resolution: int = 64,
        split: str = "train",
        seed: int = 0,
        classes: Sequence[str] = SHAPE_CLASSES,
        size_range: tuple[float, float] = (0.15, 0.6),
        size_bins: int = 5,
        backgrounds: Sequence[str] | None = tuple(BACKGROUNDS),
        supersample: int = 4,
        background_contrast: float = 0.7,
        rotation: float = math.pi,
        transform: Callable | None = None,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
    ) -> None:
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.resolution = check_positive_int("resolution", resolution)
        check_choice("split", split, tuple(_SPLITS))
        classes = tuple(classes)
        unknown = [c for c in classes if c not in SHAPE_CLASSES]
        if not classes or unknown or len(set(classes)) != len(classes):
            raise ValueError(f"classes must be distinct names from {list(SHAPE_CLASSES)}, got {list(classes)}")
        lo, hi = (float(v) for v in size_range)
        if not 0 < lo <= hi <= 1:
            raise ValueError(
                f"size_range must be (lo, hi) with 0 < lo <= hi <= 1 (fractions of the side), got {size_range}"
            )
        backgrounds = tuple(backgrounds or ())
        for b in backgrounds:
            check_choice("background", b, tuple(BACKGROUNDS))
        self.size_bins = check_positive_int("size_bins", size_bins)
        self.supersample = check_positive_int("supersample", supersample)
        if not 0 <= background_contrast <= 1:
            raise ValueError(f"background_contrast must be in [0, 1], got {background_contrast}")
        if isinstance(rotation, bool) or not isinstance(rotation, (int, float)) or not 0 <= rotation <= math.pi:
            raise ValueError(f"rotation must be a number of radians in [0, pi] (pi: any orientation), got {rotation!r}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std (or neither)")
        self.rotation = float(rotation)
        self.split, self.seed, self.classes = split, int(seed), classes
        self.size_range, self.backgrounds = (lo, hi), backgrounds
        self.background_contrast = float(background_contrast)
        self.transform = transform
        self.mean, self.std = mean, std

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return self.num_samples

    def at(self, resolution: int) -> "Shapes":
        """The same samples rendered at another resolution."""
        new = object.__new__(Shapes)
        new.__dict__.update(self.__dict__)
        new.resolution = check_positive_int("resolution", resolution)
        return new

    def spec(self, index: int) -> ShapeSpec:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = sample_rng(self.seed, _SPLITS[self.split], index)
        return sample_spec(
            rng,
            self.classes[index % self.num_classes],
            size_range=self.size_range,
            backgrounds=self.backgrounds,
            size_bins=self.size_bins,
            rotation=self.rotation,
        )

    def size_bin(self, index: int) -> int:
        return self.spec(index).size_bin

    def render(self, index: int, resolution: int | None = None) -> np.ndarray:
        """The ``(R, R, 3)`` float32 image of sample ``index`` (before transform / normalisation)."""
        return render(
            self.spec(index),
            resolution or self.resolution,
            supersample=self.supersample,
            background_contrast=self.background_contrast,
        )

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if index < 0:
            index += self.num_samples
        img = self.render(index)
        if self.transform is not None:
            img = np.asarray(self.transform(image=img)["image"], dtype=np.float32)
        x = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).clamp_(0.0, 1.0)  # (3, R, R)
        if self.mean is not None:
            mean = torch.as_tensor(self.mean, dtype=torch.float32).reshape(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=torch.float32).reshape(-1, 1, 1)
            x = (x - mean) / std
        return x, index % self.num_classes
