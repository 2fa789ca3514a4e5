"""open_clip preprocessing of the vlpe towers, and ``eval/zero_shot.py``'s command line.

Checked against: the towers' own timm ``pretrained_cfg`` (mean / std of ``models/vit_timm.py``), the pixels
``eval/zero_shot.py`` trains on (``_pixels``), open_clip's own transform pipeline (``image_transform_v2`` through
``open_clip.create_model_and_transforms``) and ``ZeroShotConfig``'s fields (for ``--help``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

open_clip = pytest.importorskip("open_clip")
import zero_shot as zs  # noqa: E402

import models.clip as vo  # noqa: E402

NAME = "vlpe-ViT-Pico-4-28-rope"
TINY = ["steps=2", "batch_size=16", "train_limit=64", "test_limit=20", "sizes=[28]", "eval_batch=20", "warmup_steps=1"]


def test_preprocess_cfg_matches_the_towers_timm_config():
    model, _, _ = vo.create_model_and_transforms(NAME)
    pp, timm_cfg = model.visual.preprocess_cfg, model.visual.trunk.pretrained_cfg
    assert tuple(pp["mean"]) == tuple(timm_cfg["mean"]) and tuple(pp["std"]) == tuple(timm_cfg["std"])
    assert vo.preprocess_cfg(NAME)["size"] == vo.TOWERS["vlpe-ViT-Pico-4-28"][2]
    with pytest.raises(ValueError, match="not a config of models.clip"):
        vo.preprocess_cfg("ViT-B-32")


def test_open_clips_transform_gives_the_pixels_the_tower_is_trained_on():
    from PIL import Image

    x, _, _ = zs._fashion_mnist("test", 4)
    model, _, val = vo.create_model_and_transforms(NAME)
    ours = torch.stack([val(Image.fromarray(np.asarray(im), mode="L")) for im in x])  # (4, 3, 28, 28)
    trained = zs._pixels(x, 28, model.visual.preprocess_cfg)
    torch.testing.assert_close(ours, trained, atol=1e-6, rtol=0)


def test_register_takes_a_preprocess_cfg():
    config = vo.config_for("vlpe-ViT-Pico-4-28", "ape")
    vo.register("vlpe-test-pico-ape-half", config, preprocess=dict(mean=(0.5,) * 3, std=(0.5,) * 3))
    assert vo.preprocess_cfg("vlpe-test-pico-ape-half")["mean"] == (0.5,) * 3
    with pytest.raises(ValueError, match="unknown key 'crop'"):
        vo.register("vlpe-test-pico-ape-bad", config, preprocess=dict(crop=0.9))
    assert "vlpe-test-pico-ape-bad" not in open_clip.list_models()


def test_zero_shot_help_lists_every_key():
    text = zs.build_parser().format_help()
    for f in dataclasses.fields(zs.ZeroShotConfig):
        assert f"  {f.name}=" in text, f"--help does not list {f.name}"


def test_zero_shot_takes_positional_overrides_and_shows_progress(tmp_path, capsys):
    result = zs.main(["encodings=[nope]", *TINY, "--out", str(tmp_path)])
    assert result["config"]["steps"] == 2 and list(result["results"]) == ["nope"]
    assert "[zero-shot] nope" in capsys.readouterr().err  # the progress bar (tqdm, stderr)
    assert json.loads((tmp_path / "zero_shot.json").read_text())["config"]["train_limit"] == 64
