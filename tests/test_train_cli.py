"""The training scripts' command line: ``--help`` lists every config key with its default (read here from the config
classes themselves) and the launch notes; ``--deepspeed_config FILE`` is merged as the deepspeed section wherever it
stands on the line, with the documented precedence, and a missing or unusable file is an error."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from train.cli import parse
from train.config import ConfigError
from train.engine import TrainSection, deepspeed_config
from train.points_setup import PointsConfig
from train.vit_setup import ViTConfig
from train.vlm_setup import VLMConfig

SCRIPTS = {"vit": ViTConfig, "vlm": VLMConfig, "points": PointsConfig}
CONFIG = "configs/vit_rope.yaml"


def _yaml_scalar(v) -> str:
    """How a default reads in YAML, written out by hand for the value kinds the config classes use."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict) and not v:
        return "{}"
    if isinstance(v, list):  # flow style: [a, b]
        return "[" + ", ".join(_yaml_scalar(x) for x in v) + "]"
    return str(v)


def _defaults(cfg) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in _defaults(value).items()})
        else:
            out[f.name] = value
    return out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_lists_every_key_with_its_default_and_the_launch_notes(script, capsys):
    import importlib

    module = importlib.import_module(f"train.{script}")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    defaults = _defaults(SCRIPTS[script]())  # an instance of the config class: its real defaults
    assert len(defaults) > 30
    for key, value in defaults.items():
        if isinstance(value, float) and value < 1e-3:
            assert any(ln.strip().startswith(f"{key}=") and float(ln.split("=", 1)[1].split()[0]) == value
                       for ln in lines), key  # fmt: skip
            continue
        entry = f"{key}={_yaml_scalar(value)}"
        assert any(ln.strip() == entry or ln.strip().startswith(entry + " ") for ln in lines), entry
    flat = " ".join(text.split())
    assert "deepspeed --master_port 29501" in flat and "EADDRINUSE" in flat and "29500" in flat
    assert "compiles a CPU communication op (about 90 s)" in flat
    assert "--deepspeed_config FILE" in flat and "later wins" in flat


def _ds_file(tmp_path, data, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "placement",
    ["end", "end_equals", "middle", "middle_equals", "first"],
)
def test_deepspeed_config_is_merged_wherever_it_stands(placement, tmp_path):
    f = _ds_file(tmp_path, {"gradient_clipping": 0.5, "tensorboard": {"enabled": True}})
    head, tail = ["--config", CONFIG, "train.steps=3"], ["model.encoding=alibi"]
    argv = {
        "end": head + tail + ["--deepspeed_config", f],
        "end_equals": head + tail + [f"--deepspeed_config={f}"],
        "middle": head + ["--deepspeed_config", f] + tail,
        "middle_equals": head + [f"--deepspeed_config={f}"] + tail,
        "first": ["--local_rank=0", "--deepspeed", "--deepspeed_config", f] + head + tail,
    }[placement]
    cfg, raw = parse(ViTConfig, argv)
    assert cfg.deepspeed == {"gradient_clipping": 0.5, "tensorboard": {"enabled": True}}
    assert raw["deepspeed"] == cfg.deepspeed
    assert cfg.train.steps == 3 and cfg.model.encoding == "alibi"  # the overrides around it still count


def test_precedence_yaml_then_file_then_overrides(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("deepspeed:\n  gradient_clipping: 0.9\n  steps_per_print: 7\n  wall_clock_breakdown: true\n")
    f = _ds_file(tmp_path, {"gradient_clipping": 0.5, "steps_per_print": 3})
    cfg, _ = parse(ViTConfig, ["--config", str(cfg_file), "--deepspeed_config", f, "deepspeed.steps_per_print=2"])
    # the file beats the YAML section key by key, the command line beats the file; untouched keys stay
    assert cfg.deepspeed == {"gradient_clipping": 0.5, "steps_per_print": 2, "wall_clock_breakdown": True}
    ds = deepspeed_config(TrainSection(grad_clip=1.0), cfg.deepspeed, world=1, device=torch.device("cpu"))
    assert ds["gradient_clipping"] == 0.5  # and both beat what train.grad_clip sets


def test_a_deepspeed_yaml_file_works_too(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("zero_optimization:\n  stage: 1\n")
    cfg, _ = parse(ViTConfig, ["--config", CONFIG, "--deepspeed_config", str(path), "train.zero_stage=1"])
    assert cfg.deepspeed == {"zero_optimization": {"stage": 1}}


def test_deepspeed_config_errors(tmp_path):
    missing = tmp_path / "nowhere" / "ds_config.json"
    with pytest.raises(ConfigError, match=str(missing)):
        parse(ViTConfig, ["--config", CONFIG, "--deepspeed_config", str(missing)])
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="mapping"):
        parse(ViTConfig, ["--config", CONFIG, f"--deepspeed_config={bad}"])
    typo = _ds_file(tmp_path, {"gradient_cliping": 0.5}, "typo.json")
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):  # parse builds the DeepSpeed config
        parse(ViTConfig, ["--config", CONFIG, "--deepspeed_config", typo])
    with pytest.raises(ConfigError, match="did you mean 'gradient_clipping'"):
        deepspeed_config(TrainSection(), {"gradient_cliping": 0.5}, world=1, device=torch.device("cpu"))
    opt = _ds_file(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 0.1}}}, "opt.json")
    with pytest.raises(ConfigError, match="optimizer section"):
        parse(ViTConfig, ["--config", CONFIG, "--deepspeed_config", opt])
    with pytest.raises(SystemExit):  # any other flag is refused, not ignored
        parse(ViTConfig, ["--config", CONFIG, "--deepspeed_mpi"])
    with pytest.raises(SystemExit):
        parse(ViTConfig, ["--config", CONFIG, "--deepspeed_config"])  # the flag without its file


def test_tensorboard_defaults_under_the_run_folder():
    train = TrainSection(out_dir="runs/x")
    ds = deepspeed_config(train, {"tensorboard": {"enabled": True}}, world=1, device=torch.device("cpu"))
    assert ds["tensorboard"] == {"enabled": True, "output_path": "runs/x", "job_name": "tensorboard"}
    ds = deepspeed_config(train, {"tensorboard": {"enabled": True, "output_path": "/tmp/tb", "job_name": "a"}},
                          world=1, device=torch.device("cpu"))  # fmt: skip
    assert ds["tensorboard"] == {"enabled": True, "output_path": "/tmp/tb", "job_name": "a"}
    assert "tensorboard" not in deepspeed_config(train, {}, world=1, device=torch.device("cpu"))
