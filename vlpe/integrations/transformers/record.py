"""The record of a patch that :func:`vlpe.integrations.transformers.apply` keeps in the model config (``"vlpe"``
in ``config.json``): writing it (:func:`variant_record`) and reading it back checked (:func:`read_record`,
:func:`check_options`)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from vlpe.encodings import multimodal as mm

__all__ = ["RECORD_KEY", "RECORD_FORMAT", "ROTARY_KEYS", "variant_record", "read_record", "check_options",
           "check_rotary_options"]  # fmt: skip

RECORD_KEY = "vlpe"  # the model config's attribute (a key of config.json) holding the record of the patch
RECORD_FORMAT = 1
ROTARY_KEYS = ("allocation", "section", "theta", "scaling")  # options of apply() that go to the rotary tables
_VARIANT_FIELDS = ("design", "allocation", "design_options", "section", "theta", "name")




class _NotJSON(Exception):
    pass


def _json(value: Any) -> Any:
    """``value`` as JSON that reads back equal (tuples become lists, numbers int / float), or :class:`_NotJSON`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_json(x) for x in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _json(x) for k, x in value.items()}
    raise _NotJSON


def variant_record(variant: str | mm.Variant, options: Mapping[str, Any]) -> dict[str, Any]:
    """The record of ``apply(model, variant, **options)`` that :func:`apply` keeps in ``model.config.vlpe``.

    ``{"format": 1, "variant": V, "options": {...}}`` with ``V`` the registered name given (or of a registered
    :class:`~vlpe.encodings.multimodal.Variant` object), else the variant's fields ``{"design", "allocation",
    "design_options", "section", "theta", "name"}``; ``options`` are the options as given (tuples as lists).
    Values JSON cannot hold (tensors, generators, non-finite numbers) are left out and named in
    ``"unrecorded"`` (``"design_options.generator"`` for a variant's own), which :func:`read_record` refuses.
    ``tests/test_integration_transformers_export.py`` checks that the model restored from it gives the logits of
    the one recorded, and that stock transformers loads a config holding it.
    """
    unrecorded: list[str] = []

    def entries(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in values.items():
            try:
                out[key] = _json(value)
            except _NotJSON:
                unrecorded.append(prefix + key)
        return out

    if isinstance(variant, str):
        recorded: Any = variant
    elif mm.VARIANTS.get(variant.name) is variant:
        recorded = variant.name
    else:
        recorded = entries({f: getattr(variant, f) for f in _VARIANT_FIELDS if f != "design_options"})
        recorded["design_options"] = entries(variant.design_options, "design_options.")
    record = {"format": RECORD_FORMAT, "variant": recorded, "options": entries(options)}
    if unrecorded:
        record["unrecorded"] = unrecorded
    return record


def read_record(record: Any, *, where: str) -> tuple[str | mm.Variant, dict[str, Any]]:
    """``(variant, options)`` to apply again from a :func:`variant_record` (``where`` names its source in the
    errors); ValueError for a missing record, another format, options the record could not hold, or options
    :func:`apply` does not take (:func:`check_options`: unknown names, wrongly typed or invalid values)."""
    how = "pass the variant explicitly (vlpe.integrations.transformers.apply(model, variant, **options))"
    if record is None:
        raise ValueError(
            f"{where} has no vlpe record (the 'vlpe' entry that vlpe.integrations.transformers.apply puts in the "
            f"model config and save_pretrained writes to config.json); {how}"
        )
    if not isinstance(record, Mapping) or record.get("format") != RECORD_FORMAT or "variant" not in record:
        raise ValueError(
            f"{where}: the vlpe record {record!r} is not of format {RECORD_FORMAT} "
            f"({{'format': {RECORD_FORMAT}, 'variant': ..., 'options': {{...}}}}); {how}"
        )
    if record.get("unrecorded"):
        raise ValueError(
            f"{where}: the variant was applied with option(s) {list(record['unrecorded'])} that JSON cannot hold "
            f"(tensors, generators ...), so the record does not restore it; {how} with those options"
        )
    variant, options = record["variant"], record.get("options") or {}
    if isinstance(variant, Mapping):
        unknown = sorted(set(variant) - set(_VARIANT_FIELDS))
        if unknown or not {"design", "allocation"} <= set(variant):
            raise ValueError(
                f"{where}: the recorded variant {dict(variant)} must have 'design' and 'allocation' and only the "
                f"fields {list(_VARIANT_FIELDS)}; {how}"
            )
        check_rotary_options({k: variant[k] for k in ("allocation", "section", "theta") if k in variant},
                             where=f"{where}: the recorded variant")
        try:
            variant = mm.Variant(**variant)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: the recorded variant {dict(variant)} is not valid: {e}; {how}") from None
    elif not isinstance(variant, str):
        raise ValueError(f"{where}: the recorded variant must be a name or a dict of fields, got {variant!r}; {how}")
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: the recorded options must be a dict, got {options!r}; {how}")
    check_options(variant, options, where=where)
    return variant, dict(options)


def check_rotary_options(options: Mapping[str, Any], *, where: str) -> None:
    """Check the types of the rotary options of :func:`apply` found in ``options``.

    Args:
        options: options of :func:`apply`; only ``theta``, ``section``, ``allocation`` and ``scaling`` are read.
        where: names the source of the options in the errors (a file, ``"apply"`` ...).

    Raises:
        ValueError: ``theta`` is not a finite number > 0 (a string, a boolean, NaN ...), ``section`` not a list of
            integers >= 0 (or None), ``allocation`` not a name, or ``scaling`` neither a dict nor None.
    """
    if "theta" in options:
        theta = options["theta"]
        if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not 0 < float(theta) < math.inf:
            raise ValueError(f"{where}: option 'theta' (the RoPE base) must be a finite number > 0 such as 10000.0, "
                             f"got {theta!r}")
    section = options.get("section")
    if section is not None and (
        not isinstance(section, (list, tuple))
        or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in section)
    ):
        raise ValueError(f"{where}: option 'section' must be a list of integers >= 0 (rotary pairs per axis, e.g. "
                         f"[2, 3, 3]) or None, got {section!r}")
    if "allocation" in options and not isinstance(options["allocation"], str):
        raise ValueError(f"{where}: option 'allocation' must be the name of a frequency allocation such as "
                         f"'interleaved', got {options['allocation']!r}")
    scaling = options.get("scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"{where}: option 'scaling' must be a vlpe scaling dict such as {{'type': 'yarn', "
                         f"'factor': 2.0}} or None, got {scaling!r}")


def check_options(variant: str | mm.Variant, options: Mapping[str, Any], *, where: str) -> mm.Variant:
    """Check ``options`` for ``apply(model, variant, **options)`` before any model is touched.

    The names must be options of the variant's design or rotary options (``section``, ``allocation``, ``theta``,
    ``scaling``), the rotary options of the right types (:func:`check_rotary_options`), and the design options and
    allocation valid for the variant (:meth:`vlpe.encodings.multimodal.Variant.with_options`).

    Args:
        variant: a registered name or a :class:`~vlpe.encodings.multimodal.Variant`.
        options: the options, e.g. those of a record (:func:`read_record`).
        where: names the source of the variant and options in the errors (a file ...).

    Returns:
        The variant with the design options and allocation of ``options``.

    Raises:
        ValueError: an unknown variant, a name that is not an option (``model``, ``variant``, a misspelling), or a
            value the option does not take; the message starts with ``where``.
    """
    try:
        v = mm.get_variant(variant)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    design = mm.DESIGNS[v.design]
    bad = [k for k in options if not isinstance(k, str) or (k not in design.defaults and k not in ROTARY_KEYS)]
    if bad:
        raise ValueError(
            f"{where}: {', '.join(map(repr, bad))} {'is not an option' if len(bad) == 1 else 'are not options'} of "
            f"variant {v.label!r}: apply(model, variant, **options) takes the {design.name!r} design's options "
            f"({', '.join(sorted(design.defaults)) or 'none'}) and {', '.join(ROTARY_KEYS)}"
        )
    check_rotary_options(options, where=where)
    changes = {k: x for k, x in options.items() if k not in ROTARY_KEYS}
    try:
        return v.with_options(allocation=options.get("allocation"), **changes)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
