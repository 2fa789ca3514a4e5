"""VideoRoPE++'s YaRN-V against vlpe's time-only scaling of VideoRoPE.

The released YaRN-V (Wiselnn570/VideoRoPE @ 7712ca3, ``videorope_plus/videorope_plus_extrapolation_impl/vllm/
model_executor/layers/rotary_embedding.py``, ``MRotaryEmbedding.post_init``, branch ``videorope++_v1``) keeps the
base frequencies of the spatial pairs (the ``h + w`` highest-frequency pairs of the low-frequency temporal
allocation) and gives the temporal pairs the frequencies of an NTK base ``theta * r ** (d / (d - 2))`` with
``r = (factor * L0 - 1) / (L0 - 1)``; no attention factor. That is vlpe's ``ntk`` scaling with the time-only factor
``{"t": r}``: equal, tested here against the released computation re-derived below (not imported). vlpe's time-only
``yarn`` is a different rule (NTK-by-parts with an attention temperature): the tests show by how much it differs.
"""

from __future__ import annotations

import math

import torch
from test_mm_helpers import batch, tokens

from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal.rotary import frequencies

HEAD_DIM, THETA, L0, FACTOR = 128, 1e6, 32768, 4.0
SECTION = (16, 24, 24)


def yarn_v_inv_freq(rotary_dim=HEAD_DIM, base=THETA, factor=FACTOR, original=L0, section=SECTION):
    """The released ``videorope++_v1`` frequencies: base ones for the spatial pairs, NTK ones for the temporal."""
    k = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    plain = 1.0 / base**k
    ntk_base = base * ((original * factor - 1) / (original - 1)) ** (rotary_dim / (rotary_dim - 2))
    ntk = 1.0 / ntk_base**k
    spatial = section[1] + section[2]
    return torch.cat([plain[:spatial], ntk[spatial : spatial + section[0]]])  # (K,)


def yarn_v_tables(ids):
    """Cos / sin of the released rule on VideoRoPE's low-frequency temporal allocation, float64."""
    inv = yarn_v_inv_freq()
    K = inv.numel()
    k = torch.arange(K)
    axis = torch.where(k >= K - SECTION[0], 0, torch.where(k % 2 == 0, 1, 2))  # LTA: h even, w odd, t lowest 16
    ang = ids.double()[axis].permute(1, 2, 0) * inv  # (B, S, K)
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def long_video_ids(offset):
    """A 64-frame video and an image; ``offset`` moves every id deep into a long context, where the temporal pairs'
    scaling turns angles by radians."""
    types, mask, grid = batch([tokens(5, ("vid", (64, 8, 8)), 4), tokens(2, ("img", (1, 6, 4)), 3)])
    ids, _ = mm.position_ids("videorope", types, grid, attention_mask=mask)
    return ids + offset


def test_yarn_v_is_vlpe_time_only_ntk():
    """Equal frequencies (to fp32 rounding, vlpe keeps frequencies in fp32), hence equal tables: at moderate ids to
    1e-5, at ids past 30000 to the fp32 rounding of the frequencies times the position."""
    r = (L0 * FACTOR - 1) / (L0 - 1)
    F, factor = frequencies("videorope", head_dim=HEAD_DIM, num_axes=3, scaling={"type": "ntk", "factor": {"t": r}})
    assert factor == 1.0  # no attention temperature, as released
    assert (F != 0).sum(0).tolist() == [1] * (HEAD_DIM // 2)  # every pair reads one axis
    rel = (F.sum(0).double() / yarn_v_inv_freq() - 1).abs().max().item()
    assert rel < 2 * 2**-24, rel
    assert (F[0] != 0).nonzero().flatten().tolist() == list(range(48, 64))  # time: the 16 lowest-frequency pairs
    for offset, atol in ((0.0, 1e-5), (30000.0, 4e-3)):
        ids = long_video_ids(offset)
        cos, sin = mm.rotary("videorope", ids.double(), head_dim=HEAD_DIM, dtype=torch.float64,
                             scaling={"type": "ntk", "factor": {"t": r}})
        ref_cos, ref_sin = yarn_v_tables(ids)
        err = max((cos - ref_cos).abs().max().item(), (sin - ref_sin).abs().max().item())
        assert err < atol, (offset, err)


def test_yarn_v_differs_from_vlpe_time_only_yarn():
    """Time-only YaRN (NTK-by-parts over the original extent, temperature 0.1 ln 4 + 1) is another rule: on the
    spatial pairs its tables are YaRN-V's times the temperature, on the temporal pairs they differ well beyond the fp32
    rounding."""
    ids = long_video_ids(30000.0)
    cos, _ = mm.rotary("videorope", ids.double(), head_dim=HEAD_DIM, dtype=torch.float64,
                       scaling={"type": "yarn", "factor": {"t": FACTOR}, "original_size": [L0, L0, L0]})
    ref_cos, _ = yarn_v_tables(ids)
    temperature = 0.1 * math.log(FACTOR) + 1
    assert (cos[..., :48] / temperature - ref_cos[..., :48]).abs().max() < 4e-3  # spatial pairs: temperature only
    assert (cos[..., 48:64] / temperature - ref_cos[..., 48:64]).abs().max() > 1e-2  # temporal pairs: another rule
