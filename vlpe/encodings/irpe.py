"""iRPE: image relative position encoding with bucketed 2D offsets (bias and contextual modes)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from .base import Context, Encoding
from .spec import EncodingSpec
from .functional.bias import (
    IRPE_METHODS,
    compact_index_dtype,
    irpe_num_buckets,
    irpe_offset_buckets,
    toeplitz_2d,
)
from .registry import register

__all__ = ["IRPE"]

_RPE_ON = ("q", "k", "v", "qk", "qkv")
_METHOD_ALIASES = {"euc": "euclidean"}
#: Bucket maps up to this many bytes are kept as int64 (ready for gather); larger ones are stored compact.
_INT64_INDEX_BYTES = 32 * 2**20
_CACHE_SIZE = 4


@register("irpe")
class IRPE(Encoding):
    """iRPE (Wu, Peng, Chen, Fu, Chao, "Rethinking and Improving Relative Position Encoding for Vision
    Transformer", ICCV 2021), re-derived from and checked against microsoft/Cream ``iRPE/DeiT-with-iRPE/irpe.py``.

    Query-minus-key grid offsets go through the piecewise index ``g`` (alpha:beta:gamma = 1:2:8 times
    ``ratio``) and one of four mappings (``euclidean``, ``quant`` = g of the squared distance as in the
    reference code, ``cross`` = separate row and column tables summed, ``product`` = a 2D table), giving a
    bucket per token pair. ``mode='bias'`` adds a learned scalar per bucket; ``mode='contextual'`` adds
    ``q_i . r_bucket / sqrt(d)`` on keys (``r`` indexed by ``I(i, j)``), ``k_j . r_bucket / sqrt(d)`` on queries
    (indexed by the reversed offset ``I(j, i)``) and ``sum_j a_ij r_bucket`` on values. Every pair involving a
    prefix token uses one extra bucket (the last). Tables are per layer, zero-initialised (so a fresh iRPE is
    exactly ``nope``), shared over heads unless ``shared_head=False``.

    The bucket map is built once per grid shape from ``Positions.grid`` (rectangular grids; coordinates are
    not read: buckets depend on grid offsets only) and cached by ``(h, w, prefix, device)``. The contextual
    term is ``torch.gather`` of the ``(B, H, n, buckets)`` product ``q @ table`` (the reference's CUDA
    ``rpe_index`` op, in plain PyTorch), the values term a ``scatter_add`` of the attention probabilities into
    buckets followed by one matmul, never an ``(N, N, d)`` gather.
    """

    claims = frozenset({"zero_init", "neutral", "relative", "extrapolation"})
    supported_axes = (2,)
    needs_grid = True

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        mode: Literal["bias", "contextual"] = "contextual",
        method: Literal["euclidean", "quant", "cross", "product"] = "product",
        ratio: float = 1.9,
        rpe_on: Literal["q", "k", "v", "qk", "qkv"] = "k",
        shared_head: bool = True,
    ) -> None:
        num_heads, depth = spec.num_heads, spec.depth
        super().__init__(spec=spec)
        method = _METHOD_ALIASES.get(method, method)
        if method not in IRPE_METHODS:
            raise ValueError(f"unknown iRPE method {method!r}; choose one of {IRPE_METHODS}")
        if mode == "ctx":
            mode = "contextual"
        if mode not in ("bias", "contextual"):
            raise ValueError(f"iRPE mode must be 'bias' or 'contextual', got {mode!r}")
        if rpe_on not in _RPE_ON:
            raise ValueError(f"rpe_on must be one of {_RPE_ON} (where iRPE attaches), got {rpe_on!r}")
        if mode == "bias" and "v" in rpe_on:
            raise ValueError("iRPE bias mode exists only on queries/keys; use mode='contextual' for rpe_on with 'v'")
        ratio = float(ratio)
        if not ratio > 0:
            raise ValueError(f"ratio must be > 0 (alpha = ratio, beta = 2 ratio, gamma = 8 ratio), got {ratio}")
        self.mode, self.method, self.ratio, self.rpe_on, self.shared_head = mode, method, ratio, rpe_on, shared_head
        self.alpha, self.beta, self.gamma = ratio, 2.0 * ratio, 8.0 * ratio
        self.parts = 2 if method == "cross" else 1
        self.grid_buckets = irpe_num_buckets(method, self.beta)  # per part, without the prefix bucket
        self.num_buckets = self.grid_buckets + 1  # per part; the last bucket is the prefix bucket
        kb = self.parts * self.num_buckets  # all parts side by side
        hs = 1 if shared_head else num_heads
        dh = self.head_dim
        for target in "qkv":
            if target not in rpe_on:
                self.register_parameter(f"table_{target}", None)
            elif mode == "bias":
                self.register_parameter(f"table_{target}", nn.Parameter(torch.zeros(depth, hs, kb)))
            elif target == "v":
                self.register_parameter("table_v", nn.Parameter(torch.zeros(depth, hs, kb, dh)))
            else:
                self.register_parameter(f"table_{target}", nn.Parameter(torch.zeros(depth, hs, dh, kb)))
        self._cache: dict[tuple, Tensor] = {}

    @property
    def pieces(self) -> frozenset[str]:
        """From ``rpe_on``: a bias with ``q``/``k`` (its faster forms are registered in
        :mod:`vlpe.attention_forms.irpe`), a values term only with ``v`` (without it the attention keeps SDPA)."""
        out = set()
        if "q" in self.rpe_on or "k" in self.rpe_on:
            out.add("score")
        if "v" in self.rpe_on:
            out.add("values")
        return frozenset(out)

    # ------------------------------------------------------------------ bucket map
    def bucket_ids(self, h: int, w: int, prefix: int = 0, device: torch.device | str | None = None) -> Tensor:
        """Bucket of every token pair, ``(P, N, N)`` with ``N = prefix + h w``; parts are not offset.

        Cached per ``(h, w, prefix, device)``; grids up to ~2048 tokens are int64, larger ones compact.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        key = (int(h), int(w), int(prefix), device.type, device.index)
        ids = self._cache.get(key)
        if ids is not None:
            return ids
        offsets = irpe_offset_buckets(self.method, h, w, self.alpha, self.beta, self.gamma).to(device)
        n = prefix + h * w
        dtype = torch.int64
        if self.parts * n * n * 8 > _INT64_INDEX_BYTES:
            dtype = compact_index_dtype(self.grid_buckets)
        ids = torch.full((self.parts, n, n), self.grid_buckets, dtype=dtype, device=device)  # prefix bucket
        toeplitz_2d(offsets.to(dtype), h, w, out=ids[:, prefix:, prefix:])
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = ids
        return ids

    def offset_buckets(self, h: int, w: int, device: torch.device | str | None = None) -> Tensor:
        """Bucket of every grid offset, ``(P, 2h - 1, 2w - 1)`` int64 at query-minus-key ``[p, dr + h - 1,
        dc + w - 1]`` (:func:`irpe_offset_buckets`), cached per ``(h, w, device)``."""
        device = torch.device("cpu") if device is None else torch.device(device)
        key = ("offsets", int(h), int(w), device.type, device.index)
        if key not in self._cache:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = irpe_offset_buckets(self.method, h, w, self.alpha, self.beta, self.gamma).to(device)
        return self._cache[key]

    def _prepare(self, ctx: Context) -> None:
        h, w = ctx.pos.grid
        ctx["ids"] = self.bucket_ids(h, w, ctx.pos.prefix, ctx.pos.device)  # (P, N, N)

    def _index(self, ctx: Context, rows: slice | None, transpose: bool) -> list[Tensor]:
        """Per part, the int64 bucket of every (query row, key) pair, offset into the side-by-side table.

        ``transpose`` gives ``I(j, i)`` (the reversed offset, for the query-side table).
        """
        ids = ctx["ids"]  # (P, N, N)
        rows = slice(None) if rows is None else rows
        sel = ids[:, :, rows].transpose(1, 2) if transpose else ids[:, rows]  # (P, n, N)
        out = []
        for p in range(self.parts):
            idx = sel[p] if sel.dtype == torch.int64 else sel[p].long()
            out.append(idx + p * self.num_buckets if p else idx)
        return out

    # ------------------------------------------------------------------ hooks
    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        """``e_ij += q_i . r[I(i, j)] / sqrt(d)`` (keys) and ``k_j . r[I(j, i)] / sqrt(d)`` (queries), or the
        learned scalars of the buckets (bias mode): ``(B, H, n, N)`` (``(1, 1, n, N)`` for a shared bias table)."""
        build = self._bias_of_heads(q, k, ctx, layer, slice(None) if rows is None else rows)
        return None if build is None else build(slice(None))

    def _bias_of_heads(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
        """``bias(heads)``: the bias of the query ``rows`` for a step-1 slice of heads (:meth:`score` is all heads of
        it; the attention's per-head form calls it head by head): the int64 bucket indices and the ``q @ table``
        products once per call, then one gather per head. Bias mode with a shared table gives one bias for every
        head."""
        self.check_layer(layer)
        if "q" not in self.rpe_on and "k" not in self.rpe_on:
            return None
        scale = self.head_dim**-0.5
        B, H, n, _ = q.shape
        N = k.shape[-2]
        sides = []  # (side, P x (n, N) indices, contextual table or None)
        if "k" in self.rpe_on:
            table = None if self.mode == "bias" else (q * scale) @ self.table_k[layer].to(q.dtype)  # (B, H, n, P*K)
            sides.append(("k", self._index(ctx, rows, transpose=False), table))
        if "q" in self.rpe_on:
            table = None
            if self.mode != "bias":
                table = ((k * scale) @ self.table_q[layer].to(k.dtype)).transpose(-1, -2).contiguous()  # (B,H,PK,N)
            sides.append(("q", self._index(ctx, rows, transpose=True), table))
        shared = self.mode == "bias" and self.shared_head
        cache: list[Tensor] = []

        def bias(heads: slice) -> Tensor:
            if shared and cache:
                return cache[0]  # (1, 1, n, N): the same for every head
            out = None
            for side, idx, table in sides:
                if table is None:  # bias mode: the learned scalar of each bucket
                    t = getattr(self, f"table_{side}")[layer]  # (H', P*K)
                    t = t if self.shared_head else t[heads]
                    terms = (t[:, i].unsqueeze(0) for i in idx)  # (1, h', n, N) each
                else:
                    t = table[:, heads]
                    h = t.shape[1]
                    if side == "k":
                        terms = (torch.gather(t, -1, i.expand(B, h, n, N)) for i in idx)  # (B, h, n, N)
                    else:
                        terms = (torch.gather(t, -2, i.expand(B, h, n, N)) for i in idx)
                for term in terms:
                    out = term if out is None else out.add_(term)
            if shared:
                cache.append(out)
            return out

        return bias

    def values(self, attn: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        """``sum_j a_ij r_v[I(i, j)]``: probabilities summed per bucket, then one ``(buckets, d)`` matmul."""
        self.check_layer(layer)
        if "v" not in self.rpe_on:
            return None
        B, H, n, N = attn.shape
        idx = self._index(ctx, rows, transpose=False)  # P x (n, N)
        per_bucket = attn.new_zeros(B, H, n, self.parts * self.num_buckets)  # (B, H, n, P*K)
        for i in idx:
            per_bucket = per_bucket.scatter_add(-1, i.expand(B, H, n, N), attn)
        return per_bucket @ self.table_v[layer].to(per_bucket.dtype)  # (B, H, n, Dh)

    def neutralize(self) -> "IRPE":
        for t in (self.table_q, self.table_k, self.table_v):
            if t is not None:
                t.zero_()
        return self

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, mode={self.mode!r}, method={self.method!r}, ratio={self.ratio}, "
            f"rpe_on={self.rpe_on!r}, shared_head={self.shared_head}, buckets={self.num_buckets}x{self.parts}"
        )

