"""Multiplicative GRAPE against the official computations, re-stated here, and against RoPE (its special case).

model-architectures/GRAPE ``model/llama-mha-grape-m-nonctx.py`` at 135ee30e5e255cf4385fd8553e32e2575b2f1733
(``MSGRAPECommuting``: canonical planes, learnable log-frequencies, pairs turned by ``-angle``);
JJJYmmm/Multimodal-RoPEs ``multimodal_ropes/freq_allocation/grape.py`` at ca035e5377bae51d24833bc789183b99ccc55ef1
(``MixedAxisGrapeRotation``: learned planes, unit axis directions, the closed-form per-plane update).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vlpe import Positions, attention_logits
from vlpe.encodings import build
from vlpe.testing import randomize_parameters

F64 = torch.float64


def _qk(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g, dtype=F64), torch.randn(B, H, N, D, generator=g, dtype=F64)


def _logits(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("num_axes,grid", [(2, (5, 6)), (3, (2, 3, 4))])
def test_grape_at_its_rope_initialisation_is_axial_rope(num_axes, grid):
    pos = Positions.grid_nd(grid, prefix=1)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, pos.num_tokens, 24, generator=g), torch.randn(2, 4, pos.num_tokens, 24, generator=g)
    grape = build("grape", dim=96, num_heads=4, num_axes=num_axes, depth=2)
    rope = build("rope", dim=96, num_heads=4, num_axes=num_axes)
    for layer in (0, 1):
        err = (attention_logits(grape, q, k, pos, layer=layer) - attention_logits(rope, q, k, pos)).abs().max()
        assert err < 1e-5, err


def test_grape_1d_equals_the_official_commuting_grape_at_mirrored_positions():
    """MSGRAPECommuting: angle t * exp(log_freq), pairs (x1, x2) -> (x1 cos + x2 sin, -x1 sin + x2 cos)."""
    D, T = 16, 9
    enc = build("grape", dim=2 * D, num_heads=2, num_axes=1, depth=1, theta=10000.0).double()
    with torch.no_grad():  # a trained spectrum: the official init moved by noise
        enc.log_freq.add_(torch.randn(enc.log_freq.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    log_freq = enc.log_freq.detach()[0]  # (D/2,)
    official_init = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=F64) / D))
    assert torch.allclose(build("grape", dim=2 * D, num_heads=2, num_axes=1, theta=10000.0).log_freq[0].double(),
                          official_init.log(), atol=1e-6)
    t = torch.arange(T, dtype=F64)
    ang = t[:, None] * log_freq.exp()[None]  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()

    def official(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)

    q, k = _qk(1, 2, T, D)
    ref = _logits(official(q), official(k))
    got = attention_logits(enc, q, k, Positions((-t)[None, :, None]))
    assert (got - ref).abs().max() < 1e-10


def _random_orthonormal_planes(P, D, seed):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=F64))
    rows = Q.T[: 2 * P]  # (2P, D) orthonormal
    return rows[0::2].clone(), rows[1::2].clone()


def test_grape_equals_the_multimodal_ropes_learned_plane_update_on_orthogonal_planes():
    """MixedAxisGrapeRotation re-stated: per-plane orthonormalisation, unit directions, closed-form update."""
    D, H = 12, 2
    enc = build("grape", dim=D * H, num_heads=H, num_axes=3, depth=1).double()
    a, b = _random_orthonormal_planes(D // 2, D, 3)
    g = torch.Generator().manual_seed(4)
    axis_weight = torch.randn(D // 2, 3, generator=g, dtype=F64)
    inv_freq = torch.rand(D // 2, generator=g, dtype=F64) + 0.1
    with torch.no_grad():
        enc.plane_a[0].copy_(a)
        enc.plane_b[0].copy_(b)
        enc.directions[0].copy_(axis_weight)
        enc.log_freq[0].copy_(inv_freq.log())
    pos = Positions.grid_nd((2, 3, 4), prefix=1)

    def reference(x, positions):
        ra = F.normalize(a, dim=-1)
        rb = F.normalize(b - (b * ra).sum(-1, keepdim=True) * ra, dim=-1)
        xa, xb = x @ ra.T, x @ rb.T  # (B, H, N, P)
        angle = (positions @ F.normalize(axis_weight, dim=-1).T) * inv_freq  # (B, N, P)
        cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
        xa_rot, xb_rot = xa * cos - xb * sin, xa * sin + xb * cos
        return x + (xa_rot - xa) @ ra + (xb_rot - xb) @ rb

    q, k = _qk(1, H, pos.num_tokens, D)
    c = pos.coords.double()
    ref = _logits(reference(q, c), reference(k, c))
    assert (attention_logits(enc, q, k, pos) - ref).abs().max() < 1e-10


def test_grape_closed_form_equals_the_matrix_exponential_and_planes_are_orthonormal():
    enc = randomize_parameters(build("grape", dim=32, num_heads=2, depth=2, init="random"), seed=5).double()
    a, b = enc.planes()
    V = torch.cat([a, b], dim=-2)  # (L, 2P, D)
    assert torch.allclose(V @ V.transpose(-1, -2), torch.eye(16, dtype=F64).expand(2, 16, 16), atol=1e-12)
    g = torch.Generator().manual_seed(6)
    pts = torch.randn(1, 6, 2, generator=g, dtype=F64) * 3
    q, k = _qk(1, 2, 6, 16)
    for layer in (0, 1):
        G = enc.rotation_matrix(pts, layer)  # (1, N, D, D)
        rq, rk = torch.einsum("bnde,bhne->bhnd", G, q), torch.einsum("bnde,bhne->bhnd", G, k)
        got = attention_logits(enc, q, k, Positions.points(pts), layer=layer)
        assert (got - _logits(rq, rk)).abs().max() < 1e-9
        # commuting generators: G(p_i)^T G(p_j) = G(p_j - p_i)
        rel = G[0, 0].T @ G[0, 1]
        assert torch.allclose(rel, enc.rotation_matrix((pts[:, 1] - pts[:, 0])[:, None], layer)[0, 0], atol=1e-9)


def test_grape_bad_options_raise():
    for opts, match in (({"theta": 0.0}, "theta"), ({"init": "eye"}, "init")):
        with pytest.raises(ValueError, match=match):
            build("grape", dim=64, num_heads=4, **opts)
    with pytest.raises(ValueError, match="even head dim"):
        build("grape", dim=12, num_heads=4)
