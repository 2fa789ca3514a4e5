"""The inference fast path of ``vlpe.attend`` (per-head SDPA, lattice tables, skipped half-planes) against the
reference path (``fast=False``), which training keeps; and ``Positions.lattice``."""

import pytest
import torch

import vlpe
import vlpe.attention as attention
import vlpe.attention_fast as attention_fast
from vlpe.attention_forms import heads_bias, lattice_table
from vlpe.encodings import HALF_PLANES, build

# (name, options) of every bias encoding and the variants that change which fast path is taken
BIAS_ENCODINGS = [
    ("alibi", {}),
    ("lookhere", {}),  # corners-triangles-none: up/down/left/right half-planes and unmasked heads
    ("lh180", {}),  # halves + diagonals (no axis half-plane)
    ("lh45", {}),
    ("lookhere", {"head_directions": "zerohalves-zerocorners-none"}),  # masked "zero" heads
    ("lookhere", {"head_directions": "corners-triangles-none", "fill_with": "max", "distance": "sqrt"}),
    ("lookhere", {"head_directions": "corners-triangles-none", "fill_with": "zero", "distance": "square"}),
    ("lookhere", {"head_directions": "corners-triangles-center"}),  # centre heads: no lattice table
    ("fire", {}),
    ("fire", {"distance": "euclidean", "normalize": "threshold"}),
    ("irpe", {}),  # contextual, product, keys
    ("irpe", {"mode": "bias", "method": "euclidean", "rpe_on": "qk"}),
    ("irpe", {"mode": "bias", "method": "cross", "shared_head": False}),
    ("irpe", {"mode": "contextual", "method": "quant", "rpe_on": "qk", "shared_head": False}),
]


def _build(name, options, heads=12):
    enc = build(name, dim=8 * heads, num_heads=heads, depth=3, **options).eval()
    with torch.no_grad():  # non-trivial learned tables (iRPE starts at zero)
        for p in enc.parameters():
            if p.dim() > 1 and not p.abs().sum():
                p.normal_(0, 0.5)
    return enc


def _qkv(pos, heads, batch=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, batch, heads, pos.num_tokens, dim, generator=g).unbind(0)


@pytest.fixture(params=[1 << 30, 3000], ids=["one-chunk", "small-chunks"])
def budget(request, monkeypatch):
    """The whole grid in one chunk, or chunks of a few rows (several chunks, truncated keys)."""
    monkeypatch.setattr(attention_fast, "FAST_BIAS_BYTES", request.param)
    return request.param


@pytest.mark.parametrize("name,options", BIAS_ENCODINGS)
@pytest.mark.parametrize("grid,prefix", [((5, 7), 1), ((6, 4), 0), ((3, 8), 2)])
def test_fast_path_equals_the_reference_on_grids(name, options, grid, prefix, budget):
    enc = _build(name, options)
    pos = vlpe.Positions.grid(*grid, prefix=prefix)
    q, k, v = _qkv(pos, enc.num_heads)
    for positions in (pos, pos.with_coords(pos.coords)):  # lattice table, and the per-head builders
        ctx = enc.prepare(positions)
        with torch.no_grad():
            ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=1, fast=False)
            fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=1, fast=True)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,options", [e for e in BIAS_ENCODINGS if e[0] in ("alibi", "fire", "lookhere")])
def test_fast_path_on_continuous_and_padded_positions(name, options, budget):
    enc = _build(name, options)
    g = torch.Generator().manual_seed(1)
    coords = torch.randn(2, 40, 2, generator=g) * 4
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, 30:] = False  # a padded sample: its keys are masked on both paths
    for pos in (vlpe.Positions(coords, prefix=1), vlpe.Positions(coords, prefix=2, valid=valid)):
        q, k, v = _qkv(pos, enc.num_heads)
        ctx = enc.prepare(pos)
        with torch.no_grad():
            ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=2, fast=False)
            fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=2, fast=True)
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_pype_mask_fast_path(budget):
    from vlpe.encodings import multimodal as mm

    types = torch.tensor([[0, 0] + [1] * 16 + [0, 0, 0] + [1] * 4 + [0]])
    grid = torch.tensor([[1, 8, 8], [1, 4, 4]])
    ids, _ = mm.position_ids("pype", types, grid, depth=3)  # (3, 1, S)
    enc = build("pype", dim=32, num_heads=4, depth=3).eval()
    pos = vlpe.Positions(ids.permute(1, 2, 0).float())
    q, k, v = _qkv(pos, 4)
    ctx = enc.prepare(pos)
    with torch.no_grad():
        for layer in range(3):
            ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, fast=False)
            fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, fast=True)
            torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,options", [e for e in BIAS_ENCODINGS if e[0] != "irpe"])
def test_lattice_tables_are_the_dense_bias(name, options):
    """Every patch pair of ``score`` reads the table at its offset; pairs with prefix tokens are 0; a head's
    half-plane claim holds: every key outside it is masked (exactly zero attention)."""
    enc = _build(name, options)
    pos = vlpe.Positions.grid(5, 6, prefix=2)
    q, k, _ = _qkv(pos, enc.num_heads, batch=1)
    ctx = enc.prepare(pos)
    lat = lattice_table(enc, ctx, 1)
    if name == "lookhere" and options.get("head_directions", "").endswith("center"):
        assert lat is None  # centre heads read the key's absolute position
        return
    dense = enc.score(q, k, ctx, 1)[0]  # (H, N, N)
    P, (h, w) = pos.prefix, pos.grid
    assert lat.table.shape == (enc.num_heads, 2 * h - 1, 2 * w - 1)
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    r, c = r.flatten(), c.flatten()
    dy, dx = r[None, :] - r[:, None], c[None, :] - c[:, None]  # (queries, keys): key minus query
    torch.testing.assert_close(lat.table[:, dy + h - 1, dx + w - 1], dense[:, P:, P:], rtol=1e-6, atol=0)
    assert not dense[:, :P].any() and not dense[:, :, :P].any()
    outside = {"up": dy > 0, "down": dy < 0, "left": dx > 0, "right": dx < 0}
    for head, plane in enumerate(lat.half_planes):
        assert plane is None or plane in HALF_PLANES
        if plane is not None:
            logits = dense[head, P:, P:][outside[plane]] + 1e4  # any realistic logit on top
            assert outside[plane].any() and torch.exp(logits - 1e4).eq(0).all()


def test_lookhere_half_planes_of_the_default_heads():
    enc = _build("lookhere", {})  # corners (up-left, up-right, down-left, down-right), wedges, unmasked heads
    lat = lattice_table(enc, enc.prepare(vlpe.Positions.grid(4, 4)), 0)
    assert lat.half_planes == ("up", "up", "down", "down", "up", "down", "left", "right") + (None,) * 4
    unmasked = _build("lookhere", {"fill_with": "zero"})  # nothing is masked, nothing may be skipped
    assert lattice_table(unmasked, unmasked.prepare(vlpe.Positions.grid(4, 4)), 0).half_planes == (None,) * 12


def test_automatic_choice_keeps_training_on_the_reference_path(monkeypatch):
    enc = _build("lookhere", {})
    pos = vlpe.Positions.grid(6, 6, prefix=1)
    q, k, v = _qkv(pos, 12)
    ctx = enc.prepare(pos)
    calls = []
    real = attention_fast._lattice_attention
    monkeypatch.setattr(attention_fast, "_lattice_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(attention, "FAST_MIN_TOKENS", 10)
    qg = q.clone().requires_grad_(True)
    train = vlpe.attend(qg, k, v, enc=enc, ctx=ctx, layer=0)  # autograd needed: the reference path
    assert not calls
    assert torch.equal(train.detach(), vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=0, fast=False))
    train.sum().backward()
    assert qg.grad is not None
    with torch.no_grad():
        auto = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=0)  # inference, N >= FAST_MIN_TOKENS
    assert calls == [1]
    torch.testing.assert_close(auto, train.detach(), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(attention, "FAST_MIN_TOKENS", 10**6)
    with torch.no_grad():
        vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=0)  # below the threshold: reference path
    assert calls == [1]


def test_an_encoding_may_lower_the_automatic_threshold(monkeypatch):
    """A class's registered ``min_tokens`` (FIRE's fast form) moves the automatic choice for that encoding only."""
    calls = []
    real = attention_fast._lattice_attention
    monkeypatch.setattr(attention_fast, "_lattice_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for name, side, taken in (("fire", 14, 1), ("fire", 12, 0), ("alibi", 14, 0)):
        enc = _build(name, {})
        pos = vlpe.Positions.grid(side, side, prefix=1)
        q, k, v = _qkv(pos, 12)
        calls.clear()
        with torch.no_grad():
            out = vlpe.attend(q, k, v, enc=enc, ctx=enc.prepare(pos), layer=0)
            ref = vlpe.attend(q, k, v, enc=enc, ctx=enc.prepare(pos), layer=0, fast=False)
        assert len(calls) == taken, (name, side)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_encoding_parameters_needing_grad_keep_the_reference_path(monkeypatch):
    enc = build("irpe", dim=96, num_heads=12, depth=3)  # learned tables that require grad
    pos = vlpe.Positions.grid(4, 4, prefix=1)
    q, k, v = _qkv(pos, 12)
    monkeypatch.setattr(attention, "FAST_MIN_TOKENS", 10)
    monkeypatch.setattr(attention, "_fast_attention", lambda *a: pytest.fail("fast path under autograd"))
    out = vlpe.attend(q, k, v, enc=enc, ctx=enc.prepare(pos))
    assert out.requires_grad


def test_fast_true_says_why_it_cannot_run():
    enc = _build("alibi", {})
    pos = vlpe.Positions.grid(3, 3, prefix=1)
    q, k, v = _qkv(pos, 12)
    ctx = enc.prepare(pos)
    with pytest.raises(ValueError, match="inference"):
        vlpe.attend(q.requires_grad_(True), k, v, enc=enc, ctx=ctx, fast=True)
    q = q.detach()
    with torch.no_grad():
        with pytest.raises(ValueError, match="attn_mask"):
            vlpe.attend(q, k, v, enc=enc, ctx=ctx, fast=True, is_causal=True)
        with pytest.raises(ValueError, match="backend"):
            vlpe.attend(q, k, v, enc=enc, ctx=ctx, fast=True, backend="eager")
        with pytest.raises(ValueError, match="fast must be"):
            vlpe.attend(q, k, v, enc=enc, ctx=ctx, fast="yes")
        nope = build("nope", dim=96, num_heads=12)
        torch.testing.assert_close(  # nothing to speed up: plain SDPA either way
            vlpe.attend(q, k, v, enc=nope, ctx=nope.prepare(pos), fast=True),
            vlpe.attend(q, k, v, enc=nope, ctx=nope.prepare(pos), fast=False),
        )


def test_bf16_fast_path_matches_the_reference_in_bf16():
    enc = _build("lookhere", {})
    pos = vlpe.Positions.grid(6, 5, prefix=1)
    q, k, v = (t.bfloat16() for t in _qkv(pos, 12))
    ctx = enc.prepare(pos)
    with torch.no_grad():
        ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, fast=False)
        fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, fast=True)
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_positions_lattice_flag():
    pos = vlpe.Positions.grid(3, 4, prefix=1)
    assert pos.lattice and pos.to("cpu").lattice and vlpe.Positions.video(2, 3, 3).lattice
    assert not pos.with_coords(pos.coords).lattice
    assert not pos.shifted([0.5, 0.5]).lattice
    assert not pos.replace(prefix=1).lattice
    assert not vlpe.Positions(pos.coords, prefix=1, grid=(3, 4)).lattice
    assert not vlpe.Positions.video(2, 3, 3, timestamps=torch.tensor([0.0, 0.7])).lattice


@pytest.mark.parametrize("name", ["fire", "lookhere", "alibi"])
def test_vit_inference_takes_the_lattice_tables(name, monkeypatch):
    """A ViT with its own CLS at 1,025 tokens reaches the lattice tables in inference (its tokenizer's
    positions keep ``lattice`` through the prepended CLS) and gives the reference path's logits."""
    import vlpe.attention_fast as fast_mod
    from models.vit import ViT

    torch.manual_seed(0)
    model = ViT(img_size=32, patch_size=1, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2,
                encoding=name).eval()
    x = torch.randn(2, 1, 32, 32)  # 32 x 32 patches + CLS = 1,025 tokens >= FAST_MIN_TOKENS
    calls = []
    real = fast_mod._lattice_attention
    monkeypatch.setattr(fast_mod, "_lattice_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        out = model(x)
    assert len(calls) == 2  # one per block
    ref = model(x)  # parameters need gradients: the reference path
    torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_widened_qk_fast_path(name):
    """PaPE's widened q/k: v padded to their width on the fast path (SDPA's fused kernel), same output."""
    enc = build(name, dim=96, num_heads=12, depth=2).eval()
    g = torch.Generator().manual_seed(2)
    valid = torch.ones(2, 21, dtype=torch.bool)
    valid[0, 15:] = False
    for pos in (vlpe.Positions.grid(4, 5, prefix=1), vlpe.Positions(torch.randn(2, 21, 2, generator=g), prefix=1,
                                                                       valid=valid)):
        q, k, v = _qkv(pos, 12)
        ctx = enc.prepare(pos)
        with torch.no_grad():
            ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=1, fast=False)
            fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=1, fast=True)
        assert fast.shape == ref.shape == v.shape
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,options", [e for e in BIAS_ENCODINGS if e[0] != "fire"])
def test_score_heads_is_score_head_by_head(name, options):
    """The registered per-head form builds exactly ``score``'s values, one head (or a shared head) at a time."""
    enc = _build(name, options)
    pos = vlpe.Positions.grid(5, 6, prefix=2)
    q, k, _ = _qkv(pos, enc.num_heads)
    ctx = enc.prepare(pos)
    for rows in (slice(0, 1), slice(0, 9), slice(5, 32)):
        qr = q[:, :, rows]
        want = enc.score(qr, k, ctx, 2, rows=rows).expand(2, enc.num_heads, -1, -1)
        build = heads_bias(enc, qr, k, ctx, 2, rows)
        got = torch.cat([build(slice(h, h + 1)).expand(2, 1, -1, -1) for h in range(enc.num_heads)], dim=1)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("options", [o for n, o in BIAS_ENCODINGS if n == "irpe"])
def test_irpe_lattice_tables_are_the_dense_bias(options):
    """iRPE's offset tables: float tables (bias mode) and the bucket table with per-query values (contextual key
    term) give ``score``'s bias for every patch pair, and one bias per head (per query) for prefix pairs."""
    enc = _build("irpe", options)
    pos = vlpe.Positions.grid(5, 6, prefix=2)
    q, k, _ = _qkv(pos, enc.num_heads)
    ctx = enc.prepare(pos)
    lat = lattice_table(enc, ctx, 1)
    if enc.mode == "contextual" and (enc.rpe_on != "k" or enc.method == "cross"):
        assert lat is None  # the query term reads the keys
        return
    dense = enc.score(q, k, ctx, 1).expand(2, enc.num_heads, -1, -1)  # (B, H, N, N)
    P, (h, w) = pos.prefix, pos.grid
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    r, c = r.flatten(), c.flatten()
    at = (r[None, :] - r[:, None] + h - 1, c[None, :] - c[:, None] + w - 1)  # key minus query
    for head in range(enc.num_heads):
        t = lat.table[head if lat.table.shape[0] > 1 else 0]
        if lat.values is None:
            patch = t[at].expand(2, -1, -1)
            pre = (lat.prefix_bias[head if lat.prefix_bias.numel() > 1 else 0]).expand(2, pos.num_tokens, P)
        else:
            vals = lat.values(q[:, head], head)  # (B, N, K)
            patch = torch.gather(vals[:, P:], -1, t[at].expand(2, -1, -1))
            pre = vals[..., lat.prefix_bucket, None].expand(2, pos.num_tokens, P)
        torch.testing.assert_close(patch, dense[:, head, P:, P:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pre, dense[:, head, :, :P], rtol=1e-6, atol=1e-6)
        row = dense[:, head, :P]  # prefix queries: one bias on every key
        assert torch.equal(row, row[..., :1].expand_as(row))
