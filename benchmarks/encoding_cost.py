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
ratios to ``nope`` and the largest difference of the two outputs. ``pype`` (a VLM decoder encoding) attends
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
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import vlpe
from vlpe.encodings import build, construct, get
from benchmarks.reference_forms import PaPENaive

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
            opts = {"depth": depth, "num_axes": 2, "grid": tuple(grid)}  # learned tables at the benchmark grid
            if name in REFERENCE_FORMS:
                out[name] = construct(REFERENCE_FORMS[name], dim=dim, num_heads=num_heads, **opts).to(device)
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


# --------------------------------------------------------------------------- one layer
#: the encodings of the one-layer table: every bias encoding (score / widen hook) and its variants
LAYER_ENCODINGS = ["alibi", "lookhere", "lh180", "lh45", "irpe", "fire", "pape", "pape_ri", "pype"]


def _pype_positions(tokens: int, depth: int, device) -> vlpe.Positions:
    """PyPE's per-layer positions of one square image (merged 2 x 2) after text, ``tokens`` tokens in all."""
    from vlpe.encodings import multimodal as mm

    side = int(round((tokens - 1) ** 0.5))
    types = torch.tensor([[0] * (tokens - side * side) + [1] * (side * side)], device=device)
    grid = torch.tensor([[1, 2 * side, 2 * side]], device=device)
    ids, _ = mm.position_ids("pype", types, grid, depth=depth)  # (depth, 1, S)
    return vlpe.Positions(ids.permute(1, 2, 0).float())


def run_layer(args, device):
    """One inference attention layer per encoding, reference path vs automatic path, side by side."""
    side = args.image // args.patch
    grid_pos = vlpe.Positions.grid(side, side, prefix=1, device=device)
    N, H, D = grid_pos.num_tokens, args.heads, args.dim // args.heads
    names = ["nope"] + [n for n in (args.encodings or LAYER_ENCODINGS) if n != "nope"]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(args.batch, H, N, D, generator=g).to(device) for _ in range(3))
    encs, positions = {}, {}
    for name in names:
        opts = {"depth": args.depth} if name == "pype" else {"depth": args.depth, "num_axes": 2}
        encs[name] = build(name, dim=args.dim, num_heads=H, **opts).to(device).eval()
        positions[name] = _pype_positions(N, args.depth, device) if name == "pype" else grid_pos
    layer = args.depth // 2

    def call(name, fast, backend="sdpa"):
        enc = encs[name]
        ctx = enc.prepare(positions[name])
        return vlpe.attend(q, k, v, enc=enc, ctx=ctx, layer=layer, fast=fast, backend=backend)

    runs = {("nope", "auto"): lambda: call("nope", None)}
    for name in names[1:]:
        runs[name, "reference"] = lambda name=name: call(name, False)
        runs[name, "auto"] = lambda name=name: call(name, None)
    compile_s, failed = {}, {}
    if args.flex:
        for name in names:
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    call(name, None, "flex")  # the first call compiles (once per shape)
                compile_s[name] = time.perf_counter() - t0
                runs[name, "flex"] = lambda name=name: call(name, None, "flex")
            except Exception as e:  # e.g. a values term, which flex cannot take
                failed[name] = f"{type(e).__name__}: {e}"
    timer = time.process_time if args.clock == "cpu" else time.perf_counter
    diffs = {}
    with torch.inference_mode():
        for name in names[1:]:
            diffs[name] = (runs[name, "auto"]() - runs[name, "reference"]()).abs().max().item()
        keys = list(runs)
        best = {key: float("inf") for key in keys}
        for r in range(args.rounds):
            shift = r % len(keys)
            for key in keys[shift:] + keys[:shift]:
                _sync(device)
                t0 = timer()
                runs[key]()
                _sync(device)
                best[key] = min(best[key], timer() - t0)
    base = best["nope", "auto"]
    print(f"\none attention layer, inference: {side}x{side}+1 = {N} tokens, {H} heads of {D}, batch {args.batch}, "
          f"{args.rounds} interleaved rounds, minimum ({device}, {torch.get_num_threads()} threads, {args.clock} clock)")
    print(f"nope: {1e3 * base:.1f} ms")
    head = f"{'encoding':<12}{'reference x nope':>18}{'fast path x nope':>18}{'speed-up':>10}{'max |diff|':>12}"
    print(head + (f"{'flex x nope':>13}{'flex compile s':>16}" if args.flex else ""))
    rows = {}
    for name in names[1:]:
        ref, auto = best[name, "reference"], best[name, "auto"]
        row = {"reference_ms": 1e3 * ref, "auto_ms": 1e3 * auto, "reference_ratio": ref / base,
               "auto_ratio": auto / base, "max_abs_diff": diffs[name]}
        line = f"{name:<12}{ref / base:>17.2f}x{auto / base:>17.2f}x{ref / auto:>9.2f}x{diffs[name]:>12.1e}"
        if args.flex:
            if (name, "flex") in best:
                row["flex_ratio"], row["flex_compile_s"] = best[name, "flex"] / base, compile_s[name]
                line += f"{row['flex_ratio']:>12.2f}x{compile_s[name]:>16.1f}"
            else:
                line += f"{'failed':>13}"
        rows[name] = row
        print(line)
    if args.flex and ("nope", "flex") in best:
        print(f"flex nope: {best['nope', 'flex'] / base:.2f}x nope on SDPA, compile {compile_s['nope']:.1f} s")
    for name, why in failed.items():
        print(f"flex {name}: {why}", file=sys.stderr)
    return {"mode": "layer", "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "tokens": N, "heads": H, "head_dim": D, "batch": args.batch, "rounds": args.rounds, "clock": args.clock,
            "nope_ms": 1e3 * base, "results": rows,
            "flex_nope_ratio": best["nope", "flex"] / base if ("nope", "flex") in best else None}


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
            cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name,
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
