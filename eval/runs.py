"""Loading exported runs: the backbone of a finished ``train/vit.py`` / ``train/points.py`` run, rebuilt on a device.

A training run leaves ``<run>/model.safetensors`` (the state dict of a ``train.tasks.Classifier``, keys prefixed
``backbone.``) and ``<run>/config.yaml`` (the full run config plus ``num_classes`` and ``script``). :func:`load_run`
rebuilds the backbone from the config (:func:`models.vit.vit_from_config`, :func:`models.points.points_from_config`)
and loads the weights with ``safetensors`` (no pickles are ever unpickled); the config is read with
``yaml.safe_load``, validated by ``train.config.from_dict`` and compared with the model signature the export records
in its metadata (an edited config is refused, naming the recorded and the current value).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Run", "load_run", "pick_device"]

SCRIPTS = ("vit", "points")


@dataclass
class Run:
    """A trained run rebuilt from its export: the backbone (eval mode), its config and where it came from."""

    path: Path
    name: str
    script: str
    cfg: Any  # train.vit_setup.ViTConfig or train.points_setup.PointsConfig
    num_classes: int
    model: nn.Module


def _script_parts(script: str):
    if script == "vit":
        from models.vit import vit_from_config
        from train.vit_setup import ViTConfig

        return ViTConfig, vit_from_config
    if script == "points":
        from models.points import points_from_config
        from train.points_setup import PointsConfig

        return PointsConfig, points_from_config
    raise ValueError(f"script must be one of {list(SCRIPTS)}, got {script!r}")


def load_run(run_dir: str | Path, *, script: str, device: str | torch.device = "cpu") -> Run:
    """Rebuild the backbone exported by ``train/<script>.py`` in ``run_dir`` and load its weights."""
    import yaml
    from safetensors.torch import load_file

    from train.checkpoint import check_export
    from train.config import from_dict
    from train.tasks import Classifier

    run_dir = Path(run_dir)
    cfg_path, weights = run_dir / "config.yaml", run_dir / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise ValueError(
                f"{p} does not exist: --run must be the train.out_dir of a finished training run "
                f"(it holds config.yaml and model.safetensors)"
            )
    raw = yaml.safe_load(cfg_path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path} must be a mapping of config sections, got {type(raw).__name__}")
    raw = dict(raw)
    signed = dict(raw)
    found = raw.pop("script", None)
    num_classes = raw.pop("num_classes", None)
    if found != script:
        raise ValueError(
            f"{run_dir} was exported by train/{found}.py but this evaluation needs a train/{script}.py run"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"{cfg_path} must record a positive integer num_classes, got {num_classes!r}")
    check_export(weights, signed, config_path=cfg_path)  # the exported model's own record of its config
    config_cls, build_model = _script_parts(script)
    cfg = from_dict(config_cls, raw, where=str(cfg_path))
    wrapper = Classifier(build_model(cfg, num_classes))
    state = load_file(str(weights))
    mismatch = f"{weights} does not match the model {cfg_path.name} describes (was the config edited after training?)"
    try:
        result = wrapper.load_state_dict(state, strict=False)
    except RuntimeError as e:  # tensor shape mismatches
        raise ValueError(f"{mismatch}: {e}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{mismatch}: missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    model = wrapper.backbone.to(device).eval()
    return Run(path=run_dir, name=run_dir.name, script=script, cfg=cfg, num_classes=num_classes, model=model)


def pick_device(name: str | None) -> torch.device:
    """``None``/"auto": CUDA when available, else CPU; otherwise the named device."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
