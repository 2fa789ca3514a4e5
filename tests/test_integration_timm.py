"""vlpe ViTs in timm's registry, and `vlpe.integrations.timm.convert` against the original timm models."""

import pytest
import timm
import torch

import models.vit  # noqa: F401  (registers vlpe_vit_* with timm)
import vlpe.integrations.timm as vt


def _timm_vit(**kw):
    torch.manual_seed(0)
    return timm.create_model("vit_base_patch16_224", pretrained=False, depth=2, num_classes=5, **kw).eval()


def test_registered_models_build_with_any_encoding_and_size():
    assert "vlpe_vit_small_patch16_224" in timm.list_models("vlpe_vit_*")
    m = timm.create_model("vlpe_vit_base_patch16_224", encoding="lookhere", depth=2, num_classes=3).eval()
    assert m.encoding.name == "lookhere"
    with torch.no_grad():
        assert m(torch.randn(1, 3, 224, 224)).shape == (1, 3)
        m.set_input_size(img_size=320)
        assert m(torch.randn(1, 3, 320, 256)).shape == (1, 3)
    with pytest.raises(ValueError, match="pretrained"):
        timm.create_model("vlpe_vit_small_patch16_224", pretrained=True)


def test_convert_ape_equals_timm_at_every_size():
    """The learned table copied into vlpe's ape: same logits as timm, resampled like timm's dynamic size."""
    m = _timm_vit(dynamic_img_size=True)
    x, x_rect = torch.randn(2, 3, 224, 224), torch.randn(1, 3, 160, 288)
    with torch.no_grad():
        ref, ref_rect = m(x), m(x_rect)
        c = vt.convert(m, "ape").eval()
        torch.testing.assert_close(c(x), ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(c(x_rect), ref_rect, rtol=0, atol=1e-5)


def test_convert_nope_equals_timm_without_position_embedding():
    m = _timm_vit()
    with torch.no_grad():
        m.pos_embed.zero_()
        x = torch.randn(2, 3, 224, 224)
        ref = m(x)
        torch.testing.assert_close(vt.convert(m, "nope").eval()(x), ref, rtol=0, atol=1e-5)


def test_convert_keeps_weights_and_switches_encoding():
    m = _timm_vit()
    qkv = m.blocks[0].attn.qkv.weight
    c = vt.convert(m, "lookhere", inplace=True).eval()
    assert c.model.blocks[0].attn.qkv.weight is qkv  # inplace: shared, not copied
    assert c.model.pos_embed is None
    with torch.no_grad():
        a = c(torch.randn(1, 3, 224, 224))
        b = c(torch.randn(1, 3, 448, 320))  # any size, no resampling needed
    assert a.shape == b.shape == (1, 5)
    # the encoding really acts: LookHere's masks change the output compared with no encoding
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert not torch.allclose(c(x), vt.convert(_timm_vit(), "nope").eval()(x))


def test_convert_eva_and_bad_input():
    torch.manual_seed(0)
    e = timm.create_model("vit_small_patch16_rope_224", pretrained=False, depth=2, num_classes=4).eval()
    c = vt.convert(e, "rope_mixed").eval()
    with torch.no_grad():
        assert c(torch.randn(1, 3, 192, 256)).shape == (1, 4)
    with pytest.raises(ValueError, match="VisionTransformer or Eva"):
        vt.convert(torch.nn.Linear(3, 3), "rope")
    with pytest.raises(ValueError, match="unknown encoding"):
        vt.convert(_timm_vit(), "ropee")
