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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._util import cache_dir, check_choice, check_positive_int, require_debian_file, sample_rng

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

CGAL_ARCHIVE = Path("/usr/share/doc/libcgal-dev/data.tar.gz")
SHAPE_EXTENSIONS = (".off", ".obj", ".ply", ".xyz", ".pwn")
_READER_VERSION = 2  # bump when parsing changes, to invalidate the parsed-mesh cache
_SPLITS = {"train": 0, "test": 1, "val": 2}
_ROTATIONS = ("none", "z", "so3")


# ============================================================================ meshes and readers
@dataclass(frozen=True, eq=False)
class Mesh:
    """A triangle mesh (``faces`` (F, 3) int64) or a point set (no faces), ``vertices`` (V, 3) float64."""

    vertices: np.ndarray
    faces: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    name: str = ""

    def __post_init__(self) -> None:
        v = np.asarray(self.vertices, dtype=np.float64)
        f = np.asarray(self.faces, dtype=np.int64).reshape(-1, 3)
        if v.ndim != 2 or v.shape[1] != 3 or len(v) == 0:
            raise ValueError(f"{self.name or 'mesh'}: vertices must be a non-empty (V, 3) array, got {v.shape}")
        if not np.isfinite(v).all():
            raise ValueError(f"{self.name or 'mesh'}: vertices contain NaN or infinite values")
        if len(f) and (f.min() < 0 or f.max() >= len(v)):
            raise ValueError(f"{self.name or 'mesh'}: face indices outside [0, {len(v)})")
        object.__setattr__(self, "vertices", v)
        object.__setattr__(self, "faces", f)

    @property
    def is_point_set(self) -> bool:
        return len(self.faces) == 0

    def face_areas(self) -> np.ndarray:
        a, b, c = (self.vertices[self.faces[:, i]] for i in range(3))
        return 0.5 * np.linalg.norm(np.cross(b - a, c - a), axis=1)  # (F,)

    def normalized(self) -> "Mesh":
        """Centred on its bounding-box centre and scaled so the farthest vertex is at distance 1."""
        v = self.vertices
        v = v - 0.5 * (v.min(0) + v.max(0))
        r = np.linalg.norm(v, axis=1).max()
        if not r > 0:
            raise ValueError(f"{self.name or 'mesh'}: all vertices coincide")
        return Mesh(v / r, self.faces, self.name)


def _fan(polys: Iterable[Sequence[int]]) -> np.ndarray:
    """Fan-triangulate polygons given as index lists (faces with < 3 indices are dropped)."""
    tris = [(p[0], p[i], p[i + 1]) for p in polys for i in range(1, len(p) - 1)]
    return np.asarray(tris, dtype=np.int64).reshape(-1, 3)


def _content_lines(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def _numbers(text: str) -> np.ndarray | None:
    """All whitespace-separated numbers of ``text`` as float64 (C speed), or None if any token is not one."""
    if "#" in text:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # older numpy warns (and stops) at a non-numeric token
            return np.fromstring(text, dtype=np.float64, sep=" ")
    except (ValueError, DeprecationWarning):
        return None


def _rows(lines: Sequence[str], what: str) -> list[list[str]] | np.ndarray:
    """Tokenised rows; a float array when every row has the same number of tokens."""
    tokens = [ln.split() for ln in lines]
    if tokens and all(len(t) == len(tokens[0]) for t in tokens):
        try:
            return np.array(" ".join(lines).split(), dtype=np.float64).reshape(len(lines), -1)
        except ValueError as e:
            raise ValueError(f"non-numeric {what}: {e}") from None
    return tokens


def _skip_lines(text: str, n: int) -> tuple[list[str], str]:
    """The first ``n`` non-blank, non-comment lines of ``text`` and the text after them."""
    head, pos = [], 0
    while len(head) < n:
        nl = text.find("\n", pos)
        line = text[pos:] if nl < 0 else text[pos:nl]
        pos = len(text) if nl < 0 else nl + 1
        line = line.split("#", 1)[0].strip()
        if line:
            head.append(line)
        if nl < 0:
            break
    return head, text[pos:]


def _triangles(values: np.ndarray, nf: int) -> np.ndarray | None:
    """``(nf, 3)`` faces from ``nf`` rows ``3 a b c`` flattened, or None if they are not all triangles."""
    if values.size != 4 * nf:
        return None
    rows = values.reshape(nf, 4)
    return rows[:, 1:].astype(np.int64) if (rows[:, 0] == 3).all() else None


def read_off(text: str, name: str = "") -> Mesh:
    """Object File Format: ``[C][N][ST]OFF`` header, counts ``V F E``, V vertex rows, F face rows."""
    head, rest = _skip_lines(text, 1)
    if not head:
        raise ValueError("empty OFF file")
    words = head[0].split()
    if not words[0].endswith("OFF") or words[0].startswith("4") or "BINARY" in (t.upper() for t in words):
        raise ValueError(f"unsupported OFF header {head[0]!r} (ascii 3D OFF only)")
    counts = words[1:]
    if len(counts) < 2:
        more, rest = _skip_lines(rest, 1)
        counts = more[0].split() if more else []
    if len(counts) < 2:
        raise ValueError("OFF file has no 'V F E' counts row")
    nv, nf = int(counts[0]), int(counts[1])
    if nv <= 0 or nf < 0:
        raise ValueError(f"OFF file declares {nv} vertices and {nf} faces")
    # fast path: uniform vertex rows and triangle faces, parsed in one pass
    first, _ = _skip_lines(rest, 1)
    k = len(first[0].split()) if first else 0
    values = _numbers(rest) if k >= 3 else None
    if values is not None and values.size >= nv * k:
        if nf:
            faces = _triangles(values[nv * k :], nf)
        else:
            faces = np.zeros((0, 3), np.int64) if values.size == nv * k else None
        if faces is not None:
            return Mesh(values[: nv * k].reshape(nv, k)[:, :3], faces, name)
    lines = _content_lines(rest)
    if len(lines) < nv + nf:
        raise ValueError(f"OFF file declares {nv} vertices and {nf} faces but has {len(lines)} data rows")
    vrows = _rows(lines[:nv], "vertex rows")
    if isinstance(vrows, np.ndarray):
        vertices = vrows[:, :3]
    else:
        vertices = np.array([[float(t) for t in r[:3]] for r in vrows], dtype=np.float64)
    if vertices.shape != (nv, 3):
        raise ValueError(f"OFF vertex rows must hold at least 3 coordinates, got shape {vertices.shape}")
    polys = []
    for line in lines[nv : nv + nf]:
        r = line.split()
        n = int(r[0])
        if len(r) < n + 1:
            raise ValueError(f"OFF face row {line!r} lists fewer than {n} indices")
        polys.append([int(t) for t in r[1 : n + 1]])
    return Mesh(vertices, _fan(polys), name)


def read_obj(text: str, name: str = "") -> Mesh:
    """Wavefront OBJ: ``v x y z`` and ``f a b c ...`` rows (``a/b/c`` and negative indices accepted)."""
    verts, polys = [], []
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if parts[0] == "v":
            verts.append([float(t) for t in parts[1:4]])
        elif parts[0] == "f":
            idx = []
            for t in parts[1:]:
                k = int(t.split("/")[0])
                idx.append(k - 1 if k > 0 else len(verts) + k)
            polys.append(idx)
    if not verts:
        raise ValueError("OBJ file has no 'v' rows")
    return Mesh(np.asarray(verts, dtype=np.float64), _fan(polys), name)


_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2",
    "ushort": "u2", "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}  # fmt: skip


def _ply_type(name: str) -> str:
    if name not in _PLY_TYPES:
        raise ValueError(f"unknown PLY property type {name!r}")
    return _PLY_TYPES[name]


def read_ply(data: bytes, name: str = "") -> Mesh:
    """Stanford PLY, ascii or binary (little/big endian): the ``vertex`` x, y, z and ``face`` index lists."""
    end = data.find(b"end_header")
    if not data.startswith(b"ply") or end < 0:
        raise ValueError("not a PLY file (no 'ply' magic or no 'end_header')")
    nl = data.find(b"\n", end)
    body = data[nl + 1 :] if nl >= 0 else b""
    header = data[:end].decode("ascii", errors="replace").splitlines()
    fmt, elements = None, []  # elements: [name, count, [(prop, type) or (prop, (count_type, item_type))]]
    for line in header[1:]:
        t = line.split()
        if not t or t[0] in ("comment", "obj_info"):
            continue
        if t[0] == "format":
            fmt = t[1]
        elif t[0] == "element":
            elements.append([t[1], int(t[2]), []])
        elif t[0] == "property":
            if not elements:
                raise ValueError("PLY property before any element")
            if t[1] == "list":
                elements[-1][2].append((t[4], (_ply_type(t[2]), _ply_type(t[3]))))
            else:
                elements[-1][2].append((t[2], _ply_type(t[1])))
    if fmt not in ("ascii", "binary_little_endian", "binary_big_endian"):
        raise ValueError(f"unsupported PLY format {fmt!r}")
    vertices, faces = None, np.zeros((0, 3), dtype=np.int64)
    if fmt == "ascii":
        text = body.decode("ascii", errors="strict")
        numbers = _numbers(text)
        tokens = text.split() if numbers is None else numbers
        pos = 0
        for el_name, count, props in elements:
            if all(not isinstance(p[1], tuple) for p in props):
                k = len(props)
                block = np.array(tokens[pos : pos + count * k], dtype=np.float64)
                if block.size != count * k:
                    raise ValueError(f"PLY element {el_name!r} is truncated")
                table = block.reshape(count, k)
                pos += count * k
                if el_name == "vertex":
                    names = [p[0] for p in props]
                    vertices = table[:, [names.index(c) for c in ("x", "y", "z")]]
            else:
                tri = None
                if len(props) == 1 and isinstance(tokens, np.ndarray):
                    tri = _triangles(tokens[pos : pos + 4 * count], count)
                if tri is not None:
                    pos += 4 * count
                    if el_name == "face":
                        faces = tri
                    continue
                polys = []
                for _ in range(count):
                    row = []
                    for _pname, ptype in props:
                        if isinstance(ptype, tuple):
                            n = int(tokens[pos])
                            row.append([int(x) for x in tokens[pos + 1 : pos + 1 + n]])
                            pos += 1 + n
                        else:
                            pos += 1
                    polys.append(row[0] if row else [])
                if el_name == "face":
                    faces = _fan(polys)
    else:
        order = "<" if fmt == "binary_little_endian" else ">"
        pos = 0
        for el_name, count, props in elements:
            if all(not isinstance(p[1], tuple) for p in props):
                dt = np.dtype([(p[0], order + p[1]) for p in props])
                if pos + count * dt.itemsize > len(body):
                    raise ValueError(f"PLY element {el_name!r} is truncated")
                table = np.frombuffer(body, dtype=dt, count=count, offset=pos)
                pos += count * dt.itemsize
                if el_name == "vertex":
                    vertices = np.stack([table[c].astype(np.float64) for c in ("x", "y", "z")], axis=1)
            else:  # lists: fast path when every list has the first one's length
                polys, fast = [], False
                if count and len(props) == 1:
                    ctype, itype = props[0][1]
                    n0 = int(np.frombuffer(body, dtype=order + ctype, count=1, offset=pos)[0])
                    dt = np.dtype([("n", order + ctype), ("idx", order + itype, (n0,))])
                    if pos + count * dt.itemsize <= len(body):
                        table = np.frombuffer(body, dtype=dt, count=count, offset=pos)
                        if (table["n"] == n0).all():
                            fast = True
                            pos += count * dt.itemsize
                            if el_name == "face":
                                idx = table["idx"].astype(np.int64)  # (count, n0)
                                faces = idx if n0 == 3 else _fan(idx.tolist())
                if not fast:
                    for _ in range(count):
                        row = []
                        for _pname, ptype in props:
                            if isinstance(ptype, tuple):
                                cdt, idt = np.dtype(order + ptype[0]), np.dtype(order + ptype[1])
                                n = int(np.frombuffer(body, dtype=cdt, count=1, offset=pos)[0])
                                pos += cdt.itemsize
                                row.append(np.frombuffer(body, dtype=idt, count=n, offset=pos).tolist())
                                pos += n * idt.itemsize
                            else:
                                pos += np.dtype(ptype).itemsize
                        polys.append(row[0] if row else [])
                    if el_name == "face":
                        faces = _fan(polys)
    if vertices is None:
        raise ValueError("PLY file has no 'vertex' element with x, y, z")
    return Mesh(vertices, faces, name)


def read_xyz(text: str, name: str = "") -> Mesh:
    """Point set rows ``x y z [nx ny nz ...]`` (``.xyz``, ``.pwn``); a leading single-number count row is skipped."""
    first, rest = _skip_lines(text, 1)
    if first and len(first[0].split()) == 1:
        text = rest
        first, _ = _skip_lines(text, 1)
    if not first:
        raise ValueError("empty point set")
    k = len(first[0].split())
    values = _numbers(text)
    if values is not None and k >= 3 and values.size % k == 0:
        return Mesh(values.reshape(-1, k)[:, :3], name=name)
    rows = _rows(_content_lines(text), "point rows")
    if isinstance(rows, np.ndarray):
        pts = rows[:, :3]
    else:
        pts = np.array([[float(t) for t in r[:3]] for r in rows], dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ValueError(f"point rows must hold at least 3 coordinates, got shape {pts.shape}")
    return Mesh(pts, name=name)


def read_shape(name: str, data: bytes) -> Mesh:
    """Parse a mesh or point set from its bytes, choosing the reader by the file extension of ``name``."""
    ext = os.path.splitext(name)[1].lower()
    check_choice("file extension", ext, SHAPE_EXTENSIONS)
    if ext == ".ply":
        return read_ply(data, name)
    text = data.decode("utf-8")
    if ext == ".off":
        return read_off(text, name)
    if ext == ".obj":
        return read_obj(text, name)
    return read_xyz(text, name)


# ============================================================================ loading a collection
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


# ============================================================================ sampling and augmentation
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


# ============================================================================ procedural shapes
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


# ============================================================================ protocols
ROTATION_PROTOCOLS = {"z/z": ("z", "z"), "z/so3": ("z", "so3"), "so3/so3": ("so3", "so3")}


def rotation_protocol(
    train: PointCloudDataset, test: PointCloudDataset, protocol: str = "z/so3"
) -> tuple[PointCloudDataset, PointCloudDataset]:
    """The (train, test) pair of a rotation protocol: "z/z", "z/so3" (z-aligned train, SO(3) test), "so3/so3"."""
    check_choice("protocol", protocol, tuple(ROTATION_PROTOCOLS))
    r_train, r_test = ROTATION_PROTOCOLS[protocol]
    return train.variant(rotation=r_train), test.variant(rotation=r_test)


def point_count_protocol(
    test: PointCloudDataset, *, train_points: int | None = None, factors: Sequence[int] = (1, 2, 4, 8)
) -> dict[int, PointCloudDataset]:
    """Test sets at ``factor * train_points`` points (default 1x, 2x, 4x, 8x), keyed by the point count."""
    base = check_positive_int("train_points", test.num_points if train_points is None else train_points)
    out = {}
    for f in factors:
        f = check_positive_int("factor", f)
        out[base * f] = test.variant(num_points=base * f)
    return out
