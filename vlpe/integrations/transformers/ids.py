"""Position ids of a patched model: the packed tensor its decoder takes, prompts, cached decoding, generate()."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from vlpe.encodings import multimodal as mm

__all__ = ["pack_position_ids", "prompt_position_ids", "PositionIds"]


def pack_position_ids(
    ids: Tensor, attention_mask: Tensor | None = None, *, masked: bool, cu_seqlens=None, validate: bool = True
) -> Tensor:
    """The position tensor a patched model takes, from a design's ids ``(A, B, S)`` (e.g. computed in a collator
    with :func:`vlpe.encodings.multimodal.position_ids`): ``(1 + A [+ 1], B, S)``.

    Rows: the Hugging Face 1D text row (every real token's index in its sample, 0 on padding; restarting at every
    sample with ``cu_seqlens``), the ids, and for designs with their own attention mask (PyPE, ``masked``; see
    :attr:`vlpe.encodings.multimodal.Variant.masked`) the sample label of every token (0 padding, else 1, or the
    packed sample's number + 1). Float when the ids are.

    With ``cu_seqlens`` (and ``validate``) the boundaries are checked and, with an ``attention_mask``, that no
    padding slot sits between two real tokens of one sample (:func:`vlpe.encodings.multimodal.text_position_ids`:
    one host read); ``validate=False`` skips this for ids whose :func:`vlpe.encodings.multimodal.position_ids`
    call has validated the same inputs.
    """
    A, B, S = ids.shape
    text = mm.text_position_ids(
        (B, S), attention_mask, cu_seqlens=cu_seqlens, device=ids.device, validate=validate
    )  # (B, S)
    label = None
    if masked:
        label = torch.ones(B, S, dtype=torch.long, device=ids.device)
        if attention_mask is not None:
            label = label * (attention_mask != 0).to(device=ids.device)
        if cu_seqlens is not None:  # packed samples never attend to each other (the layer masks)
            label = label * (mm.packed_samples(cu_seqlens, B, S, device=ids.device).index + 1)
    return _stack(text, ids, label)


def prompt_position_ids(
    variant: mm.Variant,
    *,
    family: str,
    spatial_merge_size: int,
    mm_token_type_ids: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    attention_mask: Tensor | None = None,
    second_per_grid_ts: Tensor | None = None,
    cu_seqlens=None,
) -> tuple[Tensor, Tensor]:
    """Packed ids ``(1 + rows, B, S)`` and ``rope_deltas`` of whole prompts of a ``family`` model (``qwen2_vl``,
    ``qwen2_5_vl``, ``qwen3_vl``) under ``variant``, from the processor's tensors; needs no model, so a collator
    (in DataLoader workers) computes exactly what the patched model would (:meth:`PositionIds.prompt_position_ids`).
    With ``cu_seqlens`` (packed rows) every sample's own ids, a restarting text row, and ``rope_deltas (n, 1)``;
    a packed sample's padding must sit at its end or start (padding between two of its real tokens, an empty batch
    or ``cu_seqlens`` of another form are ``ValueError``, see :func:`vlpe.encodings.multimodal.position_ids`)."""
    types = mm_token_type_ids.long()
    if types.dim() != 2 or types.shape[1] == 0:
        raise ValueError(
            f"mm_token_type_ids must be (batch, seq) with seq >= 1 (0 text, 1 image, 2 video per token), got shape "
            f"{tuple(types.shape)}; drop empty batches before computing position ids"
        )
    B, S = types.shape
    if attention_mask is not None and (attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, S)):
        raise ValueError(
            f"attention_mask must be a 2D (batch, seq) padding mask matching mm_token_type_ids {(B, S)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    options: dict[str, Any] = {}
    if video_grid_thw is not None and family == "qwen3_vl":
        # Qwen3-VL emits every temporal patch as its own block after a timestamp: one T = 1 grid each
        frames = video_grid_thw[:, 0]
        video_grid_thw = video_grid_thw.repeat_interleave(frames, dim=0)
        video_grid_thw[:, 0] = 1
        if second_per_grid_ts is not None:
            spg = torch.as_tensor(second_per_grid_ts)
            second_per_grid_ts = spg.repeat_interleave(frames.to(spg.device))
    v = variant
    defaults = mm.DESIGNS[v.design].defaults
    if (second_per_grid_ts is not None and "second_per_grid_ts" in defaults
            and v.design_options.get("second_per_grid_ts") is None):
        options["second_per_grid_ts"] = second_per_grid_ts
    grid, _ = mm.merge_grids(types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    ids, deltas = mm.position_ids(v, types, grid, attention_mask, spatial_merge_size, cu_seqlens=cu_seqlens, **options)
    # mm.position_ids validated cu_seqlens (and the padding inside packed samples): no second host read
    return pack_position_ids(ids, attention_mask, masked=v.masked, cu_seqlens=cu_seqlens, validate=False), deltas


def _stack(text: Tensor, ids: Tensor, label: Tensor | None) -> Tensor:
    """``(1 + A [+ 1], B, S)``: text row, ids, label row (if any), in the ids' dtype when float, else int64."""
    parts = [text[None], ids] + ([label[None]] if label is not None else [])
    dtype = ids.dtype if ids.is_floating_point() else torch.long
    return torch.cat([p.to(device=ids.device, dtype=dtype) for p in parts], dim=0)


def _pads(mask: Tensor | None, B: int, S: int, device) -> Tensor:
    """``(B, 1)`` padding slots of every prompt."""
    if mask is None:
        return torch.zeros(B, 1, dtype=torch.long, device=device)
    return S - mask.long().sum(-1, keepdim=True).to(device)


class PositionIds:
    """The id bookkeeping of :class:`vlpe.integrations.transformers.Patch` (a mixin: the patch holds ``variant``,
    ``family``, ``spatial_merge_size``, ``num_axes``, ``masked``, ``base`` and the per-instance state
    ``_pending`` / ``_pads``)."""

    @property
    def rows(self) -> int:
        """Rows of the packed position tensor after the Hugging Face text row: ids, then the sample labels."""
        return self.num_axes + int(self.masked)

    # -- packed position tensor ----------------------------------------------------------------------------------

    def pack(self, text_pos: Tensor, ids: Tensor, valid: Tensor | None) -> Tensor:
        """``(1 + rows, B, S)`` from the text row, the design's ids and (masked designs) the sample labels."""
        return _stack(text_pos, ids, valid if self.masked else None)

    def text_only(self, text_pos: Tensor) -> Tensor:
        """The packed tensor of text tokens at 1D positions ``text_pos (B, S)`` (no vision block before them)."""
        B = text_pos.shape[0]
        deltas = torch.zeros(B, 1, dtype=text_pos.dtype, device=text_pos.device)
        ids = mm.decode_position_ids(self.variant, deltas, text_pos)
        return self.pack(text_pos, ids, torch.ones_like(text_pos, dtype=torch.bool))

    def unpack(self, position_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(ids (A, B, S), sample labels (B, S) or None)`` of a packed tensor, with or without its text row
        (the decoder drops it from 4-row tensors); ``(B, S)`` are plain 1D positions of text tokens."""
        p = position_ids
        if p.dim() == 2:
            p = self.text_only(p)
        if p.dim() == 3 and p.shape[0] in (self.rows + 1, self.rows):
            p = p[-self.rows :]
            if self.masked:
                return p[:-1], p[-1]
            return p, None
        raise ValueError(
            f"position_ids of shape {tuple(p.shape)} do not fit variant {self.label!r}: expected "
            f"({self.rows + 1}, B, S) from vlpe.integrations.transformers.position_ids, or (B, S) 1D positions"
        )

    # -- ids -----------------------------------------------------------------------------------------------------

    def prompt_position_ids(
        self,
        mm_token_type_ids: Tensor | None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        attention_mask: Tensor | None = None,
        second_per_grid_ts: Tensor | None = None,
        *,
        shape: tuple[int, int] | None = None,
        device=None,
        cu_seqlens=None,
    ) -> tuple[Tensor, Tensor]:
        """Packed ids ``(1 + rows, B, S)`` and ``rope_deltas`` of whole prompts (nothing cached); with
        ``cu_seqlens`` (packed rows) every sample's own ids, a restarting text row, and ``rope_deltas (n, 1)``."""
        if mm_token_type_ids is None:
            if image_grid_thw is not None or video_grid_thw is not None:
                raise ValueError(
                    "image_grid_thw / video_grid_thw given without mm_token_type_ids: pass the processor's "
                    "mm_token_type_ids (0 text, 1 image, 2 video per token)"
                )
            if shape is None:
                raise ValueError("text-only position ids need input_ids (or the batch shape)")
            mm_token_type_ids = torch.zeros(shape, dtype=torch.long, device=device)
        return prompt_position_ids(
            self.variant, family=self.family, spatial_merge_size=self.spatial_merge_size,
            mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            attention_mask=attention_mask, second_per_grid_ts=second_per_grid_ts, cu_seqlens=cu_seqlens,
        )  # fmt: skip

    def compute_3d_position_ids(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache=None,
        mm_token_type_ids: Tensor | None = None,
        second_per_grid_ts: Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        """Bound on the base model: prompt ids from vlpe; tokens after a cached prefix from the vlpe deltas.

        Whether tokens follow a cached prefix is decided without reading a device value: a cache whose length is a
        Python int (dynamic caches) tells it, and the prompt grids mean a prompt. A cache whose length is a tensor
        (static caches, as ``generate`` compiles them) is continued by :meth:`continue_position_ids`, which also
        places a prompt that starts at that cache (generate's prefill).

        Raises:
            ValueError: image / video grids after a cached prefix, a prepared 4D mask for a prompt, or a cache
                without ``rope_deltas``.
        """
        cache = kwargs.pop("past_key_values", cache)
        B, S = inputs_embeds.shape[:2] if inputs_embeds is not None else input_ids.shape
        device = inputs_embeds.device if inputs_embeds is not None else input_ids.device
        cached = 0 if cache is None else cache.get_seq_length()  # an int, or a 0-dim tensor (static caches)
        # generate() with a compileable (static) cache hands the model prepared 4D masks (a dict): the padding
        # of the prompt then comes from the ids computed when generation started
        mask = attention_mask if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 else None
        grids = image_grid_thw is not None or video_grid_thw is not None
        fresh = not isinstance(cached, Tensor) and cached == 0
        if grids and not fresh:
            if int(cached) != 0:  # a prompt with vision blocks: its ids are computed on the host anyway
                raise ValueError(
                    "image/video grids after a cached prefix are not supported by the vlpe patch: run the whole "
                    "prompt through one forward (or one generate call) so its vision blocks get their vlpe ids"
                )
            fresh = True
        if fresh:
            if not grids and self._pending is not None:
                found = self._from_pending(self._pending, mm_token_type_ids, S)
                if found is not None:  # the prompt of the running generate() call (+ its generated tokens)
                    pos, deltas, pads = found
                    self._remember(deltas, pads)
                    return pos.to(device)
            if attention_mask is not None and mask is None:
                raise ValueError(
                    "the vlpe patch computes prompt ids from a 2D (batch, seq) attention_mask (padding), not from a "
                    "prepared 4D mask"
                )
            pos, deltas = self.prompt_position_ids(
                mm_token_type_ids, image_grid_thw, video_grid_thw, mask, second_per_grid_ts,
                shape=(B, S), device=device,
            )
            self._remember(deltas, _pads(mask, B, S, device))
            return pos.to(device)
        return self.continue_position_ids(cached, (B, S), device=device, attention_mask=mask)

    def continue_position_ids(
        self, cached: int | Tensor, shape: tuple[int, int], *, device=None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Packed ids ``(1 + rows, B, S)`` of ``S`` tokens after ``cached`` cached ones (an int or a 0-dim tensor),
        with no read of a device value (compiled decoding).

        Every token is text placed at its real-token index + the remembered ``rope_deltas`` (any number of tokens
        at once: assisted decoding's candidates, after a cache crop too); their ``mm_token_type_ids`` are not read.
        Tokens that fall inside the prompt of the running ``generate()`` call (a static cache's prefill, a chunked
        prefill) take that prompt's own ids.

        Args:
            cached: tokens in the cache before these.
            shape: ``(B, S)`` of the new tokens.
            device: of the result.
            attention_mask: ``(B, L)`` 2D mask of the whole sequence so far, or None (the prompt's padding is the
                one remembered).

        Returns:
            The packed position tensor.

        Raises:
            ValueError: no ``rope_deltas`` were computed and the cache length is known to be > 0.
        """
        B, S = shape
        deltas = self.base.rope_deltas
        if deltas is None:
            if not isinstance(cached, Tensor) and self._pending is None:
                raise ValueError(
                    "a cache is present but no rope_deltas were computed: run the prompt through the model first"
                )
            deltas = torch.zeros(B, 1, dtype=torch.long, device=device)  # a text prompt (as transformers places it)
        deltas = deltas.to(device)
        deltas = deltas.repeat_interleave(B // deltas.shape[0], dim=0)
        position = torch.arange(S, device=device) + cached  # (S,) cache positions of the new tokens
        mask = attention_mask
        if mask is not None:  # real-token index from the mask of the whole sequence
            ids = mm.decode_position_ids(self.variant, deltas, position, attention_mask=mask)
            text_pos = (mask.long().cumsum(-1) - 1)[:, -S:]
        else:  # from the prompt's padding: every token after the prompt is real
            pads = self._pads
            pads = torch.zeros(B, 1, dtype=torch.long, device=device) if pads is None else pads.to(device)
            text_pos = position.expand(B, S) - pads.repeat_interleave(B // pads.shape[0], dim=0)
            ids = mm.decode_position_ids(self.variant, deltas, text_pos)
        pos = self.pack(text_pos, ids, torch.ones(B, S, dtype=torch.bool, device=device))
        return self._inside_pending(pos, cached, position)

    def _inside_pending(self, pos: Tensor, cached: int | Tensor, position: Tensor) -> Tensor:
        """``pos`` with the pending prompt's own ids at the cache positions ``position (S,)`` inside that prompt."""
        if self._pending is None:
            return pos
        stored, prompt, _, _ = self._pending
        B0, S0 = stored.shape
        B = pos.shape[1]
        if B % B0 or (not isinstance(cached, Tensor) and cached >= S0):
            return pos
        prompt = prompt.to(device=pos.device, dtype=pos.dtype).repeat_interleave(B // B0, dim=1)  # (R, B, S0)
        index = position.clamp(max=S0 - 1).view(1, 1, -1).expand(prompt.shape[0], B, -1)  # (R, B, S)
        return torch.where(position < S0, prompt.gather(-1, index), pos)

    def _remember(self, deltas: Tensor, pads: Tensor) -> None:
        """Keep what later tokens are placed from: ``rope_deltas`` (on the model, as transformers does) and the
        number of padding slots of every prompt."""
        self.base.rope_deltas = deltas
        self._pads = pads

    def _from_pending(self, pending: tuple, types: Tensor | None, S: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """Ids of ``S`` tokens starting with the ``pending`` prompt (computed when ``generate()`` started), if
        ``types`` are that prompt's (repeated for beams / ``num_return_sequences``), followed by text tokens:
        generated ones (``use_cache=False`` re-runs the whole sequence at every step) or assisted decoding's
        candidates, which the types may not cover yet."""
        stored, pos, deltas, pads = pending
        B0, S0 = stored.shape
        if types is None or types.dim() != 2 or not S0 <= types.shape[1] <= S or types.shape[0] % B0:
            return None
        k = types.shape[0] // B0
        stored = stored.to(types.device).repeat_interleave(k, dim=0)
        if not torch.equal(stored, types[:, :S0]) or bool((types[:, S0:] != 0).any()):
            return None
        dev = types.device
        pos, deltas, pads = (t.to(dev).repeat_interleave(k, dim=d) for t, d in ((pos, 1), (deltas, 0), (pads, 0)))
        n = S - S0
        if n:
            B = types.shape[0]
            text_pos = torch.arange(S0, S0 + n, device=dev).expand(B, n) - pads  # generated tokens are real
            ids = mm.decode_position_ids(self.variant, deltas, text_pos)
            pos = torch.cat([pos, self.pack(text_pos, ids, torch.ones(B, n, dtype=torch.bool, device=dev))], -1)
        return pos, deltas, pads

    def prepare_position_ids_for_generation(self, inputs_tensor: Tensor, model_kwargs: dict) -> None:
        """Bound on the generation model: ``generate()`` computes no ``position_ids`` of its own.

        ``generate()`` hands the grids to the vision encoder (and drops them) before the first forward, so the
        prompt's ids are computed here while the grids are at hand; the first forward takes them after checking
        its ``mm_token_type_ids`` (repeated for beams / ``num_return_sequences``). Every later step is placed from
        the vlpe ``rope_deltas``.

        Assisted decoding calls ``generate()`` of the assistant with the prompt's ``mm_token_type_ids`` but without
        its grids (the vision features come encoded, ``mm_encoder_outputs``). The model itself as its assistant
        keeps the ids of the running call; another assistant places the prompt's vision tokens as text, as
        transformers does without grids, with a warning: only its drafts depend on them, never the output.

        Raises:
            ValueError: vision tokens after a cached prefix (continuing generation with new images / videos).
        """
        pending, self._pending = self._pending, None
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        types = model_kwargs.get("mm_token_type_ids")
        cached = 0 if cache is None else int(cache.get_seq_length())  # once per generate() call, on the host
        if cached > 0:
            if types is not None and types.dim() == 2 and bool((types[:, cached:] != 0).any()):
                raise ValueError(
                    "image/video tokens after a cached prefix are not supported by the vlpe patch: run the whole "
                    "prompt through one generate call (or one forward) so its vision blocks get their vlpe ids"
                )
            return None
        if "input_ids" in model_kwargs and model_kwargs["input_ids"].shape[1] > 0:
            inputs_tensor = model_kwargs["input_ids"]
        shape = tuple(inputs_tensor.shape[:2])
        device = inputs_tensor.device
        grids = model_kwargs.get("image_grid_thw") is not None or model_kwargs.get("video_grid_thw") is not None
        placed, seconds = types, model_kwargs.get("second_per_grid_ts")
        if types is None:  # text: ids kept for a static cache's prefill (the first forward computes its own)
            types = placed = torch.zeros(shape, dtype=torch.long, device=device)
        elif not grids and bool((types != 0).any()):
            found = None if pending is None else self._from_pending(pending, types, shape[1])
            if found is not None:  # the model is the assistant of its own running generate() call
                self._pending = pending
                self._remember(found[1], found[2])
                return None
            if model_kwargs.get("mm_encoder_outputs"):
                warnings.warn(
                    "vlpe: generate() got vision features (mm_encoder_outputs) without their image_grid_thw / "
                    "video_grid_thw (the assistant of assisted decoding does): the prompt's vision tokens are placed "
                    "as text, as transformers places them without grids; pass the grids for the variant's ids",
                    stacklevel=2,
                )
                placed, seconds = torch.zeros_like(types), None
        mask = model_kwargs.get("attention_mask")
        mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        pos, deltas = self.prompt_position_ids(
            placed, model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw"), mask,
            seconds, shape=shape, device=device,
        )
        pads = _pads(mask, *shape, device)
        self._pending = (types.clone(), pos, deltas, pads)
        self._remember(deltas, pads)
        return None

    def get_rope_index(
        self,
        input_ids: Tensor | None = None,
        mm_token_type_ids: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        attention_mask: Tensor | None = None,
        second_per_grid_ts: Tensor | None = None,
        **kwargs,
    ) -> tuple[Tensor, Tensor]:
        """Bound on the base model (Hugging Face signature): the design's ids ``(A, B, S)`` and ``rope_deltas``."""
        shape = None if input_ids is None else tuple(input_ids.shape)
        device = None if input_ids is None else input_ids.device
        pos, deltas = self.prompt_position_ids(
            mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts,
            shape=shape, device=device,
        )
        ids, _ = self.unpack(pos)
        return ids, deltas
