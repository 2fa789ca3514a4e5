"""The documented contract (vlpe.encodings.plan) is enough to write an attention block.

``contract_attention`` below uses only ``enc.prepare(pos)``, its plan and the hooks, as the contract in
``vlpe/encodings/plan.py`` describes them, and nothing of ``vlpe.attention``. It must match
``vlpe.attention_logits`` and ``vlpe.attend`` for every registered encoding (each example configuration,
RPE-2D over every base), with key padding. Also: the plan says the truth about the hooks, ``vlpe.attention``
and ``vlpe.encodings.base`` form no import circle, and a ViT forward on Positions does no host sync.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlpe
from vlpe.encodings import get
from vlpe.testing import examples, grid_positions, randomize_parameters

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [(label, enc) for name in vlpe.encodings.available() for label, enc in examples(name)]


def contract_attention(enc, ctx, layer, q, k, v):
    """Attention written from the contract alone: ``(logits (B, H, N, N), output (B, H, N, Dv))``."""
    step = ctx.plan[layer]
    scale = q.shape[-1] ** -0.5  # the q/k width as projected, before widening
    if step.rotate:
        q, k = enc.rotate(q, k, ctx, layer)
    if step.widen:
        q, k = enc.widen(q, k, ctx, layer)
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, N, N)
    if step.score:
        logits = logits + enc.score(q, k, ctx, layer, rows=None).to(logits.dtype)
    valid = ctx.pos.valid  # key padding is the attention's job
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    attn = logits.softmax(dim=-1)
    out = attn @ v  # (B, H, N, Dv)
    if step.values:
        out = out + enc.values(attn, ctx, layer, rows=None).to(out.dtype)
    return logits, out


def _randomise(enc, seed=0):
    return randomize_parameters(enc, seed=seed)


def _padded(enc, batch=2):
    """The encoding's grid positions for a batch whose second sample has its last 3 tokens padded."""
    pos = grid_positions(enc)
    valid = torch.ones(batch, pos.num_tokens, dtype=torch.bool)
    valid[1, -3:] = False
    return pos.replace(coords=pos.coords.expand(batch, -1, -1), valid=valid)


@pytest.mark.parametrize("label,enc", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_block_written_from_the_contract_matches_vlpe(label, enc):
    enc = _randomise(enc).eval()
    pos = _padded(enc)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 2, enc.num_heads, pos.num_tokens, enc.head_dim, generator=g).unbind(0)
    ctx = enc.prepare(pos)
    with torch.no_grad():
        for layer in range(enc.depth):
            logits, out = contract_attention(enc, ctx, layer, q, k, v)
            torch.testing.assert_close(logits, vlpe.attention_logits(enc, q, k, pos, layer=layer), rtol=1e-5, atol=1e-5)
            for backend in ("sdpa", "eager"):
                ref = vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, backend=backend)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{backend}: {m}")


def test_pype_with_its_ring_mask_matches_and_without_it_has_no_score():
    masked = vlpe.encodings.build("pype", dim=64, num_heads=4, depth=2)
    plain = vlpe.encodings.build("pype", dim=64, num_heads=4, depth=2, mask=False)
    pos = vlpe.Positions(torch.arange(12.0)[:, None].expand(12, 2).contiguous())  # one axis per layer
    assert masked.prepare(pos).plan[0].score and not plain.prepare(pos).plan[0].score
    assert plain.pieces == {"rotate"}  # no score hook: the fused SDPA path, no chunked bias
    test_a_block_written_from_the_contract_matches_vlpe("pype[mask]", masked)


@pytest.mark.parametrize("label,enc", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_the_plan_tells_the_truth(label, enc):
    """A piece the plan leaves out is the identity / no term when called anyway."""
    enc = _randomise(enc).eval()
    pos = grid_positions(enc)
    ctx = enc.prepare(pos)
    q, k = torch.randn(2, 1, enc.num_heads, pos.num_tokens, enc.head_dim).unbind(0)
    x = torch.randn(1, pos.num_tokens, enc.dim)
    step = ctx.plan[0]
    assert ctx.plan.pieces == enc.pieces | ({"embed"} if ctx.plan.embed else set())
    if not ctx.plan.embed:
        assert enc.embed(x, ctx) is x
    if not step.mix:
        assert enc.mix(x, ctx, 0) is x
    for hook in ("rotate", "widen"):
        if not getattr(step, hook):
            a, b = getattr(enc, hook)(q, k, ctx, 0)
            assert a is q and b is k, hook
    if not step.score:
        assert enc.score(q, k, ctx, 0) is None
    if not step.values:
        assert enc.values(torch.softmax(q @ k.transpose(-1, -2), -1), ctx, 0) is None


# --------------------------------------------------------------------------- no import circle
def _imports_of(path: Path) -> set[str]:
    """Every module a file imports (at any depth: lazy imports inside functions too), resolved to vlpe names."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_encodings_never_import_the_attention_side():
    offenders = {}
    for path in (ROOT / "vlpe" / "encodings").rglob("*.py"):
        bad = {m for m in _imports_of(path) if m == "vlpe.attention" or m.startswith("vlpe.attention")}
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, offenders


@pytest.mark.parametrize("first,second", [("vlpe.attention", "vlpe.encodings.base"),
                                          ("vlpe.encodings.base", "vlpe.attention")])
def test_fresh_imports_in_either_order(first, second):
    code = f"import {first}; import {second}; import vlpe.attention_flex, vlpe.attention_fast"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- no host sync in a forward
@pytest.mark.parametrize("encoding", ["rope", "lookhere", "alibi", "irpe", "ape", "peg", "pape", "sincos", "rpe2d"])
@pytest.mark.parametrize("training", [False, True])
def test_a_vit_forward_on_positions_reads_nothing_back(encoding, training, monkeypatch):
    from models.vit import vit

    torch.manual_seed(0)
    model = vit("nano", img_size=16, patch_size=4, num_classes=3, encoding=encoding).train(training)
    model.tokenizer.check_finite = False  # the tokenizer's NaN check is its own documented host read
    images = torch.randn(2, 3, 16, 16)
    model(images)  # warm-up: lazily built caches (iRPE buckets) may be built once, outside the check

    def refuse(*args, **kwargs):
        raise AssertionError("host sync during the forward")

    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    with torch.no_grad():
        out = model(images)
    monkeypatch.undo()
    assert out.shape == (2, 3)


def test_positions_validate_is_explicit():
    bad = torch.zeros(2, 5, 2)
    bad[1, 2, 0] = float("nan")
    pos = vlpe.Positions(bad)  # the constructor reads no values
    with pytest.raises(ValueError, match="sample 1"):
        pos.validate()
    assert vlpe.Positions.grid(2, 2, prefix=1).validate().num_tokens == 5
    assert get("rpe2d").bases() and "irpe" not in get("rpe2d").bases()


def test_no_encoding_name_is_compared_outside_the_encodings():
    """Presence as data: library code outside ``vlpe/encodings/`` never branches on an encoding's name."""
    names = set(vlpe.encodings.available())
    root = Path(vlpe.__file__).resolve().parent
    found = []
    for path in root.rglob("*.py"):
        if "encodings" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:  # `x == "ape"`, `name in ("rope", ...)`
                    consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    for c in consts:
                        if isinstance(c, ast.Constant) and c.value in names:
                            found.append(f"{path.relative_to(root)}:{node.lineno} {c.value!r}")
    assert not found, found
