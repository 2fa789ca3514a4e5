"""PaPE / PaPE-RI: widened q/k against a slow explicit parabolic bias, invariances, numerics, options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vlpe
from vlpe import Positions, attend, attention_logits
from vlpe.encodings import build
from benchmarks.reference_forms import PaPENaive
from vlpe.testing import PropertyFailure, check_rotation_invariant


def _qk(B, H, N, Dh, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, Dh, generator=g, dtype=dtype), torch.randn(B, H, N, Dh, generator=g, dtype=dtype)


def _explicit_positions(pos: Positions, prefix_position: str) -> torch.Tensor:
    """Raw (uncentred) coordinates with prefix tokens one step before the smallest patch coordinate."""
    p = pos.coords.double().clone()  # (B, N, A)
    if pos.prefix and prefix_position == "corner":
        p[:, : pos.prefix] = p[:, pos.prefix :].amin(dim=1, keepdim=True) - 1.0
    return p


def _explicit_logits(enc, q, k, pos, layer, prefix_position="corner"):
    """e_ij = (q_i . k_j + sum_m [-a_im (w_m . d)^2 + b_im (w_m . d)]) / sqrt(Dh), d = p_i - p_j, by loops."""
    B, H, N, Dh = q.shape
    x = q.transpose(1, 2).reshape(B, N, H * Dh)  # token = all heads' query
    p = _explicit_positions(pos, prefix_position)
    out = torch.empty(B, H, N, N, dtype=torch.float64)
    if enc.name == "pape":
        M = enc.num_parabolas
        a = F.softplus(x @ enc.coeff_a[layer].double()).reshape(B, N, H, M)
        b = (x @ enc.coeff_b[layer].double()).reshape(B, N, H, M)
        w = enc.position[layer].double()  # (H, M, A)
    else:
        alpha = F.softplus(x @ enc.coeff[layer].double()) * enc.scales[layer].double() ** 2  # (B, N, H)
    for bi in range(B):
        pb = p[bi if p.shape[0] > 1 else 0]
        for i in range(N):
            for j in range(N):
                d = pb[i] - pb[j]  # (A,)
                skip = prefix_position == "none" and (i < pos.prefix or j < pos.prefix)
                if enc.name == "pape":
                    delta = w @ d  # (H, M)
                    bias = (-a[bi, i] * delta**2 + b[bi, i] * delta).sum(-1)  # (H,)
                else:
                    bias = -alpha[bi, i] * (d @ d)  # (H,)
                if skip:
                    bias = torch.zeros_like(bias)
                out[bi, :, i, j] = ((q[bi, :, i] * k[bi, :, j]).sum(-1) + bias) / math.sqrt(Dh)
    return out


CASES = [
    ("pape", dict(num_parabolas=7), Positions.grid(3, 4, prefix=1), "corner"),
    ("pape", dict(num_parabolas=5, prefix_position="none"), Positions.grid(3, 3, prefix=2), "none"),
    ("pape_ri", dict(), Positions.grid(3, 4, prefix=1), "corner"),
    ("pape", dict(num_parabolas=4, num_axes=3), None, "corner"),  # continuous 3D points, no grid
    ("pape_ri", dict(num_axes=3), None, "corner"),
]


@pytest.mark.parametrize("name,opts,pos,prefix_position", CASES)
def test_widened_dot_product_equals_explicit_bias(name, opts, pos, prefix_position):
    enc = build(name, dim=32, num_heads=2, depth=2, **opts).double()
    if pos is None:
        g = torch.Generator().manual_seed(3)
        pos = Positions.points(torch.randn(2, 9, 3, generator=g, dtype=torch.float64) * 5 + 40)
    q, k = _qk(pos.batch, 2, pos.num_tokens, 16)
    for layer in (0, 1):
        got = attention_logits(enc, q, k, pos, layer=layer)
        want = _explicit_logits(enc, q, k, pos, layer, prefix_position)
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize("opts,pos,prefix_position", [c[1:] for c in CASES if c[0] == "pape"])
def test_naive_reference_form_matches_the_explicit_bias_and_the_folded_form(opts, pos, prefix_position):
    """The benchmark's 3M + 2 channel form (the reference's naive layout) is a third derivation of the same logits."""
    folded = build("pape", dim=32, num_heads=2, depth=2, **opts).double()
    naive = vlpe.encodings.construct(PaPENaive, dim=32, num_heads=2, depth=2, **opts).double()
    naive.load_state_dict(folded.state_dict())
    assert naive.extra_width == 3 * folded.num_parabolas + 2 > folded.extra_width
    if pos is None:
        g = torch.Generator().manual_seed(3)
        pos = Positions.points(torch.randn(2, 9, 3, generator=g, dtype=torch.float64) * 5 + 40)
    q, k = _qk(pos.batch, 2, pos.num_tokens, 16, seed=5)
    for layer in (0, 1):
        got = attention_logits(naive, q, k, pos, layer=layer)
        want = _explicit_logits(folded, q, k, pos, layer, prefix_position)
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-9), (got - want).abs().max()
        assert torch.allclose(got, attention_logits(folded, q, k, pos, layer=layer), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_fused_sdpa_output_equals_softmax_of_explicit_logits(name):
    enc = build(name, dim=32, num_heads=2, depth=1).double()
    pos = Positions.grid(4, 3, prefix=1)
    q, k = _qk(1, 2, pos.num_tokens, 16)
    v = torch.randn_like(q)
    ctx = enc.prepare(pos)
    out = attend(q, k, v, enc=enc, ctx=ctx, layer=0, backend="sdpa")
    want = _explicit_logits(enc, q, k, pos, 0).softmax(-1) @ v
    assert torch.allclose(out, want, atol=1e-10)
    assert enc.hooks == ("widen",)  # no score hook: nothing N x N is built, the fused path stays available


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_translation_invariance_including_prefix(name):
    enc = build(name, dim=64, num_heads=4, depth=1)
    pos = Positions.grid(5, 6, prefix=1)
    q, k = _qk(1, 4, pos.num_tokens, 16, dtype=torch.float32)
    base = attention_logits(enc, q, k, pos)
    for off in ([3.0, -7.0], [250.0, 1000.0]):
        moved = attention_logits(enc, q, k, pos.shifted(off))
        assert torch.equal(moved, base)  # integer grids centre exactly: bit-identical
    g = torch.Generator().manual_seed(1)
    pts = Positions.points(torch.randn(1, 20, 2, generator=g) * 3)
    q, k = _qk(1, 4, 20, 16, dtype=torch.float32)
    base = attention_logits(enc, q, k, pts)
    moved = attention_logits(enc, q, k, pts.with_coords(pts.coords + torch.tensor([12.3, -45.6])))
    assert torch.allclose(moved, base, atol=1e-4 * base.abs().max().item())


def test_pape_ri_rotation_invariant_and_pape_is_not():
    ri = build("pape_ri", dim=64, num_heads=4, depth=1, num_axes=3)
    check_rotation_invariant(ri)  # random 3D rotations
    check_rotation_invariant(build("pape_ri", dim=64, num_heads=4, depth=1))
    with pytest.raises(PropertyFailure):
        check_rotation_invariant(build("pape", dim=64, num_heads=4, depth=1))
    # PaPE's bias does change by much more than rounding under a rotation of the coordinates
    enc = build("pape", dim=64, num_heads=4, depth=1)
    pts = Positions.points(torch.randn(1, 16, 2) * 4)
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]])
    q, k = _qk(1, 4, 16, 16, dtype=torch.float32)
    diff = attention_logits(enc, q, k, pts) - attention_logits(enc, q, k, pts.with_coords(pts.coords @ rot.T))
    assert diff.abs().max() > 0.1


def test_bf16_large_offset_cancels_exactly_and_error_is_small():
    """64 x 64 grid (+ CLS) under bf16 autocast: an offset of 1000 gives bit-identical logits, and the logits of
    near pairs (the ones softmax keeps) stay as close to fp32 as plain bf16 q . k."""
    torch.manual_seed(0)
    pos = Positions.grid(64, 64, prefix=1)
    near = torch.cdist(pos.coords[0], pos.coords[0]) <= 3  # (N, N)
    q, k = _qk(1, 1, pos.num_tokens, 64, dtype=torch.float32)
    with torch.no_grad():
        nope = build("nope", dim=64, num_heads=1)
        nope_ref = attention_logits(nope, q, k, pos)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nope_err = (attention_logits(nope, q, k, pos).float() - nope_ref).abs().max()
        for name in ("pape", "pape_ri"):
            enc = build(name, dim=64, num_heads=1, depth=1)
            ref = attention_logits(enc, q, k, pos)[0, 0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = attention_logits(enc, q, k, pos)[0, 0]
                low_off = attention_logits(enc, q, k, pos.shifted([1000.0, 1000.0]))[0, 0]
            assert torch.equal(low, low_off)
            err = (low.float() - ref).abs()
            near_err = err[near].max().item()
            print(
                f"\n[{name} bf16 vs fp32, 64x64 grid] near pairs (|d| <= 3): max |err| {near_err:.4f} "
                f"(|logit| <= {ref[near].abs().max().item():.1f}); all pairs: {err.max().item():.3f} "
                f"(|logit| <= {ref.abs().max().item():.0f}); plain bf16 q.k: {nope_err.item():.4f}"
            )
            assert near_err < 4 * nope_err.item() + 0.05
            assert err.max().item() < 0.01 * ref.abs().max().item()  # far pairs: bf16 output rounding only


def test_fp32_features_match_fp64():
    enc = build("pape", dim=64, num_heads=2, depth=1)
    pos = Positions.grid(32, 32, prefix=1).shifted([500.0, 500.0])
    q, k = _qk(1, 2, pos.num_tokens, 32, dtype=torch.float32)
    got = attention_logits(enc, q, k, pos)
    enc64 = build("pape", dim=64, num_heads=2, depth=1).double()
    enc64.load_state_dict(enc.state_dict())
    want = attention_logits(enc64, q.double(), k.double(), pos.replace(coords=pos.coords.double()))
    near = torch.cdist(pos.coords[0].double(), pos.coords[0].double()) <= 3
    assert (got.double() - want)[0][:, near].abs().max() < 1e-2


def test_neutral_settings():
    """Spec 8 item 2: zero coefficient weights still leave softplus(0) = log 2 curvature, so the position
    projection must be zeroed too; neutralize() does both and the encoding is exactly nope."""
    pos = Positions.grid(4, 4, prefix=1)
    q, k = _qk(1, 4, pos.num_tokens, 16, dtype=torch.float32)
    nope = attention_logits(build("nope", dim=64, num_heads=4), q, k, pos)
    enc = build("pape", dim=64, num_heads=4, depth=1)
    with torch.no_grad():
        enc.coeff_a.zero_()
        enc.coeff_b.zero_()
    assert (attention_logits(enc, q, k, pos) - nope).abs().max() > 0.1  # log 2 curvature: still positional
    with torch.no_grad():
        enc.position.zero_()
    assert torch.allclose(attention_logits(enc, q, k, pos), nope, atol=1e-6)
    ri = build("pape_ri", dim=64, num_heads=4, depth=1)
    assert (attention_logits(ri, q, k, pos) - nope).abs().max() > 1e-3
    with torch.no_grad():
        ri.neutralize()
    assert torch.allclose(attention_logits(ri, q, k, pos), nope, atol=1e-6)


def test_distance_decay_and_directional_asymmetry():
    """PaPE-RI's positional term decreases strictly along a ray; PaPE's term for d and -d differs by 2 b . d."""
    pts = torch.zeros(1, 8, 2)
    pts[0, 1:, 0] = torch.arange(1, 8).float()
    pts[0, 1:, 1] = 0.5 * torch.arange(1, 8).float()
    pos = Positions.points(pts)
    q = torch.randn(1, 2, 8, 16)
    zeros = torch.zeros_like(q)
    ri = build("pape_ri", dim=32, num_heads=2, depth=1)
    bias = attention_logits(ri, q, zeros, pos)[0, :, 0]  # (H, N): query 0, keys along the ray
    assert (bias[:, 1:] < bias[:, :-1]).all()
    enc = build("pape", dim=32, num_heads=2, depth=1, num_parabolas=3).double()
    sym = Positions.points(torch.tensor([[[0.0, 0.0], [2.0, 1.0], [-2.0, -1.0]]], dtype=torch.float64))
    q = torch.randn(1, 2, 3, 16, dtype=torch.float64)
    z = torch.zeros_like(q)
    e = attention_logits(enc, q, z, sym)[0, :, 0] * 4.0  # (H, 3) positional term of query 0 (times sqrt(Dh))
    x = q.transpose(1, 2).reshape(1, 3, 32)  # the token: all heads' query
    b = (x @ enc.coeff_b[0].double()).reshape(1, 3, 2, 3)  # (1, N, H, M) slopes
    w = enc.position[0]  # (H, M, 2)
    d = torch.tensor([-2.0, -1.0], dtype=torch.float64)  # p_0 - p_1
    bdotd = (b[0, 0] * (w @ d)).sum(-1)  # (H,)
    assert torch.allclose(enc.coefficients(q, 0)[1][0, 0] @ d, bdotd, atol=1e-12)
    assert torch.allclose(e[:, 1] - e[:, 2], 2 * bdotd, atol=1e-10)


def test_padding_tokens_do_not_move_the_centre_or_change_real_logits():
    enc = build("pape", dim=64, num_heads=4, depth=1)
    g = torch.Generator().manual_seed(0)
    pts = torch.randn(1, 10, 2, generator=g) * 3
    padded = torch.cat([pts, torch.full((1, 4, 2), 1e4)], dim=1)
    valid = torch.tensor([[True] * 10 + [False] * 4])
    q, k = _qk(1, 4, 14, 16, dtype=torch.float32)
    a = attention_logits(enc, q[:, :, :10], k[:, :, :10], Positions.points(pts))
    b = attention_logits(enc, q, k, Positions.points(padded, valid=valid))
    assert torch.allclose(a, b[:, :, :10, :10], rtol=0, atol=1e-6 * a.abs().max().item())  # same centre


def test_batched_positions_and_training_gradients():
    enc = build("pape", dim=64, num_heads=4, depth=2)
    attn = vlpe.Attention(dim=64, num_heads=4)
    g = torch.Generator().manual_seed(0)
    pos = Positions.points(torch.randn(3, 12, 2, generator=g) * 4)
    x = torch.randn(3, 12, 64, requires_grad=True)
    ctx = enc.prepare(pos)
    out = attn(x, enc=enc, ctx=ctx, layer=1)
    out.square().mean().backward()
    for p in (enc.position, enc.coeff_a, enc.coeff_b):
        assert p.grad is not None and p.grad[1].abs().sum() > 0 and p.grad[0].abs().sum() == 0
    # each sample equals its own single-sample forward
    one = attn(x[1:2], enc=enc, ctx=enc.prepare(pos.replace(coords=pos.coords[1:2])), layer=1)
    assert torch.allclose(out[1:2], one, atol=1e-5)


def test_parameters_stay_fp32_and_bf16_model_runs():
    enc = build("pape", dim=64, num_heads=4, depth=1)
    ri = build("pape_ri", dim=64, num_heads=4, depth=1)
    for e in (enc, ri):
        before = {n: t.detach().clone() for n, t in e.state_dict().items()}
        e.half()
        e.bfloat16()
        for n, t in e.state_dict().items():  # exact fp32 values, not rounded ones
            assert t.dtype == torch.float32 and torch.equal(t, before[n]), n
    pos = Positions.grid(6, 6, prefix=1).shifted([300.0, 300.0])
    q, k = _qk(1, 4, pos.num_tokens, 16, dtype=torch.float32)
    for e in (enc, ri):
        ref = attention_logits(e, q, k, pos)
        low = attention_logits(e, q.bfloat16(), k.bfloat16(), pos)
        assert low.dtype == torch.bfloat16
        assert (low.float() - ref).abs().max() < 0.02 * ref.abs().max() + 0.1


def test_bad_options_raise():
    with pytest.raises(ValueError, match="num_parabolas"):
        build("pape", dim=64, num_heads=4, num_parabolas=0)
    with pytest.raises(ValueError, match="prefix_position"):
        build("pape_ri", dim=64, num_heads=4, prefix_position="centre")
    enc = build("pape", dim=64, num_heads=4, depth=2)
    pos = Positions.grid(2, 2)
    q, k = _qk(1, 4, 4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="depth"):
        attention_logits(enc, q, k, pos, layer=2)
