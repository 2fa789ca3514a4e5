"""Command line shared by the training scripts:
``--config FILE [--deepspeed_config FILE] [section.key=value ...]``.

Accepts the ``--local_rank`` the DeepSpeed launcher injects and DeepSpeed's own ``--deepspeed`` /
``--deepspeed_config`` flags (anywhere on the line, ``--flag FILE`` or ``--flag=FILE``), so the same script runs
under ``deepspeed train/X.py`` and ``python train/X.py``. Any other unknown flag is an error, never ignored.
``--help`` lists every config key with its default, taken from the config class.

:func:`parse` also builds the run's DeepSpeed config (:func:`train.launch.deepspeed_config`, the world size from
``WORLD_SIZE`` as the launcher sets it, else 1), so a bad ``--deepspeed_config`` file or a batch-size conflict is
an error before the process group starts (``deepspeed.init_distributed`` loads a communication op first: about
20 s with a warm cache, minutes while another build holds its lock).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import textwrap
from typing import Sequence, TypeVar

from .checkpoint import CheckpointError, disk_full_message
from .config import ConfigError, config_keys, load_config, read_mapping, to_dict
from .launch import TrainSection, deepspeed_config

__all__ = ["parse", "build_parser", "check_deepspeed", "main_guard", "PRECEDENCE", "LAUNCH_NOTES"]

T = TypeVar("T")

PRECEDENCE = (
    "DeepSpeed settings, later wins: (1) what train.* sets (batch sizes from micro_batch x grad_accum x ranks, "
    "gradient_clipping from grad_clip, bf16 from precision, ZeRO stage from zero_stage); (2) the --config file's "
    "deepspeed: section; (3) the --deepspeed_config FILE (JSON or YAML, merged key by key as the deepspeed "
    "section); (4) deepspeed.key=value overrides on the command line. What the training loop itself uses must agree "
    "with train.*: train_micro_batch_size_per_gpu (train.micro_batch), gradient_accumulation_steps (train.grad_accum), "
    "zero_optimization.stage (train.zero_stage) and train_batch_size (their product with the ranks); a value that "
    "differs is an error naming both, as is a key the installed DeepSpeed does not read (nested keys of the sections "
    "it reads key by key, such as checkpoint, included), an optimizer / scheduler section (the scripts build AdamW "
    "and the cosine schedule from train.*), checkpoint.load_universal (DeepSpeed's universal-checkpoint loader "
    "unpickles with weights_only=False), an offload the ZeRO stage does not do (offload_param below ZeRO-3, "
    "offload_optimizer at ZeRO-0) and a monitor whose package is missing (wandb, comet)."
)

LAUNCH_NOTES = (
    "Launching: the deepspeed launcher rendezvous on port 29500; when another run holds it the launch fails with "
    "EADDRINUSE ('address already in use'): pick another port, e.g. deepspeed --master_port 29501 train/X.py ... "
    "(plain python train/X.py runs one process on a free port). The first deepspeed launch on a machine compiles a "
    "CPU communication op (about 90 s); later launches reuse it. At the end the script prints where the weights "
    "went (<out_dir>/model.safetensors and the final checkpoint). deepspeed.tensorboard.enabled=true also writes "
    "TensorBoard events (tensorboard --logdir <out_dir>/tensorboard); metrics.jsonl stays the record. "
    "deepspeed.wandb.enabled=true needs the optional extra: pip install -e '.[wandb]' (or pip install wandb). "
    "ZeRO-Offload: deepspeed.zero_optimization.offload_optimizer.device=cpu (train.zero_stage 1-3) steps DeepSpeed's "
    "CPU Adam with the same parameter groups and schedule (its CPU op compiles on first use, about two minutes); "
    "deepspeed.zero_optimization.offload_param.device=cpu needs train.zero_stage=3."
)


def _keys_help(cls: type) -> str:
    rows = config_keys(cls)
    width = max(len(f"{k}={v}") for k, v, _ in rows)
    lines = ["config keys and their defaults (a --config file sets its own values; override any as key=value):"]
    for key, value, note in rows:
        text = f"{key}={value}"
        if key == "deepspeed":
            note = "any DeepSpeed config key, e.g. deepspeed.tensorboard.enabled=true (see the precedence below)"
        lines.append(f"  {text:<{width}}  {note}".rstrip())
    return "\n".join(lines)


def build_parser(cls: type, description: str = "") -> argparse.ArgumentParser:
    """The parser of a training script whose config class is ``cls`` (``--help`` generated from its defaults)."""
    epilog = "\n\n".join([_keys_help(cls), textwrap.fill(PRECEDENCE, 100), textwrap.fill(LAUNCH_NOTES, 100)])
    parser = argparse.ArgumentParser(description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--config", required=True,
                        help="YAML config (see configs/); a relative path is read from the current folder, else from "
                             "the checkout root")  # fmt: skip
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed", action="store_true",
                        help="DeepSpeed's flag, accepted for its launch convention: these scripts always train "
                             "through DeepSpeed")  # fmt: skip
    parser.add_argument("--deepspeed_config", metavar="FILE", default=None,
                        help="a DeepSpeed config (JSON or YAML), merged as the deepspeed section (precedence below)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 model.encoding=rope")
    return parser


def parse(cls: type[T], argv: Sequence[str] | None = None, *, description: str = "") -> tuple[T, dict]:
    """Parse the command line into a validated config of type ``cls`` (and its plain-dict form)."""
    parser = build_parser(cls, description)
    args, unknown = parser.parse_known_intermixed_args(argv)
    if unknown:
        parser.error(f"unrecognised arguments {unknown}; overrides look like section.key=value")
    sections = None
    if args.deepspeed_config is not None:
        if "deepspeed" not in getattr(cls, "__dataclass_fields__", {}):
            raise ConfigError(f"--deepspeed_config: {cls.__name__} has no deepspeed section to merge the file into")
        sections = {"deepspeed": read_mapping(args.deepspeed_config, what="--deepspeed_config")}
    cfg = load_config(cls, args.config, args.overrides, sections=sections)
    check_deepspeed(cfg)
    return cfg, to_dict(cfg)


def _launch_world_size() -> int:
    """The number of ranks the launcher started (``WORLD_SIZE``), 1 for a plain ``python train/X.py``."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"the environment's WORLD_SIZE={raw!r} is not a positive number of ranks; unset it for one "
                          f"process or launch with deepspeed --num_gpus N")  # fmt: skip
    return world


def check_deepspeed(cfg: object) -> dict | None:
    """The DeepSpeed config ``fit`` will hand DeepSpeed, built now from ``cfg.train`` and ``cfg.deepspeed``, so its
    errors (unknown keys, values that disagree with ``train.*``, batch sizes that do not multiply out) are raised
    before any process group or communication op; ``None`` for a config without those two sections."""
    train, overrides = getattr(cfg, "train", None), getattr(cfg, "deepspeed", None)
    if not isinstance(train, TrainSection) or not isinstance(overrides, dict):
        return None
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as train.launch.setup_distributed
    if getattr(train, "sequence_parallel", 1) > 1:  # sequence parallelism: N must divide the world size
        from train.sequence_parallel import check_world

        check_world(train.sequence_parallel, _launch_world_size())
    return deepspeed_config(train, overrides, world=_launch_world_size(), device=device)


def main_guard(main) -> None:
    """Run ``main()``, turning config mistakes, unusable checkpoints and a full disk into a one-paragraph error
    instead of a traceback."""
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"disk full: {disk_full_message(e.filename or '.', action='writing')}", file=sys.stderr)
        sys.exit(2)
