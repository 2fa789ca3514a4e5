"""Qwen3.5's partial-rotary interleaved MRoPE (``qwen35``): parity with transformers' Qwen3.5 rotary module, its
``apply_rotary_pos_emb`` and ``get_rope_index``, and an independent float64 reference of the equations.

Qwen3.5 (released config): head_dim 256, ``partial_rotary_factor`` 0.25 (the first 64 channels rotate, K = 32
pairs), ``mrope_section`` [11, 11, 10] interleaved, ``rope_theta`` 1e7.
"""

from __future__ import annotations

import types as pytypes

import pytest
import torch
from test_mm_helpers import MERGE, batch, tokens

import vlpe
from vlpe.encodings import multimodal as mm

HEAD_DIM, THETA, SECTION = 256, 1e7, [11, 11, 10]


def qwen35_batch():
    return batch(
        [
            tokens(3, ("img", (1, 4, 6)), 2, ("frames", (3, 4, 4), 2), 2),
            tokens(1, ("frames", (2, 8, 4), 3), 1, ("img", (1, 2, 2)), 3),
        ]
    )


def hf_rotary():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    cfg = Qwen3_5TextConfig(
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "mrope_interleaved": True, "mrope_section": SECTION,
                         "rope_theta": THETA, "partial_rotary_factor": 0.25},
    )
    return Qwen3_5TextRotaryEmbedding(cfg)


def hf_rope_index(types, mask, grid, is_video):
    """transformers' ``Qwen3_5Model.get_rope_index`` on a stand-in holding only what it reads (the merge size and
    the model's own ``get_vision_position_ids``): no model is built."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    stub = pytypes.SimpleNamespace(config=pytypes.SimpleNamespace(
        vision_config=pytypes.SimpleNamespace(spatial_merge_size=MERGE)))
    stub.get_vision_position_ids = lambda *a, **k: Qwen3_5Model.get_vision_position_ids(stub, *a, **k)
    return Qwen3_5Model.get_rope_index(stub, torch.zeros_like(types), types, image_grid_thw=grid[~is_video],
                                       video_grid_thw=grid[is_video].clone(), attention_mask=mask)


def reference_tables(ids: torch.Tensor):
    """The equations in float64, written from the paper's description: pair ``k < 32`` rotates by
    ``p[k mod 3] * theta ** (-2k / 64)`` (t, h, w round robin), tables in the half layout of the 64 rotated
    channels."""
    rd = int(HEAD_DIM * 0.25)
    k = torch.arange(rd // 2, dtype=torch.float64)
    axis = k.long() % 3
    pos = ids.double()[axis]  # (K, B, S): the axis each pair reads
    ang = pos.permute(1, 2, 0) * THETA ** (-2 * k / rd)  # (B, S, K)
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def test_qwen35_ids_match_transformers():
    types, mask, grid = qwen35_batch()
    is_video = torch.tensor([0, 1, 1, 0], dtype=torch.bool)
    with torch.no_grad():
        ref_ids, ref_deltas = hf_rope_index(types, mask, grid, is_video)
    ids, deltas = mm.position_ids("qwen35", types, grid, attention_mask=mask, pad_position=0)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)


def test_qwen35_tables_match_transformers_and_the_equations():
    types, mask, grid = qwen35_batch()
    ids, _ = mm.position_ids("qwen35", types, grid, attention_mask=mask)
    with torch.no_grad():
        ref_cos, ref_sin = hf_rotary()(torch.zeros(1), ids)
    cos, sin = mm.rotary("qwen35", ids, head_dim=HEAD_DIM)
    assert cos.shape == ref_cos.shape == (2, ids.shape[-1], 64)
    assert (cos - ref_cos).abs().max() <= 1e-6 and (sin - ref_sin).abs().max() <= 1e-6
    exact_cos, exact_sin = reference_tables(ids)
    assert (cos.double() - exact_cos).abs().max() < 2e-5 and (sin.double() - exact_sin).abs().max() < 2e-5
    # the explicit section of the released config gives the same tables
    cos2, sin2 = mm.rotary(mm.Variant("per_frame", "interleaved", section=(11, 11, 10), theta=THETA,
                                      partial_rotary_factor=0.25), ids, head_dim=HEAD_DIM)
    assert torch.equal(cos2, cos) and torch.equal(sin2, sin)


def test_qwen35_rotation_matches_transformers_apply_and_the_encoding():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    types, mask, grid = qwen35_batch()
    ids, _ = mm.position_ids("qwen35", types, grid, attention_mask=mask)
    with torch.no_grad():
        ref_cos, ref_sin = hf_rotary()(torch.zeros(1), ids)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 4, ids.shape[-1], HEAD_DIM, generator=g)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    cos, sin = mm.rotary("qwen35", ids, head_dim=HEAD_DIM)
    got_q, got_k = mm.apply_rotary_pos_emb(q, k, cos, sin)
    assert (got_q - ref_q).abs().max() <= 1e-5 and (got_k - ref_k).abs().max() <= 1e-5
    assert torch.equal(got_q[..., 64:], q[..., 64:])  # three quarters pass through
    enc = vlpe.encodings.build("qwen35", dim=4 * HEAD_DIM, num_heads=4)
    ctx = enc.prepare(vlpe.Positions(ids.permute(1, 2, 0).float()))
    enc_q, enc_k = enc.rotate(q, k, ctx, 0)
    assert (enc_q - ref_q).abs().max() <= 1e-5 and (enc_k - ref_k).abs().max() <= 1e-5


def test_qwen35_round_robin_census():
    amap = mm.allocation_map("round_robin", num_pairs=32)
    assert amap.tolist() == [k % 3 for k in range(32)]
    assert amap.bincount().tolist() == SECTION
    assert torch.equal(amap, mm.allocation_map("interleaved", num_pairs=32, section=SECTION))
    assert mm.default_section("round_robin", 32) == (11, 11, 10)


def test_qwen35_text_only_is_partial_1d_rope():
    ids = torch.arange(9).view(1, 1, -1).expand(3, 1, -1)
    cos, sin = mm.rotary("qwen35", ids, head_dim=HEAD_DIM, dtype=torch.float64)
    k = torch.arange(32, dtype=torch.float64)
    ang = torch.arange(9, dtype=torch.float64)[:, None] * THETA ** (-2 * k / 64)
    assert torch.allclose(cos[0], torch.cat([ang.cos(), ang.cos()], -1), atol=1e-6)


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5, True, "0.25"])
def test_partial_rotary_factor_refused(factor):
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        mm.Variant("grid", "interleaved", partial_rotary_factor=factor)


def test_partial_rotary_of_an_odd_part_refused():
    v = mm.Variant("grid", "round_robin", partial_rotary_factor=0.25)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        mm.rotary(v, torch.zeros(3, 1, 4), head_dim=12)  # 3 channels would rotate
