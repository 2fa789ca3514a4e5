"""Reading and validating instruction annotations in the formats of the common fine-tuning stacks, and turning a
sample into chat messages.

A file is a JSON list of sample objects, or JSONL (one object per line). Three formats are read; the format of a
file is detected from its first sample (``format="auto"``) or given (``data.format``), and every sample of the file
must follow it:

* ``llava`` (LLaVA, LLaVA-Video-178K, 2U1/Qwen2-VL-Finetune, ms-swift's and LLaMA-Factory's ShareGPT): a sample has
  ``conversations``, a list of turns ``{"from": ..., "value": text}`` (``from``: ``human`` / ``user``, ``gpt`` /
  ``assistant`` / ``bot``, ``system``), and media under ``image`` / ``video`` (a path or a list of paths) or
  ``images`` / ``videos`` (lists).
* ``sharegpt`` (LLaMA-Factory's and ms-swift's ``messages``): ``messages``, a list of ``{"role": ..., "content":
  text}`` with the same roles, media under ``images`` / ``videos`` lists, and an optional top-level ``system`` text.
* ``qwen`` (the Qwen-VL model cards, qwen-vl-utils): ``messages`` whose ``content`` is a list of items
  ``{"type": "text", "text": ...}``, ``{"type": "image", "image": path}`` or ``{"type": "video", "video": path or
  [frame paths]}``; a media item may set ``fps``, ``nframes``, ``max_frames``, ``min_pixels`` and ``max_pixels``,
  which override the run's settings for that item. ``file://`` is stripped from paths; a text-only turn may be a
  plain string.

In ``llava`` and ``sharegpt`` samples, ``<image>`` / ``<video>`` placeholders in user turns mark where each media
file goes, in order, one per file and kind; a kind with no placeholder puts all its files at the start of the first
user turn (images before videos). A video-only sample whose placeholders are all ``<image>``, one per video, reads
them as the videos' (LLaVA-Video-178K writes them so). A video given as a list of frame files (a nested list, or a
``video`` / ``videos`` list whose every entry is an image file) is one video made of those frames. One newline on
each side of a placeholder belongs to it.

The turns of every format obey one rule: an optional leading system turn, then user and assistant turns
alternating, starting with a user turn and ending with an assistant turn whose text is not empty; media sit in user
turns. Texts must be valid Unicode (a lone surrogate such as ``"\\ud800"`` is valid JSON but no text). Paths are
local files: ``http(s)://`` and other URLs are refused (nothing is downloaded). Keys other than these are kept and
ignored. Every problem raises :class:`AnnotationError` naming the file, the sample and the field.

:func:`parse_sample` turns a sample of any format into the one form the dataset reads: ``{"id": ..., "format":
..., "messages": [{"role": "system" | "user" | "assistant", "content": [items]}]}`` with items ``{"type": "text",
"text": ...}``, ``{"type": "image", "image": path}`` and ``{"type": "video", "video": path}`` or ``{"type":
"video", "frames": [paths]}`` (plus the item's own settings); adjacent text items are joined. A sample of one format and the same
sample written in another parse to equal messages.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

__all__ = ["AnnotationError", "read_annotations", "detect_format", "parse_sample", "parse_samples",
           "validate_sample", "validate_samples", "sample_media", "chat_messages", "to_messages", "FORMATS",
           "PLACEHOLDERS", "ROLES", "MEDIA_OPTIONS"]  # fmt: skip

#: the annotation formats and what marks each (the error for an unknown file lists them)
FORMATS = {
    "llava": "'conversations' of {'from', 'value'} turns with 'image' / 'video' (or 'images' / 'videos'): LLaVA, "
             "2U1/Qwen2-VL-Finetune, LLaMA-Factory / ms-swift ShareGPT",
    "sharegpt": "'messages' of {'role', 'content': text} with 'images' / 'videos' lists: LLaMA-Factory, ms-swift",
    "qwen": "'messages' whose 'content' is a list of {'type': 'text' | 'image' | 'video', ...} items: Qwen-VL, "
            "qwen-vl-utils",
}  # fmt: skip
PLACEHOLDERS = {"video": ("<video>", "<image>"), "image": ("<image>",)}  # accepted placeholders per media kind
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
         "system": "system"}  # fmt: skip
#: the settings a ``qwen`` media item may carry (they override the run's for that item)
MEDIA_OPTIONS = {"fps": float, "nframes": int, "max_frames": int, "min_pixels": int, "max_pixels": int}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_PLACEHOLDER = re.compile(r"\n?(<video>|<image>)\n?")  # one newline on each side belongs to the placeholder
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# per format: the list of turns, the role field, the text field
_KEYS = {"llava": ("conversations", "from", "value"), "sharegpt": ("messages", "role", "content"),
         "qwen": ("messages", "role", "content")}  # fmt: skip


class AnnotationError(ValueError):
    """A malformed annotation file or sample; the message names the file, the sample index and the field."""


def _fail(source: str, where: str, message: str) -> AnnotationError:
    return AnnotationError(f"{source}: {where}: {message}" if where else f"{source}: {message}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _formats_text() -> str:
    return "; ".join(f"{name}: {what}" for name, what in FORMATS.items())


def read_annotations(path: str | os.PathLike, *, format: str = "auto") -> list[dict]:
    """The validated samples of an annotation file, as written: a JSON list of objects, or JSONL (one object per
    line; blank lines are allowed). The layout is read from the content (a file starting with ``[`` is a JSON
    list), so a ``.json`` file holding JSONL works too.

    Args:
        path (str | os.PathLike): the annotation file.
        format (str): ``"auto"`` (detected from the first sample) or one of :data:`FORMATS`.

    Returns:
        list[dict]: the samples; :func:`parse_samples` gives their common form.

    Raises:
        AnnotationError: naming the file, and the sample (for JSONL its line) and field.
    """
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
        samples = _loads(body, f"{path}")
    elif body.startswith("{"):
        try:  # a whole-file JSON object that spans several lines is neither a list nor JSONL
            whole = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            whole = None
        if isinstance(whole, dict) and len([ln for ln in text.splitlines() if ln.strip()]) > 1:
            raise AnnotationError(f"{path}: expected a JSON list of samples (or JSONL, one object per line), got "
                                  f"one JSON object with keys {list(whole)[:5]}")  # fmt: skip
        samples, lines = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            samples.append(_loads(line, f"{path}: line {number}", jsonl=True))
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
    validate_samples(samples, source=source, lines=lines, format=format)
    return samples


def _loads(text: str, where: str, *, jsonl: bool = False) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        hint = "; a JSONL file holds one sample object per line" if jsonl else ""
        raise AnnotationError(f"{where}: not valid JSON ({err}){hint}") from None
    except RecursionError:
        raise AnnotationError(f"{where}: the JSON is nested too deeply to read (thousands of levels); a sample is "
                              "an object of turns and media paths, a few levels deep") from None  # fmt: skip


def detect_format(sample: Any, *, source: str = "annotations", where: str = "sample 0") -> str:
    """The format (a key of :data:`FORMATS`) of a sample: ``llava`` with ``conversations``; with ``messages``,
    ``qwen`` when a message's content is a list of items, else ``sharegpt``.

    Raises:
        AnnotationError: the sample has neither key; the message lists the formats.
    """
    if isinstance(sample, dict) and "conversations" in sample:
        return "llava"
    if isinstance(sample, dict) and isinstance(sample.get("messages"), list):
        lists = any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in sample["messages"])
        return "qwen" if lists else "sharegpt"
    keys = list(sample)[:6] if isinstance(sample, dict) else _type_name(sample)
    raise _fail(source, where, f"matches no annotation format (keys {keys}); the formats read are {_formats_text()}; "
                               "set data.format to check a file against one")  # fmt: skip


def _check_format(format: str) -> None:
    if format != "auto" and format not in FORMATS:
        raise AnnotationError(f"format must be 'auto' or one of {list(FORMATS)}, got {format!r}")


def validate_samples(samples: Sequence[Any], *, source: str = "annotations", lines: Sequence[int] | None = None,
                     format: str = "auto") -> str:  # fmt: skip
    """Validate every sample (see :func:`parse_sample`); ``lines`` (JSONL) adds each sample's line number.
    Returns the format of the samples (detected when ``format="auto"``)."""
    return parse_samples(samples, source=source, lines=lines, format=format)[0]["format"]


def parse_samples(samples: Sequence[Any], *, source: str = "annotations", lines: Sequence[int] | None = None,
                  format: str = "auto") -> list[dict]:  # fmt: skip
    """The common form (:func:`parse_sample`) of every sample, all of one format (detected from the first one
    when ``format="auto"``)."""
    _check_format(format)
    if isinstance(samples, (str, bytes, dict)) or not isinstance(samples, Sequence):
        raise AnnotationError(f"{source}: expected a list of sample dicts, got {_type_name(samples)}")
    if not samples:
        raise AnnotationError(f"{source}: the list of samples is empty")
    fmt, decided = format, None
    if fmt == "auto":
        first = "sample 0" if lines is None else f"sample 0 (line {lines[0]})"
        fmt, decided = detect_format(samples[0], source=source, where=first), 0
        if fmt == "sharegpt":  # a qwen file may open with text-only samples (plain string contents)
            decided = next((i for i, s in enumerate(samples) if isinstance(s, dict) and "messages" in s
                            and detect_format(s, source=source) == "qwen"), None)  # fmt: skip
            fmt, decided = ("qwen", decided) if decided is not None else ("sharegpt", 0)
    out = []
    for i, sample in enumerate(samples):
        where = f"sample {i}" if lines is None else f"sample {i} (line {lines[i]})"
        try:
            out.append(parse_sample(sample, format=fmt, source=source, where=where))
        except AnnotationError as err:
            if decided is None or decided == i:
                raise
            raise AnnotationError(f"{err} [the file was read in the {fmt} format, detected from sample {decided}; "
                                  "every sample of a file has one format: convert this one, or set data.format]"
                                  ) from None  # fmt: skip
    return out


def validate_sample(sample: Any, *, source: str = "annotations", where: str = "sample", format: str = "auto") -> None:
    """Raise :class:`AnnotationError` unless ``sample`` follows its format (module docstring)."""
    parse_sample(sample, format=format, source=source, where=where)


# paths ------------------------------------------------------------------------------------------------------------
def _path(value: Any, source: str, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, where, f"{field} must be a non-empty path string, got {_type_name(value)} {value!r}"[:300])
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif _URL.match(value):
        raise _fail(source, where, f"{field} is a URL ({value[:80]}); media are read from local files only (nothing "
                                   "is downloaded): download it and give its path")  # fmt: skip
    _text(value, source, where, field)
    return value


def _is_image_file(path: str) -> bool:
    return path.lower().endswith(IMAGE_SUFFIXES)


def _media_lists(sample: dict, source: str, where: str) -> dict[str, list[dict]]:
    """``{"image": [items], "video": [items]}`` of a llava / sharegpt sample's media keys."""
    out: dict[str, list[dict]] = {"image": [], "video": []}
    for kind in ("image", "video"):
        present = [k for k in (kind, kind + "s") if k in sample]
        if len(present) > 1:
            raise _fail(source, where, f"has both '{kind}' and '{kind}s'; give the files under one of them")
        if not present:
            continue
        key = present[0]
        value = sample[key]
        entries = [value] if isinstance(value, str) else value
        if not isinstance(entries, list) or not entries:
            raise _fail(source, where, f"{key} must be a path string or a non-empty list of path strings, "
                                       f"got {_type_name(value)} {value!r}"[:300])  # fmt: skip
        if kind == "video" and len(entries) > 1 and all(isinstance(e, str) and _is_image_file(e) for e in entries):
            entries = [entries]  # a list of image files is the frames of one video
        for j, entry in enumerate(entries):
            field = key if isinstance(value, str) else f"{key}[{j}]"
            if kind == "video" and isinstance(entry, list):
                if not entry:
                    raise _fail(source, where, f"{field} is an empty list of frames; give the frame files in order")
                out[kind].append({"type": "video", "frames": [_path(p, source, where, f"{field}[{k}]")
                                                              for k, p in enumerate(entry)]})  # fmt: skip
                continue
            path = _path(entry, source, where, field)
            if kind == "video" and _is_image_file(path):
                raise _fail(source, where, f"{field} is an image file ({path}) among video files; give a video made "
                                           "of frame files as a nested list of them, e.g. [[\"f0.jpg\", \"f1.jpg\"]]")
            out[kind].append({"type": kind, kind: path})
    return out


def _text(value: str, source: str, where: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _fail(source, where, f"{field} holds {value[err.start]!r} at character {err.start}, a lone surrogate "
                                   "that is not valid Unicode text (JSON allows the escape, a tokenizer does not); "
                                   "fix the text") from None  # fmt: skip


# turns ------------------------------------------------------------------------------------------------------------
def _split(value: str) -> list[dict]:
    items: list[dict] = []
    for k, piece in enumerate(_PLACEHOLDER.split(value)):
        if k % 2:  # a placeholder: its kind is resolved against the sample's media
            items.append({"type": "placeholder", "text": piece})
        elif piece:
            items.append({"type": "text", "text": piece})
    return items


def _qwen_item(item: Any, source: str, where: str, field: str) -> dict:
    if not isinstance(item, dict):
        raise _fail(source, where, f"{field} must be an object {{'type': 'text' | 'image' | 'video', ...}}, "
                                   f"got {_type_name(item)}")  # fmt: skip
    kind = item.get("type")
    if kind is None:  # qwen-vl-utils also reads an item by its key alone
        kind = next((k for k in ("text", "image", "video") if k in item), None)
    if kind not in ("text", "image", "video"):
        raise _fail(source, where, f"{field}.type must be 'text', 'image' or 'video', got {kind!r}")
    if kind not in item:
        raise _fail(source, where, f"{field} is a {kind} item without a '{kind}' key")
    if kind == "text":
        if not isinstance(item["text"], str):
            raise _fail(source, where, f"{field}.text must be a string, got {_type_name(item['text'])}")
        _text(item["text"], source, where, f"{field}.text")
        return {"type": "text", "text": item["text"]}
    unknown = [k for k in item if k not in ("type", kind, *MEDIA_OPTIONS)]
    if unknown:
        raise _fail(source, where, f"{field} sets {unknown}, which are not read; a media item may set "
                                   f"{list(MEDIA_OPTIONS)}")  # fmt: skip
    value = item[kind]
    if kind == "video" and isinstance(value, list):
        if not value:
            raise _fail(source, where, f"{field}.video is an empty list of frames")
        out = {"type": "video", "frames": [_path(p, source, where, f"{field}.video[{k}]") for k, p in enumerate(value)]}
    else:
        out = {"type": kind, kind: _path(value, source, where, f"{field}.{kind}")}
    for key, tp in MEDIA_OPTIONS.items():
        if key not in item:
            continue
        v = item[key]
        ok = not isinstance(v, bool) and isinstance(v, (int, float) if tp is float else int) and v > 0
        if ok and key in ("nframes", "max_frames"):
            ok = v >= 2
        if not ok:
            need = ">= 2 (a temporal patch is 2 frames)" if key in ("nframes", "max_frames") else "> 0"
            raise _fail(source, where, f"{field}.{key} must be a {'number' if tp is float else 'integer'} {need}, "
                                       f"got {v!r}")  # fmt: skip
        if kind == "image" and key not in ("min_pixels", "max_pixels"):
            raise _fail(source, where, f"{field}.{key} is a video setting; an image item may set min_pixels and "
                                       "max_pixels")  # fmt: skip
        out[key] = tp(v)
    if "min_pixels" in out and "max_pixels" in out and out["min_pixels"] > out["max_pixels"]:
        raise _fail(source, where, f"{field}.min_pixels ({out['min_pixels']}) exceeds max_pixels ({out['max_pixels']})")
    return out


def _turns(sample: dict, fmt: str, source: str, where: str) -> list[dict]:
    """``[{"role", "content": [items]}]`` of a sample's turns, roles mapped, placeholders unresolved."""
    turns_key, role_key, text_key = _KEYS[fmt]
    if turns_key not in sample:
        other = [f for f in FORMATS if f != fmt and _KEYS[f][0] in sample]
        hint = f" (it has '{_KEYS[other[0]][0]}': a {other[0]} sample)" if other else ""
        raise _fail(source, where, f"has no '{turns_key}' (the {fmt} format: {FORMATS[fmt]}){hint}; every sample of "
                                   "a file has the format of its first, or of data.format")  # fmt: skip
    turns = sample[turns_key]
    if not isinstance(turns, list) or not turns:
        raise _fail(source, where, f"{turns_key} must be a non-empty list of turns, got {_type_name(turns)}")
    out = []
    for j, turn in enumerate(turns):
        field = f"{turns_key}[{j}]"
        if not isinstance(turn, dict):
            raise _fail(source, where, f"{field} must be an object {{'{role_key}': ..., '{text_key}': ...}}, "
                                       f"got {_type_name(turn)}")  # fmt: skip
        for key in (role_key, text_key):
            if key not in turn:
                raise _fail(source, where, f"{field} has no '{key}'")
        speaker, value = turn[role_key], turn[text_key]
        if not isinstance(speaker, str) or speaker not in ROLES:
            raise _fail(source, where, f"{field}.{role_key} must be one of {list(ROLES)}, got {speaker!r}")
        if isinstance(value, str):
            _text(value, source, where, f"{field}.{text_key}")
            content = _split(value) if fmt != "qwen" else ([{"type": "text", "text": value}] if value else [])
            if fmt == "qwen" and _PLACEHOLDER.search(value):
                raise _fail(source, where, f"{field}.{text_key} holds a {_PLACEHOLDER.search(value).group(1)} "
                                           "placeholder; in the qwen format media are items of a content list "
                                           "({'type': 'video', 'video': path})")  # fmt: skip
        elif fmt == "qwen" and isinstance(value, list):
            content = [_qwen_item(item, source, where, f"{field}.{text_key}[{k}]") for k, item in enumerate(value)]
        else:
            need = "a string or a list of items" if fmt == "qwen" else "a string"
            hint = ("; a list of {'type': ...} items is the qwen format (set data.format=qwen)"
                    if fmt == "sharegpt" and isinstance(value, list) else "")  # fmt: skip
            raise _fail(source, where, f"{field}.{text_key} must be {need}, got {_type_name(value)}{hint}")
        out.append({"role": ROLES[speaker], "content": content, "field": field, "text_key": text_key,
                    "speaker": speaker})  # fmt: skip
    system = sample.get("system")
    if system is not None and fmt != "qwen":
        if not isinstance(system, str):
            raise _fail(source, where, f"system must be a string, got {_type_name(system)}")
        _text(system, source, where, "system")
        if out[0]["role"] == "system":
            raise _fail(source, where, f"has a 'system' text and a system turn in {turns_key}; give one of them")
        out.insert(0, {"role": "system", "content": [{"type": "text", "text": system}] if system else [],
                       "field": "system", "text_key": "", "speaker": "system"})  # fmt: skip
    return out


def _check_roles(turns: list[dict], fmt: str, source: str, where: str) -> None:
    user, bot = ("human", "gpt") if fmt == "llava" else ("user", "assistant")
    _, role_key, _ = _KEYS[fmt]
    expected = "user"
    for j, turn in enumerate(turns):
        role, field = turn["role"], turn["field"]
        if role == "system":
            if j != 0:
                raise _fail(source, where, f"{field}.{role_key} is {turn['speaker']!r}; only the first turn may be a "
                                           "system turn")  # fmt: skip
        elif role != expected:
            want = user if expected == "user" else bot
            raise _fail(source, where, f"{field}.{role_key} must be {want!r} (turns alternate {user}, {bot}, ... "
                                       f"after an optional leading system turn), got {turn['speaker']!r}")  # fmt: skip
        else:
            expected = "assistant" if role == "user" else "user"
        media = [i for i in turn["content"] if i["type"] != "text"]
        if media and role != "user":
            shown = media[0]["text"] if media[0]["type"] == "placeholder" else f"a {media[0]['type']} item"
            raise _fail(source, where, f"{field}.{turn['text_key']} holds {shown} in a {turn['speaker']} turn; media "
                                       f"belong in {user} turns")  # fmt: skip
        text = "".join(i["text"] for i in turn["content"] if i["type"] == "text")
        if role == "assistant" and not text.strip():
            raise _fail(source, where, f"{field}.{turn['text_key']} is empty; a {bot} turn needs the answer text")
    if expected != "user":  # no user turn, or a user turn without an answer at the end
        got = "only a system turn" if len(turns) == 1 else f"a last {user} turn with no {bot} answer"
        raise _fail(source, where, f"{_KEYS[fmt][0]} must end with a {bot} turn (the answer to learn), got {got}")


def _resolve(turns: list[dict], media: dict[str, list[dict]], source: str, where: str, turns_key: str) -> None:
    """Replace the placeholders of llava / sharegpt turns by the sample's media items, in order; a kind without
    placeholders opens the first user turn."""
    holders = [(t, i) for t in turns for i in t["content"] if i["type"] == "placeholder"]
    count = {p: sum(i["text"] == p for _, i in holders) for p in ("<image>", "<video>")}
    as_kind = {"<image>": "image", "<video>": "video"}
    if media["video"] and not media["image"] and not count["<video>"] and count["<image>"] == len(media["video"]):
        as_kind["<image>"] = "video"  # LLaVA-Video-178K's <image> for a video
    for placeholder, n in count.items():
        kind = as_kind[placeholder]
        if n and not media[kind]:
            turn = next(t for t, i in holders if i["text"] == placeholder)
            raise _fail(source, where, f"{turn['field']}.{turn['text_key']} holds {placeholder} but the sample has no "
                                       f"'{kind}' / '{kind}s' files")  # fmt: skip
        if n and n != len(media[kind]):
            raise _fail(source, where, f"{turns_key} hold {n} {placeholder} placeholder(s) but the sample lists "
                                       f"{len(media[kind])} {kind} file(s) (a list of frame files is one video); use "
                                       f"one {placeholder} per {kind}, or none (the {kind}s then open the first user "
                                       "turn)")  # fmt: skip
    queues = {kind: list(items) for kind, items in media.items()}
    for turn in turns:
        turn["content"] = [dict(queues[as_kind[i["text"]]].pop(0)) if i["type"] == "placeholder" else i
                           for i in turn["content"]]  # fmt: skip
    first = next(t for t in turns if t["role"] == "user")
    first["content"][:0] = [dict(i) for i in queues["image"] + queues["video"]]


def _join(content: list[dict]) -> list[dict]:
    out: list[dict] = []
    for item in content:
        if item["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + item["text"]}
        elif item["type"] != "text" or item["text"]:
            out.append(item)
    return out


def parse_sample(sample: Any, *, format: str = "auto", source: str = "annotations", where: str = "sample") -> dict:
    """The common form of one sample (module docstring): ``{"id": ..., "messages": [...]}``.

    Args:
        sample (Any): one sample as read from the file.
        format (str): ``"auto"`` or one of :data:`FORMATS`.
        source (str): the file name, for the errors.
        where (str): the sample, for the errors (``"sample 3"``).

    Returns:
        dict: ``id`` (None when the sample has none), ``format`` and ``messages``.

    Raises:
        AnnotationError: naming ``source``, ``where`` and the field.
    """
    _check_format(format)
    if not isinstance(sample, dict):
        raise _fail(source, where, f"expected a JSON object (a sample), got {_type_name(sample)}")
    fmt = detect_format(sample, source=source, where=where) if format == "auto" else format
    if "id" in sample and (isinstance(sample["id"], bool) or not isinstance(sample["id"], (str, int))):
        raise _fail(source, where, f"id must be a string or an integer, got {_type_name(sample['id'])}")
    turns_key = _KEYS[fmt][0]
    if fmt == "qwen":
        stray = [k for k in ("image", "images", "video", "videos") if k in sample]
        if stray:
            raise _fail(source, where, f"has '{stray[0]}', but in the qwen format media are items of a message's "
                                       "content list ({'type': 'image', 'image': path})")  # fmt: skip
    media = _media_lists(sample, source, where) if fmt != "qwen" else {"image": [], "video": []}
    turns = _turns(sample, fmt, source, where)
    _check_roles(turns, fmt, source, where)
    if fmt != "qwen":
        _resolve(turns, media, source, where, turns_key)
    messages = [{"role": t["role"], "content": _join(t["content"])} for t in turns]
    return {"id": sample.get("id"), "format": fmt, "messages": messages}


def sample_media(parsed: dict) -> list[dict]:
    """The media items of a parsed sample (:func:`parse_sample`), in the order of the rendered text."""
    return [i for m in parsed["messages"] for i in m["content"] if i["type"] != "text"]


def chat_messages(parsed: dict) -> list[dict]:
    """The chat-template messages of a parsed sample: its messages with every media item reduced to
    ``{"type": "image" | "video"}``."""
    return [{"role": m["role"], "content": [i if i["type"] == "text" else {"type": i["type"]} for i in m["content"]]}
            for m in parsed["messages"]]  # fmt: skip


def to_messages(sample: dict, *, format: str = "auto") -> list[dict]:
    """Chat-template messages of a sample as written: ``{"role": "user" | "assistant" | "system", "content":
    [{"type": "video" | "image"}, {"type": "text", "text": ...}, ...]}``, the media items where the placeholders
    were, or at the start of the first user turn when the sample has none."""
    return chat_messages(parse_sample(sample, format=format))
