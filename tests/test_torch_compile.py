"""torch.compile: the ViT-S preset (width 384, 6 heads, depth 12, patch 16) with ``rope``, ``lookhere`` and
``pape``, in eval mode under ``torch.no_grad()`` on a (2, 3, 224, 224) batch, traces into exactly one graph with
no graph break (``torch._dynamo.explain``, the break reasons in the failure message); the tokenizer's NaN check
stays in the compiled graph (a device-side assert, no host read); and the out-of-place RoPE rotation that
compiled code runs equals the eager ``out=`` rotation bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import models.vit as mv
from vlpe.encodings.functional.rope import _rotate, _rotate_functional
from vlpe.tokenizers._common import check_finite_samples


def _reasons(explained) -> str:
    lines = []
    for b in explained.break_reasons:
        where = "; ".join(f"{f.filename}:{f.lineno} {f.name}" for f in b.user_stack[-3:])
        lines.append(f"- {b.reason.splitlines()[0]} (at {where})")
    return "\n".join(lines) or "(no reasons recorded)"


@pytest.mark.parametrize("encoding", ["rope", "lookhere", "pape"])
def test_vit_small_traces_as_one_graph(encoding):
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = mv.vit("small", img_size=224, patch_size=16, encoding=encoding).eval()
        x = torch.randn(2, 3, 224, 224)  # (B, C, H, W)
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(x)
    finally:
        torch._dynamo.reset()
    assert explained.graph_count == 1 and explained.graph_break_count == 0, (
        f"{encoding}: {explained.graph_count} graphs, {explained.graph_break_count} graph breaks:\n"
        f"{_reasons(explained)}"
    )


def test_nan_check_stays_in_the_compiled_graph():
    torch._dynamo.reset()
    try:
        check = torch.compile(check_finite_samples, backend="eager", fullgraph=True)
        check([torch.zeros(2, 3, 4, 4)], "ImageTokenizer", "image")  # finite: passes
        bad = torch.zeros(2, 3, 4, 4)
        bad[1, 0, 2, 2] = float("nan")
        with pytest.raises(RuntimeError, match="NaN or infinite"):
            check([bad], "ImageTokenizer", "image")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("pairs", [32, 16])  # full and partial rotary of a head width of 64
@pytest.mark.parametrize("inverse", [False, True])
def test_compiled_rotation_is_the_eager_rotation(dtype, pairs, inverse):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 10, 64, generator=g).to(dtype)  # (B, H, N, Dh)
    cos = torch.randn(2, 1, 10, pairs, generator=g)  # (B, 1, N, P): shared by the heads
    sin = torch.randn(2, 1, 10, pairs, generator=g)
    dt = torch.promote_types(x.dtype, cos.dtype)
    lead = torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    want = _rotate(x, cos, sin, inverse=inverse)
    got = _rotate_functional(x, cos, sin, inverse=inverse, dt=dt, lead=lead)
    assert got.dtype == want.dtype and torch.equal(got, want)
