"""Point clouds: mesh readers, area-weighted sampling, the CGAL shape set, procedural shapes, protocols.

``libcgal-demo`` is required (CI installs it): without it these tests fail with the install command.
"""

from __future__ import annotations

import math
import tarfile
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from data.points import cgal as points_cgal
from data._util import MissingPackageError
from data.collate import PointCollator
from data.points import (
    CGAL_MODELS,
    CGALShapes,
    Mesh,
    SyntheticShapes3D,
    SYNTHETIC_CLASSES,
    point_count_protocol,
    random_rotation,
    read_obj,
    read_off,
    read_ply,
    read_shape,
    read_xyz,
    rotation_protocol,
    sample_surface,
)
from vlpe import Positions

SQUARE_V = [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]]


@pytest.fixture(scope="module")
def cgal():
    return CGALShapes(split="test", samples_per_class=2)


def _pdist(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x[:, None] - x[None], axis=-1)


# ----------------------------------------------------------------------------- readers
def test_read_off_comments_quads_colours_and_fast_path_agree():
    text = """OFF
# a comment
5 3 0
0 0 0
1 0 0
1 1 0
0 1 0
0 0 1
4 0 1 2 3
3 0 1 4
3 1 2 4 255 0 0
"""
    m = read_off(text)
    assert m.vertices.tolist() == SQUARE_V
    assert m.faces.tolist() == [[0, 1, 2], [0, 2, 3], [0, 1, 4], [1, 2, 4]]  # the quad fan-split
    tri = "OFF\n5 2 0\n" + "\n".join(" ".join(map(str, v)) for v in SQUARE_V) + "\n3 0 1 2\n3 0 1 4\n"
    fast = read_off(tri)  # uniform rows: parsed in one numpy pass
    slow = read_off(tri.replace("3 0 1 4\n", "3 0 1 4 # trailing comment\n"))  # line-by-line path
    assert np.array_equal(fast.vertices, slow.vertices) and np.array_equal(fast.faces, slow.faces)
    assert fast.faces.tolist() == [[0, 1, 2], [0, 1, 4]]
    colour = read_off("COFF\n3 1 0\n0 0 0 9 9 9 255\n1 0 0 9 9 9 255\n0 1 0 9 9 9 255\n3 0 1 2\n")
    assert colour.vertices.tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    counts_on_header = read_off("OFF 3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 2\n")
    assert counts_on_header.faces.tolist() == [[0, 1, 2]]


def test_read_obj_and_xyz():
    obj = "# cube corner\nv 0 0 0\nv 1 0 0\nv 1 1 0\nv 0 1 0\nvn 0 0 1\nf 1//1 2//1 3//1 4//1\nf -4 -3 -1\n"
    m = read_obj(obj)
    assert m.vertices.tolist() == SQUARE_V[:4]
    assert m.faces.tolist() == [[0, 1, 2], [0, 2, 3], [0, 1, 3]]
    pts = read_xyz("3\n0 0 0 0 0 1\n1 2 3 0 0 1\n4 5 6 0 0 1\n")
    assert pts.is_point_set and pts.vertices.tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("fmt", ["ascii", "binary_little_endian", "binary_big_endian"])
def test_read_ply_formats(fmt):
    verts = np.array(SQUARE_V, dtype=np.float32)
    faces = [[0, 1, 2, 3], [0, 1, 4]]
    header = (
        f"ply\nformat {fmt} 1.0\ncomment test\nelement vertex 5\nproperty float x\nproperty float y\n"
        "property float z\nproperty uchar red\nelement face 2\nproperty list uchar int vertex_indices\nend_header\n"
    )
    if fmt == "ascii":
        body = "".join(f"{x} {y} {z} 7\n" for x, y, z in verts) + "".join(
            f"{len(f)} " + " ".join(map(str, f)) + "\n" for f in faces
        )
        data = (header + body).encode()
    else:
        o = "<" if fmt == "binary_little_endian" else ">"
        vdt = np.dtype([("x", o + "f4"), ("y", o + "f4"), ("z", o + "f4"), ("red", "u1")])
        vrec = np.zeros(5, dtype=vdt)
        vrec["x"], vrec["y"], vrec["z"], vrec["red"] = verts[:, 0], verts[:, 1], verts[:, 2], 7
        body = vrec.tobytes()
        for f in faces:
            body += np.uint8(len(f)).tobytes() + np.asarray(f, dtype=o + "i4").tobytes()
        data = header.encode() + body
    m = read_ply(data)
    assert m.vertices.tolist() == SQUARE_V
    assert m.faces.tolist() == [[0, 1, 2], [0, 2, 3], [0, 1, 4]]


def test_read_shape_rejects_corrupt_files():
    with pytest.raises(ValueError):
        read_shape("a.off", b"OFF\n3 1 0\n0 0 0\n1 0 0\n")  # truncated
    with pytest.raises(ValueError):
        read_shape("a.off", b"OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 7\n")  # index out of range
    with pytest.raises(ValueError):
        read_shape("a.ply", b"ply\nformat binary_little_endian 1.0\nelement vertex 10\nproperty float x\n"
                   b"property float y\nproperty float z\nend_header\n" + b"\x00" * 12)  # truncated body
    with pytest.raises(ValueError, match="extension"):
        read_shape("a.stp", b"")


# ----------------------------------------------------------------------------- sampling
def test_area_weighted_sampling_on_two_triangles():
    # two disjoint right triangles with areas 0.5 and 4.5: 10% / 90% of the samples
    v = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [10, 0, 0], [13, 0, 0], [10, 3, 0]]
    mesh = Mesh(np.array(v, dtype=float), np.array([[0, 1, 2], [3, 4, 5]]))
    n = 40000
    pts = sample_surface(mesh, n, np.random.default_rng(0))
    big = pts[:, 0] >= 5
    assert abs(big.mean() - 0.9) < 0.01  # binomial std 0.0015
    # uniform inside each triangle: the mean is the centroid, and no point leaves the triangle
    assert np.allclose(pts[big].mean(0), [11, 1, 0], atol=0.03)
    assert np.allclose(pts[~big].mean(0), [1 / 3, 1 / 3, 0], atol=0.02)
    small = pts[~big]
    assert (small[:, 0] >= 0).all() and (small[:, 1] >= 0).all() and (small[:, :2].sum(1) <= 1 + 1e-12).all()


def test_sampling_is_nested_in_the_point_count():
    mesh = Mesh(np.array(SQUARE_V, dtype=float), np.array([[0, 1, 2], [0, 2, 3], [0, 1, 4]]))
    a = sample_surface(mesh, 100, np.random.default_rng(5))
    b = sample_surface(mesh, 400, np.random.default_rng(5))
    assert np.array_equal(a, b[:100])


def test_random_rotations_are_proper_and_uniform():
    rng = np.random.default_rng(0)
    Rs = np.stack([random_rotation(rng, "so3") for _ in range(2000)])
    assert np.allclose(Rs @ Rs.transpose(0, 2, 1), np.eye(3), atol=1e-12)
    assert np.allclose(np.linalg.det(Rs), 1.0)
    assert np.abs(Rs[:, :, 2].mean(0)).max() < 0.05  # R e_z uniform on the sphere: mean ~ 0
    Rz = random_rotation(rng, "z")
    assert np.allclose(Rz[2], [0, 0, 1]) and np.allclose(Rz[:, 2], [0, 0, 1])


# ----------------------------------------------------------------------------- CGAL shapes
def test_cgal_shapes_load_and_sample(cgal):
    assert cgal.stats.files >= 160 and cgal.stats.unreadable == 0
    assert cgal.num_classes >= 60 and cgal.stats.loaded == cgal.num_classes
    assert cgal.stats.missing == [] and len(cgal.classes) == len(CGAL_MODELS)
    assert {"armadillo", "bunny00", "ChineseDragon-10kv", "cow", "kitten"} <= set(cgal.classes)
    x, y = cgal[5]
    assert x.shape == (1024, 3) and x.dtype == torch.float32 and y == 5
    assert len(cgal) == 2 * cgal.num_classes
    plain = cgal.variant(rotation="none", scale=None, jitter=0.0)
    for i in range(0, cgal.num_classes, 7):  # normalised to the unit sphere, centred on the bounding box
        p = plain.points(i)
        assert np.linalg.norm(p, axis=1).max() <= 1 + 1e-6
        assert np.linalg.norm(p, axis=1).max() > 0.9
    assert torch.equal(cgal[3][0], CGALShapes(split="test", samples_per_class=2)[3][0])  # deterministic


def test_cgal_all_merges_duplicate_files():
    ds = CGALShapes(selection="all", samples_per_class=1)
    assert ds.num_classes >= 140
    # the archive holds the same scans twice in different formats
    assert ds.stats.duplicates.get("data/points_3/oni.pwn") == "data/points_3/oni.ply"
    assert ds.stats.duplicates.get("data/points_3/kitten.xyz") == "data/points_3/kitten.off"
    kept = set(ds.classes)
    assert {"data/meshes/armadillo.off", "data/meshes/bunny00.off", "data/meshes/cow.off"} <= kept


def _write_shapes(folder):
    folder.mkdir()
    (folder / "tri.off").write_text("OFF\n3 1 0\n0 0 0\n1 0 0\n0 1 0\n3 0 1 2\n")
    (folder / "quad.obj").write_text("v 0 0 0\nv 2 0 0\nv 2 1 0\nv 0 1 0\nv 0 0 3\nf 1 2 3 4\nf 1 2 5\n")
    (folder / "broken.off").write_text("OFF\n8 12 0\n0 0 0\n1 1\n")
    (folder / "garbage.ply").write_bytes(
        b"ply\nformat binary_little_endian 1.0\nelement vertex 100\n"
        b"property double x\nproperty double y\nproperty double z\nend_header\n\x00\x01"
    )
    (folder / "empty.xyz").write_text("")
    (folder / "notes.txt").write_text("ignored: not a shape extension")


def test_corrupt_files_are_skipped_with_a_warning_and_counted(tmp_path):
    _write_shapes(tmp_path / "shapes")
    with pytest.warns(UserWarning, match="unreadable shape file") as record:
        ds = CGALShapes(source=tmp_path / "shapes", selection="all", dedupe=None, samples_per_class=1)
    assert len([w for w in record if "unreadable" in str(w.message)]) == 3
    assert ds.stats.files == 5 and ds.stats.unreadable == 3 and ds.stats.loaded == 2
    assert sorted(ds.stats.unreadable_files) == ["broken.off", "empty.xyz", "garbage.ply"]
    assert ds.classes == ("quad.obj", "tri.off")
    assert ds[1][0].shape == (1024, 3)


def test_archive_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("VLPE_CACHE_DIR", str(tmp_path / "cache"))
    _write_shapes(tmp_path / "shapes")
    archive = tmp_path / "shapes.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "shapes", arcname="data")
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        a = CGALShapes(source=archive, selection="all", dedupe=None, samples_per_class=1)
    assert list((tmp_path / "cache" / "points").glob("shapes-*.npz"))
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        b = CGALShapes(source=archive, selection="all", dedupe=None, samples_per_class=1)
    assert a.stats.as_dict() == b.stats.as_dict() and a.stats.unreadable == 3
    assert len([w for w in first if "unreadable" in str(w.message)]) == 3
    assert len([w for w in second if "unreadable" in str(w.message)]) == 3  # the cache still reports them
    assert a.classes == b.classes == ("data/quad.obj", "data/tri.off")
    assert np.allclose(a.points(0), b.points(0), atol=1e-6)  # the cache stores float32


def test_missing_cgal_package_names_the_apt_command(monkeypatch, tmp_path):
    monkeypatch.setattr(points_cgal, "CGAL_ARCHIVE", tmp_path / "nope" / "data.tar.gz")
    with pytest.raises(MissingPackageError, match=r"sudo apt-get install libcgal-demo"):
        CGALShapes()


def test_invalid_point_arguments(cgal, tmp_path):
    with pytest.raises(ValueError, match="rotation"):
        SyntheticShapes3D(rotation="x")
    with pytest.raises(ValueError, match="num_points"):
        SyntheticShapes3D(num_points=0)
    with pytest.raises(ValueError, match="partial"):
        SyntheticShapes3D(partial=1.5)
    with pytest.raises(ValueError, match="scale"):
        SyntheticShapes3D(scale=(1.2, 0.8))
    with pytest.raises(ValueError, match="classes"):
        SyntheticShapes3D(classes=("sphere", "teapot"))
    with pytest.raises(ValueError, match="variant"):
        cgal.variant(colour=True)
    with pytest.raises(ValueError, match="selection"):
        CGALShapes(selection="everything")
    with pytest.raises(ValueError, match="does not exist"):
        CGALShapes(source=tmp_path / "missing")
    with pytest.raises(ValueError, match="protocol"):
        rotation_protocol(cgal, cgal, "so3/z")


# ----------------------------------------------------------------------------- procedural shapes
def test_synthetic_shapes():
    opts = dict(num_points=512, samples_per_class=3, rotation="none", scale=None, jitter=0.0)
    ds = SyntheticShapes3D(**opts)
    assert ds.num_classes == len(SYNTHETIC_CLASSES) == 10 and len(ds) == 30
    for i in range(10):
        x, y = ds[i]
        assert x.shape == (512, 3) and y == i
        r = x.norm(dim=1)
        assert float(r.max()) <= 1 + 1e-5 and float(r.max()) > 0.95
    sphere = ds.points(0)
    assert np.allclose(np.linalg.norm(sphere, axis=1), 1.0, atol=0.01)  # a (tessellated) unit sphere
    torus = ds.points(4)  # axis z, R = 1 normalised: points lie at |z| <= tube radius
    assert np.abs(torus[:, 2]).max() < 0.35
    assert torch.equal(ds[13][0], SyntheticShapes3D(**opts)[13][0])
    assert not torch.equal(ds[13][0], ds.variant(seed=1)[13][0])
    assert not np.allclose(ds.points(16), ds.points(26)[:512])  # two tables differ in proportions


# ----------------------------------------------------------------------------- protocols
def test_rotation_protocol_preserves_pairwise_distances(cgal):
    train, test = rotation_protocol(cgal.variant(split="train"), cgal, "z/so3")
    assert (train.rotation, test.rotation, train.split, test.split) == ("z", "so3", "train", "test")
    upright = test.variant(rotation="none")
    for i in (0, 17, 40):
        a, b = test.points(i)[:256], upright.points(i)[:256]
        assert np.allclose(_pdist(a), _pdist(b), atol=1e-9)
        assert not np.allclose(a, b)
        R, *_ = np.linalg.lstsq(b, a, rcond=None)  # the map between them is a rotation
        assert np.allclose(R.T @ R, np.eye(3), atol=1e-8) and math.isclose(np.linalg.det(R), 1.0, abs_tol=1e-8)
    ztrain = train.points(3)
    assert np.allclose(ztrain[:, 2], train.variant(rotation="none").points(3)[:, 2])  # z rotations keep z
    so3_train, so3_test = rotation_protocol(cgal, cgal, "so3/so3")
    assert so3_train.rotation == so3_test.rotation == "so3"


def test_point_count_protocol_gives_requested_counts(cgal):
    base = cgal.variant(num_points=256)
    variants = point_count_protocol(base)
    assert sorted(variants) == [256, 512, 1024, 2048]
    for n, ds in variants.items():
        x, y = ds[9]
        assert x.shape == (n, 3) and y == 9 and len(ds) == len(base)
    # same shape, same augmentation: the smaller cloud is the start of the larger one
    assert np.allclose(variants[2048].points(9)[:256], base.points(9), atol=1e-12)
    custom = point_count_protocol(base, train_points=100, factors=(2, 8))
    assert sorted(custom) == [200, 800] and custom[800][0][0].shape == (800, 3)


def test_partial_views_keep_part_of_the_shape():
    part = SyntheticShapes3D(num_points=512, rotation="none", scale=None, jitter=0.0, samples_per_class=2, partial=0.5)
    before = part.variant(partial=None, num_points=1024)  # the surface sample the view is cut from
    for i in range(10, 20):
        p, f = part.points(i), before.points(i)
        assert p.shape == (512, 3)
        rows = {tuple(r) for r in f}
        assert all(tuple(r) in rows for r in p)  # a subset of the full sample ...
        assert not np.array_equal(p, f[:512])  # ... chosen by the view, not by order
        # the kept half lies on one side of the shape: its centroid moves away from the full one
        assert np.linalg.norm(p.mean(0) - f.mean(0)) > 0.1
    assert np.array_equal(part.points(3), part.points(3))


# ----------------------------------------------------------------------------- collator
def test_point_collator_mixed_lengths_and_dataloader_workers(cgal):
    ds = SyntheticShapes3D(num_points=64, samples_per_class=1)
    batch = [ds[0], (ds[1][0][:40], 1), (ds[2][0][:10], 2)]
    out = PointCollator(prefix=1)(batch)
    assert out["points"].shape == (3, 64, 3) and out["labels"].tolist() == [0, 1, 2]
    assert out["valid"].sum(1).tolist() == [64, 40, 10] and out["lengths"].tolist() == [64, 40, 10]
    pos = out["positions"]
    assert isinstance(pos, Positions) and pos.prefix == 1 and pos.grid is None
    assert pos.coords.shape == (3, 65, 3) and bool((pos.coords[:, 0] == 0).all())
    assert torch.equal(pos.coords[1, 1:41], batch[1][0]) and bool((pos.coords[1, 41:] == 0).all())
    assert pos.valid.sum(1).tolist() == [65, 41, 11] and bool(pos.valid[:, 0].all())
    same = PointCollator()([ds[0], ds[1]])
    assert same["valid"] is None and same["positions"].valid is None
    loader = DataLoader(cgal.variant(num_points=128), batch_size=4, num_workers=2, collate_fn=PointCollator(prefix=1))
    first = next(iter(loader))
    assert isinstance(first["positions"], Positions) and first["positions"].coords.shape == (4, 129, 3)
    assert torch.equal(first["positions"].coords[:, 1:], first["points"])
