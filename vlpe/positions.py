"""Explicit token coordinates: the one input every vlpe encoding reads.

`Positions` carries per-token float coordinates for a whole sequence (prefix tokens included), the
number of prefix tokens (CLS, registers) at its start, the regular grid the remaining tokens form when
they form one, and which tokens are padding. Encodings never infer a grid from ``sqrt(N)``.

Conventions:
    * ``coords`` has shape ``(B, N, A)``: B samples (B may be 1 and broadcast over a batch), N tokens,
      A axes. Grids are built as int64 then ``.float()``; coordinates are float32 (float64 is kept).
    * Axis order: images ``(h, w)`` (row, column), videos ``(t, h, w)``, points ``(x, y, z)``.
    * Prefix tokens come first; their coordinates are zero and encodings treat them specially (no
      rotation, a dedicated bucket, no mask), as each encoding documents.
    * ``valid`` (B, N) bool marks real tokens in padded batches of different sizes; None means all real.
    * ``lattice`` is True for positions built by :meth:`Positions.grid_nd` (``.grid``, ``.video`` without
      timestamps) and their ``.to()`` copies: the non-prefix coordinates are exactly the row-major integer
      grid, so the offset between two tokens is their grid offset. A host-side fact (no tensor is read);
      bias encodings use it for offset tables (:class:`vlpe.encodings.LatticeBias`). Any other constructor,
      ``with_coords``, ``shifted`` and ``replace`` give ``lattice=False``.
    * The constructor never reads a tensor back to the host (it runs on every forward): it checks shapes,
      dtypes and sizes only. :meth:`Positions.validate` does the checks that read values (finite
      coordinates); data loaders and tests call it, the forward path does not.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["Positions"]


def whole(value, what: str) -> int:
    """``value`` as an int when it is a whole number (int, numpy/torch integer, a float such as 2.0), else a
    ``ValueError`` naming ``what``: 2.7 patches or 1.9 prefix tokens are mistakes, never rounded silently."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        pass
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()  # a 0-d tensor given as a size: a Python-level argument, not a hot path
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"{what} must be a whole number, got {value!r}")


def _real(values, what: str) -> Tensor:
    """``values`` as a tensor of real numbers; a dtype that holds no coordinate is a ``ValueError``.

    Only the dtype is checked (free): bool masks and complex numbers are never coordinates (a cast would turn
    ``True`` into 1 and drop imaginary parts silently), nor are strings; finite values are checked by
    :meth:`Positions.validate` (a host read).
    """
    if not isinstance(values, Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"Positions expects {what} as numbers (a tensor or nested lists of numbers), got a "
                f"{type(values).__name__} that is not numeric ({e})"
            ) from None
    if values.dtype == torch.bool or values.is_complex():
        raise ValueError(
            f"Positions expects {what} as real numbers (float or integer), got dtype {values.dtype}; "
            f"a padding mask goes to valid=, not into the coordinates"
        )
    return values


def _as_coords(coords: Tensor) -> Tensor:
    coords = _real(coords, "coordinates")
    if coords.dim() == 2:
        coords = coords.unsqueeze(0)
    if coords.dim() != 3:
        raise ValueError(
            f"Positions expects coords of shape (B, N, A) or (N, A), got a tensor of shape {tuple(coords.shape)}"
        )
    if not coords.is_floating_point():
        coords = coords.to(torch.int64).float()
    elif coords.dtype != torch.float64:
        coords = coords.float()
    return coords


class Positions:
    """Per-token coordinates of a token sequence.

    Args:
        coords: ``(B, N, A)`` or ``(N, A)`` coordinates of all N tokens, prefix tokens included.
        prefix: number of prefix tokens at the start of the sequence.
        grid: the shape of the regular grid the non-prefix tokens form in row-major order, e.g.
            ``(h, w)`` or ``(t, h, w)``; None when they form none (points, ragged batches).
        valid: ``(B, N)`` bool, True for real tokens; None when every token is real.
        axes: names of the A axes, e.g. ``("h", "w")``.
    """

    coords: Tensor
    prefix: int
    #: the grid shape of an instance; on the class, ``Positions.grid(h, w)`` builds an image grid
    grid: tuple[int, ...] | None
    valid: Tensor | None
    axes: tuple[str, ...] | None
    #: the non-prefix coordinates are exactly the row-major integer grid (see the module docstring)
    lattice: bool

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("Positions is immutable; use .replace(...) / .with_coords(...)")

    def __init__(
        self,
        coords: Tensor,
        *,
        prefix: int = 0,
        grid: Sequence[int] | None = None,
        valid: Tensor | None = None,
        axes: Sequence[str] | None = None,
    ) -> None:
        coords = _as_coords(coords)
        B, N, A = coords.shape
        prefix = whole(prefix, "prefix (the number of prefix tokens)")
        if prefix < 0 or prefix > N:
            raise ValueError(f"prefix must be in [0, N={N}] (the number of tokens), got {prefix}")
        if prefix:  # prefix tokens have no coordinates (documented convention); no read-back to test for it
            coords = torch.cat([coords.new_zeros(B, prefix, A), coords[:, prefix:]], dim=1)  # (B, N, A)
        if grid is not None:
            grid = tuple(whole(g, f"grid size {g!r} of grid {tuple(grid)}") for g in grid)
            if any(g < 1 for g in grid) or math.prod(grid) != N - prefix:
                raise ValueError(
                    f"grid {grid} holds {math.prod(grid)} tokens but the sequence has N - prefix = {N - prefix}"
                )
            if len(grid) != A:
                raise ValueError(f"grid {grid} has {len(grid)} axes but coords have A = {A}")
        if valid is not None:
            valid = torch.as_tensor(valid, dtype=torch.bool, device=coords.device)
            if valid.dim() == 1:
                valid = valid.unsqueeze(0)
            if valid.dim() != 2 or valid.shape[1] != N or valid.shape[0] not in (1, B):
                raise ValueError(f"valid must have shape (B, N) = ({B}, {N}), got {tuple(valid.shape)}")
        if axes is not None:
            axes = tuple(axes)
            if len(axes) != A:
                raise ValueError(f"axes {axes} name {len(axes)} axes but coords have A = {A}")
        object.__setattr__(self, "coords", coords)
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "valid", valid)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "lattice", False)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def grid_nd(
        cls,
        shape: Sequence[int],
        *,
        prefix: int = 0,
        axes: Sequence[str] | None = None,
        device: torch.device | str | None = None,
    ) -> "Positions":
        """Integer coordinates of a row-major grid of any number of axes, prefix tokens first."""
        shape = tuple(whole(s, f"grid size {s!r} of {tuple(shape)}") for s in shape)
        if any(s < 1 for s in shape):
            raise ValueError(f"grid sizes must be >= 1, got {shape}")
        prefix = whole(prefix, "prefix (the number of prefix tokens)")
        if prefix < 0:
            raise ValueError(f"prefix (the number of prefix tokens) must be >= 0, got {prefix}")
        ranges = [torch.arange(s, device=device, dtype=torch.int64) for s in shape]
        mesh = torch.meshgrid(*ranges, indexing="ij")
        coords = torch.stack(mesh, dim=-1).reshape(-1, len(shape)).float()  # (prod, A)
        if prefix:
            coords = torch.cat([coords.new_zeros(prefix, len(shape)), coords], dim=0)  # (N, A)
        pos = cls(coords, prefix=prefix, grid=shape, axes=axes)
        object.__setattr__(pos, "lattice", True)
        return pos

    @classmethod
    def grid(
        cls, h: int, w: int, *, prefix: int = 0, device: torch.device | str | None = None
    ) -> "Positions":
        """An ``h x w`` image patch grid in row-major order, ``prefix`` tokens (CLS first) before it."""
        return cls.grid_nd((h, w), prefix=prefix, axes=("h", "w"), device=device)

    @classmethod
    def video(
        cls,
        t: int,
        h: int,
        w: int,
        *,
        prefix: int = 0,
        timestamps: Tensor | None = None,
        device: torch.device | str | None = None,
        validate: bool = True,
    ) -> "Positions":
        """A ``t x h x w`` tubelet grid; ``timestamps`` (t,) or (B, t) replace the integer time axis.

        ``validate`` (with ``timestamps``): NaN or infinite timestamps raise ``ValueError`` (:meth:`validate`,
        one host read); ``False`` skips the read, for callers that checked them already
        (:class:`vlpe.tokenizers.VideoTokenizer` folds them into its one check of the video).
        """
        pos = cls.grid_nd((t, h, w), prefix=prefix, axes=("t", "h", "w"), device=device)
        if timestamps is None:
            return pos
        ts = _real(timestamps, "timestamps (one time per tubelet)").to(device=pos.coords.device).float()
        if ts.dim() == 1:
            ts = ts.unsqueeze(0)
        if ts.shape[-1] != t:
            raise ValueError(f"timestamps must have {t} entries per sample (one per tubelet), got {tuple(ts.shape)}")
        coords = pos.coords.expand(ts.shape[0], -1, -1).clone()  # (B, N, 3)
        coords[:, prefix:, 0] = ts.repeat_interleave(h * w, dim=-1)
        pos = cls(coords, prefix=prefix, grid=(t, h, w), axes=("t", "h", "w"))
        return pos.validate() if validate else pos

    @classmethod
    def points(
        cls, xyz: Tensor, *, prefix: int = 0, valid: Tensor | None = None, validate: bool = True
    ) -> "Positions":
        """Continuous point coordinates ``(B, N, 3)`` (or any A); prefix rows must already be included.

        ``validate``: NaN or infinite coordinates raise ``ValueError`` (:meth:`validate`, one host read; padding
        points too: give them any finite value and ``valid=False``); ``False`` skips the read, for callers that
        checked the points already (:class:`vlpe.tokenizers.PointTokenizer` does, in its one check per call).
        """
        xyz = _as_coords(xyz)
        axes = ("x", "y", "z")[: xyz.shape[-1]] if xyz.shape[-1] <= 3 else None
        pos = cls(xyz, prefix=prefix, valid=valid, axes=axes)
        return pos.validate() if validate else pos

    # ----------------------------------------------------------------- views
    @property
    def batch(self) -> int:
        return self.coords.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.coords.shape[1]

    @property
    def num_axes(self) -> int:
        return self.coords.shape[2]

    @property
    def device(self) -> torch.device:
        return self.coords.device

    @property
    def patch_coords(self) -> Tensor:
        """Coordinates of the non-prefix tokens, ``(B, N - prefix, A)``."""
        return self.coords[:, self.prefix :]

    @property
    def is_prefix(self) -> Tensor:
        """``(N,)`` bool, True for prefix tokens."""
        idx = torch.arange(self.num_tokens, device=self.device)
        return idx < self.prefix

    def to(self, device: torch.device | str) -> "Positions":
        valid = None if self.valid is None else self.valid.to(device)
        pos = Positions(self.coords.to(device), prefix=self.prefix, grid=self.grid, valid=valid, axes=self.axes)
        object.__setattr__(pos, "lattice", self.lattice)
        return pos

    def with_coords(self, coords: Tensor, *, keep_grid: bool = True) -> "Positions":
        """Same tokens at new coordinates (``keep_grid=False`` drops the regular-grid claim)."""
        return Positions(
            coords,
            prefix=self.prefix,
            grid=self.grid if keep_grid else None,
            valid=self.valid,
            axes=self.axes,
        )

    def shifted(self, offset: Tensor | Sequence[float]) -> "Positions":
        """All non-prefix tokens moved by ``offset`` (A,): the grid stays a grid."""
        off = torch.as_tensor(offset, dtype=self.coords.dtype, device=self.device).reshape(1, 1, -1)
        coords = self.coords.clone()
        coords[:, self.prefix :] = coords[:, self.prefix :] + off
        return self.with_coords(coords)

    def validate(self) -> "Positions":
        """Checks that read tensor values (a host sync; not for the forward path): every coordinate is finite.

        Returns ``self``; raises ``ValueError`` naming the first bad sample.
        """
        bad = ~torch.isfinite(self.coords).all(dim=-1).all(dim=-1)  # (B,)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"Positions got NaN or infinite coordinates (sample {b}); every coordinate must be finite "
                "(mark padding tokens with `valid=` instead of NaN)"
            )
        return self

    def check(self, num_tokens: int, *, num_axes: int | Sequence[int] | None = None, who: str = "encoding") -> None:
        """Raise ``ValueError`` unless these positions describe ``num_tokens`` tokens with an allowed axis count."""
        if self.num_tokens != num_tokens:
            raise ValueError(
                f"{who}: positions describe {self.num_tokens} tokens but the input has {num_tokens}; "
                f"build Positions for exactly the tokens given (prefix tokens included)"
            )
        if num_axes is not None:
            allowed = (num_axes,) if isinstance(num_axes, int) else tuple(num_axes)
            if self.num_axes not in allowed:
                raise ValueError(
                    f"{who}: expected positions with {' or '.join(map(str, allowed))} axes, got {self.num_axes}"
                )

    def __repr__(self) -> str:
        return (
            f"Positions(B={self.batch}, N={self.num_tokens}, A={self.num_axes}, prefix={self.prefix}, "
            f"grid={self.grid}, padded={self.valid is not None})"
        )

    def replace(self, **changes) -> "Positions":
        fields = dict(coords=self.coords, prefix=self.prefix, grid=self.grid, valid=self.valid, axes=self.axes)
        fields.update(changes)
        coords = fields.pop("coords")
        return Positions(coords, **fields)

