"""Rotary tables of a multimodal variant: the frequency matrix of its allocation, then ``(cos, sin)`` of given ids.

:func:`rotary` is the functional API. It is :func:`frequencies` (the ``(A, K)`` matrix, ``(H_kv, A, K)`` per
head, that holds ``inv_freq[k]`` in the row of the axis pair ``k`` reads, scaled) followed by :func:`tables`
(angles ``ids @ F`` in fp32, cos/sin in the Hugging Face half layout). A caller that keeps the frequency matrix
of a device (the transformers integration does) calls :func:`tables` alone per forward; the allocation map
itself is cached per device (:func:`vlpe.encodings.multimodal.allocation_map`), so no call copies host data to
the device after the first.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from ..functional.rope import apply_rope, cos_sin, inv_freq as _inv_freq, rope_angles
from ..functional.scaling import parse_scaling, scale_frequencies
from .allocations import allocation_map, axes_of, frequency_matrix
from .variants import Variant, get_variant

__all__ = ["rotary", "frequencies", "tables", "apply_rotary_pos_emb", "axes_read"]


def axes_read(variant: str | Variant, num_axes: int, *, section: Sequence[int] | None = None) -> int:
    """The number of position axes the tables of ``variant`` read from ids with ``num_axes`` rows: the
    allocation's own count (a single row is broadcast to it), or ``num_axes`` for allocations that read any."""
    v = get_variant(variant)
    if v.layered:
        return num_axes
    sec = tuple(section) if section is not None else v.section
    need = axes_of(v.allocation, sec, v.num_axes())
    if need is None or need == num_axes:
        return num_axes
    if num_axes != 1:
        raise ValueError(
            f"{v.label}: the {v.allocation} allocation reads {need} position axes but position_ids have {num_axes}"
        )
    return need


def frequencies(
    variant: str | Variant,
    *,
    head_dim: int,
    num_axes: int,
    theta: float | None = None,
    num_kv_heads: int | None = None,
    section: Sequence[int] | None = None,
    rotary_dim: int | None = None,
    inv_freq: Tensor | None = None,
    scaling: Mapping[str, Any] | None = None,
    device=None,
) -> tuple[Tensor, float]:
    """``(F, attention_factor)``: the variant's scaled frequency matrix on ``device`` and the factor that
    multiplies cos and sin (YaRN's attention factor; 1 otherwise).

    ``F`` is ``(A, K)`` (``(H_kv, A, K)`` for the ``multi_head`` allocation; ``(1, K)`` for PyPE, whose layers
    each read one axis) with ``K = rotary_dim / 2``; ``num_axes`` is the axis count A the tables read
    (:func:`axes_read`). Arguments as :func:`rotary`.
    """
    v = get_variant(variant)
    sec = tuple(section) if section is not None else v.section
    if rotary_dim is None:  # given frequencies are a model's own: its rotary dim (a Qwen3.5 model's is partial)
        rotary_dim = v.rotary_dim(head_dim) if inv_freq is None else 2 * torch.as_tensor(inv_freq).numel()
    if rotary_dim % 2 or rotary_dim < 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    K = rotary_dim // 2
    theta = v.theta if theta is None else float(theta)
    if theta <= 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    if scaling is not None and inv_freq is not None:
        raise ValueError("give scaling= (vlpe scales the frequencies of theta) or inv_freq= (already scaled), not both")
    if inv_freq is None:
        freqs = _inv_freq(K, theta, dim=rotary_dim, device=device)
    else:
        freqs = torch.as_tensor(inv_freq, device=device).float().reshape(-1)
        if freqs.numel() != K:
            raise ValueError(f"inv_freq must have rotary_dim / 2 = {K} entries, got {freqs.numel()}")
    spectrum = {"hi": 1.0, "lo": theta ** (-(K - 1) / K), "num_pairs": K}  # the frequencies of theta
    if v.layered:  # its allocation reads one axis (Variant checks it)
        amap = allocation_map(v.allocation, num_pairs=K, device=freqs.device)
        F = frequency_matrix(amap, freqs, 1)  # (1, K): every layer is its own 1D position
        plan = parse_scaling(scaling, num_axes=1, who=f"rotary({v.label!r})")
    else:
        amap = allocation_map(v.allocation, num_pairs=K, num_axes=num_axes, section=sec, num_kv_heads=num_kv_heads,
                              device=freqs.device)
        F = frequency_matrix(amap, freqs, num_axes)  # (A, K) or (H_kv, A, K)
        plan = parse_scaling(scaling, num_axes=num_axes, who=f"rotary({v.label!r})")
    F = scale_frequencies(F, plan, **spectrum)
    return F, (1.0 if plan is None else plan.attention_factor)


def tables(
    ids: Tensor,
    freqs: Tensor,
    *,
    layered: bool = False,
    layer: int | None = None,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of ids ``(A, B, S)`` and a frequency matrix from :func:`frequencies` (see :func:`rotary`).

    ``layered``: every row of ``ids`` is one decoder layer's 1D position (PyPE), ``freqs`` is ``(1, K)``; the
    tables are ``(A, B, S, 2K)``, or ``(B, S, 2K)`` of one ``layer``.
    """
    K = freqs.shape[-1]
    if layered:
        if layer is not None:
            if not 0 <= layer < ids.shape[0]:
                raise ValueError(f"layer must be in [0, {ids.shape[0]}) (the PyPE depth), got {layer}")
            ids = ids[layer : layer + 1]
        coords = ids.unsqueeze(-1)  # (L, B, S, 1)
        angles = rope_angles(coords.flatten(0, 1), freqs).reshape(*ids.shape, K)  # (L, B, S, K)
        if layer is not None:
            angles = angles[0]
    else:
        angles = rope_angles(ids.permute(1, 2, 0), freqs)  # (B, S, K) or (B, H_kv, S, K)
    cos, sin = cos_sin(angles)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def rotary(
    variant: str | Variant,
    position_ids: Tensor,
    *,
    head_dim: int,
    theta: float | None = None,
    num_kv_heads: int | None = None,
    allocation: str | None = None,
    section: Sequence[int] | None = None,
    rotary_dim: int | None = None,
    inv_freq: Tensor | None = None,
    attention_scaling: float = 1.0,
    scaling: Mapping[str, Any] | None = None,
    layer: int | None = None,
    dtype: torch.dtype = torch.float32,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` tables in the Hugging Face 5.x convention (half layout, ``cat(angles, angles)``).

    Angles are ``position[axis(k)] * inv_freq[k]`` in fp32 (fp64 for fp64 ids) with autocast off; pairs
    without an axis get cos 1, sin 0. Shapes: ``(B, S, rotary_dim)``, usable with transformers'
    ``apply_rotary_pos_emb``; ``(B, H_kv, S, rotary_dim)`` for the ``multi_head`` allocation (apply with
    :func:`apply_rotary_pos_emb`, which repeats KV-head tables for grouped query heads); for PyPE
    ``(depth, B, S, rotary_dim)``, or ``(B, S, rotary_dim)`` of one ``layer``.

    Args:
        variant: a registered variant name or a :class:`Variant`.
        position_ids: ``(A, B, S)`` from :func:`position_ids` (``(B, S)`` is taken as one axis).
        head_dim: attention head dim; ``rotary_dim`` rotary channels of it (default: the variant's
            :meth:`Variant.rotary_dim`, ``int(head_dim * partial_rotary_factor)``; all of it but for Qwen3.5).
        theta: RoPE base (default: the variant's).
        num_kv_heads: key/value heads (``multi_head`` allocation).
        allocation, section: override the variant's frequency allocation / its section.
        inv_freq: ``(rotary_dim/2,)`` inverse frequencies to use instead of ``theta`` (e.g. YaRN-scaled ones
            from ``transformers.modeling_rope_utils``), with their ``attention_scaling``; without ``rotary_dim``
            they set it (``2 * len(inv_freq)``: a model's own frequencies carry its own partial rotary factor).
        scaling: training-free scaling ``{"type": "linear" | "ntk" | "yarn", "factor": s, ...}``
            (:mod:`vlpe.encodings.functional.scaling`): ``factor`` a scalar or per axis (``{"t": 4}`` scales only
            the pairs that read time), ``original_size`` the training extent in position ids (YaRN); with a
            scalar factor this is transformers' ``rope_type`` linear / yarn of the same ``theta``. YaRN's attention
            factor multiplies cos and sin. PyPE takes one factor for all layers.
        layer: PyPE only: the decoder layer whose table to return.
        dtype: dtype of the returned tables.
        validate: floating ``position_ids`` (fractional designs) must be finite: a NaN id would turn every
            attention row that reads it NaN. One host read of one boolean for float ids (integer ids cannot hold
            NaN: no read); False makes the call free of host syncs, as :func:`position_ids`'s ``validate``.
    """
    v = get_variant(variant, allocation=allocation)
    ids = torch.as_tensor(position_ids)
    if ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"position_ids must be integer or real-valued, got dtype {ids.dtype}")
    if validate and ids.is_floating_point() and not bool(torch.isfinite(ids).all()):
        raise ValueError(
            f"rotary({v.label!r}): position_ids hold NaN or infinite values; every id must be finite (padding "
            f"slots take pad_position, as position_ids() gives them)"
        )
    if ids.dim() == 2:
        ids = ids.unsqueeze(0)
    if ids.dim() != 3:
        raise ValueError(f"position_ids must have shape (A, B, S) (or (B, S)), got {tuple(ids.shape)}")
    layered = v.layered
    if layer is not None and not layered:
        raise ValueError(f"layer= is only for the layer-dependent PyPE design, not {v.label}")
    A = axes_read(v, ids.shape[0], section=section)
    if A != ids.shape[0]:
        ids = ids.expand(A, -1, -1)
    F, factor = frequencies(
        v, head_dim=head_dim, num_axes=1 if layered else A, theta=theta, num_kv_heads=num_kv_heads, section=section,
        rotary_dim=rotary_dim, inv_freq=inv_freq, scaling=scaling, device=ids.device,
    )
    if factor != 1.0:
        attention_scaling = attention_scaling * factor
    return tables(ids, F, layered=layered, layer=layer, attention_scaling=attention_scaling, dtype=dtype)


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """Rotate ``q, k`` ``(B, H, S, D)`` by tables from :func:`rotary` (Hugging Face signature).

    ``(B, S, d)`` tables broadcast over heads (``unsqueeze_dim``) exactly as transformers'
    ``apply_rotary_pos_emb``; per-head ``(B, H_kv, S, d)`` tables are repeated for grouped query heads
    (query head ``j`` uses KV head ``j // (H / H_kv)``). ``d < D`` rotates the first ``d`` channels.
    """
    return rotate_heads(q, cos, sin, unsqueeze_dim), rotate_heads(k, cos, sin, unsqueeze_dim)


def rotate_heads(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """One of :func:`apply_rotary_pos_emb`'s two rotations: ``x`` with its heads on dim ``unsqueeze_dim``
    (``(B, H, S, D)`` for 1, ``(B, S, H, D)`` for 2), per-head tables ``(B, H_kv, S, d)`` read there too."""
    c, s = cos, sin
    if c.dim() == 3:
        c, s = c.unsqueeze(unsqueeze_dim), s.unsqueeze(unsqueeze_dim)
    elif c.dim() == 4:
        if unsqueeze_dim == 2:  # (B, H_kv, S, d) -> (B, S, H_kv, d), the layout of x
            c, s = c.transpose(1, 2), s.transpose(1, 2)
        elif unsqueeze_dim != 1:
            raise ValueError(
                f"per-head rotary tables need the heads of x on dim 1 or 2, got unsqueeze_dim={unsqueeze_dim}"
            )
        H, Hkv = x.shape[unsqueeze_dim], c.shape[unsqueeze_dim]
        if H != Hkv:
            if H % Hkv:
                raise ValueError(f"{H} heads cannot share {Hkv} per-head rotary tables")
            c, s = c.repeat_interleave(H // Hkv, dim=unsqueeze_dim), s.repeat_interleave(H // Hkv, dim=unsqueeze_dim)
    half = c.shape[-1] // 2
    return apply_rope(x, c[..., :half], s[..., :half])
