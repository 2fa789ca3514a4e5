"""The model of ``benchmarks/encoding_cost.py``: a ViT-style stack of pre-norm blocks, and the encodings it times.

:class:`Stack` runs an encoding as a model does (``prepare`` once per forward, ``embed`` before block 0, the
attention hooks of ``vlpe.Attention`` in every :class:`Block`, ``mix`` after each block);
:func:`two_d_encodings` lists the registered encodings that take image positions plus the benchmark-only
reference forms (:data:`REFERENCE_FORMS`), and :func:`build_encodings` builds them for a grid, skipping those
that do not build at the size. ``eval/speed.py`` reuses the stack through ``benchmarks/encoding_cost.py``.
"""

from __future__ import annotations

import torch
from torch import nn

import vlpe
from vlpe.encodings import build, construct, get
from benchmarks.reference_forms import PaPENaive

__all__ = ["Block", "Stack", "REFERENCE_FORMS", "two_d_encodings", "build_encodings"]


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with a 4x GELU MLP."""

    def __init__(self, dim: int, num_heads: int, backend: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = vlpe.Attention(dim=dim, num_heads=num_heads, backend=backend)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, enc, ctx, layer):
        x = x + self.attn(self.norm1(x), enc=enc, ctx=ctx, layer=layer)
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, dim: int, num_heads: int, depth: int, backend: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, backend) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, pos, enc):
        ctx = enc.prepare(pos)  # once per forward, shared by all layers
        x = enc.embed(x, ctx) if ctx.plan.embed else x
        for i, blk in enumerate(self.blocks):
            x = blk(x, enc, ctx, i)
            x = enc.mix(x, ctx, i) if ctx.plan[i].mix else x
        return self.norm(x)


#: Benchmark-only formulations, timed beside the registered encodings they are the reference form of.
REFERENCE_FORMS = {"pape_naive": PaPENaive}  # the reference's 3M + 2 channel widening, beside ``pape``


def two_d_encodings() -> list[str]:
    """Registered encodings that take 2-axis (image) positions, plus the reference forms."""
    names = []
    for name in vlpe.encodings.available():
        axes = get(name).supported_axes
        if axes is None or 2 in axes:
            names.append(name)
            names += [ref for ref, cls in REFERENCE_FORMS.items() if cls.name == name]
    return names


def build_encodings(names, *, dim, num_heads, depth, grid, device):
    """``{name: module}``; encodings that cannot be built at this size are reported and skipped."""
    out, skipped = {}, {}
    for name in ["nope"] + [n for n in names if n != "nope"]:
        try:
            opts = {"depth": depth, "num_axes": 2, "grid": tuple(grid)}  # learned tables at the benchmark grid
            if name in REFERENCE_FORMS:
                out[name] = construct(REFERENCE_FORMS[name], dim=dim, num_heads=num_heads, **opts).to(device)
            else:
                out[name] = build(name, dim=dim, num_heads=num_heads, **opts).to(device)
        except (ValueError, TypeError) as e:
            skipped[name] = str(e)
    return out, skipped


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
