"""PyPE's faster form: its ring mask of a query chunk built once and shared by every head, registered for
:class:`vlpe.encodings.multimodal.encodings.PyPE` (``score`` itself, so equal to it; checked in
tests/test_fast_forms_registry.py and tests/test_fast_attention.py)."""

from __future__ import annotations

from torch import Tensor

from ..encodings.base import Context
from ..encodings.multimodal.encodings import PyPE
from .registry import fast_form

__all__ = ["pype_heads"]


@fast_form(PyPE, "heads", when=lambda enc: enc.mask)
def pype_heads(enc: PyPE, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
    """The mask of the query ``rows`` ``(B, 1, n, N)``, shared by every head (None without the mask)."""
    bias = enc.score(q, k, ctx, layer, rows=rows)
    return None if bias is None else (lambda heads: bias)
