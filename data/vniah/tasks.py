"""The tasks: V-NIAH and V-NIAH-D (:class:`VNIAH`), V-RULER-style :class:`VCounting` and :class:`VOrdering`,
and their helpers (vocabulary, collation, writing a sample to mp4); see :mod:`data.vniah` for the protocol."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .._util import sample_rng
from ..video import write_video
from .sources import (
    DISTRACTOR_RGB,
    FASHION_ANSWERS,
    NEEDLE_RGB,
    NUMBER_WORDS,
    PHOTO_NEEDLES,
    QUESTIONS,
    NeedlePool,
    _make_haystack,
    _paint,
)

__all__ = ["VNIAH", "VCounting", "VOrdering", "vocabulary", "needle_depth_index", "collate_tasks", "write_sample"]


def needle_depth_index(depth: float, length: int, span: int = 1) -> int:
    """First frame of a ``span``-frame needle at ``depth`` in a ``length``-frame video:
    ``round(depth * (length - span))``."""
    if not (isinstance(depth, (int, float, np.floating)) and 0.0 <= float(depth) <= 1.0):
        raise ValueError(f"needle depth must be a number in [0, 1], got {depth!r}")
    if length < span:
        raise ValueError(f"length {length} is shorter than the needle span ({span} frames); use length >= {span}")
    return int(round(float(depth) * (length - span)))


def _int_list(name: str, values: Sequence[int], minimum: int) -> tuple[int, ...]:
    out = tuple(int(v) for v in values)
    if not out or any(v < minimum or v != w for v, w in zip(out, values)):
        raise ValueError(f"{name} must be a non-empty list of integers >= {minimum}, got {list(values)!r}")
    return out


class _Task(Dataset):
    """Shared machinery: grid indexing, haystack, needle drawing and painting, sample assembly."""

    task = "needle"

    def __init__(
        self,
        *,
        lengths: Sequence[int],
        samples_per_cell: int,
        size: int | Sequence[int],
        haystack: Any,
        needles: str,
        split: str,
        needle_size: int | None,
        needle_span: int,
        fps: float,
        seed: int,
        min_length: int,
    ):
        self.size = (int(size), int(size)) if isinstance(size, (int, np.integer)) else tuple(int(s) for s in size)
        if len(self.size) != 2 or min(self.size) < 1:
            raise ValueError(f"size must be an int or (height, width), got {size!r}")
        self.needle_span = _int_list("needle_span", [needle_span], 1)[0]
        self.lengths = _int_list("lengths", lengths, 1)
        too_short = [L for L in self.lengths if L < min_length]
        if too_short:
            raise ValueError(
                f"lengths {too_short} are shorter than the needle span this task needs ({min_length} frames); "
                f"use lengths >= {min_length}"
            )
        self.samples_per_cell = _int_list("samples_per_cell", [samples_per_cell], 1)[0]
        self.needle_size = min(self.size) if needle_size is None else int(needle_size)
        if not 1 <= self.needle_size <= min(self.size):
            raise ValueError(f"needle_size must be in [1, {min(self.size)}] for {self.size} frames, got {needle_size}")
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.fps, self.seed = float(fps), int(seed)
        self.needles = NeedlePool(needles, split=split)
        self.haystack = _make_haystack(haystack)

    # grid -----------------------------------------------------------------------------------------------
    def _cell_params(self) -> list[dict[str, Any]]:
        return [{"length": L} for L in self.lengths]

    @property
    def cells(self) -> list[dict[str, Any]]:
        """The grid cells in index order; item ``i`` belongs to cell ``i // samples_per_cell``."""
        return self._cell_params()

    def __len__(self) -> int:
        return len(self.cells) * self.samples_per_cell

    def _cell(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        return self.cells[index // self.samples_per_cell]

    @property
    def answers(self) -> tuple[str, ...]:
        return self.needles.answers

    # drawing --------------------------------------------------------------------------------------------
    def _place(self, rng: np.random.Generator) -> tuple[int, int]:
        H, W = self.size
        s = self.needle_size
        return int(rng.integers(0, H - s + 1)), int(rng.integers(0, W - s + 1))

    def _paint_span(self, frames: np.ndarray, start: int, item: int, rgb: Sequence[int], box: tuple[int, int]) -> None:
        gray = self.needles.image(item, self.needle_size)
        for t in range(start, start + self.needle_span):
            _paint(frames[t], gray, rgb, *box)

    def _random_starts(self, rng: np.random.Generator, length: int, k: int) -> list[int]:
        """k non-overlapping span starts, uniformly over all such placements, increasing."""
        free = length - k * (self.needle_span - 1)
        c = np.sort(rng.choice(free, size=k, replace=False))
        return [int(v) + i * (self.needle_span - 1) for i, v in enumerate(c)]

    def _base(self, index: int, length: int) -> tuple[dict[str, Any], np.ndarray]:
        frames = np.array(self.haystack.frames(sample_rng(self.seed, index, 0), length, self.size), dtype=np.uint8)
        sample = {
            "task": self.task,
            "index": index,
            "length": length,
            "depth": float("nan"),
            "needle_indices": [],
            "needle_answers": [],
            "needle_items": [],
            "needle_boxes": [],
            "distractor_indices": [],
            "distractor_answers": [],
            "distractor_items": [],
            "distractor_boxes": [],
        }
        return sample, frames

    def _finish(self, sample: dict[str, Any], frames: np.ndarray, question: str, answer: str) -> dict[str, Any]:
        video = torch.from_numpy(frames)  # (L, H, W, 3) uint8
        ts = torch.arange(frames.shape[0], dtype=torch.float64) / self.fps  # (L,) seconds
        sample.update(
            frames=video,
            timestamps=ts,
            question=question,
            answer=answer,
            needle_index=sample["needle_indices"][0] if sample["needle_indices"] else -1,
            segments=[("video", video, ts), ("text", question), ("answer", answer)],
        )
        return sample

    def _add(self, sample: dict[str, Any], frames: np.ndarray, kind: str, start: int, item: int, cls: int, rng) -> None:
        box = self._place(rng)
        self._paint_span(frames, start, item, NEEDLE_RGB if kind == "needle" else DISTRACTOR_RGB, box)
        sample[f"{kind}_indices"].append(start)
        sample[f"{kind}_answers"].append(self.needles.answers[cls])
        sample[f"{kind}_items"].append(item)
        sample[f"{kind}_boxes"].append(box)


class VNIAH(_Task):
    """V-NIAH over ``lengths x depths`` (``samples_per_cell`` needles per cell), optionally with distractors.

    ``distractors``: None (V-NIAH), ``"single"`` (V-NIAH-D: one at ``+-delta`` frames from the needle, side
    drawn with p = 0.5, forced near an edge, omitted if neither side fits) or ``"periodic"`` (one at every
    ``needle +- k * period`` that fits). Distractors are blue items of a class other than the needle's.
    ``needle_span`` consecutive frames carry the needle. Item ``i`` is a dict (see :meth:`__getitem__`).
    """

    def __init__(
        self,
        *,
        lengths: Sequence[int] = (16, 32, 64),
        depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        samples_per_cell: int = 5,
        size: int | Sequence[int] = 32,
        haystack: Any = "procedural",
        needles: str = "fashion_mnist",
        split: str = "test",
        needle_size: int | None = None,
        needle_span: int = 1,
        distractors: str | None = None,
        delta: int = 8,
        period: int | None = None,
        fps: float = 2.0,
        seed: int = 0,
    ):
        self.depths = tuple(depths)
        if not self.depths:
            raise ValueError("depths must be a non-empty list of numbers in [0, 1]")
        for d in self.depths:
            needle_depth_index(d, max(int(needle_span), 1), int(needle_span))  # validates the range
        if distractors not in (None, "single", "periodic"):
            raise ValueError(f"distractors must be None, 'single' or 'periodic', got {distractors!r}")
        span = int(needle_span)
        if distractors == "single" and not (isinstance(delta, (int, np.integer)) and delta >= span):
            raise ValueError(f"delta must be an integer >= needle_span ({span}) frames, got {delta!r}")
        if distractors == "periodic" and not (isinstance(period, (int, np.integer)) and period >= span):
            raise ValueError(
                f"periodic distractors need period= an integer >= needle_span ({span}) frames, got {period!r}"
            )
        self.distractors, self.delta, self.period = distractors, int(delta), None if period is None else int(period)
        self.task = {None: "v_niah", "single": "v_niah_d", "periodic": "v_niah_d_periodic"}[distractors]
        super().__init__(
            lengths=lengths, samples_per_cell=samples_per_cell, size=size, haystack=haystack, needles=needles,
            split=split, needle_size=needle_size, needle_span=span, fps=fps, seed=seed, min_length=span,
        )  # fmt: skip
        if self.needles.num_classes < 2 and distractors is not None:
            raise ValueError("distractors need at least two needle classes")

    def _cell_params(self) -> list[dict[str, Any]]:
        return [{"length": L, "depth": float(d)} for L in self.lengths for d in self.depths]

    def _distractor_starts(self, rng: np.random.Generator, start: int, length: int) -> list[int]:
        span = self.needle_span
        fits = lambda s: 0 <= s and s + span <= length  # noqa: E731
        if self.distractors == "single":
            sides = [start - self.delta, start + self.delta]
            if rng.random() < 0.5:
                sides.reverse()
            return [s for s in sides if fits(s)][:1]
        if self.distractors == "periodic":
            out = []
            for sign in (-1, 1):
                k = 1
                while fits(start + sign * k * self.period):
                    out.append(start + sign * k * self.period)
                    k += 1
            return sorted(out)
        return []

    def __getitem__(self, index: int) -> dict[str, Any]:
        """A sample: ``frames`` uint8 (L, H, W, 3), ``timestamps`` float64 (L,) seconds, ``question``,
        ``answer``, ``needle_index`` (first needle frame), ``needle_indices``/``_answers``/``_items``/``_boxes``
        (box = (y0, x0) of the ``needle_size`` square), the same for ``distractor_*``, ``length``, ``depth``,
        ``task``, ``label`` (class id of the answer) and ``segments`` for :mod:`data.vlm_collate`."""
        cell = self._cell(index)
        sample, frames = self._base(index, cell["length"])
        L, d = cell["length"], cell["depth"]
        start = needle_depth_index(d, L, self.needle_span)
        rng_needle, rng_distractor = sample_rng(self.seed, index, 1), sample_rng(self.seed, index, 2)
        item, cls = self.needles.draw(rng_needle)
        for s in self._distractor_starts(rng_distractor, start, L):
            d_item, d_cls = self.needles.draw(rng_distractor, exclude=[cls])
            self._add(sample, frames, "distractor", s, d_item, d_cls, rng_distractor)
        self._add(sample, frames, "needle", start, item, cls, rng_needle)
        sample.update(depth=d, label=cls)
        return self._finish(sample, frames, QUESTIONS["needle"], self.needles.answers[cls])


class VCounting(_Task):
    """V-RULER-style counting: ``1..max_count`` red items at random frames; the answer is the count as a word
    (``"three"``). Optional blue distractors (``num_distractors``) must not be counted."""

    task = "counting"

    def __init__(
        self,
        *,
        lengths: Sequence[int] = (16, 32, 64),
        samples_per_cell: int = 10,
        min_count: int = 1,
        max_count: int = 5,
        num_distractors: int = 0,
        size: int | Sequence[int] = 32,
        haystack: Any = "procedural",
        needles: str = "fashion_mnist",
        split: str = "test",
        needle_size: int | None = None,
        needle_span: int = 1,
        fps: float = 2.0,
        seed: int = 0,
    ):
        if not 1 <= int(min_count) <= int(max_count) < len(NUMBER_WORDS):
            raise ValueError(
                f"need 1 <= min_count <= max_count <= {len(NUMBER_WORDS) - 1}, got {min_count}, {max_count}"
            )
        if int(num_distractors) < 0:
            raise ValueError(f"num_distractors must be >= 0, got {num_distractors}")
        self.min_count, self.max_count, self.num_distractors = int(min_count), int(max_count), int(num_distractors)
        super().__init__(
            lengths=lengths, samples_per_cell=samples_per_cell, size=size, haystack=haystack, needles=needles,
            split=split, needle_size=needle_size, needle_span=needle_span, fps=fps, seed=seed,
            min_length=(self.max_count + self.num_distractors) * int(needle_span),
        )  # fmt: skip

    def __getitem__(self, index: int) -> dict[str, Any]:
        L = self._cell(index)["length"]
        sample, frames = self._base(index, L)
        rng = sample_rng(self.seed, index, 1)
        count = int(rng.integers(self.min_count, self.max_count + 1))
        starts = self._random_starts(rng, L, count + self.num_distractors)
        kinds = np.array(["needle"] * count + ["distractor"] * self.num_distractors)[rng.permutation(len(starts))]
        for s, kind in zip(starts, kinds):
            item, cls = self.needles.draw(rng)
            self._add(sample, frames, str(kind), s, item, cls, rng)
        sample.update(label=count)
        return self._finish(sample, frames, QUESTIONS["counting"], NUMBER_WORDS[count])


class VOrdering(_Task):
    """V-RULER-style ordering: ``num_items`` red items of distinct classes at random increasing frames; the
    answer lists their classes in temporal order (``"coat bag sneaker"``)."""

    task = "ordering"

    def __init__(
        self,
        *,
        lengths: Sequence[int] = (16, 32, 64),
        samples_per_cell: int = 10,
        num_items: int = 3,
        size: int | Sequence[int] = 32,
        haystack: Any = "procedural",
        needles: str = "fashion_mnist",
        split: str = "test",
        needle_size: int | None = None,
        needle_span: int = 1,
        fps: float = 2.0,
        seed: int = 0,
    ):
        if int(num_items) < 2:
            raise ValueError(f"num_items must be >= 2 for an ordering, got {num_items}")
        self.num_items = int(num_items)
        super().__init__(
            lengths=lengths, samples_per_cell=samples_per_cell, size=size, haystack=haystack, needles=needles,
            split=split, needle_size=needle_size, needle_span=needle_span, fps=fps, seed=seed,
            min_length=self.num_items * int(needle_span),
        )  # fmt: skip
        if self.num_items > self.needles.num_classes:
            raise ValueError(f"num_items must be <= {self.needles.num_classes} distinct classes, got {num_items}")

    def __getitem__(self, index: int) -> dict[str, Any]:
        L = self._cell(index)["length"]
        sample, frames = self._base(index, L)
        rng = sample_rng(self.seed, index, 1)
        classes = rng.choice(self.needles.num_classes, size=self.num_items, replace=False)
        for s, c in zip(self._random_starts(rng, L, self.num_items), classes):
            item, cls = self.needles.draw(rng, classes=[int(c)])
            self._add(sample, frames, "needle", s, item, cls, rng)
        sample.update(label=[int(c) for c in classes])
        return self._finish(sample, frames, QUESTIONS["ordering"], " ".join(sample["needle_answers"]))


def vocabulary(needles: str = "fashion_mnist") -> list[str]:
    """Every text the tasks produce (questions, answers, counts), for building the word-level tokenizer."""
    answers = FASHION_ANSWERS if needles == "fashion_mnist" else tuple(PHOTO_NEEDLES.values())
    return [*QUESTIONS.values(), *answers, *NUMBER_WORDS]


def collate_tasks(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch task samples for non-VLM models: frames / timestamps stacked when all lengths match (else
    lists), ``label`` as a tensor when every label is an int; every other field as a list."""
    batch: dict[str, Any] = {}
    for key in samples[0]:
        if key == "segments":
            continue
        values = [s[key] for s in samples]
        if key in ("frames", "timestamps") and len({tuple(v.shape) for v in values}) == 1:
            batch[key] = torch.stack(values)
        elif key == "label" and all(isinstance(v, int) for v in values):
            batch[key] = torch.tensor(values, dtype=torch.long)
        else:
            batch[key] = values
    return batch


def write_sample(sample: dict[str, Any], path: str | os.PathLike, **options: Any) -> Path:
    """Write a task sample's frames to an mp4 at its timestamps (see :func:`data.video.write_video`)."""
    return write_video(path, sample["frames"].numpy(), timestamps=sample["timestamps"].numpy(), **options)
