"""NoPE: no position encoding. The reference every neutral setting is compared against."""

from __future__ import annotations

from .base import Encoding
from .registry import register


@register("nope")
class NoPE(Encoding):
    """No position information: every hook is the identity (Kazemnejad et al., NeurIPS 2023, "NoPE")."""

    claims = frozenset({"relative", "extrapolation", "zero_init", "neutral", "rotation_invariant"})

    def __init__(self, *, dim: int, num_heads: int, depth: int = 12, num_axes: int = 2) -> None:
        super().__init__(dim=dim, num_heads=num_heads, depth=depth, num_axes=num_axes)

    def neutralize(self) -> "NoPE":
        return self
