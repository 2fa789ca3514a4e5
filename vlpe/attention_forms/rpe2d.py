"""RPE-2D's faster forms: those of the encoding it wraps (:class:`vlpe.encodings.rpe2d.RPE2D` is exactly its base
in eval mode, and in training reads the base with re-sampled positions), on the base's own context
``ctx["inner"]``; checked with the base's forms in tests/test_fast_forms_registry.py."""

from __future__ import annotations

from torch import Tensor

from ..encodings.base import Context, LatticeBias
from ..encodings.rpe2d import RPE2D
from .registry import fast_form, flex_form, flex_mods, forms_of, heads_bias, lattice_table

__all__ = ["rpe2d_lattice", "rpe2d_heads", "rpe2d_flex"]


@fast_form(RPE2D, "lattice", when=lambda enc: "lattice_bias" in forms_of(enc.base))
def rpe2d_lattice(enc: RPE2D, ctx: Context, layer: int) -> LatticeBias | None:
    return lattice_table(enc.base, ctx["inner"], layer)


@fast_form(RPE2D, "heads", when=lambda enc: "score_heads" in forms_of(enc.base))
def rpe2d_heads(enc: RPE2D, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
    return heads_bias(enc.base, q, k, ctx["inner"], layer, rows)


@flex_form(RPE2D, when=lambda enc: "flex" in forms_of(enc.base))
def rpe2d_flex(enc: RPE2D, q: Tensor, k: Tensor, ctx: Context, layer: int):
    return flex_mods(enc.base, q, k, ctx["inner"], layer)
