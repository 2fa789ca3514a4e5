"""The patch of one model instance: :func:`apply`, :func:`remove`, :func:`patch_of`, :func:`position_ids`, and the
record of the variant a patch writes into the model config (:func:`variant_record`, :func:`read_record`)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal.checkpoints import family_variant

from .attention import MASK_BASES, AttentionHooks, register_attention
from .ids import PositionIds
from .record import RECORD_FORMAT, RECORD_KEY, ROTARY_KEYS, check_rotary_options, read_record, variant_record
from .rotary import MultimodalRotary, RotarySettings, rotary_settings
from .stock import write_folder

__all__ = ["Patch", "apply", "remove", "patch_of", "position_ids", "variant_record", "read_record", "RECORD_FORMAT"]

_METHODS = ("compute_3d_position_ids", "get_rope_index")  # shadowed on the base model instance
_GENERATION = "_prepare_position_ids_for_generation"  # shadowed on the generation model instance


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


class Patch(PositionIds, AttentionHooks):
    """What :func:`apply` installed on one model instance, and how to undo it (:meth:`remove`).

    The patch lives on the model it patches: it is the ``patch`` of the rotary module it installs, every hook and
    shadowed method is one of its bound methods, and it refers to the model's modules directly. A
    ``copy.deepcopy`` of the model therefore has its own patch (removing one leaves the other patched), and a
    patched model pickles (``torch.save(model)``) and loads back patched.

    Attributes:
        variant: the :class:`vlpe.encodings.multimodal.Variant` in use, with every option of :func:`apply` in it
            (design options, allocation, section): the one object the ids, tables and masks all come from.
        family: ``"qwen2_vl"``, ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        spatial_merge_size, num_axes: of the model / the variant's ids.
        record: the :func:`variant_record` of the :func:`apply` call, kept in ``model.config.vlpe`` while installed.
    """

    def __init__(
        self, *, model: nn.Module, base: nn.Module, family: str, variant: mm.Variant, spatial_merge_size: int,
        record: dict | None = None,
    ) -> None:
        self.model, self.base, self.family = model, base, family
        self.variant = variant
        self.record = record  # what install() writes to the model config (variant_record)
        self.spatial_merge_size = int(spatial_merge_size)
        self.num_axes = variant.num_axes()
        self._pending: tuple | None = None
        self._pads: Tensor | None = None
        self._heads: tuple[Tensor, Tensor] | None = None
        self._rotating: dict[int, tuple] = {}  # layer -> (query / key modules, their per-head hook handles)
        self._handles: list = []
        self._shadowed: list[tuple] = []  # (instance, name, had its own, its own)
        self._attn_implementation: str | None = None  # the text model's before the patch (masked designs)

    @property
    def label(self) -> str:
        return self.variant.label

    @property
    def design_options(self) -> dict[str, Any]:
        """The design options in use (defaults of :func:`apply` filled in: PyPE's ``depth`` ...)."""
        return dict(self.variant.design_options)

    @property
    def layered(self) -> bool:
        return self.variant.layered

    @property
    def masked(self) -> bool:
        return self.variant.masked

    @property
    def per_head(self) -> bool:
        return self.variant.per_head

    @property
    def text(self) -> nn.Module:
        return self.base.language_model

    def __repr__(self) -> str:
        return f"Patch(variant={self.label!r}, family={self.family!r}, design_options={self.design_options})"

    @contextlib.contextmanager
    def using(self, **design_options: Any) -> Iterator["Patch"]:
        """Run calls with more design options, e.g. ``with patch.using(second_per_grid_ts=spg): model(...)``
        (Qwen2-VL's forward does not hand ``second_per_grid_ts`` on to the position ids)."""
        saved = self.variant
        self.variant = saved.with_options(**design_options)
        try:
            yield self
        finally:
            self.variant = saved

    # -- install / undo ------------------------------------------------------------------------------------------

    def install(self, settings: RotarySettings) -> None:
        text = self.text
        text.rotary_emb = MultimodalRotary(patch=self, stock=text.rotary_emb, settings=settings)
        for name in _METHODS:
            self._shadow(self.base, name)
        if self.model is not self.base and hasattr(type(self.model), _GENERATION):
            self._shadow(self.model, _GENERATION, self.prepare_position_ids_for_generation)
        self._shadow(self.model, "save_pretrained", self.save_pretrained)  # exports through vlpe (stock.py)
        self.base.rope_deltas = None
        self._handles.append(text.register_forward_pre_hook(self.text_model_pre_hook, with_kwargs=True))
        if self.layered or self.masked or self.per_head:
            for layer in text.layers:
                attn = layer.self_attn
                self._handles.append(attn.register_forward_pre_hook(self.attention_pre_hook, with_kwargs=True))
                if self.per_head:
                    self._handles.append(attn.register_forward_hook(self.attention_post_hook, with_kwargs=True))
                    self.place_head_hooks(attn)  # and again at every call: they follow wrappers of q/k (LoRA)
        if self.masked:
            current = text.config._attn_implementation
            register_attention()
            self.model.set_attn_implementation({"text_config": f"vlpe_{current}"})
            self._attn_implementation = current
        if self.record is not None:
            setattr(self.base.config, RECORD_KEY, copy.deepcopy(self.record))

    def save_pretrained(self, save_directory, **kwargs: Any) -> None:
        """Bound on the patched model as its ``save_pretrained``: the export of
        :func:`vlpe.integrations.transformers.save_pretrained` (stock rope settings where they express the patch,
        a folder stock loaders refuse otherwise), with transformers' arguments."""
        write_folder(self.model, self, save_directory, **kwargs)

    def _shadow(self, obj: nn.Module, name: str, value: Any = None) -> None:
        """Shadow a method on one instance (its ``__dict__``) by the patch's own."""
        self._shadowed.append((obj, name, name in obj.__dict__, obj.__dict__.get(name)))
        obj.__dict__[name] = getattr(self, name) if value is None else value

    def remove(self) -> None:
        """Restore the stock model: rotary module, methods, hooks, attention implementation, ``rope_deltas``, and
        a config without the record of the patch."""
        text = self.text
        if isinstance(text.rotary_emb, MultimodalRotary) and text.rotary_emb.patch is self:
            text.rotary_emb = text.rotary_emb.stock
            if RECORD_KEY in vars(self.base.config):
                delattr(self.base.config, RECORD_KEY)
        while self._shadowed:
            obj, name, had, previous = self._shadowed.pop()
            if had:
                obj.__dict__[name] = previous
            else:
                obj.__dict__.pop(name, None)
        while self._handles:
            self._handles.pop().remove()
        for _, handles in self._rotating.values():
            for handle in handles:
                handle.remove()
        self._rotating.clear()
        if self._attn_implementation is not None:
            self.model.set_attn_implementation({"text_config": self._attn_implementation})
            self._attn_implementation = None
        self._pending = self._pads = self._heads = None
        self.base.rope_deltas = None


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
    return rotary.patch if isinstance(rotary, MultimodalRotary) else None


def _resolve(v: mm.Variant, options: dict[str, Any], base: nn.Module, family: str) -> tuple[mm.Variant, dict]:
    """The variant with every option of :func:`apply` in it, and the rotary options (``theta`` / ``scaling``)."""
    rotary_options = {k: options.pop(k) for k in ROTARY_KEYS if k in options}
    check_rotary_options(rotary_options, where="apply")
    if "allocation" in rotary_options:
        v = v.with_options(allocation=rotary_options.pop("allocation"))
    design = mm.DESIGNS[v.design]
    text = base.language_model
    num_layers = len(text.layers)
    if v.layered:  # one axis per decoder layer: the option that sets the axis count is the model's depth
        depth = options.setdefault(design.axes, num_layers)
        if depth != num_layers:
            raise ValueError(f"{design.name}: {design.axes}={depth} must equal the number of decoder layers "
                             f"({num_layers})")
    vision_tps = getattr(base.config.vision_config, "tokens_per_second", None)
    if "tokens_per_second" in design.defaults and vision_tps is not None:
        options.setdefault("tokens_per_second", vision_tps)  # the checkpoint's time resolution (Qwen2.5-VL)
    v = v.with_options(**options)  # unknown design options fail here, before anything changes
    section = rotary_options.pop("section", None)
    native = (text.config.rope_parameters or {}).get("mrope_section")
    if (
        section is None and v.section is None and native is not None and v.allocation == family_variant(family).allocation
        and len(native) == v.num_axes()
    ):
        section = native  # the checkpoint's own split of the pairs over (t, h, w)
    if section is not None:
        v = v.with_options(section=section)
    return v, rotary_options


def apply(model: nn.Module, variant: str | mm.Variant | None = None, **options: Any) -> nn.Module:
    """Make ``model`` use the multimodal RoPE ``variant`` for its text positions, rotary and generation.

    Args:
        model: a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (``*ForConditionalGeneration`` or base ``*Model``), also
            one built on the meta device (e.g. inside ``from_pretrained``): its tables come from its config.
        variant: a name of :data:`vlpe.encodings.multimodal.VARIANTS` or a ``Variant(design, allocation)``; None
            (with no options): the variant and options recorded in ``model.config.vlpe`` (see below).
        **options: the design's options (see :data:`vlpe.encodings.multimodal.DESIGNS`); ``section``,
            ``allocation`` and ``theta`` go to the rotary tables (``theta`` defaults to the model's
            ``rope_theta``, PyPE's ``depth`` to the number of decoder layers); ``scaling`` a vlpe scaling dict.

    Patch the ``*ForConditionalGeneration`` model to use ``generate()``: patching only its base ``*Model``
    changes forward passes but leaves generation's own position bookkeeping in place.

    The call is recorded in ``model.config.vlpe`` (:func:`variant_record`; ``save_pretrained`` writes it to
    ``config.json``, ``remove`` deletes it), so that ``apply(model)`` on the model loaded back applies it again.

    Returns the same model. Applying to a patched model replaces the previous patch. Raises ValueError for an
    unsupported model, an unknown variant or option, an option value of the wrong type or range (``theta`` not a
    finite number > 0, ``section`` not a list of integers >= 0 ...: :func:`check_rotary_options`), rope scaling that
    changes with the sequence length, a masked design (PyPE) under an attention implementation other than sdpa /
    eager, or (no variant) a config without a restorable record (:func:`read_record`).
    """
    base, family = _locate(model)
    if variant is None:
        if options:
            raise ValueError(
                f"apply: options {sorted(options)} given without a variant; pass the variant with them, or neither "
                "to apply the variant recorded in model.config.vlpe"
            )
        variant, options = read_record(getattr(base.config, RECORD_KEY, None), where="model.config")
    record = variant_record(variant, options)
    v, rotary_options = _resolve(mm.get_variant(variant), dict(options), base, family)
    text = base.language_model
    stock = text.rotary_emb.stock if isinstance(text.rotary_emb, MultimodalRotary) else text.rotary_emb
    settings = rotary_settings(_Stock(text, stock), v, rotary_options)
    v = v.with_options(theta=settings.theta)  # the model's base: mm.rotary(patch.variant, ...) gives its tables
    patch = Patch(model=model, base=base, family=family, variant=v,
                  spatial_merge_size=int(base.config.vision_config.spatial_merge_size), record=record)
    # the allocation must fit the model before anything changes (section sums, KV heads); on the host, also
    # under a meta-device context
    with torch.device("cpu"):
        probe = torch.zeros(patch.rows + 1, 1, 1, dtype=torch.long)
        MultimodalRotary(patch=patch, stock=stock, settings=settings)(torch.zeros(1, 1, 1), probe)
    impl = text.config._attn_implementation
    if patch.masked and impl not in MASK_BASES and not (impl or "").startswith("vlpe_"):
        raise ValueError(
            f"variant {patch.label!r} brings its own attention mask and runs on 'sdpa' or 'eager' attention; the "
            f"text model uses {impl!r} (model.set_attn_implementation('sdpa') first)"
        )
    old = patch_of(model)
    if old is not None:
        old.remove()
    patch.install(settings)
    return model


class _Stock:
    """The text model as :func:`rotary_settings` reads it, with the stock rotary even while a patch is on."""

    def __init__(self, text: nn.Module, stock: nn.Module) -> None:
        self.config, self.layers, self.rotary_emb = text.config, text.layers, stock


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` on this model instance: the stock rotary, position ids, generation and attention come
    back (other instances, deep copies included, keep their own patches)."""
    patch = patch_of(model)
    if patch is None:
        raise ValueError(f"{type(model).__name__} carries no vlpe patch (vlpe.integrations.transformers.apply)")
    patch.remove()
    return model


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
    without ``attention_mask`` and with ``use_cache=False`` (see the package docstring).
    """
    patch = patch_of(model)
    if patch is None:
        raise ValueError("position_ids needs a model patched with vlpe.integrations.transformers.apply")
    return patch.prompt_position_ids(
        mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts, cu_seqlens=cu_seqlens
    )
