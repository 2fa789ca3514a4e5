"""Bias primitives shared by the relative-bias encodings: iRPE's piecewise index and bucket maps, the lattice of
grid offsets and the one rule for the bias of pairs with a prefix (CLS, register) token.

Conventions: offsets are *query minus key* (``p_i - p_j``, iRPE's convention); grids are row-major
``(h, w)``; bucket maps are integer tensors built once per grid and shared by every layer. Index math
runs on int64 grids converted to fp32 (the reference computes ``g`` in float32; see
:func:`piecewise_index`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "IRPE_METHODS",
    "piecewise_index",
    "irpe_num_buckets",
    "irpe_offset_buckets",
    "toeplitz_2d",
    "compact_index_dtype",
    "lattice_offsets",
    "clear_prefix",
]

IRPE_METHODS = ("euclidean", "quant", "cross", "product")
IRPEMethod = Literal["euclidean", "quant", "cross", "product"]


def piecewise_index(x: Tensor, alpha: float, beta: float, gamma: float) -> Tensor:
    """iRPE's piecewise index function ``g`` (Wu et al., ICCV 2021, Eq. 18), int64.

    ``g(x) = round(x)`` for ``|x| <= alpha``; otherwise
    ``sign(x) * min(beta, round(alpha + ln(|x| / alpha) / ln(gamma / alpha) * (beta - alpha)))``,
    truncated toward zero, so every output lies in ``[-floor(beta), floor(beta)]``. Computed in float32
    (the reference's precision, which decides rounding at the segment boundaries).
    """
    if not 0 < alpha < beta < gamma:
        raise ValueError(f"piecewise_index needs 0 < alpha < beta < gamma, got {alpha}, {beta}, {gamma}")
    xf = x.float() if x.dtype != torch.float32 else x
    ax = xf.abs()
    near = xf.round()  # |x| <= alpha: the offset itself
    far = alpha + torch.log(ax.clamp_min(alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.sign(xf) * far.round().clamp(max=beta)
    return torch.where(ax <= alpha, near, far).trunc().to(torch.int64)


def irpe_num_buckets(method: str, beta: float) -> int:
    """Buckets one iRPE table part holds for a grid (prefix bucket not included).

    ``2 floor(beta) + 1`` for euclidean / quant / each cross part, ``(2 floor(beta) + 1) ** 2`` for product.
    """
    s = 2 * int(beta) + 1
    return s * s if method == "product" else s


def irpe_offset_buckets(method: str, h: int, w: int, alpha: float, beta: float, gamma: float) -> Tensor:
    """Bucket of every grid offset: ``(P, 2h - 1, 2w - 1)`` int64, ``[p, dr + h - 1, dc + w - 1]``.

    ``dr, dc`` are query-minus-key row/column offsets. ``P = 2`` for ``cross`` (rows part, columns part),
    else 1. Buckets are non-negative: ``g + floor(beta)`` (product: ``(g_r + b) S + g_c + b``).
    """
    if method not in IRPE_METHODS:
        raise ValueError(f"unknown iRPE method {method!r}; choose one of {IRPE_METHODS}")
    b = int(beta)
    dr = torch.arange(-(h - 1), h, dtype=torch.int64)[:, None].expand(2 * h - 1, 2 * w - 1)  # (2h-1, 2w-1)
    dc = torch.arange(-(w - 1), w, dtype=torch.int64)[None, :].expand(2 * h - 1, 2 * w - 1)

    def g(x: Tensor) -> Tensor:
        return piecewise_index(x, alpha, beta, gamma)

    if method == "euclidean":
        dist = (dr.square() + dc.square()).float().sqrt().round()  # rounded Euclidean distance
        parts = [g(dist) + b]
    elif method == "quant":
        parts = [g(dr.square() + dc.square()) + b]  # the reference's code: g of the squared distance
    elif method == "cross":
        parts = [g(dr) + b, g(dc) + b]
    else:
        s = 2 * b + 1
        parts = [(g(dr) + b) * s + (g(dc) + b)]
    return torch.stack(parts)  # (P, 2h-1, 2w-1)


def toeplitz_2d(offset_table: Tensor, h: int, w: int, *, out: Tensor | None = None) -> Tensor:
    """Expand an offset table ``(P, 2h-1, 2w-1)`` to the pair map ``(P, hw, hw)`` of a row-major grid.

    ``out[p, i, j] = offset_table[p, r_i - r_j + h - 1, c_i - c_j + w - 1]``, written one grid row of
    queries at a time (``w x hw`` per step), so nothing larger than the result is ever allocated; ``out``
    may be a view (e.g. the patch block of a map with prefix tokens).
    """
    P = offset_table.shape[0]
    n = h * w
    if out is None:
        out = torch.empty(P, n, n, dtype=offset_table.dtype, device=offset_table.device)
    r = torch.arange(h, device=offset_table.device)
    c = torch.arange(w, device=offset_table.device)
    cols = c[:, None] - c[None, :] + (w - 1)  # (w_i, w_j): c_i - c_j
    for ri in range(h):
        block = offset_table[:, ri - r + (h - 1)]  # (P, h_j, 2w-1): row offsets r_i - r_j
        block = block[:, :, cols]  # (P, h_j, w_i, w_j)
        out[:, ri * w : (ri + 1) * w] = block.permute(0, 2, 1, 3).reshape(P, w, n)
    return out


def compact_index_dtype(max_value: int) -> torch.dtype:
    """Smallest integer dtype holding ``[0, max_value]`` (bucket maps of large grids are stored compact)."""
    if max_value < 2**8:
        return torch.uint8
    if max_value < 2**15:
        return torch.int16
    return torch.int32


def lattice_offsets(h: int, w: int, device: torch.device | str | None = None) -> Tensor:
    """Every key-minus-query offset of an ``h x w`` grid as coordinates ``(1, (2h-1)(2w-1), 2)`` fp32, ``(dy, dx)``
    in row-major order from ``(-(h-1), -(w-1))``: keys at these coordinates seen from a query at the origin
    give a bias encoding's :class:`~vlpe.encodings.LatticeBias` table through its own pairwise code."""
    dy = torch.arange(-(h - 1), h, device=device, dtype=torch.float32)
    dx = torch.arange(-(w - 1), w, device=device, dtype=torch.float32)
    return torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1).reshape(1, -1, 2)


def clear_prefix(bias: Tensor, prefix: int, q_idx: slice | Tensor, kv_idx: Tensor | None = None) -> Tensor:
    """The bias with every pair involving one of the first ``prefix`` tokens (CLS, registers) set to 0.

    ``q_idx`` a step-1 slice of query rows: ``bias`` ``(..., n, N)`` holds those rows and every key, cleared in
    place (the dense chunks of the fast path). ``q_idx`` / ``kv_idx`` index tensors (FlexAttention's
    ``score_mod``): out of place, ``torch.where`` on the broadcast indices (traced by ``torch.compile``).
    """
    if not prefix:
        return bias
    if isinstance(q_idx, slice):
        bias[..., :prefix] = 0.0
        start = q_idx.start or 0
        if start < prefix:
            bias[..., : min(prefix - start, bias.shape[-2]), :] = 0.0
        return bias
    return torch.where((q_idx < prefix) | (kv_idx < prefix), torch.zeros_like(bias), bias)
