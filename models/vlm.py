"""A small video-language model: a vlpe vision tower, a 2x2 merger and a Hugging Face Qwen2-VL decoder.

Layout (Qwen2-VL's, scaled down)::

    pixel patches (collator, Qwen2-VL order) -> linear patch embedding -> vlpe Encoder (any vision encoding,
    default axial ``rope`` over (t, h, w)) -> 2x2 merger -> placeholders of a Qwen2VLForConditionalGeneration
    decoder -> vlpe.integrations.transformers.apply(decoder, variant) -> any multimodal RoPE variant

The decoder is the real ``transformers`` class built from a tiny ``Qwen2VLConfig``; only its ``model.visual`` is
replaced by :class:`VisionTower`, which honours the interface the Hugging Face model calls
(``visual(pixel_values, grid_thw=..., **kwargs)`` returning ``pooler_output`` = merged tokens in placeholder
order, plus ``dtype`` and ``spatial_merge_size``). Hugging Face therefore does the placeholder scatter, the
KV cache and ``generate()``; the vlpe patch supplies position ids, rotary tables and generation-time ids for
the chosen variant (``rope1d``, ``mrope``, ``mrope_i``, ``mhrope``, ``vrope``, ``v2pe``, ``pype``,
``videorope``, ``hope_video``, ``qwen25vl``, ``qwen3vl``, or any ``mm.Variant``).

As in Qwen2-VL, the tower attends within each temporal patch (``vision_attention="frame"``; ``"block"``
attends over a whole image or video): relating frames to each other and to the question is the decoder's
job, which is what the decoder's position encoding is tested on.

Batches come from :meth:`VLM.collator` (Qwen2-VL conventions, :mod:`data.vlm_collate`), which computes the
decoder's position ids on the CPU with :func:`vlpe.encodings.multimodal.position_ids` and packs them as the
patched model expects, so a training step never builds positions on the accelerator.

    tok = data.text.build_tokenizer(data.vniah.vocabulary())
    model = vlm("tiny", tokenizer=tok, variant="mrope_i")
    batch = model.collator()(samples)             # samples: segment lists / data.vniah items
    out = model(batch)                            # {"loss", "logits"}
    new = model.generate(batch, max_new_tokens=2)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from torch import Tensor, nn

from vlpe.encodings import multimodal as mm

from .vision_tower import Merger, VisionTower

__all__ = [
    "PRESETS",
    "VisionTower",
    "Merger",
    "VLM",
    "VLMCollate",
    "vlm",
    "vlm_from_config",
    "pack_position_ids",
    "answer_accuracy",
]

# Sizes. ``tiny`` (0.27M parameters) trains on 2 CPU cores in minutes; ``full`` (43M) is GPU-sized.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
        vision_dim=64, vision_depth=2, vision_heads=4,
    ),
    "small": dict(
        hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=384,
        vision_dim=128, vision_depth=4, vision_heads=4,
    ),
    "full": dict(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536,
        vision_dim=384, vision_depth=8, vision_heads=6,
    ),
}  # fmt: skip


# the vision tower and its merger (VisionTower, Merger) live in models/vision_tower.py


# ----------------------------------------------------------------------------------------------------------------
# Position ids for the patched decoder
# ----------------------------------------------------------------------------------------------------------------


def pack_position_ids(
    ids: Tensor, attention_mask: Tensor | None, *, masked: bool, cu_seqlens: Tensor | None = None
) -> Tensor:
    """``(1 + A [+ 1], B, S)``: the Hugging Face 1D text row (every real token's index in its sample, 0 on
    padding), the design's ``ids (A, B, S)`` and, for designs with their own attention mask (PyPE, ``masked``),
    the sample label of every token (0 padding); the tensor a model patched by
    :func:`vlpe.integrations.transformers.apply` takes as ``position_ids``. With ``cu_seqlens`` (a packed batch)
    the text row restarts at every sample (:func:`vlpe.integrations.transformers.pack_position_ids`)."""
    from vlpe.integrations import transformers as vlpe_hf

    return vlpe_hf.pack_position_ids(ids, attention_mask, masked=masked, cu_seqlens=cu_seqlens)


@dataclass
class VLMCollate:
    """Samples -> keyword arguments of the patched decoder (picklable, for DataLoader workers).

    Runs :class:`data.vlm_collate.VLMCollator` with the model's patching and the decoder's position variant,
    splits the pixels by modality (:func:`data.vlm_collate.to_hf_inputs`) and packs the position ids
    (:func:`pack_position_ids`). ``with_positions=False`` leaves them out; ``prompt_only=True`` drops the
    ``answer`` segments (prompts for ``generate()``, best with ``padding_side="left"``). ``packing=True`` packs the
    samples into rows of at most ``max_length`` tokens (:class:`data.vlm_collate.VLMCollator`): every sample keeps
    its own positions and labels, and the decoder attends within each sample only (no ``attention_mask``, a text
    row restarting at every sample).
    """

    tokenizer: Any
    variant: Any
    position_options: dict[str, Any] = field(default_factory=dict)
    masked: bool = False
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    padding_side: str = "right"
    with_positions: bool = True
    prompt_only: bool = False
    max_length: int | None = None
    packing: bool = False

    def __post_init__(self) -> None:
        from data.vlm_collate import VLMCollator

        self._collator = VLMCollator(
            self.tokenizer, patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size, padding_side=self.padding_side, max_length=self.max_length,
            position_variant=self.variant if self.with_positions else None,
            position_options=dict(self.position_options), packing=self.packing,
        )  # fmt: skip
        if self.packing and not self.with_positions:
            raise ValueError("packing needs the collator's per-sample position ids: leave with_positions=True")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_collator"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def __call__(self, samples: Sequence[Any]) -> dict[str, Tensor]:
        from data.vlm_collate import to_hf_inputs

        if self.prompt_only:
            from data.vlm_collate import segments_of

            samples = [[seg for seg in segments_of(s) if seg[0] != "answer"] for s in samples]
        batch = self._collator(samples)
        out = to_hf_inputs(batch)
        if self.with_positions:
            out["position_ids"] = pack_position_ids(
                batch["position_ids"], batch["attention_mask"], masked=self.masked, cu_seqlens=batch.get("cu_seqlens")
            )
        return out


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


class VLM(nn.Module):
    """Vision tower + merger + Qwen2-VL decoder, with the decoder switched to a vlpe multimodal RoPE variant.

    Args:
        tokenizer: a :class:`data.text.WordTokenizer` (or any object with ``vocab_size``, ``pad_id``, ``bos_id``,
            ``eos_id``, ``image_token_id``, ``video_token_id``, ``vision_start_id``, ``vision_end_id``).
        variant / variant_options: the decoder's multimodal RoPE (``vlpe.encodings.multimodal.VARIANTS`` name or
            ``Variant``) and its design options (``spatial_reset=True``, ``temporal_scale=...``, ``section=...``).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the decoder.
        rope_theta: the decoder's rotary base; None takes the variant's own (``Variant.theta``).
        vision_*: the tower (width, blocks, heads, vlpe encoding and options, ``"frame"``/``"block"`` attention).
        patch_size, temporal_patch_size, merge_size, in_chans: patching (the collator must use the same).
        attn_implementation: the decoder's attention (``"sdpa"`` or ``"eager"``).
        initializer_range: std of the decoder's initial weights; None: ``hidden_size ** -0.5`` (unit gain per
            projection; Hugging Face's usual 0.02 is that only at widths near 2,500, and in a narrow decoder it
            starts the attention path so close to zero that training stalls at chance for hundreds of steps).
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        variant: Any = "mrope_i",
        variant_options: Mapping[str, Any] | None = None,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        intermediate_size: int | None = None,
        rope_theta: float | None = None,
        vision_dim: int = 64,
        vision_depth: int = 2,
        vision_heads: int = 4,
        vision_encoding: str = "rope",
        vision_encoding_options: Mapping[str, Any] | None = None,
        vision_attention: Literal["frame", "block"] = "frame",
        patch_size: int = 4,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        in_chans: int = 3,
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
        initializer_range: float | None = None,
        tie_word_embeddings: bool = True,
    ) -> None:
        super().__init__()
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        from vlpe.integrations import transformers as vlpe_hf

        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}) and num_heads of "
                f"num_kv_heads ({num_kv_heads})"
            )
        head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise ValueError(f"the decoder head dim hidden_size / num_heads = {head_dim} must be even for rotary")
        v = mm.get_variant(variant)
        self.tokenizer = tokenizer
        self.variant = v
        theta = float(v.theta if rope_theta is None else rope_theta)
        init_std = hidden_size**-0.5 if initializer_range is None else float(initializer_range)
        ids = dict(
            image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
            vision_start_token_id=tokenizer.vision_start_id, vision_end_token_id=tokenizer.vision_end_id,
        )  # fmt: skip
        config = Qwen2VLConfig(
            text_config=dict(
                vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                intermediate_size=intermediate_size or 2 * hidden_size, initializer_range=init_std,
                bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                # the stock rotary is replaced by the vlpe one; its section only has to be valid
                rope_parameters={"rope_type": "default", "rope_theta": theta,
                                 "mrope_section": list(mm.default_section("chunked", head_dim // 2))},
            ),
            # the stock tower is replaced below: build the smallest one Qwen2VLConfig accepts
            vision_config=dict(depth=0, embed_dim=8, hidden_size=hidden_size, num_heads=1, patch_size=patch_size,
                               temporal_patch_size=temporal_patch_size, spatial_merge_size=merge_size,
                               in_channels=in_chans),
            tie_word_embeddings=tie_word_embeddings,
            **ids,
        )  # fmt: skip
        config._attn_implementation = attn_implementation
        hf = Qwen2VLForConditionalGeneration(config)
        hf.config.text_config._attn_implementation = attn_implementation
        hf.model.visual = VisionTower(
            out_dim=hidden_size, dim=vision_dim, depth=vision_depth, num_heads=vision_heads, patch_size=patch_size,
            temporal_patch_size=temporal_patch_size, in_chans=in_chans, spatial_merge_size=merge_size,
            encoding=vision_encoding, encoding_options=vision_encoding_options, attention=vision_attention,
        )  # fmt: skip
        gen = hf.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
        self.hf = hf
        self._variant_arg, self._variant_options = v, dict(variant_options or {})
        vlpe_hf.apply(hf, v, **self._variant_options)
        self.variant = self.patch.variant  # with every option applied (allocation, section, design options)

    def set_rope_scaling(self, scaling: Mapping[str, Any] | None) -> "VLM":
        """Training-free scaling of the decoder's rotary tables from the next forward on (a vlpe scaling dict,
        e.g. ``{"type": "yarn", "factor": {"t": 4}}``; None: the trained tables). Re-applies the variant with
        ``scaling=`` (no parameter changes); the position ids are unaffected."""
        from vlpe.integrations import transformers as vlpe_hf

        options = dict(self._variant_options)
        if scaling is not None:
            options["scaling"] = dict(scaling)
        vlpe_hf.apply(self.hf, self._variant_arg, **options)  # replaces the current patch
        return self

    # -- properties ------------------------------------------------------------------------------------------------
    @property
    def patch(self):
        """The decoder's :class:`vlpe.integrations.transformers.Patch` (found on the model, so it follows copies)."""
        from vlpe.integrations import transformers as vlpe_hf

        return vlpe_hf.patch_of(self.hf)

    @property
    def visual(self) -> VisionTower:
        return self.hf.model.visual

    @property
    def config(self):
        return self.hf.config

    @property
    def position_options(self) -> dict[str, Any]:
        """The design options the decoder was patched with (defaults filled in: PyPE's depth ...)."""
        return self.patch.design_options

    def no_weight_decay(self) -> set[str]:
        names = {f"hf.model.visual.{n}" for n in self.visual.no_weight_decay()}
        return names | {n for n, _ in self.named_parameters() if "embed_tokens" in n or "lm_head" in n}

    def collator(self, **kwargs: Any) -> VLMCollate:
        """A :class:`VLMCollate` matching this model's patching, variant and position options."""
        vc = self.hf.config.vision_config
        base = dict(
            tokenizer=self.tokenizer, variant=self.variant, position_options=self.position_options,
            masked=self.variant.masked, patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
            merge_size=vc.spatial_merge_size,
        )  # fmt: skip
        return VLMCollate(**{**base, **kwargs})

    # -- forward / generate ----------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` from :meth:`collator` -> ``{"loss"}`` (mean over supervised answer tokens) and ``"logits"``.

        ``position_ids`` should be in the batch (computed by the collator); without them the patched model
        computes them from ``mm_token_type_ids`` and the grids.
        """
        inputs = {k: v for k, v in batch.items() if k != "second_per_grid_ts"}
        with self._video_timing(batch):
            out = self.hf(**{**inputs, "use_cache": False})
        result = {"logits": out.logits}
        if out.loss is not None:
            result["loss"] = out.loss
        return result

    @torch.no_grad()
    def generate(self, batch: Mapping[str, Tensor], **kwargs: Any):
        """``hf.generate`` on a prompt batch (``collator(prompt_only=True, padding_side="left")``): labels and
        precomputed position ids are dropped, the patched model places the prompt and every generated token."""
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "position_ids", "second_per_grid_ts")}
        with self._video_timing(batch):
            return self.hf.generate(**inputs, **kwargs)

    @contextlib.contextmanager
    def _video_timing(self, batch: Mapping[str, Tensor]):
        """Qwen2-VL's forward and generate() do not pass ``second_per_grid_ts`` on to the position ids, yet
        time-aware designs (``qwen25vl``) place frames by it: hand this batch's values to the patch for the call
        (the collator used the same values)."""
        spg = batch.get("second_per_grid_ts")
        if spg is None or "second_per_grid_ts" not in mm.DESIGNS[self.variant.design].defaults:
            yield
            return
        with self.patch.using(second_per_grid_ts=spg):
            yield


def vlm(preset: str = "tiny", *, tokenizer: Any, variant: Any = "mrope_i", **overrides: Any) -> VLM:
    """A :class:`VLM` from a size preset (``tiny`` / ``small`` / ``full``) with keyword overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown VLM preset {preset!r}; presets: {', '.join(PRESETS)}")
    return VLM(tokenizer=tokenizer, variant=variant, **{**PRESETS[preset], **overrides})


def vlm_from_config(cfg: Any, tokenizer: Any) -> VLM:
    """The :class:`VLM` a small-VLM run's config describes.

    Args:
        cfg: A :class:`train.vlm_setup.VLMConfig` (its ``model`` section).
        tokenizer: The run's word tokenizer (:func:`train.vlm_setup.build_tokenizer` of its data, or the words an
            export recorded).

    Returns:
        The model, initialised.

    Raises:
        ValueError: An unknown preset, variant or option.
    """
    m = cfg.model
    sizes = dict(
        hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size, vision_dim=m.vision_dim, vision_depth=m.vision_depth,
        vision_heads=m.vision_heads,
    )  # fmt: skip
    return vlm(
        m.preset,
        tokenizer=tokenizer,
        variant=m.variant,
        variant_options=m.variant_options,
        rope_theta=m.rope_theta,
        initializer_range=m.initializer_range,
        vision_encoding=m.vision_encoding,
        vision_encoding_options=m.vision_encoding_options,
        vision_attention=m.vision_attention,
        patch_size=m.patch_size,
        temporal_patch_size=m.temporal_patch_size,
        merge_size=m.merge_size,
        attn_implementation=m.attn_implementation,
        **{k: v for k, v in sizes.items() if v is not None},
    )


# ----------------------------------------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------------------------------------


def answer_accuracy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher-forced exact match per sequence: ``(correct (B,) bool, scored (B,) bool)``.

    The prediction for token ``s`` is ``argmax logits[s - 1]``; a sequence is correct when every supervised
    token (``labels != -100``) is predicted (LongVA's V-NIAH scoring). ``scored`` marks sequences with at least
    one supervised token.
    """
    pred = logits[:, :-1].argmax(-1)  # (B, S-1)
    target = labels[:, 1:]  # (B, S-1)
    supervised = target != -100
    wrong = (pred != target) & supervised
    return ~wrong.any(-1) & supervised.any(-1), supervised.any(-1)
