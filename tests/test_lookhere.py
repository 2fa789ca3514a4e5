"""LookHere: fields of view against the written definitions (slow loops), slopes, symmetries, flex vs dense.

Field-of-view definitions (spec encodings-vision.md 3.2, checked against GreenCUBIC/lookhere
``create_lh_layer_tensor``): (dx, dy) = key - query in (column, row) patch units, "up" is a smaller row,
every boundary inclusive. "diagonals" heads see the *union* of two adjacent 90-degree wedges (the
reference intersects the wedges' masked sets), i.e. a half-plane bounded by a diagonal.
"""

import math

import pytest
import torch

import vlpe
from vlpe.attention import attend
from vlpe.encodings.lookhere import head_layout
from vlpe.testing import check, probe


def w_up(dx, dy):
    return abs(dx) <= -dy


def w_down(dx, dy):
    return abs(dx) <= dy


def w_left(dx, dy):
    return dx <= -abs(dy)


def w_right(dx, dy):
    return dx >= abs(dy)


SPEC = {
    "halves": [lambda dx, dy: dy <= 0, lambda dx, dy: dy >= 0, lambda dx, dy: dx <= 0, lambda dx, dy: dx >= 0],
    "corners": [
        lambda dx, dy: dy <= 0 and dx <= 0,
        lambda dx, dy: dy <= 0 and dx >= 0,
        lambda dx, dy: dy >= 0 and dx <= 0,
        lambda dx, dy: dy >= 0 and dx >= 0,
    ],
    "triangles": [w_up, w_down, w_left, w_right],
    "eighths1": [
        lambda dx, dy: w_up(dx, dy) and dx <= 0,
        lambda dx, dy: w_down(dx, dy) and dx <= 0,
        lambda dx, dy: w_left(dx, dy) and dy <= 0,
        lambda dx, dy: w_right(dx, dy) and dy <= 0,
    ],
    "eighths2": [
        lambda dx, dy: w_up(dx, dy) and dx >= 0,
        lambda dx, dy: w_down(dx, dy) and dx >= 0,
        lambda dx, dy: w_left(dx, dy) and dy >= 0,
        lambda dx, dy: w_right(dx, dy) and dy >= 0,
    ],
    "diagonals": [
        lambda dx, dy: w_up(dx, dy) or w_right(dx, dy),
        lambda dx, dy: w_up(dx, dy) or w_left(dx, dy),
        lambda dx, dy: w_down(dx, dy) or w_right(dx, dy),
        lambda dx, dy: w_down(dx, dy) or w_left(dx, dy),
    ],
    "none": [lambda dx, dy: True] * 4,
}


def build(heads=4, dim=None, **opts):
    return vlpe.encodings.build(opts.pop("name", "lookhere"), dim=dim or 8 * heads, num_heads=heads, **opts)


def bias_of(enc, pos, layer=0):
    """Pre-softmax logits with q = k = 0, i.e. the bias alone, (B, H, N, N)."""
    z = torch.zeros(pos.batch, enc.num_heads, pos.num_tokens, enc.head_dim)
    return vlpe.attention_logits(enc, z, z, pos, layer=layer)


def patch_offsets(h, w):
    """Yield (i, j, dx, dy) for every patch pair of an h x w grid (tokens after one CLS)."""
    for i in range(h * w):
        for j in range(h * w):
            yield 1 + i, 1 + j, j % w - i % w, j // w - i // w


@pytest.mark.parametrize("group", sorted(SPEC))
def test_fields_of_view_and_penalties_on_7x7_match_the_definitions(group):
    enc = build(head_directions=group)  # depth 12, layer 0: 2 * 1.5 * head slope
    b = bias_of(enc, vlpe.Positions.grid(7, 7, prefix=1))[0]  # (4, 50, 50)
    slopes = [0.5] * 4 if group != "none" else [0.25, 0.0625, 0.015625, 0.00390625]
    for h, sees in enumerate(SPEC[group]):
        for i, j, dx, dy in patch_offsets(7, 7):
            if sees(dx, dy):
                assert b[h, i, j].item() == pytest.approx(-3.0 * slopes[h] * math.hypot(dx, dy), abs=1e-5)
            else:
                assert b[h, i, j].item() < -1e38, (group, h, dx, dy)
    assert (b[:, 0, :] == 0).all() and (b[:, :, 0] == 0).all()  # CLS unmasked and unpenalised both ways


def test_quadrant_and_wedge_heads_see_the_reported_share_of_pairs():
    b = bias_of(build(heads=12, name="lh90"), vlpe.Positions.grid(7, 7, prefix=1))[0, :, 1:, 1:]
    share = (b > -1e30).double().mean((1, 2))
    assert torch.allclose(share[:4], torch.tensor(0.327, dtype=torch.float64), atol=5e-4)  # 28 * 28 / 49^2
    assert torch.allclose(share[4:8], torch.tensor(0.303, dtype=torch.float64), atol=5e-4)
    assert (share[8:] == 1).all()


def test_zero_and_center_heads():
    pos = vlpe.Positions.grid(7, 7, prefix=1)
    assert (bias_of(build(head_directions="zero"), pos) == 0).all()
    b = bias_of(build(head_directions="center"), pos)[0]
    slopes = [0.25, 0.0625, 0.015625, 0.00390625]  # undirected slopes, times 2 * 1.5 at layer 0
    for h in range(4):
        for i, j, _, _ in patch_offsets(7, 7):
            r, c = divmod(j - 1, 7)
            assert b[h, i, j].item() == pytest.approx(-3.0 * slopes[h] * math.hypot(r - 3, c - 3), abs=1e-5)
    zh = bias_of(build(head_directions="zerohalves"), pos)[0]  # masks without a distance penalty
    assert ((zh == 0) | (zh < -1e38)).all() and (zh < -1e38).any()


def test_lh90_slopes_and_head_split():
    enc = build(heads=12, name="lh90")
    torch.testing.assert_close(enc.slopes(0), torch.tensor([1.5] * 8 + [0.75, 0.1875, 0.046875, 0.01171875]))
    torch.testing.assert_close(enc.slopes(11), torch.tensor([0.5] * 8 + [0.25, 0.0625, 0.015625, 0.00390625]))
    names, dirs = head_layout("corners-triangles-none", 12)
    assert names == ["corners"] * 4 + ["triangles"] * 4 + ["none"] * 4
    assert dirs[:4] == [("up", "left"), ("up", "right"), ("down", "left"), ("down", "right")]
    names, dirs = head_layout("corners-none", 12)  # two groups of 12 heads: 8 + 4
    assert names == ["corners"] * 8 + ["none"] * 4 and dirs[4:8] == dirs[:4]
    assert head_layout("corners-triangles-none", 16)[0] == ["corners"] * 8 + ["triangles"] * 4 + ["none"] * 4
    assert head_layout("corners-none", 6)[0] == ["corners"] * 4 + ["none"] * 2
    assert build(heads=6).head_directions == "corners-none"  # default: LH-90's groups that fit the heads
    assert build(heads=12).head_directions == "corners-triangles-none"
    enc16 = build(heads=16, head_directions="corners-triangles-none", global_slope=1.0, layer_slopes=(1.0, 1.0))
    assert enc16.slopes(0)[:8].tolist() == [0.5] * 4 + [0.25] * 4  # 8 directed heads: 1/2 x4, 1/4 x4


@pytest.mark.parametrize("name", ["lh180", "lh90", "lh45"])
def test_translation_and_extrapolation(name):
    enc = build(heads=12, name=name)
    b = bias_of(enc, vlpe.Positions.grid(6, 7, prefix=1))[0]
    seen = {}
    for i, j, dx, dy in patch_offsets(6, 7):
        key = (dx, dy)
        if key in seen:
            assert torch.equal(b[:, i, j], seen[key])
        else:
            seen[key] = b[:, i, j]
    check(enc, "relative")
    check(enc, "extrapolation")  # the patch-patch block of a larger grid equals the smaller grid


# head permutation a horizontal flip induces (left <-> right), worked out from the group tables
FLIPS = {
    "lh90": [1, 0, 3, 2, 4, 5, 7, 6, 8, 9, 10, 11],  # corners UL<->UR, DL<->DR; wedges left<->right
    "lh180": [0, 1, 3, 2, 5, 4, 7, 6, 8, 9, 10, 11],  # halves left<->right; diagonals up-right<->up-left, ...
    "lh45": [4, 5, 3, 2, 0, 1, 7, 6, 8, 9, 10, 11],  # up/down octants swap sides; left/right octants swap
}


@pytest.mark.parametrize("name", sorted(FLIPS))
def test_horizontal_flip_swaps_left_and_right_heads(name):
    enc = build(heads=12, name=name)
    pos = vlpe.Positions.grid(5, 6, prefix=1)
    coords = pos.coords.clone()
    coords[:, 1:, 1] = 5 - coords[:, 1:, 1]  # mirror the columns, same token order
    flipped = bias_of(enc, pos.with_coords(coords))
    assert torch.equal(flipped, bias_of(enc, pos)[:, FLIPS[name]])


def test_zero_global_slope_with_unmasked_heads_is_nope():
    pos = vlpe.Positions.grid(4, 5, prefix=1)
    enc = build(head_directions="none", global_slope=0.0, depth=2)
    nope = vlpe.encodings.build("nope", dim=32, num_heads=4, depth=2)
    assert torch.equal(probe(enc, pos), probe(nope, pos))
    assert not torch.equal(probe(build(head_directions="none", depth=2), pos), probe(nope, pos))


def test_score_honours_rows_and_chunked_attention_equals_whole():
    enc = build(heads=12, name="lh45")
    pos = vlpe.Positions.grid(6, 5, prefix=2)
    q, k, v = torch.randn(3, 2, 12, pos.num_tokens, 8).unbind(0)
    ctx = enc.prepare(pos)
    full = enc.score(q, k, ctx, 3)
    for rows in (slice(0, 1), slice(0, 7), slice(1, 4), slice(10, 32)):
        torch.testing.assert_close(enc.score(q[:, :, rows], k, ctx, 3, rows=rows), full[:, :, rows], rtol=0, atol=0)
    whole = attend(q, k, v, enc=enc, ctx=ctx, layer=3)
    chunked = attend(q, k, v, enc=enc, ctx=ctx, layer=3, max_bias_bytes=2 * 12 * pos.num_tokens * 4 * 5)
    torch.testing.assert_close(chunked, whole)


def test_context_holds_only_per_token_tables():
    enc = build(heads=12, name="lh90", head_directions="corners-triangles-center", fill_with="max")
    pos = vlpe.Positions.grid(16, 16, prefix=1)
    ctx = enc.prepare(pos)
    for name, t in ctx.tables.items():
        assert t.numel() <= 4 * pos.num_tokens, name  # O(N): projections, centre distances, diagonal


def test_per_sample_coordinates():
    a, b = vlpe.Positions.grid(4, 4, prefix=1), vlpe.Positions.grid(4, 4, prefix=1)
    coords = torch.cat([a.coords, b.coords * 1.5])  # the second sample at a different patch spacing
    both = vlpe.Positions(coords, prefix=1)
    enc = build(heads=12, name="lh90")
    torch.testing.assert_close(bias_of(enc, both)[1:], bias_of(enc, vlpe.Positions(b.coords * 1.5, prefix=1)))
    torch.testing.assert_close(bias_of(enc, both)[:1], bias_of(enc, a))


def test_fill_and_distance_options():
    pos = vlpe.Positions.grid(7, 7, prefix=1)
    base = bias_of(build(head_directions="corners"), pos)[0]
    hidden = base < -1e38
    zero = bias_of(build(head_directions="corners", fill_with="zero"), pos)[0]
    assert (zero[hidden] == 0).all() and torch.equal(zero[~hidden], base[~hidden])
    top = bias_of(build(head_directions="corners", fill_with="max"), pos)[0]
    assert torch.allclose(top[hidden], torch.tensor(-1.5 * 6 * math.sqrt(2)))  # the 7x7 diagonal
    sq = bias_of(build(head_directions="corners", distance="square"), pos)[0]
    rt = bias_of(build(head_directions="corners", distance="sqrt"), pos)[0]
    d = -base[~hidden] / 1.5  # Euclidean distances of the visible pairs
    torch.testing.assert_close(sq[~hidden], -1.5 * d.square())
    torch.testing.assert_close(rt[~hidden], -1.5 * d.sqrt())


def test_bf16_autocast_keeps_distances_fp32():
    enc = build(heads=12, name="lh90")
    pos = vlpe.Positions.grid(5, 6, prefix=1).shifted([500.0, 700.0])
    q, k = torch.randn(2, 1, 12, pos.num_tokens, 8).unbind(0)
    ctx = enc.prepare(pos)
    ref = enc.score(q, k, ctx, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = enc.score(q.bfloat16(), k.bfloat16(), enc.prepare(pos), 0)
        logits = vlpe.attention_logits(enc, q, k, pos)
    assert low.dtype == torch.float32 and torch.equal(low, ref)
    full = vlpe.attention_logits(enc, q, k, pos)
    seen = full > -1e30
    assert torch.equal(logits > -1e30, seen)
    assert (logits.float()[seen] - full[seen]).abs().max() < 0.1


@pytest.mark.slow
def test_flex_attention_equals_the_dense_path():
    """FlexAttention (compiled on CPU, forward only) with the analytic score_mod and the block mask."""
    enc = build(heads=12, head_directions="corners-triangles-center")
    pos = vlpe.Positions.grid(5, 6, prefix=1)
    q, k, v = torch.randn(3, 1, 12, pos.num_tokens, 8).unbind(0)
    ctx = enc.prepare(pos)
    with torch.no_grad():
        dense = attend(q, k, v, enc=enc, ctx=ctx, layer=2, backend="sdpa")
        flex = attend(q, k, v, enc=enc, ctx=ctx, layer=2, backend="flex")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_bad_options_raise_value_errors():
    with pytest.raises(ValueError, match="unknown LookHere direction"):
        build(head_directions="corners-sideways")
    with pytest.raises(ValueError, match="at least 9 heads"):
        build(heads=4, head_directions="corners-triangles-none")
    with pytest.raises(ValueError, match="fill_with"):
        build(fill_with="nan")
    with pytest.raises(ValueError, match="distance"):
        build(distance="cubic")
    with pytest.raises(ValueError, match="head_slopes"):
        build(head_directions="corners", head_slopes=[1.0, 2.0])
    with pytest.raises(ValueError, match="layer_slopes"):
        build(head_directions="corners", layer_slopes=(1.0, 0.5, 0.2))
    with pytest.raises(ValueError, match="axes"):
        build(head_directions="corners", num_axes=3)
