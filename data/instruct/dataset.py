"""One tokenized instruction sample per item, through a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint's own processor,
with labels on the assistant tokens only.

The sample's turns (see :mod:`data.instruct.annotations`) become chat messages and are rendered by the processor's
chat template. Each assistant span is found in characters by rendering the messages before it with the generation
prompt and the messages up to it: the span is the assistant content plus the end-of-turn text the template writes
after it (``<|im_end|>\\n`` for the Qwen templates). Assistant spans are tokenized by the tokenizer and carry their
ids as labels; the text between them goes through the processor with the media whose placeholders it holds (one
processor call per media item), so vision tokens, Qwen3-VL's rendered frame timestamps and ``mm_token_type_ids``
are the processor's own; every other label is -100 (transformers' ignore index). The concatenated ids equal the
processor's one-shot ids of the whole rendered text (the tests check it for all three families). Videos are
loaded by :func:`data.instruct.media.load_video` and handed over with ``do_sample_frames=False`` and their real
frame indices and native rate as ``video_metadata``, so Qwen3-VL renders the real frame times; Qwen2.5-VL's
``second_per_grid_ts`` is set to ``temporal_patch_size`` x the real mean interval of the sampled frames (the
5.24 processor derives it from ``len(indices) / total_frames * fps``, the average rate over the whole video).

Annotations are read in any format of :mod:`data.instruct.annotations` (LLaVA ``conversations``, LLaMA-Factory /
ms-swift ``messages``, Qwen content items); a sample may hold images and videos, in any order, and videos given as
frame files. Media paths are relative to ``media_root``; a path that leads outside it (``..``, an absolute path, a
symlink that resolves outside) is refused with ``ValueError`` unless ``allow_outside_root=True``.

Samples longer than ``max_length`` tokens are dropped (``None``, counted in ``dropped``), never truncated. A
missing or undecodable media file (or a picture the processors refuse: an aspect ratio over 200) skips its sample
(``None``, a RuntimeWarning, recorded in ``skipped``), with the rule of :class:`data.images.ImageFolder`: more than
``max_skipped`` distinct files raise ``ValueError``; so does a process in which more than ``max_skipped_fraction``
of the samples read (at least 16, or all of a smaller set) were left out, dropped or skipped: such a run would
learn from nothing. The counts are per process (each DataLoader worker keeps its own). Malformed annotations
raise at construction.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .annotations import AnnotationError, chat_messages, parse_samples, read_annotations, sample_media
from .media import MediaError, _check_rate, load_frames, load_image, load_video_indexed

__all__ = ["InstructDataset", "FAMILIES", "IGNORE_INDEX"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IGNORE_INDEX = -100
_PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                      "qwen3_vl": "Qwen3VLProcessor"}  # fmt: skip


def _pixels(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer number of pixels per frame (e.g. 448 * 448) or None, "
                         f"got {value!r}")  # fmt: skip
    return int(value)


class InstructDataset(Dataset):
    """Instruction samples of ``annotations`` (a JSON / JSONL file or a list of sample dicts) with media under
    ``media_root``, tokenized by ``processor`` (the checkpoint's ``AutoProcessor``) of ``family``.

    Item ``i`` is None when the sample is dropped or skipped (see the module docstring), else a dict of tensors
    without a batch axis: ``input_ids``, ``labels``, ``mm_token_type_ids`` (S,) long; ``pixel_values`` +
    ``image_grid_thw`` (k, 3) for images, ``pixel_values_videos`` + ``video_grid_thw`` (v, 3) for videos,
    ``second_per_grid_ts`` (v,) float32 for Qwen2.5-VL; ``index`` and ``length`` (= S) ints.

    ``fps`` / ``max_frames`` / ``nframes``: the video sampling (:mod:`data.instruct.media`; ``nframes``, when
    set, takes that many frames instead). ``min_pixels`` / ``max_pixels``: the pixel budget of every image and
    every video frame (None: the processor's own); ``image_max_pixels`` / ``video_max_pixels`` replace
    ``max_pixels`` for images / video frames. They go to the processor as ``size={"shortest_edge",
    "longest_edge"}``, scaled by the frame count for Qwen3-VL videos, whose processor reads ``size`` as a budget
    for the whole video; videos larger than the budget are decoded at it. A Qwen-format media item's own
    ``fps``, ``nframes``, ``max_frames``, ``min_pixels`` and ``max_pixels`` override these for that item.
    ``format``: the annotation format (``"auto"``: detected per file). ``allow_outside_root``: read media paths
    that lead outside ``media_root``. ``max_skipped`` / ``max_skipped_fraction``: the limits of the module
    docstring (``max_skipped_fraction=1`` never stops).
    """

    def __init__(
        self,
        *,
        annotations: str | os.PathLike | Sequence[dict],
        media_root: str | os.PathLike,
        processor: Any,
        family: str,
        fps: float = 2.0,
        max_frames: int = 32,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_length: int | None = None,
        max_skipped: int = 100,
        nframes: int | None = None,
        image_max_pixels: int | None = None,
        video_max_pixels: int | None = None,
        format: str = "auto",
        allow_outside_root: bool = False,
        max_skipped_fraction: float = 0.5,
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        expected = _PROCESSOR_CLASSES[family]
        if expected not in [c.__name__ for c in type(processor).__mro__]:
            raise ValueError(f"family {family!r} needs a {expected} (AutoProcessor of a {family} checkpoint), got "
                             f"{type(processor).__name__}; pass the family of the checkpoint")  # fmt: skip
        if not getattr(processor, "chat_template", None):
            raise ValueError(f"the {type(processor).__name__} has no chat template; the labels are found through "
                             "it (an Instruct checkpoint folder ships one in chat_template.jinja / .json)")  # fmt: skip
        _check_rate(fps, max_frames)
        self.min_pixels, self.max_pixels = _pixels("min_pixels", min_pixels), _pixels("max_pixels", max_pixels)
        self.kind_max = {"image": _pixels("image_max_pixels", image_max_pixels),
                         "video": _pixels("video_max_pixels", video_max_pixels)}  # fmt: skip
        for name, value in (("max_pixels", self.max_pixels), ("image_max_pixels", self.kind_max["image"]),
                            ("video_max_pixels", self.kind_max["video"])):  # fmt: skip
            if self.min_pixels and value and self.min_pixels > value:
                raise ValueError(f"min_pixels ({min_pixels}) must not exceed {name} ({value})")
        if nframes is not None and (isinstance(nframes, bool) or not isinstance(nframes, int) or nframes < 2):
            raise ValueError(f"nframes must be an integer >= 2 (frames per video) or None, got {nframes!r}")
        if isinstance(max_skipped_fraction, bool) or not isinstance(max_skipped_fraction, (int, float)) \
                or not 0 <= max_skipped_fraction <= 1:  # fmt: skip
            raise ValueError(f"max_skipped_fraction must be a number in [0, 1] (1: never stop), got "
                             f"{max_skipped_fraction!r}")  # fmt: skip
        if not isinstance(allow_outside_root, bool):
            raise ValueError(f"allow_outside_root must be True or False, got {allow_outside_root!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):  # fmt: skip
            raise ValueError(f"max_length must be a positive integer number of tokens or None, got {max_length!r}")
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 0:
            raise ValueError(f"max_skipped must be an int >= 0 (unreadable media files tolerated), got {max_skipped!r}")
        self.media_root = Path(media_root)
        if not self.media_root.is_dir():
            raise ValueError(f"media_root {str(self.media_root)!r} is not a folder; give the folder the annotation "
                             "paths are relative to")  # fmt: skip
        if isinstance(annotations, (str, os.PathLike)):
            self.source = Path(annotations).name
            self.samples = parse_samples(read_annotations(annotations, format=format), source=self.source,
                                         format=format)  # fmt: skip
        else:
            self.source = "annotations"
            self.samples = parse_samples(list(annotations) if isinstance(annotations, Sequence) else annotations,
                                         source=self.source, format=format)  # fmt: skip
        self.format = self.samples[0]["format"]
        self.allow_outside_root = allow_outside_root
        self.root = self.media_root.resolve()
        for i, sample in enumerate(self.samples):  # paths that lead outside the root, before any file is opened
            for item in sample_media(sample):
                for p in item.get("frames", [item.get("image") or item.get("video")]):
                    self._media_path(p, i, resolve=False)  # symlinks are resolved when the file is read
        self.processor, self.family = processor, family
        self.tokenizer = processor.tokenizer
        self.fps, self.max_frames, self.nframes = float(fps), int(max_frames), nframes
        self.max_length, self.max_skipped, self.max_skipped_fraction = max_length, max_skipped, max_skipped_fraction
        self.tokens = {"image": processor.image_token, "video": processor.video_token}
        for i, sample in enumerate(self.samples):  # the processor's media tokens in text would count as media
            for j, message in enumerate(sample["messages"]):
                for item in message["content"]:
                    hit = [t for t in self.tokens.values() if item["type"] == "text" and t in item["text"]]
                    if hit:
                        raise AnnotationError(
                            f"{self.source}: sample {i}: turn {j} holds the processor's media token {hit[0]}; write "
                            "<video> / <image> placeholders (or qwen media items) instead"
                        )
        self.dropped: dict[int, int] = {}
        self.skipped: dict[str, str] = {}
        self.reads = 0  # samples read by this process, and of them left out (dropped or skipped)
        self.left_out = 0

    def __len__(self) -> int:
        return len(self.samples)

    # paths -----------------------------------------------------------------------------------------------------
    def _media_path(self, path: str, index: int, *, resolve: bool = True) -> Path:
        """The file of a media path of sample ``index``, under ``media_root``; ``ValueError`` when it leads
        outside it (by ``..``, as an absolute path, or, with ``resolve``, once symlinks are resolved) and that is
        not allowed."""
        joined = self.media_root / path
        if self.allow_outside_root:
            return joined
        lexical = Path(os.path.normpath(self.root / path))
        resolved = joined.resolve() if resolve and (joined.exists() or joined.is_symlink()) else lexical
        inside = lexical.is_relative_to(self.root) and resolved.is_relative_to(self.root)
        if not inside:
            how = "resolves" if lexical.is_relative_to(self.root) else "leads"
            raise ValueError(
                f"{self.source}: sample {index}: the media path {path!r} {how} outside data.media_root ({self.root}); "
                "media are read from under the media root only. Move the file there, set data.media_root to a "
                "folder that holds it, or allow paths outside it with data.allow_outside_root=true (e.g. for "
                "LLaMA-Factory / ms-swift files with absolute paths)"
            )
        return joined

    # processor kwargs ------------------------------------------------------------------------------------------
    def _budget(self, item: dict) -> tuple[int | None, int | None]:
        """``(min_pixels, max_pixels)`` per image or video frame of a media item: its own, else the run's."""
        lo = item.get("min_pixels", self.min_pixels)
        hi = item.get("max_pixels", self.kind_max[item["type"]] or self.max_pixels)
        return lo, hi

    @staticmethod
    def _size(default: Any, lo: int | None, hi: int | None, scale: int = 1) -> dict | None:
        if lo is None and hi is None:
            return None
        lo = default["shortest_edge"] if lo is None else lo * scale
        hi = default["longest_edge"] if hi is None else hi * scale
        return {"shortest_edge": int(lo), "longest_edge": int(max(hi, lo))}

    def _video_kwargs(self, item: dict, num_frames: int) -> dict:
        vp = self.processor.video_processor
        kwargs: dict[str, Any] = {}
        if getattr(vp, "cap_pixels_per_frame", False) is None:  # unset: keep the budget as given, no warning
            kwargs["cap_pixels_per_frame"] = False
        size = self._size(vp.size, *self._budget(item), num_frames if self.family == "qwen3_vl" else 1)
        if size is not None:
            kwargs["size"] = size
        return kwargs

    # media -----------------------------------------------------------------------------------------------------
    def _load(self, item: dict, index: int) -> dict:
        if item["type"] == "image":
            return {"item": item, "image": load_image(self._media_path(item["image"], index))}  # (H, W, 3) uint8
        sampling = dict(fps=item.get("fps", self.fps), max_frames=item.get("max_frames", self.max_frames),
                        nframes=item.get("nframes", self.nframes), max_pixels=self._budget(item)[1])  # fmt: skip
        if "frames" in item:
            loaded = load_frames([self._media_path(p, index) for p in item["frames"]], **sampling)
        else:
            loaded = load_video_indexed(self._media_path(item["video"], index), **sampling)
        frames, ts, idx, native, n = loaded
        T = frames.shape[0]
        # seconds per temporal patch: temporal_patch_size x the mean interval of the sampled frames
        tps = int(self.processor.video_processor.temporal_patch_size)
        interval = float(ts[-1] - ts[0]) / (T - 1) if T > 1 else 1.0 / native
        if pad := -T % tps:  # repeat the last frame, as the video processor pads (Qwen3-VL needs >= 2 frames)
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
            idx = np.concatenate([idx, np.repeat(idx[-1:], pad)])
        meta = {"fps": native, "total_num_frames": int(n), "frames_indices": idx.tolist()}
        return {"item": item, "video": frames, "metadata": meta, "second_per_grid_t": tps * interval,
                "timestamps": ts}  # fmt: skip

    def _skip(self, err: MediaError) -> None:
        self.skipped[err.path] = str(err)
        if len(self.skipped) > self.max_skipped:
            raise ValueError(
                f"{len(self.skipped)} media files of {self.source} are missing or cannot be decoded, more than "
                f"max_skipped={self.max_skipped} (the last: {err.path}: {err.reason}); fix or remove them, or check "
                f"media_root ({self.media_root})"
            ) from None
        warnings.warn(f"skipping a sample of {self.source}: {err} ({len(self.skipped)} files skipped so far, limit "
                      f"{self.max_skipped})", RuntimeWarning, stacklevel=3)  # fmt: skip

    def _leave_out(self) -> None:
        """Count a sample left out; stop when too large a share of the samples read were (module docstring)."""
        self.left_out += 1
        enough = self.reads >= min(16, len(self.samples))
        if enough and self.left_out > self.max_skipped_fraction * self.reads:
            raise ValueError(
                f"{self.left_out} of the {self.reads} samples of {self.source} read in this process were left out, "
                f"more than max_skipped_fraction={self.max_skipped_fraction}: {len(self.skipped)} media file(s) "
                f"unreadable (e.g. {next(iter(self.skipped.values()), 'none')}), {len(self.dropped)} sample(s) longer "
                f"than max_length={self.max_length}. Training on the rest would learn from almost nothing; fix the "
                f"media or data.media_root ({self.media_root}), raise data.max_length, or raise "
                "data.max_skipped_fraction"
            )

    # text ------------------------------------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def render(self, index: int) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat text of sample ``index`` and the ``[start, end)`` character span of every assistant
        turn in it (content + end-of-turn text)."""
        messages = chat_messages(self.samples[index])
        full = self._render(messages, False)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, upto = self._render(messages[:k], True), self._render(messages[: k + 1], False)
            if not (upto.startswith(before) and full.startswith(upto) and len(upto) > len(before)):
                raise ValueError(
                    f"{self.source}: sample {index}: the chat template does not render turn {k} as a continuation of "
                    "the turns before it plus the generation prompt, so the assistant tokens cannot be located; use "
                    "a template that renders each turn independently of the later ones (the Qwen-VL Instruct ones do)"
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def _encode_prompt(self, text: str, media: dict | None, first: bool) -> dict:
        kwargs: dict[str, Any] = dict(return_tensors="pt", add_special_tokens=first)
        if media is not None and "image" in media:
            kwargs["images"] = [media["image"]]
            size = self._size(self.processor.image_processor.size, *self._budget(media["item"]))
            if size is not None:
                kwargs["images_kwargs"] = {"size": size}
        elif media is not None:
            kwargs.update(videos=[media["video"]], video_metadata=[media["metadata"]], do_sample_frames=False,
                          videos_kwargs=self._video_kwargs(media["item"], media["video"].shape[0]))  # fmt: skip
        out = self.processor(text=[text], **kwargs)
        return {k: v[0] if k in ("input_ids", "mm_token_type_ids") else v for k, v in out.items()}

    def __getitem__(self, index: int) -> dict | None:
        if not 0 <= index < len(self.samples):
            raise IndexError(f"index {index} out of range for {len(self.samples)} samples")
        self.reads += 1
        items = sample_media(self.samples[index])
        try:
            media = [self._load(item, index) for item in items]
        except MediaError as err:
            self._skip(err)
            self._leave_out()
            return None
        full, spans = self.render(index)
        for kind, token in self.tokens.items():
            found, want = full.count(token), sum(item["type"] == kind for item in items)
            if found != want:
                raise ValueError(f"{self.source}: sample {index}: the rendered chat text holds {found} {token} tokens "
                                 f"for {want} {kind}(s); the chat template must write one per media item")  # fmt: skip
        # pieces: (text, is_assistant, media item or None); prompt text is cut right after each media token
        pieces: list[tuple[str, bool, dict | None]] = []
        bounds = [0] + [b for s in spans for b in s] + [len(full)]
        queue = list(media)
        for j in range(len(bounds) - 1):
            text = full[bounds[j] : bounds[j + 1]]
            if j % 2:
                pieces.append((text, True, None))
                continue
            while queue:
                token = self.tokens[queue[0]["item"]["type"]]
                if token not in text:
                    break
                cut = text.index(token) + len(token)
                pieces.append((text[:cut], False, queue.pop(0)))
                text = text[cut:]
            if text:
                pieces.append((text, False, None))
        ids, labels, types = [], [], []
        vision: dict[str, list[torch.Tensor]] = {}
        for k, (text, assistant, item) in enumerate(pieces):
            if assistant:
                toks = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
                ids.append(toks)
                labels.append(toks)
                types.append(torch.zeros_like(toks))
                continue
            out = self._encode_prompt(text, item, first=k == 0)
            toks = out["input_ids"].long()
            ids.append(toks)
            labels.append(torch.full_like(toks, IGNORE_INDEX))
            types.append(out["mm_token_type_ids"].long())
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                if key in out:
                    vision.setdefault(key, []).append(out[key])
            if item is not None and "video" in item and self.family == "qwen2_5_vl":
                vision.setdefault("second_per_grid_ts", []).append(
                    torch.tensor([item["second_per_grid_t"]], dtype=torch.float32))
        input_ids = torch.cat(ids)  # (S,)
        length = int(input_ids.numel())
        if self.max_length is not None and length > self.max_length:
            self.dropped[index] = length
            self._leave_out()
            return None
        item = {"input_ids": input_ids, "labels": torch.cat(labels), "mm_token_type_ids": torch.cat(types)}
        item.update({k: torch.cat(v) for k, v in vision.items()})
        item.update(index=int(index), length=length)
        return item
