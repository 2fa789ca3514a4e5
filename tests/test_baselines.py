"""Baseline encodings (ape, sincos, fourier, rope_mixed, alibi): hand-computed examples, slow reference loops and
the properties the logit-level kit cannot see (additive embeddings act on the tokens, not on the logits)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import vlpe
from vlpe.attention_forms import flex_mods
from vlpe import Positions
from vlpe.encodings import build
from vlpe.encodings.alibi import alibi_slopes


def _qkv(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


def _rotation(A, seed):
    g = torch.Generator().manual_seed(seed)
    m, r = torch.linalg.qr(torch.randn(A, A, generator=g, dtype=torch.float64))
    m = m * torch.sign(torch.diagonal(r))
    if torch.linalg.det(m) < 0:
        m[:, 0] = -m[:, 0]
    return m


# =========================================================================== alibi
def test_alibi_slopes_power_of_two_by_hand():
    # H = 8: m_h = 2^(-8 (h+1) / 8) = 1/2, 1/4, ..., 1/256
    expected = torch.tensor([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    assert torch.equal(alibi_slopes(8), expected)


def test_alibi_slopes_non_power_of_two_by_hand():
    # H = 6: the 4 slopes of H = 4 (1/4, 1/16, 1/64, 1/256), then every other slope of H = 8 (1/2, 1/8)
    expected = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])
    assert torch.equal(alibi_slopes(6), expected)
    # H = 12: the 8 slopes of H = 8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the H = 16 sequence
    expected = torch.tensor([2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)])
    torch.testing.assert_close(alibi_slopes(12), expected, rtol=1e-7, atol=0)
    assert torch.equal(alibi_slopes(1), torch.tensor([2.0**-8]))


def test_alibi_bias_on_a_3x3_grid_by_hand():
    enc = build("alibi", dim=8, num_heads=2)  # slopes 1/16, 1/256
    pos = Positions.grid(3, 3, prefix=1)
    q = k = torch.zeros(1, 2, 10, 4)
    bias = enc.score(q, k, enc.prepare(pos), 0)  # (1, H, 10, 10)
    assert bias.shape == (1, 2, 10, 10)
    # token 1 = (0, 0), token 9 = (2, 2), token 6 = (1, 2), token 8 = (2, 1)
    assert bias[0, 0, 1, 9].item() == pytest.approx(-math.sqrt(8) / 16, abs=1e-7)
    assert bias[0, 1, 1, 9].item() == pytest.approx(-math.sqrt(8) / 256, abs=1e-7)
    assert bias[0, 0, 6, 8].item() == pytest.approx(-math.sqrt(2) / 16, abs=1e-7)
    assert bias[0, 0, 2, 3].item() == pytest.approx(-1 / 16, abs=1e-7)  # (0,1) -> (0,2)
    assert bias[0, 0, 5, 5].item() == 0.0
    # prefix tokens unpenalised: the CLS row and column are zero
    assert torch.equal(bias[:, :, 0, :], torch.zeros(1, 2, 10))
    assert torch.equal(bias[:, :, :, 0], torch.zeros(1, 2, 10))
    # every entry against a slow reference loop over token pairs
    rc = [(i // 3, i % 3) for i in range(9)]
    for h, m in enumerate((1 / 16, 1 / 256)):
        for i in range(9):
            for j in range(9):
                d = math.hypot(rc[i][0] - rc[j][0], rc[i][1] - rc[j][1])
                assert bias[0, h, 1 + i, 1 + j].item() == pytest.approx(-m * d, abs=1e-7)


def test_alibi_score_honours_rows_and_chunked_attention():
    enc = build("alibi", dim=48, num_heads=6)
    pos = Positions.grid(5, 6, prefix=1)
    q, k, v = _qkv(2, 6, pos.num_tokens, 8)
    ctx = enc.prepare(pos)
    full = enc.score(q, k, ctx, 0)
    part = enc.score(q[:, :, 4:11], k, ctx, 0, rows=slice(4, 11))
    assert torch.equal(part, full[..., 4:11, :])
    # the sdpa path in query chunks of a few rows equals one eager pass over the dense bias
    chunked = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="sdpa", max_bias_bytes=2 * 6 * 31 * 4 * 3)
    eager = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="eager")
    torch.testing.assert_close(chunked, eager, rtol=0, atol=1e-5)


def test_alibi_flex_score_mod_is_analytic_and_equals_the_dense_bias():
    enc = build("alibi", dim=24, num_heads=3, num_axes=3)
    g = torch.Generator().manual_seed(0)
    coords = torch.randn(2, 9, 3, generator=g) * 5
    pos = Positions(coords, prefix=2)
    q, k, _ = _qkv(2, 3, 9, 8)
    ctx = enc.prepare(pos)
    score_mod, block_mask = flex_mods(enc, q, k, ctx, 0)
    assert block_mask is None
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(3)[None, :, None, None]
    qi = torch.arange(9)[None, None, :, None]
    ki = torch.arange(9)[None, None, None, :]
    got = score_mod(torch.zeros(2, 3, 9, 9), b, h, qi, ki)
    torch.testing.assert_close(got, enc.score(q, k, ctx, 0).expand(2, 3, 9, 9), rtol=0, atol=1e-6)
    # nothing N x N captured: the closure holds per-token coordinate columns only
    captured = [c.cell_contents for c in score_mod.__closure__ if isinstance(c.cell_contents, (list, torch.Tensor))]
    sizes = [t.numel() for item in captured for t in (item if isinstance(item, list) else [item])]
    assert max(sizes) <= 2 * 9


@pytest.mark.slow
def test_alibi_flex_backend_matches_eager():
    enc = build("alibi", dim=64, num_heads=4)
    pos = Positions.grid(4, 5, prefix=1)
    q, k, v = _qkv(2, 4, pos.num_tokens, 16)
    ctx = enc.prepare(pos)
    out = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="flex")
    torch.testing.assert_close(out, vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="eager"), rtol=0, atol=1e-5)


def test_alibi_rotation_and_translation_invariant_in_3d():
    enc = build("alibi", dim=32, num_heads=4, num_axes=3)
    g = torch.Generator().manual_seed(1)
    xyz = torch.randn(1, 16, 3, generator=g, dtype=torch.float64) * 3
    q, k, _ = _qkv(1, 4, 16, 8)
    base = vlpe.attention_logits(enc, q, k, Positions(xyz))
    moved = xyz @ _rotation(3, 5).T + torch.tensor([10.0, -4.0, 2.5], dtype=torch.float64)
    torch.testing.assert_close(vlpe.attention_logits(enc, q, k, Positions(moved)), base, rtol=0, atol=1e-9)


def test_alibi_distances_stay_fp32_under_autocast_at_large_coordinates():
    enc = build("alibi", dim=32, num_heads=4)
    pos = Positions.grid(4, 4, prefix=1).shifted([4096.0, -8192.0])
    q, k, _ = _qkv(1, 4, 17, 8)
    ctx = enc.prepare(pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias = enc.score(q.bfloat16(), k.bfloat16(), ctx, 0)
    assert bias.dtype == torch.float32
    ref = enc.score(q, k, enc.prepare(Positions.grid(4, 4, prefix=1)), 0)
    torch.testing.assert_close(bias, ref, rtol=0, atol=1e-6)


def test_alibi_monotone_decay_along_a_ray():
    enc = build("alibi", dim=16, num_heads=2)
    t = torch.arange(8).float()
    pos = Positions(torch.stack([t * 0.6, t * 0.8], dim=-1))  # a ray, unit steps
    b = enc.score(torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), enc.prepare(pos), 0)[0, :, 0]  # (H, 8)
    assert (b[:, 1:] < b[:, :-1]).all()
    torch.testing.assert_close(b, -alibi_slopes(2)[:, None] * t, rtol=0, atol=1e-6)


# =========================================================================== ape
def test_ape_errors_and_prefix_rules():
    enc = build("ape", dim=16, num_heads=2, grid_size=(4, 4), prefix=1)
    with pytest.raises(ValueError, match="prefix"):
        enc.prepare(Positions.grid(4, 4, prefix=0))
    with pytest.raises(ValueError, match="regular grid"):
        enc.prepare(Positions(torch.randn(1, 17, 2), prefix=1))
    with pytest.raises(ValueError, match="grid_size"):
        build("ape", dim=16, num_heads=2, grid_size=(4, 4, 4))
    with pytest.raises(ValueError, match="grid_size"):
        build("ape", dim=16, num_heads=2, num_axes=3)
    with pytest.raises(ValueError):
        build("ape", dim=16, num_heads=2, num_axes=1)
    x = torch.randn(2, 17, 16)
    ctx = enc.prepare(Positions.grid(4, 4, prefix=1))
    with pytest.raises(ValueError, match="width"):
        enc.embed(torch.randn(2, 17, 8), ctx)
    with pytest.raises(ValueError, match="tokens"):
        enc.embed(torch.randn(2, 18, 16), ctx)
    torch.testing.assert_close(enc.embed(x, ctx), x + enc.pos_embed.detach())


def test_ape_init_neutral_and_weight_decay():
    torch.manual_seed(0)
    enc = build("ape", dim=64, num_heads=4, grid_size=(16, 16))
    w = enc.pos_embed.detach()
    # timm's trunc_normal_(std=.02) cuts at +-2 (absolute), far beyond 100 std: in effect N(0, .02^2)
    assert w.std().item() == pytest.approx(0.02, rel=0.05)
    assert w.mean().abs().item() < 0.002
    assert enc.no_weight_decay() == {"pos_embed"}
    enc.neutralize()
    x = torch.randn(1, 257, 64)
    assert torch.equal(enc.embed(x, enc.prepare(Positions.grid(16, 16, prefix=1))), x)


def test_ape_video_resamples_each_axis():
    """3 axes: trilinear. A table constant along time keeps every frame's (h, w) table when only t changes."""
    enc = build("ape", dim=8, num_heads=2, num_axes=3, grid_size=(2, 3, 4), prefix=1)
    frame = torch.randn(1, 3 * 4, 8)
    with torch.no_grad():
        enc.pos_embed[1:] = frame.expand(2, -1, -1).reshape(-1, 8)
    pe = enc.prepare(Positions.video(5, 3, 4, prefix=1))["pe"][0]  # (1 + 5*12, C)
    assert torch.equal(pe[0], enc.pos_embed[0].detach())
    torch.testing.assert_close(pe[1:].reshape(5, 12, 8), frame.expand(5, -1, -1), rtol=0, atol=1e-6)
    # same size: identity; another size: trilinear, as F.interpolate computes it
    assert torch.equal(enc.prepare(Positions.video(2, 3, 4, prefix=1))["pe"][0], enc.pos_embed.detach())
    pe = enc.prepare(Positions.video(3, 5, 2, prefix=1))["pe"][0, 1:]
    grid = enc.pos_embed.detach()[1:].reshape(1, 2, 3, 4, 8).permute(0, 4, 1, 2, 3)
    ref = F.interpolate(grid, size=(3, 5, 2), mode="trilinear", align_corners=False)
    torch.testing.assert_close(pe, ref.permute(0, 2, 3, 4, 1).reshape(-1, 8), rtol=0, atol=1e-6)


def test_ape_gradient_reaches_the_table_through_resampling():
    enc = build("ape", dim=16, num_heads=2, grid_size=(4, 4))
    x = torch.randn(2, 1 + 36, 16)
    enc.embed(x, enc.prepare(Positions.grid(6, 6, prefix=1))).square().sum().backward()
    assert enc.pos_embed.grad is not None and enc.pos_embed.grad.abs().min() > 0


# =========================================================================== sincos
def _mae_2d_sincos(dim, h, w):
    """MAE ``get_2d_sincos_pos_embed`` re-derived as a slow loop: [sin(col w), cos(col w), sin(row w), cos(row w)]."""
    quarter = dim // 4
    out = torch.zeros(h * w, dim, dtype=torch.float64)
    for i in range(h):
        for j in range(w):
            for kk in range(quarter):
                om = 1.0 / 10000 ** (kk / quarter)
                t = i * w + j
                out[t, kk] = math.sin(j * om)
                out[t, quarter + kk] = math.cos(j * om)
                out[t, 2 * quarter + kk] = math.sin(i * om)
                out[t, 3 * quarter + kk] = math.cos(i * om)
    return out


def test_sincos_per_axis_reverse_axes_is_mae():
    enc = build("sincos", dim=16, num_heads=2, layout="per_axis", reverse_axes=True)
    pe = enc.prepare(Positions.grid(3, 5, prefix=1))["pe"][0]
    torch.testing.assert_close(pe[1:].double(), _mae_2d_sincos(16, 3, 5), rtol=0, atol=1e-6)
    assert torch.equal(pe[0], torch.zeros(16))


def test_sincos_any_axes_points_video_and_leftover_channels():
    # 3 axes on dim 20: P = 3 frequencies per axis, 18 channels, 2 leftover zeros
    enc = build("sincos", dim=20, num_heads=2, num_axes=3, temperature=100.0)
    g = torch.Generator().manual_seed(0)
    xyz = torch.randn(2, 7, 3, generator=g, dtype=torch.float64) * 10
    pe = enc.prepare(Positions.points(xyz))["pe"]  # (2, 7, 20)
    assert pe.shape == (2, 7, 20) and pe.dtype == torch.float64
    om = [100.0 ** (-kk / 3) for kk in range(3)]
    b, n = 1, 4
    want = [math.sin(xyz[b, n, a].item() * o) for a in range(3) for o in om]
    want += [math.cos(xyz[b, n, a].item() * o) for a in range(3) for o in om] + [0.0, 0.0]
    torch.testing.assert_close(pe[b, n], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    # extrapolation: a small video grid's embedding is the matching block of a larger one
    video = build("sincos", dim=24, num_heads=2, num_axes=3)
    small = video.prepare(Positions.video(2, 3, 3, prefix=1))["pe"][0, 1:].reshape(2, 3, 3, 24)
    big = video.prepare(Positions.video(4, 5, 6, prefix=1))["pe"][0, 1:].reshape(4, 5, 6, 24)
    assert torch.equal(small, big[:2, :3, :3])
    with pytest.raises(ValueError, match="layout"):
        build("sincos", dim=16, num_heads=2, layout="interleaved")
    with pytest.raises(ValueError, match="dim"):
        build("sincos", dim=4, num_heads=2, num_axes=3)


def test_sincos_fp32_under_autocast_at_large_coordinates():
    enc = build("sincos", dim=32, num_heads=2)
    pos = Positions.grid(3, 3).shifted([70000.0, 12345.0])
    ref = enc.prepare(Positions(pos.coords.double()))["pe"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pe = enc.prepare(pos)["pe"]
        x = enc.embed(torch.zeros(1, 9, 32, dtype=torch.bfloat16), enc.prepare(pos))
    assert pe.dtype == torch.float32 and x.dtype == torch.bfloat16
    torch.testing.assert_close(pe.double(), ref, rtol=0, atol=5e-3)  # fp32 angle rounding at 7e4 only


# =========================================================================== fourier
def _lff_reference(enc, coords):
    """The paper's formula evaluated directly from the module's weights (B, N, A) -> (B, N, C), fp64."""
    W = enc.w_r.weight.detach().double()  # (F/2, M)
    l1, l2 = enc.mlp[0], enc.mlp[2]
    G = enc.groups
    B, N, A = coords.shape
    x = coords.double().reshape(B, N, G, A // G)
    proj = torch.einsum("bngm,fm->bngf", x, W)
    r = torch.cat([torch.cos(proj), torch.sin(proj)], dim=-1) / math.sqrt(enc.num_features)
    hdn = F.gelu(r @ l1.weight.detach().double().T + l1.bias.detach().double())
    return (hdn @ l2.weight.detach().double().T + l2.bias.detach().double()).reshape(B, N, -1)


def test_fourier_output_at_continuous_coordinates():
    torch.manual_seed(0)
    enc = build("fourier", dim=32, num_heads=4, num_features=16, hidden=24, gamma=3.0)
    g = torch.Generator().manual_seed(3)
    coords = torch.cat([torch.zeros(2, 1, 2), torch.rand(2, 10, 2, generator=g) * 20 - 5], dim=1)
    pos = Positions(coords, prefix=1)
    pe = enc.prepare(pos)["pe"]
    assert pe.shape == (2, 11, 32) and pe.dtype == torch.float32
    torch.testing.assert_close(pe[:, 1:].double(), _lff_reference(enc, coords[:, 1:]), rtol=0, atol=1e-5)
    assert torch.equal(pe[:, 0], torch.zeros(2, 32))  # prefix tokens get zeros
    x = torch.randn(2, 11, 32)
    torch.testing.assert_close(enc.embed(x, enc.prepare(pos)), x + pe)


def test_fourier_groups_share_weights_and_concatenate():
    torch.manual_seed(0)
    enc = build("fourier", dim=24, num_heads=2, num_axes=4, groups=2, num_features=8, hidden=8)
    g = torch.Generator().manual_seed(1)
    coords = torch.randn(1, 5, 4, generator=g)
    pe = enc.encode(coords)
    torch.testing.assert_close(pe.double(), _lff_reference(enc, coords), rtol=0, atol=1e-5)
    torch.testing.assert_close(pe[..., :12], enc.encode(torch.cat([coords[..., :2]] * 2, -1))[..., :12])
    torch.testing.assert_close(pe[..., 12:], enc.encode(torch.cat([coords[..., 2:]] * 2, -1))[..., 12:])
    with pytest.raises(ValueError, match="groups"):
        build("fourier", dim=24, num_heads=2, num_axes=3, groups=2)
    with pytest.raises(ValueError, match="even"):
        build("fourier", dim=24, num_heads=2, num_features=7)


def test_fourier_init_std_is_one_over_gamma():
    torch.manual_seed(0)
    enc = build("fourier", dim=16, num_heads=2, num_features=8192, gamma=4.0)
    assert enc.w_r.weight.std().item() == pytest.approx(0.25, rel=0.05)


def test_fourier_gradient_flows_and_extrapolation_is_evaluation():
    torch.manual_seed(0)
    enc = build("fourier", dim=16, num_heads=2, num_features=8, hidden=8)
    pos = Positions.grid(3, 4, prefix=1)
    x = torch.randn(2, 13, 16, requires_grad=True)
    enc.embed(x, enc.prepare(pos)).square().sum().backward()
    for p in enc.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert x.grad is not None
    with torch.no_grad():
        small = enc.prepare(Positions.grid(3, 4))["pe"][0].reshape(3, 4, 16)
        big = enc.prepare(Positions.grid(7, 9))["pe"][0].reshape(7, 9, 16)
        torch.testing.assert_close(small, big[:3, :4])
        far = Positions(torch.tensor([[[50.5, -20.25]]]))  # any coordinate, no grid
        torch.testing.assert_close(enc.prepare(far)["pe"], enc.encode(far.coords))


def test_fourier_neutral_and_autocast():
    torch.manual_seed(0)
    enc = build("fourier", dim=16, num_heads=2, num_features=8, hidden=8)
    pos = Positions.grid(3, 3, prefix=1).shifted([600.0, 900.0])
    ref = enc.prepare(pos)["pe"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = enc.features(pos.coords)
        low = enc.prepare(pos)["pe"]
    assert feats.dtype == torch.float32
    err = (low.float() - ref).abs().max() / ref.abs().max()
    assert err < 5e-2, err
    neutral = copy.deepcopy(enc).neutralize()
    assert torch.equal(neutral.prepare(pos)["pe"], torch.zeros(1, 10, 16))


# =========================================================================== rope_mixed
def test_rope_mixed_tables_dtype_and_weight_decay():
    enc = build("rope_mixed", dim=64, num_heads=4, depth=3)
    assert enc.no_weight_decay() == {"freqs"}
    assert enc.freqs.shape == (3, 4, 2, 8)
    ctx = enc.prepare(Positions.grid(4, 5, prefix=1))
    assert ctx["cos"].shape == (1, 3, 4, 21, 8) and ctx["cos"].dtype == torch.float32
    with torch.no_grad():  # the inference path computes sin in place: same tables
        inf = enc.prepare(Positions.grid(4, 5, prefix=1))
    assert torch.equal(inf["cos"], ctx["cos"].detach()) and torch.equal(inf["sin"], ctx["sin"].detach())
    p, before = enc.freqs, enc.freqs.detach().clone()
    enc.bfloat16()
    assert enc.freqs is p and enc.freqs.dtype == torch.float32  # learned frequencies stay fp32 ...
    assert torch.equal(enc.freqs.detach(), before)  # ... with their exact values, not bf16-rounded ones
    enc.half()
    assert torch.equal(enc.freqs.detach(), before)
    enc.double()
    assert enc.freqs.dtype == torch.float64


def test_rope_mixed_rotation_per_layer_and_gradient():
    enc = build("rope_mixed", dim=32, num_heads=2, depth=2)
    pos = Positions.grid(3, 3, prefix=1)
    q, k, _ = _qkv(1, 2, 10, 16)
    ctx = enc.prepare(pos)
    q0, k0 = enc.rotate(q, k, ctx, 0)
    q1, _ = enc.rotate(q, k, ctx, 1)
    assert not torch.allclose(q0, q1)  # each layer has its own frequencies
    assert torch.equal(q0[:, :, 0], q[:, :, 0])  # CLS unrotated
    # slow reference: pair m of head h at layer 0 rotates by f[0, h, :, m] . p
    f = enc.freqs.detach()
    for n in range(1, 10):
        p = pos.coords[0, n]
        for h in range(2):
            ang = f[0, h].T @ p  # (D/2,)
            x1, x2 = q[0, h, n, :8], q[0, h, n, 8:]
            want = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])
            torch.testing.assert_close(q0[0, h, n], want, rtol=0, atol=1e-5)
    (q0 * k0).sum().backward()
    assert enc.freqs.grad is not None and enc.freqs.grad[0].abs().sum() > 0
    with pytest.raises(ValueError, match="depth"):
        enc.rotate(q, k, ctx, 2)


def test_rope_mixed_three_axes_init():
    """A = 3: axial magnitudes theta^(-k/P) turned by a random rotation per layer and head."""
    enc = build("rope_mixed", dim=48, num_heads=2, depth=2, num_axes=3)  # head dim 24, 12 pairs, P = 4
    f = enc.freqs.detach().double()  # (L, H, 3, 12)
    mag = 10.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    torch.testing.assert_close(f.norm(dim=-2), mag.repeat(3).expand(2, 2, 12), rtol=1e-6, atol=0)
    dirs = f / f.norm(dim=-2, keepdim=True)
    gram = dirs[..., [0, 4, 8]].transpose(-1, -2) @ dirs[..., [0, 4, 8]]  # the 3 axis directions
    torch.testing.assert_close(gram, torch.eye(3, dtype=torch.float64).expand(2, 2, 3, 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(dirs[..., 1], dirs[..., 0], rtol=0, atol=1e-6)  # one direction per axis group
    assert not torch.allclose(f[0, 0], f[0, 1])  # heads differ
    pos = Positions.video(2, 3, 3, prefix=1)
    assert enc.prepare(pos)["cos"].shape == (1, 2, 2, 19, 12)
    with pytest.raises(ValueError, match="divisible by 4"):
        build("rope_mixed", dim=36, num_heads=2)


@pytest.mark.parametrize("name,opts", [("rope", {"theta": 10000.0}), ("alibi", {})])
def test_fixed_frequency_buffers_survive_downcasts_exactly(name, opts):
    enc = build(name, dim=96, num_heads=6, **opts)
    ((key, buf),) = enc.named_buffers()
    before = buf.clone()
    enc.bfloat16()
    after = dict(enc.named_buffers())[key]
    assert after.dtype == torch.float32 and torch.equal(after, before)


# =========================================================================== apply_rope fast path
def _apply_rope_reference(x, cos, sin):
    """The rotation as a plain autograd graph (chunk / mul / cat), in the promoted precision."""
    rot = 2 * cos.shape[-1]
    xr = x[..., :rot].to(torch.promote_types(x.dtype, cos.dtype))
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, x[..., rot:]], dim=-1) if rot != x.shape[-1] else out


@pytest.mark.parametrize(
    "x_shape,t_shape",
    [((2, 3, 5, 8), (1, 1, 5, 4)), ((2, 3, 5, 10), (2, 3, 5, 3)), ((1, 3, 5, 8), (4, 1, 5, 4))],
    ids=["shared-tables", "partial-rotary", "tables-broadcast-x"],
)
def test_apply_rope_hand_written_backward_matches_autograd(x_shape, t_shape):
    from vlpe.encodings.functional.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(t_shape, generator=g, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(t_shape, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(apply_rope, (x, cos, sin))
    torch.testing.assert_close(apply_rope(x, cos, sin), _apply_rope_reference(x, cos, sin), rtol=0, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(apply_rope(x, cos, sin), _apply_rope_reference(x, cos, sin), rtol=0, atol=1e-12)


def test_apply_rope_bf16_input_rotates_in_table_precision():
    from vlpe.encodings.functional.rope import apply_rope

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 16, generator=g).bfloat16().requires_grad_()
    ang = torch.rand(1, 1, 7, 8, generator=g) * 100
    out = apply_rope(x, ang.cos(), ang.sin())
    ref = _apply_rope_reference(x, ang.cos(), ang.sin())
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    gout = torch.randn(out.shape, generator=g).bfloat16()
    (gx,) = torch.autograd.grad(out, x, gout)
    (gr,) = torch.autograd.grad(ref, x, gout)
    assert gx.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), gr.float(), rtol=0, atol=2e-2)
    with pytest.raises(ValueError, match="channels"):
        apply_rope(x, torch.ones(1, 1, 7, 9), torch.ones(1, 1, 7, 9))


# =========================================================================== registry
@pytest.mark.parametrize("name", ["ape", "sincos", "fourier", "rope_mixed", "alibi"])
def test_baselines_registered_and_reject_unknown_options(name):
    assert name in vlpe.encodings.available()
    with pytest.raises(ValueError, match="does not take"):
        build(name, dim=32, num_heads=2, bogus=1)


@pytest.mark.slow
def test_benchmark_script_runs_side_by_side_with_nope(tmp_path):
    """Smoke run of benchmarks/encoding_cost.py at a toy size: nope is always measured and is the ratio's base."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "encoding_cost.py"
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(script),
        "--encodings",
        "rope",
        "alibi",
        "--configs",
        "2:1",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--dim",
        "32",
        "--heads",
        "2",
        "--depth",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    res = report["configs"][0]["results"]
    assert set(res) == {"nope", "rope", "alibi"} and report["configs"][0]["tokens"] == 5
    assert res["nope"]["ratio_min"] == 1.0 and len(res["rope"]["times_ms"]) == 2
