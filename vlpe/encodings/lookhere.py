"""LookHere: per-head directional fields of view (2D attention masks) with a linear distance penalty."""

from __future__ import annotations

from itertools import groupby
from typing import ClassVar, Literal, Sequence

import torch
from torch import Tensor

from .base import Context, Encoding, LatticeBias
from .spec import EncodingSpec
from .functional.bias import lattice_offsets
from .registry import register, register_preset

__all__ = ["LookHere", "DIRECTION_GROUPS", "default_directions", "head_layout"]

# Half-planes a key may be required to lie in, as bits of a field-of-view code. (dx, dy) = key - query in
# (column, row) patch units; "up" is a smaller row index. Every boundary is inclusive.
_RIGHT, _LEFT, _DOWN, _UP = 1, 2, 4, 8  # dx >= 0, dx <= 0, dy >= 0, dy <= 0
_SUM_POS, _SUM_NEG, _DIF_POS, _DIF_NEG = 16, 32, 64, 128  # dx+dy >= 0, dx+dy <= 0, dx-dy >= 0, dx-dy <= 0
#: bit -> (form index into (x, y, x + y, x - y), True for ">= 0" / False for "<= 0")
_HALF_PLANES = {
    _RIGHT: (0, True), _LEFT: (0, False), _DOWN: (1, True), _UP: (1, False),
    _SUM_POS: (2, True), _SUM_NEG: (2, False), _DIF_POS: (3, True), _DIF_NEG: (3, False),
}  # fmt: skip

#: Field-of-view primitives -> required half-plane bits (intersection). Wedges ("tri_*") are 90-degree
#: cones around an axis; "diag_*" are the *union* of two adjacent wedges, i.e. a half-plane bounded by a
#: diagonal (the reference intersects the two wedges' masked sets).
_PRIMITIVES = {
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
_MASKED = -3.3895313892515355e38  # bfloat16's lowest finite value: masked logits stay finite in fp32 and bf16
_FILLS = ("inf", "zero", "max")
_DISTANCES = ("linear", "sqrt", "square")


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


def _default_head_slopes(head_names: list[str]) -> list[float]:
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


@register("lookhere")
class LookHere(Encoding):
    """LookHere (Fuller, Kyrollos, Yassin, Green, "LookHere: Vision Transformers with Directed Attention
    Generalize and Extrapolate", NeurIPS 2024), re-derived from and checked against GreenCUBIC/lookhere
    ``lookhere.py`` (``create_lh_bias_tensor`` / ``create_lh_layer_tensor``).

    Head h of layer l sees key j from query i only inside its field of view (a direction group of
    ``head_directions``, e.g. quadrants and 90-degree wedges for ``"corners-triangles-none"``), with bias
    ``-global_slope * layer_slope_l * head_slope_h * D(i, j)`` there (D the Euclidean patch distance) and a
    finite ``-3.39e38`` (``fill_with='inf'``) elsewhere; layer slopes run linearly from ``layer_slopes[0]``
    to ``layer_slopes[1]``. Prefix tokens are unmasked and unpenalised both ways. No parameters.
    ``head_directions=None`` picks LH-90's groups that fit the head count (``default_directions``); heads are
    dealt to groups in blocks of four as in the reference (12 heads and 2 groups: 8 + 4). Masks do not depend
    on the slopes (the reference's ``0 * inf`` turns a zero slope into no mask; here ``global_slope=0`` keeps
    the fields of view and drops only the distance penalty).

    Unlike the reference, which stores ``depth x heads x N x N`` bias maps, the bias is computed per layer
    and per query chunk from the coordinates (``score`` honours ``rows``); the per-forward context holds only
    ``(B, N)`` coordinate tables. ``flex`` returns an analytic ``score_mod`` and a ``block_mask`` of the
    fields of view. Distances are fp32. Presets: ``lh180``, ``lh90`` (the reference's released LH-90 config),
    ``lh45``.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "fp32_angles"})
    pieces = frozenset({"score", "score_heads", "lattice_bias", "flex"})
    supported_axes = (2,)
    #: the example (property kit, demo, benchmarks) has 4 heads: one 4-head group (also for the 12-head presets)
    example: ClassVar[dict] = {"head_directions": "corners"}

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        head_directions: str | None = None,
        global_slope: float = 2.0,
        layer_slopes: Sequence[float] = (1.5, 0.5),
        head_slopes: Sequence[float] | None = None,
        distance: Literal["linear", "sqrt", "square"] = "linear",
        fill_with: Literal["inf", "zero", "max"] = "inf",
    ) -> None:
        num_heads = spec.num_heads
        super().__init__(spec=spec)
        if fill_with not in _FILLS:
            raise ValueError(
                f"fill_with must be one of {_FILLS} (masked logits: -3.39e38, 0, the largest distance penalty), "
                f"got {fill_with!r}"
            )
        if distance not in _DISTANCES:
            raise ValueError(f"distance must be one of {_DISTANCES}, got {distance!r}")
        layer_slopes = tuple(float(s) for s in layer_slopes)
        if len(layer_slopes) != 2:
            raise ValueError(f"layer_slopes must be (first layer, last layer), got {layer_slopes}")
        if head_directions is None:
            head_directions = default_directions(num_heads)
        head_names, head_dirs = head_layout(head_directions, num_heads)
        if head_slopes is None:
            head_slopes = _default_head_slopes(head_names)
        head_slopes = [float(s) for s in head_slopes]
        if len(head_slopes) != num_heads:
            raise ValueError(f"head_slopes must give one slope per head ({num_heads}), got {len(head_slopes)}")
        self.head_directions, self.distance, self.fill_with = head_directions, distance, fill_with
        self.global_slope, self.layer_slopes = float(global_slope), layer_slopes
        self.head_names, self.head_dirs = head_names, head_dirs
        required, zero, center = [], [], []
        for dirs in head_dirs:
            bits = 0
            for d in dirs:
                bits |= _PRIMITIVES.get(d, 0)
            required.append(bits)
            zero.append("zero" in dirs)
            center.append("center" in dirs)
        self.has_center = any(center)
        self._slopes = head_slopes  # Python floats: no device round trip in the hot path
        self._kinds = ["zero" if z else "center" if c else "distance" for z, c in zip(zero, center)]
        groups: dict[int, list[int]] = {}
        for h, bits in enumerate(required):
            groups.setdefault(bits, []).append(h)
        self._fov_groups = list(groups.items())  # (required half-plane bits, heads with that field of view)
        self._required = required  # (H,) required half-plane bits per head
        self._group_of = {h: g for g, (_, heads) in enumerate(self._fov_groups) for h in heads}
        self.register_buffer("required", torch.tensor(required, dtype=torch.uint8), persistent=False)  # (H,)
        self.register_buffer("head_slopes", torch.tensor(head_slopes, dtype=torch.float32), persistent=False)
        self.register_buffer("is_zero", torch.tensor(zero), persistent=False)  # (H,) no bias at all
        self.register_buffer("is_center", torch.tensor(center), persistent=False)  # (H,) distance to the centre


    # ------------------------------------------------------------------ slopes
    def layer_slope(self, layer: int) -> float:
        """``linspace(layer_slopes[0], layer_slopes[1], depth)[layer]``."""
        self.check_layer(layer)
        s0, s1 = self.layer_slopes
        return s0 if self.depth == 1 else s0 + (s1 - s0) * layer / (self.depth - 1)

    def slopes(self, layer: int) -> Tensor:
        """Effective per-patch penalty of every head at ``layer``, ``(H,)`` fp32 (0 for "zero" heads)."""
        s = self.head_slopes * (self.global_slope * self.layer_slope(layer))
        return s.masked_fill(self.is_zero, 0.0)

    def _dist(self, d2: Tensor) -> Tensor:
        """The penalised distance from squared distances ``d2``, in place (``d2`` is consumed)."""
        if self.distance == "linear":
            return d2.sqrt_()
        if self.distance == "sqrt":
            return d2.sqrt_().sqrt_()
        return d2

    # ------------------------------------------------------------------ per forward
    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        with torch.autocast(pos.device.type, enabled=False):
            coords = pos.coords if pos.coords.dtype == torch.float64 else pos.coords.float()  # (B, N, 2)
            y, x = coords[..., 0], coords[..., 1]  # (B, N) rows, columns
            ctx["proj"] = torch.stack([x, y, x + y, x - y])  # (4, B, N): the four half-plane boundary forms
            if self.has_center or self.fill_with == "max":
                patch = coords[:, pos.prefix :]  # (B, n, 2)
                valid = None if pos.valid is None else pos.valid[:, pos.prefix :, None]
                lo = patch if valid is None else patch.masked_fill(~valid, float("inf"))
                hi = patch if valid is None else patch.masked_fill(~valid, float("-inf"))
                lo, hi = lo.amin(1), hi.amax(1)  # (B, 2) bounding box of the patches
                if self.has_center:
                    centre = (lo + hi) / 2  # (B, 2)
                    d2 = (coords - centre[:, None]).square().sum(-1)  # (B, N)
                    ctx["centre_dist"] = self._dist(d2)
                if self.fill_with == "max":
                    ctx["max_dist"] = self._dist((hi - lo).square().sum(-1))  # (B,) the grid diagonal

    # ------------------------------------------------------------------ dense path
    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor:
        """The ``(B, H, n, N)`` bias of the query ``rows``, written head by head into one tensor.

        Beside the result only ``(B, n, N)`` temporaries exist: the distance, one bool mask per half-plane
        and per field of view (compared from per-token projections, no offset tensors), one fill buffer.
        """
        rows = slice(None) if rows is None else rows
        with torch.autocast(q.device.type, enabled=False):
            pairs = self._pairs(ctx, rows, layer)
            out = pairs.dist.new_empty(pairs.dist.shape[0], self.num_heads, *pairs.dist.shape[1:])  # (B, H, n, N)
            for h in range(self.num_heads):
                pairs.fill(h, out[:, h])
            self._clear_prefix(out, ctx.pos.prefix, rows, out.shape[-2])
        return out

    def score_heads(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
        """Per-head bias of the query ``rows``: the distance and half-plane masks once, then each head as in
        :meth:`score` (the same operations, so the same values)."""
        with torch.autocast(q.device.type, enabled=False):
            pairs = self._pairs(ctx, rows, layer)

        def bias(heads: slice) -> Tensor:
            B, n, N = pairs.dist.shape
            chosen = range(self.num_heads)[heads]
            with torch.autocast(q.device.type, enabled=False):
                out = pairs.dist.new_empty(B, len(chosen), n, N)  # (B, h, n, N)
                for i, h in enumerate(chosen):
                    pairs.fill(h, out[:, i])
                self._clear_prefix(out, ctx.pos.prefix, rows, n)
            return out

        return bias

    def lattice_bias(self, ctx: Context, layer: int) -> LatticeBias | None:
        """The offset table of lattice positions (not with "center" heads, whose bias reads the key's absolute
        position): the bias of keys at every offset seen from a query at the origin, by the code of
        :meth:`score`. With ``fill_with='inf'`` every head whose field of view lies in an axis half-plane
        (quadrants, wedges, halves) lets the attention skip the keys outside it."""
        pos = ctx.pos
        if self.has_center or not pos.lattice or pos.grid is None or len(pos.grid) != 2:
            return None
        h, w = pos.grid
        with torch.autocast(pos.device.type, enabled=False):
            off = lattice_offsets(h, w, pos.device).to(ctx["proj"].dtype)  # (1, M, 2): (dy, dx)
            y, x = off[..., 0], off[..., 1]  # (1, M)
            keys = torch.stack([x, y, x + y, x - y])  # (4, 1, M)
            pairs = _Pairs(self, keys.new_zeros(4, 1, 1), keys, layer, ctx)
            table = pairs.dist.new_empty(self.num_heads, 1, keys.shape[-1])  # (H, 1, M)
            for head in range(self.num_heads):
                pairs.fill(head, table[head : head + 1])
        planes = tuple(_half_plane(bits) if self.fill_with == "inf" else None for bits in self._required)
        return LatticeBias(table.reshape(self.num_heads, 2 * h - 1, 2 * w - 1), planes)

    def _pairs(self, ctx: Context, rows: slice, layer: int) -> "_Pairs":
        proj = ctx["proj"]  # (4, B, N)
        return _Pairs(self, proj[:, :, rows], proj, layer, ctx)

    @staticmethod
    def _clear_prefix(bias: Tensor, prefix: int, rows: slice, n: int) -> None:
        """Zero the bias of prefix keys and of prefix query rows (``rows`` is a step-1 slice of queries)."""
        if not prefix:
            return
        bias[..., :prefix] = 0.0
        start = rows.start or 0
        if start < prefix:
            bias[..., : min(prefix - start, n), :] = 0.0

    # ------------------------------------------------------------------ flex path
    def flex(self, q: Tensor, k: Tensor, ctx: Context, layer: int):
        """Analytic ``score_mod`` (distance penalty from the captured ``(B, N)`` coordinates) and, for
        ``fill_with='inf'``, a ``block_mask`` of the fields of view; nothing N x N is kept."""
        from torch.nn.attention.flex_attention import create_block_mask

        proj = ctx["proj"]  # (4, B, N): x, y, x + y, x - y
        x, y = proj[0], proj[1]
        per_sample = proj.shape[1] > 1
        slopes = -self.slopes(layer).to(proj.dtype)  # (H,)
        bits = torch.tensor(list(_HALF_PLANES), dtype=torch.uint8, device=proj.device)
        req = (self.required[:, None] & bits) != 0  # (H, 8) which half-planes each head needs
        is_center = self.is_center
        centre = ctx["centre_dist"] if self.has_center else None
        fill = ctx["max_dist"] if self.fill_with == "max" else None
        prefix, mode, distance = ctx.pos.prefix, self.fill_with, self.distance

        def dist(d2):  # out of place: traced by torch.compile
            return d2 if distance == "square" else d2.sqrt() if distance == "linear" else d2.sqrt().sqrt()

        def offsets(b, q_idx, kv_idx):
            bb = b if per_sample else 0
            return x[bb, kv_idx] - x[bb, q_idx], y[bb, kv_idx] - y[bb, q_idx]

        def visible(b, h, q_idx, kv_idx):
            bb = b if per_sample else 0
            seen = (q_idx < prefix) | (kv_idx < prefix)
            inside = None
            for c, (form, positive) in enumerate(_HALF_PLANES.values()):
                pk, pq = proj[form, bb, kv_idx], proj[form, bb, q_idx]
                ok = (pk >= pq if positive else pk <= pq) | ~req[h, c]
                inside = ok if inside is None else inside & ok
            return seen | inside

        def score_mod(score, b, h, q_idx, kv_idx):
            dx, dy = offsets(b, q_idx, kv_idx)
            d = dist(dx * dx + dy * dy)
            if centre is not None:
                d = torch.where(is_center[h], centre[b if per_sample else 0, kv_idx], d)
            # fill 'inf': the block_mask drops hidden keys, so the formula sees visible keys only
            hidden = None if mode == "inf" else ~visible(b, h, q_idx, kv_idx)
            bias = head_bias(d, slopes[h], hidden, mode, fill[b if per_sample else 0] if mode == "max" else None)
            if prefix:
                bias = torch.where((q_idx < prefix) | (kv_idx < prefix), torch.zeros_like(bias), bias)
            return score + bias.to(score.dtype)

        if mode != "inf":
            return score_mod, None
        B = q.shape[0] if per_sample else None
        block_mask = create_block_mask(visible, B, q.shape[1], q.shape[-2], k.shape[-2], device=q.device)
        return score_mod, block_mask

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, head_directions={self.head_directions!r}, global_slope={self.global_slope}, "
            f"layer_slopes={self.layer_slopes}, distance={self.distance!r}, fill_with={self.fill_with!r}"
        )


def _half_plane(bits: int) -> str | None:
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


class _Pairs:
    """LookHere's bias between queries and keys given by their boundary-form projections, one head at a time.

    ``proj_q`` (4, B, n) and ``proj_k`` (4, B, N) hold ``x, y, x + y, x - y`` of the queries and keys (the
    query rows of ``ctx["proj"]`` and all of it in :meth:`LookHere.score`; a query at the origin and keys at
    every grid offset for :meth:`LookHere.lattice_bias`). The distance is computed once; the half-plane masks
    once each, on first use; the field-of-view mask and its fill of the most recent head group are kept.
    """

    def __init__(self, enc: "LookHere", proj_q: Tensor, proj_k: Tensor, layer: int, ctx: Context) -> None:
        self.enc, self.proj_q, self.proj_k, self.ctx = enc, proj_q, proj_k, ctx
        x, y = proj_k[0], proj_k[1]  # (B, N)
        d2 = (x[:, None, :] - proj_q[0][:, :, None]).square_()  # (B, n, N)
        d2.addcmul_(dy := y[:, None, :] - proj_q[1][:, :, None], dy)
        del dy
        self.dist = enc._dist(d2)  # (B, n, N)
        self.factor = -enc.global_slope * enc.layer_slope(layer)
        self.outside: dict[int, Tensor] = {}  # half-plane bit -> (B, n, N) "key outside it"
        self.group: int | None = None  # the head group whose mask and fill are kept
        self.hid: Tensor | None = None
        self.floor: Tensor | None = None  # fill 'inf': (B, n, N) of 0 / -3.39e38

    def _hidden(self, req: int) -> Tensor | None:
        """``(B, n, N)`` True where the key lies outside the field of view ``req`` (None: sees everything).

        Half-plane ``f(key - query) >= 0`` of a linear form f is ``f(key) >= f(query)``: a comparison of the
        projections, so no offset tensor is built.
        """
        hidden, owned = None, False
        for bit, (form, positive) in _HALF_PLANES.items():
            if not req & bit:
                continue
            if bit not in self.outside:
                pk, pq = self.proj_k[form], self.proj_q[form]  # (B, N), (B, n)
                self.outside[bit] = (torch.lt if positive else torch.gt)(pk[:, None, :], pq[:, :, None])
            if hidden is None:
                hidden = self.outside[bit]
            elif owned:
                hidden |= self.outside[bit]
            else:  # never modify a cached half-plane mask in place
                hidden, owned = hidden | self.outside[bit], True
        return hidden

    def fill(self, h: int, o: Tensor) -> None:
        """Write head ``h``'s bias into ``o`` (B, n, N) (prefix tokens not cleared here)."""
        enc, dist = self.enc, self.dist
        g = enc._group_of[h]
        if g != self.group:
            self.group, self.hid = g, self._hidden(enc._fov_groups[g][0])
            if self.hid is not None and enc.fill_with == "inf":
                out = dist.new_empty(dist.shape) if self.floor is None else self.floor
                self.floor = torch.mul(self.hid, _MASKED, out=out)
        hid, floor = self.hid, self.floor
        B, n, N = dist.shape
        s = self.factor * enc._slopes[h]
        kind = enc._kinds[h]
        d = dist
        if kind == "center":
            d = self.ctx["centre_dist"][:, None, :].expand(B, n, N)  # the key's distance to the centre
        max_dist = self.ctx["max_dist"][:, None, None] if enc.fill_with == "max" else None  # (B, 1, 1)
        head_bias(d, 0.0 if kind == "zero" else s, hid, enc.fill_with, max_dist, floor=floor, out=o)


def head_bias(d: Tensor, slope, hidden: Tensor | None, fill_with: str, max_dist: Tensor | None = None, *,
              floor: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """LookHere's bias of one head: the one formula of the dense path (:class:`_Pairs`) and the flex path.

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
            return bias + torch.where(hidden, _MASKED, 0.0)
        return torch.where(hidden, 0.0 if fill_with == "zero" else slope * max_dist, bias)
    if hidden is not None and fill_with == "inf":
        if floor is None:
            floor = torch.mul(hidden, _MASKED)
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


# LH-90 is the reference's released config (global slope 2, layer slopes 1.5 -> 0.5, quadrants + 90-degree
# wedges + unmasked heads). The LH-180 / LH-45 strings live only inside the released checkpoints; by analogy
# with LH-90 (two 4-direction groups covering the 8 compass directions + 4 unmasked heads) they use the
# 180-degree groups (half-planes along the axes and along the diagonals) and the 45-degree groups (the eight
# octants) with the same slopes.
register_preset("lh90", "lookhere", head_directions="corners-triangles-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
register_preset("lh180", "lookhere", head_directions="halves-diagonals-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
register_preset("lh45", "lookhere", head_directions="eighths1-eighths2-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
