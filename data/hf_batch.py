"""Batches of processed instruction samples for a Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL model under a vlpe
variant: padded rows, or packed rows described by ``cu_seqlens``.

An item is what :class:`data.instruct.InstructDataset` returns for one sample (``input_ids``, ``labels``,
``mm_token_type_ids`` ``(S,)`` and the processor's vision tensors), or None for a sample the dataset dropped (too
long) or skipped (unreadable media); None items are left out and counted (``num_skipped``). The batch holds the
keyword arguments of the model's forward plus ``labels``, ``num_labels`` (supervised tokens, the loss divisor),
``num_samples`` and ``num_skipped``. Position ids are computed here, in the DataLoader workers, by
:func:`vlpe.integrations.transformers.ids.prompt_position_ids` (exactly what the patched model computes itself, which
the tests check), as the packed ``(1 + rows, B, S)`` tensor the patched decoder takes.

* Padded (``packing=False``): one sample a row, right padding, an ``attention_mask``.
* Packed (``packing=True``): the samples, in order, fill rows of at most ``max_length`` tokens (one row without a
  limit), right padding at the end of each row (its slots are segments of their own, so no real token ever sees
  one); ``cu_seqlens`` ``(n + 1,)`` int32 over the flattened ``(B * S)`` tokens, every sample's own ids with a text
  row restarting at every sample, no ``attention_mask`` and ``use_cache=False``, so the patch builds the block-
  diagonal causal mask (sdpa / eager) or hands flash-attention its varlen metadata. The first token of every sample
  is never supervised (nothing in the sample predicts it), so the loss of a packed batch equals the loss of the same
  samples padded (tested).
* ``filler``: a sample holding one small image and one small video and no label, appended to a batch that lacks
  either modality. Under DeepSpeed ZeRO-3 every rank gathers a module's parameters collectively when it runs it, so
  every rank must run the vision tower the same number of times (once for images, once for videos) in every
  micro-batch; the filler makes that so without changing the loss (it is a sample of its own, with no label).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from .vlm_collate import pack_rows

__all__ = ["InstructCollator", "IGNORE_INDEX", "MODEL_KEYS"]

IGNORE_INDEX = -100
_VISION = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
# the keys of a batch that go to the model's forward
MODEL_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "position_ids", "pixel_values", "image_grid_thw",
              "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "use_cache")  # fmt: skip


@dataclass(kw_only=True)
class InstructCollator:
    """Collate processed instruction samples (see the module docstring).

    Args:
        variant: the :class:`vlpe.encodings.multimodal.Variant` of the patched model
            (``vlpe.integrations.transformers.patch_of(model).variant``).
        family: ``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``; spatial_merge_size: the vision tower's merge.
        pad_token_id: the tokenizer's padding id.
        packing: pack samples into rows with ``cu_seqlens``; max_length: a packed row's token budget (None: one row).
        filler: a processed item with one image and one video (:meth:`needs_filler`), or None.
    """

    variant: Any
    family: str
    spatial_merge_size: int
    pad_token_id: int
    packing: bool = False
    max_length: int | None = None
    filler: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.packing, bool):
            raise ValueError(f"packing must be True or False, got {self.packing!r}")
        if self.max_length is not None and (isinstance(self.max_length, bool) or self.max_length < 1):
            raise ValueError(f"max_length must be a positive number of tokens or None, got {self.max_length!r}")
        if self.filler is not None:
            missing = [g for _, g in _VISION if g not in self.filler]
            if missing or bool((self.filler["labels"] != IGNORE_INDEX).any()):
                raise ValueError("the filler must hold one image and one video (image_grid_thw, video_grid_thw) and "
                                 f"no supervised token; missing: {missing}")  # fmt: skip

    def __call__(self, items: Sequence[dict | None]) -> dict[str, Any]:
        kept = [it for it in items if it is not None]
        skipped = len(items) - len(kept)
        real = len(kept)
        if self.filler is not None and not all(any(g in it for it in kept) for _, g in _VISION):
            kept = kept + [self.filler]
        if not kept:
            raise ValueError(
                "every sample of this micro-batch was dropped or skipped and there is no filler sample to run; "
                "give the collator a filler (InstructCollator(filler=...)) or fix the data"
            )
        for it in kept:
            if it["input_ids"].numel() == 0:
                raise ValueError(f"sample {it.get('index', '?')} has no tokens; every sample needs at least one")
        lengths = [int(it["input_ids"].numel()) for it in kept]
        groups = self._groups(lengths) if self.packing else [[k] for k in range(len(kept))]
        B = len(groups)
        S = max(sum(lengths[k] for k in g) for g in groups)
        input_ids = torch.full((B, S), self.pad_token_id, dtype=torch.long)  # (B, S)
        labels = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
        types = torch.zeros((B, S), dtype=torch.long)
        mask = torch.zeros((B, S), dtype=torch.long)
        bounds = [0]  # packed: segment ends over the flattened (B * S) tokens
        for b, g in enumerate(groups):
            at = 0
            for k in g:
                it, n = kept[k], lengths[k]
                input_ids[b, at : at + n] = it["input_ids"]
                lab = it["labels"].clone()
                if self.packing:
                    lab[0] = IGNORE_INDEX  # predicted by the previous sample's last token otherwise
                labels[b, at : at + n] = lab
                types[b, at : at + n] = it["mm_token_type_ids"]
                mask[b, at : at + n] = 1
                at += n
                bounds.append(b * S + at)
            if self.packing and at < S:  # every padding slot a segment of its own: it sees itself only
                bounds += range(b * S + at + 1, (b + 1) * S + 1)
        batch: dict[str, Any] = {"input_ids": input_ids, "mm_token_type_ids": types, "labels": labels}
        for pixels, grid in _VISION:
            found = [it for it in kept if grid in it]
            if found:
                batch[pixels] = torch.cat([it[pixels] for it in found])
                batch[grid] = torch.cat([it[grid] for it in found]).long()
        spg = [it["second_per_grid_ts"] for it in kept if "second_per_grid_ts" in it]
        if spg:
            batch["second_per_grid_ts"] = torch.cat([torch.as_tensor(s, dtype=torch.float32).reshape(-1) for s in spg])
        cu = None
        if self.packing:
            cu = torch.tensor(bounds, dtype=torch.int32)  # (n + 1,)
            batch["cu_seqlens"] = cu
            batch["use_cache"] = False
        else:
            batch["attention_mask"] = mask
        batch["position_ids"], batch["rope_deltas"] = self.position_ids(batch, None if self.packing else mask, cu)
        batch["num_labels"] = torch.tensor(int((labels[:, 1:] != IGNORE_INDEX).sum()))
        batch["num_samples"] = real
        batch["num_skipped"] = skipped
        return batch

    def position_ids(self, batch: dict, mask: Tensor | None, cu: Tensor | None) -> tuple[Tensor, Tensor]:
        """The patched model's packed ids ``(1 + rows, B, S)`` and ``rope_deltas`` of the batch."""
        from vlpe.integrations.transformers.ids import prompt_position_ids

        return prompt_position_ids(
            self.variant, family=self.family, spatial_merge_size=self.spatial_merge_size,
            mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=batch.get("image_grid_thw"),
            video_grid_thw=batch.get("video_grid_thw"), attention_mask=mask,
            second_per_grid_ts=batch.get("second_per_grid_ts"), cu_seqlens=cu,
        )  # fmt: skip

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        return pack_rows(lengths, self.max_length)
