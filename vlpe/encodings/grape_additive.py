"""Additive GRAPE: logit biases from a unipotent action in a lifted space, ``G(p) = I + sum_a p_a A_a``, ``A_a A_b = 0``
(all products of generators vanish).

Zhang et al., "Group Representational Position Encoding" (arXiv 2512.07805), additive family. Lift queries and
keys by two homogeneous channels, ``q^ = [q, 1, 0]`` and ``k^ = [k, 0, 1]``, and let a position act by the unipotent
``G(p) = I + (w . p) e_u e_v^T`` (``e_u, e_v`` the two lifted channels, so every generator squares to 0 and all of
them commute). Queries transform by ``G(p_i)^{-T}`` and keys by ``G(p_j)``; since ``G(p_i)^{-1} G(p_j) = G(p_j - p_i)``
the score is exactly relative::

    q~_i . k~_j = q_i . k_j + w_h . (p_j - p_i)

In 1D with a causal mask (keys ``j <= i``) and ``w_h = m_h`` (ALiBi's slope) the bias is ``-m_h (i - j)``: ALiBi.
Without causality the query's share ``-w_h . p_i`` is the same for every key and cancels in the softmax, so the
bias acts as a learned linear ramp over key positions per head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .alibi import alibi_slopes
from .base import Context, Encoding, fp32
from .registry import register
from .spec import EncodingSpec

__all__ = ["GRAPEAdditive"]


@register("grape_additive")
class GRAPEAdditive(Encoding):
    """Additive GRAPE (Zhang et al., 2025) for nD positions: bias ``w_h . (p_j - p_i)`` of a learned per-head vector
    ``w_h`` (depth, H, A) on the signed offset, the score of the unipotent lift written as a ``score`` bias.

    The official code (model-architectures/GRAPE ``model/llama-mha-grape-a-pi.py`` and ``llama-mha-alibi.py``, commit
    135ee30e5e255cf4385fd8553e32e2575b2f1733) trains causal 1D language models whose additive term is contextual
    (a FoX-style cumulative log-sigmoid gate); vlpe implements the paper's non-contextual unipotent form, whose exact
    special case is ALiBi: with ``causal=True``, one axis and ``init="slopes"`` (``w_h`` = the official
    ``_get_alibi_slopes``), it equals the official ALiBi bias, checked in the tests against the lift computed with
    explicit ``(D + 2)``-dimensional matrices.

    ``init="slopes"`` sets every axis of ``w_h`` to ALiBi's slope ``m_h``, ``init="zeros"`` starts as ``nope``
    (non-causal). ``causal=True`` masks keys after the query in token order with ``-inf`` (decoders). Pairs with a
    prefix token get no bias. Offsets are fp32 (autocast off). ``neutralize()`` zeroes ``w`` (the causal mask stays).

    Args:
        spec: the build-time facts.
        init: ``"slopes"`` or ``"zeros"``.
        causal: mask keys after the query.

    Raises:
        ValueError: an unknown ``init``, a non-bool ``causal``.

    Reference: Zhang, Chen, Liu, Qin, Yuan, Xu, Yuan, Gu, Yao, "Group Representational Position Encoding",
    arXiv 2512.07805 (2025), additive GRAPE.
    """

    keep_fp32 = True  # exact fp32 parameters/buffers through downcasts (see Encoding.keep_fp32)

    claims = frozenset({"relative", "extrapolation", "neutral", "fp32_angles"})
    pieces = frozenset({"score"})

    def __init__(self, *, spec: EncodingSpec, init: str = "slopes", causal: bool = False) -> None:
        super().__init__(spec=spec)
        if init not in ("slopes", "zeros"):
            raise ValueError(f"init must be 'slopes' (ALiBi's slopes on every axis) or 'zeros', got {init!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        self.init = init
        self.causal = causal
        if causal:
            self.claims = self.claims - {"neutral"}  # the mask stays: never the same as nope
        elif init == "zeros":
            self.claims = self.claims | {"zero_init"}
        self.weight = nn.Parameter(torch.zeros(spec.depth, spec.num_heads, self.num_axes))  # (L, H, A)
        if init == "slopes":
            with torch.no_grad():
                self.weight.copy_(alibi_slopes(spec.num_heads)[None, :, None].expand_as(self.weight))

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        wide = torch.promote_types(fp32(pos.coords).dtype, self.weight.dtype)  # fp64 module: fp64
        ctx["coords"] = pos.coords.to(wide)  # (B, N, A)
        ctx["patch"] = (~pos.is_prefix).to(ctx["coords"].dtype)  # (N,)

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor:
        self.check_layer(layer)
        rows = slice(None) if rows is None else rows
        with torch.autocast(q.device.type, enabled=False):
            c, patch = ctx["coords"], ctx["patch"]
            w = fp32(self.weight[layer]).to(c.dtype)  # (H, A)
            offset = c[:, None, :, :] - c[:, rows, None, :]  # (B, n, N, A)  p_j - p_i, exact for grids
            bias = torch.einsum("bija,ha->bhij", offset, w)  # (B, H, n, N)  w_h . (p_j - p_i)
            bias = bias * (patch[rows, None] * patch[None, :])  # no bias on pairs with a prefix token
            if self.causal:
                N = bias.shape[-1]
                i = torch.arange(N, device=bias.device)[rows][:, None]  # (n, 1) query index
                bias = bias.masked_fill(torch.arange(N, device=bias.device)[None, :] > i, float("-inf"))
            return bias

    def neutralize(self) -> "GRAPEAdditive":
        self.weight.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {"weight"}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}init={self.init!r}, causal={self.causal}"
