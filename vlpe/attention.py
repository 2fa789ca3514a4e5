"""Reference attention that applies an encoding's hooks, with ``sdpa``, ``eager`` and ``flex`` backends.

* ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention`. Encodings without a bias keep the
  fused kernel; a bias is built per query chunk (``max_bias_bytes``) so a dense ``(B, H, N, N)`` bias
  is never held whole at large N.
* ``eager``: explicit ``softmax(q k^T * scale + bias) v``; required by encodings with a ``values`` hook.
* ``flex``: FlexAttention with the encoding's ``score_mod`` / ``block_mask``. Compiled; on CPU torch
  has no FlexAttention backward, so training on CPU must use ``sdpa`` or ``eager``.

Inference fast path of ``sdpa`` (``attend(..., fast=None)``: automatic from :data:`FAST_MIN_TOKENS` tokens on
when no autograd graph is needed; ``fast=True`` forces it, ``fast=False`` keeps the reference path): one SDPA
call per head and query chunk, the chunk's bias at most :data:`FAST_BIAS_BYTES`, built just before the call
reads it, while it is still in cache, and the keys and values of that head stay cached across its chunks.

* on lattice positions (``Positions.lattice``; any 2D grid for iRPE, which reads only the grid) an
  encoding's :meth:`~vlpe.encodings.Encoding.lattice_bias` table gives every chunk's bias as one strided
  copy of a ``(2h-1, 2w-1)`` table (no arithmetic per pair; iRPE's contextual term one gather of the
  chunk's per-query bucket values), and the keys outside a head's masked half-plane (LookHere's fields of
  view) are not computed at all;
* otherwise :meth:`~vlpe.encodings.Encoding.score_heads` builds the chunk's bias head by head, sharing the
  per-chunk work (distances, masks, index maps) between heads;
* encodings with neither keep the reference path;
* widened q/k (``widen``, PaPE) get v padded with zero channels to their width: SDPA's fused CPU kernel needs
  one head width and otherwise falls back to its math kernel, which holds the (B, H, N, N) attention.

Training (and any call needing autograd) always takes the reference path. The fast path equals it to fp32
rounding (the same bias values; skipped keys have attention weight exactly 0), checked in
tests/test_fast_attention.py. FlexAttention's compiled CPU forward was measured slower than SDPA here
(``benchmarks/encoding_cost.py --layer --flex``), so it is not the CPU fast path.

The softmax scale is ``head_dim ** -0.5`` of the q/k *as given*, before any ``widen`` features.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .encodings.base import Context, Encoding, LatticeBias
from .positions import Positions

__all__ = [
    "attend", "attention_logits", "Attention", "dense_score_mod", "Backend", "check_qkv", "FAST_MIN_TOKENS",
    "FAST_BIAS_BYTES",
]

Backend = Literal["sdpa", "eager", "flex"]
BACKENDS = ("sdpa", "eager", "flex")

#: Largest dense bias (bytes) built at once by the ``sdpa``/``eager`` paths; larger ones go by query chunks.
MAX_BIAS_BYTES = 16 * 2**20
#: The inference fast path is taken automatically from this many tokens on (see the module docstring).
FAST_MIN_TOKENS = 1024
#: Largest bias (bytes) of one head and query chunk on the fast path: small enough to stay in cache.
FAST_BIAS_BYTES = 4 * 2**20


def _key_padding(ctx: Context | None, dtype: torch.dtype) -> Tensor | None:
    """``(B, 1, 1, N)`` additive mask: 0 for real keys, -inf for padding."""
    if ctx is None or ctx.pos.valid is None:
        return None
    valid = ctx.pos.valid[:, None, None, :]  # (B, 1, 1, N)
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))


def _shape(t) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def check_qkv(
    q: Tensor, k: Tensor, v: Tensor | None, *, enc: Encoding | None, ctx: Context | None, who: str,
    attn_mask: Tensor | None = None,
) -> None:
    """Shape checks (no tensor is read): ``q, k, v`` are (B, H, N, Dh) with one batch and head count; with an
    encoding, self-attention over the tokens its ``ctx`` describes, with its heads and head width."""
    tensors = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    if any(not isinstance(t, Tensor) or t.dim() != 4 for t in tensors.values()):
        got = ", ".join(f"{n} {_shape(t)}" for n, t in tensors.items())
        raise ValueError(f"{who}: q, k, v must be (B, H, N, Dh) tensors, got {got}")
    B, H, Nq, D = q.shape
    if k.shape[0] != B or (v is not None and v.shape[0] != B):
        raise ValueError(f"{who}: q, k, v must share one batch size, got q {_shape(q)}, k {_shape(k)}"
                         + ("" if v is None else f", v {_shape(v)}"))
    if k.shape[1] != H or (v is not None and v.shape[1] != H):
        raise ValueError(f"{who}: q, k, v must have the same number of heads, got q {H}, k {k.shape[1]}"
                         + ("" if v is None else f", v {v.shape[1]}"))
    if k.shape[-1] != D:
        raise ValueError(f"{who}: q and k must have the same head width, got {D} and {k.shape[-1]}")
    if v is not None and v.shape[-2] != k.shape[-2]:
        raise ValueError(f"{who}: k and v must have the same number of tokens, got {k.shape[-2]} and {v.shape[-2]}")
    if enc is not None:
        name = type(enc).__name__
        if H != enc.num_heads:
            raise ValueError(f"{who}: {name} was built for {enc.num_heads} heads, q/k have {H}; build the encoding "
                             f"with num_heads={H}")
        if D != enc.head_dim:
            raise ValueError(f"{who}: {name} was built for head_dim={enc.head_dim} (dim={enc.dim} / "
                             f"{enc.num_heads} heads), q/k have head width {D}")
        if k.shape[-2] != Nq:
            raise ValueError(f"{who}: an encoding needs self-attention over the tokens of its positions, got "
                             f"{Nq} query and {k.shape[-2]} key tokens")
        if ctx is not None and isinstance(ctx, Context):
            Encoding.check_tokens(q, ctx, who)
            if ctx.pos.batch not in (1, B):
                raise ValueError(f"{who}: positions have batch {ctx.pos.batch} but q/k have batch {B}; give one "
                                 f"set of positions (batch 1) or one per sample")
    if attn_mask is not None:
        target = (B, H, Nq, k.shape[-2])
        try:
            fits = not isinstance(attn_mask, Tensor) or attn_mask.dim() > 4 or (
                torch.broadcast_shapes(attn_mask.shape, target) != target
            )
        except RuntimeError:
            fits = True
        if fits:
            raise ValueError(f"{who}: attn_mask {_shape(attn_mask)} must broadcast to (B, H, N, N) = {target}")


def _combine(*biases: Tensor | None) -> Tensor | None:
    out = None
    for b in biases:
        if b is None:
            continue
        out = b if out is None else out + b
    return out


def _row_chunks(q: Tensor, n_keys: int, heads: int, max_bytes: int) -> list[slice]:
    n = q.shape[-2]
    per_row = max(1, q.shape[0] * heads * n_keys * 4)
    rows = max(1, min(n, max_bytes // per_row))
    return [slice(s, min(s + rows, n)) for s in range(0, n, rows)]


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    enc: Encoding | None = None,
    ctx: Context | None = None,
    layer: int = 0,
    backend: Backend = "sdpa",
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    max_bias_bytes: int = MAX_BIAS_BYTES,
    fast: bool | None = None,
) -> Tensor:
    """Attention over ``q, k, v`` (B, H, N, Dh) with every hook of ``enc`` applied; returns (B, H, N, Dh).

    ``ctx`` is ``enc.prepare(pos)``, built once per forward and shared by all layers. ``attn_mask`` is an
    extra additive (float) or keep (bool) mask broadcastable to (B, H, N, N). ``fast``: the inference fast
    path of the ``sdpa`` backend for bias and widening encodings (module docstring): None takes it from
    :data:`FAST_MIN_TOKENS` tokens on when nothing needs gradients, True whenever it applies (a
    ``ValueError`` says why it cannot: autograd, ``attn_mask``, ``is_causal``, dropout, another backend or a
    ``values`` term), False never.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if fast is not None and not isinstance(fast, bool):
        raise ValueError(f"fast must be None (automatic), True or False, got {fast!r}")
    if (enc is None) != (ctx is None):
        raise ValueError("attend needs both `enc` and `ctx` (ctx = enc.prepare(pos)) or neither")
    if enc is not None and (not isinstance(ctx, Context) or ctx.owner not in (None, enc)):
        got = type(ctx).__name__ if not isinstance(ctx, Context) else f"a Context of {type(ctx.owner).__name__}"
        raise ValueError(f"attend: ctx must be what enc.prepare(pos) returned for this {type(enc).__name__}, got {got}")
    check_qkv(q, k, v, enc=enc, ctx=ctx, who=f"{type(enc).__name__ if enc is not None else ''} attention".strip(),
              attn_mask=attn_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if enc is not None:
        q, k = enc.rotate(q, k, ctx, layer)
        q, k = enc.widen(q, k, ctx, layer)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    pad = _key_padding(ctx, q.dtype)
    has_score = enc is not None and enc.uses("score")
    has_values = enc is not None and enc.uses("values")
    if has_values and backend != "eager":
        backend = "eager" if backend == "sdpa" else backend
        if backend == "flex":
            raise ValueError(f"{type(enc).__name__} has a values term, which needs the eager backend, not flex")

    if (has_score or q.shape[-1] != v.shape[-1]) and fast is not False:
        why = _fast_blocker(backend, has_values, attn_mask, is_causal, dropout_p, enc, (q, k, v))
        if fast and why:
            raise ValueError(f"attend(fast=True): the inference fast path does not apply: {why}")
        if why is None and (fast or q.shape[-2] >= FAST_MIN_TOKENS):
            out = _fast_attention(q, k, v, enc, ctx, layer, scale, pad)
            if out is not None:
                return out

    if backend == "flex":
        return _flex(q, k, v, enc, ctx, layer, scale, _combine(attn_mask, pad), is_causal)

    static = _combine(attn_mask, pad)
    if not has_score and not has_values and backend == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=static, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )
    n_q, n_k = q.shape[-2], k.shape[-2]
    causal = None
    if is_causal:
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril().logical_not()
    outs = []
    for rows in _row_chunks(q, n_k, q.shape[1], max_bias_bytes):
        qr = q[:, :, rows]  # (B, H, n, D)
        bias = enc.score(qr, k, ctx, layer, rows=rows) if has_score else None
        mask = _combine(bias, None if static is None else _rows(static, rows, n_q))
        if causal is not None:
            c = causal[rows]
            mask = _combine(mask, torch.zeros(c.shape, dtype=q.dtype, device=q.device).masked_fill(c, float("-inf")))
        if backend == "sdpa":
            if mask is not None and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)
            outs.append(F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale))
            continue
        logits = (qr @ k.transpose(-2, -1)) * scale  # (B, H, n, N)
        if mask is not None:
            logits = logits + mask.to(logits.dtype)
        attn = logits.softmax(dim=-1)
        if dropout_p:
            attn = F.dropout(attn, p=dropout_p)
        out = attn @ v  # (B, H, n, D)
        if has_values:
            extra = enc.values(attn, ctx, layer, rows=rows)
            if extra is not None:
                out = out + extra.to(out.dtype)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _rows(mask: Tensor, rows: slice, n_q: int) -> Tensor:
    return mask[..., rows, :] if mask.shape[-2] == n_q else mask


# --------------------------------------------------------------------------- inference fast path
def _needs_grad(enc: Encoding | None, tensors: tuple[Tensor, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    return enc is not None and any(p.requires_grad for p in enc.parameters())


def _fast_blocker(backend, has_values, attn_mask, is_causal, dropout_p, enc, tensors) -> str | None:
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


def _fast_attention(q, k, v, enc, ctx, layer, scale, pad) -> Tensor | None:
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
        if enc is None or not enc.uses("score"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=pad, scale=scale)[..., :Dv]
        out = _fast_attention(q, k, v, enc, ctx, layer, scale, pad)
        return None if out is None else out[..., :Dv]
    pos = ctx.pos
    if pad is None and pos.grid is not None and len(pos.grid) == 2:  # the encoding checks pos.lattice if it must
        lat = enc.lattice_bias(ctx, layer)
        if lat is not None:
            return _lattice_attention(q, k, v, lat, pos, scale)
    return _head_attention(q, k, v, enc, ctx, layer, scale, pad)


def _head_attention(q, k, v, enc, ctx, layer, scale, pad) -> Tensor | None:
    """SDPA per query chunk and head with the bias of :meth:`Encoding.score_heads`; None when not offered.

    Query chunks hold at most :data:`FAST_BIAS_BYTES` of one head's bias; each chunk's shared work is done once
    by ``score_heads``, then each head's bias is built and read at once.
    """
    B, H, N, _ = q.shape
    n_k = k.shape[-2]
    step = max(1, min(N, FAST_BIAS_BYTES // max(1, B * n_k * q.element_size())))
    out = None
    for start in range(0, N, step):
        rows = slice(start, min(start + step, N))
        qr = q[:, :, rows]  # (B, H, n, D)
        build = enc.score_heads(qr, k, ctx, layer, rows)
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


def attention_logits(enc: Encoding, q: Tensor, k: Tensor, pos: Positions, layer: int = 0) -> Tensor:
    """Pre-softmax scores ``(B, H, N, N)`` with every effect of ``enc`` on them included.

    ``q, k``: ``(B, H, N, Dh)`` as they enter attention. For tests and plots (this materialises N x N).
    """
    ctx = enc.prepare(pos)
    check_qkv(q, k, None, enc=enc, ctx=ctx, who=f"{type(enc).__name__} attention_logits")
    scale = q.shape[-1] ** -0.5
    q, k = enc.rotate(q, k, ctx, layer)
    q, k = enc.widen(q, k, ctx, layer)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
    bias = enc.score(q, k, ctx, layer, rows=None)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    pad = _key_padding(ctx, logits.dtype)
    return logits if pad is None else logits + pad


# --------------------------------------------------------------------------- flex
def dense_score_mod(enc: Encoding, q: Tensor, k: Tensor, ctx: Context, layer: int):
    """A FlexAttention ``score_mod`` reading the encoding's dense bias (fine for small N)."""
    bias = enc.score(q, k, ctx, layer, rows=None)
    if bias is None:
        return None
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).contiguous()  # (B, H, N, N)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx].to(score.dtype)

    return score_mod


_compiled_flex = None


def _flex(q, k, v, enc, ctx, layer, scale, static, is_causal):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(
            "FlexAttention has no backward on CPU in this torch; use backend='sdpa' (or 'eager') for CPU training"
        )
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    mods = []
    block_mask = None
    if enc is not None and enc.uses("score"):
        sm, block_mask = enc.flex(q, k, ctx, layer)
        if sm is not None:
            mods.append(sm)
    if static is not None:
        st = static.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).contiguous()
        mods.append(lambda score, b, h, qi, ki: score + st[b, h, qi, ki].to(score.dtype))
    if is_causal:
        mods.append(lambda score, b, h, qi, ki: torch.where(qi >= ki, score, float("-inf")))

    def score_mod(score, b, h, q_idx, kv_idx):
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    return _compiled_flex(q, k, v, score_mod=score_mod if mods else None, block_mask=block_mask, scale=scale)


# --------------------------------------------------------------------------- module
class Attention(nn.Module):
    """Multi-head self-attention (timm ``Attention`` layout: fused ``qkv`` then ``proj``) with encoding hooks."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        backend: Backend = "sdpa",
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.backend = backend
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        *,
        enc: Encoding | None = None,
        ctx: Context | None = None,
        layer: int = 0,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"Attention expects tokens (B, N, C), got {_shape(x)}; add the batch dimension")
        B, N, C = x.shape
        if C != self.qkv.in_features:
            raise ValueError(f"Attention was built for dim={self.qkv.in_features}, got tokens of width {C}")
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, Dh) each
        q, k = self.q_norm(q), self.k_norm(k)
        out = attend(
            q,
            k,
            v,
            enc=enc,
            ctx=ctx,
            layer=layer,
            backend=self.backend,
            attn_mask=attn_mask,
            dropout_p=self.attn_drop if self.training else 0.0,
        )  # (B, H, N, Dh)
        out = out.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(out))
