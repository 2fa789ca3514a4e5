"""LookHere: per-head directional fields of view (2D attention masks) with a linear distance penalty."""

from __future__ import annotations

from typing import ClassVar, Literal, Sequence

import torch
from torch import Tensor

from .base import Context, Encoding
from .spec import EncodingSpec
from .functional.bias import clear_prefix
from .functional.lookhere import DIRECTION_GROUPS, default_directions, head_bias, head_layout
from .functional.lookhere import FIELD_PRIMITIVES, HALF_PLANE_BITS, MASKED_LOGIT, default_head_slopes
from .registry import register, register_preset

__all__ = ["LookHere", "HeadPairs", "DIRECTION_GROUPS", "default_directions", "head_layout"]

_FILLS = ("inf", "zero", "max")
_DISTANCES = ("linear", "sqrt", "square")


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
    ``(B, N)`` coordinate tables. Its faster forms (a lattice table, a per-head builder, an analytic flex
    ``score_mod`` and a ``block_mask`` of the fields of view) are registered in :mod:`vlpe.attention_forms.lookhere`.
    Distances are fp32. Presets: ``lh180``, ``lh90`` (the reference's released LH-90 config),
    ``lh45``.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "fp32_angles"})
    pieces = frozenset({"score"})
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
            head_slopes = default_head_slopes(head_names)
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
                bits |= FIELD_PRIMITIVES.get(d, 0)
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
            clear_prefix(out, ctx.pos.prefix, rows)
        return out

    def _pairs(self, ctx: Context, rows: slice, layer: int) -> "HeadPairs":
        proj = ctx["proj"]  # (4, B, N)
        return HeadPairs(self, proj[:, :, rows], proj, layer, ctx)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, head_directions={self.head_directions!r}, global_slope={self.global_slope}, "
            f"layer_slopes={self.layer_slopes}, distance={self.distance!r}, fill_with={self.fill_with!r}"
        )


class HeadPairs:
    """LookHere's bias between queries and keys given by their boundary-form projections, one head at a time.

    ``proj_q`` (4, B, n) and ``proj_k`` (4, B, N) hold ``x, y, x + y, x - y`` of the queries and keys (the
    query rows of ``ctx["proj"]`` and all of it in :meth:`LookHere.score`; a query at the origin and keys at
    every grid offset for the lattice table of :mod:`vlpe.attention_forms.lookhere`). The distance is computed
    once; the half-plane masks once each, on first use; the field-of-view mask and its fill of the most recent
    head group are kept.
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
        for bit, (form, positive) in HALF_PLANE_BITS.items():
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
                self.floor = torch.mul(self.hid, MASKED_LOGIT, out=out)
        hid, floor = self.hid, self.floor
        B, n, N = dist.shape
        s = self.factor * enc._slopes[h]
        kind = enc._kinds[h]
        d = dist
        if kind == "center":
            d = self.ctx["centre_dist"][:, None, :].expand(B, n, N)  # the key's distance to the centre
        max_dist = self.ctx["max_dist"][:, None, None] if enc.fill_with == "max" else None  # (B, 1, 1)
        head_bias(d, 0.0 if kind == "zero" else s, hid, enc.fill_with, max_dist, floor=floor, out=o)


# LH-90 is the reference's released config (global slope 2, layer slopes 1.5 -> 0.5, quadrants + 90-degree
# wedges + unmasked heads). The LH-180 / LH-45 strings live only inside the released checkpoints; by analogy
# with LH-90 (two 4-direction groups covering the 8 compass directions + 4 unmasked heads) they use the
# 180-degree groups (half-planes along the axes and along the diagonals) and the 45-degree groups (the eight
# octants) with the same slopes.
register_preset("lh90", "lookhere", head_directions="corners-triangles-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
register_preset("lh180", "lookhere", head_directions="halves-diagonals-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
register_preset("lh45", "lookhere", head_directions="eighths1-eighths2-none", global_slope=2.0, layer_slopes=(1.5, 0.5))
