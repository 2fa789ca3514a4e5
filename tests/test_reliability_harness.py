"""Training-harness reliability, second round: no DeepSpeed load path can unpickle objects, what is loaded is
validated, the ``train.*`` / ``deepspeed.*`` values the loop relies on agree, a resume notices a changed input
size, a full disk is named, and config mistakes are one-paragraph errors.

The checks run against the functions themselves (``deepspeed_config``, ``load_config``, ``parse``,
``checkpoint_problem``, ``safe_load``, ``save_checkpoint``, ``_truncate_metrics``, ``_resume_checkpoint``); one slow
test launches ``train/vit.py`` once to show the universal-checkpoint attack refused end to end.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_train import ENV, PY, ROOT, TINY_VIT
from train.checkpoint import CheckpointError, checkpoint_problem, model_signature, safe_load, signature_differences
from train.cli import main_guard, parse
from train.config import ConfigError, load_config, to_dict
from train.engine import TrainSection, deepspeed_config
from train.vit_setup import ViTConfig

CONFIG = ROOT / "configs" / "vit_rope.yaml"
CPU = torch.device("cpu")


class _Payload:
    """Creates ``marker`` when unpickled by a loader that runs pickled calls."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(path: Path, *, signature: dict | None = None) -> Path:
    """A checkpoint folder with the files ``checkpoint_problem`` asks for (marker, model states, rank-0 RNG)."""
    path.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "step": 2}, path / "mp_rank_00_model_states.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rng_rank0.pt")
    (path / "COMPLETE").write_text("2")
    if signature is not None:
        (path / "model.json").write_text(json.dumps(signature))
    return path


def _mount(path: Path) -> Path:
    p = path.resolve()
    while not os.path.ismount(p):
        p = p.parent
    return p


# --------------------------------------------------------------------------- security
def test_universal_checkpoint_loading_is_refused():
    """DeepSpeed's universal loader calls ``torch.load(weights_only=False)`` on ``<tag>/zero/*.pt`` itself
    (``deepspeed/runtime/base_optimizer.py``), past the safe checkpoint engine: the key is refused."""
    train = TrainSection(micro_batch=4, zero_stage=1)
    with pytest.raises(ConfigError, match=r"checkpoint\.load_universal") as e:
        deepspeed_config(train, {"checkpoint": {"load_universal": True}}, world=1, device=CPU)
    assert "weights_only" in str(e.value) and "\n" not in str(e.value)
    # the other checkpoint keys DeepSpeed reads stay usable
    cfg = deepspeed_config(train, {"checkpoint": {"load_universal": False, "tag_validation": "Fail"}}, world=1,
                           device=CPU)  # fmt: skip
    assert cfg["checkpoint"]["tag_validation"] == "Fail"


def test_the_checkpoint_check_opens_every_file_sub_folders_included(tmp_path):
    marker = tmp_path / "payload_ran"
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step_00000002")
    assert checkpoint_problem(ckpt, world=1) is None
    (ckpt / "zero").mkdir()
    torch.save({"optimizer": _Payload(marker)}, ckpt / "zero" / "optimizer_state.pt")
    problem = checkpoint_problem(ckpt, world=1)
    assert problem is not None and "zero/optimizer_state.pt" in problem and f"{open.__module__}.{open.__qualname__}" in problem
    # resumed by name it is an error naming the file; nothing in it ran
    from train.engine import _resume_checkpoint

    with pytest.raises(CheckpointError, match="zero/optimizer_state.pt"):
        _resume_checkpoint(TrainSection(resume=str(ckpt)), ckpt.parent, world=1, rank=0, signature={})
    assert not marker.exists()
    # a truncated archive in a sub-folder is found too
    (ckpt / "zero" / "optimizer_state.pt").unlink()
    torch.save({"w": torch.ones(100)}, ckpt / "zero" / "fp32.pt")
    data = (ckpt / "zero" / "fp32.pt").read_bytes()
    (ckpt / "zero" / "fp32.pt").write_bytes(data[: len(data) // 2])
    assert "zero/fp32.pt" in checkpoint_problem(ckpt, world=1)


def _scaler():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(2.0**16, 1000, 1, 2, False)


@pytest.mark.parametrize("tamper", ["nan_scale", "zero_scale", "method_replaced", "field_of_another_type"])
def test_loaded_instances_of_allowed_classes_are_validated(tmp_path, tamper):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    good = tmp_path / "good.pt"
    torch.save({"loss_scaler": _scaler(), "step": 3}, good)
    loaded = safe_load(good)["loss_scaler"]
    assert vars(loaded) == vars(_scaler())
    scaler = _scaler()
    if tamper == "nan_scale":
        scaler.cur_scale = float("nan")
    elif tamper == "zero_scale":
        scaler.cur_scale = 0.0
    elif tamper == "method_replaced":
        scaler.update_scale = LossScaler  # another allowed global, in the place of a method
    else:
        scaler.scale_window = LossScaler
    bad = tmp_path / "bad.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": [scaler]}}, bad)
    with pytest.raises(CheckpointError, match=r"refusing to load .*bad\.pt.*DynamicLossScaler"):
        safe_load(bad)


def test_a_fragment_address_out_of_range_is_refused(tmp_path):
    from deepspeed.utils.tensor_fragment import fragment_address

    ok = tmp_path / "ok.pt"
    torch.save({"addr": fragment_address(numel=4, start=0)}, ok)
    assert safe_load(ok)["addr"] == fragment_address(numel=4, start=0)
    bad = tmp_path / "bad.pt"
    torch.save({"addr": fragment_address(numel=-4, start=0)}, bad)
    with pytest.raises(CheckpointError, match="numel"):
        safe_load(bad)


def test_a_blocked_global_is_never_answered_with_advice_to_drop_weights_only(tmp_path):
    bad = tmp_path / "bad.pt"

    class _System:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"x": _System()}, bad)
    with pytest.raises(CheckpointError) as e:
        safe_load(bad)
    msg = str(e.value)
    assert f"{os.system.__module__}.{os.system.__name__}" in msg and "refusing to load" in msg
    assert "False" not in msg and "Re-running" not in msg and "\n" not in msg


# --------------------------------------------------------------------------- lost or silently wrong
@pytest.mark.parametrize(
    "overrides, deepspeed_key, train_key",
    [
        ({"gradient_accumulation_steps": 2, "train_batch_size": 8}, "deepspeed.gradient_accumulation_steps",
         "train.grad_accum"),
        ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2}, "deepspeed.train_micro_batch_size_per_gpu",
         "train.micro_batch"),
        ({"train_micro_batch_size_per_gpu": 0}, "deepspeed.train_micro_batch_size_per_gpu", "train.micro_batch"),
        ({"gradient_accumulation_steps": "two"}, "deepspeed.gradient_accumulation_steps", "train.grad_accum"),
        ({"zero_optimization": {"stage": 3}}, "deepspeed.zero_optimization.stage", "train.zero_stage"),
    ],
)  # fmt: skip
def test_deepspeed_values_the_train_section_owns_must_agree(overrides, deepspeed_key, train_key):
    train = TrainSection(micro_batch=4, grad_accum=1)
    with pytest.raises(ConfigError) as e:
        deepspeed_config(train, overrides, world=1, device=CPU)
    assert deepspeed_key in str(e.value) and train_key in str(e.value)


def test_deepspeed_values_that_agree_with_the_train_section_are_accepted():
    train = TrainSection(micro_batch=4, grad_accum=2, zero_stage=1)
    same = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
            "zero_optimization": {"stage": 1}}  # fmt: skip
    cfg = deepspeed_config(train, same, world=2, device=CPU)
    assert {k: cfg[k] for k in same} == same


@pytest.mark.parametrize(
    "overrides, named",
    [({"load_universal_checkpoint": True}, "load_universal_checkpoint"),
     ({"use_node_local_storage": True}, "use_node_local_storage"),
     ({"checkpoint": {"bogus": 1}}, "bogus"),
     ({"checkpoint": {"writer": {"typ": "fast"}}}, "typ")],
)  # fmt: skip
def test_deepspeed_keys_deepspeed_never_reads_are_errors(overrides, named):
    with pytest.raises(ConfigError, match=f"unknown key '{named}'"):
        deepspeed_config(TrainSection(micro_batch=4), overrides, world=1, device=CPU)


def test_a_negative_gradient_clip_is_an_error_not_clipping_turned_off():
    with pytest.raises(ConfigError, match="train.grad_clip"):
        load_config(ViTConfig, CONFIG, ["train.grad_clip=-1"])
    with pytest.raises(ConfigError, match="deepspeed.gradient_clipping"):
        deepspeed_config(TrainSection(micro_batch=4), {"gradient_clipping": -1}, world=1, device=CPU)
    assert deepspeed_config(TrainSection(grad_clip=0.0), {}, world=1, device=CPU)["gradient_clipping"] == 0.0


@pytest.mark.parametrize("override", ["train.lr=-0.1", "train.lr=0", "train.lr=.nan", "train.min_lr=-1",
                                      "train.weight_decay=-0.5", "train.warmup_steps=-3"])  # fmt: skip
def test_impossible_optimizer_settings_are_config_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(ViTConfig, CONFIG, [override])


def _run_config(*overrides: str) -> dict:
    """The run config ``train/vit.py::main`` hands to ``fit`` (the parsed config, ``num_classes``, ``script``)."""
    cfg = load_config(ViTConfig, CONFIG, list(overrides))
    return {**to_dict(cfg), "num_classes": 10, "script": "vit"}


@pytest.mark.parametrize("key, before, after", [("img_size", 28, 32), ("channels", 1, 3)])
def test_a_changed_input_size_is_part_of_the_model_signature(tmp_path, key, before, after):
    from train.engine import _resume_checkpoint

    recorded = model_signature(_run_config(f"data.{key}={before}"))
    now = _run_config(f"data.{key}={after}")
    diffs = signature_differences(recorded, now)
    assert len(diffs) == 1 and f"data.{key}" in diffs[0] and str(before) in diffs[0] and str(after) in diffs[0]
    # the resume refuses before anything is loaded (it used to die later with a raw size mismatch)
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step_00000002", signature=recorded)
    with pytest.raises(CheckpointError, match=rf"data\.{key}"):
        _resume_checkpoint(TrainSection(resume="auto", steps=4), ckpt.parent, world=1, rank=0,
                           signature=model_signature(now))  # fmt: skip
    # data keys the weights do not depend on still resume
    same = model_signature(_run_config(f"data.{key}={before}", "data.val_limit=7", "data.augment=true"))
    found = _resume_checkpoint(TrainSection(resume="auto", steps=4), ckpt.parent, world=1, rank=0, signature=same)
    assert found == ckpt


_TORCH_WRITE_FAILED = (
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: file write failed"
)


class _FullDiskEngine:
    """Stands in for a DeepSpeed engine whose checkpoint write runs out of space, as torch reports it."""

    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        raise RuntimeError(_TORCH_WRITE_FAILED)


class _Engine:
    def save_checkpoint(self, save_dir, *, tag, client_state, save_latest):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"module": {}}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")


def test_a_full_disk_during_a_checkpoint_write_names_the_disk_and_the_path(tmp_path, monkeypatch):
    from train import engine as engine_module

    ckpt_dir = tmp_path / "checkpoints"
    monkeypatch.setattr(engine_module.dist, "barrier", lambda *a, **k: None)
    with pytest.raises(CheckpointError) as e:
        engine_module.save_checkpoint(_FullDiskEngine(), ckpt_dir, 2, 0, keep=2, signature={"m": 1})
    msg = str(e.value)
    assert str(ckpt_dir / "step_00000002") in msg and f"mounted at {_mount(tmp_path)}" in msg and "full" in msg
    assert "inline_container" not in msg

    # the same when the marker write is the one that fails (OSError ENOSPC): no COMPLETE marker is left
    real_write = Path.write_text

    def full(self, *a, **k):
        if self.name == "COMPLETE":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError, match="full"):
        engine_module.save_checkpoint(_Engine(), ckpt_dir, 4, 0, keep=2, signature={"m": 1})
    assert not (ckpt_dir / "step_00000004" / "COMPLETE").exists()


def test_a_full_disk_while_cutting_the_metrics_back_names_the_disk_and_the_path(tmp_path, monkeypatch):
    from train.engine import _truncate_metrics

    metrics = tmp_path / "metrics.jsonl"
    records = [json.dumps({"split": "train", "step": s}) for s in (1, 2, 3)]
    metrics.write_text("".join(f"{r}\n" for r in records))
    before = metrics.read_text()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CheckpointError) as e:
        _truncate_metrics(metrics, 2)
    msg = str(e.value)
    assert "metrics" in msg and str(tmp_path) in msg and f"mounted at {_mount(tmp_path)}" in msg
    monkeypatch.undo()
    assert metrics.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# --------------------------------------------------------------------------- raw errors left
@pytest.mark.parametrize(
    "text",
    ["train:\n  steps: [1, 2\n", "train: !!python/object/apply:os.system ['true']\n",
     "model: !!python/name:os.system\n"],
)  # fmt: skip
def test_invalid_yaml_and_python_tags_in_the_config_are_one_paragraph(tmp_path, text, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(ViTConfig, path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    if "!!python" in text:
        assert "!!python" in str(e.value)
    from train.vit import main

    with pytest.raises(SystemExit) as code:
        main_guard(lambda: main(["--config", str(path)]))
    err = capsys.readouterr().err
    assert code.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs a /proc file system")
def test_an_out_dir_under_proc_is_a_config_error():
    from train.engine import check_out_dir

    for out in ("/proc/vlpe-run", "/proc/self/vlpe-run"):
        with pytest.raises(ConfigError, match="out_dir"):
            check_out_dir(out)


def test_binary_config_files_are_config_errors(tmp_path):
    binary = tmp_path / "ds_config.json"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"--deepspeed_config.*ds_config\.json"):
        parse(ViTConfig, ["--config", str(CONFIG), "--deepspeed_config", str(binary)])
    with pytest.raises(ConfigError, match=r"ds_config\.json"):
        parse(ViTConfig, ["--config", str(binary)])


@pytest.mark.slow
def test_the_universal_checkpoint_attack_is_refused_end_to_end(tmp_path):
    """``train/vit.py ... train.zero_stage=1 deepspeed.checkpoint.load_universal=true train.resume=auto`` with a
    payload in ``<tag>/zero/optimizer_state.pt``: a one-paragraph error, and the payload never runs."""
    out = tmp_path / "run"
    marker = tmp_path / "payload_ran"
    ckpt = _checkpoint(out / "checkpoints" / "step_00000002")
    # the engine states DeepSpeed reads before it reaches the universal loader (no module: a universal load skips it)
    torch.save({"module": {}, "step": 2, "dp_world_size": 1, "mp_world_size": 1, "global_steps": 2, "skipped_steps": 0,
                "lr_scheduler": {"lr_lambdas": [None, None], "last_epoch": 2, "_step_count": 3}},
               ckpt / "mp_rank_00_model_states.pt")  # fmt: skip
    (ckpt / "zero").mkdir()
    torch.save({"optimizer": _Payload(marker)}, ckpt / "zero" / "optimizer_state.pt")
    cmd = [PY, "train/vit.py", "--config", str(CONFIG), *TINY_VIT, "train.steps=4", "train.zero_stage=1",
           "deepspeed.checkpoint.load_universal=true", "train.resume=auto", f"train.out_dir={out}"]  # fmt: skip
    env = {**ENV, "PYTHONPATH": str(ROOT)}  # this checkout's harness, whatever the environment's path file names
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0 and not marker.exists(), r.stderr[-2000:]
    assert "load_universal" in r.stderr and "Traceback" not in r.stderr
