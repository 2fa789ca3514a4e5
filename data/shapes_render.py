"""Shapes-HR's renderer: a :class:`ShapeSpec` rasterised at any resolution, with real photo detail.

The shape's coverage of each pixel is the mean of an exact inside test (:func:`data.shapes_geometry.inside`) on
an ``s x s`` supersampled grid; the background is a square crop of one of scikit-image's bundled CC0 / public
domain photos (:data:`BACKGROUNDS`, read from the installed package and area-downscaled once to a short side of
at most 512), reconstructed bilinearly and integrated exactly over each output pixel (``_box_mean_of_linear``),
so a render at 2R average-pooled 2x2 gives the render at R. :func:`render` blends the two. The description it
renders (:class:`ShapeSpec`) is defined here, the module that reads it, and :mod:`data.shapes` (which draws the
descriptions) re-exports it, so the renderer imports nothing from :mod:`data.shapes`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ._util import MissingPackageError, check_choice, check_positive_int, python_package_dir
from .shapes_geometry import inside

__all__ = ["BACKGROUNDS", "ShapeSpec", "render"]


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


@dataclass(frozen=True)
class ShapeSpec:
    """A resolution-independent sample. Image units: the image is the unit square, ``(y, x)`` down/right.

    Attributes:
        shape: the shape class, a name in :data:`data.shapes_geometry.SHAPE_CLASSES`.
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
