"""The registries of the optimised forms of an encoding's bias, kept on the attention side, and their shared helpers.

An encoding is ``prepare`` plus the pieces of the contract (:mod:`vlpe.encodings.plan`); the faster forms of its
``score`` are registered here per encoding class by the modules of :mod:`vlpe.attention_forms`:

* :data:`FAST_FORMS` (``@fast_form(cls, "lattice")`` / ``@fast_form(cls, "heads")``) for the inference fast path
  of :mod:`vlpe.attention_fast`: a lattice offset table (:class:`vlpe.encodings.LatticeBias`) and a builder of the
  bias of a query chunk for any heads;
* :data:`FLEX_FORMS` (``@flex_form(cls)``) for :mod:`vlpe.attention_flex`: an analytic ``(score_mod,
  block_mask)``.

The plan of ``enc.prepare(pos)`` reads which forms exist from here (:func:`forms_of`, given to the plan module
by :func:`vlpe.encodings.plan.register_forms`), so presence is data, never found by looking at methods.
:func:`vlpe.encodings.functional.bias.clear_prefix` (re-exported here for the forms) is the one place where the bias
of pairs with a prefix (CLS, register) token is cleared.
Every registered form is checked against its encoding's ``score`` (the written form of the bias) in
tests/test_fast_forms_registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from torch import Tensor

from ..encodings import plan as _plan
from ..encodings.base import Context, Encoding, LatticeBias
from ..encodings.functional.bias import clear_prefix
from ..encodings.registry import by_class

__all__ = [
    "FAST_FORMS", "FLEX_FORMS", "FORM_NAMES", "FastForm", "FlexForm", "clear_prefix", "fast_form", "fast_form_of",
    "flex_form", "flex_form_of", "forms_of", "fast_min_tokens", "heads_bias", "lattice_table", "flex_mods",
]

#: ``lattice(enc, ctx, layer) -> LatticeBias | None`` (None: not these positions)
LatticeForm = Callable[[Encoding, Context, int], "LatticeBias | None"]
#: ``heads(enc, q, k, ctx, layer, rows) -> bias(heads) | None``: ``q`` the query ``rows`` of every head, ``k`` every
#: key; ``bias(heads)`` the ``(B', h, n, N)`` bias of a step-1 slice of heads (a head dimension of 1 may be shared
#: by all of them), equal to ``score(q, k, ctx, layer, rows=rows)[:, heads]``
HeadsForm = Callable[[Encoding, Tensor, Tensor, Context, int, slice], "Callable[[slice], Tensor] | None"]
#: ``flex(enc, q, k, ctx, layer) -> (score_mod, block_mask)`` for FlexAttention, nothing N x N captured
FlexForm = Callable[[Encoding, Tensor, Tensor, Context, int], "tuple[Callable | None, Any]"]

#: names a fast form goes by; an encoding module defining one of them is a form the registries do not reach
FORM_NAMES = ("score_heads", "lattice_bias", "flex", "score_mod", "block_mask")


@dataclass(frozen=True)
class FastForm:
    """The fast-path forms of one encoding class; ``*_when(enc)`` is the per-instance condition (None: always);
    ``min_tokens``: tokens from which ``attend(fast=None)`` takes the fast path for this class (None: the default
    :data:`vlpe.attention.FAST_MIN_TOKENS`; lower where the reference bias is costly per pair)."""

    lattice: LatticeForm | None = None
    heads: HeadsForm | None = None
    lattice_when: Callable[[Encoding], bool] | None = None
    heads_when: Callable[[Encoding], bool] | None = None
    min_tokens: int | None = None


#: encoding class -> its fast-path forms (the inference fast path of :mod:`vlpe.attention_fast`)
FAST_FORMS: dict[type, FastForm] = {}
#: encoding class -> (its FlexAttention form, per-instance condition or None)
FLEX_FORMS: dict[type, tuple[FlexForm, Callable[[Encoding], bool] | None]] = {}

_KINDS = ("lattice", "heads")


def fast_form(
    cls: type, kind: str, *, when: Callable[[Encoding], bool] | None = None, min_tokens: int | None = None
):
    """Decorator registering ``fn`` as the ``kind`` (``"lattice"`` or ``"heads"``) fast form of encoding class ``cls``
    (and of its subclasses that register none of their own); ``when(enc)``: the per-instance condition;
    ``min_tokens``: the class's automatic fast-path threshold (:class:`FastForm`)."""
    if kind not in _KINDS:
        raise ValueError(f"fast_form kind must be 'lattice' or 'heads', got {kind!r}")
    if not (isinstance(cls, type) and issubclass(cls, Encoding)):
        raise TypeError(f"fast_form registers a form for an Encoding class, got {cls!r}")
    if min_tokens is not None and (isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1):
        raise ValueError(f"fast_form min_tokens must be an integer >= 1 (or None), got {min_tokens!r}")

    def register(fn):
        old = FAST_FORMS.get(cls, FastForm())
        new = {kind: fn, f"{kind}_when": when}
        if min_tokens is not None:
            new["min_tokens"] = min_tokens
        FAST_FORMS[cls] = replace(old, **new)
        return fn

    return register


def flex_form(cls: type, *, when: Callable[[Encoding], bool] | None = None):
    """Decorator registering ``fn`` as the FlexAttention form of encoding class ``cls`` (``when``: as :func:`fast_form`)."""
    if not (isinstance(cls, type) and issubclass(cls, Encoding)):
        raise TypeError(f"flex_form registers a form for an Encoding class, got {cls!r}")

    def register(fn):
        FLEX_FORMS[cls] = (fn, when)
        return fn

    return register




def fast_form_of(enc: Encoding) -> FastForm | None:
    """The fast forms registered for ``enc``'s class (the nearest class of its MRO), or None."""
    return by_class(FAST_FORMS, enc)


def flex_form_of(enc: Encoding) -> FlexForm | None:
    """The FlexAttention form registered for ``enc``'s class, or None."""
    entry = by_class(FLEX_FORMS, enc)
    return None if entry is None else entry[0]


def forms_of(enc: Encoding) -> frozenset[str]:
    """The plan pieces of the forms ``enc`` has: ``lattice_bias``, ``score_heads``, ``flex`` (each registered for its
    class and its per-instance condition true). The plan module asks this (:func:`vlpe.encodings.plan.register_forms`)."""
    out = set()
    fast = fast_form_of(enc)
    if fast is not None:
        if fast.lattice is not None and (fast.lattice_when is None or fast.lattice_when(enc)):
            out.add("lattice_bias")
        if fast.heads is not None and (fast.heads_when is None or fast.heads_when(enc)):
            out.add("score_heads")
    flex = by_class(FLEX_FORMS, enc)
    if flex is not None and (flex[1] is None or flex[1](enc)):
        out.add("flex")
    return frozenset(out)


_plan.register_forms(forms_of)


# --------------------------------------------------------------------------- calls (the attention's entry points)
def lattice_table(enc: Encoding, ctx: Context, layer: int) -> LatticeBias | None:
    """``enc``'s registered lattice table at ``layer`` (None: no form, or not these positions)."""
    form = fast_form_of(enc)
    return None if form is None or form.lattice is None else form.lattice(enc, ctx, layer)


def fast_min_tokens(enc: Encoding) -> int | None:
    """The tokens from which ``attend(fast=None)`` takes the fast path for ``enc``'s class (None: the default)."""
    form = fast_form_of(enc)
    return None if form is None else form.min_tokens


def heads_bias(enc: Encoding, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice):
    """``enc``'s registered per-head bias builder of the query ``rows`` (None: no form)."""
    form = fast_form_of(enc)
    return None if form is None or form.heads is None else form.heads(enc, q, k, ctx, layer, rows)


def flex_mods(enc: Encoding, q: Tensor, k: Tensor, ctx: Context, layer: int):
    """``(score_mod, block_mask)`` of ``enc``'s registered FlexAttention form (``(None, None)``: no form)."""
    form = flex_form_of(enc)
    return (None, None) if form is None else form(enc, q, k, ctx, layer)
