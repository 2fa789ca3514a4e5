"""FIRE: a learned function of the normalised relative position, added to the attention logits, for nD coordinates.

Li et al., "Functional Interpolation for Relative Positions Improves Long Context Transformers" (ICLR 2024,
arXiv 2310.04418). The 1D bias is ``b_h(i, j) = f_h(psi(i - j) / psi(max(L, i)))`` with
``psi(x) = log(c x + 1)``, a learnable ``c`` (init 0.1), a learnable threshold ``L`` (``|l| * init_L``, the
paper's multiplier parametrisation) and ``f`` a two-layer ReLU MLP of width 32 mapping to the H heads.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from .alibi import pairwise_distance
from .base import Context, Encoding
from .spec import EncodingSpec
from .registry import register

__all__ = ["FIRE", "patch_bounds"]

_EPS = 1e-6  # keeps the normaliser away from 0 (the paper's eps)


def patch_bounds(pos, coords: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample bounding box ``(lo, hi)``, each ``(B', 1, A)``, of the non-prefix, non-padding ``coords``
    (``coords`` are ``pos.coords`` in the caller's precision); on device, no host read. A sample without
    real tokens gets ``lo = hi = 0``.
    """
    patch = coords[:, pos.prefix :]  # (B, M, A)
    if patch.shape[1] == 0:
        zeros = coords.new_zeros(coords.shape[0], 1, coords.shape[2])
        return zeros, zeros
    if pos.valid is None:
        return patch.amin(1, keepdim=True), patch.amax(1, keepdim=True)
    ok = pos.valid[:, pos.prefix :, None]  # (B', M, 1)
    big = torch.finfo(coords.dtype).max
    lo = torch.where(ok, patch, big).amin(1, keepdim=True)
    hi = torch.where(ok, patch, -big).amax(1, keepdim=True)
    empty = lo > hi
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


@register("fire")
class FIRE(Encoding):
    """FIRE (Li et al., ICLR 2024) for images, videos and point clouds: a per-layer MLP of log-compressed,
    normalised offsets, ``b_h(i, j) = f_h(psi(d_ij) / (psi(T) + eps))``, ``psi(x) = log(|c| x + 1)``.

    Choices the 1D causal paper leaves open, made here for bidirectional vision tokens:

    * offsets: ``distance="axial"`` (default) feeds the A signed per-axis offsets
      ``sign(p_i - p_j) psi(|p_i - p_j|)`` (direction kept: left and right differ), the MLP maps A inputs to H;
      ``distance="euclidean"`` feeds one input, ``psi(||p_i - p_j||_2)`` (isotropic, rotation invariant).
    * normaliser ``T``: the paper's ``max(L, i)`` uses the query's absolute index (the number of keys a causal
      query sees), which would break shift invariance. Here the analogue of "how far can a key be" is the
      extent of the token coordinates: ``normalize="extent"`` (default) uses ``T = max(L, extent)``, the
      extent being per sample the range ``max - min`` of the non-prefix, non-padding coordinates per axis
      (axial) or the diagonal of that bounding box (euclidean). It is invariant to shifts, so ``relative``
      holds, and larger test images are *interpolated* into the trained input range (the paper's progressive
      interpolation); the bias of a sub-grid therefore differs from its block in a larger grid (no
      ``extrapolation``). ``normalize="threshold"`` uses ``T = L`` only: the bias is a function of the offset
      alone, so ``extrapolation`` holds as well (and ``rotation_invariant`` with ``distance="euclidean"``).
      ``init_L`` defaults to 4 patches, about the paper's ratio of L to its training length (512 / 2048) at a
      16-patch image.
    * prefix tokens (CLS, registers) have no position: every pair with a prefix token gets zero bias, as in
      vlpe's ``alibi``.

    Each layer has its own ``c``, ``l`` and MLP (the paper's module per attention layer). The MLP weights are
    the module's own fp32 parameters (``keep_fp32``), and offsets, ``psi`` and the MLP run in fp32 with
    autocast off. ``score`` builds only the requested query rows; its faster forms (a lattice table of the
    grid offsets, an analytic flex ``score_mod`` computing the MLP from captured ``(B, N)`` coordinate columns,
    so nothing N x N is stored) are registered in :mod:`vlpe.attention_forms.fire`.
    ``neutralize()`` zeroes the output layer. Checked against a slow explicit per-pair loop in
    tests/test_fire.py.
    """

    keep_fp32 = True  # exact fp32 parameters through downcasts (see Encoding.keep_fp32)
    # the reference bias runs the MLP on every pair, the lattice table on (2h-1)(2w-1) offsets only: the fast
    # path pays from about a 14 x 14 grid on (`benchmarks/encoding_cost.py --layer --image 224 --encodings fire`)

    claims = frozenset({"relative", "neutral", "fp32_angles"})
    pieces = frozenset({"score"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        distance: Literal["axial", "euclidean"] = "axial",
        normalize: Literal["extent", "threshold"] = "extent",
        hidden: int = 32,
        init_c: float = 0.1,
        init_L: float = 4.0,
    ) -> None:
        num_heads, depth, num_axes = spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        if distance not in ("axial", "euclidean"):
            raise ValueError(f"fire: distance must be 'axial' (per-axis offsets) or 'euclidean', got {distance!r}")
        if normalize not in ("extent", "threshold"):
            raise ValueError(
                f"fire: normalize must be 'extent' (max(L, coordinate extent)) or 'threshold' (L), got {normalize!r}"
            )
        if not (isinstance(hidden, int) and hidden >= 1):
            raise ValueError(f"fire: hidden must be a positive int (the MLP width, 32 in the paper), got {hidden!r}")
        if not (init_c > 0 and math.isfinite(init_c)):
            raise ValueError(f"fire: init_c must be a finite number > 0 (the paper uses 0.1), got {init_c}")
        if not (init_L > 0 and math.isfinite(init_L)):
            raise ValueError(f"fire: init_L must be a finite number > 0 (a threshold in coordinate units), got {init_L}")
        self.distance = distance
        self.normalize = normalize
        self.hidden = hidden
        self.init_c = float(init_c)
        self.init_L = float(init_L)
        F = num_axes if distance == "axial" else 1  # MLP inputs
        self.num_inputs = F
        self.c = nn.Parameter(torch.full((depth,), self.init_c))  # (layers,)
        self.l = nn.Parameter(torch.ones(depth))  # (layers,) L = |l| * init_L
        self.w1 = nn.Parameter(torch.empty(depth, hidden, F))
        self.b1 = nn.Parameter(torch.empty(depth, hidden))
        self.w2 = nn.Parameter(torch.empty(depth, num_heads, hidden))
        self.b2 = nn.Parameter(torch.empty(depth, num_heads))
        self.reset_parameters()
        extra = set()
        if normalize == "threshold":
            extra.add("extrapolation")
            if distance == "euclidean":
                extra.add("rotation_invariant")
        if extra:
            self.claims = self.claims | extra

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init for both layers (uniform in +-1/sqrt(fan_in))."""
        with torch.no_grad():
            for w, b, fan_in in ((self.w1, self.b1, self.num_inputs), (self.w2, self.b2, self.hidden)):
                bound = 1.0 / math.sqrt(fan_in)
                w.uniform_(-bound, bound)
                b.uniform_(-bound, bound)
            self.c.fill_(self.init_c)
            self.l.fill_(1.0)

    # ------------------------------------------------------------------ per forward
    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        with torch.autocast(pos.device.type, enabled=False):
            coords = pos.coords if pos.coords.dtype == torch.float64 else pos.coords.float()  # (B, N, A)
            ctx["coords"] = coords
            ctx["patch"] = (~pos.is_prefix).to(coords.dtype)  # (N,) 0 for prefix tokens
            if self.normalize == "extent":
                ctx["extent"] = self._extent(pos, coords)  # (B, F)

    def _extent(self, pos, coords: Tensor) -> Tensor:
        """Per-sample coordinate extent of the non-prefix, non-padding tokens: ``(B, F)`` (F = A or 1)."""
        lo, hi = patch_bounds(pos, coords)
        rng = (hi - lo).squeeze(1)  # (B', A)
        if self.distance == "euclidean":
            rng = rng.square().sum(-1, keepdim=True).sqrt()  # (B, 1): the bounding-box diagonal
        return rng

    def _psi(self, x: Tensor, layer: int) -> Tensor:
        return torch.log1p(self.c[layer].abs().to(x.dtype) * x)

    def _denominator(self, ctx: Context, layer: int, dtype: torch.dtype) -> Tensor:
        """``psi(T) + eps`` per sample and input: ``(B, F)`` (extent) or ``(1, 1)`` (threshold)."""
        L = (self.l[layer].abs() * self.init_L).to(dtype)
        T = torch.maximum(ctx["extent"].to(dtype), L) if self.normalize == "extent" else L.reshape(1, 1)
        return self._psi(T, layer) + _EPS

    # ------------------------------------------------------------------ hooks
    def _pair_bias(self, cq: Tensor, ck: Tensor, ctx: Context, layer: int) -> Tensor:
        """The MLP bias ``(B, n, N, H)`` of queries at ``cq`` (B, n, A) and keys at ``ck`` (B, N, A), prefix
        tokens not handled; fp32 (the coordinates' precision) with autocast off."""
        with torch.autocast(ck.device.type, enabled=False):
            dt = ck.dtype
            if self.distance == "euclidean":
                x = self._psi(pairwise_distance(cq, ck), layer)[..., None]  # (B, n, N, 1)
            else:
                d = cq[:, :, None, :] - ck[:, None, :, :]  # (B, n, N, A)
                x = torch.sign(d) * self._psi(d.abs(), layer)
            x = x / self._denominator(ctx, layer, dt)[:, None, None, :]  # (B, n, N, F)
            h = torch.relu(x @ self.w1[layer].to(dt).T + self.b1[layer].to(dt))  # (B, n, N, hidden)
            return h @ self.w2[layer].to(dt).T + self.b2[layer].to(dt)  # (B, n, N, H)

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor:
        self.check_layer(layer)
        coords, patch = ctx["coords"], ctx["patch"]
        rows = slice(None) if rows is None else rows
        out = self._pair_bias(coords[:, rows], coords, ctx, layer)  # (B, n, N, H)
        out = out * (patch[rows, None] * patch[None, :])[..., None]  # prefix rows / columns: zero
        return out.permute(0, 3, 1, 2)  # (B, H, n, N)

    def neutralize(self) -> FIRE:
        self.w2.zero_()
        self.b2.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"c", "l"}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, distance={self.distance!r}, normalize={self.normalize!r}, "
            f"hidden={self.hidden}, init_c={self.init_c}, init_L={self.init_L}"
        )
