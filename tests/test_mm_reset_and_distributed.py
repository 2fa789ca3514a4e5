"""IL-RoPE, Omni-RoPE (reset visual layout) and MM-RoPE (distributed meta components, scaled grid): hand-computed
examples from the methods' equations, an independent slow loop of the ids, the allocation census and the tables
against float64 equations.

The released implementation these follow for a Qwen-style token layout is JJJYmmm/Multimodal-RoPEs @ cd413b9
(``pos_design/omnirope.py``, ``pos_design/mmrope.py``, ``freq_allocation/{mrope,mrope_i,mmrope}.py``); the loop below
re-derives its computation (a running shift; every unit placed at ``(shift + scale_t * tau, ...)``), it does not
import it.
"""

from __future__ import annotations

import pytest
import torch
from test_mm_helpers import MERGE, batch, tokens
from test_mm_position_ids import TEXT_BEFORE, rows, worked_example  # the spec's worked example

from vlpe.encodings import multimodal as mm

PATTERN = (0, 0, 1, 2, 1, 2, 1, 2)




@pytest.mark.parametrize("variant", ["ilrope", "omnirope"])
def test_worked_example_reset_layout(variant):
    """(shift, row, col) for the image at shift 4; text resumes at 4 + max(0, 1, 2) + 1 = 7."""
    types, grid = worked_example()
    ids, deltas = mm.position_ids(variant, types, grid)
    image = [(4, 0, 0), (4, 0, 1), (4, 0, 2), (4, 1, 0), (4, 1, 1), (4, 1, 2)]
    assert rows(ids) == TEXT_BEFORE + image + [(7, 7, 7), (8, 8, 8), (9, 9, 9)]
    assert deltas.tolist() == [[-3]]


def test_worked_example_mmrope_scaled():
    """position_scale (4, 8, 8): h = 4 + 8 i, w = 4 + 8 j; text resumes at 4 + max(0, 8, 16) + 1 = 21."""
    types, grid = worked_example()
    ids, deltas = mm.position_ids("mmrope", types, grid, position_scale=(4, 8, 8))
    image = [(4, 4, 4), (4, 4, 12), (4, 4, 20), (4, 12, 4), (4, 12, 12), (4, 12, 20)]
    assert rows(ids) == TEXT_BEFORE + image + [(21, 21, 21), (22, 22, 22), (23, 23, 23)]
    assert deltas.tolist() == [[24 - 13]]
    plain, _ = mm.position_ids("mmrope", types, grid)  # default scale (1, 1, 1): the Qwen3-VL grid
    assert torch.equal(plain, mm.position_ids("qwen3vl", types, grid)[0])


def reference_ids(types, mask, grid, *, scale=(1.0, 1.0, 1.0), stride=1.0, reset=False, pad=1):
    """Slow loop, one token at a time: every video is split into T = 1 frames (each its own unit); a unit at running
    position ``s`` gets ``(s + scale_t * stride * tau, [s +] scale_h * i, [s +] scale_w * j)`` (``reset``: h, w
    without ``s``), and the next text token ``s + max(scale_t * stride * (T - 1), scale_h * (H - 1), scale_w * (W - 1))
    + 1``. Returns float64 ids (3, B, S) and deltas (B, 1) = next position - real tokens."""
    B, S = types.shape
    units = []  # the grid rows in order; a video row of T frames is T units of one frame
    for T, H, W in grid.tolist():
        units += [(1, H // MERGE, W // MERGE)] * T
    out = torch.full((3, B, S), float(pad), dtype=torch.float64)
    deltas = torch.zeros(B, 1, dtype=torch.float64)
    u = 0
    for b in range(B):
        s, n, real = 0.0, 0, 0
        positions = [k for k in range(S) if mask[b, k]]
        while n < len(positions):
            k = positions[n]
            if types[b, k] == 0:
                out[:, b, k] = s
                s += 1
                n += 1
                real += 1
                continue
            T, H, W = units[u]
            u += 1
            for t in range(T):
                for i in range(H):
                    for j in range(W):
                        k = positions[n]
                        off = 0.0 if reset else s
                        out[:, b, k] = torch.tensor([s + scale[0] * stride * t, off + scale[1] * i, off + scale[2] * j])
                        n += 1
                        real += 1
            s += max(scale[0] * stride * (T - 1), scale[1] * (H - 1), scale[2] * (W - 1)) + 1
        deltas[b, 0] = s - real
    return out, deltas


def reset_batch():
    return batch(
        [
            tokens(3, ("img", (1, 4, 6)), 2, ("frames", (3, 4, 4), 2), 2),
            tokens(1, ("frames", (2, 8, 4), 3), 1, ("img", (1, 2, 2)), 3),
            tokens(4, ("img", (1, 8, 2)), 1, ("img", (1, 6, 10)), 2),
        ]
    )


@pytest.mark.parametrize("variant", ["ilrope", "omnirope"])
@pytest.mark.parametrize("stride", [1, 2.5])
def test_reset_layout_matches_the_loop(variant, stride):
    types, mask, grid = reset_batch()
    ids, deltas = mm.position_ids(variant, types, grid, attention_mask=mask, temporal_stride=stride)
    ref, ref_d = reference_ids(types, mask, grid, stride=stride, reset=True)
    assert (ids.double() - ref).abs().max() == 0 and (deltas.double() - ref_d).abs().max() == 0


@pytest.mark.parametrize("scale", [(1, 1, 1), (4, 8, 8), (1.5, 0.5, 2.0)])
def test_mmrope_scaled_grid_matches_the_loop(scale):
    types, mask, grid = reset_batch()
    ids, deltas = mm.position_ids("mmrope", types, grid, attention_mask=mask, position_scale=scale)
    ref, ref_d = reference_ids(types, mask, grid, scale=tuple(float(v) for v in scale))
    assert (ids.double() - ref).abs().max() == 0 and (deltas.double() - ref_d).abs().max() == 0
    assert ids.is_floating_point() == (scale == (1.5, 0.5, 2.0))


def test_reset_layout_text_to_image_logits_depend_on_the_text_index():
    """Prepending text moves t only: the h, w offset between text and image changes (an intended reset)."""
    a, _, ga = batch([tokens(4, ("img", (1, 4, 6)), 3)])
    b, _, gb = batch([tokens(6, ("img", (1, 4, 6)), 3)])
    ia, _ = mm.position_ids("ilrope", a, ga)
    ib, _ = mm.position_ids("ilrope", b, gb)
    assert ia[1:, 0, 4:10].tolist() == ib[1:, 0, 6:12].tolist()  # image h, w unchanged ...
    assert ia[0, 0, 4] + 2 == ib[0, 0, 6]  # ... while t moved with the text


def test_distributed_census_and_refusals():
    amap = mm.allocation_map("distributed", num_pairs=64)
    assert amap.tolist() == [PATTERN[k % 8] for k in range(64)]
    assert amap.bincount().tolist() == [16, 24, 24]
    for a in range(3):  # every axis reads pairs in every meta component: the first 8 pairs and the last 8
        pairs = (amap == a).nonzero().flatten()
        assert pairs.min() < 8 and pairs.max() >= 56
    assert mm.default_section("distributed", 64) == (16, 24, 24)
    with pytest.raises(ValueError, match="pattern t t h w h w h w is fixed"):
        mm.allocation_map("distributed", num_pairs=64, section=(24, 20, 20))
    with pytest.raises(ValueError, match="position_scale must be three positive numbers"):
        mm.position_ids("mmrope", *worked_example(), position_scale=(1, 0, 1))
    with pytest.raises(ValueError, match="position_scale must be three positive numbers"):
        mm.position_ids("mmrope", *worked_example(), position_scale=(1, 1))


def reference_tables(ids, amap, head_dim, theta):
    """float64 equations: pair k rotates by ``p[axis(k)] * theta ** (-2k / D)``, half layout."""
    k = torch.arange(head_dim // 2, dtype=torch.float64)
    ang = ids.double()[amap].permute(1, 2, 0) * theta ** (-2 * k / head_dim)  # (B, S, K)
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


@pytest.mark.parametrize("variant,amap", [
    ("mmrope", torch.tensor([PATTERN[k % 8] for k in range(32)])),
    ("omnirope", torch.tensor([0] * 8 + [1] * 12 + [2] * 12)),
    ("ilrope", torch.tensor([k % 3 if k < 30 else 0 for k in range(32)])),
])
def test_tables_match_the_equations(variant, amap):
    types, mask, grid = reset_batch()
    ids, _ = mm.position_ids(variant, types, grid, attention_mask=mask)
    cos, sin = mm.rotary(variant, ids, head_dim=64)
    ref_cos, ref_sin = reference_tables(ids, amap, 64, mm.VARIANTS[variant].theta)
    assert (cos.double() - ref_cos).abs().max() < 2e-5 and (sin.double() - ref_sin).abs().max() < 2e-5
    assert mm.allocation_map(mm.VARIANTS[variant].allocation, num_pairs=32).tolist() == amap.tolist()
