"""The DeepSpeed training loop shared by ``train/vit.py``, ``train/points.py`` and ``train/vlm.py``.

One code path for every launch: ``deepspeed [--num_gpus N] train/X.py --config ...`` (the launcher sets
the rank variables) and plain ``python train/X.py --config ...`` (one process: the variables are filled in
here). gloo on CPU, NCCL on GPU. The pieces:

* :class:`TrainSection`: the ``train:`` section of every config (steps, batch, optimiser, precision,
  ZeRO stage, validation/checkpoint cadence, resume), :func:`setup_distributed` and :func:`deepspeed_config`
  (the DeepSpeed config from that section and the YAML ``deepspeed:`` overrides, every key checked):
  :mod:`train.launch`;
* :class:`ResumableBatchSampler` + :class:`SeededDataset`: the data order and every sample's augmentation
  are functions of (seed, step), so a resumed run sees exactly the batches an uninterrupted run would:
  :mod:`train.data_order`;
* :func:`fit`: the loop, with JSON-lines metrics, tqdm on rank 0 (periodic lines when stderr is not a terminal:
  :mod:`train.progress`), validation every N steps, checkpoints every N steps (model, optimizer, scheduler,
  data position, RNG, the model signature) and a safetensors
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

The optimizer is AdamW over :func:`param_groups` with the cosine schedule: torch's, or under ZeRO-Offload
(``deepspeed.zero_optimization.offload_optimizer.device=cpu``) DeepSpeed's CPU Adam in AdamW mode with the same
groups and hyper-parameters (:func:`build_optimizer`).

Precision: ``bf16`` uses DeepSpeed's ``torch_autocast`` mode, so parameters (learned frequencies
included) stay fp32 and encodings compute angles in fp32 (see the DeepSpeed notes on bf16 parameter casts).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
    read_signature,
    save_rng,
    step_of,
    tag_for,
    world_problem,
)
from .config import ConfigError
from .data_order import ResumableBatchSampler, SeededDataset, move_to
from .launch import TrainSection, check_out_dir, deepspeed_config, offload_devices, seed_everything, setup_distributed

__all__ = [
    "TrainSection",
    "deepspeed_config",
    "setup_distributed",
    "ResumableBatchSampler",
    "SeededDataset",
    "fit",
    "build_optimizer",
    "move_to",
    "export_weights",
    "seed_everything",
    "check_out_dir",
    "monitor_events",
]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay for biases, norms, embeddings/tokens and encodings' ``no_weight_decay`` names. A
    model with a ``split_groups(decay, no_decay, weight_decay)`` method builds its own groups from those two lists
    (e.g. a learning rate per part: :func:`train.finetune.part_groups`)."""
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
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter keeps its shape in ds_shape
        if ndim < 2 or name in skip or any(s in name for s in ("pos_embed", "cls_token", "reg_token")):
            no_decay.append(p)
        else:
            decay.append(p)
    split = getattr(model, "split_groups", None)
    if callable(split):
        return [g for g in split(decay, no_decay, weight_decay) if g["params"]]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed drops empty groups; the schedule must see the same ones


def build_optimizer(model: nn.Module, train: TrainSection, ds_config: dict) -> torch.optim.Optimizer:
    """The AdamW of a run: torch's, or DeepSpeed's CPU Adam in AdamW mode when ZeRO offloads the optimizer.

    ZeRO-Offload (``zero_optimization.offload_optimizer.device`` ``cpu`` or ``nvme``) steps the optimizer on the
    CPU, where DeepSpeed accepts only its own CPU optimizers. Both take the same :func:`param_groups` (the weight
    decay of each group), ``train.lr`` (which the cosine schedule scales group by group), betas ``(0.9, 0.999)``
    and eps ``1e-8``, with decoupled weight decay, so a run with and without offload follows the same update rule.
    The CPU Adam compiles a CPU op on its first use on a machine (about two minutes) and loads it in seconds later.

    Args:
        model (nn.Module): the model to train.
        train (TrainSection): the run's ``train:`` section (``lr``, ``weight_decay``).
        ds_config (dict): the DeepSpeed config of the run (:func:`deepspeed_config`).

    Returns:
        torch.optim.Optimizer: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` when the optimizer is offloaded, else
        ``torch.optim.AdamW``.
    """
    groups = param_groups(model, train.weight_decay)
    if offload_devices(ds_config)[0] != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=train.lr, betas=(0.9, 0.999), eps=1e-8, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.999), eps=1e-8)


def cosine_schedule(train: TrainSection) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / max(1, train.warmup_steps)
        t = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        floor = train.min_lr / train.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


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
    export: Callable[[object, Path], object] | None = None,
) -> FitResult:
    """Train ``model`` (whose ``forward(batch) -> {"loss": ...}``) as configured; returns the final step.

    ``validate(module, device)`` returns a metrics dict (already reduced across ranks); it runs every
    ``val_every`` steps and at the end. Metrics go to ``<out_dir>/metrics.jsonl`` (rank 0). ``export(engine,
    out_dir)`` replaces the safetensors export at the end (e.g. a Hugging Face folder). A batch that is a dict with
    ``num_skipped`` (samples its collator left out), or a :class:`data.collate.CountedBatch`, adds to the
    ``skipped`` count every train record carries (:func:`data.collate.num_skipped`).
    """
    import deepspeed
    import yaml

    from data.collate import num_skipped
    from .lock import hold_out_dir

    out_dir = check_out_dir(train.out_dir)
    rank, world, device = setup_distributed()
    run_lock = hold_out_dir(out_dir, rank=rank)  # a second run on this out_dir is refused (train/lock.py)
    ckpt_dir = out_dir / "checkpoints"
    signature = model_signature(run_config)
    seed_everything(train.seed + 1)  # the training stream (dropout, drop-path) after the model's init

    ds_cfg = deepspeed_config(train, deepspeed_overrides, world=world, device=device)
    optimizer = build_optimizer(model, train, ds_cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(train))
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_cfg, dist_init_required=False
    )
    engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)  # weights_only=True loads
    offload = offload_devices(ds_cfg)
    if rank == 0 and offload != ("none", "none"):
        stepped_by = type(getattr(engine, "basic_optimizer", optimizer)).__name__  # what DeepSpeed steps
        where = [f"{what} {'on ' + device if device != 'none' else 'not offloaded'}"
                 for what, device in zip(("optimizer state", "parameters"), offload)]  # fmt: skip
        print(f"[train] ZeRO-Offload: {where[0]} (optimizer {stepped_by}), {where[1]}", flush=True)

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
    sp = getattr(train, "sequence_parallel", 1)  # the ranks of a sequence-parallel group share each batch
    sampler = ResumableBatchSampler(
        len(train_set),  # type: ignore[arg-type]
        micro_batch=train.micro_batch,
        rank=rank // sp,
        world=world // sp,
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
    if rank == 0 and train.progress:  # a bar on a terminal, periodic lines in a redirected log
        from .progress import progress

        bar = progress(total=train.steps, initial=start, desc=f"train {out_dir.name}")

    def log(record: dict) -> None:
        result.metrics.append(record)
        if rank == 0:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if engine.monitor.enabled:  # DeepSpeed's monitors (TensorBoard, CSV, ...): the same numbers, by step
            engine.monitor.write_events(monitor_events(record))

    step = start
    skipped = 0  # samples the collator left out (dropped or unreadable), this rank, since the start of this process
    window_loss, window_n, window_tokens, t0 = 0.0, 0, 0, time.perf_counter()
    engine.train()
    for micro, batch in enumerate(loader):
        skipped += num_skipped(batch)  # what the collator left out: a dict's "num_skipped" or a CountedBatch's
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
                rec["tokens_per_s"] = window_tokens * (world // sp) / dt
            rec["samples_per_s"] = window_n * train.micro_batch * (world // sp) / dt
            if skipped:
                rec["skipped"] = skipped
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
    if export is not None:
        where = export(engine, out_dir)
    else:
        where = out_dir / "model.safetensors"
        export_weights(
            engine.module, where, zero_stage=train.zero_stage,
            metadata={METADATA_KEY: json.dumps(signature, sort_keys=True)},
        )  # fmt: skip
    dist.barrier()
    tb = getattr(engine.monitor, "tb_monitor", None)
    if tb is not None and tb.summary_writer is not None:
        tb.summary_writer.close()
    if rank == 0:
        final = ckpt_dir / tag_for(step)
        print(f"[train] weights: {Path(where).resolve()} (final checkpoint: {final.resolve()})", flush=True)
    result.step = step
    if run_lock is not None:
        run_lock.release()
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
    ``auto`` takes the newest whole complete checkpoint, warning about each damaged newer one it skips. A checkpoint
    whose ZeRO partitions another number of ranks wrote is refused either way (:func:`train.checkpoint.world_problem`),
    before DeepSpeed's load would fail on it.
    Either way the checkpoint's model signature must equal the config's (checked first: a checkpoint of another model
    or data is named as such) and its step must not exceed ``train.steps``.
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
        recorded = path / SIGNATURE  # another model or data first: that run is not this one, whatever else differs
        if recorded.is_file():
            fix = "resume with the recorded model settings, or start a new run (another train.out_dir)"
            check_signature(read_signature(recorded), signature, where=f"checkpoint {path}", fix=fix)
        mismatch = world_problem(path, world=world)  # not damage: every checkpoint of the run would be skipped
        if mismatch is not None:
            raise CheckpointError(f"cannot resume: {mismatch}")
        problem = checkpoint_problem(path, world=world)
        if problem is not None:
            if explicit:
                raise CheckpointError(f"cannot resume from {path}: {problem}; resume from another checkpoint")
            if rank == 0:
                warnings.warn(f"skipping checkpoint {path}: {problem}", RuntimeWarning, stacklevel=2)
            continue
        if not recorded.is_file() and rank == 0:
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
            f"no complete checkpoint under {ckpt_dir} can be resumed: each is damaged or holds objects that are "
            f"refused (the warnings above say which file); delete them to start over"
        )
    return None


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of ``path`` (JSON lines) up to ``step``: a resumed run logs the later steps again. A full
    disk is a :class:`CheckpointError` naming the file and the disk (``path`` is left as it was)."""
    from .checkpoint import disk_full_message, is_disk_full

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
    try:
        tmp.write_text("".join(f"{line}\n" for line in kept))
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise CheckpointError(
                disk_full_message(tmp, action=f"cutting {path.name} back to step {step} for the resume, writing")
            ) from None
        raise


def save_checkpoint(engine, ckpt_dir: Path, step: int, rank: int, *, keep: int, signature: dict | None = None) -> None:
    """DeepSpeed checkpoint + RNG per rank (+ the model signature), then ``COMPLETE`` once every rank is done.

    A write that fails for want of space (``OSError`` ENOSPC, or torch's ``inline_container.cc`` write error,
    :func:`train.checkpoint.is_disk_full`) is a :class:`CheckpointError` naming the checkpoint and the disk; the
    half-written checkpoint has no ``COMPLETE`` marker, so a resume never picks it."""
    import shutil

    from .checkpoint import disk_full_message, is_disk_full

    tag = tag_for(step)

    def disk_full(e: BaseException) -> CheckpointError:
        return CheckpointError(disk_full_message(ckpt_dir / tag, action=f"writing the step-{step} checkpoint"))

    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        save_rng(ckpt_dir / tag / f"rng_rank{rank}.pt")
    except (OSError, RuntimeError) as e:
        if is_disk_full(e):
            raise disk_full(e) from None
        raise
    dist.barrier()
    if rank == 0:
        try:
            if signature is not None:
                (ckpt_dir / tag / SIGNATURE).write_text(json.dumps(signature, sort_keys=True, indent=1))
            (ckpt_dir / tag / MARKER).write_text(str(step))
        except OSError as e:
            (ckpt_dir / tag / MARKER).unlink(missing_ok=True)  # a marker cut short must not mark it complete
            if is_disk_full(e):
                raise disk_full(e) from None
            raise
        done = sorted((p for p in ckpt_dir.iterdir() if (p / MARKER).is_file()), key=lambda p: step_of(p.name))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
