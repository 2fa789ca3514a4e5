"""Bad input to the multimodal ids is a ValueError that names what is wrong, never a wrapped value or a crash.

The grid products, merge sizes and padding ids that do not fit int64, ``second_per_grid_ts`` that is not a finite
number >= 0, token types that are complex, batches of no rows, float grids (refused, not truncated), and design
options of the wrong kind (numbers that are not finite, not positive or absurdly large; bools or strings where
numbers are expected) through ``position_ids``, ``Variant.with_options`` and the constructor alike. Valid values
next to each refused one still give the ids a hand computation or the released loop gives.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_mm_helpers import batch, released_mrope_loop, tokens

from vlpe.encodings import multimodal as mm

T = torch.tensor
TYPES = T([[0, 1, 1, 1, 1, 0]])  # text, a 2 x 2 image (merge 2), text
GRID = T([[1, 4, 4]])
VIDEO = T([[0, 2, 2, 2, 2, 2, 2, 2, 2, 0]])  # text, a 2-frame 2 x 2 video, text
VIDEO_GRID = T([[2, 4, 4]])


# --------------------------------------------------------------------------- grids and merge sizes past int64
@pytest.mark.parametrize(
    "grid,merge",
    [
        ([[1, 4, 2**62 + 1]], 1),  # 4 (2**62 + 1) wraps to 4, the tokens the batch holds: text at 4.6e18 before
        ([[2**40, 2**40, 2**40]], 2),  # 2**117 tokens: a raw ZeroDivisionError before
        ([[1, 2**32, 2**33]], 2),  # 2**63 wraps to -2**63
    ],
)
def test_a_block_of_more_tokens_than_the_batch_is_refused(grid, merge):
    with pytest.raises(ValueError, match="more tokens than the batch holds"):
        mm.position_ids("mrope", TYPES, T(grid), spatial_merge_size=merge)


@pytest.mark.parametrize("merge", [2**64, 2**64 - 2, 2**63, True, 0, -2, 2.5, float("inf"), float("nan"), "2"])
def test_a_merge_size_that_is_not_a_positive_int64_is_refused(merge):
    with pytest.raises(ValueError, match="spatial_merge_size must be a positive integer"):
        mm.position_ids("mrope", TYPES, GRID, spatial_merge_size=merge)


def test_the_merge_size_of_the_wrapped_kernel_call_is_refused():
    with pytest.raises(ValueError, match="spatial_merge_size"):
        mm.position_ids("mrope", TYPES, T([[1, 2**62 - 1, 4]]), spatial_merge_size=2**64 - 1)


def test_a_merge_size_near_the_int64_limit_is_taken():
    """A merge size of 2**62 (far above any grid) is a valid, if odd, input: a block of (1, 2**62, 2**62)
    patches is one merged token."""
    ids, deltas = mm.position_ids("mrope", T([[0, 1, 0]]), T([[1, 2**62, 2**62]]), spatial_merge_size=2**62)
    assert ids.tolist() == [[[0, 1, 2]]] * 3 and deltas.tolist() == [[0]]


# --------------------------------------------------------------------------- padding ids
@pytest.mark.parametrize("pad", [2**63, 2**64, -(2**63) - 1, float("nan"), float("inf"), 1.5, "1", True, None])
def test_a_padding_id_that_int64_ids_cannot_hold_is_refused(pad):
    mask = T([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="pad_position"):
        mm.position_ids("mrope", TYPES, GRID, attention_mask=mask, pad_position=pad)


@pytest.mark.parametrize("pad", [-(2**63), 2**63 - 1, -1, 0, 7])
def test_padding_ids_in_range_are_written_to_the_padding_slots(pad):
    mask = T([[0, 1, 1, 1, 1, 1]])
    ids, deltas = mm.position_ids("mrope", TYPES, GRID, attention_mask=mask, pad_position=pad)
    want_ids, want_deltas = released_mrope_loop(TYPES, mask, GRID)
    want_ids[:, 0, 0] = pad
    assert torch.equal(ids, want_ids) and torch.equal(deltas, want_deltas)


def test_a_padding_id_outside_a_float_dtype_is_refused_and_a_fraction_is_taken():
    mask = T([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="pad_position"):
        mm.position_ids("mrope", TYPES, GRID, attention_mask=mask, pad_position=float("nan"), dtype=torch.float32)
    ids, _ = mm.position_ids("mrope", TYPES, GRID, attention_mask=mask, pad_position=-0.5, dtype=torch.float32)
    assert ids[:, 0, 0].tolist() == [-0.5] * 3


# --------------------------------------------------------------------------- second_per_grid_ts
@pytest.mark.parametrize("spg", [float("nan"), float("inf"), -float("inf"), -1.0])
@pytest.mark.parametrize("form", ["list", "tensor"])
def test_seconds_per_grid_that_are_not_finite_numbers_of_at_least_zero_are_refused(spg, form):
    """``qwen25vl`` gave time ids of -2**63 for every token of such a video before."""
    spg = torch.tensor([spg]) if form == "tensor" else [spg]
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        mm.position_ids("qwen25vl", VIDEO, VIDEO_GRID, second_per_grid_ts=spg)


def test_seconds_per_grid_beyond_exact_positions_are_refused():
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        mm.position_ids("qwen25vl", VIDEO, VIDEO_GRID, second_per_grid_ts=torch.tensor([1e30]))
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        mm.get_variant("qwen25vl").with_options(second_per_grid_ts=[1e30])


@pytest.mark.parametrize("spg", [0.0, 0.5, 2.0])
def test_seconds_per_grid_of_at_least_zero_give_the_released_time_ids(spg):
    mask = torch.ones_like(VIDEO)
    for given in ([spg], torch.tensor([spg])):
        ids, deltas = mm.position_ids("qwen25vl", VIDEO, VIDEO_GRID, second_per_grid_ts=given)
        want_ids, want_deltas = released_mrope_loop(VIDEO, mask, VIDEO_GRID, second_per_grid_ts=[spg])
        assert torch.equal(ids, want_ids) and torch.equal(deltas, want_deltas)


# --------------------------------------------------------------------------- token types, empty batches, grids
def test_complex_token_types_are_refused():
    with pytest.raises(ValueError, match="must hold integers"):
        mm.position_ids("mrope", TYPES.to(torch.complex64), GRID)


@pytest.mark.parametrize("grid", [None, GRID])
@pytest.mark.parametrize("variant", ["mrope", "qwen3vl", "v2pe"])
def test_a_batch_of_no_rows_is_refused(variant, grid):
    with pytest.raises(ValueError, match="no tokens"):
        mm.position_ids(variant, torch.zeros(0, 6, dtype=torch.int64), grid)


@pytest.mark.parametrize("which", ["image", "video"])
def test_a_float_grid_is_refused_not_truncated(which):
    types = T([[0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0]])
    images, videos = T([[1, 4, 4]]), T([[1, 4, 4]])
    if which == "image":
        images = T([[1.0, 4.0, 4.0]])
    else:
        videos = T([[1.9, 4.0, 4.0]])  # was read as (1, 4, 4)
    with pytest.raises(ValueError, match=f"{which}_grid_thw must hold integers"):
        mm.merge_grids(types, images, videos)
    with pytest.raises(ValueError, match=f"{which}_grid_thw must hold integers"):  # one modality alone as well
        mm.merge_grids(types, images if which == "image" else None, videos if which == "video" else None)


# --------------------------------------------------------------------------- design options
POSITIVE = f"positive numbers no larger than {2**20}"
BAD_NUMBERS = [1e308, float("inf"), float("nan"), -1, 0, True, "2", None, [2]]
NUMBER_OPTIONS = [
    ("mrope", "temporal_stride"),
    ("qwen25vl", "tokens_per_second"),
    ("videorope", "temporal_scale"),
    ("v2pe", "stride"),
    ("v2pe", "tile_tokens"),
]


@pytest.mark.parametrize("variant,option", NUMBER_OPTIONS)
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_a_number_option_of_the_wrong_kind_is_refused_up_front(variant, option, value):
    """``temporal_stride=1e308`` raised a raw OverflowError at the first forward before, a bool or a string was
    taken as a number. Refused by ``with_options`` (how a recorded export is restored), the constructor and
    ``position_ids`` alike, naming the option and what it takes."""
    v = mm.get_variant(variant)
    pattern = f"{option} must be a positive number no larger than {2**20}"
    with pytest.raises(ValueError, match=pattern):
        v.with_options(**{option: value})
    with pytest.raises(ValueError, match=pattern):
        mm.Variant(v.design, v.allocation, {option: value})
    with pytest.raises(ValueError, match=pattern):
        mm.position_ids(variant, VIDEO, VIDEO_GRID, **{option: value})


def test_number_options_in_range_are_taken_with_their_meaning():
    """The largest stride allowed, a fractional one and an int one give the hand-computed grid ids: a 2-frame
    1 x 1 video at text position 1 puts frame tau at 1 + stride * tau, the text after it at 1 + stride + 1."""
    types = T([[0, 2, 2, 0]])
    grid = T([[2, 2, 2]])
    for stride in (2**20, 0.5, 3):
        v = mm.get_variant("mrope").with_options(temporal_stride=stride)
        ids, _ = mm.position_ids(v, types, grid, dtype=torch.float64)
        assert ids[0, 0].tolist() == [0, 1, 1 + stride, max(stride, 0) + 2]


@pytest.mark.parametrize(
    "variant,option,value,expected",
    [
        ("mrope", "spatial_reset", 1, "must be True or False"),
        ("mrope", "spatial_reset", "yes", "must be True or False"),
        ("hope_video", "training", "true", "must be True or False"),
        ("pype", "depth", True, "must be an integer from 1 to 4096"),
        ("pype", "depth", 0, "must be an integer from 1 to 4096"),
        ("pype", "depth", 2.5, "must be an integer from 1 to 4096"),
        ("pype", "depth", 10**9, "must be an integer from 1 to 4096"),
        ("pype", "interval", "4", "must be an integer from 1 to 4096"),
        ("v2pe", "mode", "fixed", "must be 'fix', 'rnd' or 'default'"),
        ("v2pe", "generator", 0, "must be a torch.Generator or None"),
        ("v2pe", "strides", [1, float("nan")], f"must be None or a list of {POSITIVE}: every stride must be"),
        ("v2pe", "strides", "1248", f"must be None or a list of {POSITIVE}: every stride must be"),
        ("hope_video", "temporal_scales", [0.5, 1e308], f"must be None or a list of {POSITIVE}: every temporal scale"),
        ("qwen25vl", "second_per_grid_ts", [True], "must be None, a real tensor, or numbers from 0 to 1048576"),
        ("qwen25vl", "second_per_grid_ts", ["2"], "must be None, a real tensor, or numbers from 0 to 1048576"),
        ("qwen25vl", "second_per_grid_ts", torch.tensor([1j]), "must be None, a real tensor, or numbers"),
    ],
)
def test_other_options_of_the_wrong_kind_are_refused_up_front(variant, option, value, expected):
    v = mm.get_variant(variant)
    with pytest.raises(ValueError, match=f"{option} {expected}"):
        v.with_options(**{option: value})
    with pytest.raises(ValueError, match=f"{option} {expected}"):
        mm.position_ids(variant, VIDEO, VIDEO_GRID, **{option: value})


def test_the_refusal_names_the_design_the_option_and_the_value():
    with pytest.raises(ValueError) as e:
        mm.get_variant("mrope").with_options(temporal_stride=1e308)
    assert str(e.value).startswith("grid design: temporal_stride must be") and str(e.value).endswith("got 1e+308")


def test_valid_options_of_every_kind_are_taken():
    """Ints, floats, numpy-free Python values of each kind: the variants build and give ids of the right shape."""
    types, _, grid = batch([tokens(1, ("vid", (2, 4, 4)), 1)])
    for variant, options in [
        ("mrope", {"temporal_stride": 2, "spatial_reset": True}),
        ("qwen25vl", {"tokens_per_second": 4, "second_per_grid_ts": [0.5]}),
        ("hope_video", {"training": True, "temporal_scales": [0.5, 1.5], "generator": torch.Generator()}),
        ("v2pe", {"mode": "rnd", "strides": [1, 2.5], "tile_tokens": 256}),
        ("pype", {"depth": 3, "interval": 1}),
    ]:
        v = mm.get_variant(variant).with_options(**options)
        ids, _ = mm.position_ids(v, types, grid)
        assert ids.shape[1:] == types.shape and bool(torch.isfinite(ids.double()).all())
        assert not math.isnan(float(ids.double().sum()))


def test_every_option_of_every_design_has_a_rule_its_default_passes():
    """A design option without a rule would raise a KeyError when given; a default its rule refuses would make the
    rule wrong (the defaults are what the released methods use)."""
    from vlpe.encodings.multimodal.designs import _OPTION_RULES

    for design in mm.DESIGNS.values():
        for option, default in design.defaults.items():
            assert option in _OPTION_RULES, (design.name, option)
            assert _OPTION_RULES[option](default) is None, (design.name, option, default)
        assert design.options(dict(design.defaults)) == design.defaults  # every default given back is taken
