"""What a training run is launched with: the ``train:`` section, the process group, the DeepSpeed config.

* :class:`TrainSection`: the ``train:`` section of every config (steps, batch, optimiser, precision,
  ZeRO stage, validation/checkpoint cadence, resume);
* :func:`setup_distributed`: the process group under the ``deepspeed`` launcher or in one plain process
  (the rank variables filled in here); gloo on CPU, NCCL on GPU; the names of DeepSpeed's shared-memory segments
  removed once every rank has mapped them (:func:`release_shared_memory_names`);
* :func:`deepspeed_config`: the DeepSpeed config dict from that section plus the YAML ``deepspeed:``
  overrides, with the batch-size identity checked up front and explained in one line, and every key checked
  against what the installed DeepSpeed reads (a typo is an error with a suggestion), an offload the ZeRO stage does
  not do refused (:func:`offload_devices`) and a monitor whose package is missing named with its install command;
* :func:`check_out_dir`, :func:`seed_everything`.
"""

from __future__ import annotations

import errno
import math
import os
import random
import tempfile
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from .config import ConfigError, _suggest

__all__ = ["TrainSection", "setup_distributed", "release_shared_memory_names", "deepspeed_config", "offload_devices",
           "check_out_dir", "seed_everything"]


@dataclass(kw_only=True)
class TrainSection:
    """The ``train:`` section common to every training script."""

    steps: int = 200
    micro_batch: int = 32  # per rank
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 10
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    zero_stage: int = 0
    val_every: int = 50
    val_batches: int = 20  # per rank, per validation
    ckpt_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    out_dir: str = "runs/default"
    resume: str = "none"  # "none" | "auto" (latest complete checkpoint) | a checkpoint directory
    num_workers: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch", "grad_accum", "val_every", "val_batches", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.out_dir.strip():
            raise ConfigError("train.out_dir must name a directory for the run's outputs, got an empty string")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"train.{name} must be a finite number, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0 (the peak learning rate of the cosine schedule), got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(
                f"train.min_lr must lie in [0, train.lr={self.lr}] (the floor the cosine schedule decays to), "
                f"got {self.min_lr}"
            )
        for name in ("warmup_steps", "weight_decay", "keep_checkpoints", "num_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_clip < 0:
            raise ConfigError(
                f"train.grad_clip must be >= 0 (the maximum gradient norm; 0 turns clipping off), got {self.grad_clip}"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> tuple[int, int, torch.device]:
    """Initialise the process group (launcher or single process); returns (rank, world, device)."""
    import deepspeed

    if "WORLD_SIZE" not in os.environ:  # plain `python train/X.py`: a one-process group
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
        release_shared_memory_names(dist.get_rank(), dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


#: the POSIX shared-memory segment of one rank of DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp:
#: "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>", about 66 MB)
SHM_SEGMENT = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
SHM_FOLDER = Path("/dev/shm")


def release_shared_memory_names(rank: int, world: int) -> None:
    """Remove the name of this rank's DeepSpeed shared-memory segment once every rank has mapped every segment.

    DeepSpeed's CPU all-reduce creates one segment per rank when the process group starts and maps the segments of
    all ranks before ``init_distributed`` returns, but never unlinks them: every launch (one process included) left
    about 66 MB per rank in ``/dev/shm``, that is in RAM, until the machine restarted, and a development machine ran
    out of memory after a few hundred launches. After a barrier (every rank has returned from its initialisation)
    each rank unlinks its own name; the mappings stay valid and the memory is freed when the last rank exits. A name
    that is not there (no shm op: GPU, another OS, another DeepSpeed) is left alone."""
    if world > 1:
        dist.barrier()
    name = SHM_SEGMENT.format(uid=os.getuid() if hasattr(os, "getuid") else 0, addr=os.environ.get("MASTER_ADDR", ""),
                              port=os.environ.get("MASTER_PORT", ""), rank=rank)
    try:
        (SHM_FOLDER / name).unlink()
    except FileNotFoundError:
        pass


def deepspeed_config(train: TrainSection, overrides: dict, *, world: int, device: torch.device) -> dict:
    """The DeepSpeed config: batch sizes and precision from ``train``, then the YAML's ``deepspeed:`` keys."""
    precision = train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch * train.grad_accum * world,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.bfloat16"}
    _check_owned_values(train, overrides or {})
    cfg = _deep_merge(cfg, overrides or {})
    _check_zero_section(cfg)
    _check_deepspeed_keys(cfg, overrides or {}, world=world)
    _refuse_unsafe_loading(cfg)
    _check_offload(cfg, train)
    _check_monitors(cfg)
    owned = [k for k in ("optimizer", "scheduler") if k in cfg]
    if owned:
        raise ConfigError(
            f"deepspeed: the {' and '.join(owned)} section(s) would replace the AdamW optimizer and cosine schedule "
            f"the training scripts build; remove them and set train.lr, train.min_lr, train.warmup_steps and "
            f"train.weight_decay instead"
        )
    tensorboard = cfg.get("tensorboard")
    if isinstance(tensorboard, dict) and tensorboard.get("enabled"):  # DeepSpeed's monitor: under the run's folder
        tensorboard = dict(tensorboard)
        if not tensorboard.get("output_path"):
            tensorboard["output_path"] = str(Path(train.out_dir))
        tensorboard.setdefault("job_name", "tensorboard")
        cfg["tensorboard"] = tensorboard
    micro, acc, total = (
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
        cfg["train_batch_size"],
    )
    if micro * acc * world != total:
        raise ConfigError(
            f"deepspeed batch sizes disagree: train_batch_size={total} but micro_batch {micro} x grad_accum {acc} "
            f"x world size {world} = {micro * acc * world}; drop deepspeed.train_batch_size or set it to "
            f"{micro * acc * world}"
        )
    return cfg


#: top-level keys DeepSpeed reads outside ``DeepSpeedConfig._initialize_params`` (engine features, launchers)
_DEEPSPEED_READ_ELSEWHERE = frozenset(
    {
        "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting",
        "nebula", "quantize_training", "sequence_parallel_size", "sparse_attention",
    }
)  # fmt: skip

#: DeepSpeed keys whose value the training loop itself uses (from the ``train:`` section): a ``deepspeed:`` value
#: must agree with it. ``zero_optimization.stage`` decides how ``export_weights`` gathers the weights.
_OWNED = (
    (("train_micro_batch_size_per_gpu",), "micro_batch", "the data loader draws train.micro_batch samples per rank"),
    (("gradient_accumulation_steps",), "grad_accum", "the loop counts an optimizer step every train.grad_accum "
                                                     "micro-batches and sizes the schedule with it"),
    (("zero_optimization", "stage"), "zero_stage", "the export gathers ZeRO-3 partitions by train.zero_stage"),
)  # fmt: skip


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_owned_values(train: TrainSection, overrides: dict) -> None:
    """``ConfigError`` for a ``deepspeed:`` value that the ``train:`` section owns (:data:`_OWNED`) and that
    differs from it, or for batch sizes / gradient clipping that are not valid numbers; each message names
    the ``deepspeed.*`` key and the ``train.*`` key it must agree with."""
    for path, name, why in _OWNED:
        node: Any = overrides
        for part in path:
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            key, mine = "deepspeed." + ".".join(path), getattr(train, name)
            if name != "zero_stage" and not _positive_int(node):
                raise ConfigError(f"{key} must be a positive integer, got {node!r}; set train.{name} instead")
            if node != mine or isinstance(node, bool):
                raise ConfigError(
                    f"{key}={node!r} disagrees with train.{name}={mine}: {why}, so DeepSpeed must use the same "
                    f"value; set train.{name}={node!r} and drop {key}"
                )
    total = overrides.get("train_batch_size")
    if total is not None and not _positive_int(total):
        raise ConfigError(f"deepspeed.train_batch_size must be a positive integer, got {total!r}; or drop it "
                          f"(it is train.micro_batch x train.grad_accum x the number of ranks)")  # fmt: skip
    clip = overrides.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0
                             or not math.isfinite(clip)):  # fmt: skip
        raise ConfigError(
            f"deepspeed.gradient_clipping must be a finite number >= 0 (0 turns clipping off), got {clip!r}"
        )


def _refuse_unsafe_loading(cfg: dict) -> None:
    """``ConfigError`` for ``checkpoint.load_universal``: DeepSpeed's universal-checkpoint loader reads the
    files under ``<tag>/zero/`` with ``torch.load(weights_only=False)`` itself, bypassing the checkpoint
    engine :class:`train.checkpoint.SafeCheckpointEngine` replaces, so a crafted file there would run code."""
    section = cfg.get("checkpoint")
    if isinstance(section, dict) and section.get("load_universal"):
        raise ConfigError(
            "deepspeed.checkpoint.load_universal is refused: DeepSpeed's universal-checkpoint loader unpickles the "
            "files under <checkpoint>/zero/ with torch.load(weights_only=False), which runs any code a crafted file "
            "holds, and the training scripts load checkpoints only through a weights_only=True loader. Drop the key "
            "and resume from a checkpoint the scripts wrote (train.resume=auto), with the same number of ranks"
        )


def offload_devices(cfg: dict) -> tuple[str, str]:
    """Where ZeRO keeps the optimizer state and the parameters of the DeepSpeed config ``cfg``.

    Read through DeepSpeed's own ZeRO config model, so its aliases and deprecated spellings (``cpu_offload``,
    ``cpu_offload_param``) count as it counts them.

    Args:
        cfg (dict): a DeepSpeed config, as :func:`deepspeed_config` returns it.

    Returns:
        tuple[str, str]: the devices of ``offload_optimizer`` and ``offload_param``: ``"cpu"``, ``"nvme"`` or
        ``"none"`` (not offloaded).
    """
    from deepspeed.runtime.zero.config import get_zero_config

    zero = get_zero_config(cfg)

    def device(section) -> str:
        value = "none" if section is None else section.device
        return str(getattr(value, "value", value))  # an enum member or, as DeepSpeed stores it, its value

    return device(zero.offload_optimizer), device(zero.offload_param)


def _check_zero_section(cfg: dict) -> None:
    """``ConfigError`` for a ``zero_optimization`` that is not a mapping (DeepSpeed's deprecated boolean form would
    replace the stage ``train.zero_stage`` sets)."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ConfigError(
            f"deepspeed.zero_optimization must be a mapping of ZeRO settings, e.g. "
            f"{{offload_optimizer: {{device: cpu}}}}, got {zero!r}; the stage comes from train.zero_stage"
        )


def _check_offload(cfg: dict, train: TrainSection) -> None:
    """``ConfigError`` for an offload the ZeRO stage does not do: parameters are offloaded by ZeRO-3 only
    (DeepSpeed would keep them on the device at a lower stage without a word), the optimizer state by ZeRO 1-3."""
    optimizer, param = offload_devices(cfg)
    if param != "none" and train.zero_stage != 3:
        raise ConfigError(
            f"deepspeed.zero_optimization.offload_param (device {param}) offloads the parameters ZeRO-3 partitions "
            f"and needs train.zero_stage=3, got train.zero_stage={train.zero_stage}; set train.zero_stage=3, or drop "
            f"offload_param (offload_optimizer alone works at stages 1, 2 and 3)"
        )
    if optimizer != "none" and train.zero_stage == 0:
        raise ConfigError(
            f"deepspeed.zero_optimization.offload_optimizer (device {optimizer}) offloads the optimizer state ZeRO "
            f"partitions and needs train.zero_stage 1, 2 or 3, got 0; set train.zero_stage=2 (or 1, or 3)"
        )


#: DeepSpeed monitors that import a package of their own, and the pip names that install it
_MONITOR_PACKAGES = {
    "wandb": ("wandb", "pip install -e '.[wandb]' (or pip install wandb)"),
    "comet": ("comet_ml", "pip install 'comet_ml>=3.41.0'"),
}


def _check_monitors(cfg: dict) -> None:
    """``ConfigError`` for an enabled DeepSpeed monitor whose package is not importable: DeepSpeed would fail on
    every rank after the process group started ("please pip install wandb")."""
    import importlib.util

    for key, (module, install) in _MONITOR_PACKAGES.items():
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"deepspeed.{key}.enabled=true needs the {module} package, which is not installed here; install it "
                f"with {install}, or set deepspeed.{key}.enabled=false"
            )


def _check_deepspeed_keys(cfg: dict, overrides: dict, *, world: int) -> None:
    """``ConfigError`` for a ``deepspeed:`` key the installed DeepSpeed does not read, or a nested value its
    config models reject (their pydantic errors, said in one paragraph).

    The known keys are those DeepSpeed's own parser looks up (recorded while it parses ``cfg``) plus
    :data:`_DEEPSPEED_READ_ELSEWHERE`, so the check follows the installed version.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    looked_up: dict[tuple[str, ...], set[str]] = {}

    class _Recording(dict):
        """A mapping that records every key looked up in it (sub-mappings recorded under their path)."""

        def __init__(self, data: dict, path: tuple[str, ...]) -> None:
            super().__init__({k: _Recording(v, (*path, k)) if isinstance(v, dict) else v for k, v in data.items()})
            self._path = path

        def _seen(self, key):
            looked_up.setdefault(self._path, set()).add(key)

        def __getitem__(self, key):
            self._seen(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            self._seen(key)
            return super().get(key, default)

        def __contains__(self, key):
            self._seen(key)
            return super().__contains__(key)

        def __copy__(self):
            return self

    probe = DeepSpeedConfig.__new__(DeepSpeedConfig)
    probe._param_dict, probe.global_rank, probe.world_size = _Recording(cfg, ()), 0, world
    try:
        probe._initialize_params(probe._param_dict)
    except Exception as e:  # noqa: BLE001 - DeepSpeed's config models raise pydantic / assertion errors
        if type(e).__name__ != "ValidationError":
            return  # not a schema error: DeepSpeed itself reports it when the engine starts
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("For further")]
        raise ConfigError(f"deepspeed: {' | '.join(lines)}") from None
    known = looked_up.get((), set()) | _DEEPSPEED_READ_ELSEWHERE
    unknown = [k for k in overrides if k not in known]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"deepspeed: unknown key {k!r}{_suggest(k, sorted(known))}; the installed DeepSpeed reads: "
            f"{', '.join(sorted(known))}"
        )
    # a section DeepSpeed reads key by key (``checkpoint``, ``aio``, ...): a key it never looked up is ignored by
    # it. Sections it hands whole to its config models (no key looked up) are checked by those models above.
    for path, keys in sorted(looked_up.items()):
        node: Any = overrides
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not path or not isinstance(node, dict):
            continue
        stray = [k for k in node if k not in keys]
        if stray:
            where = "deepspeed." + ".".join(path)
            raise ConfigError(
                f"{where}: unknown key {stray[0]!r}{_suggest(stray[0], sorted(keys))}; the installed DeepSpeed "
                f"reads there: {', '.join(sorted(keys))}"
            )


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; ``ConfigError`` when it, or a folder above it, exists as a file, or when the nearest
    existing folder of the path cannot hold new entries (checked by creating and removing a temporary folder in
    it: a read-only disk, a folder without write permission, a kernel file system such as ``/proc``)."""
    out = Path(out_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"lies under {p}, which is a file"
                raise ConfigError(f"train.out_dir={str(out)!r} {what}; choose a directory path")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".vlpe-write-check-", dir=p))
            except OSError as e:
                reason = os.strerror(e.errno) if e.errno else str(e)
                hint = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                raise ConfigError(
                    f"train.out_dir={str(out)!r} cannot be written: creating a folder in {p} failed with "
                    f"'{reason}'{hint}; choose a directory on a writable disk"
                ) from None
            break
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and random: call before building the model so its initialisation is reproducible."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
