"""RoPE-Mixed: rotary encoding with learned per-layer, per-head frequency vectors mixing the axes."""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

import torch
from torch import Tensor, nn

from .base import Context, Encoding
from .spec import EncodingSpec
from .functional.rope import apply_rope, axial_inv_freq, cos_sin, rope_angles, to_half, to_interleaved
from .registry import register
from .rope import RotaryScaling

__all__ = ["RoPEMixed", "init_mixed_freqs"]


def init_mixed_freqs(
    head_dim: int,
    depth: int,
    num_heads: int,
    num_axes: int = 2,
    *,
    theta: float = 10.0,
    rotate: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Initial RoPE-Mixed frequencies ``(depth, heads, A, D/2)`` in fp32; coordinates are ``(h, w)`` for A = 2.

    A = 2 (naver-ai/rope-vit ``init_random_2d_freqs``): magnitudes ``theta ** (-4k/D)`` for ``k < D/4``; per
    layer and head an angle ``phi ~ U(0, 2 pi)`` (one ``torch.rand(depth, heads, 1)`` draw, the same draw as
    timm's ``init_random_2d_freqs``, so equal seeds give equal values); pair ``k < D/4`` points along
    ``(x, y) = (cos phi, sin phi)`` and pair ``D/4 + k`` along the direction turned by ``pi/2``. Here
    x = column (axis 1) and y = row (axis 0).
    Other A: the axial frequencies of :func:`axial_inv_freq` (``theta ** (-k/P)``, pair groups one axis
    each) turned by a Haar-random rotation per layer and head.
    ``rotate=False`` keeps the unrotated (axial) directions.
    """
    if head_dim % 4:
        raise ValueError(f"rope_mixed needs a head dim divisible by 4, got {head_dim}")
    half = head_dim // 2
    if num_axes == 2:
        quarter = head_dim // 4
        k = torch.arange(quarter, dtype=torch.int64).float()  # (D/4,)
        mag = 1.0 / (theta ** (4.0 * k / head_dim))  # (D/4,)
        if rotate:
            phi = torch.rand(depth, num_heads, 1, generator=generator) * (2 * math.pi)  # (L, H, 1)
        else:
            phi = torch.zeros(depth, num_heads, 1)
        f_x = torch.cat([mag * phi.cos(), mag * (phi + math.pi / 2).cos()], dim=-1)  # (L, H, D/2)
        f_y = torch.cat([mag * phi.sin(), mag * (phi + math.pi / 2).sin()], dim=-1)  # (L, H, D/2)
        return torch.stack([f_y, f_x], dim=-2)  # (L, H, 2, D/2): axis 0 = row (y), axis 1 = column (x)
    base = axial_inv_freq(head_dim, num_axes, theta)  # (A, D/2)
    if not rotate or num_axes == 1:
        return base.expand(depth, num_heads, num_axes, half).clone()
    m = torch.randn(depth, num_heads, num_axes, num_axes, generator=generator, dtype=torch.float64)
    qm, r = torch.linalg.qr(m)
    qm = qm * torch.diagonal(r, dim1=-2, dim2=-1).sign().unsqueeze(-2)  # Haar-distributed orthogonal
    return (qm.float() @ base).contiguous()  # (L, H, A, D/2)


@register("rope_mixed")
class RoPEMixed(RotaryScaling, Encoding):
    """RoPE-Mixed (Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024,
    naver-ai/rope-vit): each layer and head learns, per rotation pair, a frequency *vector* over the axes, so
    the angle ``f . p`` can follow diagonal directions.

    ``freqs`` is a Parameter ``(depth, heads, A, D/2)``; with A = 2 its init equals timm's
    ``init_random_2d_freqs`` / ``RotaryEmbeddingMixed`` (theta = 10, random rotation per layer and head) for the
    same seed, up to the axis order (ours ``(h, w)``, timm's ``(x, y)``). Checked against timm's
    ``RotaryEmbeddingMixed`` + ``apply_rot_embed_cat`` (``layout='interleaved'``). Learned frequencies stay
    fp32 through ``.half()`` / ``.bfloat16()`` (note that DeepSpeed's bf16 mode casts parameters directly;
    use its ``torch_autocast`` mode to keep them fp32), angles are fp32 under autocast, and ``freqs`` is
    excluded from weight decay. The cos/sin tables of all layers, ``(B or 1, depth, H, N, D/2)``, are built
    once per forward. Prefix tokens sit at coordinate 0 and are not rotated.

    ``scaling``: ``linear`` divides every frequency component along axis a by ``s_a`` (positions divided by
    ``s_a``); ``ntk`` / ``yarn`` scale each component by the gain a fixed RoPE frequency of the same magnitude
    would get, on the init spectrum ``theta ** (-k / P)`` (P pairs per axis; :mod:`vlpe.encodings.functional.scaling`).
    The learned parameters are untouched.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        theta: float = 10.0,
        rotate: bool = True,
        layout: Literal["half", "interleaved"] = "half",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        num_heads, depth, num_axes = spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        self.theta = float(theta)
        self.rotate_init = bool(rotate)
        self.layout = layout
        self.freqs = nn.Parameter(
            init_mixed_freqs(self.head_dim, depth, num_heads, num_axes, theta=theta, rotate=rotate)
        )
        self.band_pairs = self.head_dim // 2 // num_axes  # pairs per axis of the init spectrum
        self._init_scaling(scaling)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(
                init_mixed_freqs(
                    self.head_dim, self.depth, self.num_heads, self.num_axes, theta=self.theta, rotate=self.rotate_init
                )
            )


    def _prepare(self, ctx: Context) -> None:
        angles = rope_angles(ctx.pos.coords, self.scaled(self.freqs))  # (B, L, H, N, D/2)
        if angles.requires_grad:
            cos, sin = cos_sin(angles)
        else:  # inference: sin in place, one (L, H, N, D/2) table less at the peak
            with torch.autocast(angles.device.type, enabled=False):
                cos, sin = angles.cos(), angles.sin_()
        cos, sin = self.temper(cos, sin)
        ctx["cos"], ctx["sin"] = cos, sin
        # per-layer views from one unbind: their gradients meet in one stack, not L full-size selects
        ctx["layers"] = tuple(zip(cos.unbind(1), sin.unbind(1)))  # L x ((B, H, N, D/2), (B, H, N, D/2))

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        if not 0 <= layer < self.depth:
            raise ValueError(f"rope_mixed was built with depth={self.depth}, got layer={layer}")
        cos, sin = ctx["layers"][layer]  # (B, H, N, D/2) each
        if self.layout == "interleaved":
            return (
                to_interleaved(apply_rope(to_half(q), cos, sin)),
                to_interleaved(apply_rope(to_half(k), cos, sin)),
            )
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def neutralize(self) -> RoPEMixed:
        with torch.no_grad():
            self.freqs.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, theta={self.theta}, layout={self.layout!r}{self.scaling_repr()}"
