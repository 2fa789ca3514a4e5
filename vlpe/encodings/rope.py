"""Axial RoPE for any number of axes (2D images, 3D video or points) and plain 1D RoPE for decoders."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from .base import Context, Encoding
from .functional.rope import apply_rope, axial_inv_freq, cos_sin, inv_freq, rope_angles, to_half, to_interleaved
from .registry import register


class RotaryEncoding(Encoding):
    """Shared machinery: an ``(A, D/2)`` frequency buffer, fp32 tables once per forward, one apply per layer.

    The frequency buffer is non-persistent and kept fp32 through ``.half()``/``.bfloat16()`` (timm's
    ``_apply`` guard), so checkpoints carry no tables and downcasts cannot degrade the angles.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})

    def __init__(self, *, dim, num_heads, depth, num_axes, layout: Literal["half", "interleaved"] = "half") -> None:
        super().__init__(dim=dim, num_heads=num_heads, depth=depth, num_axes=num_axes)
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        self.layout = layout


    def _prepare(self, ctx: Context) -> None:
        angles = rope_angles(ctx.pos.coords, self.freqs)  # (B, N, D/2)
        cos, sin = cos_sin(angles)
        ctx["cos"], ctx["sin"] = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, N, D/2)

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        cos, sin = ctx["cos"], ctx["sin"]
        if self.layout == "interleaved":
            return (
                to_interleaved(apply_rope(to_half(q), cos, sin)),
                to_interleaved(apply_rope(to_half(k), cos, sin)),
            )
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def neutralize(self) -> "RotaryEncoding":
        self.freqs.zero_()
        return self


@register("rope")
class AxialRoPE(RotaryEncoding):
    """Axial RoPE: head-dim rotation pairs split evenly over the A axes, ``theta ** (-k/P)`` per axis.

    Heo et al., "Rotary Position Embedding for Vision Transformer" (ECCV 2024, naver-ai/rope-vit
    RoPE-Axial, theta = 100) and EVA-02 (theta = 10000). Checked against timm's
    ``RotaryEmbeddingCat`` / ``apply_rot_embed_cat`` (``layout='interleaved'``, rows first). Prefix tokens sit at
    coordinate 0 and are therefore not rotated; angles are fp32 under autocast.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        depth: int = 12,
        num_axes: int = 2,
        theta: float = 100.0,
        layout: Literal["half", "interleaved"] = "half",
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, depth=depth, num_axes=num_axes, layout=layout)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.theta = float(theta)
        self.register_buffer("freqs", axial_inv_freq(self.head_dim, num_axes, self.theta), persistent=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, theta={self.theta}, layout={self.layout!r}"


@register("rope1d")
class RoPE1D(RotaryEncoding):
    """Plain 1D RoPE of decoders (Su et al., RoFormer 2021): pair j rotates by ``p * theta ** (-2j/D)``.

    Checked against Hugging Face ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` (half layout).
    """

    supported_axes = (1,)

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        depth: int = 12,
        num_axes: int = 1,
        theta: float = 10000.0,
        layout: Literal["half", "interleaved"] = "half",
    ) -> None:
        super().__init__(dim=dim, num_heads=num_heads, depth=depth, num_axes=num_axes, layout=layout)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.theta = float(theta)
        self.register_buffer("freqs", inv_freq(self.head_dim // 2, self.theta).unsqueeze(0), persistent=False)
