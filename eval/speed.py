"""Cost of every registered encoding relative to ``nope``, and multimodal position ids against transformers.

    python eval/speed.py                                   # every registered encoding, 197 and 785 tokens
    python eval/speed.py --encodings rope lookhere mrope --configs 14:8 28:2 --rounds 7 --clock cpu
    python eval/speed.py --device cuda --out results/speed/speed_h200.json

1. Training step (forward + backward) of a ViT-S-sized stack (12 pre-norm blocks, dim 384, 6 heads) for each
   encoding, side by side with ``nope`` in one run: the stack, the timing rounds (interleaved, rotating start,
   min and median) and the ``nope`` ratios are those of ``benchmarks/encoding_cost.py`` (imported, not copied).
   Each encoding gets the positions it takes for one ``side x side`` frame plus a CLS token, so every
   configuration has the same token count: 2 axes (h, w) for image encodings; 3 axes (t = 0, h, w) for the
   multimodal 3-axis variants (MRoPE, VideoRoPE, ...); 1 axis (the row-major index) for 1D variants (V2PE,
   rope1d); encodings with more axes (VRoPE's four diagonals, PyPE's one axis per layer) get the row-major
   index on every axis (the same cost as their own layouts). Every encoding is built once, in its declared
   example configuration (``Encoding.example``, the one the property kit and the demo use) with the model
   facts (depth, axes, the benchmark grid); one that cannot be built is skipped with the reason.
2. Peak memory of one such training step above the parameters held before it, and its ratio to ``nope``:
   ``torch.cuda.max_memory_allocated`` on GPU; on CPU the peak of live tensor memory tracked by
   ``torch.distributed._tools.mem_tracker.MemTracker`` (activations, gradients, temporaries).
3. ``vlpe.encodings.multimodal.position_ids("mrope", ...)`` against ``transformers``'
   ``Qwen2VLModel.get_rope_index`` on the batches of ``benchmarks/mm_position_ids.py`` (its tiny model and
   batch builder are imported): identical ids on the image case, and the speed-up on both cases (after a
   video, transformers 5.x and vlpe place the following text differently by design, so that case is timed only).

Prints tables and writes JSON (default ``results/speed/speed.json``). Run by hand; nothing here is a test
of speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import torch
from torch import nn

import vlpe
from vlpe.encodings import available, build, get

ROOT = Path(__file__).resolve().parents[1]

__all__ = [
    "load_benchmark",
    "axes_for",
    "build_encoding",
    "positions_for",
    "FrameStack",
    "peak_memory",
    "mm_position_ids_benchmark",
    "run",
    "main",
]


def load_benchmark(name: str) -> ModuleType | None:
    """``benchmarks/<name>.py`` as a module (``benchmarks/`` is scripts, not a package), or None if absent."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.is_file():
        return None
    mod_name = f"vlpe_benchmarks_{name}"  # a private name: nothing else can import it by accident
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def axes_for(name: str) -> int | None:
    """The axis count to benchmark ``name`` with: 2 when it lists image axes, its smallest listed count when it
    lists others, None (the encoding's own default, e.g. one axis per layer) when it lists none."""
    axes = get(name).supported_axes
    return None if axes is None else 2 if 2 in axes else min(axes)


def build_encoding(name: str, *, dim: int, num_heads: int, depth: int, grid: tuple[int, int]):
    """``(encoding, options used)``: the declared example configuration with the model facts (depth, axes, the
    benchmark grid, so learned tables need no resampling). Raises ValueError when it does not build."""
    opts: dict[str, Any] = {"depth": depth, "grid": tuple(grid), **get(name).example}
    if axes_for(name) is not None:
        opts.setdefault("num_axes", axes_for(name))
    try:
        return build(name, dim=dim, num_heads=num_heads, **opts), opts
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} could not be built with {opts}: {e}") from None


def positions_for(num_axes: int, side: int, *, device: torch.device | str | None = None) -> vlpe.Positions:
    """Positions of one ``side x side`` frame plus a CLS token with ``num_axes`` axes (see the module)."""
    if num_axes == 2:
        return vlpe.Positions.grid(side, side, prefix=1, device=device)
    if num_axes == 3:
        return vlpe.Positions.video(1, side, side, prefix=1, device=device)
    line = vlpe.Positions.grid_nd((side * side,), prefix=1, device=device)  # (1, N, 1) row-major index
    if num_axes == 1:
        return line
    return vlpe.Positions(line.coords.expand(-1, -1, num_axes).contiguous(), prefix=1)


class FrameStack(nn.Module):
    """The benchmark stack fed each encoding's own positions for one frame (ignores the 2D grid it is given)."""

    def __init__(self, stack: nn.Module, side: int, axes: Sequence[int], device: torch.device) -> None:
        super().__init__()
        self.stack = stack
        self.positions = {a: positions_for(a, side, device=device) for a in sorted(set(axes))}

    def forward(self, x: torch.Tensor, pos: vlpe.Positions, enc) -> torch.Tensor:
        return self.stack(x, self.positions[enc.num_axes], enc)


def peak_memory(stack: nn.Module, enc, x: torch.Tensor, device: torch.device) -> tuple[int | None, str]:
    """Peak bytes of one forward + backward above what was held before it, and how it was measured."""
    params = list(stack.parameters()) + list(enc.parameters())
    for p in params:
        p.grad = None

    def step():
        stack(x, None, enc).float().square().mean().backward()

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - start
        method = "torch.cuda.max_memory_allocated"
    else:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker
        except ImportError as e:  # a private torch module; report rather than guess
            return None, f"unavailable ({e})"
        tracker = MemTracker()
        tracker.track_external(stack, enc)
        with tracker:
            step()
        snap = tracker.get_tracker_snapshot("peak")
        peak = 0
        for per_type in snap.values():
            held = sum(v for k, v in per_type.items() if getattr(k, "value", k) in ("Parameter", "Buffer"))
            peak = max(peak, per_type["Total"] - held)
        method = "MemTracker peak minus parameters and buffers"
    for p in params:
        p.grad = None
    return int(peak), method


def mm_position_ids_benchmark(rounds: int = 30) -> dict:
    """vlpe's ``position_ids("mrope", ...)`` vs ``Qwen2VLModel.get_rope_index`` on the batches of
    benchmarks/mm_position_ids.py."""
    bench = load_benchmark("mm_position_ids")
    if bench is None:
        return {"skipped": "benchmarks/mm_position_ids.py is not present"}
    from vlpe.encodings import multimodal as mm

    model = bench.tiny_qwen2vl()
    # the image case must match exactly; after a video, transformers 5.x advances the text position by
    # max(h, w) while vlpe keeps the released max over all axes + 1, so that case is timed only
    cases = {
        "B=32, 16 images (4x4 merged) each": bench.build_batch(32, [(1, (1, 8, 8))] * 16),
        "B=8, video 16x14x14 + 2 images": bench.build_batch(8, [(2, (16, 28, 28)), (1, (1, 24, 24)), (1, (1, 24, 24))]),
    }
    compared = {next(iter(cases))}

    def run_hf(tt, img, vid):
        with torch.no_grad():
            return model.get_rope_index(torch.zeros_like(tt), tt, image_grid_thw=img, video_grid_thw=vid)

    def run_vlpe(tt, img, vid):
        grid = img if vid is None else mm.merge_grids(tt, img, vid)[0]
        return mm.position_ids("mrope", tt, grid)

    out: dict[str, Any] = {"rounds": rounds, "cases": {}}
    for name, case in cases.items():
        (ids_hf, d_hf), (ids, d) = run_hf(*case), run_vlpe(*case)  # warm-up and comparison
        same = bool(torch.equal(ids, ids_hf) and torch.equal(d, d_hf)) if name in compared else None
        out["cases"][name] = {"tokens": int(case[0].shape[1]), "batch": int(case[0].shape[0]), "identical": same}
    best = {(n, w): float("inf") for n in cases for w in ("hf", "vlpe")}
    for _ in range(rounds):
        for name, case in cases.items():
            for who, fn in (("hf", run_hf), ("vlpe", run_vlpe)):
                t0 = time.perf_counter()
                fn(*case)
                best[name, who] = min(best[name, who], time.perf_counter() - t0)
    for name, rec in out["cases"].items():
        hf, ours = best[name, "hf"] * 1e3, best[name, "vlpe"] * 1e3
        rec.update(transformers_ms=round(hf, 3), vlpe_ms=round(ours, 3), speedup=round(hf / ours, 2))
    return out


def run(
    encodings: Sequence[str] | None = None,
    *,
    configs: Sequence[tuple[int, int]] = ((14, 8), (28, 2)),
    dim: int = 384,
    heads: int = 6,
    depth: int = 12,
    backend: str = "sdpa",
    rounds: int = 5,
    warmup: int = 1,
    device: str | torch.device = "cpu",
    clock: str = "wall",
    memory: bool = True,
    mm: bool = True,
    mm_rounds: int = 30,
    progress: bool = True,
) -> dict:
    """The whole report as a JSON-ready dict (see the module docstring)."""
    from tqdm import tqdm

    bench = load_benchmark("encoding_cost")
    if bench is None:
        raise ValueError("benchmarks/encoding_cost.py is missing: eval/speed.py reuses its stack and timing")
    device = torch.device(device)
    names = list(dict.fromkeys(["nope", *(encodings or available())]))
    unknown = [n for n in names if n not in available()]
    if unknown:
        raise ValueError(f"unknown encodings {unknown}; registered: {', '.join(available())}")
    torch.manual_seed(0)
    inner = bench.Stack(dim, heads, depth, backend).to(device).train()
    report: dict[str, Any] = {
        "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": {"dim": dim, "heads": heads, "depth": depth, "backend": backend},
        "rounds": rounds, "clock": clock, "configs": [],
    }
    for side, batch in configs:
        encs, options, skipped = {}, {}, {}
        for name in names:
            try:
                encs[name], options[name] = build_encoding(
                    name, dim=dim, num_heads=heads, depth=depth, grid=(side, side)
                )
                encs[name].to(device).train()
            except ValueError as e:
                skipped[name] = str(e)
        stack = FrameStack(inner, side, [e.num_axes for e in encs.values()], device)
        res = bench.time_config(stack, encs, side=side, batch=batch, rounds=rounds, warmup=warmup, device=device,
                                dim=dim, clock=clock)
        res["skipped"] = skipped
        res["options"] = {
            n: {k: (list(v) if isinstance(v, tuple) else v) for k, v in o.items()} for n, o in options.items()
        }
        res["axes"] = {n: e.num_axes for n, e in encs.items()}
        if memory:
            x = torch.randn(batch, side * side + 1, dim, generator=torch.Generator().manual_seed(0)).to(device)
            mem = {}
            for name in tqdm(list(res["results"]), desc=f"memory {side}x{side}", disable=not progress, leave=False):
                mem[name], method = peak_memory(stack, encs[name], x, device)
            base = mem.get("nope")
            for name, peak in mem.items():
                r = res["results"][name]
                r["peak_mib"] = None if peak is None else round(peak / 2**20, 2)
                r["memory_ratio"] = round(peak / base, 4) if peak is not None and base else None
            res["memory_method"] = method
        report["configs"].append(res)
    if mm:
        try:
            report["mm_position_ids"] = mm_position_ids_benchmark(mm_rounds)
        except ImportError as e:
            report["mm_position_ids"] = {"skipped": f"transformers is not importable ({e})"}
    return report


def format_report(report: dict) -> str:
    lines = []
    for c in report["configs"]:
        lines.append(
            f"\n{c['grid'][0]}x{c['grid'][1]}+1 = {c['tokens']} tokens, batch {c['batch']}, forward + backward, "
            f"{report['rounds']} rounds ({report['device']}, {report['threads']} threads, {report['clock']} clock)"
        )
        lines.append(
            f"{'encoding':<13}{'axes':>5}{'min ms':>10}{'x nope':>8}{'x nope med':>11}{'peak MiB':>10}{'x nope':>8}"
        )
        for name, r in c["results"].items():
            peak = r.get("peak_mib")
            ratio = r.get("memory_ratio")
            lines.append(
                f"{name:<13}{c['axes'][name]:>5}{r['min_ms']:>10.1f}{r['ratio_min']:>8.2f}{r['ratio_median']:>11.2f}"
                f"{'-' if peak is None else f'{peak:.1f}':>10}{'-' if ratio is None else f'{ratio:.2f}':>8}"
            )
        for name, why in {**c.get("skipped", {}), **c.get("failed", {})}.items():
            lines.append(f"  skipped {name}: {why}")
    mm = report.get("mm_position_ids")
    if mm is not None:
        lines.append("\nmultimodal position ids: vlpe position_ids('mrope') vs transformers "
                     "Qwen2VLModel.get_rope_index")
        if "skipped" in mm:
            lines.append(f"  skipped: {mm['skipped']}")
        else:
            lines.append(f"{'case':<36}{'L':>6}{'transformers ms':>17}{'vlpe ms':>9}{'speed-up':>10}{'identical':>11}")
            for name, r in mm["cases"].items():
                lines.append(f"{name:<36}{r['tokens']:>6}{r['transformers_ms']:>17.2f}{r['vlpe_ms']:>9.2f}"
                             f"{r['speedup']:>9.1f}x{'-' if r['identical'] is None else str(r['identical']):>11}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--encodings", nargs="+", default=None,
                   help="default: every registered encoding (nope is always added)")
    p.add_argument("--configs", nargs="+", default=["14:8", "28:2"],
                   help="SIDE:BATCH, a SIDE x SIDE frame plus CLS (default 14:8 28:2 = 197 and 785 tokens)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--backend", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time; cpu: process CPU time (steadier on a shared machine)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument("--no-mm", action="store_true", help="skip the multimodal position-id comparison")
    p.add_argument("--mm-rounds", type=int, default=30)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="outputs/speed/speed.json")
    args = p.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.configs]
        if any(len(c) != 2 or min(c) < 1 for c in configs):
            raise ValueError
    except ValueError:
        p.error(f"--configs takes SIDE:BATCH pairs of positive integers, got {args.configs}")
    torch.set_num_threads(max(1, args.threads))
    report = run(args.encodings, configs=configs, dim=args.dim, heads=args.heads, depth=args.depth,
                 backend=args.backend, rounds=args.rounds, warmup=args.warmup, device=args.device, clock=args.clock,
                 memory=not args.no_memory, mm=not args.no_mm, mm_rounds=args.mm_rounds,
                 progress=not args.no_progress)
    print(format_report(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
