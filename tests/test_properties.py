"""Every claim of every registered encoding, checked by the property kit (vlpe.testing).

A new encoding is covered the moment it is registered: the parameters come from the registry. ``check`` runs
every claim but ``zero_init`` twice, on the encoding as built and on a copy with randomised parameters
(``vlpe.testing.randomize_parameters``), so zero-initialised tables cannot make a claim hold vacuously
(tests/test_reliability_library.py plants a wrong claim to show the second run catches it).
"""

import pytest
import torch

import vlpe
from vlpe.encodings import get
from vlpe.testing import check, check_errors, check_scaling, example, examples, takes_scaling


def _build(name):
    return example(name)


#: every claim of every example configuration (a wrapper such as rpe2d: one per wrapped encoding)
CONFIGS = {label: (name, opts) for name in vlpe.encodings.available()
           for (label, _), opts in zip(examples(name), get(name).examples())}
CASES = [(label, claim) for label, (name, opts) in CONFIGS.items() for claim in sorted(example(name, **opts).claims)]


@pytest.mark.parametrize("label,claim", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_claimed_property(label, claim):
    name, opts = CONFIGS[label]
    torch.manual_seed(0)
    check(example(name, **opts), claim)


@pytest.mark.parametrize("name", vlpe.encodings.available())
def test_error_behaviour(name):
    check_errors(_build(name))


SCALED = [name for name in vlpe.encodings.available() if takes_scaling(_build(name))]


def test_every_rotary_encoding_takes_scaling():
    for name in ("rope", "rope1d", "rope_mixed", "string", "mrope", "mrope_i", "mhrope", "pype", "vrope", "v2pe"):
        assert name in SCALED, name
    assert "scaling" in vlpe.encodings.options_of(get("comrope"))


@pytest.mark.parametrize("name", SCALED)
def test_scaling_properties(name):
    torch.manual_seed(0)
    check_scaling(_build(name))


@pytest.mark.parametrize("opts", [{"coords": "raw"}, {"coords": "raw", "block": 4, "variant": "ld"}])
def test_scaling_properties_comrope_raw(opts):
    torch.manual_seed(0)
    check_scaling(vlpe.encodings.build("comrope", dim=64, num_heads=4, depth=2, **opts))


def test_scaling_properties_head_axes():
    check_scaling(vlpe.encodings.build("rope", dim=64, num_heads=4, depth=2, head_axes=(0, 1, 1, None)))


@pytest.mark.parametrize("name", vlpe.encodings.available())
def test_every_encoding_declares_a_docstring_and_claims(name):
    cls = get(name)
    assert cls.__doc__ and len(cls.__doc__.split()) > 8, f"{name} needs a docstring naming its paper and reference"


@pytest.mark.parametrize("name", vlpe.encodings.available())
def test_keep_fp32_encodings_survive_downcasts_exactly(name):
    """Encodings that keep fp32 state hold the exact same values after .bfloat16() / .half()."""
    enc = _build(name)
    before = {k: v.detach().clone() for k, v in list(enc.named_parameters()) + list(enc.named_buffers())}
    enc.bfloat16()
    for k, v in list(enc.named_parameters()) + list(enc.named_buffers()):
        if not v.is_floating_point() or not get(name).keep_fp32:
            continue
        if k in before and "." not in k:  # the module's own state (submodules follow their own rule)
            assert v.dtype == torch.float32, f"{name}.{k} dropped to {v.dtype}"
            assert torch.equal(v, before[k].float()), f"{name}.{k} changed value through .bfloat16()"
