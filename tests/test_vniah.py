"""data.vniah: needles are found in the frames themselves (not only in the metadata), at the requested
depth; distractors sit at +-delta with another answer; counting / ordering answers match the frames;
samples are a pure function of (seed, index).

Fashion-MNIST is read here with an independent IDX parser from the Debian package's files.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from data.video import read_video, real_clip_path
from data.vniah import (
    DISTRACTOR_RGB,
    FASHION_ANSWERS,
    NEEDLE_RGB,
    NUMBER_WORDS,
    PHOTO_NEEDLES,
    RealHaystack,
    VCounting,
    VNIAH,
    VOrdering,
    collate_tasks,
    vocabulary,
    write_sample,
)

FMNIST = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST label order (T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag, Ankle boot)
WORDS = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]


@pytest.fixture(scope="module")
def fashion():
    with gzip.open(FMNIST / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(FMNIST / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(int)
    return images, labels


def tinted(gray: np.ndarray, rgb) -> np.ndarray:
    """The expected drawing: luminance x colour, rounded."""
    return np.rint(gray[..., None].astype(float) * np.asarray(rgb, float) / 255.0).astype(np.uint8)


def signature_frames(frames: torch.Tensor, rgb) -> list[int]:
    """Frames that are entirely a grey image tinted by ``rgb`` (found without any metadata)."""
    f = frames.numpy().astype(float)  # (L, H, W, 3)
    lum = f[..., 0] * 255.0 / rgb[0] if rgb[0] >= max(rgb) else f[..., 2] * 255.0 / rgb[2]
    out = []
    for t in range(len(f)):
        expect = lum[t][..., None] * np.asarray(rgb, float) / 255.0
        if np.abs(f[t] - expect).max() <= 2.0 and lum[t].std() > 10:
            out.append(t)
    return out


def item_of(frame: torch.Tensor, images: np.ndarray, rgb) -> int:
    """Which Fashion-MNIST test image is drawn in ``frame``: its full-intensity channel equals the image."""
    channel = int(np.argmax(rgb))
    assert rgb[channel] == 255
    hits = np.flatnonzero((images == frame.numpy()[None, ..., channel]).all(axis=(1, 2)))
    assert hits.size >= 1
    return int(hits[0])


# --------------------------------------------------------------------------------------------- V-NIAH


@pytest.mark.parametrize("length", [8, 33])
def test_exactly_one_needle_at_the_requested_depth(fashion, length):
    images, labels = fashion
    depths = (0.0, 0.3, 0.55, 1.0)
    ds = VNIAH(lengths=(length,), depths=depths, samples_per_cell=2, size=28, seed=7)
    assert len(ds) == len(depths) * 2
    for i in range(len(ds)):
        s = ds[i]
        d = depths[i // 2]
        expected = round(d * (length - 1))
        assert s["frames"].shape == (length, 28, 28, 3) and s["frames"].dtype == torch.uint8
        assert signature_frames(s["frames"], NEEDLE_RGB) == [expected]  # one red frame, found from pixels
        item = item_of(s["frames"][expected], images, NEEDLE_RGB)
        np.testing.assert_array_equal(s["frames"][expected].numpy(), tinted(images[item], NEEDLE_RGB))
        assert s["answer"] == WORDS[labels[item]] and s["label"] == labels[item]
        assert s["needle_index"] == expected and s["depth"] == d and s["length"] == length
        assert s["question"] == "What item is shown in red?" and s["distractor_indices"] == []
        np.testing.assert_allclose(s["timestamps"].numpy(), np.arange(length) / 2.0)


def test_real_haystack_with_a_pasted_needle(fashion):
    images, _ = fashion
    hay = RealHaystack(("carphone_pristine",), backend="av")
    ds = VNIAH(lengths=(48,), depths=(0.25,), samples_per_cell=2, size=32, needle_size=20, haystack=hay, seed=1)
    pool = read_video(real_clip_path("carphone_pristine"), size=32, backend="av", timeout=None).frames  # 120 frames
    for i in range(2):
        s = ds[i]
        frames = s["frames"].numpy()
        t = round(0.25 * 47)
        y, x = s["needle_boxes"][0]
        from PIL import Image

        gray = np.asarray(Image.fromarray(images[s["needle_items"][0]]).resize((20, 20), Image.BILINEAR))
        np.testing.assert_array_equal(frames[t, y : y + 20, x : x + 20], tinted(gray, NEEDLE_RGB))
        # every other frame is real footage: consecutive decoded frames of the clip, looped
        rest = np.delete(np.arange(48), t)
        start = int(np.flatnonzero((pool == frames[0]).all(axis=(1, 2, 3)))[0])
        np.testing.assert_array_equal(frames[rest], pool[(start + rest) % len(pool)])
        # outside the box the needle frame is the haystack frame too
        mask = np.ones((32, 32), bool)
        mask[y : y + 20, x : x + 20] = False
        np.testing.assert_array_equal(frames[t][mask], pool[(start + t) % len(pool)][mask])


def test_needle_depth_and_length_are_validated():
    with pytest.raises(ValueError, match=r"depth must be a number in \[0, 1\]"):
        VNIAH(lengths=(8,), depths=(1.5,))
    with pytest.raises(ValueError, match=r"depth must be a number in \[0, 1\]"):
        VNIAH(lengths=(8,), depths=(-0.1,))
    with pytest.raises(ValueError, match="shorter than the needle span"):
        VNIAH(lengths=(8, 2), depths=(0.5,), needle_span=3)
    with pytest.raises(ValueError, match="shorter than the needle span"):
        VCounting(lengths=(4,), max_count=5)
    with pytest.raises(ValueError, match="delta"):
        VNIAH(lengths=(8,), distractors="single", delta=0)
    with pytest.raises(ValueError, match="period"):
        VNIAH(lengths=(8,), distractors="periodic")
    with pytest.raises(ValueError, match="needles"):
        VNIAH(lengths=(8,), needles="cifar")
    with pytest.raises(IndexError):
        VNIAH(lengths=(8,), depths=(0.5,), samples_per_cell=1)[1]


def test_needle_span(fashion):
    ds = VNIAH(lengths=(10,), depths=(1.0,), samples_per_cell=1, size=28, needle_span=3)
    s = ds[0]
    assert signature_frames(s["frames"], NEEDLE_RGB) == [7, 8, 9]
    assert s["needle_index"] == 7


# ------------------------------------------------------------------------------------------- V-NIAH-D


def test_single_distractor_at_plus_minus_delta_with_another_answer(fashion):
    images, labels = fashion
    depths = (0.0, 0.1, 0.5, 0.9, 1.0)
    kw = dict(lengths=(24,), depths=depths, samples_per_cell=4, size=28, seed=3)
    plain, dist = VNIAH(**kw), VNIAH(**kw, distractors="single", delta=5)
    sides = set()
    for i in range(len(dist)):
        a, s = plain[i], dist[i]
        n = s["needle_index"]
        (k,) = s["distractor_indices"]
        assert abs(k - n) == 5
        sides.add(k - n)
        if n < 5:
            assert k == n + 5  # forced to the side that fits
        if n + 5 > 23:
            assert k == n - 5
        assert signature_frames(s["frames"], DISTRACTOR_RGB) == [k]  # found from the pixels
        assert signature_frames(s["frames"], NEEDLE_RGB) == [n]
        d_item = item_of(s["frames"][k], images, DISTRACTOR_RGB)
        assert WORDS[labels[d_item]] == s["distractor_answers"][0] != s["answer"]
        # matched pair: same haystack, needle and answer as V-NIAH; only the distractor frame differs
        assert a["answer"] == s["answer"] and a["needle_index"] == n
        differs = (a["frames"] != s["frames"]).flatten(1).any(1).nonzero().flatten().tolist()
        assert differs == [k]
        assert s["task"] == "v_niah_d" and a["task"] == "v_niah"
    assert sides == {-5, 5}  # both sides occur


def test_single_distractor_is_omitted_when_neither_side_fits():
    s = VNIAH(lengths=(6,), depths=(0.5,), samples_per_cell=1, size=28, distractors="single", delta=5)[0]
    assert s["distractor_indices"] == [] and signature_frames(s["frames"], DISTRACTOR_RGB) == []


def test_periodic_distractors(fashion):
    images, labels = fashion
    ds = VNIAH(lengths=(40,), depths=(0.5,), samples_per_cell=3, size=28, distractors="periodic", period=6)
    for i in range(3):
        s = ds[i]
        n = round(0.5 * 39)
        assert s["needle_index"] == n
        expected = [n + 6 * k for k in range(-10, 11) if k and 0 <= n + 6 * k < 40]
        assert s["distractor_indices"] == expected == signature_frames(s["frames"], DISTRACTOR_RGB)
        for k, ans in zip(expected, s["distractor_answers"]):
            assert WORDS[labels[item_of(s["frames"][k], images, DISTRACTOR_RGB)]] == ans != s["answer"]
        assert s["task"] == "v_niah_d_periodic"


# ------------------------------------------------------------------------------- counting and ordering


def test_counting_answer_counts_red_frames():
    ds = VCounting(lengths=(20,), samples_per_cell=8, max_count=5, num_distractors=2, size=28, seed=2)
    counts = set()
    for i in range(len(ds)):
        s = ds[i]
        red = signature_frames(s["frames"], NEEDLE_RGB)
        assert NUMBER_WORDS[len(red)] == s["answer"] and s["label"] == len(red)
        assert len(signature_frames(s["frames"], DISTRACTOR_RGB)) == 2
        assert red == s["needle_indices"]
        counts.add(len(red))
    assert len(counts) > 1


def test_ordering_answer_lists_classes_in_temporal_order(fashion):
    images, labels = fashion
    ds = VOrdering(lengths=(16,), samples_per_cell=4, num_items=3, size=28, seed=5)
    for i in range(len(ds)):
        s = ds[i]
        red = signature_frames(s["frames"], NEEDLE_RGB)
        assert len(red) == 3
        words = [WORDS[labels[item_of(s["frames"][t], images, NEEDLE_RGB)]] for t in red]
        assert " ".join(words) == s["answer"] and len(set(words)) == 3


# ---------------------------------------------------------------------------------------- determinism


def test_deterministic_by_seed_and_independent_of_order():
    kw = dict(lengths=(12, 20), depths=(0.2, 0.8), samples_per_cell=2, size=32, distractors="single", delta=4)
    a, b, c = VNIAH(**kw, seed=11), VNIAH(**kw, seed=11), VNIAH(**kw, seed=12)
    order = list(range(len(a)))
    first = {i: a[i] for i in order}
    copy = pickle.loads(pickle.dumps(b))
    for i in reversed(order):  # another order, another (unpickled) object
        s = copy[i]
        assert torch.equal(s["frames"], first[i]["frames"]) and s["answer"] == first[i]["answer"]
        assert s["distractor_indices"] == first[i]["distractor_indices"]
    assert any(not torch.equal(c[i]["frames"], first[i]["frames"]) for i in order)
    batch = collate_tasks([first[0], first[1]])
    assert batch["frames"].shape == (2, 12, 32, 32, 3) and batch["label"].dtype == torch.long


# --------------------------------------------------------------------------------------- photos, mp4


def test_photo_needles_and_vocabulary():
    ds = VNIAH(lengths=(8,), depths=(0.5,), samples_per_cell=3, needles="photos", distractors="single", delta=3)
    for i in range(3):
        s = ds[i]
        assert s["answer"] in PHOTO_NEEDLES.values() and s["distractor_answers"][0] != s["answer"]
        assert signature_frames(s["frames"], NEEDLE_RGB) == [s["needle_index"]]
    vocab = vocabulary()
    assert set(FASHION_ANSWERS) <= set(vocab) and "five" in vocab


def test_write_sample_to_mp4(tmp_path):
    s = VNIAH(lengths=(10,), depths=(0.7,), samples_per_cell=1, size=32, seed=4)[0]
    clip = read_video(write_sample(s, tmp_path / "sample.mp4", lossless=True), timeout=30)
    assert len(clip) == 10
    np.testing.assert_allclose(clip.timestamps, s["timestamps"].numpy(), atol=1e-3)
    assert np.abs(clip.frames.astype(float) - s["frames"].numpy()).mean() < 2.0
    red = clip.frames[..., 0].astype(float) - clip.frames[..., 1:].mean(-1)
    assert int(red.mean(axis=(1, 2)).argmax()) == s["needle_index"] == round(0.7 * 9)
