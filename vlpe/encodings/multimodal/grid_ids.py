"""The ``grid`` design's ids (Qwen2-VL MRoPE and the variants that share its layout) in a few fused passes.

The general path (:func:`vlpe.encodings.multimodal.layout.token_layout`, then the design) builds a per-token
description of the batch and assembles positions from it; for the common case of unpacked rows, an integer
temporal stride and ``B * S * stride < 2**23``, :func:`grid_position_ids` gets the same ids with one
``cumsum`` locating each block's last token, one in-place ``cumsum`` of a small int32 buffer of per-block
changes, and float32 divisions (exact below ``2**24``). Its checks (token types, grid rows, vision token
count, blocks across row starts, blocks matching runs of tokens) fold into seven numbers read once; on any
failure it returns None and the general path raises the same error. Equality with the general path, and
declining exactly where it raises, are tested on random and corrupted batches in ``tests/test_mm_grid_ids.py``
(and over every option in ``tests/test_mm_position_ids.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .layout import _as_grid, _checked_inputs, merge_divisor

__all__ = ["grid_position_ids"]


_CONSTS: dict[torch.device, tuple[Tensor, ...]] = {}
_BIG = 1 << 62
#: bounds of the seven quantities :func:`grid_position_ids` checks
_LOWER = (0, -_BIG, 1, -_BIG, -_BIG, 0, 0)
_UPPER = (_BIG, 2, _BIG, 0, 0, 0, 0)


def _consts(device: torch.device) -> tuple[Tensor, ...]:
    """The small constant tensors of :func:`grid_position_ids`, kept per device (never copied to it again):
    ``(4, 1)`` zeros, the ``(4, 1)`` weights of a row's own state and of the previous row's in its change, and
    the ``(7,)`` lower and upper bounds of the checked quantities."""
    consts = _CONSTS.get(device)  # (a torch.device is its own key: no attribute reads per call)
    if consts is None:
        rows = ([[0]] * 4, [[0], [1], [1], [0]], [[1], [-1], [-1], [-1]], _LOWER, _UPPER)
        consts = _CONSTS[device] = tuple(torch.tensor(r, dtype=torch.int64, device=device) for r in rows)
    return consts


def grid_position_ids(
    mm_token_type_ids: Tensor,
    grid_thw: Tensor | None,
    attention_mask: Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    temporal_stride: float = 1,
    spatial_reset: bool = False,
    pad_position: float = 1,
    dtype: torch.dtype | None = None,
    validate: bool = True,
) -> tuple[Tensor, Tensor] | None:
    """The ``grid`` design's ``(ids (3, B, S), deltas (B, 1))`` in a few fused passes, or None where it does not
    apply (no grid rows, a non-integer stride, ``B * S * stride >= 2**23``; packed rows are not taken here) or
    the inputs fail a check: the caller then takes the general path (:func:`token_layout`, the design, the
    assembly), which raises the check's ValueError; the ids are the general path's, exactly.

    The general path's quantities, with fewer passes over the tokens (small tensors: the cost is the number
    of torch ops, so everything per grid row is done on ``R + 1`` values at once):

    1. one int32 buffer ``(4, B*S + 3)`` of per-token increments (slot 0 the initial values, slot ``p + 1``
       the change after token ``p``): the vision tokens, the text tokens (that advance the position);
    2. ``searchsorted`` of the rows' vision counts in the ``cumsum`` of the first row gives the slot after
       every grid row's last token, where the row's change is scattered (``R + 1`` values): the vision count
       drops by the row's size, the position advances by ``max(T, H, W)``, and the current ``H, W`` change;
    3. one ``cumsum`` of the buffer then holds, for every token, its raster offset in its block (0 on text),
       the running position (up to the value at the sample's start) and its block's ``H`` and ``W``;
    4. ``(tau, i, j)`` from the offset by float32 division (exact: every value is an integer below 2**24).

    With ``validate`` the general path's checks are folded into seven integers read once: token types in 0..2,
    merged grids >= 1 with ``H, W`` divisible, the offset 0 at every row start and after the last token, and
    blocks = runs (exactly R runs of one vision type start, each at offset 0). These imply the vision token
    count: a vision token with offset 0 starts a block that has tokens, so R runs at offset 0 need all R blocks
    to have tokens; missing tokens then leave the last block open and extra ones follow its end, and either
    way the offset after the last token is not 0.
    """
    try:
        stride = float(temporal_stride)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(stride) and stride > 0 and stride.is_integer()):
        return None
    stride = int(stride)
    types, valid, m = _checked_inputs(mm_token_type_ids, attention_mask, spatial_merge_size)
    device = types.device
    B, S = types.shape
    N = B * S
    grid = _as_grid(grid_thw, device)
    R = grid.shape[0]
    if R == 0 or N == 0 or N * stride >= 1 << 23:
        return None
    # (tensor indexing costs more than the small ops here: views are taken by narrow / select / unbind)
    zero, this, prev, lower, upper = _consts(device)
    div = merge_divisor(m, device)
    g = torch.floor_divide(torch.cat([grid, div.view(1, 3)]), div)  # (R + 1, 3) merged, a virtual (1, 1, 1) row last
    gH, gW = g.as_strided((R + 1,), (3,), 1), g.as_strided((R + 1,), (3,), 2)  # columns of the fresh g
    n = g.prod(-1)  # (R + 1,) tokens per row
    if stride == 1:
        adv = g.amax(-1)  # max(T - 1, H - 1, W - 1) + 1
    else:
        adv = torch.maximum(torch.maximum((g.select(1, 0) - 1) * stride, gH - 1), gW - 1) + 1
    start = n.cumsum(0) - n  # (R + 1,) vision tokens before each row (start[R]: all of them)
    # buffer rows: 0 position, 1 W, 2 H, 3 offset; change[:, r] = entering row r: position +adv[r - 1], the
    # W and H of row r, offset -n[r - 1] (the vision tokens of row r - 1 are done)
    state = torch.stack([adv, gW, gH, n])  # (4, R + 1)
    before = torch.cat([zero, state.as_strided((4, R), (R + 1, 1))], dim=1)  # the previous row's (none for row 0)
    change = torch.addcmul(state * this, before, prev).to(torch.int32)

    flat = types.reshape(-1)
    vis = types.bool() if valid is None else types.bool() & valid  # (B, S) vision tokens
    flat_vis = vis.view(-1)
    buf = torch.zeros(4, N + 3, dtype=torch.int32, device=device)
    # views of the fresh buffers (offset 0, contiguous) by as_strided: one call where unbind / narrow / view
    # chains cost several
    row = N + 3
    if valid is None:  # text advances the position by one
        torch.logical_not(flat_vis, out=buf.as_strided((N,), (1,), 1))
    else:
        torch.logical_xor(valid.view(-1), flat_vis, out=buf.as_strided((N,), (1,), 1))
    buf.as_strided((N,), (1,), 3 * row + 1).copy_(flat_vis)
    cnt = buf.as_strided((N + 2,), (1,), 3 * row).cumsum(0, dtype=torch.int32)  # (N + 2,) vision tokens before slots
    slots = torch.searchsorted(cnt, start)  # (R + 1,) slot 0, then the slot after each row's last token (N + 2: none)
    buf.scatter_add_(1, slots.expand(4, -1), change)
    acc = buf.cumsum_(1)  # (4, N + 3) in place: token p's values at column p, the end at column N

    if validate:
        lo, hi = torch.aminmax(types)
        vt = flat if valid is None else flat * flat_vis
        starts = torch.empty(N, dtype=torch.bool, device=device)  # a run of one vision type starts here
        torch.ne(vt.narrow(0, 1, N - 1), vt.narrow(0, 0, N - 1), out=starts.as_strided((N - 1,), (1,), 1))
        starts.as_strided((B,), (S,)).fill_(True)  # at every row start
        run = starts & flat_vis
        off = acc.as_strided((N,), (1,), 3 * row)  # the offsets
        found = torch.stack([
            lo, hi,  # token types in 0 .. 2
            g.amin(), torch.remainder(grid, div).amax(),  # merged grids >= 1, H and W divisible by m
            acc.as_strided((B + 1,), (S,), 3 * row).sum(),  # offsets 0 at every row start and at the end
            run.sum() - R, (run * off).sum(),  # blocks = runs: R runs of one type, each at offset 0
        ])
        if not torch.equal(found.clamp(lower, upper), found):
            return None  # the general path raises the ValueError of the first failing check

    accf = acc.float()
    _, W, H, off = accf.unbind(0)  # (N + 3,) each: W, H, offset in the block (the last 3 columns unused)
    line = torch.div(off, W).floor_()  # the block's line: tau * H + i
    torch.addcmul(off, line, W, value=-1, out=off)  # j (over the offset)
    torch.div(line, H, out=W).floor_()  # tau (over W)
    torch.addcmul(line, W, H, value=-1, out=H)  # i (over H)
    coords = accf.as_strided((3, B, S), (row, S, 1), row)  # (tau, i, j)
    if stride != 1:
        W.mul_(stride)
    running = accf.as_strided((B, S), (S, 1)) - accf.as_strided((B, 1), (S, 0))  # position - the row start's
    if spatial_reset:  # h, w local to the block; text carries the running position on every axis
        coords.select(0, 0).add_(running)
        torch.where(vis, coords.narrow(0, 1, 2), running, out=coords.narrow(0, 1, 2))
    else:
        coords.add_(running)
    ends = accf.as_strided((B,), (S,), S) - accf.as_strided((B,), (S,))  # (B,) positions a row advances
    deltas = ends.sub_(S if valid is None else valid.sum(-1))
    work = torch.float64 if (dtype is not None and dtype.is_floating_point) else torch.int64
    dtype = torch.int64 if dtype is None else dtype
    if work == torch.float64:
        ids = coords.to(work)
    else:  # float32 -> int32 (into the spent buffer) -> int64: cheaper than one float32 -> int64 pass
        ints = acc.as_strided((3, B, S), (row, S, 1), row)
        ints.copy_(coords)
        ids = ints.to(torch.int64)
    if valid is not None:
        ids.masked_fill_(~valid, pad_position)
    return ids.to(dtype), deltas.view(B, 1).to(dtype)  # integers below 2**24: exact in every dtype
