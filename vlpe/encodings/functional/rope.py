"""Rotary primitives shared by every rotary encoding (axial, mixed, multimodal, ComRoPE's RoPE part).

Layout: vlpe's canonical layout is *half* (NeoX / Hugging Face / DINOv3): rotation pair ``m`` is the
channel pair ``(m, m + D/2)``. Tables are stored at half width, ``(..., N, D/2)``, and applied by
``mul`` + ``add_``/``sub_`` straight into one output buffer, with a hand-written backward (the inverse rotation);
on CPU this halves the cost of the autograd ``chunk``/``mul``/``cat`` graph in a training step, and the half
layout is ~1.6x cheaper than the interleaved ``stack`` + ``reshape``.
timm's default *interleaved* layout (pairs ``(2m, 2m+1)``) is reachable with :func:`to_interleaved`.

Numerics: angles are products of fp32 coordinates and fp32 frequencies computed with autocast disabled;
``apply_rope`` rotates in the tables' precision and casts back to the input dtype (timm's rule).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "inv_freq",
    "axial_inv_freq",
    "rope_angles",
    "cos_sin",
    "apply_rope",
    "rotate_half",
    "to_interleaved",
    "to_half",
]


def inv_freq(num_pairs: int, theta: float = 10000.0, *, dim: int | None = None, device=None) -> Tensor:
    """Standard inverse frequencies ``theta ** (-2j / dim)`` for ``j < num_pairs``, fp32 (``dim`` defaults to ``2 * num_pairs``)."""
    dim = 2 * num_pairs if dim is None else dim
    j = torch.arange(num_pairs, device=device, dtype=torch.int64).float()  # (P,)
    return 1.0 / (theta ** (2.0 * j / dim))


def axial_inv_freq(head_dim: int, num_axes: int, theta: float = 100.0, *, device=None) -> Tensor:
    """Axial RoPE frequencies as an ``(A, D/2)`` matrix: pair ``m`` reads axis ``m // (D/2A)``.

    Each axis gets ``P = D // (2A)`` consecutive pairs with frequencies ``theta ** (-k / P)``, k < P
    (timm/EVA ``freq_bands(dim // 4, step=1)`` for 2 axes, rope-vit's ``theta ** (-4k/d)``). Pairs left over
    when ``D/2`` is not divisible by A get frequency 0: they are not rotated.
    """
    if head_dim % 2:
        raise ValueError(f"rotary encodings need an even head dim, got {head_dim}")
    half = head_dim // 2
    per_axis = half // num_axes
    if per_axis < 1:
        raise ValueError(f"head dim {head_dim} is too small for {num_axes} rotary axes (need >= {2 * num_axes})")
    band = inv_freq(per_axis, theta, dim=2 * per_axis, device=device)  # (P,)
    freqs = torch.zeros(num_axes, half, device=device)  # (A, D/2)
    for a in range(num_axes):
        freqs[a, a * per_axis : (a + 1) * per_axis] = band
    return freqs


def rope_angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """Angles ``coords @ freqs`` in fp32 with autocast off.

    Args:
        coords: ``(B, N, A)`` positions.
        freqs: ``(A, P)`` shared, or ``(..., A, P)`` with leading dims (layers, heads) broadcast in front.

    Returns:
        ``(B, N, P)`` for 2-D ``freqs``; ``(B, *lead, N, P)`` otherwise.
    """
    with torch.autocast(coords.device.type, enabled=False):
        c = coords.float() if coords.dtype != torch.float64 else coords
        f = freqs.to(c.dtype)
        if f.dim() == 2:
            return c @ f  # (B, N, P)
        lead = f.shape[:-2]
        c = c.reshape(c.shape[0], *([1] * len(lead)), *c.shape[1:])  # (B, 1.., N, A)
        return c @ f  # (B, *lead, N, P)


def cos_sin(angles: Tensor) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of fp32 angles, autocast off."""
    with torch.autocast(angles.device.type, enabled=False):
        return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False) -> Tensor:
    """Half-layout rotation by ``+angle`` (``-angle`` when ``inverse``) written straight into one output buffer.

    Elementwise ``mul``/``sub_``/``add_`` per half in the promoted precision (rounding exactly like the plain
    formula), no ``cat``; then one cast back to ``x.dtype`` when the tables are wider. Not differentiable itself (``out=``); see
    :class:`_RoPEFunction`. Under ``torch.compile`` the same operations run out of place
    (:func:`_rotate_functional`), which the compiler traces without a graph break.
    """
    P = cos.shape[-1]
    rot, D = 2 * P, x.shape[-1]
    dt = torch.promote_types(x.dtype, cos.dtype)
    lead = torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    if torch.compiler.is_compiling():
        return _rotate_functional(x, cos, sin, inverse=inverse, dt=dt, lead=lead)
    out = torch.empty(*lead, D, dtype=dt, device=x.device)  # (..., N, D)
    x1, x2 = x[..., :P], x[..., P:rot]
    o1, o2 = out[..., :P], out[..., P:rot]
    tmp = torch.empty(o1.shape, dtype=dt, device=x.device)  # (..., N, D/2)
    torch.mul(x1, cos, out=o1)
    torch.mul(x2, sin, out=tmp)
    o1.add_(tmp) if inverse else o1.sub_(tmp)  # x1 cos - x2 sin   (inverse: + x2 sin)
    torch.mul(x2, cos, out=o2)
    torch.mul(x1, sin, out=tmp)
    o2.sub_(tmp) if inverse else o2.add_(tmp)  # x2 cos + x1 sin  (inverse: - x1 sin)
    if rot != D:
        out[..., rot:] = x[..., rot:]  # partial rotary: the rest passes through
    return out if dt == x.dtype else out.to(x.dtype)


def _rotate_functional(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool, dt: torch.dtype, lead) -> Tensor:
    """:func:`_rotate` without ``out=`` (``torch.compile`` cannot write into the strided halves of one buffer):
    the same elementwise operations in the same precision, joined by ``cat``; the compiler fuses them."""
    P = cos.shape[-1]
    rot, D = 2 * P, x.shape[-1]
    x1, x2 = x[..., :P], x[..., P:rot]  # (..., N, D/2) each
    a1, b1 = x1 * cos, x2 * sin
    a2, b2 = x2 * cos, x1 * sin
    o1 = a1 + b1 if inverse else a1 - b1  # x1 cos - x2 sin   (inverse: + x2 sin)
    o2 = a2 - b2 if inverse else a2 + b2  # x2 cos + x1 sin  (inverse: - x1 sin)
    parts = [o1, o2]  # (*lead, D/2) each: x and the tables broadcast
    if rot != D:
        parts.append(x[..., rot:].to(dt).expand(*lead, D - rot))  # partial rotary: the rest passes through
    out = torch.cat(parts, dim=-1)  # (..., N, D)
    return out if dt == x.dtype else out.to(x.dtype)


class _RoPEFunction(torch.autograd.Function):
    """Rotation with a hand-written backward: the gradient of a rotation is the inverse rotation.

    Saves only the tables (and ``x`` when the tables themselves need a gradient, as learned frequencies do),
    about half the backward work of the autograd graph of ``chunk``/``mul``/``cat``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        tables_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if tables_grad else None, cos, sin)
        ctx.x_meta = (x.shape, x.dtype)
        return _rotate(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, cos, sin = ctx.saved_tensors
        x_shape, x_dtype = ctx.x_meta
        gx = gc = gs = None
        if ctx.needs_input_grad[0]:
            gx = _rotate(g.to(x_dtype), cos, sin, inverse=True)
            if gx.shape != x_shape:
                gx = gx.sum_to_size(x_shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            P = cos.shape[-1]
            dt = torch.promote_types(g.dtype, cos.dtype)
            g1, g2 = g[..., :P].to(dt), g[..., P : 2 * P].to(dt)
            x1, x2 = x[..., :P].to(dt), x[..., P : 2 * P].to(dt)
            if ctx.needs_input_grad[1]:
                gc = torch.addcmul(g1 * x1, g2, x2).sum_to_size(cos.shape).to(cos.dtype)
            if ctx.needs_input_grad[2]:
                gs = torch.addcmul(g2 * x1, g1, x2, value=-1).sum_to_size(sin.shape).to(sin.dtype)
        return gx, gc, gs


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., N, D) by half-width tables ``cos``/``sin`` (..., N, D/2) in the half layout.

    Pair ``m`` = channels ``(m, m + D/2)``: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``.
    Channels beyond ``2 * cos.shape[-1]`` (partial rotary) pass through unchanged. Leading dims broadcast.
    Under autograd the backward is the inverse rotation (first-order gradients only, also for the tables).
    """
    if 2 * cos.shape[-1] > x.shape[-1] or cos.shape[-1] != sin.shape[-1]:
        raise ValueError(
            f"apply_rope: tables cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must have the same width and "
            f"rotate at most the {x.shape[-1]} channels of x"
        )
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return _RoPEFunction.apply(x, cos, sin)
    return _rotate(x, cos, sin)


def rotate_half(x: Tensor) -> Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim (Hugging Face's helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def to_interleaved(x: Tensor) -> Tensor:
    """Channel permutation half -> interleaved: ``[a0..a_{P-1}, b0..b_{P-1}] -> [a0, b0, a1, b1, ...]``."""
    a, b = x.chunk(2, dim=-1)
    return torch.stack([a, b], dim=-1).flatten(-2)


def to_half(x: Tensor) -> Tensor:
    """Inverse of :func:`to_interleaved`."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
