"""Where ``--config`` is read from, and which part of the command line a config error is reported against.

Checked against ``train/config.py::load_config`` and ``train/cli.py::parse`` with the repository's own
``configs/vit_rope.yaml`` and files written here: a relative ``--config`` is read from the current folder first,
then from the checkout root; a mistake in a ``key=value`` override names that override, one in the file names the
file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from train.cli import parse
from train.config import ConfigError, load_config
from train.vit_setup import ViTConfig

ROOT = Path(__file__).resolve().parents[1]


def test_a_relative_config_resolves_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = parse(ViTConfig, ["--config", "configs/vit_rope.yaml", "train.steps=3"])
    assert cfg.model.encoding == "rope" and cfg.train.steps == 3
    assert load_config(ViTConfig, "configs/vit_rope.yaml") == load_config(ViTConfig, ROOT / "configs/vit_rope.yaml")


def test_the_current_folder_comes_first(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "vit_rope.yaml").write_text(f"inherit: {ROOT / 'configs' / 'vit_rope.yaml'}\ntrain:\n  steps: 11\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(ViTConfig, "configs/vit_rope.yaml").train.steps == 11


def test_a_missing_config_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(ViTConfig, "configs/vit_ropee.yaml")
    msg = str(e.value)
    assert str(tmp_path / "configs" / "vit_ropee.yaml") in msg and str(ROOT / "configs" / "vit_ropee.yaml") in msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stpes=5", r"unknown key 'stpes' \(did you mean 'steps'\?\); valid keys: steps"),
        ("modle.encoding=rope", "unknown key 'modle'"),
        ("train.steps=many", "expected int"),
        ("model.readout=mean", "not one of"),
        ("train={stpes: 5}", r"section train\): unknown key 'stpes'"),
    ],
)
def test_an_override_mistake_names_the_command_line(override, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        parse(ViTConfig, ["--config", "configs/vit_rope.yaml", override])
    msg = str(e.value)
    assert msg.startswith(f"command-line override {override!r}") and "vit_rope.yaml" not in msg


def test_a_file_mistake_still_names_the_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(f"inherit: {ROOT / 'configs' / 'vit_rope.yaml'}\ntrain:\n  stpes: 5\n")
    with pytest.raises(ConfigError, match=rf"{path}\.train: unknown key 'stpes'"):
        parse(ViTConfig, ["--config", str(path)])
