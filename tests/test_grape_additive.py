"""Additive GRAPE against its unipotent lift built here with explicit (D + 2)-dimensional matrices, and against
ALiBi (its special case: causal, one axis, the official ALiBi slopes of model-architectures/GRAPE
``model/llama-mha-grape-a-pi.py`` ``_get_alibi_slopes`` at 135ee30e5e255cf4385fd8553e32e2575b2f1733, re-stated)."""

from __future__ import annotations

import math

import pytest
import torch

from vlpe import Positions, attention_logits
from vlpe.encodings import build

F64 = torch.float64


def _official_alibi_slopes(n):
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + _official_alibi_slopes(2 * c)[0::2][: n - c]


def _lifted_logits(q, k, coords, w):
    """q, k (B, H, N, D), coords (N, A), w (H, A): (G(p_i)^{-T} q^_i) . (G(p_j) k^_j) / sqrt(D) with
    q^ = [q, sqrt(D), 0], k^ = [k, 0, 1] and G(p) = I + (w . p) e_u e_v^T, as dense matrices."""
    B, H, N, D = q.shape
    out = torch.empty(B, H, N, N, dtype=F64)
    for h in range(H):
        G = torch.eye(D + 2, dtype=F64).repeat(N, 1, 1)  # (N, D + 2, D + 2)
        G[:, D, D + 1] = coords @ w[h]
        qh = torch.cat([q[:, h], torch.full((B, N, 1), math.sqrt(D), dtype=F64), torch.zeros(B, N, 1, dtype=F64)], -1)
        kh = torch.cat([k[:, h], torch.zeros(B, N, 1, dtype=F64), torch.ones(B, N, 1, dtype=F64)], -1)
        qt = torch.einsum("nde,bne->bnd", torch.linalg.inv(G).transpose(-1, -2), qh)
        kt = torch.einsum("nde,bne->bnd", G, kh)
        out[:, h] = qt @ kt.transpose(-1, -2) / math.sqrt(D)
    return out


def _qk(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g, dtype=F64), torch.randn(B, H, N, D, generator=g, dtype=F64)


@pytest.mark.parametrize("heads", [8, 6])
def test_grape_additive_causal_1d_is_the_official_alibi(heads):
    N, D = 9, 4
    enc = build("grape_additive", dim=heads * D, num_heads=heads, num_axes=1, causal=True, depth=1).double()
    m = torch.tensor(_official_alibi_slopes(heads), dtype=F64)
    assert torch.allclose(enc.weight[0, :, 0].detach(), m, atol=1e-7)
    q, k = _qk(1, heads, N, D)
    i = torch.arange(N)
    alibi = -m[:, None, None] * (i[:, None] - i[None, :]).to(F64)  # (H, N, N)
    ref = (q @ k.transpose(-1, -2)) / math.sqrt(D) + alibi.masked_fill(i[None, :] > i[:, None], float("-inf"))
    got = attention_logits(enc, q, k, Positions(i.to(F64)[None, :, None]))
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    assert (got[finite] - ref[finite]).abs().max() < 1e-6  # fp32 slopes
    assert torch.allclose(torch.softmax(got, -1), torch.softmax(ref, -1), atol=1e-6)


@pytest.mark.parametrize("num_axes,grid", [(2, (3, 4)), (3, (2, 2, 3))])
def test_grape_additive_equals_its_unipotent_lift(num_axes, grid):
    H, D = 3, 4
    enc = build("grape_additive", dim=H * D, num_heads=H, num_axes=num_axes, depth=2).double()
    with torch.no_grad():
        enc.weight.copy_(torch.randn(enc.weight.shape, generator=torch.Generator().manual_seed(2), dtype=F64))
    pos = Positions.grid_nd(grid)
    q, k = _qk(1, H, pos.num_tokens, D)
    for layer in (0, 1):
        ref = _lifted_logits(q, k, pos.coords[0].double(), enc.weight[layer].detach())
        assert (attention_logits(enc, q, k, pos, layer=layer) - ref).abs().max() < 1e-10
    # non-causal: the query's share cancels in the softmax, leaving a per-key ramp w . p_j
    w = enc.weight[0].detach()
    ramp = torch.einsum("na,ha->hn", pos.coords[0].double(), w)[None, :, None, :]
    plain = q @ k.transpose(-1, -2) / math.sqrt(D) + ramp
    assert torch.allclose(torch.softmax(attention_logits(enc, q, k, pos, layer=0), -1), torch.softmax(plain, -1),
                          atol=1e-12)


def test_grape_additive_prefix_pairs_get_no_bias_and_bad_options_raise():
    enc = build("grape_additive", dim=16, num_heads=2).double()
    pos = Positions.grid(2, 3, prefix=1)
    q, k = _qk(1, 2, pos.num_tokens, 8)
    got = attention_logits(enc, q, k, pos)
    plain = q @ k.transpose(-1, -2) / math.sqrt(8)
    assert torch.allclose(got[..., 0, :], plain[..., 0, :]) and torch.allclose(got[..., :, 0], plain[..., :, 0])
    with pytest.raises(ValueError, match="init"):
        build("grape_additive", dim=16, num_heads=2, init="ones")
    with pytest.raises(ValueError, match="causal"):
        build("grape_additive", dim=16, num_heads=2, causal=1)
