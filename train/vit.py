"""Train a ViT with any vlpe encoding on an image classification set.

    deepspeed --num_gpus 2 train/vit.py --config configs/vit_lookhere.yaml
    python train/vit.py --config configs/vit_rope.yaml train.steps=50 model.encoding=alibi

The default configs are CPU-sized (Fashion-MNIST at 28 px, a 4-block ViT, a few minutes on 2 cores);
``configs/full/`` holds the GPU-cluster-sized variants. The trained weights are exported to
``<out_dir>/model.safetensors`` with ``<out_dir>/config.yaml`` beside them (for ``eval/resolution.py``).
"""

from __future__ import annotations

from functools import partial

from train.cli import main_guard, parse
from train.engine import fit, move_to, seed_everything
from train.tasks import Classifier, evaluate_classification, val_loader
from train.vit_setup import ViTConfig, build_datasets, collate


def main(argv=None) -> None:
    from models.vit import vit_from_config

    cfg, raw = parse(ViTConfig, argv, description=__doc__)
    size = cfg.data.img_size
    batch_of = partial(collate, stand_in=(cfg.data.channels, size, size))  # the shape every dataset here yields
    seed_everything(cfg.train.seed)  # reproducible model initialisation
    train_set, val_set, num_classes = build_datasets(cfg.data)
    model = Classifier(vit_from_config(cfg, num_classes), label_smoothing=cfg.model.label_smoothing)

    def validate(module, device):
        loader = val_loader(
            val_set, micro_batch=cfg.train.micro_batch, max_batches=cfg.train.val_batches, collate=batch_of
        )
        return evaluate_classification(module, loader, device, to_device=move_to)

    patches = (cfg.data.img_size // cfg.model.patch_size) ** 2
    fit(
        model=model,
        train=cfg.train,
        deepspeed_overrides=cfg.deepspeed,
        train_set=train_set,
        collate=batch_of,
        validate=validate,
        run_config={**raw, "num_classes": num_classes, "script": "vit"},
        tokens_per_sample=lambda batch: len(batch[1]) * patches,
    )


if __name__ == "__main__":
    main_guard(main)
