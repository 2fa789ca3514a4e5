"""Spiral RoPE: 2D RoPE whose rotation pairs read the position along K directions evenly spread over [0, pi).

Liu et al., "Spiral RoPE: Rotate Your Rotary Positional Embeddings in the 2D Plane". Axial RoPE projects a
patch position on two directions only (the row and the column axis); Spiral RoPE gives every rotation pair one
of ``K`` directions ``phi_k = k pi / K`` and rotates it by ``omega * (cos(phi) row + sin(phi) col)``. ``K = 2``
is axial RoPE. Every pair is a fixed linear function of the position, so the encoding is exactly relative and
a frequency matrix ``(2, D/2)`` for vlpe's rotary machinery (tables once per forward, fp32 angles, scaling).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

import torch
from torch import Tensor

from .registry import register
from .rope import RotaryEncoding
from .spec import EncodingSpec

__all__ = ["SpiralRoPE", "spiral_freqs"]


def _band(num: int, theta: float, max_freq: float, truncate: float) -> Tensor:
    """``max_freq * theta ** (-j / num)`` for ``j < num`` (fp64), the lowest ``int(num * truncate)`` set to 0."""
    band = max_freq * theta ** (-torch.arange(num, dtype=torch.float64) / num)  # (num,)
    cut = int(num * truncate)
    if cut:
        band[-cut:] = 0.0
    return band


def spiral_freqs(head_dim: int, *, directions: int = 4, theta: float = 10000.0, max_freq: float = 1.5,
                 same_theta: bool = False, truncate: float = 0.0) -> Tensor:
    """Spiral RoPE's frequency matrix ``(2, D/2)`` fp32: pair ``p`` rotates by ``f[0, p] row + f[1, p] col``.

    The pairs follow the reference's order. The first ``P = D/4`` pairs start from the row direction, the
    others from the column direction (``phi = pi / 2``); pair ``p`` is turned further by ``i pi / K`` with
    ``i = (p // 2) mod (K / 2)`` (consecutive two-pair groups cycle through the K / 2 turns). Its magnitude
    ``omega``: with ``same_theta=False`` pair ``m`` of a half (``m = p mod P``) has ``max_freq * theta ** (-m / P)``;
    with ``same_theta=True`` the band has ``Q = P / (K/2)`` values ``max_freq * theta ** (-j / Q)`` and every
    direction gets all of them (pair ``m`` reads ``j = 2 ((m // 2) // (K/2)) + m mod 2``). ``truncate`` zeroes the
    lowest ``int(num * truncate)`` magnitudes of the band.

    Args:
        head_dim: ``D``, a multiple of ``2 K`` (``4 K`` with ``same_theta``).
        directions: ``K``, even, >= 2.

    Returns:
        ``(2, D/2)`` fp32: row 0 the row (axis 0) component, row 1 the column (axis 1) component.

    Raises:
        ValueError: an odd or too small ``K``, a head dim that does not fit it, ``theta <= 0``, ``max_freq <= 0``
            or ``truncate`` outside [0, 1).
    """
    if isinstance(directions, bool) or not isinstance(directions, int) or directions < 2 or directions % 2:
        raise ValueError(f"directions must be an even int >= 2 (2 is axial RoPE), got {directions!r}")
    turns = directions // 2
    if head_dim % (4 * turns) or head_dim < 8:
        raise ValueError(f"spiral_rope with directions={directions} needs a head dim that is a multiple of "
                         f"{4 * turns} and >= 8, got {head_dim}")
    if not theta > 0 or not max_freq > 0:
        raise ValueError(f"theta and max_freq must be > 0, got theta={theta}, max_freq={max_freq}")
    if not 0.0 <= truncate < 1.0:
        raise ValueError(f"truncate (the fraction of lowest frequencies set to 0) must be in [0, 1), got {truncate}")
    P = head_dim // 4  # pairs per half
    m = torch.arange(P)  # (P,)
    if same_theta:
        Q = P // turns
        if Q < 2 or Q % 2:
            raise ValueError(f"spiral_rope with same_theta needs an even band of >= 2 frequencies per direction: "
                             f"head dim {head_dim} / (4 * {turns}) = {Q}; use a larger head dim or fewer directions")
        omega = _band(Q, theta, max_freq, truncate)[2 * ((m // 2) // turns) + m % 2]  # (P,)
    else:
        omega = _band(P, theta, max_freq, truncate)  # (P,)
    p = torch.arange(2 * P)  # (D/2,) global pair index
    phi = (p >= P).double() * (math.pi / 2) + ((p // 2) % turns).double() * (math.pi / directions)  # (D/2,)
    omega = torch.cat([omega, omega])  # (D/2,)
    return torch.stack([omega * phi.cos(), omega * phi.sin()]).float()  # (2, D/2)


@register("spiral_rope")
class SpiralRoPE(RotaryEncoding):
    """Spiral RoPE (Liu et al.): 2D RoPE with ``K`` pair directions ``k pi / K``; ``K = 2`` is axial RoPE (with
    ``theta ** (-m / P)`` bands). Checked against the frequencies and the angle maps of
    huajianduzhuo-code/Spiral_RoPE ``RoPE_DeiT/rope.py`` (``VisionRotaryEmbedding``, ``rotate_freqs``, commit
    4abece3b678fc2f45faa153fab37a96d86e7dcb1), re-stated in the tests.

    The reference builds the turned pairs by rotating each pair's angle map as an image (``grid_sample``, about
    the grid centre, border padding); inside the grid that is the linear map ``omega (cos(phi) row + sin(phi) col)``
    plus a constant per pair, which cancels in every logit. vlpe uses the linear map everywhere, so it is
    relative and extrapolates, and differs from the reference at the grid corners, where the reference's samples
    fall outside the grid and are clamped to its border.

    Prefix tokens sit at 0 and are not rotated (the reference's CLS). The reference's channel order is
    ``layout="interleaved"`` (pair ``p`` = channels ``2p, 2p + 1``); the default ``"half"`` is vlpe's. The
    reference positions a grid of ``n`` patches trained at ``n0`` at ``i n0 / n``, which is ``scaling={"type":
    "linear", "factor": n / n0}`` here. ``neutralize()`` zeroes the frequencies.

    Args:
        spec: the build-time facts (2 axes).
        directions: ``K``, even, >= 2 (the reference's ``rotate = K / 2``).
        theta: frequency base.
        max_freq: the highest frequency (the reference's ``max_freq_lang``).
        same_theta: every direction gets the whole band (see :func:`spiral_freqs`).
        truncate: fraction of the lowest frequencies set to 0 (the reference's ``truncate_percentage``).
        layout: ``"half"`` or ``"interleaved"``.
        scaling: training-free RoPE scaling (see :mod:`vlpe.encodings.functional.scaling`).

    Raises:
        ValueError: see :func:`spiral_freqs`; a bad layout.

    Reference: Liu et al., "Spiral RoPE: Rotate Your Rotary Positional Embeddings in the 2D Plane" (2025).
    """

    supported_axes = (2,)
    example = {"directions": 4}

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        directions: int = 4,
        theta: float = 10000.0,
        max_freq: float = 1.5,
        same_theta: bool = False,
        truncate: float = 0.0,
        layout: Literal["half", "interleaved"] = "half",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(spec=spec, layout=layout)
        if not isinstance(same_theta, bool):
            raise ValueError(f"same_theta must be a bool, got {same_theta!r}")
        freqs = spiral_freqs(self.head_dim, directions=directions, theta=theta, max_freq=max_freq,
                             same_theta=same_theta, truncate=truncate)  # (2, D/2)
        self.directions = directions
        self.theta = float(theta)
        self.max_freq = float(max_freq)
        self.same_theta = same_theta
        self.truncate = float(truncate)
        self.band_pairs = self.head_dim // 4 // (directions // 2 if same_theta else 1)
        self.register_buffer("freqs", freqs, persistent=False)
        self._init_scaling(scaling)

    def spectrum(self) -> dict[str, Any]:
        P = self.band_pairs
        return {"hi": self.max_freq, "lo": self.max_freq * self.theta ** (-(P - 1) / P), "num_pairs": P}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, directions={self.directions}, theta={self.theta}, "
                f"max_freq={self.max_freq}, same_theta={self.same_theta}, layout={self.layout!r}")
