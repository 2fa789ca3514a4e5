"""Config floats written with an exponent and no dot (``train.lr=1e-3``), which YAML 1.1 reads as strings."""

from __future__ import annotations

import pytest

from train.config import ConfigError, from_dict, parse_overrides
from train.engine import TrainSection


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("2E-05", 2e-5), ("+3e2", 300.0), ("1.5e-4", 1.5e-4)])
def test_exponent_floats_from_the_command_line(text, value):
    cfg = from_dict(TrainSection, parse_overrides([f"lr={text}"]))
    assert isinstance(cfg.lr, float) and cfg.lr == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "1e", "e-3", "1e-3x"])
def test_other_strings_are_still_errors(text):
    with pytest.raises(ConfigError, match="expected float"):
        from_dict(TrainSection, {"lr": text})


def test_int_fields_take_no_exponent_strings():
    with pytest.raises(ConfigError):
        from_dict(TrainSection, {"steps": "1e3"})
