"""The Shapes-HR render cache (data/shapes_cache.py) and its wiring into train/vit.py and eval/resolution.py.

Checked against: the live :class:`data.shapes.Shapes` (every pixel within ``0.5/255 + 1e-6``: the uint8 quantisation,
equal labels and size bins), a second read with the renderer patched to raise (the file is read, nothing is
rendered), a truncated and a foreign file (rendered again with a warning), and two processes started together on
the same file (one renders, both read the same valid pixels).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import data.shapes as shapes_mod
import data.shapes_render as render_mod
from data.shapes import Shapes
from data.shapes_cache import CachedShapes, cache_path, cached_shapes, default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
TOL = 0.5 / 255 + 1e-6
N = 40


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("VLPE_CACHE", str(folder))
    return folder


def _no_render(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("rendered although the cache file exists")

    monkeypatch.setattr(shapes_mod, "render", refuse)
    monkeypatch.setattr(render_mod, "render", refuse)


def _check_equal_to_live(cached: Shapes, live: Shapes) -> None:
    assert len(cached) == len(live)
    for i in range(len(live)):
        (x, y), (ref, ref_y) = cached[i], live[i]
        assert x.shape == ref.shape == (3, live.resolution, live.resolution) and x.dtype == torch.float32
        assert float((x - ref).abs().max()) <= TOL, i
        assert y == ref_y and cached.size_bin(i) == live.size_bin(i)


# --------------------------------------------------------------------------- contents, name, location
@pytest.mark.parametrize("resolution", [28, 64])
def test_cached_images_equal_live_renders_up_to_uint8(cache, resolution):
    live = Shapes(N, resolution=resolution, split="test")
    cached = cached_shapes(live)
    assert isinstance(cached, CachedShapes) and isinstance(cached, Shapes)
    assert not cached.path.exists()  # made on the first read, not when the dataset is built
    _check_equal_to_live(cached, live)
    assert cached.rendered and cached.path.parent == cache == default_cache_dir()
    assert cached.path.name.startswith(f"shapes-test-seed0-{resolution}px-n{N}-") and cached.path.suffix == ".npy"
    stored = np.load(cached.path, allow_pickle=False)
    assert stored.dtype == np.uint8 and stored.shape == (N, resolution, resolution, 3)
    assert np.array_equal(stored[3], np.rint(live.render(3) * 255).astype(np.uint8))
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_default_location_is_runs_cache_shapes(monkeypatch):
    monkeypatch.delenv("VLPE_CACHE", raising=False)
    assert default_cache_dir() == ROOT / "runs" / "cache" / "shapes"


def test_file_name_changes_with_every_pixel_parameter_only(cache):
    base = Shapes(N, resolution=28, split="train")
    name = cache_path(base).name
    changed = [
        Shapes(N, resolution=28, split="val"),
        Shapes(N, resolution=28, split="train", seed=1),
        Shapes(N, resolution=32, split="train"),
        Shapes(N + 1, resolution=28, split="train"),
        Shapes(N, resolution=28, split="train", classes=("circle", "square")),
        Shapes(N, resolution=28, split="train", size_range=(0.2, 0.6)),
        Shapes(N, resolution=28, split="train", backgrounds=("grass",)),
        Shapes(N, resolution=28, split="train", supersample=2),
        Shapes(N, resolution=28, split="train", background_contrast=0.5),
    ]
    names = [cache_path(s).name for s in changed]
    assert name not in names and len(set(names)) == len(names)
    # applied after the read (or only binning the drawn size): the same file
    same = Shapes(N, resolution=28, split="train", size_bins=3, mean=0.5, std=0.25,
                  transform=lambda image: {"image": image})  # fmt: skip
    assert cache_path(same).name == name
    assert cache_path(base, cache_dir="/elsewhere") == Path("/elsewhere") / name


# --------------------------------------------------------------------------- reuse, repair
def test_second_use_reads_the_file_without_rendering(cache, monkeypatch):
    live = Shapes(N, resolution=28, split="val")
    first = cached_shapes(live)
    first.images()
    assert first.rendered
    reference = [live[i] for i in range(N)]
    _no_render(monkeypatch)
    second = cached_shapes(Shapes(N, resolution=28, split="val"))
    xs = [second[i] for i in range(N)]
    assert not second.rendered
    for (x, y), (ref, ref_y) in zip(xs, reference):
        assert float((x - ref).abs().max()) <= TOL and y == ref_y
    assert isinstance(second.images(), np.memmap) and not second.images().flags.writeable
    # a pickled copy (a spawned DataLoader worker) carries the path, not the pixels, and reopens the file
    clone = pickle.loads(pickle.dumps(second))
    assert len(pickle.dumps(second)) < 4096 and torch.equal(clone[5][0], xs[5][0])
    # the normalisation is applied after the read, as Shapes applies it after the render
    norm = cached_shapes(Shapes(N, resolution=28, split="val", mean=0.5, std=0.25))
    assert torch.allclose(norm[2][0], (xs[2][0] - 0.5) / 0.25)


@pytest.mark.parametrize("damage", ["truncate", "foreign"])
def test_an_unusable_file_is_rendered_again_with_a_warning(cache, damage):
    live = Shapes(N, resolution=28, split="train")
    cached_shapes(live).images()
    path = cache_path(live)
    if damage == "truncate":
        size = path.stat().st_size
        os.truncate(path, size // 2)
    else:
        np.save(path, np.zeros((N, 28, 28), dtype=np.uint8))  # the right name, the wrong shape
    again = cached_shapes(live)
    with pytest.warns(RuntimeWarning, match="unusable .*rendering it again"):
        again.images()
    assert again.rendered
    _check_equal_to_live(again, live)
    assert np.load(path, allow_pickle=False).shape == (N, 28, 28, 3)


# --------------------------------------------------------------------------- concurrency
_CHILD = r"""
import hashlib, json, sys, time
from pathlib import Path
import numpy as np
from data.shapes import Shapes
from data.shapes_cache import cached_shapes

go = Path(sys.argv[1])
ds = cached_shapes(Shapes(40, resolution=64, split="test"))
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
images = ds.images()
pixels = np.stack([ds[i][0].numpy() for i in range(len(ds))])  # (N, 3, R, R)
print(json.dumps({"rendered": ds.rendered, "sha": hashlib.sha256(np.ascontiguousarray(images)).hexdigest(),
                  "pixels": hashlib.sha256(pixels.tobytes()).hexdigest()}), flush=True)
"""


def test_two_processes_creating_the_same_cache_both_get_valid_data(cache, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "VLPE_CACHE": str(cache), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(go)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        go.touch()  # both start reading the missing file at once
        outputs = [child.communicate(timeout=120) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert all(child.returncode == 0 for child in children), [err for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sorted(r["rendered"] for r in results) == [False, True]  # one rendered, the other waited and read
    live = Shapes(N, resolution=64, split="test")
    expected = np.stack([np.rint(live.render(i) * 255).astype(np.uint8) for i in range(N)])  # (N, R, R, 3)
    import hashlib

    assert {r["sha"] for r in results} == {hashlib.sha256(expected).hexdigest()}
    assert len({r["pixels"] for r in results}) == 1
    assert sorted(p.name for p in cache.iterdir()) == sorted([cache_path(live).name, cache_path(live).name + ".lock"])


# --------------------------------------------------------------------------- wiring
def test_build_datasets_and_evaluation_read_the_cache(cache, monkeypatch):
    import resolution  # eval/resolution.py

    from train.vit_setup import DataSection, build_datasets

    data = DataSection(dataset="shapes", channels=3, img_size=28, shapes_train=N, shapes_val=N, shapes_test=N,
                       val_limit=None, shapes_cache=True)  # fmt: skip
    train, val, _ = build_datasets(data)
    assert isinstance(train, CachedShapes) and isinstance(val, CachedShapes) and val.split == "val"
    _check_equal_to_live(val, Shapes(N, resolution=28, split="val"))
    _, held_val, _ = build_datasets(replace(data, holdout=10))
    assert isinstance(held_val.dataset, CachedShapes) and held_val.dataset.path == train.path  # one file
    test = resolution.test_dataset(data, 64, "render")  # evaluation at another size: that size's test file
    assert isinstance(test, CachedShapes) and test.split == "test" and test.resolution == 64
    live64 = Shapes(N, resolution=64, split="test")
    _check_equal_to_live(test, live64)
    bins = resolution.size_bins(test)
    assert bins is not None and bins[0].tolist() == [live64.size_bin(i) for i in range(N)]
    assert not train.path.exists()  # never read: never rendered
    _no_render(monkeypatch)
    again = resolution.test_dataset(data, 64, "render")
    assert torch.equal(again[7][0], test[7][0]) and not again.rendered
