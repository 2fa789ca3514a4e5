"""What a training run is launched with: the ``train:`` section, the process group, the DeepSpeed config.

* :class:`TrainSection`: the ``train:`` section of every config (steps, batch, optimiser, precision,
  ZeRO stage, validation/checkpoint cadence, resume);
* :func:`setup_distributed`: the process group under the ``deepspeed`` launcher or in one plain process
  (the rank variables filled in here); gloo on CPU, NCCL on GPU;
* :func:`deepspeed_config`: the DeepSpeed config dict from that section plus the YAML ``deepspeed:``
  overrides, with the batch-size identity checked up front and explained in one line, and every key checked
  against what the installed DeepSpeed reads (a typo is an error with a suggestion);
* :func:`check_out_dir`, :func:`seed_everything`.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from .config import ConfigError, _suggest

__all__ = ["TrainSection", "setup_distributed", "deepspeed_config", "check_out_dir", "seed_everything"]


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
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


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
    cfg = _deep_merge(cfg, overrides or {})
    _check_deepspeed_keys(cfg, overrides or {}, world=world)
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
        "load_universal_checkpoint", "nebula", "quantize_training", "sequence_parallel_size", "sparse_attention",
        "use_node_local_storage",
    }
)  # fmt: skip


def _check_deepspeed_keys(cfg: dict, overrides: dict, *, world: int) -> None:
    """``ConfigError`` for a ``deepspeed:`` key the installed DeepSpeed does not read, or a nested value its
    config models reject (their pydantic errors, said in one paragraph).

    The known keys are those DeepSpeed's own parser looks up (recorded while it parses ``cfg``) plus
    :data:`_DEEPSPEED_READ_ELSEWHERE`, so the check follows the installed version.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class _Recording(dict):
        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def __copy__(self):
            return self

    probe = DeepSpeedConfig.__new__(DeepSpeedConfig)
    probe._param_dict, probe.global_rank, probe.world_size = _Recording(cfg), 0, world
    try:
        probe._initialize_params(probe._param_dict)
    except Exception as e:  # noqa: BLE001 - DeepSpeed's config models raise pydantic / assertion errors
        if type(e).__name__ != "ValidationError":
            return  # not a schema error: DeepSpeed itself reports it when the engine starts
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith("For further")]
        raise ConfigError(f"deepspeed: {' | '.join(lines)}") from None
    known = seen | _DEEPSPEED_READ_ELSEWHERE
    unknown = [k for k in overrides if k not in known]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"deepspeed: unknown key {k!r}{_suggest(k, sorted(known))}; the installed DeepSpeed reads: "
            f"{', '.join(sorted(known))}"
        )


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path; ``ConfigError`` when it, or a folder above it, exists as a file."""
    out = Path(out_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"lies under {p}, which is a file"
                raise ConfigError(f"train.out_dir={str(out)!r} {what}; choose a directory path")
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
