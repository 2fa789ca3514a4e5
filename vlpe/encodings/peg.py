"""CPE / PEG: a depthwise convolution with a residual on the patch grid, between transformer blocks."""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from torch import Tensor, nn

from .base import Context, Encoding
from .plan import LayerPlan, Plan
from .spec import EncodingSpec
from .registry import register

__all__ = ["PEG"]

_PADDINGS = ("zeros", "reflect", "replicate", "circular")


@register("peg")
class PEG(Encoding):
    """Conditional position encoding (CPVT; Chu et al., "Conditional Positional Encodings for Vision
    Transformers", ICLR 2023): the Position Encoding Generator ``PEG(X) = X + DWConv_kxk(X)`` on the patch
    grid, checked against timm's ``twins.PosConv`` (the authors' Twins ``PosCNN``).

    One depthwise ``k x k`` convolution (bias, stride 1, ``(k-1)/2`` padding; zero padding by default, which is
    what lets the network locate the borders) per insertion point, applied after each block listed in
    ``after`` (CPVT's default: after the first block, ``after=(0,)``). Prefix tokens (CLS, registers) bypass
    the convolution unchanged. Any grid shape works (the grid comes from ``Positions``); ``num_axes=3`` uses a
    depthwise ``k x k x k`` convolution over ``(t, h, w)`` video grids. Weights follow the Twins init,
    ``N(0, sqrt(2 / fan_out))`` with ``fan_out = k^A`` (so PEG is not a no-op at step 0), biases 0; zeroing
    them (``neutralize()``) leaves the residual, i.e. the identity.
    """

    claims = frozenset({"neutral"})
    pieces = frozenset({"mix"})
    supported_axes = (2, 3)
    needs_grid = True

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        kernel_size: int = 3,
        after: Sequence[int] = (0,),
        padding: Literal["zeros", "reflect", "replicate", "circular"] = "zeros",
    ) -> None:
        dim, depth, num_axes = spec.dim, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        kernel_size = int(kernel_size)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd integer (same-size output), got {kernel_size}")
        if padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {padding!r}")
        if isinstance(after, int):
            after = (after,)
        after = tuple(int(a) for a in after)
        if not after or len(set(after)) != len(after) or any(not 0 <= a < depth for a in after):
            raise ValueError(
                f"after must list distinct block indices in [0, depth={depth}) after which a PEG runs, got {after}"
            )
        self.kernel_size, self.padding, self.after = kernel_size, padding, after
        conv = nn.Conv2d if num_axes == 2 else nn.Conv3d
        self.convs = nn.ModuleList(
            conv(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim, bias=True, padding_mode=padding)
            for _ in after
        )
        self._slot = {layer: i for i, layer in enumerate(after)}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Twins init: ``N(0, sqrt(2 / fan_out))``, ``fan_out = k^A * out_channels / groups``; bias 0."""
        fan_out = self.kernel_size**self.num_axes
        for c in self.convs:
            nn.init.normal_(c.weight, 0.0, math.sqrt(2.0 / fan_out))
            nn.init.zeros_(c.bias)

    def _prepare(self, ctx: Context) -> None:
        grid = ctx.pos.grid
        if self.padding == "reflect" and min(grid) <= self.kernel_size // 2:
            raise ValueError(
                f"padding='reflect' needs every grid side > {self.kernel_size // 2} (kernel {self.kernel_size}), "
                f"got grid {grid}; use 'zeros', 'replicate' or 'circular'"
            )

    def _plan(self, ctx: Context) -> Plan:
        """``mix`` after the blocks of ``after`` only (the other layers have no piece)."""
        layers = tuple(LayerPlan.of({"mix"} if i in self._slot else ()) for i in range(self.depth))
        return Plan(embed=False, layers=layers)

    def mix(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        self.check_layer(layer)
        slot = self._slot.get(layer)
        if slot is None:
            return x
        self.check_x(x, ctx, "PEG")
        B, N, C = x.shape
        p, grid = ctx.pos.prefix, ctx.pos.grid
        tokens = x[:, p:]  # (B, n, C)
        # channels-last view (B, C, *grid): no copy in, the depthwise conv keeps the layout
        feat = tokens.reshape(B, *grid, C).movedim(-1, 1)  # (B, C, *grid)
        out = feat + self.convs[slot](feat)  # (B, C, *grid)
        out = out.movedim(1, -1).reshape(B, N - p, C)  # (B, n, C)
        return out if p == 0 else torch.cat([x[:, :p], out], dim=1)

    def neutralize(self) -> "PEG":
        for c in self.convs:
            c.weight.zero_()
            c.bias.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        """The PEG convolutions, as Twins excludes its ``pos_block`` parameters from weight decay."""
        return {name for name, _ in self.named_parameters()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}, after={self.after}, padding={self.padding!r}"
