"""The faster forms of the encodings' biases, on the attention side: registered per encoding class in
:mod:`vlpe.attention_forms.registry` (:data:`FAST_FORMS` for the inference fast path, :data:`FLEX_FORMS` for
FlexAttention), one module per encoding. Encodings never import this package; their plan learns which forms
exist from the registry. Every form is checked against its encoding's ``score`` in
tests/test_fast_forms_registry.py.
"""

from . import alibi, fire, irpe, lookhere, pype, rpe2d  # noqa: F401  (each registers its forms)
from .registry import (
    FAST_FORMS, FLEX_FORMS, FORM_NAMES, FastForm, clear_prefix, fast_form, fast_form_of, flex_form, flex_form_of,
    flex_mods, forms_of, heads_bias, lattice_table,
)

__all__ = [
    "FAST_FORMS", "FLEX_FORMS", "FORM_NAMES", "FastForm", "clear_prefix", "fast_form", "fast_form_of", "flex_form",
    "flex_form_of", "flex_mods", "forms_of", "heads_bias", "lattice_table",
]
