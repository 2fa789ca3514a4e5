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

``pape_naive`` (not a registered encoding) is PaPE in the reference implementation's naive widened form
(``3M + 2`` extra q/k channels instead of ``1 + P(P+1)/2 + P``), same parameters and logits; it is timed beside
``pape`` so the table shows the folded form against the formulation it replaces.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import vlpe
from vlpe.encodings import build, get
from vlpe.encodings.pape import PaPENaive

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` with a 4x GELU MLP."""

    def __init__(self, dim: int, num_heads: int, backend: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = vlpe.Attention(dim=dim, num_heads=num_heads, backend=backend)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, enc, ctx, layer):
        x = x + self.attn(self.norm1(x), enc=enc, ctx=ctx, layer=layer)
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, dim: int, num_heads: int, depth: int, backend: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, num_heads, backend) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, pos, enc):
        ctx = enc.prepare(pos)  # once per forward, shared by all layers
        x = enc.embed(x, ctx)
        for i, blk in enumerate(self.blocks):
            x = blk(x, enc, ctx, i)
            x = enc.mix(x, ctx, i)
        return self.norm(x)


#: Benchmark-only formulations, timed beside the registered encodings they are the reference form of.
REFERENCE_FORMS = {"pape_naive": PaPENaive}  # the reference's 3M + 2 channel widening, beside ``pape``


def two_d_encodings() -> list[str]:
    """Registered encodings that take 2-axis (image) positions, plus the reference forms."""
    names = []
    for name in vlpe.encodings.available():
        axes = get(name).supported_axes
        if axes is None or 2 in axes:
            names.append(name)
            names += [ref for ref, cls in REFERENCE_FORMS.items() if cls.name == name]
    return names


def build_encodings(names, *, dim, num_heads, depth, grid, device):
    """``{name: module}``; encodings that cannot be built at this size are reported and skipped."""
    out, skipped = {}, {}
    for name in ["nope"] + [n for n in names if n != "nope"]:
        try:
            opts = {"depth": depth, "num_axes": 2}
            if name == "ape":
                opts["grid_size"] = grid  # trained at the benchmark grid: no resampling cost
            if name in REFERENCE_FORMS:
                out[name] = REFERENCE_FORMS[name](dim=dim, num_heads=num_heads, **opts).to(device)
            else:
                out[name] = build(name, dim=dim, num_heads=num_heads, **opts).to(device)
        except (ValueError, TypeError) as e:
            skipped[name] = str(e)
    return out, skipped


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# --------------------------------------------------------------------------- memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(args, device) -> dict:
    """Runs in its own process: one inference forward of one encoding; prints the peak above the start level."""
    torch.manual_seed(0)
    side = args.image // args.patch
    stack = Stack(args.dim, args.heads, args.depth, args.backend).to(device).eval()
    encs, skipped = build_encodings([args.memory_child], dim=args.dim, num_heads=args.heads, depth=args.depth,
                                    grid=(14, 14), device=device)
    if args.memory_child not in encs:
        return {"name": args.memory_child, "skipped": skipped.get(args.memory_child, "not built")}
    enc = encs[args.memory_child].eval()
    pos = vlpe.Positions.grid(side, side, prefix=1, device=device)
    x = torch.randn(args.batch, pos.num_tokens, args.dim, device=device)
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        else:
            start = _rss_bytes()
            peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter()
        stack(x, pos, enc)
        _sync(device)
        seconds = time.perf_counter() - t0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if peak <= peak_before:  # the forward never rose above an earlier (set-up) peak
                peak = max(start, _rss_bytes())
    return {"name": args.memory_child, "tokens": pos.num_tokens, "delta_bytes": peak - start, "seconds": seconds}


def run_memory(args, device):
    names = ["nope"] + [n for n in (args.encodings or two_d_encodings()) if n != "nope"]
    side = args.image // args.patch
    rows = {}
    for rep in range(args.repeats):
        for name in names:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
                   "--image", str(args.image), "--patch", str(args.patch), "--dim", str(args.dim),
                   "--heads", str(args.heads), "--depth", str(args.depth), "--batch", str(args.batch),
                   "--backend", args.backend, "--device", str(device), "--threads", str(args.threads)]
            # glibc: serve every allocation >= 64 KiB by mmap and return it on free, so the resident set
            # follows live tensors instead of the allocator's cached heap
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=env)
            if proc.returncode != 0:
                rows[name] = {"name": name, "error": proc.stderr.strip().splitlines()[-1:]}
                print(f"{name}: failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if "delta_bytes" in r and (name not in rows or r["delta_bytes"] < rows[name].get("delta_bytes", 1e30)):
                rows[name] = r  # min over repeats
            elif name not in rows:
                rows[name] = r
    base = rows.get("nope", {}).get("delta_bytes")
    print(f"\ninference peak memory above the start level, {side}x{side}+1 = {side * side + 1} tokens, "
          f"batch {args.batch}, {args.depth} layers x {args.heads} heads, dim {args.dim} ({device})")
    print(f"{'encoding':<14}{'peak delta MiB':>16}{'x nope':>9}{'forward s':>11}")
    for name, r in rows.items():
        if "delta_bytes" not in r:
            print(f"{name:<14}{'skipped/failed':>16}  {r.get('skipped') or r.get('error')}")
            continue
        r["ratio"] = round(r["delta_bytes"] / base, 4) if base else None
        print(f"{name:<14}{r['delta_bytes'] / 2**20:>16.1f}{(r['ratio'] or float('nan')):>9.3f}{r['seconds']:>11.2f}")
    return {"mode": "memory", "device": str(device), "torch": torch.__version__, "image": args.image,
            "patch": args.patch, "grid": [side, side], "batch": args.batch,
            "model": {"dim": args.dim, "heads": args.heads, "depth": args.depth, "backend": args.backend},
            "repeats": args.repeats, "results": rows}


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
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: all cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: process CPU time (steadier on a shared machine)")
    p.add_argument("--memory", action="store_true", help="inference peak-memory mode, one subprocess per encoding")
    p.add_argument("--image", type=int, default=1024, help="memory mode: image side in pixels")
    p.add_argument("--patch", type=int, default=16, help="memory mode: patch size")
    p.add_argument("--batch", type=int, default=1, help="memory mode: batch size")
    p.add_argument("--repeats", type=int, default=1, help="memory mode: subprocess runs per encoding (min kept)")
    p.add_argument("--out", default=None, help="JSON path (default outputs/bench/encodings[_memory].json)")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    big = args.memory or args.memory_child
    args.dim = args.dim or (768 if big else 384)
    args.heads = args.heads or (12 if big else 6)
    torch.set_num_threads(max(1, args.threads))
    device = torch.device(args.device)

    if args.memory_child:
        print(json.dumps(memory_child(args, device)))
        return
    report = run_memory(args, device) if args.memory else run_timing(args, device)
    out = Path(args.out) if args.out else ROOT / "outputs" / "bench" / (
        "encodings_memory.json" if args.memory else "encodings.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
