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
from train.points_setup import PointsConfig
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


def test_offload_the_stage_does_not_do_is_refused_before_launch(no_process_group):
    """Parameters are offloaded by ZeRO-3 only: at stage 2 DeepSpeed would keep them in place without a word.
    DeepSpeed's deprecated spelling (``cpu_offload_param``) counts as it counts it."""
    with pytest.raises(ConfigError, match=r"offload_param \(device cpu\).*needs train.zero_stage=3, got "
                                          r"train.zero_stage=2"):  # fmt: skip
        parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=2", "deepspeed.zero_optimization.offload_param."
                             "device=cpu"])  # fmt: skip
    with pytest.raises(ConfigError, match="offload_param"):
        parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=1",
                             "deepspeed.zero_optimization.cpu_offload_param=true"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"offload_optimizer \(device cpu\).*needs train.zero_stage 1, 2 or 3"):
        parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=0",
                             "deepspeed.zero_optimization.offload_optimizer.device=cpu"])  # fmt: skip
    # what ZeRO does offload is accepted
    offload_optimizer = "deepspeed.zero_optimization.offload_optimizer.device=cpu"
    for stage in (1, 2, 3):
        parse(PointsConfig, ["--config", CONFIG, f"train.zero_stage={stage}", offload_optimizer])
    parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=3", offload_optimizer,
                         "deepspeed.zero_optimization.offload_param.device=cpu"])  # fmt: skip
    parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=2", "deepspeed.zero_optimization.offload_param."
                         "device=none"])  # fmt: skip
    parse(PointsConfig, ["--config", CONFIG, "train.zero_stage=2", "deepspeed.zero_optimization.cpu_offload=true"])
    for value, said in (("foo", "'foo'"), ("true", "True")):  # DeepSpeed's boolean form would drop train.zero_stage
        with pytest.raises(ConfigError, match=f"deepspeed.zero_optimization must be a mapping.*got {said};"):
            parse(PointsConfig, ["--config", CONFIG, f"deepspeed.zero_optimization={value}"])


def test_wandb_monitor_without_wandb_names_the_extra_before_launch(tmp_path, monkeypatch, no_process_group):
    """``deepspeed.wandb.enabled=true`` without the package failed on rank 0 after the launch ("please pip install
    wandb"); now the command line says which extra installs it. ``sys.modules[name] = None`` makes a package
    unimportable whether or not it is installed."""
    import importlib.machinery
    import sys
    import types

    monkeypatch.setitem(sys.modules, "wandb", None)
    for argv in (["deepspeed.wandb.enabled=true"], ["deepspeed.wandb.enabled=true", "deepspeed.wandb.project=p"]):
        with pytest.raises(ConfigError, match=r"deepspeed.wandb.enabled=true needs the wandb package.*"
                                              r"pip install -e '\.\[wandb\]' \(or pip install wandb\)"):  # fmt: skip
            parse(PointsConfig, ["--config", CONFIG, *argv])
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        points_main(["--config", CONFIG, "deepspeed.wandb.enabled=true", f"train.out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    parse(PointsConfig, ["--config", CONFIG, "deepspeed.wandb.enabled=false"])  # off: nothing to import
    stand_in = types.ModuleType("wandb")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", stand_in)  # importable: accepted
    parse(PointsConfig, ["--config", CONFIG, "deepspeed.wandb.enabled=true"])


def test_the_wandb_extra_is_optional():
    """wandb is an extra of its own: not a pin of the environment, not in [all]."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [x.split(">")[0].split("=")[0].strip() for x in extras["wandb"]] == ["wandb"]
    assert not any(x.startswith("wandb") for x in extras["all"])
    pins = [ln.split("==")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    assert "wandb" not in pins
