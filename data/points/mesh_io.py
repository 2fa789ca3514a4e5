"""Meshes and point sets, and the small readers of the shape files in the CGAL archive.

:class:`Mesh` (triangles or a bare point set) and :func:`read_off`, :func:`read_obj`, :func:`read_ply`
(ascii and binary), :func:`read_xyz` (XYZ/PWN), with :func:`read_shape` choosing by the file extension.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .._util import check_choice

__all__ = ["Mesh", "read_off", "read_obj", "read_ply", "read_xyz", "read_shape", "SHAPE_EXTENSIONS"]


SHAPE_EXTENSIONS = (".off", ".obj", ".ply", ".xyz", ".pwn")
_READER_VERSION = 2  # bump when parsing changes, to invalidate the parsed-mesh cache


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
