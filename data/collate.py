"""DataLoader collators for images of different sizes and point clouds of different lengths.

Each collator returns a dict with the batch and the tokens' :class:`vlpe.Positions`, built on the CPU
inside the DataLoader workers (a ``Positions`` pickles like any tensor container), so a training step
only moves them to the device and never syncs to build positions.

Images, two layouts (``ImageCollator(layout=...)``):

* ``"pad"`` (default): every image is zero-padded at the bottom/right to the largest patch grid of the
  batch, ``hm x wm``; ``images`` is one ``(B, C, hm*p, wm*p)`` tensor. Positions are the regular
  ``hm x wm`` grid for every sample (``grid == (hm, wm)``) and ``valid`` marks, per sample, the patches of
  its own ``h x w`` top-left block. Grid-based encodings (convolutional PEG, LookHere masks) keep working;
  padded patches are masked out by ``valid``.
* ``"packed"``: ``images`` stays a list of ``(C, H, W)`` tensors and positions follow the layout of
  :class:`vlpe.tokenizers.ImageTokenizer` for lists: sample ``i``'s ``h_i * w_i`` tokens in row-major order
  packed at the front, padding at the end (coordinate 0, ``valid`` False), ``grid`` None.

In both layouts a batch whose images all have the same grid gets ``valid=None`` (no padding token) and
``grid=(h, w)``. For batches of a single size altogether, group the indices with
:class:`SizeGroupedBatchSampler`. ``prefix`` tokens (CLS, registers) come first with coordinate 0 and
``valid`` True, as in :class:`vlpe.Positions`.

Points: :class:`PointCollator` pads clouds to the longest with zeros and returns the ``(B, N, 3)`` points,
their ``valid`` mask and ``Positions.points`` of the points (each point a token; prefix tokens first).

Skipped samples: a collator that leaves samples out (unreadable files a dataset returned as ``None``) says how many
in the batch, as the ``"num_skipped"`` key of a dict batch or as a :class:`CountedBatch` (a tuple batch with a
``num_skipped`` attribute); :func:`num_skipped` reads either, and ``train.engine.fit`` adds it to the ``skipped``
count of its train records.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Hashable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Sampler

from vlpe import Positions
from vlpe.tokenizers._common import check_fit, patches_along, to_pair

__all__ = [
    "CountedBatch", "ImageCollator", "PointCollator", "SizeGroupedBatchSampler", "image_positions", "num_skipped"
]


class CountedBatch(tuple):
    """A tuple batch (e.g. ``(images, labels)``) that also carries ``num_skipped``, the samples its collator left
    out. It unpacks, indexes and pickles (DataLoader workers) like the tuple it is; rebuilt from its items alone
    (``type(batch)(items)``, as ``train.data_order.move_to`` does) its count is 0, so read it before moving it."""

    num_skipped: int

    def __new__(cls, items=(), num_skipped: int = 0):
        self = super().__new__(cls, items)
        self.num_skipped = int(num_skipped)
        return self

    def __reduce__(self):
        return (type(self), (tuple(self), self.num_skipped))


def num_skipped(batch) -> int:
    """How many samples the collator of ``batch`` left out: a dict batch's ``"num_skipped"``, a
    :class:`CountedBatch`'s ``num_skipped``, else 0 (what ``train.engine.fit`` counts into its train records)."""
    if isinstance(batch, dict):
        return int(batch.get("num_skipped", 0))
    return int(getattr(batch, "num_skipped", 0))


def _split_sample(sample, who: str) -> tuple[Tensor, int | None]:
    if isinstance(sample, Tensor):
        return sample, None
    if isinstance(sample, (tuple, list)) and len(sample) >= 1 and isinstance(sample[0], Tensor):
        return sample[0], (int(sample[1]) if len(sample) > 1 else None)
    raise ValueError(f"{who}: each sample must be a tensor or a (tensor, label) pair, got {type(sample).__name__}")


def _labels(labels: list[int | None]) -> Tensor | None:
    if all(lbl is None for lbl in labels):
        return None
    if any(lbl is None for lbl in labels):
        raise ValueError("either every sample of a batch has a label or none has")
    return torch.tensor(labels, dtype=torch.int64)


def image_positions(
    sizes: Sequence[tuple[int, int]], *, prefix: int = 0, layout: str = "pad"
) -> Positions:
    """Positions of a batch of patch grids ``sizes`` [(h, w), ...] in the ``"pad"`` or ``"packed"`` layout."""
    if layout not in ("pad", "packed"):
        raise ValueError(f"layout must be 'pad' or 'packed', got {layout!r}")
    if not sizes:
        raise ValueError("image_positions needs at least one (h, w) size")
    B = len(sizes)
    hw = torch.tensor(sizes, dtype=torch.int64).reshape(B, 2)  # (B, 2)
    if bool((hw < 1).any()):
        raise ValueError(f"patch grid sizes must be >= 1, got {list(sizes)}")
    same = bool((hw == hw[0]).all())
    if same:
        h, w = sizes[0]
        base = Positions.grid(int(h), int(w), prefix=prefix)
        coords = base.coords.expand(B, -1, -1).contiguous()  # (B, P + h*w, 2)
        return Positions(coords, prefix=prefix, grid=(int(h), int(w)), axes=("h", "w"))
    if layout == "pad":
        hm, wm = int(hw[:, 0].max()), int(hw[:, 1].max())
        rc = Positions.grid(hm, wm).coords[0].to(torch.int64)  # (hm*wm, 2) row-major (row, col)
        inside = (rc[None, :, 0] < hw[:, None, 0]) & (rc[None, :, 1] < hw[:, None, 1])  # (B, hm*wm)
        coords = rc.float().expand(B, -1, -1)  # (B, hm*wm, 2)
        grid = (hm, wm)
    else:
        n = hw[:, 0] * hw[:, 1]  # (B,)
        N = int(n.max())
        k = torch.arange(N, dtype=torch.int64)  # (N,)
        inside = k[None, :] < n[:, None]  # (B, N)
        row = torch.div(k[None, :], hw[:, 1:2], rounding_mode="floor")  # (B, N)
        col = k[None, :] - row * hw[:, 1:2]  # (B, N)
        coords = torch.stack([row, col], dim=-1).masked_fill(~inside[..., None], 0).float()  # (B, N, 2)
        grid = None
    if prefix:
        coords = torch.cat([coords.new_zeros(B, prefix, 2), coords], dim=1)  # (B, P + N, 2)
        inside = torch.cat([torch.ones(B, prefix, dtype=torch.bool), inside], dim=1)  # (B, P + N)
    return Positions(coords.contiguous(), prefix=prefix, grid=grid, valid=inside, axes=("h", "w"))


class ImageCollator:
    """Collate ``(image (C, H, W), label)`` samples of any sizes; see the module for the two layouts.

    Args:
        patch_size: ``p`` or ``(ph, pw)`` pixels per patch (the model's patch embedding).
        prefix: number of prefix tokens the model prepends (CLS + registers).
        layout: "pad" or "packed".
        fit: how a side that is not a multiple of the patch is handled, as in
            :class:`vlpe.tokenizers.ImageTokenizer`: "raise", "crop" (drop the remainder) or "pad"
            (zero-pad to the next multiple; the partial patch is a valid token).

    Returns a dict: ``images`` (tensor or list), ``labels`` (B,) int64 (if the samples have labels),
    ``sizes`` (B, 2) int64 patch grids, ``positions`` (:class:`vlpe.Positions`).
    """

    def __init__(
        self, *, patch_size: int | Sequence[int] = 16, prefix: int = 0, layout: str = "pad", fit: str = "raise"
    ) -> None:
        self.patch_size = to_pair(patch_size, "patch_size")
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"prefix must be an int >= 0 (number of CLS/register tokens), got {prefix!r}")
        if layout not in ("pad", "packed"):
            raise ValueError(f"layout must be 'pad' or 'packed', got {layout!r}")
        self.prefix, self.layout, self.fit = prefix, layout, check_fit(fit)

    def __call__(self, batch: Sequence) -> dict:
        if not batch:
            raise ValueError("ImageCollator got an empty batch")
        images, labels = zip(*(_split_sample(s, "ImageCollator") for s in batch))
        ph, pw = self.patch_size
        sizes, fitted = [], []
        for i, img in enumerate(images):
            if img.dim() != 3:
                raise ValueError(f"ImageCollator: sample {i} must be a (C, H, W) image, got shape {tuple(img.shape)}")
            if img.shape[0] != images[0].shape[0]:
                raise ValueError(
                    f"ImageCollator: sample {i} has {img.shape[0]} channels, sample 0 has {images[0].shape[0]}"
                )
            H, W = img.shape[-2:]
            h = patches_along(H, ph, self.fit, axis="height", who="ImageCollator")
            w = patches_along(W, pw, self.fit, axis="width", who="ImageCollator")
            if self.fit == "crop":
                img = img[:, : h * ph, : w * pw]
            sizes.append((h, w))
            fitted.append(img)
        pos = image_positions(sizes, prefix=self.prefix, layout=self.layout)
        if self.layout == "pad":
            hm, wm = max(s[0] for s in sizes), max(s[1] for s in sizes)
            out_images: Tensor | list[Tensor] = torch.stack(
                [F.pad(img, (0, wm * pw - img.shape[-1], 0, hm * ph - img.shape[-2])) for img in fitted]
            )  # (B, C, hm*ph, wm*pw)
        else:
            out_images = list(fitted)
        out = {"images": out_images, "sizes": torch.tensor(sizes, dtype=torch.int64), "positions": pos}
        lbl = _labels(list(labels))
        if lbl is not None:
            out["labels"] = lbl
        return out


class PointCollator:
    """Collate ``(points (N_i, 3), label)`` samples, padding with zeros to the longest cloud.

    Returns a dict: ``points`` (B, N, 3) float32, ``valid`` (B, N) bool or None when every cloud has N
    points, ``labels`` (B,) int64 (if the samples have labels), ``positions`` =
    ``Positions.points`` of ``prefix`` zero rows followed by the points (``valid`` with prefix rows True).
    """

    def __init__(self, *, prefix: int = 0) -> None:
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"prefix must be an int >= 0 (number of CLS/register tokens), got {prefix!r}")
        self.prefix = prefix

    def __call__(self, batch: Sequence) -> dict:
        if not batch:
            raise ValueError("PointCollator got an empty batch")
        clouds, labels = zip(*(_split_sample(s, "PointCollator") for s in batch))
        for i, c in enumerate(clouds):
            if c.dim() != 2 or c.shape[0] < 1 or c.shape[1] != clouds[0].shape[1]:
                raise ValueError(
                    f"PointCollator: sample {i} must be (N, A) points with N >= 1 and the same A as sample 0, "
                    f"got shape {tuple(c.shape)}"
                )
        lengths = torch.tensor([c.shape[0] for c in clouds], dtype=torch.int64)  # (B,)
        B, N, A = len(clouds), int(lengths.max()), clouds[0].shape[1]
        points = torch.zeros(B, N, A, dtype=torch.float32)
        for i, c in enumerate(clouds):
            points[i, : c.shape[0]] = c
        padded = bool((lengths != N).any())
        valid = torch.arange(N)[None, :] < lengths[:, None] if padded else None  # (B, N)
        coords = torch.cat([points.new_zeros(B, self.prefix, A), points], dim=1)  # (B, P + N, A)
        tok_valid = None
        if valid is not None:
            tok_valid = torch.cat([torch.ones(B, self.prefix, dtype=torch.bool), valid], dim=1)  # (B, P + N)
        out = {
            "points": points,
            "valid": valid,
            "lengths": lengths,
            "positions": Positions.points(coords, prefix=self.prefix, valid=tok_valid),
        }
        lbl = _labels(list(labels))
        if lbl is not None:
            out["labels"] = lbl
        return out


class SizeGroupedBatchSampler(Sampler[list[int]]):
    """Batches whose samples all share one size key (e.g. the resolution), for grid batches without padding.

    ``keys[i]`` is sample ``i``'s size key. Each epoch shuffles within each size (``shuffle=True``),
    cuts batches of ``batch_size`` and shuffles the batch order; ``set_epoch`` changes the permutation.
    """

    def __init__(
        self, keys: Sequence[Hashable], batch_size: int, *, shuffle: bool = True, drop_last: bool = False, seed: int = 0
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.groups: dict[Hashable, list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            self.groups[k].append(i)
        self.batch_size, self.shuffle, self.drop_last, self.seed, self.epoch = batch_size, shuffle, drop_last, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = []
        for members in self.groups.values():
            idx = np.asarray(members)
            if self.shuffle:
                idx = idx[rng.permutation(len(idx))]
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size].tolist()
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        f = math.floor if self.drop_last else math.ceil
        return sum(f(len(m) / self.batch_size) for m in self.groups.values())
