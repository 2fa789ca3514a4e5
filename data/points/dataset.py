"""The point-cloud dataset base: surface sampling, the augmentation chain and the per-item seed streams.

Subclasses (:class:`~data.points.cgal.CGALShapes`, :class:`~data.points.procedural.SyntheticShapes3D`) give
the classes and one shape per item; :class:`PointCloudDataset` samples, augments and rotates it (see
:mod:`data.points` for the order of the augmentations).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from .._util import check_choice, check_positive_int, sample_rng
from .mesh_io import Mesh

__all__ = ["sample_surface", "random_rotation", "PointCloudDataset"]


_SPLITS = {"train": 0, "test": 1, "val": 2}
_ROTATIONS = ("none", "z", "so3")


def sample_surface(mesh: Mesh, n: int, rng: np.random.Generator, *, cdf: np.ndarray | None = None) -> np.ndarray:
    """``(n, 3)`` points uniform on the surface (area-weighted faces, uniform barycentric), or drawn from a point set.

    One ``(n, 3)`` uniform draw feeds face choice and barycentric coordinates, so the first ``m`` points
    of an ``n``-point sample (same generator state) are the ``m``-point sample.
    """
    u = rng.random((n, 3))  # (n, 3)
    if mesh.is_point_set:
        return mesh.vertices[np.minimum((u[:, 0] * len(mesh.vertices)).astype(np.int64), len(mesh.vertices) - 1)]
    if cdf is None:
        cdf = np.cumsum(mesh.face_areas())
    face = np.minimum(np.searchsorted(cdf, u[:, 0] * cdf[-1], side="right"), len(cdf) - 1)  # (n,)
    a, b, c = (mesh.vertices[mesh.faces[face, i]] for i in range(3))  # (n, 3) each
    s = np.sqrt(u[:, 1:2])
    return (1 - s) * a + s * (1 - u[:, 2:3]) * b + s * u[:, 2:3] * c


def random_rotation(rng: np.random.Generator, mode: str = "so3") -> np.ndarray:
    """A ``(3, 3)`` rotation: uniform over SO(3) (a uniform unit quaternion) or about the z axis."""
    check_choice("rotation", mode, _ROTATIONS)
    if mode == "none":
        return np.eye(3)
    if mode == "z":
        t = rng.uniform(0, 2 * math.pi)
        c, s = math.cos(t), math.sin(t)
        return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


class PointCloudDataset(Dataset):
    """Base class: ``num_points`` augmented surface samples of a shape per item; ``(points (N, 3), label)``.

    Args:
        split: "train", "test" or "val" (independent seed streams).
        num_points: points per sample.
        samples_per_class: dataset length is ``num_classes * samples_per_class``; item ``i`` has label
            ``i % num_classes``.
        rotation: "none", "z" (about the up axis) or "so3" (uniform random rotation).
        scale: (lo, hi) range of the independent per-axis scale factors, or None.
        jitter: standard deviation of the Gaussian noise added to each coordinate (0 disables).
        partial: fraction of the surface kept by a partial view (e.g. 0.6), or None for full shapes.
        seed: base seed; item ``i`` depends only on ``(seed, split, i)``.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        num_points: int = 1024,
        samples_per_class: int = 32,
        rotation: str = "z",
        scale: tuple[float, float] | None = (0.8, 1.25),
        jitter: float = 0.01,
        partial: float | None = None,
        seed: int = 0,
    ) -> None:
        check_choice("split", split, tuple(_SPLITS))
        check_choice("rotation", rotation, _ROTATIONS)
        self.num_points = check_positive_int("num_points", num_points)
        self.samples_per_class = check_positive_int("samples_per_class", samples_per_class)
        if scale is not None and not (0 < scale[0] <= scale[1]):
            raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi, or None; got {scale}")
        if not jitter >= 0:
            raise ValueError(f"jitter must be >= 0 (a standard deviation), got {jitter}")
        if partial is not None and not 0 < partial <= 1:
            raise ValueError(f"partial must be a kept fraction in (0, 1] or None, got {partial}")
        self.split, self.rotation, self.scale = split, rotation, None if scale is None else tuple(scale)
        self.jitter, self.partial, self.seed = float(jitter), partial, int(seed)

    # subclasses provide the classes and a shape per item
    classes: tuple[str, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return self.num_classes * self.samples_per_class

    def _shape(self, index: int, label: int) -> tuple[Mesh, np.ndarray | None]:
        raise NotImplementedError

    def variant(self, **changes) -> "PointCloudDataset":
        """The same samples with some options changed (``rotation=``, ``num_points=``, ``jitter=``, ...)."""
        allowed = {"split", "num_points", "samples_per_class", "rotation", "scale", "jitter", "partial", "seed"}
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"variant() accepts {sorted(allowed)}, got unknown {sorted(unknown)}")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        opts = {k: getattr(self, k) for k in allowed}
        opts.update(changes)
        PointCloudDataset.__init__(new, **opts)
        return new

    def points(self, index: int) -> np.ndarray:
        """The ``(num_points, 3)`` float64 point set of item ``index`` (all augmentations applied)."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} items")
        label = index % self.num_classes
        key = (self.seed, _SPLITS[self.split], index)
        mesh, cdf = self._shape(index, label)
        n = self.num_points
        if self.partial is None:
            pts = sample_surface(mesh, n, sample_rng(*key, 0), cdf=cdf)
        else:  # partial view: of n / partial surface points keep the n farthest along a view direction
            pts = sample_surface(mesh, int(math.ceil(n / self.partial)), sample_rng(*key, 0), cdf=cdf)
            view = sample_rng(*key, 1).normal(size=3)
            order = np.argsort(-(pts @ view), kind="stable")[:n]
            pts = pts[np.sort(order)]
        if self.scale is not None:
            pts = pts * sample_rng(*key, 2).uniform(self.scale[0], self.scale[1], size=3)
        if self.jitter > 0:
            pts = pts + self.jitter * sample_rng(*key, 3).normal(size=pts.shape)
        if self.rotation != "none":
            pts = pts @ random_rotation(sample_rng(*key, 4), self.rotation).T
        return pts

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if index < 0:
            index += len(self)
        return torch.from_numpy(self.points(index).astype(np.float32)), index % self.num_classes
