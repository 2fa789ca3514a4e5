"""Library reliability: per-layer depth checks, timm conversion checks, fp32 angles through casts, and the
ValueErrors that replace raw torch errors for mismatched inputs (shapes, contexts, options, positions)."""

from __future__ import annotations

import pytest
import torch

import vlpe
from vlpe import Positions, attention_logits
from vlpe.attention import Attention, attend
from vlpe.encodings import build, get
from vlpe.testing import PropertyFailure, check_fp32_angles, randomize_parameters


def _build(name, **extra):
    return vlpe.testing.example(name, **extra)


def _randomise(enc, seed=0):
    return randomize_parameters(enc, seed=seed)


def _grid(enc):
    return vlpe.testing.grid_positions(enc)


# --------------------------------------------------------------------------- 2. layer index in [0, depth)
def test_lookhere_rejects_layers_outside_its_depth():
    enc = build("lookhere", dim=64, num_heads=4, depth=2)
    pos = Positions.grid(3, 3, prefix=1)
    q = torch.randn(1, 4, pos.num_tokens, 16)
    attention_logits(enc, q, q, pos, layer=1)  # the last layer is fine
    for layer in (2, 5, -1):
        with pytest.raises(ValueError, match=r"depth=2.*layer=" + str(layer)):
            attention_logits(enc, q, q, pos, layer=layer)
    with pytest.raises(ValueError, match="depth=2"):
        enc.slopes(5)


@pytest.mark.parametrize("name", vlpe.encodings.available())
def test_every_per_layer_encoding_rejects_layers_beyond_its_depth(name):
    """An encoding whose effect differs between layers 0 and 1 (after randomising its parameters) raises
    ValueError at layer = depth and at layer = -1 instead of reading some other layer's state."""
    torch.manual_seed(0)
    enc = _randomise(_build(name)).eval()
    pos = _grid(enc)
    layers = lambda ls: _effect_at(enc, pos, ls)  # noqa: E731
    with torch.no_grad():
        e0, e1 = layers(0), layers(1)
    if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(e0, e1)):
        return  # layer-independent: nothing per layer to run out of
    for bad in (2, -1):
        with pytest.raises(ValueError, match="depth"):
            with torch.no_grad():
                layers(bad)


def _effect_at(enc, pos, layer):
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, enc.num_heads, pos.num_tokens, enc.head_dim, generator=g) for _ in range(2))
    x = torch.randn(1, pos.num_tokens, enc.dim, generator=g)
    ctx = enc.prepare(pos)
    out = [attend(q, k, k, enc=enc, ctx=ctx, layer=layer, backend="eager")]
    if ctx.plan[layer].mix:
        out.append(enc.mix(x, ctx, layer))
    return out


def test_model_deeper_than_its_encoding_raises():
    from models.blocks import Encoder

    enc = Encoder(dim=64, depth=3, num_heads=4, encoding="lookhere", encoding_options={"depth": 2})
    pos = Positions.grid(3, 3, prefix=1)
    with pytest.raises(ValueError, match="depth=2"):
        enc(torch.randn(1, pos.num_tokens, 64), pos)


# --------------------------------------------------------------------------- 3. timm convert
def _small_timm(**kw):
    import timm

    torch.manual_seed(0)
    return timm.create_model(
        "vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=192, depth=2,
        num_heads=3, num_classes=4, **kw,
    ).eval()  # fmt: skip


def test_convert_rejects_an_encoding_built_for_another_model():
    import vlpe.integrations.timm as vt

    m = _small_timm()
    with pytest.raises(ValueError, match=r"dim=64.*192|192.*dim=64"):
        vt.convert(m, build("rope", dim=64, num_heads=4, depth=2))
    with pytest.raises(ValueError, match="num_heads"):
        vt.convert(m, build("rope", dim=192, num_heads=4, depth=2))
    with pytest.raises(ValueError, match="depth"):
        vt.convert(m, build("lookhere", dim=192, num_heads=3, depth=1))
    with pytest.raises(ValueError, match="num_axes"):
        vt.convert(m, build("rope", dim=192, num_heads=3, depth=2, num_axes=3))
    with pytest.raises(ValueError, match="options"):
        vt.convert(m, build("rope", dim=192, num_heads=3, depth=2), theta=10.0)
    c = vt.convert(m, build("rope", dim=192, num_heads=3, depth=2))  # a matching instance is fine
    assert c(torch.randn(1, 3, 32, 32)).shape == (1, 4)


@pytest.mark.parametrize("name", ["pape", "ape", "lookhere"])
def test_convert_leaves_its_argument_untouched(name):
    import vlpe.integrations.timm as vt

    m = _small_timm()
    x = torch.randn(2, 3, 32, 32)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        before = m(x)
        c = vt.convert(m, name).eval()
        after = m(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert m.state_dict().keys() == state.keys()
    assert c.model is not m and c.model.blocks[0].attn.qkv.weight is not m.blocks[0].attn.qkv.weight
    torch.testing.assert_close(c.model.blocks[0].attn.qkv.weight, m.blocks[0].attn.qkv.weight, rtol=0, atol=0)
    # inplace=True is the explicit way to share (and change) the given model
    shared = vt.convert(m, name, inplace=True)
    assert shared.model is m and m.blocks[0].attn.qkv.weight is shared.model.blocks[0].attn.qkv.weight


# --------------------------------------------------------------------------- 4. fp32 angles through casts
def test_fourier_keeps_its_frequencies_fp32_through_a_cast():
    enc = build("fourier", dim=64, num_heads=4, depth=2)
    w = enc.w_r.weight.detach().clone()
    enc.to(torch.bfloat16)
    assert enc.w_r.weight.dtype == torch.float32 and torch.equal(enc.w_r.weight, w)
    assert enc.mlp[0].weight.dtype == torch.bfloat16  # the MLP follows the cast
    for offset in (500.0, 5000.0):
        pos = Positions.grid(3, 3).shifted([offset, offset])
        ref = build("fourier", dim=64, num_heads=4, depth=2)
        ref.load_state_dict({k: v.float() for k, v in enc.state_dict().items()})
        torch.testing.assert_close(enc.features(pos.coords), ref.features(pos.coords), rtol=0, atol=0)


def test_property_kit_checks_fp32_angles_through_a_cast():
    """A fourier whose frequencies follow a bf16 cast (what it did before) fails the kit's fp32_angles check."""
    torch.manual_seed(0)
    leaky = build("fourier", dim=64, num_heads=4, depth=2)
    plain = torch.nn.Linear(leaky.w_r.in_features, leaky.w_r.out_features, bias=False)
    plain.weight.data.copy_(leaky.w_r.weight.data)
    leaky.w_r = plain  # a plain Linear follows every cast
    with pytest.raises(PropertyFailure, match="bfloat16"):
        check_fp32_angles(leaky)
    check_fp32_angles(build("fourier", dim=64, num_heads=4, depth=2))


# --------------------------------------------------------------------------- 9. ValueErrors, not raw torch
@pytest.mark.parametrize("name", ["alibi", "lookhere", "irpe", "rope", "pape", "nope"])
def test_attend_rejects_mismatched_q_k_v_and_masks(name):
    enc = build(name, dim=64, num_heads=4, depth=2)
    pos = Positions.grid(3, 4, prefix=1)
    N = pos.num_tokens
    ctx = enc.prepare(pos)
    q = torch.randn(1, 4, N, 16)
    attend(q, q, q, enc=enc, ctx=ctx)
    cases = {
        "heads": (torch.randn(1, 8, N, 8), None, "4 heads"),
        "head_dim": (torch.randn(1, 4, N, 8), None, "head_dim=16"),
        "k tokens": (q, torch.randn(1, 4, N + 2, 16), "tokens"),
        "batch": (torch.randn(2, 4, N, 16), torch.randn(3, 4, N, 16), "batch"),
    }
    for what, (qq, kk, msg) in cases.items():
        kk = qq if kk is None else kk
        with pytest.raises(ValueError, match=msg):
            attend(qq, kk, kk, enc=enc, ctx=ctx)
    with pytest.raises(ValueError, match="attn_mask"):
        attend(q, q, q, enc=enc, ctx=ctx, attn_mask=torch.ones(N + 1, N, dtype=torch.bool))
    with pytest.raises(ValueError, match="B, H, N, Dh"):
        attend(q[0], q[0], q[0], enc=enc, ctx=ctx)
    with pytest.raises(ValueError, match="heads"):
        attention_logits(enc, torch.randn(1, 8, N, 8), torch.randn(1, 8, N, 8), pos)


def test_positions_batch_must_match_the_tokens():
    enc = build("alibi", dim=64, num_heads=4, depth=2)
    pos = Positions(torch.randn(3, 10, 2))
    q = torch.randn(2, 4, 10, 16)
    with pytest.raises(ValueError, match="batch"):
        attend(q, q, q, enc=enc, ctx=enc.prepare(pos))


@pytest.mark.parametrize("name", ["alibi", "lookhere", "irpe", "rope", "pape", "ape", "sincos", "peg"])
def test_a_context_from_another_encoding_or_none_is_a_value_error(name):
    opts = {"grid_size": (3, 4), "prefix": 1} if name == "ape" else {}
    enc = build(name, dim=64, num_heads=4, depth=2, **opts)
    other = build("nope" if name != "nope" else "rope", dim=64, num_heads=4, depth=2)
    pos = Positions.grid(3, 4, prefix=1)
    q = torch.randn(1, 4, pos.num_tokens, 16)
    x = torch.randn(1, pos.num_tokens, 64)
    foreign = other.prepare(pos)
    for ctx in (foreign, None):
        with pytest.raises(ValueError, match="prepare"):
            attend(q, q, q, enc=enc, ctx=ctx)
        for hook, call in (
            ("embed", lambda c: enc.embed(x, c)),
            ("mix", lambda c: enc.mix(x, c, 0)),
            ("rotate", lambda c: enc.rotate(q, q, c, 0)),
            ("widen", lambda c: enc.widen(q, q, c, 0)),
            ("score", lambda c: enc.score(q, q, c, 0)),
        ):
            if hook in enc.pieces:
                with pytest.raises(ValueError, match="prepare"):
                    call(ctx)


@pytest.mark.parametrize("name", ["ape", "sincos", "fourier", "peg"])
def test_token_hooks_reject_2d_or_wrong_width_tokens(name):
    opts = {"grid_size": (3, 4), "prefix": 1} if name == "ape" else {}
    enc = build(name, dim=64, num_heads=4, depth=2, **opts)
    pos = Positions.grid(3, 4, prefix=1)
    ctx = enc.prepare(pos)
    hook = (lambda x: enc.mix(x, ctx, 0)) if name == "peg" else (lambda x: enc.embed(x, ctx))
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        hook(torch.randn(pos.num_tokens, 64))
    with pytest.raises(ValueError, match="dim=64"):
        hook(torch.randn(1, pos.num_tokens, 32))


def test_attention_module_rejects_2d_or_wrong_width_tokens():
    a = Attention(dim=64, num_heads=4)
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        a(torch.randn(10, 64))
    with pytest.raises(ValueError, match="dim=64"):
        a(torch.randn(1, 10, 32))


def test_option_types_and_axis_counts_are_checked():
    with pytest.raises(ValueError, match="theta"):
        build("rope", dim=64, num_heads=4, theta="100")
    with pytest.raises(ValueError, match="depth"):
        build("rope", dim=64, num_heads=4, depth=2.5)
    for name in ("rope", "sincos", "alibi", "fourier"):
        with pytest.raises(ValueError, match="num_axes"):
            build(name, dim=64, num_heads=4, num_axes=0)
    build("rope", dim=64, num_heads=4, theta=100)  # an int where a float is expected is fine


def test_grid_sizes_and_prefix_must_be_whole_numbers():
    with pytest.raises(ValueError, match="2.7"):
        Positions.grid(2.7, 3)
    with pytest.raises(ValueError, match="prefix"):
        Positions.grid(2, 3, prefix=-1)
    with pytest.raises(ValueError, match="prefix"):
        Positions.grid(2, 3, prefix=1.9)
    with pytest.raises(ValueError, match="prefix"):
        Positions(torch.zeros(5, 2), prefix=1.9)
    with pytest.raises(ValueError, match="grid"):
        Positions(torch.zeros(6, 2), grid=(2.5, 2.4))
    assert Positions.grid(2.0, 3).grid == (2, 3)  # whole floats are whole numbers
    assert Positions.grid(torch.tensor(2), 3, prefix=torch.tensor(1)).prefix == 1


def test_image_tokenizer_rejects_nan_pixels():
    from vlpe.tokenizers import ImageTokenizer

    tok = ImageTokenizer(dim=32, patch_size=4, in_chans=1)
    x = torch.rand(2, 1, 8, 8)
    x[1, 0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN.*sample 1|sample 1.*NaN"):
        tok(x)
    with pytest.raises(ValueError, match="NaN"):
        tok([torch.rand(1, 8, 8), x[1]])


def test_video_tokenizer_rejects_nan_pixels():
    from vlpe.tokenizers import VideoTokenizer

    tok = VideoTokenizer(dim=32, patch_size=4, tubelet_size=2, in_chans=1)
    x = torch.rand(3, 1, 2, 8, 8)
    tok(x)
    x[2, 0, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="video sample 2"):
        tok(x)
    assert VideoTokenizer(dim=32, patch_size=4, in_chans=1, check_finite=False)(x)[0].shape[0] == 3


def test_point_tokenizer_ignores_nan_padding_and_rejects_nan_real_points():
    from vlpe.tokenizers import PointTokenizer
    from vlpe.tokenizers.points import farthest_point_sample

    torch.manual_seed(0)
    tok = PointTokenizer(dim=32, num_groups=4, group_size=4).eval()
    xyz = torch.randn(1, 16, 3)
    valid = torch.ones(1, 16, dtype=torch.bool)
    valid[0, 3] = False
    clean_tokens, clean_pos = tok(xyz, valid=valid)
    poisoned = xyz.clone()
    poisoned[0, 3] = float("nan")
    tokens, pos = tok(poisoned, valid=valid)
    torch.testing.assert_close(tokens, clean_tokens)
    torch.testing.assert_close(pos.coords, clean_pos.coords)
    idx = farthest_point_sample(poisoned, 4, valid=valid)
    torch.testing.assert_close(idx, farthest_point_sample(xyz, 4, valid=valid))
    real_nan = xyz.clone()
    real_nan[0, 5, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        tok(real_nan, valid=valid)


def test_point_tokenizer_rejects_clouds_without_points():
    from vlpe.tokenizers import PointTokenizer

    tok = PointTokenizer(dim=32, num_groups=4, group_size=4)
    with pytest.raises(ValueError, match="P=0"):
        tok(torch.zeros(1, 0, 3))
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1] = False
    with pytest.raises(ValueError, match=r"cloud 1.*no real points|no real points.*cloud 1"):
        tok(torch.randn(2, 16, 3), valid=valid)


def test_randomize_parameters_draws_every_float_parameter_deterministically():
    enc = build("irpe", dim=32, num_heads=4)
    a = [p.detach().clone() for p in randomize_parameters(enc, seed=3).parameters() if p.is_floating_point()]
    g = torch.Generator().manual_seed(3)  # the documented draw, written out
    want = [torch.randn(p.shape, generator=g, dtype=torch.float64).float() * 0.3 for p in a]
    assert a and all(torch.equal(x, y) for x, y in zip(a, want))
