"""What a ViT run is made of: its config (``configs/vit_*.yaml``), the datasets it names and how they batch.

Read by ``train/vit.py`` (which trains it) and by the evaluations of its exports (``eval/resolution.py``); the model
a config describes is :func:`models.vit.vit_from_config`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.utils.data import Dataset, Subset

from train.config import ConfigError
from train.engine import TrainSection

__all__ = ["ModelSection", "DataSection", "ViTConfig", "build_datasets", "collate"]


@dataclass(kw_only=True)
class ModelSection:
    preset: str = "micro"
    patch_size: int = 4
    embed_dim: int | None = None
    depth: int | None = None
    num_heads: int | None = None
    mlp_ratio: float = 4.0
    encoding: str = "rope"
    encoding_options: dict = field(default_factory=dict)
    readout: Literal["cls", "gap"] = "cls"
    num_registers: int = 0
    drop_path_rate: float = 0.0
    layer_scale: float | None = None
    backend: Literal["sdpa", "eager", "flex"] = "sdpa"
    label_smoothing: float = 0.0


@dataclass(kw_only=True)
class DataSection:
    dataset: Literal["fashion_mnist", "mnist5k", "digits", "shapes", "folder"] = "fashion_mnist"
    root: str | None = None  # for "folder"
    img_size: int = 28  # training resolution
    channels: int = 1
    train_limit: int | None = None  # use the first N training images (None: all); applied after holdout
    val_limit: int | None = 2000  # use the first N validation images (also of the test split evaluation reads)
    holdout: int = 0  # >0: the LAST N training images are the validation set (no augmentation) and never trained on
    augment: bool = False
    shapes_train: int = 20000  # procedural shapes: samples per split
    shapes_val: int = 2000  # the 'val' split: the validation set when holdout = 0
    shapes_test: int = 10000  # the 'test' split: what evaluation reads
    shapes_cache: bool = False  # read Shapes-HR renders from the cache of data/shapes_cache.py ($VLPE_CACHE)
    shapes_size: list[float] = field(default_factory=lambda: [0.15, 0.6])  # Shapes-HR: [min, max] shape diameter,
    # as fractions of the image side
    shapes_backgrounds: list[str] | None = None  # Shapes-HR background photos (None: all of data.shapes.BACKGROUNDS)
    shapes_rotation: float = 180.0  # Shapes-HR: each shape turns by up to +-this many degrees (180: any; 0: upright)

    def __post_init__(self) -> None:
        for name in ("train_limit", "val_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"data.{name} must be >= 1 images (or null for all), got {value}")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int) or self.holdout < 0:
            raise ConfigError(
                f"data.holdout must be an integer >= 0 (the number of training images held out for validation; "
                f"0 validates on the test split), got {self.holdout!r}"
            )
        for name in ("shapes_train", "shapes_val", "shapes_test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{name} must be an integer >= 1 (samples of that Shapes split), got {value!r}")
        size = self.shapes_size
        if (
            not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in size)
            or not 0 < size[0] <= size[1] <= 1
        ):  # fmt: skip
            raise ConfigError(
                f"data.shapes_size must be [min, max] shape diameters as fractions of the image side with "
                f"0 < min <= max <= 1, e.g. [0.15, 0.6], got {size!r}"
            )
        self.shapes_size = [float(size[0]), float(size[1])]
        turn = self.shapes_rotation
        if isinstance(turn, bool) or not isinstance(turn, (int, float)) or not 0 <= turn <= 180:
            raise ConfigError(
                f"data.shapes_rotation must be a number of degrees in [0, 180] (180: any orientation, 0: upright), "
                f"got {turn!r}"
            )


@dataclass(kw_only=True)
class ViTConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: dict = field(default_factory=dict)


def _without_transform(ds: Dataset) -> Dataset:
    """``ds`` without its training transform (a shallow copy; an ImageFolder gets its own skip record)."""
    if getattr(ds, "transform", None) is None:
        return ds
    plain = copy.copy(ds)
    plain.transform = None  # type: ignore[attr-defined]
    if isinstance(getattr(plain, "skipped", None), dict):
        plain.skipped = {}  # type: ignore[attr-defined]
    return plain


def _warn_if_classes_split(train: Dataset, held: int, dataset: str) -> None:
    """Warn when the held-out tail leaves a class without training images, or misses a class of which it should hold
    at least 3 images at the split's class frequencies: the holdout is the tail of the split's own order, not a
    stratified draw, and a class-sorted split (MNIST-5k, class folders) then validates on a few classes only."""
    import warnings

    import numpy as np

    labels = getattr(train, "labels", None)
    if labels is None:  # Shapes: label i % num_classes, every class in both parts once held >= num_classes
        return
    labels = np.asarray(labels)
    counts = np.bincount(labels)
    kept = np.bincount(labels[: len(labels) - held], minlength=len(counts))  # (classes,)
    tail = np.bincount(labels[len(labels) - held :], minlength=len(counts))  # (classes,)
    lost = np.flatnonzero((counts > 0) & (kept == 0)).tolist()
    missing = np.flatnonzero((tail == 0) & (counts * held / len(labels) >= 3)).tolist()
    if lost or missing:
        what = [f"misses classes {missing}"] * bool(missing)
        what += [f"leaves classes {lost} without a training image"] * bool(lost)
        warnings.warn(
            f"data.holdout={held} on {dataset}: the held-out tail of the training split (its own order, not a "
            f"stratified draw) {' and '.join(what)}; the split is ordered by class, so this validation set is not "
            f"representative",
            RuntimeWarning,
            stacklevel=3,
        )


def build_datasets(
    data: DataSection, *, size: int | None = None, split: Literal["val", "test"] = "val"
) -> tuple[Dataset, Dataset, int]:
    """``(train, val, num_classes)`` at resolution ``size`` (default: the training resolution); with
    ``split="test"`` the second set is the dataset's test split instead (what evaluation reads).

    Validation set (``split="val"``): with ``data.holdout = n > 0`` the last ``n`` images of the training split, at
    ``size`` and without the training transform, which training then leaves out (``train_limit`` applies to the
    remaining images); with 0 the test split (Fashion-MNIST, MNIST-5k, digits), the ``val/`` folder, or for Shapes
    the ``'val'`` split of ``shapes_val`` samples. Test set (``split="test"``): the test split, the ``val/`` folder
    (with the training folder's class list), or ``Shapes(split="test", num_samples=shapes_test)``; it never
    depends on ``holdout``. ``val_limit`` keeps the first images of whichever set is second. With
    ``data.shapes_cache`` every Shapes set reads its renders from :mod:`data.shapes_cache` (uint8 renders, within
    0.5/255 of the live ones; made once, by the first process that reads them).

    Checked against (``tests/test_vit_holdout.py``): the uncut training split (the held-out images are its last
    ``n``, disjoint from the training indices), the behaviour of ``holdout = 0`` before the field existed, and the
    test split at the evaluation offsets.
    """
    from data import images as imgs
    from data import transforms

    if split not in ("val", "test"):
        raise ValueError(f"split must be 'val' or 'test', got {split!r}")
    size = data.img_size if size is None else size
    common = dict(size=size, channels=data.channels)
    train_tf = transforms.train_transform(size) if data.augment else None
    if data.dataset in ("fashion_mnist", "mnist5k", "digits"):
        cls = {"fashion_mnist": imgs.FashionMNIST, "mnist5k": imgs.MNIST5k, "digits": imgs.Digits}[data.dataset]
        train = cls("train", transform=train_tf, **common)
        val = cls("test", **common) if split == "test" or not data.holdout else None
    elif data.dataset == "shapes":
        from data.shapes import Shapes

        if data.channels != 3:
            raise ConfigError(f"data.dataset=shapes renders RGB images: set data.channels=3 (got {data.channels})")
        drawn: dict = dict(resolution=size, size_range=tuple(data.shapes_size))
        if data.shapes_rotation != 180:
            drawn["rotation"] = math.radians(data.shapes_rotation)
        if data.shapes_backgrounds is not None:
            drawn["backgrounds"] = tuple(data.shapes_backgrounds)
        train = Shapes(num_samples=data.shapes_train, split="train", **drawn)
        val = (
            Shapes(num_samples=data.shapes_test, split="test", **drawn) if split == "test"
            else None if data.holdout
            else Shapes(num_samples=data.shapes_val, split="val", **drawn)
        )  # fmt: skip
        if data.shapes_cache:
            from data.shapes_cache import cached_shapes

            train = cached_shapes(train)
            val = None if val is None else cached_shapes(val)
    else:
        if data.root is None:
            raise ConfigError("data.dataset=folder needs data.root (a folder with train/ and val/ class folders)")
        train = imgs.ImageFolder(f"{data.root}/train", transform=train_tf, **common)
        if split == "test":
            val = imgs.ImageFolder(f"{data.root}/val", classes=train.classes, **common)
        else:
            val = None if data.holdout else imgs.ImageFolder(f"{data.root}/val", **common)
    num_classes = len(getattr(train, "classes", ())) or int(getattr(train, "num_classes"))
    n, held = len(train), data.holdout  # type: ignore[arg-type]
    if held >= n:
        raise ConfigError(
            f"data.holdout={held} must be smaller than the {n} images of the {data.dataset} training split "
            f"(the last holdout images validate, the rest train)"
        )
    if held:
        if split == "val":
            _warn_if_classes_split(train, held, data.dataset)
        keep = n - held if data.train_limit is None else min(data.train_limit, n - held)
        if val is None:  # the held-out tail, without the training transform; val_limit keeps its first images
            shown = held if data.val_limit is None else min(data.val_limit, held)
            val = Subset(_without_transform(train), range(n - held, n - held + shown))
        elif data.val_limit is not None:  # the test split
            val = Subset(val, range(min(data.val_limit, len(val))))
        train = Subset(train, range(keep))
        return train, val, num_classes
    if data.train_limit is not None:
        train = Subset(train, range(min(data.train_limit, len(train))))
    if data.val_limit is not None:
        val = Subset(val, range(min(data.val_limit, len(val))))
    return train, val, num_classes


def collate(items, *, stand_in: tuple[int, int, int] | None = None):
    """``(images, labels)`` as a :class:`data.collate.CountedBatch`: stacked when all images share a size, else a
    list; images an ImageFolder could not decode (``None``, already warned about) are dropped and counted in its
    ``num_skipped`` (``train.engine.fit`` adds it to the ``skipped`` count of its train records).

    A batch whose every image failed still has to go through the model on every rank (DeepSpeed's collectives
    and ZeRO-3's gathers need all ranks in step): with ``stand_in=(C, H, W)`` it becomes one zero image of that
    shape and no label, which :class:`train.tasks.Classifier` turns into a zero loss that touches every parameter
    (zero gradients; the optimizer still steps, so its moments decay and weight decay applies) and
    :func:`train.tasks.evaluate_classification` scores as nothing. Without ``stand_in`` such a batch is a
    ``ValueError``.
    """
    from data.collate import CountedBatch

    kept = [(x, y) for x, y in items if x is not None]
    dropped = len(items) - len(kept)
    if not kept:
        if stand_in is None:
            raise ValueError(
                f"every image of this batch of {len(items)} failed to decode (see the warnings); fix the data, or "
                f"collate with stand_in=(C, H, W) to train through such batches with a zero loss"
            )
        return CountedBatch((torch.zeros(1, *stand_in), torch.zeros(0, dtype=torch.long)), num_skipped=dropped)
    images = [x for x, _ in kept]
    labels = torch.tensor([y for _, y in kept], dtype=torch.long)
    same = all(im.shape == images[0].shape for im in images)
    return CountedBatch(((torch.stack(images) if same else images), labels), num_skipped=dropped)
