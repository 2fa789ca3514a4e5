"""RPE-2D: sampled positions are ordered and cover the expanded range; eval and L = grid reproduce the base."""

from __future__ import annotations

import pytest
import torch

import vlpe
from vlpe import Positions, attention_logits
from vlpe.encodings import build


def _batched(pos: Positions, B: int) -> Positions:
    return pos.replace(coords=pos.coords.expand(B, -1, -1))


def _axis_values(coords: torch.Tensor, grid, a: int) -> torch.Tensor:
    """Coordinates along axis a of a row-major grid: (B, g_a)."""
    B, A = coords.shape[0], len(grid)
    lines = coords.reshape(B, *grid, A)
    idx = [0] * A
    idx[a] = slice(None)
    return lines[(slice(None), *idx, a)]


@pytest.mark.parametrize("grid,opts", [((4, 5), {}), ((2, 3, 4), {"length": (5, 6, 9)}), ((4, 5), {"crop": True})])
def test_training_positions_strictly_increase_and_stay_in_range(grid, opts):
    enc = build("rpe2d", dim=48, num_heads=2, depth=1, num_axes=len(grid), **opts).train()
    pos = _batched(Positions.grid_nd(grid, prefix=1), 64)
    ctx = enc.prepare(pos)
    coords = ctx["inner"].pos.patch_coords  # (B, n, A)
    L = enc.ranges(grid)
    assert torch.equal(ctx["inner"].pos.coords[:, :1], torch.zeros(64, 1, len(grid)))  # CLS untouched
    for a, g in enumerate(grid):
        vals = _axis_values(coords, grid, a)  # (B, g)
        assert (vals[:, 1:] > vals[:, :-1]).all()
        assert vals.min() >= 0 and vals.max() <= L[a] - 1
        assert torch.equal(vals, vals.round())
        # separable: every token on the same axis-a index shares the coordinate
        lines = coords.reshape(64, *grid, len(grid))[..., a]
        assert torch.equal(lines, vals.reshape(64, *[g if b == a else 1 for b in range(len(grid))]).expand_as(lines))
    assert len({tuple(c.flatten().tolist()) for c in coords}) > 32  # a different draw per sample


@pytest.mark.parametrize("crop", [False, True])
def test_every_index_of_the_expanded_range_is_reachable(crop):
    torch.manual_seed(1)
    enc = build("rpe2d", dim=48, num_heads=2, depth=1, expand=2.0, crop=crop).train()
    grid = (4, 5)
    ctx = enc.prepare(_batched(Positions.grid(*grid, prefix=1), 400))
    L = enc.ranges(grid)
    assert L == (8, 10)
    for a in range(2):
        seen = torch.bincount(ctx["indices"][a].flatten(), minlength=L[a])
        assert (seen > 0).all(), seen
        # without crop every index is equally likely: g / L of the draws each (loose 5-sigma band)
        if not crop:
            p = grid[a] / L[a]
            mean, sd = 400 * p, (400 * p * (1 - p)) ** 0.5
            assert ((seen - mean).abs() < 5 * sd).all(), seen


@pytest.mark.parametrize(
    "base,opts", [("rope", {}), ("sincos", {}), ("rope_mixed", {}), ("string", {}), ("pape", {}), ("alibi", {})]
)
def test_range_equal_to_grid_gives_the_base_exactly(base, opts):
    grid = (3, 4)
    enc = build("rpe2d", dim=64, num_heads=4, depth=2, base=base, length=grid).train()
    ref = enc.base
    pos = _batched(Positions.grid(*grid, prefix=1).shifted([7.0, -2.0]), 3)
    ctx = enc.prepare(pos)
    assert torch.equal(ctx["inner"].pos.coords, pos.coords)
    x = torch.randn(3, pos.num_tokens, 64)
    assert torch.equal(enc.embed(x, ctx), ref.embed(x, ref.prepare(pos)))
    q, k = torch.randn(2, 3, 4, pos.num_tokens, 16).unbind(0)
    assert torch.equal(attention_logits(enc, q, k, pos, layer=1), attention_logits(ref, q, k, pos, layer=1))
    # expand=1.0 is the same statement
    one = build("rpe2d", dim=64, num_heads=4, depth=2, base=base, expand=1.0).train()
    one.base.load_state_dict(ref.state_dict())
    assert torch.equal(one.prepare(pos)["inner"].pos.coords, pos.coords)


def test_non_uniform_axis_coordinates_are_kept_and_continued():
    """Video timestamps: index i maps to the i-th timestamp; indices past the end continue with the mean step."""
    ts = torch.tensor([0.0, 0.5, 2.0])
    pos = _batched(Positions.video(3, 2, 2, prefix=1, timestamps=ts), 200)
    enc = build("rpe2d", dim=48, num_heads=2, depth=1, num_axes=3, length=(5, 2, 2)).train()
    ctx = enc.prepare(pos)
    t = _axis_values(ctx["inner"].pos.patch_coords, (3, 2, 2), 0)  # (B, 3)
    ext = torch.tensor([0.0, 0.5, 2.0, 3.0, 4.0])
    assert torch.equal(t, ext[ctx["indices"][0]])
    assert set(t.flatten().tolist()) == set(ext.tolist())


@pytest.mark.parametrize("base", ["rope", "sincos", "ape"])
def test_eval_is_deterministic_and_equals_the_base(base):
    opts = {"base_options": {"grid_size": (6, 8)}} if base == "ape" else {}
    enc = build("rpe2d", dim=64, num_heads=4, depth=2, base=base, crop=True, **opts).eval()
    pos = Positions.grid(4, 5, prefix=1)
    x = torch.randn(2, pos.num_tokens, 64)
    q, k = torch.randn(2, 2, 4, pos.num_tokens, 16).unbind(0)
    with torch.no_grad():
        enc.crop_embed.weight.normal_()  # a trained crop embedding: the eval box is zero, so it adds nothing
        a, b = enc.embed(x, enc.prepare(pos)), enc.embed(x, enc.prepare(pos))
        assert torch.equal(a, b)
        assert torch.equal(a, enc.base.embed(x, enc.base.prepare(pos)))
        assert torch.equal(attention_logits(enc, q, k, pos), attention_logits(enc.base, q, k, pos))
        enc.train()
        assert not torch.equal(enc.prepare(_batched(pos, 2))["inner"].pos.coords, pos.coords.expand(2, -1, -1))


def test_ape_reads_table_rows_at_the_sampled_indices():
    enc = build("rpe2d", dim=32, num_heads=2, depth=1, base="ape", base_options={"grid_size": (6, 7)}).train()
    table = enc.base.pos_embed  # (1 + 42, C)
    pos = _batched(Positions.grid(3, 4, prefix=1), 5)
    ctx = enc.prepare(pos)
    pe = ctx["inner"]["pe"]  # (B, N, C)
    rows, cols = ctx["indices"]
    for b in range(5):
        assert torch.equal(pe[b, 0], table[0])
        for r in range(3):
            for c in range(4):
                assert torch.equal(pe[b, 1 + r * 4 + c], table[1 + rows[b, r] * 7 + cols[b, c]])
    # L = grid: the table itself, as the eval path gives it
    full = enc.prepare(_batched(Positions.grid(6, 7, prefix=1), 2))["inner"]["pe"]
    assert torch.equal(full, table.unsqueeze(0).expand(2, -1, -1))


def test_crop_box_matches_the_window_and_conditions_the_cls_token():
    torch.manual_seed(0)
    enc = build("rpe2d", dim=32, num_heads=2, depth=1, expand=3.0, crop=True).train()
    grid = (3, 4)
    pos = _batched(Positions.grid(*grid, prefix=1), 300)
    ctx = enc.prepare(pos)
    box = ctx["box"]  # (B, 4): (start, end) fractions cut off per axis
    L = enc.ranges(grid)
    for a in range(2):
        start, end = box[:, 2 * a] * L[a], L[a] - box[:, 2 * a + 1] * L[a]  # window [start, end)
        ind = ctx["indices"][a]
        assert (ind.min(1).values >= start.round()).all() and (ind.max(1).values < end.round()).all()
        assert (end - start >= grid[a] - 1e-5).all()
    assert (box > 0).any() and (box == 0).any()
    x = torch.randn(300, pos.num_tokens, 32)
    assert torch.equal(enc.embed(x, ctx), x)  # zero-initialised: no effect until trained
    with torch.no_grad():
        enc.crop_embed.weight.normal_()
    out = enc.embed(x, ctx)
    assert torch.equal(out[:, 1:], x[:, 1:])
    assert torch.allclose(out[:, 0] - x[:, 0], box @ enc.crop_embed.weight.T, atol=1e-5)


def test_sampling_runs_without_host_syncs():
    """On the meta device any .item()/bool()/tolist() would raise: the sampling is pure tensor ops."""
    enc = build("rpe2d", dim=32, num_heads=2, depth=1, crop=True).train()
    pos = _batched(Positions.grid(3, 4, prefix=1), 4)
    meta = pos.replace(coords=pos.coords.to("meta"))  # the constructor reads nothing back
    coords, _, box = enc.sample(meta)
    assert coords.device.type == "meta" and coords.shape == pos.coords.shape and box.shape == (4, 4)


def test_hooks_follow_the_base_and_training_backward():
    enc = build("rpe2d", dim=64, num_heads=4, depth=2)
    assert enc.hooks == ("rotate",) and "score" not in enc.pieces  # fused SDPA stays available
    assert build("rpe2d", dim=64, num_heads=4, base="sincos", crop=True).hooks == ("embed",)
    assert enc.prepare(Positions.grid(3, 3, prefix=1)).plan[0].pieces == ("rotate",)
    lh = build("rpe2d", dim=64, num_heads=4, base="alibi")  # the plan follows the base
    assert lh.prepare(Positions.grid(3, 3, prefix=1)).plan[0].score
    enc = build("rpe2d", dim=64, num_heads=4, depth=2, base="rope_mixed", crop=True).train()
    attn = vlpe.Attention(dim=64, num_heads=4)
    pos = _batched(Positions.grid(3, 3, prefix=1), 2)
    ctx = enc.prepare(pos)
    x = enc.embed(torch.randn(2, pos.num_tokens, 64), ctx)
    attn(x, enc=enc, ctx=ctx, layer=1).square().mean().backward()
    assert enc.base.freqs.grad[1].abs().sum() > 0 and enc.crop_embed.weight.grad is not None
    assert enc.no_weight_decay() == {"base.freqs"}


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown base"):
        build("rpe2d", dim=64, num_heads=4, base="ropee")
    with pytest.raises(ValueError, match="read"):
        build("rpe2d", dim=64, num_heads=4, base="irpe")
    with pytest.raises(ValueError, match="expand"):
        build("rpe2d", dim=64, num_heads=4, expand=0.5)
    with pytest.raises(ValueError, match="not both"):
        build("rpe2d", dim=64, num_heads=4, expand=2.0, length=10)
    with pytest.raises(ValueError, match="grid_size"):
        build("rpe2d", dim=64, num_heads=4, base="ape", expand=2.0)
    with pytest.raises(ValueError, match="base_options"):
        build("rpe2d", dim=64, num_heads=4, base_options={"num_heads": 2})
    with pytest.raises(ValueError, match="theta"):
        build("rpe2d", dim=64, num_heads=4, base_options={"theta": -1.0})
    enc = build("rpe2d", dim=64, num_heads=4, length=4).train()
    with pytest.raises(ValueError, match="larger than the expanded range"):
        enc.prepare(Positions.grid(5, 3, prefix=1))
    with pytest.raises(ValueError, match="regular grid"):
        enc.prepare(Positions.points(torch.randn(1, 6, 2)))
    crop = build("rpe2d", dim=64, num_heads=4, crop=True)
    with pytest.raises(ValueError, match="prefix"):
        crop.prepare(Positions.grid(2, 2))
