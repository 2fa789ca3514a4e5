"""The ``grid`` design's ids on CPU in one C pass (``grid_ids.c``, built by :mod:`vlpe.native`).

For unpacked CPU batches the ids, deltas and every check of
:func:`vlpe.encodings.multimodal.grid_ids.grid_position_ids` come from one loop over the tokens: tens of
microseconds for a batch of thousands of tokens, where the tensor form's cost is the fixed cost of its torch
calls. The loop always checks its input (the checks cost nothing there) and declines (None) on any failure,
whatever ``validate`` says; the caller then takes the tensor path, which raises the general path's error
(``validate=True``) or builds the ids without checks, as before. It is not taken under ``torch.compile`` (a ctypes
call would break the graph), without a C compiler, with ``VLPE_NATIVE=0`` or inside ``vlpe.native.off()``.
Equality with the general path on random and corrupted batches is tested in ``tests/test_mm_grid_ids.py``, with a
per-block loop of the released semantics in ``tests/test_mm_fused_ids.py``; both run every case on this path (its
own answer checked) and on the tensor path.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from ... import native

__all__ = ["native_grid_ids", "available"]

_SOURCE = Path(__file__).with_name("grid_ids.c")
#: output dtypes written from the kernel's int64 ids (exact: every id is an integer below 2**62, and below 2**24
#: wherever the float32 tensor path applies)
_DTYPES = frozenset({torch.int64, torch.int32, torch.float32, torch.float64})
_I64 = ctypes.c_int64
_FN: list = []  # [the kernel or None], resolved on first use


def _kernel():
    if not _FN:
        lib = native.library(_SOURCE)
        fn = None
        if lib is not None:
            fn = lib.vlpe_grid_ids
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, _I64, _I64,
                           _I64, _I64, _I64, _I64, _I64, ctypes.c_int, _I64, ctypes.c_void_p, ctypes.c_void_p]
        _FN.append(fn)
    return _FN[0]


def available() -> bool:
    """Whether the C kernel is built and loaded (False: every call takes the tensor path)."""
    return _kernel() is not None


def native_grid_ids(types: Tensor, valid: Tensor | None, grid: Tensor, *, m: int, stride: int, spatial_reset: bool,
                    pad_position: float, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """``(ids (3, B, S), deltas (B, 1))`` from the C kernel, or None where it does not apply (not CPU, under
    ``torch.compile`` or :func:`vlpe.native.off`, no kernel, an output dtype other than int64 / int32 / float32 / float64, a fractional
    ``pad_position``, more than ``2**31`` tokens or a stride of ``2**31``) or a check fails.

    ``types`` ``(B, S)`` integer, ``valid`` ``(B, S)`` bool or None, ``grid`` ``(R, 3)`` int64, all on the CPU
    (any strides)."""
    if types.device.type != "cpu" or grid.device.type != "cpu" or dtype not in _DTYPES:
        return None
    B, S = types.shape
    pad = float(pad_position)
    if B * S >= 1 << 31 or stride >= 1 << 31 or not (math.isfinite(pad) and pad.is_integer()):
        return None
    if native.suspended() or torch.compiler.is_compiling():
        return None
    fn = _kernel()
    if fn is None:
        return None
    if types.dtype != torch.int64:
        types = types.to(torch.int64)
    if valid is not None and valid.device.type != "cpu":
        return None
    ids = torch.empty((3, B, S), dtype=torch.int64)
    deltas = torch.empty((B, 1), dtype=torch.int64)
    ts0, ts1 = types.stride()
    vs0, vs1 = (0, 0) if valid is None else valid.stride()
    gs0, gs1 = grid.stride()
    code = fn(types.data_ptr(), ts0, ts1, None if valid is None else valid.data_ptr(), vs0, vs1,
              grid.data_ptr(), gs0, gs1, grid.shape[0], B, S, m, stride, spatial_reset, int(pad),
              ids.data_ptr(), deltas.data_ptr())
    if code:
        return None
    if dtype != torch.int64:
        return ids.to(dtype), deltas.to(dtype)
    return ids, deltas
