"""LieRE and Spiral RoPE against their reference computations, re-stated here from the official code.

LieRE: StanfordMIMI/LieRE ``models/rope_vit.py`` at 657fc51c9a1c206e8ec7ccaa241798536696edf1
(``LierePositionEncoder.forward``: positions, ``triu - 0.5`` bases, per-token ``matrix_exp``;
``FlexibleAttention.apply_transforms``: consecutive channel blocks, unrotated rest).
Spiral RoPE: huajianduzhuo-code/Spiral_RoPE ``RoPE_DeiT/rope.py`` at 4abece3b678fc2f45faa153fab37a96d86e7dcb1
(``VisionRotaryEmbedding.forward`` and ``rotate_freqs``: angle maps turned as images by ``grid_sample``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vlpe import Positions, attention_logits
from vlpe.encodings import build
from vlpe.testing import property_report

F64 = torch.float64


def _qk(B, H, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g, dtype=F64), torch.randn(B, H, N, D, generator=g, dtype=F64)


# --------------------------------------------------------------------------- LieRE
def _ref_liere_rotations(raw, grid, train_grid):
    """The reference encoder: raw (A, L, G, b, b) -> rotations (1, 1 + N, L, G, b, b), CLS first (identity)."""
    steps = torch.cartesian_prod(*(torch.linspace(0, n / n0, n, dtype=F64) for n, n0 in zip(grid, train_grid)))
    positions = steps.reshape(1, -1, len(grid))  # (1, N, A); cartesian_prod of one axis is 1-D
    upper = torch.triu(raw, diagonal=1) - 0.5
    bases = upper - upper.transpose(-1, -2)
    gen = (positions.reshape(list(positions.shape) + [1] * 4) * bases).sum(dim=-5)  # (1, N, L, G, b, b)
    gen = torch.cat([torch.zeros_like(gen[:, :1]), gen], dim=1)
    return torch.matrix_exp(gen)


def _ref_liere_apply(x, rot, heads):
    """x (B, H, N, D), rot (1, N, G, b, b) with G = heads * J: rotate the first J b channels in blocks of b."""
    B, H, N, D = x.shape
    b = rot.shape[-1]
    J = rot.shape[-3] // heads
    states = x[..., : J * b].reshape(B, H, N, J, b, 1)
    R = rot.view(1, N, heads, J, b, b).transpose(1, 2)  # (1, heads, N, J, b, b)
    return torch.cat([(R @ states).flatten(-3), x[..., J * b :]], dim=-1)


def _liere(seed=0, **opts):
    enc = build("liere", **{"dim": 24, "num_heads": 2, "depth": 2, **opts})
    with torch.no_grad():  # the reference's U(0, 2 pi) draw, seeded here
        g = torch.Generator().manual_seed(seed)
        enc.generators.copy_(torch.rand(enc.generators.shape, generator=g) * 2 * math.pi)
    return enc.double()


@pytest.mark.parametrize("block,grid,train", [(4, (3, 4), (3, 4)), (5, (3, 4), (3, 4)), (4, (5, 6), (3, 4)),
                                              (12, (2, 3, 2), (2, 3, 2))])
def test_liere_logits_equal_the_reference(block, grid, train):
    enc = _liere(block=block, grid=train, num_axes=len(grid))
    H, D = enc.num_heads, enc.head_dim
    gens = enc.generators.detach()  # (L, H, A, J, b, b)
    L, _, A, J, b, _ = gens.shape
    raw = gens.permute(2, 0, 1, 3, 4, 5).reshape(A, L, H * J, b, b)  # the reference layout
    rot = _ref_liere_rotations(raw, grid, train)  # (1, N, L, G, b, b)
    pos = Positions.grid_nd(grid, prefix=1)
    q, k = _qk(1, H, pos.num_tokens, D)
    worst = 0.0
    for layer in range(L):
        rq, rk = _ref_liere_apply(q, rot[:, :, layer], H), _ref_liere_apply(k, rot[:, :, layer], H)
        ref = rq @ rk.transpose(-1, -2) / math.sqrt(D)
        got = attention_logits(enc, q, k, pos, layer=layer)
        worst = max(worst, (got - ref).abs().max().item())
    assert worst < 1e-9, worst


def test_liere_shared_generators_and_raw_coordinates_match_dense_exponentials():
    enc = _liere(block=6, coords="raw", per_layer=False, per_head=False)
    assert enc.generators.shape[:2] == (1, 1) and not enc.needs_grid
    g = torch.Generator().manual_seed(2)
    pts = torch.randn(1, 7, 2, generator=g, dtype=F64) * 2
    S = enc.skew().detach()[0, 0]  # (A, J, b, b)
    dense_gen = torch.zeros(2, 12, 12, dtype=F64)
    for j in range(2):
        dense_gen[:, j * 6 : (j + 1) * 6, j * 6 : (j + 1) * 6] = S[:, j]
    R = torch.matrix_exp(torch.einsum("bna,ade->bnde", pts, dense_gen))  # (1, N, D, D)
    assert torch.allclose(enc.rotation_matrix(pts, 1)[:, 0], R, atol=1e-10)
    q, k = _qk(1, 2, 7, 12)
    rq, rk = torch.einsum("bnde,bhne->bhnd", R, q), torch.einsum("bnde,bhne->bhnd", R, k)
    assert torch.allclose(attention_logits(enc, q, k, Positions.points(pts), layer=1),
                          rq @ rk.transpose(-1, -2) / math.sqrt(12), atol=1e-10)


def test_liere_is_not_relative_and_claims_only_what_holds():
    """The generators of different axes do not commute: a common shift changes the logits (no relative claim)."""
    enc = _liere(block=4, coords="raw")
    pos = Positions.grid(3, 4)
    q, k = _qk(1, 2, pos.num_tokens, 12)
    moved = attention_logits(enc, q, k, pos.shifted([1.0, 2.0]))
    assert (moved - attention_logits(enc, q, k, pos)).abs().max() > 1e-2
    for opts in ({}, {"coords": "raw"}):
        report = property_report(build("liere", dim=24, num_heads=2, depth=2, block=4, **opts), all_properties=True)
        assert report["relative"] == "no" and all(v in ("ok", "no") for v in report.values()), report


def test_liere_bad_options_raise():
    for opts, match in (({"block": 1}, "block"), ({"block": 13}, "block"), ({"coords": "pixels"}, "coords"),
                        ({"init_scale": -1.0}, "init_scale"), ({"per_head": 1}, "per_head")):
        with pytest.raises(ValueError, match=match):
            build("liere", dim=24, num_heads=2, **opts)
    with pytest.raises(ValueError, match="grid"):
        build("liere", dim=24, num_heads=2).prepare(Positions.points(torch.randn(1, 5, 2)))
    with pytest.raises(ValueError, match="training grid"):
        build("liere", dim=24, num_heads=2, grid=(3, 4, 5)).prepare(Positions.grid(3, 4))


# --------------------------------------------------------------------------- Spiral RoPE
def _ref_turn_maps(maps, deg):
    """The reference's rotate_freqs: maps (n, n, d1, d2) turned by deg about the centre (bilinear, border)."""
    n = maps.shape[0]
    a = math.radians(deg)
    img = maps.reshape(n, n, -1).permute(2, 0, 1).unsqueeze(0)
    theta = torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]], dtype=img.dtype)
    grid = F.affine_grid(theta.unsqueeze(0), list(img.shape), align_corners=True)
    out = F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=True)
    return out.squeeze(0).permute(1, 2, 0).reshape(maps.shape)


def _ref_spiral_angles(head_dim, rotate, n, *, theta=10000.0, max_freq=1.5, same_theta=False, truncate=0.0):
    """The reference's angle per channel (n * n, head_dim), interleaved pairs, rows first."""
    dim = head_dim // 2
    eff = dim // rotate if same_theta else dim
    lo = max_freq / theta ** ((eff - 2) / eff)
    half = eff // 2
    freqs = lo * (max_freq / lo) ** (torch.arange(half - 1, -1, -1, dtype=F64) / (half - 1))
    if truncate > 0:
        freqs[-int(half * truncate):] = 0
    f = torch.arange(n, dtype=F64)[:, None] * freqs[None]  # (n, half)
    f = f.repeat_interleave(2, dim=-1)
    if same_theta:
        f = f.reshape(n, -1, 4).repeat_interleave(rotate, dim=1).reshape(n, -1)
    f = torch.cat([f[:, None, :].expand(n, n, -1), f[None, :, :].expand(n, n, -1)], dim=-1)  # (n, n, D)
    f = f.reshape(n, n, -1, rotate * 4).clone()
    for i in range(1, rotate):
        f[..., i * 4 : (i + 1) * 4] = _ref_turn_maps(f[..., i * 4 : (i + 1) * 4], i * 90 / rotate)
    return f.reshape(n * n, head_dim)


def _interior(n, rotate):
    """Patches whose turned sample point lies inside the grid for every turn (no border clamping)."""
    c = (n - 1) / 2
    r, w = torch.meshgrid(torch.arange(n, dtype=F64), torch.arange(n, dtype=F64), indexing="ij")
    ok = torch.ones(n, n, dtype=torch.bool)
    for i in range(rotate):
        a = math.radians(i * 90 / rotate)
        for s in (c + math.cos(a) * (r - c) + math.sin(a) * (w - c), c + math.cos(a) * (w - c) - math.sin(a) * (r - c)):
            ok &= (s >= -1e-9) & (s <= n - 1 + 1e-9)
    return ok.flatten()


@pytest.mark.parametrize("head_dim,rotate,same_theta,truncate", [(64, 2, False, 0.0), (64, 2, True, 0.0),
                                                                 (48, 3, False, 0.25), (64, 4, True, 0.0)])
def test_spiral_logits_equal_the_reference_inside_the_grid(head_dim, rotate, same_theta, truncate):
    n = 14
    enc = build("spiral_rope", dim=head_dim, num_heads=1, directions=2 * rotate, same_theta=same_theta,
                truncate=truncate, layout="interleaved").double()
    ang = _ref_spiral_angles(head_dim, rotate, n, same_theta=same_theta, truncate=truncate)  # (N, D)
    pos = Positions.grid(n, n, prefix=1)
    q, k = _qk(1, 1, pos.num_tokens, head_dim)

    def ref_rotate(x):
        cos = torch.cat([torch.ones(1, head_dim, dtype=F64), ang.cos()])  # CLS unrotated
        sin = torch.cat([torch.zeros(1, head_dim, dtype=F64), ang.sin()])
        pairs = x.unflatten(-1, (-1, 2))
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)  # the reference's rotate_half
        return x * cos + turned * sin

    ref = ref_rotate(q) @ ref_rotate(k).transpose(-1, -2) / math.sqrt(head_dim)
    got = attention_logits(enc, q, k, pos)
    # patch pairs only: the reference turns a map about the grid centre, which adds a constant phase per pair to
    # every patch (cancelling between patches) but not to the unrotated CLS
    inside = torch.cat([torch.tensor([False]), _interior(n, rotate)])
    assert inside.sum() > n * n // 3
    err = (got - ref)[..., inside, :][..., inside].abs().max().item()
    assert err < 1e-5, err  # vlpe's rotary tables are fp32 (frequencies and angles): ~1e-7 relative
    if rotate > 1:  # at the corners the reference clamps its turned maps to the border: a documented difference
        assert (got - ref).abs().max().item() > 1e-3


def test_spiral_with_two_directions_is_axial_rope_and_directions_are_spread():
    pos = Positions.grid(5, 6, prefix=1)
    q, k = _qk(2, 4, pos.num_tokens, 16)
    spiral = build("spiral_rope", dim=64, num_heads=4, directions=2, theta=100.0, max_freq=1.0)
    rope = build("rope", dim=64, num_heads=4, theta=100.0)
    assert torch.allclose(attention_logits(spiral, q.float(), k.float(), pos),
                          attention_logits(rope, q.float(), k.float(), pos), atol=1e-6)
    f = build("spiral_rope", dim=64, num_heads=1, directions=4).freqs.double()  # (2, D/2)
    deg = torch.rad2deg(torch.atan2(f[1], f[0]))  # direction from the row axis towards the column axis
    assert torch.allclose(deg[:16], torch.tensor([0.0, 0.0, 45.0, 45.0] * 4, dtype=F64), atol=1e-9)
    assert torch.allclose(deg[16:], torch.tensor([90.0, 90.0, 135.0, 135.0] * 4, dtype=F64), atol=1e-9)
    assert torch.allclose(f.norm(dim=0)[:16], 1.5 * 10000.0 ** (-torch.arange(16, dtype=F64) / 16))


def test_spiral_bad_options_raise():
    for opts, match in (({"directions": 3}, "even"), ({"directions": 0}, "even"), ({"directions": 6}, "multiple"),
                        ({"theta": 0.0}, "theta"), ({"truncate": 1.0}, "truncate"), ({"layout": "x"}, "layout"),
                        ({"same_theta": 1}, "same_theta")):
        with pytest.raises(ValueError, match=match):
            build("spiral_rope", dim=64, num_heads=4, **opts)
    with pytest.raises(ValueError, match="2 coordinate axes"):
        build("spiral_rope", dim=64, num_heads=4, num_axes=3)
