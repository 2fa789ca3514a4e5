"""The one-layer mode of ``benchmarks/encoding_cost.py`` (``--layer``): one inference attention layer per encoding.

:func:`run_layer` times ``prepare`` + ``vlpe.attend`` on fixed q, k, v at a large grid for every bias encoding
(:data:`LAYER_ENCODINGS`), on the reference path (``fast=False``) and on the automatic path, interleaved in every
round with ``nope`` (and the compiled FlexAttention path with ``--flex``), and reports both ratios to ``nope``
and the largest difference of the two outputs. Beside them it prints the limit of any bias on SDPA: the same
SDPA call as ``nope`` reading a prebuilt ``(1, H, N, N)`` float mask (built before timing, which the fast path
never holds); ``--fast-only`` leaves the reference path out of the timed rounds (its output is still compared). ``pype`` attends over its own positions of the same token count
(``_pype_positions``: one square image merged 2 x 2 after text).
"""

from __future__ import annotations

import sys
import time

import torch

import vlpe
from vlpe.encodings import build
from benchmarks.encoding_cost_stack import _sync

__all__ = ["LAYER_ENCODINGS", "run_layer"]


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

    full = torch.randn(1, H, N, N, generator=g).to(device)  # (1, H, N, N): the limit's prebuilt mask

    def limit():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)

    fast_only = getattr(args, "fast_only", False)
    runs = {("nope", "auto"): lambda: call("nope", None), ("sdpa+mask", "limit"): limit}
    for name in names[1:]:
        if not fast_only:
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
            diffs[name] = (runs[name, "auto"]() - call(name, False)).abs().max().item()
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
    print(f"nope: {1e3 * base:.1f} ms; the limit, SDPA reading a prebuilt (1, H, N, N) mask: "
          f"{best['sdpa+mask', 'limit'] / base:.2f}x nope")
    head = f"{'encoding':<12}{'reference x nope':>18}{'fast path x nope':>18}{'speed-up':>10}{'max |diff|':>12}"
    print(head + (f"{'flex x nope':>13}{'flex compile s':>16}" if args.flex else ""))
    rows = {}
    for name in names[1:]:
        ref, auto = best.get((name, "reference"), float("nan")), best[name, "auto"]
        row = {"reference_ms": 1e3 * ref, "auto_ms": 1e3 * auto, "reference_ratio": ref / base,
               "auto_ratio": auto / base, "max_abs_diff": diffs[name]}
        if (name, "reference") in best:
            line = f"{name:<12}{ref / base:>17.2f}x{auto / base:>17.2f}x{ref / auto:>9.2f}x{diffs[name]:>12.1e}"
        else:  # --fast-only: the reference path was run once, to compare, not timed
            line = f"{name:<12}{'-':>18}{auto / base:>17.2f}x{'-':>10}{diffs[name]:>12.1e}"
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
            "nope_ms": 1e3 * base, "limit_ratio": best["sdpa+mask", "limit"] / base, "results": rows,
            "flex_nope_ratio": best["nope", "flex"] / base if ("nope", "flex") in best else None}
