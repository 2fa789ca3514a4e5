"""Video datasets: lazy and picklable; corrupt files are skipped, warned about, and counted."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from .decode import BACKENDS, VideoDecodeError, _check_sampling, _normalize_size, _require
from .server import read_video

__all__ = ["VideoDataset", "VideoLoader", "LoaderStats", "collate_clips"]


class VideoDataset:
    """Map-style dataset of video files; each item is read (in the calling worker) with :func:`read_video`.

    An item is a dict: ``frames`` uint8 tensor (T, H, W, 3), ``timestamps`` float64 tensor (T,) in seconds,
    ``indices`` int64 tensor (T,), ``fps``, ``path``, ``backend``. A file that cannot be decoded gives
    ``{"skipped": True, "path": ..., "error": ...}`` after a warning; :func:`collate_clips` drops it and
    :class:`VideoLoader` counts it.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        num_frames: int | None = None,
        fps: float | None = None,
        indices: Sequence[int] | None = None,
        size: int | Sequence[int] | None = None,
        backend: str = "auto",
        timeout: float | None = 60.0,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        _check_sampling(num_frames, fps, indices)
        self.paths = [os.fspath(p) for p in paths]
        self.options = dict(num_frames=num_frames, fps=fps, indices=indices, size=_normalize_size(size))
        self.options.update(backend=backend, timeout=timeout)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        torch = _require("torch")
        path = self.paths[i]
        try:
            clip = read_video(path, **self.options)
        except VideoDecodeError as err:
            warnings.warn(f"skipping video {path}: {err.reason}", RuntimeWarning, stacklevel=2)
            return {"skipped": True, "path": path, "error": err.reason}
        return {
            "frames": torch.from_numpy(clip.frames),
            "timestamps": torch.from_numpy(clip.timestamps),
            "indices": torch.from_numpy(clip.indices),
            "fps": clip.fps,
            "path": path,
            "backend": clip.backend,
        }


def collate_clips(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch VideoDataset items: drop skipped ones (listed under ``skipped``), stack equal-shaped clips.

    ``frames`` / ``timestamps`` are stacked (B, T, H, W, 3) / (B, T) when all clips have the same shape,
    else left as lists.
    """
    torch = _require("torch")
    kept = [s for s in samples if not s.get("skipped")]
    batch: dict[str, Any] = {
        "skipped": [(s["path"], s["error"]) for s in samples if s.get("skipped")],
        "path": [s["path"] for s in kept],
        "fps": [s["fps"] for s in kept],
        "backend": [s["backend"] for s in kept],
    }
    for key in ("frames", "timestamps", "indices"):
        items = [s[key] for s in kept]
        same = len({tuple(x.shape) for x in items}) == 1
        batch[key] = torch.stack(items) if items and same else items
    return batch


@dataclass
class LoaderStats:
    """What a :class:`VideoLoader` has seen so far (counted in the main process, across all workers)."""

    loaded: int = 0
    skipped: int = 0
    errors: dict[str, str] = field(default_factory=dict)

    def update(self, batch: dict[str, Any]) -> None:
        self.loaded += len(batch["path"])
        self.skipped += len(batch["skipped"])
        self.errors.update(dict(batch["skipped"]))


class VideoLoader:
    """A torch DataLoader over a :class:`VideoDataset` that skips undecodable videos and counts them.

    ``stats`` (a :class:`LoaderStats`) accumulates over iterations; batches whose every video was skipped
    are not yielded. Keyword arguments go to ``torch.utils.data.DataLoader``. With ``num_workers > 0`` the
    workers start from a fork server (override with ``multiprocessing_context``): a plain fork copies the
    parent's FFmpeg and decord thread pools mid-state, and a worker that frees such an object deadlocks.
    """

    def __init__(self, dataset: VideoDataset, **loader_kwargs: Any):
        torch = _require("torch")
        loader_kwargs.setdefault("collate_fn", collate_clips)
        if loader_kwargs.get("num_workers", 0) > 0 and "forkserver" in torch.multiprocessing.get_all_start_methods():
            loader_kwargs.setdefault("multiprocessing_context", "forkserver")
        self.loader = torch.utils.data.DataLoader(dataset, **loader_kwargs)
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            self.stats.update(batch)
            if batch["path"]:
                yield batch
