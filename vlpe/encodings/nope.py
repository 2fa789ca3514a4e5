"""NoPE: no position encoding. The reference every neutral setting is compared against."""

from __future__ import annotations

from .base import Encoding
from .spec import EncodingSpec
from .registry import register


@register("nope")
class NoPE(Encoding):
    """No position information: every hook is the identity (Kazemnejad et al., NeurIPS 2023, "NoPE")."""

    claims = frozenset({"relative", "extrapolation", "zero_init", "neutral", "rotation_invariant"})

    def __init__(self, *, spec: EncodingSpec) -> None:
        super().__init__(spec=spec)

    def neutralize(self) -> "NoPE":
        return self
