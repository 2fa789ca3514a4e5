"""ALiBi's faster forms (lattice table, per-head chunk bias, FlexAttention ``score_mod``), registered for
:class:`vlpe.encodings.alibi.ALiBi`; each equals :meth:`ALiBi.score` (the written form), checked in
tests/test_fast_forms_registry.py and tests/test_fast_attention.py."""

from __future__ import annotations

import torch

from ..encodings.alibi import ALiBi, pairwise_distance
from ..encodings.base import Context, LatticeBias
from ..encodings.functional.bias import lattice_offsets
from .registry import clear_prefix, fast_form, flex_form

__all__ = ["alibi_lattice", "alibi_heads", "alibi_flex"]


@fast_form(ALiBi, "lattice")
def alibi_lattice(enc: ALiBi, ctx: Context, layer: int) -> LatticeBias | None:
    """``-m_h * |offset|`` at every grid offset (keys at the offsets seen from a query at the origin, the pairwise
    code of ``score``); prefix pairs: 0 (:class:`LatticeBias` default)."""
    pos = ctx.pos
    if not pos.lattice or pos.grid is None or len(pos.grid) != 2:
        return None
    h, w = pos.grid
    offsets = lattice_offsets(h, w, pos.device).to(ctx["coords"].dtype)  # (1, M, 2)
    dist = pairwise_distance(offsets.new_zeros(1, 1, 2), offsets)  # (1, 1, M)
    table = -enc.slopes.to(dist.dtype)[:, None] * dist[0]  # (H, M)
    return LatticeBias(table.reshape(enc.num_heads, 2 * h - 1, 2 * w - 1), (None,) * enc.num_heads)


@fast_form(ALiBi, "heads")
def alibi_heads(enc: ALiBi, q, k, ctx: Context, layer: int, rows: slice):
    """The chunk's distances once (prefix pairs cleared), then ``-m_h * dist`` per head."""
    coords = ctx["coords"]  # (B, N, A)
    dist = clear_prefix(pairwise_distance(coords[:, rows], coords), ctx.pos.prefix, rows)[:, None]  # (B, 1, n, N)
    slopes = -enc.slopes.to(dist.dtype)[None, :, None, None]  # (1, H, 1, 1)
    return lambda heads: slopes[:, heads] * dist  # (B, h, n, N)


@flex_form(ALiBi)
def alibi_flex(enc: ALiBi, q, k, ctx: Context, layer: int):
    """Analytic ``score_mod``: the distance from captured ``(B, N)`` coordinate columns; nothing N x N."""
    coords = ctx["coords"]
    B = q.shape[0]
    cols = [coords[..., a].expand(B, -1).contiguous() for a in range(coords.shape[-1])]  # A x (B, N)
    slopes = enc.slopes.to(coords.dtype)
    prefix = ctx.pos.prefix

    def score_mod(score, b, h, q_idx, kv_idx):
        d2 = None
        for c in cols:
            diff = c[b, q_idx] - c[b, kv_idx]
            d2 = diff * diff if d2 is None else d2 + diff * diff
        bias = clear_prefix(-slopes[h] * torch.sqrt(d2), prefix, q_idx, kv_idx)
        return score + bias.to(score.dtype)

    return score_mod, None
