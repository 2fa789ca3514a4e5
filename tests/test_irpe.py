"""iRPE: the piecewise index, the four mappings, and the gather/scatter paths against a slow reference loop.

The reference loop below recomputes every bucket from the paper's definitions (spec encodings-vision.md
section 1) in plain Python and builds the logits bias and the values term pair by pair.
"""

import math

import pytest
import torch

import vlpe
from vlpe.attention import attend
from vlpe.encodings.functional.bias import piecewise_index
from vlpe.testing import check, probe


def build(**opts):
    opts.setdefault("dim", 16)
    opts.setdefault("num_heads", 2)
    opts.setdefault("depth", 2)
    dim, heads = opts.pop("dim"), opts.pop("num_heads")
    return vlpe.encodings.build("irpe", dim=dim, num_heads=heads, **opts)


# --------------------------------------------------------------------------- independent definitions
def ref_g(x: float, ratio: float) -> int:
    """Eq. 18 with alpha:beta:gamma = 1:2:8, truncated to an integer."""
    a, b, c = ratio, 2 * ratio, 8 * ratio
    if abs(x) <= a:
        return round(x)
    v = min(b, round(a + math.log(abs(x) / a) / math.log(c / a) * (b - a)))
    return int(math.copysign(v, x))


def ref_buckets(method: str, dr: int, dc: int, ratio: float) -> list[int]:
    b = int(2 * ratio)
    if method == "euclidean":
        return [ref_g(round(math.hypot(dr, dc)), ratio) + b]
    if method == "quant":
        return [ref_g(dr * dr + dc * dc, ratio) + b]
    if method == "cross":
        return [ref_g(dr, ratio) + b, ref_g(dc, ratio) + b]
    s = 2 * b + 1
    return [(ref_g(dr, ratio) + b) * s + ref_g(dc, ratio) + b]


def ref_pair_buckets(enc, pos, i, j):
    """Buckets of token pair (i, j): every pair touching a prefix token uses the last bucket."""
    p, (h, w) = pos.prefix, pos.grid
    if i < p or j < p:
        return [enc.num_buckets - 1] * enc.parts
    ri, ci = divmod(i - p, w)
    rj, cj = divmod(j - p, w)
    return ref_buckets(enc.method, ri - rj, ci - cj, enc.ratio)


def reference_attention(enc, q, k, v, pos, layer):
    """softmax(q k^T / sqrt(d) + rpe_k + rpe_q) v + sum_j a_ij r_v, every pair in a Python loop."""
    B, H, N, D = q.shape
    scale = D**-0.5
    K = enc.num_buckets
    idx = [[ref_pair_buckets(enc, pos, i, j) for j in range(N)] for i in range(N)]

    def col(table, buckets):  # sum over parts of table[..., p * K + bucket]
        return sum(table[..., p * K + b] for p, b in enumerate(buckets))

    entries = []
    for i in range(N):
        row = []
        for j in range(N):
            e = torch.zeros(B, H, dtype=q.dtype)
            if "k" in enc.rpe_on:
                if enc.mode == "bias":
                    e = e + col(enc.table_k[layer], idx[i][j])  # (H',)
                else:
                    r = col(enc.table_k[layer], idx[i][j])  # (H', D)
                    e = e + (q[:, :, i] * scale * r).sum(-1)
            if "q" in enc.rpe_on:
                if enc.mode == "bias":
                    e = e + col(enc.table_q[layer], idx[j][i])
                else:
                    r = col(enc.table_q[layer], idx[j][i])  # reversed offset
                    e = e + (k[:, :, j] * scale * r).sum(-1)
            row.append(e)
        entries.append(torch.stack(row, -1))
    bias = torch.stack(entries, -2)  # (B, H, N, N)
    attn = ((q @ k.transpose(-2, -1)) * scale + bias).softmax(-1)
    out = attn @ v
    if "v" in enc.rpe_on:
        tv = enc.table_v[layer]  # (H', P*K, D)
        extra = []
        for i in range(N):
            acc = torch.zeros(B, H, D, dtype=q.dtype)
            for j in range(N):
                rv = sum(tv[:, p * K + b] for p, b in enumerate(idx[i][j]))  # (H', D)
                acc = acc + attn[:, :, i, j, None] * rv
            extra.append(acc)
        out = out + torch.stack(extra, -2)
    return out


def randomize(enc, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in (enc.table_q, enc.table_k, enc.table_v):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    return enc


# --------------------------------------------------------------------------- piecewise index
@pytest.mark.parametrize(
    "ratio,expected",
    [  # spec 1.3: |offset| -> index
        (1.9, {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 7: 3, 10: 3, 11: 3, 50: 3}),
        (2.0, {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 6: 3, 9: 3, 10: 4, 40: 4}),
    ],
)
def test_piecewise_index_hand_worked_examples(ratio, expected):
    x = torch.tensor(list(expected), dtype=torch.int64)
    got = piecewise_index(x, ratio, 2 * ratio, 8 * ratio)
    assert got.tolist() == list(expected.values())
    assert piecewise_index(-x, ratio, 2 * ratio, 8 * ratio).tolist() == [-v for v in expected.values()]


def test_piecewise_index_matches_definition_on_a_range():
    for ratio in (1.9, 2.0, 3.3, 20.0):
        x = torch.arange(-300, 301)
        got = piecewise_index(x, ratio, 2 * ratio, 8 * ratio)
        assert got.tolist() == [ref_g(int(v), ratio) for v in x]


# --------------------------------------------------------------------------- bucket maps
@pytest.mark.parametrize(
    "method,ratio,used",
    [("euclidean", 20, 20), ("quant", 33, 51), ("cross", 20, 56), ("product", 1.9, 50)],
)
def test_used_bucket_counts_of_the_released_configs(method, ratio, used):
    """ctx_euc_20, ctx_quant_51, ctx_cross_56, ctx_product_50: buckets a 14x14 grid + CLS touches."""
    enc = build(method=method, ratio=ratio)
    ids = enc.bucket_ids(14, 14, prefix=1)
    assert sum(ids[p].unique().numel() for p in range(enc.parts)) == used


@pytest.mark.parametrize("method", ["euclidean", "quant", "cross", "product"])
def test_bucket_map_matches_reference_and_depends_only_on_the_offset(method):
    enc = build(method=method, ratio=1.9)
    h, w = 4, 6
    pos = vlpe.Positions.grid(h, w, prefix=2)
    ids = enc.bucket_ids(h, w, prefix=2)
    N = pos.num_tokens
    want = torch.tensor([[ref_pair_buckets(enc, pos, i, j) for j in range(N)] for i in range(N)]).permute(2, 0, 1)
    assert torch.equal(ids, want)
    by_offset = {}
    for i in range(2, N):
        for j in range(2, N):
            off = ((i - 2) // w - (j - 2) // w, (i - 2) % w - (j - 2) % w)
            assert by_offset.setdefault(off, ids[:, i, j].tolist()) == ids[:, i, j].tolist()
    patch = ids[:, 2:, 2:]
    b = int(enc.beta)
    if method in ("euclidean", "quant"):
        assert torch.equal(patch, patch.transpose(1, 2))  # undirected: I(i, j) = I(j, i)
    elif method == "product":
        assert torch.equal(patch.transpose(1, 2), (2 * b + 1) ** 2 - 1 - patch)  # point reflection
    else:
        assert torch.equal(patch.transpose(1, 2), 2 * b - patch)


def test_saturation_and_no_bucket_out_of_range_on_a_large_grid():
    enc = build(method="product", ratio=1.9)  # saturates from |offset| = 11 on: bucket +-3
    ids = enc.bucket_ids(30, 30, prefix=1)
    assert int(ids.max()) == enc.num_buckets - 1 and int(ids[:, 1:, 1:].max()) < enc.grid_buckets
    s = 2 * 3 + 1
    # query (0, 0), keys at rows 11..29 of column 0: row offset <= -11 -> g = -3, column offset 0 -> g = 0
    far = ids[0, 1, 1 + 11 * 30 :: 30]
    assert far.unique().tolist() == [(-3 + 3) * s + (0 + 3)]
    for method, ratio in (("euclidean", 1.9), ("quant", 1.9), ("cross", 1.9)):
        e = build(method=method, ratio=ratio)
        m = e.bucket_ids(30, 30, prefix=0)
        assert int(m.max()) <= 2 * int(e.beta) and int(m.min()) >= 0


def test_bucket_cache_gives_the_same_ids_as_a_fresh_build():
    enc = build(method="product", ratio=1.9)
    enc.bucket_ids(20, 20, prefix=1)
    cached = enc.bucket_ids(14, 14, prefix=1)
    fresh = build(method="product", ratio=1.9).bucket_ids(14, 14, prefix=1)
    assert torch.equal(cached, fresh)
    assert enc.bucket_ids(14, 14, prefix=1) is cached  # reused, not rebuilt


def test_rectangular_grids_come_from_positions():
    enc = build(method="product", ratio=1.9)
    a, b = enc.prepare(vlpe.Positions.grid(3, 8, prefix=1)), enc.prepare(vlpe.Positions.grid(8, 3, prefix=1))
    assert not torch.equal(a["ids"], b["ids"])  # same N, different grids: never sqrt(N)
    with pytest.raises(ValueError, match="regular grid"):
        enc.prepare(vlpe.Positions(torch.randn(1, 25, 2)))


# --------------------------------------------------------------------------- attention math
CONFIGS = [
    dict(mode="contextual", method="product", ratio=1.9, rpe_on="qkv", shared_head=True),
    dict(mode="contextual", method="cross", ratio=1.2, rpe_on="qkv", shared_head=False),
    dict(mode="contextual", method="euclidean", ratio=1.9, rpe_on="k", shared_head=False),
    dict(mode="contextual", method="quant", ratio=1.9, rpe_on="v", shared_head=True),
    dict(mode="bias", method="product", ratio=1.9, rpe_on="qk", shared_head=False),
    dict(mode="bias", method="cross", ratio=1.9, rpe_on="q", shared_head=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['mode']}-{c['method']}-{c['rpe_on']}-{c['shared_head']}")
def test_gather_forward_and_backward_match_the_reference_loop(cfg):
    enc = randomize(build(**cfg)).double()
    pos = vlpe.Positions.grid(3, 4, prefix=1)
    g = torch.Generator().manual_seed(1)
    shape = (2, 2, pos.num_tokens, 8)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    layer = 1
    params = [p for p in (enc.table_q, enc.table_k, enc.table_v) if p is not None]

    out = attend(q, k, v, enc=enc, ctx=enc.prepare(pos), layer=layer, backend="eager")
    grads = torch.autograd.grad((out * w).sum(), [q, k, v, *params])
    ref = reference_attention(enc, q, k, v, pos, layer)
    ref_grads = torch.autograd.grad((ref * w).sum(), [q, k, v, *params])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert any(p.abs().sum() > 0 for p in grads[3:])  # the tables do receive gradients


def test_query_chunks_equal_the_whole():
    enc = randomize(build(mode="contextual", method="cross", ratio=1.9, rpe_on="qkv"))
    pos = vlpe.Positions.grid(5, 6, prefix=1)
    q, k, v = torch.randn(3, 1, 2, pos.num_tokens, 8).unbind(0)
    ctx = enc.prepare(pos)
    whole = attend(q, k, v, enc=enc, ctx=ctx, layer=0, backend="eager")
    rows = 2 * 2 * pos.num_tokens * 4 * 7  # 7 query rows per chunk
    chunked = attend(q, k, v, enc=enc, ctx=ctx, layer=0, backend="eager", max_bias_bytes=rows)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    full = enc.score(q, k, ctx, 0)
    torch.testing.assert_close(enc.score(q[:, :, 3:9], k, ctx, 0, rows=slice(3, 9)), full[:, :, 3:9])


@pytest.mark.parametrize("rpe_on", ["k", "qkv"])
def test_zero_init_is_exactly_nope(rpe_on):
    for method in ("euclidean", "quant", "cross", "product"):
        check(build(dim=64, num_heads=4, method=method, rpe_on=rpe_on), "zero_init")
    check(build(dim=64, num_heads=4, mode="bias", rpe_on="qk", shared_head=False), "zero_init")


def test_relative_and_extrapolation_hold_with_trained_tables():
    for cfg in CONFIGS:
        enc = randomize(build(dim=64, num_heads=4, **cfg))
        check(enc, "relative")
        check(enc, "extrapolation")
        pos = vlpe.Positions.grid(3, 4, prefix=1)
        assert not torch.equal(probe(enc, pos), probe(build(dim=64, num_heads=4, **cfg), pos))  # not vacuous


def test_bf16_autocast_stays_close_to_fp32():
    enc = randomize(build(dim=64, num_heads=4, rpe_on="qkv"))
    pos = vlpe.Positions.grid(4, 5, prefix=1)
    q, k, v = torch.randn(3, 1, 4, pos.num_tokens, 16).unbind(0)
    ctx = enc.prepare(pos)
    ref = attend(q, k, v, enc=enc, ctx=ctx, layer=0, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = attend(q, k, v, enc=enc, ctx=ctx, layer=0, backend="eager")
    assert (low.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_bad_options_raise_value_errors():
    with pytest.raises(ValueError, match="bias mode"):
        build(mode="bias", rpe_on="qkv")
    with pytest.raises(ValueError, match="method"):
        build(method="polar")
    with pytest.raises(ValueError, match="rpe_on"):
        build(rpe_on="kv")
    with pytest.raises(ValueError, match="ratio"):
        build(ratio=0)
    with pytest.raises(ValueError, match="axes"):
        build(num_axes=3)


def test_only_configured_hooks_are_used():
    """Without 'v' there is no values term, so attention keeps the SDPA path (no forced eager)."""
    assert build(rpe_on="k").hooks == ("score",)
    assert build(rpe_on="qkv").hooks == ("score", "values")
    assert build(rpe_on="v").hooks == ("values",)
    pos = vlpe.Positions.grid(3, 3, prefix=1)
    assert not build(rpe_on="k").prepare(pos).plan[0].values  # the plan says so: the attention reads it
    assert build(rpe_on="qkv").prepare(pos).plan[1].values
    with pytest.raises(ValueError, match="unknown encoding pieces"):
        vlpe.encodings.plan.LayerPlan.of({"rotation"})
