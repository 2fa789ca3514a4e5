"""MRoPE's ``grid`` ids (:func:`vlpe.encodings.multimodal.position_ids`) against the released semantics and an
independent check of the layout, on random batches and random corruptions of them: a layout that fits its grid
rows (every block one run of ``T * H/m * W/m`` vision tokens of one type, in order, blocks of one type separated
by text, rows positive and divisible by the merge size) gets the ids of the released loop
(``test_mm_helpers.released_mrope_loop``) exactly, and every other layout raises a ValueError."""

from __future__ import annotations

import random

import pytest
import torch
from test_mm_helpers import MERGE, batch, released_mrope_loop, tokens

from vlpe.encodings import multimodal as mm


def fits(types, mask, grid) -> bool:
    """Whether the vision tokens of ``types`` (real ones, per ``mask``) are the blocks of ``grid`` in order: a loop
    over each row's runs of one non-zero type, each run one or more whole blocks of its type (more than one only
    when the types differ, so a run of one type is exactly one block)."""
    rows = grid.tolist()
    if any(min(r) < 1 or r[1] % MERGE or r[2] % MERGE for r in rows):
        return False
    if ((types < 0) | (types > 2)).any():
        return False
    sizes = [r[0] * (r[1] // MERGE) * (r[2] // MERGE) for r in rows]
    k = 0
    for b in range(types.shape[0]):
        seq = [int(t) if real else 0 for t, real in zip(types[b].tolist(), mask[b].tolist())]  # padding ends a run
        runs, n = [], 0
        while n < len(seq):  # runs of one vision type
            if seq[n] == 0:
                n += 1
                continue
            start = n
            while n < len(seq) and seq[n] == seq[start]:
                n += 1
            runs.append(n - start)
        for length in runs:
            if k >= len(sizes) or sizes[k] != length:
                return False
            k += 1
    return k == len(sizes)


def random_sample(rng: random.Random):
    parts = [rng.randint(0, 3)]
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["img", "vid"])
        T = 1 if kind == "img" else rng.randint(1, 3)
        parts += [(kind, (T, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3))), rng.randint(1, 3)]  # text between blocks
    return tokens(*parts)


def corrupt(types, mask, grid, rng: random.Random):
    """One random damage: a token's type changed, a vision token removed or added, a grid row changed, two
    rows swapped, a row dropped or added, or an odd H / W; the result may or may not still be valid."""
    types, mask, grid = types.clone(), mask.clone(), grid.clone()
    B, S = types.shape
    what = rng.randrange(7)
    b, s = rng.randrange(B), rng.randrange(S)
    if what == 0:
        types[b, s] = rng.choice([0, 1, 2])
    elif what == 1:  # remove one vision token (shift the row left, a text token at the end)
        vis = (types[b] > 0).nonzero().flatten().tolist()
        if vis:
            p = rng.choice(vis)
            types[b, p:-1] = types[b, p + 1:].clone()
            types[b, -1] = 0
    elif what == 2:  # insert a vision token of the neighbour's type (drop the row's last token)
        kind = int(types[b, s]) or rng.choice([1, 2])
        types[b, s + 1:] = types[b, s:-1].clone()
        types[b, s] = kind
    elif what == 3 and grid.shape[0]:
        r, a = rng.randrange(grid.shape[0]), rng.randrange(3)
        step = rng.choice([-1, 1, 2]) if a == 0 else rng.choice([-2, 2, 4])  # T by frames; H, W stay divisible
        grid[r, a] = max(1 if a == 0 else 2, int(grid[r, a]) + step)
    elif what == 4 and grid.shape[0] > 1:
        i, j = rng.sample(range(grid.shape[0]), 2)
        grid[[i, j]] = grid[[j, i]]
    elif what == 5:
        grid = grid[:-1] if rng.random() < 0.5 and grid.shape[0] > 1 else torch.cat([grid, grid[-1:]])
    else:
        r = rng.randrange(grid.shape[0])
        grid[r, 1 + rng.randrange(2)] += 1  # not divisible by the merge size
    return types, mask, grid


def check(types, mask, grid, **options):
    """True if ``position_ids`` gave the released loop's ids, False if it raised; fails on any other outcome."""
    full = torch.ones_like(types) if mask is None else mask
    valid = fits(types, full, grid)
    try:
        ids, deltas = mm.position_ids("mrope", types, grid, attention_mask=mask, **options)
    except ValueError as e:
        assert not valid, f"a layout that fits its grid rows was refused: {e}"
        return False
    assert valid, "a layout that does not fit its grid rows got ids"
    want_ids, want_deltas = released_mrope_loop(types, full, grid)  # padding slots get 1 in both
    assert torch.equal(ids, want_ids) and torch.equal(deltas, want_deltas)
    return True


@pytest.mark.parametrize("padded", [False, True])
def test_ids_equal_the_released_loop_on_random_batches(padded):
    rng = random.Random(0)
    for _ in range(60):
        samples = [random_sample(rng) for _ in range(rng.randint(1, 3))]
        types, mask, grid = batch(samples, pad=rng.choice(["left", "right"]))
        assert check(types, mask if padded else None, grid)  # valid (padding is text when no mask is given)


def test_ids_are_refused_exactly_where_the_layout_does_not_fit_its_grid():
    rng = random.Random(1)
    outcomes = {True: 0, False: 0}
    for _ in range(400):
        samples = [random_sample(rng) for _ in range(rng.randint(1, 3))]
        types, mask, grid = batch(samples, pad="right")
        full = torch.ones_like(mask)
        types = torch.where(mask.bool(), types, 0)  # unpadded rows: padding becomes text
        for _ in range(rng.randint(1, 2)):
            types, _, grid = corrupt(types, mask, grid, rng)
        outcomes[check(types, None, grid)] += 1
        if rng.random() < 0.3:
            check(types, full, grid)
        if rng.random() < 0.3:  # one padding slot anywhere: inside a block it splits it
            holed = full.clone()
            holed[rng.randrange(holed.shape[0]), rng.randrange(holed.shape[1])] = 0
            check(types, holed, grid)
    assert outcomes[True] > 20 and outcomes[False] > 150  # both outcomes are exercised


def test_adjacent_blocks_and_blocks_across_rows_are_refused():
    """Hand-made layouts the checks exist for: two images with no text between them (one run, two blocks), a
    block continued on the next row, a block split by a text token, a token missing and one too many."""
    two = torch.tensor([[1, 2, 4], [1, 2, 2]])  # 2 + 1 merged tokens
    bad = [
        (torch.tensor([[0, 1, 1, 1, 0]]), two),  # adjacent images of one type: 1 run for 2 blocks
        (torch.tensor([[0, 0, 1, 1], [1, 0, 0, 0]]), torch.tensor([[1, 2, 6]])),  # a 3-token image across rows
        (torch.tensor([[0, 1, 0, 1, 0, 1, 0]]), two),  # the first block split by text
        (torch.tensor([[0, 1, 1, 0, 0, 0, 0]]), two),  # the second image missing
        (torch.tensor([[0, 1, 1, 0, 1, 1, 0]]), two),  # one vision token too many
        (torch.tensor([[0, 1, 2, 0, 1, 0]]), two),  # the first block of two types
    ]
    for types, grid in bad:
        assert not fits(types, torch.ones_like(types), grid), types
        with pytest.raises(ValueError):
            mm.position_ids("mrope", types, grid)
    good = torch.tensor([[0, 1, 1, 0, 2, 0]])  # an image, then a 1-token video (types may differ per block)
    assert check(good, None, two)


@pytest.mark.parametrize("outer", ["none", "no_grad", "inference_mode"])
def test_outputs_are_ordinary_tensors_that_autograd_and_in_place_ops_accept(outer):
    """Ids index a learned table whose gradient is taken (autograd saves the index), and callers shift them in
    place: outside inference mode the outputs must be ordinary tensors (inference tensors would raise on both)."""
    types, mask, grid = batch([tokens(2, ("img", (1, 4, 4)), 1, ("vid", (2, 2, 4)), 3)], pad="right")
    ctx = {"none": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[outer]
    with ctx():
        ids, deltas = mm.position_ids("mrope", types, grid, attention_mask=mask)
    assert ids.is_inference() == deltas.is_inference() == (outer == "inference_mode")
    if outer == "inference_mode":
        return
    table = torch.nn.Embedding(int(ids.max()) + 1, 2)
    table(ids).sum().backward()  # saves ids for backward
    assert table.weight.grad is not None
    ids.add_(1)  # in place, outside inference mode
    deltas.sub_(1)
    want_ids, want_deltas = released_mrope_loop(types, mask, grid)
    assert torch.equal(ids - 1, want_ids) and torch.equal(deltas + 1, want_deltas)
    merged, kinds = mm.merge_grids(types, grid[:1], grid[1:])
    assert not merged.is_inference() and not kinds.is_inference()
