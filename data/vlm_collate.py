"""Collate interleaved text / image / video samples into a batch in Hugging Face Qwen2-VL conventions.

A sample is a list of segments (or a dict with a ``"segments"`` list, as :mod:`data.vniah` produces)::

    [("text", "Question: ..."), ("video", frames, timestamps), ("image", image), ("answer", "sneaker")]

* ``("text", str)`` and ``("answer", str)``: words of the :class:`data.text.WordTokenizer`; answer tokens
  (and the ``<eos>`` that closes the answer) are the only supervised positions of ``labels``.
* ``("image", img)``: (H, W, 3) uint8 (or float in [0, 1]).
* ``("video", frames, timestamps)``: (T, H, W, 3) uint8 (or float) frames and their (T,) times in seconds
  (real timestamps, e.g. from :func:`data.video.read_video`).

Layout of one sequence: ``<bos>``, then per segment its words, or ``<|vision_start|>`` + one placeholder
(``<|image_pad|>`` / ``<|video_pad|>``) per *merged* patch + ``<|vision_end|>``; answers end with
``<eos>``. Padding (``<pad>``) goes right or left.

Pixels follow the Qwen2-VL processors (``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor`` with
``do_resize=False``; the parity is tested): values scaled to [0, 1] and normalised with the OpenAI-CLIP
mean and std; an image is repeated ``temporal_patch_size`` times; a video whose frame count is not a
multiple of ``temporal_patch_size`` is padded by repeating its last frame; every block is cut into
(temporal_patch_size x patch x patch) patches ordered (t, row-block, column-block, row-in-block,
column-in-block), so each ``merge x merge`` group of patches that becomes one decoder token is
contiguous; a patch is flattened as (channel, time, y, x). Frame height and width must be multiples
of ``patch_size * merge_size`` (resize the data, e.g. ``read_video(..., size=)``; nothing is resized here).

Batch (tensors): ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (0 text, 1 image, 2 video),
``labels`` (-100 except answer tokens), all (B, S); ``pixel_values`` (total patches, C * tp * p * p) for
every block in order of appearance (sample 0 first); ``grid_thw`` (blocks, 3) in patches, in the same
order, with ``grid_types`` (blocks,) 1 image / 2 video; ``image_grid_thw`` / ``video_grid_thw`` (the same
rows split by modality, as the Hugging Face processor returns them); ``second_per_grid_ts`` (videos,) =
temporal_patch_size x the mean frame interval of the real timestamps (Qwen2.5-VL's
``temporal_patch_size / fps``); ``video_grid_timestamps`` (video grid rows in total,) the mean time of the
first and last frame of each temporal patch (Qwen3-VL's convention). With ``position_variant`` set, also
``position_ids`` (A, B, S) and ``rope_deltas`` from :func:`vlpe.encodings.multimodal.position_ids`.
:func:`to_hf_inputs` renames and splits the batch for ``transformers``' Qwen2-VL models.

Packing (``packing=True``): the samples, in order, fill rows of at most ``max_length`` tokens (one row when
``max_length`` is None), each row padded on the right to the longest; the batch then also holds ``cu_seqlens``
(n + 1,) int32, the cumulative sample lengths over the flattened ``(B * S)`` batch as flash-attention's varlen
kernels take them. A row's padding belongs to its last sample and comes after all of its real tokens, so that a
causal varlen kernel run on these boundaries is exact for every real token (padding never precedes a real token of
its segment); packing therefore refuses ``padding_side="left"``, whose padding would open the row's first sample.
A sample that encodes to no tokens is refused (with or without packing). ``attention_mask`` still marks
padding; ``labels`` are every sample's own (its first token never supervised: nothing in the sample predicts it);
``position_ids`` are every sample's own ids (text restarting at each sample) and ``rope_deltas`` (n, 1) one per
sample. :func:`to_hf_inputs` then hands the model a position tensor with a text row restarting at every sample and
no attention mask (``use_cache=False``), from which transformers builds a block-diagonal causal mask: samples never
attend to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from .text import WordTokenizer

__all__ = [
    "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "VLMCollator", "patchify", "to_hf_inputs", "segments_of", "pack_rows",
]  # fmt: skip

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IGNORE_INDEX = -100
_KINDS = ("text", "answer", "image", "video")


def _pixels(x: Any, what: str) -> Tensor:
    """(..., H, W, 3) uint8 or float in [0, 1] -> float32 in [0, 1]."""
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, Tensor) else x)
    if t.shape[-1:] != (3,):
        raise ValueError(f"{what} must be channels-last RGB (..., H, W, 3), got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        return t.float().div_(255.0)
    if not t.is_floating_point():
        raise ValueError(f"{what} must be uint8 (0..255) or float (0..1), got {t.dtype}")
    return t.float()


def patchify(
    frames: Tensor,
    *,
    patch_size: int,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
) -> tuple[Tensor, tuple[int, int, int]]:
    """Cut (T, C, H, W) normalised frames into Qwen2-VL's flattened patches.

    ``T`` must be a multiple of ``temporal_patch_size`` (pad or repeat before). Returns
    ``(grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size ** 2)`` patches ordered
    (t, row-block, column-block, row-in-block, column-in-block), each flattened as (c, time, y, x), and
    the grid ``(grid_t, grid_h, grid_w)`` in patches.
    """
    T, C, H, W = frames.shape
    p, tp, m = patch_size, temporal_patch_size, merge_size
    if T % tp:
        raise ValueError(f"{T} frames is not a multiple of temporal_patch_size={tp}")
    if H % (p * m) or W % (p * m):
        raise ValueError(
            f"frame size {H}x{W} is not a multiple of patch_size * merge_size = {p * m}; resize the frames "
            f"(e.g. read_video(..., size=({max(1, round(H / (p * m))) * p * m}, {max(1, round(W / (p * m))) * p * m})))"
        )
    gt, gh, gw = T // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, p, p)
    return x.reshape(gt * gh * gw, C * tp * p * p), (gt, gh, gw)


def segments_of(sample: Any) -> list[tuple]:
    """The segment list of a sample (a list of segments, or a dict with a ``"segments"`` key)."""
    segs = sample.get("segments") if isinstance(sample, dict) else sample
    if not isinstance(segs, (list, tuple)) or not segs:
        raise ValueError("a sample must be a non-empty list of segments or a dict with a 'segments' list")
    for seg in segs:
        if not isinstance(seg, (list, tuple)) or not seg or seg[0] not in _KINDS:
            raise ValueError(f"each segment must be a tuple starting with one of {_KINDS}, got {seg!r:.80}")
    return list(segs)


@dataclass
class VLMCollator:
    """Turn interleaved samples into a Qwen2-VL style batch (see the module docstring for every key).

    Args:
        tokenizer: the word-level tokenizer (its special tokens give the placeholder ids).
        patch_size, temporal_patch_size, merge_size: the vision tower's patching (Qwen2-VL: 14, 2, 2).
        image_mean, image_std: per-channel normalisation after scaling to [0, 1].
        padding_side: "right" or "left" ("right" only with ``packing``: see the module docstring).
        max_length: raise ValueError for a longer sequence (nothing is truncated); None: no limit.
        add_bos: start every sequence with ``<bos>``; answer_eos: close every answer with a supervised ``<eos>``.
        position_variant: a :mod:`vlpe.encodings.multimodal` variant name (or Variant); when set the batch
            also gets ``position_ids`` and ``rope_deltas``. position_options: the design's options
            (``second_per_grid_ts`` is filled in from the real timestamps when the design takes it).
        packing: pack several samples into each row of at most ``max_length`` tokens, in order, with
            ``cu_seqlens`` and per-sample labels and positions (see the module docstring).
    """

    tokenizer: WordTokenizer
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: Sequence[float] = OPENAI_CLIP_MEAN
    image_std: Sequence[float] = OPENAI_CLIP_STD
    padding_side: str = "right"
    max_length: int | None = None
    add_bos: bool = True
    answer_eos: bool = True
    position_variant: Any = None
    position_options: dict[str, Any] = field(default_factory=dict)
    packing: bool = False

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.packing, bool):
            raise ValueError(f"packing must be True or False, got {self.packing!r}")
        if self.padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {self.padding_side!r}")
        if self.packing and self.padding_side != "right":
            raise ValueError(
                "packing=True needs padding_side='right': cu_seqlens give every row's padding to a sample, and left "
                "padding would sit before the first sample's real tokens inside its segment, which a flash-attention "
                "varlen kernel lets them attend to; use padding_side='right' (the padding then follows the row's "
                "last sample, after every real token)"
            )
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("image_mean and image_std need 3 values each, std positive")
        if self.position_variant is not None:
            from vlpe.encodings import multimodal as mm

            self._variant = mm.get_variant(self.position_variant)  # unknown names fail here, not in a worker
            self._design_options = set(mm.designs.get_design(self._variant.design).defaults)

    @property
    def tokens_per_patch_group(self) -> int:
        return self.merge_size**2

    # ---------------------------------------------------------------------------------------------------
    def _vision(self, kind: str, seg: tuple) -> tuple[Tensor, tuple[int, int, int], float | None, Tensor | None]:
        mean = torch.tensor(self.image_mean, dtype=torch.float32)
        std = torch.tensor(self.image_std, dtype=torch.float32)
        tp = self.temporal_patch_size
        if kind == "image":
            if len(seg) != 2:
                raise ValueError("an image segment is ('image', image)")
            x = _pixels(seg[1], "an image")
            if x.dim() != 3:
                raise ValueError(f"an image must be (H, W, 3), got {tuple(x.shape)}")
            x = ((x - mean) / std).permute(2, 0, 1).unsqueeze(0).expand(tp, -1, -1, -1)  # (tp, C, H, W)
            patches, grid = patchify(x, patch_size=self.patch_size, temporal_patch_size=tp, merge_size=self.merge_size)
            return patches, grid, None, None
        if len(seg) != 3 or seg[2] is None:
            raise ValueError("a video segment is ('video', frames (T, H, W, 3), timestamps (T,) in seconds)")
        x = _pixels(seg[1], "video frames")
        if x.dim() != 4:
            raise ValueError(f"video frames must be (T, H, W, 3), got {tuple(x.shape)}")
        ts = torch.as_tensor(np.asarray(seg[2]) if not isinstance(seg[2], Tensor) else seg[2]).double().reshape(-1)
        T = x.shape[0]
        if ts.numel() != T:
            raise ValueError(f"a video with {T} frames needs {T} timestamps, got {ts.numel()}")
        if T > 1 and not bool((ts[1:] > ts[:-1]).all()):
            raise ValueError("video timestamps must be strictly increasing seconds")
        x = ((x - mean) / std).permute(0, 3, 1, 2)  # (T, C, H, W)
        pad = (-T) % tp
        if pad:  # repeat the last frame, as the Qwen2-VL processor does
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            ts = torch.cat([ts, ts[-1:].expand(pad)])
        patches, grid = patchify(x, patch_size=self.patch_size, temporal_patch_size=tp, merge_size=self.merge_size)
        spg = tp * float(ts[T - 1] - ts[0]) / (T - 1) if T > 1 else 1.0  # s per temporal patch (1.0: HF default)
        grid_ts = ts.reshape(-1, tp)
        grid_ts = (grid_ts[:, 0] + grid_ts[:, -1]) / 2  # (grid_t,)
        return patches, grid, spg, grid_ts

    def _encode(
        self, sample: Any, pixel_chunks: list, grids: list, types: list, spgs: list, grid_times: list
    ) -> tuple[list[int], list[int], list[int]]:
        """Token ids, token types and labels of one sample; its vision blocks are appended to the lists."""
        tok = self.tokenizer
        ids, mm, labels = [], [], []
        if self.add_bos:
            ids.append(tok.bos_id), mm.append(0), labels.append(IGNORE_INDEX)
        for seg in segments_of(sample):
            kind = seg[0]
            if kind in ("text", "answer"):
                if len(seg) != 2 or not isinstance(seg[1], str):
                    raise ValueError(f"a {kind} segment is ({kind!r}, str), got {seg!r:.80}")
                words = tok.encode(seg[1])
                if kind == "answer" and self.answer_eos:
                    words = words + [tok.eos_id]
                ids += words
                mm += [0] * len(words)
                labels += words if kind == "answer" else [IGNORE_INDEX] * len(words)
                continue
            patches, grid, spg, gts = self._vision(kind, seg)
            n = grid[0] * grid[1] * grid[2] // self.merge_size**2
            code = 1 if kind == "image" else 2
            pad_id = tok.image_token_id if kind == "image" else tok.video_token_id
            ids += [tok.vision_start_id] + [pad_id] * n + [tok.vision_end_id]
            mm += [0] + [code] * n + [0]
            labels += [IGNORE_INDEX] * (n + 2)
            pixel_chunks.append(patches)
            grids.append(grid)
            types.append(code)
            if spg is not None:
                spgs.append(spg)
                grid_times.append(gts)
        if self.max_length is not None and len(ids) > self.max_length:
            raise ValueError(
                f"a sample has {len(ids)} tokens, more than max_length={self.max_length}; use fewer or smaller "
                "frames, or raise max_length (sequences are never truncated)"
            )
        return ids, mm, labels

    def __call__(self, samples: Sequence[Any]) -> dict[str, Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        pixel_chunks: list[Tensor] = []
        grids: list[tuple[int, int, int]] = []
        types: list[int] = []
        spgs: list[float] = []
        grid_times: list[Tensor] = []
        rows = [self._encode(s, pixel_chunks, grids, types, spgs, grid_times) for s in samples]
        for k, r in enumerate(rows):
            if not r[0]:
                raise ValueError(
                    f"sample {k} encodes to no tokens (add_bos=False and no words, image or video in it); a batch "
                    "needs at least one token per sample: drop empty samples before collating"
                )
        groups = self._groups([len(r[0]) for r in rows]) if self.packing else [[k] for k in range(len(rows))]
        if self.packing:  # concatenate the samples of every row; no sample's first token is predicted
            lengths = [[len(rows[k][0]) for k in g] for g in groups]
            for r in rows:
                if r[2]:
                    r[2][0] = IGNORE_INDEX
            rows = [tuple(sum((rows[k][f] for k in g), []) for f in range(3)) for g in groups]
        B, S = len(rows), max(len(r[0]) for r in rows)
        input_ids = torch.full((B, S), self.tokenizer.pad_id, dtype=torch.long)
        mm_types = torch.zeros((B, S), dtype=torch.long)
        labels = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((B, S), dtype=torch.long)
        for b, (ids, mm, lab) in enumerate(rows):
            n = len(ids)
            sl = slice(0, n) if self.padding_side == "right" else slice(S - n, S)
            input_ids[b, sl] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            mm_types[b, sl] = torch.from_numpy(np.asarray(mm, dtype=np.int64))
            labels[b, sl] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
            attention[b, sl] = 1
        dim = 3 * self.temporal_patch_size * self.patch_size**2
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        grid_types = torch.tensor(types, dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "mm_token_type_ids": mm_types,
            "labels": labels,
            "pixel_values": torch.cat(pixel_chunks) if pixel_chunks else torch.zeros((0, dim)),
            "grid_thw": grid_thw,
            "grid_types": grid_types,
            "image_grid_thw": grid_thw[grid_types == 1],
            "video_grid_thw": grid_thw[grid_types == 2],
            "second_per_grid_ts": torch.tensor(spgs, dtype=torch.float32),
            "video_grid_timestamps": torch.cat(grid_times).float() if grid_times else torch.zeros(0),
        }
        cu = None
        if self.packing:  # per row: the samples' lengths, the (right) padding counted in the last sample
            for row in lengths:
                row[-1] += S - sum(row)
            flat = [n for row in lengths for n in row]
            cu = torch.tensor([0, *np.cumsum(flat).tolist()], dtype=torch.int32)  # (n + 1,) over B * S tokens
            batch["cu_seqlens"] = cu
        if self.position_variant is not None:
            from vlpe.encodings import multimodal as mm

            options = dict(self.position_options)
            if "second_per_grid_ts" in self._design_options and options.get("second_per_grid_ts") is None:
                options["second_per_grid_ts"] = batch["second_per_grid_ts"]
            ids, deltas = mm.position_ids(
                self._variant, mm_types, grid_thw if len(grids) else None, attention_mask=attention,
                spatial_merge_size=self.merge_size, cu_seqlens=cu, **options,
            )  # fmt: skip
            batch["position_ids"], batch["rope_deltas"] = ids, deltas
        return batch

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        return pack_rows(lengths, self.max_length)


def pack_rows(lengths: Sequence[int], max_length: int | None) -> list[list[int]]:
    """Samples (by index, in order) of every packed row: a new row starts when the next sample would take the row
    past ``max_length`` tokens (one row without a limit); a sample longer than ``max_length`` is a ValueError."""
    groups: list[list[int]] = [[]]
    used = 0
    for k, n in enumerate(lengths):
        if max_length is not None and n > max_length:
            raise ValueError(f"a sample of {n} tokens does not fit a packed row of max_length={max_length}")
        if groups[-1] and max_length is not None and used + n > max_length:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += n
    return groups


def to_hf_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """The batch as keyword arguments of ``transformers``' Qwen2-VL / Qwen2.5-VL models: ``pixel_values``
    holds only image patches and ``pixel_values_videos`` only video patches (each in order of appearance).

    A packed batch (``cu_seqlens``) needs its ``position_ids``: they go first with the Hugging Face text row
    restarting at every sample (:func:`vlpe.encodings.multimodal.text_position_ids`), and the ``attention_mask``
    and the cache are left out (``use_cache=False``), so that the model builds a block-diagonal causal mask from
    that row (every padding slot attends to itself only). Under flash attention a model patched by
    :mod:`vlpe.integrations.transformers` hands the varlen kernel the segments of that same row for any batch size
    (a stock transformers model infers them from it for a batch of one row only)."""
    grid, kinds = batch["grid_thw"], batch["grid_types"]
    sizes = (grid.prod(-1)).tolist()
    chunks = torch.split(batch["pixel_values"], sizes) if sizes else ()
    out = {k: batch[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "labels")}
    images = [c for c, k in zip(chunks, kinds.tolist()) if k == 1]
    videos = [c for c, k in zip(chunks, kinds.tolist()) if k == 2]
    if images:
        out["pixel_values"], out["image_grid_thw"] = torch.cat(images), batch["image_grid_thw"]
    if videos:
        out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(videos), batch["video_grid_thw"]
        out["second_per_grid_ts"] = batch["second_per_grid_ts"]
    if "position_ids" in batch:
        out["position_ids"] = batch["position_ids"]
    if "cu_seqlens" in batch:
        from vlpe.encodings import multimodal as mm

        if "position_ids" not in batch:
            raise ValueError(
                "a packed batch (cu_seqlens) needs its per-sample position_ids: collate with position_variant set"
            )
        ids = batch["position_ids"]
        text = mm.text_position_ids(batch["attention_mask"], batch["attention_mask"], cu_seqlens=batch["cu_seqlens"])
        out["position_ids"] = torch.cat([text[None].to(ids.dtype), ids])  # (1 + A, B, S)
        del out["attention_mask"]
        out["use_cache"] = False
    return out
