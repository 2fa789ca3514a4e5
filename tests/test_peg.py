"""PEG / CPE: parity with timm's Twins ``PosConv``, convolution equivariance, border leakage, prefix bypass."""

import math

import pytest
import torch
from timm.models.twins import PosConv

import vlpe
from vlpe.testing import check


def build(dim=8, **opts):
    opts.setdefault("depth", 3)
    return vlpe.encodings.build("peg", dim=dim, num_heads=2, **opts)


def run(enc, x, pos, layer=0):
    return enc.mix(x, enc.prepare(pos), layer)


def grid_tokens(grid_map, prefix_tokens=None):
    """(B, C, *grid) feature map -> (B, N, C) tokens in row-major order, prefix tokens first."""
    tokens = grid_map.flatten(2).transpose(1, 2)
    return tokens if prefix_tokens is None else torch.cat([prefix_tokens, tokens], 1)


def test_matches_timm_twins_posconv():
    enc = build(dim=16)
    with torch.no_grad():
        enc.convs[0].bias.normal_()
    ref = PosConv(16, 16)
    ref.proj[0].load_state_dict(enc.convs[0].state_dict())
    pos = vlpe.Positions.grid(5, 7, prefix=1)
    x = torch.randn(2, pos.num_tokens, 16)
    out = run(enc, x, pos)
    torch.testing.assert_close(out[:, 1:], ref(x[:, 1:].contiguous(), (5, 7)))
    assert torch.equal(out[:, 0], x[:, 0])  # CLS passes unchanged


@pytest.mark.parametrize("k", [3, 5])
def test_shift_equivariance_away_from_the_borders(k):
    enc = build(kernel_size=k)
    pad = (k - 1) // 2
    h, w = 9, 11
    big = torch.randn(1, 8, h + 2, w + 3)
    a, b = big[:, :, :h, :w], big[:, :, 2 : h + 2, 3 : w + 3]  # b is a shifted by (2, 3)
    pos = vlpe.Positions.grid(h, w)
    ya = run(enc, grid_tokens(a), pos).transpose(1, 2).reshape(1, 8, h, w)
    yb = run(enc, grid_tokens(b), pos).transpose(1, 2).reshape(1, 8, h, w)
    # interior of both maps (>= pad from every border): outputs are the shifted copies of each other
    inner_a = ya[:, :, 2 + pad : h - pad, 3 + pad : w - pad]
    torch.testing.assert_close(inner_a, yb[:, :, pad : h - 2 - pad, pad : w - 3 - pad])
    assert not torch.allclose(ya[:, :, 2, 3], yb[:, :, 0, 0])  # at the border the shift is not equivariant


@pytest.mark.parametrize("k", [3, 5])
def test_constant_input_is_non_constant_only_in_a_border_band(k):
    enc = build(kernel_size=k)
    pad = (k - 1) // 2
    h, w = 8, 10
    x = torch.full((1, h * w, 8), 1.5)
    y = run(enc, x, vlpe.Positions.grid(h, w)).transpose(1, 2).reshape(8, h, w)
    inner = y[:, pad : h - pad, pad : w - pad]
    assert torch.allclose(inner, inner[:, :1, :1].expand_as(inner))  # constant inside
    band = torch.ones(h, w, dtype=torch.bool)
    band[pad : h - pad, pad : w - pad] = False
    diff = (y - inner[:, :1, :1]).abs()  # (C, h, w)
    assert (diff[:, band] > 1e-4).all()  # every border position of every channel differs (random weights)


@pytest.mark.parametrize("padding", ["circular", "replicate"])
def test_border_free_paddings_keep_a_constant_input_constant(padding):
    enc = build(padding=padding)
    x = torch.full((1, 6 * 7, 8), -0.5)
    y = run(enc, x, vlpe.Positions.grid(6, 7))
    assert torch.allclose(y, y[:, :1].expand_as(y))


def test_circular_padding_is_exactly_shift_equivariant():
    enc = build(padding="circular")
    a = torch.randn(1, 8, 5, 6)
    b = a.roll((2, -1), dims=(2, 3))
    pos = vlpe.Positions.grid(5, 6)
    ya = run(enc, grid_tokens(a), pos).transpose(1, 2).reshape(1, 8, 5, 6)
    yb = run(enc, grid_tokens(b), pos).transpose(1, 2).reshape(1, 8, 5, 6)
    torch.testing.assert_close(ya.roll((2, -1), dims=(2, 3)), yb)


def test_zero_weights_are_the_identity_and_the_init_is_twins():
    enc = build(dim=64, depth=2)
    std = enc.convs[0].weight.std().item()
    assert abs(std - math.sqrt(2 / 9)) < 0.05 and torch.equal(enc.convs[0].bias, torch.zeros(64))
    x = torch.randn(2, 1 + 4 * 5, 64)
    pos = vlpe.Positions.grid(4, 5, prefix=1)
    assert not torch.allclose(run(enc, x, pos), x)  # not a no-op at init
    with torch.no_grad():
        enc.neutralize()
    assert torch.equal(run(enc, x, pos), x)
    check(build(dim=64, depth=2), "neutral")


@pytest.mark.parametrize("grid", [(1, 1), (1, 9), (9, 1), (3, 7), (7, 3), (14, 14), (6, 10)])
def test_any_grid_shape_and_prefix_tokens_pass_unchanged(grid):
    enc = build(dim=8)
    pos = vlpe.Positions.grid(*grid, prefix=3)
    x = torch.randn(2, pos.num_tokens, 8)
    fmap = x[:, 3:].transpose(1, 2).reshape(2, 8, *grid)
    want = fmap + torch.nn.functional.conv2d(fmap, enc.convs[0].weight, enc.convs[0].bias, padding=1, groups=8)
    y = run(enc, x, pos)
    assert torch.equal(y[:, :3], x[:, :3])
    torch.testing.assert_close(y[:, 3:], grid_tokens(want))


def test_inserted_only_after_the_listed_blocks_with_one_conv_each():
    enc = build(dim=8, depth=4, after=(0, 2))
    assert len(enc.convs) == 2
    pos = vlpe.Positions.grid(4, 4, prefix=1)
    x = torch.randn(1, pos.num_tokens, 8)
    ctx = enc.prepare(pos)
    assert torch.equal(enc.mix(x, ctx, 1), x) and torch.equal(enc.mix(x, ctx, 3), x)
    with torch.no_grad():
        enc.convs[1].weight.zero_()
        enc.convs[1].bias.zero_()
    assert not torch.equal(enc.mix(x, ctx, 0), x)
    assert torch.equal(enc.mix(x, ctx, 2), x)  # block 2 uses its own (zeroed) conv
    assert enc.no_weight_decay() == {"convs.0.weight", "convs.0.bias", "convs.1.weight", "convs.1.bias"}


def test_video_grids_use_a_depthwise_3d_conv():
    enc = build(dim=8, num_axes=3)
    assert isinstance(enc.convs[0], torch.nn.Conv3d)
    assert abs(enc.convs[0].weight.std().item() - math.sqrt(2 / 27)) < 0.05
    # a kernel that only looks within the frame must act like the 2D PEG on every frame
    two_d = build(dim=8)
    with torch.no_grad():
        enc.convs[0].weight.zero_()
        enc.convs[0].weight[:, :, 1] = two_d.convs[0].weight
        enc.convs[0].bias.copy_(torch.randn(8))
        two_d.convs[0].bias.copy_(enc.convs[0].bias)
    t, h, w = 3, 4, 5
    pos = vlpe.Positions.video(t, h, w, prefix=1)
    x = torch.randn(2, pos.num_tokens, 8)
    y = run(enc, x, pos)
    assert torch.equal(y[:, 0], x[:, 0])
    frames = x[:, 1:].reshape(2, t, h * w, 8)
    for f in range(t):
        y2 = run(two_d, frames[:, f], vlpe.Positions.grid(h, w))
        torch.testing.assert_close(y[:, 1:].reshape(2, t, h * w, 8)[:, f], y2)


def test_bf16_autocast():
    enc = build(dim=8)
    pos = vlpe.Positions.grid(4, 4, prefix=1)
    x = torch.randn(1, pos.num_tokens, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(enc, x.bfloat16(), pos)
    torch.testing.assert_close(y.float(), run(enc, x, pos), atol=0.1, rtol=0.05)


def test_errors():
    with pytest.raises(ValueError, match="regular grid"):
        build().prepare(vlpe.Positions.points(torch.randn(1, 20, 2)))  # a 2D point set
    with pytest.raises(ValueError, match="kernel_size"):
        build(kernel_size=4)
    with pytest.raises(ValueError, match="padding"):
        build(padding="mirror")
    with pytest.raises(ValueError, match="after"):
        build(depth=3, after=(3,))
    with pytest.raises(ValueError, match="reflect"):
        build(padding="reflect").prepare(vlpe.Positions.grid(1, 5))
    with pytest.raises(ValueError, match="axes"):
        build(num_axes=1)
    enc = build()
    with pytest.raises(ValueError, match="tokens"):
        enc.mix(torch.randn(1, 10, 8), enc.prepare(vlpe.Positions.grid(3, 4)), 0)
