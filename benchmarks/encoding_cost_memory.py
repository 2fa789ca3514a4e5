"""The memory mode of ``benchmarks/encoding_cost.py`` (``--memory``): inference peak memory per encoding.

:func:`run_memory` starts ``benchmarks/encoding_cost.py --memory-child NAME`` once per encoding (and repeat),
with glibc told to ``mmap`` and unmap every block of 64 KiB or more so the resident set follows live tensors;
:func:`memory_child`, in that subprocess, runs one inference forward of the stack and reports the peak resident
set size (CUDA: peak allocated memory) above the level just before it. The table compares each with ``nope``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import vlpe
from benchmarks.encoding_cost_stack import Stack, _sync, build_encodings, two_d_encodings

__all__ = ["memory_child", "run_memory"]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().with_name("encoding_cost.py")  # the script each memory child runs


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
    if args.reference:
        vlpe.attention.FAST_MIN_TOKENS = 1 << 62  # the reference path only
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
            cmd = [sys.executable, str(SCRIPT), "--memory-child", name,
                   "--image", str(args.image), "--patch", str(args.patch), "--dim", str(args.dim),
                   "--heads", str(args.heads), "--depth", str(args.depth), "--batch", str(args.batch),
                   "--backend", args.backend, "--device", str(device), "--threads", str(args.threads)]
            cmd += ["--reference"] if args.reference else []
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
          f"batch {args.batch}, {args.depth} layers x {args.heads} heads, dim {args.dim} ({device}, "
          f"{'reference' if args.reference else 'automatic'} attention path)")
    print(f"{'encoding':<14}{'peak delta MiB':>16}{'x nope':>9}{'forward s':>11}")
    for name, r in rows.items():
        if "delta_bytes" not in r:
            print(f"{name:<14}{'skipped/failed':>16}  {r.get('skipped') or r.get('error')}")
            continue
        r["ratio"] = round(r["delta_bytes"] / base, 4) if base else None
        print(f"{name:<14}{r['delta_bytes'] / 2**20:>16.1f}{(r['ratio'] or float('nan')):>9.3f}{r['seconds']:>11.2f}")
    return {"mode": "memory", "reference": args.reference, "device": str(device), "torch": torch.__version__,
            "image": args.image,
            "patch": args.patch, "grid": [side, side], "batch": args.batch,
            "model": {"dim": args.dim, "heads": args.heads, "depth": args.depth, "backend": args.backend},
            "repeats": args.repeats, "results": rows}
