"""Position designs: token layout -> ``position_ids (A, B, S)`` and ``rope_deltas (B, 1)``.

A design places the tokens of every vision *unit* (a grid row, or one frame for per-frame designs) relative
to the running text position ``s`` at which the unit starts, and says how far the running position advances
past the unit. Text tokens always advance by one and carry the running position on every axis, so text-only
input is plain 1D RoPE for every design. The assembly (:func:`assemble`) is one exclusive ``cumsum`` of
per-token increments, shared by all designs; nothing loops over tokens or blocks.

Designs (the method and the released code each one follows):

==================  ====  =====================================================================================
name                A     vision token coordinates, unit start ``s``; next text position
==================  ====  =====================================================================================
``1d``              1     ``s + raster index``; ``s + T*H*W`` (vanilla RoPE)
``grid``            3     ``(s + stride*tau, s + i, s + j)``; ``s + max(stride*(T-1), H-1, W-1) + 1``
                          (Qwen2-VL released code: the maximum over all axes + 1); ``spatial_reset=True`` puts
                          ``h, w`` at local ``(i, j)`` and keeps the next position (Huang et al. 2025)
``absolute_time``   3     ``grid`` with ``t = s + floor(tau * second_per_grid_t * tokens_per_second)`` for videos
                          (Qwen2.5-VL)
``per_frame``       3     ``grid`` with every video frame its own ``T = 1`` block (Qwen3-VL; frames are separated
                          by timestamp text in the token sequence)
``scaled_frames``   3     ``per_frame`` with every axis scaled, ``(s + st*tau, s + sh*i, s + sw*j)``;
                          ``s + max(st*(T-1), sh*(H-1), sw*(W-1)) + 1`` (MM-RoPE of Lumos-1: ``position_scale``
                          ``(st / temporal_stride, sh, sw)``, the latent-to-pixel compression)
``circle``          3     per frame, the centred grid ``(j - (W-1)/2, i - (H-1)/2)`` mapped onto a circle of radius
                          ``r`` (angle ``alpha`` x its normalised polar angle + ``(1 - alpha)`` x its raster share of
                          2 pi) in the plane orthogonal to the text diagonal ``(1, 1, 1)``, ``s`` added on every
                          axis; ``s + max(ids - s) + 1`` (Circle-RoPE, radius 10, alpha 0.5)
``diagonal``        3     ``t' = s + g*tau``, ``(t', t' + i - (H-1)//2, t' + j - (W-1)//2)``; ``s + g*(T-1) + 1``
                          (VideoRoPE, g = delta = 2; HoPE, g = gamma fixed or drawn per block in training)
``vrope``           4     ``s + tau*(H+W-1) + u_r`` with the four diagonals ``u_r``; ``s + T*(H+W-1)`` (VRoPE)
``v2pe``            1     ``s - 1 + delta*(m+1)``, ``delta = stride/256``; ``s + ceil(delta*N)`` (V2PE)
``pype``            L     per layer ``l``: ``s + tau*(M_l+1) + min(ring, M_l)``; ``s + T*(M_l+1)`` (PyPE)
==================  ====  =====================================================================================
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .layout import Check, TokenLayout

__all__ = ["Design", "DesignOut", "DESIGNS", "get_design", "assemble", "V2PE_STRIDES", "HOPE_SCALES"]

#: V2PE's training strides (``v2pe_rnd``): delta = stride / 256, drawn independently for each image.
V2PE_STRIDES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: HoPE's dynamic temporal scaling set (gamma drawn per visual block during training).
HOPE_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5)


@dataclass
class DesignOut:
    """What a design returns for the vision tokens of a batch.

    Attributes:
        offsets: per axis, ``(B, S)`` coordinates of vision tokens relative to their unit start (absolute on
            axes that are not ``anchored``), as a sequence of A tensors or one ``(A, B, S)`` tensor; ignored
            for text tokens.
        advance: ``(1 or A, R)`` running-position advance past one unit of each grid row (a frame for
            per-frame designs).
        anchored: per axis, whether the unit start is added to ``offsets``.
        floating: the design produces fractional positions (float output).
        text_zero: ``offsets`` are 0 on text tokens (built from the layout's ``tau, i, j, index``), so
            anchored axes need no select.
    """

    offsets: Sequence[Tensor] | Tensor
    advance: Tensor
    anchored: tuple[bool, ...]
    floating: bool
    text_zero: bool = False


@dataclass(frozen=True, kw_only=True)
class Design:
    """One position design as data: its function and the facts callers read instead of comparing names.

    The methods and the released code each design follows are the table above; tests/test_mm_position_ids.py pins
    every design's ids against that code, tests/test_mm_designs_facts.py checks the facts against the ids.

    Attributes:
        name: the design's name (its key in :data:`DESIGNS`).
        fn: ``(layout, options) -> DesignOut``.
        defaults: every option the design takes, with its default.
        summary: one line on the method.
        axes: the number of position axes A (rows of ``position_ids``), or the name of the option that sets it
            (PyPE: ``"depth"``, one axis per decoder layer).
        split_frames: every video frame is its own ``T = 1`` block.
        layered: every axis is one decoder layer's 1D position (PyPE): layer ``l`` rotates with plain 1D RoPE at
            axis ``l``, so it pairs only with a one-axis allocation and ``rope_deltas`` are ``(B, A)``.
        needs_mask: the design brings its own attention mask, built from its ids (PyPE's ring mask,
            :func:`vlpe.encodings.multimodal.pype_attention_mask`), which replaces the causal mask.
    """

    name: str
    fn: Callable[[TokenLayout, dict[str, Any]], DesignOut]
    defaults: dict[str, Any]
    summary: str
    axes: int | str = 3
    split_frames: bool = False
    layered: bool = False
    needs_mask: bool = False

    def options(self, given: dict[str, Any]) -> dict[str, Any]:
        """The design's options: its defaults with the ``given`` ones merged over them, each given one checked.

        Args:
            given: option values by name (from a call, a :class:`Variant`, or a record of one).

        Returns:
            Every option the design takes, by name.

        Raises:
            ValueError: an option the design does not take, or a value of the wrong kind: a number that is not
                finite, not positive or above :data:`OPTION_LIMIT`, a bool or a string where a number is expected,
                a flag that is not a bool, a count that is not an integer in ``1 .. COUNT_LIMIT``, an unknown
                ``mode``, or ``second_per_grid_ts`` entries that are not finite numbers ``>= 0``.
        """
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"position design {self.name!r} does not take option(s) {unknown}; it takes: "
                f"{', '.join(sorted(self.defaults)) or 'no options'} (plus attention_mask, spatial_merge_size, "
                "pad_position, dtype, validate)"
            )
        for name, value in given.items():
            problem = _OPTION_RULES[name](value)
            if problem is not None:
                raise ValueError(f"{self.name} design: {name} {problem}, got {value!r}")
        return {**self.defaults, **given}

    def num_axes(self, given: dict[str, Any]) -> int:
        """The number of position axes A; the ``given`` options are read (and checked) only when one sets it."""
        return self.axes if isinstance(self.axes, int) else int(self.options(given)[self.axes])


#: the largest value of a numeric design option (strides, scales, rates): one of them times a position of a batch
#: of up to 2**31 tokens stays below 2**53, exact in float64 and far inside int64
OPTION_LIMIT = 2**20
#: the largest count option (PyPE's ``depth`` and ``interval``, in decoder layers)
COUNT_LIMIT = 4096


def _real(value: Any) -> bool:
    """A real number that is not a bool (bools are ints in Python, but never a stride or a scale)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_number(value: Any) -> str | None:
    """None if ``value`` is a finite number in ``(0, OPTION_LIMIT]``, else what is expected."""
    if _real(value) and math.isfinite(value) and 0 < value <= OPTION_LIMIT:
        return None
    return f"must be a positive number no larger than {OPTION_LIMIT} (an int or a float, not a bool or a string)"


def _positive_numbers(item: str) -> Callable[[Any], str | None]:
    """The rule of a list option (None, or a list or tuple of numbers each passing :func:`_positive_number`),
    whose entries the message calls ``item``."""

    def check(value: Any) -> str | None:
        if value is None or (isinstance(value, (list, tuple)) and all(_positive_number(v) is None for v in value)):
            return None
        return (f"must be None or a list of positive numbers no larger than {OPTION_LIMIT}: every {item} must be a "
                "positive number")
    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def _count(value: Any) -> str | None:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= value <= COUNT_LIMIT:
        return None
    return f"must be an integer from 1 to {COUNT_LIMIT}"


def _mode(value: Any) -> str | None:
    ok = isinstance(value, str) and value in ("fix", "rnd", "default")
    return None if ok else "must be 'fix', 'rnd' or 'default'"


def _unit_interval(value: Any) -> str | None:
    return None if _real(value) and 0 <= value <= 1 else "must be a number from 0 to 1"


def _three_scales(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(_positive_number(v) is None for v in value)
    return None if ok else (f"must be three positive numbers (t, h, w) no larger than {OPTION_LIMIT}, e.g. "
                            "(4, 8, 8) for a video latent compressed 4x in time and 8x in space")


def _generator(value: Any) -> str | None:
    return None if value is None or isinstance(value, torch.Generator) else "must be a torch.Generator or None"


def _seconds(value: Any) -> str | None:
    """``second_per_grid_ts``: None, a tensor of a real dtype (its values are checked with the batch, with
    ``validate``), or numbers (one, or a list or tuple of them), each finite and in ``[0, OPTION_LIMIT]``."""
    expected = (f"must be None, a real tensor, or numbers from 0 to {OPTION_LIMIT} (seconds per temporal patch, "
                "one per video)")
    if value is None:
        return None
    if isinstance(value, Tensor):
        return None if not (value.dtype == torch.bool or value.is_complex()) else expected
    values = value if isinstance(value, (list, tuple)) else [value]
    ok = all(_real(v) and math.isfinite(v) and 0 <= v <= OPTION_LIMIT for v in values)
    return None if ok else expected


#: the check of every design option, by name: None if the value is fine, else what is expected
_OPTION_RULES: dict[str, Callable[[Any], str | None]] = {
    "temporal_stride": _positive_number,
    "tokens_per_second": _positive_number,
    "temporal_scale": _positive_number,
    "stride": _positive_number,
    "tile_tokens": _positive_number,
    "temporal_scales": _positive_numbers("temporal scale"),
    "strides": _positive_numbers("stride"),
    "spatial_reset": _flag,
    "position_scale": _three_scales,
    "radius": _positive_number,
    "alpha": _unit_interval,
    "training": _flag,
    "depth": _count,
    "interval": _count,
    "mode": _mode,
    "generator": _generator,
    "second_per_grid_ts": _seconds,
}


def _integral(x: float) -> bool:
    return float(x).is_integer()


def _per_row_choice(values: Sequence[float], L: TokenLayout, generator: torch.Generator | None) -> Tensor:
    """One value per grid row drawn uniformly from ``values`` (float64, on the layout's device)."""
    table = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dev = generator.device if generator is not None else L.device
    idx = torch.randint(len(values), (L.num_rows,), generator=generator, device=dev)
    return table.to(L.device)[idx.to(L.device)]


def _unit(L: TokenLayout) -> tuple[Tensor, Tensor, Tensor]:
    """``(T, H, W)`` of one unit per row, ``(R,)`` each."""
    return L.unit_grid.unbind(-1)


# --------------------------------------------------------------------------- designs
def _one_d(L: TokenLayout, o: dict) -> DesignOut:
    T, H, W = _unit(L)
    return DesignOut(L.index.unsqueeze(0), (T * H * W).unsqueeze(0), (True,), False, text_zero=True)


def _grid(L: TokenLayout, o: dict) -> DesignOut:
    stride = float(o["temporal_stride"])
    T, H, W = _unit(L)
    tau = L.tau
    floating = not _integral(stride)
    if floating:
        tau, T = tau.double(), T.double()
    else:
        stride = int(stride)
    if stride == 1 and not floating and L.coords is not None:  # (t, h, w) offsets are the layout's (tau, i, j)
        adv = L.unit_grid.amax(-1)  # (R,) max(T - 1, H - 1, W - 1) + 1
        anchored = (True, False, False) if o["spatial_reset"] else (True, True, True)
        return DesignOut(L.coords, adv.unsqueeze(0), anchored, False, text_zero=True)
    t = tau * stride
    adv = torch.maximum(torch.maximum((T - 1) * stride, (H - 1).to(t.dtype)), (W - 1).to(t.dtype)) + 1  # (R,)
    offsets = (t, L.i, L.j)
    anchored = (True, False, False) if o["spatial_reset"] else (True, True, True)
    return DesignOut(offsets, adv.unsqueeze(0), anchored, floating, text_zero=True)


def _scaled_grid(L: TokenLayout, o: dict) -> DesignOut:
    """The grid with each axis' offsets multiplied by its scale (time also by ``temporal_stride``); the next text
    position is the largest scaled offset + 1 (the maximum over all axes + 1, as the grid)."""
    scale = [float(o["temporal_stride"]) * float(o["position_scale"][0])] + [float(v) for v in o["position_scale"][1:]]
    T, H, W = _unit(L)
    floating = not all(_integral(v) for v in scale)
    if floating:
        offsets = tuple(x.double() * v for x, v in zip((L.tau, L.i, L.j), scale))  # 3 x (B, S)
        extent = [(n - 1).double() * v for n, v in zip((T, H, W), scale)]  # 3 x (R,)
    else:
        offsets = tuple(x * int(v) for x, v in zip((L.tau, L.i, L.j), scale))
        extent = [(n - 1) * int(v) for n, v in zip((T, H, W), scale)]
    adv = torch.maximum(torch.maximum(extent[0], extent[1]), extent[2]) + 1  # (R,)
    return DesignOut(offsets, adv.unsqueeze(0), (True, True, True), floating, text_zero=True)


def _circle(L: TokenLayout, o: dict) -> DesignOut:
    """Circle-RoPE: every unit's grid centred, mapped onto a circle and turned into the plane orthogonal to the
    text diagonal, so every vision token is at the same distance from the text positions ``(s, s, s)``."""
    radius, alpha = float(o["radius"]), float(o["alpha"])
    R = L.num_rows
    H, W = L.H.double(), L.W.double()
    x = L.j.double() - (W - 1) / 2  # (B, S) centred column ...
    y = L.i.double() - (H - 1) / 2  # ... and row (move_to_origin)
    polar = torch.atan2(y, x)  # (B, S)
    row = L.row.clamp(0, max(R - 1, 0))
    inf = torch.tensor(math.inf, dtype=torch.float64, device=L.device)
    lo = torch.full((max(R, 1),), math.inf, dtype=torch.float64, device=L.device).scatter_reduce(
        0, row.reshape(-1), torch.where(L.vision, polar, inf).reshape(-1), "amin")  # (R,) per unit
    hi = torch.full((max(R, 1),), -math.inf, dtype=torch.float64, device=L.device).scatter_reduce(
        0, row.reshape(-1), torch.where(L.vision, polar, -inf).reshape(-1), "amax")
    span = L.rows_to_tokens((hi - lo)[:R]) if R else torch.zeros_like(polar)
    lo_t = L.rows_to_tokens(lo[:R]) if R else torch.zeros_like(polar)
    spread = torch.where(span > 0, (polar - lo_t) / torch.where(span > 0, span, 1.0) * (2 * math.pi), polar)
    share = L.index.double() % (H * W) / (H * W) * (2 * math.pi)  # the raster index's share of a turn
    angle = alpha * spread + (1 - alpha) * share
    cx, cy = radius * torch.cos(angle), radius * torch.sin(angle)
    u = (-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0)  # an orthonormal basis of the plane orthogonal to (1, 1, 1)
    v = (-1 / math.sqrt(6), -1 / math.sqrt(6), 2 / math.sqrt(6))
    w_, h_, t_ = (cx * u[a] + cy * v[a] for a in range(3))  # the circle's x, y, z in that plane
    top = torch.maximum(torch.maximum(t_, h_), w_)  # (B, S)
    if R:
        far = torch.full((R,), -math.inf, dtype=torch.float64, device=L.device).scatter_reduce(
            0, row.reshape(-1), torch.where(L.vision, top, -inf).reshape(-1), "amax")
    else:
        far = torch.zeros(0, dtype=torch.float64, device=L.device)
    return DesignOut((t_, h_, w_), (far + 1).unsqueeze(0), (True, True, True), True)


def _absolute_time(L: TokenLayout, o: dict) -> DesignOut:
    tps = float(o["tokens_per_second"])
    is_video = L.row_type == 2  # (R,)
    spg = o["second_per_grid_ts"]
    if spg is None:
        per_row = is_video.float()  # 1.0 s per temporal patch when absent (released default)
    else:
        spg = torch.as_tensor(spg, dtype=torch.float32, device=L.device).reshape(-1)
        n_videos = is_video.sum()
        L.checks.append(
            Check(
                ~(torch.isfinite(spg) & (spg >= 0)).all(),
                lambda: f"second_per_grid_ts must be finite numbers >= 0 (temporal_patch_size / fps of each video), "
                f"got {spg.tolist()}",
            )
        )
        L.checks.append(
            Check(
                n_videos != spg.numel(),
                lambda: f"second_per_grid_ts has {spg.numel()} entries but the batch holds {int(n_videos)} videos; "
                "pass one value (temporal_patch_size / fps) per video, in order of appearance",
            )
        )
        if spg.numel() == 0:
            spg = torch.zeros(1, device=L.device)
        vid = (is_video.cumsum(0) - 1).clamp(0, spg.numel() - 1)
        per_row = torch.where(is_video, spg[vid], torch.zeros_like(spg[vid]))  # images: no time scaling
    # released order of operations: (tau * second_per_grid_t) * tokens_per_second in fp32, then truncation
    t = ((L.tau.float() * L.rows_to_tokens(per_row)) * tps).long()
    T, H, W = _unit(L)
    t_last = ((T - 1).float() * per_row) * tps  # (R,) the time position of each video's last frame
    if spg is not None:
        L.checks.append(
            Check(
                (t_last >= 2.0**53).any(),
                lambda: f"second_per_grid_ts * tokens_per_second puts a video's last frame at time position "
                f"{float(t_last.max()):.3g} (at least 2**53, beyond exact positions): pass seconds per temporal "
                "patch (temporal_patch_size / fps), not frame counts or timestamps",
            )
        )
    t_last = t_last.long()
    adv = torch.maximum(torch.maximum(t_last, H - 1), W - 1) + 1  # (R,)
    return DesignOut((t, L.i, L.j), adv.unsqueeze(0), (True, True, True), False, text_zero=True)


def _diagonal(L: TokenLayout, o: dict) -> DesignOut:
    who = "diagonal design"
    if o["training"]:
        scales = o["temporal_scales"]
        if scales is None or len(scales) == 0:
            raise ValueError(f"{who}: training=True draws the temporal scale from temporal_scales; got {scales!r}")
        gamma = _per_row_choice(scales, L, o["generator"])  # (R,) float64
    else:
        gamma = torch.full((L.num_rows,), float(o["temporal_scale"]),
                           dtype=torch.float64, device=L.device)
    T, H, W = _unit(L)
    t = L.rows_to_tokens(gamma) * L.tau  # (B, S)
    h = t + (L.i - L.rows_to_tokens((H - 1) // 2))
    w = t + (L.j - L.rows_to_tokens((W - 1) // 2))
    adv = gamma * (T - 1) + 1  # (R,)
    return DesignOut((t, h, w), adv.unsqueeze(0), (True, True, True), True)


def _vrope(L: TokenLayout, o: dict) -> DesignOut:
    T, H, W = _unit(L)
    span = H + W - 1  # (R,) index span of one frame
    ii, jj = L.i, L.j
    ri, rj = L.H - 1 - ii, L.W - 1 - jj
    base = L.tau * L.rows_to_tokens(span)
    offsets = (base + ii + jj, base + ii + rj, base + ri + jj, base + ri + rj)  # 4 x (B, S)
    return DesignOut(offsets, (T * span).unsqueeze(0), (True,) * 4, False)


def _v2pe(L: TokenLayout, o: dict) -> DesignOut:
    who = "v2pe design"
    tile = float(o["tile_tokens"])
    mode = o["mode"]
    if mode == "default":
        stride = torch.full((L.num_rows,), tile, dtype=torch.float64, device=L.device)
    elif mode == "fix":
        stride = torch.full((L.num_rows,), float(o["stride"]), dtype=torch.float64,
                            device=L.device)
    elif mode == "rnd":
        stride = _per_row_choice(o["strides"], L, o["generator"])
    else:
        raise ValueError(f"{who}: mode must be 'fix', 'rnd' or 'default', got {mode!r}")
    T, H, W = _unit(L)
    n = T * H * W  # (R,) tokens of the block
    delta = stride / tile  # (R,)
    offsets = L.rows_to_tokens(delta) * (L.index + 1).double() - 1.0  # (B, S): s - 1 + delta * m, m = 1..N
    # span ceil(delta * N), exactly: ceil(stride * N / tile) in integers whenever the strides are integers
    used = {"default": [tile], "fix": [o["stride"]], "rnd": list(o["strides"])}[mode]
    if _integral(tile) and all(_integral(v) for v in used):
        adv = ((stride.round().long() * n + int(tile) - 1) // int(tile)).double()
    else:
        adv = torch.ceil(delta * n.double())
    return DesignOut(offsets.unsqueeze(0), adv.unsqueeze(0), (True,), True)


def _pype(L: TokenLayout, o: dict) -> DesignOut:
    depth, interval = int(o["depth"]), int(o["interval"])  # checked by Design.options
    T, H, W = _unit(L)
    layer = torch.arange(depth, device=L.device).view(depth, 1)  # (A, 1)
    half = torch.minimum(H, W) // 2  # (R,)
    M = half - torch.minimum(layer // interval + 1, half)  # (A, R) largest ring index at layer l
    ring = torch.minimum(torch.minimum(L.i, L.j), torch.minimum(L.H - 1 - L.i, L.W - 1 - L.j))  # (B, S)
    M_tok = L.rows_to_tokens(M)  # (A, B, S)
    offsets = L.tau * (M_tok + 1) + torch.minimum(ring, M_tok)  # (A, B, S)
    return DesignOut(offsets, T * (M + 1), (True,) * depth, False)


DESIGNS: dict[str, Design] = {
    d.name: d
    for d in (
        Design(name="1d", fn=_one_d, defaults={}, axes=1,
               summary="vanilla 1D RoPE: every token advances the position by one"),
        Design(name="grid", fn=_grid, defaults={"temporal_stride": 1, "spatial_reset": False},
               summary="Qwen2-VL MRoPE grid (released semantics: next text at the maximum over all axes + 1)"),
        Design(name="spatial_reset", fn=_grid, defaults={"temporal_stride": 1, "spatial_reset": True},
               summary="MRoPE-I spatial reset: h, w local to the block, only t carries the offset"),
        Design(name="absolute_time", fn=_absolute_time, defaults={"second_per_grid_ts": None, "tokens_per_second": 2},
               summary="Qwen2.5-VL absolute time: t = floor(tau * second_per_grid_t * tokens_per_second)"),
        Design(name="per_frame", fn=_grid, defaults={"temporal_stride": 1, "spatial_reset": False}, split_frames=True,
               summary="Qwen3-VL: every frame is its own T = 1 block (timestamps are text between frames)"),
        Design(name="scaled_frames", fn=_scaled_grid, split_frames=True,
               defaults={"temporal_stride": 1, "position_scale": (1, 1, 1)},
               summary="MM-RoPE (Lumos-1): per-frame grid with each axis scaled by position_scale"),
        Design(name="circle", fn=_circle, split_frames=True, defaults={"radius": 10.0, "alpha": 0.5},
               summary="Circle-RoPE: each frame's grid on a circle orthogonal to the text diagonal"),
        Design(name="diagonal", fn=_diagonal,
               defaults={"temporal_scale": 2.0, "temporal_scales": HOPE_SCALES, "training": False, "generator": None},
               summary="VideoRoPE / HoPE diagonal layout with temporal scale (delta or gamma)"),
        Design(name="vrope", fn=_vrope, defaults={}, axes=4,
               summary="VRoPE: four diagonal coordinates, frames tile the index line"),
        Design(name="v2pe", fn=_v2pe, axes=1,
               defaults={"mode": "fix", "stride": 64, "strides": V2PE_STRIDES, "tile_tokens": 256, "generator": None},
               summary="V2PE: fractional increments delta = stride / 256 inside images"),
        Design(name="pype", fn=_pype, defaults={"depth": 32, "interval": 4}, axes="depth", layered=True,
               needs_mask=True, summary="PyPE: per-layer concentric rings, periphery first, expanding centre"),
    )
}


def get_design(name: str) -> Design:
    if isinstance(name, Design):
        return name
    if name not in DESIGNS:
        raise ValueError(f"unknown position design {name!r}; designs are: {', '.join(DESIGNS)}")
    return DESIGNS[name]


# --------------------------------------------------------------------------- assembly
def assemble(
    L: TokenLayout,
    out: DesignOut,
    *,
    pad_position: float = 1,
    dtype: torch.dtype | None = None,
    validate: bool = False,
) -> tuple[Tensor, Tensor]:
    """Running positions by one exclusive cumsum, then vision coordinates; returns ``(ids, deltas)``.

    ``ids`` is ``(A, B, S)``; ``deltas`` is ``(B, 1)`` (``(B, A)`` when the advance differs per axis, PyPE),
    the next free position minus the number of real tokens (Hugging Face 5.x convention). For packed rows
    (``L.samples``) the running position restarts at every sample (segment sums, :meth:`Samples.cumsum`) and
    ``deltas`` is ``(n, 1)`` (``(n, A)``), one per sample in order over the flattened batch. With ``validate``, an
    integer ``dtype`` other than int64 must hold every id and delta (:func:`_fitted`).

    Raises:
        ValueError: an integer ``dtype`` for a design of fractional positions, a ``pad_position`` that is not a
            finite number or (integer ids) not an integer in the dtype's range, or (``validate``) ids outside an
            integer ``dtype``'s range.
    """
    if dtype is None:
        dtype = torch.float32 if out.floating else torch.int64
    if out.floating and not dtype.is_floating_point:
        raise ValueError(
            f"this position design produces fractional positions; dtype must be a float dtype, got {dtype}"
        )
    _check_pad(pad_position, dtype)
    work = torch.float64 if dtype.is_floating_point else torch.int64
    B, S = L.valid.shape
    N = B * S
    adv = out.advance.to(work)  # (A', R)
    A1 = adv.shape[0]
    text = L.valid ^ L.vision  # (B, S) text tokens advance by one
    if L.samples is None and L.num_rows and not L.split_frames:
        # one cumsum per batch row over the increments shifted by one slot: slot s of row b is the position
        # when token s starts (exclusive), slot S the next free position; each grid row advances once, at its
        # last token (R values scattered, nothing gathered per token); a missing row lands in a spare slot
        M = B * (S + 1)
        shifted = torch.zeros(A1, M + 1, dtype=work, device=L.device)
        rows3 = shifted[:, :M].view(A1, B, S + 1)
        rows3[..., 1:] = text
        last = L.row_last  # (R,) flat index b S + s (N when absent)
        shifted.scatter_add_(1, (last + last // S + 1).clamp_(max=M).expand(A1, -1), adv)
        c = rows3.cumsum(-1)
        running, next_pos = c[..., :S], c[..., S]  # (A', B, S), (A', B)
        real = L.valid_len.to(work)  # (B,)
    else:
        text = text.to(work)
        if L.num_rows == 0:
            inc = text.unsqueeze(0).expand(A1, B, S)
        elif L.split_frames:
            inc = torch.where(L.frame_last, L.rows_to_tokens(adv), text)  # (A', B, S)
        else:
            # each row advances once, at its last token: scatter R values instead of gathering N
            slot = torch.zeros(A1, N + 1, dtype=work, device=L.device)
            slot.scatter_(1, L.row_last.clamp(max=N).expand(A1, -1), adv)
            inc = slot[:, :N].view(A1, B, S) + text
        if L.samples is None:
            running = inc.cumsum(-1) - inc  # exclusive: position when each token (or its unit) starts
            next_pos = running[..., -1] + inc[..., -1]  # (A', B)
            real = L.valid_len.to(work)  # (B,)
        else:  # the same, restarting at every sample: (A', B, S) and the (A', n) total advance of each sample
            running, next_pos = L.samples.cumsum(inc)
            _, real = L.samples.cumsum(L.valid.to(work))  # (n,) real tokens per sample
    A = len(out.anchored)
    if out.text_zero and all(out.anchored) and isinstance(out.offsets, Tensor):  # one add for all axes
        ids = torch.add(running, out.offsets)  # (A', B, S) + (A, B, S), in the work dtype
        if L.padded:
            ids.masked_fill_(~L.valid, pad_position)
        deltas = (next_pos - real).transpose(0, 1)  # (B or n, A')
        return _fitted(ids, deltas, dtype, validate)
    ids = torch.empty(A, B, S, dtype=work, device=L.device)
    for a in range(A):  # a handful of axes (PyPE: one per layer), never tokens or blocks
        run = running[a if A1 > 1 else 0]
        off = out.offsets[a].to(work)
        if out.anchored[a] and out.text_zero:  # offsets are 0 on text tokens: one add
            torch.add(run, off, out=ids[a])
        else:
            torch.where(L.vision, off + run if out.anchored[a] else off, run, out=ids[a])
    if L.padded:
        ids.masked_fill_(~L.valid, pad_position)
    deltas = (next_pos - real).transpose(0, 1)  # (B or n, A')
    return _fitted(ids, deltas, dtype, validate)


def _check_pad(pad_position: Any, dtype: torch.dtype) -> None:
    """``ValueError`` unless ``dtype`` ids can hold ``pad_position``: a finite number, and for integer ids an
    integer in the dtype's range."""
    if _real(pad_position) and math.isfinite(pad_position):
        if dtype.is_floating_point:
            return
        info = torch.iinfo(dtype)
        if int(pad_position) == pad_position and info.min <= pad_position <= info.max:
            return
        expected = f"an integer from {info.min} to {info.max} for {dtype} ids"
    else:
        expected = "a finite number (an int or a float, not a bool or a string)"
    raise ValueError(f"pad_position (the id of padding slots) must be {expected}, got {pad_position!r}")


def _fitted(ids: Tensor, deltas: Tensor, dtype: torch.dtype, validate: bool) -> tuple[Tensor, Tensor]:
    """``ids`` and ``deltas`` (int64 or float64) in ``dtype``; with ``validate``, ``ValueError`` (one host read)
    where an integer ``dtype`` other than int64 cannot hold them all: the cast would wrap them silently."""
    if validate and not dtype.is_floating_point and dtype != torch.int64 and ids.dtype == torch.int64:
        info = torch.iinfo(dtype)
        lo, hi = torch.aminmax(torch.cat([ids.reshape(-1), deltas.reshape(-1)]))
        if bool((lo < info.min) | (hi > info.max)):
            raise ValueError(
                f"the position ids and rope deltas span [{int(lo)}, {int(hi)}], outside {dtype}'s range "
                f"[{info.min}, {info.max}]: the cast would wrap them; pass dtype=torch.int64 (the default) or None"
            )
    return ids.to(dtype), deltas.to(dtype)
