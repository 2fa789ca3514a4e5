"""A small, learnable instruction set in the LLaVA format of :mod:`data.instruct.annotations`: V-NIAH needle
videos written as real mp4 files, plus needle images.

Each video is a :class:`data.vniah.VNIAH` sample (a haystack of ``frames`` frames, one of which carries one of the
eight scikit-image photos drawn in red; :data:`data.vniah.PHOTO_NEEDLES`) written with
:func:`data.vniah.write_sample` (lossless H.264, timestamps ``frame / fps``: the decoded pixels are the frames, so
the set is the same every time it is made, which a lossy encode was not); every ``image_every``-th sample is instead the
needle frame alone, saved as a PNG image. The question is :data:`data.vniah.QUESTIONS` ``["needle"]`` ("What item
is shown in red?") and the answer the needle's one-word class, so chance is 1/8. Video samples write the
``<video>`` placeholder, except every fourth, which writes ``<image>`` as LLaVA-Video-178K does for videos;
image samples write ``<image>``. ``train.json`` is a JSON list and ``val.json`` JSONL (both formats are read by
:func:`data.instruct.read_annotations`); media lie under ``media/``. Samples depend only on ``seed``: train and
val draw disjoint V-NIAH indices from one permutation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["make_vniah_instruct"]


def _positive_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def make_vniah_instruct(
    folder: str | os.PathLike,
    *,
    train: int = 192,
    val: int = 32,
    frames: int = 8,
    frame_size: int = 56,
    fps: float = 2.0,
    seed: int = 0,
    image_every: int = 8,
    haystack: str = "procedural",
) -> dict:
    """Write the set (see the module docstring) under ``folder``; returns ``{"train": path, "val": path,
    "media_root": path, "answers": [the 8 classes], "question": text}`` (paths as strings).

    ``train`` / ``val``: sample counts; ``frames``, ``frame_size`` (even; square frames), ``fps``: the videos;
    ``image_every``: one image sample per this many samples (0: videos only); ``haystack``: ``"procedural"``
    (moving sprites; fast) or ``"real"`` (the shipped real clips; decoding them adds a few seconds), see
    :class:`data.vniah.VNIAH`.
    """
    from PIL import Image

    from data.vniah import QUESTIONS, VNIAH, write_sample

    train, val = _positive_int("train", train, 1), _positive_int("val", val, 1)
    frames = _positive_int("frames", frames, 2)
    frame_size = _positive_int("frame_size", frame_size, 2)
    if frame_size % 2:
        raise ValueError(f"frame_size must be even (H.264 yuv420p), got {frame_size}")
    image_every = _positive_int("image_every", image_every, 0)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not np.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number, got {fps!r}")
    folder = Path(folder)
    media = folder / "media"
    media.mkdir(parents=True, exist_ok=True)
    total = train + val
    depths = np.linspace(0.0, 1.0, min(frames, 8)).tolist()
    task = VNIAH(lengths=[frames], depths=depths, samples_per_cell=-(-total // len(depths)), size=frame_size,
                 haystack=haystack, needles="photos", fps=float(fps), seed=seed)  # fmt: skip
    order = np.random.default_rng(seed).permutation(len(task))[:total]  # disjoint indices for train and val
    question = QUESTIONS["needle"]
    samples = []
    for i, index in enumerate(order.tolist()):
        s = task[index]
        sample_id = f"vniah_{i:05d}"
        if image_every and i % image_every == image_every - 1:
            rel = f"{sample_id}.png"
            Image.fromarray(s["frames"][s["needle_index"]].numpy()).save(media / rel)  # (H, W, 3) uint8
            kind, placeholder = "image", "<image>"
        else:
            rel = f"{sample_id}.mp4"
            write_sample(s, media / rel, lossless=True)
            kind, placeholder = "video", "<image>" if i % 4 == 1 else "<video>"
        samples.append({
            "id": sample_id, kind: rel,
            "conversations": [{"from": "human", "value": f"{placeholder}\n{question}"},
                              {"from": "gpt", "value": s["answer"]}],
            "needle_index": int(s["needle_index"]), "depth": float(s["depth"]),
        })  # fmt: skip
    train_path, val_path = folder / "train.json", folder / "val.json"
    train_path.write_text(json.dumps(samples[:train], indent=1) + "\n", encoding="utf-8")
    val_path.write_text("".join(json.dumps(s) + "\n" for s in samples[train:]), encoding="utf-8")
    return {"train": str(train_path), "val": str(val_path), "media_root": str(media),
            "answers": list(task.answers), "question": question}  # fmt: skip
