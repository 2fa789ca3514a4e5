"""Training-free RoPE scaling (linear / NTK / YaRN) for any frequency matrix, one axis at a time.

Position interpolation (Chen et al. 2023, arXiv 2306.15595), NTK-aware scaling (the "NTK-aware scaled RoPE"
note: base ``theta * s ** (d / (d - 2))``) and YaRN (Peng et al., arXiv 2309.00071) as transformers'
``modeling_rope_utils`` defines them for 1D (``_compute_linear_scaling_rope_parameters``,
``_compute_dynamic_ntk_parameters``, ``_compute_yarn_parameters``); the tests check inverse frequencies and the
attention factor against those functions. Here they act on a frequency matrix ``(..., A, P)`` (entry
``[a, p]``: how fast pair ``p`` turns per unit of axis ``a``), per axis, so every rotary encoding shares them:

* ``linear``: every frequency of axis ``a`` is divided by ``s_a`` (positions divided by ``s_a``).
* ``ntk``: a frequency at spectral index ``j`` of its axis' band of ``P`` pairs is multiplied by
  ``s ** (-j / (P - 1))``: the highest frequency is kept, the lowest divided by ``s`` (geometric in between),
  exactly the inverse frequencies of base ``theta * s ** (2P / (2P - 2))``.
* ``yarn``: "NTK-by-parts": with ``r = L_a * omega / (2 pi)`` rotations over the original extent ``L_a``,
  pairs above ``beta_fast`` rotations keep their frequency, pairs below ``beta_slow`` are divided by ``s``, a
  linear ramp over the spectral index between them (``truncate``: bounds rounded to whole pairs, transformers'
  default); the attention temperature ``attention_factor = 0.1 ln(s) + 1`` multiplies cos and sin as
  transformers does, so logits scale by ``attention_factor ** 2``.

The spectral index of a frequency ``omega`` is ``j = (P - 1) log(hi / |omega|) / log(hi / lo)`` for the axis'
reference spectrum (``hi`` = its highest, ``lo`` its lowest of ``P`` geometric frequencies): exactly the pair
index for fixed RoPE frequencies, and for learned ones (RoPE-Mixed, ComRoPE) the place a frequency of that
magnitude would have. Signs are kept, zero frequencies stay zero; ``j`` is clamped to ``[0, P - 1]`` for NTK
(never faster than the original, never slower than linear interpolation).

Vision: the "original length" ``L_a`` (``original_size``, the 1D ``original_max_position_embeddings``) is
the training grid's extent along axis ``a`` in the coordinate units the encoding reads (patches; 14 for
224 px images of 16 px patches). ``factor`` is a scalar, a sequence of one value per axis, or a dict by axis
name (``t``/``h``/``w``, or the axis index): ``{"t": 4}`` scales only time, ``(2, 2)`` both image axes.
With per-axis factors the YaRN temperature uses the largest one (for decoders, whose axes advance together,
this is transformers' value); ``attention_factor`` sets it explicitly.

VideoRoPE++'s YaRN-V (Wei et al. 2025; Wiselnn570/VideoRoPE @ 7712ca3, ``videorope_plus`` vLLM
``MRotaryEmbedding``, branch ``videorope++_v1``) is not this module's ``yarn``: it keeps the spatial pairs and gives the
temporal ones the NTK base ``theta * r ** (d / (d - 2))``, ``r = (factor * L0 - 1) / (L0 - 1)``, without a temperature,
i.e. ``{"type": "ntk", "factor": {"t": r}}`` on VideoRoPE's allocation (equal to fp32 rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["SCALING_TYPES", "RopeScaling", "parse_scaling", "scale_frequencies", "resolution_scaling", "axis_names"]

SCALING_TYPES = ("linear", "ntk", "yarn")
_KEYS = (
    "type", "factor", "original_size", "original_max_position_embeddings", "beta_fast", "beta_slow",
    "attention_factor", "mscale", "mscale_all_dim", "truncate",
)
_YARN_ONLY = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
_NAMES = {1: ("t",), 2: ("h", "w"), 3: ("t", "h", "w")}


def axis_names(num_axes: int) -> tuple[str, ...]:
    """Names a per-axis dict may use: ``t`` (1 axis), ``h, w`` (2), ``t, h, w`` (3); indices always work."""
    return _NAMES.get(num_axes, ())


@dataclass(frozen=True)
class RopeScaling:
    """A validated scaling config: per-axis ``factor`` and ``original`` (None where not given)."""

    type: str
    factor: tuple[float, ...]
    original: tuple[float | None, ...]
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    @property
    def num_axes(self) -> int:
        return len(self.factor)


def _per_axis(value: Any, num_axes: int, names: Sequence[str], key: str, who: str, default: Any) -> list:
    """A scalar, a length-A sequence or a dict by axis name / index -> a list of A values."""
    if isinstance(value, Mapping):
        out = [default] * num_axes
        for k, v in value.items():
            if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < num_axes:
                a = k
            elif isinstance(k, str) and k in names:
                a = list(names).index(k)
            else:
                valid = ", ".join([*map(repr, names), *map(str, range(num_axes))])
                raise ValueError(
                    f"{who}: scaling {key} names axis {k!r}, but this encoding has {num_axes} axes "
                    f"(valid keys: {valid})"
                )
            out[a] = v
        return out
    if isinstance(value, (list, tuple)):
        if len(value) != num_axes:
            raise ValueError(
                f"{who}: scaling {key} {list(value)} has {len(value)} entries; give one per axis ({num_axes}), "
                f"a scalar, or a dict by axis"
            )
        return list(value)
    return [value] * num_axes


def _number(v: Any, key: str, who: str, *, positive: bool = True) -> float:
    if isinstance(v, Tensor):
        raise ValueError(f"{who}: scaling {key} must be a Python number (not a tensor), got {v!r}")
    if isinstance(v, bool):  # float(True) is 1.0: a flag where a number belongs is a mistake, never a factor
        raise ValueError(f"{who}: scaling {key} must be a number such as 2.0, got the boolean {v!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{who}: scaling {key} must be a number, got {v!r}") from None
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{who}: scaling {key} must be a finite number > 0, got {v!r}")
    return x


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_scaling(
    cfg: Mapping[str, Any] | RopeScaling | None, *, num_axes: int, names: Sequence[str] | None = None,
    who: str = "rope scaling",
) -> RopeScaling | None:
    """Validate a scaling dict ``{"type": "linear" | "ntk" | "yarn", "factor": s, ...}`` for ``num_axes`` axes.

    Keys: ``type``, ``factor`` (scalar / per axis), ``original_size`` (alias ``original_max_position_embeddings``;
    the training extent per axis, required by YaRN), ``attention_factor``, and for YaRN ``beta_fast`` (32),
    ``beta_slow`` (1), ``mscale`` / ``mscale_all_dim`` (DeepSeek's temperature ratio) and ``truncate`` (True).
    Raises ValueError for an unknown type or key, a non-positive factor, or an axis the encoding lacks.
    """
    if cfg is None:
        return None
    names = axis_names(num_axes) if names is None else tuple(names)
    if isinstance(cfg, RopeScaling):
        if cfg.num_axes != num_axes:
            raise ValueError(f"{who}: the scaling was made for {cfg.num_axes} axes, this encoding has {num_axes}")
        return cfg
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{who}: scaling must be a dict like {{'type': 'yarn', 'factor': 2.0}} or None, got {cfg!r}")
    unknown = sorted(set(map(str, cfg)) - set(_KEYS))
    if unknown:
        raise ValueError(f"{who}: unknown scaling key(s) {unknown}; valid keys: {', '.join(_KEYS)}")
    kind = cfg.get("type")
    if kind not in SCALING_TYPES:
        raise ValueError(f"{who}: scaling type must be one of {', '.join(map(repr, SCALING_TYPES))}, got {kind!r}")
    if kind != "yarn":
        bad = sorted(k for k in _YARN_ONLY if k in cfg)
        if bad:
            raise ValueError(f"{who}: scaling key(s) {bad} are YaRN options; type is {kind!r}")
    if "factor" not in cfg:
        raise ValueError(f"{who}: scaling needs a 'factor' (a scalar, one per axis, or a dict by axis)")
    factor = [_number(f, "factor", who) for f in _per_axis(cfg["factor"], num_axes, names, "factor", who, 1.0)]
    if "original_size" in cfg and "original_max_position_embeddings" in cfg:
        raise ValueError(f"{who}: give original_size or original_max_position_embeddings, not both")
    orig_cfg = cfg.get("original_size", cfg.get("original_max_position_embeddings"))
    original: list[float | None] = [None] * num_axes
    if orig_cfg is not None:
        original = [
            None if o is None else _number(o, "original_size", who)
            for o in _per_axis(orig_cfg, num_axes, names, "original_size", who, None)
        ]
    beta_fast = _number(cfg.get("beta_fast", 32.0), "beta_fast", who)
    beta_slow = _number(cfg.get("beta_slow", 1.0), "beta_slow", who)
    if kind == "yarn":
        if beta_fast <= beta_slow:
            raise ValueError(f"{who}: YaRN needs beta_fast > beta_slow, got {beta_fast} and {beta_slow}")
        missing = [a for a, (f, o) in enumerate(zip(factor, original)) if o is None and f != 1.0]
        if missing:
            raise ValueError(
                f"{who}: YaRN needs original_size, the training extent of every scaled axis (in the coordinate "
                f"units the encoding reads, e.g. 14 patches for 224 px / 16 px patches); axes {missing} have none"
            )
    s = max(factor)
    if cfg.get("attention_factor") is not None:
        attention = _number(cfg["attention_factor"], "attention_factor", who)
    elif kind == "yarn":
        m, m_all = cfg.get("mscale"), cfg.get("mscale_all_dim")
        if m and m_all:
            attention = _mscale(s, _number(m, "mscale", who)) / _mscale(s, _number(m_all, "mscale_all_dim", who))
        else:
            attention = _mscale(s)
    else:
        attention = 1.0
    truncate = cfg.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{who}: scaling truncate must be True or False, got {truncate!r}")
    return RopeScaling(
        type=kind, factor=tuple(factor), original=tuple(original), beta_fast=beta_fast, beta_slow=beta_slow,
        attention_factor=float(attention), truncate=truncate,
    )


def _on(x: Any, like: Tensor) -> Tensor:
    """``x`` (a float, a per-axis sequence -> ``(A, 1)``, or a tensor) as fp64 on ``like``'s device, filled there
    (no host-to-device copy of Python numbers on the forward path)."""
    if isinstance(x, Tensor):
        return x.to(device=like.device, dtype=torch.float64)
    if isinstance(x, (list, tuple)):
        if len(set(x)) == 1:
            return torch.full((len(x), 1), float(x[0]), dtype=torch.float64, device=like.device)
        out = torch.empty(len(x), 1, dtype=torch.float64, device=like.device)  # (A, 1)
        for a, v in enumerate(x):  # axes, not tokens
            out[a].fill_(float(v))
        return out
    return torch.full((), float(x), dtype=torch.float64, device=like.device)


def scale_frequencies(
    freqs: Tensor, scaling: RopeScaling | None, *, hi: Any = 1.0, lo: Any, num_pairs: Any, factor: Tensor | None = None
) -> Tensor:
    """``freqs`` ``(..., A, P)`` scaled per axis (axis dim -2) by ``scaling``; the same tensor for None.

    Args:
        freqs: frequency matrix, fp32 (fp64 kept); any leading dims (layers, heads) broadcast.
        scaling: from :func:`parse_scaling` for A axes.
        hi, lo, num_pairs: the reference spectrum of each entry's band: highest and lowest of ``num_pairs``
            geometric frequencies (floats, per-axis sequences, or tensors broadcastable to ``freqs``). For
            ``inv_freq(P, theta)`` this is ``hi = 1, lo = theta ** (-(P - 1) / P)``.
        factor: a factor computed on device, broadcastable to ``(A, 1)``, instead of ``scaling.factor`` (e.g.
            transformers' dynamic NTK, whose factor follows the sequence length; no host read).

    Differentiable in ``freqs`` (learned frequencies keep their gradient); computed in fp64, autocast off,
    returned in ``freqs``' dtype. Multiply cos/sin by ``scaling.attention_factor`` afterwards.
    """
    if scaling is None:
        return freqs
    A = freqs.shape[-2]
    if scaling.num_axes != A:
        raise ValueError(f"scaling for {scaling.num_axes} axes applied to a frequency matrix with {A} axes")
    with torch.autocast(freqs.device.type, enabled=False):
        f = freqs.double()
        s = _on(scaling.factor if factor is None else factor, f)  # (A, 1)
        if scaling.type == "linear":
            return (f / s).to(freqs.dtype)
        w = f.abs()
        if not isinstance(num_pairs, Tensor) and min(num_pairs if isinstance(num_pairs, (list, tuple)) else [num_pairs]) < 2:
            raise ValueError(f"{scaling.type} scaling needs at least 2 rotation pairs per axis, got {num_pairs}")
        hi_t, lo_t, P = _on(hi, f), _on(lo, f), _on(num_pairs, f)
        span = torch.log(hi_t / lo_t).clamp_min(1e-12)  # log range of the band
        safe = torch.where(w > 0, w, torch.ones_like(w))
        j = (P - 1) * torch.log(hi_t / safe) / span  # (..., A, P) spectral index, 0 = highest
        if scaling.type == "ntk":
            top = (P - 1).clamp_min(1)
            gain = s ** (-torch.minimum(j.clamp(min=0), top) / top)
        else:
            L = _on([1.0 if o is None else o for o in scaling.original], f)  # (A, 1)

            def correction(rotations: float) -> Tensor:  # spectral index of the pair turning that often over L
                return (P - 1) * torch.log(hi_t * L / (rotations * 2 * math.pi)) / span

            low, high = correction(scaling.beta_fast), correction(scaling.beta_slow)
            if scaling.truncate:
                low, high = low.floor(), high.ceil()
            low, high = low.clamp(min=0), torch.minimum(high, 2 * P - 1)
            high = torch.where(high == low, high + 0.001, high)  # transformers' guard against a zero-width ramp
            ramp = ((j - low) / (high - low)).clamp(0, 1)  # 0: extrapolate (keep), 1: interpolate (divide by s)
            gain = (1 - ramp) + ramp / s
        return torch.where(w > 0, f * gain, f).to(freqs.dtype)


def resolution_scaling(
    train_size: int | Sequence[int], test_size: int | Sequence[int], type: str = "yarn", **options: Any
) -> dict[str, Any]:
    """The scaling dict for evaluating at ``test_size`` a model trained at ``train_size`` (grid extents in
    patches, per axis or one for all): ``factor = test / train`` per axis, ``original_size = train``.

    >>> resolution_scaling((14, 14), (28, 21))
    {'type': 'yarn', 'factor': (2.0, 1.5), 'original_size': (14, 14)}
    """
    tr = tuple(train_size) if isinstance(train_size, (list, tuple)) else None
    te = tuple(test_size) if isinstance(test_size, (list, tuple)) else None
    if tr is None and te is None:
        tr, te = (train_size,), (test_size,)
    elif tr is None:
        tr = (train_size,) * len(te)
    elif te is None:
        te = (test_size,) * len(tr)
    if len(tr) != len(te):
        raise ValueError(f"train_size {tr} and test_size {te} must have the same number of axes")
    for x in tr + te:
        _number(x, "size", "resolution_scaling")
    factor = tuple(float(b) / float(a) for a, b in zip(tr, te))
    cfg = {"type": type, "factor": factor if len(factor) > 1 else factor[0],
           "original_size": tr if len(tr) > 1 else tr[0]}
    cfg.update(options)
    return cfg
