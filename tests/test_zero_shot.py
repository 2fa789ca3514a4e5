"""eval/zero_shot.py: CLIPs with vlpe towers trained on Fashion-MNIST captions, zero-shot at several sizes."""

from __future__ import annotations

import json

import pytest
import torch

open_clip = pytest.importorskip("open_clip")
import zero_shot as zs  # noqa: E402

from train.config import ConfigError, load_config  # noqa: E402

TINY = ["steps=3", "batch_size=16", "train_limit=128", "test_limit=40", "sizes=[28,56]", "eval_batch=20", "warmup_steps=1"]


def test_unicl_loss_is_clip_loss_when_every_caption_is_unique():
    torch.manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    scale = torch.tensor(14.0)
    ref = open_clip.ClipLoss()(image, text, scale)
    torch.testing.assert_close(zs.unicl_loss(image, text, scale, torch.arange(8)), ref)
    # two images of one class: each one's caption is a positive of the other
    labels = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])
    assert zs.unicl_loss(image, text, scale, labels) != ref


def test_main_trains_every_encoding_and_writes_the_table(tmp_path):
    threads = torch.get_num_threads()
    result = zs.main(["--encodings", "nope", "lookhere", "--set", *TINY, "--out", str(tmp_path)])
    assert torch.get_num_threads() == threads  # the config's threads=1 holds for the run only
    assert list(result["results"]) == ["nope", "lookhere"]
    for row in result["results"].values():
        assert set(row["top1"]) == {28, 56} and all(0.0 <= a <= 1.0 for a in row["top1"].values())
        assert row["vision_params"] > 0 and row["loss_first"] > 0
    saved = json.loads((tmp_path / "zero_shot.json").read_text())
    assert saved["config"]["steps"] == 3 and saved["data"]["test_images"] == 40 and saved["train_size"] == 28
    assert set(saved["templates"]["train"]).isdisjoint(saved["templates"]["test"])  # held-out prompts
    md = (tmp_path / "zero_shot.md").read_text()
    assert "| encoding | 28 px (train) | 56 px (2x) |" in md and "| lookhere |" in md


def test_training_is_deterministic_per_seed():
    cfg = load_config(zs.ZeroShotConfig, zs.DEFAULT_CONFIG, ["encodings=[rope]", *TINY, "steps=2"])
    x, y, classes = zs._fashion_mnist("train", 64)
    a = zs.train_clip(cfg, "rope", x, y, classes)[2]
    b = zs.train_clip(cfg, "rope", x, y, classes)[2]
    assert a == b and len(a) == 2


def test_bad_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="valid keys"):
        zs.main(["--set", "step=3", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="at least one encoding"):
        zs.main(["--set", "encodings=[]", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="batch_size"):
        zs.main(["--set", "batch_size=1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="no open_clip config"):
        zs.main(["--encodings", "mrope", "--set", *TINY, "--out", str(tmp_path)])
