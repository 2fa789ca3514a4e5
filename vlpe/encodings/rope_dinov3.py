"""DINOv3's RoPE: axial rotary encoding of coordinates normalised to [-1, 1] by the grid extent, with training-time
coordinate augmentations (shift, jitter, rescale)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .base import Context
from .spec import EncodingSpec
from .fire import patch_bounds
from .functional.rope import cos_sin, rope_angles
from .registry import register
from .rope import RotaryEncoding

__all__ = ["DINOv3RoPE", "dinov3_periods"]

NORMALIZE = ("separate", "max", "min")


def dinov3_periods(
    num_periods: int, *, base: float | None = 100.0, min_period: float | None = None, max_period: float | None = None
) -> Tensor:
    """The ``num_periods`` (P) periods of one axis, fp32 ``(P,)``: ``base ** (k / P)`` for ``k < P``, or
    ``min_period * (max_period / min_period) ** (k / (P - 1))`` (geometric from min to max period)."""
    k = torch.arange(num_periods, dtype=torch.float64)  # (P,)
    if base is not None:
        return (base ** (k / num_periods)).float()
    t = k / (num_periods - 1) if num_periods > 1 else torch.zeros(1, dtype=torch.float64)
    return (min_period * (max_period / min_period) ** t).float()


@register("rope_dinov3")
class DINOv3RoPE(RotaryEncoding):
    """DINOv3's RoPE (Siméoni et al., "DINOv3", 2025; facebookresearch/dinov3
    ``dinov3/layers/rope_position_encoding.py``), checked against timm's ``RotaryEmbeddingDinoV3`` and against a
    re-derivation of the reference formula in tests/test_rope_dinov3.py.

    Axis a of a token at patch coordinate ``p_a`` gets the normalised coordinate ``u_a = 2 (p_a + 0.5) / n_a - 1``
    (so a grid from 0 fills [-1, 1]); ``n_a`` is the extent of axis a (``normalize_coords="separate"``), or the
    largest / smallest extent over the axes (``"max"`` / ``"min"``). Rotation pair ``m`` of the half layout
    (channels ``m, m + D/2``) reads axis ``m // P`` (``P = D / (2 A)`` pairs per axis, DINOv3's ``D/4`` for
    images) with angle ``2 pi u_a / period_{m mod P}``; periods are ``base ** (k / P)`` or geometric from
    ``min_period`` to ``max_period``.

    Extents: from ``pos.grid`` when the positions are a grid (Python ints). For positions without a grid
    (crops, point sets) each sample's extent is measured on device from its non-prefix, non-padding coordinates,
    ``n_a = max_a - min_a + 1`` patches. Either way the coordinates are taken from their minimum
    (``u_a = 2 (p_a - min_a + 0.5) / n_a - 1``, on device): the reference builds ``u`` from the index of a patch
    in its feature map (timm's ``_build_grid(grid_type="centered")`` at its default ``grid_offset=0``), so the
    tokens of an ``h x w`` grid fill [-1, 1] wherever their coordinates start, and the same coordinates give the
    same rotation with or without the grid metadata (``Positions.grid(h, w).shifted(d)`` and
    ``Positions(those coords)``; a lattice from :meth:`Positions.grid_nd` starts at 0 and skips the min). Prefix tokens
    (CLS, registers) are not rotated, as in DINOv3. Because ``u_i - u_j = 2 (p_i - p_j) / n``, patch-patch logits
    depend only on offsets at a fixed extent (``relative``), but a sub-grid of a larger grid is rescaled
    (no ``extrapolation``): every resolution is interpolated into [-1, 1].

    Training only (``self.training``), once per forward for the whole batch, drawn on device: ``u`` is shifted by
    a uniform per-axis value in ``[-shift_coords, shift_coords]``, multiplied by a per-axis log-uniform factor in
    ``[1/jitter_coords, jitter_coords]`` and by one log-uniform factor in ``[1/rescale_coords, rescale_coords]``
    (DINOv3's order). In eval mode the encoding is deterministic. Angles are fp32 under autocast; the
    frequency buffer stays fp32 through ``.to(torch.bfloat16)``. Training-free ``scaling`` does not apply
    (normalised coordinates already map every resolution into [-1, 1]).
    """

    claims = frozenset({"relative", "neutral", "fp32_angles"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        base: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: Literal["separate", "max", "min"] = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        layout: Literal["half", "interleaved"] = "half",
    ) -> None:
        dim, num_axes = spec.dim, spec.num_axes
        super().__init__(spec=spec, layout=layout)
        if self.head_dim % (2 * num_axes):
            raise ValueError(
                f"rope_dinov3 gives each of the {num_axes} axes the same number of rotation pairs: the head dim "
                f"({self.head_dim}) must be a multiple of 2 * num_axes = {2 * num_axes}"
            )
        periods_given = min_period is not None or max_period is not None
        if periods_given and base is not None:
            raise ValueError(
                "rope_dinov3 takes either base or min_period + max_period; pass base=None with the two periods"
            )
        if base is None and (min_period is None or max_period is None):
            raise ValueError("rope_dinov3 needs base, or both min_period and max_period (with base=None)")
        if base is not None and not (math.isfinite(base) and base > 0):
            raise ValueError(f"rope_dinov3: base must be a finite number > 0, got {base}")
        if base is None and not (0 < min_period <= max_period and math.isfinite(max_period)):
            raise ValueError(
                f"rope_dinov3: need 0 < min_period <= max_period (finite), got {min_period} and {max_period}"
            )
        if normalize_coords not in NORMALIZE:
            raise ValueError(f"rope_dinov3: normalize_coords must be one of {NORMALIZE}, got {normalize_coords!r}")
        for name, value, low in (("shift_coords", shift_coords, 0.0), ("jitter_coords", jitter_coords, 1.0),
                                 ("rescale_coords", rescale_coords, 1.0)):  # fmt: skip
            if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value < low):
                what = "a shift >= 0" if low == 0 else "a factor >= 1"
                raise ValueError(f"rope_dinov3: {name} must be None or {what}, got {value!r}")
        self.base = None if base is None else float(base)
        self.min_period = None if min_period is None else float(min_period)
        self.max_period = None if max_period is None else float(max_period)
        self.normalize_coords = normalize_coords
        self.shift_coords = None if shift_coords is None else float(shift_coords)
        self.jitter_coords = None if jitter_coords is None else float(jitter_coords)
        self.rescale_coords = None if rescale_coords is None else float(rescale_coords)
        P = self.head_dim // (2 * num_axes)
        self.band_pairs = P
        omega = (2 * math.pi / dinov3_periods(P, base=base, min_period=min_period, max_period=max_period).double())
        freqs = torch.zeros(num_axes, self.head_dim // 2, dtype=torch.float64)  # (A, D/2)
        for a in range(num_axes):  # axes, not tokens
            freqs[a, a * P : (a + 1) * P] = omega
        self.register_buffer("freqs", freqs.float(), persistent=False)
        self._init_scaling(None)

    # ------------------------------------------------------------------ scaling (does not apply)
    @property
    def accepts_scaling(self) -> bool:
        return False

    def set_scaling(self, scaling):
        if scaling is not None:
            raise ValueError(
                "rope_dinov3 normalises coordinates to [-1, 1] by the grid extent, so every resolution is "
                "interpolated already; training-free scaling does not apply (use rope for scaling)"
            )
        return super().set_scaling(None)

    # ------------------------------------------------------------------ per forward
    def normalized_coords(self, pos, *, training: bool = False) -> Tensor:
        """DINOv3 coordinates ``u`` of every token ``(B, N, A)`` fp32 (prefix rows are not meaningful), with
        the training augmentations when ``training``."""
        A = self.num_axes
        with torch.autocast(pos.device.type, enabled=False):
            c = pos.coords if pos.coords.dtype == torch.float64 else pos.coords.float()  # (B, N, A)
            if pos.grid is not None:
                n = list(pos.grid)  # Python ints: no device read
                if self.normalize_coords != "separate":
                    n = [max(n) if self.normalize_coords == "max" else min(n)] * A
                if not pos.lattice:  # a grid moved (shifted) or given new coordinates: taken from its minimum
                    c = c - patch_bounds(pos, c)[0]  # (B, N, A), on device; a lattice starts at 0 already
                u = torch.stack([2.0 * (c[..., a] + 0.5) / n[a] - 1.0 for a in range(A)], dim=-1)  # (B, N, A)
            else:
                lo, n = self._measured_extent(pos, c)  # (B', 1, A) each
                u = 2.0 * (c - lo + 0.5) / n - 1.0  # (B, N, A)
            if training:
                u = self._augment(u)
            return u

    def _combine_extents(self, n: Tensor) -> Tensor:
        """Per-axis extents ``(..., A)`` -> the normalisers of ``normalize_coords``."""
        if self.normalize_coords == "max":
            return n.amax(-1, keepdim=True).expand(n.shape)
        if self.normalize_coords == "min":
            return n.amin(-1, keepdim=True).expand(n.shape)
        return n

    def _measured_extent(self, pos, c: Tensor) -> tuple[Tensor, Tensor]:
        lo, hi = patch_bounds(pos, c)  # (B', 1, A) each
        return lo, self._combine_extents(hi - lo + 1.0)

    def _augment(self, u: Tensor) -> Tensor:
        """DINOv3's shift, jitter, rescale (in that order), one draw per forward, on ``u``'s device."""
        A, dd = self.num_axes, dict(device=u.device, dtype=u.dtype)
        if self.shift_coords is not None:
            u = u + torch.empty(A, **dd).uniform_(-self.shift_coords, self.shift_coords)
        if self.jitter_coords is not None:
            j = math.log(self.jitter_coords)
            u = u * torch.empty(A, **dd).uniform_(-j, j).exp()
        if self.rescale_coords is not None:
            r = math.log(self.rescale_coords)
            u = u * torch.empty(1, **dd).uniform_(-r, r).exp()
        return u

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        u = self.normalized_coords(pos, training=ctx.training)  # (B, N, A)
        angles = rope_angles(u, self.freqs)  # (B, N, D/2) fp32
        if pos.prefix:
            angles = angles * (~pos.is_prefix).to(angles.dtype)[:, None]  # prefix tokens: not rotated
        cos, sin = cos_sin(angles)
        ctx["cos"], ctx["sin"] = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, N, D/2)

    def extra_repr(self) -> str:
        periods = f"base={self.base}" if self.base is not None else f"periods=[{self.min_period}, {self.max_period}]"
        augs = "".join(
            f", {n}={v}"
            for n, v in (("shift", self.shift_coords), ("jitter", self.jitter_coords), ("rescale", self.rescale_coords))
            if v is not None
        )
        return f"{super().extra_repr()}, {periods}, normalize_coords={self.normalize_coords!r}{augs}"
