"""PaPE and PaPE-RI: parabolic attention biases folded into widened q/k (no N x N bias, one SDPA call).

Koo Øhrstrøm et al., "Parabolic Position Encoding" (arXiv 2602.01418), reference implementation
DTU-PAS/parabolic-position-encoding (``pape/nn/positions/pape_naive.py``, ``pape_efficient.py``,
``pape_ri.py``). Per layer and head, query token i adds to its logit with key j

    PaPE:    sum_m [ -a_im (w_m . d)^2 + b_im (w_m . d) ],   d = p_i - p_j,  a = softplus(.) > 0
    PaPE-RI: -a_i s_h^2 ||d||^2,                              s_h fixed per head

inside the softmax scale (the bias is divided by sqrt(Dh) with q . k). Writing the M parabolas as one
quadratic form, ``sum_m a_m (w_m . d)^2 = d^T A_i d`` with ``A_i = sum_m a_im w_m w_m^T`` (P x P) and
``b_i = sum_m b_im w_m`` (the reference's efficient kernel does the same), the bias is a dot product of a
query feature and a key feature::

    q~_i = [q_i,  -c_i^T A_i c_i + b_i . c_i,  sym(A_i),          2 A_i c_i - b_i]
    k~_j = [k_j,  1,                           -sym(c_j c_j^T),   c_j           ]

(``sym`` packs the upper triangle, off-diagonal entries of A doubled), so only ``1 + P(P+1)/2 + P`` extra
channels are appended (6 for images, 10 for video; the reference's naive form appends ``3M + 2`` = 152) and
zero-padded to a multiple of 8. The expansion of
``||c_i - c_j||^2`` cancels terms of size ``|c|^2``, so the features are built in fp32 with autocast off from
coordinates centred per sample on the centre of their bounding box; the bias is translation invariant, so the
centring changes nothing mathematically, and for integer grids it is exact in fp32 (a grid offset by 1000
gives bit-identical features). The key features depend on positions only and are built once per forward.
When the q k^T matmul runs in bf16/fp16, every feature is split into two exactly representable parts (three
channels per feature, see ``_widened``), which keeps the bias of near pairs as accurate as bf16 q . k itself
(fp16 additionally limits |features| to 65504: keep coordinates moderate there).

Coefficients and the token: the reference computes ``a, b`` from the normalised hidden state entering
attention. The ``widen`` hook sees the projected ``q, k``; vlpe computes the coefficients from the token's
query vector with all heads concatenated, ``q_i = W_q x_i + b_q`` (B, N, C). Because ``W_q`` is a square,
generically invertible map of the same token, ``A' q_i`` spans the same coefficient maps ``A x_i`` as the
reference (up to the fixed offset ``A' b_q`` from the qkv bias), with the same ``C x 2HM`` weights, and no
change to the attention interface is needed.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .spec import EncodingSpec
from .registry import register

__all__ = ["PaPE", "PaPERI", "centred_coords"]

PrefixPosition = Literal["corner", "none"]


def centred_coords(pos, *, prefix_position: PrefixPosition = "corner") -> Tensor:
    """fp32 coordinates ``(B, N, A)`` centred per sample on the bounding box of the real patch tokens.

    Prefix tokens sit one unit before the smallest patch coordinate on every axis (``"corner"``: the
    reference puts CLS at (0, 0) with 1-based patch indices) or at the centre (``"none"``, the caller
    zeroes their features). Padding tokens (``valid`` False) do not move the centre.
    """
    with torch.autocast(pos.device.type, enabled=False):
        coords = pos.coords.float() if pos.coords.dtype != torch.float64 else pos.coords  # (B, N, A)
        patch = coords[:, pos.prefix :]  # (B, n, A)
        if pos.valid is not None:
            real = pos.valid[:, pos.prefix :, None]  # (B, n, 1)
            lo = patch.masked_fill(~real, float("inf")).amin(dim=1)  # (B, A)
            hi = patch.masked_fill(~real, float("-inf")).amax(dim=1)
        elif patch.shape[1]:
            lo, hi = patch.amin(dim=1), patch.amax(dim=1)  # (B, A)
        else:
            lo = hi = coords.new_zeros(coords.shape[0], coords.shape[2])
        empty = ~torch.isfinite(lo)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        centre = (lo + hi) * 0.5  # (B, A), exact for integer (and half-integer) coordinates
        c = patch - centre.unsqueeze(1)  # (B, n, A)
        if pos.prefix:
            head = (lo - centre - 1.0) if prefix_position == "corner" else torch.zeros_like(lo)  # (B, A)
            c = torch.cat([head.unsqueeze(1).expand(-1, pos.prefix, -1), c], dim=1)  # (B, N, A)
        return c


def _pad_width(head_dim: int, extra: int, multiple: int = 8) -> int:
    """Zero channels appended so ``head_dim + extra + pad`` is a multiple of ``multiple``."""
    return -(head_dim + extra) % multiple


_LOW = (torch.bfloat16, torch.float16)


def _matmul_dtype(q: Tensor) -> torch.dtype | None:
    """The reduced precision the q k^T matmul will run in (q's dtype or the autocast dtype), else None."""
    if q.dtype in _LOW:
        return q.dtype
    dev = q.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in _LOW:
        return torch.get_autocast_dtype(dev)
    return None


def _split(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp32 ``x = hi + lo`` (to ~2x the significand of ``dtype``), both exactly representable in ``dtype``."""
    hi = x.to(dtype).float()
    lo = (x - hi).to(dtype).float()
    return hi, lo


def _sym_pairs(num_axes: int) -> tuple[list[int], list[int]]:
    rows, cols = torch.triu_indices(num_axes, num_axes).tolist()  # constructor-time only
    return rows, cols


class _ParabolicBase(Encoding):
    """Shared machinery: centred fp32 coordinates, key features once per forward, widened q/k per layer."""

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"widen"})

    def __init__(self, *, spec: EncodingSpec, prefix_position: PrefixPosition) -> None:
        super().__init__(spec=spec)
        if prefix_position not in ("corner", "none"):
            raise ValueError(
                f"prefix_position must be 'corner' (prefix tokens one step before the first patch, as the "
                f"reference places CLS) or 'none' (prefix tokens get no parabolic bias), got {prefix_position!r}"
            )
        self.prefix_position = prefix_position


    def _key_features(self, c: Tensor) -> Tensor:
        """Position-only key features ``(B, N, W_k)`` from centred coordinates (override)."""
        raise NotImplementedError

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        c = centred_coords(pos, prefix_position=self.prefix_position)  # (B, N, A) fp32
        c = c.to(torch.promote_types(c.dtype, next(self.parameters()).dtype))  # fp64 in a .double() module
        with torch.autocast(pos.device.type, enabled=False):
            kf = self._key_features(c)  # (B, N, W)
            if pos.prefix and self.prefix_position == "none":
                kf = kf.clone()
                kf[:, : pos.prefix] = 0
            ctx["coords"] = c
            ctx["key_features"] = kf.unsqueeze(1)  # (B, 1, N, W)
            ctx["keep"] = None
            if pos.prefix and self.prefix_position == "none":
                keep = torch.ones(1, 1, pos.num_tokens, 1, device=c.device, dtype=c.dtype)
                keep[:, :, : pos.prefix] = 0
                ctx["keep"] = keep  # (1, 1, N, 1): prefix queries get no bias

    def _tokens(self, q: Tensor) -> Tensor:
        """The token's query vector with all heads concatenated: ``(B, H, N, Dh) -> (B, N, C)``."""
        B, H, N, Dh = q.shape
        return q.transpose(1, 2).reshape(B, N, H * Dh)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.depth:
            raise ValueError(f"{self.name} was built with depth={self.depth}, got layer={layer}")

    def _widened(
        self, q: Tensor, k: Tensor, qf: Tensor, ctx: Context, low: torch.dtype | None
    ) -> tuple[Tensor, Tensor]:
        """Append query features ``qf`` (B, H, N, W) and the shared key features, zero-padded to a multiple of 8.

        When the attention matmul will run in bf16/fp16 (low-precision q/k or autocast), each fp32 feature is
        split into ``hi + lo`` parts exactly representable in that dtype and the products are expanded as
        ``hi_q hi_k + hi_q lo_k + lo_q hi_k`` (three channels per feature): the matmul accumulates in fp32, so
        the cancelling terms keep ~16 significant bits instead of 8.
        """
        if ctx["keep"] is not None:
            qf = qf * ctx["keep"]
        kf = ctx["key_features"]  # (B or 1, 1, N, W)
        if low is not None:
            q_hi, q_lo = _split(qf, low)
            k_hi, k_lo = _split(kf, low)
            qf = torch.cat([q_hi, q_hi, q_lo], dim=-1)  # (B, H, N, 3W)
            kf = torch.cat([k_hi, k_lo, k_hi], dim=-1)  # (B, 1, N, 3W)
        B = max(q.shape[0], kf.shape[0])
        pad = _pad_width(q.shape[-1], qf.shape[-1])
        qf = qf.to(q.dtype)
        kf = kf.to(k.dtype).expand(B, k.shape[1], -1, -1)
        if pad:
            qf = F.pad(qf, (0, pad))
            kf = F.pad(kf, (0, pad))
        q = q.expand(B, -1, -1, -1) if q.shape[0] != B else q
        qf = qf.expand(B, -1, -1, -1) if qf.shape[0] != B else qf
        k = k.expand(B, -1, -1, -1) if k.shape[0] != B else k
        return torch.cat([q, qf], dim=-1), torch.cat([k, kf], dim=-1)  # (B, H, N, Dh + W + pad)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prefix_position={self.prefix_position!r}"


@register("pape")
class PaPE(_ParabolicBase):
    """PaPE (Koo Øhrstrøm et al., arXiv 2602.01418): ``num_parabolas`` learned parabolas per layer and head
    over projected offsets ``w_m . (p_i - p_j)``, curvature ``softplus`` and slope from the query token, folded
    into widened q/k (reference: DTU-PAS/parabolic-position-encoding ``pape_naive.py`` / ``pape_efficient.py``;
    the widened dot product is checked against a slow explicit bias in the tests).

    Parameters per layer: ``position`` (H, M, P) (the reference ``Linear(P, H*M, bias=False)`` init,
    U(-1/sqrt(P), 1/sqrt(P))) and ``coeff_a``, ``coeff_b`` (C, H*M) (``Linear(C, 2*H*M, bias=False)`` init),
    applied to the token's concatenated query vector (see the module docstring). Any number of axes, no grid
    needed. Prefix tokens sit one step before the first patch on every axis (``prefix_position="corner"``,
    the reference's CLS at (0, 0)) or get no bias (``"none"``). ``neutralize()`` zeroes the projections, so
    the bias vanishes (spec section 8 item 2). All parameters stay fp32 under ``.bfloat16()``.
    """

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        num_parabolas: int = 50,
        prefix_position: PrefixPosition = "corner",
    ) -> None:
        dim, num_heads, depth, num_axes = spec.dim, spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec, prefix_position=prefix_position)
        if not isinstance(num_parabolas, int) or num_parabolas < 1:
            raise ValueError(f"num_parabolas must be an integer >= 1 (the reference uses 50), got {num_parabolas!r}")
        self.num_parabolas = num_parabolas
        H, M, A, C = num_heads, num_parabolas, num_axes, dim
        self.position = nn.Parameter(torch.empty(depth, H, M, A))  # w_m per layer and head
        self.coeff_a = nn.Parameter(torch.empty(depth, C, H * M))  # curvature (pre-softplus) projection
        self.coeff_b = nn.Parameter(torch.empty(depth, C, H * M))  # slope projection
        rows, cols = _sym_pairs(A)
        self.register_buffer("_rows", torch.tensor(rows), persistent=False)
        self.register_buffer("_cols", torch.tensor(cols), persistent=False)
        self.register_buffer(
            "_sym_weight", torch.tensor([1.0 if r == s else 2.0 for r, s in zip(rows, cols)]), persistent=False
        )
        # packed -> full symmetric (A, A): entry (r, s) reads packed pair {r, s}, halved off the diagonal
        pair = {(r, s): i for i, (r, s) in enumerate(zip(rows, cols))}
        index = [pair[(min(r, s), max(r, s))] for r in range(A) for s in range(A)]
        self.register_buffer("_unpack_index", torch.tensor(index), persistent=False)
        self.register_buffer(
            "_unpack_scale",
            torch.tensor([1.0 if r == s else 0.5 for r in range(A) for s in range(A)]),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            bound_p = 1.0 / math.sqrt(self.num_axes)
            bound_c = 1.0 / math.sqrt(self.dim)
            self.position.uniform_(-bound_p, bound_p)
            self.coeff_a.uniform_(-bound_c, bound_c)
            self.coeff_b.uniform_(-bound_c, bound_c)

    @property
    def extra_width(self) -> int:
        A = self.num_axes
        return 1 + A * (A + 1) // 2 + A

    def _key_features(self, c: Tensor) -> Tensor:
        outer = c[..., self._rows] * c[..., self._cols]  # (B, N, P(P+1)/2)
        return torch.cat([torch.ones_like(c[..., :1]), -outer, c], dim=-1)  # (B, N, 1 + P(P+1)/2 + P)

    def _project(self, q: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """``(a (B, N, H*M), b (B, N, H, A))`` fp32: one GEMM of the token with ``[coeff_a | coeff_b w]``."""
        x = self._tokens(q)  # (B, N, C)
        B, N, C = x.shape
        H, M, A = self.num_heads, self.num_parabolas, self.num_axes
        with torch.autocast(q.device.type, enabled=False):
            # b_i = sum_m b_im w_m only enters the bias, so the slope projection is folded through w once
            # (C, H*M) -> (C, H*A), as the reference's efficient path does
            b_fold = torch.einsum("chm,hma->cha", self.coeff_b[layer].reshape(C, H, M), self.position[layer])
            weight = torch.cat([self.coeff_a[layer], b_fold.reshape(C, H * A)], dim=1)  # (C, H*M + H*A)
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight.dtype)
        y = fp32(x @ weight)  # (B, N, H*M + H*A)
        return F.softplus(y[..., : H * M]), y[..., H * M :].reshape(B, N, H, A)

    def coefficients(self, q: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Curvatures ``a`` (softplus, > 0) ``(B, N, H, M)`` and slopes in position space ``b_i = sum_m b_im w_m``
        ``(B, N, H, A)``, fp32, from q (B, H, N, Dh)."""
        a, b = self._project(q, layer)
        return a.unflatten(-1, (self.num_heads, self.num_parabolas)), b

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self._check_layer(layer)
        low = _matmul_dtype(q)  # read before autocast is switched off below
        a, bp = self._project(q, layer)  # (B, N, H*M), (B, N, H, A)
        H, A = self.num_heads, self.num_axes
        with torch.autocast(q.device.type, enabled=False):
            c = ctx["coords"]  # (B, N, A)
            w = self.position[layer]  # (H, M, A), fp32 (fp64 in a .double() module)
            dt = torch.promote_types(c.dtype, w.dtype)
            c, w, a, bp = c.to(dt), w.to(dt), a.to(dt), bp.to(dt)
            # A_i = sum_m a_im w_m w_m^T, packed (upper triangle, off-diagonal doubled): one GEMM against the
            # block-diagonal (H*M, H*K) matrix of the w_m w_m^T, so nothing of size (B, N, H, M) is built
            ww = w[..., self._rows] * w[..., self._cols] * self._sym_weight.to(dt)  # (H, M, K)
            eye = torch.eye(H, dtype=dt, device=w.device)
            packed = (a @ torch.einsum("hmk,hg->hmgk", ww, eye).flatten(0, 1).flatten(1)).unflatten(-1, (H, -1))
            full = (packed[..., self._unpack_index] * self._unpack_scale.to(dt)).unflatten(-1, (A, A))  # (B,N,H,A,A)
            ac = torch.einsum("bnhrs,bns->bnhr", full, c)  # (B, N, H, A)  A_i c_i
            f0 = ((bp - ac) * c.unsqueeze(2)).sum(-1, keepdim=True)  # (B, N, H, 1)  b_i . c_i - c_i^T A_i c_i
            qf = torch.cat([f0, packed, 2.0 * ac - bp], dim=-1).transpose(1, 2)  # (B, H, N, 1 + K + A)
            return self._widened(q, k, qf, ctx, low)

    def neutralize(self) -> "PaPE":
        self.position.zero_()
        self.coeff_a.zero_()
        self.coeff_b.zero_()
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_parabolas={self.num_parabolas}"


@register("pape_ri")
class PaPERI(_ParabolicBase):
    """PaPE-RI (Koo Øhrstrøm et al., arXiv 2602.01418): one isotropic parabola ``-a_i s_h^2 ||p_i - p_j||^2`` per
    layer and head, so the bias depends on distance only and is exactly rotation invariant; reference
    DTU-PAS/parabolic-position-encoding ``pape_ri.py`` (checked against a slow explicit bias in the tests).

    ``a = softplus(coeff . q_token)`` per head (``coeff`` (C, H) per layer, ``Linear(C, H, bias=False)`` init);
    ``scales`` (depth, H) is a fixed random buffer U(-1/sqrt(P), 1/sqrt(P)) as in the reference (saved in the
    state dict, never trained). ``neutralize()`` zeroes the scales, which removes the bias. Prefix tokens as in
    ``pape``; for exact rotation invariance with prefix tokens use ``prefix_position="none"``.
    """

    claims = _ParabolicBase.claims | {"rotation_invariant"}

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        prefix_position: PrefixPosition = "corner",
    ) -> None:
        dim, num_heads, depth = spec.dim, spec.num_heads, spec.depth
        super().__init__(spec=spec, prefix_position=prefix_position)
        self.coeff = nn.Parameter(torch.empty(depth, dim, num_heads))
        self.register_buffer("scales", torch.empty(depth, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            bound_c = 1.0 / math.sqrt(self.dim)
            self.coeff.uniform_(-bound_c, bound_c)
            bound_s = 1.0 / math.sqrt(self.num_axes)
            self.scales.uniform_(-bound_s, bound_s)

    @property
    def extra_width(self) -> int:
        return 2 + self.num_axes

    def _key_features(self, c: Tensor) -> Tensor:
        sq = (c * c).sum(-1, keepdim=True)  # (B, N, 1)
        return torch.cat([torch.ones_like(sq), -sq, c], dim=-1)  # (B, N, 2 + P)

    def curvature(self, q: Tensor, layer: int) -> Tensor:
        """``a_i s_h^2`` as ``(B, H, N, 1)`` fp32 from q (B, H, N, Dh)."""
        x = self._tokens(q)  # (B, N, C)
        w = self.coeff[layer]  # (C, H)
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(w.dtype)
        a = F.softplus(fp32(x @ w))  # (B, N, H)
        s2 = fp32(self.scales[layer]).square()  # (H,)
        return (a * s2).transpose(1, 2).unsqueeze(-1)  # (B, H, N, 1)

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self._check_layer(layer)
        low = _matmul_dtype(q)  # read before autocast is switched off below
        alpha = self.curvature(q, layer)  # (B, H, N, 1)
        with torch.autocast(q.device.type, enabled=False):
            c = ctx["coords"].unsqueeze(1)  # (B, 1, N, A)
            dt = torch.promote_types(c.dtype, alpha.dtype)
            c, alpha = c.to(dt), alpha.to(dt)
            sq = (c * c).sum(-1, keepdim=True)  # (B, 1, N, 1)
            qf = torch.cat([-alpha * sq, alpha, 2.0 * alpha * c], dim=-1)  # (B, H, N, 2 + A)
            return self._widened(q, k, qf, ctx, low)

    def neutralize(self) -> "PaPERI":
        self.scales.zero_()
        return self
