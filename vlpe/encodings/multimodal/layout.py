"""Vectorised token layout of a multimodal batch: which vision block (and frame) every token belongs to.

Every position design in :mod:`vlpe.encodings.multimodal` starts from the same per-token description of the
batch, computed here without a Python loop over tokens or blocks and without reading tensor values on the
host (only the optional validation reads one boolean):

1. vision tokens are counted in order of appearance over the flattened ``(B, S)`` batch (padding excluded),
   giving every vision token a global index ``g``;
2. the grid rows (after spatial merging) hold ``T * H * W`` tokens each; ``searchsorted`` of ``g`` in the
   cumulative row sizes gives the token's grid row and its offset inside that row;
3. the offset decomposes into ``(tau, i, j)`` by integer division (raster order: frame, row, column).

A position design then only needs, per token, the *start* of its unit (the running position when the unit
begins, an exclusive ``cumsum`` of per-token increments done by the caller) plus the token's coordinates
inside the unit. A *unit* is a whole grid row, or a single frame for per-frame designs (Qwen3-VL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

__all__ = ["TokenLayout", "token_layout", "Check"]


@dataclass
class Check:
    """A deferred data-dependent validity check: ``bad`` is a 0-d bool tensor, ``message`` explains a failure."""

    bad: Tensor
    message: Callable[[], str]


@dataclass
class TokenLayout:
    """Per-token block structure of a batch; all per-token tensors are ``(B, S)``.

    Attributes:
        valid: real (non-padding) tokens.
        vision: valid image/video tokens.
        types: the token types (0 text, 1 image, 2 video) as int64.
        row: the grid row (vision block) of each vision token (0 elsewhere).
        tau, i, j: frame, row and column of each vision token inside its unit (``tau`` is 0 for per-frame units).
        T, H, W: the merged grid of the token's unit (``T`` is 1 for per-frame units); 1 for text.
        index: the token's raster index inside its unit, ``(tau * H + i) * W + j``.
        last: True on the last token of each unit (where the running position advances).
        grid: ``(R, 3)`` merged grids ``(T, H // m, W // m)`` in order of appearance.
        row_type: ``(R,)`` token type (1 image / 2 video) of each grid row.
        valid_len: ``(B,)`` number of real tokens per sample.
        checks: deferred validity checks (evaluated with one host read by :meth:`validate`).
    """

    valid: Tensor
    vision: Tensor
    types: Tensor
    row: Tensor
    tau: Tensor
    i: Tensor
    j: Tensor
    T: Tensor
    H: Tensor
    W: Tensor
    index: Tensor
    last: Tensor
    grid: Tensor
    row_type: Tensor
    valid_len: Tensor
    split_frames: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.grid.shape[0]

    @property
    def device(self) -> torch.device:
        return self.types.device

    def validate(self) -> None:
        """Raise ``ValueError`` for the first failing check; a single host read when every check passes."""
        if not self.checks:
            return
        if not bool(torch.stack([c.bad.reshape(()) for c in self.checks]).any()):
            return
        for c in self.checks:
            if bool(c.bad):
                raise ValueError(c.message())


def _as_grid(grid_thw, device: torch.device) -> Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    grid = torch.as_tensor(grid_thw, device=device)
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        raise ValueError(f"grid_thw must hold integers (patches per axis), got dtype {grid.dtype}")
    grid = grid.to(torch.int64)
    if grid.numel() == 0:
        return grid.reshape(0, 3)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(
            f"grid_thw must have shape (blocks, 3) = (T, H, W) in patches per vision block, got {tuple(grid.shape)}"
        )
    return grid


def token_layout(
    mm_token_type_ids: Tensor,
    grid_thw: Tensor | None,
    attention_mask: Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    split_frames: bool = False,
) -> TokenLayout:
    """Describe every token of a batch by its vision block, frame and grid cell (see the module docstring).

    Args:
        mm_token_type_ids: ``(B, S)`` 0 text, 1 image, 2 video.
        grid_thw: ``(R, 3)`` grids in patches (before spatial merging), in order of appearance over the
            batch (sample 0's blocks first); None or empty for text-only batches.
        attention_mask: ``(B, S)`` 1 for real tokens, 0 for padding; None when every token is real.
        spatial_merge_size: patches merged per axis into one LLM token (2 in Qwen2/2.5/3-VL).
        split_frames: units are single frames (Qwen3-VL), which may be separated by text (timestamps).

    The structural checks (grid count, divisibility, blocks aligned with the runs of vision tokens) are
    recorded in ``checks`` and evaluated by :meth:`TokenLayout.validate`.
    """
    types = torch.as_tensor(mm_token_type_ids)
    if types.dim() != 2:
        raise ValueError(f"mm_token_type_ids must have shape (B, S), got {tuple(types.shape)}")
    if types.is_floating_point():
        raise ValueError(f"mm_token_type_ids must hold integers 0 (text), 1 (image), 2 (video), got {types.dtype}")
    types = types.to(torch.int64)
    device = types.device
    B, S = types.shape
    m = int(spatial_merge_size)
    if m < 1 or m != spatial_merge_size:
        raise ValueError(f"spatial_merge_size must be a positive integer, got {spatial_merge_size!r}")
    if attention_mask is None:
        valid = torch.ones(B, S, dtype=torch.bool, device=device)
    else:
        valid = torch.as_tensor(attention_mask, device=device)
        if valid.shape != (B, S):
            raise ValueError(
                f"attention_mask must have the shape of mm_token_type_ids {(B, S)}, got {tuple(valid.shape)}"
            )
        valid = valid.bool()
    grid = _as_grid(grid_thw, device)
    R = grid.shape[0]
    vision = (types != 0) & valid  # (B, S)
    valid_len = valid.sum(-1)  # (B,)
    checks: list[Check] = [
        Check(
            ((types < 0) | (types > 2)).any(),
            lambda: "mm_token_type_ids must be 0 (text), 1 (image) or 2 (video); got values "
            f"{sorted(set(types.unique().tolist()) - {0, 1, 2})}",
        )
    ]
    ones = torch.ones(B, S, dtype=torch.int64, device=device)
    zeros = torch.zeros(B, S, dtype=torch.int64, device=device)
    if R == 0:
        n_vis = vision.sum()
        checks.append(
            Check(
                n_vis > 0,
                lambda: f"mm_token_type_ids mark {int(n_vis)} image/video tokens but grid_thw has no rows; "
                "pass one (T, H, W) row per vision block in order of appearance",
            )
        )
        no = torch.zeros(B, S, dtype=torch.bool, device=device)
        return TokenLayout(
            valid=valid, vision=vision, types=types, row=zeros, tau=zeros, i=zeros, j=zeros, T=ones, H=ones,
            W=ones, index=zeros, last=no, grid=grid, row_type=torch.zeros(0, dtype=torch.int64, device=device),
            valid_len=valid_len, split_frames=split_frames, checks=checks,
        )

    gt, gh, gw = grid.unbind(-1)  # (R,) each, in patches
    Tm, Hm, Wm = gt, gh // m, gw // m  # merged grid
    bad_grid = (grid < 1).any(-1) | (gh % m != 0) | (gw % m != 0)  # (R,)
    checks.append(
        Check(
            bad_grid.any(),
            lambda: f"grid_thw rows must be positive and H, W divisible by spatial_merge_size={m}; bad rows "
            f"(index: T, H, W): {[(r, tuple(grid[r].tolist())) for r in bad_grid.nonzero().flatten().tolist()]}",
        )
    )
    n_row = Tm * Hm * Wm  # (R,) tokens per block
    cum = n_row.cumsum(0)  # (R,)
    flat_vis = vision.reshape(-1)
    g = flat_vis.to(torch.int64).cumsum(0) - 1  # (B*S,) global vision index
    n_vis = g[-1] + 1 if g.numel() else torch.zeros((), dtype=torch.int64, device=device)
    checks.append(
        Check(
            n_vis != cum[-1],
            lambda: f"the token types hold {int(n_vis)} image/video tokens but grid_thw describes {int(cum[-1])} "
            f"(sum of T * (H/{m}) * (W/{m}) over its {R} rows); pass exactly one row per vision block, "
            "in order of appearance over the batch",
        )
    )
    row = torch.searchsorted(cum, g, right=True).clamp_(max=R - 1).reshape(B, S)  # (B, S)
    T_tok, H_tok, W_tok = Tm[row], Hm[row].clamp(min=1), Wm[row].clamp(min=1)  # (B, S)
    off = g.reshape(B, S) - (cum[row] - n_row[row])  # (B, S) offset inside the row
    hw = H_tok * W_tok
    tau = off // hw
    rem = off - tau * hw
    i = rem // W_tok
    j = rem - i * W_tok

    vis_types = torch.where(vision, types, zeros)
    prev = torch.cat([zeros[:, :1], vis_types[:, :-1]], dim=1)  # (B, S)
    run_start = vision & (prev != vis_types)  # first token of a run of same-type vision tokens
    row_start = off == 0
    if split_frames:
        frame_start = rem == 0
        misaligned = vision & ((run_start & ~frame_start) | (row_start & ~run_start))
        what = "every vision block (and every run of vision tokens) must start at a frame of its grid"
    else:
        misaligned = vision & (run_start != row_start)
        what = "every vision block must be one run of consecutive image/video tokens matching its grid row"
    checks.append(
        Check(
            misaligned.any(),
            lambda: f"the vision blocks in mm_token_type_ids do not match grid_thw: {what} (rows are taken in "
            "order of appearance; blocks may not span samples, and two blocks need a text token between them)",
        )
    )
    # type of every row: scatter the type of its first token (non-first tokens go to a dump slot R)
    dump = torch.where(vision & row_start, row, torch.full_like(row, R)).reshape(-1)
    row_type = torch.zeros(R + 1, dtype=torch.int64, device=device).scatter_(0, dump, vis_types.reshape(-1))[:R]

    if split_frames:
        last = vision & (rem == hw - 1)
        return TokenLayout(
            valid=valid, vision=vision, types=types, row=row, tau=zeros, i=i, j=j, T=ones, H=H_tok, W=W_tok,
            index=rem, last=last, grid=torch.stack([Tm, Hm, Wm], -1), row_type=row_type, valid_len=valid_len,
            split_frames=True, checks=checks,
        )
    last = vision & (off == n_row[row] - 1)
    return TokenLayout(
        valid=valid, vision=vision, types=types, row=row, tau=tau, i=i, j=j, T=T_tok, H=H_tok, W=W_tok,
        index=off, last=last, grid=torch.stack([Tm, Hm, Wm], -1), row_type=row_type, valid_len=valid_len,
        split_frames=False, checks=checks,
    )
