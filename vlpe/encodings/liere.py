"""LieRE: rotations ``R(p) = exp(sum_a p_a S_a)`` with learned, independent skew-symmetric generators.

Ostmeier et al., "LieRE: Lie Rotational Positional Encodings" (ICML 2025, arXiv 2406.10322). Each axis ``a``
has its own block-diagonal skew-symmetric generator ``S_a`` (``D / b`` blocks of size ``b``, per layer and
head); a token at ``p`` rotates its query and key by the matrix exponential of ``sum_a p_a S_a``. Unlike
ComRoPE / STRING the generators do not commute, so ``R(p_i)^T R(p_j)`` is not a function of ``p_j - p_i``:
LieRE is an absolute encoding acting multiplicatively (no ``relative`` claim).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from .base import Context, Encoding, fp32
from .registry import register
from .spec import EncodingSpec

__all__ = ["LieRE", "liere_grid_coords"]


def liere_grid_coords(pos, train_grid: tuple[int, ...] | None, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """The reference's grid coordinates: axis ``a`` of extent ``n`` runs over ``linspace(0, n / n0, n)``.

    ``n0`` is the training extent of the axis (``train_grid``; the grid itself when None), so the training grid
    spans [0, 1] per axis and a larger grid extends past 1 at the same spacing up to rounding of ``n / n0``.
    Prefix tokens sit at 0 on every axis (the identity rotation). Computed in ``dtype``, autocast off.

    Args:
        pos: :class:`vlpe.Positions` on a regular grid (``pos.grid`` set).
        train_grid: the training grid ``(n0_1, ..., n0_A)`` or None.

    Returns:
        ``(B, N, A)`` coordinates.

    Raises:
        ValueError: positions without a grid, or a training grid of another axis count.
    """
    if pos.grid is None:
        raise ValueError(
            "liere with coords='normalized' needs tokens on a regular grid (Positions.grid / .video / .grid_nd) to "
            "know the extent of each axis; for point clouds build it with coords='raw'"
        )
    grid = tuple(pos.grid)
    ref = grid if train_grid is None else tuple(train_grid)
    if len(ref) != len(grid):
        raise ValueError(f"liere: the training grid {ref} has {len(ref)} axes but the positions' grid {grid} has "
                         f"{len(grid)}; build it with grid= a grid of {len(grid)} axes")
    with torch.autocast(pos.device.type, enabled=False):
        c = pos.coords.to(torch.promote_types(pos.coords.dtype, dtype))  # (B, N, A)
        step = [(n / n0) / (n - 1) if n > 1 else 0.0 for n, n0 in zip(grid, ref)]  # python floats per axis
        return c * torch.tensor(step, dtype=c.dtype, device=c.device)  # prefix rows stay 0


@register("liere")
class LieRE(Encoding):
    """LieRE (Ostmeier et al., ICML 2025): ``R(p) = exp(sum_a p_a S_a)``, ``S_a`` learned block-diagonal
    skew-symmetric generators per axis (and per layer and head, the reference's ``rotary_embedding_per_layer``
    / ``_per_head``), applied to q and k; checked against the computation of StanfordMIMI/LieRE
    ``models/rope_vit.py`` (``LierePositionEncoder``, ``FlexibleAttention.apply_transforms``, commit
    657fc51c9a1c206e8ec7ccaa241798536696edf1) re-stated in the tests.

    Parameterisation (the reference's): a raw tensor ``generators`` (L', H', A, J, b, b) drawn from
    ``U(0, init_scale)`` (``2 pi``); block ``j`` of axis ``a`` is ``S = U - U^T`` with ``U`` its strictly
    upper triangle. Block ``j`` acts on the consecutive channels ``j b .. (j + 1) b - 1``; the last
    ``D mod b`` channels are not rotated. The exponentials run in fp32 (fp64 in a ``.double()`` module) with
    autocast off, for all layers at once, once per forward; ``generators`` stays fp32 under ``.bfloat16()``.

    ``coords="normalized"`` (default, the reference): a grid axis of extent ``n`` runs over
    ``linspace(0, n / n0, n)`` with ``n0`` its training extent (``spec.grid``, else ``n``); prefix tokens get the
    identity. ``coords="raw"``: the coordinates as given (prefix tokens at 0, the identity; then a small grid's
    logits are a block of a large grid's). ``neutralize()`` zeroes the generators (``R = I``).

    Args:
        spec: the build-time facts; ``spec.grid`` is the training grid of ``coords="normalized"``.
        block: size ``b`` of the skew-symmetric blocks (``2 <= b <= D``; ``b = 2`` gives learned per-axis
            plane rotations, ``b = D`` one dense generator per axis).
        coords: ``"normalized"`` or ``"raw"``.
        per_layer: one set of generators per layer (else one shared by all layers).
        per_head: one set per head (else one shared by the heads).
        init_scale: the raw parameters are drawn from ``U(0, init_scale)``.

    Raises:
        ValueError: a block that is not an int in ``[2, D]``, an unknown ``coords``, a negative ``init_scale``.

    Reference: Ostmeier, Axelrod, Moseley, Chaudhari, Langlotz, "LieRE: Lie Rotational Positional Encodings",
    ICML 2025 (arXiv 2406.10322).
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"neutral", "fp32_angles"})
    pieces = frozenset({"rotate"})
    needs_grid = True  # coords="normalized" reads the grid extent; coords="raw" does not
    example = {"block": 4}

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        block: int = 8,
        coords: Literal["normalized", "raw"] = "normalized",
        per_layer: bool = True,
        per_head: bool = True,
        init_scale: float = 2 * math.pi,
    ) -> None:
        super().__init__(spec=spec)
        if isinstance(block, bool) or not isinstance(block, int) or not 2 <= block <= self.head_dim:
            raise ValueError(f"block must be an int in [2, head dim {self.head_dim}] (dim / num_heads), got {block!r}")
        if coords not in ("normalized", "raw"):
            raise ValueError(f"coords must be 'normalized' (the reference's linspace(0, n / n0, n)) or 'raw', "
                             f"got {coords!r}")
        if not isinstance(per_layer, bool) or not isinstance(per_head, bool):
            raise ValueError(f"per_layer and per_head must be bools, got {per_layer!r}, {per_head!r}")
        if not init_scale >= 0:
            raise ValueError(f"init_scale must be >= 0, got {init_scale}")
        self.block = block
        self.num_blocks = self.head_dim // block
        self.coords = coords
        self.per_layer = per_layer
        self.per_head = per_head
        self.init_scale = float(init_scale)
        if coords == "raw":
            self.claims = self.claims | {"extrapolation"}
            self.needs_grid = False
        shape = (spec.depth if per_layer else 1, spec.num_heads if per_head else 1, self.num_axes,
                 self.num_blocks, block, block)
        self.generators = nn.Parameter(torch.empty(shape))  # (L', H', A, J, b, b) raw
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.generators.uniform_(0.0, self.init_scale)

    def skew(self) -> Tensor:
        """The generators ``S`` (L', H', A, J, b, b): ``U - U^T`` for ``U`` the strict upper triangle, fp32."""
        with torch.autocast(self.generators.device.type, enabled=False):
            U = torch.triu(fp32(self.generators), diagonal=1)
            return U - U.transpose(-1, -2)

    def positions_of(self, pos) -> Tensor:
        """The coordinates the rotations read (B, N, A), fp32 (fp64 in a ``.double()`` module)."""
        dtype = torch.float64 if self.generators.dtype == torch.float64 else torch.float32
        if self.coords == "normalized":
            return liere_grid_coords(pos, self.spec.grid, dtype=dtype)
        with torch.autocast(pos.device.type, enabled=False):
            return pos.coords.to(torch.promote_types(pos.coords.dtype, dtype))

    def block_rotations(self, coords: Tensor) -> Tensor:
        """``exp(sum_a p_a S_a)`` per block: coords (B, N, A) -> (B, L', H', N, J, b, b), autocast off."""
        with torch.autocast(coords.device.type, enabled=False):
            S = self.skew()  # (L', H', A, J, b, b)
            log = torch.einsum("bna,lhajxy->blhnjxy", coords.to(S.dtype), S)  # (B, L', H', N, J, b, b)
            return torch.matrix_exp(log.contiguous())

    def _prepare(self, ctx: Context) -> None:
        ctx["rot"] = self.block_rotations(self.positions_of(ctx.pos))  # (B, L', H', N, J, b, b)

    def _apply_blocks(self, x: Tensor, R: Tensor) -> Tensor:
        """``x`` (B, H, N, D) with channels ``j b ..`` rotated by ``R`` (B, H', N, J, b, b), in R's precision."""
        n = self.num_blocks * self.block
        xb = x[..., :n].to(R.dtype).unflatten(-1, (self.num_blocks, self.block))  # (B, H, N, J, b)
        out = torch.einsum("bhnjxy,bhnjy->bhnjx", R.expand(-1, x.shape[1], -1, -1, -1, -1), xb)
        out = out.flatten(-2).to(x.dtype)  # (B, H, N, J b)
        return out if n == x.shape[-1] else torch.cat([out, x[..., n:]], dim=-1)

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        self.check_layer(layer)
        R = ctx["rot"][:, layer if self.per_layer else 0]  # (B, H', N, J, b, b)
        with torch.autocast(q.device.type, enabled=False):
            return self._apply_blocks(q, R), self._apply_blocks(k, R)

    def rotation_matrix(self, coords: Tensor, layer: int) -> Tensor:
        """Dense ``R(p)`` (B, H', N, D, D), for tests and plots."""
        self.check_layer(layer)
        R = self.block_rotations(coords)[:, layer if self.per_layer else 0]  # (B, H', N, J, b, b)
        dense = torch.zeros(*R.shape[:3], self.head_dim, self.head_dim, dtype=R.dtype, device=R.device)
        dense[..., range(self.num_blocks * self.block, self.head_dim), range(self.num_blocks * self.block,
                                                                             self.head_dim)] = 1.0
        for j in range(self.num_blocks):  # blocks, not tokens
            s = slice(j * self.block, (j + 1) * self.block)
            dense[..., s, s] = R[..., j, :, :]
        return dense

    def neutralize(self) -> "LieRE":
        self.generators.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"generators"}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}block={self.block}, coords={self.coords!r}, per_layer={self.per_layer}, "
                f"per_head={self.per_head}")
