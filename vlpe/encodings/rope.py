"""Axial RoPE for any number of axes (2D images, 3D video or points) and plain 1D RoPE for decoders.

Every rotary encoding takes ``scaling={"type": "linear" | "ntk" | "yarn", "factor": s, ...}`` (see
:mod:`vlpe.encodings.functional.scaling`) at build time or later through ``enc.set_scaling(cfg)``;
:func:`set_scaling` applies one config to every rotary encoding inside a model. Scaling changes no parameter
and no ``state_dict`` key, so trained weights are evaluated at a new resolution as they are.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch
from torch import Tensor, nn

from .base import Context, Encoding
from .spec import EncodingSpec
from .functional.rope import apply_rope, axial_inv_freq, cos_sin, inv_freq, rope_angles, to_half, to_interleaved
from .functional.scaling import RopeScaling, parse_scaling, scale_frequencies
from .registry import register

__all__ = ["RotaryScaling", "RotaryEncoding", "AxialRoPE", "RoPE1D", "set_scaling"]


class RotaryScaling:
    """Mixin of every rotary encoding: the ``scaling`` option, :meth:`set_scaling` and the scaled frequencies.

    ``scaling`` is a plain attribute (no buffer, no parameter): checkpoints are the same with or without it.
    Subclasses name their reference spectrum in :meth:`spectrum` (highest / lowest frequency and pairs per axis
    band, :func:`~vlpe.encodings.functional.scaling.scale_frequencies`) and call :meth:`scaled` on their
    frequency matrix and :meth:`temper` on their tables once per forward.
    """

    scaling: RopeScaling | None = None

    @property
    def accepts_scaling(self) -> bool:
        """False where this configuration has no meaningful scaling (ComRoPE on normalised coordinates)."""
        return True

    def _init_scaling(self, scaling: Mapping[str, Any] | None) -> None:
        self.scaling = None
        if scaling is not None:
            self.set_scaling(scaling)

    def set_scaling(self, scaling: Mapping[str, Any] | RopeScaling | None):
        """Use ``scaling`` from the next forward on (None: no scaling); returns the encoding."""
        parsed = parse_scaling(scaling, num_axes=self.num_axes, names=self.axis_names, who=type(self).__name__)
        if parsed is not None:
            self._check_scaling(parsed)
        self.scaling = parsed
        return self

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        return None  # the default names of functional.scaling.axis_names

    def _check_scaling(self, scaling: RopeScaling) -> None:
        if scaling.type != "linear":
            with torch.no_grad():
                scale_frequencies(self._scaling_probe(), scaling, **self.spectrum())

    def _scaling_probe(self) -> Tensor:
        return self.freqs

    def spectrum(self) -> dict[str, Any]:
        """``hi``, ``lo``, ``num_pairs`` of the reference spectrum: ``theta ** (-k / P)``, ``k < P`` per axis."""
        P = self.band_pairs
        return {"hi": 1.0, "lo": self.theta ** (-(P - 1) / P), "num_pairs": P}

    def scaled(self, freqs: Tensor) -> Tensor:
        """``freqs`` ``(..., A, P)`` with this encoding's scaling applied (the same tensor without scaling)."""
        if self.scaling is None:
            return freqs
        return scale_frequencies(freqs, self.scaling, **self.spectrum())

    def temper(self, *tables: Tensor) -> tuple[Tensor, ...]:
        """Tables times the YaRN attention factor (logits scale by its square); unchanged without one."""
        m = 1.0 if self.scaling is None else self.scaling.attention_factor
        return tables if m == 1.0 else tuple(t * m for t in tables)

    def scaling_repr(self) -> str:
        return "" if self.scaling is None else f", scaling={self.scaling.type}x{self.scaling.factor}"


class RotaryEncoding(RotaryScaling, Encoding):
    """Shared machinery: an ``(A, D/2)`` frequency buffer (``(H, A, D/2)`` per head), fp32 tables once per
    forward, one apply per layer, and the training-free ``scaling`` of :class:`RotaryScaling`.

    The frequency buffer is non-persistent and kept fp32 through ``.half()``/``.bfloat16()`` (timm's
    ``_apply`` guard), so checkpoints carry no tables and downcasts cannot degrade the angles. Subclasses set
    ``freqs`` and ``theta``, then call ``self._init_scaling(scaling)``; ``band_pairs`` is the number of pairs
    of one axis' frequency band (``D/2`` unless set).
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})

    def __init__(self, *, spec: EncodingSpec, layout: Literal["half", "interleaved"] = "half") -> None:
        super().__init__(spec=spec)
        if layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
        self.layout = layout
        self.band_pairs = self.head_dim // 2

    def _prepare(self, ctx: Context) -> None:
        angles = rope_angles(ctx.pos.coords, self.scaled(self.freqs))  # (B, N, D/2), (B, H, N, D/2) per head
        cos, sin = self.temper(*cos_sin(angles))
        if self.freqs.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, N, D/2)
        ctx["cos"], ctx["sin"] = cos, sin

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}{self.scaling_repr()}"

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

    ``head_axes`` (one entry per head, an axis index or None) gives whole heads to one axis, the vision form of
    Multi-Head RoPE (Huang et al., arXiv 2510.23095; vlpe ``mhrope`` for decoders): a head of axis ``a`` puts all
    its ``D/2`` pairs on that axis with frequencies ``theta ** (-k / (D/2))``, a None head is not rotated.
    ``scaling`` (linear / ntk / yarn, per axis) is described in :mod:`vlpe.encodings.functional.scaling`.
    """


    def __init__(
        self,
        *,
        spec: EncodingSpec,
        theta: float = 100.0,
        layout: Literal["half", "interleaved"] = "half",
        head_axes: Sequence[int | None] | None = None,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        dim, num_heads, num_axes = spec.dim, spec.num_heads, spec.num_axes
        super().__init__(spec=spec, layout=layout)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.theta = float(theta)
        self.head_axes = None if head_axes is None else self._check_head_axes(head_axes)
        if self.head_axes is None:
            freqs = axial_inv_freq(self.head_dim, num_axes, self.theta)  # (A, D/2)
            self.band_pairs = self.head_dim // 2 // num_axes
        else:
            if self.head_dim % 2:
                raise ValueError(f"rotary encodings need an even head dim, got {self.head_dim}")
            band = inv_freq(self.head_dim // 2, self.theta)  # (D/2,)
            freqs = torch.zeros(num_heads, num_axes, self.head_dim // 2)  # (H, A, D/2)
            for h, a in enumerate(self.head_axes):  # heads, not tokens
                if a is not None:
                    freqs[h, a] = band
        self.register_buffer("freqs", freqs, persistent=False)
        self._init_scaling(scaling)

    def _check_head_axes(self, head_axes) -> tuple[int | None, ...]:
        axes = tuple(head_axes)
        ok = len(axes) == self.num_heads and all(
            a is None or (isinstance(a, int) and not isinstance(a, bool) and 0 <= a < self.num_axes) for a in axes
        )
        if not ok:
            raise ValueError(
                f"head_axes must give each of the {self.num_heads} heads an axis in [0, {self.num_axes}) or None "
                f"(not rotated), e.g. {tuple([0, 1] * (self.num_heads // 2))}; got {head_axes!r}"
            )
        return axes

    def extra_repr(self) -> str:
        extra = "" if self.head_axes is None else f", head_axes={self.head_axes}"
        return f"{super().extra_repr()}, theta={self.theta}, layout={self.layout!r}{extra}"


@register("rope1d")
class RoPE1D(RotaryEncoding):
    """Plain 1D RoPE of decoders (Su et al., RoFormer 2021): pair j rotates by ``p * theta ** (-2j/D)``.

    Checked against Hugging Face ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` (half layout).
    """

    supported_axes = (1,)
    default_num_axes = 1

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        theta: float = 10000.0,
        layout: Literal["half", "interleaved"] = "half",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(spec=spec, layout=layout)
        if theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.theta = float(theta)
        self.register_buffer("freqs", inv_freq(self.head_dim // 2, self.theta).unsqueeze(0), persistent=False)
        self._init_scaling(scaling)


def set_scaling(module: nn.Module, scaling: Mapping[str, Any] | None) -> int:
    """Apply ``scaling`` (None: remove it) to every rotary encoding inside ``module``; returns how many.

    For evaluating trained weights at a new resolution: parameters and ``state_dict`` keys stay as they are.
    Raises ValueError when ``module`` holds no encoding that takes scaling, or when one of them rejects it
    (nothing is changed then).
    """
    targets = [m for m in module.modules() if isinstance(m, RotaryScaling)]
    if not targets:
        raise ValueError(f"{type(module).__name__} holds no rotary encoding that takes scaling")
    rejected = [type(m).__name__ for m in targets if not m.accepts_scaling]
    if rejected and scaling is not None:
        raise ValueError(f"set_scaling: {', '.join(rejected)} take no scaling in this configuration (see its docs)")
    old = [m.scaling for m in targets]
    try:
        for m in targets:
            m.set_scaling(scaling)
    except ValueError:
        for m, o in zip(targets, old):
            m.scaling = o
        raise
    return len(targets)
