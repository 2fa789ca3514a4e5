"""FIRE's faster forms (lattice table, FlexAttention ``score_mod``), registered for :class:`vlpe.encodings.fire.FIRE`;
each equals :meth:`FIRE.score` (the written form: the table runs the same MLP code at every grid offset), checked
in tests/test_fast_forms_registry.py, tests/test_fast_attention.py and tests/test_fire.py."""

from __future__ import annotations

import torch
from torch import Tensor

from ..encodings.base import Context, LatticeBias
from ..encodings.fire import FIRE
from ..encodings.functional.bias import lattice_offsets
from .registry import clear_prefix, fast_form, flex_form

__all__ = ["fire_lattice", "fire_flex"]


@fast_form(FIRE, "lattice", min_tokens=196)  # the reference bias runs an MLP on every pair: fast from 14 x 14
def fire_lattice(enc: FIRE, ctx: Context, layer: int) -> LatticeBias | None:
    """The MLP of ``score`` at every grid offset (keys at the offsets seen from a query at the origin),
    ``(2h-1)(2w-1)`` evaluations instead of ``N^2``; prefix pairs: 0 (:class:`LatticeBias` default)."""
    enc.check_layer(layer)
    pos = ctx.pos
    if not pos.lattice or pos.grid is None or len(pos.grid) != 2:
        return None
    h, w = pos.grid
    keys = lattice_offsets(h, w, pos.device).to(ctx["coords"].dtype)  # (1, M, 2)
    table = enc._pair_bias(keys.new_zeros(1, 1, 2), keys, ctx, layer)[0, 0]  # (M, H)
    return LatticeBias(table.T.reshape(enc.num_heads, 2 * h - 1, 2 * w - 1), (None,) * enc.num_heads)


@flex_form(FIRE)
def fire_flex(enc: FIRE, q: Tensor, k: Tensor, ctx: Context, layer: int):
    """Analytic ``score_mod``: the MLP from captured ``(B, N)`` coordinate columns, one hidden unit at a time."""
    enc.check_layer(layer)
    coords = ctx["coords"]
    B = q.shape[0]
    dt = coords.dtype
    cols = [coords[..., a].expand(B, -1).contiguous() for a in range(coords.shape[-1])]  # A x (B, N)
    den = enc._denominator(ctx, layer, dt).expand(B, enc.num_inputs).contiguous()  # (B, F)
    c = enc.c[layer].abs().to(dt)
    w1, b1 = enc.w1[layer].to(dt), enc.b1[layer].to(dt)  # (hidden, F), (hidden,)
    w2t, b2 = enc.w2[layer].to(dt).T.contiguous(), enc.b2[layer].to(dt)  # (hidden, H), (H,)
    prefix, euclid, F, hidden = ctx.pos.prefix, enc.distance == "euclidean", enc.num_inputs, enc.hidden
    if q.device.type == "cpu" or not torch.is_grad_enabled():
        # CPU FlexAttention has no backward, and it cannot compile captured tensors that require grad
        den, c, w1, b1, w2t, b2 = (t.detach() for t in (den, c, w1, b1, w2t, b2))

    def score_mod(score, b, h, q_idx, kv_idx):
        diffs = [col[b, q_idx] - col[b, kv_idx] for col in cols]
        if euclid:
            d2 = diffs[0] * diffs[0]
            for d in diffs[1:]:
                d2 = d2 + d * d
            xs = [torch.log1p(c * torch.sqrt(d2)) / den[b, 0]]
        else:
            xs = [torch.sign(d) * torch.log1p(c * d.abs()) / den[b, f] for f, d in enumerate(diffs)]
        bias = b2[h]
        for u in range(hidden):  # the MLP, one hidden unit at a time (pointwise ops only)
            pre = b1[u]
            for f in range(F):
                pre = pre + w1[u, f] * xs[f]
            bias = bias + w2t[u][h] * torch.relu(pre)
        return score + clear_prefix(bias, prefix, q_idx, kv_idx).to(score.dtype)

    return score_mod, None
