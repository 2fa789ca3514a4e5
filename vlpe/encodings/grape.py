"""Multiplicative GRAPE: products of rank-2 rotations ``exp(theta_j(p) L_j)`` in learned, mutually orthogonal planes.

Zhang et al., "Group Representational Position Encoding" (arXiv 2512.07805). A rank-2 skew generator
``L = b a^T - a b^T`` (``a, b`` orthonormal) has the closed-form exponential
``exp(theta L) = I + sin(theta) L + (1 - cos(theta)) L^2``: it turns the plane spanned by ``a, b`` by ``theta`` and
leaves its complement alone. With ``D/2`` mutually orthogonal planes the generators commute, so
``G(p) = prod_j exp(theta_j(p) L_j)`` satisfies ``G(p_i)^T G(p_j) = G(p_j - p_i)`` whenever ``theta_j`` is linear in
``p``; vision positions enter through ``theta_j(p) = omega_j (u_j . p)``, a learned unit direction ``u_j`` per plane.
With the canonical coordinate planes, RoPE's spectrum and one-hot directions this is axial RoPE exactly.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .functional.rope import axial_inv_freq, cos_sin, rope_angles
from .registry import register
from .spec import EncodingSpec

__all__ = ["GRAPEMultiplicative", "orthonormal_planes"]


def orthonormal_planes(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Mutually orthonormal planes from raw vectors: ``a, b`` (..., P, D) -> the same shapes, fp32 or wider.

    The ``2P`` vectors ``a_1, b_1, a_2, b_2, ...`` are orthonormalised in that order (Gram-Schmidt through a QR
    with a positive diagonal), so plane ``j`` is ``a_j`` normalised and ``b_j`` made orthogonal to it and to every
    earlier plane: already orthonormal inputs come back unchanged. Autocast off.

    Raises:
        ValueError: more than ``D/2`` planes (they cannot be mutually orthogonal).
    """
    P, D = a.shape[-2], a.shape[-1]
    if 2 * P > D:
        raise ValueError(f"grape: {P} mutually orthogonal planes need a head dim >= {2 * P}, got {D}")
    with torch.autocast(a.device.type, enabled=False):
        V = torch.stack([fp32(a), fp32(b)], dim=-2).flatten(-3, -2)  # (..., 2P, D): a_1, b_1, a_2, ...
        Q, R = torch.linalg.qr(V.transpose(-1, -2))  # (..., D, 2P), (..., 2P, 2P)
        sign = torch.diagonal(R, dim1=-2, dim2=-1).sign()
        Q = Q * torch.where(sign == 0, torch.ones_like(sign), sign).unsqueeze(-2)
        planes = Q.transpose(-1, -2).unflatten(-2, (P, 2))  # (..., P, 2, D)
        return planes[..., 0, :], planes[..., 1, :]


@register("grape")
class GRAPEMultiplicative(Encoding):
    """Multiplicative GRAPE (Zhang et al., 2025) for nD positions: ``G(p) = prod_j exp(omega_j (u_j . p) L_j)``
    with learned mutually orthogonal planes ``(a_j, b_j)``, directions ``u_j`` and frequencies ``omega_j`` per layer.

    Checked against the official computation re-stated in the tests: model-architectures/GRAPE
    ``model/llama-mha-grape-m-nonctx.py`` (``MSGRAPECommuting``: RoPE-initialised learnable log-frequencies on the
    canonical planes, commit 135ee30e5e255cf4385fd8553e32e2575b2f1733) and the learned-plane nD form of
    JJJYmmm/Multimodal-RoPEs ``multimodal_ropes/freq_allocation/grape.py`` (``MixedAxisGrapeRotation``: per-plane
    closed-form update ``x + sum_j (xa' - xa) a_j + (xb' - xb) b_j`` with unit axis directions, commit
    ca035e5377bae51d24833bc789183b99ccc55ef1). vlpe orthonormalises all planes jointly (:func:`orthonormal_planes`),
    so the rotations commute and the encoding is exactly relative; Multimodal-RoPEs orthonormalises each plane on its
    own, which equals this whenever the planes are mutually orthogonal (at its RoPE initialisation and in the tests).
    The official 1D code turns pairs by ``-angle`` (``x1 cos + x2 sin``); vlpe turns by ``+angle`` as its RoPE does,
    the same encoding at mirrored positions.

    Initialisation (``init="axial"``): plane ``j`` is the canonical pair ``(e_j, e_{j + D/2})`` (vlpe's half layout),
    ``u_j`` the one-hot axis and ``omega_j`` the frequency of vlpe ``rope`` with ``theta``: the encoding equals
    ``rope`` until trained (up to the fp32 rounding of ``exp(log f)``). ``init="random"``: planes ``N(0, 1)``,
    directions ``N(0, 1)`` (then normalised).
    Frequencies are ``exp(log_freq)`` (positive, the official parameterisation). Planes, directions and tables are
    fp32 (autocast off), built once per forward for every layer. Prefix tokens sit at 0 and are not rotated.
    ``neutralize()`` zeroes the directions (``theta = 0``, ``G = I``).

    Args:
        spec: the build-time facts.
        theta: frequency base of the RoPE initialisation.
        init: ``"axial"`` or ``"random"``.

    Raises:
        ValueError: an odd head dim, a head dim too small for the axes, ``theta <= 0``, an unknown ``init``.

    Reference: Zhang, Chen, Liu, Qin, Yuan, Xu, Yuan, Gu, Yao, "Group Representational Position Encoding",
    arXiv 2512.07805 (2025), Section 3 (multiplicative GRAPE) and its nD appendix.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})

    def __init__(self, *, spec: EncodingSpec, theta: float = 100.0,
                 init: Literal["axial", "random"] = "axial") -> None:
        super().__init__(spec=spec)
        if not theta > 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        if init not in ("axial", "random"):
            raise ValueError(f"init must be 'axial' (equal to axial RoPE at start) or 'random', got {init!r}")
        freqs = axial_inv_freq(self.head_dim, self.num_axes, theta)  # (A, D/2), checks the head dim
        self.theta = float(theta)
        self.init = init
        P, D, L, A = self.head_dim // 2, self.head_dim, spec.depth, self.num_axes
        self.num_planes = P
        self.plane_a = nn.Parameter(torch.empty(L, P, D))
        self.plane_b = nn.Parameter(torch.empty(L, P, D))
        self.directions = nn.Parameter(torch.empty(L, P, A))
        self.log_freq = nn.Parameter(torch.empty(L, P))
        self.register_buffer("rope_freqs", freqs, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        P, D = self.num_planes, self.head_dim
        with torch.no_grad():
            f = self.rope_freqs  # (A, P)
            mag = f.abs().amax(dim=0)  # (P,) a pair's frequency on its axis (0: left over, not rotated)
            self.log_freq.copy_(mag.clamp_min(1e-30).log().expand_as(self.log_freq))
            if self.init == "axial":
                eye = torch.eye(D)
                self.plane_a.copy_(eye[:P].expand_as(self.plane_a))
                self.plane_b.copy_(eye[P:].expand_as(self.plane_b))
                one_hot = (f > 0).to(f.dtype).T  # (P, A)
                self.directions.copy_(one_hot.expand_as(self.directions))
            else:
                self.plane_a.normal_()
                self.plane_b.normal_()
                self.directions.normal_()

    def planes(self) -> tuple[Tensor, Tensor]:
        """The orthonormal planes ``a, b`` (L, P, D), fp32."""
        return orthonormal_planes(self.plane_a, self.plane_b)

    def frequencies(self) -> Tensor:
        """``omega_j u_j`` per layer as a frequency matrix (L, A, P), fp32, autocast off."""
        with torch.autocast(self.log_freq.device.type, enabled=False):
            u = F.normalize(fp32(self.directions), dim=-1)  # (L, P, A); a zero direction stays 0
            return (fp32(self.log_freq).exp().unsqueeze(-1) * u).transpose(-1, -2)

    def _prepare(self, ctx: Context) -> None:
        freqs = self.frequencies()  # (L, A, P)
        coords = ctx.pos.coords.to(torch.promote_types(ctx.pos.coords.dtype, freqs.dtype))  # fp64 module: fp64
        angles = rope_angles(coords, freqs)  # (B, L, N, P)
        cos, sin = cos_sin(angles)
        ctx["cos"], ctx["sin"] = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, L, 1, N, P)
        ctx["a"], ctx["b"] = self.planes()  # (L, P, D)

    @staticmethod
    def _turn(x: Tensor, a: Tensor, b: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``prod_j exp(theta_j L_j) x`` through the closed form: x (B, H, N, D), planes (P, D), tables (B, 1, N, P)."""
        xa, xb = x @ a.T, x @ b.T  # (B, H, N, P)
        da = xa * (cos - 1) - xb * sin  # a-coefficient of the update
        db = xa * sin + xb * (cos - 1)
        return x + da @ a + db @ b

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self.check_layer(layer)
        a, b = ctx["a"][layer], ctx["b"][layer]  # (P, D)
        cos, sin = ctx["cos"][:, layer], ctx["sin"][:, layer]  # (B, 1, N, P)
        with torch.autocast(q.device.type, enabled=False):
            out = [self._turn(x.to(a.dtype), a, b, cos, sin).to(x.dtype) for x in (q, k)]
        return out[0], out[1]

    def rotation_matrix(self, coords: Tensor, layer: int) -> Tensor:
        """Dense ``G(p)`` (B, N, D, D) through the matrix exponential of ``sum_j theta_j L_j``, for tests."""
        self.check_layer(layer)
        a, b = self.planes()
        a, b = a[layer], b[layer]  # (P, D)
        freqs = self.frequencies()[layer]  # (A, P)
        theta = rope_angles(coords.to(torch.promote_types(coords.dtype, freqs.dtype)), freqs)  # (B, N, P)
        L = b.unsqueeze(-1) * a.unsqueeze(-2) - a.unsqueeze(-1) * b.unsqueeze(-2)  # (P, D, D)
        return torch.matrix_exp(torch.einsum("bnp,pde->bnde", theta.to(L.dtype), L))

    def neutralize(self) -> "GRAPEMultiplicative":
        self.directions.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"plane_a", "plane_b", "directions", "log_freq"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}theta={self.theta}, init={self.init!r}"
