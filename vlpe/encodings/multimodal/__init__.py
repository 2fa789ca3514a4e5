"""Multimodal rotary position encodings for VLM decoders: position designs x frequency allocations.

Every multimodal RoPE splits into a *position design* (token layout -> ``position_ids (A, B, S)`` and
``rope_deltas (B, 1)``) and a *frequency allocation* (which rotary pair, or KV head, reads which axis).
A named variant is one of each; any design pairs with any allocation through :class:`Variant`.

>>> from vlpe.encodings import multimodal as mm
>>> ids, deltas = mm.position_ids("mrope", mm_token_type_ids, grid_thw, attention_mask=None,
...                               spatial_merge_size=2)                     # doctest: +SKIP
>>> cos, sin = mm.rotary("mrope", ids, head_dim=128, theta=1e6)           # doctest: +SKIP
>>> ids_new = mm.decode_position_ids("mrope", deltas, cache_position)     # doctest: +SKIP
>>> ids, deltas = mm.position_ids("mrope", types, grid_thw, cu_seqlens=cu)  # packed row  # doctest: +SKIP

API (Hugging Face 5.x conventions):

* ``position_ids(variant, mm_token_type_ids, grid_thw, attention_mask=None, spatial_merge_size=2,
  *, cu_seqlens=None, pad_position=1, dtype=None, validate=True, **options)
  -> (ids (A, B, S), deltas (B, 1))``.
  ``mm_token_type_ids`` (B, S): 0 text, 1 image, 2 video; ``grid_thw`` (blocks, 3) in patches before merging,
  in order of appearance over the batch (:func:`merge_grids` interleaves HF's ``image_grid_thw`` and
  ``video_grid_thw``). Vectorised (cumsum / searchsorted / gather), no host syncs but the one boolean of
  ``validate``. Integer designs return int64, fractional ones float32. Padding slots get ``pad_position``.
  ``deltas`` = next free position - number of real tokens (PyPE: ``(B, depth)``, one per layer).
  Packed rows: ``cu_seqlens`` (cumulative sample lengths from 0, as flash-attention's varlen kernels take them:
  one 1-D tensor over the flattened ``B * S`` tokens, or one per row) gives every sample exactly its ids alone,
  and ``deltas (n, 1)``, one per sample in order; :func:`text_position_ids` is the matching restarting 1D row.
* ``rotary(variant, ids, *, head_dim, theta=None, num_kv_heads=None, allocation=None, section=None,
  rotary_dim=None, inv_freq=None, attention_scaling=1.0, layer=None, dtype=float32) -> (cos, sin)``:
  ``(B, S, head_dim)`` half-layout tables for transformers' ``apply_rotary_pos_emb``;
  ``(B, H_kv, S, head_dim)`` for the per-head ``multi_head`` allocation (apply with
  :func:`apply_rotary_pos_emb`, GQA aware); PyPE ``(depth, B, S, head_dim)`` or one ``layer``'s table.
* ``decode_position_ids(variant, rope_deltas, cache_position, *, attention_mask=None) -> (A, B, n)``: ids
  of generated text tokens; prompt ids + these equal the ids of the whole sequence computed at once.
* ``rotary`` is ``frequencies(variant, ...)`` (the scaled ``(A, K)`` frequency matrix, built on the device once per
  allocation: the allocation map is cached per device) then ``tables(ids, F, ...)``
  (:mod:`vlpe.encodings.multimodal.rotary`); a caller that keeps ``F`` per device calls ``tables`` alone.
* ``Variant(design, allocation, design_options={}, section=None, theta=...)``: one object for the functional API,
  the registered encodings (each holds its :data:`VARIANTS` object; ``encoding(variant, dim=..., num_heads=...)``
  for any other) and the transformers integration (``patch_of(model).variant``); ``variant.with_options(...)``
  merges design options, an allocation, a section or theta into a new one. ``VARIANTS``, ``DESIGNS``,
  ``ALLOCATIONS``; ``allocation_map(...)`` (pair -> axis census); ``pype_attention_mask(ids, layer,
  cu_seqlens=None)``; ``packed_samples(cu_seqlens, B, S)`` (which sample every token of a packed batch is in).
* Designs and allocations are data that declare their facts (:class:`Design`: ``axes``, ``layered``,
  ``needs_mask``, ``split_frames``; :class:`Allocation`: ``axes``, ``one_axis``, ``per_head``, ...);
  a variant reads them (``num_axes()``, ``layered``, ``masked``, ``per_head``) and no caller compares names.
  Modules import downwards only: samples, layout < designs, allocations < variants < rotary < encodings.

Variants: ``rope1d`` (1d + none), ``mrope`` (grid + chunked), ``qwen25vl`` (absolute_time + chunked),
``mrope_i`` (grid + interleaved; ``spatial_reset=True`` option), ``qwen3vl`` (per_frame + interleaved),
``qwen35`` (per_frame + round_robin, a quarter of the head rotating: ``Variant.partial_rotary_factor``),
``mhrope`` (grid + multi_head), ``ilrope`` (per_frame with spatial reset + interleaved), ``omnirope`` (the same
ids + chunked), ``mmrope`` (scaled_frames + distributed), ``circlerope`` (circle + chunked),
``videorope`` (diagonal, delta 2 + low_freq_temporal), ``hope_video``
(diagonal, gamma + hybrid), ``vrope`` (vrope + interleaved over 4 axes), ``v2pe`` (v2pe + none),
``pype`` (pype + none, per layer). Each is also a registered vlpe encoding
(``vlpe.encodings.build("mrope_i", dim=..., num_heads=..., num_axes=3)``) that takes
``vlpe.Positions(ids.permute(1, 2, 0))``; ``rope1d`` is the core 1D decoder RoPE.

Position ids follow each method's released code; for Qwen2-VL text after a vision block resumes at the
maximum over all axes + 1 (the released semantics, not transformers 5.x's ``max(h, w)`` advance).
"""

from .allocations import ALLOCATIONS, Allocation, allocation_map, default_section, frequency_matrix, get_allocation
from .designs import DESIGNS, HOPE_SCALES, V2PE_STRIDES, Design, get_design
from .layout import Samples, TokenLayout, packed_samples, token_layout
from .rotary import apply_rotary_pos_emb, rotary
from .encodings import encoding
from .variants import (
    VARIANTS,
    Variant,
    decode_position_ids,
    get_variant,
    merge_grids,
    position_ids,
    pype_attention_mask,
    text_position_ids,
)

__all__ = [
    "ALLOCATIONS",
    "Allocation",
    "DESIGNS",
    "VARIANTS",
    "HOPE_SCALES",
    "V2PE_STRIDES",
    "Design",
    "Samples",
    "TokenLayout",
    "Variant",
    "allocation_map",
    "apply_rotary_pos_emb",
    "decode_position_ids",
    "default_section",
    "encoding",
    "frequency_matrix",
    "get_allocation",
    "get_design",
    "get_variant",
    "merge_grids",
    "packed_samples",
    "position_ids",
    "pype_attention_mask",
    "rotary",
    "text_position_ids",
    "token_layout",
]
