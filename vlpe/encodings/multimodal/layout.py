"""Vectorised token layout of a multimodal batch: which vision block (and frame) every token belongs to.

Every position design in :mod:`vlpe.encodings.multimodal` starts from the same per-token description of the
batch, computed here without a Python loop over tokens or blocks and without reading tensor values on the
host (only the optional validation reads one boolean):

1. vision tokens are counted in order of appearance over the flattened ``(B, S)`` batch (padding excluded):
   ``cnt = cumsum(vision)``;
2. grid row ``r`` (``n_r = T * H * W`` tokens after spatial merging) starts at vision count ``c_r`` =
   exclusive cumsum of ``n``; ``searchsorted(cnt, c_r + 1)`` is the flat index of its first token and
   ``searchsorted(cnt, c_r + n_r)`` of its last one (``R`` queries, not one per token);
3. a ``cumsum`` of row-start markers gives every token its row, and ``cnt - 1 - c_row`` its raster offset,
   decomposed into ``(tau, i, j)`` by integer division.

A position design then only needs the *start* of each unit (the running position when it begins, an
exclusive ``cumsum`` of per-token increments done by :func:`vlpe.encodings.multimodal.designs.assemble`)
and the token's coordinates inside the unit. A *unit* is a grid row, or a single frame for per-frame
designs (Qwen3-VL, whose frames are separated by timestamp text).

Packed rows (several samples in one row, ``cu_seqlens`` as flash-attention's varlen kernels take them) are
described by :class:`Samples`: every token's sample (one ``searchsorted`` of the token index into the
boundaries) and segment sums (a row ``cumsum`` minus its value at the sample's first token), so running
positions restart at every sample boundary without a loop over samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

__all__ = ["TokenLayout", "token_layout", "Check", "Samples", "packed_samples", "merge_divisor", "grid_position_ids"]


@dataclass
class Check:
    """A deferred data-dependent validity check: ``bad`` is a 0-d bool tensor, ``message`` explains a failure."""

    bad: Tensor
    message: Callable[[], str]


@dataclass
class TokenLayout:
    """Per-token block structure of a batch; per-token tensors are ``(B, S)``, per-row tensors ``(R,)``.

    Attributes:
        valid: real (non-padding) tokens.
        vision: valid image/video tokens.
        row: the grid row (vision block) of each vision token (meaningless elsewhere).
        tau, i, j: frame, row and column of each vision token inside its unit (``tau`` = 0 for per-frame units);
            0 for text tokens.
        index: the token's raster index inside its unit (0 for text tokens).
        grid: ``(R, 3)`` merged grids ``(T, H // m, W // m)`` in order of appearance.
        unit_grid: the grid of one unit: ``grid``, or ``(1, H, W)`` per frame for per-frame units.
        row_type: ``(R,)`` token type (1 image / 2 video) of each grid row.
        row_last: ``(R,)`` flat index (into ``B * S``) of each row's last token (``B * S`` if absent).
        frame_last: per-frame units only: True on the last token of every frame.
        valid_len: ``(B,)`` number of real tokens per row.
        padded: an attention mask was given.
        samples: the packed samples of every row (``cu_seqlens`` given), or None: every row is one sample.
        checks: deferred validity checks (evaluated with one host read by :meth:`validate`).
        coords: ``(3, B, S)`` ``tau, i, j`` stacked (they are its views), or None (per-frame units).
    """

    valid: Tensor
    vision: Tensor
    row: Tensor
    tau: Tensor
    i: Tensor
    j: Tensor
    index: Tensor
    grid: Tensor
    unit_grid: Tensor
    row_type: Tensor
    row_last: Tensor
    frame_last: Tensor | None
    valid_len: Tensor
    padded: bool
    samples: Samples | None = None
    checks: list[Check] = field(default_factory=list)
    coords: Tensor | None = None
    _per_token: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.grid.shape[0]

    @property
    def device(self) -> torch.device:
        return self.valid.device

    @property
    def split_frames(self) -> bool:
        return self.frame_last is not None

    def per_token(self, name: str) -> Tensor:
        """The unit grid's ``"T"``, ``"H"`` or ``"W"`` gathered to every token ``(B, S)`` (cached)."""
        if name not in self._per_token:
            col = {"T": 0, "H": 1, "W": 2}[name]
            self._per_token[name] = self.rows_to_tokens(self.unit_grid[:, col])
        return self._per_token[name]

    @property
    def T(self) -> Tensor:
        return self.per_token("T")

    @property
    def H(self) -> Tensor:
        return self.per_token("H")

    @property
    def W(self) -> Tensor:
        return self.per_token("W")

    def rows_to_tokens(self, values: Tensor) -> Tensor:
        """Per-row values ``(..., R)`` gathered to tokens ``(..., B, S)`` (zeros for a batch without rows)."""
        if self.num_rows == 0:
            return torch.zeros(*values.shape[:-1], *self.row.shape, dtype=values.dtype, device=self.device)
        flat = self.row.reshape(-1)
        if values.dim() == 1:
            return values.index_select(0, flat).view(self.row.shape)  # 1-D index_select: the fast gather
        lead = values.shape[:-1]
        out = values.reshape(-1, values.shape[-1]).T.contiguous().index_select(0, flat)  # (N, prod(lead))
        return out.T.reshape(*lead, *self.row.shape)

    def validate(self) -> None:
        """Raise ``ValueError`` for the first failing check; a single host read when every check passes."""
        if not self.checks:
            return
        if not bool(torch.stack([c.bad.reshape(()) for c in self.checks]).any()):
            return
        for c in self.checks:
            if bool(c.bad):
                raise ValueError(c.message())


@dataclass
class Samples:
    """The samples packed into the rows of a ``(B, S)`` batch, from ``cu_seqlens`` (:func:`packed_samples`).

    Attributes:
        cu: ``(n + 1,)`` int64 sample boundaries over the flattened batch (flat token indices into ``B * S``;
            sample ``k`` holds tokens ``cu[k] <= idx < cu[k + 1]``), clamped into ``[0, B * S]``.
        index: ``(B, S)`` the sample of every token (in ``0 .. n - 1``).
        start: ``(B * S,)`` flat index of the first token of every token's sample.
        checks: deferred validity checks of ``cu_seqlens`` (one host read in :meth:`TokenLayout.validate`).
    """

    cu: Tensor
    index: Tensor
    start: Tensor
    checks: list[Check] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Number of samples ``n`` (empty ones included), from the shape of ``cu``: no host read."""
        return self.cu.shape[0] - 1

    def cumsum(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Segment sums of per-token values ``x (..., B, S)``: ``(exclusive, totals)``.

        ``exclusive (..., B, S)``: the sum of ``x`` over the earlier tokens of the same sample;
        ``totals (..., n)``: the sum over each sample (0 for an empty one). One row ``cumsum`` (samples never
        span rows) minus its value at every sample's first token.
        """
        lead, (B, S) = x.shape[:-2], x.shape[-2:]
        N = B * S
        incl = x.cumsum(-1).reshape(*lead, N)  # (..., N) inclusive, per row
        excl = incl - x.reshape(*lead, N)
        base = excl.index_select(-1, self.start)  # (..., N) the exclusive sum at each token's sample start
        first, last = self.cu[:-1].clamp(max=N - 1), (self.cu[1:] - 1).clamp(min=0)  # (n,) each
        totals = incl.index_select(-1, last) - excl.index_select(-1, first)
        totals = torch.where(self.cu[1:] > self.cu[:-1], totals, torch.zeros_like(totals))
        return (excl - base).reshape(x.shape), totals


def _as_cu(cu_seqlens, B: int, S: int, device: torch.device) -> tuple[Tensor, str]:
    """Flat int64 boundaries ``(n + 1,)`` over ``B * S`` and a description of the accepted form (for messages)."""

    def one(c, what: str) -> Tensor:
        t = torch.as_tensor(c, device=device)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer token offsets, got dtype {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(
                f"{what} must be 1-D cumulative sample lengths starting at 0, e.g. [0, 7, 12], with at least "
                f"2 entries; got shape {tuple(t.shape)}"
            )
        return t.to(torch.int64)

    rows = None
    if isinstance(cu_seqlens, (list, tuple)) and cu_seqlens and not isinstance(cu_seqlens[0], (int, float)):
        if not (isinstance(cu_seqlens[0], Tensor) and cu_seqlens[0].dim() == 0):
            rows = list(cu_seqlens)
    elif isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 2:
        rows = list(cu_seqlens.unbind(0))
    if rows is None:  # one 1-D tensor over the flattened batch
        if B == 1:
            return one(cu_seqlens, "cu_seqlens"), f"from 0 to the row length S = {S}"
        return one(cu_seqlens, "cu_seqlens"), f"1-D over the flattened batch, from 0 to B * S = {B * S}"
    if len(rows) != B:
        raise ValueError(f"cu_seqlens given per row must have one entry per row (B = {B}), got {len(rows)}")
    per_row = [one(r, f"cu_seqlens[{b}]") for b, r in enumerate(rows)]
    offsets = [r[1:] + b * S for b, r in enumerate(per_row)]
    return torch.cat([per_row[0][:1], *offsets]), f"per row, each from 0 to S = {S}"


def packed_samples(cu_seqlens, batch: int, length: int, *, device: torch.device | None = None) -> Samples:
    """The samples packed into the rows of a ``(batch, length)`` batch.

    ``cu_seqlens`` takes two forms (the cumulative sample lengths that flash-attention's varlen kernels take):

    * one 1-D tensor (or list of ints) ``(n + 1,)`` over the *flattened* batch: ``0 = cu[0] <= cu[1] <= ... <=
      cu[n] = batch * length``, and every row boundary ``b * length`` must be one of the entries (a sample never
      spans two rows). For ``batch = 1`` this is the row's own ``cu_seqlens``;
    * one 1-D sequence per row (a list of ``batch`` tensors / lists, or a ``(batch, k + 1)`` tensor), each from
      0 to ``length``; samples are numbered row by row.

    Equal consecutive entries make empty samples. The checks (start at 0, non-decreasing, end at the row
    length, row boundaries) are deferred to :attr:`Samples.checks`; values are clamped, so nothing indexes out
    of range before they run.
    """
    device = torch.device("cpu") if device is None else device
    B, S = int(batch), int(length)
    N = B * S
    cu, form = _as_cu(cu_seqlens, B, S, device)
    raw = cu
    cu = cu.clamp(0, N)
    token = torch.arange(N, device=device)
    index = (torch.searchsorted(cu, token, right=True) - 1).clamp_(0, cu.shape[0] - 2)  # (N,) sample of each token
    start = cu.index_select(0, index)  # (N,)
    checks = [
        Check(raw[0] != 0, lambda: f"cu_seqlens must start at 0 (the first sample's first token); got {raw.tolist()}"),
        Check(
            (raw[1:] < raw[:-1]).any(),
            lambda: f"cu_seqlens must not decrease (cumulative sample lengths, {form}); got {raw.tolist()}",
        ),
        Check(
            raw[-1] != N,
            lambda: f"cu_seqlens must end at the row length ({form}; packed samples must cover every token, "
            f"padding included in a sample); got {raw.tolist()}",
        ),
    ]
    if B > 1:
        row_bounds = torch.arange(1, B, device=device) * S  # (B-1,)
        pos = torch.searchsorted(raw, row_bounds).clamp(max=raw.shape[0] - 1)
        checks.append(
            Check(
                (raw.index_select(0, pos) != row_bounds).any(),
                lambda: f"cu_seqlens over the flattened batch must contain every row boundary "
                f"{row_bounds.tolist()} (a sample may not span two rows of length {S}); got {raw.tolist()}",
            )
        )
    return Samples(cu=cu, index=index.view(B, S), start=start, checks=checks)


_DIVISORS: dict[tuple, Tensor] = {}


def merge_divisor(m: int, device: torch.device) -> Tensor:
    """``(3,)`` int64 ``[1, m, m]`` on ``device``: a grid row divided by it is the merged grid. Kept per
    ``(m, device)``, so no call copies it to the device again."""
    key = (int(m), device.type, device.index)
    if key not in _DIVISORS:
        _DIVISORS[key] = torch.tensor([1, int(m), int(m)], dtype=torch.int64, device=device)
    return _DIVISORS[key]


def _as_grid(grid_thw, device: torch.device) -> Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    grid = torch.as_tensor(grid_thw, device=device)
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        raise ValueError(f"grid_thw must hold integers (patches per axis), got dtype {grid.dtype}")
    grid = grid.to(torch.int64)
    if grid.numel() == 0:
        return grid.reshape(0, 3)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(
            f"grid_thw must have shape (blocks, 3) = (T, H, W) in patches per vision block, got {tuple(grid.shape)}"
        )
    return grid


def _checked_inputs(mm_token_type_ids, attention_mask, spatial_merge_size) -> tuple[Tensor, Tensor | None, int]:
    """The token types ``(B, S)``, the attention mask as a bool ``(B, S)`` (None if not given) and the merge size,
    with the eager shape / dtype checks shared by :func:`token_layout` and :func:`grid_position_ids`."""
    types = torch.as_tensor(mm_token_type_ids)
    if types.dim() != 2:
        raise ValueError(f"mm_token_type_ids must have shape (B, S), got {tuple(types.shape)}")
    if types.is_floating_point() or types.dtype == torch.bool:
        raise ValueError(f"mm_token_type_ids must hold integers 0 (text), 1 (image), 2 (video), got {types.dtype}")
    B, S = types.shape
    m = int(spatial_merge_size)
    if m < 1 or m != spatial_merge_size:
        raise ValueError(f"spatial_merge_size must be a positive integer, got {spatial_merge_size!r}")
    if attention_mask is None:
        return types, None, m
    valid = torch.as_tensor(attention_mask, device=types.device)
    if valid.shape != (B, S):
        raise ValueError(f"attention_mask must have the shape of mm_token_type_ids {(B, S)}, got {tuple(valid.shape)}")
    return types, valid.bool(), m


def token_layout(
    mm_token_type_ids: Tensor,
    grid_thw: Tensor | None,
    attention_mask: Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    split_frames: bool = False,
    cu_seqlens=None,
    checks: bool = True,
) -> TokenLayout:
    """Describe every token of a batch by its vision block, frame and grid cell (see the module docstring).

    Args:
        mm_token_type_ids: ``(B, S)`` 0 text, 1 image, 2 video.
        grid_thw: ``(R, 3)`` grids in patches (before spatial merging), in order of appearance over the
            batch (sample 0's blocks first); None or empty for text-only batches.
        attention_mask: ``(B, S)`` 1 for real tokens, 0 for padding; None when every token is real.
        spatial_merge_size: patches merged per axis into one LLM token (2 in Qwen2/2.5/3-VL).
        split_frames: units are single frames (Qwen3-VL), which may be separated by text (timestamps).
        cu_seqlens: packed rows: the sample boundaries (see :func:`packed_samples` for the accepted forms);
            None: every row is one sample.
        checks: record the structural checks (grid count, divisibility, blocks aligned with the runs of vision
            tokens and inside one sample, the form of ``cu_seqlens``) in ``checks``, evaluated by
            :meth:`TokenLayout.validate`; False skips building them (``position_ids(validate=False)``).

    Per-token work is a few passes over the ``B * S`` tokens (two cumulative sums, one gather of the per-row
    table, the raster decomposition); everything per grid row is done on ``R`` values, and for unpacked
    batches the sample of a token is its batch row (no per-token sample index).
    """
    types, mask, m = _checked_inputs(mm_token_type_ids, attention_mask, spatial_merge_size)
    device = types.device
    B, S = types.shape
    N = B * S
    flat_types = types.reshape(-1).to(torch.int64)  # (N,)
    if mask is None:
        valid = torch.ones(B, S, dtype=torch.bool, device=device)
        vision = types != 0  # (B, S)
        valid_len = torch.full((B,), S, dtype=torch.int64, device=device)
        vt = flat_types  # (N,) type of vision tokens, 0 elsewhere
    else:
        valid = mask
        vision = (types != 0) & valid
        valid_len = valid.sum(-1)
        vt = flat_types * vision.reshape(-1)
    grid = _as_grid(grid_thw, device)
    samples = None if cu_seqlens is None else packed_samples(cu_seqlens, B, S, device=device)
    R = grid.shape[0]
    found: list[Check] = []
    if checks:
        lo, hi = torch.aminmax(types) if N else (types.new_zeros(()), types.new_zeros(()))
        found.append(
            Check(
                (lo < 0) | (hi > 2),
                lambda: "mm_token_type_ids must be 0 (text), 1 (image) or 2 (video); got values "
                f"{sorted(set(types.unique().tolist()) - {0, 1, 2})}",
            )
        )
        if samples is not None:
            found += samples.checks
    if R == 0:
        zeros = torch.zeros(B, S, dtype=torch.int64, device=device)
        if checks:
            n_vis = vision.sum()
            found.append(
                Check(
                    n_vis > 0,
                    lambda: f"mm_token_type_ids mark {int(n_vis)} image/video tokens but grid_thw has no rows; "
                    "pass one (T, H, W) row per vision block in order of appearance",
                )
            )
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return TokenLayout(
            valid=valid, vision=vision, row=zeros, tau=zeros, i=zeros, j=zeros, index=zeros, grid=grid,
            unit_grid=grid, row_type=empty, row_last=empty,
            frame_last=torch.zeros(B, S, dtype=torch.bool, device=device) if split_frames else None,
            valid_len=valid_len, padded=attention_mask is not None, samples=samples, checks=found,
        )

    g = grid // merge_divisor(m, device)  # (R, 3) merged grids (T, H / m, W / m)
    Tm, HWm = g[:, 0], g[:, 1:]  # (R,), (R, 2) merged grid rows, columns
    if checks:

        def bad_rows() -> str:
            bad = ((grid < 1).any(-1) | (grid[:, 1:] % m != 0).any(-1)).nonzero().flatten().tolist()
            return (
                f"grid_thw rows must be positive and H, W divisible by spatial_merge_size={m}; bad rows "
                f"(index: T, H, W): {[(r, tuple(grid[r].tolist())) for r in bad]}"
            )

        found.append(Check((grid < 1).any() | (grid[:, 1:] % m).any(), bad_rows))
    HWc = HWm.clamp(min=1)  # safe divisors (bad rows are reported above)
    hw_row = HWc.prod(-1)  # (R,)
    n_row = g.prod(-1)  # (R,) tokens per block
    end_cnt = n_row.cumsum(0)  # (R,) vision count after each row
    start_cnt = end_cnt - n_row  # (R,) vision count before each row

    flat_vis = vision.reshape(-1)
    cnt = flat_vis.cumsum(0)  # (N,) inclusive vision count (int64)
    if checks:
        n_vis = cnt[-1]
        found.append(
            Check(
                n_vis != end_cnt[-1],
                lambda: f"the token types hold {int(n_vis)} image/video tokens but grid_thw describes "
                f"{int(end_cnt[-1])} (sum of T * (H/{m}) * (W/{m}) over its {R} rows); pass exactly one row per "
                "vision block, in order of appearance over the batch",
            )
        )
    row_first = torch.searchsorted(cnt, start_cnt, right=True)  # (R,) flat index of each row's first token (N if none)
    row_last = torch.searchsorted(cnt, end_cnt)  # (R,) flat index of each row's last token
    marker = torch.zeros(N + 1, dtype=torch.int64, device=device)
    marker.index_fill_(0, row_first[1:], 1)  # starts of rows 1.. (a row of no tokens is a bad grid row)
    row = marker[:N].cumsum(0)  # (N,) row of each vision token (row 0 for the text before it)

    hw_tok = hw_row.index_select(0, row)  # (N,) per-token row data (1-D gathers are the fast ones)
    w_tok = HWc[:, 1].index_select(0, row)
    off = (cnt - (start_cnt + 1).index_select(0, row)).mul_(flat_vis)  # (N,) raster offset in the row, 0 for text
    tau = off // hw_tok
    rem = off - tau * hw_tok
    i = rem // w_tok
    j = rem - i * w_tok

    fi, la = row_first.clamp(max=N - 1), row_last.clamp(max=N - 1)
    row_type = vt.index_select(0, fi)  # (R,)
    if checks:
        if samples is None:  # every row is one sample: the sample of a token is its batch row
            straddles = fi // S != la // S  # (R,)
        else:
            sample_of = samples.index.reshape(-1)  # (N,)
            straddles = sample_of.index_select(0, fi) != sample_of.index_select(0, la)

        def straddling() -> str:
            where = (lambda t: t // S) if samples is None else (lambda t: int(samples.index.reshape(-1)[t]))
            bad = [(r, int(where(fi[r])), int(where(la[r]))) for r in straddles.nonzero().flatten().tolist()]
            return (
                "vision blocks straddle a sample boundary (a block must lie inside one sample: check cu_seqlens "
                f"and that grid_thw lists the blocks in order of appearance); (grid_thw row, first sample, last "
                f"sample): {bad}"
            )

        found.append(Check(straddles.any(), straddling))
        if split_frames:
            # frames of a row may be separated by text: runs of vision tokens start exactly at frame starts
            prev = torch.cat([vt.new_zeros(B, 1), vt.view(B, S)[:, :-1]], dim=1).view(-1)  # type before, 0 at row 0
            if samples is not None:
                prev = prev.masked_fill(samples.start == torch.arange(N, device=device), 0)  # no run across samples
            run_start = flat_vis & (prev != vt)  # (N,)
            misaligned = (flat_vis & ((run_start & (rem != 0)) | ((off == 0) & ~run_start))).any()
            misaligned = misaligned | straddles.any() | (vt.index_select(0, la) != row_type).any()
            what = "every run of vision tokens must start at a frame of its grid row, and a row may not span samples"
        else:
            # one run per row: no text inside it, one token type, and no row of its type right before it in
            # its sample (the counts check has placed every vision token in a row, so a run continuing past a
            # row's ends is the next row's tokens, or vision tokens past the last row)
            typesum = vt.cumsum(0)  # (N,)
            at = typesum.index_select(0, torch.cat([fi, la]))  # (2R,)
            contiguous = row_last - row_first + 1 == n_row
            uniform = at[R:] - at[:R] + row_type == row_type * n_row
            sample = fi // S if samples is None else samples.index.reshape(-1).index_select(0, fi)
            glued = (row_first[1:] == row_last[:-1] + 1) & (row_type[1:] == row_type[:-1]) & (sample[1:] == sample[:-1])
            misaligned = ~(contiguous & uniform & ~straddles).all() | glued.any()
            what = "every vision block must be one run of consecutive image/video tokens matching its grid row"
        found.append(
            Check(
                misaligned,
                lambda: f"the vision blocks in mm_token_type_ids do not match grid_thw: {what} (rows are taken in "
                "order of appearance; blocks may not span samples, and two blocks need a text token between them)",
            )
        )
    shape = (B, S)
    if split_frames:
        frame_last = (flat_vis & (rem == hw_tok - 1)).reshape(shape)
        zeros = torch.zeros(B, S, dtype=torch.int64, device=device)
        unit_grid = torch.cat([torch.ones_like(Tm)[:, None], HWm], dim=1)
        return TokenLayout(
            valid=valid, vision=vision, row=row.reshape(shape), tau=zeros, i=i.reshape(shape), j=j.reshape(shape),
            index=rem.reshape(shape), grid=g, unit_grid=unit_grid, row_type=row_type, row_last=row_last,
            frame_last=frame_last, valid_len=valid_len, padded=attention_mask is not None, samples=samples,
            checks=found,
        )
    coords = torch.stack([tau, i, j]).view(3, B, S)  # one tensor for the designs that add all three
    return TokenLayout(
        valid=valid, vision=vision, row=row.reshape(shape), tau=coords[0], i=coords[1], j=coords[2],
        index=off.reshape(shape), grid=g, unit_grid=g, row_type=row_type, row_last=row_last, frame_last=None,
        valid_len=valid_len, padded=attention_mask is not None, samples=samples, checks=found, coords=coords,
    )


# --------------------------------------------------------------------------- fused grid ids (Qwen2-VL MRoPE)
_CONSTS: dict[tuple, tuple[Tensor, ...]] = {}
_BIG = 1 << 62
#: bounds of the eight quantities :func:`grid_position_ids` checks, in the general path's check order
_LOWER = (0, -_BIG, 1, -_BIG, 0, -_BIG, 0, 0)
_UPPER = (_BIG, 2, _BIG, 0, 0, 0, 0, 0)


def _consts(device: torch.device) -> tuple[Tensor, ...]:
    """The small constant tensors of :func:`grid_position_ids`, kept per device (never copied to it again):
    ``(4, 1)`` zeros, the ``(4, 1)`` weights of a row's own state and of the previous row's in its change, and
    the ``(8,)`` lower and upper bounds of the checked quantities."""
    key = (device.type, device.index)
    if key not in _CONSTS:
        rows = ([[0]] * 4, [[0], [1], [1], [0]], [[1], [-1], [-1], [-1]], _LOWER, _UPPER)
        _CONSTS[key] = tuple(torch.tensor(r, dtype=torch.int64, device=device) for r in rows)
    return _CONSTS[key]


def grid_position_ids(
    mm_token_type_ids: Tensor,
    grid_thw: Tensor | None,
    attention_mask: Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    temporal_stride: float = 1,
    spatial_reset: bool = False,
    pad_position: float = 1,
    dtype: torch.dtype | None = None,
    validate: bool = True,
) -> tuple[Tensor, Tensor] | None:
    """The ``grid`` design's ``(ids (3, B, S), deltas (B, 1))`` in a few fused passes, or None where it does not
    apply (no grid rows, a non-integer stride, ``B * S * stride >= 2**23``; packed rows are not taken here) or
    the inputs fail a check: the caller then takes the general path (:func:`token_layout`, the design, the
    assembly), which raises the check's ValueError; the ids are the general path's, exactly.

    The general path's quantities, with fewer passes over the tokens (small tensors: the cost is the number
    of torch ops, so everything per grid row is done on ``R + 1`` values at once):

    1. one int32 buffer ``(4, B*S + 3)`` of per-token increments (slot 0 the initial values, slot ``p + 1``
       the change after token ``p``): the vision tokens, the text tokens (that advance the position);
    2. ``searchsorted`` of the rows' vision counts in the ``cumsum`` of the first row gives the slot after
       every grid row's last token, where the row's change is scattered (``R + 1`` values): the vision count
       drops by the row's size, the position advances by ``max(T, H, W)``, and the current ``H, W`` change;
    3. one ``cumsum`` of the buffer then holds, for every token, its raster offset in its block (0 on text),
       the running position (up to the value at the sample's start) and its block's ``H`` and ``W``;
    4. ``(tau, i, j)`` from the offset by float32 division (exact: every value is an integer below 2**24).

    With ``validate`` the general path's checks are folded into eight scalars read once: token types in 0..2,
    merged grids >= 1 with ``H, W`` divisible, the vision token count, no block across a row start (the offset
    is 0 at every row start), and blocks = runs (exactly R runs of one vision type start, each at offset 0).
    """
    try:
        stride = float(temporal_stride)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(stride) and stride > 0 and stride.is_integer()):
        return None
    stride = int(stride)
    types, valid, m = _checked_inputs(mm_token_type_ids, attention_mask, spatial_merge_size)
    device = types.device
    B, S = types.shape
    N = B * S
    grid = _as_grid(grid_thw, device)
    R = grid.shape[0]
    if R == 0 or N == 0 or N * stride >= 1 << 23:
        return None
    # (tensor indexing costs more than the small ops here: views are taken by narrow / select / unbind)
    zero, this, prev, lower, upper = _consts(device)
    div = merge_divisor(m, device)
    g = torch.floor_divide(torch.cat([grid, div.view(1, 3)]), div)  # (R + 1, 3) merged, a virtual (1, 1, 1) row last
    gT, gH, gW = g.unbind(1)
    n = g.prod(-1)  # (R + 1,) tokens per row
    if stride == 1:
        adv = g.amax(-1)  # max(T - 1, H - 1, W - 1) + 1
    else:
        adv = torch.maximum(torch.maximum((gT - 1) * stride, gH - 1), gW - 1) + 1
    start = n.cumsum(0) - n  # (R + 1,) vision tokens before each row (start[R]: all of them)
    # buffer rows: 0 position, 1 W, 2 H, 3 offset; change[:, r] = entering row r: position +adv[r - 1], the
    # W and H of row r, offset -n[r - 1] (the vision tokens of row r - 1 are done)
    state = torch.stack([adv, gW, gH, n])  # (4, R + 1)
    before = torch.cat([zero, state.narrow(1, 0, R)], dim=1)  # the previous row's (none for row 0)
    change = torch.addcmul(state * this, before, prev).to(torch.int32)

    flat = types.reshape(-1)
    vis = types.bool() if valid is None else types.bool() & valid  # (B, S) vision tokens
    flat_vis = vis.view(-1)
    buf = torch.zeros(4, N + 3, dtype=torch.int32, device=device)
    b_pos, _, _, b_off = buf.unbind(0)
    if valid is None:  # text advances the position by one
        torch.logical_not(flat_vis, out=b_pos.narrow(0, 1, N))
    else:
        torch.logical_xor(valid.view(-1), flat_vis, out=b_pos.narrow(0, 1, N))
    b_off.narrow(0, 1, N).copy_(flat_vis)
    cnt = b_off.narrow(0, 0, N + 2).cumsum(0)  # (N + 2,) vision tokens before each slot
    slots = torch.searchsorted(cnt, start)  # (R + 1,) slot 0, then the slot after each row's last token (N + 2: none)
    buf.scatter_add_(1, slots.expand(4, -1), change)
    acc = buf.cumsum_(1)  # (4, N + 3) in place: token p's values at column p, the end at column N

    if validate:
        lo, hi = torch.aminmax(types)
        vt = flat if valid is None else flat * flat_vis
        starts = torch.empty(N, dtype=torch.bool, device=device)  # a run of one vision type starts here
        torch.ne(vt.narrow(0, 1, N - 1), vt.narrow(0, 0, N - 1), out=starts.narrow(0, 1, N - 1))
        starts.as_strided((B,), (S,)).fill_(True)  # at every row start
        run = starts & flat_vis
        off = b_off.narrow(0, 0, N)  # (acc's row 3)
        found = torch.stack([
            lo, hi,  # token types in 0 .. 2
            g.amin(), torch.remainder(grid, div).amax(),  # merged grids >= 1, H and W divisible by m
            cnt.select(0, N + 1) - start.select(0, R),  # vision tokens = sum of T (H / m) (W / m)
            acc.as_strided((B,), (S,), 3 * (N + 3)).amax(),  # no block spans a row start: the offset there is 0
            run.sum() - R, (run * off).sum(),  # blocks = runs: R runs of one type, each at offset 0
        ])
        if not torch.equal(found.clamp(lower, upper), found):
            return None  # the general path raises the ValueError of the first failing check

    accf = acc.float()
    pos, W, H, off = accf.narrow(1, 0, N + 1).unbind(0)  # position + the sample start's, W, H, offset in the block
    line = torch.div(off, W).floor_()  # the block's line: tau * H + i
    torch.addcmul(off, line, W, value=-1, out=off)  # j (over the offset)
    torch.div(line, H, out=W).floor_()  # tau (over W)
    torch.addcmul(line, W, H, value=-1, out=H)  # i (over H)
    coords = accf.narrow(0, 1, 3).narrow(1, 0, N).view(3, B, S)  # (tau, i, j)
    if stride != 1:
        W.mul_(stride)
    at_start = accf.as_strided((B + 1,), (S,))  # (B + 1,) position at every row start, and after the last token
    running = pos.narrow(0, 0, N).view(B, S) - at_start.narrow(0, 0, B).view(B, 1)
    if spatial_reset:  # h, w local to the block; text carries the running position on every axis
        coords.select(0, 0).add_(running)
        torch.where(vis, coords.narrow(0, 1, 2), running, out=coords.narrow(0, 1, 2))
    else:
        coords.add_(running)
    deltas = at_start.diff() - (S if valid is None else valid.sum(-1))  # (B,)
    work = torch.float64 if (dtype is not None and dtype.is_floating_point) else torch.int64
    dtype = torch.int64 if dtype is None else dtype
    if work == torch.float64:
        ids = coords.to(work)
    else:  # float32 -> int32 (into the spent buffer) -> int64: cheaper than one float32 -> int64 pass
        ints = acc.narrow(0, 1, 3).narrow(1, 0, N).view(3, B, S)
        ints.copy_(coords)
        ids = ints.to(torch.int64)
    if valid is not None:
        ids.masked_fill_(~valid, pad_position)
    return ids.to(dtype), deltas.view(B, 1).to(dtype)  # integers below 2**24: exact in every dtype
