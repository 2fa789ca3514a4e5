"""Checkpoint discovery and the "complete" marker that makes a half-written checkpoint invisible.

A checkpoint is a directory ``<out>/checkpoints/step_00000042/`` written by DeepSpeed's
``save_checkpoint`` plus per-rank RNG states; rank 0 writes ``COMPLETE`` last, after every rank has
finished writing. ``latest_complete`` only ever returns directories with that marker, so a run killed in
the middle of saving resumes from the previous checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

__all__ = ["MARKER", "tag_for", "step_of", "latest_complete", "save_rng", "load_rng"]

MARKER = "COMPLETE"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a checkpoint tag (step_XXXXXXXX)")
    return int(m.group(1))


def latest_complete(ckpt_dir: str | Path) -> str | None:
    """Tag of the newest checkpoint whose ``COMPLETE`` marker exists, or None."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG.match(p.name) and (p / MARKER).is_file()]
    return max(tags, key=step_of) if tags else None


def save_rng(path: Path) -> None:
    import random

    import numpy as np

    state = {
        "torch": torch.get_rng_state(),
        "numpy": torch.as_tensor(np.frombuffer(np.random.get_state()[1].tobytes(), dtype=np.uint8).copy()),
        "numpy_pos": torch.tensor(np.random.get_state()[2]),
        "python": torch.tensor(list(random.getstate()[1]), dtype=torch.int64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, path)


def load_rng(path: Path) -> None:
    import random

    import numpy as np

    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch"])
    keys = np.frombuffer(state["numpy"].numpy().tobytes(), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), 0, 0.0))
    py = tuple(int(v) for v in state["python"].tolist())
    random.setstate((3, py, None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
