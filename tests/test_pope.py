"""PoPE against the paper's complex-valued attention score, evaluated directly in fp64 (no official code exists).

Gopalakrishnan et al., arXiv 2509.10534: ``q~_tc = softplus(q_tc) e^{i t theta_c}``,
``k~_sc = softplus(k_sc) e^{i (s theta_c + delta_c)}``, ``a_ts = Re sum_c q~_tc conj(k~_sc)``, with
``theta_c = base ** (-c / d)`` in 1D; vlpe gives each axis its own block of channels.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vlpe import Positions, attention_logits
from vlpe.encodings import build

F64 = torch.float64


def _qk(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g, dtype=F64), torch.randn(B, H, N, D, generator=g, dtype=F64)


def _paper_logits(q, k, coords, theta_c, delta):
    """coords (N, A), theta_c (A, D) per-channel frequency vector, delta (H, D): Re sum_c q~ conj(k~) / sqrt(D)."""
    phase = coords @ theta_c  # (N, D)
    qt = F.softplus(q) * torch.exp(1j * phase)  # (B, H, N, D) complex128
    kt = F.softplus(k) * torch.exp(1j * (phase + delta[:, None, :]))
    return (qt @ kt.conj().transpose(-1, -2)).real / math.sqrt(q.shape[-1])


def test_pope_1d_frequencies_are_the_papers():
    enc = build("pope", dim=32, num_heads=2, num_axes=1, theta=10000.0)
    assert torch.allclose(enc.freqs[0].double(), 10000.0 ** (-torch.arange(16, dtype=F64) / 16), rtol=1e-6)


@pytest.mark.parametrize("num_axes,grid", [(1, (7,)), (2, (3, 4)), (3, (2, 2, 3))])
def test_pope_logits_equal_the_papers_complex_score(num_axes, grid):
    D, H = 12, 2
    enc = build("pope", dim=D * H, num_heads=H, num_axes=num_axes, depth=2).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained phase bias inside the paper's clamp range, and one entry outside it
        enc.phase_bias.copy_(-torch.rand(enc.phase_bias.shape, generator=g, dtype=F64) * 2 * math.pi)
        enc.phase_bias[1, 0, 0] = 5.0  # clamped to 0
    pos = Positions.grid_nd(grid, prefix=1)
    P = D // num_axes
    theta_c = torch.zeros(num_axes, D, dtype=F64)  # channel c reads axis c // P at 100 ** (-(c mod P) / P)
    for c in range(P * num_axes):
        theta_c[c // P, c] = 100.0 ** (-(c % P) / P)
    q, k = _qk(1, H, pos.num_tokens, D)
    for layer in (0, 1):
        delta = enc.phase_bias[layer].detach().clamp(-2 * math.pi, 0.0)
        ref = _paper_logits(q, k, pos.coords[0].double(), theta_c, delta)
        got = attention_logits(enc, q, k, pos, layer=layer)
        assert (got - ref).abs().max() < 1e-6  # the frequency buffer is fp32 (~1e-7 relative), the rest fp64


def test_pope_separates_what_from_where():
    """The magnitudes see only content: with all phases zero (one token position) the logits are
    sum_c softplus(q_c) softplus(k_c) / sqrt(D), never negative, whatever the signs of q and k."""
    enc = build("pope", dim=16, num_heads=2, num_axes=2).double()
    pos = Positions(torch.zeros(1, 5, 2))
    q, k = _qk(1, 2, 5, 8)
    got = attention_logits(enc, q, k, pos)
    assert torch.allclose(got, F.softplus(q) @ F.softplus(k).transpose(-1, -2) / math.sqrt(8), atol=1e-12)
    assert (got > 0).all()


def test_pope_bad_options_raise():
    with pytest.raises(ValueError, match="theta"):
        build("pope", dim=16, num_heads=2, theta=0.0)
    with pytest.raises(ValueError, match="channel per axis"):
        build("pope", dim=4, num_heads=2, num_axes=3)
