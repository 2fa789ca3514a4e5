"""A render cache for Shapes-HR: every sample of a :class:`data.shapes.Shapes` rendered once, read back by every run.

Rendering Shapes-HR on the fly costs every run (and every test size of every evaluation) the same CPU time again;
:func:`cached_shapes` wraps a :class:`~data.shapes.Shapes` so that its images come from one ``.npy`` file instead:

* **Contents.** ``(N, R, R, 3)`` uint8, image ``i`` = ``round(255 * render(spec(i), R))``, i.e. exactly what
  ``Shapes.render(i)`` returns, quantised. A cached image therefore differs from the live render by at most
  ``0.5 / 255`` per value (plus float32 rounding); labels (``i % num_classes``), ``spec`` and ``size_bin`` are
  computed exactly as the uncached dataset computes them (nothing about them is stored). ``transform`` and
  ``mean`` / ``std`` are applied after the read, as :class:`~data.shapes.Shapes` applies them after the render.
* **Location.** ``$VLPE_CACHE`` if set, else ``<repo>/runs/cache/shapes`` (or ``cache_dir=``).
* **Name.** ``shapes-<split>-seed<seed>-<R>px-n<N>-<digest>.npy``: ``<digest>`` is 16 hex digits of the SHA-256
  of :func:`cache_key` (the format version, split, seed, resolution, number of samples and every parameter that
  changes pixels: classes, size range, background names and the bytes of their photo files, supersampling,
  background contrast). ``size_bins``, ``transform`` and ``mean`` / ``std`` do not change the stored pixels and are
  not part of it. Bump ``_FORMAT`` when the renderer changes: every older file is then ignored.
* **Creation.** Lazily, by whichever process first reads an image (so a dataset that is only built, e.g. the
  training set of an evaluation, renders nothing): under an exclusive ``fcntl.flock`` on ``<name>.lock`` the file is
  looked for again (another process may have made it meanwhile), else rendered into a temporary file in the same
  folder and moved into place with ``os.replace``, so a reader never sees a partial file. Concurrent jobs wait for
  the one that renders. (``flock`` needs a local or flock-capable file system.)
* **Reading.** ``np.load(path, mmap_mode="r", allow_pickle=False)``, once per process (a pickled dataset, e.g. in a
  spawned DataLoader worker, carries the path, not the array). A file that cannot be read or has the wrong dtype or
  shape (a truncated file, a foreign file) is never used: it is rendered again, with a ``RuntimeWarning``.

Checked against (``tests/test_shapes_cache.py``): the live :class:`~data.shapes.Shapes` (pixels within
``0.5/255 + 1e-6``, equal labels and size bins), a second read with the renderer patched to raise, a truncated file,
and two spawned processes creating the same file at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np

from ._util import python_package_dir
from .shapes import Shapes
from .shapes_render import BACKGROUNDS

__all__ = ["CachedShapes", "cached_shapes", "cache_key", "cache_path", "default_cache_dir"]

_FORMAT = 1  # the stored layout and renderer version: bump it when either changes (old files are then ignored)
_CACHE_ATTRS = ("cache_dir", "path", "rendered", "_images")
log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$VLPE_CACHE`` if set, else ``<repo>/runs/cache/shapes``."""
    env = os.environ.get("VLPE_CACHE")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "runs" / "cache" / "shapes"


@functools.lru_cache(maxsize=len(BACKGROUNDS))
def _photo_digest(name: str) -> str:
    """SHA-256 (16 hex digits) of a background photo file as installed (a changed photo changes the renders)."""
    path = python_package_dir("skimage", pip_name="scikit-image") / "data" / BACKGROUNDS[name]
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else "missing"


def cache_key(shapes: Shapes) -> dict:
    """Everything the stored pixels of ``shapes`` depend on, as JSON-ready values."""
    return {
        "format": _FORMAT,
        "split": shapes.split,
        "seed": shapes.seed,
        "resolution": shapes.resolution,
        "num_samples": shapes.num_samples,
        "classes": list(shapes.classes),
        "size_range": [float(v) for v in shapes.size_range],
        "backgrounds": [[b, _photo_digest(b)] for b in shapes.backgrounds],
        "supersample": shapes.supersample,
        "background_contrast": float(shapes.background_contrast),
        **({"rotation": shapes.rotation} if shapes.rotation != math.pi else {}),  # absent: any orientation
    }


def cache_path(shapes: Shapes, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache file of ``shapes``: ``<cache_dir>/shapes-<split>-seed<seed>-<R>px-n<N>-<digest>.npy``."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(json.dumps(cache_key(shapes), sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"shapes-{shapes.split}-seed{shapes.seed}-{shapes.resolution}px-n{shapes.num_samples}-{digest}.npy"


def _open(path: Path, shape: tuple[int, ...]) -> tuple[np.ndarray | None, str | None]:
    """``(array, None)`` for a usable file, ``(None, None)`` for no file, ``(None, why)`` for an unusable one."""
    if not path.exists():
        return None, None
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as err:  # truncated header or data, not an .npy file, ...
        return None, f"unreadable: {type(err).__name__}: {err}"
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.shape != shape:
        found = f"{getattr(arr, 'dtype', type(arr).__name__)} {getattr(arr, 'shape', '')}"
        return None, f"holds {found}, expected uint8 {shape}"
    return arr, None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing, never deleted: deleting it would race)."""
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write(live: Shapes, path: Path) -> None:
    """Render every sample of ``live`` into ``path`` atomically (a temporary file, then ``os.replace``)."""
    n, r = live.num_samples, live.resolution
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    log.info("rendering the Shapes-HR cache %s (%d images at %d px)", path, n, r)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(n, r, r, 3))  # (N, R, R, 3)
        for i in range(n):
            img = live.render(i)  # (R, R, 3) float32 in [0, 1]
            out[i] = np.rint(np.clip(img, 0.0, 1.0) * 255.0).astype(np.uint8)
        out.flush()
        del out
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CachedShapes(Shapes):
    """A :class:`~data.shapes.Shapes` whose images are read from its render cache (see the module docstring).

    Same length, labels, ``spec``, ``size_bin``, ``transform`` and normalisation as the ``Shapes`` it wraps; images
    within ``0.5/255`` of the live render (uint8 quantisation). Build it with :func:`cached_shapes`.

    Attributes:
        path: the cache file.
        rendered: whether this object rendered the file (False when it was found, or not needed yet).
    """

    def __init__(self, *, base: Shapes, cache_dir: str | os.PathLike | None = None) -> None:
        if isinstance(base, CachedShapes):
            base = base.uncached()
        if not isinstance(base, Shapes):
            raise TypeError(f"base must be a data.shapes.Shapes, got {type(base).__name__}")
        self.__dict__.update(base.__dict__)  # already validated by Shapes.__init__
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.path = cache_path(base, cache_dir=self.cache_dir)
        self.rendered = False
        self._images: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}  # workers reopen the file rather than receive its pixels

    def uncached(self) -> Shapes:
        """The live :class:`~data.shapes.Shapes` this reads the renders of."""
        live = object.__new__(Shapes)
        live.__dict__.update({k: v for k, v in self.__dict__.items() if k not in _CACHE_ATTRS})
        return live

    def at(self, resolution: int) -> "CachedShapes":
        """The same samples at another resolution, from that resolution's cache file."""
        return CachedShapes(base=self.uncached().at(resolution), cache_dir=self.cache_dir)

    def images(self) -> np.ndarray:
        """All images, ``(N, R, R, 3)`` uint8, memory-mapped read-only (the file is made first if missing)."""
        if self._images is None:
            self._images = self._ensure()
        return self._images

    def _ensure(self) -> np.ndarray:
        shape = (self.num_samples, self.resolution, self.resolution, 3)
        arr, _ = _open(self.path, shape)
        if arr is not None:
            return arr
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path.with_name(self.path.name + ".lock")):
            arr, problem = _open(self.path, shape)  # another process may have made it while this one waited
            if arr is not None:
                return arr
            if problem is not None:
                warnings.warn(
                    f"the Shapes-HR cache file {self.path} is unusable ({problem}); rendering it again",
                    RuntimeWarning,
                    stacklevel=3,
                )
            _write(self.uncached(), self.path)
            self.rendered = True
            arr, problem = _open(self.path, shape)
        if arr is None:
            raise OSError(f"the Shapes-HR cache file {self.path} just written cannot be read back: {problem}")
        return arr

    def render(self, index: int, resolution: int | None = None) -> np.ndarray:
        """The ``(R, R, 3)`` float32 image of sample ``index``: from the cache at this dataset's resolution
        (``uint8 / 255``), a live render at any other ``resolution``."""
        if resolution is not None and resolution != self.resolution:
            return self.uncached().render(index, resolution)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return np.asarray(self.images()[index], dtype=np.float32) / np.float32(255.0)  # (R, R, 3)


def cached_shapes(shapes: Shapes, *, cache_dir: str | os.PathLike | None = None) -> CachedShapes:
    """``shapes`` reading its images from the render cache (made by the first process that reads an image).

    Equal to ``shapes`` up to the uint8 quantisation of the images (at most ``0.5/255`` per value); labels and
    ``size_bin`` are exactly those of ``shapes``. ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    return CachedShapes(base=shapes, cache_dir=cache_dir)
