"""The named multimodal RoPE variants as vlpe encodings (``vlpe.encodings.build("mrope_i", ...)``).

Each encoding rotates q/k with its variant's frequency allocation, reading ``vlpe.Positions`` whose
coordinates are the variant's position ids, ``coords = position_ids.permute(1, 2, 0)`` i.e. ``(B, S, A)``.
``enc.positions(mm_token_type_ids, grid_thw, ...)`` builds them (the padding becomes ``valid``).
``rope1d`` (1D decoder RoPE) is the core encoding of :mod:`vlpe.encodings.rope`; the multimodal ``rope1d``
variant of :func:`vlpe.encodings.multimodal.rotary` uses the same frequencies and angles.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence

import torch
from torch import Tensor

from ...positions import Positions
from ..base import Context
from ..spec import EncodingSpec
from ..functional.rope import apply_rope, cos_sin, inv_freq, rope_angles, to_half, to_interleaved
from ..registry import construct, register, resolve_spec
from ..rope import RotaryEncoding
from .allocations import allocation_map, axes_of, frequency_matrix
from .variants import VARIANTS, Variant, get_variant
from .variants import position_ids as _position_ids

__all__ = [
    "encoding",
    "MultimodalRoPE",
    "MRoPE",
    "Qwen25VLRoPE",
    "MRoPEInterleave",
    "Qwen3VLRoPE",
    "Qwen35RoPE",
    "MultiHeadRoPE",
    "ILRoPE",
    "OmniRoPE",
    "MMRoPE",
    "CircleRoPE",
    "VideoRoPE",
    "HoPEVideo",
    "VRoPE",
    "V2PE",
    "PyPE",
]


class MultimodalRoPE(RotaryEncoding):
    """Base: a multimodal variant's allocation as an ``(A, D/2)`` frequency buffer (``(H, A, D/2)`` per head).

    ``scaling`` (linear / ntk / yarn, a factor per axis ``t``/``h``/``w``) scales the frequencies of the pairs
    each axis reads, as :func:`vlpe.encodings.multimodal.rotary` does (one shared primitive).
    """

    #: the variant a registered class is a view of (the :data:`VARIANTS` object itself, not a copy of its settings)
    variant: ClassVar[Variant | None] = None
    default_num_axes = 3

    def __init__(
        self,
        *,
        spec: EncodingSpec,
        theta: float | None = None,
        section: Sequence[int] | None = None,
        layout: Literal["half", "interleaved"] = "half",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(spec=spec, layout=layout)
        v = self.active_variant
        self.theta = float(v.theta if theta is None else theta)
        if self.theta <= 0:
            raise ValueError(f"theta must be > 0, got {theta}")
        self.section = None if section is None else tuple(section)
        #: rotation pairs: the first ``2 * rotary_pairs`` channels rotate (partial rotary), the rest pass through
        self.rotary_pairs = v.rotary_dim(self.head_dim) // 2 if self.head_dim % 2 == 0 else 0
        self.band_pairs = self.rotary_pairs
        self.register_buffer("freqs", self._frequencies(), persistent=False)
        self._init_scaling(scaling)

    @classmethod
    def of(cls, variant: str | Variant, *, dim: int, num_heads: int, **options: Any) -> "MultimodalRoPE":
        """The encoding of any variant: the registered view when ``variant`` is a preset, otherwise the class
        its structure needs (per-layer PyPE, per-head ``multi_head``, or this base) holding ``variant``."""
        v = get_variant(variant)
        for sub in _VIEWS:
            if sub.variant == v:
                return construct(sub, dim=dim, num_heads=num_heads, **options)
        klass = PyPE if v.layered else MultiHeadRoPE if v.per_head else MultimodalRoPE
        if klass is MultimodalRoPE and "num_axes" not in options:
            options["num_axes"] = v.num_axes()
        spec, own = resolve_spec(klass, dim=dim, num_heads=num_heads, who=f"variant {v.name or v.design!r}", **options)
        obj = klass.__new__(klass)
        obj.__dict__["_variant"] = v  # read by ``active_variant`` during __init__
        obj.__init__(spec=spec, **own)
        return obj

    @property
    def active_variant(self) -> Variant:
        """The :class:`Variant` this encoding rotates with (``spec`` is the :class:`EncodingSpec` it was built from,
        as for every encoding)."""
        v = self.__dict__.get("_variant") or type(self).variant
        if v is None:
            raise ValueError(f"{type(self).__name__} holds no variant: build it with MultimodalRoPE.of(variant, ...)")
        return v

    def _map(self) -> Tensor:
        v = self.active_variant
        need = axes_of(v.allocation, self.section, self.num_axes)
        if need is not None and need != self.num_axes:
            raise ValueError(
                f"{type(self).__name__}: the {v.allocation} allocation reads {need} position axes, got num_axes="
                f"{self.num_axes}"
            )
        return allocation_map(
            v.allocation, num_pairs=self.rotary_pairs, num_axes=self.num_axes, section=self.section
        )

    def _frequencies(self) -> Tensor:
        if self.head_dim % 2:
            raise ValueError(f"rotary encodings need an even head dim, got {self.head_dim}")
        K = self.rotary_pairs
        base = inv_freq(K, self.theta, dim=2 * K)  # (K,) K = rotary_dim / 2 (D/2 unless partial)
        return frequency_matrix(self._map(), base, self.num_axes)  # (A, K)

    def positions(
        self,
        mm_token_type_ids: Tensor,
        grid_thw: Tensor | None,
        attention_mask: Tensor | None = None,
        spatial_merge_size: int = 2,
        **options,
    ) -> Positions:
        """``vlpe.Positions`` of a multimodal batch for this variant (padding marked invalid)."""
        ids, _ = _position_ids(
            self.active_variant, mm_token_type_ids, grid_thw, attention_mask, spatial_merge_size, **options
        )
        valid = None if attention_mask is None else torch.as_tensor(attention_mask).bool()
        coords = ids.permute(1, 2, 0)
        if not coords.is_floating_point():
            coords = coords.float()
        return Positions(coords, valid=valid)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, theta={self.theta}, section={self.section}"


def encoding(variant: str | Variant, *, dim: int, num_heads: int, **options: Any) -> MultimodalRoPE:
    """Any variant as a vlpe encoding (an ``nn.Module`` rotating q/k with its allocation): the registered view of
    a preset, otherwise the class its structure needs (:meth:`MultimodalRoPE.of`)."""
    return MultimodalRoPE.of(variant, dim=dim, num_heads=num_heads, **options)


#: the registered classes, each a view of one preset of :data:`VARIANTS`, in order of registration
_VIEWS: list[type[MultimodalRoPE]] = []


def _view(name: str) -> Callable[[type[MultimodalRoPE]], type[MultimodalRoPE]]:
    """Class decorator: the class is the encoding of the preset ``VARIANTS[name]``, holds that object itself, reads
    the axis count its design declares (any for a layer-dependent one: its ``depth``) and is registered under its
    one name."""
    variant = VARIANTS[name]

    def deco(cls: type[MultimodalRoPE]) -> type[MultimodalRoPE]:
        cls.variant = variant
        if variant.layered:
            cls.supported_axes = None
        else:
            cls.supported_axes = (variant.num_axes(),)
            cls.default_num_axes = variant.num_axes()
        _VIEWS.append(cls)
        return register(variant.name)(cls)

    return deco


@_view("mrope")
class MRoPE(MultimodalRoPE):
    """MRoPE of Qwen2-VL (Wang et al., arXiv 2409.12191): chunked (t, h, w) pairs, ``mrope_section`` [16, 24, 24].

    Position design ``grid`` (released semantics). Tables checked against transformers'
    ``Qwen2VLRotaryEmbedding`` and ids against ``Qwen2VLModel.get_rope_index``.
    """


@_view("qwen25vl")
class Qwen25VLRoPE(MRoPE):
    """Qwen2.5-VL (Bai et al., arXiv 2502.13923): MRoPE with absolute-time temporal ids, base 1e6.

    Same tables as ``mrope``; the ``absolute_time`` design (t = floor(tau * second_per_grid_t * tokens_per_second))
    is checked against a loop of the released transformers 4.x semantics.
    """


@_view("mrope_i")
class MRoPEInterleave(MultimodalRoPE):
    """MRoPE-Interleave (Huang et al., "Revisiting Multimodal Positional Encoding in VLMs", arXiv 2510.23095).

    Interleaved allocation t h w t h w ... t t t t ([24, 20, 20] at K = 64) so every axis spans the spectrum;
    grid design with optional ``spatial_reset``. Checked against JJJYmmm/Multimodal-RoPEs and transformers'
    ``Qwen3VLTextRotaryEmbedding``.
    """


@_view("qwen3vl")
class Qwen3VLRoPE(MRoPEInterleave):
    """Qwen3-VL (Qwen team 2025): MRoPE-I allocation, per-frame video blocks separated by timestamp text, base 5e6.

    Ids checked against transformers 5.x ``Qwen3VLModel.get_rope_index``; tables against
    ``Qwen3VLTextRotaryEmbedding``.
    """


@_view("qwen35")
class Qwen35RoPE(MRoPEInterleave):
    """Qwen3.5's partial-rotary interleaved MRoPE: a quarter of the head dim rotates, pair ``k`` reads axis ``k mod 3``.

    ``partial_rotary_factor`` 0.25: with head_dim 256 the first 64 channels rotate (K = 32 pairs, half layout of
    those 64 channels, frequencies ``theta ** (-2k / 64)``, base 1e7) and the other 192 pass through; the
    ``round_robin`` allocation gives t, h, w the section [11, 11, 10] (t 0, 3, ..., 30; h 1, 4, ..., 31;
    w 2, 5, ..., 29); ids of the ``per_frame`` design (every video frame its own ``T = 1`` block, as Qwen3-VL).

    Reference: Qwen team, Qwen3.5 (2026). Tables checked against transformers 5.24
    ``Qwen3_5TextRotaryEmbedding`` + ``apply_rotary_pos_emb`` (huggingface/transformers, the installed release) and
    ids against ``Qwen3_5Model.get_rope_index``; the allocation as JJJYmmm/Multimodal-RoPEs @ cd413b9
    (``freq_allocation/mrope_i.py``, ``tests/test_qwen35_partial_rope.py``).
    """

    #: a quarter of a 16-channel head is 2 pairs, too few for the property kit to see NTK scaling at base 1e7
    example: ClassVar[dict] = {"dim": 256}


@_view("mhrope")
class MultiHeadRoPE(MultimodalRoPE):
    """Multi-Head RoPE (Huang et al., arXiv 2510.23095): whole KV heads per axis ([2, 3, 3] of 8), GQA aware.

    ``section`` counts KV heads per axis; query head ``j`` uses the axis of KV head ``j // (H / H_kv)``;
    heads beyond the section sum carry no position. Checked against JJJYmmm/Multimodal-RoPEs ``mhrope``.
    """

    takes_kv_heads = True

    def __init__(self, *, spec: EncodingSpec, **kwargs) -> None:
        self.num_kv_heads = spec.num_heads if spec.num_kv_heads is None else spec.num_kv_heads
        super().__init__(spec=spec, **kwargs)

    def _map(self) -> Tensor:
        H, Hkv = self.num_heads, self.num_kv_heads
        if Hkv is None or Hkv < 1 or H % Hkv:
            raise ValueError(f"num_kv_heads must divide num_heads={H}, got {Hkv}")
        amap = allocation_map(self.active_variant.allocation, num_pairs=self.rotary_pairs, section=self.section,
                              num_kv_heads=Hkv)  # (H_kv, K)
        return amap.repeat_interleave(H // Hkv, dim=0)  # (H, D/2): query head j reads KV head j // rep


@_view("ilrope")
class ILRoPE(MRoPEInterleave):
    """IL-RoPE of Mogao (Liao et al., arXiv 2505.05472): interleaved (t, h, w) pairs over a reset visual layout.

    Every vision unit (an image, or one video frame) sits at ``(s + stride * tau, i, j)``: time carries the running
    position ``s``, height and width restart at 0 in every unit; text resumes at ``s + max(stride * (T - 1), H - 1,
    W - 1) + 1`` (design ``per_frame`` with ``spatial_reset=True``). Allocation ``interleaved`` ([24, 20, 20] at
    K = 64). Text-only input is 1D RoPE; text-to-image logits on the h, w pairs depend on the text's absolute index.

    Reference: no official code of IL-RoPE is public; checked against JJJYmmm/Multimodal-RoPEs @ cd413b9
    (``pos_design/ilrope.py`` = ``pos_design/omnirope.py``, ``freq_allocation/mrope_i.py``), the implementation of
    the Qwen-team survey (Huang et al., arXiv 2510.23095), re-derived in the tests as a loop.
    """


@_view("omnirope")
class OmniRoPE(MRoPE):
    """Omni-RoPE of OmniGen2 (Wu et al., arXiv 2506.18871): chunked (t, h, w) pairs over a reset visual layout.

    Ids as :class:`ILRoPE` (every vision unit at ``(shift, row, col)``, the shift advancing by the unit's largest
    extent); allocation ``chunked`` [16, 24, 24] (t the highest-frequency band), as Qwen2-VL.

    Reference: OmniGen2's released code applies it to diffusion image tokens; the Qwen-style token layout is checked
    against JJJYmmm/Multimodal-RoPEs @ cd413b9 (``pos_design/omnirope.py``, ``freq_allocation/mrope.py``).
    """


@_view("mmrope")
class MMRoPE(MultimodalRoPE):
    """MM-RoPE of Lumos-1 (Yuan et al., arXiv 2507.08801): distributed meta components ``t t h w h w h w``.

    Pair ``k`` reads axis ``(0, 0, 1, 2, 1, 2, 1, 2)[k mod 8]`` (2 : 3 : 3, [16, 24, 24] at K = 64), so every axis has
    pairs in every frequency band; ids of the ``scaled_frames`` design, the grid with each axis scaled by
    ``position_scale`` (default (1, 1, 1); Lumos-1 scales latent coordinates toward pixel ones, e.g. (4, 8, 8)).

    Reference: checked against JJJYmmm/Multimodal-RoPEs @ cd413b9 (``pos_design/mmrope.py``,
    ``freq_allocation/mmrope.py``); Lumos-1's own code was not available to this library.
    """


@_view("circlerope")
class CircleRoPE(MRoPE):
    """Circle-RoPE (Wang et al., arXiv 2505.16416): every image on a circle orthogonal to the text diagonal.

    Each vision unit (an image, or one video frame) has its grid centred, mapped onto a circle of radius ``r`` = 10
    (angle ``alpha`` = 0.5 times the polar angle normalised to a full turn over the unit, plus ``1 - alpha`` times
    the token's raster share of a turn) in the plane orthogonal to ``(1, 1, 1)``, and shifted by the running
    position ``s`` on every axis: every vision token is equally far from the text positions ``(s, s, s)``. Text
    resumes at the unit's largest id + 1; allocation ``chunked`` [16, 24, 24] (Qwen2.5-VL's). Video frames are
    separate units (the released code handles images; frames as Qwen3-VL blocks follow JJJYmmm/Multimodal-RoPEs).
    Not implemented: the released per-layer alternation with MRoPE ids (``AGE_mode``), ``dff_rate``,
    ``move_to_positive`` and the ``auto`` radius.

    Reference: lose4578/CircleRoPE @ 063fb2c (``code/circle_rope.py`` ``get_circle_rope_index``, config radius 10,
    alpha 0.5, ``move_to_origin``), and JJJYmmm/Multimodal-RoPEs @ cd413b9 (``pos_design/circlerope.py``).
    """


@_view("videorope")
class VideoRoPE(MultimodalRoPE):
    """VideoRoPE (Wei et al., ICML 2025, arXiv 2502.05173): low-frequency temporal allocation + diagonal layout.

    Pairs below K - 16 alternate h/w, the 16 lowest-frequency pairs read t; ids from the ``diagonal`` design
    with delta = 2. Checked against Wiselnn570/VideoRoPE ``get_t_scale_rope_index`` and
    ``apply_m_modify_multimodal_rotary_pos_emb``.
    """


@_view("hope_video")
class HoPEVideo(MultimodalRoPE):
    """HoPE for video (Li et al., NeurIPS 2025, arXiv 2505.20444): hybrid allocation + dynamic temporal scaling.

    As VideoRoPE, with the lowest-frequency band carrying no position (text included, so text-only HoPE is
    1D RoPE with that band unrotated); gamma fixed at inference, drawn per block in training. Checked against
    hrlics/HoPE ``apply_hybrid_multimodal_rotary_pos_emb`` and ``get_dynamic_rope_index``.
    """


@_view("vrope")
class VRoPE(MultimodalRoPE):
    """VRoPE (Liu et al., EMNLP 2025, arXiv 2502.11664): four diagonal coordinates, pair k reads ``U_{k mod 4}``.

    Frames tile the index line without gaps and the mean coordinate is constant within a frame. Checked
    against johncaged/VRoPE ``generate_nd_positions``.
    """


@_view("v2pe")
class V2PE(MultimodalRoPE):
    """V2PE (Ge et al., arXiv 2412.09616): 1D RoPE with fractional increments delta = stride / 256 in images.

    Plain 1D frequencies on float positions; ids checked against OpenGVLab/V2PE ``get_rope_pos_id``.
    """


@_view("pype")
class PyPE(MultimodalRoPE):
    """PyPE (Chen et al., arXiv 2501.10967): per-layer concentric ring positions plus the ring attention mask.

    Positions have one axis per decoder layer (``num_axes = depth``; 1 shares one axis over all layers);
    layer ``l`` rotates with 1D RoPE at axis ``l``. With ``mask=True`` the ``score`` hook adds PyPE's mask,
    key k visible to query q iff ``pos_l(k) <= pos_l(q)`` (it replaces the causal mask: do not also pass
    ``is_causal``). Checked against SakuraTroyChen/PyPE ``pype_forward``.
    """

    def __init__(self, *, spec: EncodingSpec, mask: bool = True, **kwargs) -> None:
        self.mask = bool(mask)
        depth, num_axes = spec.depth, spec.num_axes
        if num_axes not in (None, 1, depth):
            raise ValueError(
                f"PyPE positions have one axis per layer: num_axes must be 1 or depth={depth}, got {num_axes}"
            )
        super().__init__(spec=spec, **kwargs)

    @classmethod
    def axes_for(cls, spec: EncodingSpec) -> int:
        return spec.depth  # one axis per layer

    @property
    def pieces(self) -> frozenset[str]:
        """The rotation, and the ring mask (a score; its per-head form is registered in
        :mod:`vlpe.attention_forms.pype`) only with ``mask=True``."""
        return frozenset({"rotate", "score"} if self.mask else {"rotate"})

    def _frequencies(self) -> Tensor:
        if self.head_dim % 2:
            raise ValueError(f"rotary encodings need an even head dim, got {self.head_dim}")
        if self.section is not None:
            raise ValueError("PyPE uses plain 1D frequencies; it takes no section")
        K = self.rotary_pairs
        return inv_freq(K, self.theta, dim=2 * K).unsqueeze(0)  # (1, K)

    def positions(self, mm_token_type_ids, grid_thw, attention_mask=None, spatial_merge_size=2, **options):
        """Per-layer PyPE positions ``(B, S, depth)`` for this encoding's depth (see the base class)."""
        if self.num_axes != self.depth:
            raise ValueError(f"PyPE.positions builds one axis per layer; build the encoding with num_axes=depth "
                             f"({self.depth}), got num_axes={self.num_axes}")
        options.setdefault("depth", self.depth)
        return super().positions(mm_token_type_ids, grid_thw, attention_mask, spatial_merge_size, **options)

    def _axis(self, layer: int) -> int:
        if not 0 <= layer < self.depth:
            raise ValueError(f"PyPE: layer must be in [0, depth={self.depth}), got {layer}")
        return 0 if self.num_axes == 1 else layer

    def _scaling_probe(self) -> Tensor:
        return self.freqs.expand(self.num_axes, -1)

    def _prepare(self, ctx: Context) -> None:
        ctx["coords"] = ctx.pos.coords  # per-layer tables are built in rotate (they differ per layer)
        ctx["freqs"] = self.scaled(self.freqs.expand(self.num_axes, -1))  # (A, D/2): row a for the layers of axis a

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        a = self._axis(layer)
        coords = ctx["coords"][..., a : a + 1]  # (B, N, 1)
        cos, sin = self.temper(*cos_sin(rope_angles(coords, ctx["freqs"][a : a + 1])))  # (B, N, D/2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.layout == "interleaved":
            return to_interleaved(apply_rope(to_half(q), cos, sin)), to_interleaved(apply_rope(to_half(k), cos, sin))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        if not self.mask:
            return None
        a = self._axis(layer)
        p = ctx["coords"][..., a]  # (B, N)
        pq = p if rows is None else p[:, rows]
        forbid = p.unsqueeze(1) > pq.unsqueeze(2)  # (B, n, N): pos(k) > pos(q)
        bias = torch.zeros(forbid.shape, dtype=q.dtype, device=q.device).masked_fill(forbid, float("-inf"))
        return bias.unsqueeze(1)  # (B, 1, n, N)

    def neutralize(self) -> "PyPE":
        self.freqs.zero_()
        self.mask = False
        return self

