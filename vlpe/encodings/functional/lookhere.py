"""LookHere's geometry and bias formula, free of any module state: fields of view and the per-head bias.

Field-of-view codes are bit sets of half-planes ``(dx, dy) = key - query`` must lie in (columns, rows; "up" is a
smaller row, every boundary inclusive); the primitives (halves, quadrants, 90-degree wedges, diagonal
half-planes) and the reference's direction groups of four heads are tables here. :func:`head_layout` deals the
heads of a config such as ``"corners-triangles-none"`` to its groups in blocks of four,
:func:`default_head_slopes` gives the reference's per-head slopes, :func:`axis_half_plane` names the axis
half-plane a field of view lies in (what the lattice fast path may skip), and :func:`head_bias` is the one formula
of a head's bias shared by the dense and the flex paths of :class:`vlpe.encodings.lookhere.LookHere`.
"""

from __future__ import annotations

from itertools import groupby

import torch
from torch import Tensor

__all__ = [
    "DIRECTION_GROUPS", "FIELD_PRIMITIVES", "HALF_PLANE_BITS", "MASKED_LOGIT", "default_directions", "head_layout",
    "default_head_slopes", "axis_half_plane", "head_bias",
]  # fmt: skip

# Half-planes a key may be required to lie in, as bits of a field-of-view code. (dx, dy) = key - query in
# (column, row) patch units; "up" is a smaller row index. Every boundary is inclusive.
_RIGHT, _LEFT, _DOWN, _UP = 1, 2, 4, 8  # dx >= 0, dx <= 0, dy >= 0, dy <= 0
_SUM_POS, _SUM_NEG, _DIF_POS, _DIF_NEG = 16, 32, 64, 128  # dx+dy >= 0, dx+dy <= 0, dx-dy >= 0, dx-dy <= 0
#: bit -> (form index into (x, y, x + y, x - y), True for ">= 0" / False for "<= 0")
HALF_PLANE_BITS = {
    _RIGHT: (0, True), _LEFT: (0, False), _DOWN: (1, True), _UP: (1, False),
    _SUM_POS: (2, True), _SUM_NEG: (2, False), _DIF_POS: (3, True), _DIF_NEG: (3, False),
}  # fmt: skip

#: Field-of-view primitives -> required half-plane bits (intersection). Wedges ("tri_*") are 90-degree
#: cones around an axis; "diag_*" are the *union* of two adjacent wedges, i.e. a half-plane bounded by a
#: diagonal (the reference intersects the two wedges' masked sets).
FIELD_PRIMITIVES = {
    "up": _UP,
    "down": _DOWN,
    "left": _LEFT,
    "right": _RIGHT,
    "tri_up": _SUM_NEG | _DIF_POS,  # |dx| <= -dy
    "tri_down": _SUM_POS | _DIF_NEG,  # |dx| <= dy
    "tri_left": _SUM_NEG | _DIF_NEG,  # dx <= -|dy|
    "tri_right": _SUM_POS | _DIF_POS,  # dx >= |dy|
    "diag_up_right": _DIF_POS,  # up wedge U right wedge: dx - dy >= 0
    "diag_up_left": _SUM_NEG,  # dx + dy <= 0
    "diag_down_right": _SUM_POS,  # dx + dy >= 0
    "diag_down_left": _DIF_NEG,  # dx - dy <= 0
}

#: Direction groups of four heads each (names and head order as in the reference ``dir_short_hand``).
#: "zero" heads get no bias; "center" heads are penalised by the key's distance to the image centre.
DIRECTION_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "none": ((),) * 4,
    "zero": (("zero",),) * 4,
    "none1zero3": ((),) + (("zero",),) * 3,
    "none2zero2": ((),) * 2 + (("zero",),) * 2,
    "none3zero1": ((),) * 3 + (("zero",),),
    "center": (("center",),) * 4,
    "halves": (("up",), ("down",), ("left",), ("right",)),
    "corners": (("up", "left"), ("up", "right"), ("down", "left"), ("down", "right")),
    "triangles": (("tri_up",), ("tri_down",), ("tri_left",), ("tri_right",)),
    "diagonals": (("diag_up_right",), ("diag_up_left",), ("diag_down_right",), ("diag_down_left",)),
    "eighths1": (("tri_up", "left"), ("tri_down", "left"), ("tri_left", "up"), ("tri_right", "up")),
    "eighths2": (("tri_up", "right"), ("tri_down", "right"), ("tri_left", "down"), ("tri_right", "down")),
    "zerohalves": tuple(("zero", d) for d in ("up", "down", "left", "right")),
    "zerocorners": tuple(("zero",) + c for c in (("up", "left"), ("up", "right"), ("down", "left"), ("down", "right"))),
    "zerotriangles": tuple(("zero", d) for d in ("tri_up", "tri_down", "tri_left", "tri_right")),
}
_UNDIRECTED = ("zero", "center", "none")  # groups whose name contains one of these get the undirected slopes
MASKED_LOGIT = -3.3895313892515355e38  # bfloat16's lowest finite value: masked logits stay finite in fp32 and bf16


def _group_sizes(num_heads: int, groups: int, config: str) -> list[int]:
    """Heads per group: blocks of four heads (one per direction) dealt round-robin from the first group,
    a last partial block to the next group in turn (the reference's 12 = 8 + 4, 16 = 8 + 4 + 4, 6 = 4 + 2)."""
    sizes = [0] * groups
    left, g = num_heads, 0
    while left:
        take = min(4, left)
        sizes[g % groups] += take
        left -= take
        g += 1
    if min(sizes) == 0:
        raise ValueError(
            f"LookHere head_directions {config!r} has {groups} direction groups but num_heads={num_heads}: heads "
            f"are dealt in blocks of 4, so {groups} groups need at least {4 * (groups - 1) + 1} heads "
            f"(e.g. 12 heads for 3 groups); use fewer groups or more heads"
        )
    return sizes


def default_directions(num_heads: int) -> str:
    """LH-90's layout for ``num_heads``: ``"corners-triangles-none"`` from 9 heads on (12 heads: 4 + 4 + 4),
    ``"corners-none"`` for 5-8 heads (6 heads: 4 + 2, the reference's 6-head split), ``"corners"`` below."""
    if num_heads >= 9:
        return "corners-triangles-none"
    return "corners-none" if num_heads >= 5 else "corners"


def head_layout(config: str, num_heads: int) -> tuple[list[str], list[tuple[str, ...]]]:
    """``(group name, direction primitives)`` of each head for a config such as ``"corners-triangles-none"``."""
    if not isinstance(config, str) or not config:
        raise ValueError(f"head_directions must be a string like 'corners-triangles-none', got {config!r}")
    names = config.split("-")
    unknown = [n for n in names if n not in DIRECTION_GROUPS]
    if unknown:
        raise ValueError(
            f"unknown LookHere direction group(s) {unknown} in {config!r}; groups are {sorted(DIRECTION_GROUPS)} "
            f"joined by '-'"
        )
    head_names: list[str] = []
    head_dirs: list[tuple[str, ...]] = []
    for name, size in zip(names, _group_sizes(num_heads, len(names), config)):
        head_names += [name] * size
        head_dirs += [DIRECTION_GROUPS[name][i % 4] for i in range(size)]
    return head_names, head_dirs


def default_head_slopes(head_names: list[str]) -> list[float]:
    """Per-head slopes by runs of equal group names: directed runs ``2^-(1 + k // 4)`` (1/2 for the first
    four heads, 1/4 for the next four, ...); undirected runs ``1/4, 1/16, 1/64, 1/256`` (each repeated
    ``n / 4`` times for runs of n > 4 heads)."""
    slopes: list[float] = []
    for name, run in groupby(head_names):
        n = len(list(run))
        if any(u in name for u in _UNDIRECTED):
            slopes += [4.0 ** -(1 + (k if n <= 4 else 4 * k // n)) for k in range(n)]
        else:
            slopes += [2.0 ** -(1 + k // 4) for k in range(n)]
    return slopes


def axis_half_plane(bits: int) -> str | None:
    """The axis half-plane (:data:`vlpe.encodings.HALF_PLANES`) a field of view with these required bits lies in,
    if any: its own bit, or the two diagonal bounds that imply it (a wedge ``|dx| <= -dy`` lies in ``dy <= 0``)."""
    implied = {
        "up": (_UP, _SUM_NEG | _DIF_POS), "down": (_DOWN, _SUM_POS | _DIF_NEG),
        "left": (_LEFT, _SUM_NEG | _DIF_NEG), "right": (_RIGHT, _SUM_POS | _DIF_POS),
    }  # fmt: skip
    for name, (bit, wedge) in implied.items():
        if bits & bit or bits & wedge == wedge:
            return name
    return None


def head_bias(d: Tensor, slope, hidden: Tensor | None, fill_with: str, max_dist: Tensor | None = None, *,
              floor: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """LookHere's bias of one head: the one formula of the dense path (:class:`vlpe.encodings.lookhere.HeadPairs`)
    and the flex path.

    ``slope * d`` for a key inside the field of view (``d`` the penalised distance, or the key's distance to
    the image centre for "center" heads; ``slope`` <= 0, 0 for "zero" heads); for a key outside it (``hidden``
    True): the finite ``-3.39e38`` (``fill_with='inf'``; it absorbs the penalty exactly, so the formula is
    ``slope * d + floor`` with ``floor = hidden * -3.39e38``), 0 (``'zero'``) or ``slope * max_dist`` (``'max'``,
    the grid diagonal penalised like a visible key). ``hidden`` None: every key is visible.

    Out of place when ``out`` is None (traced by ``torch.compile`` in flex's ``score_mod``); else written into
    ``out`` with the same values (``floor``: the cached ``hidden * -3.39e38`` of the head's field of view).
    """
    if out is None:
        bias = d * slope
        if hidden is None:
            return bias
        if fill_with == "inf":
            return bias + torch.where(hidden, MASKED_LOGIT, 0.0)
        return torch.where(hidden, 0.0 if fill_with == "zero" else slope * max_dist, bias)
    if hidden is not None and fill_with == "inf":
        if floor is None:
            floor = torch.mul(hidden, MASKED_LOGIT)
        if slope == 0:
            return out.copy_(floor)
        return torch.add(floor, d, alpha=slope, out=out)  # floor + slope * d
    if slope == 0:
        out.zero_()
    else:
        torch.mul(d, slope, out=out)
    if hidden is None:
        return out
    if fill_with == "zero" or slope == 0:
        return out.masked_fill_(hidden, 0.0)
    return out.copy_(torch.where(hidden, max_dist * slope, out))
