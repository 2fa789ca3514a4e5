"""Cayley-STRING: axial RoPE in a learned orthonormal basis, ``R(r) = P RoPE(r) P^T``.

Schenck et al., "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING" (ICML 2025). Every
rotation ``exp(sum_k L_k r_k)`` with commuting skew-symmetric generators equals ``P RoPE(r) P^T`` for an
orthogonal P; Cayley-STRING learns ``P = (I - S)(I + S)^{-1}`` with S skew-symmetric, per layer and head.

Since ``(R(r_i) q)^T (R(r_j) k) = (P^T q)^T RoPE(r_j - r_i) (P^T k)``, the outer P cancels in every dot
product: ``rotate`` returns ``RoPE(r) P^T q`` (one ``D x D`` basis change, then vlpe's RoPE primitives) and
the logits equal those of the full ``R(r)`` exactly.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .spec import EncodingSpec
from .functional.rope import apply_rope, axial_inv_freq, cos_sin, rope_angles
from .registry import register
from .rope import RotaryScaling

__all__ = ["CayleySTRING", "cayley"]


def cayley(S: Tensor) -> Tensor:
    """``(I - S)(I + S)^{-1}`` for skew-symmetric ``S`` (..., D, D): orthogonal, det +1, ``I`` at ``S = 0``.

    ``I + S`` is always invertible (the eigenvalues of S are imaginary); ``(I - S)`` and ``(I + S)^{-1}``
    commute, so this is ``solve(I + S, I - S)``.
    """
    eye = torch.eye(S.shape[-1], dtype=S.dtype, device=S.device)
    return torch.linalg.solve(eye + S, eye - S)


@register("string")
class CayleySTRING(RotaryScaling, Encoding):
    """Cayley-STRING (Schenck et al., ICML 2025): axial RoPE (vlpe ``rope``: ``theta``, half layout, prefix
    tokens unrotated) in a learned orthonormal basis ``P = (I - S)(I + S)^{-1}`` per layer and head.

    There is no official repository; the paper's Cayley parameterisation is checked in the tests against dense
    fp64 matrices (``P`` orthogonal, ``R(r_i)^T R(r_j) = R(r_j - r_i)``), and with ``S = 0`` (the init) the
    encoding equals ``rope``. ``skew`` (depth, H, D, D) holds S through its antisymmetric part
    ``S = (W - W^T) / 2``; it stays fp32 under ``.bfloat16()``. P is built once per forward (all layers), the
    basis change and rotation run in fp32. ``neutralize()`` zeroes the frequencies (``R = P P^T = I``).
    ``scaling`` scales the axial RoPE frequencies as for ``rope`` (the basis P is untouched).
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        theta: float = 100.0,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        num_heads, depth, num_axes = spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.theta = float(theta)
        self.register_buffer("freqs", axial_inv_freq(self.head_dim, num_axes, self.theta), persistent=False)
        self.skew = nn.Parameter(torch.zeros(depth, num_heads, self.head_dim, self.head_dim))
        self.band_pairs = self.head_dim // 2 // num_axes
        self._init_scaling(scaling)


    def basis(self) -> Tensor:
        """``P`` (depth, H, D, D), orthogonal, fp32 (fp64 in a ``.double()`` module), autocast off."""
        with torch.autocast(self.skew.device.type, enabled=False):
            W = fp32(self.skew)
            return cayley(0.5 * (W - W.transpose(-1, -2)))

    def _prepare(self, ctx: Context) -> None:
        angles = rope_angles(ctx.pos.coords, self.scaled(self.freqs))  # (B, N, D/2)
        cos, sin = self.temper(*cos_sin(angles))
        ctx["cos"], ctx["sin"] = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, N, D/2)
        ctx["basis"] = self.basis()  # (L, H, D, D)

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        if not 0 <= layer < self.depth:
            raise ValueError(f"string was built with depth={self.depth}, got layer={layer}")
        P = ctx["basis"][layer]  # (H, D, D)
        cos, sin = ctx["cos"], ctx["sin"]
        with torch.autocast(q.device.type, enabled=False):
            # row vectors: (P^T q)^T = q^T P
            qp = q.to(P.dtype) @ P  # (B, H, N, D)
            kp = k.to(P.dtype) @ P
            return apply_rope(qp, cos, sin).to(q.dtype), apply_rope(kp, cos, sin).to(k.dtype)

    def rotation_matrix(self, coords: Tensor, layer: int) -> Tensor:
        """Dense ``R(r) = P RoPE(r) P^T`` (B, H, N, D, D), for tests and plots."""
        P = self.basis()[layer]  # (H, D, D)
        D = self.head_dim
        angles = rope_angles(coords, self.scaled(self.freqs))  # (B, N, D/2)
        cos, sin = self.temper(*cos_sin(angles))
        eye = torch.eye(D, dtype=cos.dtype, device=cos.device)
        rope = apply_rope(eye.expand(*cos.shape[:2], D, D).transpose(-1, -2), cos.unsqueeze(-2), sin.unsqueeze(-2))
        rope = rope.transpose(-1, -2).unsqueeze(1).to(P.dtype)  # (B, 1, N, D, D): column m = RoPE(r) e_m
        return P[None, :, None] @ rope @ P.transpose(-1, -2)[None, :, None]

    def neutralize(self) -> "CayleySTRING":
        self.freqs.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"skew"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, theta={self.theta}{self.scaling_repr()}"
