"""MRoPE's ``grid`` ids and :func:`merge_grids` against per-block Python loops.

:func:`vlpe.encodings.multimodal.position_ids` builds every block's ids with batched tensor ops (the token layout,
one exclusive ``cumsum``); here the ``grid`` design is checked against the released Qwen2-VL semantics written as a
loop over samples and blocks (text advances the position by one, a block of merged ``(T, H, W)`` gives
``(p + t * stride, p + i, p + j)`` and advances it by ``max((T - 1) * stride, H - 1, W - 1) + 1``), over its
options, output dtypes and padding ids; the checks are exercised on hand-made layouts, one per check.
:func:`merge_grids` (one ``searchsorted`` for both modalities) is checked against a loop that finds every row's
first token by counting the tokens of its modality, on valid and invalid inputs alike (its result must not depend
on the checks).
"""

from __future__ import annotations

import random

import pytest
import torch

from vlpe.encodings import multimodal as mm

MERGE = 2


def random_layout(rng: random.Random, B: int):
    """``B`` samples of text runs and vision blocks: ``(samples, grid (R, 3))``, each sample a list of parts,
    ``int`` (text tokens) or ``(kind, (T, H, W))`` (a block, grid in patches); two blocks of one type always
    have text between them, blocks of different types may touch."""
    samples, grids = [], []
    for _ in range(B):
        parts, last = [rng.randint(0, 3)], None
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice([1, 2])
            T = 1 if kind == 1 else rng.randint(1, 3)
            g = (T, MERGE * rng.randint(1, 3), MERGE * rng.randint(1, 3))
            if parts[-1] == 0 and last == kind:
                parts.append(1)  # a block right after one of its type would be glued to it
            parts.append((kind, g))
            grids.append(g)
            last = kind
            parts.append(rng.choice([0, 0, 1, 2, 3]) if kind == 1 else rng.randint(0, 3))
        samples.append(parts)
    return samples, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)


def encode(samples, rng: random.Random, pad: str | None):
    """``(types (B, S), mask (B, S) or None)``: the samples padded to one length (padding on the given side,
    or text tokens when ``pad`` is None, which then belong to the samples)."""
    rows = []
    for parts in samples:
        types = []
        for p in parts:
            if isinstance(p, int):
                types += [0] * p
            else:
                kind, (T, H, W) = p
                types += [kind] * (T * (H // MERGE) * (W // MERGE))
        rows.append(types)
    S = max(1, max(len(r) for r in rows) + rng.randint(0, 2))
    types = torch.zeros(len(rows), S, dtype=torch.int64)
    mask = torch.zeros(len(rows), S, dtype=torch.int64)
    for b, r in enumerate(rows):
        at = S - len(r) if pad == "left" else 0
        types[b, at:at + len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[b, at:at + len(r)] = 1
    return types, (None if pad is None else mask)


def reference_ids(samples, types, mask, *, stride=1, spatial_reset=False, pad_position=1):
    """The released semantics as a loop over samples, tokens and blocks: ``(ids (3, B, S), deltas (B, 1))`` as
    Python numbers (float: ``pad_position`` may be fractional)."""
    B, S = types.shape
    ids = [[[float(pad_position)] * S for _ in range(B)] for _ in range(3)]
    deltas = []
    for b, parts in enumerate(samples):
        real = [s for s in range(S) if mask is None or mask[b, s]]
        slots = iter(real)
        p = 0
        for part in parts:
            if isinstance(part, int):
                for _ in range(part):
                    s = next(slots)
                    for a in range(3):
                        ids[a][b][s] = p
                    p += 1
                continue
            _, (T, H, W) = part
            H, W = H // MERGE, W // MERGE
            for t in range(T):
                for i in range(H):
                    for j in range(W):
                        s = next(slots)
                        ids[0][b][s] = p + t * stride
                        ids[1][b][s] = i if spatial_reset else p + i
                        ids[2][b][s] = j if spatial_reset else p + j
            p += max((T - 1) * stride, H - 1, W - 1) + 1
        for s in slots:  # trailing text that pads the sample (pad=None)
            for a in range(3):
                ids[a][b][s] = p
            p += 1
        deltas.append([p - len(real)])
    return ids, deltas


def grid_ids(types, grid, mask=None, **options):
    """MRoPE's ``(ids, deltas)``: the ``grid`` design through :func:`position_ids`."""
    return mm.position_ids("mrope", types, grid, attention_mask=mask, **options)


@pytest.mark.parametrize("pad", [None, "left", "right"])
def test_grid_ids_equal_a_per_block_loop(pad):
    rng = random.Random({None: 0, "left": 1, "right": 2}[pad])
    for trial in range(40):
        samples, grid = random_layout(rng, rng.randint(1, 4))
        if grid.shape[0] == 0:
            continue
        types, mask = encode(samples, rng, pad)
        options = [
            dict(),
            dict(spatial_reset=True),
            dict(temporal_stride=rng.choice([2, 3])),
            dict(dtype=rng.choice([torch.float32, torch.float64, torch.int32]), pad_position=rng.choice([0, 1, 7])),
        ]
        for o in options:
            ids, deltas = grid_ids(types, grid, mask, validate=trial % 2 == 0, **o)
            want_ids, want_deltas = reference_ids(samples, types, mask, stride=o.get("temporal_stride", 1),
                                                  spatial_reset=o.get("spatial_reset", False),
                                                  pad_position=o.get("pad_position", 1))
            dtype = o.get("dtype", torch.int64)
            assert ids.dtype == dtype and deltas.dtype == dtype and ids.shape == (3, *types.shape)
            assert ids.is_contiguous() and deltas.shape == (types.shape[0], 1)
            assert torch.equal(ids, torch.tensor(want_ids, dtype=torch.float64).to(dtype)), (samples, o)
            assert torch.equal(deltas, torch.tensor(want_deltas, dtype=torch.float64).to(dtype)), (samples, o)


def test_grid_ids_of_a_one_token_row_and_non_contiguous_types():
    """``S = 1`` (no pair of neighbours to compare) and token types given as a strided view."""
    types = torch.tensor([[1], [0]])
    ids, deltas = grid_ids(types, torch.tensor([[1, 2, 2]]))
    assert ids.tolist() == [[[0], [0]]] * 3 and deltas.tolist() == [[0], [0]]  # both advance by one
    wide = torch.tensor([[0, 9, 1, 9, 1, 9, 0, 9], [2, 9, 2, 9, 0, 9, 0, 9]])
    types = wide[:, ::2]  # (2, 4) with strides (8, 2): [[0, 1, 1, 0], [2, 2, 0, 0]]
    grid = torch.tensor([[1, 2, 4], [2, 2, 2]])
    ids, deltas = grid_ids(types, grid)
    samples = [[1, (1, (1, 2, 4)), 1], [(2, (2, 2, 2)), 2]]
    want_ids, want_deltas = reference_ids(samples, types, None)
    assert ids.tolist() == want_ids and deltas.tolist() == want_deltas


# one layout per check: (what is wrong, types, grid); each must raise a ValueError
TWO = torch.tensor([[1, 2, 4], [1, 2, 2]])  # an image of 2 merged tokens, then one of 1
REFUSED = [
    ("a token type outside 0 .. 2", [[0, 1, 1, 0, 3, 0]], TWO),
    ("a negative token type", [[0, 1, 1, 0, 1, -1]], TWO),
    ("H not divisible by the merge size", [[0, 1, 1, 0, 1, 0]], torch.tensor([[1, 3, 4], [1, 2, 2]])),
    ("a merged size of 0", [[0, 1, 1, 0, 0, 0]], torch.tensor([[1, 2, 4], [0, 2, 2]])),
    ("two blocks of one type glued", [[0, 1, 1, 1, 0]], TWO),
    ("text inside a block", [[0, 1, 0, 1, 0, 1, 0]], TWO),
    ("a block across rows", [[0, 0, 0, 1], [1, 0, 1, 0]], TWO),
    ("a block of two types", [[0, 1, 2, 0, 1, 0]], TWO),
    ("a block's tokens missing", [[0, 1, 1, 0, 0, 0]], TWO),
    ("a token too many", [[0, 1, 1, 0, 1, 1]], TWO),
    ("a grid row too many", [[0, 1, 1, 0, 1, 0]], torch.cat([TWO, TWO[1:]])),
    ("a block of more tokens than the batch", [[0, 1, 1, 0, 1, 0]], torch.tensor([[1, 2, 4], [1, 2, 2 + (1 << 33)]])),
]


@pytest.mark.parametrize("what,types,grid", REFUSED, ids=[r[0] for r in REFUSED])
def test_grid_ids_refuse_each_broken_layout(what, types, grid):
    with pytest.raises(ValueError):
        grid_ids(torch.tensor(types), grid)


def test_grid_ids_take_adjacent_blocks_of_different_types():
    types = torch.tensor([[0, 1, 1, 2, 2, 0], [2, 2, 0, 0, 1, 0]])  # image then video touching; a row starting with one
    grid = torch.tensor([[1, 2, 4], [2, 2, 2], [2, 2, 2], [1, 2, 2]])
    ids, deltas = grid_ids(types, grid)
    samples = [[1, (1, (1, 2, 4)), (2, (2, 2, 2)), 1], [(2, (2, 2, 2)), 2, (1, (1, 2, 2)), 1]]
    want_ids, want_deltas = reference_ids(samples, types, None)
    assert ids.tolist() == want_ids and deltas.tolist() == want_deltas


# --------------------------------------------------------------------------- merge_grids
def reference_merge(types, images, videos, mask, m=MERGE):
    """Every row's first token located by counting the tokens of its modality (a loop), rows ordered by it
    (image rows first on ties); ``(grid (R, 3), kinds (R,))`` as lists."""
    flat = [int(t) if mask is None or mask.reshape(-1)[p] else 0 for p, t in enumerate(types.reshape(-1).tolist())]
    rows = []
    for kind, grid in ((1, images), (2, videos)):
        seen = 0  # tokens of this modality before the row
        for g in ([] if grid is None else grid.reshape(-1, 3).tolist()):
            n = (g[0] // 1) * (g[1] // m) * (g[2] // m)
            count, first = 0, len(flat)
            for p, t in enumerate(flat):
                count += t == kind
                if count > seen:
                    first = p
                    break
            rows.append((first, kind, g))
            seen += n
    given = [k for k, g in ((1, images), (2, videos)) if g is not None and g.numel()]
    if len(given) < 2:
        return [g for _, _, g in rows], [k for _, k, _ in rows]
    rows = sorted(rows, key=lambda r: (r[0], r[1]))  # stable: image rows were listed first
    return [g for _, _, g in rows], [k for _, k, _ in rows]


def test_merge_grids_equals_a_counting_loop_on_any_input():
    rng = random.Random(3)
    for _ in range(300):
        B, S = rng.randint(1, 3), rng.randint(1, 12)
        values = [0, 0, 1, 2] + ([3, -1] if rng.random() < 0.2 else [])  # invalid types too
        types = torch.tensor([[rng.choice(values) for _ in range(S)] for _ in range(B)])

        def grids():
            if rng.random() < 0.15:
                return None
            k = rng.randint(0, 3)
            g = torch.tensor([[rng.randint(0, 3), 2 * rng.randint(0, 2) + rng.choice([0, 0, 1]), 2 * rng.randint(0, 2)]
                              for _ in range(k)], dtype=torch.int64).reshape(k, 3)
            if k and rng.random() < 0.05:
                g[rng.randrange(k), rng.randrange(3)] = -2  # a negative value
            return g.to(torch.int32) if rng.random() < 0.2 else g

        images, videos = grids(), grids()
        mask = torch.randint(0, 2, (B, S)) if rng.random() < 0.4 else None
        grid, kinds = mm.merge_grids(types, images, videos, attention_mask=mask)
        want_grid, want_kinds = reference_merge(types, images, videos, mask)
        assert grid.dtype == torch.int64 and kinds.dtype == torch.int64
        assert grid.tolist() == want_grid and kinds.tolist() == want_kinds, (types, images, videos, mask)
