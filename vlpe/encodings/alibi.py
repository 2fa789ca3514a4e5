"""nD ALiBi: a per-head linear penalty on the Euclidean distance between token coordinates."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import Context, Encoding
from .spec import EncodingSpec
from .registry import register

__all__ = ["ALiBi", "alibi_slopes", "pairwise_distance"]


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al., ICLR 2022), fp32 ``(H,)``.

    H a power of two: ``m_h = 2 ** (-8 (h + 1) / H)``. Otherwise the slopes of ``n = 2 ** floor(log2 H)``
    heads, followed by every other slope (the 1st, 3rd, ...) of the ``2n`` sequence until H slopes exist.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(n)
    if n < num_heads:
        slopes += power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def pairwise_distance(a: Tensor, b: Tensor) -> Tensor:
    """Euclidean distances ``(B, n, m)`` between coordinates ``a`` (B, n, A) and ``b`` (B, m, A), fp32.

    Accumulates per-axis squared differences (no ``|a|^2 + |b|^2 - 2ab`` cancellation at large coordinates),
    with autocast off.
    """
    with torch.autocast(a.device.type, enabled=False):
        a = a if a.dtype == torch.float64 else a.float()
        b = b if b.dtype == torch.float64 else b.float()
        d2 = None
        for ax in range(a.shape[-1]):
            diff = a[..., :, None, ax] - b[..., None, :, ax]  # (B, n, m)
            d2 = diff.square() if d2 is None else d2.add_(diff.square())
        return d2.sqrt()


@register("alibi")
class ALiBi(Encoding):
    """nD ALiBi: ``bias_{h,ij} = -m_h * ||p_i - p_j||_2`` over all axes (2D ALiBi of CROMA, Fuller et al.,
    NeurIPS 2023; the nD form of PaPE's baseline), with ALiBi's slopes (Press et al., ICLR 2022) including the
    rule for head counts that are not powers of two.

    Prefix tokens are unpenalised: rows and columns of prefix tokens get zero bias (PaPE instead puts CLS at
    position 0 and penalises it like a patch). Distances are fp32 under autocast. ``score`` builds only the
    requested query rows from the coordinates (its faster forms, a lattice table and an analytic flex
    ``score_mod``, are registered in :mod:`vlpe.attention_forms.alibi`). ``neutralize()`` sets
    the slopes to 0. Checked against slopes and biases computed by hand from the definition.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "rotation_invariant", "neutral", "fp32_angles"})
    pieces = frozenset({"score"})

    def __init__(self, *, spec: EncodingSpec) -> None:
        num_heads = spec.num_heads
        super().__init__(spec=spec)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)  # (H,)


    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        coords = pos.coords if pos.coords.dtype == torch.float64 else pos.coords.float()
        ctx["coords"] = coords  # (B, N, A)
        ctx["patch"] = (~pos.is_prefix).to(coords.dtype)  # (N,) 0 for prefix tokens

    def _distance(self, ctx: Context, rows: slice) -> Tensor:
        """``(B, n, N)`` distances of the query ``rows`` to every key, 0 for pairs with a prefix token."""
        coords, patch = ctx["coords"], ctx["patch"]
        dist = pairwise_distance(coords[:, rows], coords)  # (B, n, N)
        return dist * patch[rows, None] * patch[None, :]  # prefix rows / columns: no penalty

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor:
        dist = self._distance(ctx, slice(None) if rows is None else rows)
        return -self.slopes.to(dist.dtype)[None, :, None, None] * dist[:, None]  # (B, H, n, N)

    def neutralize(self) -> ALiBi:
        self.slopes.zero_()
        return self
