"""Multimodal frequency allocations and rotary tables: the spec's allocation census, text-only reduction to 1D
RoPE, the relative property per axis, parity with transformers' Qwen2-VL / Qwen3-VL rotary modules, and the
registered encodings against the functional tables."""

from __future__ import annotations

import pytest
import torch
from test_mm_helpers import batch, tiny_qwen2vl, tiny_qwen3vl, tokens

import vlpe
from vlpe.encodings import multimodal as mm

ALL = list(mm.VARIANTS)
OPTS = {"pype": {"depth": 3, "interval": 1}}


def mm_batch(variant):
    if variant == "qwen3vl":
        samples = [
            tokens(2, ("img", (1, 4, 6)), 1, ("frames", (3, 4, 4), 2), 2),
            tokens(1, ("frames", (2, 6, 2), 3), 3),
        ]
    else:
        samples = [tokens(2, ("img", (1, 4, 6)), 1, ("vid", (3, 4, 4)), 2), tokens(1, ("vid", (2, 6, 2)), 3)]
    return batch(samples)


def ids_of(variant, **kw):
    types, mask, grid = mm_batch(variant)
    ids, _ = mm.position_ids(variant, types, grid, attention_mask=mask, **OPTS.get(variant, {}), **kw)
    return ids


def census(variant, *, head_dim=128, num_kv_heads=8, num_axes=None, section=None):
    """Which axis each rotary pair reads, measured from the tables: move one axis, see which pairs turn.

    Returns ``{axis: set of pairs}`` (``{(head, axis): pairs}`` for per-head tables) and the pairs that never
    turn (no position).
    """
    A = num_axes or mm.get_variant(variant).num_axes()
    base = torch.full((A, 1, 1), 3.0, dtype=torch.float64)
    K = head_dim // 2
    kw = dict(head_dim=head_dim, num_kv_heads=num_kv_heads, section=section, theta=1e4, dtype=torch.float64)
    cos0, sin0 = mm.rotary(variant, base, **kw)
    out = {}
    moved_any = torch.zeros(cos0.shape[:-2] + (K,), dtype=torch.bool)
    for a in range(A):
        p = base.clone()
        p[a] += 1000.37
        cos, sin = mm.rotary(variant, p, **kw)
        moved = ((cos - cos0).abs() + (sin - sin0).abs())[..., 0, :K] > 1e-9  # (B, [H,] K)
        moved_any |= moved
        if moved.dim() == 3:  # per head
            for h in range(moved.shape[1]):
                out[h, a] = set(moved[0, h].nonzero().flatten().tolist())
        else:
            out[a] = set(moved[0].nonzero().flatten().tolist())
    still = set((~moved_any).reshape(-1, K).all(0).nonzero().flatten().tolist())
    return out, still


# --------------------------------------------------------------------------- allocation census (spec 2, 3, 7, 8, 10.3)
def test_census_mrope_chunked():
    got, still = census("mrope")
    assert got == {0: set(range(0, 16)), 1: set(range(16, 40)), 2: set(range(40, 64))} and not still
    assert mm.allocation_map("chunked", num_pairs=64).bincount().tolist() == [16, 24, 24]


@pytest.mark.parametrize("variant", ["mrope_i", "qwen3vl"])
def test_census_interleaved(variant):
    got, still = census(variant)
    assert got[0] == set(range(0, 60, 3)) | {60, 61, 62, 63}
    assert got[1] == set(range(1, 60, 3)) and got[2] == set(range(2, 60, 3)) and not still
    assert all(min(p) <= 2 and max(p) >= 57 for p in got.values())  # every axis spans the spectrum


def test_census_qwen35_partial_section():
    """Qwen3.5: K = 32 rotary pairs, section [11, 11, 10]: t 0,3..30; h 1,4..31; w 2,5..29."""
    got, _ = census("qwen3vl", head_dim=64, section=(11, 11, 10))
    assert got == {0: set(range(0, 32, 3)), 1: set(range(1, 32, 3)), 2: set(range(2, 30, 3))}


def test_census_videorope_low_frequency_temporal():
    got, still = census("videorope")
    assert got == {0: set(range(48, 64)), 1: set(range(0, 48, 2)), 2: set(range(1, 48, 2))} and not still


def test_census_hope_hybrid():
    got, still = census("hope_video")
    assert got == {0: set(), 1: set(range(0, 48, 2)), 2: set(range(1, 48, 2))}
    assert still == set(range(48, 64))


def test_census_mhrope_heads():
    got, still = census("mhrope", num_kv_heads=8)
    heads = {0: [0, 1], 1: [2, 3, 4], 2: [5, 6, 7]}
    for a, hs in heads.items():
        for h in range(8):
            assert got[h, a] == (set(range(64)) if h in hs else set())
    got, still = census("mhrope", num_kv_heads=10, section=(2, 3, 3))  # heads beyond the sum: no position
    assert all(got[h, a] == set() for h in (8, 9) for a in range(3))


def test_census_vrope_mod4_and_1d():
    got, still = census("vrope")
    assert got == {a: set(range(a, 64, 4)) for a in range(4)} and not still
    for v in ("rope1d", "v2pe"):
        got, still = census(v)
        assert got == {0: set(range(64))}


# --------------------------------------------------------------------------- text only (spec 10.2)
def rope_1d_reference(pos, head_dim, theta):
    """Textbook 1D RoPE tables in float64: angle(n, k) = n * theta ** (-2k / d), HF half layout."""
    k = torch.arange(head_dim // 2, dtype=torch.float64)
    ang = pos.double()[..., None] * theta ** (-2 * k / head_dim)
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


@pytest.mark.parametrize("variant", ALL)
def test_text_only_reduces_to_1d_rope(variant):
    types, mask, _ = batch([tokens(37), tokens(20)])
    ids, _ = mm.position_ids(variant, types, None, attention_mask=mask, **OPTS.get(variant, {}))
    theta = 1e4
    kw = {"layer": 1} if variant == "pype" else {}
    cos, sin = mm.rotary(variant, ids, head_dim=64, theta=theta, num_kv_heads=4, **kw)
    rotary_dim = mm.get_variant(variant).rotary_dim(64)  # Qwen3.5: a quarter of the head rotates
    ref_cos, ref_sin = rope_1d_reference((mask.cumsum(-1) - 1).masked_fill(mask == 0, 1), rotary_dim, theta)
    if cos.dim() == 4:  # per-head tables: every KV head equals 1D RoPE on text
        ref_cos, ref_sin = ref_cos[:, None].expand_as(cos), ref_sin[:, None].expand_as(sin)
    if variant == "hope_video":  # the 8 lowest-frequency pairs (k >= 24 of 32) are not rotated
        band = torch.zeros(64, dtype=torch.bool)
        band[24:32] = band[56:64] = True
        ref_cos, ref_sin = ref_cos.masked_fill(band, 1.0), ref_sin.masked_fill(band, 0.0)
    assert torch.allclose(cos.double(), ref_cos, atol=1e-6) and torch.allclose(sin.double(), ref_sin, atol=1e-6)


def test_multimodal_rope1d_equals_core_rope1d():
    types, mask, grid = mm_batch("mrope")
    ids, _ = mm.position_ids("rope1d", types, grid, attention_mask=mask)
    cos, sin = mm.rotary("rope1d", ids, head_dim=32)
    enc = vlpe.encodings.build("rope1d", dim=128, num_heads=4, num_axes=1)
    ctx = enc.prepare(vlpe.Positions(ids.permute(1, 2, 0)))
    assert torch.equal(cos[..., :16], ctx["cos"][:, 0]) and torch.equal(sin[..., :16], ctx["sin"][:, 0])
    assert enc.theta == mm.VARIANTS["rope1d"].theta


# --------------------------------------------------------------------------- relative property (spec 10.4)
def logits(variant, ids, q, k, **kw):
    cos, sin = mm.rotary(variant, ids, head_dim=q.shape[-1], dtype=torch.float64, **kw)
    if cos.dim() == 4 and variant == "pype":
        cos, sin = cos[1], sin[1]
    qr, kr = mm.apply_rotary_pos_emb(q, k, cos, sin)
    return qr @ kr.transpose(-1, -2)


@pytest.mark.parametrize("variant", ALL)
def test_shift_of_one_axis_leaves_logits_unchanged(variant):
    ids = ids_of(variant).double()
    g = torch.Generator().manual_seed(0)
    B, S = ids.shape[1:]
    q, k = torch.randn(2, B, 8, S, 32, generator=g, dtype=torch.float64)
    kw = dict(num_kv_heads=4, theta=100.0)
    base = logits(variant, ids, q, k, **kw)
    for a in range(ids.shape[0]):
        for c in (7.0, -3.5):
            moved = ids.clone()
            moved[a] += c
            assert torch.allclose(logits(variant, moved, q, k, **kw), base, atol=1e-9)
    if variant not in ("hope_video",):  # a position that is not a common shift does change the logits
        moved = ids.clone()
        moved[:, :, 4] += 1.0
        assert not torch.allclose(logits(variant, moved, q, k, **kw), base, atol=1e-6)


def test_mhrope_shift_touches_only_that_axis_heads():
    ids = ids_of("mhrope").double()
    q = torch.randn(2, 8, ids.shape[-1], 32, dtype=torch.float64)  # 8 query heads, 4 KV heads (GQA 2)
    cos0, sin0 = mm.rotary("mhrope", ids, head_dim=32, num_kv_heads=4)
    assert cos0.shape == (2, 4, ids.shape[-1], 32)
    q0, _ = mm.apply_rotary_pos_emb(q, q, cos0, sin0)
    heads = {0: [0], 1: [1, 2], 2: [3]}  # default section for 4 KV heads: [1, 2, 1]
    for a, kv in heads.items():
        moved = ids.clone()
        moved[a] += 5.0
        q1, _ = mm.apply_rotary_pos_emb(q, q, *mm.rotary("mhrope", moved, head_dim=32, num_kv_heads=4))
        changed = {h for h in range(8) if not torch.allclose(q1[:, h], q0[:, h])}
        assert changed == {2 * h + r for h in kv for r in (0, 1)}  # query head j uses KV head j // 2


# --------------------------------------------------------------------------- parity with transformers
def test_mrope_tables_match_qwen2vl_rotary():
    model = tiny_qwen2vl()  # head_dim 8, mrope_section [2, 1, 1], theta 1e4
    ids = ids_of("mrope")
    with torch.no_grad():
        ref_cos, ref_sin = model.language_model.rotary_emb(torch.zeros(1), ids)
    cos, sin = mm.rotary("mrope", ids, head_dim=8, theta=1e4, section=(2, 1, 1))
    assert ref_cos.shape == cos.shape
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)


def test_qwen3vl_tables_match_qwen3vl_rotary_and_apply():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

    model = tiny_qwen3vl()  # head_dim 16, interleaved [4, 2, 2], theta 5e6
    ids = ids_of("qwen3vl")
    with torch.no_grad():
        ref_cos, ref_sin = model.language_model.rotary_emb(torch.zeros(1), ids)
    cos, sin = mm.rotary("qwen3vl", ids, head_dim=16, section=(4, 2, 2))
    assert torch.allclose(cos, ref_cos, atol=1e-6) and torch.allclose(sin, ref_sin, atol=1e-6)
    q, k = torch.randn(2, 2, 4, ids.shape[-1], 16)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_q, ours_k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(ours_q, ref_q, atol=1e-6) and torch.allclose(ours_k, ref_k, atol=1e-6)


# --------------------------------------------------------------------------- registered encodings
ENCODINGS = [v for v in ALL if v != "rope1d"]


@pytest.mark.parametrize("name", ENCODINGS)
def test_encoding_rotate_equals_functional_tables(name):
    ids = ids_of(name)
    heads, kv, head_dim = 8, 4, 32
    opts = {"num_kv_heads": kv} if name == "mhrope" else {}
    if name == "pype":
        opts = {"depth": 3}
    enc = vlpe.encodings.build(name, dim=heads * head_dim, num_heads=heads, num_axes=ids.shape[0], **opts)
    ctx = enc.prepare(vlpe.Positions(ids.permute(1, 2, 0)))
    q, k = torch.randn(2, 2, heads, ids.shape[-1], head_dim)
    layer = 2 if name == "pype" else 0
    got = enc.rotate(q, k, ctx, layer)
    cos, sin = mm.rotary(name, ids, head_dim=head_dim, theta=enc.theta, num_kv_heads=kv,
                         **({"layer": layer} if name == "pype" else {}))
    want = mm.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert enc.theta == mm.VARIANTS[name].theta


def test_encoding_positions_helper_and_padding():
    enc = vlpe.encodings.build("videorope", dim=64, num_heads=2, num_axes=3)
    types, mask, grid = mm_batch("videorope")
    pos = enc.positions(types, grid, attention_mask=mask)
    ids, _ = mm.position_ids("videorope", types, grid, attention_mask=mask)
    assert torch.equal(pos.coords, ids.permute(1, 2, 0)) and torch.equal(pos.valid, mask.bool())


def test_pype_encoding_mask_equals_functional_mask():
    types, _, grid = batch([tokens(2, ("img", (1, 12, 12)), 3)])
    ids, _ = mm.position_ids("pype", types, grid, depth=4, interval=1)
    enc = vlpe.encodings.build("pype", dim=32, num_heads=2, depth=4)
    pos = vlpe.Positions(ids.permute(1, 2, 0))
    q, k = torch.randn(2, 1, 2, ids.shape[-1], 16)
    for layer in range(4):
        lg = vlpe.attention_logits(enc, q, k, pos, layer=layer)
        keep = mm.pype_attention_mask(ids, layer)
        assert torch.equal(torch.isfinite(lg), keep.expand_as(lg))
        ctx = enc.prepare(pos)
        rows = slice(5, 17)
        assert torch.equal(enc.score(q[:, :, rows], k, ctx, layer, rows=rows), enc.score(q, k, ctx, layer)[:, :, rows])


def test_build_contract_call():
    enc = vlpe.encodings.build("mrope_i", dim=256, num_heads=2, num_axes=3)
    ids = ids_of("mrope_i")
    q, k = torch.randn(2, 2, 2, ids.shape[-1], 128)
    lg = vlpe.attention_logits(enc, q, k, vlpe.Positions(ids.permute(1, 2, 0)))
    assert lg.shape == (2, 2, ids.shape[-1], ids.shape[-1])


# --------------------------------------------------------------------------- pairing and options
def test_any_design_pairs_with_any_allocation():
    types, mask, grid = mm_batch("mrope")
    v = mm.Variant("diagonal", "interleaved", {"temporal_scale": 0.5})
    ids, _ = mm.position_ids(v, types, grid, attention_mask=mask)
    cos, _ = mm.rotary(v, ids, head_dim=64)
    ids2, _ = mm.position_ids("hope_video", types, grid, attention_mask=mask, temporal_scale=0.5)
    cos2, _ = mm.rotary("hope_video", ids2, head_dim=64, allocation="interleaved", theta=1e4)
    assert torch.equal(ids, ids2) and torch.allclose(cos, cos2)
    # a one-axis design feeds a three-axis allocation on every axis (text convention t = h = w)
    one, _ = mm.position_ids("v2pe", types, grid, attention_mask=mask)
    c3, _ = mm.rotary("v2pe", one, head_dim=64, allocation="chunked")
    c1, _ = mm.rotary("v2pe", one, head_dim=64)
    assert torch.allclose(c3, c1)


def test_inv_freq_override_and_scaling():
    ids = ids_of("mrope")
    cos, sin = mm.rotary("mrope", ids, head_dim=16, theta=1e4)
    k = torch.arange(8, dtype=torch.float32)
    cos2, sin2 = mm.rotary("mrope", ids, head_dim=16, inv_freq=1.0 / (1e4 ** (2 * k / 16)), attention_scaling=2.0)
    assert torch.allclose(cos2, 2 * cos) and torch.allclose(sin2, 2 * sin)
    cos_p, _ = mm.rotary("mrope", ids, head_dim=16, rotary_dim=8, theta=1e4, section=(2, 1, 1))
    assert cos_p.shape[-1] == 8


def test_tables_stay_fp32_under_autocast():
    ids = ids_of("mrope_i") + 100_000
    ref, _ = mm.rotary("mrope_i", ids, head_dim=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = mm.rotary("mrope_i", ids, head_dim=64)
    assert low.dtype == torch.float32 and torch.equal(low, ref)


def test_rotary_errors():
    ids = ids_of("mrope")
    with pytest.raises(ValueError, match="unknown multimodal RoPE variant"):
        mm.rotary("nope_rope", ids, head_dim=64)
    with pytest.raises(ValueError, match="unknown frequency allocation"):
        mm.rotary("mrope", ids, head_dim=64, allocation="spiral")
    with pytest.raises(ValueError, match="num_kv_heads"):
        mm.rotary("mhrope", ids, head_dim=64)
    with pytest.raises(ValueError, match="must sum to"):
        mm.rotary("mrope", ids, head_dim=64, section=(16, 24, 24))
    with pytest.raises(ValueError, match="reads 4 position axes"):
        mm.rotary("vrope", ids, head_dim=64)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        mm.rotary("mrope", ids, head_dim=63)
    with pytest.raises(ValueError, match="cannot be interleaved"):
        mm.allocation_map("interleaved", num_pairs=32, section=(8, 12, 12))
    with pytest.raises(ValueError, match="assigns 9 KV heads"):
        mm.allocation_map("multi_head", num_pairs=8, section=(3, 3, 3), num_kv_heads=8)
    with pytest.raises(ValueError, match="does not take option"):
        vlpe.encodings.build("mrope", dim=64, num_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="supports 3"):
        vlpe.encodings.build("mrope", dim=64, num_heads=2, num_axes=2)


def test_pype_encoding_positions_use_its_depth():
    enc = vlpe.encodings.build("pype", dim=32, num_heads=2, depth=5)
    types, _, grid = batch([tokens(2, ("img", (1, 12, 12)), 3)])
    pos = enc.positions(types, grid)
    ids, _ = mm.position_ids("pype", types, grid, depth=5)
    assert pos.num_axes == 5 and torch.equal(pos.coords, ids.permute(1, 2, 0).float())
    with pytest.raises(ValueError, match="num_axes=depth"):
        vlpe.encodings.build("pype", dim=32, num_heads=2, depth=5, num_axes=1).positions(types, grid)


# ------------------------------------------------------------------------------------------------------------
# one variant object: registered encodings are views of VARIANTS, any variant has an encoding
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in mm.VARIANTS if n != "rope1d"])
def test_registered_encodings_hold_their_variant(name):
    opts = {"num_kv_heads": 4} if name == "mhrope" else {}
    enc = vlpe.encodings.build(name, dim=256, num_heads=8, **opts)
    assert enc.active_variant is mm.VARIANTS[name]  # the table's object itself, no copy of its settings
    assert type(mm.encoding(mm.VARIANTS[name], dim=256, num_heads=8, **opts)) is type(enc)


def test_any_variant_is_an_encoding_that_matches_its_tables():
    v = mm.Variant("diagonal", "interleaved", {"temporal_scale": 0.5}, theta=1e4)
    types, mask, grid = mm_batch("videorope")
    ids, _ = mm.position_ids(v, types, grid, attention_mask=mask)
    enc = mm.encoding(v, dim=8 * 32, num_heads=8)
    assert enc.active_variant is v and type(enc) is mm.encodings.MultimodalRoPE
    ctx = enc.prepare(vlpe.Positions(ids.permute(1, 2, 0).float()))
    q, k = torch.randn(2, 2, 8, ids.shape[-1], 32)
    got = enc.rotate(q, k, ctx, 0)
    want = mm.apply_rotary_pos_emb(q, k, *mm.rotary(v, ids, head_dim=32))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert isinstance(mm.encoding(mm.Variant("pype", "none"), dim=64, num_heads=2, depth=3), mm.encodings.PyPE)


def test_with_options_builds_one_validated_variant():
    v = mm.VARIANTS["mrope_i"].with_options(spatial_reset=True, section=[24, 20, 20], theta=5e5)
    assert (v.name, v.design_options, v.section, v.theta) == ("mrope_i", {"spatial_reset": True}, (24, 20, 20), 5e5)
    assert mm.VARIANTS["mrope_i"].design_options == {}  # presets are never changed
    w = v.with_options(allocation="chunked")
    assert (w.allocation, w.section, w.name) == ("chunked", None, None)
    with pytest.raises(ValueError, match="does not take option"):
        mm.VARIANTS["mrope"].with_options(temporal_scale=2.0)
    with pytest.raises(ValueError, match="unknown frequency allocation"):
        v.with_options(allocation="spiral")
    assert mm.VARIANTS["pype"].layered and mm.VARIANTS["pype"].masked and not mm.VARIANTS["mrope"].layered
