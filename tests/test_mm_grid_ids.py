"""The fused ``grid`` path (:func:`vlpe.encodings.multimodal.grid_ids.grid_position_ids`) against the general
path (``token_layout`` -> design -> checks -> assembly) on random batches and random corruptions of them: for
every input the fused path either gives the general path's ids and deltas exactly or declines (None), and it
declines exactly where the general path raises. Every test runs twice: on the C kernel (``grid_ids.c``, whose own
answer is checked as well, so that a decline hidden by the tensor path behind it fails) and on the tensor path."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_mm_helpers import batch, grid_ids_path, native_direct, tokens

from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal.grid_ids import grid_position_ids


#: MRoPE on the grid design without its fused path: every call takes the general path
GENERAL = mm.Variant(dataclasses.replace(mm.DESIGNS["grid"], fused=None), mm.VARIANTS["mrope"].allocation)


def general(types, grid, mask, **options):
    """The general path's ``(ids, deltas)``, or the ValueError it raises."""
    try:
        return mm.position_ids(GENERAL, types, grid, attention_mask=mask, **options)
    except ValueError as e:
        return e


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


@pytest.fixture(params=["native", "tensor"])
def path(request):
    with grid_ids_path(request.param):
        yield request.param


def check(types, mask, grid, path, **options):
    ref = general(types, grid, mask, **options)
    fused = grid_position_ids(types, grid, mask, spatial_reset=options.get("spatial_reset", False))
    direct = native_direct(types, grid, mask, **options) if path == "native" else None
    if isinstance(ref, ValueError):
        assert fused is None, f"the general path raises ({ref}) but the fused path gave ids"
        assert direct is None, f"the general path raises ({ref}) but the C kernel gave ids"
        return False
    assert fused is not None, "valid input, but the fused path declined"
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
    if path == "native":
        assert direct is not None, "valid input, but the C kernel declined"
        assert torch.equal(direct[0], ref[0]) and torch.equal(direct[1], ref[1])
    return True


@pytest.mark.parametrize("padded", [False, True])
def test_fused_path_equals_the_general_path_on_random_batches(padded, path):
    rng = random.Random(0)
    for _ in range(60):
        samples = [random_sample(rng) for _ in range(rng.randint(1, 3))]
        types, mask, grid = batch(samples, pad=rng.choice(["left", "right"]))
        assert check(types, mask if padded else None, grid, path)  # valid (padding is text when no mask is given)


def test_fused_path_declines_exactly_where_the_general_path_raises(path):
    rng = random.Random(1)
    outcomes = {True: 0, False: 0}
    for _ in range(400):
        samples = [random_sample(rng) for _ in range(rng.randint(1, 3))]
        types, mask, grid = batch(samples, pad="right")
        full = torch.ones_like(mask).bool()
        types = torch.where(mask.bool(), types, 0)  # unpadded rows: padding becomes text
        for _ in range(rng.randint(1, 2)):
            types, _, grid = corrupt(types, mask, grid, rng)
        outcomes[check(types, None, grid, path)] += 1
        if rng.random() < 0.3:
            check(types, full, grid, path)
        if rng.random() < 0.3:  # one padding slot anywhere: inside a block it splits it
            holed = full.clone()
            holed[rng.randrange(holed.shape[0]), rng.randrange(holed.shape[1])] = False
            check(types, holed, grid, path)
    assert outcomes[True] > 20 and outcomes[False] > 150  # both outcomes are exercised


def test_adjacent_blocks_and_blocks_across_rows_are_refused(path):
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
        assert isinstance(general(types, grid, None), ValueError), types
        assert grid_position_ids(types, grid, None) is None, types
        assert native_direct(types, grid) is None, types
    good = torch.tensor([[0, 1, 1, 0, 2, 0]])  # an image, then a 1-token video (types may differ per block)
    assert check(good, None, two, path)


@pytest.mark.parametrize("outer", ["none", "no_grad", "inference_mode"])
def test_outputs_are_ordinary_tensors_that_autograd_and_in_place_ops_accept(outer, path):
    """The fused path runs in inference mode inside; what it returns must still be an ordinary tensor (unless the
    caller is in inference mode itself): ids index a learned table whose gradient is taken (autograd saves the
    index), and callers shift them in place. Inference tensors would raise on both."""
    types, mask, grid = batch([tokens(2, ("img", (1, 4, 4)), 1, ("vid", (2, 2, 4)), 3)], pad="right")
    ctx = {"none": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[outer]
    with ctx():
        ids, deltas = grid_position_ids(types, grid, mask)
    assert ids.is_inference() == deltas.is_inference() == (outer == "inference_mode")
    if outer == "inference_mode":
        return
    table = torch.nn.Embedding(int(ids.max()) + 1, 2)
    table(ids).sum().backward()  # saves ids for backward
    assert table.weight.grad is not None
    ids.add_(1)  # in place, outside inference mode
    deltas.sub_(1)
    ref = general(types, grid, mask)
    assert torch.equal(ids - 1, ref[0]) and torch.equal(deltas + 1, ref[1])
    merged, kinds = mm.merge_grids(types, grid[:1], grid[1:])
    assert not merged.is_inference() and not kinds.is_inference()
