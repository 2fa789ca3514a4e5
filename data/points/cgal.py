"""Shape collections from a folder or an archive (parsed once, cached), duplicates merged, and :class:`CGALShapes`:
shape identification on the meshes and point sets of Debian ``libcgal-demo``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .._util import cache_dir, check_choice, check_positive_int, require_debian_file
from .dataset import PointCloudDataset, sample_surface
from .mesh_io import _READER_VERSION, SHAPE_EXTENSIONS, Mesh, read_shape

__all__ = ["CGAL_ARCHIVE", "CGAL_MODELS", "CGALShapes", "LoadStats", "load_shapes", "dedupe_shapes", "shape_descriptor"]


CGAL_ARCHIVE = Path("/usr/share/doc/libcgal-dev/data.tar.gz")


def _iter_files(source: Path) -> Iterable[tuple[str, bytes]]:
    """(relative name, bytes) of the shape files in a folder or a ``.tar[.gz]`` archive, sorted by name."""
    if source.is_dir():
        for p in sorted(source.rglob("*")):
            if p.is_file() and p.suffix.lower() in SHAPE_EXTENSIONS:
                yield p.relative_to(source).as_posix(), p.read_bytes()
        return
    with tarfile.open(source, "r:*") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and os.path.splitext(m.name)[1].lower() in SHAPE_EXTENSIONS),
            key=lambda m: m.name,
        )
        for m in members:
            f = tar.extractfile(m)
            if f is not None:
                yield m.name, f.read()


def shape_descriptor(mesh: Mesh, *, points: int = 4096, pairs: int = 32768) -> np.ndarray:
    """A rotation-invariant fingerprint of a normalised shape: D2 distance histogram + PCA spectrum.

    Used to find duplicates (the same object stored twice with another tessellation or vertex order);
    identical shapes land within ~0.03 (L1) of each other, sampling noise included.
    """
    rng = np.random.default_rng(12345)
    pts = sample_surface(mesh, points, rng)
    pts = pts - pts.mean(0)
    a, b = pts[rng.integers(0, len(pts), pairs)], pts[rng.integers(0, len(pts), pairs)]
    d = np.linalg.norm(a - b, axis=1)
    hist = np.histogram(d, bins=24, range=(0.0, 2.0))[0] / len(d)
    eig = np.sort(np.linalg.eigvalsh(np.cov(pts.T)))[::-1]
    return np.concatenate([hist, eig / eig.sum()])


def dedupe_shapes(meshes: Sequence[Mesh], threshold: float = 0.03) -> tuple[list[Mesh], dict[str, str]]:
    """Drop every shape whose :func:`shape_descriptor` is within ``threshold`` (L1) of an earlier kept one.

    Returns the kept shapes and ``{dropped name: kept name}``.
    """
    kept: list[Mesh] = []
    descs: list[np.ndarray] = []
    dropped: dict[str, str] = {}
    for m in meshes:
        d = shape_descriptor(m)
        dist = [float(np.abs(d - e).sum()) for e in descs]
        if dist and min(dist) < threshold:
            dropped[m.name] = kept[int(np.argmin(dist))].name
            continue
        kept.append(m)
        descs.append(d)
    return kept, dropped


@dataclass
class LoadStats:
    """What a shape loader found: counts and the file names behind them."""

    source: str = ""
    files: int = 0  # shape files seen (by extension)
    readable: int = 0  # parsed and kept by load_shapes
    unreadable: int = 0  # skipped with a warning
    unreadable_files: list[str] = field(default_factory=list)
    too_small: list[str] = field(default_factory=list)  # point sets below min_points, meshes without area
    duplicates: dict[str, str] = field(default_factory=dict)  # dropped -> kept (selection="all")
    missing: list[str] = field(default_factory=list)  # requested names not found among the readable shapes
    loaded: int = 0  # classes of the dataset

    def as_dict(self) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            out[k] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        return out


def load_shapes(source: str | os.PathLike, *, min_points: int = 200) -> tuple[list[Mesh], LoadStats]:
    """Read every shape file of a folder or ``.tar[.gz]`` archive, normalised to the unit sphere.

    Names are the files' paths inside the source. Unreadable files are skipped with a warning and
    counted (``stats.unreadable``, ``stats.unreadable_files``). Point sets with fewer than
    ``min_points`` points and meshes without surface area are dropped (``stats.too_small``).
    """
    source = Path(source)
    if not source.exists():
        raise ValueError(f"shape source {source} does not exist (expected a folder or a .tar.gz of mesh files)")
    min_points = check_positive_int("min_points", min_points)
    stats = LoadStats(source=str(source))
    meshes: list[Mesh] = []
    for name, data in _iter_files(source):
        stats.files += 1
        try:
            mesh = read_shape(name, data)
            if mesh.is_point_set:
                if len(mesh.vertices) < min_points:
                    stats.too_small.append(name)
                    continue
            elif not mesh.face_areas().sum() > 0:
                stats.too_small.append(name)
                continue
            mesh = mesh.normalized()
            # float32 precision, as the cache stores it: fresh and cached loads give identical samples
            mesh = Mesh(mesh.vertices.astype(np.float32).astype(np.float64), mesh.faces, mesh.name)
        except Exception as e:  # noqa: BLE001 - any parse failure means "skip this file"
            stats.unreadable += 1
            stats.unreadable_files.append(name)
            warnings.warn(f"skipping unreadable shape file {name}: {type(e).__name__}: {e}", stacklevel=2)
            continue
        meshes.append(mesh)
    stats.readable = len(meshes)
    return meshes, stats


def _load_cached(source: Path, *, min_points: int) -> tuple[list[Mesh], LoadStats]:
    """:func:`load_shapes` of an archive, the parsed result kept in the cache folder (keyed by size and time).

    Folders are read afresh every time (their contents can change without their own time changing).
    """
    if source.is_dir():
        return load_shapes(source, min_points=min_points)
    st = source.stat()
    key = hashlib.sha1(
        json.dumps([str(source.resolve()), st.st_size, st.st_mtime_ns, min_points, _READER_VERSION]).encode()
    ).hexdigest()[:16]
    path = cache_dir("points") / f"shapes-{key}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                stats = LoadStats(**json.loads(str(z["stats"])))
                names = json.loads(str(z["names"]))
                meshes = [Mesh(z[f"v{i}"].astype(np.float64), z[f"f{i}"], n) for i, n in enumerate(names)]
            for name in stats.unreadable_files:
                warnings.warn(f"skipping unreadable shape file {name} (cached result)", stacklevel=3)
            return meshes, stats
        except Exception:  # noqa: BLE001 - a stale or partial cache file is rebuilt
            pass
    meshes, stats = load_shapes(source, min_points=min_points)
    arrays = {"stats": json.dumps(stats.as_dict()), "names": json.dumps([m.name for m in meshes])}
    for i, m in enumerate(meshes):
        arrays[f"v{i}"] = m.vertices.astype(np.float32)
        arrays[f"f{i}"] = m.faces.astype(np.int32)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)  # atomic: concurrent loaders never see a partial file
    return meshes, stats


# Distinct objects of the CGAL archive (scanned models, CAD parts, a few primitives, scanned point sets):
# the archive's unit cubes, spheres, planar test patches, re-ordered copies and part-of-another-model
# files are left out so that every class is a different shape.
CGAL_MODELS: tuple[str, ...] = (
    # scanned and modelled objects
    "armadillo.off", "bunny00.off", "ChineseDragon-10kv.off", "bear.off", "bull.off", "camel.off", "cow.off",
    "dino.off", "diplodocus.off", "elephant.off", "elk.off", "hand.off", "head.off", "homer.off", "lion.off",
    "man.off", "mannequin-devil.off", "nefertiti.off", "pig.off", "triceratops.off", "mushroom.off",
    "femur.off", "cactus.off", "helmet.off", "retinal.off", "blobby.off",
    # CAD parts
    "fandisk.off", "turbine.off", "anchor.off", "blade.off", "bones.off", "couplingdown.off", "cheese.off",
    "dragknob.off", "eight.off", "joint.off", "rotor.off", "pinion.off", "spool.off", "handle.off",
    "mech-holes-shark.off", "boeing.off", "plane.off", "knot1.off",
    # primitives and simple solids
    "sphere.off", "cylinder.off", "cube.off", "torus_quad.off", "double-torus-example.off", "ellipsoid.off",
    "octahedron.off", "star.off", "tetrahedron.off", "u.off", "three_peaks.off", "holes.off", "oblong.off",
    "mask_cone.off",
    # scanned point sets (points_3/)
    "kitten.xyz", "hippo1.ply", "oni.ply", "radar.xyz", "poste_france.xyz", "building.ply", "ball.ply",
    "fin90_with_PCA_normals.xyz", "spheres.ply", "circles.ply", "b9_training.ply", "half.xyz",
)  # fmt: skip


class CGALShapes(PointCloudDataset):
    """Shape identification on the meshes and point sets of Debian ``libcgal-demo`` (each shape a class).

    Args:
        source: a folder or ``.tar[.gz]`` of shape files; default the CGAL archive
            ``/usr/share/doc/libcgal-dev/data.tar.gz`` (``sudo apt-get install libcgal-demo``).
        selection: "curated" (default: the 70 distinct objects of :data:`CGAL_MODELS`, class names are
            the file stems), "all" (every readable file, duplicates merged by :func:`dedupe_shapes`,
            class names are the paths inside the source), or a sequence of file names.
        dedupe: duplicate threshold for ``selection="all"`` (None keeps everything).
        min_points: point sets with fewer points are dropped.
        Other keywords: see :class:`PointCloudDataset`.

    Archives are parsed once and cached under ``~/.cache/vlpe/points`` (``$VLPE_CACHE_DIR``). ``stats``
    (a :class:`LoadStats`) reports files found, readable, unreadable (skipped with a warning), too
    small, merged as duplicates, requested but missing, and the number of classes loaded.
    """

    def __init__(
        self,
        *,
        source: str | os.PathLike | None = None,
        selection: str | Sequence[str] = "curated",
        dedupe: float | None = 0.03,
        min_points: int = 200,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if source is None:
            source = require_debian_file(CGAL_ARCHIVE, "libcgal-demo", what="the CGAL data archive")
        source = Path(source)
        if not source.exists():
            raise ValueError(f"shape source {source} does not exist (expected a folder or a .tar.gz of mesh files)")
        meshes, stats = _load_cached(source, min_points=min_points)
        stats = LoadStats(**stats.as_dict())  # a private copy
        if isinstance(selection, str) and selection == "all":
            if dedupe is not None:
                meshes, stats.duplicates = dedupe_shapes(meshes, dedupe)
            names = [m.name for m in meshes]
        else:
            if isinstance(selection, str):
                check_choice("selection", selection, ("curated", "all"))
                wanted = CGAL_MODELS
            else:
                wanted = tuple(selection)
            by_file = {}
            for m in meshes:
                by_file.setdefault(os.path.basename(m.name), m)
            stats.missing = [w for w in wanted if w not in by_file]
            for w in stats.missing:
                warnings.warn(f"CGALShapes: {w} is not among the readable shapes of {source}", stacklevel=2)
            meshes = [by_file[w] for w in wanted if w in by_file]
            names = [os.path.splitext(w)[0] for w in wanted if w in by_file]
        if not meshes:
            raise ValueError(f"no usable shapes in {source} for selection {selection!r}")
        stats.loaded = len(meshes)
        self.meshes = meshes
        self.stats = stats
        self.classes = tuple(names)
        self._cdfs = [None if m.is_point_set else np.cumsum(m.face_areas()) for m in meshes]

    def _shape(self, index: int, label: int) -> tuple[Mesh, np.ndarray | None]:
        return self.meshes[label], self._cdfs[label]
