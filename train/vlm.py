"""Train a VLM with any multimodal RoPE variant: the small VLM (:mod:`models.vlm`) on a short-video needle task, or
(``model.hf_model`` set) a pretrained Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder on LLaVA-format
instruction data (:mod:`train.finetune`).

    deepspeed --num_gpus 8 train/vlm.py --config configs/full/mrope_i.yaml
    python train/vlm.py --config configs/mrope_i.yaml train.steps=50 model.variant=videorope
    deepspeed --num_gpus 8 train/vlm.py --config configs/hf/qwen2_vl.yaml model.hf_model=DIR model.variant=mrope_i \
        data.annotations=train.json data.media_root=DIR

Fine-tuning keys (``model.hf_model`` set): ``model.scaling`` (a vlpe scaling dict for the rotary tables),
``model.attn_implementation`` (``flash_attention_2`` on GPU), ``model.lora.*``; ``data.annotations`` /
``data.val_annotations`` / ``data.media_root`` / ``data.fps`` / ``data.max_frames`` / ``data.min_pixels`` /
``data.max_pixels`` / ``data.max_length`` / ``data.packing`` / ``data.max_skipped``; ``train.freeze`` /
``train.gradient_checkpointing``. The small VLM's keys (``model.preset``, ``model.hidden_size``, ``data.task``,
``data.frames`` ...) do not apply to a checkpoint folder and are refused there, and the other way round.

The task is V-NIAH on small frames (:mod:`data.vniah`): a haystack of ``data.frames`` frames, one needle frame
(a Fashion-MNIST item drawn in red) at a uniformly drawn place, the question "What item is shown in red?" and a
one-word answer; the loss is on the answer tokens (and the ``<eos>`` that ends them) only. Validation is
LongVA's exact match (teacher-forced argmax on every answer token) on held-out needles at the training length,
summed over ranks. Position ids are computed by the collator in the DataLoader workers
(:func:`vlpe.encodings.multimodal.position_ids`) and handed to the model.

The default configs are CPU-sized (8 frames of 16x16, a 2-layer decoder, a few minutes on 2 cores; on a shared
machine ``OMP_NUM_THREADS=1`` is much faster than oversubscribed threads);
``configs/full/`` holds the GPU-sized variants. The trained weights are exported to
``<out_dir>/model.safetensors`` with ``<out_dir>/config.yaml`` beside them; :func:`models.vlm.vlm_from_config`
rebuilds the model from that config (``eval/long_video.py`` tests it at longer lengths).
"""

from __future__ import annotations

from typing import Any

import torch

from train.cli import main_guard, parse
from train.config import ConfigError
from train.engine import fit, move_to, seed_everything
from train.tasks import reduce_accuracy, val_loader
from train.vlm_setup import VLMConfig, build_datasets, build_tokenizer


@torch.no_grad()
def evaluate_answers(module, batches, device: torch.device) -> dict[str, float]:
    """Exact-match answer accuracy (teacher-forced) and mean answer-token loss over ``batches``, summed over
    ranks."""
    from models.vlm import answer_accuracy

    stats = torch.zeros(3, dtype=torch.float64)  # correct, scored, loss x scored
    for batch in batches:
        batch = move_to(batch, device)
        out = module(batch)
        correct, scored = answer_accuracy(out["logits"], batch["labels"])
        n = scored.sum()
        stats += torch.stack([correct.sum(), n, out["loss"].detach().float() * n]).double().cpu()
    return reduce_accuracy(stats)


def main(argv=None) -> None:
    cfg, raw = parse(VLMConfig, argv, description=__doc__)
    seed_everything(cfg.train.seed)  # reproducible model initialisation
    if cfg.model.hf_model is not None:
        from train.finetune import main as finetune

        return finetune(cfg, raw)
    from models.vlm import vlm_from_config

    tokenizer = build_tokenizer(cfg.data)
    try:
        model = vlm_from_config(cfg, tokenizer)
    except ValueError as e:  # unknown preset / variant / option: a config mistake, said in one line
        raise ConfigError(f"model: {e}") from e
    train_set, val_set = build_datasets(cfg)
    collate = model.collator()
    answers = len(train_set.answers)

    def validate(module, device):
        loader = val_loader(
            val_set,
            micro_batch=cfg.train.micro_batch,
            max_batches=cfg.train.val_batches,
            collate=collate,
            num_workers=cfg.train.num_workers,
        )
        return {**evaluate_answers(module, loader, device), "chance": 1.0 / answers}

    run_config: dict[str, Any] = {
        **raw,
        "script": "vlm",
        "tokenizer_words": list(tokenizer.words),
        "position_options": {k: v for k, v in model.position_options.items() if k != "second_per_grid_ts"},
    }
    fit(
        model=model,
        train=cfg.train,
        deepspeed_overrides=cfg.deepspeed,
        train_set=train_set,
        collate=collate,
        validate=validate,
        run_config=run_config,
        tokens_per_sample=lambda batch: int(batch["input_ids"].numel()),
    )


if __name__ == "__main__":
    main_guard(main)
