"""Checkpoint discovery and the "complete" marker that makes a half-written checkpoint invisible.

A checkpoint is a directory ``<out>/checkpoints/step_00000042/`` written by DeepSpeed's
``save_checkpoint`` plus per-rank RNG states and the run's model signature (``model.json``); rank 0 writes
``COMPLETE`` last, after every rank has finished writing. ``latest_complete`` only ever returns directories
with that marker, so a run killed in the middle of saving resumes from the previous checkpoint.

Loading never unpickles arbitrary objects: every file is read with ``torch.load(weights_only=True)``
(:func:`safe_load`), which admits tensors, containers and plain values plus an allow-list of DeepSpeed's
plain-data classes (its loss scalers, ZeRO stage enum and fragment addresses). :class:`SafeCheckpointEngine` puts that
loader under DeepSpeed's ``load_checkpoint``; anything else is refused with a :class:`CheckpointError`.
:func:`checkpoint_problem` checks a checkpoint before it is loaded (marker, model states, one RNG file per
rank, every file a readable archive), so a damaged newest checkpoint can be skipped for the previous one.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MARKER",
    "SIGNATURE",
    "CheckpointError",
    "tag_for",
    "step_of",
    "latest_complete",
    "complete_tags",
    "checkpoint_problem",
    "save_rng",
    "load_rng",
    "safe_load",
    "SafeCheckpointEngine",
    "model_signature",
    "signature_differences",
    "check_signature",
    "exported_signature",
    "check_export",
]

MARKER = "COMPLETE"
SIGNATURE = "model.json"  # the run's model signature, beside the DeepSpeed files of a checkpoint
METADATA_KEY = "vlpe.model"  # the same signature in the safetensors export's metadata
_TAG = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot or must not be loaded; the message names the file and what to do."""


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a checkpoint tag (step_XXXXXXXX)")
    return int(m.group(1))


def complete_tags(ckpt_dir: str | Path) -> list[str]:
    """Tags of the checkpoints whose ``COMPLETE`` marker exists, newest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and _TAG.match(p.name) and (p / MARKER).is_file()]
    return sorted(tags, key=step_of, reverse=True)


def latest_complete(ckpt_dir: str | Path) -> str | None:
    """Tag of the newest checkpoint whose ``COMPLETE`` marker exists, or None."""
    tags = complete_tags(ckpt_dir)
    return tags[0] if tags else None


def checkpoint_problem(path: str | Path, *, world: int) -> str | None:
    """Why the checkpoint directory ``path`` cannot be resumed by ``world`` ranks, or None when it looks whole.

    Cheap (no tensor is read): the ``COMPLETE`` marker, a model-states file, ``rng_rank{r}.pt`` for every
    rank, and every ``.pt`` file a torch archive whose index is readable (a truncated file has none).
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return f"{path} has no {MARKER} marker (it was never finished)"
    if not any(path.glob("*model_states.pt")):
        return f"{path} holds no *model_states.pt file"
    for r in range(world):
        if not (path / f"rng_rank{r}.pt").is_file():
            return f"{path} lacks rng_rank{r}.pt (the RNG state of rank {r}; was it written by fewer ranks?)"
    for f in sorted(path.glob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f.name} in {path} is truncated or damaged ({e})"
    return None


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

    state = safe_load(path)
    torch.set_rng_state(state["torch"])
    keys = np.frombuffer(state["numpy"].numpy().tobytes(), dtype=np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), 0, 0.0))
    py = tuple(int(v) for v in state["python"].tolist())
    random.setstate((3, py, None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------- loading without unpickling
def _allowed_globals() -> list:
    """DeepSpeed's plain-data classes found in its own checkpoints (ZeRO optimizer states: the loss scaler,
    the ZeRO stage enum, fragment addresses of the flat partitions)."""
    allowed: list = []
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        allowed.append(ZeroStageEnum)
    except ImportError:
        pass
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        allowed += [LossScaler, DynamicLossScaler]
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        allowed.append(fragment_address)
    except ImportError:
        pass
    return allowed


def safe_load(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's plain-data classes allowed.

    A file that needs any other object to unpickle is refused (nothing in it runs); an unreadable file
    (truncated, damaged) is reported. Both raise :class:`CheckpointError` naming the file.
    """
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e)
        if "Unsupported" in detail or "WeightsUnpickler" in detail:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", detail)
            what = f" ({found.group(1)})" if found else ""
            raise CheckpointError(
                f"refusing to load {path}: it holds a pickled object{what} that vlpe's checkpoints never contain, "
                f"and unpickling it could run arbitrary code; vlpe reads checkpoints with weights_only=True. "
                f"Resume from a checkpoint this harness wrote, or delete this one"
            ) from None
        raise CheckpointError(f"cannot read {path}: {detail.splitlines()[0] if detail else e!r}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else repr(e)
        raise CheckpointError(f"cannot read {path}, it is truncated or damaged: {first}") from None


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with :func:`safe_load` as its ``load`` (saving is unchanged).

    Installed by ``train.engine.fit`` right after ``deepspeed.initialize``, so ``engine.load_checkpoint``
    never calls ``torch.load(weights_only=False)``.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_load(path, map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# --------------------------------------------------------------------------- what the model is
_NOT_MODEL = ("data", "train", "deepspeed")


def model_signature(run_config: dict) -> dict:
    """What defines a run's model: every section of its config but data/train/deepspeed (the ``model``
    section, the script, and what the script records, e.g. ``num_classes``), as plain JSON values."""
    return json.loads(json.dumps({k: v for k, v in run_config.items() if k not in _NOT_MODEL}, sort_keys=True))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def signature_differences(recorded: dict, now: dict) -> list[str]:
    """``["model.encoding: 'rope' (recorded) vs 'lookhere' (now)", ...]`` for every key that differs."""
    a, b = _flat(model_signature(recorded)), _flat(model_signature(now))
    missing = object()
    return [
        f"{k}: {a.get(k, '<absent>')!r} (recorded) vs {b.get(k, '<absent>')!r} (now)"
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    ]


def check_signature(recorded: dict, now: dict, *, where: str, fix: str) -> None:
    """:class:`CheckpointError` listing every difference between the ``recorded`` and the ``now`` model."""
    diffs = signature_differences(recorded, now)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise CheckpointError(f"{where} was made by a different model: {shown}. {fix}")


def exported_signature(weights: str | Path) -> dict | None:
    """The model signature in a safetensors export's metadata (None for exports without one)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata() or {}
    raw = meta.get(METADATA_KEY)
    return None if raw is None else json.loads(raw)


def check_export(weights: str | Path, config: dict, *, config_path: str | Path) -> None:
    """:class:`CheckpointError` when the model signature recorded in the safetensors export ``weights``
    differs from the one of the run config ``config`` (read from ``config_path``); exports from before
    signatures were recorded are not checked."""
    recorded = exported_signature(weights)
    if recorded is not None:
        fix = f"restore {config_path} to the config the run was trained with"
        check_signature(recorded, config, where=str(weights), fix=fix)
