"""Absolute position embeddings added to the tokens before block 0: learned (``ape``) and fixed sin-cos (``sincos``).

Both build their ``(B or 1, N, C)`` table once per forward in :meth:`Encoding.prepare` and add it in
``embed``; prefix tokens (CLS, registers) get their own learned slot (``ape``) or zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..positions import Positions
from .base import Context, Encoding
from .spec import EncodingSpec
from .registry import register

__all__ = ["AdditiveEmbedding", "LearnedAPE", "SinCosAPE", "resample_grid_embed", "sincos_embed"]


class AdditiveEmbedding(Encoding):
    """Base of the encodings that add a table ``ctx["pe"]`` (B or 1, N, C) to the tokens in ``embed``.

    The table is built in the subclass's ``_prepare``; ``embed`` checks the token count and width and adds it
    in the tokens' dtype.
    """

    pieces = frozenset({"embed"})

    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        self.check_x(x, ctx, f"{type(self).__name__}.embed")
        pe = ctx["pe"]  # (B or 1, N, C)
        return x + pe.to(x.dtype)


# --------------------------------------------------------------------------- learned APE
def resample_grid_embed(table: Tensor, old: Sequence[int], new: Sequence[int], *, antialias: bool = True) -> Tensor:
    """Resample a patch-embedding table ``(prod(old), C)`` laid out row-major on grid ``old`` to grid ``new``.

    2 axes: bicubic (antialiased when shrinking), ``align_corners=False``, in fp32, cast back to the table's
    dtype (timm ``resample_abs_pos_embed``); 3 axes: trilinear (no antialias in torch); 1 axis: linear.
    The same size returns ``table`` unchanged.
    """
    old, new = tuple(int(s) for s in old), tuple(int(s) for s in new)
    if len(old) != len(new) or not 1 <= len(old) <= 3:
        raise ValueError(f"resample_grid_embed needs two grids of the same 1-3 axes, got {old} -> {new}")
    if old == new:
        return table
    C = table.shape[-1]
    mode = {1: "linear", 2: "bicubic", 3: "trilinear"}[len(old)]
    with torch.autocast(table.device.type, enabled=False):
        grid = table.float().reshape(1, *old, C).movedim(-1, 1)  # (1, C, *old)
        grid = F.interpolate(grid, size=new, mode=mode, align_corners=False, antialias=antialias and mode == "bicubic")
        return grid.movedim(1, -1).reshape(-1, C).to(table.dtype)  # (prod(new), C)


@register("ape")
class LearnedAPE(AdditiveEmbedding):
    """Learned absolute position embedding, resampled to the input grid (ViT, Dosovitskiy et al., ICLR 2021).

    The table holds ``prefix`` slots (CLS, registers; 0 = DeiT-III / big_vision "no_embed_class") followed by
    one row per patch of the training grid ``grid_size``. On any other grid the patch rows are resampled
    bicubically with antialias, ``align_corners=False`` and in fp32, exactly like timm's
    ``resample_abs_pos_embed`` (checked against it, square and rectangular grids); prefix slots are never
    resampled. Videos (3 axes, ``grid_size=(t, h, w)``) are resampled trilinearly. The embedding reads the
    grid shape only, not the coordinates: shifted positions on the same grid get the same table. Init is
    ``trunc_normal_(std=0.02)`` as in timm (cut at +-2 absolute, so in effect N(0, 0.02^2));
    ``neutralize()`` zeroes the table.
    """

    claims = frozenset({"neutral"})
    supported_axes = (2, 3)
    needs_grid = True

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        grid_size: Sequence[int] | None = None,
        prefix: int = 1,
        antialias: bool = True,
        init_std: float = 0.02,
    ) -> None:
        dim, num_axes = spec.dim, spec.num_axes
        super().__init__(spec=spec)
        if grid_size is None and spec.grid is not None and len(spec.grid) == num_axes:
            grid_size = spec.grid  # the model's training grid
        if grid_size is None:
            if num_axes != 2:
                raise ValueError(f"ape with num_axes={num_axes} needs an explicit grid_size of {num_axes} entries")
            grid_size = (14, 14)
        grid_size = tuple(int(g) for g in grid_size)
        if len(grid_size) != num_axes or any(g < 1 for g in grid_size):
            raise ValueError(f"grid_size must be {num_axes} positive sizes (one per axis), got {grid_size}")
        if prefix < 0:
            raise ValueError(f"prefix (number of prefix slots in the table) must be >= 0, got {prefix}")
        self.grid_size = grid_size
        self.prefix = int(prefix)
        self.antialias = bool(antialias)
        self.init_std = float(init_std)
        self.pos_embed = nn.Parameter(torch.empty(self.prefix + math.prod(grid_size), dim))  # (P + h0*w0, C)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=self.init_std)

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        if self.prefix and pos.prefix != self.prefix:
            raise ValueError(
                f"ape was built with {self.prefix} prefix slot(s) but the positions have prefix={pos.prefix}; "
                f"build Positions with prefix={self.prefix} or the encoding with prefix={pos.prefix} (0 = no slots)"
            )
        if pos.grid == self.grid_size and pos.prefix == self.prefix:
            ctx["pe"] = self.pos_embed.unsqueeze(0)  # (1, N, C): the training grid, no copy
            return
        patches = resample_grid_embed(
            self.pos_embed[self.prefix :], self.grid_size, pos.grid, antialias=self.antialias
        )  # (n_patches, C)
        head = self.pos_embed[: self.prefix] if self.prefix else patches.new_zeros(pos.prefix, self.dim)
        ctx["pe"] = torch.cat([head, patches], dim=0).unsqueeze(0)  # (1, N, C)

    def prepare_rows(self, pos: Positions, indices: list[Tensor]) -> Context:
        """The learned table read at the grid rows ``indices`` (per axis ``(B, g_a)``, indices into
        ``grid_size``) instead of being resampled to ``pos.grid`` (RPE-2D's sampled positions: its rows reader,
        :data:`vlpe.encodings.rpe2d.BASES`)."""
        if self.prefix and pos.prefix != self.prefix:
            raise ValueError(
                f"ape was built with {self.prefix} prefix slot(s) but the positions have prefix={pos.prefix}"
            )
        grid, L = pos.grid, self.grid_size
        flat = torch.zeros((), dtype=torch.long, device=pos.device)
        for a in range(len(grid)):
            shape = [pos.batch] + [1] * len(grid)
            shape[1 + a] = grid[a]
            flat = flat * L[a] + indices[a].reshape(shape)  # row-major index in the table grid
        rows = self.pos_embed[self.prefix + flat.reshape(pos.batch, -1)]  # (B, n, C)
        head = self.pos_embed[: self.prefix] if self.prefix else rows.new_zeros(pos.prefix, self.dim)
        ctx = Context(pos, training=self.training, owner=self)
        ctx["pe"] = torch.cat([head.unsqueeze(0).expand(pos.batch, -1, -1), rows], dim=1)  # (B, N, C)
        ctx.plan = self._plan(ctx)
        return ctx

    def neutralize(self) -> LearnedAPE:
        with torch.no_grad():
            self.pos_embed.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grid_size={self.grid_size}, prefix={self.prefix}"


# --------------------------------------------------------------------------- sin-cos APE
SinCosLayout = Literal["blocked", "per_axis"]


def sincos_embed(
    coords: Tensor,
    dim: int,
    *,
    temperature: float = 10000.0,
    layout: SinCosLayout = "blocked",
    reverse_axes: bool = False,
) -> Tensor:
    """Fixed sin-cos features of float coordinates ``(B, N, A)`` -> ``(B, N, dim)`` in fp32 (autocast off).

    Each axis gets ``P = dim // (2A)`` frequencies ``omega_k = temperature ** (-k / P)``. ``layout="blocked"``:
    ``[sin(c_0 w), ..., sin(c_{A-1} w), cos(c_0 w), ..., cos(c_{A-1} w)]`` (timm ``build_sincos2d_pos_embed``);
    ``"per_axis"``: ``[sin(c_0 w), cos(c_0 w), sin(c_1 w), ...]`` (timm ``interleave_sin_cos=True``; with
    ``reverse_axes`` the MAE layout). ``reverse_axes`` reads the axes in reverse order (column first).
    (timm's ``reverse_coord`` is different: it enumerates the tokens of the transposed grid, so on ``(h, w)``
    it equals this function on the coordinates of a ``(w, h)`` grid, and nothing changes on square grids.)
    Channels left over when ``dim`` is not a multiple of ``2A`` are zero.
    """
    if layout not in ("blocked", "per_axis"):
        raise ValueError(f"layout must be 'blocked' (timm) or 'per_axis' (interleave_sin_cos / MAE), got {layout!r}")
    B, N, A = coords.shape
    P = dim // (2 * A)
    if P < 1:
        raise ValueError(f"sincos needs dim >= 2 * num_axes (one sin/cos pair per axis), got dim={dim}, A={A}")
    with torch.autocast(coords.device.type, enabled=False):
        c = coords if coords.dtype == torch.float64 else coords.float()
        if reverse_axes:
            c = c.flip(-1)
        k = torch.arange(P, device=c.device, dtype=torch.int64).to(c.dtype)
        omega = 1.0 / (temperature ** (k / P))  # (P,) in the coordinates' precision (timm's freq_bands)
        angles = c.unsqueeze(-1) * omega  # (B, N, A, P)
        if layout == "blocked":
            sc = torch.stack([angles.sin(), angles.cos()], dim=2)  # (B, N, 2, A, P)
        else:
            sc = torch.stack([angles.sin(), angles.cos()], dim=3)  # (B, N, A, 2, P)
        emb = sc.reshape(B, N, 2 * A * P)  # (B, N, 2AP)
        if emb.shape[-1] != dim:
            emb = F.pad(emb, (0, dim - emb.shape[-1]))
        return emb


@register("sincos")
class SinCosAPE(AdditiveEmbedding):
    """Fixed sin-cos absolute embedding for any number of axes (Vaswani et al. 2017; 2D as in MAE, He et al.
    CVPR 2022), evaluated at the float coordinates, so it serves grids, videos and point clouds alike.

    Frequencies ``temperature ** (-k / (D / 2A))`` per axis, fp32 under autocast. ``layout="blocked"`` reproduces
    timm's ``build_sincos2d_pos_embed`` exactly (``layout="per_axis"`` its ``interleave_sin_cos``; its
    ``reverse_coord=True`` on an ``(h, w)`` grid is this encoding on ``Positions.grid(w, h)``, a transposed token
    order). ``layout="per_axis", reverse_axes=True`` (column channels first) is MAE's
    ``get_2d_sincos_pos_embed``. Prefix tokens get zeros. No parameters; being a function of each token's
    own coordinates, a small grid's embedding is the matching block of a larger grid's (``extrapolation``).
    float64 coordinates give a float64 table.
    """

    claims = frozenset({"extrapolation", "fp32_angles"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        temperature: float = 10000.0,
        layout: SinCosLayout = "blocked",
        reverse_axes: bool = False,
    ) -> None:
        dim, num_axes = spec.dim, spec.num_axes
        super().__init__(spec=spec)
        if layout not in ("blocked", "per_axis"):
            raise ValueError(
                f"layout must be 'blocked' (timm) or 'per_axis' (interleave_sin_cos / MAE), got {layout!r}"
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if dim < 2 * num_axes:
            raise ValueError(f"sincos needs dim >= 2 * num_axes, got dim={dim}, num_axes={num_axes}")
        self.temperature = float(temperature)
        self.layout = layout
        self.reverse_axes = bool(reverse_axes)

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        pe = sincos_embed(
            pos.patch_coords, self.dim, temperature=self.temperature, layout=self.layout, reverse_axes=self.reverse_axes
        )  # (B, N - prefix, C)
        if pos.prefix:
            pe = torch.cat([pe.new_zeros(pe.shape[0], pos.prefix, self.dim), pe], dim=1)  # (B, N, C)
        ctx["pe"] = pe

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, temperature={self.temperature}, layout={self.layout!r}, "
            f"reverse_axes={self.reverse_axes}"
        )
