"""Learnable Fourier features + MLP position embedding for any continuous coordinates."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .absolute import AdditiveEmbedding
from .base import Context, apply_keeping_fp32
from .spec import EncodingSpec
from .registry import register

__all__ = ["LearnableFourier"]


class _FP32Linear(nn.Linear):
    """``nn.Linear`` whose weight stays at its exact fp32 value through ``.to(bfloat16)`` / ``.half()`` /
    DeepSpeed casts (device moves and ``.double()`` apply): the frequencies ``W_r`` of the Fourier features."""

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp32(self, super()._apply, fn, recurse)


@register("fourier")
class LearnableFourier(AdditiveEmbedding):
    """Learnable Fourier features followed by an MLP, added to the tokens (Li, Si, Li, Hsieh, Bengio,
    "Learnable Fourier Features for Multi-Dimensional Spatial Positional Encoding", NeurIPS 2021).

    The A coordinate axes form ``groups`` G groups of ``M = A / G`` axes; per group
    ``r(x) = [cos(x W_r^T), sin(x W_r^T)] / sqrt(F)`` with ``W_r`` (F/2, M), then
    ``PE = GELU(r W_1 + b_1) W_2 + b_2`` of width C/G (W_r and the MLP shared across groups), concatenated
    over groups. ``W_r`` is drawn from N(0, gamma^-2) read as a *variance*, i.e. std ``1 / gamma`` (the
    paper's notation; the popular ``learnable_fourier_positional_encoding`` package uses std ``gamma^-2``
    instead). Coordinates are in patch units, and the default gamma = 2 puts the initial frequencies in
    the band of the sin-cos embedding (up to ~1 rad per patch). Features are computed in fp32 with
    autocast off, and ``W_r`` stays fp32 through ``.to(bfloat16)`` / ``.half()`` casts; the MLP runs in the
    ambient precision (it follows casts). Being a function of each token's own coordinates,
    it extrapolates by evaluation at new coordinates. Prefix tokens get zeros. ``neutralize()`` zeroes the
    last layer, making the embedding exactly zero. Checked against a direct evaluation of the formula.
    """

    claims = frozenset({"neutral", "extrapolation", "fp32_angles"})

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        num_features: int = 128,
        hidden: int = 128,
        gamma: float = 2.0,
        groups: int = 1,
    ) -> None:
        dim, num_axes = spec.dim, spec.num_axes
        super().__init__(spec=spec)
        if num_features < 2 or num_features % 2:
            raise ValueError(f"num_features F must be a positive even number (F/2 cos + F/2 sin), got {num_features}")
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0 (W_r std is 1/gamma), got {gamma}")
        if groups < 1 or num_axes % groups or dim % groups:
            raise ValueError(f"groups must divide both num_axes ({num_axes}) and dim ({dim}); got groups={groups}")
        self.num_features = int(num_features)
        self.hidden = int(hidden)
        self.gamma = float(gamma)
        self.groups = int(groups)
        M = num_axes // groups
        self.w_r = _FP32Linear(M, num_features // 2, bias=False)  # W_r: (F/2, M), fp32 through casts
        self.mlp = nn.Sequential(nn.Linear(num_features, hidden), nn.GELU(), nn.Linear(hidden, dim // groups))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_r.weight, std=1.0 / self.gamma)
        for layer in (self.mlp[0], self.mlp[2]):
            layer.reset_parameters()

    def features(self, coords: Tensor) -> Tensor:
        """Fourier features ``(B, N, G, F)`` of coordinates ``(B, N, A)``, fp32 with autocast off."""
        B, N, A = coords.shape
        with torch.autocast(coords.device.type, enabled=False):
            x = coords.float() if coords.dtype != torch.float64 else coords
            x = x.reshape(B, N, self.groups, A // self.groups)  # (B, N, G, M)
            proj = x @ self.w_r.weight.to(x.dtype).T  # (B, N, G, F/2)
            return torch.cat([proj.cos(), proj.sin()], dim=-1) / math.sqrt(self.num_features)  # (B, N, G, F)

    def encode(self, coords: Tensor) -> Tensor:
        """The embedding ``(B, N, C)`` at coordinates ``(B, N, A)`` (any float values)."""
        r = self.features(coords)  # (B, N, G, F)
        r = r.to(self.mlp[0].weight.dtype)
        pe = self.mlp(r)  # (B, N, G, C/G)
        return pe.flatten(-2)  # (B, N, C)

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        pe = self.encode(pos.patch_coords)  # (B, N - prefix, C)
        if pos.prefix:
            pe = torch.cat([pe.new_zeros(pe.shape[0], pos.prefix, self.dim), pe], dim=1)  # (B, N, C)
        ctx["pe"] = pe

    def neutralize(self) -> LearnableFourier:
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)
        return self

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_features={self.num_features}, hidden={self.hidden}, "
            f"gamma={self.gamma}, groups={self.groups}"
        )
