"""Multimodal position ids: vlpe's vectorised builder vs transformers' ``Qwen2VLModel.get_rope_index``.

Both run on the same inputs, side by side in one process: each round times every case once (interleaved),
and the minimum over rounds is reported. vlpe's time includes interleaving Hugging Face's image and video
grids (``merge_grids``); it is given for the default call (``validate=True``: the inputs are checked, one
boolean read on the host) and for ``validate=False`` (no host read). Cases, each sample 10 text tokens before and
after every block plus its <vision_start>/<vision_end> tokens:

* B=8, 4 images of 448 px per sample (32 x 32 patches = 16 x 16 merged tokens each): outputs must be identical
  (images follow the same semantics in both); target >= 5x faster with validation.
* B=4, a 64-frame 336 px video (32 x 24 x 24 patches, temporal patch 2) + a 336 px image per sample: speed only
  (transformers 5.x advances text after a video by max(h, w) only; vlpe keeps the released maximum over all
  axes + 1); target >= 3x faster with validation.
* B=32, 16 tiny images per sample (8 x 8 patches = 4 x 4 merged tokens): identical outputs; transformers'
  per-image Python loop dominates here, so this is the most favourable case for vlpe.

The realistic batches (images, video) are printed first, with their targets; the tiny-image case follows as
a second table. Every timed call directly follows an untimed call of the same function on the same inputs, so
each contestant is timed warm (without it, whichever call followed the other library's ran with cold caches:
~30 us of a 300 us call here). The calls take a few hundred microseconds, so the minimum needs many rounds on
a busy machine (the default is 100, about 12 s).

Run: ``python benchmarks/mm_position_ids.py [--rounds 100] [--threads 1]``
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2VLConfig, Qwen2VLModel

from vlpe.encodings import multimodal as mm


def tiny_qwen2vl() -> Qwen2VLModel:
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=999, video_token_id=998, vision_start_token_id=997,
    )
    return Qwen2VLModel(cfg).eval()


def build_batch(batch: int, blocks: list[tuple[int, tuple[int, int, int]]], text: int = 3):
    """Token types for ``batch`` identical samples: ``text`` tokens, then per block <vs> tokens <ve> + text;
    the image and video grids (patches, before merging) in Hugging Face's separate lists."""
    types: list[int] = [0] * text
    images, videos = [], []
    for kind, g in blocks:
        n = g[0] * (g[1] // 2) * (g[2] // 2)
        types += [0] + [kind] * n + [0] + [0] * text
        (images if kind == 1 else videos).append(g)
    tt = torch.tensor(types).repeat(batch, 1)
    img = torch.tensor(images * batch) if images else None
    vid = torch.tensor(videos * batch) if videos else None
    return tt, img, vid


CASES = {
    "B=8, 4 images of 448 px": (8, [(1, (1, 32, 32))] * 4, 10),
    "B=4, 64-frame video + image, 336 px": (4, [(2, (32, 24, 24)), (1, (1, 24, 24))], 10),
    "B=32, 16 images of 8x8 patches": (32, [(1, (1, 8, 8))] * 16, 3),
}
IDENTICAL = ("B=8, 4 images of 448 px", "B=32, 16 images of 8x8 patches")  # image-only: same semantics
TARGETS = {"B=8, 4 images of 448 px": 5.0, "B=4, 64-frame video + image, 336 px": 3.0}  # the realistic rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_qwen2vl()
    cases = {name: build_batch(b, blocks, text) for name, (b, blocks, text) in CASES.items()}

    def run_hf(tt, img, vid):
        with torch.no_grad():
            return model.get_rope_index(torch.zeros_like(tt), tt, image_grid_thw=img, video_grid_thw=vid)

    def run_vlpe(tt, img, vid, validate=True):
        grid = mm.merge_grids(tt, img, vid)[0]
        return mm.position_ids("mrope", tt, grid, validate=validate)

    for name in IDENTICAL:  # correctness first: identical outputs on the image cases
        ids_hf, d_hf = run_hf(*cases[name])
        ids, d = run_vlpe(*cases[name])
        same = torch.equal(ids, ids_hf) and torch.equal(d, d_hf)
        print(f"{name}: position_ids and rope_deltas identical to transformers: {same}")
        if not same:
            raise SystemExit("outputs differ")
    runs = {"hf": run_hf, "vlpe": run_vlpe, "vlpe_novalidate": lambda *c: run_vlpe(*c, validate=False)}
    for c in cases.values():  # warm-up
        for fn in runs.values():
            fn(*c)
    best = {(name, who): float("inf") for name in cases for who in runs}
    for r in range(args.rounds):
        for name, c in cases.items():
            order = list(runs.items())
            for who, fn in order[r % len(order) :] + order[: r % len(order)]:
                fn(*c)  # untimed: every timed call follows one of its own on the same inputs (all timed warm)
                t0 = time.perf_counter()
                fn(*c)
                best[name, who] = min(best[name, who], time.perf_counter() - t0)

    print(f"\nminimum over {args.rounds} interleaved rounds, {torch.get_num_threads()} thread(s); vlpe includes "
          "merge_grids")
    header = (f"{'case':38s} {'tokens':>7s} {'transformers ms':>16s} {'vlpe ms':>8s} {'speed-up':>9s} "
              f"{'validate=False ms':>18s} {'speed-up':>9s}")

    def row(name: str) -> str:
        hf, ours, lean = (best[name, who] * 1e3 for who in runs)
        line = (f"{name:38s} {cases[name][0].numel():7d} {hf:16.2f} {ours:8.3f} {hf / ours:8.1f}x {lean:18.3f} "
                f"{hf / lean:8.1f}x")
        if name in TARGETS:
            line += f"  (target >= {TARGETS[name]:.0f}x: {'met' if hf / ours >= TARGETS[name] else 'NOT met'})"
        return line

    print("realistic batches\n" + header)
    for name in TARGETS:
        print(row(name))
    print("\ntiny images (transformers' per-image loop dominates)\n" + header)
    for name in cases:
        if name not in TARGETS:
            print(row(name))


if __name__ == "__main__":
    main()
