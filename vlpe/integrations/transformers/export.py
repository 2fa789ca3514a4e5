"""Checkpoint folders of patched models: :func:`save_pretrained` writes one (of the kind :mod:`.stock` decides:
stock loaders compute the same model, or refuse it naming vlpe), :func:`from_pretrained` loads it back patched,
:func:`recorded_variant` and :func:`recorded_preprocessing` read its record without loading it, :func:`load_config`
gives the config transformers builds it from.

A patched model's ``state_dict`` has the stock model's keys (:class:`MultimodalRotary` holds the stock rotary's
tensors under their own names), so the weights file is the stock one, with the source's tensor names also after a
ZeRO-3 load (:func:`keep_used_conversions`); ``config.json`` adds the ``"vlpe"`` record
(:func:`vlpe.integrations.transformers.patch.variant_record`) and the rope settings of the export's kind.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from vlpe.encodings import multimodal as mm

from .patch import apply, patch_of
from .record import RECORD_KEY, check_options, read_record
from .stock import restore_config, write_folder

__all__ = [
    "save_pretrained", "from_pretrained", "recorded_variant", "recorded_preprocessing", "load_config",
    "keep_used_conversions", "PREPROCESSING",
]

# what a record may say about the inputs: the video sampling and the pixel budgets (per video frame: min_pixels /
# max_pixels; per image: min_pixels / image_max_pixels, else max_pixels)
PREPROCESSING = ("fps", "max_frames", "min_pixels", "max_pixels", "image_max_pixels")


def _config_file(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The ``config.json`` of the checkpoint folder ``path`` and its contents.

    Raises:
        ValueError: the folder has no ``config.json``, or it is not a JSON object (not JSON, not UTF-8, a list
            ...); the message names the file.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(
            f"{str(path)!r} is not a Hugging Face checkpoint folder (no config.json); give the folder that "
            "save_pretrained wrote (config.json, the weights, the processor files)"
        )
    try:
        config = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{file} is not valid JSON ({e}); a checkpoint folder's config.json is the JSON object save_pretrained "
            "writes: restore or rewrite it"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{file} holds a JSON {type(config).__name__}, not the JSON object (the model config) save_pretrained "
            "writes: restore or rewrite it"
        )
    return file, config


def recorded_variant(path: str | Path) -> tuple[str | mm.Variant, dict[str, Any]]:
    """``(variant, options)`` recorded in the ``config.json`` of the checkpoint folder ``path``, as
    :func:`vlpe.integrations.transformers.apply` takes them.

    Raises:
        ValueError: the folder has no config.json or one that is not a JSON object, no record, a record that
            cannot be restored (options that were not JSON), or options ``apply`` does not take (unknown names,
            wrongly typed or invalid values); the message names the file and the option.
    """
    file, config = _config_file(path)
    return read_record(config.get(RECORD_KEY), where=str(file))


def from_pretrained(
    path: str | Path, *, variant: str | mm.Variant | None = None, variant_options: Mapping[str, Any] | None = None,
    **from_pretrained_kwargs: Any,
):  # fmt: skip
    """Load the checkpoint folder ``path`` with ``AutoModelForImageTextToText`` (``local_files_only`` unless
    given) and apply the variant recorded in its ``config.json``, or ``variant`` with ``variant_options``.

    The record (or ``variant`` and ``variant_options``) is read and checked before any weight is loaded.

    Returns:
        What ``from_pretrained`` returns (the model, or ``(model, loading_info)`` with ``output_loading_info=True``).

    Raises:
        ValueError: as :func:`recorded_variant` (naming ``config.json`` and the option), or for ``variant_options``
            without ``variant`` or that ``apply`` does not take.
    """
    if variant is None:
        if variant_options:
            raise ValueError(
                "from_pretrained: variant_options given without variant; pass variant= too, or neither to apply "
                "the variant recorded in config.json"
            )
        variant, options = recorded_variant(path)
    else:
        _config_file(path)
        if not isinstance(variant_options, (Mapping, type(None))):
            raise ValueError(f"from_pretrained: variant_options must be a dict of options, got {variant_options!r}")
        options = dict(variant_options or {})
        check_options(variant, options, where=f"from_pretrained({str(path)!r}, variant={variant!r})")
    from transformers import AutoModelForImageTextToText

    kwargs = {"local_files_only": True, **from_pretrained_kwargs}
    kwargs.setdefault("config", load_config(path))  # a vlpe-only export's own rope types back
    loaded = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    model = keep_used_conversions(loaded[0] if isinstance(loaded, tuple) else loaded)
    apply(model, variant, **options)
    return loaded


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    state_dict: dict | None = None,
    processor: Any = None,
    preprocessing: Mapping[str, Any] | None = None,
    safe_serialization: bool = True,
    is_main_process: bool = True,
    **save_kwargs: Any,
) -> Path:
    """Write ``model`` (a patched Qwen-VL model, or a stock one) to the folder ``path`` as ``model.save_pretrained``
    does, with the record of its patch in ``config.json``, and ``processor`` when given.

    The export is one of two kinds (:mod:`.stock`): where the patch is expressible in the family's own config, its
    rope settings are written there and stock loaders compute vlpe's positions and tables; otherwise the config's
    rope types name vlpe and :func:`from_pretrained`, so stock loaders refuse the folder instead of running stock
    positions. The record's ``"export"`` entry says which. A patched model's own ``model.save_pretrained`` comes
    here too.

    Args:
        model: the Qwen-VL model (adapters merged: peft's ``merge_and_unload``).
        path: the folder to write.
        state_dict: passed to ``save_pretrained`` as is (e.g. the 16-bit weights gathered from ZeRO-3, with the
            model's own keys).
        processor: saved beside the model when given.
        preprocessing: the inputs the model was trained on (``fps``, ``max_frames``, ``min_pixels``,
            ``max_pixels``), recorded for the evaluators (:func:`recorded_preprocessing`).
        safe_serialization: safetensors (the installed transformers writes nothing else).
        is_main_process: only that process writes (the processor included).
        **save_kwargs: any other argument of transformers' ``save_pretrained`` (``max_shard_size`` ...).

    Returns:
        ``path``.

    Raises:
        ValueError: an unpatched model whose config still carries a record (it would name a variant the weights
            were not trained with: apply it, or delete ``model.config.vlpe``); ``safe_serialization=False``.
    """
    return write_folder(model, patch_of(model), path, state_dict=state_dict, processor=processor,
                        preprocessing=preprocessing, safe_serialization=safe_serialization,
                        is_main_process=is_main_process, **save_kwargs)  # fmt: skip


def recorded_preprocessing(path: str | Path) -> dict[str, Any]:
    """The inputs the checkpoint folder ``path`` was trained on, as its record keeps them (:data:`PREPROCESSING`:
    ``fps``, ``max_frames``, ``min_pixels``, ``max_pixels`` per video frame, ``image_max_pixels``; ``{}`` when none
    were recorded).

    Raises:
        ValueError: as :func:`recorded_variant` for the folder, or a ``preprocessing`` entry that is not a dict of
            positive numbers.
    """
    file, config = _config_file(path)
    record = config.get(RECORD_KEY)
    found = record.get("preprocessing", {}) if isinstance(record, Mapping) else {}
    bad = not isinstance(found, Mapping) or any(
        k not in PREPROCESSING or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        for k, v in (found.items() if isinstance(found, Mapping) else ())
    )
    if bad:
        raise ValueError(f"{file}: the vlpe record's 'preprocessing' must map {list(PREPROCESSING)} to positive numbers, "
                         f"got {found!r}; the file was edited: fix or remove that entry")  # fmt: skip
    return dict(found)


def load_config(path: str | Path):
    """The model config of the checkpoint folder ``path`` as transformers builds the model from it, with the
    original rope types of a vlpe-only export put back (:func:`vlpe.integrations.transformers.stock.restore_config`).

    Returns:
        A ``PretrainedConfig`` to pass as ``from_pretrained(path, config=...)``.

    Raises:
        ValueError: as :func:`recorded_variant` for the file, an unknown ``model_type``, or a vlpe-only record that
            does not match the file.
    """
    from transformers import CONFIG_MAPPING

    file, config = _config_file(path)
    config = restore_config(config, where=str(file))
    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"{file}: model_type {kind!r} is not a model type the installed transformers knows")
    return CONFIG_MAPPING[kind].from_dict(config)


def keep_used_conversions(model: nn.Module) -> nn.Module:
    """Keep only the key conversions that loading ``model`` applied, for its ``save_pretrained`` to reverse.

    transformers 5.x records the key renamings it applied while loading a checkpoint and reverses them on save, so
    that the saved file has the source's keys. Loading under DeepSpeed ZeRO-3 records every conversion of the
    architecture instead, applied or not, and the save then renames keys the source never had
    (``model.model.layers.*`` for ``model.layers.*``). Each conversion knows whether it was applied
    (``was_used``); the others are dropped here. A model without recorded conversions is left as it is.

    Returns:
        ``model``.
    """
    recorded = getattr(model, "_weight_conversions", None)
    if recorded:
        model._weight_conversions = [c for c in recorded if not hasattr(c, "was_used") or c.was_used()]
    return model
