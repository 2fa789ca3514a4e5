"""timm's model test-suite re-stated for the ``vlpe_vit_*`` architectures.

Each ``test_model_*`` below is named after the function of timm's ``tests/test_models.py`` (pytorch-image-models,
the suite of timm 1.0.x) whose checks it re-implements, and asserts what that function asserts, with timm's input
sizes: a model without a fixed input size runs at its cfg's ``input_size`` clipped to the test's target side
(``TARGET_*`` below, timm's values). timm's ViTs decide which of its tests apply, and the same ones apply here:

* cfgs: ViTs give tokens, not a spatial map (``pool_size`` None), so timm runs ``test_model_default_cfgs_non_std``
  on them (its ``NON_STD_FILTERS``), not the NCHW checks of ``test_model_default_cfgs``;
* features: ``features_only`` goes through ``forward_intermediates`` (timm's getter), as for ``vit_*``;
* FX: traced with timm's registered notrace modules and functions (:mod:`models.vit_timm` adds the vlpe ones) and
  torchvision's feature extractor, exactly as timm's ``_create_fx_model`` does; the traced model must equal eager;
* FX feature extraction (``feature_cls='fx'``): each level is the eager block output (the models whose encoding
  also acts between blocks, and the default one);
* TorchScript: vlpe encodings cannot be scripted (:data:`vlpe.encodings.base.NOT_SCRIPTABLE`), so where timm's
  ``test_model_forward_torchscript`` scripts and runs a model, here scripting must fail with that reason (timm lists
  its own unscriptable models in ``EXCLUDE_JIT_FILTERS`` instead).

Models: the pretrained cfg of every registered ``vlpe_vit_*`` name is checked; the tests that build models run one
architecture per encoding (each at the cheapest preset registered for it, at the smallest image size), the
keyword-encoding ViT of every preset (tiny, small, base, micro, pico) at that size, and the keyword-encoding ViT at
224 px, which exercises timm's clipping of a non-fixed input size.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import timm
import torch
from timm.layers import get_channel_dim, get_spatial_dim, set_layer_config
from timm.models import FeatureInfo, get_notrace_functions, get_notrace_modules, get_pretrained_cfg
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import models.vit as mv
import vlpe
from vlpe.encodings.base import NOT_SCRIPTABLE

# timm's target sides per test (tests/test_models.py)
TARGET_FWD_SIZE = 384
TARGET_BWD_SIZE = 128
TARGET_JIT_SIZE = 128
TARGET_FFEAT_SIZE = 96
TARGET_FWD_FX_SIZE = 128
TARGET_BWD_FX_SIZE = 128

ALL = timm.list_models("vlpe_vit_*")
_NAME = re.compile(r"vlpe_vit_(?P<preset>[a-z]+)_patch(?P<patch>\d+)_(?P<size>\d+)(?:_(?P<encoding>\w+))?$")


def _cheapest_per_encoding(names: list[str]) -> list[str]:
    """One name per encoding (and the keyword one): its cheapest registered preset at the smallest image size."""
    parsed = [(n, _NAME.match(n)) for n in names]
    smallest = min(int(m["size"]) for _, m in parsed)
    cost = {p: d["embed_dim"] ** 2 * d["depth"] for p, d in mv.PRESETS.items()}
    pick: dict[str | None, str] = {}
    for n, m in sorted(parsed, key=lambda nm: cost[nm[1]["preset"]]):
        if int(m["size"]) == smallest:
            pick.setdefault(m["encoding"], n)
    return sorted(pick.values())


#: one architecture per encoding, the keyword-encoding ViT of every preset at the smallest image size, and one at
#: 224 px (timm clips a non-fixed input size to the test's target side)
MODELS = sorted(
    set(_cheapest_per_encoding(ALL))
    | {n for n in ALL if _NAME.match(n)["encoding"] is None and _NAME.match(n)["size"] == "28"}
) + [mv.timm_name("pico", 16, 224)]


def _acts_between_blocks(name: str) -> bool:
    """Whether the name fixes an encoding with an ``embed`` or ``mix`` hook (built as the preset builds it)."""
    m = _NAME.match(name)
    if m["encoding"] is None:
        return False
    dims = mv.PRESETS[m["preset"]]
    enc = vlpe.encodings.build(
        m["encoding"], dim=dims["embed_dim"], num_heads=dims["num_heads"], depth=dims["depth"], num_axes=2, grid=(2, 2)
    )
    return bool({"embed", "mix"} & enc.pieces)


#: the keyword-encoding ViT and those whose encoding acts between the blocks
AROUND_BLOCKS = [n for n in MODELS if _NAME.match(n)["encoding"] is None or _acts_between_blocks(n)]


def _input_size(name: str, target: int | None = None) -> tuple[int, ...]:
    """timm's ``_get_input_size``: the cfg's size, each side clipped to ``target`` unless the size is fixed."""
    cfg = get_pretrained_cfg(name)
    size = cfg.input_size
    if cfg.fixed_input_size or target is None or max(size) <= target:
        return size
    if cfg.min_input_size:
        return cfg.min_input_size
    return tuple(min(s, target) for s in size)


def _fx_model(model: torch.nn.Module) -> torch.nn.Module:
    """timm's ``_create_fx_model``: torchvision's feature extractor returning the last node of the train and the
    eval graph, traced with timm's notrace modules and functions as leaves."""
    tracer_kwargs = dict(
        leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True
    )
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    return create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=tracer_kwargs
    )


def _grads_complete(model: torch.nn.Module, num_params: int) -> None:
    for n, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {n}"
    assert sum(p.grad.numel() for p in model.parameters()) == num_params, "some parameters are missing gradients"


def test_registry_covers_every_encoding():
    """The model list is timm's registry: every grid encoding has an architecture among the models built here."""
    fixed = {_NAME.match(n)["encoding"] for n in MODELS}
    assert set(mv.grid_encodings()) | {None} <= fixed
    assert set(MODELS) <= set(ALL)


@pytest.mark.parametrize("model_name", ALL)
def test_pretrained_cfg_fields(model_name):
    """The cfg fields timm's tests and data pipeline read, in the form timm's ViT cfgs give them: the size the name
    says (channels first), no pooled feature map (``pool_size`` None: tokens), a size that is not fixed (positions
    come from each input), one mean and std per channel, and the first conv / classifier as module names."""
    cfg = get_pretrained_cfg(model_name)
    m = _NAME.match(model_name)
    assert cfg.input_size == (3, int(m["size"]), int(m["size"]))
    assert cfg.pool_size is None and cfg.fixed_input_size is False
    assert len(cfg.mean) == len(cfg.std) == cfg.input_size[0] and min(cfg.std) > 0
    assert 0 < cfg.crop_pct <= 1 and cfg.interpolation in ("bilinear", "bicubic")
    assert cfg.num_classes == 1000 and isinstance(cfg.first_conv, str) and isinstance(cfg.classifier, str)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward(model_name):
    """timm ``test_model_forward``: one eval forward at the clipped size, no NaN, the same with grad checkpointing."""
    model = timm.create_model(model_name, pretrained=False).eval()
    inputs = torch.randn(1, *_input_size(model_name, TARGET_FWD_SIZE))
    outputs = model(inputs)
    assert outputs.shape[0] == 1
    assert not torch.isnan(outputs).any()
    model.set_grad_checkpointing()
    torch.testing.assert_close(model(inputs), outputs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_backward(model_name):
    """timm ``test_model_backward``: a train-mode backward with 42 classes reaches every parameter."""
    model = timm.create_model(model_name, pretrained=False, num_classes=42).train()
    num_params = sum(p.numel() for p in model.parameters())
    outputs = model(torch.randn(2, *_input_size(model_name, TARGET_BWD_SIZE)))
    outputs.mean().backward()
    _grads_complete(model, num_params)
    assert outputs.shape[-1] == 42
    assert not torch.isnan(outputs).any()


@pytest.mark.parametrize("model_name", MODELS)
def test_model_default_cfgs_non_std(model_name):
    """timm ``test_model_default_cfgs_non_std`` (what timm runs for ``vit_*``): feature widths, the head's pooled
    width with and without a classifier, and the cfg's classifier and first conv naming real weights. Also the cfg
    describing the model built from it (size, channels, classes), which timm's data config relies on."""
    model = timm.create_model(model_name, pretrained=False).eval()
    assert model.num_classes >= 0 and model.num_features > 0 and model.head_hidden_size > 0
    state_dict = model.state_dict()
    cfg = model.default_cfg
    input_size = _input_size(model_name)
    assert max(input_size) <= 320
    assert tuple(cfg["input_size"]) == (model.in_chans, *model.img_size) and cfg["num_classes"] == model.num_classes

    x = torch.randn(1, *input_size)
    outputs = model.forward_features(x)
    outputs_pre = model.forward_head(outputs, pre_logits=True)
    assert outputs.shape[-1 if outputs.ndim == 3 else 1] == model.num_features
    assert outputs_pre.shape[1] == model.head_hidden_size

    model.reset_classifier(0)
    assert model.num_classes == 0
    outputs = model(x)
    assert outputs.shape[-1 if outputs.ndim == 3 else 1] == model.head_hidden_size
    assert outputs.shape == outputs_pre.shape

    outputs = timm.create_model(model_name, pretrained=False, num_classes=0).eval()(x)
    assert outputs.shape[-1 if outputs.ndim == 3 else 1] == model.num_features

    assert cfg["classifier"] + ".weight" in state_dict
    assert state_dict[cfg["classifier"] + ".weight"].shape[0] == cfg["num_classes"]
    assert cfg["first_conv"] + ".weight" in state_dict
    assert state_dict[cfg["first_conv"] + ".weight"].shape[1] == cfg["input_size"][0]


def _check_feature_maps(info: FeatureInfo, outputs, batch_size: int, input_size: tuple[int, ...]) -> None:
    """The per-level checks of timm's feature tests: channels and stride as ``info`` says, NCHW maps."""
    channels, reduction = info.channels(), info.reduction()
    feat_axis, spatial_axis = get_channel_dim("NCHW"), get_spatial_dim("NCHW")
    assert len(channels) == len(outputs)
    for e, r, o in zip(channels, reduction, outputs):
        assert e == o.shape[feat_axis]
        assert o.shape[spatial_axis[0]] <= math.ceil(input_size[-2] / r) + 1
        assert o.shape[spatial_axis[1]] <= math.ceil(input_size[-1] / r) + 1
        assert o.shape[0] == batch_size
        assert not torch.isnan(o).any()


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("feature_cls", [None, "getter"], ids=["default", "getter"])
def test_model_forward_intermediates_features(model_name, feature_cls):
    """timm ``test_model_forward_intermediates_features`` (``feature_cls='getter'``) and ``test_model_forward_features``
    (the default wrapper, the same getter for ViTs): at least 3 levels by default, each as ``feature_info`` says."""
    kwargs = {} if feature_cls is None else dict(feature_cls=feature_cls)
    model = timm.create_model(model_name, pretrained=False, features_only=True, **kwargs).eval()
    assert len(model.feature_info.channels()) >= 3
    input_size = _input_size(model_name, TARGET_FFEAT_SIZE)
    _check_feature_maps(model.feature_info, model(torch.randn(1, *input_size)), 1, input_size)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_intermediates(model_name):
    """timm ``test_model_forward_intermediates``: NCHW intermediates as ``feature_info`` says, the final output
    equal to ``forward_features``, and the same with grad checkpointing."""
    model = timm.create_model(model_name, pretrained=False).eval()
    feature_info = FeatureInfo(model.feature_info, len(model.feature_info))
    assert len(feature_info.channels()) >= 3
    input_size = _input_size(model_name, TARGET_FFEAT_SIZE)
    x = torch.randn(1, *input_size)
    output, intermediates = model.forward_intermediates(x, output_fmt="NCHW")
    _check_feature_maps(feature_info, intermediates, 1, input_size)
    torch.testing.assert_close(output, model.forward_features(x))
    model.set_grad_checkpointing()
    torch.testing.assert_close(model.forward_intermediates(x, output_fmt="NCHW")[0], output, rtol=1e-4, atol=1e-5)


def _script(model: torch.nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated in torch 2.x
        torch.jit.script(model)


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_torchscript(model_name):
    """timm ``test_model_forward_torchscript`` builds the model under ``set_scriptable(True)`` and scripts it; a vlpe
    ViT refuses with the reason and the alternatives, and is unchanged (it still runs)."""
    with set_layer_config(scriptable=True):
        model = timm.create_model(model_name, pretrained=False).eval()
    with pytest.raises(RuntimeError) as err:
        _script(model)
    assert str(err.value) == NOT_SCRIPTABLE
    assert "Positions" in NOT_SCRIPTABLE and "torch.compile" in NOT_SCRIPTABLE and "torch.fx" in NOT_SCRIPTABLE
    x = torch.randn(1, *_input_size(model_name, TARGET_JIT_SIZE))
    assert model(x).shape[0] == 1


@pytest.mark.parametrize("model_name", MODELS)
def test_model_forward_fx(model_name):
    """timm ``test_model_forward_fx``: the traced model's output equals the eager one exactly."""
    model = timm.create_model(model_name, pretrained=False).eval()
    with torch.inference_mode():
        inputs = torch.randn(1, *_input_size(model_name, TARGET_FWD_FX_SIZE))
        outputs = model(inputs)
        fx_outputs = torch.cat(tuple(_fx_model(model)(inputs).values()))
    assert torch.equal(fx_outputs, outputs)
    assert outputs.shape[0] == 1
    assert not torch.isnan(outputs).any()


@pytest.mark.parametrize("model_name", MODELS)
def test_model_backward_fx(model_name):
    """timm ``test_model_backward_fx``: a train-mode backward through the traced model reaches every parameter."""
    model = timm.create_model(model_name, pretrained=False, num_classes=42).train()
    num_params = sum(p.numel() for p in model.parameters())
    fx = _fx_model(model)
    outputs = torch.cat(tuple(fx(torch.randn(2, *_input_size(model_name, TARGET_BWD_FX_SIZE))).values()))
    outputs.mean().backward()
    _grads_complete(fx, num_params)
    assert outputs.shape[-1] == 42
    assert not torch.isnan(outputs).any()


@pytest.mark.parametrize("model_name", AROUND_BLOCKS[:2])
def test_model_forward_fx_torchscript(model_name):
    """timm ``test_model_forward_fx_torchscript`` scripts the traced model: it holds the encoding, which refuses."""
    with set_layer_config(scriptable=True):
        model = timm.create_model(model_name, pretrained=False).eval()
    with pytest.raises(RuntimeError, match=re.escape(NOT_SCRIPTABLE)):
        _script(_fx_model(model))


@pytest.mark.parametrize("model_name", AROUND_BLOCKS)
def test_fx_features_are_the_block_outputs(model_name):
    """timm's FX feature extraction (``feature_cls='fx'``) traces through the blocks: each level is exactly what the
    eager block returns (read by a forward hook on the model it was built from)."""
    fx = timm.create_model(model_name, pretrained=False, features_only=True, feature_cls="fx").eval()
    model = timm.create_model(model_name, pretrained=False).eval()
    weights = {k.removeprefix("graph_module."): v for k, v in fx.state_dict().items()}
    assert not model.load_state_dict(weights, strict=False).unexpected_keys  # the same weights in both
    seen: dict[str, torch.Tensor] = {}
    for info in fx.feature_info.get_dicts():
        block = model.get_submodule(info["module"])
        block.register_forward_hook(lambda m, a, out, key=info["module"]: seen.__setitem__(key, out))
    x = torch.randn(1, *_input_size(model_name, TARGET_FFEAT_SIZE))
    with torch.inference_mode():
        levels = fx(x)
        model(x)
    assert len(levels) == len(seen) >= 3
    for info, level in zip(fx.feature_info.get_dicts(), levels):
        assert torch.equal(level, seen[info["module"]])
