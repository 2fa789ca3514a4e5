"""Frequency allocations: which rotary pair (and, for multi-head, which KV head) reads which position axis.

An allocation is an integer map over the ``K = rotary_dim / 2`` rotation pairs (pair ``k`` rotates the
channels ``(k, k + K)``, Hugging Face half layout; ``k = 0`` is the highest frequency), shape ``(K,)``, or
``(H_kv, K)`` for per-head allocations. Entries are axis indices; ``-1`` marks pairs that carry no position
(cos = 1, sin = 0). :func:`frequency_matrix` turns a map into the ``(A, K)`` (or ``(H_kv, A, K)``) matrix that
:func:`vlpe.encodings.functional.rope.rope_angles` multiplies the ``(B, S, A)`` coordinates with, so every
allocation shares one fp32 angle computation.

=====================  ======================================================================================
name                   map (defaults for K = 64)
=====================  ======================================================================================
``none``               every pair reads axis 0: plain 1D RoPE (designs with a single axis: 1D, V2PE, PyPE)
``chunked``            consecutive chunks per axis, ``section`` pairs each; Qwen2-VL ``mrope_section``
                       [16, 24, 24]: t 0-15, h 16-39, w 40-63
``interleaved``        axis ``a > 0`` takes ``k = a (mod A)`` for ``k < A * section[a]``, axis 0 the rest;
                       MRoPE-I / Qwen3-VL [24, 20, 20]: t h w t h w ... t t t t; VRoPE [16]*4: ``k mod 4``
``round_robin``        pair ``k`` reads axis ``k mod A``: ``interleaved`` with section ``ceil((K - a) / A)``;
                       Qwen3.5 [11, 11, 10] at K = 32 (its 64 rotary channels of 256)
``distributed``        MM-RoPE (Lumos-1): meta components of 8 pairs ``t t h w h w h w``, pair ``k`` reads
                       ``(0, 0, 1, 2, 1, 2, 1, 2)[k mod 8]``: [16, 24, 24] at K = 64, every axis in every band;
                       the pattern is fixed (a section other than its census is refused)
``multi_head``         ``section`` counts KV heads per axis (MHRoPE [2, 3, 3] of 8); a head uses all pairs of
                       its axis, heads beyond the section sum carry no position; the default section needs
                       at least 4 KV heads (below that time would get none: an error)
``low_freq_temporal``  VideoRoPE LTA [16, 24, 24]: pairs below ``K - section[0]`` alternate h (even k) / w
                       (odd k), the lowest-frequency ``section[0]`` pairs read t
``hybrid``             HoPE HFA: as ``low_freq_temporal`` with the temporal band carrying no position
=====================  ======================================================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["Allocation", "ALLOCATIONS", "get_allocation", "allocation_map", "default_section", "frequency_matrix",
           "axes_of"]

#: the fewest KV heads the ``multi_head`` default section serves (it gives time ``num_kv_heads // 4`` of them)
MIN_MULTI_HEAD_KV = 4


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """One frequency allocation as data: its map, its default section and the facts callers read instead of
    comparing names. The methods and released sections are the table above (Qwen2-VL, MRoPE-I / Qwen3-VL, MHRoPE,
    VideoRoPE, HoPE, VRoPE); the census tests of tests/test_mm_rotary.py check every map against them.

    Attributes:
        name: the allocation's name (its key in :data:`ALLOCATIONS`).
        build: ``(k, K, A, section, num_kv_heads) -> map``, ``k = arange(K)``; the section is already resolved.
        default_section: ``(K, A, num_kv_heads) -> section``, the released values scaled to ``K`` pairs.
        axes: the number of position axes read without a section (None: the design's count); ignored when
            ``one_axis``.
        section_sets_axes: a given section's length is the number of axes read (one entry per axis).
        one_axis: every pair reads axis 0 (plain 1D RoPE): ids of any axis count, takes no section; the only
            kind a layer-dependent design (one 1D position per layer, PyPE) pairs with.
        per_head: the map is per KV head, ``(H_kv, K)``, and the tables ``(B, H_kv, S, D)``.
    """

    name: str
    build: Callable[[Tensor, int, int, tuple[int, ...], int | None], Tensor]
    default_section: Callable[[int, int, int | None], tuple[int, ...]]
    axes: int | None = 3
    section_sets_axes: bool = True
    one_axis: bool = False
    per_head: bool = False

    def axes_read(self, section: Sequence[int] | None, num_axes: int) -> int | None:
        """Number of position axes this allocation reads (None: any, it only reads axis 0)."""
        if self.one_axis:
            return None
        if section is not None and self.section_sets_axes:
            return len(section)
        return num_axes if self.axes is None else self.axes


def _thirds(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    t = K // 4
    w = (K - t) // 2
    return (t, K - t - w, w)  # [16, 24, 24] at K = 64


def _interleaved_section(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    if A == 3:
        hw = (K * 5) // 16
        return (K - 2 * hw, hw, hw)  # [24, 20, 20] at K = 64
    per = K // A
    return (K - per * (A - 1),) + (per,) * (A - 1)


def _round_robin_section(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    return tuple((K - a + A - 1) // A for a in range(A))  # [11, 11, 10] at K = 32, A = 3


#: MM-RoPE's meta component: the axis of each of 8 consecutive pairs (2 t : 3 h : 3 w)
DISTRIBUTED_PATTERN = (0, 0, 1, 2, 1, 2, 1, 2)


def _distributed_section(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    axes = [DISTRIBUTED_PATTERN[k % len(DISTRIBUTED_PATTERN)] for k in range(K)]
    return tuple(axes.count(a) for a in range(3))  # [16, 24, 24] at K = 64


def _build_distributed(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
    fixed = _distributed_section(K, A, num_kv_heads)
    if tuple(sec) != fixed:
        raise ValueError(
            f"distributed allocation: the pattern t t h w h w h w is fixed, so its section at {K} pairs is "
            f"{list(fixed)}, got {list(sec)}; omit section (or use the interleaved / chunked allocation)"
        )
    return torch.tensor(DISTRIBUTED_PATTERN, dtype=torch.int64)[k % len(DISTRIBUTED_PATTERN)]  # (K,)


def _head_section(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    if num_kv_heads is None:
        raise ValueError("the multi_head allocation needs num_kv_heads (the number of key/value heads)")
    if isinstance(num_kv_heads, bool) or int(num_kv_heads) != num_kv_heads or num_kv_heads < MIN_MULTI_HEAD_KV:
        raise ValueError(
            f"the multi_head allocation's default section gives time num_kv_heads // 4 KV heads, so it needs "
            f"num_kv_heads >= {MIN_MULTI_HEAD_KV} (with fewer, time would get no head); got num_kv_heads="
            f"{num_kv_heads!r}: use a model with at least {MIN_MULTI_HEAD_KV} KV heads or pass section=[t, h, w] "
            f"(KV heads per axis, e.g. [1, 1, 1] of 3)"
        )
    t = num_kv_heads // 4
    w = (num_kv_heads - t) // 2
    return (t, num_kv_heads - t - w, w)  # [2, 3, 3] of 8 KV heads


def _no_section(K: int, A: int, num_kv_heads: int | None) -> tuple[int, ...]:
    return ()


def _build_none(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
    return torch.zeros(K, dtype=torch.int64)  # (K,) every pair reads axis 0


def _build_chunked(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
    if sum(sec) != K:
        raise ValueError(f"chunked allocation: section {list(sec)} must sum to the {K} rotary pairs (head_dim / 2)")
    return torch.repeat_interleave(torch.arange(len(sec)), torch.tensor(sec))  # (K,)


def _build_interleaved(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
    if sum(sec) != K:
        raise ValueError(f"interleaved allocation: section {list(sec)} must sum to the {K} rotary pairs")
    amap = torch.zeros(K, dtype=torch.int64)  # (K,)
    for a in range(1, A):  # a handful of axes, not tokens
        amap[(k % A == a) & (k < A * sec[a])] = a
    counts = torch.bincount(amap, minlength=A).tolist()
    if tuple(counts) != sec:
        raise ValueError(
            f"interleaved allocation: section {list(sec)} cannot be interleaved over {K} pairs (axis a > 0 takes "
            f"pairs k = a mod {A} below {A} * section[a]; this gives {counts}); give axis 0 the largest share"
        )
    return amap


def _build_heads(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
    if num_kv_heads is None or num_kv_heads < 1:
        raise ValueError("multi_head allocation: num_kv_heads (number of key/value heads) must be >= 1")
    if sum(sec) > num_kv_heads:
        raise ValueError(
            f"multi_head allocation: section {list(sec)} assigns {sum(sec)} KV heads but the model has "
            f"num_kv_heads={num_kv_heads}"
        )
    head_axis = torch.full((num_kv_heads,), -1, dtype=torch.int64)  # (H_kv,)
    head_axis[: sum(sec)] = torch.repeat_interleave(torch.arange(len(sec)), torch.tensor(sec))
    return head_axis.view(-1, 1).expand(num_kv_heads, K).clone()  # (H_kv, K)


def _build_temporal_band(temporal: int, name: str):
    """The map of ``low_freq_temporal`` (band ``temporal = 0``, time) and ``hybrid`` (``-1``, no position)."""

    def build(k: Tensor, K: int, A: int, sec: tuple[int, ...], num_kv_heads: int | None) -> Tensor:
        if len(sec) != 3 or sum(sec) != K:
            raise ValueError(
                f"{name} allocation: section [t, h, w] must have 3 entries summing to {K}, got {list(sec)}"
            )
        spatial = K - sec[0]
        if (sec[1], sec[2]) != ((spatial + 1) // 2, spatial // 2):
            raise ValueError(
                f"{name} allocation: the {spatial} spatial pairs alternate h/w, so section must be "
                f"[{sec[0]}, {(spatial + 1) // 2}, {spatial // 2}], got {list(sec)}"
            )
        amap = torch.where(k % 2 == 0, 1, 2)  # (K,) h on even pairs, w on odd ones
        return torch.where(k >= spatial, temporal, amap).to(torch.int64)

    return build


#: every frequency allocation by name, in the order of the table above
ALLOCATIONS: dict[str, Allocation] = {
    a.name: a
    for a in (
        Allocation(name="none", build=_build_none, default_section=_no_section, axes=None, one_axis=True),
        Allocation(name="chunked", build=_build_chunked, default_section=_thirds),
        Allocation(name="interleaved", build=_build_interleaved, default_section=_interleaved_section, axes=None),
        Allocation(name="round_robin", build=_build_interleaved, default_section=_round_robin_section, axes=None),
        Allocation(name="distributed", build=_build_distributed, default_section=_distributed_section,
                   section_sets_axes=False),
        Allocation(name="multi_head", build=_build_heads, default_section=_head_section, per_head=True),
        Allocation(name="low_freq_temporal", build=_build_temporal_band(0, "low_freq_temporal"),
                   default_section=_thirds, section_sets_axes=False),
        Allocation(name="hybrid", build=_build_temporal_band(-1, "hybrid"), default_section=_thirds,
                   section_sets_axes=False),
    )
}


def get_allocation(allocation: str | Allocation) -> Allocation:
    """The :class:`Allocation` of a name (or the Allocation itself); ``ValueError`` naming them all otherwise."""
    if isinstance(allocation, Allocation):
        return allocation
    if not isinstance(allocation, str) or allocation not in ALLOCATIONS:
        raise ValueError(f"unknown frequency allocation {allocation!r}; allocations are: {', '.join(ALLOCATIONS)}")
    return ALLOCATIONS[allocation]


def default_section(
    allocation: str, num_pairs: int, num_axes: int = 3, num_kv_heads: int | None = None
) -> tuple[int, ...]:
    """The default ``section`` of an allocation, scaled to ``num_pairs`` (the released values at K = 64)."""
    return get_allocation(allocation).default_section(num_pairs, num_axes, num_kv_heads)


def axes_of(allocation: str, section: Sequence[int] | None, num_axes: int) -> int | None:
    """Number of position axes an allocation reads (None: any, it only reads axis 0)."""
    return get_allocation(allocation).axes_read(section, num_axes)


def _section(allocation, section, K, A, num_kv_heads) -> tuple[int, ...]:
    if section is None:
        return default_section(allocation, K, A, num_kv_heads)
    sec = tuple(section)
    if any(int(s) != s or s < 0 for s in sec):
        raise ValueError(f"{allocation} allocation: section must hold non-negative integers, got {list(section)}")
    return tuple(int(s) for s in sec)


def allocation_map(
    allocation: str,
    *,
    num_pairs: int,
    num_axes: int = 3,
    section: Sequence[int] | None = None,
    num_kv_heads: int | None = None,
    device=None,
) -> Tensor:
    """The pair -> axis map, ``(K,)`` int64 (``(H_kv, K)`` for ``multi_head``); ``-1`` = no position.

    With a ``device`` the map is built on the host once per distinct arguments and device, and the cached device
    tensor is returned from then on (treat it as read-only); without one a fresh host tensor.

    Args:
        allocation: one of :data:`ALLOCATIONS`.
        num_pairs: ``K = rotary_dim / 2``.
        num_axes: number of position axes (used by ``interleaved`` without an explicit section).
        section: pairs per axis (``chunked``, ``interleaved``, ``low_freq_temporal``, ``hybrid``; the
            temporal count for the last two) or KV heads per axis (``multi_head``); None for the default.
        num_kv_heads: key/value heads (``multi_head`` only).
    """
    if device is None:
        return _allocation_map(allocation, int(num_pairs), num_axes, section, num_kv_heads)  # built on the host
    key = (allocation, int(num_pairs), int(num_axes), None if section is None else tuple(section),
           None if num_kv_heads is None else int(num_kv_heads))
    return _on_device(*key, torch.device(device))


@functools.lru_cache(maxsize=256)
def _on_device(allocation, K, num_axes, section, num_kv_heads, device) -> Tensor:
    """The map copied to ``device`` once per (allocation, shape, device): later calls reuse the device tensor
    (no host-to-device copy per call). Shared: never modified in place."""
    with torch.inference_mode(False), torch.no_grad():
        return _allocation_map(allocation, K, num_axes, section, num_kv_heads).to(device)


def _allocation_map(allocation, K, num_axes, section, num_kv_heads) -> Tensor:
    alloc = get_allocation(allocation)
    if K < 1:
        raise ValueError(f"rotary allocations need at least one rotation pair, got num_pairs={K}")
    if alloc.one_axis:
        if section is not None:
            raise ValueError(f"the {alloc.name!r} allocation (plain 1D RoPE) takes no section")
        return alloc.build(torch.arange(K), K, 1, (), num_kv_heads)
    A = alloc.axes_read(section, num_axes)
    sec = _section(alloc.name, section, K, A, num_kv_heads)
    return alloc.build(torch.arange(K), K, A, sec, num_kv_heads)  # (K,) or (H_kv, K)


def frequency_matrix(amap: Tensor, inv_freq: Tensor, num_axes: int) -> Tensor:
    """``(A, K)`` (or ``(H, A, K)``) matrix with ``inv_freq[k]`` in row ``amap[k]`` and zeros elsewhere."""
    axes = torch.arange(num_axes, device=amap.device).view(-1, 1)  # (A, 1)
    onehot = amap.unsqueeze(-2) == axes  # (..., A, K)
    return onehot.to(torch.float32) * inv_freq.float().to(amap.device)
