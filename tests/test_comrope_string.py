"""ComRoPE (AP / LD) and Cayley-STRING against dense fp64 matrix exponentials built here from the parameters."""

from __future__ import annotations

import math

import pytest
import torch

import vlpe
from vlpe import Positions, attention_logits
from vlpe.encodings import build


def _dense_generators(enc, layer: int) -> torch.Tensor:
    """ComRoPE's generators A_a as dense (H, A, D, D) fp64 matrices, from the reference parameterisation:
    block j (channels j, j + D/b, ...) of axis a is Theta[a, j] (G_j - G_j^T); Theta = [j mod A == a] (AP) or
    the learned multipliers (LD)."""
    G = enc.generators[layer].detach().double()  # (H, J, b, b)
    H, J, b, _ = G.shape
    A, D = enc.num_axes, enc.head_dim
    if enc.variant == "ap":
        theta = torch.tensor([[1.0 if j % A == a else 0.0 for j in range(J)] for a in range(A)], dtype=torch.float64)
    else:
        theta = enc.multipliers[layer].detach().double()  # (A, J)
    out = torch.zeros(H, A, D, D, dtype=torch.float64)
    for j in range(J):
        ch = torch.arange(b) * J + j
        for a in range(A):
            out[:, a, ch[:, None], ch[None, :]] = theta[a, j] * (G[:, j] - G[:, j].transpose(-1, -2))
    return out


def _dense_rotation(gens: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """exp(sum_a p_a A_a): gens (H, A, D, D), p (..., A) -> (..., H, D, D)."""
    log = torch.einsum("...a,hade->...hde", p.double(), gens)
    return torch.matrix_exp(log)


def _logits_from_rotations(q, k, R):
    """(R_i q_i) . (R_j k_j) / sqrt(D) with R (B, N, H, D, D)."""
    Rq = torch.einsum("bnhde,bhne->bhnd", R, q)
    Rk = torch.einsum("bnhde,bhne->bhnd", R, k)
    return Rq @ Rk.transpose(-1, -2) / math.sqrt(q.shape[-1])


def _qk(B, H, N, D, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g, dtype=dtype), torch.randn(B, H, N, D, generator=g, dtype=dtype)


COMROPE = [(v, b) for v in ("ap", "ld") for b in (2, 3, 4)]


@pytest.mark.parametrize("variant,block", COMROPE)
def test_comrope_generators_commute_and_rotation_is_exactly_relative(variant, block):
    enc = build("comrope", dim=24, num_heads=2, depth=2, variant=variant, block=block).double()
    for layer in (0, 1):
        gens = _dense_generators(enc, layer)  # (H, A, D, D)
        assert torch.allclose(gens, -gens.transpose(-1, -2))
        ab = gens[:, 0] @ gens[:, 1]
        assert torch.allclose(ab, gens[:, 1] @ gens[:, 0], atol=1e-12)
        g = torch.Generator().manual_seed(layer)
        pi, pj = torch.rand(5, 2, generator=g, dtype=torch.float64), torch.rand(5, 2, generator=g, dtype=torch.float64)
        Ri, Rj = _dense_rotation(gens, pi), _dense_rotation(gens, pj)
        assert torch.allclose(Ri.transpose(-1, -2) @ Rj, _dense_rotation(gens, pj - pi), atol=1e-10)
        # the module's block tables are the same matrices
        assert torch.allclose(enc.rotation_matrix(pi.unsqueeze(0), layer)[0].transpose(0, 1), Ri, atol=1e-10)


def test_non_commuting_generators_are_not_relative():
    """The relativity test above can fail: independent skew blocks per axis (LieRE) break it."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    gens = (X - X.transpose(-1, -2)).unsqueeze(0)  # (1, A=2, D, D), not commuting
    pi, pj = torch.tensor([0.3, 0.7], dtype=torch.float64), torch.tensor([0.9, 0.1], dtype=torch.float64)
    lhs = _dense_rotation(gens, pi).transpose(-1, -2) @ _dense_rotation(gens, pj)
    assert (lhs - _dense_rotation(gens, pj - pi)).abs().max() > 1e-3


@pytest.mark.parametrize("variant,block", COMROPE)
def test_comrope_logits_equal_dense_reference(variant, block):
    """Normalised coordinates (i + 0.5) / n with CLS at 0.5 (the reference's get_positions), fp64."""
    enc = build("comrope", dim=24, num_heads=2, depth=2, variant=variant, block=block).double()
    pos = Positions.grid(3, 4, prefix=1)
    p = (pos.coords.double() + 0.5) / torch.tensor([3.0, 4.0], dtype=torch.float64)
    p[:, 0] = 0.5
    q, k = _qk(1, 2, pos.num_tokens, 12)
    for layer in (0, 1):
        R = _dense_rotation(_dense_generators(enc, layer), p)  # (1, N, H, D, D)
        assert torch.allclose(
            attention_logits(enc, q, k, pos, layer=layer), _logits_from_rotations(q, k, R), atol=1e-10
        )


@pytest.mark.parametrize("variant,block", [("ap", 2), ("ld", 4)])
def test_comrope_raw_coords_on_3d_points(variant, block):
    enc = build(
        "comrope", dim=48, num_heads=2, depth=1, num_axes=3, variant=variant, block=block, coords="raw", init_std=0.3
    ).double()
    g = torch.Generator().manual_seed(1)
    pts = torch.randn(2, 7, 3, generator=g, dtype=torch.float64) * 3
    q, k = _qk(2, 2, 7, 24)
    R = _dense_rotation(_dense_generators(enc, 0), pts)
    got = attention_logits(enc, q, k, Positions.points(pts))
    assert torch.allclose(got, _logits_from_rotations(q, k, R), atol=1e-10)
    assert "extrapolation" in enc.claims and not enc.needs_grid


def test_comrope_bad_options_raise():
    with pytest.raises(ValueError, match="block"):
        build("comrope", dim=64, num_heads=4, block=3)  # head dim 16
    with pytest.raises(ValueError, match="block"):
        build("comrope", dim=64, num_heads=4, block=1)
    with pytest.raises(ValueError, match="variant"):
        build("comrope", dim=64, num_heads=4, variant="liere")
    with pytest.raises(ValueError, match="coords"):
        build("comrope", dim=64, num_heads=4, coords="pixels")
    with pytest.raises(ValueError, match="blocks"):
        build("comrope", dim=16, num_heads=2, num_axes=3, block=4)  # 2 blocks for 3 axes
    enc = build("comrope", dim=64, num_heads=4)
    with pytest.raises(ValueError, match="grid"):
        enc.prepare(Positions.points(torch.randn(1, 5, 2)))


# --------------------------------------------------------------------------- STRING
def _string(seed=0, dim=32, num_heads=2, **opts):
    enc = build("string", dim=dim, num_heads=num_heads, depth=2, **opts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        enc.skew.copy_(torch.randn(enc.skew.shape, generator=g) * 0.3)
    return enc


def test_string_basis_is_orthogonal_with_det_one():
    enc = _string().double()
    P = enc.basis()  # (L, H, D, D)
    eye = torch.eye(enc.head_dim, dtype=torch.float64)
    assert torch.allclose(P @ P.transpose(-1, -2), eye, atol=1e-12)
    assert torch.allclose(torch.linalg.det(P), torch.ones(P.shape[:2], dtype=torch.float64), atol=1e-10)
    # Cayley: (I + S) P = I - S with S the antisymmetric part of the parameter
    W = enc.skew.detach()
    S = 0.5 * (W - W.transpose(-1, -2))
    assert torch.allclose((eye + S) @ P, eye - S, atol=1e-12)
    P32 = _string().basis()
    assert (P32 @ P32.transpose(-1, -2) - torch.eye(enc.head_dim)).abs().max() < 1e-5


@pytest.mark.parametrize("num_axes", [2, 3])
def test_string_rotation_is_exactly_relative_and_logits_match_dense(num_axes):
    enc = build("string", dim=48, num_heads=2, depth=2, num_axes=num_axes).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        enc.skew.copy_(torch.randn(enc.skew.shape, generator=g, dtype=torch.float64) * 0.3)
    pts = torch.randn(1, 6, num_axes, generator=g, dtype=torch.float64) * 4
    D = enc.head_dim
    for layer in (0, 1):
        R = enc.rotation_matrix(pts, layer)[0]  # (H, N, D, D)
        P = enc.basis()[layer]
        # independent dense RoPE: block-diagonal plane rotations, pair m = channels (m, m + D/2)
        ang = pts[0] @ enc.freqs.double()  # (N, D/2)
        rope = torch.zeros(6, D, D, dtype=torch.float64)
        m = torch.arange(D // 2)
        rope[:, m, m] = ang.cos()
        rope[:, m + D // 2, m + D // 2] = ang.cos()
        rope[:, m, m + D // 2] = -ang.sin()
        rope[:, m + D // 2, m] = ang.sin()
        want = P[:, None] @ rope[None] @ P.transpose(-1, -2)[:, None]
        assert torch.allclose(R, want, atol=1e-12)
        for i, j in ((0, 1), (2, 5), (4, 3)):
            rel = enc.rotation_matrix((pts[:, j] - pts[:, i]).unsqueeze(1), layer)[0, :, 0]
            assert torch.allclose(R[:, i].transpose(-1, -2) @ R[:, j], rel, atol=1e-10)
        q, k = _qk(1, 2, 6, D)
        got = attention_logits(enc, q, k, Positions.points(pts), layer=layer)
        assert torch.allclose(got, _logits_from_rotations(q, k, R.transpose(0, 1).unsqueeze(0)), atol=1e-10)


def test_string_with_zero_skew_equals_rope():
    enc = build("string", dim=64, num_heads=4, depth=2)  # init: S = 0, P = I
    rope = build("rope", dim=64, num_heads=4)
    pos = Positions.grid(5, 6, prefix=1).shifted([40.0, -3.0])
    q, k = _qk(2, 4, pos.num_tokens, 16, dtype=torch.float32)
    for layer in (0, 1):
        assert torch.allclose(
            attention_logits(enc, q, k, pos, layer=layer), attention_logits(rope, q, k, pos), atol=1e-6
        )
    assert (
        attention_logits(_string(dim=64, num_heads=4), q, k, pos) - attention_logits(rope, q, k, pos)
    ).abs().max() > 1e-2


# --------------------------------------------------------------------------- shared
@pytest.mark.parametrize("name,opts", [("comrope", {}), ("comrope", {"block": 4, "variant": "ld"}), ("string", {})])
def test_parameters_stay_fp32_and_tables_once_per_forward(name, opts):
    enc = build(name, dim=64, num_heads=4, depth=2, **opts)
    if name == "string":
        with torch.no_grad():
            enc.skew.normal_(0, 0.1)
    before = {n: t.detach().clone() for n, t in list(enc.named_parameters()) + list(enc.named_buffers())}
    params = list(enc.parameters())
    enc.bfloat16()
    after = dict(list(enc.named_parameters()) + list(enc.named_buffers()))
    for n, t in before.items():  # exact fp32 values, not bf16-rounded ones, and the same Parameter objects
        assert after[n].dtype == torch.float32 and torch.equal(after[n].detach(), t), n
    assert all(a is b for a, b in zip(params, enc.parameters()))
    pos = Positions.grid(4, 4, prefix=1)
    ctx = enc.prepare(pos)
    for v in ctx.tables.values():
        assert v.dtype == torch.float32
    assert any(v.shape[1] == 2 or v.shape[0] == 2 for v in ctx.tables.values())  # every layer's tables at once
    q, k = _qk(1, 4, pos.num_tokens, 16, dtype=torch.bfloat16)
    ref = attention_logits(enc, q.float(), k.float(), pos)
    low = attention_logits(enc, q, k, pos)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("name,opts", [("comrope", {"variant": "ld"}), ("comrope", {"block": 4}), ("string", {})])
def test_gradients_reach_the_generators(name, opts):
    enc = build(name, dim=64, num_heads=4, depth=2, **opts)
    if name == "string":
        with torch.no_grad():
            enc.skew.normal_(0, 0.1)
    attn = vlpe.Attention(dim=64, num_heads=4)
    pos = Positions.grid(3, 3, prefix=1)
    x = torch.randn(2, pos.num_tokens, 64)
    out = attn(x, enc=enc, ctx=enc.prepare(pos), layer=1)
    out.square().mean().backward()
    for p in enc.parameters():
        assert p.grad is not None and p.grad[1].abs().sum() > 0
