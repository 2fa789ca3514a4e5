"""The inference fast path of :func:`vlpe.attend` (``sdpa`` backend, no autograd): one SDPA call per head and
query chunk, the chunk's bias at most :data:`FAST_BIAS_BYTES`, built just before the call reads it.

* on lattice positions the lattice form registered for the encoding (:data:`FAST_FORMS`, plan flag
  ``lattice_bias``) gives every chunk's bias as one strided copy of a ``(2h-1, 2w-1)`` table, and keys outside a
  head's masked half-plane are skipped;
* otherwise the registered per-head form (plan flag ``score_heads``) builds the chunk's bias head by head;
* encodings with neither keep the reference path (these functions return None).

The forms live in :mod:`vlpe.attention_forms` (registered per encoding class, never found on the encoding); which
exist is read from the plan (:class:`vlpe.encodings.plan.LayerPlan`). Checked against the reference path in
tests/test_fast_attention.py and tests/test_fast_forms_registry.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import attention_forms  # noqa: F401  (registers every encoding's forms)
from .attention_forms.registry import FAST_FORMS, FastForm, fast_form, heads_bias, lattice_table
from .encodings.base import Encoding, LatticeBias
from .encodings.plan import LayerPlan
from .positions import Positions

__all__ = ["FAST_BIAS_BYTES", "FAST_FORMS", "FastForm", "fast_blocker", "fast_attention", "fast_form"]

#: Largest bias (bytes) of one head and query chunk on the fast path: small enough to stay in cache.
FAST_BIAS_BYTES = 4 * 2**20


def _combine(*biases: Tensor | None) -> Tensor | None:
    out = None
    for b in biases:
        if b is None:
            continue
        out = b if out is None else out + b
    return out


def _needs_grad(enc: Encoding | None, tensors: tuple[Tensor, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    return enc is not None and any(p.requires_grad for p in enc.parameters())


def fast_blocker(backend, has_values, attn_mask, is_causal, dropout_p, enc, tensors) -> str | None:
    """Why the fast path cannot run this call (None: it can)."""
    if backend != "sdpa":
        return f"it is an SDPA path, the backend is {backend!r}"
    if has_values:
        return f"{type(enc).__name__} has a values term (eager backend)"
    if attn_mask is not None or is_causal:
        return "it takes no attn_mask / is_causal (the encoding's bias and key padding only)"
    if dropout_p:
        return "it has no attention dropout"
    if _needs_grad(enc, tensors):
        return "it is for inference: something needs gradients (use torch.no_grad() / inference_mode())"
    return None


def fast_attention(q, k, v, enc, ctx, step: LayerPlan, layer, scale, pad) -> Tensor | None:
    """The fast path (module docstring): lattice tables, else per-head builders; None: neither is offered.

    Widened q/k (``widen``, PaPE) have more channels than v; SDPA's fused CPU kernel needs one width (else
    it falls back to the math kernel, which holds the (B, H, N, N) attention), so v gets zero channels: they
    change neither the attention nor the first ``Dv`` output channels, which are returned.
    """
    Dq, Dv = q.shape[-1], v.shape[-1]
    if Dq != Dv:
        width = max(Dq, Dv)
        q, k = (F.pad(t, (0, width - Dq)) for t in (q, k)) if Dq < width else (q, k)
        v = F.pad(v, (0, width - Dv)) if Dv < width else v
        if enc is None or not step.score:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=pad, scale=scale)[..., :Dv]
        out = fast_attention(q, k, v, enc, ctx, step, layer, scale, pad)
        return None if out is None else out[..., :Dv]
    pos = ctx.pos
    if step.lattice_bias and pad is None and pos.grid is not None and len(pos.grid) == 2:
        lat = lattice_table(enc, ctx, layer)  # the form checks pos.lattice if it must (None: not these positions)
        if lat is not None:
            return _lattice_attention(q, k, v, lat, pos, scale)
    if not step.score_heads:
        return None
    return _head_attention(q, k, v, enc, ctx, layer, scale, pad)


def _head_attention(q, k, v, enc, ctx, layer, scale, pad) -> Tensor | None:
    """SDPA per query chunk and head with the bias of the registered per-head form; None when not offered.

    Query chunks hold at most :data:`FAST_BIAS_BYTES` of one head's bias; each chunk's shared work is done once
    by the form, then each head's bias is built and read at once.
    """
    B, H, N, _ = q.shape
    n_k = k.shape[-2]
    step = max(1, min(N, FAST_BIAS_BYTES // max(1, B * n_k * q.element_size())))
    out = None
    for start in range(0, N, step):
        rows = slice(start, min(start + step, N))
        qr = q[:, :, rows]  # (B, H, n, D)
        build = heads_bias(enc, qr, k, ctx, layer, rows)
        if build is None:
            return None  # first chunk: the encoding offers no per-head bias
        if out is None:
            out = q.new_empty(B, H, N, v.shape[-1])
        for h in range(H):
            heads = slice(h, h + 1)
            mask = _combine(build(heads), pad)  # (B', 1, n, N)
            if mask is not None and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            out[:, heads, rows] = F.scaled_dot_product_attention(
                qr[:, heads], k[:, heads], v[:, heads], attn_mask=mask, scale=scale
            )
    return out


#: half-plane -> (transpose, flip rows): the frame in which that half-plane is "key row <= query row"
_FRAMES = {None: (False, False), "up": (False, False), "down": (False, True), "left": (True, False),
           "right": (True, True)}  # fmt: skip


def _to_frame(x: Tensor, h: int, w: int, transpose: bool, flip: bool) -> Tensor:
    """Patch tokens ``(B, h w, D)`` in row-major grid order as the frame's grid ``(B, h', w', D)``."""
    x = x.unflatten(1, (h, w))
    if transpose:
        x = x.transpose(1, 2)
    return x.flip(1) if flip else x


def _lattice_attention(q, k, v, lat: LatticeBias, pos: Positions, scale) -> Tensor:
    """SDPA per head and chunk of query rows with the bias read off the lattice table ``lat``.

    Per head the grid is seen in the frame (transposed and/or row-flipped) where its masked half-plane
    is "key row <= query row". In that frame queries go in reverse raster order, so the entry of query
    ``(h'-1-a, w'-1-b)`` and key ``(r, c)`` is ``table'[a + r, b + c]``: one strided view of the table, copied
    (float tables) or gathered from the chunk's ``lat.values`` (bucket tables) chunk by chunk into the mask.
    A chunk of query rows whose lowest row is ``h'-1-a`` sees keys of rows ``<= h'-1-a`` only, so only those
    (a contiguous prefix of the keys) are passed. Prefix queries see one bias on every key and attend
    without it; patch queries get the prefix bias on prefix keys (the :class:`LatticeBias` contract).
    Checked against the reference path in tests/test_fast_attention.py.
    """
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    P = pos.prefix
    h, w = pos.grid
    out = q.new_empty(B, H, N, Dv)
    if P:  # prefix queries: the same bias on every key, which softmax ignores
        out[:, :, :P] = F.scaled_dot_product_attention(q[:, :, :P], k, v, scale=scale)
    Bm = B if lat.values is not None else 1  # bucket tables: per-sample bias (it reads the queries)
    esize = q.element_size()
    chunk_rows = {wf: max(1, FAST_BIAS_BYTES // (esize * Bm * wf * N)) for wf in (h, w)}  # frame rows per chunk
    buf = q.new_empty(max(Bm * r * wf * N for wf, r in chunk_rows.items()))
    for head in range(H):
        plane = lat.half_planes[head]
        tr, fl = _FRAMES[plane]
        hf, wf = (w, h) if tr else (h, w)
        t = lat.table[head if lat.table.shape[0] > 1 else 0]  # (2h-1, 2w-1) at key-minus-query offsets
        t = t.transpose(0, 1) if tr else t
        t = t.flip(0) if fl else t
        t = t.contiguous() if lat.values is not None else t.to(q.dtype).contiguous()  # (2hf-1, 2wf-1), frame
        stride = 2 * wf - 1
        windows = t.as_strided((hf, wf, hf, wf), (stride, 1, stride, 1))  # [a, b, r, c] = t[a + r, b + c]
        if lat.values is None:
            pre = 0.0 if lat.prefix_bias is None else lat.prefix_bias[head if lat.prefix_bias.numel() > 1 else 0]
        if plane is None:
            kf, vf = k[:, head], v[:, head]  # (B, N, D): identity frame, prefix first
        else:
            kf = torch.cat([k[:, head, :P], _to_frame(k[:, head, P:], h, w, tr, fl).flatten(1, 2)], dim=1)
            vf = torch.cat([v[:, head, :P], _to_frame(v[:, head, P:], h, w, tr, fl).flatten(1, 2)], dim=1)
        qf = _to_frame(q[:, head, P:], h, w, tr, fl).flip(1, 2).flatten(1, 2)  # (B, h w, D) reverse raster
        of = q.new_empty(B, hf * wf, Dv)
        step = chunk_rows[wf]
        for a in range(0, hf, step):
            e = min(hf, a + step)
            m = (e - a) * wf
            kr = hf - a if plane is not None else hf  # frame rows of keys this chunk can see
            nk = P + kr * wf
            mask = buf[: Bm * m * nk].view(Bm, m, nk)
            qc = qf[:, a * wf : e * wf]  # (B, m, D)
            if lat.values is None:
                mask[:, :, :P] = pre
                mask[:, :, P:].view(1, e - a, wf, kr, wf).copy_(windows[None, a:e, :, :kr])
            else:
                vals = lat.values(qc, head).to(q.dtype)  # (B, m, K)
                mask[:, :, :P] = vals[..., lat.prefix_bucket, None]
                src = vals.view(B, e - a, wf, 1, -1).expand(B, e - a, wf, kr, vals.shape[-1])
                idx = windows[None, a:e, :, :kr].expand(B, e - a, wf, kr, wf)
                torch.gather(src, -1, idx, out=mask[:, :, P:].view(B, e - a, wf, kr, wf))
            of[:, a * wf : e * wf] = F.scaled_dot_product_attention(
                qc[:, None], kf[:, None, :nk], vf[:, None, :nk], attn_mask=mask[:, None], scale=scale
            )[:, 0]
        o = of.unflatten(1, (hf, wf))
        o = o.flip(2) if fl else o.flip(1, 2)  # reverse raster -> frame raster -> grid rows
        out[:, head, P:].unflatten(1, (h, w)).copy_(o.transpose(1, 2) if tr else o)
    return out
