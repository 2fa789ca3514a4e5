"""DeepSpeed overhead of the ViT training step: the same model and batches through a plain PyTorch loop
and through ``deepspeed.initialize`` (one process, gloo), measured side by side in one run.

    python benchmarks/deepspeed_overhead.py [--config configs/vit_rope.yaml] [--rounds 8] [--steps 10]

Rounds alternate the two loops (the machine is noisy); each round times ``--steps`` optimizer steps on
pre-collated batches (data loading excluded), and the table reports tokens/s from the fastest round of each
and the ratio. Writes outputs/bench/deepspeed_overhead.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/vit_rope.yaml")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="outputs/bench/deepspeed_overhead.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import deepspeed

    from train.config import load_config
    from train.engine import deepspeed_config, param_groups, setup_distributed
    from train.tasks import Classifier
    from train.vit import ViTConfig, build_datasets, build_model, collate

    cfg = load_config(ViTConfig, args.config)
    rank, world, device = setup_distributed()
    train_set, _, num_classes = build_datasets(cfg.data)
    mb = cfg.train.micro_batch
    batches = [collate([train_set[i * mb + j] for j in range(mb)]) for i in range(args.steps)]
    tokens = mb * (cfg.data.img_size // cfg.model.patch_size) ** 2

    torch.manual_seed(0)
    plain = Classifier(build_model(cfg, num_classes))
    ds_model = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(param_groups(plain, cfg.train.weight_decay), lr=cfg.train.lr)
    engine, _, _, _ = deepspeed.initialize(
        model=ds_model,
        optimizer=torch.optim.AdamW(param_groups(ds_model, cfg.train.weight_decay), lr=cfg.train.lr),
        config=deepspeed_config(cfg.train, cfg.deepspeed, world=world, device=device),
        dist_init_required=False,
    )

    def run_plain() -> float:
        t = time.perf_counter()
        for b in batches:
            loss = plain(b)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    def run_ds() -> float:
        t = time.perf_counter()
        for b in batches:
            loss = engine(b)["loss"]
            engine.backward(loss)
            engine.step()
        return time.perf_counter() - t

    run_plain(), run_ds()  # warm-up
    times: dict[str, list[float]] = {"plain": [], "deepspeed": []}
    for _ in range(args.rounds):
        times["plain"].append(run_plain())
        times["deepspeed"].append(run_ds())
    rows = {}
    for name, ts in times.items():
        best = min(ts)
        rows[name] = {
            "tokens_per_s": tokens * args.steps / best,
            "step_ms_min": 1e3 * best / args.steps,
            "step_ms_median": 1e3 * statistics.median(ts) / args.steps,
        }
    ratio = rows["deepspeed"]["step_ms_min"] / rows["plain"]["step_ms_min"]
    print(f"config {args.config}, micro-batch {mb}, {tokens} patch tokens per step, {torch.get_num_threads()} threads")
    print(f"{'loop':<10} {'tokens/s':>10} {'ms/step min':>12} {'ms/step median':>15}")
    for name, r in rows.items():
        print(f"{name:<10} {r['tokens_per_s']:>10.0f} {r['step_ms_min']:>12.1f} {r['step_ms_median']:>15.1f}")
    print(f"DeepSpeed / plain step time: {ratio:.3f}x (overhead {100 * (ratio - 1):+.1f}%)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "rows": rows, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
