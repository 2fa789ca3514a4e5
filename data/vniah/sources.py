"""What the V-NIAH tasks are made of: the answer vocabularies and questions, the needle pools (Fashion-MNIST
items, scikit-image photos) and the haystacks (real footage, procedural video)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .._util import python_package_dir
from ..video import HAYSTACK_CLIPS, REAL_CLIPS, ProceduralVideo, read_video, real_clip_path

__all__ = ["FASHION_ANSWERS", "PHOTO_NEEDLES", "NUMBER_WORDS", "NEEDLE_RGB", "DISTRACTOR_RGB", "QUESTIONS",
           "NeedlePool", "ProceduralHaystack", "RealHaystack"]


FASHION_ANSWERS = ("tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")
# scikit-image photos shipped in the wheel (no download): file -> one-word answer.
PHOTO_NEEDLES = {
    "astronaut.png": "astronaut",
    "camera.png": "cameraman",
    "chelsea.png": "cat",
    "coffee.png": "coffee",
    "rocket.jpg": "rocket",
    "horse.png": "horse",
    "coins.png": "coins",
    "moon.png": "moon",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
NEEDLE_RGB = (255, 40, 40)  # red
DISTRACTOR_RGB = (40, 90, 255)  # blue
QUESTIONS = {
    "needle": "What item is shown in red?",
    "counting": "How many red items appear?",
    "ordering": "In what order do the red items appear?",
}


@functools.lru_cache(maxsize=2)
def _photo_arrays() -> tuple[np.ndarray, tuple[str, ...]]:
    from PIL import Image

    folder = python_package_dir("skimage", pip_name="scikit-image==0.26.0") / "data"
    out = []
    for file in PHOTO_NEEDLES:
        path = folder / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall it with: pip install scikit-image==0.26.0")
        img = Image.open(path).convert("L")
        side = min(img.size)
        left, top = (img.size[0] - side) // 2, (img.size[1] - side) // 2
        out.append(np.asarray(img.crop((left, top, left + side, top + side)).resize((64, 64), Image.BILINEAR)))
    return np.stack(out), tuple(PHOTO_NEEDLES.values())


class NeedlePool:
    """Grayscale needle images with one-word answers: ``"fashion_mnist"`` (split ``train``/``test``) or ``"photos"``."""

    def __init__(self, kind: str = "fashion_mnist", *, split: str = "test"):
        if kind == "fashion_mnist":
            from ..images import FashionMNIST

            ds = FashionMNIST(split)
            self.images, labels, self.answers = ds.images, ds.labels, FASHION_ANSWERS
        elif kind == "photos":
            self.images, self.answers = _photo_arrays()
            labels = np.arange(len(self.answers))
        else:
            raise ValueError(f"needles must be 'fashion_mnist' or 'photos', got {kind!r}")
        self.kind, self.split = kind, split
        self.labels = np.asarray(labels, dtype=np.int64)
        self.by_class = [np.flatnonzero(self.labels == c) for c in range(len(self.answers))]

    @property
    def num_classes(self) -> int:
        return len(self.answers)

    def draw(
        self, rng: np.random.Generator, classes: Sequence[int] | None = None, *, exclude: Sequence[int] = ()
    ) -> tuple[int, int]:
        """(item index, class) of a random item, of a class drawn from ``classes`` minus ``exclude``."""
        pool = [c for c in (range(self.num_classes) if classes is None else classes) if c not in set(exclude)]
        if not pool:
            raise ValueError("no needle class left to draw from")
        c = int(pool[rng.integers(len(pool))])
        items = self.by_class[c]
        return int(items[rng.integers(len(items))]), c

    def image(self, item: int, size: int) -> np.ndarray:
        """Item ``item`` as a (size, size) uint8 grayscale square (antialiased bilinear resize)."""
        img = self.images[item]
        if img.shape != (size, size):
            from PIL import Image

            img = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR))
        return img


def _paint(frame: np.ndarray, gray: np.ndarray, rgb: Sequence[int], y0: int, x0: int) -> None:
    """Draw a grayscale square as ``luminance x colour`` (black background) into ``frame`` in place."""
    s = gray.shape[0]
    color = np.asarray(rgb, dtype=np.uint32)
    frame[y0 : y0 + s, x0 : x0 + s] = ((gray[..., None].astype(np.uint32) * color + 127) // 255).astype(np.uint8)


class ProceduralHaystack:
    """Moving sprites over a drifting texture (:class:`data.video.ProceduralVideo`), a new scene per sample."""

    def __init__(self, *, num_sprites: int = 3, speed: float = 1.0):
        self.num_sprites, self.speed = num_sprites, speed

    def frames(self, rng: np.random.Generator, length: int, size: tuple[int, int]) -> np.ndarray:
        video = ProceduralVideo(
            height=size[0], width=size[1], seed=int(rng.integers(2**31)), num_sprites=self.num_sprites, speed=self.speed
        )
        start = int(rng.integers(0, 10_000))
        return video.frames(np.arange(start, start + length))


@functools.lru_cache(maxsize=8)
def _real_pool(
    clips: tuple[str, ...], size: tuple[int, int], sample_fps: float | None, backend: str, timeout: float
) -> np.ndarray:
    opts = dict(size=size, fps=sample_fps, backend=backend, timeout=timeout)
    parts = [read_video(_clip_file(name), **opts).frames for name in clips]
    pool = np.concatenate(parts)
    pool.flags.writeable = False
    return pool


def _clip_file(clip: str | os.PathLike) -> Path:
    """The file of a shipped clip's name (:data:`data.video.REAL_CLIPS`) or of a path to a video file."""
    if isinstance(clip, str) and clip in REAL_CLIPS:
        return real_clip_path(clip)
    path = Path(clip)
    if not path.is_file():
        raise ValueError(
            f"haystack clip {str(clip)!r} is neither a video file nor a shipped clip; give the path of a video "
            f"file (mp4, avi, ...) or one of {sorted(REAL_CLIPS)}"
        )
    return path


class RealHaystack:
    """Real footage: the named clips (default :data:`data.video.HAYSTACK_CLIPS`, ~1,600 frames; a clip is the name
    of a shipped clip or the path of any video file, e.g. your own footage) decoded at
    the task's frame size (centre crop + antialiased resize), optionally resampled to ``sample_fps``,
    concatenated in order and looped; a sample is ``L`` consecutive pool frames from a random start.

    The pool is decoded once per process and size (through the deadline-guarded reader) and cached.
    ``backend`` defaults to PyAV: for these whole-clip sequential decodes it is several times faster than
    decord (1,635 frames at 32x32: 4.7 s vs 21 s on a 2-core machine); "auto" or "decord" work too.
    """

    def __init__(
        self,
        clips: Sequence[str | os.PathLike] = HAYSTACK_CLIPS,
        *,
        sample_fps: float | None = None,
        backend: str = "av",
        timeout: float = 300.0,
    ):
        self.clips = tuple(clips)
        if not self.clips:
            raise ValueError("clips must name at least one real clip")
        for name in self.clips:
            _clip_file(name)  # fail now (naming the install command for a shipped clip) if a clip is missing
        self.sample_fps, self.backend, self.timeout = sample_fps, backend, float(timeout)

    def pool(self, size: tuple[int, int]) -> np.ndarray:
        return _real_pool(self.clips, tuple(size), self.sample_fps, self.backend, self.timeout)

    def frames(self, rng: np.random.Generator, length: int, size: tuple[int, int]) -> np.ndarray:
        pool = self.pool(size)
        start = int(rng.integers(len(pool)))
        return pool[(start + np.arange(length)) % len(pool)]  # a fresh array (fancy indexing copies)


def _make_haystack(haystack: Any) -> Any:
    if haystack == "procedural":
        return ProceduralHaystack()
    if haystack == "real":
        return RealHaystack()
    if hasattr(haystack, "frames"):
        return haystack
    if isinstance(haystack, (str, os.PathLike)) and Path(haystack).is_file():
        return RealHaystack((str(haystack),))  # a video file of the user's: its frames, looped
    raise ValueError(
        f"haystack must be 'procedural', 'real', the path of an existing video file or an object with "
        f".frames(rng, length, size), got {haystack!r}"
    )
