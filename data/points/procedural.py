"""Procedural point-cloud shapes: primitives and assemblies with random proportions (a ModelNet-like set)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .._util import check_choice, sample_rng
from .dataset import _SPLITS, PointCloudDataset
from .mesh_io import Mesh, _fan

__all__ = ["SYNTHETIC_CLASSES", "synthetic_shape", "SyntheticShapes3D"]


SYNTHETIC_CLASSES: tuple[str, ...] = (
    "sphere", "box", "cylinder", "cone", "torus", "pyramid", "table", "chair", "lamp", "mug",
)  # fmt: skip


def _grid_surface(fn, nu: int, nv: int, *, wrap_u: bool = True, wrap_v: bool = False) -> Mesh:
    """Triangulate a parametric surface ``fn(u, v) -> (..., 3)`` over ``[0, 1]^2``."""
    u = np.linspace(0, 1, nu + (0 if wrap_u else 1), endpoint=not wrap_u)
    v = np.linspace(0, 1, nv + (0 if wrap_v else 1), endpoint=not wrap_v)
    U, V = np.meshgrid(u, v, indexing="ij")
    pts = fn(U, V).reshape(-1, 3)  # (nu' * nv', 3)
    nu_, nv_ = len(u), len(v)
    idx = np.arange(nu_ * nv_).reshape(nu_, nv_)
    iu = np.arange(nu if wrap_u else nu_ - 1)
    iv = np.arange(nv if wrap_v else nv_ - 1)
    a = idx[iu[:, None], iv[None, :]]
    b = idx[(iu[:, None] + 1) % nu_, iv[None, :]]
    c = idx[(iu[:, None] + 1) % nu_, (iv[None, :] + 1) % nv_]
    d = idx[iu[:, None], (iv[None, :] + 1) % nv_]
    faces = np.concatenate([np.stack([a, b, c], -1).reshape(-1, 3), np.stack([a, c, d], -1).reshape(-1, 3)])
    return Mesh(pts, faces)


def _combine(*parts: Mesh) -> Mesh:
    verts, faces, off = [], [], 0
    for p in parts:
        verts.append(p.vertices)
        faces.append(p.faces + off)
        off += len(p.vertices)
    return Mesh(np.concatenate(verts), np.concatenate(faces))


def _moved(m: Mesh, offset: Sequence[float]) -> Mesh:
    return Mesh(m.vertices + np.asarray(offset, dtype=np.float64), m.faces)


def _box(sx: float, sy: float, sz: float, center: Sequence[float] = (0, 0, 0)) -> Mesh:
    v = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], dtype=np.float64)
    v = v * (np.array([sx, sy, sz]) / 2) + np.asarray(center, dtype=np.float64)
    quads = [(0, 1, 3, 2), (4, 6, 7, 5), (0, 4, 5, 1), (2, 3, 7, 6), (0, 2, 6, 4), (1, 5, 7, 3)]
    return Mesh(v, _fan(quads))


def _disk(r: float, z: float, segments: int = 32) -> Mesh:
    t = 2 * math.pi * np.arange(segments) / segments
    rim = np.stack([r * np.cos(t), r * np.sin(t), np.full(segments, z)], 1)
    v = np.concatenate([[[0.0, 0.0, z]], rim])
    k = np.arange(segments)
    faces = np.stack([np.zeros(segments, dtype=np.int64), 1 + k, 1 + (k + 1) % segments], 1)  # (segments, 3)
    return Mesh(v, faces)


def _cylinder(r: float, h: float, *, caps: bool = True, segments: int = 32) -> Mesh:
    """A z-axis cylinder from z = 0 to z = h."""
    side = _grid_surface(
        lambda u, v: np.stack([r * np.cos(2 * math.pi * u), r * np.sin(2 * math.pi * u), h * v], -1), segments, 1
    )
    return _combine(side, _disk(r, 0.0, segments), _disk(r, h, segments)) if caps else side


def _cone(r: float, h: float, *, segments: int = 32) -> Mesh:
    side = _grid_surface(
        lambda u, v: np.stack(
            [r * (1 - v) * np.cos(2 * math.pi * u), r * (1 - v) * np.sin(2 * math.pi * u), h * v], -1
        ),
        segments,
        8,
    )
    return _combine(side, _disk(r, 0.0, segments))


def _sphere(r: float, segments: int = 32) -> Mesh:
    def fn(u, v):
        th, ph = 2 * math.pi * u, math.pi * v
        return np.stack([r * np.sin(ph) * np.cos(th), r * np.sin(ph) * np.sin(th), r * np.cos(ph)], -1)

    return _grid_surface(fn, segments, segments // 2)


def _torus(R: float, r: float, segments: int = 32) -> Mesh:
    def fn(u, v):
        th, ph = 2 * math.pi * u, 2 * math.pi * v
        rr = R + r * np.cos(ph)
        return np.stack([rr * np.cos(th), rr * np.sin(th), r * np.sin(ph)], -1)

    return _grid_surface(fn, segments, segments // 2, wrap_v=True)


def _pyramid(base: float, h: float) -> Mesh:
    b = base / 2
    v = np.array([[-b, -b, 0], [b, -b, 0], [b, b, 0], [-b, b, 0], [0, 0, h]], dtype=np.float64)
    return Mesh(v, _fan([(0, 3, 2, 1), (0, 1, 4), (1, 2, 4), (2, 3, 4), (3, 0, 4)]))


def _legs(w: float, d: float, h: float, r: float) -> list[Mesh]:
    leg = _cylinder(r, h, segments=12)
    return [_moved(leg, (sx * (w / 2 - r), sy * (d / 2 - r), 0)) for sx in (-1, 1) for sy in (-1, 1)]


def synthetic_shape(name: str, rng: np.random.Generator) -> Mesh:
    """A random instance of the procedural class ``name`` (z up), not yet normalised."""
    check_choice("shape", name, SYNTHETIC_CLASSES)
    U = rng.uniform
    if name == "sphere":
        return _sphere(1.0)
    if name == "box":
        return _box(U(0.6, 1.4), U(0.6, 1.4), U(0.6, 1.4))
    if name == "cylinder":
        return _cylinder(U(0.3, 0.6), U(0.8, 2.0))
    if name == "cone":
        return _cone(U(0.4, 0.8), U(0.8, 2.0))
    if name == "torus":
        return _torus(1.0, U(0.15, 0.45))
    if name == "pyramid":
        return _pyramid(U(0.8, 1.6), U(0.6, 1.4))
    if name == "table":
        w, d, h, t = U(1.2, 2.0), U(0.7, 1.2), U(0.7, 1.1), U(0.05, 0.12)
        return _combine(_box(w, d, t, (0, 0, h + t / 2)), *_legs(w, d, h, U(0.03, 0.07)))
    if name == "chair":
        w, h, t, back = U(0.8, 1.1), U(0.8, 1.0), U(0.06, 0.12), U(0.8, 1.3)
        seat = _box(w, w, t, (0, 0, h + t / 2))
        backrest = _box(w, t, back, (0, -(w - t) / 2, h + t + back / 2))
        return _combine(seat, backrest, *_legs(w, w, h, U(0.03, 0.06)))
    if name == "lamp":
        base_r, pole, shade_r, shade_h = U(0.3, 0.5), U(1.0, 1.8), U(0.35, 0.6), U(0.3, 0.6)
        return _combine(
            _cylinder(base_r, 0.08),
            _cylinder(U(0.02, 0.05), pole, segments=12),
            _moved(_cone(shade_r, shade_h), (0, 0, pole - shade_h / 2)),
        )
    # mug: a cylinder with a torus handle in the x-z plane
    r, h = U(0.4, 0.6), U(0.9, 1.4)
    handle = _torus(U(0.2, 0.35) * h, U(0.04, 0.08), segments=24)
    hv = handle.vertices[:, [0, 2, 1]]  # the handle ring stands in the x-z plane
    return _combine(_cylinder(r, h), Mesh(hv + np.array([r, 0.0, h / 2]), handle.faces))


class SyntheticShapes3D(PointCloudDataset):
    """A procedural ModelNet-like set: :data:`SYNTHETIC_CLASSES` with random proportions per item.

    ``classes`` picks a subset (label order); other keywords: see :class:`PointCloudDataset`. The shape
    of item ``i`` depends only on ``(seed, split, i)``.
    """

    def __init__(self, *, classes: Sequence[str] = SYNTHETIC_CLASSES, **kwargs) -> None:
        super().__init__(**kwargs)
        classes = tuple(classes)
        if not classes or len(set(classes)) != len(classes) or any(c not in SYNTHETIC_CLASSES for c in classes):
            raise ValueError(f"classes must be distinct names from {list(SYNTHETIC_CLASSES)}, got {list(classes)}")
        self.classes = classes

    def _shape(self, index: int, label: int) -> tuple[Mesh, np.ndarray | None]:
        mesh = synthetic_shape(self.classes[label], sample_rng(self.seed, _SPLITS[self.split], index, 5)).normalized()
        return mesh, None
