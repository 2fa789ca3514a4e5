"""ComRoPE: rotary encoding with trainable commuting angle matrices, ``R(p) = exp(sum_a p_a A_a)``.

Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable Commuting
Angle Matrices" (CVPR 2025, arXiv 2506.03737); reference implementation Longin-Yu/ComRoPE ``model.py``
(``ComRoPEAPAttention``, ``ComRoPELDAttention``, ``RoPESelfAttentionBase.get_rotation_matrix``).

Every generator ``A_a`` is block diagonal with ``D/b`` skew-symmetric ``b x b`` blocks, and block j of every
axis is a multiple of the same skew matrix ``S_j = G_j - G_j^T``:

* ``variant="ap"`` (axial partition): block j belongs to axis ``j mod A`` only, ``A_a[j] = [j = a mod A] S_j``;
* ``variant="ld"`` (linearly dependent): ``A_a[j] = theta_{a,j} S_j`` with learned multipliers ``theta``.

So the generators commute and ``R(p_i)^T R(p_j) = R(p_j - p_i)`` exactly. Block j of ``R(p)`` is
``exp(t_j(p) S_j)`` with the scalar ``t_j(p) = sum_a p_a Theta[a, j]`` (``Theta`` = the axis mask or theta).
For ``b = 2`` this is a plane rotation by ``t_j * omega_j`` and vlpe uses the shared RoPE primitives; for
``b > 2`` the blocks are exponentiated with ``torch.matrix_exp`` in fp32 (autocast off), for all layers at
once, once per forward, and applied as ``b x b`` block products (never a dense ``D x D`` matrix per token).

Channel layout: block j holds channels ``j, j + D/b, ..., j + (b-1) D/b`` (for ``b = 2`` the half layout of
vlpe's RoPE); the reference uses consecutive channels, a fixed permutation of q/k channels that changes
nothing after the learned projections.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Mapping

import torch
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .spec import EncodingSpec
from .functional.rope import apply_rope, cos_sin, rope_angles
from .functional.scaling import scale_frequencies
from .registry import register
from .rope import RotaryScaling

__all__ = ["ComRoPE", "normalized_grid_coords"]





def normalized_grid_coords(pos, *, prefix_value: float = 0.5, dtype: torch.dtype = torch.float32) -> Tensor:
    """Grid coordinates mapped to ``(c + 0.5) / n_a`` per axis (the reference's ``axis_scale``), fp32.

    ``n_a`` is the grid extent along axis a, so a patch grid fills (0, 1) at any resolution (interpolation,
    not extrapolation). Prefix tokens sit at ``prefix_value`` on every axis (the reference's CLS at 0.5).
    Every axis is divided by its own extent (for video the reference divides the frame index by the spatial
    patch count as well). Computed in ``dtype`` (fp32, or fp64), autocast off.
    """
    if pos.grid is None:
        raise ValueError(
            "comrope with coords='normalized' needs tokens on a regular grid (Positions.grid / .video / .grid_nd) "
            "to know the extent of each axis; for point clouds build it with coords='raw'"
        )
    with torch.autocast(pos.device.type, enabled=False):
        c = pos.coords.to(torch.promote_types(pos.coords.dtype, dtype))  # (B, N, A)
        out = torch.stack([(c[..., a] + 0.5) / n for a, n in enumerate(pos.grid)], dim=-1)  # python extents
        if pos.prefix:
            out = out.clone()
            out[:, : pos.prefix] = prefix_value
        return out


@register("comrope")
class ComRoPE(RotaryScaling, Encoding):
    """ComRoPE-AP / ComRoPE-LD (Yu et al., CVPR 2025): RoPE whose rotation ``exp(sum_a p_a A_a)`` uses learned,
    commuting, block-diagonal skew-symmetric generators; checked against dense ``torch.matrix_exp`` of the
    full generators built from the reference's parameterisation (Longin-Yu/ComRoPE ``model.py``).

    Parameters per layer: ``generators`` (H, D/b, b, b) ~ N(0, init_std^2) (the reference's ``freqs``) and,
    for LD, ``multipliers`` (A, D/b) ~ N(0, 1), shared by the heads as in the reference. Both stay fp32
    under ``.bfloat16()``. ``coords="normalized"`` (default, the reference) maps a grid to ``(i + 0.5) / n``
    per axis and rotates prefix tokens at the centre 0.5; ``coords="raw"`` uses the coordinates as given
    (prefix tokens at 0, unrotated; then the small-grid logits are a block of the large-grid ones).
    ``neutralize()`` zeroes the generators (``R = I``).

    ``scaling`` (``coords="raw"`` only: normalised coordinates already map every resolution into (0, 1)) acts
    on block j's rate along axis a, ``Theta[a, j] * omega_j`` (``omega_j`` the block's fastest rotation rate,
    its spectral norm; ``S_j[1, 0]`` for b = 2): ``linear`` divides it by ``s_a``; ``ntk`` / ``yarn`` use the
    spectrum of the learned rates themselves (per layer and axis, highest to lowest magnitude), and YaRN's
    ramp is the continuous one (learned rates sit on no pair grid, so ``truncate`` has no effect).
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})
    needs_grid = True  # coords="normalized" reads the grid extent; coords="raw" does not

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        variant: Literal["ap", "ld"] = "ap",
        block: int = 2,
        init_std: float = 1.0,
        coords: Literal["normalized", "raw"] = "normalized",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        dim, num_heads, depth, num_axes = spec.dim, spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        if variant not in ("ap", "ld"):
            raise ValueError(f"variant must be 'ap' (axial partition) or 'ld' (linearly dependent), got {variant!r}")
        if not isinstance(block, int) or block < 2 or self.head_dim % block:
            raise ValueError(
                f"block must be an integer >= 2 that divides the head dim {self.head_dim} "
                f"(dim / num_heads), got {block!r}"
            )
        num_blocks = self.head_dim // block
        if variant == "ap" and num_blocks < num_axes:
            raise ValueError(
                f"comrope variant='ap' gives each of the {num_axes} axes its own blocks, but head dim "
                f"{self.head_dim} / block {block} = {num_blocks} blocks; use a smaller block or variant='ld'"
            )
        if coords not in ("normalized", "raw"):
            raise ValueError(f"coords must be 'normalized' (the reference's (i + 0.5) / n) or 'raw', got {coords!r}")
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std}")
        self.variant = variant
        self.block = block
        self.num_blocks = num_blocks
        self.init_std = float(init_std)
        self.coords = coords
        if coords == "raw":
            self.claims = self.claims | {"extrapolation"}
            self.needs_grid = False
        self.generators = nn.Parameter(torch.empty(depth, num_heads, num_blocks, block, block))
        if variant == "ld":
            self.multipliers = nn.Parameter(torch.empty(depth, num_axes, num_blocks))
        else:
            mask = torch.zeros(num_axes, num_blocks)  # (A, D/b): block j belongs to axis j mod A
            for a in range(num_axes):
                mask[a, a::num_axes] = 1.0
            self.register_buffer("axis_mask", mask, persistent=False)
        self.reset_parameters()
        self._init_scaling(scaling)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.generators.normal_(0.0, self.init_std)
            if self.variant == "ld":
                self.multipliers.normal_(0.0, 1.0)


    # ------------------------------------------------------------------ scaling
    @property
    def accepts_scaling(self) -> bool:
        return self.coords == "raw"

    def set_scaling(self, scaling):
        if scaling is not None and self.coords != "raw":
            raise ValueError(
                "comrope with coords='normalized' maps every resolution into (0, 1) already; training-free scaling "
                "needs coords='raw' (positions in patches)"
            )
        return super().set_scaling(scaling)

    def rates(self) -> Tensor:
        """Rotation rate of every block (L, H, D/b): ``S_j[1, 0]`` for b = 2, the spectral norm for b > 2."""
        S = self.skew()
        if self.block == 2:
            return S[..., 1, 0]
        with torch.autocast(S.device.type, enabled=False):
            return torch.linalg.matrix_norm(fp32(S), ord=2)

    def _scaling_probe(self) -> Tensor:
        return self.axis_weights().unsqueeze(1) * self.rates().unsqueeze(2)  # (L, H, A, D/b)

    def spectrum(self) -> dict[str, Any]:
        """The learned rates' own spectrum per layer and axis: highest / lowest nonzero magnitude (detached)."""
        with torch.no_grad():
            w = self._scaling_probe().abs().double()  # (L, H, A, J)
            hi = w.amax(dim=(1, 3), keepdim=True)  # (L, 1, A, 1)
            lo = torch.where(w > 0, w, torch.full_like(w, float("inf"))).amin(dim=(1, 3), keepdim=True)
            lo = torch.where(torch.isfinite(lo), lo, hi).clamp_min(1e-30)
            hi = hi.clamp_min(1e-30)
        if self.variant == "ld":
            pairs: Any = self.num_blocks
        else:  # blocks per axis
            pairs = [max(2, len(range(a, self.num_blocks, self.num_axes))) for a in range(self.num_axes)]  # a lone block: j = 0
        return {"hi": hi, "lo": lo, "num_pairs": pairs}

    def scaled(self, freqs: Tensor) -> Tensor:
        if self.scaling is None:
            return freqs
        return scale_frequencies(freqs, replace(self.scaling, truncate=False), **self.spectrum())

    def _check_scaling(self, scaling) -> None:
        return None  # any learned spectrum is valid (a band of one block keeps its rate under ntk / yarn)

    def _axis_gains(self) -> Tensor:
        """``Theta[a, j]`` times the scaling gain of its rate, (L, H, A, J) (b > 2)."""
        F = self._scaling_probe()  # (L, H, A, J)
        G = self.scaled(F)
        ratio = torch.where(F != 0, G / torch.where(F != 0, F, torch.ones_like(F)), torch.ones_like(F))
        return self.axis_weights().unsqueeze(1) * ratio

    # ------------------------------------------------------------------ math
    def skew(self) -> Tensor:
        """``S = G - G^T``: (depth, H, D/b, b, b)."""
        return self.generators - self.generators.transpose(-1, -2)

    def axis_weights(self) -> Tensor:
        """``Theta`` (depth, A, D/b): block j's generator for axis a is ``Theta[a, j] S_j``."""
        if self.variant == "ld":
            return self.multipliers
        return self.axis_mask.unsqueeze(0).expand(self.depth, -1, -1)

    def positions_of(self, pos) -> Tensor:
        """The coordinates the rotation reads, (B, N, A) fp32 (fp64 in a ``.double()`` module)."""
        dtype = self.generators.dtype if self.generators.dtype == torch.float64 else torch.float32
        if self.coords == "normalized":
            return normalized_grid_coords(pos, dtype=dtype)
        return pos.coords.to(torch.promote_types(pos.coords.dtype, dtype))

    def block_rotations(self, coords: Tensor) -> Tensor:
        """``exp(t_j(p) S_j)`` for every layer, head, token and block: (B, depth, H, N, D/b, b, b) fp32."""
        with torch.autocast(coords.device.type, enabled=False):
            S = fp32(self.skew())  # (L, H, J, b, b)
            if self.scaling is None:
                theta = fp32(self.axis_weights())  # (L, A, J)
                t = torch.einsum("bna,laj->blnj", fp32(coords).to(S.dtype), theta.to(S.dtype))  # (B, L, N, J)
                log = t[:, :, None, :, :, None, None] * S[None, :, :, None]  # (B, L, H, N, J, b, b)
            else:  # scaled: every head has its own gains
                theta = fp32(self._axis_gains())  # (L, H, A, J)
                t = torch.einsum("bna,lhaj->blhnj", fp32(coords).to(S.dtype), theta.to(S.dtype))  # (B, L, H, N, J)
                log = (t[..., None, None] * S[None, :, :, None]).contiguous()  # (B, L, H, N, J, b, b)
            R = torch.matrix_exp(log)
            return R if self.scaling is None else self.temper(R)[0]

    def _prepare(self, ctx: Context) -> None:
        c = self.positions_of(ctx.pos)  # (B, N, A)
        if self.block == 2:
            S = self.skew()
            omega = S[..., 1, 0]  # (L, H, J): exp(t S) rotates pair j by t * omega
            freqs = self.axis_weights().unsqueeze(1) * omega.unsqueeze(2)  # (L, H, A, J)
            angles = rope_angles(c, self.scaled(freqs))  # (B, L, H, N, J)
            ctx["cos"], ctx["sin"] = self.temper(*cos_sin(angles))
        else:
            R = self.block_rotations(c)  # (B, L, H, N, J, b_out, b_in)
            ctx["rot"] = R.permute(0, 1, 2, 3, 5, 6, 4).contiguous()  # (B, L, H, N, b_out, b_in, J)

    def _rotate_blocks(self, x: Tensor, R: Tensor) -> Tensor:
        """``x`` (B, H, N, D) times block rotations ``R`` (B, H, N, b, b, J) in the tables' precision."""
        dtype = x.dtype
        xb = x.to(R.dtype).unflatten(-1, (self.block, self.num_blocks))  # (B, H, N, b_in, J)
        out = (R * xb.unsqueeze(-3)).sum(-2)  # (B, H, N, b_out, J)
        return out.flatten(-2).to(dtype)

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        if not 0 <= layer < self.depth:
            raise ValueError(f"comrope was built with depth={self.depth}, got layer={layer}")
        if self.block == 2:
            cos, sin = ctx["cos"][:, layer], ctx["sin"][:, layer]  # (B, H, N, D/2)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        R = ctx["rot"][:, layer]  # (B, H, N, b, b, J)
        with torch.autocast(q.device.type, enabled=False):
            return self._rotate_blocks(q, R), self._rotate_blocks(k, R)

    def rotation_matrix(self, coords: Tensor, layer: int) -> Tensor:
        """Dense ``R(p)`` (B, H, N, D, D) in vlpe's channel layout, for tests and plots."""
        B, N, _ = coords.shape
        J, b = self.num_blocks, self.block
        R = self.block_rotations(coords)[:, layer]  # (B, H, N, J, b, b)
        dense = R.new_zeros(B, self.num_heads, N, b * J, b * J)
        for j in range(J):  # block j acts on channels j, j + J, ..., j + (b - 1) J
            ch = torch.arange(b, device=R.device) * J + j
            dense[..., ch[:, None], ch[None, :]] = R[..., j, :, :]
        return dense

    def neutralize(self) -> "ComRoPE":
        self.generators.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"generators", "multipliers"} if self.variant == "ld" else {"generators"}

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, variant={self.variant!r}, block={self.block}, init_std={self.init_std}, "
            f"coords={self.coords!r}{self.scaling_repr()}"
        )
