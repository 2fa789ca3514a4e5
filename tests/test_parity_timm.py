"""Parity of the baseline encodings with independent implementations: timm layers and Hugging Face Llama RoPE."""

from __future__ import annotations

import pytest
import torch

import vlpe
from vlpe import Positions
from vlpe.encodings import build

timm_layers = pytest.importorskip("timm.layers")
from timm.layers import (
    RotaryEmbeddingCat,
    RotaryEmbeddingMixed,
    apply_rot_embed_cat,
    build_sincos2d_pos_embed,
    resample_abs_pos_embed,
)
from timm.layers.pos_embed_sincos import init_random_2d_freqs


def _qk(B, H, N, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g).to(dtype), torch.randn(B, H, N, D, generator=g).to(dtype)


def _timm_rotate(x, emb, prefix=1):
    """timm AttentionRope: prefix tokens unrotated, the rest by apply_rot_embed_cat (interleaved layout)."""
    return torch.cat([x[:, :, :prefix], apply_rot_embed_cat(x[:, :, prefix:], emb)], dim=2)


# --------------------------------------------------------------------------- ape
@pytest.mark.parametrize(
    "old,new,prefix",
    [
        ((14, 14), (20, 20), 1),  # upsample, square
        ((14, 14), (8, 8), 1),  # downsample: antialias matters
        ((6, 10), (9, 7), 1),  # rectangular in and out
        ((6, 10), (4, 13), 0),  # patch-only table (no_embed_class)
        ((5, 5), (7, 3), 2),  # CLS + one register slot
    ],
)
def test_ape_matches_timm_resample_abs_pos_embed(old, new, prefix):
    enc = build("ape", dim=32, num_heads=4, grid_size=old, prefix=prefix)
    pos = Positions.grid(*new, prefix=prefix or 1)
    pe = enc.prepare(pos)["pe"]  # (1, N, C)
    ref = resample_abs_pos_embed(
        enc.pos_embed.detach()[None], new_size=list(new), old_size=list(old), num_prefix_tokens=prefix
    )  # (1, prefix + h*w, C)
    if prefix:
        torch.testing.assert_close(pe, ref, rtol=0, atol=1e-6)
    else:  # the CLS token of the positions gets no embedding from a patch-only table
        torch.testing.assert_close(pe[:, 1:], ref, rtol=0, atol=1e-6)
        assert torch.equal(pe[:, :1], torch.zeros_like(pe[:, :1]))


def test_ape_identity_at_training_size():
    enc = build("ape", dim=32, num_heads=4, grid_size=(6, 9))
    pe = enc.prepare(Positions.grid(6, 9, prefix=1))["pe"]
    assert torch.equal(pe[0], enc.pos_embed.detach())
    ref = resample_abs_pos_embed(enc.pos_embed.detach()[None], new_size=[6, 9], old_size=[6, 9])
    assert torch.equal(pe, ref)


def test_ape_bf16_table_resampled_in_fp32_like_timm():
    enc = build("ape", dim=32, num_heads=4, grid_size=(7, 7)).bfloat16()
    pe = enc.prepare(Positions.grid(11, 5, prefix=1))["pe"]
    ref = resample_abs_pos_embed(enc.pos_embed.detach()[None], new_size=[11, 5], old_size=[7, 7])
    assert pe.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(pe, ref)


# --------------------------------------------------------------------------- sincos
@pytest.mark.parametrize("shape", [(5, 7), (6, 6), (1, 4)])
@pytest.mark.parametrize("interleave", [False, True])
def test_sincos_matches_timm_build_sincos2d_pos_embed(shape, interleave):
    dim = 48
    layout = "per_axis" if interleave else "blocked"
    enc = build("sincos", dim=dim, num_heads=4, layout=layout, temperature=10000.0)
    pe = enc.prepare(Positions.grid(*shape, prefix=1))["pe"][0]  # (N, C)
    ref = build_sincos2d_pos_embed(list(shape), dim=dim, temperature=10000.0, interleave_sin_cos=interleave)
    torch.testing.assert_close(pe[1:], ref, rtol=0, atol=1e-6)
    assert torch.equal(pe[0], torch.zeros(dim))  # the CLS token gets zeros


def test_sincos_reverse_coord_matches_timm():
    """timm's reverse_coord enumerates the transposed grid: a no-op on square grids, (w, h) tokens otherwise."""
    dim, temp = 32, 100.0
    enc = build("sincos", dim=dim, num_heads=4, temperature=temp)
    pe = enc.prepare(Positions.grid(6, 6))["pe"][0]
    ref = build_sincos2d_pos_embed([6, 6], dim=dim, temperature=temp, reverse_coord=True)
    torch.testing.assert_close(pe, ref, rtol=0, atol=1e-6)
    pe = enc.prepare(Positions.grid(7, 4))["pe"][0]
    ref = build_sincos2d_pos_embed([4, 7], dim=dim, temperature=temp, reverse_coord=True)
    torch.testing.assert_close(pe, ref, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- axial rope
@pytest.mark.parametrize("shape", [(4, 5), (7, 3)])
def test_rope_interleaved_matches_timm_rotary_embedding_cat(shape):
    B, H, Dh = 2, 3, 16
    enc = build("rope", dim=H * Dh, num_heads=H, theta=10000.0, layout="interleaved")
    pos = Positions.grid(*shape, prefix=1)
    q, k = _qk(B, H, pos.num_tokens, Dh)
    ours_q, ours_k = enc.rotate(q, k, enc.prepare(pos), 0)
    timm_rope = RotaryEmbeddingCat(dim=Dh, temperature=10000.0, in_pixels=False, feat_shape=list(shape))
    emb = timm_rope.get_embed()  # (h*w, 2 * Dh), rows first ('ij')
    torch.testing.assert_close(ours_q, _timm_rotate(q, emb), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_k, _timm_rotate(k, emb), rtol=0, atol=1e-5)
    # timm's dynamic path (shape given per call) builds the same table
    torch.testing.assert_close(
        _timm_rotate(q, RotaryEmbeddingCat(dim=Dh, temperature=10000.0, in_pixels=False).get_embed(list(shape))),
        ours_q,
        rtol=0,
        atol=1e-5,
    )


def test_rope_half_and_interleaved_layouts_differ_by_a_channel_permutation():
    from vlpe.encodings.functional.rope import to_half

    B, H, Dh = 1, 2, 16
    half = build("rope", dim=H * Dh, num_heads=H, layout="half")
    inter = build("rope", dim=H * Dh, num_heads=H, layout="interleaved")
    pos = Positions.grid(4, 4, prefix=1)
    q, k = _qk(B, H, pos.num_tokens, Dh)
    # the interleaved pair (2m, 2m+1) is the half pair (m, m + D/2): same logits once q, k are permuted
    torch.testing.assert_close(
        vlpe.attention_logits(inter, q, k, pos),
        vlpe.attention_logits(half, to_half(q), to_half(k), pos),
        rtol=0,
        atol=1e-5,
    )
    perm = to_half(torch.arange(Dh))
    qh, _ = half.rotate(q[..., perm], k[..., perm], half.prepare(pos), 0)
    qi, _ = inter.rotate(q, k, inter.prepare(pos), 0)
    torch.testing.assert_close(qh, qi[..., perm], rtol=0, atol=1e-6)
    # and the layouts really differ: without the permutation the rotation is another one
    assert not torch.allclose(half.rotate(q, k, half.prepare(pos), 0)[0], qi, atol=1e-3)


# --------------------------------------------------------------------------- rope_mixed
def _to_ours(timm_freqs):
    """timm (2 = (x, y), depth, heads, D/2) -> ours (depth, heads, 2 = (h, w), D/2)."""
    return torch.stack([timm_freqs[1], timm_freqs[0]], dim=-2)


@pytest.mark.parametrize("shape", [(4, 4), (3, 5)])
def test_rope_mixed_matches_timm_rotary_embedding_mixed(shape):
    B, H, Dh, depth = 2, 3, 16, 3
    torch.manual_seed(7)
    ref = RotaryEmbeddingMixed(dim=H * Dh, depth=depth, num_heads=H, temperature=10.0, feat_shape=list(shape))
    enc = build("rope_mixed", dim=H * Dh, num_heads=H, depth=depth, layout="interleaved")
    with torch.no_grad():
        enc.freqs.copy_(_to_ours(ref.freqs))
    emb = ref.get_embed().detach()  # (depth, H, N, 2 * Dh)
    pos = Positions.grid(*shape, prefix=1)
    q, k = _qk(B, H, pos.num_tokens, Dh)
    ctx = enc.prepare(pos)
    for layer in range(depth):
        oq, ok = enc.rotate(q, k, ctx, layer)
        torch.testing.assert_close(oq, _timm_rotate(q, emb[layer]), rtol=0, atol=1e-5)
        torch.testing.assert_close(ok, _timm_rotate(k, emb[layer]), rtol=0, atol=1e-5)


def test_rope_mixed_init_equals_timm_for_the_same_seed():
    H, Dh, depth = 6, 32, 4
    torch.manual_seed(123)
    ref = RotaryEmbeddingMixed(dim=H * Dh, depth=depth, num_heads=H, temperature=10.0)
    torch.manual_seed(123)
    enc = build("rope_mixed", dim=H * Dh, num_heads=H, depth=depth)
    torch.testing.assert_close(enc.freqs.detach(), _to_ours(ref.freqs.detach()), rtol=0, atol=1e-7)


def test_rope_mixed_init_distribution_matches_init_random_2d_freqs():
    """Property-wise: magnitudes, orthogonal quarter pairs, turn direction, uniform random angles."""
    H, Dh, depth, theta = 8, 32, 64, 10.0
    ours = build("rope_mixed", dim=H * Dh, num_heads=H, depth=depth, theta=theta).freqs.detach()  # (L, H, 2, D/2)
    ref = _to_ours(init_random_2d_freqs(Dh, depth, H, temperature=theta))
    quarter = Dh // 4
    mag = theta ** (-4.0 * torch.arange(quarter) / Dh)  # hand formula
    for f in (ours, ref):
        norms = f.norm(dim=-2)  # (L, H, D/2)
        torch.testing.assert_close(norms, mag.repeat(2).expand_as(norms), rtol=1e-6, atol=0)
        a, b = f[..., :quarter], f[..., quarter:]  # (L, H, 2, D/4) (y, x) components
        torch.testing.assert_close((a * b).sum(-2), torch.zeros_like(norms[..., :quarter]), rtol=0, atol=1e-6)
        # the second quarter is the first turned by +pi/2 in the (x, y) plane: cross(a, b) = |a||b| > 0
        cross = a[..., 1, :] * b[..., 0, :] - a[..., 0, :] * b[..., 1, :]
        torch.testing.assert_close(cross, mag.square().expand_as(cross), rtol=1e-5, atol=0)
        # one angle per layer and head, shared by the pairs of a head, spread over [0, 2 pi)
        phi = torch.atan2(a[..., 0, :], a[..., 1, :])  # (L, H, D/4)
        assert torch.allclose(phi, phi[..., :1].expand_as(phi), atol=1e-5)
        phi = phi[..., 0].remainder(2 * torch.pi).flatten()
        assert phi.unique().numel() == depth * H
        hist = torch.histc(phi, bins=4, min=0, max=2 * torch.pi)
        assert (hist > depth * H / 4 * 0.6).all(), hist


# --------------------------------------------------------------------------- rope1d vs Llama
@pytest.mark.parametrize("offset", [0, 1000])
def test_rope1d_matches_transformers_llama(offset):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    H, Dh, S, B = 4, 16, 11, 2
    cfg = LlamaConfig(
        hidden_size=H * Dh,
        num_attention_heads=H,
        num_key_value_heads=H,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=16,
        max_position_embeddings=4096,
    )
    theta = cfg.rope_parameters["rope_theta"]
    rot = LlamaRotaryEmbedding(cfg)
    q, k = _qk(B, H, S, Dh)
    ids = torch.arange(S).expand(B, S) + offset
    cos, sin = rot(q, ids)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    enc = build("rope1d", dim=H * Dh, num_heads=H, theta=theta)
    pos = Positions(ids[..., None].float())
    oq, ok = enc.rotate(q, k, enc.prepare(pos), 0)
    atol = 1e-5 if offset == 0 else 5e-4  # transformers' fp32 angle at 1000 differs in the last bits
    torch.testing.assert_close(oq, ref_q, rtol=0, atol=atol)
    torch.testing.assert_close(ok, ref_k, rtol=0, atol=atol)
