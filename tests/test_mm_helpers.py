"""Shared helpers of the multimodal RoPE tests (no tests here).

Token sequences, tiny randomly initialised transformers models, and a loop of the released semantics.
"""

from __future__ import annotations

import functools

import torch

MERGE = 2


def tokens(*parts):
    """One sample: ints are text runs; ``("img"|"vid", (T, H, W))`` are vision blocks (grid in patches).

    Returns ``(types list, grids list)``; ``("ts", k)`` adds k timestamp text tokens (Qwen3-VL), and
    ``("frames", (T, H, W), ts)`` a Qwen3-VL video: per frame ``ts`` text tokens, <vs>, frame, <ve>.
    """
    types, grids = [], []
    for p in parts:
        if isinstance(p, int):
            types += [0] * p
        elif p[0] in ("img", "vid"):
            T, H, W = p[1]
            types += [1 if p[0] == "img" else 2] * (T * (H // MERGE) * (W // MERGE))
            grids.append(tuple(p[1]))
        elif p[0] == "frames":
            T, H, W = p[1]
            for _ in range(T):
                types += [0] * p[2] + [0] + [2] * ((H // MERGE) * (W // MERGE)) + [0]
            grids.append(tuple(p[1]))
        else:
            raise ValueError(p)
    return types, grids


def batch(samples, *, pad="left"):
    """Stack samples (from :func:`tokens`) with padding; returns ``(types (B, S), mask (B, S), grid (R, 3))``."""
    S = max(len(t) for t, _ in samples)
    B = len(samples)
    types = torch.zeros(B, S, dtype=torch.int64)
    mask = torch.zeros(B, S, dtype=torch.int64)
    grids = []
    for b, (t, g) in enumerate(samples):
        sl = slice(S - len(t), S) if pad == "left" else slice(0, len(t))
        types[b, sl] = torch.tensor(t, dtype=torch.int64)
        mask[b, sl] = 1
        grids += g
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return types, mask, grid


@functools.lru_cache(maxsize=None)
def tiny_qwen2vl():
    """A randomly initialised 161K-parameter transformers Qwen2-VL (no weights downloaded)."""
    from transformers import Qwen2VLConfig, Qwen2VLModel

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=14,
                           spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=999, video_token_id=998, vision_start_token_id=997,
    )
    return Qwen2VLModel(cfg).eval()


@functools.lru_cache(maxsize=None)
def tiny_qwen3vl():
    """A randomly initialised tiny transformers Qwen3-VL (interleaved MRoPE [4, 2, 2], head_dim 16)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=64, head_dim=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                          "rope_theta": 5e6}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=4, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0], patch_size=16,
                           spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=999, video_token_id=998, vision_start_token_id=997,
    )
    return Qwen3VLModel(cfg).eval()


def released_mrope_loop(types, mask, grid, *, second_per_grid_ts=None, tokens_per_second=2):
    """Slow reference of the released (transformers 4.x) Qwen2-VL / Qwen2.5-VL ``get_rope_index`` semantics.

    Per sample, over the real tokens: text gets the running position on all three axes; a vision block of
    merged grid (T, H, W) starting at s gets (s + t(tau), s + i, s + j) with t(tau) = tau (Qwen2-VL) or
    floor(tau * second_per_grid_t * tokens_per_second) for videos (Qwen2.5-VL), and the next text resumes at
    the maximum over all axes + 1. Padding gets 1; delta = next position - number of real tokens.
    """
    B, S = types.shape
    ids = torch.ones(3, B, S, dtype=torch.int64)
    deltas = torch.zeros(B, 1, dtype=torch.int64)
    rows = iter(grid.tolist())
    videos = iter([] if second_per_grid_ts is None else list(second_per_grid_ts))
    for b in range(B):
        real = [n for n in range(S) if mask[b, n]]
        seq = [int(types[b, n]) for n in real]
        out, nxt, n = [], 0, 0
        while n < len(seq):
            if seq[n] == 0:
                out.append((nxt, nxt, nxt))
                nxt, n = nxt + 1, n + 1
                continue
            kind = seq[n]
            T, H, W = next(rows)
            H, W = H // MERGE, W // MERGE
            spg = (next(videos) if second_per_grid_ts is not None else 1.0) if kind == 2 else 0.0
            block = []
            for tau in range(T):
                t = int(tau * spg * tokens_per_second) if second_per_grid_ts is not None else tau
                for i in range(H):
                    for j in range(W):
                        block.append((nxt + t, nxt + i, nxt + j))
            out += block
            nxt = max(max(p) for p in block) + 1
            n += T * H * W
        for k, n_ in enumerate(real):
            ids[:, b, n_] = torch.tensor(out[k])
        deltas[b, 0] = nxt - len(real)
    return ids, deltas
