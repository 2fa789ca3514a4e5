"""The registries of the encodings' faster forms (``vlpe.attention_forms``): every registered form against the
written form of its bias, and no form left where the attention cannot reach it.

Checked against: each encoding's ``score`` as the reference path of ``vlpe.attend(fast=False)`` uses it (the
written form of the bias). For every encoding class with a registered form and configurations that exercise it,
on random q/k/v with prefix tokens over a square-free grid, a second grid and continuous coordinates, each form's
attention output (the lattice table through the fast path's lattice attention, the per-head builder through its
per-head attention, and the FlexAttention ``score_mod`` / ``block_mask`` through ``flex_attention`` run eagerly,
which on CPU materialises the scores: the compiled CPU kernel is exercised by the slow tests of test_lookhere,
test_fire and test_baselines) equals the reference to 1e-5. The reachability check reads the encoding classes
(the registry's, their MRO and every ``Encoding`` subclass under ``vlpe.encodings``) and, with ``ast``, the
source of every module under ``vlpe/encodings/``; a throwaway subclass shows it fails on an unregistered form.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

import vlpe
import vlpe.attention_fast as attention_fast
from vlpe.attention_forms import FAST_FORMS, FLEX_FORMS, FORM_NAMES, fast_form, fast_form_of, flex_mods, forms_of
from vlpe.attention_forms import heads_bias, lattice_table
from vlpe.encodings import Encoding, available, build, get
from vlpe.encodings.alibi import ALiBi

ROOT = Path(__file__).resolve().parents[1]

#: configurations per registered encoding class: the classes' own examples plus the variants that change a form
EXTRA = {
    "lookhere": [{"head_directions": "corners-triangles-none"}, {"head_directions": "corners-triangles-center"},
                 {"head_directions": "corners-triangles-none", "fill_with": "max", "distance": "sqrt"},
                 {"head_directions": "zerohalves-zerocorners-none", "fill_with": "zero", "distance": "square"}],
    "fire": [{"distance": "euclidean", "normalize": "threshold"}],
    "irpe": [{"mode": "bias", "method": "euclidean", "rpe_on": "qk"},
             {"mode": "bias", "method": "cross", "shared_head": False},
             {"mode": "contextual", "method": "quant", "rpe_on": "qk", "shared_head": False}],
    "pype": [{"mask": True}],
}
HEADS = 12


def _configs() -> list[tuple[str, dict]]:
    out = []
    for name in available():
        cls = get(name)
        if name in ("lh90", "lh180", "lh45") or fast_form_of(cls) is None:
            continue  # presets: the class and forms of lookhere
        for opts in list(cls.examples()) + EXTRA.get(name, []):
            if name == "rpe2d" and not forms_of(get(opts["base"])):
                continue  # the bases without forms (rotations, embeddings) have no score
            out.append((name, dict(opts)))
    return out


CONFIGS = _configs()


def _build(name: str, options: dict) -> Encoding:
    facts = {"depth": 3} if name == "pype" else {"depth": 3, "num_axes": 2}
    enc = build(name, dim=8 * HEADS, num_heads=HEADS, **facts, **options).eval()
    with torch.no_grad():  # non-trivial learned tables (iRPE starts at zero)
        for p in enc.parameters():
            if p.dim() > 1 and not p.abs().sum():
                p.normal_(0, 0.5)
    return enc


def _positions(name: str, grid: tuple[int, int], prefix: int) -> list[vlpe.Positions]:
    if name == "pype":  # one axis per layer: its ring positions of text + one merged image
        from vlpe.encodings import multimodal as mm

        types = torch.tensor([[0] * (prefix + 1) + [1] * (grid[0] * grid[1]) + [0]])  # merged 2 x 2
        ids, _ = mm.position_ids("pype", types, torch.tensor([[1, 2 * grid[0], 2 * grid[1]]]), depth=3)
        return [vlpe.Positions(ids.permute(1, 2, 0).float())]
    pos = vlpe.Positions.grid(*grid, prefix=prefix)
    g = torch.Generator().manual_seed(sum(grid) + prefix)
    moved = pos.with_coords(pos.coords + 0.3 * torch.randn(pos.coords.shape, generator=g))  # continuous
    return [pos, moved]


def _entering(enc, ctx, layer, q, k):
    """q, k as they enter the bias (the plan's rotation and widening first, as ``attend`` does)."""
    step = ctx.plan[layer]
    if step.rotate:
        q, k = enc.rotate(q, k, ctx, layer)
    if step.widen:
        q, k = enc.widen(q, k, ctx, layer)
    return q, k


@pytest.fixture(params=[1 << 30, 3000], ids=["one-chunk", "small-chunks"])
def budget(request, monkeypatch):
    """The whole grid in one chunk, or chunks of a few rows (several chunks, truncated keys)."""
    monkeypatch.setattr(attention_fast, "FAST_BIAS_BYTES", request.param)
    return request.param


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
@pytest.mark.parametrize("grid,prefix", [((5, 7), 1), ((6, 4), 2)])
def test_every_registered_form_is_the_written_bias(name, options, grid, prefix, budget):
    enc = _build(name, options)
    form = fast_form_of(enc)
    layer = 1
    for pos in _positions(name, grid, prefix):
        ctx = enc.prepare(pos)
        step = ctx.plan[layer]
        registered = forms_of(enc) if step.score else frozenset()
        assert set(step.forms) == registered  # the plan says what the registry has, nothing else
        g = torch.Generator().manual_seed(7)
        q, k, v = torch.randn(3, 2, HEADS, pos.num_tokens, 8, generator=g).unbind(0)  # (B, H, N, Dh)
        scale = q.shape[-1] ** -0.5
        with torch.no_grad():
            ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, fast=False)  # (B, H, N, Dh)
            qe, ke = _entering(enc, ctx, layer, q, k)
            checked = []
            if step.lattice_bias:
                lat = lattice_table(enc, ctx, layer)
                if lat is not None:
                    out = attention_fast._lattice_attention(qe, ke, v, lat, pos, scale)
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"lattice: {m}")
                    checked.append("lattice")
            if step.score_heads:
                out = attention_fast._head_attention(qe, ke, v, enc, ctx, layer, scale, None)
                assert out is not None
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"heads: {m}")
                checked.append("heads")
            if step.flex and budget > 1 << 20:  # flex has no chunks: once
                score_mod, block_mask = flex_mods(enc, qe, ke, ctx, layer)
                out = flex_attention(qe, ke, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"flex: {m}")
                checked.append("flex")
            fast = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, fast=True)  # whichever the plan picks
            torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        if form is not None and pos.lattice and step.score:
            assert checked, f"{name} {options}: no form ran"


def test_every_form_is_registered_for_an_encoding_class_that_has_a_score():
    assert {cls.__name__ for cls in FAST_FORMS} >= {"ALiBi", "LookHere", "FIRE", "IRPE", "PyPE", "RPE2D"}
    assert {cls.__name__ for cls in FLEX_FORMS} >= {"ALiBi", "LookHere", "FIRE", "RPE2D"}
    for cls in list(FAST_FORMS) + list(FLEX_FORMS):
        assert issubclass(cls, Encoding)
        declared = cls.__dict__.get("pieces")  # class data (a property answers per instance)
        assert not isinstance(declared, frozenset) or not declared & {"score_heads", "lattice_bias", "flex"}


# --------------------------------------------------------------------------- reachability
def _registered_functions() -> set[int]:
    out = set()
    for form in FAST_FORMS.values():
        out |= {id(f) for f in (form.lattice, form.heads) if f is not None}
    out |= {id(f) for f, _ in FLEX_FORMS.values()}
    return out


def _encoding_classes() -> set[type]:
    """The registry's classes and every ``Encoding`` subclass defined under ``vlpe.encodings`` (with their MRO)."""
    found = {get(name) for name in available()}
    todo = [Encoding]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("vlpe.encodings") and sub not in found:
                found.add(sub)
            todo.append(sub)
    return {c for cls in found for c in cls.__mro__ if isinstance(c, type) and issubclass(c, Encoding)}


def unreached_attributes(classes) -> list[str]:
    """Form-named attributes of encoding classes (or their MRO) that no registry holds."""
    reached = _registered_functions()
    out = []
    for cls in classes:
        for c in cls.__mro__:
            if not (isinstance(c, type) and issubclass(c, Encoding)):
                continue
            for name in FORM_NAMES:
                attr = c.__dict__.get(name)
                if attr is None:
                    continue
                fn = getattr(attr, "__func__", attr)  # staticmethod / classmethod objects
                fn = inspect.unwrap(fn) if callable(fn) else fn
                if id(fn) not in reached and id(attr) not in reached:
                    out.append(f"{c.__module__}.{c.__qualname__}.{name}")
    return sorted(set(out))


def unreached_definitions(source: str, module: str) -> list[str]:
    """Functions (and lambdas bound to a name) called like a form in ``source``, unless a registry holds them."""
    registered = {(f.__module__, f.__qualname__) for f in _registered_by_name()}
    out = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        for n in names:
            if n in FORM_NAMES and not any(m == module and q.split(".")[-1] == n for m, q in registered):
                out.append(f"{module}:{getattr(node, 'lineno', '?')} {n}")
    return out


def _registered_by_name():
    for form in FAST_FORMS.values():
        yield from (f for f in (form.lattice, form.heads) if f is not None)
    yield from (f for f, _ in FLEX_FORMS.values())


def test_no_encoding_defines_a_form_the_registries_do_not_reach():
    assert unreached_attributes(_encoding_classes()) == []
    found = []
    for path in sorted((ROOT / "vlpe" / "encodings").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found += unreached_definitions(path.read_text(encoding="utf-8"), module)
    assert found == [], f"fast forms defined in vlpe/encodings that no registry reaches: {found}"


def test_the_reachability_check_fails_on_an_unregistered_form():
    class Sneaky(ALiBi):  # a throwaway subclass with a form of its own, in the old style
        def score_heads(self, q, k, ctx, layer, rows):
            return lambda heads: None

        def flex(self, q, k, ctx, layer):
            return None, None

    assert unreached_attributes([Sneaky]) == [f"{__name__}.{Sneaky.__qualname__}.flex",
                                              f"{__name__}.{Sneaky.__qualname__}.score_heads"]
    assert "lattice_bias" in forms_of(Sneaky) and "score_heads" in forms_of(Sneaky)  # the parent's, inherited
    try:
        fast_form(Sneaky, "heads")(Sneaky.score_heads)  # registered: attention reaches it
        assert unreached_attributes([Sneaky]) == [f"{__name__}.{Sneaky.__qualname__}.flex"]
    finally:
        FAST_FORMS.pop(Sneaky, None)
    source = "class X:\n    def lattice_bias(self, ctx, layer):\n        return None\n\ndef g():\n    def score_mod(s, b, h, q, k):\n        return s\n    return score_mod\n"
    assert [d.split()[-1] for d in unreached_definitions(source, "vlpe.encodings.x")] == ["lattice_bias", "score_mod"]
