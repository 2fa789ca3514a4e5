"""Reference attention that applies an encoding's hooks, with ``sdpa``, ``eager`` and ``flex`` backends.

* ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention`. Encodings without a bias keep the
  fused kernel; a bias is built per query chunk (``max_bias_bytes``) so a dense ``(B, H, N, N)`` bias
  is never held whole at large N.
* ``eager``: explicit ``softmax(q k^T * scale + bias) v``; required by encodings with a ``values`` hook.
* ``flex``: FlexAttention with the encoding's ``score_mod`` / ``block_mask``. Compiled; on CPU torch
  has no FlexAttention backward, so training on CPU must use ``sdpa`` or ``eager``.

Inference fast path of ``sdpa`` (``attend(..., fast=None)``: automatic from :data:`FAST_MIN_TOKENS` tokens on,
or the ``min_tokens`` the encoding's fast form registers (:mod:`vlpe.attention_forms`), when no autograd graph is
needed; ``fast=True`` forces it, ``fast=False`` keeps the reference path): SDPA per head over chunks of queries
bounded in bytes of bias (:data:`FAST_BIAS_BYTES` per call), each chunk's bias built just before the call reads it.

* on lattice positions (``Positions.lattice``; any 2D grid for iRPE, which reads only the grid) the lattice form
  registered for the encoding (:mod:`vlpe.attention_forms`) gives every chunk's bias as one strided copy of a
  ``(2h-1, 2w-1)`` table (no arithmetic per pair; iRPE's contextual term one gather of the chunk's per-query
  bucket values); on CPU the keys go in pieces combined exactly through their log-sum-exp, so a call holds
  many query rows, and the keys outside a head's masked half-plane (LookHere's fields of view) are not
  computed at all;
* otherwise the registered per-head form builds the chunk's bias head by head, sharing the per-chunk work
  (distances, masks, index maps) between heads;
* encodings with neither keep the reference path;
* widened q/k (``widen``, PaPE) get v padded with zero channels to their width: SDPA's fused CPU kernel needs
  one head width and otherwise falls back to its math kernel, which holds the (B, H, N, N) attention.

Training (and any call needing autograd) always takes the reference path. The fast path equals it to fp32
rounding (the same bias values; skipped keys have attention weight exactly 0), checked in
tests/test_fast_attention.py and, form by form, tests/test_fast_forms_registry.py. FlexAttention's compiled CPU
forward was measured slower than SDPA here (``benchmarks/encoding_cost.py --layer --flex``), so it is not the
CPU fast path.

The softmax scale is ``head_dim ** -0.5`` of the q/k *as given*, before any ``widen`` features.

Which hooks and registered forms run is read from the plan of ``enc.prepare(pos)`` (``ctx.plan[layer]``), never
from the class; the contract a hand-written block follows is in :mod:`vlpe.encodings.plan`. The fast path lives in
:mod:`vlpe.attention_fast`, the FlexAttention path (and the dense ``score_mod`` fallback) in
:mod:`vlpe.attention_flex`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention_fast import FAST_BIAS_BYTES, _combine, fast_attention, fast_blocker
from .attention_forms.registry import fast_min_tokens
from .attention_flex import dense_score_mod, flex_attend
from .encodings.base import Context, Encoding
from .positions import Positions

__all__ = [
    "attend", "attention_logits", "Attention", "dense_score_mod", "Backend", "check_qkv", "FAST_MIN_TOKENS",
    "MAX_BIAS_BYTES", "FAST_BIAS_BYTES",
]

Backend = Literal["sdpa", "eager", "flex"]
BACKENDS = ("sdpa", "eager", "flex")

#: Largest dense bias (bytes) built at once by the ``sdpa``/``eager`` paths; larger ones go by query chunks.
MAX_BIAS_BYTES = 16 * 2**20
#: The inference fast path is taken automatically from this many tokens on (see the module docstring).
FAST_MIN_TOKENS = 1024


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
    :data:`FAST_MIN_TOKENS` tokens on (the ``min_tokens`` its fast form registers, if any) when nothing
    needs gradients, True whenever it applies (a
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
    step = ctx.plan[layer] if enc is not None else None  # which pieces this layer has (the plan, as data)
    if step is not None:
        if step.rotate:
            q, k = enc.rotate(q, k, ctx, layer)
        if step.widen:
            q, k = enc.widen(q, k, ctx, layer)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    pad = _key_padding(ctx, q.dtype)
    has_score = step is not None and step.score
    has_values = step is not None and step.values
    if has_values and backend != "eager":
        backend = "eager" if backend == "sdpa" else backend
        if backend == "flex":
            raise ValueError(f"{type(enc).__name__} has a values term, which needs the eager backend, not flex")

    if (has_score or q.shape[-1] != v.shape[-1]) and fast is not False:
        why = fast_blocker(backend, has_values, attn_mask, is_causal, dropout_p, enc, (q, k, v))
        if fast and why:
            raise ValueError(f"attend(fast=True): the inference fast path does not apply: {why}")
        least = (None if enc is None else fast_min_tokens(enc)) or FAST_MIN_TOKENS
        if why is None and (fast or q.shape[-2] >= least):
            out = _fast_attention(q, k, v, enc, ctx, step, layer, scale, pad)
            if out is not None:
                return out

    if backend == "flex":
        return flex_attend(q, k, v, enc, ctx, step, layer, scale, _combine(attn_mask, pad), is_causal)

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


_fast_attention = fast_attention  # module attribute: tests replace it to check which path is taken


_LOGITS_USAGE = "call attention_logits(q, k, enc=enc, pos=pos, layer=0) (the order of attend(q, k, v, enc=, ctx=))"
_LOGITS_CONTRACT = ("enc", "q", "k", "pos", "layer")  # the public contract's positional order


def attention_logits(
    q: Tensor | Encoding,
    k: Tensor | None = None,
    *contract: Tensor | Positions | int,
    enc: Encoding | None = None,
    pos: Positions | None = None,
    layer: int | None = None,
) -> Tensor:
    """Pre-softmax scores with every effect of ``enc`` on them included (materialises N x N: for tests and plots).

    Called as ``attention_logits(q, k, enc=enc, pos=pos, layer=0)``, the argument order of :func:`attend`. The
    public contract's positional order ``attention_logits(enc, q, k, pos, layer=0)`` is the same call.

    Args:
        q: Queries ``(B, H, N, Dh)`` as they enter attention.
        k: Keys ``(B, H, N, Dh)``.
        contract: Nothing; or, in the contract's order (``q`` the encoding, ``k`` the queries), the keys, the
            positions and optionally the layer.
        enc: The encoding.
        pos: The positions of the ``N`` tokens.
        layer: The attention block (default 0).

    Returns:
        The logits ``(B, H, N, N)``, ``-inf`` on padding keys.

    Raises:
        TypeError: An argument missing, given twice, or more positional arguments than either order takes.
    """
    if isinstance(q, Encoding):  # the public contract's order: (enc, q, k, pos, layer)
        if len(contract) > 3:
            raise TypeError(f"attention_logits(enc, q, k, pos, layer=0) takes at most 5 positional arguments, got "
                            f"{2 + len(contract)}; {_LOGITS_USAGE}")  # fmt: skip
        given = dict(zip(_LOGITS_CONTRACT, (q, k, *contract)))
        for name, value in (("enc", enc), ("pos", pos), ("layer", layer)):
            if value is not None and name in given:
                raise TypeError(f"attention_logits got {name!r} both by position and by keyword; {_LOGITS_USAGE}")
            given.setdefault(name, value)
        enc, q, k, pos, layer = (given.get(name) for name in _LOGITS_CONTRACT)
    elif contract:
        raise TypeError(f"attention_logits takes at most 2 positional arguments here (q, k), got {2 + len(contract)}; "
                        f"{_LOGITS_USAGE}")  # fmt: skip
    missing = [name for name, given in (("enc", enc), ("k", k), ("pos", pos)) if given is None]
    if missing:
        raise TypeError(f"attention_logits is missing {', '.join(map(repr, missing))}; {_LOGITS_USAGE}")
    layer = 0 if layer is None else layer
    ctx = enc.prepare(pos)
    check_qkv(q, k, None, enc=enc, ctx=ctx, who=f"{type(enc).__name__} attention_logits")
    scale = q.shape[-1] ** -0.5
    step = ctx.plan[layer]
    if step.rotate:
        q, k = enc.rotate(q, k, ctx, layer)
    if step.widen:
        q, k = enc.widen(q, k, ctx, layer)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
    bias = enc.score(q, k, ctx, layer, rows=None) if step.score else None
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    pad = _key_padding(ctx, logits.dtype)
    return logits if pad is None else logits + pad


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
