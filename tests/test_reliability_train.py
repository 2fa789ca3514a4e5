"""Training-harness reliability: checkpoints never unpickle objects, resumes and evaluations notice a changed
model, metrics log each step once, config mistakes are errors, damaged checkpoints fall back or say why."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from test_train import ENV, PY, ROOT, TINY_VIT, _read_metrics, _run
from train.config import ConfigError, load_config
from train.engine import TrainSection, deepspeed_config

BASE = [PY, "train/vit.py", "--config", "configs/vit_rope.yaml", *TINY_VIT, "train.ckpt_every=2",
        "train.val_every=2", "data.train_limit=64", "data.val_limit=16", "train.val_batches=1"]


def _fail(cmd):
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0, f"{' '.join(map(str, cmd))} should have failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step rope run with checkpoints at steps 2 and 4 (copied by each test before it changes it)."""
    out = tmp_path_factory.mktemp("base") / "run"
    _run(BASE + ["train.steps=4", f"train.out_dir={out}"])
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# --------------------------------------------------------------------------- 1. no unpickling on resume
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # runs on torch.load(weights_only=False)


def _plant(ckpt: Path, marker: Path) -> None:
    """A crafted model-states file (a COMPLETE marker and RNG state beside it, as a real checkpoint has)."""
    ckpt.mkdir(parents=True)
    torch.save({"module": {}, "step": 2, "evil": _Payload(str(marker))}, ckpt / "mp_rank_00_model_states.pt")
    torch.save({"torch": torch.get_rng_state()}, ckpt / "rng_rank0.pt")
    (ckpt / "COMPLETE").write_text("2")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["explicit", "auto"])
def test_resume_refuses_checkpoints_that_unpickle_objects(tmp_path, how):
    out = tmp_path / "run"
    ckpt = out / "checkpoints" / "step_00000002"
    marker = tmp_path / "payload_ran"
    _plant(ckpt, marker)
    resume = "auto" if how == "auto" else str(ckpt)
    r = _fail(BASE + ["train.steps=4", f"train.out_dir={out}", f"train.resume={resume}"])
    assert not marker.exists(), "the checkpoint's payload ran"
    assert "refusing to load" in r.stderr and "mp_rank_00_model_states.pt" in r.stderr
    assert "Traceback" not in r.stderr  # one clear paragraph


def test_safe_loading_reads_vlpe_checkpoints_and_refuses_pickled_objects(tmp_path):
    from train.checkpoint import CheckpointError, safe_load

    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}, "step": 3, "ds_version": "0.19", "shapes": [torch.Size([2])]}, good)
    assert safe_load(good)["step"] == 3
    bad = tmp_path / "bad.pt"
    torch.save({"x": _Payload(str(tmp_path / "ran"))}, bad)
    with pytest.raises(CheckpointError, match="refusing to load"):
        safe_load(bad)
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_zero_stage_2_checkpoints_resume_through_the_safe_loader(tmp_path):
    out = tmp_path / "run"
    _run(BASE + ["train.steps=2", "train.zero_stage=2", f"train.out_dir={out}"])
    r = _run(BASE + ["train.steps=3", "train.zero_stage=2", f"train.out_dir={out}", "train.resume=auto"])
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout


# --------------------------------------------------------------------------- 5. a changed model is refused
@pytest.mark.slow
def test_resume_refuses_a_changed_model(finished, tmp_path):
    out = _copy(finished, tmp_path)
    r = _fail(BASE + ["train.steps=6", f"train.out_dir={out}", "train.resume=auto", "model.encoding=lookhere"])
    assert "model.encoding" in r.stderr and "'rope'" in r.stderr and "'lookhere'" in r.stderr


@pytest.mark.slow
def test_eval_refuses_a_run_whose_model_config_was_edited(finished, tmp_path):
    from eval.runs import load_run

    out = _copy(finished, tmp_path)
    assert load_run(out, script="vit").cfg.model.encoding == "rope"
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["model"]["encoding"] = "lookhere"  # parameter-free like rope: the weights alone cannot tell
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(ValueError, match=r"model\.encoding.*'rope'.*'lookhere'|model\.encoding.*'lookhere'.*'rope'"):
        load_run(out, script="vit")


# --------------------------------------------------------------------------- 6. each step logged once
@pytest.mark.slow
def test_metrics_log_each_step_once_after_a_resume(finished, tmp_path):
    out = _copy(finished, tmp_path)
    # the run "crashed" after logging step 4 but before its step-4 checkpoint became complete
    (out / "checkpoints" / "step_00000004" / "COMPLETE").unlink()
    r = _run(BASE + ["train.steps=4", f"train.out_dir={out}", "train.resume=auto"])
    assert "step_00000002" in r.stdout
    recs = _read_metrics(out)
    train_steps = [x["step"] for x in recs if x["split"] == "train"]
    val_steps = [x["step"] for x in recs if x["split"] == "val"]
    assert train_steps == [1, 2, 3, 4] and val_steps == [2, 4]


# --------------------------------------------------------------------------- 7. mistakes are errors
def test_zero_validation_batches_or_images_are_config_errors():
    from train.vit_setup import ViTConfig, build_datasets

    with pytest.raises(ConfigError, match="val_batches"):
        TrainSection(val_batches=0)
    with pytest.raises(ConfigError, match="val_limit"):
        load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["data.val_limit=0"])
    cfg = load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["data.dataset=digits", "data.val_limit=1"])
    assert len(build_datasets(cfg.data)[1]) == 1


def test_an_empty_validation_set_is_an_error_not_accuracy_zero():
    from train.tasks import evaluate_classification
    from train.vlm import evaluate_answers

    with pytest.raises(ValueError, match="no validation"):
        evaluate_classification(torch.nn.Identity(), [], torch.device("cpu"), to_device=lambda b, d: b)
    with pytest.raises(ValueError, match="no validation"):
        evaluate_answers(torch.nn.Identity(), [], torch.device("cpu"))


def test_unknown_deepspeed_keys_are_errors_listing_a_suggestion():
    train = TrainSection(micro_batch=4)
    with pytest.raises(ConfigError, match=r"deepspeed: unknown key 'gradiant_clipping'.*'gradient_clipping'"):
        deepspeed_config(train, {"gradiant_clipping": 1.0}, world=1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="stagee"):
        deepspeed_config(train, {"zero_optimization": {"stagee": 1}}, world=1, device=torch.device("cpu"))
    cfg = deepspeed_config(train, {"gradient_clipping": 0.5, "wall_clock_breakdown": True, "bf16": {"enabled": False}},
                           world=1, device=torch.device("cpu"))
    assert cfg["gradient_clipping"] == 0.5


def test_an_empty_out_dir_is_a_config_error():
    with pytest.raises(ConfigError, match="out_dir"):
        TrainSection(out_dir="")
    with pytest.raises(ConfigError, match="out_dir"):
        TrainSection(out_dir="  ")


def test_an_out_dir_under_a_file_is_a_config_error(tmp_path):
    from train.engine import check_out_dir

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"out_dir.*file"):
        check_out_dir(blocker / "run")
    with pytest.raises(ConfigError, match=r"out_dir.*file"):
        check_out_dir(blocker)
    check_out_dir(tmp_path / "new" / "run")  # not existing yet: fine


@pytest.mark.slow
def test_resuming_past_the_configured_steps_is_an_error(finished, tmp_path):
    out = _copy(finished, tmp_path)
    r = _fail(BASE + ["train.steps=2", f"train.out_dir={out}", "train.resume=auto"])
    assert "train.steps=2" in r.stderr and "step 4" in r.stderr


# --------------------------------------------------------------------------- 9. damaged checkpoints
@pytest.mark.slow
def test_a_truncated_checkpoint_falls_back_to_the_previous_one(finished, tmp_path):
    out = _copy(finished, tmp_path)
    states = out / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    # named explicitly, the damaged checkpoint is an error that says which file
    r = _fail(BASE + ["train.steps=6", f"train.out_dir={out}", f"train.resume={states.parent}"])
    assert "mp_rank_00_model_states.pt" in r.stderr and "Traceback" not in r.stderr
    # found by resume=auto, it is skipped with a warning for the previous complete checkpoint
    r = _run(BASE + ["train.steps=4", f"train.out_dir={out}", "train.resume=auto"])
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout
    assert "step_00000004" in r.stderr and "mp_rank_00_model_states.pt" in r.stderr  # the warning says why


@pytest.mark.slow
def test_a_missing_rng_file_is_reported(finished, tmp_path):
    out = _copy(finished, tmp_path)
    (out / "checkpoints" / "step_00000004" / "rng_rank0.pt").unlink()
    r = _fail(BASE + ["train.steps=6", f"train.out_dir={out}", f"train.resume={out / 'checkpoints' / 'step_00000004'}"])
    assert "rng_rank0.pt" in r.stderr and "Traceback" not in r.stderr
    r = _run(BASE + ["train.steps=4", f"train.out_dir={out}", "train.resume=auto"])
    assert "step_00000002" in r.stdout and "rng_rank0.pt" in r.stderr


def test_resume_checks_the_checkpoint_before_loading_it(tmp_path):
    from train.checkpoint import checkpoint_problem

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    assert "COMPLETE" in checkpoint_problem(ckpt, world=1)
    (ckpt / "COMPLETE").write_text("2")
    assert "model_states" in checkpoint_problem(ckpt, world=1)
    torch.save({"module": {}}, ckpt / "mp_rank_00_model_states.pt")
    assert "rng_rank0.pt" in checkpoint_problem(ckpt, world=1)
    torch.save({"torch": torch.get_rng_state()}, ckpt / "rng_rank0.pt")
    assert checkpoint_problem(ckpt, world=1) is None
    assert "rng_rank1.pt" in checkpoint_problem(ckpt, world=2)
    (ckpt / "rng_rank0.pt").write_bytes(b"")
    assert "rng_rank0.pt" in checkpoint_problem(ckpt, world=1)


def _written_by(ckpt: Path, ranks: int, *, zero: bool = True, partitions: int | None = None) -> Path:
    """A complete checkpoint directory under the file names DeepSpeed (ZeRO-1/2: one optimizer partition per rank)
    and this harness (one RNG state per rank) give it when ``ranks`` ranks write it; tiny archives in every file."""
    ckpt.mkdir(parents=True)
    torch.save({"module": {}}, ckpt / "mp_rank_00_model_states.pt")
    for r in range(ranks):
        torch.save({"torch": torch.get_rng_state()}, ckpt / f"rng_rank{r}.pt")
    for r in range(ranks if partitions is None else partitions) if zero else ():
        torch.save({"optimizer_state_dict": {}}, ckpt / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (ckpt / "COMPLETE").write_text(ckpt.name)
    return ckpt


@pytest.mark.filterwarnings("ignore:.*records no model signature")
def test_zero_checkpoints_of_another_number_of_ranks_are_refused_naming_both(tmp_path):
    """ZeRO partitions load only into as many processes as wrote them: refused before DeepSpeed's load raises, for
    an explicit checkpoint and under auto (not skipped as damaged: the older ones share the run's number of ranks)."""
    from train.checkpoint import CheckpointError, checkpoint_problem
    from train.engine import _resume_checkpoint

    def resume(ckpt: Path, world: int, how: str = "auto") -> Path | None:
        return _resume_checkpoint(TrainSection(steps=6, resume=str(ckpt) if how == "explicit" else how),
                                  ckpt.parent, world=world, rank=0, signature={})  # fmt: skip

    two = _written_by(tmp_path / "two" / "step_00000004", 2)
    _written_by(tmp_path / "two" / "step_00000002", 2)
    one = _written_by(tmp_path / "one" / "step_00000004", 1)
    for ckpt, world, written, now in ((two, 1, "written by 2 ranks", "this run has 1 process;"),
                                      (one, 2, "written by 1 rank ", "this run has 2 processes")):  # fmt: skip
        for how in ("auto", "explicit"):
            with pytest.raises(CheckpointError, match=f"cannot resume: {ckpt} was written by") as e:
                resume(ckpt, world, how)
            assert written in str(e.value) and now in str(e.value), str(e.value)
    assert "--num_gpus 2" in str(pytest.raises(CheckpointError, resume, two, 1).value)
    assert resume(two, 2) == two and resume(one, 1) == one  # the same number of processes resumes
    stage0 = _written_by(tmp_path / "stage0" / "step_00000004", 2, zero=False)
    assert resume(stage0, 1) == stage0  # no partitions (ZeRO stage 0): any number of processes loads it
    lost = _written_by(tmp_path / "lost" / "step_00000004", 2, partitions=1)  # a partition file missing: damaged
    assert "partitions of ranks [0] but the RNG states of ranks [0, 1]" in checkpoint_problem(lost, world=2)
    assert "partitions of ranks [0]" in checkpoint_problem(lost, world=1)
    with pytest.raises(CheckpointError, match="cannot resume from .*partitions of ranks"):
        resume(lost, 1, "explicit")


def test_model_signature_differences_name_both_values():
    from train.checkpoint import signature_differences

    a = {"script": "vit", "model": {"encoding": "rope", "depth": 4}, "num_classes": 10}
    b = {"script": "vit", "model": {"encoding": "lookhere", "depth": 4}, "num_classes": 10}
    assert signature_differences(a, a) == []
    diffs = signature_differences(a, b)
    assert diffs == ["model.encoding: 'rope' (recorded) vs 'lookhere' (now)"]
    assert json.loads(json.dumps(a)) == a


@pytest.mark.slow
@pytest.mark.parametrize("content,what", [("[1, 2]", "must hold a JSON mapping"), ("{cut", "cannot read")])
def test_resume_from_a_checkpoint_whose_signature_is_damaged_names_it(finished, tmp_path, content, what):
    """The resume reads a checkpoint's model.json with the exports' check (train.checkpoint.read_signature)."""
    from train.checkpoint import CheckpointError
    from train.engine import _resume_checkpoint

    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step_00000004"
    (ckpt / "model.json").write_text(content)
    with pytest.raises(CheckpointError, match=what) as e:
        _resume_checkpoint(TrainSection(steps=6, resume=str(ckpt)), out / "checkpoints", world=1, rank=0,
                           signature={})  # fmt: skip
    assert str(ckpt / "model.json") in str(e.value)
