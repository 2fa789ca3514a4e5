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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .samples import Check, Samples, packed_samples

__all__ = ["TokenLayout", "token_layout", "layout_checks", "Check", "Samples", "packed_samples", "merge_divisor"]


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
        row_first: ``(R,)`` flat index (into ``B * S``) of each row's first token (``B * S`` if absent).
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
    row_first: Tensor
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


_DIVISORS: dict[tuple, Tensor] = {}


def merge_divisor(m: int, device: torch.device) -> Tensor:
    """``(3,)`` int64 ``[1, m, m]`` on ``device``: a grid row divided by it is the merged grid. Kept per
    ``(m, device)``, so no call copies it to the device again."""
    key = (m, device)  # (no attribute reads per call)
    div = _DIVISORS.get(key)
    if div is None:
        with torch.inference_mode(False):  # kept across calls: an ordinary tensor
            div = _DIVISORS[key] = torch.tensor([1, int(m), int(m)], dtype=torch.int64, device=device)
    return div


def _as_grid(grid_thw, device: torch.device) -> Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    grid = torch.as_tensor(grid_thw, device=device)
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        raise ValueError(f"grid_thw must hold integers (patches per axis), got dtype {grid.dtype}")
    if grid.dtype != torch.int64:
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
    with the eager shape / dtype checks of :func:`token_layout` (no tensor value is read)."""
    types = torch.as_tensor(mm_token_type_ids)
    if types.dim() != 2:
        raise ValueError(f"mm_token_type_ids must have shape (B, S), got {tuple(types.shape)}")
    if types.is_floating_point() or types.is_complex() or types.dtype == torch.bool:
        raise ValueError(f"mm_token_type_ids must hold integers 0 (text), 1 (image), 2 (video), got {types.dtype}")
    B, S = types.shape
    if B == 0 or S == 0:
        raise ValueError(
            f"mm_token_type_ids has shape {(B, S)}: a batch with no tokens (B = 0 or S = 0) has no position ids; "
            "drop empty batches (or samples) before computing them"
        )
    try:
        m = int(spatial_merge_size)
    except (TypeError, ValueError, OverflowError):
        m = 0
    if isinstance(spatial_merge_size, bool) or m < 1 or m >= 1 << 63 or m != spatial_merge_size:
        raise ValueError(f"spatial_merge_size must be a positive integer below 2**63, got {spatial_merge_size!r}")
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

    Per-token work is a few passes over the ``B * S`` tokens (two cumulative sums, one gather of the per-row
    table, the raster decomposition); everything per grid row is done on ``R`` values, and for unpacked
    batches the sample of a token is its batch row (no per-token sample index).

    Args:
        mm_token_type_ids: ``(B, S)`` 0 text, 1 image, 2 video.
        grid_thw: ``(R, 3)`` grids in patches (before spatial merging), in order of appearance over the
            batch (sample 0's blocks first); None or empty for text-only batches.
        attention_mask: ``(B, S)`` 1 for real tokens, 0 for padding; None when every token is real.
        spatial_merge_size: patches merged per axis into one LLM token (2 in Qwen2/2.5/3-VL).
        split_frames: units are single frames (Qwen3-VL), which may be separated by text (timestamps).
        cu_seqlens: packed rows: the sample boundaries (see :func:`packed_samples` for the accepted forms);
            None: every row is one sample.
        checks: record the structural checks (:func:`layout_checks`) in ``checks``, evaluated by
            :meth:`TokenLayout.validate`; False skips building them (``position_ids(validate=False)``).

    Returns:
        The :class:`TokenLayout` of the batch.

    Raises:
        ValueError: token types that are not an integer ``(B, S)`` tensor, a batch of no tokens, a merge size that
            is not a positive integer, a mask of another shape, a ``grid_thw`` that is not an integer ``(R, 3)``
            tensor, or ``cu_seqlens`` of a form :func:`packed_samples` does not take. The checks of values are
            deferred to :meth:`TokenLayout.validate`.
    """
    types, mask, m = _checked_inputs(mm_token_type_ids, attention_mask, spatial_merge_size)
    grid = _as_grid(grid_thw, types.device)
    samples = None if cu_seqlens is None else packed_samples(cu_seqlens, *types.shape, device=types.device)
    layout = _layout(types, mask, grid, m, split_frames=split_frames, samples=samples)
    if checks:
        layout.checks = layout_checks(layout, types, grid, m)
    return layout


def _layout(types: Tensor, mask: Tensor | None, grid: Tensor, m: int, *, split_frames: bool,
            samples: Samples | None) -> TokenLayout:
    """The :class:`TokenLayout` of checked inputs (:func:`token_layout`), without its checks: on inputs that fail
    them, the per-token fields are unspecified (but computed without an error)."""
    device = types.device
    B, S = types.shape
    N = B * S
    shape = (B, S)
    padded = mask is not None
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
    R = grid.shape[0]
    if R == 0:
        zeros = torch.zeros(B, S, dtype=torch.int64, device=device)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return TokenLayout(
            valid=valid, vision=vision, row=zeros, tau=zeros, i=zeros, j=zeros, index=zeros, grid=grid,
            unit_grid=grid, row_type=empty, row_first=empty, row_last=empty,
            frame_last=torch.zeros(B, S, dtype=torch.bool, device=device) if split_frames else None,
            valid_len=valid_len, padded=padded, samples=samples,
        )

    g = grid // merge_divisor(m, device)  # (R, 3) merged grids (T, H / m, W / m)
    Tm, HWm = g[:, 0], g[:, 1:]  # (R,), (R, 2) merged grid rows, columns
    HWc = HWm.clamp(1, N)  # safe divisors whose product cannot wrap (bad or oversized rows fail the checks)
    hw_row = HWc.prod(-1)  # (R,)
    n_row = g.prod(-1)  # (R,) tokens per block
    end_cnt = n_row.cumsum(0)  # (R,) vision count after each row
    start_cnt = end_cnt - n_row  # (R,) vision count before each row

    flat_vis = vision.reshape(-1)
    cnt = flat_vis.cumsum(0)  # (N,) inclusive vision count (int64)
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
    row_type = vt.index_select(0, row_first.clamp(max=N - 1))  # (R,)
    if split_frames:
        frame_last = (flat_vis & (rem == hw_tok - 1)).reshape(shape)
        zeros = torch.zeros(B, S, dtype=torch.int64, device=device)
        unit_grid = torch.cat([torch.ones_like(Tm)[:, None], HWm], dim=1)
        return TokenLayout(
            valid=valid, vision=vision, row=row.reshape(shape), tau=zeros, i=i.reshape(shape), j=j.reshape(shape),
            index=rem.reshape(shape), grid=g, unit_grid=unit_grid, row_type=row_type, row_first=row_first,
            row_last=row_last, frame_last=frame_last, valid_len=valid_len, padded=padded, samples=samples,
        )
    coords = torch.stack([tau, i, j]).view(3, B, S)  # one tensor for the designs that add all three
    return TokenLayout(
        valid=valid, vision=vision, row=row.reshape(shape), tau=coords[0], i=coords[1], j=coords[2],
        index=off.reshape(shape), grid=g, unit_grid=g, row_type=row_type, row_first=row_first, row_last=row_last,
        frame_last=None, valid_len=valid_len, padded=padded, samples=samples, coords=coords,
    )


def layout_checks(L: TokenLayout, types: Tensor, grid: Tensor, m: int) -> list[Check]:
    """The structural checks of a batch's layout, deferred (:class:`Check`): nothing is read on the host here.

    In order: token types in 0 .. 2, the form of ``cu_seqlens`` (packed rows), then with grid rows: rows positive
    with H, W divisible by ``m``, no block of more tokens than the batch (a product past int64 would wrap), as
    many vision tokens as the rows describe, and every block one run of vision tokens of one type inside one
    sample (per-frame units: every run starts at a frame); without grid rows: no vision tokens.

    Args:
        L: the layout of the batch (:func:`token_layout`, built with these inputs).
        types: ``(B, S)`` the token types.
        grid: ``(R, 3)`` int64 grids in patches, before merging.
        m: the spatial merge size.

    Returns:
        The checks, in the order above; :meth:`TokenLayout.validate` raises the first that fails.
    """
    device = L.device
    B, S = types.shape
    N = B * S
    R = grid.shape[0]
    samples = L.samples
    lo, hi = torch.aminmax(types)
    found = [
        Check(
            (lo < 0) | (hi > 2),
            lambda: "mm_token_type_ids must be 0 (text), 1 (image) or 2 (video); got values "
            f"{sorted(set(types.unique().tolist()) - {0, 1, 2})}",
        )
    ]
    if samples is not None:
        found += samples.checks
    flat_vis = L.vision.reshape(-1)
    if R == 0:
        n_vis = flat_vis.sum()
        found.append(
            Check(
                n_vis > 0,
                lambda: f"mm_token_type_ids mark {int(n_vis)} image/video tokens but grid_thw has no rows; "
                "pass one (T, H, W) row per vision block in order of appearance",
            )
        )
        return found

    def bad_rows() -> str:
        bad = ((grid < 1).any(-1) | (grid[:, 1:] % m != 0).any(-1)).nonzero().flatten().tolist()
        return (
            f"grid_thw rows must be positive and H, W divisible by spatial_merge_size={m}; bad rows "
            f"(index: T, H, W): {[(r, tuple(grid[r].tolist())) for r in bad]}"
        )

    found.append(Check((grid < 1).any() | (grid[:, 1:] % m).any(), bad_rows))
    # tokens per block in float64: a product past int64 would wrap (to any count, even the right one); above N
    # it cannot match the batch, and below 2**53 float64 is exact
    size = L.grid.double().prod(-1)  # (R,)

    def oversized() -> str:
        bad = (size > N).nonzero().flatten().tolist()
        return (
            f"grid_thw rows describe blocks of more tokens than the batch holds ({N} = {B} x {S}); (index: T, H, W): "
            f"{[(r, tuple(grid[r].tolist())) for r in bad]}; pass grids in patches per axis, before spatial merging"
        )

    found.append(Check((size > N).any(), oversized))
    n_row = L.grid.prod(-1)  # (R,) tokens per block (exact once the check above passes)
    n_vis, n_grid = flat_vis.sum(), n_row.sum()
    found.append(
        Check(
            n_vis != n_grid,
            lambda: f"the token types hold {int(n_vis)} image/video tokens but grid_thw describes "
            f"{int(n_grid)} (sum of T * (H/{m}) * (W/{m}) over its {R} rows); pass exactly one row per "
            "vision block, in order of appearance over the batch",
        )
    )
    fi, la = L.row_first.clamp(max=N - 1), L.row_last.clamp(max=N - 1)
    row_type = L.row_type
    vt = types.reshape(-1).to(torch.int64)  # (N,) type of vision tokens, 0 elsewhere (without a mask: every token)
    if L.padded:
        vt = vt * flat_vis
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
    if L.split_frames:
        # frames of a row may be separated by text: runs of vision tokens start exactly at frame starts
        prev = torch.cat([vt.new_zeros(B, 1), vt.view(B, S)[:, :-1]], dim=1).view(-1)  # type before, 0 at row 0
        if samples is not None:
            prev = prev.masked_fill(samples.start == torch.arange(N, device=device), 0)  # no run across samples
        run_start = flat_vis & (prev != vt)  # (N,)
        frame_start = L.index.reshape(-1) == 0  # (N,) (the raster index in the frame)
        row_start = torch.zeros(N + 1, dtype=torch.bool, device=device).index_fill_(0, L.row_first, True)[:N]
        misaligned = (flat_vis & ((run_start & ~frame_start) | (row_start & ~run_start))).any()
        misaligned = misaligned | straddles.any() | (vt.index_select(0, la) != row_type).any()
        what = "every run of vision tokens must start at a frame of its grid row, and a row may not span samples"
    else:
        # one run per row: no text inside it, one token type, and no row of its type right before it in
        # its sample (the counts check has placed every vision token in a row, so a run continuing past a
        # row's ends is the next row's tokens, or vision tokens past the last row)
        typesum = vt.cumsum(0)  # (N,)
        at = typesum.index_select(0, torch.cat([fi, la]))  # (2R,)
        contiguous = L.row_last - L.row_first + 1 == n_row
        uniform = at[R:] - at[:R] + row_type == row_type * n_row
        sample = fi // S if samples is None else samples.index.reshape(-1).index_select(0, fi)
        glued = (L.row_first[1:] == L.row_last[:-1] + 1) & (row_type[1:] == row_type[:-1]) & (sample[1:] == sample[:-1])
        misaligned = ~(contiguous & uniform & ~straddles).all() | glued.any()
        what = "every vision block must be one run of consecutive image/video tokens matching its grid row"
    found.append(
        Check(
            misaligned,
            lambda: f"the vision blocks in mm_token_type_ids do not match grid_thw: {what} (rows are taken in "
            "order of appearance; blocks may not span samples, and two blocks need a text token between them)",
        )
    )
    return found
