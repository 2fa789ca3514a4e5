"""LookHere's faster forms (lattice table with skippable half-planes, per-head chunk bias, FlexAttention
``score_mod`` + ``block_mask``), registered for :class:`vlpe.encodings.lookhere.LookHere`; each equals
:meth:`LookHere.score` (the written form: the same ``HeadPairs`` / ``head_bias`` code), checked in
tests/test_fast_forms_registry.py, tests/test_fast_attention.py and tests/test_lookhere.py."""

from __future__ import annotations

import torch
from torch import Tensor

from ..encodings.base import Context, LatticeBias
from ..encodings.functional.bias import lattice_offsets
from ..encodings.functional.lookhere import HALF_PLANE_BITS, axis_half_plane, head_bias
from ..encodings.lookhere import HeadPairs, LookHere
from .registry import clear_prefix, fast_form, flex_form

__all__ = ["lookhere_lattice", "lookhere_heads", "lookhere_flex"]


@fast_form(LookHere, "lattice")
def lookhere_lattice(enc: LookHere, ctx: Context, layer: int) -> LatticeBias | None:
    """The bias of keys at every offset seen from a query at the origin, by the code of ``score`` (not with
    "center" heads, whose bias reads the key's absolute position). With ``fill_with='inf'`` every head whose
    field of view lies in an axis half-plane (quadrants, wedges, halves) lets the attention skip the keys outside it."""
    pos = ctx.pos
    if enc.has_center or not pos.lattice or pos.grid is None or len(pos.grid) != 2:
        return None
    h, w = pos.grid
    with torch.autocast(pos.device.type, enabled=False):
        off = lattice_offsets(h, w, pos.device).to(ctx["proj"].dtype)  # (1, M, 2): (dy, dx)
        y, x = off[..., 0], off[..., 1]  # (1, M)
        keys = torch.stack([x, y, x + y, x - y])  # (4, 1, M)
        pairs = HeadPairs(enc, keys.new_zeros(4, 1, 1), keys, layer, ctx)
        table = pairs.dist.new_empty(enc.num_heads, 1, keys.shape[-1])  # (H, 1, M)
        for head in range(enc.num_heads):
            pairs.fill(head, table[head : head + 1])
    planes = tuple(axis_half_plane(bits) if enc.fill_with == "inf" else None for bits in enc._required)
    return LatticeBias(table.reshape(enc.num_heads, 2 * h - 1, 2 * w - 1), planes)


@fast_form(LookHere, "heads")
def lookhere_heads(enc: LookHere, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
    """The chunk's distance and half-plane masks once, then each head as in ``score`` (the same operations)."""
    with torch.autocast(q.device.type, enabled=False):
        pairs = enc._pairs(ctx, rows, layer)

    def bias(heads: slice) -> Tensor:
        B, n, N = pairs.dist.shape
        chosen = range(enc.num_heads)[heads]
        with torch.autocast(q.device.type, enabled=False):
            out = pairs.dist.new_empty(B, len(chosen), n, N)  # (B, h, n, N)
            for i, h in enumerate(chosen):
                pairs.fill(h, out[:, i])
            clear_prefix(out, ctx.pos.prefix, rows)
        return out

    return bias


@flex_form(LookHere)
def lookhere_flex(enc: LookHere, q: Tensor, k: Tensor, ctx: Context, layer: int):
    """Analytic ``score_mod`` (distance penalty from the captured ``(B, N)`` coordinates) and, for
    ``fill_with='inf'``, a ``block_mask`` of the fields of view; nothing N x N is kept."""
    from torch.nn.attention.flex_attention import create_block_mask

    proj = ctx["proj"]  # (4, B, N): x, y, x + y, x - y
    x, y = proj[0], proj[1]
    per_sample = proj.shape[1] > 1
    slopes = -enc.slopes(layer).to(proj.dtype)  # (H,)
    bits = torch.tensor(list(HALF_PLANE_BITS), dtype=torch.uint8, device=proj.device)
    req = (enc.required[:, None] & bits) != 0  # (H, 8) which half-planes each head needs
    is_center = enc.is_center
    centre = ctx["centre_dist"] if enc.has_center else None
    fill = ctx["max_dist"] if enc.fill_with == "max" else None
    prefix, mode, distance = ctx.pos.prefix, enc.fill_with, enc.distance

    def dist(d2):  # out of place: traced by torch.compile
        return d2 if distance == "square" else d2.sqrt() if distance == "linear" else d2.sqrt().sqrt()

    def offsets(b, q_idx, kv_idx):
        bb = b if per_sample else 0
        return x[bb, kv_idx] - x[bb, q_idx], y[bb, kv_idx] - y[bb, q_idx]

    def visible(b, h, q_idx, kv_idx):
        bb = b if per_sample else 0
        seen = (q_idx < prefix) | (kv_idx < prefix)
        inside = None
        for c, (form, positive) in enumerate(HALF_PLANE_BITS.values()):
            pk, pq = proj[form, bb, kv_idx], proj[form, bb, q_idx]
            ok = (pk >= pq if positive else pk <= pq) | ~req[h, c]
            inside = ok if inside is None else inside & ok
        return seen | inside

    def score_mod(score, b, h, q_idx, kv_idx):
        dx, dy = offsets(b, q_idx, kv_idx)
        d = dist(dx * dx + dy * dy)
        if centre is not None:
            d = torch.where(is_center[h], centre[b if per_sample else 0, kv_idx], d)
        # fill 'inf': the block_mask drops hidden keys, so the formula sees visible keys only
        hidden = None if mode == "inf" else ~visible(b, h, q_idx, kv_idx)
        bias = head_bias(d, slopes[h], hidden, mode, fill[b if per_sample else 0] if mode == "max" else None)
        return score + clear_prefix(bias, prefix, q_idx, kv_idx).to(score.dtype)

    if mode != "inf":
        return score_mod, None
    B = q.shape[0] if per_sample else None
    block_mask = create_block_mask(visible, B, q.shape[1], q.shape[-2], k.shape[-2], device=q.device)
    return score_mod, block_mask
