"""RPE-2D: randomised positions over an expanded range during training, for resolution generalisation.

Liu et al., "RPE-2D" (arXiv 2503.18719, Kling/Kuaishou); no official code was found, so this follows the
paper's description and its 1-D ancestor, Ruoss et al. (ACL 2023, google-deepmind/randomized_positional_encodings:
sample positions from ``[0, L)`` without replacement, sort them). Per sample and per axis of a grid
``(g_0, ..., g_{A-1})``, training draws ``g_a`` sorted distinct indices from the expanded range ``[0, L_a)``
and token ``(r_0, ..., r_{A-1})`` gets the coordinates ``(Y_0[r_0], ..., Y_{A-1}[r_{A-1}])``: order along each
axis is kept, and every absolute index and every gap that a grid of up to ``L_a`` will use is seen in
training. At evaluation the wrapped encoding gets the positions unchanged (the standard grid).

Optional random crop (the paper's augmentation + SDXL-style micro-conditioning): the indices are drawn from a
random window ``[o_a, o_a + l_a)``, ``g_a <= l_a <= L_a``, and the window, as the fractions cut off at both
ends ``(o_a / L_a, (L_a - o_a - l_a) / L_a)`` (zero = uncropped, always zero at eval), passes through a
small learned, zero-initialised linear map and is added to the first prefix (CLS) token in ``embed``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor, nn

from ..positions import Positions
from .absolute import LearnedAPE, SinCosAPE
from .alibi import ALiBi
from .base import Context, Encoding
from .comrope import ComRoPE
from .fourier import LearnableFourier
from .pape import _ParabolicBase
from .plan import Plan
from .registry import available, build, by_class, get, register
from .rope import AxialRoPE
from .rope_mixed import RoPEMixed
from .spec import EncodingSpec
from .string import CayleySTRING

__all__ = ["RPE2D", "BASES", "register_base", "resampling_of"]

#: ``rows(base, pos, indices) -> Context``: a base's learned table read at grid indices (per axis ``(B, g_a)``)
RowsReader = Callable[[Encoding, Positions, "list[Tensor]"], Context]

#: how RPE-2D may re-sample a base encoding's positions, per encoding class (subclasses inherit it): ``"coords"``
#: (the base reads the coordinates it is given) or a :data:`RowsReader` of a learned table by grid index. Only
#: RPE-2D asks this, so it lives here, not on the encoding; :func:`register_base` adds a class.
BASES: dict[type, "str | RowsReader"] = {}


def register_base(cls: type, how: "str | RowsReader" = "coords") -> None:
    """Let RPE-2D wrap encoding class ``cls`` (and its subclasses): ``how`` is ``"coords"`` or a rows reader."""
    if not (isinstance(cls, type) and issubclass(cls, Encoding)):
        raise TypeError(f"register_base takes an Encoding class, got {cls!r}")
    if how != "coords" and not callable(how):
        raise ValueError(f"register_base: how must be 'coords' or a rows(base, pos, indices) reader, got {how!r}")
    BASES[cls] = how


def resampling_of(cls: type) -> "str | RowsReader | None":
    """How RPE-2D may re-sample ``cls``'s positions (the nearest registered class of its MRO), or None."""
    return by_class(BASES, cls)


for _cls in (AxialRoPE, RoPEMixed, ComRoPE, CayleySTRING, ALiBi, _ParabolicBase, SinCosAPE, LearnableFourier):
    register_base(_cls, "coords")
register_base(LearnedAPE, LearnedAPE.prepare_rows)  # RPE-2D samples rows of the table (its grid_size is the range)


@register("rpe2d")
class RPE2D(Encoding):
    """RPE-2D (Liu et al., arXiv 2503.18719): wraps ``base`` (``rope`` by default; also ``sincos``, ``ape``, ...)
    and, in training, feeds it per-sample sorted random positions drawn without replacement from an expanded
    range per axis (``expand`` times the grid, or an explicit ``length``); in eval it is exactly ``base``.
    The 1-D ancestor (Ruoss et al., ACL 2023, google-deepmind/randomized_positional_encodings) is the reference
    for the sampling; the tests check order, coverage of the range and the equivalence with the base.

    Positions are sampled with torch ops on the positions' device in ``prepare`` (one ``topk`` of random keys
    per axis, no host sync), one draw per sample of ``pos`` (positions with batch 1 get one draw shared by the
    batch; pass ``(B, N, A)`` positions for a draw per sample). Index ``i`` along an axis maps to the axis'
    ``i``-th coordinate of the given grid, continued linearly past its end, so with ``length`` equal to the grid
    the base encoding is reproduced exactly. ``base="ape"`` reads the learned table: its ``grid_size`` is the
    expanded range and the sampled indices select table rows. ``crop=True`` adds the random-crop
    micro-conditioning to the first prefix token (zero-initialised). Claims and pieces are those of the base
    (eval mode; ``crop=True`` adds ``embed``). Any registered encoding whose class is in :data:`BASES` (it reads the
    coordinates it is given, or a learned table by grid index) can be the base (:meth:`bases`).
    """

    needs_grid = True
    example: ClassVar[dict] = {"base": "rope"}

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        base: str = "rope",
        base_options: dict[str, Any] | None = None,
        expand: float | None = None,
        length: int | Sequence[int] | None = None,
        crop: bool = False,
    ) -> None:
        dim, num_heads, depth, num_axes = spec.dim, spec.num_heads, spec.depth, spec.num_axes
        super().__init__(spec=spec)
        bases = self.bases()
        if not isinstance(base, str) or base not in bases:
            try:
                get(base)  # unknown names get the registry's message with suggestions
            except ValueError as e:
                raise ValueError(f"rpe2d: unknown base encoding {base!r}; choose one of {bases}") from e
            raise ValueError(f"rpe2d re-samples coordinates, so the base must read them: one of {bases}, got {base!r}")
        base_options = dict(base_options or {})
        fixed = {"dim", "num_heads", "depth", "num_axes", "spec"} & set(base_options)
        if fixed:
            raise ValueError(f"rpe2d passes {sorted(fixed)} to the base itself; remove them from base_options")
        facts = {k: v for k, v in spec.facts().items() if k not in base_options}
        self.base = build(base, dim=dim, num_heads=num_heads, **facts, **base_options)
        self.base_name = base
        if expand is not None and length is not None:
            raise ValueError(
                "rpe2d takes either expand= (a factor of the grid) or length= (the range per axis), not both"
            )
        if length is not None:
            length = (int(length),) * num_axes if isinstance(length, (int, float)) else tuple(int(s) for s in length)
            if len(length) != num_axes or any(s < 1 for s in length):
                raise ValueError(f"length must be one positive size or {num_axes} (one per axis), got {length}")
        how = resampling_of(type(self.base))
        self.rows = None if how == "coords" else how  # a learned table: sample its rows (its grid is the range)
        if self.rows is not None:
            if expand is not None or (length is not None and length != self.base.grid_size):
                raise ValueError(
                    f"rpe2d with base={base!r} samples rows of the table, so the expanded range is the table's "
                    f"grid_size {self.base.grid_size}; set it with base_options={{'grid_size': ...}} instead"
                )
            length = self.base.grid_size
        if expand is None and length is None:
            expand = 2.0
        if expand is not None and not (isinstance(expand, (int, float)) and math.isfinite(expand) and expand >= 1):
            raise ValueError(f"expand must be a number >= 1 (the expanded range in grid sizes), got {expand!r}")
        self.expand = None if expand is None else float(expand)
        self.length = length
        self.crop = bool(crop)
        self.crop_embed = nn.Linear(2 * num_axes, dim, bias=False) if self.crop else None
        if self.crop_embed is not None:
            nn.init.zeros_(self.crop_embed.weight)

    @classmethod
    def bases(cls) -> tuple[str, ...]:
        """Registered encodings RPE-2D can wrap: those that declare how their positions can be re-sampled."""
        return tuple(n for n in available() if resampling_of(get(n)) is not None and not issubclass(get(n), RPE2D))

    @classmethod
    def examples(cls) -> tuple[dict[str, Any], ...]:
        """One example per base (the property kit checks each base's claims through the wrapper)."""
        return tuple({"base": b} for b in cls.bases())

    @property
    def claims(self) -> frozenset[str]:  # type: ignore[override]
        """The base's claims (in eval mode RPE-2D is exactly the base), but those on continuous coordinates:
        RPE-2D needs a grid."""
        return self.base.claims - {"rotation_invariant"}

    @property
    def pieces(self) -> frozenset[str]:  # type: ignore[override]
        """The base's pieces (and ``embed`` for the crop conditioning)."""
        return self.base.pieces | ({"embed"} if self.crop else frozenset())

    # ------------------------------------------------------------------ sampling
    def ranges(self, grid: Sequence[int]) -> tuple[int, ...]:
        """The expanded range ``L_a`` per axis for a grid (python ints; no device work)."""
        if self.length is not None:
            if any(L < g for L, g in zip(self.length, grid)):
                raise ValueError(
                    f"rpe2d: the grid {tuple(grid)} is larger than the expanded range {self.length}; "
                    f"train with grids no larger than length"
                )
            return tuple(self.length)
        return tuple(max(g, math.ceil(self.expand * g - 1e-9)) for g in grid)

    def sample(self, pos: Positions) -> tuple[Tensor, list[Tensor], Tensor]:
        """Per-sample sorted indices for every axis ``[(B, g_a)]``, the crop box (B, 2A), and the new coordinates.

        Returns ``(coords (B, N, A), indices, box)``.
        """
        grid = pos.grid
        B, A, dev = pos.batch, len(grid), pos.device
        L = self.ranges(grid)
        lines = pos.patch_coords.reshape(B, *grid, A)  # (B, g_0, ..., g_{A-1}, A)
        token_index = torch.stack(
            torch.meshgrid(*[torch.arange(g, device=dev) for g in grid], indexing="ij"), dim=-1
        ).reshape(-1, A)  # (n, A)
        new = []
        picked = []
        box = []
        for a in range(A):
            g, La = grid[a], L[a]
            sel = [0] * A
            sel[a] = slice(None)
            line = lines[(slice(None), *sel, a)]  # (B, g): the coordinates along axis a
            step = (line[:, -1:] - line[:, :1]) / (g - 1) if g > 1 else torch.ones_like(line[:, :1])
            tail = torch.arange(1, La - g + 1, device=dev, dtype=line.dtype)  # (La - g,)
            ext = torch.cat([line, line[:, -1:] + step * tail], dim=1)  # (B, La)
            keys = torch.rand(B, La, device=dev)  # (B, La)
            if self.crop:
                span = g + (torch.rand(B, device=dev) * (La - g + 1)).floor().clamp_max(La - g)  # (B,) in [g, La]
                off = (torch.rand(B, device=dev) * (La - span + 1)).floor().clamp_max(La - span)  # (B,)
                idx = torch.arange(La, device=dev)
                inside = (idx >= off[:, None]) & (idx < (off + span)[:, None])  # (B, La)
                keys = keys.masked_fill(~inside, 2.0)  # never chosen: g <= span keys are < 1
                box.append(torch.stack([off / La, (La - off - span) / La], dim=-1))  # (B, 2)
            else:
                box.append(torch.zeros(B, 2, device=dev))
            ind = keys.topk(g, dim=1, largest=False).indices.sort(dim=1).values  # (B, g) strictly increasing
            picked.append(ind)
            new.append(ext.gather(1, ind)[:, token_index[:, a]])  # (B, n)
        coords = torch.stack(new, dim=-1)  # (B, n, A)
        if pos.prefix:
            coords = torch.cat([coords.new_zeros(B, pos.prefix, A), coords], dim=1)  # (B, N, A)
        return coords, picked, torch.cat(box, dim=-1)  # box (B, 2A)

    def _prepare(self, ctx: Context) -> None:
        pos = ctx.pos
        if self.crop and pos.prefix == 0:
            raise ValueError(
                "rpe2d with crop=True adds the crop embedding to a prefix (CLS) token; positions have none"
            )
        if not ctx.training:
            ctx["inner"] = self.base.prepare(pos)
            ctx["box"] = torch.zeros(pos.batch, 2 * pos.num_axes, device=pos.device)
            return
        coords, picked, box = self.sample(pos)
        moved = pos.replace(coords=coords)  # no read-back: the constructor checks shapes only
        if self.rows is not None:
            ctx["inner"] = self.rows(self.base, moved, picked)
        else:
            ctx["inner"] = self.base.prepare(moved)
        ctx["box"] = box
        ctx["indices"] = picked

    def _plan(self, ctx: Context) -> Plan:
        inner = ctx["inner"].plan
        return Plan(embed=inner.embed or self.crop, layers=inner.layers, same_every_layer=inner.same_every_layer)

    # ------------------------------------------------------------------ hooks (delegated)
    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        x = self.base.embed(x, ctx["inner"])
        if self.crop_embed is None:
            return x
        self.check_tokens(x, ctx, "rpe2d.embed")
        v = self.crop_embed(ctx["box"].to(self.crop_embed.weight.dtype)).to(x.dtype)  # (B, C)
        return torch.cat([x[:, :1] + v.unsqueeze(1), x[:, 1:]], dim=1)

    def mix(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        return self.base.mix(x, ctx["inner"], layer)

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        return self.base.rotate(q, k, ctx["inner"], layer)

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        return self.base.widen(q, k, ctx["inner"], layer)

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        return self.base.score(q, k, ctx["inner"], layer, rows=rows)

    def values(self, attn: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        return self.base.values(attn, ctx["inner"], layer, rows=rows)

    def neutralize(self) -> "RPE2D":
        self.base.neutralize()
        if self.crop_embed is not None:
            self.crop_embed.weight.zero_()
        return self

    def no_weight_decay(self) -> set[str]:
        return {f"base.{n}" for n in self.base.no_weight_decay()}

    def extra_repr(self) -> str:
        rng = f"length={self.length}" if self.length is not None else f"expand={self.expand}"
        return f"{super().extra_repr()}, base={self.base_name!r}, {rng}, crop={self.crop}"
