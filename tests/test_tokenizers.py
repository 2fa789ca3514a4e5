"""Tokenizers: token values against independent computations (timm PatchEmbed, explicit einsums), positions
against hand-built lists, FPS and kNN against slow reference loops kept here."""

from __future__ import annotations

import math

import pytest
import torch
from timm.layers import PatchEmbed

from vlpe import Positions
from vlpe.tokenizers import (
    ImageTokenizer,
    PointTokenizer,
    VideoTokenizer,
    farthest_point_sample,
    knn_indices,
    prepend_prefix,
)


def _row_major(h: int, w: int) -> torch.Tensor:
    return torch.tensor([[r, c] for r in range(h) for c in range(w)], dtype=torch.float32)


def _timm_patch_embed(tok: ImageTokenizer, **kw) -> PatchEmbed:
    ref = PatchEmbed(img_size=None, patch_size=tok.patch_size[0], in_chans=tok.in_chans, embed_dim=tok.dim, **kw)
    ref.proj.load_state_dict(tok.proj.state_dict())
    return ref


# --------------------------------------------------------------------------- images
@pytest.mark.parametrize("hw", [(32, 32), (24, 40)], ids=["square", "rectangular"])
def test_image_batch_tokens_match_timm_and_grid_positions(hw):
    H, W = hw
    tok = ImageTokenizer(dim=24, patch_size=8, in_chans=3)
    x = torch.randn(2, 3, H, W)
    tokens, pos = tok(x)
    h, w = H // 8, W // 8
    assert tokens.shape == (2, h * w, 24)
    torch.testing.assert_close(tokens, _timm_patch_embed(tok)(x))
    assert pos.grid == (h, w) and pos.prefix == 0 and pos.valid is None and pos.axes == ("h", "w")
    torch.testing.assert_close(pos.coords[0], _row_major(h, w))


def test_image_token_is_the_linear_map_of_its_own_patch():
    tok = ImageTokenizer(dim=8, patch_size=(4, 2), in_chans=2)
    x = torch.randn(1, 2, 8, 6)
    tokens, pos = tok(x)
    wt, b = tok.proj.weight, tok.proj.bias  # (8, 2, 4, 2), (8,)
    for n, (r, c) in enumerate(pos.coords[0].long().tolist()):
        patch = x[0, :, 4 * r : 4 * r + 4, 2 * c : 2 * c + 2]  # (2, 4, 2)
        torch.testing.assert_close(tokens[0, n], (wt * patch).sum((1, 2, 3)) + b)


def test_image_prefix_tokens_and_positions():
    tok = ImageTokenizer(dim=16, patch_size=4, num_prefix=3)
    tokens, pos = tok(torch.randn(2, 3, 12, 8))
    assert tokens.shape == (2, 3 + 6, 16) and pos.prefix == 3 and pos.grid == (3, 2)
    torch.testing.assert_close(tokens[:, :3], tok.prefix.tokens.expand(2, -1, -1))
    assert (pos.coords[0, :3] == 0).all()
    torch.testing.assert_close(pos.coords[0, 3:], _row_major(3, 2))
    assert tok.no_weight_decay() == {"prefix.tokens"}


def test_image_mixed_size_list_is_packed_with_valid_mask():
    tok = ImageTokenizer(dim=16, patch_size=8, num_prefix=1)
    images = [torch.randn(3, 16, 24), torch.randn(3, 8, 8), torch.randn(3, 24, 8), torch.randn(3, 16, 24)]
    grids = [(2, 3), (1, 1), (3, 1), (2, 3)]
    tokens, pos = tok(images)
    n_max = max(h * w for h, w in grids)
    assert tokens.shape == (4, 1 + n_max, 16)
    assert pos.grid is None and pos.prefix == 1 and pos.valid.shape == (4, 1 + n_max)
    for i, (img, (h, w)) in enumerate(zip(images, grids)):
        n = h * w
        alone, alone_pos = tok(img[None])  # the same image tokenized on its own
        torch.testing.assert_close(tokens[i, : 1 + n], alone[0])
        assert (tokens[i, 1 + n :] == 0).all()
        assert pos.valid[i].tolist() == [True] * (1 + n) + [False] * (n_max - n)
        torch.testing.assert_close(pos.coords[i, 1 : 1 + n], _row_major(h, w))
        assert alone_pos.grid == (h, w)


def test_image_list_of_one_size_gets_a_grid():
    tok = ImageTokenizer(dim=8, patch_size=4)
    images = [torch.randn(3, 8, 12) for _ in range(3)]
    tokens, pos = tok(images)
    assert pos.grid == (2, 3) and pos.valid is None
    torch.testing.assert_close(tokens, tok(torch.stack(images))[0])


@pytest.mark.parametrize("fit", ["raise", "crop", "pad"])
def test_image_smaller_than_a_patch_raises(fit):
    tok = ImageTokenizer(dim=8, patch_size=8, fit=fit)
    with pytest.raises(ValueError, match="smaller than one patch"):
        tok(torch.randn(1, 3, 7, 16))
    with pytest.raises(ValueError, match="smaller than one patch"):
        tok([torch.randn(3, 16, 16), torch.randn(3, 16, 5)])


def test_image_non_divisible_sizes_raise_crop_or_pad():
    x = torch.randn(2, 3, 19, 13)
    with pytest.raises(ValueError, match="fit='crop'"):
        ImageTokenizer(dim=8, patch_size=4)(x)
    crop = ImageTokenizer(dim=8, patch_size=4, fit="crop")
    tokens, pos = crop(x)
    assert pos.grid == (4, 3)
    torch.testing.assert_close(tokens, _timm_patch_embed(crop, strict_img_size=False)(x[..., :16, :12]))
    pad = ImageTokenizer(dim=8, patch_size=4, fit="pad")
    tokens, pos = pad(x)
    assert pos.grid == (5, 4)
    torch.testing.assert_close(tokens, _timm_patch_embed(pad, strict_img_size=False, dynamic_img_pad=True)(x))


def test_image_bad_inputs_raise():
    tok = ImageTokenizer(dim=8, patch_size=4, in_chans=3)
    for bad in (torch.randn(1, 1, 8, 8), torch.randn(3, 8, 8), [], [torch.randn(1, 3, 8, 8)]):
        with pytest.raises(ValueError):
            tok(bad)
    with pytest.raises(ValueError):
        ImageTokenizer(dim=8, fit="reflect")


def test_prepend_prefix_keeps_tokens_and_positions_in_step():
    x = torch.randn(2, 4, 8)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    pos = Positions(torch.rand(2, 4, 2) + 1, valid=valid)
    cls = torch.randn(1, 8)
    y, p = prepend_prefix(x, pos, cls)
    assert y.shape == (2, 5, 8) and p.prefix == 1
    torch.testing.assert_close(y[:, 0], cls.expand(2, -1))
    torch.testing.assert_close(y[:, 1:], x)
    assert (p.coords[:, 0] == 0).all() and torch.equal(p.coords[:, 1:], pos.coords)
    assert p.valid[:, 0].all() and torch.equal(p.valid[:, 1:], valid)


def test_prepend_prefix_keeps_the_lattice_claim_of_a_grid():
    """A CLS prepended to a grid is the layout of ``Positions.grid(prefix=1)``, lattice included (the fast
    path's tables need it); padded or moved positions stay off the lattice."""
    x = torch.randn(2, 12, 8)
    _, p = prepend_prefix(x, Positions.grid(3, 4), torch.randn(1, 8))
    ref = Positions.grid(3, 4, prefix=1)
    assert p.lattice and p.prefix == 1 and p.grid == (3, 4) and torch.equal(p.coords, ref.coords)
    _, p = prepend_prefix(x, Positions.grid(3, 4).with_coords(ref.coords[:, 1:] + 0.5), torch.randn(1, 8))
    assert not p.lattice
    grid = Positions.grid(3, 4)
    padded = Positions(grid.coords.expand(2, -1, -1), grid=(3, 4), valid=torch.ones(2, 12, dtype=torch.bool))
    object.__setattr__(padded, "lattice", True)
    _, p = prepend_prefix(x, padded, torch.randn(1, 8))
    assert not p.lattice


# --------------------------------------------------------------------------- video
def test_video_tubelets_match_an_explicit_einsum_and_grid():
    tok = VideoTokenizer(dim=12, patch_size=4, tubelet_size=2, in_chans=3)
    B, T, H, W = 2, 6, 8, 12
    x = torch.randn(B, 3, T, H, W)
    tokens, pos = tok(x)
    t, h, w = 3, 2, 3
    assert tokens.shape == (B, t * h * w, 12) and pos.grid == (t, h, w) and pos.axes == ("t", "h", "w")
    blocks = x.reshape(B, 3, t, 2, h, 4, w, 4)
    ref = torch.einsum("bctihjwk,dcijk->bthwd", blocks, tok.proj.weight) + tok.proj.bias
    torch.testing.assert_close(tokens, ref.reshape(B, t * h * w, 12), rtol=1e-4, atol=1e-5)
    expected = torch.tensor([[a, r, c] for a in range(t) for r in range(h) for c in range(w)], dtype=torch.float32)
    torch.testing.assert_close(pos.coords[0], expected)


@pytest.mark.parametrize("reduce,scale", [("mean", None), ("first", None), ("mean", 2.0)])
def test_video_timestamps_land_on_the_right_tokens(reduce, scale):
    """Only tubelet 1 has content; the tokens carrying it must have that tubelet's frame times."""
    tok = VideoTokenizer(dim=4, patch_size=2, tubelet_size=3, bias=False, time_scale=scale, time_reduce=reduce)
    B, T, H, W = 2, 9, 4, 2
    ts = torch.tensor([[0.0, 0.1, 0.5, 0.9, 1.0, 2.0, 2.2, 2.3, 5.0], [3.0, 3.5, 4.0, 10.0, 10.5, 11.5, 20, 21, 22]])
    x = torch.zeros(B, 1 * 3, T, H, W)
    x[:, :, 3:6] = 1.0  # frames of tubelet 1
    tokens, pos = tok(x, timestamps=ts)
    N = 3 * 2 * 1
    assert tokens.shape == (B, N, 4) and pos.coords.shape == (B, N, 3) and pos.grid == (3, 2, 1)
    for b in range(B):
        for n in range(N):
            frames = ts[b, 3 * (n // 2) : 3 * (n // 2) + 3].tolist()
            want = sum(frames) / 3 if reduce == "mean" else frames[0]
            want = want * (scale or 1.0)
            assert math.isclose(pos.coords[b, n, 0].item(), want, rel_tol=1e-6, abs_tol=1e-6)
            assert pos.coords[b, n, 1:].tolist() == [n % 2, 0]
        carrying = tokens[b].abs().sum(-1) > 0
        assert carrying.tolist() == [n // 2 == 1 for n in range(N)]
        m = sum(ts[b, 3:6].tolist()) / 3 if reduce == "mean" else ts[b, 3].item()
        torch.testing.assert_close(pos.coords[b, carrying, 0], torch.full((2,), m * (scale or 1.0)))


def test_video_fit_pads_by_repeating_the_last_frame_or_crops():
    ts = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    x = torch.randn(1, 3, 5, 4, 4)
    pad = VideoTokenizer(dim=4, patch_size=4, tubelet_size=2, fit="pad")
    tokens, pos = pad(x, timestamps=ts)
    assert pos.grid == (3, 1, 1)
    assert pos.coords[0, :, 0].tolist() == [0.5, 2.5, 4.0]  # last tubelet = frame 4 twice
    repeated = torch.cat([x, x[:, :, -1:]], dim=2)
    torch.testing.assert_close(tokens, pad(repeated)[0])
    crop = VideoTokenizer(dim=4, patch_size=4, tubelet_size=2, fit="crop")
    crop.load_state_dict(pad.state_dict())
    tokens, pos = crop(x, timestamps=ts)
    assert pos.grid == (2, 1, 1) and pos.coords[0, :, 0].tolist() == [0.5, 2.5]
    torch.testing.assert_close(tokens, pad(x[:, :, :4])[0])
    with pytest.raises(ValueError, match="fit="):
        VideoTokenizer(dim=4, patch_size=4, tubelet_size=2)(x)


def test_video_bad_inputs_raise():
    tok = VideoTokenizer(dim=4, patch_size=4, tubelet_size=4, num_prefix=1)
    with pytest.raises(ValueError, match="smaller than one patch"):
        tok(torch.randn(1, 3, 2, 4, 4))  # fewer frames than one tubelet
    with pytest.raises(ValueError, match="timestamps"):
        tok(torch.randn(1, 3, 4, 4, 4), timestamps=torch.zeros(1, 3))
    with pytest.raises(ValueError):
        tok(torch.randn(1, 4, 4, 4))
    tokens, pos = tok(torch.randn(2, 3, 8, 4, 8), timestamps=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]))
    assert tokens.shape == (2, 1 + 4, 4) and pos.prefix == 1 and pos.coords[0, 1:, 0].tolist() == [1.5, 1.5, 5.5, 5.5]


# --------------------------------------------------------------------------- points
def _fps_reference(pts: list[list[float]], n: int, start: int, valid: list[bool]) -> list[int]:
    """Textbook FPS, one point at a time: next = the real point farthest from the chosen set (first on ties)."""
    real = [i for i in range(len(pts)) if valid[i]]
    mind = {i: math.inf for i in real}
    chosen = [start]
    for _ in range(n - 1):
        cur = pts[chosen[-1]]
        for i in real:
            mind[i] = min(mind[i], sum((pts[i][a] - cur[a]) ** 2 for a in range(len(cur))))
        chosen.append(max(real, key=lambda i: (mind[i], -i)))
    return chosen


def test_fps_matches_the_reference_loop():
    g = torch.Generator().manual_seed(1)
    B, P, G = 3, 40, 12
    xyz = torch.randn(B, P, 3, generator=g, dtype=torch.float64)
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, 25:] = False  # padded cloud
    valid[2, 8:] = False  # fewer real points than centres: real points repeat
    valid[2, 0] = False  # and the first point is padding
    start = torch.tensor([5, 0, 3])
    got = farthest_point_sample(xyz, G, valid=valid, start=start)
    for b in range(B):
        ref = _fps_reference(xyz[b].tolist(), G, int(start[b]), valid[b].tolist())
        assert got[b].tolist() == ref
    default = farthest_point_sample(xyz, G, valid=valid)  # default start: first real point
    assert default[:, 0].tolist() == [0, 0, 1]
    assert farthest_point_sample(xyz[:1], G)[0].tolist() == _fps_reference(xyz[0].tolist(), G, 0, [True] * P)


def test_knn_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    B, P, G, k = 2, 30, 5, 6
    xyz = torch.randn(B, P, 3, generator=g)
    centres = torch.randn(B, G, 3, generator=g)
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, ::3] = False
    got = knn_indices(xyz, centres, k, valid=valid)
    assert got.shape == (B, G, k)
    for b in range(B):
        for j in range(G):
            c = centres[b, j].tolist()
            cand = [(sum((p - q) ** 2 for p, q in zip(xyz[b, i].tolist(), c)), i) for i in range(P) if valid[b, i]]
            assert got[b, j].tolist() == [i for _, i in sorted(cand)[:k]]


def test_point_tokenizer_shapes_positions_and_groups():
    tok = PointTokenizer(dim=16, num_groups=8, group_size=5, hidden=16, num_prefix=1)
    xyz = torch.randn(2, 50, 3)
    tokens, pos = tok(xyz)
    assert tokens.shape == (2, 9, 16) and pos.prefix == 1 and pos.grid is None and pos.valid is None
    assert pos.axes == ("x", "y", "z")
    centre_idx, nbr_idx = tok.group(xyz)
    assert (pos.coords[:, 0] == 0).all()
    torch.testing.assert_close(pos.coords[:, 1:], torch.stack([xyz[b, centre_idx[b]] for b in range(2)]))
    # each centre is its own nearest neighbour, and 'far' starts at the point farthest from the mean
    assert torch.equal(nbr_idx[..., 0], centre_idx)
    far = ((xyz - xyz.mean(1, keepdim=True)) ** 2).sum(-1).argmax(1)
    assert torch.equal(centre_idx[:, 0], far)


def test_point_tokenizer_is_permutation_invariant():
    torch.manual_seed(3)
    tok = PointTokenizer(dim=16, num_groups=10, group_size=6, hidden=16, in_features=2).eval()
    xyz, feats = torch.randn(2, 64, 3), torch.randn(2, 64, 2)
    perm = torch.randperm(64)
    a, pa = tok(xyz, feats)
    b, pb = tok(xyz[:, perm], feats[:, perm])
    torch.testing.assert_close(b, a)  # same groups, found in the same order
    torch.testing.assert_close(pb.coords, pa.coords)
    # and as a set: shuffling the neighbours' order inside the pooling cannot matter either
    torch.testing.assert_close(b.sort(dim=1).values, a.sort(dim=1).values)


def test_point_tokenizer_padding_is_ignored():
    torch.manual_seed(4)
    tok = PointTokenizer(dim=8, num_groups=6, group_size=4, hidden=8).eval()
    real = torch.randn(1, 20, 3)
    padded = torch.cat([real, torch.full((1, 10, 3), 1e3)], dim=1)  # garbage far away
    valid = torch.arange(30)[None] < 20
    ref, ref_pos = tok(real)
    got, pos = tok(padded, valid=valid)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(pos.coords, ref_pos.coords)
    assert pos.valid.all()
    few = torch.arange(30)[None] < 4  # fewer real points than groups and than the group size
    got, pos = tok(padded, valid=few)
    assert pos.valid[0].tolist() == [True] * 4 + [False] * 2
    assert (pos.coords.abs() < 1e3).all() and torch.isfinite(got).all()


def test_point_tokenizer_bad_inputs_raise():
    tok = PointTokenizer(dim=8, num_groups=6, group_size=4, hidden=8)
    with pytest.raises(ValueError, match="at least"):
        tok(torch.randn(1, 5, 3))
    with pytest.raises(ValueError):
        tok(torch.randn(1, 20, 2))
    with pytest.raises(ValueError, match="in_features"):
        tok(torch.randn(1, 20, 3), torch.randn(1, 20, 2))
    with pytest.raises(ValueError):
        farthest_point_sample(torch.randn(1, 5, 3), 6)


# --------------------------------------------------------------------------- gradients
def test_gradients_flow_through_every_tokenizer():
    cases = [
        (ImageTokenizer(dim=8, patch_size=4, num_prefix=1), (torch.randn(2, 3, 8, 12, requires_grad=True),)),
        (
            VideoTokenizer(dim=8, patch_size=4, tubelet_size=2, num_prefix=1),
            (torch.randn(1, 3, 4, 8, 8, requires_grad=True),),
        ),
        (
            PointTokenizer(dim=8, num_groups=4, group_size=4, hidden=8, num_prefix=1),
            (torch.randn(2, 16, 3, requires_grad=True),),
        ),
    ]
    for tok, inputs in cases:
        tokens, _ = tok(*inputs)
        (tokens**2).sum().backward()
        assert inputs[0].grad is not None and inputs[0].grad.abs().sum() > 0, type(tok).__name__
        for name, p in tok.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), f"{type(tok).__name__}.{name}"
    mixed = ImageTokenizer(dim=8, patch_size=4)
    images = [torch.randn(3, 8, 8, requires_grad=True), torch.randn(3, 4, 12, requires_grad=True)]
    mixed(images)[0].sum().backward()
    assert all(im.grad is not None and im.grad.abs().sum() > 0 for im in images)
