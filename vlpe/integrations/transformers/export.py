"""Checkpoint folders of patched models: :func:`save_pretrained` writes one that stock transformers loads (with the
variant recorded in ``config.json``), :func:`from_pretrained` loads it back patched, :func:`recorded_variant` reads
the record of a folder without loading it.

A patched model's ``state_dict`` has the stock model's keys (:class:`MultimodalRotary` holds the stock rotary's
tensors under their own names), so the weights file is the stock one; the only addition is the ``"vlpe"`` entry
of ``config.json`` (:func:`vlpe.integrations.transformers.patch.variant_record`), which stock transformers keeps as
a plain config attribute. ``tests/test_integration_transformers_export.py`` checks both against stock
``AutoModelForImageTextToText.from_pretrained``.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from vlpe.encodings import multimodal as mm

from .patch import RECORD_KEY, apply, check_options, patch_of, read_record

__all__ = ["save_pretrained", "from_pretrained", "recorded_variant"]


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

    loaded = AutoModelForImageTextToText.from_pretrained(path, **{"local_files_only": True, **from_pretrained_kwargs})
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    apply(model, variant, **options)
    return loaded


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    state_dict: dict | None = None,
    processor: Any = None,
    safe_serialization: bool = True,
    is_main_process: bool = True,
) -> Path:
    """Write ``model`` (a patched Qwen-VL model, or a stock one) to the folder ``path`` as ``model.save_pretrained``
    does, with the record of its patch in ``config.json``, and ``processor`` when given; returns ``path``.

    ``state_dict`` goes to ``save_pretrained`` as is (e.g. the 16-bit weights gathered from ZeRO-3; its keys are
    the stock model's), ``is_main_process`` too (only that process writes, the processor included). The record
    written is the one of the installed patch; an unpatched model whose config still carries a record (loaded from
    such a folder without :func:`from_pretrained`) is refused, since the record would name a variant the weights
    were not trained with. Merge adapters first (peft's ``merge_and_unload``): the model must be the Qwen-VL model.
    """
    patch = patch_of(model)
    config = model.config
    if patch is None and getattr(config, RECORD_KEY, None) is not None:
        raise ValueError(
            f"{type(model).__name__} carries no vlpe patch but its config records one ({getattr(config, RECORD_KEY)}):"
            " apply it (vlpe.integrations.transformers.apply(model)) or delete model.config.vlpe to save a stock model"
        )
    if patch is not None and patch.record is not None:
        setattr(config, RECORD_KEY, copy.deepcopy(patch.record))
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = safe_serialization
    elif not safe_serialization:
        raise ValueError("safe_serialization=False: the installed transformers writes safetensors only")
    model.save_pretrained(path, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
    if processor is not None and is_main_process:
        processor.save_pretrained(path)
    return Path(path)
