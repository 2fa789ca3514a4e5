"""FIRE (Li et al., ICLR 2024) for nD coordinates: the bias against a slow per-pair loop written from the paper's
formula, shift invariance of continuous coordinates, the extent normaliser, the analytic flex score_mod, errors,
gradients and fp32 numerics."""

from __future__ import annotations

import math

import pytest
import torch

import vlpe
from vlpe.attention_forms import flex_mods
from vlpe import Positions
from vlpe.encodings import build
from vlpe.testing import PropertyFailure, check


def _qkv(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


def _coords(B, N, A, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, A, generator=g) * scale


def _randomise(enc, seed=0):
    """Non-default c and L so the loop exercises them (and the per-layer parameters differ)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        enc.c.copy_(0.05 + torch.rand(enc.depth, generator=g))
        enc.l.copy_(0.5 + torch.rand(enc.depth, generator=g))
    return enc


def _reference_bias(enc, coords, prefix, layer, valid=None):
    """Slow explicit loop: b_h(i, j) = MLP(psi(offset) / (psi(T) + eps)), psi(x) = log(c x + 1)."""
    B, N, A = coords.shape
    c = abs(enc.c[layer].item())
    L = abs(enc.l[layer].item()) * enc.init_L
    w1, b1 = enc.w1[layer].tolist(), enc.b1[layer].tolist()
    w2, b2 = enc.w2[layer].tolist(), enc.b2[layer].tolist()
    psi = lambda x: math.log(c * x + 1.0)  # noqa: E731
    out = torch.zeros(B, enc.num_heads, N, N, dtype=torch.float64)
    for b in range(B):
        pts = [coords[b, i].tolist() for i in range(N)]
        real = [i for i in range(prefix, N) if valid is None or bool(valid[0 if valid.shape[0] == 1 else b, i])]
        ranges = [max(pts[i][a] for i in real) - min(pts[i][a] for i in real) for a in range(A)]
        if enc.distance == "euclidean":
            ext = [math.sqrt(sum(r * r for r in ranges))]
        else:
            ext = ranges
        T = [max(L, e) for e in ext] if enc.normalize == "extent" else [L] * len(ext)
        for i in range(prefix, N):
            for j in range(prefix, N):
                off = [pts[i][a] - pts[j][a] for a in range(A)]
                if enc.distance == "euclidean":
                    x = [psi(math.sqrt(sum(o * o for o in off))) / (psi(T[0]) + 1e-6)]
                else:
                    x = [math.copysign(psi(abs(o)), o) / (psi(T[a]) + 1e-6) for a, o in enumerate(off)]
                hid = [max(0.0, b1[u] + sum(w1[u][f] * x[f] for f in range(len(x)))) for u in range(enc.hidden)]
                for h in range(enc.num_heads):
                    out[b, h, i, j] = b2[h] + sum(w2[h][u] * hid[u] for u in range(enc.hidden))
    return out


@pytest.mark.parametrize(
    "opts",
    [
        dict(distance="axial", normalize="extent"),
        dict(distance="axial", normalize="threshold"),
        dict(distance="euclidean", normalize="extent"),
        dict(distance="euclidean", normalize="threshold"),
    ],
)
def test_bias_equals_a_slow_per_pair_loop(opts):
    enc = _randomise(build("fire", dim=24, num_heads=3, depth=2, hidden=8, **opts))
    coords = _coords(2, 9, 2, seed=1)
    pos = Positions(coords, prefix=1)
    q, k, _ = _qkv(2, 3, 9, 8)
    ctx = enc.prepare(pos)
    for layer in range(2):
        got = enc.score(q, k, ctx, layer)
        ref = _reference_bias(enc, pos.coords, 1, layer)
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)
    # prefix rows and columns carry no bias
    assert torch.equal(got[:, :, 0], torch.zeros_like(got[:, :, 0]))
    assert torch.equal(got[:, :, :, 0], torch.zeros_like(got[:, :, :, 0]))


def test_bias_on_a_3d_grid_and_with_padding_equals_the_loop():
    enc = _randomise(build("fire", dim=32, num_heads=2, depth=1, num_axes=3, hidden=6), seed=3)
    pos = Positions.video(2, 2, 3, prefix=1)
    q, k, _ = _qkv(1, 2, pos.num_tokens, 16)
    torch.testing.assert_close(
        enc.score(q, k, enc.prepare(pos), 0).double(), _reference_bias(enc, pos.coords, 1, 0), rtol=0, atol=1e-5
    )
    # padding tokens do not widen the extent: a far-away padding token changes nothing among real tokens
    coords = _coords(2, 8, 3, seed=4)
    coords[1, -1] = 1000.0
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, -1] = False
    padded = Positions(coords, prefix=1, valid=valid)
    got = enc.score(q[:, :, :8], k[:, :, :8], enc.prepare(padded), 0)
    torch.testing.assert_close(got.double(), _reference_bias(enc, padded.coords, 1, 0, valid), rtol=0, atol=1e-5)


def test_score_honours_rows_and_chunked_attention():
    enc = build("fire", dim=48, num_heads=6, depth=1)
    pos = Positions.grid(5, 6, prefix=1)
    q, k, v = _qkv(2, 6, pos.num_tokens, 8)
    ctx = enc.prepare(pos)
    full = enc.score(q, k, ctx, 0)
    part = enc.score(q[:, :, 4:11], k, ctx, 0, rows=slice(4, 11))
    torch.testing.assert_close(part, full[..., 4:11, :], rtol=0, atol=1e-6)
    chunked = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="sdpa", max_bias_bytes=2 * 6 * 31 * 4 * 3)
    eager = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="eager")
    torch.testing.assert_close(chunked, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("distance", ["axial", "euclidean"])
@pytest.mark.parametrize("normalize", ["extent", "threshold"])
def test_relative_under_shifts_of_continuous_coordinates(distance, normalize):
    enc = _randomise(build("fire", dim=32, num_heads=4, depth=1, num_axes=3, distance=distance, normalize=normalize))
    coords = _coords(1, 12, 3, seed=2)
    q, k, _ = _qkv(1, 4, 12, 8)
    base = vlpe.attention_logits(enc, q, k, Positions(coords))
    moved = vlpe.attention_logits(enc, q, k, Positions(coords + torch.tensor([7.25, -3.5, 11.0])))
    torch.testing.assert_close(moved, base, rtol=0, atol=1e-4)


def test_extent_normaliser_interpolates_and_threshold_extrapolates():
    """extent: a larger grid compresses the same offsets (the sub-block differs); threshold: it does not."""
    ext = build("fire", dim=32, num_heads=4, depth=1, normalize="extent", init_L=1.0)
    thr = build("fire", dim=32, num_heads=4, depth=1, normalize="threshold", init_L=1.0)
    with torch.no_grad():
        for name in ("w1", "b1", "w2", "b2"):
            getattr(thr, name).copy_(getattr(ext, name))
    check(thr, "extrapolation")
    with pytest.raises(PropertyFailure, match="extrapolation"):
        check(ext, "extrapolation")
    # on a grid whose extent is below L the two modes agree
    big_L = dict(dim=32, num_heads=4, depth=1, init_L=50.0)
    a, b = build("fire", normalize="extent", **big_L), build("fire", normalize="threshold", **big_L)
    b.load_state_dict(a.state_dict())
    pos = Positions.grid(4, 5, prefix=1)
    q, k, _ = _qkv(1, 4, pos.num_tokens, 8)
    torch.testing.assert_close(vlpe.attention_logits(a, q, k, pos), vlpe.attention_logits(b, q, k, pos))


def test_instance_claims_follow_the_options():
    assert build("fire", dim=16, num_heads=2).claims == {"relative", "neutral", "fp32_angles"}
    assert "extrapolation" in build("fire", dim=16, num_heads=2, normalize="threshold").claims
    euc = build("fire", dim=16, num_heads=2, normalize="threshold", distance="euclidean")
    assert {"extrapolation", "rotation_invariant"} <= euc.claims
    for claim in sorted(euc.claims):
        check(euc, claim)


@pytest.mark.parametrize("distance", ["axial", "euclidean"])
def test_flex_score_mod_is_analytic_and_equals_the_dense_bias(distance):
    enc = _randomise(build("fire", dim=24, num_heads=3, depth=2, num_axes=3, hidden=5, distance=distance))
    pos = Positions(_coords(2, 9, 3, seed=5), prefix=2)
    q, k, _ = _qkv(2, 3, 9, 8)
    ctx = enc.prepare(pos)
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(3)[None, :, None, None]
    qi = torch.arange(9)[None, None, :, None]
    ki = torch.arange(9)[None, None, None, :]
    for layer in range(2):
        score_mod, block_mask = flex_mods(enc, q, k, ctx, layer)
        assert block_mask is None
        got = score_mod(torch.zeros(2, 3, 9, 9), b, h, qi, ki)
        torch.testing.assert_close(got, enc.score(q, k, ctx, layer).expand(2, 3, 9, 9), rtol=0, atol=1e-5)
    # nothing N x N captured: per-token coordinate columns and parameter-sized tensors only
    captured = []
    for cell in score_mod.__closure__:
        item = cell.cell_contents
        captured += item if isinstance(item, list) else [item] if isinstance(item, torch.Tensor) else []
    assert max(t.numel() for t in captured if isinstance(t, torch.Tensor)) <= max(2 * 9, enc.hidden * 3)


@pytest.mark.slow
def test_flex_backend_matches_eager():
    enc = build("fire", dim=64, num_heads=4, depth=1, hidden=8)
    pos = Positions.grid(4, 5, prefix=1)
    q, k, v = _qkv(2, 4, pos.num_tokens, 16)
    ctx = enc.prepare(pos)
    out = vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="flex")
    torch.testing.assert_close(out, vlpe.attend(q, k, v, enc=enc, ctx=ctx, backend="eager"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(distance="manhattan"), "distance"),
        (dict(normalize="query"), "normalize"),
        (dict(hidden=0), "hidden"),
        (dict(init_c=0.0), "init_c"),
        (dict(init_L=-1.0), "init_L"),
        (dict(init_L=float("inf")), "init_L"),
        (dict(bogus=1), "does not take"),
    ],
)
def test_bad_options_raise_value_error(opts, match):
    with pytest.raises(ValueError, match=match):
        build("fire", dim=16, num_heads=2, **opts)


def test_bad_positions_raise_value_error():
    enc = build("fire", dim=16, num_heads=2)
    q, k, _ = _qkv(1, 2, 10, 8)
    with pytest.raises(ValueError, match="tokens"):
        vlpe.attention_logits(enc, q, k, Positions.grid(3, 4, prefix=1))
    with pytest.raises(ValueError, match="num_axes"):
        enc.prepare(Positions(torch.zeros(10, 3)))


@pytest.mark.parametrize("normalize", ["threshold", "extent"])
def test_gradients_reach_the_mlp_c_and_L(normalize):
    # init_L above the 3x4 grid's extent, so in extent mode too the threshold is the active normaliser
    enc = build("fire", dim=32, num_heads=4, depth=1, normalize=normalize, init_L=20.0)
    pos = Positions.grid(3, 4, prefix=1)
    q, k, v = _qkv(2, 4, pos.num_tokens, 8)
    out = vlpe.attend(q, k, v, enc=enc, ctx=enc.prepare(pos), backend="sdpa")
    out.square().sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {name}"


def test_fp32_through_bf16_cast_and_autocast():
    enc = _randomise(build("fire", dim=32, num_heads=4, depth=1))
    before = {n: p.detach().clone() for n, p in enc.named_parameters()}
    enc.to(torch.bfloat16)
    for n, p in enc.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
    pos = Positions.grid(4, 4, prefix=1).shifted([800.0, 900.0])
    q, k, _ = _qkv(1, 4, pos.num_tokens, 8)
    ctx = enc.prepare(pos)
    ref = enc.score(q, k, ctx, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = enc.score(q.bfloat16(), k.bfloat16(), enc.prepare(pos), 0)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, rtol=0, atol=0)
    torch.testing.assert_close(ref, enc.score(q, k, enc.prepare(Positions.grid(4, 4, prefix=1)), 0), rtol=0, atol=1e-5)
