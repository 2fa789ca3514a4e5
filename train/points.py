"""Train a point transformer with a 3D vlpe encoding on point-cloud shape identification.

    deepspeed train/points.py --config configs/points_rope.yaml
    python train/points.py --config configs/points_pape_ri.yaml data.rotation=so3

Data: the CGAL meshes of Debian ``libcgal-demo`` (``data.dataset: cgal``, one class per shape, area-weighted
surface samples) or procedural ModelNet-like primitives (``data.dataset: procedural``). Training is
z-aligned by default; ``eval/points.py`` tests SO(3) rotations and 2x/4x/8x the point count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal



from train.cli import main_guard, parse
from train.engine import TrainSection, fit, move_to, seed_everything
from train.tasks import Classifier, evaluate_classification, val_loader


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


def build_model(cfg: PointsConfig, num_classes: int):
    from models.points import PointTransformer

    m = cfg.model
    return PointTransformer(
        num_classes=num_classes,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
        num_groups=m.num_groups,
        group_size=m.group_size,
        local=m.local,
        encoding=m.encoding,
        encoding_options=m.encoding_options,
        readout=m.readout,
        drop_path_rate=m.drop_path_rate,
        backend=m.backend,
    )


def collate(items):
    from data.collate import PointCollator

    out = PointCollator()(items)
    return (out["points"], out["valid"]), out["labels"]


def main(argv=None) -> None:
    cfg, raw = parse(PointsConfig, argv, description=__doc__)
    seed_everything(cfg.train.seed)  # reproducible model initialisation
    train_set, val_set = build_datasets(cfg.data)
    num_classes = train_set.num_classes
    model = Classifier(build_model(cfg, num_classes), label_smoothing=cfg.model.label_smoothing)

    def validate(module, device):
        loader = val_loader(val_set, micro_batch=cfg.train.micro_batch, max_batches=cfg.train.val_batches, collate=collate)
        return evaluate_classification(module, loader, device, to_device=move_to)

    fit(
        model=model,
        train=cfg.train,
        deepspeed_overrides=cfg.deepspeed,
        train_set=train_set,
        collate=collate,
        validate=validate,
        run_config={**raw, "num_classes": num_classes, "script": "points"},
        tokens_per_sample=lambda batch: len(batch[1]) * cfg.model.num_groups,
    )


if __name__ == "__main__":
    main_guard(main)
