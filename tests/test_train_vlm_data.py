"""train/vlm.py's datasets: several training lengths (data.train_lengths) and their validation."""

from __future__ import annotations

import pytest

from train.config import ConfigError, from_dict
from train.vlm_setup import VLMConfig, build_datasets


def _cfg(**data):
    return from_dict(VLMConfig, {"data": {"needles": "photos", "frames": 8, "train_samples": 64, "val_samples": 16,
                                          **data}})  # fmt: skip


def test_train_lengths_mix_the_given_lengths():
    train, val = build_datasets(_cfg(train_lengths=[2, 4, 8]))
    seen = {train[i]["length"] for i in range(len(train))}
    assert seen == {2, 4, 8}
    assert {val[i]["length"] for i in range(len(val))} == {2, 4, 8}
    only = build_datasets(_cfg())[0]
    assert {only[i]["length"] for i in range(len(only))} == {8}


@pytest.mark.parametrize("bad", [[], [2, 4], [2, 16], [0, 8]])
def test_train_lengths_must_end_at_frames(bad):
    with pytest.raises(ConfigError, match="train_lengths"):
        build_datasets(_cfg(train_lengths=bad))
