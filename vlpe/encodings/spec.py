"""The build-time facts every encoding is given, in one frozen record.

:func:`vlpe.encodings.build` turns ``dim=``, ``num_heads=`` and the model facts among the options
(``depth``, ``num_axes``, ``grid``, ``num_kv_heads``) into one :class:`EncodingSpec` and passes it the same
way to every encoding (``cls(spec=spec, **its_own_options)``); callers never need to know which encoding
reads which fact. An encoding ignores the facts it has no use for, except ``num_kv_heads``, which only
encodings declaring ``takes_kv_heads`` accept (it changes the attention's shape, so it is never dropped).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

__all__ = ["EncodingSpec", "SPEC_FIELDS"]


@dataclass(frozen=True)
class EncodingSpec:
    """What the model tells an encoding at build time.

    Attributes:
        dim: model width ``C``; tokens are ``(B, N, C)``.
        num_heads: attention heads ``H``; ``q, k, v`` are ``(B, H, N, dim // H)``.
        depth: attention blocks (per-layer tables have one entry per block).
        num_axes: coordinate axes per token ``A`` (None: the encoding's default, resolved by ``build``).
        grid: the nominal (training) grid of the tokens, e.g. ``(h, w)``; encodings with learned tables
            sized to a grid use it when not told otherwise (None: their own default).
        num_kv_heads: key/value heads of a grouped-query decoder (None: ``num_heads``).
    """

    dim: int
    num_heads: int
    depth: int = 12
    num_axes: int | None = None
    grid: tuple[int, ...] | None = None
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "num_heads", "depth", "num_axes", "num_kv_heads"):
            value = getattr(self, name)
            if value is None and name in ("num_axes", "num_kv_heads"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy / torch integers as Python ints
        if self.dim <= 0 or self.num_heads <= 0 or self.dim % self.num_heads:
            raise ValueError(
                f"dim must be a positive multiple of num_heads, got dim={self.dim}, num_heads={self.num_heads}"
            )
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.num_axes is not None and self.num_axes < 1:
            raise ValueError(f"num_axes (coordinate axes per token) must be an int >= 1, got {self.num_axes!r}")
        if self.grid is not None:
            grid = _sizes(self.grid, "grid")
            object.__setattr__(self, "grid", grid)  # a frozen dataclass normalising its own field
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be an int >= 1, got {self.num_kv_heads!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def with_axes(self, num_axes: int) -> "EncodingSpec":
        return replace(self, num_axes=num_axes)

    def facts(self) -> dict[str, Any]:
        """The fields other than ``dim`` / ``num_heads`` that are set, as ``build`` options."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("dim", "num_heads") and getattr(self, f.name) is not None}


def _sizes(value: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        sizes = tuple(value)
    except TypeError:
        raise ValueError(f"{what} must be a sequence of positive sizes, got {value!r}") from None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in sizes):
        raise ValueError(f"{what} must be positive int sizes, got {value!r}")
    return tuple(int(s) for s in sizes)


#: options of ``build`` that go into the spec rather than to the encoding's own constructor options
SPEC_FIELDS = ("depth", "num_axes", "grid", "num_kv_heads")
