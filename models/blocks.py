"""Transformer blocks that consult a vlpe encoding, and the encoder stack every backbone shares.

:class:`Encoder` owns the encoding and the blocks and runs the fixed schedule of
:mod:`vlpe.encodings.base`: ``prepare`` once per forward (tables shared by all layers), ``embed``
before block 0, ``rotate``/``widen``/``score``/``values`` inside each attention, ``mix`` after each block.

Tracing (``torch.fx``): the encoding's calls that read positions go through :func:`encoding_context`,
:func:`encoding_embed` and :func:`encoding_mix`, module-level functions that a tracer keeps as single graph nodes
(``autowrap_functions``: :data:`FX_LEAF_FUNCTIONS`, with :func:`readout`), and :class:`vlpe.attention.Attention`
and :class:`DropPath` are leaf modules (:data:`FX_LEAF_MODULES`; the models add their tokenizer). Everything between
them (norms, MLPs, residuals, the loop over blocks) is traced, so each block's output is a node of the graph.
TorchScript cannot compile an :class:`Encoder`: its encoding refuses, saying why
(:data:`vlpe.encodings.base.NOT_SCRIPTABLE`).
"""

from __future__ import annotations

from typing import Any, Collection

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import vlpe
from vlpe.attention import Attention, Backend

__all__ = [
    "Mlp", "DropPath", "LayerScale", "Block", "Encoder", "readout",
    "encoding_context", "encoding_embed", "encoding_mix", "FX_LEAF_FUNCTIONS", "FX_LEAF_MODULES",
]


class Mlp(nn.Module):
    def __init__(self, *, dim: int, hidden: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.dim() - 1))).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class LayerScale(nn.Module):
    def __init__(self, *, dim: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block whose attention consults the encoding."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        layer_scale: float | None = None,
        backend: Backend = "sdpa",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim=dim, num_heads=num_heads, qkv_bias=qkv_bias, backend=backend)
        self.ls1 = LayerScale(dim=dim, init=layer_scale) if layer_scale else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim=dim, hidden=int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim=dim, init=layer_scale) if layer_scale else nn.Identity()
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor, *, enc: vlpe.encodings.Encoding, ctx: vlpe.encodings.Context, layer: int) -> Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x), enc=enc, ctx=ctx, layer=layer)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class Encoder(nn.Module):
    """``depth`` blocks + final norm + the position encoding they share.

    Args:
        encoding / encoding_options: a registered vlpe encoding and its options (``depth`` is filled in).
    """

    def __init__(
        self,
        *,
        dim: int,
        depth: int,
        num_heads: int,
        encoding: str,
        encoding_options: dict[str, Any] | None = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        layer_scale: float | None = None,
        backend: Backend = "sdpa",
    ) -> None:
        super().__init__()
        options = dict(encoding_options or {})
        options.setdefault("depth", depth)
        self.encoding_name = encoding
        self.encoding = vlpe.encodings.build(encoding, dim=dim, num_heads=num_heads, **options)
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            Block(
                dim=dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                drop_path=dpr[i],
                layer_scale=layer_scale,
                backend=backend,
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.grad_checkpointing = False  # recompute each block in backward (activation memory of one block)

    def forward(self, x: Tensor, pos: vlpe.Positions) -> Tensor:
        """Tokens ``(B, N, C)`` at ``pos`` -> normalised tokens ``(B, N, C)``."""
        return self.norm(self.run(x, pos)[0])

    def run(
        self, x: Tensor, pos: vlpe.Positions, *, take: Collection[int] = (), last: int | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Blocks ``0 .. last`` (all by default) without the final norm: the tokens after block ``last``
        ``(B, N, C)`` and, for each index in ``take`` (ascending), the tokens after that block and its ``mix``
        (what the next block reads)."""
        enc = self.encoding
        ctx = encoding_context(enc, pos)  # tables for every layer, built once
        x = encoding_embed(enc, x, ctx)
        stop = len(self.blocks) - 1 if last is None else last
        taken: list[Tensor] = []
        for layer, block in enumerate(self.blocks):
            if layer > stop:
                break
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, enc=enc, ctx=ctx, layer=layer, use_reentrant=False)
            else:
                x = block(x, enc=enc, ctx=ctx, layer=layer)
            x = encoding_mix(enc, x, ctx, layer)
            if layer in take:
                taken.append(x)
        return x, taken

    def no_weight_decay(self) -> set[str]:
        return {f"encoding.{n}" for n in self.encoding.no_weight_decay()}


def encoding_context(enc: vlpe.encodings.Encoding, pos: vlpe.Positions) -> vlpe.encodings.Context:
    """``enc.prepare(pos)``: one graph node under ``torch.fx`` (it reads the positions' Python-level facts)."""
    return enc.prepare(pos)


def encoding_embed(enc: vlpe.encodings.Encoding, x: Tensor, ctx: vlpe.encodings.Context) -> Tensor:
    """``enc.embed(x, ctx)`` on tokens ``(B, N, C)`` where the plan has an ``embed`` (else ``x``): one graph node
    under ``torch.fx``."""
    return enc.embed(x, ctx) if ctx.plan.embed else x


def encoding_mix(enc: vlpe.encodings.Encoding, x: Tensor, ctx: vlpe.encodings.Context, layer: int) -> Tensor:
    """``enc.mix(x, ctx, layer)`` on tokens ``(B, N, C)`` where the plan has a ``mix`` after ``layer`` (else ``x``):
    one graph node under ``torch.fx``."""
    return enc.mix(x, ctx, layer) if ctx.plan[layer].mix else x


def readout(x: Tensor, pos: vlpe.Positions, mode: str) -> Tensor:
    """Sequence feature ``(B, C)``: the first (CLS) token, or the mean of the valid non-prefix tokens."""
    if mode == "cls":
        return x[:, 0]
    if mode != "gap":
        raise ValueError(f"readout must be 'cls' or 'gap', got {mode!r}")
    patches = x[:, pos.prefix :]  # (B, N - P, C)
    if pos.valid is None:
        return patches.mean(dim=1)
    w = pos.valid[:, pos.prefix :].to(patches.dtype).unsqueeze(-1)  # (B, N - P, 1)
    return (patches * w).sum(1) / w.sum(1).clamp_min(1.0)


#: functions a ``torch.fx`` tracer keeps as single nodes (``autowrap_functions``): they read positions
FX_LEAF_FUNCTIONS = (encoding_context, encoding_embed, encoding_mix, readout)
#: modules a ``torch.fx`` tracer keeps as single nodes (``leaf_modules``): attention consults the encoding's plan
#: and context, and DropPath's mask shape reads the input's rank
FX_LEAF_MODULES = (Attention, DropPath)
