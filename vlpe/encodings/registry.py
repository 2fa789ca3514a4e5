"""Name -> encoding class (plus preset options). Unknown names and options are errors, never ignored."""

from __future__ import annotations

import difflib
import inspect
import numbers
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from .base import Encoding
from .spec import SPEC_FIELDS, EncodingSpec

__all__ = ["register", "available", "build", "construct", "get", "options_of", "by_class"]

E = TypeVar("E", bound=type[Encoding])


@dataclass(frozen=True)
class _Entry:
    cls: type[Encoding]
    defaults: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, *, defaults: dict[str, Any] | None = None) -> Callable[[E], E]:
    """Class decorator: ``@register("rope")``. ``defaults`` make a preset (e.g. ``lh90`` of LookHere).

    The first name a class is registered under becomes its ``name``.
    """

    def deco(cls: E) -> E:
        if not (isinstance(cls, type) and issubclass(cls, Encoding)):
            raise TypeError(f"register({name!r}) expects an Encoding subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"encoding name {name!r} is already registered to {_REGISTRY[name].cls.__name__}")
        opts = dict(defaults or {})
        bad = set(opts) - options_of(cls)
        if bad:
            raise TypeError(f"preset {name!r} sets options {sorted(bad)} that {cls.__name__} does not take")
        _REGISTRY[name] = _Entry(cls, opts)
        if "name" not in cls.__dict__:
            cls.name = name
        return cls

    return deco


def register_preset(name: str, base: str, **defaults: Any) -> None:
    """Register ``name`` as ``base`` with different default options."""
    entry = get_entry(base)
    register(name, defaults={**entry.defaults, **defaults})(entry.cls)


def by_class(table: dict, enc_or_cls: Any) -> Any:
    """The entry of a per-class table (the caller-side registries: fast forms, RPE-2D bases, timm tables) for an
    encoding or class: that of the nearest class of its MRO, so subclasses inherit it; None when none is registered."""
    cls = enc_or_cls if isinstance(enc_or_cls, type) else type(enc_or_cls)
    return next((table[c] for c in cls.__mro__ if c in table), None)


def available() -> list[str]:
    """Sorted names of every registered encoding (presets included)."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def get_entry(name: str) -> _Entry:
    _ensure_loaded()
    if not isinstance(name, str) or name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown encoding {name!r}{hint} Registered encodings: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def get(name: str) -> type[Encoding]:
    """The class registered under ``name``."""
    return get_entry(name).cls


def options_of(cls: type[Encoding]) -> set[str]:
    """Keyword options ``build`` accepts for a class: the spec facts (:data:`SPEC_FIELDS`) and the constructor's
    own options (following ``**kwargs`` up the MRO)."""
    names: set[str] = {f for f in SPEC_FIELDS if f != "num_kv_heads" or cls.takes_kv_heads}
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__ or klass is object:
            continue
        sig = inspect.signature(klass.__dict__["__init__"])
        var_kw = False
        for p in list(sig.parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                var_kw = True
            elif p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "spec":
                names.add(p.name)
        if not var_kw:
            break
    return names


def build(name: str, *, dim: int, num_heads: int, **options: Any) -> Encoding:
    """Build the encoding registered as ``name`` for a model of width ``dim`` with ``num_heads`` heads.

    ``options`` are the model facts of :class:`EncodingSpec` (``depth``, ``num_axes``, ``grid``,
    ``num_kv_heads``: every encoding takes them and ignores those it has no use for) and the encoding's own
    keyword options; an option it does not take raises ``ValueError`` listing those it does.
    """
    entry = get_entry(name)
    return construct(entry.cls, dim=dim, num_heads=num_heads, who=f"encoding {name!r}", **{**entry.defaults, **options})


def construct(cls: type[Encoding], *, dim: int, num_heads: int, who: str | None = None, **options: Any) -> Encoding:
    """:func:`build` for a class (registered or not): ``cls(spec=EncodingSpec(...), **own_options)``."""
    spec, own = resolve_spec(cls, dim=dim, num_heads=num_heads, who=who, **options)
    return cls(spec=spec, **own)


def resolve_spec(cls: type[Encoding], *, dim: int, num_heads: int, who: str | None = None,
                 **options: Any) -> tuple[EncodingSpec, dict[str, Any]]:  # fmt: skip
    """The :class:`EncodingSpec` and the class's own options that :func:`construct` passes to ``cls``, checked
    (unknown options, option types, the spec's facts) with errors naming ``who``."""
    who = who or f"encoding {cls.__name__}"
    accepted = options_of(cls)
    unknown = sorted(set(options) - accepted)
    if unknown:
        valid = ", ".join(sorted(accepted))
        raise ValueError(f"{who} does not take option(s) {unknown}; it takes: {valid}")
    facts = {k: options.pop(k) for k in SPEC_FIELDS if k in options}
    check_option_types(cls, options, who=who)
    try:
        spec = EncodingSpec(dim=dim, num_heads=num_heads, **facts)
        if spec.num_axes is None:
            spec = spec.with_axes(cls.axes_for(spec))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{who}: {e}") from None
    return spec, options


def _scalar_kinds(annotation: Any) -> tuple[type, ...] | None:
    """The scalar types (int, float, str) an annotation allows, None allowed as ``type(None)``; None when the
    annotation is anything else (sequences, tensors, literals: left to the encoding's own checks)."""
    if annotation in (int, float, str):
        return (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds: list[type] = []
        for a in typing.get_args(annotation):
            if a is type(None):
                kinds.append(a)
            elif a in (int, float, str):
                kinds.append(a)
            else:
                return None
        return tuple(kinds)
    return None


def _fits(value: Any, kind: type) -> bool:
    if kind is type(None):
        return value is None
    if isinstance(value, bool):  # True is an int to Python, never a size or a frequency base here
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def check_option_types(cls: type[Encoding], options: dict[str, Any], *, who: str) -> None:
    """Raise ``ValueError`` for an option whose value does not fit the constructor's int / float / str
    annotation (e.g. ``theta="100"``); other annotations are left to the encoding."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            hints.update(typing.get_type_hints(init))
        except Exception:  # unresolvable annotations: nothing to check against
            continue
    for key, value in options.items():
        kinds = _scalar_kinds(hints.get(key))
        if kinds is not None and not any(_fits(value, k) for k in kinds):
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{who}: option {key}={value!r} must be {names}, got {type(value).__name__}")


_LOADED = False


def _ensure_loaded() -> None:
    """Import every module of ``vlpe.encodings`` once, so their ``@register`` calls run. The package is walked by
    its folder and name (this module's own), not through the package object: ``vlpe.encodings`` imports this
    module, which therefore imports nothing from it back."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages([str(Path(__file__).parent)], prefix=__package__ + "."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf.startswith("_") or ".functional" in info.name:
            continue
        importlib.import_module(info.name)
