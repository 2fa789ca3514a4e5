"""What a point-transformer run is made of: its config (``configs/points_*.yaml``), the datasets it names and how
they batch.

Read by ``train/points.py`` (which trains it) and by the evaluation of its exports (``eval/points.py``); the model a
config describes is :func:`models.points.points_from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from train.engine import TrainSection

__all__ = ["ModelSection", "DataSection", "PointsConfig", "build_datasets", "collate"]


@dataclass(kw_only=True)
class ModelSection:
    embed_dim: int = 96
    depth: int = 4
    num_heads: int = 4
    num_groups: int = 32
    group_size: int = 16
    local: Literal["offsets", "invariant"] = "offsets"  # per-neighbour tokenizer input (PointTokenizer)
    encoding: str = "rope"
    encoding_options: dict = field(default_factory=dict)
    readout: Literal["cls", "gap"] = "gap"
    drop_path_rate: float = 0.0
    backend: Literal["sdpa", "eager", "flex"] = "sdpa"
    label_smoothing: float = 0.0


@dataclass(kw_only=True)
class DataSection:
    dataset: Literal["cgal", "procedural"] = "cgal"
    num_points: int = 512
    samples_per_class: int = 64  # training samples per class (validation uses a quarter, min 8)
    rotation: Literal["none", "z", "so3"] = "z"
    jitter: float = 0.01
    scale_lo: float = 0.8
    scale_hi: float = 1.25
    partial: float | None = None


@dataclass(kw_only=True)
class PointsConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: dict = field(default_factory=dict)


def build_datasets(d: DataSection, *, num_points: int | None = None, rotation: str | None = None, val_only=False):
    from data.points import CGALShapes, SyntheticShapes3D

    cls = CGALShapes if d.dataset == "cgal" else SyntheticShapes3D
    common = dict(
        num_points=num_points or d.num_points,
        jitter=d.jitter,
        scale=(d.scale_lo, d.scale_hi),
        partial=d.partial,
    )
    val = cls(split="val", samples_per_class=max(8, d.samples_per_class // 4), rotation=rotation or d.rotation, **common)
    if val_only:
        return None, val
    train = cls(split="train", samples_per_class=d.samples_per_class, rotation=d.rotation, **common)
    return train, val


def collate(items):
    from data.collate import PointCollator

    out = PointCollator()(items)
    return (out["points"], out["valid"]), out["labels"]
