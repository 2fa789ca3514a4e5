"""The data order of a run: :class:`ResumableBatchSampler` + :class:`SeededDataset` make the batches and every
sample's augmentation functions of (seed, step), so a resumed run sees exactly the batches an uninterrupted run
would; :func:`move_to` puts a batch on the device.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

__all__ = ["ResumableBatchSampler", "SeededDataset", "move_to"]


def _mix(*xs: int) -> int:
    """A stable 63-bit hash of integers (splitmix64 rounds), for per-sample seeds."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class ResumableBatchSampler(Sampler[list[tuple[int, int]]]):
    """Micro-batches of ``(index, sample_seed)`` for one rank, a pure function of (seed, micro step).

    The global sample stream is the concatenation of per-epoch permutations (seeded by ``seed`` and the
    epoch); micro step ``s`` of rank ``r`` takes its slice of global micro step ``s``. Starting at
    ``start`` reproduces exactly what an uninterrupted run yields from that point.
    """

    def __init__(self, n: int, *, micro_batch: int, rank: int, world: int, seed: int, start: int, total: int) -> None:
        if n < 1:
            raise ValueError("the training dataset is empty")
        self.n, self.micro, self.rank, self.world = n, micro_batch, rank, world
        self.seed, self.start, self.total = seed, start, total

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        return torch.randperm(self.n, generator=g)

    def __len__(self) -> int:
        return max(0, self.total - self.start)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        per_step = self.micro * self.world
        cache: dict[int, torch.Tensor] = {}
        for s in range(self.start, self.total):
            first = s * per_step + self.rank * self.micro
            batch = []
            for j in range(first, first + self.micro):
                epoch, i = divmod(j, self.n)
                if epoch not in cache:
                    cache.clear()
                    cache[epoch] = self._perm(epoch)
                batch.append((int(cache[epoch][i]), _mix(self.seed, j)))
            yield batch


class SeededDataset(Dataset):
    """Wraps a dataset so item ``(index, seed)`` is produced with every RNG seeded from ``seed``.

    Random augmentation then depends only on the sample's place in the stream, not on worker count or
    history; the caller's RNG state is restored afterwards.
    """

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        """The items of a whole micro-batch (the ``DataLoader`` asks for them at once): every item is produced
        right after seeding the CPU torch, numpy and Python RNGs from its own seed, and the caller's states are
        saved and restored once per batch rather than once per item (the same items, the same states after).
        Only the CPU generator is seeded (``torch.manual_seed`` would also reseed every accelerator's, at
        ~0.1 ms per call, and ``fork_rng(devices=[])`` restores the CPU one only)."""
        np_state, py_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            try:
                out = []
                for index, seed in items:
                    torch.default_generator.manual_seed(seed)
                    np.random.seed(seed % 2**32)
                    random.seed(seed)
                    out.append(self.base[index])
                return out
            finally:
                np.random.set_state(np_state)
                random.setstate(py_state)


def move_to(batch: Any, device: torch.device) -> Any:
    """Tensors (and objects with ``.to``, e.g. ``vlpe.Positions``) in nested dicts/lists to ``device``."""
    if isinstance(batch, torch.Tensor) or hasattr(batch, "to") and not isinstance(batch, (str, bytes, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch
