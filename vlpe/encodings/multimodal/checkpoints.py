"""The position variant each released Qwen-VL family was trained with, by Hugging Face ``model_type``."""

from __future__ import annotations

from .variants import Variant, get_variant

__all__ = ["FAMILY_VARIANTS", "FAMILY_DESIGNS", "family_variant"]

FAMILY_VARIANTS = {"qwen2_vl": "mrope", "qwen2_5_vl": "qwen25vl", "qwen3_vl": "qwen3vl"}
# the designs that give the family's own ids on every prompt of that family (with their default options): Qwen3-VL's
# processor writes every temporal patch as its own block, where the t/h/w grid and one-block-a-frame coincide
FAMILY_DESIGNS = {"qwen2_vl": ("grid",), "qwen2_5_vl": ("absolute_time",), "qwen3_vl": ("per_frame", "grid")}


def family_variant(family: str) -> Variant:
    """The registered variant a released checkpoint of ``family`` runs (its own design and allocation).

    Args:
        family: a Hugging Face ``model_type``: ``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``.

    Returns:
        The :class:`Variant` preset (Qwen2-VL: the t/h/w grid, chunked; Qwen2.5-VL: absolute time, chunked;
        Qwen3-VL: one block a frame, interleaved).

    Raises:
        ValueError: for another family.

    Reference:
        Qwen2-VL (arXiv:2409.12191), Qwen2.5-VL (arXiv:2502.13923), Qwen3-VL (arXiv:2511.21631); checked against
        ``get_rope_index`` of transformers 4.57.
    """
    if family not in FAMILY_VARIANTS:
        raise ValueError(f"no released variant is known for model_type {family!r}; known: {sorted(FAMILY_VARIANTS)}")
    return get_variant(FAMILY_VARIANTS[family])
