"""open_clip model configs whose vision tower is a vlpe ViT, with any encoding that runs on a 2D grid.

    import open_clip, models.clip as vo
    [n for n in open_clip.list_models() if n.startswith("vlpe-")]   # vlpe-ViT-S-16-rope, ...-lookhere, ...
    # one config per tower and encoding that runs on a 2D grid and builds for the tower's ViT
    clip = open_clip.create_model("vlpe-ViT-Pico-4-28-lookhere")
    tokenizer = open_clip.get_tokenizer("vlpe-ViT-Pico-4-28-lookhere")   # the bundled BPE: no download
    clip.encode_image(torch.randn(2, 3, 84, 56))                            # any resolution, same weights

How: every config names its tower through open_clip's own ``vision_cfg.timm_model_name`` (open_clip's
``TimmModel`` builds it with ``timm.create_model``), so open_clip itself is not changed. The tower is a
``vlpe_vit_<preset>_patch<p>_<size>_<encoding>`` timm architecture (:mod:`models.vit`), whose name fixes
the encoding; open_clip resets its classifier, pools its class token (``timm_pool="token"``) and adds the
linear projection to the joint embedding. The text tower is open_clip's ``TextTransformer``.

Towers (:data:`TOWERS`): ``vlpe-ViT-S-16`` (ViT-S/16 at 224 px with open_clip's ViT-S-16 text tower) and
``vlpe-ViT-Pico-4-28`` (a 3-block, 96-wide ViT at 28 px with a 2-layer text tower: CPU-sized, what
``eval/zero_shot.py`` trains). :func:`register` adds a config of your own (any encoding, incl. one you
registered in vlpe). The towers are the harness's ViT (:mod:`models.vit`), so this module lives beside it,
not in the library. Checked in ``tests/test_integration_open_clip.py`` against open_clip's factory, tokenizer and
loss classes.

Preprocessing: the towers take [0, 1] pixels, unnormalised (mean 0, std 1, as their timm ``pretrained_cfg`` says
and as ``eval/zero_shot.py`` trains them), the whole image resized to the tower's size (bicubic, no crop). open_clip
reads a ``preprocess_cfg`` only from ``hf-hub:`` / ``local-dir:`` configs, so for a name of this module
``open_clip.create_model_and_transforms(name)`` falls back to OpenAI's mean/std; :func:`create_model_and_transforms`
here passes :func:`preprocess_cfg` (``image_mean`` / ``image_std`` / ``image_interpolation`` /
``image_resize_mode``) to it, and :func:`preprocess_cfg` gives the values for open_clip's own arguments.
"""

from __future__ import annotations

import copy
import json
import tempfile
from typing import Any

from .vit import fits, grid_encodings, register_timm, timm_name

__all__ = [
    "TOWERS", "PREPROCESS", "config_for", "register", "names", "preprocess_cfg", "create_model_and_transforms",
]  # fmt: skip

#: tower name -> (vlpe ViT preset, patch, image size, joint embedding width, open_clip text_cfg)
TOWERS: dict[str, tuple[str, int, int, int, dict[str, Any]]] = {
    "vlpe-ViT-S-16": (
        "small", 16, 224, 384, dict(context_length=77, vocab_size=49408, width=384, heads=6, layers=12)
    ),
    "vlpe-ViT-Pico-4-28": (
        "pico", 4, 28, 96, dict(context_length=16, vocab_size=49408, width=96, heads=2, layers=2)
    ),
}

#: how the towers are fed (open_clip ``PreprocessCfg`` keys, ``size`` from the tower): [0, 1] pixels, unnormalised,
#: the whole image resized bicubic to the tower's size (``eval/zero_shot.py``'s ``_pixels``)
PREPROCESS: dict[str, Any] = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), interpolation="bicubic",
                                  resize_mode="squash")  # fmt: skip
_PREPROCESS: dict[str, dict[str, Any]] = {}  # registered name -> its preprocess_cfg

_CONFIG_DIR = tempfile.TemporaryDirectory(prefix="vlpe-open-clip-")  # open_clip re-reads its config files
_REGISTERED: list[str] = []


def config_for(tower: str, encoding: str) -> dict[str, Any]:
    """The open_clip model config of ``tower`` (:data:`TOWERS`) with ``encoding`` in its vision tower."""
    if tower not in TOWERS:
        raise ValueError(f"unknown tower {tower!r}; towers: {', '.join(TOWERS)}")
    preset, patch, size, embed_dim, text_cfg = TOWERS[tower]
    register_timm(encoding)  # a no-op for the built-ins; names the architecture of an encoding of your own
    if not fits(preset, encoding):
        raise ValueError(f"encoding {encoding!r} does not build for the {preset} ViT of {tower}; use another tower")
    vision_cfg = dict(
        image_size=size,
        timm_model_name=timm_name(preset, patch, size, encoding),
        timm_model_pretrained=False,
        timm_pool="token",
        timm_proj="linear",
    )
    return dict(embed_dim=embed_dim, vision_cfg=vision_cfg, text_cfg=copy.deepcopy(text_cfg))


def register(name: str, config: dict[str, Any], *, preprocess: dict[str, Any] | None = None) -> str:
    """Add ``config`` to open_clip's model configs as ``name`` (``open_clip.list_models()``,
    ``create_model(name)``, ``get_tokenizer(name)``) through ``open_clip.add_model_config``; ``preprocess``
    (open_clip ``PreprocessCfg`` keys) is what :func:`preprocess_cfg` / :func:`create_model_and_transforms` give
    it (default :data:`PREPROCESS` at the config's image size)."""
    import open_clip
    import timm

    if not isinstance(name, str) or not name or any(c in name for c in "/\\"):
        raise ValueError(f"name must be a non-empty string without path separators, got {name!r}")
    if not isinstance(config, dict) or not all(k in config for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ValueError("config must be an open_clip model config: a dict with embed_dim, vision_cfg and text_cfg")
    tower = config["vision_cfg"].get("timm_model_name")
    if tower is not None and not timm.is_model(tower):
        raise ValueError(f"vision_cfg.timm_model_name {tower!r} is not a timm architecture")
    pp = _preprocess_for(config, preprocess)  # checked before anything is registered
    path = f"{_CONFIG_DIR.name}/{name}.json"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    open_clip.add_model_config(path)
    _PREPROCESS[name] = pp
    if name not in _REGISTERED:
        _REGISTERED.append(name)
    return name


def _preprocess_for(config: dict[str, Any], preprocess: dict[str, Any] | None) -> dict[str, Any]:
    from open_clip.transform import PreprocessCfg

    known = set(PreprocessCfg.__dataclass_fields__)
    cfg = {**PREPROCESS, "size": config["vision_cfg"].get("image_size", 224), **(preprocess or {})}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"preprocess: unknown key {unknown[0]!r}; open_clip's PreprocessCfg keys: {sorted(known)}")
    return cfg


def preprocess_cfg(name: str) -> dict[str, Any]:
    """The open_clip ``PreprocessCfg`` (as a dict) the config ``name`` of this module is trained with."""
    if name not in _PREPROCESS:
        raise ValueError(f"{name!r} is not a config of models.clip; configs: {', '.join(names())}")
    return copy.deepcopy(_PREPROCESS[name])


def create_model_and_transforms(name: str, **kwargs: Any):
    """``open_clip.create_model_and_transforms(name, ...)`` with :func:`preprocess_cfg` as its ``image_mean`` /
    ``image_std`` / ``image_interpolation`` / ``image_resize_mode`` (arguments given here win): returns ``(model,
    train transform, val transform)``, the transforms giving the pixels the tower is trained on."""
    import open_clip

    pp = preprocess_cfg(name)
    for key in ("mean", "std", "interpolation", "resize_mode"):
        kwargs.setdefault(f"image_{key}", pp[key])
    return open_clip.create_model_and_transforms(name, **kwargs)


def names(encoding: str | None = None) -> list[str]:
    """The open_clip configs this module registered (those of ``encoding`` only, if given)."""
    return [n for n in _REGISTERED if encoding is None or n.endswith(f"-{encoding}")]


def _register_builtins() -> None:
    """The ``vlpe-<tower>-<encoding>`` configs of every tower and grid encoding that builds for it."""
    import open_clip

    for tower, (preset, *_) in TOWERS.items():
        for encoding in grid_encodings():
            if not fits(preset, encoding):  # e.g. LookHere's direction presets on fewer than 12 heads
                continue
            name = f"{tower}-{encoding}"
            config = config_for(tower, encoding)
            with open(f"{_CONFIG_DIR.name}/{name}.json", "w") as f:
                json.dump(config, f, indent=2)
            _PREPROCESS[name] = _preprocess_for(config, None)
            _REGISTERED.append(name)
    open_clip.add_model_config(_CONFIG_DIR.name)  # one rescan for all of them


_register_builtins()
