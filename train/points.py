"""Train a point transformer with a 3D vlpe encoding on point-cloud shape identification.

    deepspeed train/points.py --config configs/points_rope.yaml
    python train/points.py --config configs/points_pape_ri.yaml data.rotation=so3

Data: the CGAL meshes of Debian ``libcgal-demo`` (``data.dataset: cgal``, one class per shape, area-weighted
surface samples) or procedural ModelNet-like primitives (``data.dataset: procedural``). Training is
z-aligned by default; ``eval/points.py`` tests SO(3) rotations and 2x/4x/8x the point count.
"""

from __future__ import annotations

from train.cli import main_guard, parse
from train.engine import fit, move_to, seed_everything
from train.points_setup import PointsConfig, build_datasets, collate
from train.tasks import Classifier, evaluate_classification, val_loader


def main(argv=None) -> None:
    from models.points import points_from_config

    cfg, raw = parse(PointsConfig, argv, description=__doc__)
    seed_everything(cfg.train.seed)  # reproducible model initialisation
    train_set, val_set = build_datasets(cfg.data)
    num_classes = train_set.num_classes
    model = Classifier(points_from_config(cfg, num_classes), label_smoothing=cfg.model.label_smoothing)

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
