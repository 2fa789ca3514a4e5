"""Shapes-HR's shape classes and their exact inside tests, in the object frame (``v`` up, the unit disc).

Every class of :data:`SHAPE_CLASSES` is a set of points ``(u, v)`` inside the unit disc: discs, rings and a
crescent by their radii, a square and a cross by their half-widths, an implicit heart curve, and polygons (a
triangle, a hexagon, a five-pointed star, an arrow) by an even-odd crossing test. :func:`inside` is what the
renderer samples on its supersampled grid (:mod:`data.shapes_render`).
"""

from __future__ import annotations

import math

import numpy as np

from ._util import check_choice

__all__ = ["SHAPE_CLASSES", "inside"]


SHAPE_CLASSES: tuple[str, ...] = (
    "circle", "square", "triangle", "star", "cross", "ring", "hexagon", "heart", "arrow", "crescent",
)  # fmt: skip


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
