"""The one interface every encoding implements.

An encoding is an ``nn.Module`` that the attention stack consults at fixed points. Heavy tables (cos/sin,
bucket indices, masks) are built once per forward by :meth:`Encoding.prepare` and shared by all layers
through the returned :class:`Context`; the hooks then read them.

===========================================  ==============================================  =================
hook                                         used by                                         default
===========================================  ==============================================  =================
``embed(x, ctx)`` tokens in/out, before      ape, sincos, fourier                            identity
block 0
``mix(x, ctx, layer)`` after block ``layer``  peg                                             identity
``rotate(q, k, ctx, layer)``                 rope family, comrope, string, mrope family      identity
``widen(q, k, ctx, layer)`` extra q/k        pape, pape_ri (folded bias)                     identity
features
``score(q, k, ctx, layer, rows=)`` additive  irpe, lookhere, alibi, pype mask                None
bias/mask for the query ``rows``
``values(attn, ctx, layer)`` extra output    irpe on values                                  None
term from attention probabilities
===========================================  ==============================================  =================

Which hooks an encoding has is data, not introspection: the class declares ``pieces`` (an instance may
narrow them, e.g. iRPE without a values term), and :meth:`Encoding.prepare` returns a :class:`Context` whose
``plan`` (:class:`vlpe.encodings.plan.Plan`) says per layer which pieces exist. Attention consults the plan
only. The whole contract (order, softmax scale, key padding, shapes) is in :mod:`vlpe.encodings.plan`.
Faster forms of a ``score`` (lattice tables, per-head builders, FlexAttention ``score_mod`` / ``block_mask``) are
not hooks: the attention registers them per encoding class (:mod:`vlpe.attention_forms`), and the plan marks the
layers that have them.

Build-time facts (width, heads, depth, axes, training grid, KV heads) arrive as one
:class:`vlpe.encodings.spec.EncodingSpec` (``cls(spec=spec, **options)``, see :func:`vlpe.encodings.build`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from ..positions import Positions
from .plan import CTX_ARG, PIECES, Plan, forms_of
from .spec import EncodingSpec

__all__ = [
    "Context", "Encoding", "LatticeBias", "HOOKS", "CLAIMS", "HALF_PLANES", "NOT_SCRIPTABLE", "apply_keeping_fp32",
]

#: the contract's hooks (the one list, :data:`vlpe.encodings.plan.PIECES`, under its public name)
HOOKS = PIECES

#: Properties an encoding may claim; :mod:`vlpe.testing` checks each claim over the whole registry.
CLAIMS = frozenset(
    {
        "relative",  # logits unchanged when every non-prefix position shifts by one constant
        "extrapolation",  # the sub-block of a larger grid equals the smaller grid
        "neutral",  # ``neutralize()`` makes the encoding exactly equal to ``nope``
        "zero_init",  # a freshly built encoding is exactly ``nope``
        "rotation_invariant",  # logits unchanged when the coordinates rotate (continuous coordinates)
        "fp32_angles",  # under bf16 autocast, angles/distances stay fp32 (large coordinates stay exact)
    }
)


#: Why ``torch.jit.script`` refuses every encoding (and any model holding one), and what to use instead.
NOT_SCRIPTABLE = (
    "TorchScript cannot compile a vlpe position encoding: it is consulted through vlpe.Positions and a per-forward "
    "Context (Python objects holding dict tables, a per-layer plan and optional hooks), which TorchScript's static "
    "types do not express. Use torch.compile, or trace with torch.fx keeping the tokenizer and the attention as "
    "leaf modules (timm's FX helpers do so for the vlpe_vit_* models)"
)

#: Half-planes a head's field of view may lie in, for :class:`LatticeBias`: "up" = key row <= query row,
#: "down" = key row >= query row, "left" = key column <= query column, "right" = key column >= query column.
HALF_PLANES = ("up", "down", "left", "right")


@dataclass(frozen=True)
class LatticeBias:
    """An encoding's bias on lattice positions (``Positions.lattice``, grid ``(h, w)``) as one offset table.

    Attributes:
        table: ``(H', 2h - 1, 2w - 1)`` (``H'`` = H, or 1 shared by the heads), indexed by the key-minus-query
            grid offset ``(dy, dx)`` of a patch query and a patch key at ``[:, dy + h - 1, dx + w - 1]``: their
            bias (float), or with ``values`` their bucket (int64).
        half_planes: per head None or one of :data:`HALF_PLANES`: the table masks every key outside that
            half-plane of the query (a bias whose attention weight is exactly 0), so the fast path may skip
            those keys without changing the result.
        values: None, or ``values(q, head) -> (B, m, K)``: the bias of each of ``m`` queries of head ``head``
            (``q`` (B, m, Dh) as they enter attention) for each of ``K`` buckets (iRPE's contextual term).
        prefix_bias: float tables: ``(H',)`` bias of every pair with a prefix token (None: 0).
        prefix_bucket: bucket tables: the bucket of every pair with a prefix token.

    Every pair with a prefix token has one bias per head (per query for bucket tables), so a prefix query
    sees the same bias on every key: softmax ignores it, and the fast path attends prefix queries without it.
    """

    table: Tensor
    half_planes: tuple[str | None, ...]
    values: Callable[[Tensor, int], Tensor] | None = None
    prefix_bias: Tensor | None = None
    prefix_bucket: int = 0

    def __post_init__(self) -> None:
        if self.table.dim() != 3 or len(self.half_planes) < self.table.shape[0]:
            raise ValueError(
                f"LatticeBias needs a (H or 1, 2h-1, 2w-1) table and one half-plane (or None) per head, got a "
                f"table of shape {tuple(self.table.shape)} and {len(self.half_planes)} half-planes"
            )
        bad = [p for p in self.half_planes if p is not None and p not in HALF_PLANES]
        if bad:
            raise ValueError(f"LatticeBias half-planes must be None or one of {HALF_PLANES}, got {bad}")
        if (self.values is not None) != (not self.table.is_floating_point()):
            raise ValueError("LatticeBias: a float table is the bias; an int64 bucket table needs values=")


class Context:
    """Per-forward state of an encoding: the positions and the tables built from them once.

    ``tables`` is a plain dict the encoding fills in :meth:`Encoding.prepare`; layers only read it.
    ``owner`` is the encoding that prepared it: its hooks refuse a context prepared by another one.
    ``plan`` says which pieces exist per layer (:class:`vlpe.encodings.plan.Plan`); set by ``prepare``.
    """

    __slots__ = ("pos", "tables", "training", "owner", "plan")

    def __init__(self, pos: Positions, *, training: bool = False, owner: "Encoding | None" = None) -> None:
        self.pos = pos
        self.tables: dict[str, Any] = {}
        self.training = training
        self.owner = owner
        self.plan: Plan | None = None

    def __getitem__(self, key: str) -> Any:
        try:
            return self.tables[key]
        except KeyError:
            who = "an unknown encoding" if self.owner is None else type(self.owner).__name__
            raise ValueError(
                f"this Context has no table {key!r}: it was prepared by {who}; pass the ctx that this "
                f"encoding's own prepare(pos) returned"
            ) from None

    def __setitem__(self, key: str, value: Any) -> None:
        self.tables[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tables

    def __repr__(self) -> str:
        return f"Context({self.pos!r}, tables={sorted(self.tables)})"


def _spec_hint(cls: type, args: tuple, kwargs: dict) -> str:
    """The error for an encoding class called without ``spec=EncodingSpec(...)``: what it got and how to build it."""
    if args:
        got = f"{len(args)} positional argument(s)"
    elif "spec" not in kwargs:
        got = f"keyword(s) {sorted(kwargs)} without spec="
    else:
        got = f"spec={kwargs['spec']!r} (a {type(kwargs['spec']).__name__}, not an EncodingSpec)"
    name = cls.__name__
    return (
        f"{name} is built from spec=EncodingSpec(dim=..., num_heads=..., ...) plus its own keyword options, got {got}; "
        f"build it with vlpe.encodings.construct({name}, dim=64, num_heads=4, **options) (any Encoding class, "
        f"checked like build) or vlpe.encodings.build(name, dim=64, num_heads=4, **options) for a registered name"
    )


class Encoding(nn.Module):
    """Base class: identity hooks, option validation and the per-forward :class:`Context`.

    Subclasses set ``name`` (via :func:`vlpe.encodings.register`), ``claims`` (a subset of
    :data:`CLAIMS`), ``pieces`` (the hooks they implement, a subset of
    :data:`vlpe.encodings.plan.PIECES`: the attention calls exactly these), ``supported_axes`` (allowed
    coordinate dimensionalities, None for any), ``default_num_axes``, ``needs_grid`` (True when the encoding
    reads the regular grid, e.g. a convolution), ``example`` (options of one small example configuration, used
    by the property kit, the demo and the benchmarks), implement the hooks they declare, and fill ``ctx`` in
    :meth:`_prepare`. What serves one caller is registered with that caller, not declared here: the faster forms
    of a ``score`` and the fast-path threshold (:mod:`vlpe.attention_forms`), the bases RPE-2D can re-sample
    (:data:`vlpe.encodings.rpe2d.BASES`), the learned tables a timm ``pos_embed`` initialises
    (:data:`vlpe.integrations.timm.ABSOLUTE_TABLES`).
    """

    name: ClassVar[str] = ""
    claims: ClassVar[frozenset[str]] = frozenset()
    #: keep this module's own floating parameters and buffers at their exact fp32 values through
    #: ``.half()`` / ``.bfloat16()`` / DeepSpeed casts (frequencies, slopes, generators, projections whose
    #: rounding would break exact relativity or the cancellation of large terms)
    keep_fp32: ClassVar[bool] = False
    supported_axes: ClassVar[tuple[int, ...] | None] = None
    #: the axis count when the spec leaves it open (see :meth:`axes_for`)
    default_num_axes: ClassVar[int] = 2
    needs_grid: ClassVar[bool] = False
    #: the hooks this encoding implements (data: the plan is built from it, nothing inspects methods)
    pieces: ClassVar[frozenset[str]] = frozenset()
    #: options of one small example configuration (property kit, demo, benchmarks); ``num_axes`` comes from
    #: :meth:`axes_for` unless given here
    example: ClassVar[dict[str, Any]] = {}
    #: reads ``spec.num_kv_heads`` (grouped-query decoders); ``build`` rejects the option for the others
    takes_kv_heads: ClassVar[bool] = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "Encoding":
        # checked before any subclass __init__ reads spec.dim, so ``IRPE(dim=64, ...)`` and ``IRPE(spec={...})``
        # get this message instead of Python's unexpected-keyword or an AttributeError of a dict; no arguments
        # at all is the copy / pickle protocol (``copyreg.__newobj__``), left to __init__
        if args or kwargs:
            spec = kwargs.get("spec")
            if args or not isinstance(spec, EncodingSpec):
                raise TypeError(_spec_hint(cls, args, kwargs))
        return super().__new__(cls)

    def __init__(self, *, spec: EncodingSpec) -> None:
        super().__init__()
        if not isinstance(spec, EncodingSpec):
            raise TypeError(_spec_hint(type(self), (), {"spec": spec}))
        if spec.num_axes is None:
            spec = spec.with_axes(self.axes_for(spec))
        dim, num_heads, depth, num_axes = spec.dim, spec.num_heads, spec.depth, spec.num_axes
        if self.supported_axes is not None and num_axes not in self.supported_axes:
            raise ValueError(
                f"{type(self).__name__} supports {' or '.join(map(str, self.supported_axes))} coordinate axes, "
                f"got num_axes={num_axes}"
            )
        for attr, allowed in (("claims", CLAIMS), ("pieces", frozenset(PIECES))):
            declared = getattr(type(self), attr)  # class data (a property answers per instance, unchecked)
            bad = sorted(declared - allowed) if isinstance(declared, frozenset) else []
            if bad:
                raise TypeError(f"{type(self).__name__} declares unknown {attr} {bad}; allowed: {sorted(allowed)}")
        self.spec = spec  # the EncodingSpec it was built with (num_axes resolved): the one meaning of ``spec``
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.depth = depth
        self.num_axes = num_axes

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook, at in CTX_ARG.items():  # every hook a subclass defines checks the ctx it is given
            fn = cls.__dict__.get(hook)
            if callable(fn) and fn is not getattr(Encoding, hook) and not hasattr(fn, "_checks_ctx"):
                setattr(cls, hook, _checking_ctx(fn, hook, at))

    @classmethod
    def axes_for(cls, spec: EncodingSpec) -> int:
        """The axis count when ``spec.num_axes`` is None (override when it depends on the spec, e.g. depth)."""
        return cls.default_num_axes

    @classmethod
    def examples(cls) -> tuple[dict[str, Any], ...]:
        """Example configurations the property kit runs (default: the one ``example``; a wrapper gives one per
        encoding it can wrap)."""
        return (dict(cls.example),)

    def check_layer(self, layer: int) -> None:
        """Raise ``ValueError`` unless ``0 <= layer < depth`` (for encodings with per-layer state)."""
        if not 0 <= layer < self.depth:
            raise ValueError(
                f"{type(self).__name__} was built with depth={self.depth} (one set per layer), got layer={layer}; "
                f"build it with depth= the number of attention blocks of the model"
            )

    def check_x(self, x: Tensor, ctx: Context, who: str) -> None:
        """Raise ``ValueError`` unless tokens ``x`` are ``(B, N, dim)`` with N the positions' token count."""
        if not isinstance(x, Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{who}: tokens must be (B, N, C), got {shape}; add the batch dimension")
        if x.shape[-1] != self.dim:
            raise ValueError(f"{who}: tokens have width {x.shape[-1]}, expected dim={self.dim}")
        self.check_tokens(x, ctx, who, dim=1)
        if ctx.pos.batch not in (1, x.shape[0]):
            raise ValueError(f"{who}: positions have batch {ctx.pos.batch} but the tokens have batch {x.shape[0]}")

    def __prepare_scriptable__(self) -> "Encoding":
        """``torch.jit.script`` calls this on every submodule before compiling: a ``RuntimeError`` giving the reason
        (:data:`NOT_SCRIPTABLE`) instead of an unsupported-annotation error from deep inside an encoding."""
        raise RuntimeError(NOT_SCRIPTABLE)

    def _apply(self, fn, recurse=True):
        if not self.keep_fp32:
            return super()._apply(fn, recurse)
        return apply_keeping_fp32(self, super()._apply, fn, recurse)

    # ------------------------------------------------------------------ per forward
    def prepare(self, pos: Positions) -> Context:
        """Validate ``pos`` and build the tables every layer of this forward will share."""
        if not isinstance(pos, Positions):
            raise ValueError(f"{type(self).__name__}.prepare expects vlpe.Positions, got {type(pos).__name__}")
        if pos.num_axes != self.num_axes:
            raise ValueError(
                f"{type(self).__name__} was built for num_axes={self.num_axes} but positions have "
                f"{pos.num_axes} axes; build it with num_axes={pos.num_axes}"
            )
        if self.needs_grid and pos.grid is None:
            raise ValueError(
                f"{type(self).__name__} needs tokens on a regular grid (Positions.grid / .video / .grid_nd); "
                f"these positions have none (point clouds or ragged batches)"
            )
        ctx = Context(pos, training=self.training, owner=self)
        self._prepare(ctx)
        ctx.plan = self._plan(ctx).with_forms(forms_of(self))  # forms: registered by the attention backends
        return ctx

    def _prepare(self, ctx: Context) -> None:
        """Fill ``ctx`` with this encoding's tables (override)."""

    def _plan(self, ctx: Context) -> Plan:
        """The plan of this forward: ``pieces`` on every layer (override when pieces depend on the positions
        or differ per layer)."""
        return Plan.uniform(self.pieces, self.depth)

    # ------------------------------------------------------------------ hooks
    def embed(self, x: Tensor, ctx: Context) -> Tensor:
        return x

    def mix(self, x: Tensor, ctx: Context, layer: int) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        return q, k

    def widen(self, q: Tensor, k: Tensor, ctx: Context, layer: int) -> tuple[Tensor, Tensor]:
        return q, k

    def score(self, q: Tensor, k: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        return None

    def values(self, attn: Tensor, ctx: Context, layer: int, rows: slice | None = None) -> Tensor | None:
        return None

    def neutralize(self) -> "Encoding":
        """Set parameters so the encoding equals ``nope`` (for encodings that claim ``neutral``)."""
        raise NotImplementedError(f"{type(self).__name__} has no neutral setting")

    # ------------------------------------------------------------------ declared pieces
    @property
    def hooks(self) -> tuple[str, ...]:
        """The main hooks among this encoding's declared ``pieces``, in :data:`HOOKS` order (for reports)."""
        return tuple(h for h in HOOKS if h in self.pieces)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, depth={self.depth}, num_axes={self.num_axes}"

    def no_weight_decay(self) -> set[str]:
        """Parameter names (relative to this module) to exclude from weight decay."""
        return set()

    @staticmethod
    def check_tokens(t: Tensor, ctx: Context, who: str, dim: int = -2) -> None:
        if t.shape[dim] != ctx.pos.num_tokens:
            raise ValueError(
                f"{who}: the input has {t.shape[dim]} tokens but positions describe {ctx.pos.num_tokens}"
            )


def _checking_ctx(fn: Callable, hook: str, at: int) -> Callable:
    """``fn`` (a hook) behind a check that its ``ctx`` is a :class:`Context` this encoding prepared
    (Python-level: no tensor is read)."""

    @functools.wraps(fn)
    def checked(self, *args, **kwargs):
        ctx = args[at] if len(args) > at else kwargs.get("ctx")
        owner = getattr(ctx, "owner", None) if isinstance(ctx, Context) else self
        if not isinstance(ctx, Context) or owner is not None and owner is not self:
            got = type(ctx).__name__ if not isinstance(ctx, Context) else f"a Context of {type(owner).__name__}"
            raise ValueError(
                f"{type(self).__name__}.{hook} needs the Context returned by this encoding's prepare(pos), "
                f"got {got}; call ctx = enc.prepare(pos) once per forward and pass it to every hook"
            )
        return fn(self, *args, **kwargs)

    checked._checks_ctx = True  # type: ignore[attr-defined]
    return checked


def fp32(t: Tensor) -> Tensor:
    """``t`` as float32 (float64 kept): the precision for angles, distances and coordinate math."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


_FULL = (torch.float32, torch.float64)


def apply_keeping_fp32(module: nn.Module, apply, fn, recurse: bool) -> nn.Module:
    """``nn.Module._apply`` (passed as ``apply``) that keeps ``module``'s own floating parameters and buffers
    at their exact fp32 values when ``fn`` casts to bf16/fp16 (same Parameter objects; device moves apply).

    For angle generators, bases and coordinate projections, whose rounding would break exact relativity or
    the cancellation of large terms. Values are restored from before the cast, not upcast from rounded ones.
    """
    params = {n: (p.data, p.grad) for n, p in module.named_parameters(recurse=False)}
    buffers = {n: b for n, b in module.named_buffers(recurse=False) if b is not None and b.is_floating_point()}
    apply(fn, recurse)
    for n, p in module.named_parameters(recurse=False):
        if p.dtype not in _FULL:
            data, grad = params[n]
            p.data = data.to(device=p.device, dtype=torch.float32)
            if p.grad is not None:
                p.grad = (grad if grad is not None else p.grad).to(device=p.device, dtype=torch.float32)
    for n, b in buffers.items():
        now = getattr(module, n)
        if now.dtype not in _FULL:
            setattr(module, n, b.to(device=now.device, dtype=torch.float32))
    return module
