"""Designs, allocations and variants carry their facts as data: no module of ``vlpe`` compares a design, variant or
encoding name outside the module that defines it, every variant is named once, and the facts each design and
allocation declares (axes, layer dependence, mask, split frames, per-head tables, ...) agree with what
the ids, maps, tables and encodings do."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest
import torch
from test_mm_helpers import batch, tokens

import vlpe
from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal import allocations, designs, variants

ROOT = pathlib.Path(vlpe.__file__).resolve().parent
DESIGN_OPTIONS = {"depth": 3}  # the option a layer-dependent design's axis count is read from, kept small


def _one_axis() -> str:
    """An allocation every design pairs with (it reads one axis; layer-dependent designs need one)."""
    return next(name for name, a in mm.ALLOCATIONS.items() if a.one_axis)


def _options(design: designs.Design) -> dict:
    return {k: v for k, v in DESIGN_OPTIONS.items() if k in design.defaults}


def _mixed_batch():
    """Two rows: text, an image, text, a 3-frame video, text / text, a video of 2 frames, padding on the left."""
    return batch([tokens(2, ("img", (1, 4, 6)), 3, ("vid", (3, 4, 4)), 2), tokens(1, ("vid", (2, 6, 4)), 4)])


# --------------------------------------------------------------------------- no name comparisons
def _owners() -> dict[str, set[pathlib.Path]]:
    """Every registered design, variant and encoding name -> the modules allowed to compare it: the module that
    defines it, for a name of several kinds (``pype`` is a design, a variant and an encoding) the modules that
    define it as every one of them (none)."""
    kinds = [
        {name: pathlib.Path(designs.__file__).resolve() for name in mm.DESIGNS},
        {name: pathlib.Path(variants.__file__).resolve() for name in mm.VARIANTS},
        {name: pathlib.Path(sys.modules[vlpe.encodings.get(name).__module__].__file__).resolve()
         for name in vlpe.encodings.available()},
    ]
    owners: dict[str, set[pathlib.Path]] = {}
    for kind in kinds:
        for name, home in kind.items():
            owners[name] = owners[name] & {home} if name in owners else {home}
    return owners


def _strings(node: ast.AST) -> list[str]:
    """The string constants of one side of a comparison (a constant, or a tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _reads_allocation(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "allocation") or (
        isinstance(node, ast.Name) and node.id == "allocation"
    )


def test_no_module_compares_a_design_variant_or_encoding_name():
    owners = _owners()
    alloc_home = pathlib.Path(allocations.__file__).resolve()
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for name in (s for side in sides for s in _strings(side)):
                if name in owners and path.resolve() not in owners[name]:
                    hits.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} compares {name!r}")
                if name in mm.ALLOCATIONS and path.resolve() != alloc_home and any(map(_reads_allocation, sides)):
                    hits.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} compares allocation {name!r}")
    assert not hits, "query the declared fact instead of the name:\n" + "\n".join(hits)


def _design_slots(tree: ast.AST) -> set[int]:
    """Constants that name a design, not a variant (``Design(name=...)``, ``Variant(design, ...)``): several designs
    share their name with the preset that uses them."""
    slots = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("Design", "Variant"):
            slots |= {id(k.value) for k in n.keywords if k.arg in ("name", "design") and n.func.id == "Design"}
            slots |= {id(k.value) for k in n.keywords if k.arg == "design"}
            if n.func.id == "Variant" and n.args:
                slots.add(id(n.args[0]))
    return slots


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(n.body[0].value) for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }


def test_every_variant_is_named_once():
    """A preset's name is written once where it is defined and at most once elsewhere (its encoding's view)."""
    counts: dict[tuple[str, pathlib.Path], int] = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _docstrings(tree) | _design_slots(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in mm.VARIANTS and id(n) not in skip:
                counts[n.value, path.resolve()] = counts.get((n.value, path.resolve()), 0) + 1
    home = pathlib.Path(variants.__file__).resolve()
    for name in mm.VARIANTS:
        assert counts.get((name, home)) == 1, name
        assert mm.VARIANTS[name].name == name
    assert all(c == 1 for c in counts.values()), {f"{p.name}:{k}": c for (k, p), c in counts.items() if c > 1}


# --------------------------------------------------------------------------- design facts
@pytest.mark.parametrize("name", list(mm.DESIGNS))
def test_design_declares_its_facts(name):
    d = mm.DESIGNS[name]
    assert d.name == name and mm.get_design(name) is d
    assert isinstance(d.axes, int) and d.axes >= 1 or isinstance(d.axes, str) and d.axes in d.defaults
    for fact in (d.split_frames, d.layered, d.needs_mask):
        assert isinstance(fact, bool)
    assert not d.layered or isinstance(d.axes, str), "a layer-dependent design takes its axis count from an option"


@pytest.mark.parametrize("name", list(mm.DESIGNS))
def test_design_axes_and_layers_match_its_ids_and_tables(name):
    d = mm.DESIGNS[name]
    v = mm.Variant(name, _one_axis())
    opts = _options(d)
    types, mask, grid = _mixed_batch()
    ids, deltas = mm.position_ids(v, types, grid, attention_mask=mask, **opts)
    A = d.num_axes(opts)
    assert ids.shape == (A, *types.shape) and v.num_axes(**opts) == A
    assert v.layered == d.layered and v.masked == d.needs_mask
    assert deltas.shape == (types.shape[0], A if d.layered else 1)  # a delta per layer only when layered
    cos, _ = mm.rotary(v, ids, head_dim=16)
    assert cos.shape == ((A,) if d.layered else ()) + (*types.shape, 16)  # one table per layer
    if isinstance(d.axes, str):  # the declared option sets the count
        more = mm.position_ids(v, types, grid, attention_mask=mask, **{d.axes: A + 2})[0]
        assert more.shape[0] == A + 2


@pytest.mark.parametrize("name", list(mm.DESIGNS))
def test_design_mask_fact_matches_its_encoding_and_ids(name):
    d = mm.DESIGNS[name]
    v = mm.Variant(name, _one_axis())
    enc = mm.encoding(v, dim=64, num_heads=2, **_options(d))
    assert ("score" in enc.pieces) == d.needs_mask  # the encoding adds the design's mask exactly when it needs one
    if d.needs_mask:
        types, mask, grid = _mixed_batch()
        ids, _ = mm.position_ids(v, types, grid, attention_mask=mask, **_options(d))
        keep = mm.pype_attention_mask(ids, layer=0, attention_mask=mask)  # (B, 1, S, S)
        causal = torch.ones_like(keep[0, 0]).tril()
        assert (keep[:, 0] & ~causal).any()  # its own mask, not the causal one: some token sees a later one


@pytest.mark.parametrize("name", list(mm.DESIGNS))
def test_split_frames_fact_matches_the_ids(name):
    """A design that splits frames reads a video whose frames are separated by text (Qwen3-VL timestamps) from one
    grid row, with the ids of T one-frame blocks; any other design refuses that row (its blocks are contiguous)."""
    d = mm.DESIGNS[name]
    v = mm.Variant(name, _one_axis())
    types, _, grid = batch([tokens(3, ("frames", (3, 4, 6), 2), 2)])
    frames = grid.repeat_interleave(grid[:, 0], dim=0)  # (T, 3): one row per frame
    frames[:, 0] = 1
    want = mm.position_ids(v, types, frames, **_options(d))
    if d.split_frames:
        got = mm.position_ids(v, types, grid, **_options(d))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        with pytest.raises(ValueError, match="do not match grid_thw"):
            mm.position_ids(v, types, grid, **_options(d))


# --------------------------------------------------------------------------- allocation facts
@pytest.mark.parametrize("name", list(mm.ALLOCATIONS))
def test_allocation_facts_match_its_map_and_tables(name):
    a = mm.ALLOCATIONS[name]
    assert a.name == name and mm.get_allocation(name) is a
    for A in (3, 4):
        if a.axes_read(None, A) not in (None, A) and a.axes is None:
            continue
        amap = mm.allocation_map(name, num_pairs=32, num_axes=A, num_kv_heads=8)
        assert (amap.dim() == 2) == a.per_head and (amap.shape[0] == 8 if a.per_head else True)
        read = a.axes_read(None, A)
        assert (read is None) == a.one_axis
        assert int(amap.max()) + 1 == (1 if a.one_axis else read)  # the axes the map reads, highest included
        assert read == (a.axes if a.axes is not None else None if a.one_axis else A)
    if a.section_sets_axes and not a.one_axis:
        section = (4, 4) if a.per_head else (16, 16)
        amap = mm.allocation_map(name, num_pairs=32, section=section, num_kv_heads=8)
        assert int(amap.max()) + 1 == a.axes_read(section, 3) == 2
    if a.one_axis:
        with pytest.raises(ValueError, match="takes no section"):
            mm.allocation_map(name, num_pairs=32, section=(16, 16))
    v = mm.Variant("grid", name)
    types, _, grid = batch([tokens(2, ("img", (1, 4, 6)), 3)])
    ids, _ = mm.position_ids(v, types, grid)
    cos, _ = mm.rotary(v, ids, head_dim=64, num_kv_heads=8)
    assert cos.shape == ((1, 8) if a.per_head else (1,)) + (types.shape[1], 64)  # per-head tables (B, H_kv, S, D)
    assert v.per_head == a.per_head


def test_layered_design_pairs_only_with_one_axis_allocations():
    for d in mm.DESIGNS.values():
        for a in mm.ALLOCATIONS.values():
            if d.layered and not a.one_axis:
                with pytest.raises(ValueError, match="one position axis per layer"):
                    mm.Variant(d.name, a.name)
            else:
                mm.Variant(d.name, a.name)
