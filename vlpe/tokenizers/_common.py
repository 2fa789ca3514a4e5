"""Pieces every tokenizer shares: fitting an input to whole patches and learned prefix tokens."""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor, nn

from ..positions import Positions

__all__ = ["Fit", "FIT_MODES", "patches_along", "to_pair", "PrefixTokens", "prepend_prefix", "check_finite_samples"]

Fit = Literal["raise", "crop", "pad"]
FIT_MODES: tuple[str, ...] = ("raise", "crop", "pad")


def check_finite_samples(samples: Sequence[Tensor], who: str, what: str) -> None:
    """``ValueError`` naming the first sample (of batches ``samples``, each (b, ...)) with a NaN/inf value.

    One reduction and one device-to-host read for all of them: the tokenizers' price for refusing NaN input
    (the encodings and attention downstream read nothing back). Under ``torch.compile`` the reduction is kept
    and checked by ``torch._assert_async`` instead (no host read, no graph break; a ``RuntimeError``).
    """
    ok = torch.cat([torch.isfinite(x).flatten(1).all(1) for x in samples])  # (B,)
    if torch.compiler.is_compiling():
        # under torch.compile the same check stays in the graph as an assert on the device (no host read, no
        # graph break); it raises RuntimeError when the compiled code runs, without naming the sample
        msg = f"{who}: a {what} sample has NaN or infinite values (check_finite=False skips this check)"
        torch._assert_async(ok.all(), msg)
        return
    if bool(ok.all()):
        return
    bad = int((~ok).nonzero()[0, 0])
    raise ValueError(
        f"{who}: {what} sample {bad} has NaN or infinite values; fix or drop it before tokenizing "
        f"(or build with check_finite=False)"
    )


def to_pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """``p`` or ``(ph, pw)`` as a pair of positive ints."""
    pair = (int(value), int(value)) if isinstance(value, int) else tuple(int(v) for v in value)
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(f"{name} must be a positive int or a pair of positive ints, got {value!r}")
    return pair  # type: ignore[return-value]


def check_fit(fit: str) -> str:
    if fit not in FIT_MODES:
        raise ValueError(f"fit must be one of {FIT_MODES}, got {fit!r}")
    return fit


def patches_along(size: int, patch: int, fit: str, *, axis: str, who: str) -> int:
    """Number of whole patches of ``patch`` pixels (frames) along an axis of ``size``, after fitting.

    An input smaller than one patch is always an error (padding it would make a token of mostly padding);
    a size that is not a multiple raises under ``fit='raise'``, drops the remainder under ``'crop'`` and
    rounds up under ``'pad'``.
    """
    if size < patch:
        raise ValueError(
            f"{who}: the input is {size} along {axis}, smaller than one patch ({patch}); inputs must be at "
            f"least one patch along every axis: upsample the input or use a smaller patch size"
        )
    rem = size % patch
    if rem == 0:
        return size // patch
    if fit == "raise":
        raise ValueError(
            f"{who}: {axis} = {size} is not a multiple of the patch size {patch}; resize the input to a multiple, "
            f"or build the tokenizer with fit='crop' (drops the last {rem}) or fit='pad' (adds {patch - rem})"
        )
    return size // patch if fit == "crop" else size // patch + 1


class PrefixTokens(nn.Module):
    """``num`` learned tokens (CLS first, then registers) prepended to a token sequence and its positions."""

    def __init__(self, *, num: int, dim: int) -> None:
        super().__init__()
        if num < 0:
            raise ValueError(f"num_prefix must be >= 0, got {num}")
        self.num = num
        if num:
            self.tokens = nn.Parameter(torch.zeros(1, num, dim))  # (1, P, C)
            nn.init.trunc_normal_(self.tokens, std=0.02)
        else:
            self.register_parameter("tokens", None)

    def forward(self, x: Tensor, pos: Positions) -> tuple[Tensor, Positions]:
        if not self.num:
            return x, pos
        return prepend_prefix(x, pos, self.tokens)

    def extra_repr(self) -> str:
        return f"num={self.num}"


def prepend_prefix(x: Tensor, pos: Positions, tokens: Tensor) -> tuple[Tensor, Positions]:
    """Prepend prefix ``tokens`` (P, C) or (1 | B, P, C) to ``x`` (B, N, C) and describe them in ``pos``.

    The new tokens come first, before any prefix ``pos`` already has; they are real (``valid``) and sit at
    coordinate 0, as :class:`~vlpe.Positions` requires. The grid claim and axis names are kept, and so is
    ``lattice`` (the result is the layout :meth:`Positions.grid_nd` builds with the larger prefix), which is
    what lets a model that adds its own CLS take the lattice tables of the inference fast path.
    """
    if tokens.dim() == 2:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 3 or tokens.shape[-1] != x.shape[-1]:
        raise ValueError(f"prefix tokens must be (P, C) or (B, P, C) with C = {x.shape[-1]}, got {tuple(tokens.shape)}")
    if pos.num_tokens != x.shape[1]:
        raise ValueError(f"positions describe {pos.num_tokens} tokens but x has {x.shape[1]}")
    B, P = x.shape[0], tokens.shape[1]
    x = torch.cat([tokens.to(x.dtype).expand(B, -1, -1), x], dim=1)  # (B, P + N, C)
    coords = torch.cat([pos.coords.new_zeros(pos.batch, P, pos.num_axes), pos.coords], dim=1)  # (B, P + N, A)
    valid = pos.valid
    if valid is not None:
        valid = torch.cat([valid.new_ones(valid.shape[0], P), valid], dim=1)  # (B, P + N)
    lattice = pos.lattice and valid is None
    pos = Positions(coords, prefix=pos.prefix + P, grid=pos.grid, valid=valid, axes=pos.axes)
    object.__setattr__(pos, "lattice", lattice)
    return x, pos
