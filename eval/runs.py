"""Shared pieces of the evaluation scripts: loading exported runs, predictions, accuracy and calibration, tables.

A training run (``train/vit.py``, ``train/points.py``) leaves ``<run>/model.safetensors`` (the state dict of a
``train.tasks.Classifier``, keys prefixed ``backbone.``) and ``<run>/config.yaml`` (the full run config plus
``num_classes`` and ``script``). :func:`load_run` rebuilds the backbone from the config and loads the weights
with ``safetensors`` (no pickles are ever unpickled); the config is read with ``yaml.safe_load``, validated
by ``train.config.from_dict`` and compared with the model signature the export records in its metadata (an
edited config is refused, naming the recorded and the current value).

Calibration is the expected calibration error of Guo et al. (ICML 2017) with 15 equal-width confidence bins
``(b/15, (b+1)/15]`` (the first bin also holds confidence 0): ``ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)|``
where ``conf`` is the top softmax probability.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "write_tables",
    "Run",
    "load_run",
    "pick_device",
    "predict",
    "expected_calibration_error",
    "classification_metrics",
    "group_accuracy",
    "markdown_table",
    "write_json",
]

SCRIPTS = ("vit", "points")


@dataclass
class Run:
    """A trained run rebuilt from its export: the backbone (eval mode), its config and where it came from."""

    path: Path
    name: str
    script: str
    cfg: Any  # train.vit.ViTConfig or train.points.PointsConfig
    num_classes: int
    model: nn.Module


def _script_parts(script: str):
    if script == "vit":
        from train.vit import ViTConfig, build_model
        return ViTConfig, build_model
    if script == "points":
        from train.points import PointsConfig, build_model
        return PointsConfig, build_model
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


@torch.inference_mode()
def predict(
    model: nn.Module,
    batches: Iterable,
    device: torch.device,
    *,
    desc: str | None = None,
    progress: bool = True,
    bf16: bool = False,
) -> tuple[Tensor, Tensor]:
    """Logits ``(n, classes)`` float32 and labels ``(n,)`` on the CPU for ``(inputs, labels)`` batches."""
    from tqdm import tqdm

    from train.engine import move_to

    logits, labels = [], []
    total = len(batches) if hasattr(batches, "__len__") else None
    for inputs, y in tqdm(batches, desc=desc, total=total, disable=not progress, leave=False, dynamic_ncols=True):
        inputs = move_to(inputs, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(inputs)  # (b, classes)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    if not logits:
        raise ValueError("no evaluation batches: the evaluation set is empty")
    return torch.cat(logits), torch.cat(labels)


def expected_calibration_error(probs: Tensor, labels: Tensor, *, bins: int = 15) -> float:
    """ECE with ``bins`` equal-width bins over the top-class confidence of ``probs`` (n, classes)."""
    if probs.dim() != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(
            f"probs must be (n, classes) with labels (n,), got {tuple(probs.shape)} / {tuple(labels.shape)}"
        )
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    n = probs.shape[0]
    if n == 0:
        raise ValueError("expected_calibration_error needs at least one sample")
    conf, pred = probs.double().max(dim=-1)  # (n,), (n,)
    correct = (pred == labels.to(pred.device)).double()  # (n,)
    edges = torch.arange(bins + 1, dtype=torch.float64, device=conf.device) / bins  # exactly b / bins
    idx = torch.bucketize(conf, edges[1:-1], right=False)  # bin b holds edges[b] < conf <= edges[b+1]
    gap = torch.bincount(idx, weights=correct, minlength=bins) - torch.bincount(idx, weights=conf, minlength=bins)
    return float(gap.abs().sum() / n)


def classification_metrics(logits: Tensor, labels: Tensor, *, bins: int = 15) -> dict[str, Any]:
    """Top-1 accuracy, ECE (``bins`` bins), mean NLL, class-mean accuracy, the sample count and the per-item
    outcomes (``outcomes``: packed bits, see :func:`stats.pack_bits`; what the benchmark's intervals resample)."""
    from stats import pack_bits

    logits, labels = logits.float(), labels.long()
    correct = logits.argmax(-1) == labels  # (n,)
    classes = labels.unique()
    per_class = torch.stack([correct[labels == c].double().mean() for c in classes])
    return {
        "acc": float(correct.double().mean()),
        "ece": expected_calibration_error(logits.softmax(-1), labels, bins=bins),
        "nll": float(F.cross_entropy(logits, labels)),
        "class_mean_acc": float(per_class.mean()),
        "count": int(labels.numel()),
        "outcomes": pack_bits(correct.numpy()),
    }


def group_accuracy(correct: Tensor, groups: Tensor, num_groups: int) -> list[float | None]:
    """Accuracy within each group ``0..num_groups-1`` (None for an empty group)."""
    count = torch.bincount(groups.long(), minlength=num_groups)[:num_groups]
    hits = torch.bincount(groups.long(), weights=correct.double(), minlength=num_groups)[:num_groups]
    return [float(h / c) if c > 0 else None for h, c in zip(hits, count)]


def fmt(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    """A table cell: ``value * scale`` with ``digits`` decimals, or an en dash for missing values."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (first column left-aligned, the others right-aligned)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path


def write_tables(evals: Sequence[dict], out_dir: str | Path, name: str, markdown: Callable[[Sequence[dict]], str]
                 ) -> dict[str, Path]:  # fmt: skip
    """``<name>.json`` (``{"runs": evals}``) and ``<name>.md`` (``markdown(evals)``) under ``out_dir``: the part
    of every evaluation script's report that is not a figure."""
    if not evals:
        raise ValueError("write_report needs at least one evaluated run")
    out = Path(out_dir)
    paths = {"json": write_json(out / f"{name}.json", {"runs": list(evals)}), "md": out / f"{name}.md"}
    paths["md"].write_text(markdown(evals))
    return paths
