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

import errno
import json
import math
import os
import pickle
import shutil
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
    "world_problem",
    "save_rng",
    "is_disk_full",
    "disk_full_message",
    "check_loaded_objects",
    "load_rng",
    "safe_load",
    "SafeCheckpointEngine",
    "model_signature",
    "signature_differences",
    "check_signature",
    "read_signature",
    "exported_signature",
    "check_export",
    "sign_export",
]

MARKER = "COMPLETE"
SIGNATURE = "model.json"  # the run's model signature, beside the DeepSpeed files of a checkpoint
METADATA_KEY = "vlpe.model"  # the same signature in the safetensors export's metadata
_TAG = re.compile(r"^step_(\d{8})$")
_RNG = re.compile(r"^rng_rank(\d+)\.pt$")  # one per rank that wrote the checkpoint (save_rng)
_ZERO = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")  # DeepSpeed's, one per DP rank


class CheckpointError(ValueError):
    """A checkpoint that cannot or must not be loaded; the message names the file and what to do."""


_DISK_FULL_TEXT = ("file write failed", "No space left on device", "Disk quota exceeded", "inline_container.cc")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a write that failed for want of space: ``OSError`` ENOSPC / EDQUOT, or torch's
    ``RuntimeError`` from its archive writer (``[enforce fail at inline_container.cc:...] ... file write failed``),
    which carries no errno."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and any(t in str(error) for t in _DISK_FULL_TEXT)


def _mount_of(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def disk_full_message(path: str | Path, *, action: str) -> str:
    """``"writing <path> failed: the disk mounted at <mount> is full (<free> MiB free of <total> MiB) ..."``: the
    path, the mount point that holds it and its free space (``shutil.disk_usage``), and what to do."""
    path = Path(path)
    mount = _mount_of(path)
    try:
        usage = shutil.disk_usage(mount)
        space = f" ({usage.free / 2**20:.0f} MiB free of {usage.total / 2**20:.0f} MiB)"
    except OSError:
        space = ""
    return (
        f"{action} {path} failed: the disk mounted at {mount} is full{space}. Free space on it or set "
        f"train.out_dir to a folder on another disk"
    )


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


def _ranks(path: Path, pattern: re.Pattern) -> set[int]:
    """The ranks named by the files of ``path`` that match ``pattern`` (its first group)."""
    return {int(m.group(1)) for f in path.iterdir() if (m := pattern.match(f.name))} if path.is_dir() else set()


def world_problem(path: str | Path, *, world: int) -> str | None:
    """Why ``world`` processes cannot resume the checkpoint directory ``path`` that another number of ranks wrote,
    or None.

    A checkpoint whose optimizer state DeepSpeed split into ZeRO partitions (stages 1 to 3, or its bf16 optimizer:
    ``*zero_pp_rank_<r>_mp_rank_XX_optim_states.pt``, one per rank) loads only into as many processes as wrote it;
    DeepSpeed has no way to split the partitions again (its universal checkpoints, which do, are refused by this
    harness). The ranks that wrote it are those of its RNG files (``rng_rank<r>.pt``), which must be the ranks of its
    partitions (else the checkpoint is damaged: :func:`checkpoint_problem` says so). Without ZeRO partitions
    (stage 0) any number of processes loads the checkpoint, so None. Reads file names only.

    Args:
        path: a checkpoint directory (``<out_dir>/checkpoints/step_XXXXXXXX``).
        world: the number of processes of the run that would resume it.

    Returns:
        The reason naming both numbers of processes and what to do, or None.
    """
    path = Path(path)
    written, partitions = _ranks(path, _RNG), _ranks(path, _ZERO)
    n = len(written)
    if not partitions or partitions != written or written != set(range(n)) or n == world:
        return None
    return (
        f"{path} was written by {n} rank{'s' if n != 1 else ''} (its optimizer state is split into {n} ZeRO "
        f"partitions, one per rank) and this run has {world} process{'es' if world != 1 else ''}; DeepSpeed loads "
        f"ZeRO partitions only into as many processes as wrote them: resume with {n} process{'es' if n != 1 else ''} "
        f"({'deepspeed --num_gpus ' + str(n) + ' ...' if n > 1 else 'one process'}), or start a new run in another "
        "train.out_dir"
    )


def checkpoint_problem(path: str | Path, *, world: int) -> str | None:
    """Why the checkpoint directory ``path`` cannot be resumed by ``world`` ranks, or None when it looks whole.

    Cheap (no tensor is read): the ``COMPLETE`` marker, a model-states file, ``rng_rank{r}.pt`` for every
    rank, DeepSpeed's ZeRO optimizer partitions (when it holds any) of the ranks of its RNG files, and every file under
    ``path``, sub-folders included: a link is refused (it could point anywhere), a
    ``.pt`` file (or any other torch archive) must have a readable index (a truncated file has none), and no
    archive may name a Python global outside what :func:`safe_load` admits (read from its pickle opcodes by
    ``torch.serialization.get_unsafe_globals_in_checkpoint``, nothing in it runs).
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return f"{path} has no {MARKER} marker (it was never finished)"
    if not any(path.glob("*model_states.pt")):
        return f"{path} holds no *model_states.pt file"
    for r in range(world):
        if not (path / f"rng_rank{r}.pt").is_file():
            return f"{path} lacks rng_rank{r}.pt (the RNG state of rank {r}; was it written by fewer ranks?)"
    partitions, written = _ranks(path, _ZERO), _ranks(path, _RNG)
    if partitions and partitions != written:
        return (
            f"{path} holds the ZeRO optimizer partitions of ranks {sorted(partitions)} but the RNG states of ranks "
            f"{sorted(written)}: a file is missing or extra (every rank that writes a checkpoint writes both)"
        )
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _allowed_globals()}
    for f in sorted(path.rglob("*")):
        name = f.relative_to(path).as_posix()
        if f.is_symlink():
            return f"{name} in {path} is a link, which the checkpoints this harness writes never hold"
        if f.is_dir():
            continue
        if f.suffix != ".pt" and not zipfile.is_zipfile(f):
            continue
        try:
            with zipfile.ZipFile(f) as z:
                z.namelist()
            unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f))) - allowed)
        except Exception as e:  # noqa: BLE001 - zipfile / torch raise several kinds for a damaged archive
            return f"{name} in {path} is truncated or damaged ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if unsafe:
            return (
                f"refusing to load {name} in {path}: it holds pickled objects ({', '.join(unsafe[:4])}) that this "
                f"harness's checkpoints never contain, and unpickling them could run arbitrary code"
            )
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


_UNSUPPORTED_GLOBAL = re.compile(r"unsupported\s+(?:global:?\s*)?GLOBAL\s+([\w.]+)", re.IGNORECASE)


def _torch_detail(detail: str) -> str:
    """torch's reason for refusing a file, without its advice to re-run ``torch.load`` with ``weights_only=False``
    (which would run whatever the file holds): the lines that do not mention ``weights_only``, in one line."""
    kept = [ln.strip() for ln in detail.splitlines() if ln.strip() and "weights_only" not in ln.lower()
            and "weights only" not in ln.lower()]  # fmt: skip
    return " ".join(kept)[:300] or "it needs objects the weights_only loader does not build"


def safe_load(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's plain-data classes allowed, and every loaded
    instance of those classes checked against a freshly built one (:func:`check_loaded_objects`).

    A file that needs any other object to unpickle is refused (nothing in it runs); an unreadable file
    (truncated, damaged) is reported. Both raise :class:`CheckpointError` naming the file; no message advises
    loading with ``weights_only=False``.
    """
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            loaded = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e)
        found = _UNSUPPORTED_GLOBAL.search(detail)
        if found or "weights only load failed" in detail.lower() or "WeightsUnpickler" in detail:
            what = f" ({found.group(1)})" if found else f" ({_torch_detail(detail)})"
            raise CheckpointError(
                f"refusing to load {path}: it holds a pickled object{what} that vlpe's checkpoints never contain, "
                f"and unpickling it could run arbitrary code; vlpe reads checkpoints with weights_only=True only. "
                f"Resume from a checkpoint this harness wrote, or delete this one"
            ) from None
        raise CheckpointError(f"cannot read {path}: {_torch_detail(detail)}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}, it is truncated or damaged: {_torch_detail(str(e) or repr(e))}") from None
    check_loaded_objects(loaded, where=str(path))
    return loaded


def _reference_instances() -> dict[type, Any]:
    """One default-built instance of each allowed class that unpickles by filling its ``__dict__``: what a
    loaded instance is checked against (its fields and their types follow the installed DeepSpeed)."""
    refs: dict[type, Any] = {}
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        refs[LossScaler] = LossScaler()
        refs[DynamicLossScaler] = DynamicLossScaler(2.0**16, 1000, 1, 2, False)
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        refs[fragment_address] = fragment_address(numel=0, start=0)
    except ImportError:
        pass
    return refs


#: fields of a loss scaler that must be > 0 (a scale of 0, a negative or a non-finite one corrupts every step)
_POSITIVE = frozenset({"cur_scale", "min_scale", "scale_factor", "scale_window"})
#: fields that must be >= 0
_NON_NEGATIVE = frozenset({"numel", "start", "cur_iter", "delayed_shift", "cur_hysteresis"})
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _field_problem(name: str, value: Any, ref: Any) -> str | None:
    if isinstance(ref, bool):
        return None if isinstance(value, bool) else "expected true/false"
    if isinstance(ref, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number like {ref!r}"
        if isinstance(ref, int) and not isinstance(ref, bool) and isinstance(value, float) and name in _NON_NEGATIVE:
            return "expected an integer"
        if not math.isfinite(value):
            return "expected a finite number"
        if name in _POSITIVE and value <= 0:
            return "expected a number > 0"
        if name in _NON_NEGATIVE and value < 0:
            return "expected a number >= 0"
        return None
    if isinstance(ref, torch.dtype):
        return None if value in _DTYPES else f"expected one of {[str(d) for d in _DTYPES]}"
    if ref is None:
        return None if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                         and math.isfinite(value)) else "expected null or a number"  # fmt: skip
    return None if type(value) is type(ref) else f"expected {type(ref).__name__}"


def check_loaded_objects(obj: Any, *, where: str) -> None:
    """:class:`CheckpointError` when an instance of an allowed class inside ``obj`` (a loaded checkpoint: dicts,
    lists, tuples of plain values) differs from a default-built one of its class (:func:`_reference_instances`):
    a field the class never sets (e.g. a method replaced by another allowed callable), or a value of the wrong
    type or out of range (a loss scale of NaN, 0 or below)."""
    refs = _reference_instances()
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (torch.Tensor, str, bytes, int, float, type(None))):
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif type(item) in refs:
            ref = vars(refs[type(item)])
            fields = vars(item)
            cls = type(item).__name__
            stray = sorted(set(fields) - set(ref))
            if stray:
                raise CheckpointError(
                    f"refusing to load {where}: its {cls} carries field(s) {stray} that {cls} never sets (expected "
                    f"only {sorted(ref)}); the file was altered. Resume from a checkpoint this harness wrote"
                )
            for name, value in fields.items():
                problem = _field_problem(name, value, ref[name])
                if problem:
                    raise CheckpointError(
                        f"refusing to load {where}: its {cls}.{name}={value!r} is invalid ({problem}); the file was "
                        f"altered or the run diverged. Resume from an earlier checkpoint"
                    )


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

#: per script, the ``data:`` keys that shape the model's weights: ``models.vit.vit_from_config`` builds the ViT with
#: ``img_size=data.img_size`` (the patch grid: the size of absolute position tables) and
#: ``in_chans=data.channels`` (the patch embedding's input channels)
WEIGHTS_DEPEND_ON = {"vit": ("img_size", "channels")}


def model_signature(run_config: dict) -> dict:
    """What defines a run's model: every section of its config but data/train/deepspeed (the ``model``
    section, the script, and what the script records, e.g. ``num_classes``), plus the ``data:`` keys its weights
    depend on (:data:`WEIGHTS_DEPEND_ON`), as plain JSON values. A signature given back is returned as it is."""
    out = {k: v for k, v in run_config.items() if k not in _NOT_MODEL}
    data = run_config.get("data")
    keys = WEIGHTS_DEPEND_ON.get(run_config.get("script"), ())  # type: ignore[arg-type]
    if isinstance(data, dict) and keys:
        out["data"] = {k: data.get(k) for k in keys}
    return json.loads(json.dumps(out, sort_keys=True))


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
    if "data" not in model_signature(recorded):  # recorded before the data keys were: not comparable
        b = {k: v for k, v in b.items() if not k.startswith("data.")}
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


def read_signature(path: str | Path) -> dict:
    """The model signature in ``path`` (a checkpoint's ``model.json``): :class:`CheckpointError` naming the file when
    it cannot be read, is not JSON or is not a mapping (what :func:`model_signature` gives and ``save_checkpoint``
    writes)."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(
            f"cannot read the model signature {path}: {e}; restore it from the run that wrote it"
        ) from None
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{path} must hold a JSON mapping (a run's model signature), got {type(saved).__name__}; restore it from "
            f"the run that wrote it"
        )
    return saved


def _json_kind(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def exported_signature(weights: str | Path) -> dict | None:
    """The model signature in a safetensors export's metadata (the JSON mapping under ``vlpe.model`` that
    ``train.engine.fit`` writes), None for an export without one; :class:`CheckpointError` naming the file when
    the header cannot be read or the entry is not a JSON mapping."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file ({e}): it is damaged or not the export a training run "
            f"wrote; restore it from the run"
        ) from None
    raw = meta.get(METADATA_KEY)
    if raw is None:
        return None
    fix = "the file was altered; restore the export the training run wrote"
    try:
        recorded = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(
            f"{weights}: its '{METADATA_KEY}' metadata is not JSON ({e}); expected the run's model signature as a "
            f"JSON mapping: {fix}"
        ) from None
    if not isinstance(recorded, dict):
        raise CheckpointError(
            f"{weights}: its '{METADATA_KEY}' metadata is a JSON {_json_kind(recorded)}, expected the run's model "
            f"signature as a JSON mapping: {fix}"
        )
    return recorded


def _signing_evidence(run_dir: Path) -> tuple[Path | None, Path | None]:
    """(the newest checkpoint signature ``checkpoints/step_*/model.json``, the lock file) found in ``run_dir``:
    files only a harness that signs its exports writes (signatures of checkpoints and of exports came in the same
    version, the run lock later)."""
    from .lock import LOCK_FILE

    ckpt_dir = run_dir / "checkpoints"
    signed = sorted(ckpt_dir.glob("step_*/" + SIGNATURE), key=lambda p: p.parent.name, reverse=True)
    lock = run_dir / LOCK_FILE
    return (signed[0] if signed else None), (lock if lock.is_file() else None)


def check_export(weights: str | Path, config: dict, *, config_path: str | Path) -> None:
    """:class:`CheckpointError` when the model signature recorded in the safetensors export ``weights``
    (:func:`exported_signature`) differs from the one of the run config ``config`` (read from ``config_path``).

    An export without a signature is refused when its folder shows it was written by a harness that signs
    exports (a checkpoint's ``model.json`` or the run lock, :func:`_signing_evidence`): its metadata was removed,
    so nothing ties it to ``config_path`` (the message lists how ``config`` differs from the checkpoint's
    signature, and how to sign the export again with :func:`sign_export`). An export whose folder holds neither
    predates signatures: it loads, with a warning that ``config_path`` is not checked against it.
    """
    weights, config_path = Path(weights), Path(config_path)
    recorded = exported_signature(weights)
    if recorded is not None:
        fix = f"restore {config_path} to the config the run was trained with"
        check_signature(recorded, config, where=str(weights), fix=fix)
        return
    signed, lock = _signing_evidence(weights.parent)
    source = signed if signed is not None else config_path
    sign = f"python -c \"from train.checkpoint import sign_export; sign_export('{weights}', signature='{source}')\""
    if signed is None and lock is None:
        import warnings

        warnings.warn(
            f"{weights} records no model signature (an export from before vlpe signed its exports: its folder holds "
            f"no signed checkpoint and no run lock), so {config_path} is not checked against it; once you are sure "
            f"it is the config these weights were trained with, sign the export: {sign}",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    diffs = ""
    if signed is not None:
        found = signature_differences(read_signature(signed), config)
        if found:
            diffs = f"; and {config_path.name} differs from the signature {signed} records: " + "; ".join(found[:8])
    raise CheckpointError(
        f"{weights} carries no model signature ('{METADATA_KEY}' in its safetensors metadata), but its folder was "
        f"written by a training run that signs its export ({signed if signed is not None else lock}): the "
        f"signature was removed (e.g. the file re-saved by a tool that drops metadata), so nothing ties these weights "
        f"to {config_path}{diffs}. Restore the model.safetensors the run wrote; or, if these are the run's weights "
        f"and {config_path.name} the config they were trained with, sign them again: {sign}"
    )


def sign_export(weights: str | Path, *, signature: dict | str | Path) -> None:
    """Write ``signature`` into the safetensors export ``weights`` as its ``vlpe.model`` metadata (the tensors and
    any other metadata unchanged; replaced atomically), so :func:`check_export` checks run configs against it.

    ``signature``: a model signature mapping, a ``model.json`` of one of the run's checkpoints
    (:func:`read_signature`), or the run's ``config.yaml`` (its :func:`model_signature`).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    weights = Path(weights)
    if isinstance(signature, (str, Path)):
        src = Path(signature)
        if src.suffix in (".yaml", ".yml"):
            import yaml

            config = yaml.safe_load(src.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise CheckpointError(f"{src} must be a run's config.yaml (a mapping), got {type(config).__name__}")
            signature = model_signature(config)
        else:
            signature = read_signature(src)
    if not isinstance(signature, dict):
        raise CheckpointError(f"signature must be a mapping, a model.json or a config.yaml, got {signature!r}")
    exported_signature(weights)  # a readable header first
    with safe_open(str(weights), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta[METADATA_KEY] = json.dumps(model_signature(signature), sort_keys=True)
    tmp = weights.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(weights)
