"""The vision tower of :class:`models.vlm.VLM`: patch embedding, a vlpe encoder over (t, h, w) and the 2x2 merger.

:class:`VisionTower` stands in for Qwen2-VL's ``model.visual``: it takes the collator's packed patches and
``grid_thw``, lays them out as rows of attention (one per temporal patch or per whole block, padded with
``valid`` masks when blocks differ in size; ``_layout``, cached per grid list), runs a
:class:`models.blocks.Encoder` with any vlpe vision encoding and returns the :class:`Merger`'s tokens in
placeholder order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch
from torch import Tensor, nn

from vlpe.attention import Backend
from vlpe.positions import Positions

from .blocks import Encoder

__all__ = ["VisionTower", "Merger"]


@functools.lru_cache(maxsize=64)
def _merge_order(h: int, w: int, m: int) -> Tensor:
    """(row, col) of the ``h * w`` patches of one frame in the collator's order: row-block, column-block,
    row-in-block, column-in-block (each ``m x m`` merge group contiguous). ``(h * w, 2)`` int64."""
    rb, cb, ri, ci = torch.meshgrid(
        torch.arange(h // m), torch.arange(w // m), torch.arange(m), torch.arange(m), indexing="ij"
    )
    return torch.stack([rb * m + ri, cb * m + ci], dim=-1).reshape(h * w, 2)


@dataclass(frozen=True)
class _Layout:
    """How the packed patches of a batch become attention rows: ``rows`` x ``width`` tokens."""

    coords: Tensor  # (R, Lmax, 3) int64: (t, row, col)
    gather: Tensor | None  # (R, Lmax) patch index of every slot; None when the patches already form (R, Lmax)
    valid: Tensor | None  # (R, Lmax) bool; None when every slot is real
    scatter: Tensor | None  # (P,) flat slot of every patch, in patch order; None with gather None

    def to(self, device: torch.device) -> "_Layout":
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return _Layout(mv(self.coords), mv(self.gather), mv(self.valid), mv(self.scatter))


@functools.lru_cache(maxsize=32)
def _layout(grids: tuple[tuple[int, int, int], ...], merge: int, per_frame: bool) -> _Layout:
    """Rows of attention for packed ``grids`` (t, h, w in patches, order of appearance): one row per temporal
    patch (``per_frame``) or per block. Built on the host once per distinct grid list (cached)."""
    segments: list[tuple[int, Tensor]] = []  # (first patch, coords (n, 3))
    offset = 0
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)}: height and width must be multiples of spatial_merge_size={merge}")
        hw = _merge_order(h, w, merge)  # (h*w, 2)
        times = torch.arange(t).repeat_interleave(h * w)[:, None]  # (t*h*w, 1)
        coords = torch.cat([times, hw.repeat(t, 1)], dim=-1)  # (t*h*w, 3)
        if per_frame:
            segments += [(offset + i * h * w, coords[i * h * w : (i + 1) * h * w]) for i in range(t)]
        else:
            segments.append((offset, coords))
        offset += t * h * w
    lengths = [len(c) for _, c in segments]
    width = max(lengths)
    if all(n == width for n in lengths):
        return _Layout(torch.stack([c for _, c in segments]), None, None, None)
    R = len(segments)
    coords = torch.zeros(R, width, 3, dtype=torch.long)
    gather = torch.zeros(R, width, dtype=torch.long)
    valid = torch.zeros(R, width, dtype=torch.bool)
    scatter = []
    for r, (first, c) in enumerate(segments):
        n = len(c)
        coords[r, :n] = c
        gather[r, :n] = torch.arange(first, first + n)
        valid[r, :n] = True
        scatter.append(torch.arange(r * width, r * width + n))
    return _Layout(coords, gather, valid, torch.cat(scatter))


class Merger(nn.Module):
    """Qwen2-VL's patch merger: the ``m x m`` contiguous patches of a group concatenated, then an MLP to the
    decoder width (the input is already layer-normed by the encoder)."""

    def __init__(self, *, dim: int, out_dim: int, merge_size: int = 2) -> None:
        super().__init__()
        self.group = merge_size**2
        inner = dim * self.group
        self.mlp = nn.Sequential(nn.Linear(inner, inner), nn.GELU(), nn.Linear(inner, out_dim))

    def forward(self, x: Tensor) -> Tensor:
        """``(P, C)`` patches in merge order -> ``(P / m^2, out_dim)``."""
        return self.mlp(x.reshape(-1, x.shape[-1] * self.group))


class VisionTower(nn.Module):
    """Linear patch embedding + :class:`models.blocks.Encoder` (any vlpe encoding) + :class:`Merger`.

    Called by the Hugging Face model as ``visual(pixel_values, grid_thw=grid_thw)``: ``pixel_values``
    ``(P, C * tp * p * p)`` packed patches of every block in order (the Qwen2-VL processor's layout, see
    :func:`data.vlm_collate.patchify`), ``grid_thw`` ``(blocks, 3)``. Every patch gets the coordinates
    ``(t, row, col)`` (temporal patch, patch row, patch column) within its block; rows of attention are temporal
    patches (``attention="frame"``, Qwen2-VL) or whole blocks (``"block"``), padded with ``valid`` masks when
    blocks differ in size. Returns a ``BaseModelOutputWithPooling`` whose ``pooler_output`` holds the merged
    tokens ``(P / m^2, out_dim)`` in placeholder order.
    """

    def __init__(
        self,
        *,
        out_dim: int,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 4,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        in_chans: int = 3,
        spatial_merge_size: int = 2,
        encoding: str = "rope",
        encoding_options: Mapping[str, Any] | None = None,
        attention: Literal["frame", "block"] = "frame",
        mlp_ratio: float = 4.0,
        backend: Backend = "sdpa",
    ) -> None:
        super().__init__()
        if attention not in ("frame", "block"):
            raise ValueError(f"vision attention must be 'frame' or 'block', got {attention!r}")
        self.patch_size, self.temporal_patch_size, self.in_chans = patch_size, temporal_patch_size, in_chans
        self.spatial_merge_size = spatial_merge_size
        self.attention = attention
        self.patch_dim = in_chans * temporal_patch_size * patch_size**2
        self.patch_embed = nn.Linear(self.patch_dim, dim)
        options = dict(encoding_options or {})
        options.setdefault("num_axes", 3)
        self.encoder = Encoder(
            dim=dim, depth=depth, num_heads=num_heads, encoding=encoding, encoding_options=options,
            mlp_ratio=mlp_ratio, backend=backend,
        )  # fmt: skip
        self.merger = Merger(dim=dim, out_dim=out_dim, merge_size=spatial_merge_size)
        for module in (self.patch_embed, self.encoder.blocks, self.merger):
            module.apply(_init_linear)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    def forward(self, hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.patch_dim:
            raise ValueError(
                f"pixel_values must be (patches, {self.patch_dim}) = (patches, channels x temporal_patch_size x "
                f"patch_size^2), got {tuple(hidden_states.shape)}"
            )
        grids = tuple(tuple(g) for g in grid_thw.tolist())  # the one host read (Hugging Face splits by it too)
        layout = _layout(grids, self.spatial_merge_size, self.attention == "frame").to(hidden_states.device)
        x = self.patch_embed(hidden_states)  # (P, C)
        R, L = layout.coords.shape[:2]
        rows = x.reshape(R, L, -1) if layout.gather is None else x[layout.gather]  # (R, L, C)
        pos = Positions(layout.coords, valid=layout.valid, axes=("t", "h", "w"))
        rows = self.encoder(rows, pos)  # (R, L, C)
        x = rows.reshape(R * L, -1)
        if layout.scatter is not None:
            x = x[layout.scatter]  # (P, C) back in patch order
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=self.merger(x))


def _init_linear(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
