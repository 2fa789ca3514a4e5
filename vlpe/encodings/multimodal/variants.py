"""Named multimodal RoPE variants (one position design + one frequency allocation) and the functional API."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .allocations import ALLOCATIONS, get_allocation
from .designs import DESIGNS, assemble, get_design
from .layout import merge_divisor, packed_samples, token_layout

__all__ = [
    "Variant",
    "VARIANTS",
    "get_variant",
    "position_ids",
    "decode_position_ids",
    "merge_grids",
    "pype_attention_mask",
    "text_position_ids",
]

@dataclass(frozen=True)
class Variant:
    """A multimodal RoPE: a position design paired with a frequency allocation.

    Any design pairs with any allocation whose axis count fits (a single-axis design is broadcast to every
    axis an allocation reads), e.g. ``Variant("diagonal", "interleaved")`` or ``Variant("grid", "hybrid")``.

    Args:
        design: a name of :data:`vlpe.encodings.multimodal.designs.DESIGNS`.
        allocation: a name of :data:`vlpe.encodings.multimodal.allocations.ALLOCATIONS`.
        design_options: defaults for the design's options (overridable per call).
        section: the allocation's section (None: the default scaled to the head dim).
        theta: default RoPE base.
        name: the registered name, if any.
        partial_rotary_factor: the fraction of the head dim that rotates (transformers' ``partial_rotary_factor``):
            the first ``rotary_dim = int(head_dim * factor)`` channels, in the half layout of those channels, with
            frequencies ``theta ** (-2k / rotary_dim)``; the other channels pass through unrotated (Qwen3.5: 0.25).
    """

    design: str
    allocation: str
    design_options: Mapping[str, Any] = field(default_factory=dict)
    section: tuple[int, ...] | None = None
    theta: float = 10000.0
    name: str | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        d = get_design(self.design)
        a = get_allocation(self.allocation)
        d.options(dict(self.design_options))  # unknown options fail now
        if d.layered and not a.one_axis:
            fits = " or ".join(repr(n) for n, b in ALLOCATIONS.items() if b.one_axis)
            raise ValueError(f"the {d.name} design has one position axis per layer; pair it with the {fits} allocation")
        if self.section is not None:
            object.__setattr__(self, "section", tuple(self.section))
        if self.theta <= 0:
            raise ValueError(f"theta must be > 0, got {self.theta}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(
                f"partial_rotary_factor (the fraction of the head dim that rotates) must be a number in (0, 1], "
                f"got {f!r}"
            )

    def rotary_dim(self, head_dim: int) -> int:
        """The rotated channels of a head of ``head_dim``: ``int(head_dim * partial_rotary_factor)`` (transformers'
        rule), the whole head without a partial factor.

        Raises:
            ValueError: the rotated part is odd or empty (no whole rotation pair).
        """
        rd = int(head_dim * self.partial_rotary_factor)
        if rd < 2 or rd % 2:
            raise ValueError(
                f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rd} (= int(head_dim * "
                f"partial_rotary_factor {self.partial_rotary_factor}) of {self.label}); choose a head_dim that makes "
                "it one"
            )
        return rd

    @property
    def label(self) -> str:
        return self.name or f"{self.design}+{self.allocation}"

    def num_axes(self, **options: Any) -> int:
        """Number of position axes A the design produces (:attr:`Design.axes`; PyPE: its ``depth``)."""
        return get_design(self.design).num_axes({**self.design_options, **options})

    @property
    def layered(self) -> bool:
        """The design gives every decoder layer its own positions (PyPE): ids ``(depth, B, S)``
        (:attr:`Design.layered`)."""
        return get_design(self.design).layered

    @property
    def masked(self) -> bool:
        """The design brings its own attention mask (PyPE, :func:`pype_attention_mask`; :attr:`Design.needs_mask`)."""
        return get_design(self.design).needs_mask

    @property
    def per_head(self) -> bool:
        """The allocation gives whole KV heads to an axis (MHRoPE): tables ``(B, H_kv, S, D)``
        (:attr:`Allocation.per_head`)."""
        return get_allocation(self.allocation).per_head

    def with_options(
        self,
        *,
        allocation: str | None = None,
        section: Sequence[int] | None = None,
        theta: float | None = None,
        **design_options: Any,
    ) -> "Variant":
        """This variant with more design options (merged over its own), another ``allocation`` (its section then
        defaults again and the preset name is dropped), ``section`` or ``theta``; validated like the constructor.
        """
        v = get_variant(self, allocation=allocation)
        changes: dict[str, Any] = {}
        if design_options:
            changes["design_options"] = {**v.design_options, **design_options}
        if section is not None:
            changes["section"] = tuple(section)
        if theta is not None:
            changes["theta"] = float(theta)
        return replace(v, **changes) if changes else v

    # the position ids of this variant; its tables are ``mm.rotary(variant, ...)`` and its encoding
    # ``mm.encoding(variant, ...)``, in the modules above this one
    def position_ids(self, mm_token_type_ids, grid_thw, attention_mask=None, spatial_merge_size=2, **options):
        return position_ids(self, mm_token_type_ids, grid_thw, attention_mask, spatial_merge_size, **options)

    def decode_position_ids(self, rope_deltas: Tensor, cache_position: Tensor, **kwargs):
        return decode_position_ids(self, rope_deltas, cache_position, **kwargs)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("1d", "none", theta=10000.0, name="rope1d"),
        Variant("grid", "chunked", theta=1e6, name="mrope"),
        Variant("absolute_time", "chunked", theta=1e6, name="qwen25vl"),
        Variant("grid", "interleaved", theta=1e6, name="mrope_i"),
        Variant("per_frame", "interleaved", theta=5e6, name="qwen3vl"),
        Variant("per_frame", "round_robin", theta=1e7, name="qwen35", partial_rotary_factor=0.25),
        Variant("grid", "multi_head", theta=1e6, name="mhrope"),
        Variant("per_frame", "interleaved", {"spatial_reset": True}, theta=1e6, name="ilrope"),
        Variant("per_frame", "chunked", {"spatial_reset": True}, theta=1e6, name="omnirope"),
        Variant("scaled_frames", "distributed", theta=1e6, name="mmrope"),
        Variant("circle", "chunked", theta=1e6, name="circlerope"),
        Variant("diagonal", "low_freq_temporal", {"temporal_scale": 2.0}, theta=1e6, name="videorope"),
        Variant("diagonal", "hybrid", {"temporal_scale": 0.75}, theta=1e6, name="hope_video"),
        Variant("vrope", "interleaved", theta=10000.0, name="vrope"),
        Variant("v2pe", "none", theta=1e6, name="v2pe"),
        Variant("pype", "none", theta=10000.0, name="pype"),
    )
}


def get_variant(variant: str | Variant, *, allocation: str | None = None) -> Variant:
    """A :class:`Variant` from a registered name (or a Variant), with an optional allocation override."""
    if isinstance(variant, Variant):
        v = variant
    elif isinstance(variant, str) and variant in VARIANTS:
        v = VARIANTS[variant]
    else:
        raise ValueError(
            f"unknown multimodal RoPE variant {variant!r}; variants are: {', '.join(VARIANTS)} "
            f"(or pair a design with an allocation: Variant(design, allocation), designs: {', '.join(DESIGNS)})"
        )
    if allocation is not None and allocation != v.allocation:
        v = replace(v, allocation=allocation, section=None, name=None)
    return v


# --------------------------------------------------------------------------- position ids
def position_ids(
    variant: str | Variant,
    mm_token_type_ids: Tensor,
    grid_thw: Tensor | None,
    attention_mask: Tensor | None = None,
    spatial_merge_size: int = 2,
    *,
    cu_seqlens: Tensor | Sequence | None = None,
    pad_position: float = 1,
    dtype: torch.dtype | None = None,
    validate: bool = True,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Multimodal position ids and rope deltas of a batch (Hugging Face 5.x argument conventions).

    With ``cu_seqlens`` every row packs several samples, and every sample gets exactly the ids (and delta) it
    gets alone: text positions restart at each sample boundary and the vision blocks (``grid_thw`` rows, in
    order of appearance over the flattened batch) belong to the samples they appear in. Padding may sit inside
    any sample (``attention_mask``), as it would alone.

    Args:
        variant: a registered variant name or a :class:`Variant`.
        mm_token_type_ids: ``(B, S)`` 0 text, 1 image, 2 video.
        grid_thw: ``(blocks, 3)`` grids in patches before spatial merging, in order of appearance over the
            batch (see :func:`merge_grids` to interleave Hugging Face's image and video grids); None when
            text only.
        attention_mask: ``(B, S)`` 1 real / 0 padding (any padding side); None when all tokens are real.
        spatial_merge_size: patches merged per axis into one decoder token.
        cu_seqlens: packed rows (flash-attention varlen convention, cumulative sample lengths from 0): one 1-D
            tensor ``(n + 1,)`` over the flattened ``B * S`` tokens (for ``B = 1`` the row's own boundaries;
            for ``B > 1`` every row boundary ``b * S`` must be an entry), or one 1-D sequence per row (a list of
            B, or a ``(B, k + 1)`` tensor), each from 0 to ``S``. Samples are numbered in order over the
            flattened batch; equal consecutive entries are empty samples. None: every row is one sample.
        pad_position: the id given to padding slots (1, as the released Qwen2-VL code).
        dtype: output dtype, a real integer or floating dtype; default int64 for integer designs, float32 for
            fractional ones (use float64 for V2PE beyond ~1e6 positions). An integer dtype other than int64 is
            checked (``validate``, one more host read) to hold every id and delta: a position past its range
            would wrap silently. Float dtypes round as they do (float16 / bfloat16 hold integers exactly up to
            2048 / 256).
        validate: check the inputs (one host read of one boolean); False makes the call free of host syncs.
        **options: the design's options, e.g. ``spatial_reset=True``, ``second_per_grid_ts=...``,
            ``temporal_scale=0.75``, ``training=True``, ``stride=64``, ``depth=32``.

    Returns:
        ``position_ids`` ``(A, B, S)`` and ``rope_deltas`` ``(B, 1)`` (``(B, A)`` for PyPE, one per layer):
        the next free position minus the number of real tokens, so a generated token at real index ``n``
        gets ``n + delta`` on every axis (:func:`decode_position_ids`). With ``cu_seqlens``, ``rope_deltas``
        is ``(n, 1)`` (PyPE ``(n, A)``): one row per packed sample, in order over the flattened batch, each
        the sample's own delta (an empty sample's is 0).

    Raises:
        ValueError: unknown variant or option, an option value of the wrong kind (:meth:`Design.options`: a
            number that is not finite, positive and at most 2**20, a bool or string for a number ...), a ``dtype``
            that is not a real integer or floating type, a ``pad_position`` that ``dtype`` cannot hold, token types
            that are not integers, a batch of no tokens (``B = 0`` or ``S = 0``), a ``spatial_merge_size`` that is
            not a positive integer below 2**63, ``cu_seqlens`` of a form not listed above (a string, floats, a dict
            ...), or (``validate``) inputs that do not fit together: token types outside 0/1/2, ids outside an
            integer ``dtype``'s range, a grid row of more tokens than the batch, ``second_per_grid_ts`` that are not
            finite and >= 0, a ``grid_thw`` whose rows do not match the vision blocks, ``cu_seqlens`` that do
            not start at 0, decrease, or do not end at the row length, a vision block straddling a sample
            boundary, or (``cu_seqlens`` with ``attention_mask``) padding between two real tokens of one sample
            (:meth:`vlpe.encodings.multimodal.Samples.holes`).
    """
    v = get_variant(variant)
    design = get_design(v.design)
    opts = design.options({**v.design_options, **options})
    _check_not_empty(mm_token_type_ids, "mm_token_type_ids")
    _check_dtype(dtype)
    layout = token_layout(
        mm_token_type_ids, grid_thw, attention_mask, spatial_merge_size=spatial_merge_size,
        split_frames=design.split_frames, cu_seqlens=cu_seqlens, checks=validate,
    )
    out = design.fn(layout, opts)
    if validate:
        if layout.samples is not None and attention_mask is not None:  # a packed sample is one run of real tokens
            layout.checks.append(layout.samples.holes(layout.valid))
        layout.validate()
    return assemble(layout, out, pad_position=pad_position, dtype=dtype, validate=validate)


def decode_position_ids(
    variant: str | Variant,
    rope_deltas: Tensor,
    cache_position: Tensor,
    *,
    attention_mask: Tensor | None = None,
    **options: Any,
) -> Tensor:
    """Position ids ``(A, B, n)`` of text tokens generated after a prompt.

    A generated token at real-token index ``n`` gets ``n + rope_delta`` on every axis (PyPE: per layer).

    Args:
        variant: the variant the prompt ids were built with (fixes the axis count A).
        rope_deltas: ``(B, 1)`` (or ``(B, A)``) from :func:`position_ids`.
        cache_position: ``(n,)`` or ``(B, n)`` indices of the new tokens in the (padded) sequence.
        attention_mask: ``(B, L)`` mask of the whole sequence so far (prompt + generated, ``L`` beyond the
            largest cache position); needed when the prompt is padded, so that padding is not counted.
            Without it the cache position is taken as the real-token index.
        **options: the design options used for the prompt (PyPE: ``depth``).
    """
    v = get_variant(variant)
    deltas = torch.as_tensor(rope_deltas)
    if deltas.dim() == 1:
        deltas = deltas.unsqueeze(1)
    if deltas.dim() != 2:
        raise ValueError(f"rope_deltas must have shape (B, 1) (or (B, A)), got {tuple(deltas.shape)}")
    A = v.num_axes(**options) if deltas.shape[1] == 1 else deltas.shape[1]
    if deltas.shape[1] not in (1, A):
        raise ValueError(f"{v.label}: rope_deltas must have shape (B, 1) or (B, {A}), got {tuple(deltas.shape)}")
    B = deltas.shape[0]
    cache_position = torch.as_tensor(cache_position, device=deltas.device)
    if cache_position.dim() == 1:
        cache_position = cache_position.unsqueeze(0).expand(B, -1)
    if cache_position.dim() != 2 or cache_position.shape[0] != B:
        raise ValueError(f"cache_position must have shape (n,) or (B={B}, n), got {tuple(cache_position.shape)}")
    cache_position = cache_position.to(torch.int64)
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=deltas.device)
        if mask.dim() != 2 or mask.shape[0] != B:
            raise ValueError(f"attention_mask must have shape (B={B}, L), got {tuple(mask.shape)}")
        real = mask.to(torch.int64).cumsum(-1) - 1  # (B, L) real-token index
        index = real.gather(1, cache_position)
    else:
        index = cache_position
    ids = index.unsqueeze(0).to(deltas.dtype) + deltas.transpose(0, 1).unsqueeze(-1)  # (A', B, n)
    return ids.expand(A, -1, -1)


# --------------------------------------------------------------------------- helpers
def merge_grids(
    mm_token_type_ids: Tensor,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
    attention_mask: Tensor | None = None,
    spatial_merge_size: int = 2,
) -> tuple[Tensor, Tensor]:
    """Interleave Hugging Face's separate image and video grids into order of appearance.

    Returns ``grid_thw (R, 3)`` for :func:`position_ids` and the ``(R,)`` token type (1 image, 2 video) of
    each row. Each row's first token is located by counting the tokens of its modality (one ``cumsum`` and one
    ``searchsorted`` for both modalities).

    Raises:
        ValueError: token types that are not ``(B, S)``, or a grid that does not hold integers (a float grid is
            refused, not truncated).
    """
    types = torch.as_tensor(mm_token_type_ids)
    if types.dim() != 2:
        raise ValueError(f"mm_token_type_ids must have shape (B, S), got {tuple(types.shape)}")
    device = types.device
    m = int(spatial_merge_size)
    given = []  # (kind, (rows, 3) int64 grid) of the modalities with rows, images first
    for kind, g in ((1, image_grid_thw), (2, video_grid_thw)):
        if g is None:
            continue
        g = torch.as_tensor(g, device=device)
        if g.is_floating_point() or g.is_complex() or g.dtype == torch.bool:
            raise ValueError(
                f"{'image' if kind == 1 else 'video'}_grid_thw must hold integers (patches per axis), got dtype "
                f"{g.dtype}: convert it with .long() where its values are whole numbers"
            )
        if g.dtype != torch.int64:  # (a torch call costs more than these checks: none when nothing changes)
            g = g.to(torch.int64)
        if g.dim() != 2 or g.shape[1] != 3:
            g = g.reshape(-1, 3)
        if g.shape[0]:
            given.append((kind, g))
    if not given:
        return torch.zeros(0, 3, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    if len(given) == 1:  # one modality: its rows are already in order of appearance (nothing to count)
        kind, g = given[0]
        return g, torch.full((g.shape[0],), kind, dtype=torch.int64, device=device)
    (_, images), (_, videos) = given  # images first, as Hugging Face lists them
    flat = types.reshape(-1)
    if attention_mask is not None:
        flat = torch.where(torch.as_tensor(attention_mask, device=device).reshape(-1).bool(), flat, 0)
    sel, kinds = _merge_consts(images.shape[0], videos.shape[0], device)
    grids = torch.cat([images, videos])  # (R, 3)
    per = torch.floor_divide(grids, merge_divisor(m, device)).prod(-1) * sel  # (2, R) tokens, in its modality's row
    starts = per.cumsum(1) - per  # (2, R) tokens of the row's modality before it (the other row unused)
    # (2, B S) image / video tokens up to each index: two comparisons written straight into one int64 buffer and
    # one in-place cumsum (half the cost of a broadcast comparison into bools and a cumsum that converts them)
    N = flat.shape[0]
    counts = torch.empty(2, N, dtype=torch.int64, device=device)
    torch.eq(flat, 1, out=counts[0])
    torch.eq(flat, 2, out=counts[1])
    counts.cumsum_(1)
    # (R,) flat index of each row's first token, by counting the tokens of its modality (both modalities in one
    # batched search; the row of the other modality is dropped by the 0/1 selector)
    first = (torch.searchsorted(counts, starts, right=True) * sel).sum(0)
    order = first.argsort(stable=True)  # (R,) image rows first on ties, as they are listed first
    return grids.index_select(0, order), kinds.index_select(0, order)


@functools.lru_cache(maxsize=256)
def _merge_consts(Ri: int, Rv: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`merge_grids`' constants for ``Ri`` image and ``Rv`` video rows, kept per shape (no per-call copy to
    the device): the ``(2, R)`` 0/1 selector of the image (row 0) and video (row 1) rows and the ``(R,)`` type of
    each row."""
    with torch.inference_mode(False):  # kept across calls: ordinary tensors
        kinds = torch.tensor([1] * Ri + [2] * Rv, dtype=torch.int64, device=device)
        return (kinds == torch.tensor([[1], [2]], device=device)).to(torch.int64), kinds


def pype_attention_mask(
    position_ids: Tensor,
    layer: int | None = None,
    attention_mask: Tensor | None = None,
    *,
    cu_seqlens: Tensor | Sequence | None = None,
) -> Tensor:
    """PyPE's attention mask as a keep mask ``(B, 1, S, S)``: query q sees key k iff ``pos(k) <= pos(q)``.

    With PyPE positions this one rule is the method's mask: causal for text (positions increase), inside an
    image a token sees every token of its own or an outer ring (``rho(k) <= rho(q)``, same-ring tokens
    bidirectionally), and image tokens see all earlier text. It replaces the causal mask. ``position_ids``
    is ``(depth, B, S)`` with ``layer`` given, or one layer's ``(B, S)``; ``attention_mask`` (B, S) hides
    padded keys; ``cu_seqlens`` (packed rows, the forms :func:`position_ids` takes and has validated) keeps
    every query inside its own sample (block diagonal).
    """
    ids = torch.as_tensor(position_ids)
    if ids.dim() == 3:
        if layer is None:
            raise ValueError("pass layer= to pick one layer of (depth, B, S) PyPE position ids")
        ids = ids[layer]
    if ids.dim() != 2:
        raise ValueError(f"position_ids must be (depth, B, S) or (B, S), got {tuple(ids.shape)}")
    keep = ids.unsqueeze(-2) <= ids.unsqueeze(-1)  # (B, S_q, S_k): pos(k) <= pos(q)
    if attention_mask is not None:
        keep = keep & attention_mask.bool().unsqueeze(-2)
    if cu_seqlens is not None:
        sample = packed_samples(cu_seqlens, *ids.shape, device=ids.device).index  # (B, S)
        keep = keep & (sample.unsqueeze(-2) == sample.unsqueeze(-1))
    return keep.unsqueeze(1)


def _check_dtype(dtype) -> None:
    """``ValueError`` unless ``dtype`` is None or a real integer / floating torch dtype (not bool or complex)."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or dtype == torch.bool or dtype.is_complex or not (
        dtype.is_floating_point or dtype in _INTEGER_DTYPES
    ):
        raise ValueError(
            f"dtype must be a torch integer or floating dtype for position ids (e.g. torch.int64, the default for "
            f"integer designs, or torch.float32), got {dtype!r}"
        )


_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)


def _check_not_empty(types, what: str) -> None:
    """``ValueError`` for a ``(B, 0)`` batch: ids of no tokens are almost always an upstream bug (an empty
    sample list, a truncation to 0), and several steps index the last token."""
    shape = tuple(getattr(types, "shape", ()))
    if len(shape) == 2 and shape[1] == 0:
        raise ValueError(
            f"{what} has shape {shape}: a batch with no tokens (S = 0) has no position ids; drop empty batches "
            "(or samples) before computing them"
        )


def text_position_ids(
    shape: tuple[int, int] | Tensor,
    attention_mask: Tensor | None = None,
    *,
    cu_seqlens: Tensor | Sequence | None = None,
    device: torch.device | None = None,
    validate: bool = True,
) -> Tensor:
    """The Hugging Face 1D text row ``(B, S)``: every real token's index among the real tokens of its sample.

    Padding slots get 0. Without ``cu_seqlens`` a row is one sample (``cumsum(mask) - 1``); with it (the forms
    :func:`position_ids` takes) the index restarts at every packed sample, which is what Hugging Face models
    read packed sequences from (``position_ids[0]`` of a 4-row tensor, or flash-attention's varlen boundaries).

    Args:
        shape: ``(B, S)``, or a ``(B, S)`` tensor (e.g. ``mm_token_type_ids``) whose shape and device are used.
        attention_mask: ``(B, S)`` 1 real / 0 padding; None: every token is real.
        validate: with ``cu_seqlens`` and ``attention_mask``, check (one host read) that no padding slot sits
            between two real tokens of one sample: the row would restart there and split the sample
            (:meth:`vlpe.encodings.multimodal.Samples.holes`); padding at a sample's start or end is exact.

    Raises:
        ValueError: a mask of another shape, ``cu_seqlens`` that do not fit (see :func:`position_ids`), packed rows
            of no tokens, or (``validate``) padding between two real tokens of one packed sample, naming the
            sample and the slot.
    """
    if isinstance(shape, Tensor):
        device = shape.device if device is None else device
        shape = tuple(shape.shape)
    B, S = (int(n) for n in shape)
    if attention_mask is None:
        valid = torch.ones(B, S, dtype=torch.int64, device=device)
    else:
        valid = torch.as_tensor(attention_mask, device=device)
        if tuple(valid.shape) != (B, S):
            raise ValueError(f"attention_mask must have shape {(B, S)}, got {tuple(valid.shape)}")
        valid = (valid != 0).to(torch.int64)
    if cu_seqlens is None:
        index = valid.cumsum(-1) - valid
    else:
        samples = packed_samples(cu_seqlens, B, S, device=valid.device)
        index, _ = samples.cumsum(valid)
        if validate:
            checks = samples.checks + ([samples.holes(valid)] if attention_mask is not None else [])
            if bool(torch.stack([c.bad.reshape(()) for c in checks]).any()):  # the one host read
                raise ValueError(next(c.message() for c in checks if bool(c.bad)))
    return index * valid  # (B, S)
