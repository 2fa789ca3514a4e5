"""Multimodal position designs: the spec's worked example, parity with transformers and with a loop of the
released semantics, and the invariants of every design (encodings-multimodal.md section 10)."""

from __future__ import annotations

import math

import pytest
import torch
from test_mm_helpers import batch, released_mrope_loop, tiny_qwen2vl, tiny_qwen3vl, tokens

from vlpe.encodings import multimodal as mm

ALL = list(mm.VARIANTS)


def worked_example():
    """3 text tokens, <vs>, an image of merged grid (1, 2, 3), <ve>, 2 text tokens: S = 13 (spec 10.15)."""
    types, _, grid = batch([tokens(4, ("img", (1, 4, 6)), 3)])
    return types, grid


def rows(ids):
    """Per-token tuples of a (A, 1, S) id tensor."""
    return [tuple(x) for x in ids[:, 0].T.tolist()]


# --------------------------------------------------------------------------- worked example (spec 10.15)
TEXT_BEFORE = [(0, 0, 0), (1, 1, 1), (2, 2, 2), (3, 3, 3)]


@pytest.mark.parametrize("variant", ["mrope", "mrope_i"])
def test_worked_example_mrope(variant):
    types, grid = worked_example()
    ids, deltas = mm.position_ids(variant, types, grid)
    image = [(4, 4, 4), (4, 4, 5), (4, 4, 6), (4, 5, 4), (4, 5, 5), (4, 5, 6)]
    assert rows(ids) == TEXT_BEFORE + image + [(7, 7, 7), (8, 8, 8), (9, 9, 9)]
    assert deltas.tolist() == [[-3]]


def test_worked_example_spatial_reset():
    types, grid = worked_example()
    ids, deltas = mm.position_ids("mrope_i", types, grid, spatial_reset=True)
    image = [(4, 0, 0), (4, 0, 1), (4, 0, 2), (4, 1, 0), (4, 1, 1), (4, 1, 2)]
    assert rows(ids) == TEXT_BEFORE + image + [(7, 7, 7), (8, 8, 8), (9, 9, 9)]
    assert deltas.tolist() == [[-3]]
    same, _ = mm.position_ids(mm.Variant("spatial_reset", "interleaved"), types, grid)
    assert torch.equal(same, ids)


def test_worked_example_videorope():
    types, grid = worked_example()
    ids, deltas = mm.position_ids("videorope", types, grid)
    image = [(4, 4, 3), (4, 4, 4), (4, 4, 5), (4, 5, 3), (4, 5, 4), (4, 5, 5)]
    assert rows(ids) == TEXT_BEFORE + image + [(5, 5, 5), (6, 6, 6), (7, 7, 7)]
    assert deltas.tolist() == [[-5]]
    assert ids.is_floating_point()


def test_worked_example_vrope():
    types, grid = worked_example()
    ids, deltas = mm.position_ids("vrope", types, grid)
    text = [(n,) * 4 for n in range(4)]
    image = [(4, 6, 5, 7), (5, 5, 6, 6), (6, 4, 7, 5), (5, 7, 4, 6), (6, 6, 5, 5), (7, 5, 6, 4)]
    assert rows(ids) == text + image + [(8,) * 4, (9,) * 4, (10,) * 4]
    assert deltas.tolist() == [[-2]]


def test_worked_example_v2pe():
    """A 2-tile image (N = 512) at stride 64 after <img> at l: l+0.25 ... l+128, then </img> at l+129."""
    types, _, grid = batch([tokens(5, ("img", (1, 32, 64)), 2)])  # 16 x 32 = 512 merged tokens
    ids, deltas = mm.position_ids("v2pe", types, grid, stride=64)
    l = 4.0  # the <img> token
    img = ids[0, 0, 5:517]
    assert img[0].item() == l + 0.25 and img[-1].item() == l + 128
    assert torch.allclose(img.diff(), torch.full((511,), 0.25))
    assert ids[0, 0, 517].item() == l + 129 and ids[0, 0, 518].item() == l + 130
    assert deltas.tolist() == [[l + 131 - 519]]


# --------------------------------------------------------------------------- parity with transformers
def test_qwen2vl_grid_matches_transformers_images_left_padding():
    types, mask, grid = batch(
        [
            tokens(3, ("img", (1, 4, 6)), 2, ("img", (1, 8, 4)), 4),
            tokens(1, ("img", (1, 2, 2)), 5),
            tokens(2, ("img", (1, 12, 10)), 1, ("img", (1, 2, 6)), 1, ("img", (1, 4, 4)), 3),
            tokens(7),
        ]
    )
    with torch.no_grad():
        ref_ids, ref_deltas = tiny_qwen2vl().get_rope_index(
            torch.zeros_like(types), types, image_grid_thw=grid, attention_mask=mask
        )
    ids, deltas = mm.position_ids("mrope", types, grid, attention_mask=mask, pad_position=0)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)
    assert ids.dtype == torch.int64
    # default padding id is the released code's 1; real tokens unchanged
    ids1, _ = mm.position_ids("mrope", types, grid, attention_mask=mask)
    pad = mask == 0
    assert (ids1[:, pad] == 1).all() and torch.equal(ids1[:, ~pad], ids[:, ~pad])


def test_qwen3vl_per_frame_matches_transformers():
    types, mask, grid = batch(
        [
            tokens(2, ("img", (1, 4, 6)), 2, ("frames", (3, 4, 4), 3), 2),
            tokens(1, ("frames", (2, 8, 4), 4), 1, ("img", (1, 2, 2)), 3),
        ]
    )
    is_video = torch.tensor([0, 1, 1, 0], dtype=torch.bool)
    with torch.no_grad():
        ref_ids, ref_deltas = tiny_qwen3vl().get_rope_index(
            torch.zeros_like(types), types, image_grid_thw=grid[~is_video], video_grid_thw=grid[is_video],
            attention_mask=mask,
        )
    ids, deltas = mm.position_ids("qwen3vl", types, grid, attention_mask=mask, pad_position=0)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)
    merged, kinds = mm.merge_grids(types, grid[~is_video], grid[is_video], attention_mask=mask)
    assert torch.equal(merged, grid) and kinds.tolist() == [1, 2, 2, 1]


def video_batch():
    return batch(
        [
            tokens(3, ("vid", (4, 6, 8)), 2, ("img", (1, 4, 4)), 3),
            tokens(2, ("img", (1, 2, 6)), 1, ("vid", (16, 4, 4)), 4),
            tokens(1, ("vid", (2, 12, 2)), 2),
        ]
    )


def test_mrope_video_matches_released_loop():
    types, mask, grid = video_batch()
    ref_ids, ref_deltas = released_mrope_loop(types, mask, grid)
    ids, deltas = mm.position_ids("mrope", types, grid, attention_mask=mask)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)
    # the temporal extent counts: after the (16, 2, 2) video the text resumes at s + 16, not s + 2
    s = ids[0, 1, mask[1].bool()][types[1, mask[1].bool()] == 2].min().item()
    after = mask.shape[1] - 4
    assert ids[0, 1, after].item() == s + 16


@pytest.mark.parametrize("fps", [1.0, 2.0, 4.0])
def test_qwen25vl_absolute_time_matches_released_loop(fps):
    types, mask, grid = video_batch()
    spg = [2.0 / fps, 1.0, 0.5]  # temporal_patch_size / fps per video, in order of appearance
    ref_ids, ref_deltas = released_mrope_loop(types, mask, grid, second_per_grid_ts=spg, tokens_per_second=2)
    ids, deltas = mm.position_ids("qwen25vl", types, grid, attention_mask=mask, second_per_grid_ts=spg)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)
    # spec 10.9: t(tau) = floor(4 tau / fps) for the first video (tokens_per_second 2, temporal patch 2)
    vid = (types[0] == 2) & mask[0].bool()
    t = ids[0, 0, vid].reshape(4, -1)[:, 0]
    s = t[0]
    assert (t - s).tolist() == [math.floor(4 * tau / fps) for tau in range(4)]
    # images keep t at the block start (no time scaling)
    img = (types[0] == 1) & mask[0].bool()
    assert (ids[0, 0, img] == ids[0, 0, img].min()).all()


# --------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("variant", ALL)
def test_text_only_is_1d(variant):
    types, mask, grid = batch([tokens(9), tokens(5)])
    opts = {"depth": 3} if variant == "pype" else {}
    ids, deltas = mm.position_ids(variant, types, None, attention_mask=mask, **opts)
    expect = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert (ids == expect.to(ids.dtype)).all()
    assert (deltas == 0).all()


@pytest.mark.parametrize("variant", ALL)
def test_left_padding_matches_unpadded(variant):
    samples = [tokens(2, ("vid", (2, 4, 6)), 1, ("img", (1, 4, 4)), 2), tokens(1, ("img", (1, 6, 2)), 3)]
    opts = {"depth": 5, "interval": 1} if variant == "pype" else {}
    types, mask, grid = batch(samples)
    ids, deltas = mm.position_ids(variant, types, grid, attention_mask=mask, **opts)
    for b, (t, g) in enumerate(samples):
        one, d1 = mm.position_ids(variant, torch.tensor([t]), torch.tensor(g), **opts)
        assert torch.equal(ids[:, b, mask[b].bool()], one[:, 0]) and torch.equal(deltas[b], d1[0])
        assert (ids[:, b, ~mask[b].bool()] == 1).all()


def test_prepending_text_shifts_ids_and_spatial_reset_does_not():
    """Spec 10.5: P more text tokens shift every id by P; with spatial reset h/w of the image stay local."""
    base = tokens(2, ("img", (1, 4, 6)), 2)
    longer = tokens(7, ("img", (1, 4, 6)), 2)
    for reset in (False, True):
        a, _ = mm.position_ids("mrope_i", torch.tensor([base[0]]), torch.tensor(base[1]), spatial_reset=reset)
        b, _ = mm.position_ids("mrope_i", torch.tensor([longer[0]]), torch.tensor(longer[1]), spatial_reset=reset)
        img_a, img_b = a[:, 0, 2:8], b[:, 0, 7:13]
        if reset:
            assert torch.equal(img_b[0], img_a[0] + 5) and torch.equal(img_b[1:], img_a[1:])
        else:
            assert torch.equal(img_b, img_a + 5)
        assert torch.equal(b[:, 0, 13:], a[:, 0, 8:] + 5)  # the continuation after the block shifts with the text


def test_diagonal_temporal_scale_and_continuation():
    types, _, grid = batch([tokens(2, ("vid", (3, 6, 4)), 2)])  # merged (3, 3, 2)
    for gamma in (0.5, 0.75, 2.0):
        ids, deltas = mm.position_ids("hope_video", types, grid, temporal_scale=gamma)
        v = ids[:, 0, 2:20].reshape(3, 3, 3, 2)  # (axis, tau, i, j)
        s = 2.0
        for tau in range(3):
            tp = s + gamma * tau
            assert (v[0, tau] == tp).all()
            assert torch.equal(v[1, tau, :, 0], tp + torch.tensor([-1.0, 0.0, 1.0]))  # i - (H-1)//2, H = 3
            assert torch.equal(v[2, tau, 0], tp + torch.tensor([0.0, 1.0]))  # j - (W-1)//2, W = 2
        assert ids[0, 0, 20].item() == s + gamma * 2 + 1  # max of the t row + 1
        assert deltas.item() == pytest.approx(s + gamma * 2 + 1 + 2 - 22)


def test_hope_training_draws_gamma_per_block_from_the_set():
    samples = [tokens(1, ("vid", (2, 2, 2)), 1)] * 40
    types, mask, grid = batch(samples)
    g = torch.Generator().manual_seed(0)
    ids, _ = mm.position_ids("hope_video", types, grid, training=True, generator=g)
    gammas = ids[0, :, 2] - ids[0, :, 1]  # t of frame 1 minus frame 0, one draw per block
    assert set(gammas.tolist()) <= set(mm.HOPE_SCALES) and len(set(gammas.tolist())) >= 3
    again, _ = mm.position_ids("hope_video", types, grid, training=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)


def test_v2pe_span_and_modes():
    samples = [tokens(3, ("img", (1, 6, 10)), 2, ("img", (1, 4, 4)), 1)]  # N = 15 and 4 tokens
    types, _, grid = batch(samples)
    for stride in (1, 16, 64, 100, 256):
        ids, _ = mm.position_ids("v2pe", types, grid, stride=stride)
        delta = stride / 256
        p = ids[0, 0].double()
        assert torch.allclose(p[3:18].diff(), torch.full((14,), delta, dtype=torch.float64))
        assert p[18].item() - p[2].item() - 1 == math.ceil(delta * 15)  # image span = ceil(delta N)
        assert p[24].item() - p[19].item() - 1 == math.ceil(delta * 4)
    default, _ = mm.position_ids("v2pe", types, grid, mode="default")
    plain, _ = mm.position_ids("rope1d", types, grid)
    assert torch.equal(default[0], plain[0].float())
    rnd, _ = mm.position_ids("v2pe", *batch(samples * 8)[::2], mode="rnd", generator=torch.Generator().manual_seed(1))
    steps = rnd[0, :, 4] - rnd[0, :, 3]
    assert set((steps * 256).round().tolist()) <= set(mm.V2PE_STRIDES) and len(set(steps.tolist())) > 1


def test_pype_schedule_span_and_rings():
    """LLaVA-1.5 (24 x 24 image, 32 layers, descent every 4): M = 11 at layers 0-3, 10 at 4-7, ..., 4 at 28-31."""
    types, _, grid = batch([tokens(5, ("img", (1, 48, 48)), 3)])
    ids, deltas = mm.position_ids("pype", types, grid, depth=32, interval=4)
    assert ids.shape == (32, 1, 5 + 576 + 3) and deltas.shape == (1, 32)
    expected_M = [11] * 4 + [10] * 4 + [9] * 4 + [8] * 4 + [7] * 4 + [6] * 4 + [5] * 4 + [4] * 4
    b = 5
    for layer, M in enumerate(expected_M):
        img = ids[layer, 0, 5:581].reshape(24, 24)
        for i, j in [(0, 5), (3, 3), (11, 12), (12, 11), (23, 0), (20, 17), (6, 9)]:
            ring = min(i, j, 23 - i, 23 - j)
            assert img[i, j].item() == b + min(ring, M)
        assert img.max().item() == b + M
        assert ids[layer, 0, 581].item() == b + M + 1  # the image occupies M + 1 positions
        assert deltas[0, layer].item() == b + M + 1 + 3 - 584
    assert ids[:, 0, :5].tolist() == [list(range(5))] * 32


def test_pype_mask_rule():
    types, _, grid = batch([tokens(2, ("img", (1, 12, 12)), 2)])  # 6 x 6 image: rings 0..2
    ids, _ = mm.position_ids("pype", types, grid, depth=6, interval=2)
    for layer in range(6):
        keep = mm.pype_attention_mask(ids, layer)[0, 0]
        M = [2, 2, 1, 1, 0, 0][layer]  # 6 // 2 = 3 minus min(l // 2 + 1, 3)
        rho = [None] * 2 + [min(i, j, 5 - i, 5 - j, M) for i in range(6) for j in range(6)] + [None] * 2
        for q in range(40):
            for k in range(40):
                q_img, k_img = 2 <= q < 38, 2 <= k < 38
                expect = rho[k] <= rho[q] if (q_img and k_img) else k <= q  # rings inside, causal elsewhere
                assert keep[q, k].item() == expect, (layer, q, k)


def test_pype_odd_grid_follows_released_schedule():
    """The released code uses M_l = H // 2 - min(l // N + 1, H // 2): for odd H the centre merges at layer 0."""
    types, _, grid = batch([tokens(1, ("img", (1, 10, 10)), 1)])  # 5 x 5, rings 0, 1, 2
    ids, _ = mm.position_ids("pype", types, grid, depth=2, interval=1)
    img = ids[:, 0, 1:26].reshape(2, 5, 5) - 1
    assert img[0, 2, 2].item() == 1 and img[0, 1, 1].item() == 1 and img[0, 0, 3].item() == 0
    assert (img[1] == 0).all()


def test_vrope_frames_tile_the_line_and_mean_is_constant():
    """H = 3, W = 4, T = 2, s = 10: frame 0 uses 10..15, frame 1 16..21, the next text starts at 22."""
    types, _, grid = batch([tokens(10, ("vid", (2, 6, 8)), 2)])
    ids, _ = mm.position_ids("vrope", types, grid)
    frames = ids[:, 0, 10:34].reshape(4, 2, 12)  # (u, tau, tokens)
    assert frames[:, 0].min().item() == 10 and frames[:, 0].max().item() == 15
    assert frames[:, 1].min().item() == 16 and frames[:, 1].max().item() == 21
    for tau in range(2):
        assert sorted(set(frames[:, tau].flatten().tolist())) == list(range(10 + 6 * tau, 16 + 6 * tau))
        mean = frames[:, tau].double().mean(0)
        assert (mean == 10 + 6 * tau + (3 + 4 - 2) / 2).all()
    assert ids[:, 0, 34].tolist() == [22] * 4


def test_qwen3vl_frames_are_t1_blocks():
    types, _, grid = batch([tokens(1, ("frames", (3, 4, 6), 2), 1)])
    ids, _ = mm.position_ids("qwen3vl", types, grid)
    p = ids[:, 0]
    start = 1 + 2 + 1  # text, timestamp, <vs>
    for f in range(3):
        frame = p[:, start : start + 6]
        s = frame[0, 0].item()
        assert (frame[0] == s).all()  # t stays at the frame start
        assert frame[1].tolist() == [s, s, s, s + 1, s + 1, s + 1] and frame[2].tolist() == [s, s + 1, s + 2] * 2
        assert p[0, start + 6].item() == s + 3  # <ve> after max(H, W) = 3
        start += 6 + 1 + 2 + 1


# --------------------------------------------------------------------------- decoding consistency
@pytest.mark.parametrize("variant", ALL)
def test_decode_matches_full_sequence(variant):
    prompt = [
        tokens(2, ("img", (1, 4, 6)), 1, ("vid", (3, 4, 4)), 2),
        tokens(1, ("vid", (2, 6, 2)), 3),
    ]
    if variant == "qwen3vl":
        prompt = [tokens(2, ("img", (1, 4, 6)), 1, ("frames", (3, 4, 4), 2), 2), tokens(1, ("frames", (2, 6, 2), 3), 3)]
    gen = 4
    opts = {"depth": 4, "interval": 1} if variant == "pype" else {}
    if variant == "qwen25vl":
        opts = {"second_per_grid_ts": [0.5, 2.0]}
    if variant in ("hope_video", "v2pe"):
        opts = {"temporal_scale": 0.6} if variant == "hope_video" else {"stride": 24}
    # Circle-RoPE's positions are irrational: a float32 delta is rounded once more than a float32 id, so the two
    # agree exactly in float64 only
    as_ids = {"dtype": torch.float64} if variant == "circlerope" else {}
    full = [(t + [0] * gen, g) for t, g in prompt]
    types, mask, grid = batch(full)
    ids_full, _ = mm.position_ids(variant, types, grid, attention_mask=mask, **opts, **as_ids)
    S = types.shape[1] - gen
    pmask = mask[:, :S]
    ids_p, deltas = mm.position_ids(variant, types[:, :S], grid, attention_mask=pmask, **opts, **as_ids)
    assert torch.equal(ids_p, ids_full[..., :S])
    # incremental: one token at a time, the attention mask growing with the generated tokens
    for n in range(gen):
        step = mm.decode_position_ids(
            variant, deltas, torch.tensor([S + n]), attention_mask=mask[:, : S + n + 1], **opts
        )
        assert torch.equal(step, ids_full[..., S + n : S + n + 1]), n
    # all at once without padding: the cache position is the real-token index
    one = [(prompt[1][0] + [0] * gen, prompt[1][1])]
    if variant == "qwen25vl":
        opts = {"second_per_grid_ts": [2.0]}
    t1, _, g1 = batch(one)
    ids1, _ = mm.position_ids(variant, t1, g1, **opts)
    _, d1 = mm.position_ids(variant, t1[:, :-gen], g1, **opts)
    n0 = t1.shape[1] - gen
    assert torch.equal(mm.decode_position_ids(variant, d1, torch.arange(n0, n0 + gen)), ids1[..., n0:])


# --------------------------------------------------------------------------- errors
def test_bad_inputs_raise_value_error():
    types, _, grid = batch([tokens(2, ("img", (1, 4, 6)), 2, ("img", (1, 4, 4)), 1)])
    with pytest.raises(ValueError, match="unknown multimodal RoPE variant"):
        mm.position_ids("mrope2", types, grid)
    with pytest.raises(ValueError, match="unknown frequency allocation"):
        mm.Variant("grid", "chunky")
    with pytest.raises(ValueError, match="unknown position design"):
        mm.Variant("gird", "chunked")
    with pytest.raises(ValueError, match="grid_thw describes"):
        mm.position_ids("mrope", types, grid[:1])  # one grid for two images
    with pytest.raises(ValueError, match="grid_thw describes"):
        mm.position_ids("mrope", types, torch.cat([grid, grid[:1]]))  # three grids for two images
    with pytest.raises(ValueError, match="do not match grid_thw"):
        mm.position_ids("mrope", types, grid.flip(0))  # same token count, wrong order
    with pytest.raises(ValueError, match="divisible by spatial_merge_size"):
        mm.position_ids("mrope", *batch([tokens(1, ("img", (1, 3, 4)), 1)])[::2])
    with pytest.raises(ValueError, match="temporal_scale must be a positive"):
        mm.position_ids("hope_video", types, grid, temporal_scale=0)
    with pytest.raises(ValueError, match="temporal_scale must be a positive"):
        mm.position_ids("videorope", types, grid, temporal_scale=-2.0)
    with pytest.raises(ValueError, match="temporal scale must be a positive"):
        mm.position_ids("hope_video", types, grid, training=True, temporal_scales=(0.5, 0.0))
    with pytest.raises(ValueError, match="does not take option"):
        mm.position_ids("mrope", types, grid, temporal_scale=2.0)
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 entries"):
        mm.position_ids("qwen25vl", *batch([tokens(1, ("vid", (2, 4, 4)), 1)])[::2], second_per_grid_ts=[1.0, 1.0])
    adjacent = torch.tensor([[0] + [1] * 10 + [0]])  # two images without a text token between them
    with pytest.raises(ValueError, match="do not match grid_thw"):
        mm.position_ids("mrope", adjacent, torch.tensor([[1, 4, 6], [1, 4, 4]]))
    with pytest.raises(ValueError, match="no rows"):
        mm.position_ids("mrope", types, None)
    with pytest.raises(ValueError, match=r"shape \(B, S\)"):
        mm.position_ids("mrope", types[0], grid)
    with pytest.raises(ValueError, match="0 \\(text\\), 1 \\(image\\) or 2 \\(video\\)"):
        mm.position_ids("mrope", types * 3, grid)
    with pytest.raises(ValueError, match="must be a float dtype"):
        mm.position_ids("videorope", types, grid, dtype=torch.int64)


def test_validate_false_skips_checks_only():
    types, mask, grid = video_batch()
    a = mm.position_ids("mrope", types, grid, attention_mask=mask)
    b = mm.position_ids("mrope", types, grid, attention_mask=mask, validate=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("variant", ALL)
def test_no_host_reads_without_validation(variant):
    """On the meta device every host read (.item(), .tolist(), bool()) raises: the builders make none."""
    types, mask, grid = video_batch()
    opts = {"depth": 3} if variant == "pype" else {}
    meta = {k: v.to("meta") for k, v in dict(types=types, mask=mask, grid=grid).items()}
    if variant == "qwen3vl":
        types2, mask2, grid2 = batch([tokens(2, ("frames", (2, 4, 4), 2), 1)])
        meta = {k: v.to("meta") for k, v in dict(types=types2, mask=mask2, grid=grid2).items()}
    ids, deltas = mm.position_ids(variant, meta["types"], meta["grid"], attention_mask=meta["mask"], validate=False,
                                  **opts)
    assert ids.device.type == "meta" and ids.shape[1:] == meta["types"].shape
    full = torch.ones(meta["mask"].shape[0], meta["mask"].shape[1] + 1, device="meta")
    step = mm.decode_position_ids(variant, deltas, torch.tensor([meta["mask"].shape[1]], device="meta"),
                                  attention_mask=full)
    assert step.shape == (ids.shape[0], ids.shape[1], 1)
    grid, _ = mm.merge_grids(meta["types"], meta["grid"], None, attention_mask=meta["mask"])
    assert grid.device.type == "meta"


@pytest.mark.parametrize("pad", ["left", "right"])
def test_padding_side_and_input_dtypes(pad):
    samples = [tokens(2, ("img", (1, 4, 6)), 1, ("vid", (2, 4, 4)), 2), tokens(1, ("img", (1, 6, 2)), 3)]
    types, mask, grid = batch(samples, pad=pad)
    ids, deltas = mm.position_ids("mrope", types.int(), grid.int(), attention_mask=mask.bool())
    ref_ids, ref_deltas = released_mrope_loop(types, mask, grid)
    assert torch.equal(ids, ref_ids) and torch.equal(deltas, ref_deltas)



# --------------------------------------------------------------------------- packed rows (cu_seqlens)
def _random_sample(rng, *, frames: bool, padding: bool):
    """A random mix of text runs, images and videos (Qwen3-VL: timestamped frames), possibly text only; with
    ``padding`` it may carry left or right padding. Returns ``(types, mask, grids, number of videos)``."""
    parts, videos = [rng.randint(1, 3)], 0
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["img", "vid"])
        T = 1 if kind == "img" else rng.randint(1, 3)
        grid = (T, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3))
        videos += kind == "vid"
        parts += [("frames", grid, rng.randint(1, 2)) if kind == "vid" and frames else (kind, grid), rng.randint(1, 3)]
    t, g = tokens(*parts)
    m = [1] * len(t)
    if padding and rng.random() < 0.5:
        pad = rng.randint(1, 3)
        t, m = ([0] * pad + t, [0] * pad + m) if rng.random() < 0.5 else (t + [0] * pad, m + [0] * pad)
    return t, m, g, videos


def _random_packing(seed, *, rows, padding, frames):
    """``rows`` rows of 2-4 random samples. Rows shorter than the longest end with right padding in their last
    sample (``padding``) or with a longer last text run. Returns the samples per row
    ``[(types, mask, grids, videos), ...]``, the packed ``(types (B, S), mask (B, S), grid (R, 3))`` and the
    per-row ``cu_seqlens``."""
    import random

    rng = random.Random(seed)
    packed = [[_random_sample(rng, frames=frames, padding=padding) for _ in range(rng.randint(2, 4))]
              for _ in range(rows)]  # fmt: skip
    S = max(sum(len(s[0]) for s in row) for row in packed)
    for row in packed:
        t, m, g, v = row[-1]
        extra = S - sum(len(s[0]) for s in row)
        row[-1] = (t + [0] * extra, m + [0 if padding else 1] * extra, g, v)
    types = torch.tensor([sum((s[0] for s in row), []) for row in packed])
    mask = torch.tensor([sum((s[1] for s in row), []) for row in packed])
    grid = torch.tensor([x for row in packed for s in row for x in s[2]], dtype=torch.int64).reshape(-1, 3)
    cu = [torch.tensor([0, *torch.tensor([len(s[0]) for s in row]).cumsum(0).tolist()]) for row in packed]
    return packed, (types, mask, grid), cu


def _flat(cu_rows, S):
    """Per-row cu_seqlens -> one 1-D cu_seqlens over the flattened batch."""
    return torch.cat([cu_rows[0][:1]] + [c[1:] + b * S for b, c in enumerate(cu_rows)])


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("rows,padding", [(1, False), (1, True), (2, False), (2, True)])
def test_packed_rows_give_every_sample_its_own_ids(variant, rows, padding):
    """Every sample of a packed row gets exactly the ids and the delta it gets alone (random text / image / video
    mixes, 2-4 samples per row, with and without padding, one or two rows), for both forms of cu_seqlens."""
    spg_table = [0.5, 0.75, 2.0, 1.0, 0.25] * 20  # Qwen2.5-VL seconds per temporal patch, video by video
    for seed in range(3):
        packed, (types, mask, grid), cu_rows = _random_packing(
            10 * seed + 2 * rows + padding, rows=rows, padding=padding, frames=variant == "qwen3vl"
        )
        S = types.shape[1]

        def opts(first_video, n_videos):
            if variant == "pype":
                return {"depth": 3, "interval": 1}
            if variant == "qwen25vl":
                return {"second_per_grid_ts": spg_table[first_video : first_video + n_videos]}
            return {}

        n_all = sum(s[3] for row in packed for s in row)
        mask_arg = mask if padding else None
        ids, deltas = mm.position_ids(variant, types, grid, attention_mask=mask_arg, cu_seqlens=_flat(cu_rows, S),
                                      **opts(0, n_all))  # fmt: skip
        ids2, deltas2 = mm.position_ids(variant, types, grid, attention_mask=mask_arg, cu_seqlens=cu_rows,
                                        **opts(0, n_all))  # fmt: skip
        assert torch.equal(ids, ids2) and torch.equal(deltas, deltas2)
        assert ids.shape[1:] == (rows, S)
        assert deltas.shape == (sum(len(row) for row in packed), 3 if variant == "pype" else 1)
        k = video = 0
        for b, row in enumerate(packed):
            start = 0
            for t, m, g, v in row:
                one, d1 = mm.position_ids(
                    variant, torch.tensor([t]), torch.tensor(g, dtype=torch.int64).reshape(-1, 3),
                    attention_mask=torch.tensor([m]) if padding else None, **opts(video, v),
                )  # fmt: skip
                assert torch.equal(ids[:, b, start : start + len(t)], one[:, 0]), (seed, b, start)
                assert torch.equal(deltas[k], d1[0]), (seed, k)
                start, k, video = start + len(t), k + 1, video + v


def test_packed_mrope_matches_the_released_loop_per_sample():
    """Independent reference: the Qwen2-VL / Qwen2.5-VL ids of a packed row equal the released loop run on every
    sample alone (text positions restart at each boundary; blocks go to the samples they appear in)."""
    samples = [
        tokens(3, ("vid", (4, 6, 8)), 2, ("img", (1, 4, 4)), 3),
        tokens(2, ("img", (1, 2, 6)), 1, ("vid", (3, 4, 4)), 4),
        tokens(5),
        tokens(1, ("vid", (2, 12, 2)), 2),
    ]
    spg = [[2.0], [1.0], [], [0.5]]  # seconds per temporal patch of each sample's videos
    types = torch.tensor([sum((t for t, _ in samples), [])])
    grid = torch.tensor([g for _, gs in samples for g in gs])
    lengths = [len(t) for t, _ in samples]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for variant, opts in [("mrope", {}), ("qwen25vl", {"second_per_grid_ts": sum(spg, [])})]:
        ids, deltas = mm.position_ids(variant, types, grid, cu_seqlens=cu, **opts)
        for k, (t, g) in enumerate(samples):
            one = torch.tensor([t])
            ref = {"second_per_grid_ts": spg[k], "tokens_per_second": 2} if opts else {}
            ref_ids, ref_deltas = released_mrope_loop(
                one, torch.ones_like(one), torch.tensor(g, dtype=torch.int64).reshape(-1, 3), **ref
            )
            assert torch.equal(ids[:, 0, cu[k] : cu[k + 1]], ref_ids[:, 0]), (variant, k)
            assert torch.equal(deltas[k], ref_deltas[0]), (variant, k)
    # text positions restart at every sample: the first token of each sample is at 0 on every axis
    assert (ids[:, 0, cu[:-1]] == 0).all()


def test_packed_samples_and_text_position_ids_hand_example():
    cu = torch.tensor([0, 3, 3, 7, 10])  # samples of 3, 0 (empty), 4 and 3 tokens in one row of 10
    s = mm.packed_samples(cu, 1, 10)
    assert s.index.tolist() == [[0, 0, 0, 2, 2, 2, 2, 3, 3, 3]] and s.count == 4
    x = torch.arange(1, 11).view(1, 10)
    excl, totals = s.cumsum(x)
    assert excl.tolist() == [[0, 1, 3, 0, 4, 9, 15, 0, 8, 17]] and totals.tolist() == [6, 0, 22, 27]
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 0]])  # right padding in sample 0, left padding in sample 2
    assert mm.text_position_ids(mask, mask).tolist() == [[0, 1, 0, 0, 2, 3, 4, 5, 6, 0]]
    assert mm.text_position_ids((1, 10), mask, cu_seqlens=cu).tolist() == [[0, 1, 0, 0, 0, 1, 2, 0, 1, 0]]
    assert mm.text_position_ids((2, 5), cu_seqlens=[[0, 2, 5], [0, 5]]).tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_pype_mask_of_a_packed_row_is_block_diagonal():
    a, b = tokens(2, ("img", (1, 8, 8)), 1), tokens(1, ("img", (1, 4, 4)), 2)
    types = torch.tensor([a[0] + b[0]])
    grid = torch.tensor(a[1] + b[1])
    cu = torch.tensor([0, len(a[0]), types.shape[1]])
    ids, _ = mm.position_ids("pype", types, grid, cu_seqlens=cu, depth=2, interval=1)
    keep = mm.pype_attention_mask(ids, 1, cu_seqlens=cu)[0, 0]
    n = len(a[0])
    for (t, g), sl in ((a, slice(0, n)), (b, slice(n, None))):
        alone, _ = mm.position_ids("pype", torch.tensor([t]), torch.tensor(g), depth=2, interval=1)
        assert torch.equal(keep[sl, sl], mm.pype_attention_mask(alone, 1)[0, 0])
    assert not keep[n:, :n].any() and not keep[:n, n:].any()


def test_packed_bad_inputs_raise_value_error():
    a, b = tokens(2, ("img", (1, 4, 6)), 2), tokens(1, ("vid", (2, 4, 4)), 3)
    types = torch.tensor([a[0] + b[0]])
    grid = torch.tensor(a[1] + b[1])
    S, n = types.shape[1], len(a[0])
    ok = torch.tensor([0, n, S])
    mm.position_ids("mrope", types, grid, cu_seqlens=ok)
    with pytest.raises(ValueError, match="must start at 0"):
        mm.position_ids("mrope", types, grid, cu_seqlens=torch.tensor([1, n, S]))
    with pytest.raises(ValueError, match="must not decrease"):
        mm.position_ids("mrope", types, grid, cu_seqlens=[0, n, 3, S])
    with pytest.raises(ValueError, match=f"must end at the row length.*S = {S}"):
        mm.position_ids("mrope", types, grid, cu_seqlens=torch.tensor([0, n, S - 1]))
    with pytest.raises(ValueError, match="must end at the row length"):
        mm.position_ids("mrope", types, grid, cu_seqlens=torch.tensor([0, n, S + 4]))
    with pytest.raises(ValueError, match="straddle a sample boundary"):
        mm.position_ids("mrope", types, grid, cu_seqlens=torch.tensor([0, 4, S]))  # inside the image
    with pytest.raises(ValueError, match="straddle a sample boundary"):
        mm.position_ids("qwen3vl", *batch([tokens(1, ("frames", (2, 4, 4), 1), 1)])[::2],
                        cu_seqlens=torch.tensor([0, 8, 16]))  # between two frames of one video  # fmt: skip
    with pytest.raises(ValueError, match="grid_thw describes"):
        mm.position_ids("mrope", types, grid[:1], cu_seqlens=ok)  # the video's grid is missing
    with pytest.raises(ValueError, match="straddle a sample boundary"):  # same count, wrong order: the first
        mm.position_ids("mrope", types, grid.flip(0), cu_seqlens=ok)  # row (8 tokens) takes the image and 2 more
    two = torch.cat([types, types])
    with pytest.raises(ValueError, match="every row boundary"):
        mm.position_ids("mrope", two, torch.cat([grid, grid]), cu_seqlens=torch.tensor([0, n, S + n, 2 * S]))
    with pytest.raises(ValueError, match="one entry per row"):
        mm.position_ids("mrope", two, torch.cat([grid, grid]), cu_seqlens=[ok])
    with pytest.raises(ValueError, match="integer token offsets"):
        mm.position_ids("mrope", types, grid, cu_seqlens=ok.float())
    with pytest.raises(ValueError, match="1-D cumulative sample lengths"):
        mm.position_ids("mrope", types, grid, cu_seqlens=torch.tensor([0]))


@pytest.mark.parametrize("variant", ALL)
def test_packed_rows_make_no_host_reads_without_validation(variant):
    packed, (types, mask, grid), cu_rows = _random_packing(7, rows=2, padding=True, frames=variant == "qwen3vl")
    cu = _flat(cu_rows, types.shape[1])
    opts = {"depth": 3} if variant == "pype" else {}
    meta = [x.to("meta") for x in (types, mask, grid, cu)]
    ids, deltas = mm.position_ids(variant, meta[0], meta[2], attention_mask=meta[1], cu_seqlens=meta[3],
                                  validate=False, **opts)  # fmt: skip
    assert ids.device.type == "meta" and ids.shape[1:] == types.shape
    assert deltas.shape[0] == cu.shape[0] - 1
