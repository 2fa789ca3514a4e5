"""The multimodal layout on CPU in C (``grid_ids.c``, built by :mod:`vlpe.native`): the ``grid`` design's ids and
:func:`vlpe.encodings.multimodal.merge_grids`.

For unpacked CPU batches the ids, deltas and every check of
:func:`vlpe.encodings.multimodal.grid_ids.grid_position_ids` come from one loop over the tokens: tens of
microseconds for a batch of thousands of tokens, where the tensor form's cost is the fixed cost of its torch
calls. The loop always checks its input (the checks cost nothing there) and declines (None) on any failure,
whatever ``validate`` says; the caller then takes the tensor path, which raises the general path's error
(``validate=True``) or builds the ids without checks, as before. It is not taken under ``torch.compile`` (a ctypes
call would break the graph), without a C compiler, with ``VLPE_NATIVE=0`` or inside ``vlpe.native.off()``.
Equality with the general path on random and corrupted batches is tested in ``tests/test_mm_grid_ids.py``, with a
per-block loop of the released semantics in ``tests/test_mm_fused_ids.py``; both run every case on this path (its
own answer checked) and on the tensor path. ``merge_grids`` of both modalities takes the second kernel, held to a
counting loop on any input in ``tests/test_mm_fused_ids.py`` on both paths.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from ... import native

__all__ = ["native_grid_ids", "native_merge_grids", "available", "SIGNATURES", "DTYPES"]

_SOURCE = Path(__file__).with_name("grid_ids.c")
#: output dtypes written from the kernel's int64 ids (an int32 output goes to the tensor path, whose ids stay below
#: 2**24, so that no cast here can wrap)
DTYPES = frozenset({torch.int64, torch.float32, torch.float64})
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: the argument types of the two C functions (tests/test_native.py reads them against the C source)
SIGNATURES = {
    "vlpe_grid_ids": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int,
                      _I64, _PTR, _PTR],
    "vlpe_merge_grids": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR,
                         _PTR, _PTR],
}
_FN: list = []  # [the two functions by name, or None], resolved on first use


def _kernels() -> dict | None:
    if not _FN:
        lib = native.library(_SOURCE)
        fns = None
        if lib is not None:
            fns = {}
            for name, argtypes in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
                fns[name] = fn
        _FN.append(fns)
    return _FN[0]


def available() -> bool:
    """Whether the C kernels are built and loaded (False: every call takes the tensor path)."""
    return _kernels() is not None


def native_grid_ids(types: Tensor, valid: Tensor | None, grid: Tensor, *, m: int, stride: int, spatial_reset: bool,
                    pad_position: float, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """``(ids (3, B, S), deltas (B, 1))`` from the C kernel, or None where it does not apply (not CPU, under
    ``torch.compile`` or :func:`vlpe.native.off`, no kernel, an output dtype other than int64 / float32 / float64, a
    fractional ``pad_position``, more than ``2**31`` tokens or a stride of ``2**31``) or a check fails.

    ``types`` ``(B, S)`` integer, ``valid`` ``(B, S)`` bool or None, ``grid`` ``(R, 3)`` int64, all on the CPU
    (any strides)."""
    if (types.device.type != "cpu" or grid.device.type != "cpu" or dtype not in DTYPES
            or (valid is not None and valid.device.type != "cpu")):
        return None
    B, S = types.shape
    pad = float(pad_position)
    if B * S >= 1 << 31 or stride >= 1 << 31 or not (math.isfinite(pad) and pad.is_integer()):
        return None
    if native.suspended() or torch.compiler.is_compiling():
        return None
    fns = _kernels()
    if fns is None:
        return None
    if types.dtype != torch.int64:
        types = types.to(torch.int64)
    ids = torch.empty((3, B, S), dtype=torch.int64)
    deltas = torch.empty((B, 1), dtype=torch.int64)
    ts0, ts1 = types.stride()
    vs0, vs1 = (0, 0) if valid is None else valid.stride()
    gs0, gs1 = grid.stride()
    code = fns["vlpe_grid_ids"](types.data_ptr(), ts0, ts1, None if valid is None else valid.data_ptr(), vs0, vs1,
                                grid.data_ptr(), gs0, gs1, grid.shape[0], B, S, m, stride, spatial_reset, int(pad),
                                ids.data_ptr(), deltas.data_ptr())
    if code:
        return None
    if dtype != torch.int64:
        return ids.to(dtype), deltas.to(dtype)
    return ids, deltas


def native_merge_grids(types: Tensor, attention_mask, images: Tensor, videos: Tensor,
                       m: int) -> tuple[Tensor, Tensor] | None:
    """:func:`vlpe.encodings.multimodal.merge_grids` of both modalities from the C kernel: ``(grid (R, 3), kinds
    (R,))``, or None where it does not apply (not CPU, under ``torch.compile`` or :func:`vlpe.native.off`, no
    kernel, token types that are not integers, a mask of another size, more than ``2**31`` tokens or rows, a grid
    value below 0 or a row of more than ``B * S`` tokens); the tensor form then runs.

    ``types`` ``(B, S)``; ``images`` ``(Ri, 3)`` and ``videos`` ``(Rv, 3)`` int64 on the same device."""
    if (types.device.type != "cpu" or images.device.type != "cpu" or videos.device.type != "cpu"
            or types.is_floating_point() or types.is_complex() or types.dtype == torch.bool):
        return None
    B, S = types.shape
    Ri, Rv = images.shape[0], videos.shape[0]
    if B * S >= 1 << 31 or Ri + Rv >= 1 << 31 or native.suspended() or torch.compiler.is_compiling():
        return None
    fns = _kernels()
    if fns is None:
        return None
    valid = None
    if attention_mask is not None:
        valid = torch.as_tensor(attention_mask)
        if valid.device.type != "cpu" or valid.numel() != B * S:
            return None
        valid = valid.reshape(-1).bool().contiguous()
    if types.dtype != torch.int64:
        types = types.to(torch.int64)
    R = Ri + Rv
    first = torch.empty(R, dtype=torch.int64)
    grid = torch.empty((R, 3), dtype=torch.int64)
    kinds = torch.empty(R, dtype=torch.int64)
    ts0, ts1 = types.stride()
    is0, is1 = images.stride()
    ws0, ws1 = videos.stride()
    code = fns["vlpe_merge_grids"](types.data_ptr(), ts0, ts1, None if valid is None else valid.data_ptr(), B, S,
                                   images.data_ptr(), is0, is1, Ri, videos.data_ptr(), ws0, ws1, Rv, m,
                                   first.data_ptr(), grid.data_ptr(), kinds.data_ptr())
    return None if code else (grid, kinds)
