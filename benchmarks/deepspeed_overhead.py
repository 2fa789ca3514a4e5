"""Training throughput of the harness against a plain PyTorch loop on the same model and data, side by side.

    python benchmarks/deepspeed_overhead.py [--config configs/vit_rope.yaml] [--rounds 5] [--window 20]

* harness: ``train.engine.fit`` itself, as ``train/vit.py`` calls it: ``deepspeed.initialize`` (one process,
  gloo), the resumable batch sampler over the seeded dataset in a ``DataLoader``, the config's collate, loss
  logging. It runs ``2 x --window`` steps with ``log_every = --window`` (validation and the progress bar off);
  its throughput is the ``samples_per_s`` it logs for the second window (steady state: no start-up, no final
  checkpoint or export).
* plain: the same model (same seed, same initialisation), the same training set, micro-batch and collate in a
  shuffled ``torch.utils.data.DataLoader``, AdamW with the same parameter groups, cosine schedule and gradient
  clipping, the loss read every step as the harness does; timed over its second window of ``--window`` steps.

Rounds alternate the two (the machine is noisy); the table reports the best window of each and the ratio of
step times. Writes outputs/bench/deepspeed_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/vit_rope.yaml")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window", type=int, default=20, help="steps per timed window (two windows per run)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="outputs/bench/deepspeed_overhead.json")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.micro_batch=32")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from torch.utils.data import DataLoader

    from train.config import load_config
    from train.engine import cosine_schedule, fit, param_groups, seed_everything
    from train.tasks import Classifier
    from models.vit import vit_from_config
    from train.vit_setup import ViTConfig, build_datasets, collate

    W = args.window
    scratch = Path(tempfile.mkdtemp(prefix="ds_overhead_"))
    fixed = [f"train.steps={2 * W}", f"train.log_every={W}", f"train.val_every={10**9}", f"train.ckpt_every={10**9}",
             "train.progress=false", f"train.out_dir={scratch / 'run'}"]
    cfg = load_config(ViTConfig, args.config, [*args.overrides, *fixed])
    train_set, _, num_classes = build_datasets(cfg.data)
    mb = cfg.train.micro_batch

    def build() -> Classifier:
        seed_everything(cfg.train.seed)  # as train/vit.py: the same initialisation for both loops
        return Classifier(vit_from_config(cfg, num_classes), label_smoothing=cfg.model.label_smoothing)

    def harness() -> float:
        """samples/s of fit's second logged window."""
        result = fit(model=build(), train=cfg.train, deepspeed_overrides=cfg.deepspeed, train_set=train_set,
                     collate=collate, validate=None, run_config={"benchmark": "deepspeed_overhead"})
        return [r for r in result.metrics if r["split"] == "train"][-1]["samples_per_s"]

    def plain() -> float:
        """samples/s of the plain loop's second window."""
        model = build()
        opt = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.999))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(cfg.train))
        loader = DataLoader(train_set, batch_size=mb, shuffle=True, drop_last=True, collate_fn=collate,
                            num_workers=cfg.train.num_workers, generator=torch.Generator().manual_seed(cfg.train.seed))
        batches = iter(loader)
        model.train()
        t0 = time.perf_counter()
        for step in range(2 * W):
            if step == W:
                t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            loss = model(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())  # the harness reads the loss every step too
        return W * mb / (time.perf_counter() - t0)

    rates: dict[str, list[float]] = {"plain": [], "harness": []}
    for r in range(args.rounds):
        for name, fn in ((("plain", plain), ("harness", harness)) if r % 2 == 0 else
                         (("harness", harness), ("plain", plain))):
            rates[name].append(fn())
    rows = {}
    for name, rs in rates.items():
        best = max(rs)
        rows[name] = {"samples_per_s": best, "step_ms": 1e3 * mb / best, "rounds": rs}
    ratio = rows["harness"]["step_ms"] / rows["plain"]["step_ms"]
    tokens = (cfg.data.img_size // cfg.model.patch_size) ** 2 + 1
    print(f"\nconfig {args.config}: micro-batch {mb}, {tokens} tokens per image, {torch.get_num_threads()} threads; "
          f"best of {args.rounds} interleaved rounds, {W}-step windows")
    print(f"{'loop':<10} {'samples/s':>10} {'ms/step':>9}")
    for name, r in rows.items():
        print(f"{name:<10} {r['samples_per_s']:>10.1f} {r['step_ms']:>9.1f}")
    print(f"harness (train/ with DeepSpeed and its data loading) / plain step time: {ratio:.3f}x "
          f"(overhead {100 * (ratio - 1):+.1f}%)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "window": W, "rows": rows, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
