"""The DeepSpeed training loop shared by ``train/vit.py``, ``train/points.py`` and ``train/vlm.py``.

One code path for every launch: ``deepspeed [--num_gpus N] train/X.py --config ...`` (the launcher sets
the rank variables) and plain ``python train/X.py --config ...`` (one process: the variables are filled in
here). gloo on CPU, NCCL on GPU. The pieces:

* :class:`TrainSection`: the ``train:`` section of every config (steps, batch, optimiser, precision,
  ZeRO stage, validation/checkpoint cadence, resume);
* :func:`deepspeed_config`: the DeepSpeed config dict from that section plus the YAML ``deepspeed:``
  overrides, with the batch-size identity checked up front and explained in one line, and every key checked
  against what the installed DeepSpeed reads (a typo is an error with a suggestion);
* :class:`ResumableBatchSampler` + :class:`SeededDataset`: the data order and every sample's augmentation
  are functions of (seed, step), so a resumed run sees exactly the batches an uninterrupted run would;
* :func:`fit`: the loop, with JSON-lines metrics, tqdm on rank 0, validation every N steps, checkpoints
  every N steps (model, optimizer, scheduler, data position, RNG, the model signature) and a safetensors
  export at the end (the model signature in its metadata), whose path it prints. With
  ``deepspeed.tensorboard.enabled=true`` every metrics record also goes to DeepSpeed's monitor
  (:func:`monitor_events`; events under ``<out_dir>/tensorboard`` unless ``output_path`` / ``job_name`` say
  otherwise); ``metrics.jsonl`` stays the record.

Resuming (``train.resume=auto`` or a checkpoint directory) loads through :class:`train.checkpoint.
SafeCheckpointEngine` (``weights_only=True``: a checkpoint never unpickles arbitrary objects), refuses a
checkpoint whose model signature differs from the config's (the message names both values) or whose step is
beyond ``train.steps``, and with ``auto`` skips a damaged newest checkpoint (a truncated file, a missing RNG
state) for the previous complete one, with a warning. ``metrics.jsonl`` is cut back to the resumed step, so
every step is logged once.

Precision: ``bf16`` uses DeepSpeed's ``torch_autocast`` mode, so parameters (learned frequencies
included) stay fp32 and encodings compute angles in fp32 (see the DeepSpeed notes on bf16 parameter casts).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from .checkpoint import (
    MARKER,
    METADATA_KEY,
    SIGNATURE,
    CheckpointError,
    SafeCheckpointEngine,
    check_signature,
    checkpoint_problem,
    complete_tags,
    load_rng,
    model_signature,
    save_rng,
    step_of,
    tag_for,
)
from .config import ConfigError, _suggest

__all__ = [
    "TrainSection",
    "deepspeed_config",
    "setup_distributed",
    "ResumableBatchSampler",
    "SeededDataset",
    "fit",
    "move_to",
    "export_weights",
    "seed_everything",
    "check_out_dir",
    "monitor_events",
]


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


# --------------------------------------------------------------------------- distributed
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


# --------------------------------------------------------------------------- data order
def _mix(*xs: int) -> int:
    """A stable 63-bit hash of integers (splitmix64 rounds), for per-sample seeds."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class ResumableBatchSampler(Sampler[list[tuple[int, int]]]):
    """Micro-batches of ``(index, sample_seed)`` for one rank, a pure function of (seed, micro step).

    The global sample stream is the concatenation of per-epoch permutations (seeded by ``seed`` and the
    epoch); micro step ``s`` of rank ``r`` takes its slice of global micro step ``s``. Starting at
    ``start`` reproduces exactly what an uninterrupted run yields from that point.
    """

    def __init__(self, n: int, *, micro_batch: int, rank: int, world: int, seed: int, start: int, total: int) -> None:
        if n < 1:
            raise ValueError("the training dataset is empty")
        self.n, self.micro, self.rank, self.world = n, micro_batch, rank, world
        self.seed, self.start, self.total = seed, start, total

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        return torch.randperm(self.n, generator=g)

    def __len__(self) -> int:
        return max(0, self.total - self.start)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        per_step = self.micro * self.world
        cache: dict[int, torch.Tensor] = {}
        for s in range(self.start, self.total):
            first = s * per_step + self.rank * self.micro
            batch = []
            for j in range(first, first + self.micro):
                epoch, i = divmod(j, self.n)
                if epoch not in cache:
                    cache.clear()
                    cache[epoch] = self._perm(epoch)
                batch.append((int(cache[epoch][i]), _mix(self.seed, j)))
            yield batch


class SeededDataset(Dataset):
    """Wraps a dataset so item ``(index, seed)`` is produced with every RNG seeded from ``seed``.

    Random augmentation then depends only on the sample's place in the stream, not on worker count or
    history; the caller's RNG state is restored afterwards.
    """

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        """The items of a whole micro-batch (the ``DataLoader`` asks for them at once): every item is produced
        right after seeding the CPU torch, numpy and Python RNGs from its own seed, and the caller's states are
        saved and restored once per batch rather than once per item (the same items, the same states after).
        Only the CPU generator is seeded (``torch.manual_seed`` would also reseed every accelerator's, at
        ~0.1 ms per call, and ``fork_rng(devices=[])`` restores the CPU one only)."""
        np_state, py_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            try:
                out = []
                for index, seed in items:
                    torch.default_generator.manual_seed(seed)
                    np.random.seed(seed % 2**32)
                    random.seed(seed)
                    out.append(self.base[index])
                return out
            finally:
                np.random.set_state(np_state)
                random.setstate(py_state)


def move_to(batch: Any, device: torch.device) -> Any:
    """Tensors (and objects with ``.to``, e.g. ``vlpe.Positions``) in nested dicts/lists to ``device``."""
    if isinstance(batch, torch.Tensor) or hasattr(batch, "to") and not isinstance(batch, (str, bytes, nn.Module)):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


# --------------------------------------------------------------------------- optimiser
def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for biases, norms, embeddings/tokens and encodings' ``no_weight_decay`` names."""
    skip: set[str] = set()
    for mod_name, mod in model.named_modules():
        fn = getattr(mod, "no_weight_decay", None)
        if callable(fn):
            prefix = f"{mod_name}." if mod_name else ""
            skip |= {prefix + n for n in fn()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name in skip or any(s in name for s in ("pos_embed", "cls_token", "reg_token")):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_schedule(train: TrainSection) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / max(1, train.warmup_steps)
        t = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        floor = train.min_lr / train.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


# --------------------------------------------------------------------------- export
def export_weights(module: nn.Module, path: Path, *, zero_stage: int, metadata: dict[str, str] | None = None) -> None:
    """Full fp32 weights to ``path`` (safetensors, with string ``metadata``) on rank 0; gathers ZeRO-3
    partitions first."""
    from safetensors.torch import save_file

    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    else:
        state = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
        tmp.replace(path)


# --------------------------------------------------------------------------- the loop
@dataclass
class FitResult:
    step: int
    metrics: list[dict] = field(default_factory=list)
    out_dir: Path | None = None


def fit(
    *,
    model: nn.Module,
    train: TrainSection,
    deepspeed_overrides: dict,
    train_set: Dataset,
    collate: Callable,
    validate: Callable[[nn.Module, torch.device], dict] | None,
    run_config: dict,
    tokens_per_sample: Callable[[dict], int] | None = None,
) -> FitResult:
    """Train ``model`` (whose ``forward(batch) -> {"loss": ...}``) as configured; returns the final step.

    ``validate(module, device)`` returns a metrics dict (already reduced across ranks); it runs every
    ``val_every`` steps and at the end. Metrics go to ``<out_dir>/metrics.jsonl`` (rank 0).
    """
    import deepspeed
    import yaml

    out_dir = check_out_dir(train.out_dir)
    rank, world, device = setup_distributed()
    ckpt_dir = out_dir / "checkpoints"
    signature = model_signature(run_config)
    seed_everything(train.seed + 1)  # the training stream (dropout, drop-path) after the model's init

    optimizer = torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(train))
    ds_cfg = deepspeed_config(train, deepspeed_overrides, world=world, device=device)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg, dist_init_required=False
    )
    engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)  # weights_only=True loads

    start = 0
    found = _resume_checkpoint(train, ckpt_dir, world=world, rank=rank, signature=signature)
    if found is not None:
        ckpt_dir, tag = found.parent, found.name
        loaded, client = engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None or not isinstance(client, dict) or "step" not in client:
            raise CheckpointError(f"DeepSpeed could not load {found} (see its log above); resume from another checkpoint")
        start = int(client["step"])
        load_rng(found / f"rng_rank{rank}.pt")
        if rank == 0:
            print(f"[train] resumed from {found} at step {start}", flush=True)

    metrics_path = out_dir / "metrics.jsonl"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
        _truncate_metrics(metrics_path, start)
    sampler = ResumableBatchSampler(
        len(train_set),  # type: ignore[arg-type]
        micro_batch=train.micro_batch,
        rank=rank,
        world=world,
        seed=train.seed,
        start=start * train.grad_accum,
        total=train.steps * train.grad_accum,
    )
    loader = DataLoader(
        SeededDataset(train_set),
        batch_sampler=sampler,
        num_workers=train.num_workers,
        collate_fn=collate,
        persistent_workers=False,
        # its own generator: creating the iterator must not draw from the global RNG (resume exactness)
        generator=torch.Generator().manual_seed(train.seed),
    )
    result = FitResult(step=start, out_dir=out_dir)
    bar = None
    if rank == 0 and train.progress:
        from tqdm import tqdm

        bar = tqdm(total=train.steps, initial=start, desc=f"train {out_dir.name}", dynamic_ncols=True)

    def log(record: dict) -> None:
        result.metrics.append(record)
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if engine.monitor.enabled:  # DeepSpeed's monitors (TensorBoard, CSV, ...): the same numbers, by step
            engine.monitor.write_events(monitor_events(record))

    step = start
    window_loss, window_n, window_tokens, t0 = 0.0, 0, 0, time.perf_counter()
    engine.train()
    for micro, batch in enumerate(loader):
        batch = move_to(batch, device)
        out = engine(batch)
        loss = out["loss"]
        engine.backward(loss)
        engine.step()
        window_loss += float(loss.detach())
        window_n += 1
        if tokens_per_sample is not None:
            window_tokens += tokens_per_sample(batch)
        if (micro + 1) % train.grad_accum:
            continue
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{window_loss / window_n:.4f}")
        if step % train.log_every == 0 or step == train.steps:
            dt = time.perf_counter() - t0
            rec = {"split": "train", "step": step, "loss": window_loss / window_n, "lr": scheduler.get_last_lr()[0]}
            if window_tokens:
                rec["tokens_per_s"] = window_tokens * world / dt
            rec["samples_per_s"] = window_n * train.micro_batch * world / dt
            log(rec)
            window_loss, window_n, window_tokens, t0 = 0.0, 0, 0, time.perf_counter()
        if validate is not None and (step % train.val_every == 0 or step == train.steps):
            engine.eval()
            with torch.no_grad():
                val = validate(engine.module, device)
            engine.train()
            log({"split": "val", "step": step, **val})
            if bar is not None:
                bar.write(f"[val] step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in val.items()))
        if step % train.ckpt_every == 0 or step == train.steps:
            save_checkpoint(engine, ckpt_dir, step, rank, keep=train.keep_checkpoints, signature=signature)
    if bar is not None:
        bar.close()
    export_weights(
        engine.module, out_dir / "model.safetensors", zero_stage=train.zero_stage,
        metadata={METADATA_KEY: json.dumps(signature, sort_keys=True)},
    )  # fmt: skip
    dist.barrier()
    tb = getattr(engine.monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        tb.summary_writer.close()
    if rank == 0:
        final = ckpt_dir / tag_for(step)
        print(f"[train] weights: {(out_dir / 'model.safetensors').resolve()} (final checkpoint: {final.resolve()})",
              flush=True)  # fmt: skip
    result.step = step
    return result


def monitor_events(record: dict) -> list[tuple[str, float, int]]:
    """DeepSpeed monitor events ``(tag, value, step)`` of one ``metrics.jsonl`` record: ``<split>/<key>`` for
    every number in it (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``val/acc`` ...)."""
    split, step = record["split"], int(record["step"])
    return [(f"{split}/{k}", float(v), step) for k, v in record.items()
            if k not in ("split", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)]  # fmt: skip


def _resume_checkpoint(train: TrainSection, ckpt_dir: Path, *, world: int, rank: int, signature: dict) -> Path | None:
    """The checkpoint directory to resume from (None: start at step 0), checked before anything is loaded.

    An explicit ``train.resume`` directory must be whole (:func:`train.checkpoint.checkpoint_problem`);
    ``auto`` takes the newest whole complete checkpoint, warning about each damaged newer one it skips.
    Either way the checkpoint's model signature must equal the config's and its step must not exceed
    ``train.steps``.
    """
    import warnings

    if train.resume in ("none", ""):
        return None
    if train.resume == "auto":
        candidates, explicit = [ckpt_dir / t for t in complete_tags(ckpt_dir)], False
    else:
        p = Path(train.resume)
        if not (p / MARKER).is_file() or not re.match(r"^step_\d{8}$", p.name):
            raise ConfigError(
                f"train.resume={train.resume!r} is not a complete checkpoint directory (<out_dir>/checkpoints/"
                f"step_XXXXXXXX with a {MARKER} marker); use auto to pick the newest one"
            )
        candidates, explicit = [p], True
    for path in candidates:
        problem = checkpoint_problem(path, world=world)
        if problem is not None:
            if explicit:
                raise CheckpointError(f"cannot resume from {path}: {problem}; resume from another checkpoint")
            if rank == 0:
                warnings.warn(f"skipping checkpoint {path}: {problem}", RuntimeWarning, stacklevel=2)
            continue
        recorded = path / SIGNATURE
        if recorded.is_file():
            fix = "resume with the recorded model settings, or start a new run (another train.out_dir)"
            check_signature(json.loads(recorded.read_text()), signature, where=f"checkpoint {path}", fix=fix)
        elif rank == 0:
            warnings.warn(f"{path} records no model signature ({SIGNATURE}); the model is not checked", stacklevel=2)
        step = step_of(path.name)
        if step > train.steps:
            raise ConfigError(
                f"checkpoint {path} is at step {step} but train.steps={train.steps}: the run would export the "
                f"later weights under the smaller step count; set train.steps >= {step}"
            )
        return path
    if candidates:
        raise CheckpointError(
            f"every complete checkpoint under {ckpt_dir} is damaged (see the warnings); delete them to start over"
        )
    return None


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of ``path`` (JSON lines) up to ``step``: a resumed run logs the later steps again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the crash
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def save_checkpoint(engine, ckpt_dir: Path, step: int, rank: int, *, keep: int, signature: dict | None = None) -> None:
    """DeepSpeed checkpoint + RNG per rank (+ the model signature), then ``COMPLETE`` once every rank is done."""
    import shutil

    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    save_rng(ckpt_dir / tag / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        if signature is not None:
            (ckpt_dir / tag / SIGNATURE).write_text(json.dumps(signature, sort_keys=True, indent=1))
        (ckpt_dir / tag / MARKER).write_text(str(step))
        done = sorted((p for p in ckpt_dir.iterdir() if (p / MARKER).is_file()), key=lambda p: step_of(p.name))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
