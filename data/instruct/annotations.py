"""Reading and validating LLaVA / ShareGPT-style instruction annotations, and turning a sample into chat messages.

The format is the one LLaVA-Video-178K and the common Qwen2-VL fine-tuning sets use: a JSON list (or JSONL, one
object per line) of samples, each with an optional ``id``, at most one of ``video`` / ``image`` (a path relative to
the media folder, or a list of paths) and ``conversations``, a list of turns ``{"from": "human" | "gpt" |
"system", "value": text}``: an optional leading system turn, then human and gpt turns alternating, starting with
human and ending with gpt. Media placeholders (``<video>``, ``<image>``) appear in human turns, one per media file;
LLaVA-Video-178K writes ``<image>`` for its videos, so a video sample accepts either. A sample with media and no
placeholder gets all its media at the start of its first human turn. Keys other than these are kept and ignored.
Every problem raises :class:`AnnotationError` naming the file, the sample and the field.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

__all__ = ["AnnotationError", "read_annotations", "validate_sample", "validate_samples", "sample_media",
           "to_messages", "PLACEHOLDERS", "ROLES"]  # fmt: skip

PLACEHOLDERS = {"video": ("<video>", "<image>"), "image": ("<image>",)}  # accepted placeholders per media kind
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
_PLACEHOLDER = re.compile(r"\n?(<video>|<image>)\n?")  # one newline on each side belongs to the placeholder


class AnnotationError(ValueError):
    """A malformed annotation file or sample; the message names the file, the sample index and the field."""


def _fail(source: str, where: str, message: str) -> AnnotationError:
    return AnnotationError(f"{source}: {where}: {message}" if where else f"{source}: {message}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def read_annotations(path: str | os.PathLike) -> list[dict]:
    """The validated samples of an annotation file: a JSON list of objects, or JSONL (one object per line; blank
    lines are allowed). The format is read from the content (a file starting with ``[`` is a JSON list), so a
    ``.json`` file holding JSONL works too. Raises :class:`AnnotationError` (the file, and for JSONL the line)."""
    path = Path(path)
    source = path.name
    if not path.is_file():
        raise AnnotationError(f"{path}: no such annotation file; expected a JSON list of samples or a JSONL file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise AnnotationError(f"{path}: not UTF-8 text ({err}); annotation files are JSON or JSONL") from None
    body = text.lstrip("\ufeff \t\r\n")
    if not body:
        raise AnnotationError(f"{path}: the file is empty; expected a JSON list of samples or JSONL")
    lines: list[int] | None = None
    if body.startswith("["):
        try:
            samples = json.loads(body)
        except json.JSONDecodeError as err:
            raise AnnotationError(f"{path}: not valid JSON: {err}") from None
    elif body.startswith("{"):
        try:  # a whole-file JSON object that spans several lines is neither a list nor JSONL
            whole = json.loads(body)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and len([ln for ln in text.splitlines() if ln.strip()]) > 1:
            raise AnnotationError(f"{path}: expected a JSON list of samples (or JSONL, one object per line), got "
                                  f"one JSON object with keys {list(whole)[:5]}")  # fmt: skip
        samples, lines = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise AnnotationError(
                    f"{path}: line {number}: not valid JSON ({err}); a JSONL file holds one sample object per line"
                ) from None
            samples.append(obj)
            lines.append(number)
    else:
        raise AnnotationError(
            f"{path}: expected a JSON list of samples ('[...]') or JSONL (one '{{...}}' per line), "
            f"got text starting with {body[:20]!r}"
        )
    if not isinstance(samples, list):
        raise AnnotationError(f"{path}: expected a JSON list of samples, got a JSON {_type_name(samples)}")
    if not samples:
        raise AnnotationError(f"{path}: the list of samples is empty")
    validate_samples(samples, source=source, lines=lines)
    return samples


def validate_samples(samples: Sequence[Any], *, source: str = "annotations",
                     lines: Sequence[int] | None = None) -> None:  # fmt: skip
    """Validate every sample (see :func:`validate_sample`); ``lines`` (JSONL) adds each sample's line number."""
    if isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Sequence):
        raise AnnotationError(f"{source}: expected a list of sample dicts, got {_type_name(samples)}")
    for i, sample in enumerate(samples):
        where = f"sample {i}" if lines is None else f"sample {i} (line {lines[i]})"
        validate_sample(sample, source=source, where=where)


def _media_field(sample: dict, source: str, where: str) -> tuple[str | None, list[str]]:
    kinds = [k for k in ("video", "image") if k in sample]
    if len(kinds) > 1:
        raise _fail(source, where, "has both 'video' and 'image'; a sample holds one kind of media (split it)")
    if not kinds:
        return None, []
    kind = kinds[0]
    value = sample[kind]
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths:
        raise _fail(source, where, f"{kind} must be a path string or a non-empty list of path strings, "
                                   f"got {_type_name(value)} {value!r}"[:300])  # fmt: skip
    for j, p in enumerate(paths):
        field = kind if isinstance(value, str) else f"{kind}[{j}]"
        if not isinstance(p, str) or not p.strip():
            raise _fail(source, where, f"{field} must be a non-empty path string, got {_type_name(p)} {p!r}")
    return kind, list(paths)


def validate_sample(sample: Any, *, source: str = "annotations", where: str = "sample") -> None:
    """Raise :class:`AnnotationError` unless ``sample`` follows the format of the module docstring."""
    if not isinstance(sample, dict):
        raise _fail(source, where, f"expected a JSON object with 'conversations', got {_type_name(sample)}")
    if "id" in sample and (isinstance(sample["id"], bool) or not isinstance(sample["id"], (str, int))):
        raise _fail(source, where, f"id must be a string or an integer, got {_type_name(sample['id'])}")
    kind, paths = _media_field(sample, source, where)
    if "conversations" not in sample:
        raise _fail(source, where, "has no 'conversations' (a list of {'from': ..., 'value': ...} turns)")
    turns = sample["conversations"]
    if not isinstance(turns, list) or not turns:
        raise _fail(source, where, f"conversations must be a non-empty list of turns, got {_type_name(turns)}")
    count = 0
    expected = "human"
    for j, turn in enumerate(turns):
        field = f"conversations[{j}]"
        if not isinstance(turn, dict):
            raise _fail(source, where, f"{field} must be an object {{'from': ..., 'value': ...}}, "
                                       f"got {_type_name(turn)}")  # fmt: skip
        for key in ("from", "value"):
            if key not in turn:
                raise _fail(source, where, f"{field} has no '{key}'")
        speaker, value = turn["from"], turn["value"]
        if speaker not in ROLES:
            raise _fail(source, where, f"{field}.from must be 'human', 'gpt' or 'system', got {speaker!r}")
        if not isinstance(value, str):
            raise _fail(source, where, f"{field}.value must be a string, got {_type_name(value)}")
        if speaker == "gpt" and not value.strip():
            raise _fail(source, where, f"{field}.value is empty; a gpt turn needs the answer text")
        if speaker == "system":
            if j != 0:
                raise _fail(source, where, f"{field}.from is 'system'; only the first turn may be a system turn")
        elif speaker != expected:
            raise _fail(source, where, f"{field}.from must be {expected!r} (turns alternate human, gpt, ... "
                                       f"after an optional leading system turn), got {speaker!r}")  # fmt: skip
        else:
            expected = "gpt" if speaker == "human" else "human"
        found = _PLACEHOLDER.findall(value)
        if found and speaker != "human":
            raise _fail(source, where, f"{field}.value holds {found[0]} in a {speaker} turn; media placeholders "
                                       "belong in human turns")  # fmt: skip
        if found and kind is None:
            raise _fail(source, where, f"{field}.value holds {found[0]} but the sample has no 'video' or 'image'")
        bad = [p for p in found if kind is not None and p not in PLACEHOLDERS[kind]]
        if bad:
            raise _fail(source, where, f"{field}.value holds {bad[0]} in an image sample; use <image>")
        count += len(found)
    if expected != "human":  # no human turn, or a human turn without an answer at the end
        got = "only a system turn" if len(turns) == 1 else "a last human turn with no gpt answer"
        raise _fail(source, where, f"conversations must end with a gpt turn (the answer to learn), got {got}")
    if count and count != len(paths):
        raise _fail(source, where, f"conversations hold {count} media placeholder(s) but {kind} lists {len(paths)} "
                                   f"file(s); use one <{kind}> per file, or none (all media then precede the first "
                                   "human turn)")  # fmt: skip


def sample_media(sample: dict) -> tuple[str | None, list[str]]:
    """``(kind, paths)`` of a validated sample: ``"video"`` / ``"image"`` / None and its paths as given."""
    return _media_field(sample, "annotations", "sample")


def _content(value: str, kind: str | None) -> list[dict]:
    items: list[dict] = []
    for k, piece in enumerate(_PLACEHOLDER.split(value)):
        if k % 2:  # a placeholder
            items.append({"type": kind})
        elif piece:
            items.append({"type": "text", "text": piece})
    return items


def to_messages(sample: dict) -> list[dict]:
    """Chat-template messages of a validated sample: ``{"role": "user" | "assistant" | "system", "content":
    [{"type": "video" | "image"}, {"type": "text", "text": ...}, ...]}``, the media items where the placeholders
    were (a newline right before or after a placeholder is part of it), or at the start of the first user turn
    when the sample has none."""
    kind, paths = sample_media(sample)
    messages = [{"role": ROLES[t["from"]], "content": _content(t["value"], kind)} for t in sample["conversations"]]
    if paths and not any(item["type"] == kind for m in messages for item in m["content"]):
        first = next(m for m in messages if m["role"] == "user")
        first["content"][:0] = [{"type": kind} for _ in paths]
    return messages
