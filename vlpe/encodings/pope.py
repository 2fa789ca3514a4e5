"""PoPE: polar coordinate position embedding, magnitudes from content ("what") and phases from position ("where").

Gopalakrishnan, Csordas, Schmidhuber, Mozer, "Decoupling the 'What' and 'Where' With Polar Coordinate Positional
Embeddings" (arXiv 2509.10534). Each of the ``D`` channels of a query or key becomes one complex number whose
magnitude is ``softplus`` of the channel and whose phase is the position times the channel's frequency (a key adds
a learned phase bias ``delta_c``); the logit is the real part of their Hermitian product::

    a_ij = sum_c softplus(q_ic) softplus(k_jc) cos(theta_c . (p_i - p_j) - delta_c)

RoPE mixes what and where in every pair's phase; PoPE keeps the phases purely positional, with ``D`` frequencies
instead of ``D / 2``. In vlpe the complex numbers are written as real pairs: ``widen`` returns
``[mu cos(phi), mu sin(phi)]`` (width ``2 D``) for queries and keys, and the softmax scale stays ``D ** -0.5``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .functional.rope import axial_inv_freq, rope_angles
from .registry import register
from .spec import EncodingSpec

__all__ = ["PoPE", "pope_freqs"]


def pope_freqs(head_dim: int, num_axes: int, theta: float) -> Tensor:
    """One frequency per channel, axial: ``(A, D)`` fp32, channel ``c`` of axis ``c // (D / A)`` at
    ``theta ** (-k / P)`` (``k = c mod P``, ``P = D // A``); channels left over get 0. For one axis this is the
    paper's ``theta ** (-c / D)``.

    Raises:
        ValueError: a head dim smaller than the axis count, ``theta <= 0``.
    """
    if not theta > 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    if head_dim < num_axes:
        raise ValueError(f"pope needs at least one channel per axis: head dim {head_dim} < {num_axes} axes")
    return axial_inv_freq(2 * head_dim, num_axes, theta)  # (A, D): D "pairs" = D channels, each its own phase


@register("pope")
class PoPE(Encoding):
    """PoPE (Gopalakrishnan et al., 2025) for nD positions: ``softplus`` magnitudes, purely positional phases with
    one axial frequency per channel, and a learned key phase bias ``delta`` (depth, H, D), initialised to 0 and
    clamped to ``[-2 pi, 0]`` as in the paper.

    No official implementation was found (the authors' paper gives the equations; PoPE-pytorch is a third-party
    port): the tests check the logits against the paper's complex-valued formula evaluated directly in fp64
    (``Re sum_c q~_ic conj(k~_jc)``), and the 1D frequencies against the paper's ``theta ** (-c / D)``.

    The features are built in fp32 (fp64 in a ``.double()`` module) with autocast off and returned in the input
    dtype; the softmax scale stays ``D ** -0.5`` (the contract of ``widen``). Prefix tokens sit at 0 (phase 0 on
    every channel), their magnitudes still ``softplus`` of their content. PoPE changes the content term itself, so
    it is never the same as ``nope`` and has no ``neutralize``.

    Args:
        spec: the build-time facts.
        theta: frequency base (vlpe's vision default 100; the paper's language models use 10000).

    Raises:
        ValueError: ``theta <= 0``; a head dim smaller than the axis count.

    Reference: Gopalakrishnan, Csordas, Schmidhuber, Mozer, "Decoupling the 'What' and 'Where' With Polar
    Coordinate Positional Embeddings", arXiv 2509.10534 (2025).
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "fp32_angles"})
    pieces = frozenset({"widen"})

    def __init__(self, *, spec: EncodingSpec, theta: float = 100.0) -> None:
        super().__init__(spec=spec)
        self.theta = float(theta)
        self.register_buffer("freqs", pope_freqs(self.head_dim, self.num_axes, self.theta), persistent=False)
        self.phase_bias = nn.Parameter(torch.zeros(spec.depth, spec.num_heads, self.head_dim))  # (L, H, D)

    def _prepare(self, ctx: Context) -> None:
        coords = ctx.pos.coords.to(torch.promote_types(ctx.pos.coords.dtype, self.freqs.dtype))
        ctx["phase"] = rope_angles(coords, self.freqs).unsqueeze(1)  # (B, 1, N, D)

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self.check_layer(layer)
        with torch.autocast(q.device.type, enabled=False):
            phi = ctx["phase"]  # (B, 1, N, D)
            delta = fp32(self.phase_bias[layer]).clamp(-2 * math.pi, 0.0).to(phi.dtype)[:, None]  # (H, 1, D)
            mq = F.softplus(q.to(phi.dtype))  # (B, H, N, D)
            mk = F.softplus(k.to(phi.dtype))
            psi = phi + delta  # (B, H, N, D) key phases
            wq = torch.cat([mq * phi.cos(), mq * phi.sin()], dim=-1)  # (B, H, N, 2D)
            wk = torch.cat([mk * psi.cos(), mk * psi.sin()], dim=-1)
            return wq.to(q.dtype), wk.to(k.dtype)

    def no_weight_decay(self) -> set[str]:
        return {"phase_bias"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}theta={self.theta}"
