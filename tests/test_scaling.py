"""Training-free RoPE scaling (linear / NTK / YaRN) and axial RoPE with whole heads per axis.

What is checked:
- 1D inverse frequencies and attention factors equal transformers' ``modeling_rope_utils`` (linear, yarn with
  and without truncation, DeepSeek mscale ratio; ntk = the dynamic-NTK base at alpha = s) for ``rope1d``,
  ``mm.rotary("rope1d")`` and the primitive;
- a YaRN example computed by hand (correction dims, ramp, gains), and the encoding-level statement: pairs
  turning more than beta_fast times over the original extent keep their frequency, pairs below beta_slow are
  divided by s;
- per-axis factors scale only their axis (vision rows only; multimodal time only), for every multimodal variant
  linear at s * ids equals none at ids and yarn / ntk with factor 1 equal none;
- learned frequencies (RoPE-Mixed) get the gains a fixed RoPE frequency of the same magnitude gets;
- ``set_scaling`` on a whole ViT leaves parameters and state_dict alone and is undone by None;
- ``head_axes``: a row head ignores column shifts, a None head is not rotated, the default is unchanged;
- bad configurations raise ValueError.
"""

from __future__ import annotations

import math

import pytest
import torch

import vlpe
import vlpe.testing
from vlpe.encodings import multimodal as mm
from vlpe.encodings import resolution_scaling, set_scaling
from vlpe.encodings.functional.rope import axial_inv_freq, inv_freq
from vlpe.encodings.functional.scaling import parse_scaling, scale_frequencies

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HF_CASES = [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.3},
]


def _hf(head_dim: int, theta: float, params: dict, *, seq_len=None, max_pos=8192):
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
                      rope_parameters={"rope_theta": theta, **params})
    inv, att = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, seq_len=seq_len)
    return inv.double(), float(att)


def _ours(params: dict) -> dict:
    return {("type" if k == "rope_type" else k): v for k, v in params.items()}


@pytest.mark.parametrize("head_dim,theta", [(16, 1e4), (64, 1e4), (128, 1e6)])
@pytest.mark.parametrize("params", HF_CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items())[:60])
def test_1d_parity_with_transformers(head_dim, theta, params):
    ref, ref_att = _hf(head_dim, theta, params)
    cfg = _ours(params)
    enc = vlpe.encodings.build("rope1d", dim=4 * head_dim, num_heads=4, theta=theta, scaling=cfg)
    ours = enc.scaled(enc.freqs)[0].double()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert enc.scaling.attention_factor == pytest.approx(ref_att, rel=1e-12)
    # mm.rotary: tables of the same frequencies and temperature as transformers' rotary module computes them
    pos = torch.arange(0, 500, 7).view(1, -1)
    cos, sin = mm.rotary("rope1d", pos, head_dim=head_dim, theta=theta, scaling=cfg)
    ang = pos[0, :, None].float() * ref.float()  # (S, K) in fp32 as transformers' rotary module
    emb = torch.cat([ang, ang], -1)
    torch.testing.assert_close(cos[0], emb.cos() * ref_att, rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[0], emb.sin() * ref_att, rtol=0, atol=1e-4)


@pytest.mark.parametrize("head_dim,theta", [(16, 1e4), (128, 1e6)])
@pytest.mark.parametrize("s", [1.0, 2.0, 5.5])
def test_ntk_is_the_ntk_aware_base(head_dim, theta, s):
    """NTK factor s = base theta * s ** (d / (d - 2)): transformers' dynamic NTK at a length where alpha = s."""
    ref, _ = _hf(head_dim, theta, {"rope_type": "dynamic", "factor": 1.0}, seq_len=int(100 * s), max_pos=100)
    enc = vlpe.encodings.build("rope1d", dim=4 * head_dim, num_heads=4, theta=theta, scaling={"type": "ntk", "factor": s})
    torch.testing.assert_close(enc.scaled(enc.freqs)[0].double(), ref, rtol=1e-6, atol=0)
    K = head_dim // 2
    by_hand = (theta * s ** (head_dim / (head_dim - 2))) ** (-2 * torch.arange(K, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(enc.scaled(enc.freqs)[0].double(), by_hand, rtol=1e-6, atol=0)


def test_yarn_hand_computed_example():
    """16 channels (8 pairs), theta 1e4, original length 1024, s = 4, beta 32 / 1, truncated.

    Correction dims: 16 ln(1024 / (32 * 2 pi)) / (2 ln 1e4) = 1.414 -> floor 1 and 16 ln(1024 / (2 pi)) / (2 ln 1e4)
    = 4.424 -> ceil 5; the ramp (j - 1) / 4 clipped to [0, 1] gives gains 1 - r + r / 4:
    1, 1, 0.8125, 0.625, 0.4375, 0.25, 0.25, 0.25. Attention factor 0.1 ln 4 + 1.
    """
    gains = torch.tensor([1, 1, 0.8125, 0.625, 0.4375, 0.25, 0.25, 0.25], dtype=torch.float64)
    base = inv_freq(8, 1e4).double()
    cfg = {"type": "yarn", "factor": 4.0, "original_size": 1024}
    enc = vlpe.encodings.build("rope1d", dim=64, num_heads=4, theta=1e4, scaling=cfg)
    torch.testing.assert_close(enc.scaled(enc.freqs)[0].double(), base * gains, rtol=1e-6, atol=0)
    assert enc.scaling.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    # untruncated: the ramp runs between the exact correction dims 1.414 and 4.424
    lo_j = 16 * math.log(1024 / (32 * 2 * math.pi)) / (2 * math.log(1e4))
    hi_j = 16 * math.log(1024 / (2 * math.pi)) / (2 * math.log(1e4))
    r = ((torch.arange(8, dtype=torch.float64) - lo_j) / (hi_j - lo_j)).clamp(0, 1)
    enc.set_scaling({**cfg, "truncate": False})
    torch.testing.assert_close(enc.scaled(enc.freqs)[0].double(), base * (1 - r + r / 4), rtol=1e-6, atol=0)


@pytest.mark.parametrize("L,s", [(512, 2.0), (3000, 8.0)])
def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones(L, s):
    enc = vlpe.encodings.build("rope1d", dim=256, num_heads=4, theta=1e4,
                               scaling={"type": "yarn", "factor": s, "original_size": L, "truncate": False})
    f0, f1 = enc.freqs[0].double(), enc.scaled(enc.freqs)[0].double()
    rotations = L * f0 / (2 * math.pi)
    fast, slow = rotations > 32, rotations < 1
    assert fast.any() and slow.any()
    torch.testing.assert_close(f1[fast], f0[fast], rtol=1e-6, atol=0)
    torch.testing.assert_close(f1[slow], f0[slow] / s, rtol=1e-6, atol=0)
    mid = ~fast & ~slow
    assert ((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / s)).all()


def test_vision_per_axis_factor_scales_only_its_axis():
    enc = vlpe.encodings.build("rope", dim=64, num_heads=4, theta=100.0)
    f0 = enc.freqs.clone()  # (2, D/2): axis 0 rows, axis 1 columns
    for cfg in ({"type": "yarn", "factor": {"h": 3.0}, "original_size": {"h": 4}},
                {"type": "ntk", "factor": (3.0, 1.0)}, {"type": "linear", "factor": {0: 3.0}}):
        enc.set_scaling(cfg)
        f1 = enc.scaled(enc.freqs)
        assert torch.equal(f1[1], f0[1]), cfg  # columns untouched
        assert (f1[0] < f0[0]).any() and (f1[0] <= f0[0]).all(), cfg
        assert enc.scaling.attention_factor == (1.0 if cfg["type"] != "yarn" else pytest.approx(0.1 * math.log(3) + 1))


def test_resolution_scaling():
    assert resolution_scaling((14, 14), (28, 21)) == {"type": "yarn", "factor": (2.0, 1.5), "original_size": (14, 14)}
    assert resolution_scaling(14, 28, "ntk") == {"type": "ntk", "factor": 2.0, "original_size": 14}
    assert resolution_scaling(14, (28, 42), truncate=False)["factor"] == (2.0, 3.0)
    with pytest.raises(ValueError, match="same number of axes"):
        resolution_scaling((14, 14), (28, 28, 28))


def test_learned_frequencies_get_the_gain_of_their_magnitude():
    """RoPE-Mixed without the random turn has axial frequencies: scaled like axial RoPE of the same theta."""
    mixed = vlpe.encodings.build("rope_mixed", dim=64, num_heads=4, depth=2, theta=10.0, rotate=False)
    axial = vlpe.encodings.build("rope", dim=64, num_heads=4, theta=10.0)
    cfg = {"type": "yarn", "factor": 3.0, "original_size": (5, 7)}
    for c in (cfg, {"type": "ntk", "factor": 3.0}):
        mixed.set_scaling(c)
        axial.set_scaling(c)
        fm0, fm1 = mixed.freqs.detach().double(), mixed.scaled(mixed.freqs).detach().double()  # (L, H, 2, D/2)
        fa0, fa1 = axial.freqs.double(), axial.scaled(axial.freqs).double()  # (2, D/2)
        for a in range(2):
            big = fm0[0, 0, a].abs() > 1e-6
            ref = {round(x, 6): y for x, y in zip(fa0[a][fa0[a] > 0].tolist(), (fa1[a] / fa0[a])[fa0[a] > 0].tolist())}
            gains = (fm1[0, 0, a][big] / fm0[0, 0, a][big]).tolist()
            for mag, g in zip(fm0[0, 0, a][big].abs().tolist(), gains):
                assert g == pytest.approx(ref[round(mag, 6)], rel=1e-6)
    assert mixed.freqs.requires_grad and mixed.scaled(mixed.freqs).requires_grad  # still trainable under scaling


# ------------------------------------------------------------------------------------------------ multimodal
def _ids(variant: str, B: int = 2, S: int = 9) -> torch.Tensor:
    v = mm.get_variant(variant)
    g = torch.Generator().manual_seed(0)
    A = v.num_axes(depth=3) if v.design == "pype" else v.num_axes()
    return torch.randint(0, 40, (A, B, S), generator=g)


@pytest.mark.parametrize("variant", sorted(mm.VARIANTS))
def test_every_variant_scales(variant):
    ids = _ids(variant)
    kw = dict(head_dim=16, num_kv_heads=4)
    cos0, sin0 = mm.rotary(variant, ids, **kw)
    for s in (2.0, 3.5):
        cos, sin = mm.rotary(variant, ids * s, scaling={"type": "linear", "factor": s}, **kw)
        torch.testing.assert_close(cos, cos0, rtol=0, atol=2e-5)
        torch.testing.assert_close(sin, sin0, rtol=0, atol=2e-5)
    for cfg in ({"type": "yarn", "factor": 1.0, "original_size": 8}, {"type": "ntk", "factor": 1.0}):
        cos, sin = mm.rotary(variant, ids, scaling=cfg, **kw)
        torch.testing.assert_close(cos, cos0, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, sin0, rtol=0, atol=1e-6)
    cos, _ = mm.rotary(variant, ids, scaling={"type": "yarn", "factor": 4.0, "original_size": 8}, **kw)
    assert (cos - cos0).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["mrope", "mrope_i", "videorope", "mhrope"])
def test_multimodal_time_only(variant):
    """``{"t": 4}``: pairs reading h / w keep their angles, pairs reading t turn as at t / 4."""
    kw = dict(head_dim=32, num_kv_heads=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60, (3, 1, 11), generator=g)
    cos, sin = mm.rotary(variant, ids, scaling={"type": "linear", "factor": {"t": 4.0}}, **kw)
    squeezed = ids.clone().double()
    squeezed[0] /= 4
    cos_ref, sin_ref = mm.rotary(variant, squeezed, **kw)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-5)
    # yarn on time only: spatial pairs bit-identical to no scaling
    yarn_t = {"type": "yarn", "factor": {"t": 4.0}, "original_size": {"t": 4}, "attention_factor": 1.0}
    cy, _ = mm.rotary(variant, ids, scaling=yarn_t, **kw)
    c0, _ = mm.rotary(variant, ids, **kw)
    spatial = ids.clone()
    spatial[1:] = 0  # only t moves: where tables differ from t = 0, the pair reads t
    ct, _ = mm.rotary(variant, spatial, **kw)
    reads_t = (ct != 1).flatten(0, -2).any(0) if ct.dim() == 3 else (ct != 1).any(-2)
    assert torch.equal(cy[..., ~reads_t] if ct.dim() == 3 else cy.masked_select(~reads_t.unsqueeze(-2)),
                       c0[..., ~reads_t] if ct.dim() == 3 else c0.masked_select(~reads_t.unsqueeze(-2)))


def test_multimodal_errors():
    ids = _ids("mrope")
    with pytest.raises(ValueError, match="scaling type"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "dynamic", "factor": 2})
    with pytest.raises(ValueError, match="> 0"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "linear", "factor": 0})
    with pytest.raises(ValueError, match="axis 'x'"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "linear", "factor": {"x": 2}})
    with pytest.raises(ValueError, match="unknown scaling key"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "linear", "factor": 2, "rope_theta": 1})
    with pytest.raises(ValueError, match="not both"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "linear", "factor": 2}, inv_freq=inv_freq(8, 1e4))
    with pytest.raises(ValueError, match="original_size"):
        mm.rotary("mrope", ids, head_dim=16, scaling={"type": "yarn", "factor": 2})


# ------------------------------------------------------------------------------------------------ encodings
def test_errors_on_build_and_set():
    with pytest.raises(ValueError, match="scaling type"):
        vlpe.encodings.build("rope", dim=64, num_heads=4, scaling={"type": "longrope", "factor": 2})
    with pytest.raises(ValueError, match="> 0"):
        vlpe.encodings.build("rope_mixed", dim=64, num_heads=4, scaling={"type": "yarn", "factor": -1,
                                                                         "original_size": 4})
    with pytest.raises(ValueError, match="axis 't'"):
        vlpe.encodings.build("rope", dim=64, num_heads=4, scaling={"type": "linear", "factor": {"t": 4}})
    with pytest.raises(ValueError, match="unknown scaling key"):
        vlpe.encodings.build("rope", dim=64, num_heads=4, scaling={"type": "linear", "factor": 2, "scale": 2})
    with pytest.raises(ValueError, match="YaRN options"):
        vlpe.encodings.build("rope", dim=64, num_heads=4, scaling={"type": "linear", "factor": 2, "beta_fast": 8})
    with pytest.raises(ValueError, match="coords='raw'"):
        vlpe.encodings.build("comrope", dim=64, num_heads=4, scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="at least 2 rotation pairs"):  # one pair per axis has no spectrum
        vlpe.encodings.build("rope", dim=16, num_heads=4, scaling={"type": "ntk", "factor": 2})


def test_set_scaling_on_a_model():
    from models.vit import ViT

    torch.manual_seed(0)
    model = ViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3, encoding="rope").eval()
    x = torch.randn(1, 3, 64, 48)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x)
        assert set_scaling(model, resolution_scaling(4, (8, 6))) == 1
        scaled = model(x)
        assert set_scaling(model, None) == 1
        after = model(x)
    assert (scaled - before).abs().max() > 1e-6  # a tiny random ViT: small but real changes
    assert torch.equal(after, before)
    now = model.state_dict()
    assert sorted(now) == sorted(state) and all(torch.equal(now[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="no rotary encoding"):
        set_scaling(torch.nn.Linear(2, 2), {"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="axis"):  # nothing half-applied
        set_scaling(model, {"type": "linear", "factor": {"t": 2}})
    assert model.encoder.encoding.scaling is None


# ------------------------------------------------------------------------------------------------ head_axes
def _logits(enc, pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, enc.num_heads, pos.num_tokens, enc.head_dim, generator=g).unbind(0)
    return vlpe.attention_logits(enc, q, k, pos), q, k


def test_head_axes():
    enc = vlpe.encodings.build("rope", dim=64, num_heads=4, head_axes=(0, 1, None, 0))
    pos = vlpe.Positions.grid(5, 6, prefix=1)
    base, q, k = _logits(enc, pos)
    cols = pos.with_coords(pos.coords + torch.tensor([0.0, 1.0]) * (torch.arange(pos.num_tokens) % 3).view(-1, 1),
                           keep_grid=False)
    rows = pos.with_coords(pos.coords + torch.tensor([1.0, 0.0]) * (torch.arange(pos.num_tokens) % 3).view(-1, 1),
                           keep_grid=False)
    by_cols, by_rows = vlpe.attention_logits(enc, q, k, cols), vlpe.attention_logits(enc, q, k, rows)
    for h, axis in enumerate((0, 1, None, 0)):
        moved_other = by_cols if axis == 0 else by_rows  # shifts along the axis the head does not read
        torch.testing.assert_close(moved_other[:, h], base[:, h], rtol=0, atol=1e-4)
        if axis is not None:
            assert (by_rows if axis == 0 else by_cols)[:, h].sub(base[:, h]).abs().max() > 1e-2
    plain = q[:, 2] @ k[:, 2].transpose(-1, -2) / math.sqrt(enc.head_dim)
    torch.testing.assert_close(base[:, 2], plain, rtol=0, atol=1e-5)  # the None head is not rotated
    band = inv_freq(enc.head_dim // 2, 100.0)
    assert torch.equal(enc.freqs[0, 0], band) and not enc.freqs[0, 1].any()
    default = vlpe.encodings.build("rope", dim=64, num_heads=4)
    assert torch.equal(default.freqs, axial_inv_freq(16, 2, 100.0))  # the default is unchanged
    for claim in sorted(enc.claims):
        vlpe.testing.check(enc, claim)
    for bad in ((0, 1, 2, 0), (0, 1), (0, 1, True, 0), ("h", 0, 0, 0)):
        with pytest.raises(ValueError, match="head_axes"):
            vlpe.encodings.build("rope", dim=64, num_heads=4, head_axes=bad)


def test_parse_scaling_per_axis_forms():
    a = parse_scaling({"type": "yarn", "factor": {"t": 4}, "original_size": 16}, num_axes=3)
    assert a.factor == (4.0, 1.0, 1.0) and a.original == (16.0, 16.0, 16.0)
    assert a.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    b = parse_scaling({"type": "linear", "factor": [2, 3]}, num_axes=2)
    assert b.factor == (2.0, 3.0) and b.attention_factor == 1.0
    f = torch.rand(3, 2, 5)
    assert torch.equal(scale_frequencies(f, None, lo=0.1, num_pairs=5), f)
