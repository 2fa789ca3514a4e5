"""The encoding contract holds what every caller reads, and nothing that serves one caller.

* one list of hooks (``vlpe.encodings.plan.CTX_ARG``): the declared pieces, the plan's fields, the public ``HOOKS``
  and the base class's ctx checks all read it;
* facts that serve one caller are registered with it: the fast-path threshold with the fast forms
  (``vlpe.attention_forms``), the bases RPE-2D can re-sample (``vlpe.encodings.rpe2d.BASES``), the learned table a
  timm ``pos_embed`` initialises (``vlpe.integrations.timm.ABSOLUTE_TABLES``); the base class has none of them;
* ``spec`` means one thing: the :class:`vlpe.encodings.EncodingSpec` an encoding was built from;
* the block stacks follow the plan: ``embed`` / ``mix`` are called only where the plan has them, and PEG's plan has
  ``mix`` only after the blocks it acts on (checked by counting the calls, independently of what the hooks return).
"""

from dataclasses import fields

import pytest
import torch

import vlpe
from models.blocks import Encoder
from vlpe.attention_forms.registry import fast_min_tokens
from vlpe.encodings import EncodingSpec, available, build, construct, get
from vlpe.encodings import base as encoding_base
from vlpe.encodings.plan import CTX_ARG, LAYER_PIECES, PIECES, LayerPlan
from vlpe.encodings.rpe2d import RPE2D, register_base, resampling_of
from vlpe.integrations.timm import absolute_table_of
from vlpe.testing import example


def test_one_hook_list():
    assert vlpe.encodings.HOOKS is PIECES and tuple(CTX_ARG) == PIECES and LAYER_PIECES == PIECES[1:]
    layer_fields = {f.name for f in fields(LayerPlan)}
    assert set(LAYER_PIECES) <= layer_fields  # every per-layer hook is a field of the plan


    class Every(encoding_base.Encoding):  # defines every hook: each gets the ctx check at the listed index
        pieces = frozenset(PIECES)

        def embed(self, x, ctx):
            return x

        def mix(self, x, ctx, layer):
            return x

        def rotate(self, q, k, ctx, layer):
            return q, k

        def widen(self, q, k, ctx, layer):
            return q, k

        def score(self, q, k, ctx, layer, rows=None):
            return None

        def values(self, attn, ctx, layer, rows=None):
            return None

    enc = construct(Every, dim=8, num_heads=2)
    for hook, at in CTX_ARG.items():
        args = [torch.zeros(1)] * 3
        args[at - 1] = "not a ctx"
        with pytest.raises(ValueError, match=f"Every.{hook} needs the Context"):
            getattr(enc, hook)(*args)


@pytest.mark.parametrize("flag", ["resampling", "absolute_table", "fast_min_tokens", "prepare_rows"])
def test_facts_of_one_caller_are_not_on_the_base_class(flag):
    assert not hasattr(encoding_base.Encoding, flag)


def test_one_caller_registries_answer_what_the_flags_did():
    # RPE-2D: every encoding that reads the coordinates it is given, and the learned table (read by rows)
    assert set(RPE2D.bases()) == {"alibi", "ape", "comrope", "fourier", "pape", "pape_ri", "rope", "rope_mixed",
                                  "sincos", "string"}  # fmt: skip
    assert callable(resampling_of(get("ape"))) and resampling_of(get("sincos")) == "coords"
    assert resampling_of(get("irpe")) is None and resampling_of(get("lookhere")) is None
    # the timm converter: only the learned absolute table takes a pos_embed
    assert [n for n in available() if absolute_table_of(get(n)) is not None] == ["ape"]
    # the fast path's threshold: FIRE's reference bias runs an MLP per pair, so it registers a lower one
    assert fast_min_tokens(build("fire", dim=8, num_heads=2)) == 196
    assert fast_min_tokens(build("alibi", dim=8, num_heads=2)) is None


def test_a_new_base_for_rpe2d_is_registered_with_rpe2d():
    from vlpe.encodings.rpe2d import BASES

    class Shifted(get("sincos")):  # a subclass inherits its parent's registration
        pass

    assert resampling_of(Shifted) == "coords"
    with pytest.raises(TypeError, match="Encoding class"):
        register_base(int)
    with pytest.raises(ValueError, match="'coords' or a rows"):
        register_base(Shifted, "rows")
    assert Shifted not in BASES


@pytest.mark.parametrize("name", sorted(available()))
def test_spec_is_the_encoding_spec_it_was_built_from(name):
    enc = example(name, dim=96, num_heads=12, depth=2)
    assert isinstance(enc.spec, EncodingSpec)
    assert (enc.spec.dim, enc.spec.num_heads, enc.spec.depth) == (enc.dim, enc.num_heads, enc.depth)
    assert enc.spec.num_axes == enc.num_axes


def _count_calls(enc, monkeypatch):
    calls = {"embed": [], "mix": []}
    real_embed, real_mix = type(enc).embed, type(enc).mix
    monkeypatch.setattr(enc, "embed", lambda x, ctx: calls["embed"].append(0) or real_embed(enc, x, ctx))
    monkeypatch.setattr(enc, "mix", lambda x, ctx, layer: calls["mix"].append(layer) or real_mix(enc, x, ctx, layer))
    return calls


@pytest.mark.parametrize("after", [(0,), (1, 3), (2,)])
def test_peg_plans_mix_only_after_its_blocks_and_the_encoder_calls_only_those(after, monkeypatch):
    depth = 4
    model = Encoder(dim=16, depth=depth, num_heads=2, encoding="peg", encoding_options={"after": after})
    enc = model.encoding
    pos = vlpe.Positions.grid(3, 4, prefix=1)
    plan = enc.prepare(pos).plan
    assert [plan[i].mix for i in range(depth)] == [i in after for i in range(depth)]
    assert not plan.embed and not any(plan[i].attention for i in range(depth))
    calls = _count_calls(enc, monkeypatch)
    x = torch.randn(2, pos.num_tokens, 16)
    with torch.no_grad():
        out = model(x, pos)
    assert calls == {"embed": [], "mix": list(after)}
    # the same forward with the hook called after every block (identity where PEG does not act)
    ref = model.encoding
    with torch.no_grad():
        ctx = ref.prepare(pos)
        y = x
        for layer, block in enumerate(model.blocks):
            y = block(y, enc=ref, ctx=ctx, layer=layer)
            y = type(ref).mix(ref, y, ctx, layer)
        torch.testing.assert_close(out, model.norm(y), rtol=0, atol=0)


def test_the_encoder_calls_embed_only_when_the_plan_has_it(monkeypatch):
    pos = vlpe.Positions.grid(3, 3, prefix=1)
    for name, embeds in (("rope", False), ("sincos", True)):
        model = Encoder(dim=16, depth=2, num_heads=2, encoding=name)
        enc = model.encoding
        calls = _count_calls(enc, monkeypatch)
        with torch.no_grad():
            model(torch.randn(1, pos.num_tokens, 16), pos)
        assert calls == {"embed": [0] if embeds else [], "mix": []}, name
