"""timm glue of the vlpe ViT: the ``vlpe_vit_*`` names, their entry points and pretrained cfgs, timm's keywords.

``timm.create_model`` keywords are mapped to the ViT's (``global_pool`` -> ``readout``, ``reg_tokens`` ->
``num_registers``; the pooling names of both live here), training exports (keys under ``backbone.``) load as bare
state dicts, and :func:`register_architectures` registers every preset x size of an encoding fixed by the name (or
chosen by keyword) as a timm entry point; the entry points and their ``default_cfgs`` live here.

This module does not know the ViT: it imports nothing from :mod:`models.vit`, whose
:func:`models.vit.register_timm` hands it the model constructor and the presets an encoding fits. :mod:`models.vit`
imports this module at its top and, at the end of its own import, registers the architectures of
:func:`models.vit.grid_encodings` (the encodings that run on a 2D grid and fit a preset) when timm is installed, so
``import models.vit`` registers them and the two modules form no import cycle (``tests/test_import_graph.py``).
Importing this module alone registers no architecture.

It also tells timm's ``torch.fx`` machinery (``timm.models.register_notrace_module`` / ``register_notrace_function``,
read by its FX feature extraction and by the FX checks of timm's ``tests/test_models.py``) which parts of a vlpe ViT
to keep as single graph nodes: the tokenizer (the positions depend on the input's size) and the pieces of
:data:`models.blocks.FX_LEAF_MODULES` / :data:`models.blocks.FX_LEAF_FUNCTIONS` (they consult the encoding's
positions and plan); the blocks between them are traced. TorchScript is refused with the reason
(:data:`vlpe.encodings.base.NOT_SCRIPTABLE`), as timm's test-suite excludes its own unscriptable models.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

__all__ = ["TIMM_PRESETS", "TIMM_SIZES", "TIMM_INSTALLED", "build_timm_model", "timm_name", "register_architectures"]


TIMM_PRESETS = ("tiny", "small", "base", "micro", "pico")
TIMM_SIZES = ((16, 224), (8, 224), (4, 32), (4, 28))  # (patch, image size)
default_cfgs: dict[str, Any] = {}  # timm reads the pretrained cfgs of this module's entry points from here

# pooling names: vlpe's readout and timm's global_pool for the same thing
_POOL_TO_READOUT = {"cls": "cls", "gap": "gap", "none": "none", "token": "cls", "avg": "gap", "": "none"}
_READOUT_TO_POOL = {"cls": "token", "gap": "avg", "none": ""}


def _readout_of(pool: str, *, what: str) -> str:
    if not isinstance(pool, str) or pool not in _POOL_TO_READOUT:
        raise ValueError(
            f"{what} must be one of 'cls'/'token' (the class token), 'gap'/'avg' (mean of the patch tokens) or "
            f"'none'/'' (no pooling: every token to the head), got {pool!r}"
        )
    return _POOL_TO_READOUT[pool]


def _timm_kwargs(kwargs: dict[str, Any], *, arch: str) -> dict[str, Any]:
    """timm's ViT keywords in vlpe's terms: ``global_pool`` -> ``readout``, ``reg_tokens`` -> ``num_registers``;
    ``dynamic_img_size`` is accepted (every vlpe ViT takes any size, positions come from each input)."""
    kwargs = dict(kwargs)
    if "global_pool" in kwargs:
        if "readout" in kwargs:
            raise ValueError(f"{arch}: pass readout or global_pool, not both")
        kwargs["readout"] = _readout_of(kwargs.pop("global_pool"), what="global_pool")
    if "reg_tokens" in kwargs:
        if "num_registers" in kwargs:
            raise ValueError(f"{arch}: pass num_registers or reg_tokens, not both")
        kwargs["num_registers"] = kwargs.pop("reg_tokens")
    dynamic = kwargs.pop("dynamic_img_size", True)
    if not isinstance(dynamic, bool):
        raise ValueError(f"{arch}: dynamic_img_size must be a bool, got {dynamic!r}")
    return kwargs


def _checkpoint_filter(state_dict: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """A training run's export (``train/``: keys under ``backbone.``) loads like a bare ViT state dict."""
    del model
    if state_dict and all(k.startswith("backbone.") for k in state_dict):
        return {k[len("backbone.") :]: v for k, v in state_dict.items()}
    return state_dict


def _has_weights(variant: str, kwargs: dict[str, Any]) -> bool:
    from timm.models import resolve_pretrained_cfg

    cfg = resolve_pretrained_cfg(
        variant, pretrained_cfg=kwargs.get("pretrained_cfg"), pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay")
    ).to_dict()
    return any(cfg.get(k) for k in ("file", "state_dict", "url", "hf_hub_id"))


def build_timm_model(
    variant: str, build: Callable[..., nn.Module], *, patch: int, size: int, fixed: str | None, pretrained: bool,
    **kwargs: Any,
) -> nn.Module:
    """The architecture ``variant`` built by timm's ``build_model_with_cfg`` from ``build(**keywords)`` (the
    model's constructor; timm's keywords mapped to its own): ``pretrained`` needs weights named by the cfg, an
    encoding fixed by the name cannot be swapped, ``features_only`` reads the last 3 blocks by default."""
    from timm.models import build_model_with_cfg

    if pretrained and not _has_weights(variant, kwargs):
        raise ValueError(
            f"{variant} has no pretrained weights to download; load your own with pretrained=True, "
            "pretrained_cfg_overlay=dict(file=<checkpoint>, num_classes=<its classes>)"
        )
    kwargs = _timm_kwargs(kwargs, arch=variant)
    if fixed is not None and kwargs.setdefault("encoding", fixed) != fixed:
        base = variant[: -len(fixed) - 1]
        raise ValueError(
            f"{variant} is the {fixed!r} encoding; for encoding={kwargs['encoding']!r} use {base} or "
            f"{base}_{kwargs['encoding']}"
        )
    kwargs.setdefault("img_size", size)
    kwargs.setdefault("patch_size", patch)
    out_indices = kwargs.pop("out_indices", 3)  # features_only: the last 3 blocks, as timm's ViTs
    model = build_model_with_cfg(
        build,
        variant,
        pretrained,
        pretrained_filter_fn=_checkpoint_filter,
        feature_cfg=dict(feature_cls="getter", out_indices=out_indices),
        **kwargs,
    )
    return model


def timm_name(preset: str, patch: int, size: int, encoding: str | None = None) -> str:
    """The timm architecture name of a vlpe ViT (``encoding``: the one fixed by the name, else by keyword)."""
    return f"vlpe_vit_{preset}_patch{patch}_{size}" + (f"_{encoding}" if encoding else "")


def register_architectures(
    encoding: str | None, presets: tuple[str, ...], *, create: Callable[..., nn.Module]
) -> list[str]:
    """Register the ``vlpe_vit_*`` architectures of ``presets`` x :data:`TIMM_SIZES` in timm for ``encoding`` fixed
    by the name or, with None, chosen by keyword; each entry point calls ``create(name, preset=, patch=, size=,
    fixed=, pretrained=, **kwargs)``. Returns the names; names already registered are left as they are."""
    import timm
    from timm.models import generate_default_cfgs, register_model

    names = [timm_name(p, patch, size, encoding) for p in presets for patch, size in TIMM_SIZES]
    made = {}
    for preset in presets:
        for patch, size in TIMM_SIZES:
            name = timm_name(preset, patch, size, encoding)
            if not timm.is_model(name):
                made[name] = _entry(name, create=create, preset=preset, patch=patch, size=size, encoding=encoding)
    default_cfgs.update(generate_default_cfgs({name: cfg for name, (_, cfg) in made.items()}))
    for name, (entry, _) in made.items():
        globals()[name] = register_model(entry)
    return names


def _entry(
    name: str, *, create: Callable[..., nn.Module], preset: str, patch: int, size: int, encoding: str | None
):
    """timm entry point and pretrained cfg of one architecture."""

    def entry(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create(name, preset=preset, patch=patch, size=size, fixed=encoding, pretrained=pretrained, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    which = f"the {encoding} encoding" if encoding else "encoding='<name>' (default rope)"
    entry.__doc__ = f"vlpe ViT-{preset}/{patch} at {size} px with {which}; no pretrained weights."
    entry.__module__ = __name__
    cfg = dict(
        url="",
        num_classes=1000,
        input_size=(3, size, size),
        pool_size=None,
        crop_pct=1.0,
        interpolation="bicubic",
        fixed_input_size=False,
        mean=(0.0, 0.0, 0.0),  # the vlpe harness feeds [0, 1] pixels, unnormalised
        std=(1.0, 1.0, 1.0),
        first_conv="tokenizer.proj",
        classifier="head",
        license="apache-2.0",
    )
    return entry, cfg


try:
    import timm as _timm  # noqa: F401  (optional for the library)
except ImportError:
    TIMM_INSTALLED = False
else:
    TIMM_INSTALLED = True
    from timm.models import register_notrace_function, register_notrace_module

    from vlpe.tokenizers import ImageTokenizer

    from .blocks import FX_LEAF_FUNCTIONS, FX_LEAF_MODULES

    for _leaf in (ImageTokenizer, *FX_LEAF_MODULES):
        register_notrace_module(_leaf)
    for _leaf in FX_LEAF_FUNCTIONS:
        register_notrace_function(_leaf)
    del _leaf
