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
  checking its ``mm_token_type_ids``.
- Per-head tables (``multi_head`` allocation, MHRoPE) are rotated by a delegating wrapper around the modeling
  file's ``apply_rotary_pos_emb`` (tables of the stock ``(B, S, D)`` shape go to the original function, so other
  models are untouched); it is installed once per modeling file and restored with the last patched model.
- Layer-dependent designs (PyPE) get a forward pre-hook on every decoder attention that hands the layer its own
  tables and mask; the mask runs through a registered attention function (``vlpe_sdpa`` / ``vlpe_eager`` in
  :class:`transformers.AttentionInterface`) set on the text model only.

Ids for a collator: :func:`position_ids` returns the packed tensor to pass as ``model(..., position_ids=...)``.
Do not pass ``position_ids`` to ``generate()`` of a patched model: let it compute them.

Packed rows (several samples per row, for training): ``position_ids(model, ..., cu_seqlens=cu)`` gives every
sample its own ids and a text row that restarts at every sample (:func:`vlpe.encodings.multimodal.text_position_ids`).
Run the forward with those ``position_ids``, without ``attention_mask`` and without a cache (``use_cache=False``):
transformers builds a block-diagonal causal mask from the text row of a 4-row tensor (3-axis designs), the patch
builds the same mask for every other row count (1D designs, VRoPE, PyPE), and PyPE's own mask keeps to each
sample, so every sample's logits equal those of the sample run alone. Padding goes inside a sample (e.g. at the end
of a row's last one) and into the ``attention_mask`` given to :func:`position_ids` only: its slots get text
position 0, so each attends to itself alone. Flash attention reads the text row of 4-row tensors only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vlpe.encodings import multimodal as mm
from vlpe.encodings.functional.rope import inv_freq as inv_freq_of
from vlpe.encodings.functional.scaling import parse_scaling, scale_frequencies

__all__ = ["Patch", "MultimodalRotary", "apply", "remove", "patch_of", "position_ids", "pack_position_ids"]

_MASK_BASES = ("sdpa", "eager")
_ROTARY_KEYS = ("allocation", "section", "theta", "scaling")
_NATIVE_ALLOCATION = {"qwen2_vl": "chunked", "qwen2_5_vl": "chunked", "qwen3_vl": "interleaved"}
_RUNTIME_ROPE_TYPES = ("longrope",)  # inv_freq switches with the sequence length (dynamic NTK is handled)


# ----------------------------------------------------------------------------------------------------------------
# Model discovery
# ----------------------------------------------------------------------------------------------------------------


def _base_classes() -> dict[type, str]:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return {Qwen2VLModel: "qwen2_vl", Qwen2_5_VLModel: "qwen2_5_vl", Qwen3VLModel: "qwen3_vl"}


def _locate(model: nn.Module) -> tuple[nn.Module, str]:
    """The ``*Model`` holding ``language_model`` and ``rope_deltas``, and the model family."""
    bases = _base_classes()
    for candidate in (model, getattr(model, "model", None)):
        for cls, family in bases.items():
            if isinstance(candidate, cls):
                return candidate, family
    names = ", ".join(c.__name__ for c in bases)
    raise ValueError(
        f"vlpe.integrations.transformers expects a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model ({names} or their "
        f"*ForConditionalGeneration), got {type(model).__name__}"
    )


# ----------------------------------------------------------------------------------------------------------------
# The rotary module
# ----------------------------------------------------------------------------------------------------------------


class _Tables(tuple):
    """``(cos, sin)`` as the decoder hands it to every layer, plus what the per-layer pre-hook needs.

    ``layered``: cos/sin carry a leading layer axis. ``ids``/``valid``: the design's ids ``(L, B, S)`` and the
    sample label ``(B, S)`` of the current tokens (0 padding, else the packed sample's number + 1), for layer masks.
    """

    layered: bool = False
    ids: Tensor | None = None
    valid: Tensor | None = None


class MultimodalRotary(nn.Module):
    """Replacement for the decoder's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.

    ``position_ids`` is the packed tensor of :meth:`Patch.pack` (with or without the Hugging Face text row
    that the decoder strips from 4-row tensors), or plain 1D positions (``(B, S)``, or the decoder's 3-row
    default) for text-only calls. Tables are ``(B, S, D)``, ``(B, H_kv, S, D)`` for head-wise allocations, with a
    leading layer axis for PyPE. Not named ``*RotaryEmbedding`` on purpose: ``PreTrainedModel._init_weights``
    recomputes the buffers of modules with that name.
    """

    def __init__(self, patch: Patch, inv_freq: Tensor | None, dynamic: tuple[float, float] | None = None):
        super().__init__()
        self._patch = patch
        # fp32 frequencies kept off the module's buffers: model.to(bfloat16) must not round them
        self._inv_freq = inv_freq
        self._dynamic = dynamic  # (factor, max_position_embeddings) of rope_type "dynamic"

    def _frequencies(self, ids: Tensor) -> dict[str, Tensor]:
        if self._inv_freq is None:
            return {}
        if self._inv_freq.device != ids.device:
            self._inv_freq = self._inv_freq.to(ids.device)
        if self._dynamic is None:
            return {"inv_freq": self._inv_freq}
        # transformers' dynamic NTK: alpha = factor * L / L0 - (factor - 1) for the length L = max id + 1 (at least
        # L0), i.e. base theta * alpha ** (d / (d - 2)): vlpe's ntk scaling with a factor computed on device
        factor, L0 = self._dynamic
        K = self._inv_freq.numel()
        L = ids.amax().to(torch.float64) + 1
        alpha = (factor * torch.clamp_min(L, L0) / L0 - (factor - 1)).view(1, 1)  # (A = 1, 1)
        theta = self._patch.rotary_kwargs["theta"]
        freqs = scale_frequencies(self._inv_freq.view(1, K), _NTK, lo=theta ** (-(K - 1) / K), num_pairs=K, factor=alpha)
        return {"inv_freq": freqs[0]}

    def extra_repr(self) -> str:
        return f"variant={self._patch.label!r}"

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        patch = self._patch
        ids, valid = patch.unpack(position_ids, x.shape[0])
        cos, sin = mm.rotary(patch.variant, ids, dtype=x.dtype, **patch.rotary_kwargs, **self._frequencies(ids))
        tables = _Tables((cos, sin))
        tables.layered = patch.layered
        if patch.masked:
            tables.ids, tables.valid = ids, valid
        return tables


# ----------------------------------------------------------------------------------------------------------------
# Per-head rotation (MHRoPE): a delegating wrapper around the modeling file's apply_rotary_pos_emb
# ----------------------------------------------------------------------------------------------------------------

_ROTATION_WRAPPERS: dict[str, list] = {}  # modeling module name -> [original function, number of patched models]


def _per_head_rotation(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if cos.dim() == 4:  # (B, H_kv, S, D) per-head tables from MultimodalRotary
            if unsqueeze_dim != 1:
                raise ValueError("per-head rotary tables need q/k laid out (B, H, S, D) (unsqueeze_dim=1)")
            return mm.apply_rotary_pos_emb(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _install_rotation(module_name: str) -> None:
    entry = _ROTATION_WRAPPERS.get(module_name)
    if entry is None:
        mod = sys.modules[module_name]
        _ROTATION_WRAPPERS[module_name] = [mod.apply_rotary_pos_emb, 1]
        mod.apply_rotary_pos_emb = _per_head_rotation(mod.apply_rotary_pos_emb)
    else:
        entry[1] += 1


def _uninstall_rotation(module_name: str) -> None:
    entry = _ROTATION_WRAPPERS.get(module_name)
    if entry is None:  # already restored (e.g. a deep copy of a patched model removed twice)
        return
    entry[1] -= 1
    if entry[1] == 0:
        sys.modules[module_name].apply_rotary_pos_emb = entry[0]
        del _ROTATION_WRAPPERS[module_name]


# ----------------------------------------------------------------------------------------------------------------
# Attention with a design's own mask (registered in transformers.AttentionInterface)
# ----------------------------------------------------------------------------------------------------------------


def _masked_attention(base: str):
    """Attention function ``vlpe_<base>``: runs ``base`` with the ``vlpe_keep`` mask a layer hook passed, if any."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        keep = kwargs.pop("vlpe_keep", None)  # (B, 1, S, S) bool: the whole sequence is in this forward
        if keep is not None:
            S, K = keep.shape[-1], key.shape[-2]
            if query.shape[-2] != S or K < S:
                raise ValueError(f"a layer mask for {S} tokens met {query.shape[-2]} queries and {K} keys")
            # a query that may see no key (padding) sees itself, so that no row of the softmax is empty
            eye = torch.eye(S, dtype=torch.bool, device=keep.device)
            keep = keep | (eye & ~keep.any(-1, keepdim=True))
            if K > S:  # a static cache: slots beyond the prompt are empty
                keep = torch.nn.functional.pad(keep, (0, K - S), value=False)
            if base == "eager":
                attention_mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device)
                attention_mask = attention_mask.masked_fill(~keep.to(query.device), torch.finfo(query.dtype).min)
            else:
                attention_mask = keep.to(query.device)
        if base == "eager":
            impl = sys.modules[type(module).__module__].eager_attention_forward
        else:
            impl = ALL_ATTENTION_FUNCTIONS[base]
        return impl(module, query, key, value, attention_mask, **kwargs)

    return attention


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for base in _MASK_BASES:
        AttentionInterface.register(f"vlpe_{base}", _masked_attention(base))
        AttentionMaskInterface.register(f"vlpe_{base}", masks[base])


# ----------------------------------------------------------------------------------------------------------------
# The patch
# ----------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Patch:
    """Everything :func:`apply` changed on one model, the variant's settings, and how to undo it (:meth:`remove`)."""

    model: nn.Module = field(repr=False)
    base: nn.Module = field(repr=False)
    family: str
    variant: mm.Variant
    design_options: dict[str, Any]
    rotary_kwargs: dict[str, Any]
    spatial_merge_size: int
    num_axes: int
    per_head: bool
    layered: bool
    masked: bool
    _undo: list = field(default_factory=list, repr=False)
    _pending: tuple | None = field(default=None, repr=False)
    _pads: Tensor | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return self.variant.label

    @property
    def rows(self) -> int:
        """Rows of the packed position tensor after the Hugging Face text row: ids, then the real-token mask."""
        return self.num_axes + int(self.masked)

    # -- packed position tensor ----------------------------------------------------------------------------------

    def pack(self, text_pos: Tensor, ids: Tensor, valid: Tensor | None) -> Tensor:
        """``(1 + rows, B, S)``: the Hugging Face 1D text row (packing, FA2), the design's ids, and for masked
        designs the sample label of every token (0 padding; 1, or the packed sample's number + 1). Float when the
        ids are."""
        return _stack(text_pos, ids, valid if self.masked else None)

    def unpack(self, position_ids: Tensor, batch: int) -> tuple[Tensor, Tensor | None]:
        """``(ids (A, B, S), sample labels (B, S) or None)`` from whatever reaches the rotary module."""
        p = position_ids
        if p.dim() == 2 or (p.dim() == 3 and p.shape[0] > 1 and p.stride(0) == 0):
            # plain 1D positions, or the decoder's default / 2D input expanded over its axes: text only
            text = (p if p.dim() == 2 else p[0]).expand(batch, -1)
            deltas = torch.zeros(batch, 1, dtype=text.dtype, device=text.device)
            ids = mm.decode_position_ids(self.variant, deltas, text, **self._decode_options())
            return ids, (torch.ones_like(text, dtype=torch.bool) if self.masked else None)
        if p.dim() == 3 and p.shape[0] in (self.rows + 1, self.rows):
            p = p[-self.rows :]  # drop the text row unless the decoder already did
            if self.masked:
                return p[:-1], p[-1]
            return p, None
        raise ValueError(
            f"position_ids of shape {tuple(p.shape)} do not fit variant {self.label!r}: expected "
            f"({self.rows + 1}, B, S) from vlpe.integrations.transformers.position_ids, or (B, S) 1D positions"
        )

    def _decode_options(self) -> dict[str, Any]:
        return {"depth": self.num_axes} if self.layered else {}

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
        types = mm_token_type_ids.long()
        B, S = types.shape
        if attention_mask is not None and (attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, S)):
            raise ValueError(
                f"attention_mask must be a 2D (batch, seq) padding mask matching mm_token_type_ids {(B, S)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        options = dict(self.design_options)
        if video_grid_thw is not None and self.family == "qwen3_vl":
            # Qwen3-VL emits every temporal patch as its own block after a timestamp: one T = 1 grid each
            frames = video_grid_thw[:, 0]
            video_grid_thw = video_grid_thw.repeat_interleave(frames, dim=0)
            video_grid_thw[:, 0] = 1
            if second_per_grid_ts is not None:
                spg = torch.as_tensor(second_per_grid_ts)
                second_per_grid_ts = spg.repeat_interleave(frames.to(spg.device))
        if second_per_grid_ts is not None and "second_per_grid_ts" in self._design_defaults:
            options.setdefault("second_per_grid_ts", second_per_grid_ts)
        grid, _ = mm.merge_grids(types, image_grid_thw, video_grid_thw, attention_mask, self.spatial_merge_size)
        ids, deltas = mm.position_ids(
            self.variant, types, grid, attention_mask, self.spatial_merge_size, cu_seqlens=cu_seqlens, **options
        )
        return pack_position_ids(ids, attention_mask, masked=self.masked, cu_seqlens=cu_seqlens), deltas

    @property
    def _design_defaults(self) -> dict[str, Any]:
        return mm.DESIGNS[self.variant.design].defaults

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
        """Bound on the base model: prompt ids from vlpe; tokens after a cached prefix from the vlpe deltas."""
        cache = kwargs.pop("past_key_values", cache)
        B, S = inputs_embeds.shape[:2] if inputs_embeds is not None else input_ids.shape
        device = inputs_embeds.device if inputs_embeds is not None else input_ids.device
        cached = 0 if cache is None else cache.get_seq_length()
        # generate() with a compileable (static) cache hands the model prepared 4D masks (a dict): the padding
        # of the prompt then comes from the ids computed when generation started
        mask = attention_mask if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 else None
        if cached == 0:
            if image_grid_thw is None and video_grid_thw is None and self._pending is not None:
                found = self._from_pending(mm_token_type_ids)
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
        # tokens after a cached prefix: text placed at cache position + rope delta
        if S > 1 and mm_token_type_ids is not None and bool((mm_token_type_ids[:, -S:] != 0).any()):
            raise ValueError(
                "image/video tokens after a cached prefix are not supported by the vlpe patch: run the whole prompt "
                "through one forward (or one generate call) so its vision blocks get their vlpe ids"
            )
        deltas = self.base.rope_deltas
        if deltas is None:
            raise ValueError(
                "a cache is present but no rope_deltas were computed: run the prompt through the model first"
            )
        deltas = deltas.to(device)
        deltas = deltas.repeat_interleave(B // deltas.shape[0], dim=0)
        cache_position = torch.arange(cached, cached + S, device=device)
        if mask is not None:  # real-token index from the mask of the whole sequence
            ids = mm.decode_position_ids(
                self.variant, deltas, cache_position, attention_mask=mask, **self._decode_options()
            )
            text_pos = (mask.long().cumsum(-1) - 1)[:, -S:]
        else:  # from the prompt's padding: every token after the prompt is real
            pads = self._pads
            pads = torch.zeros(B, 1, dtype=torch.long, device=device) if pads is None else pads.to(device)
            text_pos = cache_position.expand(B, S) - pads.repeat_interleave(B // pads.shape[0], dim=0)
            ids = mm.decode_position_ids(self.variant, deltas, text_pos, **self._decode_options())
        return self.pack(text_pos, ids, torch.ones(B, S, dtype=torch.bool, device=device))

    def _remember(self, deltas: Tensor, pads: Tensor) -> None:
        """Keep what later tokens are placed from: ``rope_deltas`` (on the model, as transformers does) and the
        number of padding slots of every prompt."""
        self.base.rope_deltas = deltas
        self._pads = pads

    def _from_pending(self, types: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
        """Ids of the prompt computed when ``generate()`` started, if ``types`` are that prompt's (repeated for
        beams / ``num_return_sequences``), followed by generated text tokens (``use_cache=False`` re-runs the
        whole sequence at every step)."""
        stored, pos, deltas, pads = self._pending
        B0, S0 = stored.shape
        if types is None or types.dim() != 2 or types.shape[1] < S0 or types.shape[0] % B0:
            return None
        k = types.shape[0] // B0
        stored = stored.to(types.device).repeat_interleave(k, dim=0)
        if not torch.equal(stored, types[:, :S0]) or bool((types[:, S0:] != 0).any()):
            return None
        dev = types.device
        pos, deltas, pads = (t.to(dev).repeat_interleave(k, dim=d) for t, d in ((pos, 1), (deltas, 0), (pads, 0)))
        n = types.shape[1] - S0
        if n:
            B = types.shape[0]
            text_pos = torch.arange(S0, S0 + n, device=dev).expand(B, n) - pads  # generated tokens are real
            ids = mm.decode_position_ids(self.variant, deltas, text_pos, **self._decode_options())
            pos = torch.cat([pos, self.pack(text_pos, ids, torch.ones(B, n, dtype=torch.bool, device=dev))], -1)
        return pos, deltas, pads

    def prepare_position_ids_for_generation(self, inputs_tensor: Tensor, model_kwargs: dict) -> None:
        """Bound on the generation model: ``generate()`` computes no ``position_ids`` of its own.

        ``generate()`` hands the grids to the vision encoder (and drops them) before the first forward, so the
        prompt's ids are computed here while the grids are at hand; the first forward takes them after checking
        its ``mm_token_type_ids`` (repeated for beams / ``num_return_sequences``). Every later step is placed from
        the vlpe ``rope_deltas``.
        """
        self._pending = None
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        types = model_kwargs.get("mm_token_type_ids")
        if types is None or (cache is not None and cache.get_seq_length() > 0):
            return None
        if "input_ids" in model_kwargs and model_kwargs["input_ids"].shape[1] > 0:
            inputs_tensor = model_kwargs["input_ids"]
        mask = model_kwargs.get("attention_mask")
        mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        pos, deltas = self.prompt_position_ids(
            types, model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw"), mask,
            model_kwargs.get("second_per_grid_ts"), shape=tuple(inputs_tensor.shape[:2]), device=inputs_tensor.device,
        )
        self._pending = (types.clone(), pos, deltas, _pads(mask, *types.shape, types.device))
        self.base.rope_deltas = deltas
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
        ids, _ = self.unpack(pos, pos.shape[1])
        return ids, deltas

    def attention_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of every decoder attention: the layer's own tables (PyPE) and mask."""
        tables = kwargs.get("position_embeddings")
        if not isinstance(tables, _Tables):
            return None
        layer = module.layer_idx
        cos, sin = tables
        if tables.layered:
            cos, sin = cos[layer], sin[layer]
        kwargs = dict(kwargs)
        kwargs["position_embeddings"] = (cos, sin)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if tables.ids is not None and (cache is None or not cache.get_seq_length(layer)):
            # the whole sequence is in this forward; after a cached prefix come text tokens placed after
            # everything before them, for which the design's mask is the causal mask the model builds anyway
            label = tables.valid  # (B, S) 0 padding, else the sample: packed samples never see each other
            keep = mm.pype_attention_mask(tables.ids, layer, attention_mask=label != 0)
            kwargs["vlpe_keep"] = keep & (label.unsqueeze(-1) == label.unsqueeze(-2)).unsqueeze(1)
        return args, kwargs

    def text_model_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of the text model: packed rows for every row count of the position tensor.

        Transformers reads packed samples (a text row restarting at every sample) from the first row of a 4-row
        position tensor only, when neither an attention mask nor a cache is given. For the patch's other row counts
        (1D designs, VRoPE's 4 axes, PyPE's layers) this builds the same mask from the text row, under the same
        conditions, with transformers' own mask builder (so it fits the attention implementation).
        """
        pos = kwargs.get("position_ids")
        if not isinstance(pos, Tensor) or pos.dim() != 3 or pos.shape[0] != self.rows + 1 or pos.shape[0] == 4:
            return None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = kwargs.get("use_cache")
        if use_cache is None:  # the model's default, as transformers resolves it (no cache under checkpointing)
            use_cache = getattr(module.config, "use_cache", False)
            use_cache = use_cache and not (module.training and getattr(module, "gradient_checkpointing", False))
        if kwargs.get("attention_mask") is not None or cache is not None or use_cache:
            return None
        from transformers.masking_utils import create_causal_mask

        embeds = kwargs.get("inputs_embeds")
        if embeds is None:  # only the shape, dtype and device are read
            dtype = module.get_input_embeddings().weight.dtype
            embeds = torch.empty(*pos.shape[1:], 0, dtype=dtype, device=pos.device)
        mask = create_causal_mask(
            config=module.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos[0].long()
        )
        if mask is None:  # a plain causal mask: nothing is packed
            return None
        return args, {**kwargs, "attention_mask": mask}

    # -- undo ----------------------------------------------------------------------------------------------------

    def remove(self) -> None:
        """Restore everything :func:`apply` installed, newest first."""
        while self._undo:
            self._undo.pop()()
        self._pending = self._pads = None
        self.base.rope_deltas = None


def _model_frequencies(rotary_cls: type, cfg, rope_type: str) -> tuple[Tensor, float]:
    """``(inv_freq, attention_scaling)`` exactly as the model's rotary module computes them at init."""
    if rope_type == "default":
        fn = getattr(rotary_cls, "compute_default_rope_parameters", None)
        if fn is None:
            raise ValueError(f"{rotary_cls.__name__} has no compute_default_rope_parameters; pass theta= to apply()")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type {rope_type!r} in the model config")
        fn = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = fn(cfg)
    return inv_freq.detach().float().cpu(), scaling


_NTK = parse_scaling({"type": "ntk", "factor": 1.0}, num_axes=1)  # the factor is given per forward (dynamic)


def _config_scaling(rope: dict, cfg) -> dict[str, Any] | None:
    """The vlpe scaling dict of a config's ``rope_parameters`` (``linear`` / ``yarn``; None for ``default``), with
    transformers' defaults (``beta_fast or 32``, a missing yarn factor from the ratio of the context lengths)."""
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return {"type": "linear", "factor": rope["factor"]}
    if kind != "yarn":
        return None
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / original
    out: dict[str, Any] = {"type": "yarn", "factor": factor, "original_size": original,
                           "truncate": rope.get("truncate", True)}
    for key in ("beta_fast", "beta_slow"):
        if rope.get(key):
            out[key] = rope[key]
    if rope.get("attention_factor") is not None:
        out["attention_factor"] = rope["attention_factor"]
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        out["mscale"], out["mscale_all_dim"] = rope["mscale"], rope["mscale_all_dim"]
    return out


def _pads(mask: Tensor | None, B: int, S: int, device) -> Tensor:
    """``(B, 1)`` padding slots of every prompt."""
    if mask is None:
        return torch.zeros(B, 1, dtype=torch.long, device=device)
    return S - mask.long().sum(-1, keepdim=True).to(device)


def _set_instance_attr(obj: Any, name: str, value: Any, undo: list) -> None:
    """Shadow a method on one instance (``obj.__dict__``), remembering how to restore it."""
    had, old = name in obj.__dict__, obj.__dict__.get(name)
    obj.__dict__[name] = value

    def restore():
        if had:
            obj.__dict__[name] = old
        else:
            obj.__dict__.pop(name, None)

    undo.append(restore)


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def patch_of(model: nn.Module) -> Patch | None:
    """The :class:`Patch` installed on ``model``, on its base ``*Model`` or on the generation model around it
    (the one that owns the text rotary), or None."""
    try:
        base, _ = _locate(model)
    except ValueError:
        return None
    rotary = base.language_model.rotary_emb
    return rotary._patch if isinstance(rotary, MultimodalRotary) else None


def apply(model: nn.Module, variant: str | mm.Variant, **options: Any) -> nn.Module:
    """Make ``model`` use the multimodal RoPE ``variant`` for its text positions, rotary and generation.

    Args:
        model: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (``*ForConditionalGeneration`` or base ``*Model``).
        variant: a name of :data:`vlpe.encodings.multimodal.VARIANTS` or a ``Variant(design, allocation)``.
        **options: the design's options (see :data:`vlpe.encodings.multimodal.DESIGNS`); ``section``,
            ``allocation`` and ``theta`` go to the rotary tables (``theta`` defaults to the model's
            ``rope_theta``, PyPE's ``depth`` to the number of decoder layers).

    Patch the ``*ForConditionalGeneration`` model to use ``generate()``: patching only its base ``*Model``
    changes forward passes but leaves generation's own position bookkeeping in place.

    Returns the same model. Applying to a patched model replaces the previous patch. Raises ValueError for an
    unsupported model, an unknown variant or option, rope scaling that changes with the sequence length, or a
    masked design (PyPE) under an attention implementation other than sdpa / eager.
    """
    base, family = _locate(model)
    old = patch_of(model)
    if old is not None:
        old.remove()
    v = mm.get_variant(variant)
    options = dict(options)
    rotary_options = {k: options.pop(k) for k in _ROTARY_KEYS if k in options}
    if "allocation" in rotary_options:
        v = mm.get_variant(v, allocation=rotary_options.pop("allocation"))
    design = mm.DESIGNS[v.design]
    layered = masked = v.design == "pype"

    text = base.language_model
    cfg = text.config
    num_layers = len(text.layers)
    if layered:
        depth = options.setdefault("depth", num_layers)
        if depth != num_layers:
            raise ValueError(f"pype: depth={depth} must equal the number of decoder layers ({num_layers})")
    vision_tps = getattr(base.config.vision_config, "tokens_per_second", None)
    if "tokens_per_second" in design.defaults and vision_tps is not None:
        options.setdefault("tokens_per_second", vision_tps)  # the checkpoint's time resolution (Qwen2.5-VL)
    design.options({**v.design_options, **options})  # unknown design options fail here, before anything changes

    rope = cfg.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in _RUNTIME_ROPE_TYPES:
        raise ValueError(
            f"the model uses rope_type={rope_type!r}, whose frequencies change with the sequence length; vlpe "
            "tables are built from fixed inverse frequencies (default, linear, yarn, llama3 ...)"
        )
    attn = text.layers[0].self_attn
    stock = text.rotary_emb
    rotary_kwargs: dict[str, Any] = {"head_dim": int(attn.head_dim), "num_kv_heads": int(cfg.num_key_value_heads)}
    inv_freq = dynamic = None
    if "theta" in rotary_options or "scaling" in rotary_options:  # vlpe's frequencies of theta, vlpe's scaling
        rotary_kwargs["theta"] = float(rotary_options.get("theta", rope.get("rope_theta", v.theta)))
        scaling = rotary_options["scaling"] if "scaling" in rotary_options else _config_scaling(rope, cfg)
        if "scaling" not in rotary_options and rope_type not in ("default", "linear", "yarn", "dynamic"):
            raise ValueError(
                f"theta= with rope_type={rope_type!r}: vlpe scales its own frequencies by linear / yarn / dynamic "
                "only; omit theta to use the model's own (scaled) frequencies"
            )
        if scaling is not None:
            rotary_kwargs["scaling"] = scaling
        if rope_type == "dynamic" and "scaling" not in rotary_options:
            K = int(attn.head_dim) // 2
            inv_freq = inv_freq_of(K, rotary_kwargs["theta"], dim=2 * K)
            dynamic = (float(rope["factor"]), float(cfg.max_position_embeddings))
    elif rope_type == "dynamic":  # the unscaled frequencies; the factor follows each forward's positions
        inv_freq, _ = _model_frequencies(type(stock), cfg, "default")
        rotary_kwargs["theta"] = float(rope["rope_theta"])
        dynamic = (float(rope["factor"]), float(cfg.max_position_embeddings))
    else:  # the model's own frequencies, statically scaled as its rope_type says, recomputed in fp32
        inv_freq, scaling = _model_frequencies(type(stock), cfg, rope_type)
        rotary_kwargs["attention_scaling"] = float(scaling)
    section = rotary_options.get("section")
    native = rope.get("mrope_section")
    if (
        section is None and v.section is None and native is not None and v.allocation == _NATIVE_ALLOCATION[family]
        and len(native) == v.num_axes(**options)
    ):
        section = native  # the checkpoint's own split of the pairs over (t, h, w)
    if section is not None:
        rotary_kwargs["section"] = tuple(section)

    patch = Patch(
        model=model, base=base, family=family, variant=v, design_options=options, rotary_kwargs=rotary_kwargs,
        spatial_merge_size=int(base.config.vision_config.spatial_merge_size), num_axes=v.num_axes(**options),
        per_head=v.allocation == "multi_head", layered=layered, masked=masked,
    )
    # the allocation must fit the model before anything changes (section sums, KV heads)
    probe = torch.zeros(patch.num_axes, 1, 1, dtype=torch.long)
    mm.rotary(v, probe, **rotary_kwargs, **({} if inv_freq is None else {"inv_freq": inv_freq.cpu()}))
    if masked and cfg._attn_implementation not in _MASK_BASES:
        raise ValueError(
            f"variant {patch.label!r} brings its own attention mask and runs on 'sdpa' or 'eager' attention; the "
            f"text model uses {cfg._attn_implementation!r} (model.set_attn_implementation('sdpa') first)"
        )
    undo = patch._undo

    # 1. rotary module
    text.rotary_emb = MultimodalRotary(patch, inv_freq, dynamic)
    undo.append(lambda: setattr(text, "rotary_emb", stock))

    # 2. position ids of prompts and of generated tokens; the public get_rope_index
    _set_instance_attr(base, "compute_3d_position_ids", patch.compute_3d_position_ids, undo)
    _set_instance_attr(base, "get_rope_index", patch.get_rope_index, undo)
    if model is not base and hasattr(type(model), "_prepare_position_ids_for_generation"):
        prepare = patch.prepare_position_ids_for_generation
        _set_instance_attr(model, "_prepare_position_ids_for_generation", prepare, undo)
    base.rope_deltas = None

    # 3. per-head rotation
    if patch.per_head:
        module_name = type(attn).__module__
        _install_rotation(module_name)
        undo.append(lambda: _uninstall_rotation(module_name))

    # 4. packed rows: the block-diagonal mask from the text row, for every row count
    handle = text.register_forward_pre_hook(patch.text_model_pre_hook, with_kwargs=True)
    undo.append(handle.remove)

    # 5. per-layer tables and the design's mask
    if layered or masked:
        for layer in text.layers:
            handle = layer.self_attn.register_forward_pre_hook(patch.attention_pre_hook, with_kwargs=True)
            undo.append(handle.remove)
    if masked:
        current = cfg._attn_implementation
        _register_attention()
        model.set_attn_implementation({"text_config": f"vlpe_{current}"})
        undo.append(lambda: model.set_attn_implementation({"text_config": current}))

    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: the stock rotary, position ids, generation and attention come back."""
    patch = patch_of(model)
    if patch is None:
        raise ValueError(f"{type(model).__name__} carries no vlpe patch (vlpe.integrations.transformers.apply)")
    patch.remove()
    return model


def pack_position_ids(
    ids: Tensor, attention_mask: Tensor | None = None, *, masked: bool, cu_seqlens=None
) -> Tensor:
    """The position tensor a patched model takes, from a design's ids ``(A, B, S)`` (e.g. computed in a collator
    with :func:`vlpe.encodings.multimodal.position_ids`): ``(1 + A [+ 1], B, S)``.

    Rows: the Hugging Face 1D text row (every real token's index in its sample, 0 on padding; restarting at every
    sample with ``cu_seqlens``), the ids, and for designs with their own attention mask (PyPE, ``masked``) the
    sample label of every token (0 padding, else 1, or the packed sample's number + 1). Float when the ids are.
    """
    A, B, S = ids.shape
    text = mm.text_position_ids((B, S), attention_mask, cu_seqlens=cu_seqlens, device=ids.device)  # (B, S)
    label = None
    if masked:
        label = torch.ones(B, S, dtype=torch.long, device=ids.device)
        if attention_mask is not None:
            label = label * (attention_mask != 0).to(device=ids.device)
        if cu_seqlens is not None:  # packed samples never attend to each other (the layer masks)
            label = label * (mm.packed_samples(cu_seqlens, B, S, device=ids.device).index + 1)
    return _stack(text, ids, label)


def _stack(text: Tensor, ids: Tensor, label: Tensor | None) -> Tensor:
    """``(1 + A [+ 1], B, S)``: text row, ids, label row (if any), in the ids' dtype when float, else int64."""
    parts = [text[None], ids] + ([label[None]] if label is not None else [])
    dtype = ids.dtype if ids.is_floating_point() else torch.long
    return torch.cat([p.to(device=ids.device, dtype=dtype) for p in parts], dim=0)


def position_ids(
    model: nn.Module,
    mm_token_type_ids: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    attention_mask: Tensor | None = None,
    second_per_grid_ts: Tensor | None = None,
    *,
    cu_seqlens=None,
) -> tuple[Tensor, Tensor]:
    """``(position_ids, rope_deltas)`` of whole prompts for a patched model, e.g. precomputed in a collator.

    Pass them as ``model(..., position_ids=position_ids)``. ``position_ids`` is packed ``(1 + rows, B, S)``: the
    Hugging Face text row (used for packed sequences), the design's ids, and for masked designs (PyPE) the
    sample label of every token (0 padding).

    ``cu_seqlens`` (packed rows, the forms :func:`vlpe.encodings.multimodal.position_ids` takes): every sample gets
    its own ids and a text row restarting at 0; ``rope_deltas`` is ``(n, 1)``, one per sample. Run the forward
    without ``attention_mask`` and with ``use_cache=False`` (see the module docstring).
    """
    patch = patch_of(model)
    if patch is None:
        raise ValueError("position_ids needs a model patched with vlpe.integrations.transformers.apply")
    return patch.prompt_position_ids(
        mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts, cu_seqlens=cu_seqlens
    )
