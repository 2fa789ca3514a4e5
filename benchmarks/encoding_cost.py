"""Cost of each position encoding in a ViT-S-sized stack, measured side by side against ``nope``.

Timing (default): forward + backward of 12 pre-norm blocks (attention + 4x MLP, dim 384, 6 heads) built from
``vlpe.Attention``, at 14x14+1 tokens (batch 8) and 28x28+1 tokens (batch 2). The encoding is used as a model
uses it: ``prepare`` once per forward, ``embed`` before block 0, the attention hooks in every block, ``mix``
after each block (``ape`` is built for the benchmark grid, so it pays no resampling). Rounds interleave all
encodings (the start rotates each round) and the table reports the minimum and median over rounds and their
ratio to ``nope``, which is always measured. ``--clock cpu`` times CPU seconds of the process instead of
wall time, which is far steadier on a shared machine. JSON goes to ``outputs/bench/encodings.json``.

Memory (``--memory``): inference peak memory at a large grid (default 1024 x 1024 px, patch 16 -> 64x64 + CLS,
12 layers x 12 heads, dim 768, batch 1). Each encoding runs in its own subprocess; the peak resident set size
(CUDA: peak allocated memory) above the level just before the forward is compared with a ``nope`` subprocess;
glibc is told to ``mmap`` (and unmap on free) every block of 64 KiB or more, so the resident set tracks live
tensors rather than cached heap.

    python benchmarks/encoding_cost.py --encodings rope rope_mixed ape
    python benchmarks/encoding_cost.py --memory --encodings rope rope_mixed alibi

One layer (``--layer``): one inference attention layer at a large grid (default 1024 x 1024 px, patch 16 -> 64x64
+ CLS = 4097 tokens, 12 heads of 64, batch 1; one thread by default): ``prepare`` + ``vlpe.attend`` on fixed
q, k, v for every bias encoding, on the reference path (``fast=False``, what every call took before the fast
path existed) and on the automatic path, interleaved in every round with ``nope``; the table gives both
ratios to ``nope`` and the largest difference of the two outputs, with the limit of any bias on SDPA (the same
call reading a prebuilt (1, H, N, N) mask) printed above them; ``--fast-only`` times the fast path alone. ``pype`` (a VLM decoder encoding) attends
over its own positions of the same token count (one 128 x 128 image merged 2 x 2 after one text token).
``--flex`` adds the compiled FlexAttention path on CPU, its compile time (paid once per shape) printed apart.

    python benchmarks/encoding_cost.py --layer
    python benchmarks/encoding_cost.py --layer --flex --encodings alibi lookhere

The memory mode measures the automatic path; ``--reference`` measures the reference path instead.

``pape_naive`` (not a registered encoding) is PaPE in the reference implementation's naive widened form
(``3M + 2`` extra q/k channels instead of ``1 + P(P+1)/2 + P``), same parameters and logits; it is timed beside
``pape`` so the table shows the folded form against the formulation it replaces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import vlpe
from benchmarks.encoding_cost_layer import LAYER_ENCODINGS, run_layer  # noqa: F401
from benchmarks.encoding_cost_memory import memory_child, run_memory
from benchmarks.encoding_cost_stack import (  # noqa: F401  (eval/speed.py uses Stack from here)
    REFERENCE_FORMS,
    Block,
    Stack,
    _sync,
    build_encodings,
    two_d_encodings,
)

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- timing
def time_config(stack, encs, *, side, batch, rounds, warmup, device, dim, clock="wall"):
    pos = vlpe.Positions.grid(side, side, prefix=1, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, pos.num_tokens, dim, generator=g).to(device)
    params = list(stack.parameters())
    # "cpu": CPU seconds of this process (all threads), immune to time slices lost to other processes
    timer = time.process_time if clock == "cpu" else time.perf_counter

    def step(enc):
        for p in params + list(enc.parameters()):
            p.grad = None
        _sync(device)
        t0 = timer()
        out = stack(x, pos, enc)
        out.float().square().mean().backward()
        _sync(device)
        return (timer() - t0) * 1e3

    failed = {}
    for name in list(encs):
        try:
            for _ in range(max(1, warmup)):
                step(encs[name])
        except Exception as e:  # an encoding that cannot run this model is reported, not fatal
            if name == "nope":
                raise
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"skipped {name}: {failed[name]}", file=sys.stderr)
    names = [n for n in encs if n not in failed]
    times = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(step(encs[name]))
    base_min, base_med = min(times["nope"]), statistics.median(times["nope"])
    res = {}
    for name in names:
        mn, md = min(times[name]), statistics.median(times[name])
        res[name] = {
            "min_ms": round(mn, 3),
            "median_ms": round(md, 3),
            "ratio_min": round(mn / base_min, 4),
            "ratio_median": round(md / base_med, 4),
            "times_ms": [round(t, 3) for t in times[name]],
        }
    return {"tokens": pos.num_tokens, "grid": [side, side], "batch": batch, "results": res, "failed": failed}


def run_timing(args, device):
    names = args.encodings or two_d_encodings()
    stack = Stack(args.dim, args.heads, args.depth, args.backend).to(device).train()
    report = {"mode": "time", "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": {"dim": args.dim, "heads": args.heads, "depth": args.depth, "backend": args.backend},
              "rounds": args.rounds, "clock": args.clock, "configs": []}
    for spec in args.configs:
        side, batch = (int(v) for v in spec.split(":"))
        encs, skipped = build_encodings(names, dim=args.dim, num_heads=args.heads, depth=args.depth,
                                        grid=(side, side), device=device)
        for e in encs.values():
            e.train()
        for name, why in skipped.items():
            print(f"skipped {name}: {why}", file=sys.stderr)
        res = time_config(stack, encs, side=side, batch=batch, rounds=args.rounds, warmup=args.warmup,
                          device=device, dim=args.dim, clock=args.clock)
        res["skipped"] = skipped
        report["configs"].append(res)
        print(f"\n{side}x{side}+1 = {res['tokens']} tokens, batch {batch}, fwd+bwd, {args.rounds} rounds "
              f"({device}, {torch.get_num_threads()} threads, {args.clock} clock)")
        print(f"{'encoding':<14}{'min ms':>10}{'median ms':>11}{'x nope (min)':>14}{'x nope (med)':>14}")
        for name, r in res["results"].items():
            print(f"{name:<14}{r['min_ms']:>10.1f}{r['median_ms']:>11.1f}{r['ratio_min']:>14.3f}"
                  f"{r['ratio_median']:>14.3f}")
    return report


# --------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encodings", nargs="+", default=None,
                   help="encodings to measure (default: every registered 2D-capable encoding); nope is always added")
    p.add_argument("--configs", nargs="+", default=["14:8", "28:2"],
                   help="SIDE:BATCH pairs, a SIDE x SIDE patch grid plus one CLS token (default 14:8 28:2)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dim", type=int, default=None, help="model width (384 timing, 768 memory)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (6 timing, 12 memory)")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--backend", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: all cores; layer mode: 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: process CPU time (steadier on a shared machine)")
    p.add_argument("--memory", action="store_true", help="inference peak-memory mode, one subprocess per encoding")
    p.add_argument("--layer", action="store_true",
                   help="one inference attention layer at --image px: reference path vs fast path, per encoding")
    p.add_argument("--flex", action="store_true", help="layer mode: also the compiled FlexAttention path")
    p.add_argument("--fast-only", action="store_true",
                   help="layer mode: time the automatic (fast) path only; the reference path is run once to compare")
    p.add_argument("--reference", action="store_true", help="memory mode: the reference attention path only")
    p.add_argument("--image", type=int, default=1024, help="memory mode: image side in pixels")
    p.add_argument("--patch", type=int, default=16, help="memory mode: patch size")
    p.add_argument("--batch", type=int, default=1, help="memory and layer modes: batch size")
    p.add_argument("--repeats", type=int, default=1, help="memory mode: subprocess runs per encoding (min kept)")
    p.add_argument("--out", default=None, help="JSON path (default outputs/bench/encodings[_memory].json)")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    big = args.memory or args.memory_child or args.layer
    args.dim = args.dim or (768 if big else 384)
    args.heads = args.heads or (12 if big else 6)
    args.threads = args.threads or (1 if args.layer else os.cpu_count())
    torch.set_num_threads(max(1, args.threads))
    device = torch.device(args.device)

    if args.memory_child:
        print(json.dumps(memory_child(args, device)))
        return
    if args.layer:
        report, name = run_layer(args, device), "encodings_layer.json"
    elif args.memory:
        report, name = run_memory(args, device), "encodings_memory.json"
    else:
        report, name = run_timing(args, device), "encodings.json"
    out = Path(args.out) if args.out else ROOT / "outputs" / "bench" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
