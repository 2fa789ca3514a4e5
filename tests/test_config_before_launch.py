"""A bad DeepSpeed configuration is reported by the command line, before the process group starts.

``deepspeed.init_distributed`` loads a communication op first (about 20 s with a warm cache, minutes while another
build holds its lock), so ``train/cli.py::parse`` builds the DeepSpeed config (``train/launch.py::deepspeed_config``,
the world size from ``WORLD_SIZE``) right after reading the YAML. Checked here against the process-group start
itself: ``deepspeed.init_distributed`` and ``torch.distributed.init_process_group`` are replaced by functions that
fail the test, so an error that comes only after them cannot pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed

from train.cli import parse
from train.config import ConfigError
from train.points import PointsConfig
from train.points import main as points_main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "points_rope.yaml")


@pytest.fixture
def no_process_group(monkeypatch):
    import deepspeed

    def started(*args, **kwargs):
        raise AssertionError("the process group started before the configuration was checked")

    monkeypatch.setattr(deepspeed, "init_distributed", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_unknown_key_of_a_deepspeed_config_file_is_a_parse_error(tmp_path, no_process_group):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"gradiant_clipping": 1.0}))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"deepspeed: unknown key 'gradiant_clipping'.*'gradient_clipping'"):
        parse(PointsConfig, ["--config", CONFIG, "--deepspeed_config", str(bad)])
    assert time.perf_counter() - start < 10  # generous: the communication op alone takes ~20 s warm


def test_batch_size_conflicts_are_parse_errors(no_process_group):
    with pytest.raises(ConfigError, match="deepspeed batch sizes disagree: train_batch_size=7"):
        parse(PointsConfig, ["--config", CONFIG, "deepspeed.train_batch_size=7"])
    with pytest.raises(ConfigError, match=r"deepspeed.train_micro_batch_size_per_gpu=3 disagrees with train.micro_batch"):
        parse(PointsConfig, ["--config", CONFIG, "deepspeed.train_micro_batch_size_per_gpu=3"])


def test_the_world_size_comes_from_the_launchers_environment(monkeypatch, no_process_group):
    cfg, _ = parse(PointsConfig, ["--config", CONFIG, "train.micro_batch=4", "train.grad_accum=2"])
    fits_one = "deepspeed.train_batch_size=8"  # 4 x 2 x 1 rank
    parse(PointsConfig, ["--config", CONFIG, "train.micro_batch=4", "train.grad_accum=2", fits_one])
    monkeypatch.setenv("WORLD_SIZE", "2")  # what `deepspeed --num_gpus 2` sets for every rank
    with pytest.raises(ConfigError, match="x world size 2 = 16"):
        parse(PointsConfig, ["--config", CONFIG, "train.micro_batch=4", "train.grad_accum=2", fits_one])
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not a positive number of ranks"):
        parse(PointsConfig, ["--config", CONFIG])


def test_a_training_script_fails_before_the_process_group(tmp_path, no_process_group):
    """The whole script: the error comes from its first line, never from ``fit``."""
    bad = tmp_path / "ds.yaml"
    bad.write_text("zero_optimization: {stage: 2}\n")  # train.zero_stage is 0
    with pytest.raises(ConfigError, match="deepspeed.zero_optimization.stage=2 disagrees with train.zero_stage=0"):
        points_main(["--config", CONFIG, "--deepspeed_config", str(bad), f"train.out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
