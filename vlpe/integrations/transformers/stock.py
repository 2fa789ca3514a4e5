"""How an exported folder meets stock loaders (transformers without vlpe, serving engines, conversion tools).

Every export is one of two kinds, written into its ``config.json`` by :func:`mark_config`:

- **stock**: the patch is expressible in the family's own config (the checkpoint's own position design, or one
  that gives the same ids on the family's prompts, with its default options and the family's allocation; any ``mrope_section``; ``rope_theta`` over unscaled frequencies). Those
  settings are written to ``text_config.rope_parameters``, so a loader that reads them computes the same rotary
  tables as vlpe. The record states the position semantics the export follows: the released models' (text after a
  vision block resumes at the block's largest position + 1, as transformers 4.49-4.57 and vlpe place it), and for
  Qwen2-VL / Qwen2.5-VL that transformers 5.x places text after a video whose last temporal position reaches its
  merged height or width elsewhere (:data:`TRANSFORMERS5_DIFFERENCE`).
- **vlpe**: anything else. Every ``rope_type`` of the config becomes :func:`refusal` (a text naming vlpe and how to
  load the folder): stock transformers raises it as an unknown rope type when it builds the model, as does any
  engine that reads rope types, instead of running stock positions. The record keeps the original rope types;
  :func:`restore_config` puts them back for vlpe's own loaders.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal.checkpoints import FAMILY_DESIGNS, family_variant

from .record import RECORD_KEY

__all__ = [
    "stock_rope", "mark_config", "restore_config", "write_folder", "refusal", "is_vlpe_only",
    "TRANSFORMERS5_DIFFERENCE",
]

EXPORT_KEY = "export"  # the record's entry describing the export
_ROPE_PLACES = (("text_config", "rope_parameters"), ("text_config", "rope_scaling"), ("rope_parameters",),
                ("rope_scaling",))  # fmt: skip
TRANSFORMERS5_DIFFERENCE = (
    "transformers >= 5.0 (checked: 5.24) places the text that follows a video block whose last temporal position "
    "is at least its merged height or width at the block's start + max(height, width) / merge, while the released "
    "models (transformers 4.49-4.57) and vlpe place it at the block's largest position + 1; such prompts give other "
    "logits under stock transformers 5.x"
)
_RELEASED = "released: text after a vision block resumes at the block's largest position + 1"


def refusal(label: str) -> str:
    """The ``rope_type`` a vlpe-only export writes: an unknown type whose text says what to do."""
    return (f"vlpe:{label} (fine-tuned with the vlpe position variant {label!r}, which stock transformers and "
            "serving engines cannot run; load it with vlpe.integrations.transformers.from_pretrained)")  # fmt: skip


def _rope_dicts(config: Mapping[str, Any]) -> dict[str, dict]:
    """The rope settings dicts of a ``config.json`` dict, by their dotted place."""
    found = {}
    for place in _ROPE_PLACES:
        node: Any = config
        for key in place:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, dict):
            found[".".join(place)] = node
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=0, abs_tol=0)
    return a == b


def stock_rope(patch: Any) -> dict[str, Any] | None:
    """The ``rope_parameters`` entries that make the family's own model compute ``patch``'s ids and tables, or None
    when the patch is not expressible in the family's config.

    Args:
        patch: the :class:`vlpe.integrations.transformers.Patch` of a model.

    Returns:
        ``{"mrope_section": [...]}`` (and ``"rope_theta"`` when ``theta=`` was given) to write into
        ``text_config.rope_parameters``, or None.
    """
    v = patch.variant
    if v.design not in FAMILY_DESIGNS[patch.family] or v.allocation != family_variant(patch.family).allocation:
        return None
    defaults = dict(mm.DESIGNS[v.design].defaults)
    tps = getattr(patch.base.config.vision_config, "tokens_per_second", None)
    if "tokens_per_second" in defaults and tps is not None:
        defaults["tokens_per_second"] = tps  # what apply() takes from the checkpoint
    given = v.design_options
    if set(given) - set(defaults) or not all(_same(given.get(k, d), d) for k, d in defaults.items()):
        return None
    options = (patch.record or {}).get("options", {})
    if patch.record is None or patch.record.get("unrecorded") or "scaling" in options:
        return None
    text_config = patch.text.config
    rope = dict(text_config.rope_parameters or {})
    out: dict[str, Any] = {}
    if v.section is not None:
        out["mrope_section"] = [int(s) for s in v.section]
    if "theta" in options:
        if rope.get("rope_type", "default") != "default":
            return None  # vlpe would scale the frequencies of theta itself: not proven equal to the family's
        out["rope_theta"] = float(patch.text.rotary_emb.settings.theta)
    return out


def is_vlpe_only(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` dict is a vlpe-only export (its record says so)."""
    record = config.get(RECORD_KEY)
    return isinstance(record, Mapping) and isinstance(record.get(EXPORT_KEY), Mapping) and \
        record[EXPORT_KEY].get("stock") is False


def mark_config(config: dict[str, Any], model: nn.Module, patch: Any,
                preprocessing: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """A copy of the ``config.json`` dict ``config`` of ``model`` (patched with ``patch``) as the export writes it.

    Args:
        config: the dict ``save_pretrained`` wrote (with the record under ``"vlpe"``).
        model: the saved model.
        patch: its patch, or None for a stock model (the config is returned unchanged but for ``preprocessing``).
        preprocessing: the inputs the model was trained on (``fps``, ``max_frames``, ``min_pixels``,
            ``max_pixels``), kept in the record for the evaluators.

    Returns:
        The dict to write: stock rope settings, or refusing rope types; the record's ``"export"`` entry says which.
    """
    out = copy.deepcopy(config)
    if patch is None:
        return out
    record = out.setdefault(RECORD_KEY, copy.deepcopy(patch.record))
    if preprocessing:
        record["preprocessing"] = {k: v for k, v in preprocessing.items() if v is not None}
    places = _rope_dicts(out)
    stock = stock_rope(patch)
    if stock is not None:
        text = places.get("text_config.rope_parameters")
        if text is None:
            raise ValueError("the saved config.json has no text_config.rope_parameters to write the rope settings to")
        text.update(stock)
        semantics = _RELEASED
        if patch.family in ("qwen2_vl", "qwen2_5_vl"):
            semantics += "; " + TRANSFORMERS5_DIFFERENCE
        record[EXPORT_KEY] = {"stock": True, "positions": semantics}
        return out
    original = {}
    for place, rope in places.items():
        for key in ("rope_type", "type"):
            if key in rope:
                original[f"{place}.{key}"] = rope[key]
                rope[key] = refusal(patch.label)
    if "text_config.rope_parameters.rope_type" not in original:
        text = places.get("text_config.rope_parameters")
        if text is None:
            raise ValueError("the saved config.json has no text_config.rope_parameters to mark as vlpe-only")
        original["text_config.rope_parameters.rope_type"] = None
        text["rope_type"] = refusal(patch.label)
    record[EXPORT_KEY] = {"stock": False, "rope_types": original}
    return out


def restore_config(config: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """A copy of the ``config.json`` dict ``config`` with a vlpe-only export's original rope types put back.

    Args:
        config: the dict read from the folder's ``config.json``.
        where: the file, named in errors.

    Returns:
        The dict a stock config class builds the model from (unchanged for stock exports and stock folders).

    Raises:
        ValueError: a vlpe-only record whose original rope types are missing or do not match the file.
    """
    out = copy.deepcopy(dict(config))
    if not is_vlpe_only(out):
        return out
    original = out[RECORD_KEY][EXPORT_KEY].get("rope_types")
    if not isinstance(original, Mapping) or not original:
        raise ValueError(f"{where}: the vlpe record marks a vlpe-only export but keeps no original rope types "
                         "('export': {'rope_types': {...}}); the file was edited: save the model again")  # fmt: skip
    places = _rope_dicts(out)
    for dotted, value in original.items():
        place, _, key = str(dotted).rpartition(".")
        rope = places.get(place)
        if rope is None or not isinstance(rope.get(key), str) or not rope[key].startswith("vlpe:"):
            raise ValueError(f"{where}: the vlpe record names the rope type {dotted!r}, which the file does not hold "
                             "as written by vlpe; the file was edited: save the model again")  # fmt: skip
        if value is None:
            del rope[key]
        else:
            rope[key] = value
    return out


def write_folder(model: nn.Module, patch: Any, path: str | Path, *, state_dict: dict | None = None,
                 processor: Any = None, preprocessing: Mapping[str, Any] | None = None,
                 safe_serialization: bool = True, is_main_process: bool = True, **save_kwargs: Any) -> Path:  # fmt: skip
    """Write ``model`` (patched with ``patch``, or None) to ``path`` with transformers' own ``save_pretrained`` and
    the ``config.json`` of its kind (:func:`mark_config`); what
    :func:`vlpe.integrations.transformers.save_pretrained` and a patched model's ``save_pretrained`` do.

    Returns:
        ``path``.

    Raises:
        ValueError: an unpatched model whose config still carries a record; ``safe_serialization=False``.
    """
    config = model.config
    if patch is None and getattr(config, RECORD_KEY, None) is not None:
        raise ValueError(
            f"{type(model).__name__} carries no vlpe patch but its config records one ({getattr(config, RECORD_KEY)}):"
            " apply it (vlpe.integrations.transformers.apply(model)) or delete model.config.vlpe to save a stock model"
        )
    if patch is not None and patch.record is not None:
        setattr(config, RECORD_KEY, copy.deepcopy(patch.record))
    save = type(model).save_pretrained  # the class's own: a patched instance's save_pretrained leads here
    kwargs: dict[str, Any] = dict(save_kwargs)
    if "safe_serialization" in inspect.signature(save).parameters:
        kwargs["safe_serialization"] = safe_serialization
    elif not safe_serialization:
        raise ValueError("safe_serialization=False: the installed transformers writes safetensors only")
    save(model, path, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
    if is_main_process:
        file = Path(path) / "config.json"
        marked = mark_config(json.loads(file.read_text()), model, patch, preprocessing)
        tmp = file.with_name(f".{file.name}.tmp")
        tmp.write_text(json.dumps(marked, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, file)
        if processor is not None:
            processor.save_pretrained(path)
    return Path(path)
