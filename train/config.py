"""Typed, validated YAML configs with dotted command-line overrides.

A config file has one section per dataclass field of the script's config class (``model``, ``data``,
``train``, ``deepspeed``). Every key is checked: a typo is an error listing the valid keys, a value of
the wrong type is an error naming the expected type. Files are read with ``yaml.safe_load`` only.

    cfg = load_config(ViTConfig, "configs/vit_lookhere.yaml", ["train.steps=50", "model.encoding=rope"])
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

__all__ = [
    "ConfigError", "load_config", "resolve_config_path", "from_dict", "to_dict", "parse_overrides", "read_mapping",
    "config_keys",
]  # fmt: skip

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value that does not fit the schema; the message says what would."""


def _suggest(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} fits none of {tp}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        out = [_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string; it is a float to every user
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls: type[T], data: dict | None, *, where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and ill-typed values."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"{where}: unknown key {k!r}{_suggest(k, list(fields))}; valid keys: {', '.join(fields)}"
        )
    kwargs = {k: _check_type(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line saying why the YAML safe loader refused a text: its own problem and position, and for a
    ``!!python/...`` (or other unknown) tag that configs hold plain values only."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    text = " ".join(f"{problem}{where}".split())
    if isinstance(e, yaml.constructor.ConstructorError) and "tag" in text:
        text += ("; configs hold plain values only (numbers, strings, lists, mappings): the safe loader never "
                 "builds Python objects from !!python tags, remove the tag")  # fmt: skip
    return text


def _safe_yaml(text: str, *, what: str) -> Any:
    """``yaml.safe_load(text)``; ``ConfigError`` naming ``what`` (a file, an override) when it is not valid YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {_yaml_problem(e)}") from None


def _read_text(path: Path, *, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not a text file (byte {e.start} is not UTF-8: is it a binary file?); "
            f"give a YAML or JSON file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {os.strerror(e.errno) if e.errno else e}") from None


def _override_leaves(items: Sequence[str]) -> list[tuple[list[str], Any, str]]:
    """``(dotted key parts, value parsed as YAML, the item as given)`` of every command-line override."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        value = _safe_yaml(raw, what=f"the value of override {item!r}") if raw != "" else ""
        out.append((key.strip().split("."), value, item))
    return out


def parse_overrides(items: Sequence[str]) -> dict:
    """``["train.steps=10", "model.encoding=rope"]`` -> nested dict (values parsed as YAML scalars)."""
    out: dict = {}
    for parts, value, item in _override_leaves(items):
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {p!r}")
        node[parts[-1]] = value
    return out


def _section_class(tp: Any) -> type | None:
    """The dataclass a field holds (``Section`` or ``Section | None``), else ``None`` (a mapping, a plain value)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def _check_override(cls: type, parts: Sequence[str], value: Any, where: str, *, prefix: Sequence[str] = ()) -> None:
    """``ConfigError`` naming the command-line override (``where``) for an unknown key or an ill-typed value; the
    keys of mappings (``deepspeed``, ``encoding_options``) are checked where they are used."""
    node, path = cls, list(prefix)
    for i, part in enumerate(parts):
        fields = [f.name for f in dataclasses.fields(node)]
        if part not in fields:
            section = f"section {'.'.join(path)}" if path else "top level"
            raise ConfigError(
                f"{where} ({section}): unknown key {part!r}{_suggest(part, fields)}; valid keys: {', '.join(fields)}"
            )
        tp = typing.get_type_hints(node)[part]
        path.append(part)
        sub = _section_class(tp)
        if i < len(parts) - 1:
            if sub is None:
                return
            node = sub
        elif sub is not None and isinstance(value, dict):  # a whole section: each of its keys as an override
            for key, inner in value.items():
                _check_override(sub, [str(key)], inner, where, prefix=path)
        else:
            _check_type(value, tp, f"{where} ({'.'.join(path)})")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """YAML mapping at ``path``; an ``inherit: other.yaml`` key merges this file over that one."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config inheritance loops through {path}")
    data = _safe_yaml(_read_text(path, what="config file"), what=f"config file {str(path)!r}") or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    inherit = data.pop("inherit", None)
    if inherit is not None:
        data = _merge(_read(path.parent / inherit, seen + (path.resolve(),)), data)
    return data


def read_mapping(path: str | Path, *, what: str) -> dict:
    """A YAML or JSON file (safe loader) whose top level is a mapping; ``ConfigError`` naming ``what`` and the path
    when it is missing or is not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist; give the path of a JSON or YAML file")
    text = _read_text(path, what=what)
    try:
        data = yaml.safe_load(text)  # JSON is YAML: DeepSpeed's JSON files read as they are
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON or YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{what} {str(path)!r} must hold a mapping of keys at the top level, got {kind}")
    return data


#: the checkout root: a relative ``--config`` path not found from the current folder is read from here
ROOT = Path(__file__).resolve().parents[1]


def resolve_config_path(path: str | Path) -> Path:
    """``path`` as given when it exists (absolute, or relative to the current folder), else relative to the
    checkout root (so ``--config configs/...`` works from any folder); ``ConfigError`` naming both places."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    rooted = ROOT / path
    if rooted.is_file():
        return rooted
    raise ConfigError(
        f"config file {str(path)!r} does not exist: looked in {Path.cwd() / path} (the current folder) and {rooted} "
        f"(the checkout root); give a path to a YAML file, e.g. configs/vit_rope.yaml"
    )


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = (), *,
                sections: dict | None = None) -> T:  # fmt: skip
    """Read ``path`` (YAML, safe loader; a relative path not found from the current folder is read from the
    checkout root, :func:`resolve_config_path`), merge ``sections`` (e.g. ``{"deepspeed": {...}}`` from a
    ``--deepspeed_config`` file) over it, then the dotted ``overrides``, and validate into ``cls``. A mistake in an
    override is reported against that override (``command-line override 'train.stpes=5' ...``), a mistake in the
    file against the file."""
    leaves = _override_leaves(overrides)
    for parts, value, item in leaves:
        _check_override(cls, parts, value, f"command-line override {item!r}")
    data = _read(resolve_config_path(path)) if path is not None else {}
    if sections:
        data = _merge(data, sections)
    data = _merge(data, parse_overrides(overrides))
    return from_dict(cls, data, where=str(path) if path else "config")


def _show(value: Any) -> str:
    """A default as it is written in a YAML file or an override (``null``, ``true``, ``[2, 4]``, ``{}``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text.removesuffix("...").strip()


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default as YAML, note)`` of every key of the config class ``cls``, from its defaults; the
    note lists a key's allowed values (``Literal`` types)."""
    out: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            out.append((key, "(required)", ""))
            continue
        if dataclasses.is_dataclass(default):
            out += config_keys(type(default), f"{key}.")
            continue
        tp = hints[f.name]
        choices = [a for a in typing.get_args(tp) if typing.get_origin(tp) is typing.Literal]
        note = f"one of {', '.join(map(str, choices))}" if choices else ""
        out.append((key, _show(default), note))
    return out
