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


# --------------------------------------------------------------------------- the timm model API of vlpe ViTs
def _pair(global_pool="token", reg_tokens=0, **kw):
    """A stock timm ViT without position embedding and a vlpe ``nope`` ViT holding the same weights."""
    dims = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    torch.manual_seed(0)
    ref = timm.create_model(
        "vit_base_patch16_224", pos_embed="none", dynamic_img_size=True, global_pool=global_pool,
        reg_tokens=reg_tokens, fc_norm=False, **dims, **kw,
    ).eval()
    ours = timm.create_model(
        "vlpe_vit_tiny_patch8_224", encoding="nope", global_pool=global_pool, reg_tokens=reg_tokens,
        class_token=True, **dims, **kw,
    ).eval()
    sd = ref.state_dict()
    prefix = [sd.pop(k) for k in ("cls_token", "reg_token") if k in sd]
    mapped = {"tokenizer.prefix.tokens": torch.cat(prefix, dim=1)}
    for k, v in sd.items():
        k = k.replace("patch_embed.proj", "tokenizer.proj")
        k = "encoder." + k if k.startswith(("blocks.", "norm.")) else k
        mapped[k] = v
    ours.load_state_dict(mapped)
    return ref, ours


@pytest.mark.parametrize("global_pool,reg_tokens", [("token", 0), ("avg", 2), ("", 1)])
def test_vit_forward_api_matches_stock_timm_vit(global_pool, reg_tokens):
    """forward_features is a tensor, forward_head(pre_logits=) and the pooling are timm's, at any size."""
    ref, ours = _pair(global_pool, reg_tokens)
    assert ours.global_pool == ref.global_pool and ours.num_prefix_tokens == ref.num_prefix_tokens
    for size in ((32, 32), (48, 24)):
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            f, f_ref = ours.forward_features(x), ref.forward_features(x)
            assert isinstance(f, torch.Tensor)
            torch.testing.assert_close(f, f_ref, rtol=0, atol=2e-5)
            torch.testing.assert_close(ours.forward_head(f, pre_logits=True), ref.forward_head(f_ref, pre_logits=True), rtol=0, atol=2e-5)
            torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=2e-5)
    feats, pos = ours.forward_features(x, return_positions=True)
    assert pos.prefix == 1 + reg_tokens and torch.equal(feats, ours.forward_features(x))


@pytest.mark.parametrize("kw", [
    dict(indices=None), dict(indices=2), dict(indices=[0, -1], norm=True),
    dict(indices=[1], return_prefix_tokens=True, output_fmt="NLC"), dict(indices=[0], stop_early=True),
    dict(indices=[-2, -1], output_dict=True, return_prefix_tokens=True),
    dict(indices=1, intermediates_only=True),
])
def test_forward_intermediates_matches_stock_timm_vit(kw):
    ref, ours = _pair("token", 1)
    x = torch.randn(2, 3, 40, 24)
    with torch.no_grad():
        got, want = ours.forward_intermediates(x, **kw), ref.forward_intermediates(x, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_features_only_matches_stock_timm_vit():
    """features_only=True: timm's FeatureGetterNet over the chosen blocks (not logits), NCHW maps, feature_info."""
    kw = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2)
    ours = timm.create_model("vlpe_vit_tiny_patch8_224", encoding="lookhere", features_only=True, out_indices=(0, -1), **kw)
    ref = timm.create_model("vit_base_patch16_224", features_only=True, out_indices=(0, -1), dynamic_img_size=True, **kw)
    assert type(ours) is type(ref)
    assert ours.feature_info.channels() == ref.feature_info.channels() == [32, 32]
    assert ours.feature_info.reduction() == ref.feature_info.reduction() == [8, 8]
    assert len(ours.model.encoder.blocks) == len(ref.model.blocks) == 3  # pruned after the last index
    with torch.no_grad():
        out = ours(torch.randn(1, 3, 40, 56))
    assert [tuple(t.shape) for t in out] == [(1, 32, 5, 7)] * 2
    default = timm.create_model("vlpe_vit_micro_patch4_28", features_only=True)
    assert default.feature_info.module_name() == [f"encoder.blocks.{i}" for i in (1, 2, 3)]  # the last 3, as timm


def test_classifier_reset_and_timm_constructor_keywords():
    ref, ours = _pair("token")
    for m in (ref, ours):
        m.reset_classifier(7, "avg")
    assert ours.get_classifier().out_features == 7 and ours.global_pool == ref.global_pool == "avg"
    with torch.no_grad():
        ours.head.load_state_dict(ref.head.state_dict())
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=2e-5)
    ours.reset_classifier(0, "")
    assert isinstance(ours.get_classifier(), torch.nn.Identity)
    with torch.no_grad():
        assert ours(x).shape == (2, 17, 32)  # no pooling, no head: every token, as timm's global_pool=''
    gap = timm.create_model("vlpe_vit_micro_patch4_28", global_pool="avg")  # vlpe's gap: no class token
    assert gap.num_prefix_tokens == 0
    with pytest.raises(ValueError, match="class token"):
        gap.reset_classifier(3, "token")
    with pytest.raises(ValueError, match="global_pool must be one of"):
        timm.create_model("vlpe_vit_micro_patch4_28", global_pool="map")
    with pytest.raises(ValueError, match="lookhere"):
        timm.create_model("vlpe_vit_micro_patch4_28_lookhere", encoding="rope")
    with pytest.raises(ValueError, match="outside"):
        ours.forward_intermediates(x, indices=[3])


def test_grad_checkpointing_and_group_matcher():
    from timm.models import group_parameters

    m = timm.create_model("vlpe_vit_micro_patch4_28", encoding="rope_mixed", drop_path_rate=0.1)
    x = torch.randn(2, 3, 28, 28)
    grads = []
    for enable in (False, True):
        m.set_grad_checkpointing(enable)
        m.zero_grad()
        torch.manual_seed(0)
        m(x).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    groups = group_parameters(m, m.group_matcher())
    assert len(groups) == 1 + 4 + 1  # stem (tokenizer + encoding), one per block, the final norm (+ head)


def test_save_for_hf_and_pretrained_file_round_trip(tmp_path):
    """timm's own export and loaders: save_for_hf -> local-dir:, and pretrained=True from a checkpoint file."""
    from timm.models import save_for_hf
    import safetensors.torch

    m = timm.create_model("vlpe_vit_micro_patch4_28_lookhere", num_classes=4, reg_tokens=1).eval()
    m.reset_classifier(4, "avg")  # the class token stays: the export says so
    save_for_hf(m, tmp_path / "hf", safe_serialization=True)
    x = torch.randn(2, 3, 28, 36)
    back = timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True).eval()
    assert back.pretrained_cfg["architecture"] == "vlpe_vit_micro_patch4_28_lookhere"
    with torch.no_grad():
        assert torch.equal(back(x), m(x))
    # a training run's export (keys under backbone.) through pretrained_cfg_overlay=dict(file=...)
    run = tmp_path / "model.safetensors"
    safetensors.torch.save_file({f"backbone.{k}": v for k, v in m.state_dict().items()}, run)
    again = timm.create_model(
        "vlpe_vit_micro_patch4_28_lookhere", pretrained=True, reg_tokens=1, global_pool="avg", class_token=True,
        pretrained_cfg_overlay=dict(file=str(run), num_classes=4),
    ).eval()
    with torch.no_grad():
        assert torch.equal(again(x), m(x))
    assert again.pretrained_cfg["num_classes"] == 4 and again.default_cfg is again.pretrained_cfg


def test_every_encoding_named_architecture_builds_and_runs():
    """One timm name per (preset, size, encoding) that fits; each builds with its encoding and runs."""
    from models.vit import TIMM_PRESETS, fits, grid_encodings

    for enc in grid_encodings():
        for preset in TIMM_PRESETS:
            assert timm.is_model(f"vlpe_vit_{preset}_patch4_28_{enc}") == fits(preset, enc)
        m = timm.create_model(f"vlpe_vit_pico_patch4_28_{enc}" if fits("pico", enc) else f"vlpe_vit_micro_patch4_28_{enc}")
        assert m.encoder.encoding_name == enc and m.pretrained_cfg["architecture"].endswith(enc)
        with torch.no_grad():
            assert m.eval()(torch.randn(1, 3, 28, 40)).shape == (1, 1000)
    assert not timm.is_model("vlpe_vit_base_patch16_224_mrope")
    with pytest.raises(ValueError, match="2D grid"):
        models.vit.register_timm("mrope")


def test_importing_the_models_draws_no_random_number():
    """The timm registration at import builds every registered encoding on trial; the caller's generator is left
    as it was, so a model's initialisation never depends on when ``models.vit`` was first imported, nor on which
    encodings are registered."""
    import subprocess
    import sys

    code = ("import torch; torch.manual_seed(0); a = torch.rand(3); torch.manual_seed(0); import models.vit; "
            "b = torch.rand(3); assert torch.equal(a, b), (a, b)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
