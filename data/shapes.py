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
import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._util import MissingPackageError, check_choice, check_positive_int, python_package_dir, sample_rng

__all__ = [
    "SHAPE_CLASSES",
    "BACKGROUNDS",
    "ShapeSpec",
    "inside",
    "render",
    "sample_spec",
    "Shapes",
]

SHAPE_CLASSES: tuple[str, ...] = (
    "circle", "square", "triangle", "star", "cross", "ring", "hexagon", "heart", "arrow", "crescent",
)  # fmt: skip
# skimage.data files (CC0 / public domain per their docstrings)
BACKGROUNDS: dict[str, str] = {
    "astronaut": "astronaut.png",
    "coffee": "coffee.png",
    "chelsea": "chelsea.png",
    "rocket": "rocket.jpg",
    "hubble_deep_field": "hubble_deep_field.jpg",
    "camera": "camera.png",
    "retina": "retina.jpg",
    "brick": "brick.png",
    "grass": "grass.png",
    "gravel": "gravel.png",
}
_MAX_BACKGROUND_SIDE = 512  # canonical photos are area-downscaled once so that their short side is <= 512
_SPLITS = {"train": 0, "test": 1, "val": 2}


# ----------------------------------------------------------------------------- shape geometry
def _regular_polygon(n: int, radius: float, phase: float = math.pi / 2) -> np.ndarray:
    a = phase + 2 * math.pi * np.arange(n) / n
    return np.stack([radius * np.cos(a), radius * np.sin(a)], axis=1)  # (n, 2) (u, v)


def _star(points: int, outer: float, inner: float) -> np.ndarray:
    a = math.pi / 2 + math.pi * np.arange(2 * points) / points
    r = np.where(np.arange(2 * points) % 2 == 0, outer, inner)
    return np.stack([r * np.cos(a), r * np.sin(a)], axis=1)  # (2p, 2)


_POLYGONS: dict[str, np.ndarray] = {
    "triangle": _regular_polygon(3, 0.95),
    "hexagon": _regular_polygon(6, 0.92),
    "star": _star(5, 0.97, 0.40),
    "arrow": np.array(
        [[-0.9, -0.2], [0.2, -0.2], [0.2, -0.55], [0.9, 0.0], [0.2, 0.55], [0.2, 0.2], [-0.9, 0.2]]
    ),
}


def _inside_polygon(u: np.ndarray, v: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """Even-odd crossing test of points ``(u, v)`` against a closed polygon ``(K, 2)``."""
    out = np.zeros(u.shape, dtype=bool)
    x2, y2 = poly[-1]
    for x1, y1 in poly:
        if y1 != y2:
            crosses = (y1 > v) != (y2 > v)
            x_at = x1 + (x2 - x1) * (v - y1) / (y2 - y1)
            out ^= crosses & (u < x_at)
        x2, y2 = x1, y1
    return out


def inside(name: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether object-frame points ``(u, v)`` (v up) lie inside the shape class ``name``.

    Every class fits in the unit disc, so a shape of size ``d`` (diameter, image units) is this set
    scaled by ``d / 2``.
    """
    check_choice("shape", name, SHAPE_CLASSES)
    if name == "circle":
        return u * u + v * v <= 0.85**2
    if name == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.68
    if name == "cross":
        au, av = np.abs(u), np.abs(v)
        return ((au <= 0.27) & (av <= 0.92)) | ((av <= 0.27) & (au <= 0.92))
    if name == "ring":
        r2 = u * u + v * v
        return (r2 >= 0.5**2) & (r2 <= 0.9**2)
    if name == "heart":  # (x^2 + y^2 - 1)^3 <= x^2 y^3, centred and scaled into the unit disc
        x, y = u * 1.3, v * 1.3 + 0.2
        return (x * x + y * y - 1) ** 3 - x * x * y**3 <= 0
    if name == "crescent":
        return (u * u + v * v <= 0.9**2) & ((u - 0.4) ** 2 + v * v > 0.75**2)
    return _inside_polygon(u, v, _POLYGONS[name])


# ----------------------------------------------------------------------------- descriptions
@dataclass(frozen=True)
class ShapeSpec:
    """A resolution-independent sample. Image units: the image is the unit square, ``(y, x)`` down/right.

    Attributes:
        shape: the shape class, a name in :data:`SHAPE_CLASSES`.
        center: ``(y, x)`` of the shape centre.
        size: diameter of the shape's circumscribed circle (fraction of the image side).
        rotation: counter-clockwise rotation in radians.
        color: RGB in [0, 1].
        background: a key of :data:`BACKGROUNDS`, or None for a plain grey background.
        crop: ``(top, left, side)``: side as a fraction of the photo's short side, top/left as fractions
            of the remaining free range.
        flip: mirror the background crop horizontally.
        size_bin: which of the equal parts of the size range ``size`` falls in (0 = smallest).
    """

    shape: str
    center: tuple[float, float]
    size: float
    rotation: float
    color: tuple[float, float, float]
    background: str | None
    crop: tuple[float, float, float]
    flip: bool
    size_bin: int


def sample_spec(
    rng: np.random.Generator,
    shape: str,
    *,
    size_range: tuple[float, float] = (0.15, 0.6),
    backgrounds: Sequence[str] | None = tuple(BACKGROUNDS),
    size_bins: int = 5,
) -> ShapeSpec:
    """Draw a description of a ``shape`` (the whole shape stays inside the image)."""
    check_choice("shape", shape, SHAPE_CLASSES)
    lo, hi = size_range
    size = float(rng.uniform(lo, hi))
    size_bin = min(int(size_bins * (size - lo) / (hi - lo)) if hi > lo else 0, size_bins - 1)
    r = size / 2
    cy, cx = (float(c) for c in rng.uniform(r, 1 - r, size=2))
    rotation = float(rng.uniform(0, 2 * math.pi))
    h, s, v = rng.uniform(0, 1), rng.uniform(0.6, 1.0), rng.uniform(0.65, 1.0)
    color = tuple(float(c) for c in colorsys.hsv_to_rgb(h, s, v))
    if backgrounds:
        bg = str(backgrounds[int(rng.integers(len(backgrounds)))])
        crop = (float(rng.uniform()), float(rng.uniform()), float(rng.uniform(0.5, 1.0)))
        flip = bool(rng.integers(2))
    else:
        bg, crop, flip = None, (0.0, 0.0, 1.0), False
    return ShapeSpec(shape, (cy, cx), size, rotation, color, bg, crop, flip, size_bin)


# ----------------------------------------------------------------------------- rendering
@functools.lru_cache(maxsize=len(BACKGROUNDS))
def _photo(name: str) -> tuple[np.ndarray, np.ndarray]:
    """A canonical background photo and its column integrals.

    Returns ``(padded, cum)``: the photo ``(H, W, 3)`` in [0, 1] (short side <= 512, area-downscaled),
    padded by one replicated pixel on each side, float32 ``(H + 2, W + 2, 3)``; and ``cum`` float64,
    the integral along y of its bilinear reconstruction up to each sample (see :func:`_box_mean_of_linear`).
    """
    import cv2

    check_choice("background", name, tuple(BACKGROUNDS))
    path = python_package_dir("skimage", pip_name="scikit-image") / "data" / BACKGROUNDS[name]
    if not path.exists():
        raise MissingPackageError(
            f"{path} is missing from the scikit-image install. Reinstall it with `pip install scikit-image`."
        )
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if img is None:
        raise OSError(f"cannot decode the background image {path}")
    img = img[:, :, ::-1]  # BGR -> RGB
    short = min(img.shape[:2])
    if short > _MAX_BACKGROUND_SIDE:
        f = _MAX_BACKGROUND_SIDE / short
        img = cv2.resize(img, (round(img.shape[1] * f), round(img.shape[0] * f)), interpolation=cv2.INTER_AREA)
    padded = np.pad(np.asarray(img, dtype=np.float32) / 255.0, ((1, 1), (1, 1), (0, 0)), mode="edge")
    cum = _knot_integrals(padded)
    padded.flags.writeable = False
    cum.flags.writeable = False
    return padded, cum


def _knot_integrals(f: np.ndarray) -> np.ndarray:
    """Integral along axis 0 of the piecewise-linear interpolant of ``f`` (unit knot spacing) up to each knot."""
    f = f.astype(np.float64, copy=False)
    return np.concatenate([np.zeros_like(f[:1]), np.cumsum(0.5 * (f[1:] + f[:-1]), axis=0)])


def _box_mean_of_linear(
    f: np.ndarray, n_out: int, *, start: float = 0.0, length: float | None = None, cum: np.ndarray | None = None
) -> np.ndarray:
    """Mean over ``n_out`` equal pixels of the piecewise-linear interpolant of ``f``, along axis 0.

    Sample ``k`` of ``f`` sits at ``k - 0.5`` (so a source image of ``n`` pixels padded by one sample on
    each side spans ``[0, n]``); output pixel ``i`` covers ``start + [i, i + 1] * length / n_out``
    (default: the whole ``[0, n]``). The integral is exact: the integral up to the knot below each pixel
    edge (``cum``, from :func:`_knot_integrals`) plus the partial quadratic piece, so the cost is
    O(n_out x columns) once ``cum`` is known.
    """
    n = f.shape[0] - 2
    length = float(n if length is None else length)
    if cum is None:
        cum = _knot_integrals(f)
    edges = start + np.arange(n_out + 1, dtype=np.float64) * (length / n_out)  # (n_out + 1,)
    k = np.clip(np.floor(edges + 0.5).astype(np.int64), 0, n)  # knot at or below each edge
    d = (edges + 0.5 - k).reshape(-1, *([1] * (f.ndim - 1)))  # offset from that knot, in [0, 1]
    fk, fk1 = f[k].astype(np.float64), f[k + 1].astype(np.float64)
    F = cum[k] + fk * d + (fk1 - fk) * (0.5 * d * d)  # (n_out + 1, ...)
    return (F[1:] - F[:-1]) / (length / n_out)


def _background(spec: ShapeSpec, resolution: int) -> np.ndarray:
    if spec.background is None:
        return np.full((resolution, resolution, 3), 0.5, dtype=np.float32)
    padded, cum = _photo(spec.background)
    H, W = padded.shape[0] - 2, padded.shape[1] - 2
    top_f, left_f, side_f = spec.crop
    side = max(2, int(round(side_f * min(H, W))))
    top, left = int(round(top_f * (H - side))), int(round(left_f * (W - side)))
    # integrate along y over the crop rows, keeping the crop's columns and one neighbour on each side
    cols = slice(left, left + side + 2)  # padded column indices: crop columns plus neighbours
    rows = _box_mean_of_linear(
        padded[:, cols], resolution, start=float(top), length=float(side), cum=cum[:, cols]
    )  # (R, S + 2, 3)
    out = _box_mean_of_linear(rows.transpose(1, 0, 2), resolution)  # (R, R, 3) indexed (x, y, c)
    out = out.transpose(1, 0, 2)  # (R, R, 3) indexed (y, x, c)
    if spec.flip:
        out = out[:, ::-1]
    return np.ascontiguousarray(out, dtype=np.float32)


def _coverage(spec: ShapeSpec, resolution: int, supersample: int) -> tuple[np.ndarray, slice, slice]:
    """Fraction of each pixel (inside the shape's bounding box) covered by the shape."""
    R, s = resolution, supersample
    cy, cx = spec.center
    r = spec.size / 2
    y0, y1 = max(0, int(math.floor((cy - r) * R))), min(R, int(math.ceil((cy + r) * R)))
    x0, x1 = max(0, int(math.floor((cx - r) * R))), min(R, int(math.ceil((cx + r) * R)))
    sub = (np.arange(s, dtype=np.float64) + 0.5) / s  # sub-pixel offsets
    ys = (((np.arange(y0, y1)[:, None] + sub[None, :]).reshape(-1) / R - cy) / r).astype(np.float32)  # (hs,)
    xs = (((np.arange(x0, x1)[:, None] + sub[None, :]).reshape(-1) / R - cx) / r).astype(np.float32)  # (ws,)
    c, sn = np.float32(math.cos(spec.rotation)), np.float32(math.sin(spec.rotation))
    cov = np.empty((y1 - y0, x1 - x0), dtype=np.float32)
    rows_per_chunk = max(1, (1 << 21) // max(1, xs.size * s))  # ~2M samples per chunk
    for a in range(0, y1 - y0, rows_per_chunk):
        b = min(y1 - y0, a + rows_per_chunk)
        dy = ys[a * s : b * s, None]  # (h, 1), image y points down
        dx = xs[None, :]  # (1, w)
        # rotate the sample points by -rotation into the object frame (v up)
        u = c * dx - sn * dy
        v = -sn * dx - c * dy
        hit = inside(spec.shape, u, v)  # (h*s, w*s)
        cov[a:b] = hit.reshape(b - a, s, x1 - x0, s).mean(axis=(1, 3))
    return cov, slice(y0, y1), slice(x0, x1)


def render(spec: ShapeSpec, resolution: int, *, supersample: int = 4, background_contrast: float = 0.7) -> np.ndarray:
    """Rasterise ``spec`` at ``resolution x resolution``: ``(R, R, 3)`` float32 in [0, 1].

    ``supersample`` is the number of samples per pixel side for the shape edges (``s*s`` per pixel).
    ``background_contrast`` scales the photo around mid-grey (1 keeps it as is) so shapes stay visible.
    """
    resolution = check_positive_int("resolution", resolution)
    supersample = check_positive_int("supersample", supersample)
    if not 0 <= background_contrast <= 1:
        raise ValueError(f"background_contrast must be in [0, 1], got {background_contrast}")
    img = _background(spec, resolution)
    if background_contrast != 1:
        img = 0.5 + background_contrast * (img - 0.5)
    cov, ys, xs = _coverage(spec, resolution, supersample)
    color = np.asarray(spec.color, dtype=np.float32)
    a = cov[:, :, None]
    img[ys, xs] = (1 - a) * img[ys, xs] + a * color
    return np.clip(img, 0.0, 1.0, out=img).astype(np.float32, copy=False)


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
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std (or neither)")
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
