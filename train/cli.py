"""Command line shared by the training scripts: ``--config FILE [section.key=value ...]``.

Accepts the ``--local_rank`` the DeepSpeed launcher injects and DeepSpeed's own flags, so the same
script runs under ``deepspeed train/X.py`` and ``python train/X.py``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence, TypeVar

from .checkpoint import CheckpointError
from .config import ConfigError, load_config, to_dict

__all__ = ["parse", "main_guard"]

T = TypeVar("T")


def parse(cls: type[T], argv: Sequence[str] | None = None, *, description: str = "") -> tuple[T, dict]:
    """Parse the command line into a validated config of type ``cls`` (and its plain-dict form)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 model.encoding=rope")
    args, unknown = parser.parse_known_args(argv)
    # DeepSpeed's launcher may add its own flags (--deepspeed, --deepspeed_config); anything else is a typo.
    stray = [u for u in unknown if not u.startswith("--deepspeed")]
    if stray:
        parser.error(f"unrecognised arguments {stray}; overrides look like section.key=value")
    cfg = load_config(cls, args.config, args.overrides)
    return cfg, to_dict(cfg)


def main_guard(main) -> None:
    """Run ``main()``, turning config mistakes and unusable checkpoints into a one-paragraph error instead
    of a traceback."""
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        sys.exit(2)
