"""DINOv3 RoPE: parity with timm's RotaryEmbeddingDinoV3, an independent re-derivation of the reference formula
(facebookresearch/dinov3 rope_position_encoding.py), training-only coordinate augmentations, fp32 numerics."""

from __future__ import annotations

import math

import pytest
import torch

import vlpe
from vlpe import Positions
from vlpe.encodings import build
from vlpe.testing import PropertyFailure, check


def _qk(B, H, N, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, N, D, generator=g).to(dtype), torch.randn(B, H, N, D, generator=g).to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _reference_rotate(x, shape, prefix, *, base=100.0, min_period=None, max_period=None, normalize="separate"):
    """DINOv3's formula restated for any grid ``shape``: u = 2 (i + 0.5) / n - 1, angle = 2 pi u / period,
    angles of axis 0 then axis 1 ..., tiled twice (half layout), x cos + rotate_half(x) sin; prefix unrotated."""
    D = x.shape[-1]
    A = len(shape)
    P = D // (2 * A)
    k = torch.arange(P, dtype=torch.float64)
    if base is not None:
        periods = base ** (2 * k / (D // 2)) if A == 2 else base ** (k / P)
    else:
        periods = torch.tensor([min_period * (max_period / min_period) ** (j / max(P - 1, 1)) for j in range(P)],
                               dtype=torch.float64)  # fmt: skip
    norm = {"separate": list(shape), "max": [max(shape)] * A, "min": [min(shape)] * A}[normalize]
    axes = [2.0 * (torch.arange(n, dtype=torch.float64) + 0.5) / m - 1.0 for n, m in zip(shape, norm)]
    u = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, A)  # (M, A)
    angles = (2 * math.pi * u[:, :, None] / periods).flatten(1)  # (M, A * P) axis-major
    angles = angles.tile(2)  # (M, D)
    xd = x.double()
    rot = xd[..., prefix:, :] * angles.cos() + _rotate_half(xd[..., prefix:, :]) * angles.sin()
    return torch.cat([xd[..., :prefix, :], rot], dim=-2)


# --------------------------------------------------------------------------- timm parity
timm_pos = pytest.importorskip("timm.layers.pos_embed_sincos")


@pytest.mark.parametrize(
    "shape,prefix,opts",
    [
        ((6, 6), 1, dict()),
        ((4, 7), 1, dict(normalize_coords="separate")),
        ((4, 7), 1, dict(normalize_coords="max")),
        ((7, 4), 5, dict(normalize_coords="min")),  # CLS + 4 registers
        ((5, 3), 1, dict(base=None, min_period=0.5, max_period=40.0, normalize_coords="max")),
        ((3, 8), 0, dict(base=1000.0)),
    ],
)
def test_eval_matches_timm_rotary_embedding_dinov3(shape, prefix, opts):
    H, D = 3, 32
    enc = build("rope_dinov3", dim=H * D, num_heads=H, **opts).eval()
    pos = Positions.grid(*shape, prefix=prefix) if prefix else Positions.grid_nd(shape)
    q, k = _qk(2, H, pos.num_tokens, D)
    rq, rk = enc.rotate(q, k, enc.prepare(pos), 0)
    ref = timm_pos.RotaryEmbeddingDinoV3(
        D,
        temperature=opts.get("base", 100.0),
        min_period=opts.get("min_period"),
        max_period=opts.get("max_period"),
        normalize_coords=opts.get("normalize_coords", "separate"),
    ).eval()
    emb = ref.get_embed(list(shape))  # (M, 2 D): [sin, cos], half layout

    def timm_rotate(x):
        return torch.cat([x[:, :, :prefix], timm_pos.apply_rot_embed_cat(x[:, :, prefix:], emb, half=True)], dim=2)

    torch.testing.assert_close(rq, timm_rotate(q), rtol=0, atol=2e-5)
    torch.testing.assert_close(rk, timm_rotate(k), rtol=0, atol=2e-5)
    logits = vlpe.attention_logits(enc, q, k, pos)
    ref_logits = timm_rotate(q) @ timm_rotate(k).transpose(-2, -1) * D**-0.5
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- the reference formula
@pytest.mark.parametrize("normalize", ["separate", "max", "min"])
@pytest.mark.parametrize("shape", [(5, 5), (3, 6), (6, 2)])
def test_matches_a_rederivation_of_the_dinov3_formula(shape, normalize):
    H, D = 2, 16
    enc = build("rope_dinov3", dim=H * D, num_heads=H, normalize_coords=normalize)
    pos = Positions.grid(*shape, prefix=1)
    q, _ = _qk(1, H, pos.num_tokens, D)
    rq, _ = enc.rotate(q, q, enc.prepare(pos), 0)
    torch.testing.assert_close(rq.double(), _reference_rotate(q, shape, 1, normalize=normalize), rtol=0, atol=2e-5)


def test_min_max_periods_and_three_axes_match_the_rederivation():
    enc = build("rope_dinov3", dim=32, num_heads=2, base=None, min_period=0.25, max_period=10.0)
    pos = Positions.grid(4, 3, prefix=1)
    q, _ = _qk(1, 2, pos.num_tokens, 16)
    ref = _reference_rotate(q, (4, 3), 1, base=None, min_period=0.25, max_period=10.0)
    torch.testing.assert_close(enc.rotate(q, q, enc.prepare(pos), 0)[0].double(), ref, rtol=0, atol=2e-5)
    enc3 = build("rope_dinov3", dim=48, num_heads=2, num_axes=3, normalize_coords="max")
    pos3 = Positions.video(2, 3, 4, prefix=1)
    q3, _ = _qk(1, 2, pos3.num_tokens, 24)
    ref3 = _reference_rotate(q3, (2, 3, 4), 1, normalize="max")
    torch.testing.assert_close(enc3.rotate(q3, q3, enc3.prepare(pos3), 0)[0].double(), ref3, rtol=0, atol=2e-5)


def test_positions_without_a_grid_use_their_measured_extent():
    """Grid coordinates given without the grid (and shifted, and padded) give the grid's rotation."""
    enc = build("rope_dinov3", dim=32, num_heads=2, normalize_coords="min")
    grid = Positions.grid(4, 6, prefix=1)
    q, k = _qk(2, 2, grid.num_tokens, 16)
    want = enc.rotate(q, k, enc.prepare(grid), 0)
    loose = Positions(grid.shifted([10.0, -3.0]).coords, prefix=1)  # no grid, shifted
    got = enc.rotate(q, k, enc.prepare(loose), 0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    # a far-away padding token does not change the extent of the real ones
    coords = torch.cat([loose.coords.expand(2, -1, -1), torch.full((2, 1, 2), 500.0)], dim=1)
    valid = torch.ones(2, coords.shape[1], dtype=torch.bool)
    valid[:, -1] = False
    padded = Positions(coords, prefix=1, valid=valid)
    qp, kp = (torch.cat([t, t[:, :, :1]], dim=2) for t in (q, k))
    got = enc.rotate(qp, kp, enc.prepare(padded), 0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a[:, :, :-1], b, rtol=0, atol=2e-5)


def test_prefix_tokens_are_not_rotated():
    enc = build("rope_dinov3", dim=32, num_heads=2)
    pos = Positions.grid(3, 3, prefix=3)
    q, k = _qk(1, 2, pos.num_tokens, 16)
    rq, rk = enc.rotate(q, k, enc.prepare(pos), 0)
    assert torch.equal(rq[:, :, :3], q[:, :, :3]) and torch.equal(rk[:, :, :3], k[:, :, :3])
    assert not torch.allclose(rq[:, :, 3:], q[:, :, 3:])


def test_claims_are_honest():
    enc = build("rope_dinov3", dim=64, num_heads=4, depth=2)
    assert enc.claims == {"relative", "neutral", "fp32_angles"}
    with pytest.raises(PropertyFailure, match="extrapolation"):
        check(enc, "extrapolation")  # a larger grid is renormalised into [-1, 1]
    with pytest.raises(PropertyFailure, match="rotation_invariant"):
        check(enc, "rotation_invariant")


# --------------------------------------------------------------------------- augmentations
AUGS = dict(shift_coords=0.3, jitter_coords=1.5, rescale_coords=2.0)


def test_augmentations_only_in_training_mode():
    plain = build("rope_dinov3", dim=32, num_heads=2)
    enc = build("rope_dinov3", dim=32, num_heads=2, **AUGS)
    pos = Positions.grid(4, 5, prefix=1)
    q, k = _qk(1, 2, pos.num_tokens, 16)
    enc.eval()
    ref = plain.eval().rotate(q, k, plain.prepare(pos), 0)
    for _ in range(3):  # deterministic, equal to no augmentation
        got = enc.rotate(q, k, enc.prepare(pos), 0)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    enc.train()
    first = enc.rotate(q, k, enc.prepare(pos), 0)
    second = enc.rotate(q, k, enc.prepare(pos), 0)
    assert not torch.allclose(first[0], ref[0], atol=1e-3)  # training changes the rotation
    assert not torch.allclose(first[0], second[0], atol=1e-3)  # a new draw every forward
    assert torch.equal(first[0][:, :, :1], q[:, :, :1])  # CLS still unrotated
    plain.train()  # training mode without augmentations changes nothing
    assert torch.equal(plain.rotate(q, k, plain.prepare(pos), 0)[0], ref[0])


@pytest.mark.parametrize(
    "opts,kind",
    [(dict(shift_coords=0.4), "shift"), (dict(jitter_coords=1.8), "jitter"), (dict(rescale_coords=3.0), "rescale")],
)
def test_augmentation_bounds(opts, kind):
    enc = build("rope_dinov3", dim=32, num_heads=2, **opts)
    pos = Positions.grid(4, 6, prefix=1)
    u0 = enc.normalized_coords(pos)[0, 1:]  # (M, 2), eval coordinates
    draws = []
    for _ in range(300):
        u = enc.normalized_coords(pos, training=True)[0, 1:]
        if kind == "shift":
            d = u - u0  # one offset per axis
            torch.testing.assert_close(d, d[:1].expand_as(d), rtol=0, atol=1e-6)
            draws.append(d[0])
        else:
            r = u / u0  # one factor per axis (rescale: the same factor on both axes)
            torch.testing.assert_close(r, r[:1].expand_as(r), rtol=1e-5, atol=0)
            if kind == "rescale":
                torch.testing.assert_close(r[0, 0], r[0, 1], rtol=1e-6, atol=0)
            draws.append(r[0])
    draws = torch.stack(draws)  # (300, 2)
    bound = next(iter(opts.values()))
    if kind == "shift":
        assert draws.abs().max() <= bound + 1e-6 and draws.abs().max() > 0.8 * bound
        assert draws.min() < 0 < draws.max()
    else:
        logs = draws.log()
        assert logs.abs().max() <= math.log(bound) + 1e-5 and logs.abs().max() > 0.8 * math.log(bound)
        assert logs.min() < 0 < logs.max()


def test_training_draws_follow_the_torch_seed():
    enc = build("rope_dinov3", dim=32, num_heads=2, **AUGS).train()
    pos = Positions.grid(3, 4, prefix=1)
    torch.manual_seed(5)
    a = enc.prepare(pos)["cos"]
    torch.manual_seed(5)
    assert torch.equal(enc.prepare(pos)["cos"], a)


# --------------------------------------------------------------------------- numerics and errors
def test_fp32_through_bf16_cast_and_autocast():
    enc = build("rope_dinov3", dim=64, num_heads=2, normalize_coords="max")
    freqs = enc.freqs.clone()
    enc.to(torch.bfloat16)
    assert enc.freqs.dtype == torch.float32 and torch.equal(enc.freqs, freqs)
    pos = Positions.grid(40, 30, prefix=1).shifted([300.0, 200.0])  # large normalised coordinates
    q, k = _qk(1, 2, pos.num_tokens, 32)
    ref = enc.rotate(q.double(), k.double(), enc.prepare(pos), 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = enc.prepare(pos)
        assert ctx["cos"].dtype == torch.float32 and ctx["sin"].dtype == torch.float32
        low = enc.rotate(q.bfloat16(), k.bfloat16(), ctx, 0)
    assert low[0].dtype == torch.bfloat16
    for a, b in zip(low, ref):
        assert (a.double() - b).abs().max() < 0.05  # bf16 rounding of q/k only, not of the angles
    full = enc.prepare(pos)
    torch.testing.assert_close(ctx["cos"], full["cos"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(dim=36, num_heads=2), "multiple of 2"),  # head dim 18: not 4 k for 2 axes
        (dict(base=100.0, min_period=1.0, max_period=10.0), "either base"),
        (dict(base=None), "needs base"),
        (dict(base=None, min_period=10.0, max_period=1.0), "min_period <= max_period"),
        (dict(base=-1.0), "base"),
        (dict(normalize_coords="diag"), "normalize_coords"),
        (dict(shift_coords=-0.1), "shift_coords"),
        (dict(jitter_coords=0.5), "jitter_coords"),
        (dict(rescale_coords=float("nan")), "rescale_coords"),
        (dict(scaling={"type": "linear", "factor": 2.0}), "does not take"),
    ],
)
def test_bad_options_raise_value_error(opts, match):
    kw = dict(dim=32, num_heads=2)
    kw.update(opts)
    with pytest.raises(ValueError, match=match):
        build("rope_dinov3", **kw)


def test_scaling_is_rejected_and_bad_positions_raise():
    enc = build("rope_dinov3", dim=32, num_heads=2)
    with pytest.raises(ValueError, match="scaling does not apply"):
        enc.set_scaling({"type": "linear", "factor": 2.0})
    assert enc.set_scaling(None) is enc
    q, k = _qk(1, 2, 10, 16)
    with pytest.raises(ValueError, match="tokens"):
        vlpe.attention_logits(enc, q, k, Positions.grid(3, 4, prefix=1))
    with pytest.raises(ValueError, match="num_axes"):
        enc.prepare(Positions(torch.zeros(10, 3)))
