"""What an encoding does in one forward, as data: the :class:`Plan` that ``enc.prepare(pos)`` returns.

The contract (everything a hand-written attention block needs; :mod:`vlpe.attention` follows it too)
=====================================================================================================

Per forward::

    ctx = enc.prepare(pos)             # tables for every layer, built once; ctx.plan is the Plan
    plan = ctx.plan
    if plan.embed: x = enc.embed(x, ctx)              # x: (B, N, C), before block 0

Per attention block ``layer`` (``q, k, v``: ``(B, H, N, Dh)`` after the projections, before any scaling;
``step = plan[layer]``, a :class:`LayerPlan`; a piece whose flag is False is not called, it is the identity
or "no term")::

    scale = Dh ** -0.5                                # Dh of q/k as projected, BEFORE widening
    if step.rotate: q, k = enc.rotate(q, k, ctx, layer)   # same shapes
    if step.widen:  q, k = enc.widen(q, k, ctx, layer)    # (B, H, N, Dh + W): extra features, same scale
    logits = (q @ k.transpose(-2, -1)) * scale        # (B, H, N, N)
    if step.score:  logits = logits + enc.score(q, k, ctx, layer, rows=None)   # broadcastable bias
    logits = logits + key_padding                     # -inf on keys with pos.valid False: the caller's job
    attn = logits.softmax(-1)
    out = attn @ v                                    # (B, H, N, Dv)
    if step.values: out = out + enc.values(attn, ctx, layer, rows=None)        # (B, H, N, Dv)
    # after the block (residuals, MLP): if step.mix: x = enc.mix(x, ctx, layer)

Rules:

* Order: rotate -> widen -> score (given the rotated and widened q/k) -> softmax -> values.
* Softmax scale: ``head_dim ** -0.5`` of the q/k as they enter attention. Widening features are folded
  so that this scale is right for them (PaPE): never rescale by the widened width.
* The encoding never applies the key-padding mask: the attention adds ``-inf`` on keys where
  ``ctx.pos.valid`` is False (``(B, 1, 1, N)``). Biases use ``-inf`` (or a large finite negative,
  LookHere) where attention is forbidden; a bias is ``(B or 1, H or 1, n, N)`` for the ``n`` query rows asked
  for (``rows``: a step-1 slice of query indices, None for all; ``q`` then holds those rows only).
* ``values`` gets the softmax probabilities of the ``rows`` ``(B, H, n, N)`` and returns ``(B, H, n, Dv)``.
* Faster forms of the same bias (never needed for correctness, they only make it cheaper) are not part of
  this contract: the attention backends register them per encoding class (:mod:`vlpe.attention_forms`: a
  lattice offset table and a per-head builder for the inference fast path, an analytic FlexAttention
  ``score_mod`` / ``block_mask``), and the plan says which exist (``step.lattice_bias``, ``step.score_heads``,
  ``step.flex``; only on layers with ``score``) from that registry, given here by :func:`register_forms`.
* Causal or extra masks are the caller's: add them to the logits like the key padding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Iterable

__all__ = ["LayerPlan", "Plan", "PIECES", "LAYER_PIECES", "CTX_ARG", "FORMS", "forms_of", "register_forms"]

#: the one list of the contract's hooks, in the order a forward consults them, each with the index of its ``ctx``
#: argument after ``self``: the pieces an encoding may declare, the plan's fields and the base class's ctx checks
#: all read it; ``embed`` is per forward, the others per layer
CTX_ARG = {"embed": 1, "rotate": 2, "widen": 2, "score": 2, "values": 1, "mix": 1}
PIECES = tuple(CTX_ARG)
LAYER_PIECES = PIECES[1:]
#: the faster forms of a ``score`` the attention backends may register for an encoding class (not declared by it)
FORMS = ("flex", "score_heads", "lattice_bias")

_FORM_SOURCES: list[Callable[[object], frozenset[str]]] = []


def register_forms(source: Callable[[object], frozenset[str]]) -> None:
    """Give the plan a ``source(enc) -> frozenset`` of the :data:`FORMS` registered for ``enc``
    (:func:`vlpe.attention_forms.registry.forms_of`, whose registries live on the attention side: encodings never
    import attention code)."""
    if source not in _FORM_SOURCES:
        _FORM_SOURCES.append(source)


def forms_of(enc: object) -> frozenset[str]:
    """The :data:`FORMS` registered for ``enc`` (empty until an attention backend registers its source)."""
    out: frozenset[str] = frozenset()
    for source in _FORM_SOURCES:
        out = out | source(enc)
    return out


@dataclass(frozen=True)
class LayerPlan:
    """Which pieces of one layer exist (True: call the hook of that name; False: skip it), and which registered
    faster forms of its ``score`` the attention may use (``flex``, ``score_heads``, ``lattice_bias``)."""

    rotate: bool = False
    widen: bool = False
    score: bool = False
    flex: bool = False
    values: bool = False
    score_heads: bool = False
    lattice_bias: bool = False
    mix: bool = False

    @classmethod
    def of(cls, pieces: Iterable[str], forms: Iterable[str] = ()) -> "LayerPlan":
        """The layer of ``pieces`` (of :data:`PIECES`) with the ``forms`` (of :data:`FORMS`) of its ``score``."""
        pieces, forms = set(pieces), set(forms)
        unknown = pieces - set(PIECES)
        if unknown:
            raise ValueError(f"unknown encoding pieces {sorted(unknown)}; pieces are {PIECES} (faster forms of a "
                             f"score, {FORMS}, are registered by the attention: vlpe.attention_forms)")
        unknown = forms - set(FORMS)
        if unknown:
            raise ValueError(f"unknown forms {sorted(unknown)}; forms are {FORMS}")
        on = {p: True for p in pieces if p != "embed"}
        return cls(**on, **{f: "score" in pieces for f in forms})

    def with_forms(self, forms: Iterable[str]) -> "LayerPlan":
        """This layer with exactly the registered ``forms`` of its ``score`` (none without a score)."""
        forms = set(forms)
        return replace(self, **{f: self.score and f in forms for f in FORMS})

    @property
    def pieces(self) -> tuple[str, ...]:
        """The contract pieces of this layer (:data:`LAYER_PIECES`), in field order."""
        return tuple(f.name for f in fields(self) if f.name in LAYER_PIECES and getattr(self, f.name))

    @property
    def forms(self) -> tuple[str, ...]:
        """The registered faster forms of this layer's ``score`` (:data:`FORMS`), in field order."""
        return tuple(f.name for f in fields(self) if f.name in FORMS and getattr(self, f.name))

    @property
    def attention(self) -> bool:
        """Anything at all inside attention (False: plain attention on the given q/k/v)."""
        return self.rotate or self.widen or self.score or self.values


@dataclass(frozen=True)
class Plan:
    """An encoding's pieces for one forward: ``embed`` (before block 0) and one :class:`LayerPlan` per layer."""

    embed: bool
    layers: tuple[LayerPlan, ...]
    #: every layer has the same pieces: ``plan[layer]`` answers for any layer index (the encoding's own hooks
    #: still check the layer when they keep per-layer state)
    same_every_layer: bool = False

    @classmethod
    def uniform(cls, pieces: Iterable[str], depth: int) -> "Plan":
        pieces = frozenset(pieces)
        return cls(embed="embed" in pieces, layers=(LayerPlan.of(pieces),) * depth, same_every_layer=True)

    def __getitem__(self, layer: int) -> LayerPlan:
        if self.same_every_layer:
            return self.layers[0]
        if not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise ValueError(
                f"this plan covers layers 0..{len(self.layers) - 1} (the encoding's depth={len(self.layers)}), "
                f"got layer={layer!r}; build the encoding with depth= the number of attention blocks"
            )
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def with_forms(self, forms: Iterable[str]) -> "Plan":
        """This plan with exactly the registered ``forms`` on every layer that has a ``score``."""
        forms = frozenset(forms)
        done = {lp: lp.with_forms(forms) for lp in set(self.layers)}
        layers = tuple(done[lp] for lp in self.layers)
        return Plan(embed=self.embed, layers=layers, same_every_layer=self.same_every_layer)

    @property
    def pieces(self) -> frozenset[str]:
        """Every piece any layer (or the forward) has."""
        out = {p for lp in set(self.layers) for p in lp.pieces}
        return frozenset(out | ({"embed"} if self.embed else set()))
