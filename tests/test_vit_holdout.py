"""``data.holdout`` of train/vit.py (validation on the tail of the training split) and the test split evaluation reads.

Checked against: the uncut training split built with ``holdout = 0`` (the held-out images are its last ``n``, pixel
for pixel, and disjoint from the training indices), a verbatim copy of ``build_datasets`` as it was before the
field existed (``holdout = 0`` builds the same sets, the same Subset indices and the same pixels), the datasets'
own test splits (``eval/resolution.py`` reads them at the benchmark's offsets, never the validation set).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import Subset

import resolution  # eval/resolution.py (eval/ is on the test path)

from data import images as imgs
from data.shapes import Shapes
from train.config import ConfigError, to_dict
from train.vit_setup import DataSection, ViTConfig, build_datasets

FASHION = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
needs_fashion = pytest.mark.skipif(not FASHION.exists(), reason="needs Debian dataset-fashion-mnist")


def _old_build_datasets(data: DataSection, *, size: int | None = None):
    """``train.vit.build_datasets`` before ``holdout`` existed (verbatim, the reference for ``holdout = 0``)."""
    from data import transforms

    size = data.img_size if size is None else size
    common = dict(size=size, channels=data.channels)
    train_tf = transforms.train_transform(size) if data.augment else None
    if data.dataset == "fashion_mnist":
        train = imgs.FashionMNIST("train", transform=train_tf, **common)
        val = imgs.FashionMNIST("test", **common)
    elif data.dataset == "mnist5k":
        train, val = imgs.MNIST5k("train", transform=train_tf, **common), imgs.MNIST5k("test", **common)
    elif data.dataset == "digits":
        train, val = imgs.Digits("train", transform=train_tf, **common), imgs.Digits("test", **common)
    elif data.dataset == "shapes":
        train = Shapes(num_samples=data.shapes_train, resolution=size, split="train")
        val = Shapes(num_samples=data.shapes_val, resolution=size, split="val")
    else:
        train = imgs.ImageFolder(f"{data.root}/train", transform=train_tf, **common)
        val = imgs.ImageFolder(f"{data.root}/val", **common)
    num_classes = len(getattr(train, "classes", ())) or int(getattr(train, "num_classes"))
    if data.train_limit is not None:
        train = Subset(train, range(min(data.train_limit, len(train))))
    if data.val_limit is not None:
        val = Subset(val, range(min(data.val_limit, len(val))))
    return train, val, num_classes


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A class-folder set: train/{a,b,c}/ three 6x6 PNGs each, val/{a,b,c}/ two each."""
    import cv2

    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for split, count in (("train", 3), ("val", 2)):
        for name in "abc":
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                cv2.imwrite(str(root / split / name / f"{k}.png"), rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    return root


def _section(dataset: str, folder_root: Path | None = None, **kw) -> DataSection:
    base = {
        "fashion_mnist": dict(img_size=28, channels=1),
        "mnist5k": dict(img_size=28, channels=1),
        "digits": dict(img_size=8, channels=1),
        "shapes": dict(img_size=16, channels=3, shapes_train=40, shapes_val=12, shapes_test=12),
        "folder": dict(img_size=6, channels=3, root=str(folder_root)),
    }[dataset]
    return DataSection(dataset=dataset, **{**base, **kw})


DATASETS = [pytest.param("fashion_mnist", marks=needs_fashion), "mnist5k", "digits", "shapes", "folder"]
HOLDOUT = {"fashion_mnist": 50, "mnist5k": 30, "digits": 40, "shapes": 10, "folder": 2}


def _base_and_indices(ds) -> tuple[object, list[int]]:
    if isinstance(ds, Subset):
        return ds.dataset, list(ds.indices)
    return ds, list(range(len(ds)))


def _pixels(ds, indices) -> torch.Tensor:
    return torch.stack([ds[i][0] for i in indices])  # (k, C, H, W)


# --------------------------------------------------------------------------- holdout = n
@pytest.mark.parametrize("dataset", DATASETS)
def test_holdout_is_the_last_n_training_images_and_left_out_of_training(dataset, folder):
    n_held = HOLDOUT[dataset]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # label-sorted splits warn (tested below)
        uncut, _, classes0 = build_datasets(_section(dataset, folder, val_limit=None))
        train, val, classes = build_datasets(_section(dataset, folder, holdout=n_held, val_limit=None))
    n = len(uncut)
    assert classes == classes0 and len(train) + len(val) == n and len(val) == n_held
    train_base, train_idx = _base_and_indices(train)
    val_base, val_idx = _base_and_indices(val)
    assert train_idx == list(range(n - n_held)) and val_idx == list(range(n - n_held, n))
    assert not set(train_idx) & set(val_idx)
    assert len(train_base) == len(val_base) == n  # both index the whole training split
    # the held-out images are the training split's last n, pixel for pixel, with their labels
    assert torch.equal(_pixels(val, range(n_held)), _pixels(uncut, range(n - n_held, n)))
    assert [val[i][1] for i in range(n_held)] == [uncut[i][1] for i in range(n - n_held, n)]
    # and the training set is the head of the same split
    for i in (0, n - n_held - 1):
        assert torch.equal(train[i][0], uncut[i][0])
    if dataset == "shapes":
        live = Shapes(num_samples=40, resolution=16, split="train")
        ref = torch.from_numpy(np.stack([live.render(i) for i in range(30, 40)])).permute(0, 3, 1, 2)
        assert torch.allclose(_pixels(val, range(n_held)), ref)


def test_train_limit_applies_after_holdout_and_val_limit_to_the_holdout():
    data = _section("digits", holdout=100, train_limit=50, val_limit=30)
    train, val, _ = build_datasets(data)
    n = len(imgs.Digits("train"))
    assert list(train.indices) == list(range(50))
    assert list(val.indices) == list(range(n - 100, n - 70))  # the first val_limit of the held-out tail
    train, val, _ = build_datasets(replace(data, train_limit=10**6, val_limit=None))
    assert list(train.indices) == list(range(n - 100)) and list(val.indices) == list(range(n - 100, n))


def test_holdout_images_skip_the_training_augmentation():
    train, val, _ = build_datasets(_section("digits", holdout=20, augment=True, img_size=16))
    plain = imgs.Digits("train", size=16, channels=1)
    assert train.dataset.transform is not None and val.dataset.transform is None
    n = len(plain)
    assert torch.equal(_pixels(val, range(20)), _pixels(plain, range(n - 20, n)))


def test_holdout_of_a_class_sorted_split_warns(folder):
    with pytest.warns(RuntimeWarning, match=r"misses classes \[0, 1, 2, 3, 4, 5, 6, 7, 8\]"):
        build_datasets(_section("mnist5k", holdout=30))  # MNIST-5k's training split is sorted by label: all 9s
    with pytest.warns(RuntimeWarning, match=r"leaves classes \[2\] without a training image"):
        build_datasets(_section("folder", folder, holdout=4))  # sorted by class folder: all of c and one b
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        build_datasets(_section("digits", holdout=100))  # interleaved labels: every class on both sides
        build_datasets(_section("digits", holdout=20))  # too few to expect every class


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_holdout_values_are_config_errors(bad):
    with pytest.raises(ConfigError, match="data.holdout must be an integer >= 0"):
        DataSection(holdout=bad)


@pytest.mark.parametrize("dataset,size", [("digits", 1438), ("shapes", 40), ("folder", 9)])
def test_holdout_as_large_as_the_training_split_is_a_config_error(dataset, size, folder):
    with pytest.raises(ConfigError, match=rf"data.holdout={size} must be smaller than the {size} images"):
        build_datasets(_section(dataset, folder, holdout=size))
    build_datasets(_section(dataset, folder, holdout=size - 1), split="test")  # the largest allowed


# --------------------------------------------------------------------------- holdout = 0: as before
@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("limits", [dict(), dict(train_limit=7, val_limit=None), dict(train_limit=10**6, val_limit=3)])
def test_holdout_zero_builds_what_the_old_build_datasets_built(dataset, limits, folder):
    data = _section(dataset, folder, **limits)
    old = _old_build_datasets(data)
    new = build_datasets(data)
    assert old[2] == new[2]
    for a, b in zip(old[:2], new[:2]):
        assert type(a) is type(b) and len(a) == len(b)
        (base_a, idx_a), (base_b, idx_b) = _base_and_indices(a), _base_and_indices(b)
        assert type(base_a) is type(base_b) and idx_a == idx_b and len(base_a) == len(base_b)
        picks = sorted({0, len(a) // 2, len(a) - 1})
        assert torch.equal(_pixels(a, picks), _pixels(b, picks))
        assert [a[i][1] for i in picks] == [b[i][1] for i in picks]


@pytest.mark.parametrize("dataset", [pytest.param("fashion_mnist", marks=needs_fashion), "mnist5k", "digits"])
@pytest.mark.parametrize("holdout", [0, 25])
def test_test_split_of_array_sets_is_the_old_validation_set(dataset, holdout):
    """What evaluation reads (``split="test"``) is the old second set, val_limit included, whatever the holdout."""
    old = _old_build_datasets(_section(dataset, val_limit=30))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        new = build_datasets(_section(dataset, val_limit=30, holdout=holdout), split="test")[1]
    assert isinstance(new, Subset) and list(new.indices) == list(old.indices) == list(range(30))
    assert type(new.dataset) is type(old.dataset) and new.dataset.split == "test"
    assert torch.equal(_pixels(new, range(30)), _pixels(old, range(30)))


# --------------------------------------------------------------------------- evaluation reads the test split
def _export_run(out_dir: Path, data: DataSection) -> Path:
    """A run folder as the training engine exports it (untrained weights)."""
    from train.engine import export_weights
    from train.tasks import Classifier
    from models.vit import vit_from_config as build_model

    cfg = ViTConfig(data=data)
    cfg.model.preset, cfg.model.patch_size = "nano", 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        num_classes = build_datasets(cfg.data)[2]
    torch.manual_seed(0)
    export_weights(Classifier(build_model(cfg, num_classes)), out_dir / "model.safetensors", zero_stage=0)
    config = {**to_dict(cfg), "num_classes": num_classes, "script": "vit"}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir


@pytest.mark.filterwarnings("ignore:.*records no model signature")
def test_evaluate_run_reads_test_images_at_its_offset(tmp_path, monkeypatch):
    data = _section("digits", holdout=300, val_limit=None)
    run_dir = _export_run(tmp_path / "digits_holdout", data)
    seen: dict[int, torch.Tensor] = {}
    real_predict = resolution.predict

    def spy(model, loader, device, **kw):
        ds = loader.dataset
        seen[ds[0][0].shape[-1]] = torch.stack([ds[i][0] for i in range(len(ds))])  # (k, 1, S, S)
        return real_predict(model, loader, device, **kw)

    monkeypatch.setattr(resolution, "predict", spy)
    offset, limit = 11, 6
    ev = resolution.evaluate_run(run_dir, [1, 2], offset=offset, limit=limit, device="cpu", progress=False)
    assert [r["size"] for r in ev["results"]] == [8, 16] and all(r["count"] == limit for r in ev["results"])
    for size in (8, 16):
        test = imgs.Digits("test", size=size, channels=1)
        assert torch.equal(seen[size], _pixels(test, range(offset, offset + limit)))
        train = imgs.Digits("train", size=size, channels=1)
        n = len(train)
        held = _pixels(train, range(n - 300, n))  # the validation set: none of it is evaluated
        assert not any(torch.equal(x, h) for x in seen[size] for h in held)


@pytest.mark.parametrize("protocol", ["render", "resize"])
def test_shapes_evaluation_reads_the_test_split(protocol):
    data = _section("shapes", holdout=10, val_limit=None, shapes_test=5)
    ds = resolution.test_dataset(data, 32, protocol)
    assert len(ds) == 5
    test16 = Shapes(num_samples=5, resolution=16, split="test")
    for k in (0, 4):
        x, y = ds[k]
        if protocol == "render":
            assert torch.allclose(x, torch.from_numpy(test16.render(k, 32)).permute(2, 0, 1))
        else:
            from data.transforms import resize

            assert torch.allclose(x, resize(test16[k][0], 32))
        assert y == test16[k][1]
    bins = resolution.size_bins(ds)
    assert bins is not None and bins[0].tolist() == [test16.size_bin(i) for i in range(5)]
    val = build_datasets(data)[1]
    assert isinstance(val, Subset) and val.dataset.split == "train"  # training validates on its own tail


# --------------------------------------------------------------------------- Shapes-HR size and orientation knobs
def _unwrap(ds):
    while not isinstance(ds, Shapes):
        ds = getattr(ds, "dataset", None) or getattr(ds, "source", None) or getattr(ds, "shapes")
    return ds


def test_shapes_rotation_keeps_every_other_draw_and_bounds_the_turn():
    import math

    free = Shapes(200, resolution=16, split="train")
    upright = Shapes(200, resolution=16, split="train", rotation=0.0)
    tilted = Shapes(200, resolution=16, split="train", rotation=math.radians(15))
    for i in range(200):
        a, b, c = free.spec(i), upright.spec(i), tilted.spec(i)
        assert b.rotation == 0.0 and abs(c.rotation) <= math.radians(15) + 1e-12
        assert 0.0 <= a.rotation < 2 * math.pi
        # one uniform draw either way: centre, size, colour and background are the same sample
        assert replace(b, rotation=a.rotation) == a and replace(c, rotation=a.rotation) == a
    turns = [tilted.spec(i).rotation for i in range(200)]
    assert min(turns) < -math.radians(10) and max(turns) > math.radians(10)  # spread over the whole range
    with pytest.raises(ValueError, match="rotation must be"):
        Shapes(10, rotation=4.0)


def test_shapes_knobs_reach_every_split_and_the_cache_key():
    from data.shapes_cache import cache_key

    data = DataSection(dataset="shapes", channels=3, img_size=16, shapes_train=40, shapes_test=30, holdout=10,
                       shapes_size=[0.4, 0.8], shapes_rotation=0)  # fmt: skip
    for split in ("val", "test"):
        train, held, _ = build_datasets(data, split=split)
        for ds in (train, held):
            s = _unwrap(ds)
            assert s.size_range == (0.4, 0.8) and s.rotation == 0.0
    default = Shapes(40, resolution=16)
    assert "rotation" not in cache_key(default)  # the default's cache files keep their names
    assert cache_key(default) != cache_key(Shapes(40, resolution=16, rotation=0.0))
    assert cache_key(default) != cache_key(Shapes(40, resolution=16, size_range=(0.4, 0.8)))


@pytest.mark.parametrize(
    "bad", [{"shapes_size": [0.8, 0.4]}, {"shapes_size": [0.0, 0.5]}, {"shapes_size": 0.5},
            {"shapes_rotation": 181}, {"shapes_rotation": -1}, {"shapes_rotation": True}],
)  # fmt: skip
def test_bad_shapes_knobs_are_config_errors(bad):
    with pytest.raises(ConfigError, match="data.shapes_"):
        DataSection(dataset="shapes", channels=3, **bad)
