"""Point-cloud datasets: real CGAL shapes, a procedural ModelNet-like generator, and the test protocols.

* :class:`CGALShapes` - shape identification on the meshes and point sets of Debian ``libcgal-demo``
  (``/usr/share/doc/libcgal-dev/data.tar.gz``: ``data/meshes`` and ``data/points_3``; Stanford bunny,
  armadillo, Chinese dragon, cow, camel, elephant, CAD parts, ...). Each distinct shape is a class; a
  sample is ``num_points`` area-weighted surface samples of it, augmented. Files are parsed with the
  small readers of this module (OFF, OBJ, PLY ascii/binary, XYZ/PWN); an unreadable file is skipped
  with a warning and counted in ``stats``. Near-identical shapes (the archive's many unit cubes and
  spheres, re-orderings of one mesh) are merged so that every class is distinguishable.
* :class:`SyntheticShapes3D` - procedural primitives and assemblies (sphere, box, cylinder, cone, torus,
  pyramid, table, chair, lamp, mug) with random proportions: an unlimited ModelNet-like set.
* Protocols: :func:`rotation_protocol` (z-aligned train / SO(3) test, as in ModelNet40 z/SO3) and
  :func:`point_count_protocol` (test at 2x, 4x, 8x the training point count).

Every sample is normalised to the unit sphere (bounding-box centre at the origin, farthest point at
distance 1) before augmentation. Augmentations, in order: partial view (keep the points farthest along
a random view direction, as in ScanObjectNN's partial scans), anisotropic scale, Gaussian jitter,
rotation (none, about z, or uniform SO(3)). Each step draws from its own seed stream keyed by
``(seed, split, index)``, so the rotation variants of a sample are exact rotations of one point set,
and the first N points of a sample with more points are the N-point sample (without partial views).

Modules: :mod:`.mesh_io` (:class:`Mesh` and the file readers), :mod:`.dataset` (:class:`PointCloudDataset`:
sampling and augmentation), :mod:`.cgal` (loading, caching and de-duplicating shape collections,
:class:`CGALShapes`), :mod:`.procedural` (:class:`SyntheticShapes3D`), :mod:`.protocols`. The names below are
re-exported here, the import path of the harness (``from data.points import CGALShapes``).
"""

from .cgal import CGAL_ARCHIVE, CGAL_MODELS, CGALShapes, LoadStats, dedupe_shapes, load_shapes, shape_descriptor
from .dataset import PointCloudDataset, random_rotation, sample_surface
from .mesh_io import Mesh, read_obj, read_off, read_ply, read_shape, read_xyz
from .procedural import SYNTHETIC_CLASSES, SyntheticShapes3D
from .protocols import point_count_protocol, rotation_protocol

__all__ = [
    "Mesh",
    "read_off",
    "read_obj",
    "read_ply",
    "read_xyz",
    "read_shape",
    "load_shapes",
    "dedupe_shapes",
    "shape_descriptor",
    "LoadStats",
    "CGAL_MODELS",
    "sample_surface",
    "random_rotation",
    "CGAL_ARCHIVE",
    "PointCloudDataset",
    "CGALShapes",
    "SyntheticShapes3D",
    "SYNTHETIC_CLASSES",
    "rotation_protocol",
    "point_count_protocol",
]
