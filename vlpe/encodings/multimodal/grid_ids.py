"""The ``grid`` design's ids (Qwen2-VL MRoPE and the variants that share its layout) in a few fused passes.

On CPU the ids and every check come from one C loop over the tokens (:mod:`.grid_ids_native`, ``grid_ids.c``)
where it is built; what follows is the tensor path, taken on other devices, under ``torch.compile``, without a C
compiler, and wherever the kernel declines (a failed check: the tensor path then raises or, with
``validate=False``, builds the ids unchecked, as it always did).

The general path (:func:`vlpe.encodings.multimodal.layout.token_layout`, then the design) builds a per-token
description of the batch and assembles positions from it; for the common case of unpacked rows, an integer
temporal stride and ``B * S * stride < 2**23``, :func:`grid_position_ids` gets the same ids with one
``cumsum`` locating each block's last token, in-place ``cumsum`` passes over one int32 buffer of per-token
increments and per-block changes, and float32 divisions (exact below ``2**24``). The calls take a few hundred
microseconds on CPU and their cost is the number of torch calls, so every per-block quantity is computed on
``R + 2`` values at once, the token-sized stages work in place on that buffer, and the checks (token types,
grid rows, blocks matching runs of tokens) fold into one float vector compared with its bounds in one host
read; on any failure it returns None and the general path raises the same error. The work runs in inference
mode (no autograd or view bookkeeping per torch call, a tenth of the cost here) on tensors that die with the
call; the two outputs are made before it, ordinary tensors. Equality with the general
path, and declining exactly where it raises, are tested on random and corrupted batches in
``tests/test_mm_grid_ids.py`` (and over every option in ``tests/test_mm_position_ids.py``); equality with a
per-block Python loop, and the decline of each check on a hand-made layout, in ``tests/test_mm_fused_ids.py``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .grid_ids_native import native_grid_ids
from .layout import _as_grid, _checked_inputs

__all__ = ["grid_position_ids"]


_CONSTS: dict[tuple, tuple[Tensor, ...]] = {}
_INF = float("inf")
#: columns of the per-block state matrix: merged T, H, W, the position advance, the token count, then (with
#: validation) the remainders of T, H, W by the merge divisor
_T, _H, _W, _ADV, _N = range(5)


def _mix(width: int) -> list[list[int]]:
    """``(4, 2 * width)``: the change of (position, W, H, offset) on entering block k, from the state rows of
    blocks ``k - 1`` (first ``width`` columns) and ``k`` (last ``width``): the position advances by the previous
    block's advance, W and H become block k's, the offset drops by the previous block's tokens."""
    mix = [[0] * (2 * width) for _ in range(4)]
    mix[0][_ADV] = 1
    mix[1][_W], mix[1][width + _W] = -1, 1
    mix[2][_H], mix[2][width + _H] = -1, 1
    mix[3][_N] = -1
    return mix


def _consts(device: torch.device, m: int) -> tuple[Tensor, ...]:
    """The small constant tensors of :func:`grid_position_ids`, float32, kept per ``(device, m)`` (never copied
    to the device again): a ``(1, 3)`` zero row, the merge divisor ``(1, m, m)`` as ``(3,)`` and as a ``(1, 3)``
    row, and the ``(4, 10)`` / ``(4, 16)`` mixing matrices of the state without / with the remainder columns."""
    key = (device, m)  # (a torch.device is its own key: no attribute reads per call)
    consts = _CONSTS.get(key)
    if consts is None:
        with torch.inference_mode(False):  # kept across calls: ordinary tensors
            div = torch.tensor([1, m, m], dtype=torch.float32, device=device)
            consts = _CONSTS[key] = (
                torch.zeros(1, 3, dtype=torch.float32, device=device), div, div.view(1, 3),
                *(torch.tensor(_mix(w), dtype=torch.float32, device=device) for w in (5, 8)),
            )
    return consts


@functools.lru_cache(maxsize=64)
def _bounds(R: int, N: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Lower and upper bounds ``(8 (R + 2) + 4,)`` of the checked vector of :func:`grid_position_ids` for ``R``
    grid rows and ``N`` tokens (kept per ``(R, N, device)``, shapes: no tensor value is a key): the state
    matrix (the zero and the virtual rows free; on the R real rows merged T, H, W >= 1, at most N tokens, the
    remainders 0), then the sum of offsets at run boundaries (<= 0), the number of runs (R), the smallest
    (>= 0) and the largest (<= 2) token type. (A block of more than N tokens cannot match the batch: the
    bound keeps the int32 block counts and changes exact whenever the checks pass.)"""
    free = [(-_INF, _INF)] * 8
    real = [(1, _INF)] * 3 + [(-_INF, _INF), (-_INF, N)] + [(0, 0)] * 3
    lower, upper = zip(*(free + real * R + free + [(-_INF, 0), (R, R), (0, _INF), (-_INF, 2)]))
    with torch.inference_mode(False):  # kept across calls: ordinary tensors
        return (torch.tensor(lower, dtype=torch.float32, device=device),
                torch.tensor(upper, dtype=torch.float32, device=device))


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

    The general path's quantities in about 50 torch calls (their number, not the arithmetic, is the cost at
    these sizes), with one token-sized allocation besides the output:

    1. the state of every block ``(R + 2, 5)`` (merged ``T, H, W``, position advance ``max(T, H, W)``, tokens
       ``n``) between a zero row and a virtual ``(1, 1, 1)`` row; one ``mm`` mixes the rows of consecutive
       blocks into the ``(4, R + 1)`` change of (position, W, H, offset) on entering each block;
    2. an int32 buffer of rows (position, W, H, offset, spare[, run boundaries]), each ``B (S + 1) + 1`` long:
       batch row ``b`` owns columns ``b (S + 1)`` (its start) to ``b (S + 1) + S`` (after its last token), the
       last column takes the changes of blocks that never end. Text tokens add 1 to the position after them,
       vision tokens 1 to the offset; ``searchsorted`` of the blocks' vision counts in the ``cumsum`` of the
       offset row gives the column after every block's last token, where the next block's change is scattered;
    3. an in-place ``cumsum`` over W, H and offset (flat: a block's state carries on) and one per batch row over
       the position (it restarts at every row): column ``b (S + 1) + s`` then holds token ``(b, s)``'s raster
       offset in its block (0 on text), its block's W and H, and its position; column ``b (S + 1) + S`` the
       position after the row (the rope delta plus its real tokens);
    4. the buffer converted to float32 in place, ``(tau, i, j)`` from the offset by float32 division (exact:
       every value is an integer below 2**24), the position added, and back to int32 in place.

    With ``validate`` the general path's checks fold into one float vector compared with its bounds, one host
    read: the state matrix (merged grids >= 1 of at most N tokens, remainders by the merge divisor 0), the
    smallest and largest token type (0 .. 2), and one ``mv`` of (offset, vision copy) with the run boundaries
    (token type changes, row starts, row ends): the offsets there sum to 0 (no block is open where a run starts
    or ends, nor across rows) and the vision tokens there, the runs, number R. These are the general path's
    checks: a vision token with offset 0 starts a block that has tokens, so R runs at offset 0 need all R blocks
    to have tokens and each to be one run; a missing or an extra token leaves a block open at a run's end; text
    or padding inside a block, or a block across rows, leaves it open at a run boundary; two blocks of one type
    with no text between them are one run.
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
    if R == 0 or N == 0:
        return None
    dtype = torch.int64 if dtype is None else dtype
    if not dtype.is_floating_point and dtype not in (torch.int64, torch.int32):
        return None  # an output type that may not hold the ids: the general path checks that they fit
    out = native_grid_ids(types, valid, grid, m=m, stride=stride, spatial_reset=spatial_reset,
                          pad_position=pad_position, dtype=dtype)
    if out is not None:  # CPU: one C pass, every check included (None: not taken, or a check failed)
        return out
    if N * stride >= 1 << 23:
        return None
    # the outputs are made here, outside inference mode: ordinary tensors (an index may be saved for backward)
    ids = torch.empty((3, B, S), dtype=dtype, device=device)
    deltas = torch.empty((B, 1), dtype=dtype, device=device)
    # everything else runs in inference mode: no autograd or view tracking per call (a tenth of the call's cost
    # at these sizes), and every tensor made below dies here
    with torch.inference_mode():
        if not _fill(ids, deltas, types, valid, grid, m, stride, spatial_reset, pad_position, validate):
            return None  # the general path raises the ValueError of the first failing check
    return ids, deltas


def _fill(ids: Tensor, deltas: Tensor, types: Tensor, valid: Tensor | None, grid: Tensor, m: int, stride: int,
          spatial_reset: bool, pad_position: float, validate: bool) -> bool:
    """Write :func:`grid_position_ids`' ids ``(3, B, S)`` and deltas ``(B, 1)`` into the given outputs; False
    (outputs unspecified) where a check fails."""
    device = types.device
    B, S = types.shape
    N = B * S
    R = grid.shape[0]
    # (a torch call costs more than these small tensors' arithmetic: views are taken by one as_strided call each)
    zero, div, div_row, mix5, mix8 = _consts(device, m)
    # (R + 2, 3) float32 (BLAS mixes it; exact below 2**24, and a grid value beyond makes a block of more than N
    # tokens, which the checks decline): a zero row first, the virtual block (m, m -> 1, 1, 1) last
    full = torch.cat([zero, grid, div_row])
    g = torch.floor_divide(full, div)  # merged (T, H, W)
    n = g.prod(-1, keepdim=True)  # (R + 2, 1) tokens per block
    if stride == 1:
        adv = g.amax(-1, keepdim=True)  # max(T - 1, H - 1, W - 1) + 1
    else:
        gT, gH, gW = g.unbind(1)
        adv = (torch.maximum(torch.maximum((gT - 1) * stride, gH - 1), gW - 1) + 1).unsqueeze(1)
    if validate:  # the remainders ride along to the checked vector
        state, width, mix = torch.cat([g, adv, n, torch.remainder(full, div)], 1), 8, mix8  # (R + 2, 8)
    else:
        state, width, mix = torch.cat([g, adv, n], 1), 5, mix5  # (R + 2, 5)
    # (4, R + 1): column k mixes the state rows k (block k - 1) and k + 1 (block k)
    change = torch.mm(mix, state.as_strided((2 * width, R + 1), (1, width))).to(torch.int32)

    P = S + 1
    L = B * P
    row = L + 1
    # rows: position, W, H, offset, the vision copy (then a scratch row), the run boundaries (validation); every
    # later stage works in place on this buffer (or on its float32 view): one allocation of the token size
    buf = torch.zeros(5 + validate, row, dtype=torch.int32, device=device)
    vis = types.bool() if valid is None else types.bool() & valid  # (B, S) vision tokens
    if valid is None:  # text advances the position by one
        torch.logical_not(vis, out=buf.as_strided((B, S), (P, 1), 1))
    else:
        torch.logical_xor(valid, vis, out=buf.as_strided((B, S), (P, 1), 1))
    # vision tokens advance the offset; the vision copy (validation) sits at the token's own column
    buf.as_strided((1 + validate, B, S), (L, P, 1), 3 * row + 1).copy_(vis)
    spare = buf.as_strided((L,), (1,), (4 + validate) * row)  # the last row: free until the checks (or the end)
    cnt = torch.cumsum(buf.as_strided((L,), (1,), 3 * row), 0, out=spare)  # (L,) vision tokens up to a column
    # vision tokens before block k (R + 2, 1), int32 like the counts (a mixed-dtype search copies them) while the
    # sums fit (blocks of at most N tokens: the checks decline any other) -> the column after the last token of
    # block k - 1, where the change of block k goes (the last value, the virtual block's end, is unused)
    before = n.cumsum(0, dtype=torch.int32) if (R + 2) * N < 1 << 31 else n.cumsum(0)
    slots = torch.searchsorted(cnt, before)
    buf.scatter_add_(1, slots.as_strided((4, R + 1), (0, 1)), change)
    buf.as_strided((3, L), (row, 1), row).cumsum_(1)  # W, H, offset: a block's state carries across rows
    buf.as_strided((B, P), (P, 1)).cumsum_(1)  # the position restarts at every batch row

    if validate:
        vt = types if valid is None else types * vis  # padding is no run
        st0, st1 = vt.stride()
        at = vt.storage_offset()
        # run boundaries: where the token type changes (compared straight into the buffer), every row start and
        # row end
        torch.ne(vt.as_strided((B, S - 1), (st0, st1), at + st1), vt.as_strided((B, S - 1), (st0, st1), at),
                 out=buf.as_strided((B, S - 1), (P, 1), 5 * row + 1))
        buf.as_strided((B, 2), (P, S), 5 * row).fill_(1)
    acc = buf.view(torch.float32)
    acc.copy_(buf)  # in place (exact: integers below 2**24)
    if validate:
        # (offsets, vision tokens) at the run boundaries
        runs = torch.mv(acc.as_strided((2, L), (row, 1), 3 * row), acc.as_strided((L,), (1,), 5 * row))
        found = torch.cat([state.view(-1), runs, torch.stack(torch.aminmax(types))])  # float32
        lower, upper = _bounds(R, N, device)
        if not torch.equal(found.clamp(lower, upper), found):
            return False

    coords = acc.as_strided((3, B, S), (row, P, 1), row)  # (W, H, offset) -> (tau, i, j) in place
    W, H, off = coords.unbind(0)
    line = torch.div(off, W, out=acc.as_strided((B, S), (P, 1), 4 * row)).floor_()  # the block's line: tau * H + i
    torch.addcmul(off, line, W, value=-1, out=off)  # j (over the offset)
    torch.div(line, H, out=W).floor_()  # tau (over W)
    torch.addcmul(line, W, H, value=-1, out=H)  # i (over H)
    if stride != 1:
        W.mul_(stride)
    pos = acc.as_strided((B, S), (P, 1))
    if spatial_reset:  # h, w local to the block; text carries the running position on every axis
        W.add_(pos)
        torch.where(vis, coords.narrow(0, 1, 2), pos, out=coords.narrow(0, 1, 2))
    else:
        coords.add_(pos)
    # (B, 1) position after each row, less its real tokens (integers below 2**24: exact in every dtype)
    deltas.copy_(acc.as_strided((B, 1), (P, 1), S) - (S if valid is None else valid.sum(-1, keepdim=True)))
    if ids.dtype.is_floating_point:
        ids.copy_(coords)
    else:  # float32 -> int32 in place -> the output's integers: cheaper than one float32 -> int64 pass
        ints = buf.as_strided((3, B, S), (row, P, 1), row)
        ints.copy_(coords)
        ids.copy_(ints)
    if valid is not None:
        ids.masked_fill_(~valid, pad_position)
    return True
