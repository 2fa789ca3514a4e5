"""Switch a Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL model to any vlpe multimodal RoPE variant.

Works on transformers 5.x through its public hooks, on ``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration`` and their base ``*Model``::

    from transformers import Qwen2VLForConditionalGeneration
    from vlpe.integrations import transformers as vlpe_hf
    model = Qwen2VLForConditionalGeneration.from_pretrained("Qwen/Qwen2-VL-2B-Instruct")
    vlpe_hf.apply(model, "mrope_i")                     # position ids, rotary and generation follow MRoPE-I
    out = model.generate(**inputs, max_new_tokens=32)  # inputs from the model's processor, as usual

``vlpe_hf.remove(model)`` restores the stock model. ``variant`` is any name of
:data:`vlpe.encodings.multimodal.VARIANTS` or a :class:`vlpe.encodings.multimodal.Variant` (any position design
with any frequency allocation); ``options`` are the design's options (``spatial_reset=True``,
``temporal_scale=0.75``, ``stride=64`` ...) plus ``section``, ``allocation`` and ``theta`` for the rotary.

What :func:`apply` changes, all of it undone by :func:`remove`:

- ``language_model.rotary_emb`` becomes a :class:`MultimodalRotary` (``forward(x, position_ids) -> (cos, sin)``,
  Hugging Face half layout) built on :func:`vlpe.encodings.multimodal.rotary`, with the model's own inverse
  frequencies (so static rope scaling such as YaRN carries over) and ``rope_theta``. The config's
  ``rope_parameters`` scaling holds for every variant: ``linear`` / ``yarn`` (and any static type) through those
  frequencies, ``dynamic`` (NTK, recomputed from each forward's largest position id as transformers does while
  positions grow) through vlpe's NTK scaling; with ``theta=`` the linear / yarn / dynamic scaling of the config is
  applied by vlpe to that theta, and ``scaling=`` (a vlpe scaling dict, e.g. ``{"type": "yarn", "factor": {"t": 4},
  "original_size": 32768}`` to stretch only time) replaces the config's. When the variant uses the
  model's native allocation (chunked for Qwen2/2.5-VL, interleaved for Qwen3-VL) and no ``section`` is given, the
  config's ``mrope_section`` is used, so ``mrope`` / ``qwen25vl`` / ``qwen3vl`` reproduce the released models.
- The base model's ``compute_3d_position_ids`` and ``get_rope_index`` are replaced on the instance: the prompt's
  ids come from :func:`vlpe.encodings.multimodal.position_ids` (the released semantics of each design, not the
  installed transformers' 5.x re-implementation), ``rope_deltas`` are the design's, and every token that follows
  a cached prefix is placed by :func:`vlpe.encodings.multimodal.decode_position_ids` (cache position + delta).
- ``generate()`` no longer precomputes ``position_ids`` (its ``last + 1`` extension is wrong whenever a prompt
  ends inside a vision block, and per layer for PyPE); because it hands the grids to the vision encoder before the
  first forward, the prompt's ids are computed when generation starts and picked up by the first forward after
  checking its ``mm_token_type_ids``. Assisted decoding (``assistant_model=``: several candidates per step, cache
  crops), static caches and ``torch.compile(fullgraph=True)`` decoding (``compile_config``) work as on the stock
  model: tokens after a cached prefix are placed without reading a device value
  (:meth:`PositionIds.continue_position_ids`).
- Per-head tables (``multi_head`` allocation, MHRoPE): forward hooks on every decoder attention's query and key
  modules (the projections; Qwen3-VL's head-wise norms) rotate every head by its KV head's axis, and the layer's
  own ``apply_rotary_pos_emb`` gets identity tables. No modeling file is touched, so other models (and other
  copies of this one) are unaffected.
- Layer-dependent designs (PyPE) get a forward pre-hook on every decoder attention that picks the layer's own
  tables from the ``position_embeddings`` it receives (``(cos, sin, ids, labels)``) and builds its mask; the mask
  runs through a registered attention function (``vlpe_sdpa`` / ``vlpe_eager`` in
  :class:`transformers.AttentionInterface`) set on the text model's config only.

Everything lives on the model instance (:class:`Patch` is the rotary module's ``patch``; hooks and shadowed methods
are its bound methods), so ``copy.deepcopy(model)`` gives an independently patched copy (``remove`` on either
leaves the other as it was), ``torch.save(model)`` / ``torch.load(..., weights_only=False)`` round-trips a patched
model, and models patched with different variants run side by side in one process. The rotary module computes its
frequency matrix once per device and keeps it (no host-to-device copy per forward).

Export (:mod:`.export`, :mod:`.stock`): a patched model's ``state_dict`` has the stock model's keys (the stock
rotary's tensors are held by :class:`MultimodalRotary` under their own names), and :func:`apply` records the variant
and its options in ``model.config.vlpe`` (``{"format": 1, "variant": name or {"design", "allocation", ...},
"options": {...}}``, see :func:`variant_record`; :func:`remove` deletes it). ``model.save_pretrained(DIR)`` of a
patched model is :func:`save_pretrained` (which also takes ZeRO-3-gathered weights, the processor and the
preprocessing a run trained on): where the family's own config expresses the patch (its own design, another
``mrope_section``, ``rope_theta``) those settings are written and stock transformers computes vlpe's logits; any
other patch gets rope types that name vlpe, so stock loaders refuse the folder rather than run stock positions.
:func:`from_pretrained` (or ``apply(model)`` with no variant on a model loaded with :func:`load_config`) restores
the patch exactly::

    vlpe_hf.save_pretrained(model, "out", processor=processor)   # config.json: "vlpe": {"variant": "mrope_i", ...}
    model = vlpe_hf.from_pretrained("out")                        # patched with mrope_i and the same options

Ids for a collator: :func:`position_ids` (or :func:`pack_position_ids` of ids computed with
:func:`vlpe.encodings.multimodal.position_ids`) returns the packed tensor to pass as ``model(..., position_ids=...)``.
Do not pass ``position_ids`` to ``generate()`` of a patched model: let it compute them.

Packed rows (several samples per row, for training): ``position_ids(model, ..., cu_seqlens=cu)`` gives every
sample its own ids and a text row that restarts at every sample (:func:`vlpe.encodings.multimodal.text_position_ids`).
Run the forward with those ``position_ids``, without ``attention_mask`` and without a cache (``use_cache=False``):
transformers builds a block-diagonal causal mask from the text row of a 4-row tensor (3-axis designs), the patch
builds the same mask for every other row count (1D designs, VRoPE, PyPE), and PyPE's own mask keeps to each
sample, so every sample's logits equal those of the sample run alone. Padding goes inside a sample (e.g. at the end
of a row's last one) and into the ``attention_mask`` given to :func:`position_ids` only: its slots get text
position 0, so each attends to itself alone. Under a flash-type attention (``flash_attention_2`` ...; see
:data:`attention.VARLEN_ATTENTION`) the same text row gives the varlen metadata (``cu_seq_lens_q/k``,
``max_length_q/k``) the patch hands every layer, for any row count and batch size. Padding between two real tokens
of one packed sample is refused (it would restart the sample's text positions).
"""


from .attention import register_attention
from .export import (
    keep_used_conversions,
    load_config,
    from_pretrained,
    recorded_preprocessing,
    recorded_variant,
    save_pretrained,
)
from .ids import pack_position_ids, prompt_position_ids
from .patch import Patch, apply, patch_of, position_ids, read_record, remove, variant_record
from .rotary import MultimodalRotary, RotarySettings

__all__ = [
    "Patch",
    "MultimodalRotary",
    "RotarySettings",
    "apply",
    "remove",
    "patch_of",
    "position_ids",
    "pack_position_ids",
    "prompt_position_ids",
    "register_attention",
    "save_pretrained",
    "from_pretrained",
    "recorded_variant",
    "recorded_preprocessing",
    "load_config",
    "keep_used_conversions",
    "variant_record",
    "read_record",
]
