"""Multimodal position ids: vlpe's vectorised builder vs transformers' ``Qwen2VLModel.get_rope_index``.

Both run on the same inputs, side by side in one process: each round times every case once (interleaved),
and the minimum over rounds is reported. Cases (ecosystem-and-style.md 3.1):

* B=32, 16 small images per sample (8x8 patches = 4x4 merged tokens): outputs must be identical (images
  follow the same semantics in both); target >= 10x faster.
* B=8, a 16-frame video (16 x 28 x 28 patches) + 2 images per sample: speed only (transformers 5.x
  advances text after a video by max(h, w) only; vlpe keeps the released maximum over all axes + 1);
  target >= 3x faster. vlpe's time includes interleaving the image and video grids (``merge_grids``).

Run: ``python benchmarks/mm_position_ids.py [--rounds 30] [--threads 1]``
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
    """Token types for ``batch`` identical samples: ``text`` tokens, then per block <vs> tokens <ve> + text."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_qwen2vl()

    cases = {}
    tt, img, _ = build_batch(32, [(1, (1, 8, 8))] * 16)
    cases["B=32, 16 images (4x4) each"] = (tt, img, None)
    tt, img, vid = build_batch(8, [(2, (16, 28, 28)), (1, (1, 24, 24)), (1, (1, 24, 24))])
    cases["B=8, video 16x14x14 + 2 images"] = (tt, img, vid)

    def run_hf(tt, img, vid):
        with torch.no_grad():
            return model.get_rope_index(torch.zeros_like(tt), tt, image_grid_thw=img, video_grid_thw=vid)

    def run_vlpe(tt, img, vid):
        grid = img if vid is None else mm.merge_grids(tt, img, vid)[0]
        return mm.position_ids("mrope", tt, grid)

    # correctness on the image case (identical outputs), then warm-up
    tt, img, _ = cases["B=32, 16 images (4x4) each"]
    ids_hf, d_hf = run_hf(tt, img, None)
    ids, d = run_vlpe(tt, img, None)
    same = torch.equal(ids, ids_hf) and torch.equal(d, d_hf)
    print(f"image case: position_ids and rope_deltas identical to transformers: {same}")
    if not same:
        raise SystemExit("outputs differ")
    for c in cases.values():
        run_hf(*c), run_vlpe(*c)

    best = {(name, who): float("inf") for name in cases for who in ("hf", "vlpe")}
    for _ in range(args.rounds):
        for name, c in cases.items():
            for who, fn in (("hf", run_hf), ("vlpe", run_vlpe)):
                t0 = time.perf_counter()
                fn(*c)
                best[name, who] = min(best[name, who], time.perf_counter() - t0)

    print(f"\n{'case':34s} {'L':>6s} {'transformers ms':>16s} {'vlpe ms':>9s} {'speed-up':>9s}")
    for name, c in cases.items():
        hf, ours = best[name, "hf"] * 1e3, best[name, "vlpe"] * 1e3
        print(f"{name:34s} {c[0].shape[1]:6d} {hf:16.2f} {ours:9.2f} {hf / ours:8.1f}x")


if __name__ == "__main__":
    main()
