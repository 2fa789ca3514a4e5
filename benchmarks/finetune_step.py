"""Time per step of fine-tuning a Hugging Face Qwen-VL folder at ZeRO-2 and ZeRO-3 (``train/vlm.py --config
configs/hf/qwen2_vl.yaml``), the two launched one after the other in one run, on the same data and model.

    python benchmarks/finetune_step.py                 # 2 ranks (CPU: gloo), 40 steps each, tiny Qwen2-VL
    python benchmarks/finetune_step.py --ranks 8 --hf-model Qwen2-VL-7B-Instruct --annotations train.json \
        --media-root videos/ --steps 50                # a real folder on a GPU node

Without ``--hf-model`` a tiny random Qwen2-VL folder (:mod:`models.tiny_qwen_vl`, the demo's) and the demo's
V-NIAH mp4 set (:func:`data.instruct.make_vniah_instruct`) are made in a temporary folder. Every launch trains
``--steps`` steps (micro-batch 4 per rank, gradient checkpointing off, nothing frozen); the time per step is the
wall time between the train records of step ``--skip`` and the last step, read from ``metrics.jsonl``
(``samples_per_s`` of each logged window), so start-up, compilation of DeepSpeed's communication op and the first
steps are left out. Printed: seconds per step at each stage and the ZeRO-3 / ZeRO-2 ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_seconds(metrics: Path, *, skip: int, micro_batch: int, ranks: int) -> float:
    """Mean seconds per step over the logged windows after step ``skip`` (from each window's samples/s)."""
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    windows = [r for r in recs if r["split"] == "train" and r["step"] > skip]
    if not windows:
        raise SystemExit(f"{metrics}: no train record after step {skip}; run more --steps")
    per_step = [micro_batch * ranks / r["samples_per_s"] for r in windows]  # one micro-batch per step per rank
    return sum(per_step) / len(per_step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--hf-model", default=None, help="a checkpoint folder (default: a tiny random Qwen2-VL)")
    p.add_argument("--annotations", default=None)
    p.add_argument("--media-root", default=None)
    p.add_argument("--variant", default="mrope_i")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank (CPU)")
    args = p.parse_args(argv)
    if args.steps <= args.skip:
        p.error("--steps must exceed --skip")
    work = Path(tempfile.mkdtemp(prefix="finetune_step_"))
    folder, annotations, media = args.hf_model, args.annotations, args.media_root
    if folder is None:
        from data.instruct import make_vniah_instruct
        from data.vniah import PHOTO_NEEDLES, QUESTIONS
        from models.tiny_qwen_vl import save_tiny_qwen_vl

        made = make_vniah_instruct(work / "data", train=256, val=16, frames=8, frame_size=56)
        folder = str(save_tiny_qwen_vl("qwen2_vl", work / "tiny", texts=[QUESTIONS["needle"], *PHOTO_NEEDLES.values()],
                                       frame=28, max_frame=56, layers=2, vision_width=64, vision_depth=2))  # fmt: skip
        annotations, media = made["train"], made["media_root"]
    elif annotations is None:
        p.error("--hf-model needs --annotations")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    ds = str(Path(sys.executable).with_name("deepspeed"))
    results = {}
    for stage in (2, 3):
        out = work / f"zero{stage}"
        cmd = [ds, "--num_gpus", str(args.ranks), "--master_port", str(_free_port()), "train/vlm.py", "--config",
               "configs/hf/qwen2_vl.yaml", f"model.hf_model={folder}", f"model.variant={args.variant}",
               f"data.annotations={annotations}", *([f"data.media_root={media}"] if media else []),
               f"train.zero_stage={stage}", f"train.steps={args.steps}", "train.micro_batch=4", "train.grad_accum=1",
               "train.freeze=[]", "train.gradient_checkpointing=false", "train.log_every=5",
               f"train.ckpt_every={args.steps}", "train.progress=false", "train.num_workers=0",
               f"train.out_dir={out}"]  # fmt: skip
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        results[stage] = step_seconds(out / "metrics.jsonl", skip=args.skip, micro_batch=4, ranks=args.ranks)
        print(f"ZeRO-{stage}: {results[stage]:.3f} s per step ({args.ranks} ranks, micro-batch 4 per rank)",
              flush=True)  # fmt: skip
    print(f"ZeRO-3 / ZeRO-2: {results[3] / results[2]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
