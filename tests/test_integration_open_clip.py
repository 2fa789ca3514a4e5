"""vlpe ViT towers in open_clip (timm_model_name path): listed configs, any-resolution encode_image, offline tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

open_clip = pytest.importorskip("open_clip")

import models.clip as vo  # noqa: E402
from models.vit import ViT, fits, grid_encodings  # noqa: E402

TOWER = "vlpe-ViT-Pico-4-28"


def test_every_grid_encoding_is_listed_with_its_timm_tower():
    listed = set(open_clip.list_models())
    for tower, (preset, *_) in vo.TOWERS.items():
        for enc in grid_encodings():
            name = f"{tower}-{enc}"
            assert (name in listed) == fits(preset, enc) == (name in vo.names(enc))
            if name in listed:
                cfg = open_clip.get_model_config(name)
                assert cfg["vision_cfg"]["timm_model_name"].endswith(f"_{enc}")  # open_clip's own timm path
    assert "mrope" not in grid_encodings()  # a 3-axis decoder encoding gets no image tower
    assert f"{TOWER}-lh45" not in listed  # LookHere's 8-direction preset needs 12 heads; Pico has 6
    assert len(vo.names()) >= 2 * 15


@pytest.mark.parametrize("encoding", ["lookhere", "ape", "rope_mixed"])
def test_create_model_encodes_images_at_any_resolution(encoding):
    torch.manual_seed(0)
    clip = open_clip.create_model(f"{TOWER}-{encoding}").eval()
    assert isinstance(clip, open_clip.CLIP)
    trunk = clip.visual.trunk
    assert isinstance(trunk, ViT) and trunk.encoding.name == encoding and trunk.global_pool == "token"
    with torch.no_grad():
        for size in ((28, 28), (56, 56), (84, 42)):
            x = torch.rand(2, 3, *size)
            f = clip.encode_image(x, normalize=True)
            assert f.shape == (2, 96) and torch.allclose(f.norm(dim=-1), torch.ones(2))
            # open_clip's TimmModel: the trunk's class token (pooled by the trunk), then the projection
            ref = clip.visual.head(trunk.forward_head(trunk.forward_features(x)))
            torch.testing.assert_close(clip.encode_image(x), ref, rtol=0, atol=0)


def test_tokenizer_is_the_bundled_bpe_and_needs_no_network(monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    tok = open_clip.get_tokenizer(f"{TOWER}-rope")
    assert isinstance(tok, open_clip.SimpleTokenizer)
    assert (Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz").is_file()  # shipped in the wheel
    ids = tok(["a photo of a sneaker.", "a bag"])
    assert ids.shape == (2, 16) and int(ids[0, 0]) == tok.sot_token_id
    clip = open_clip.create_model(f"{TOWER}-rope")
    with torch.no_grad():
        image, text, scale = clip(torch.rand(2, 3, 28, 28), ids)
    assert image.shape == text.shape == (2, 96) and scale.ndim == 0


def test_register_own_config_and_bad_input():
    cfg = vo.config_for(TOWER, "alibi")
    cfg["text_cfg"]["layers"] = 1
    assert vo.register("my-alibi-clip", cfg) == "my-alibi-clip"
    clip = open_clip.create_model("my-alibi-clip")
    assert len(clip.transformer.resblocks) == 1 and clip.visual.trunk.encoding.name == "alibi"
    with pytest.raises(ValueError, match="unknown tower"):
        vo.config_for("ViT-B-16", "rope")
    with pytest.raises(ValueError, match="2D grid"):
        vo.config_for(TOWER, "mrope")
    with pytest.raises(ValueError, match="does not build for the pico ViT"):
        vo.config_for(TOWER, "lh45")
    with pytest.raises(ValueError, match="unknown encoding"):
        vo.config_for(TOWER, "ropee")
    with pytest.raises(ValueError, match="embed_dim, vision_cfg and text_cfg"):
        vo.register("broken", {"vision_cfg": {}})
    bad = vo.config_for(TOWER, "rope")
    bad["vision_cfg"]["timm_model_name"] = "vlpe_vit_pico_patch5_28"
    with pytest.raises(ValueError, match="not a timm architecture"):
        vo.register("broken", bad)
