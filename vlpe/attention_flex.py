"""The FlexAttention path of :func:`vlpe.attend` and the dense fallback of a flex ``score_mod``.

An encoding whose plan has the ``flex`` form (registered per class in :data:`FLEX_FORMS`,
:mod:`vlpe.attention_forms`) gets its analytic ``(score_mod, block_mask)``; one with a ``score`` but no ``flex``
form gets :func:`dense_score_mod`, which reads its dense ``score`` (fine for small N). This lives on the attention
side: encodings never import attention code. Checked against the reference path in
tests/test_fast_forms_registry.py, tests/test_lookhere.py, tests/test_fire.py and tests/test_baselines.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import attention_forms  # noqa: F401  (registers every encoding's forms)
from .attention_forms.registry import FLEX_FORMS, flex_form, flex_mods
from .encodings.base import Context, Encoding
from .encodings.plan import LayerPlan

__all__ = ["FLEX_FORMS", "dense_score_mod", "flex_attend", "flex_form", "flex_mods"]


def dense_score_mod(enc: Encoding, q: Tensor, k: Tensor, ctx: Context, layer: int):
    """A FlexAttention ``score_mod`` reading the encoding's dense bias (fine for small N)."""
    bias = enc.score(q, k, ctx, layer, rows=None)
    if bias is None:
        return None
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).contiguous()  # (B, H, N, N)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx].to(score.dtype)

    return score_mod


_compiled_flex = None


def flex_attend(q, k, v, enc, ctx, step: LayerPlan | None, layer, scale, static, is_causal):
    """FlexAttention (compiled) with the encoding's score_mod / block_mask, ``static`` additive masks and causality."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(
            "FlexAttention has no backward on CPU in this torch; use backend='sdpa' (or 'eager') for CPU training"
        )
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    mods = []
    block_mask = None
    if enc is not None and step.score:
        if step.flex:
            sm, block_mask = flex_mods(enc, q, k, ctx, layer)
        else:
            sm = dense_score_mod(enc, q, k, ctx, layer)
        if sm is not None:
            mods.append(sm)
    if static is not None:
        st = static.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]).contiguous()
        mods.append(lambda score, b, h, qi, ki: score + st[b, h, qi, ki].to(score.dtype))
    if is_causal:
        mods.append(lambda score, b, h, qi, ki: torch.where(qi >= ki, score, float("-inf")))

    def score_mod(score, b, h, q_idx, kv_idx):
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    return _compiled_flex(q, k, v, score_mod=score_mod if mods else None, block_mask=block_mask, scale=scale)
