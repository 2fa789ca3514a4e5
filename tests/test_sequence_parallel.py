"""Ulysses sequence parallelism of the Qwen-VL fine-tune (``train.sequence_parallel``, train/sequence_parallel.py).

- The grid (one 2-rank launch of tests/sequence_parallel_grid.py): SP=2 against whole rows (SP=1) on the same
  batches of real mp4 / PNG samples, for mrope, mrope_i, videorope, hope_video, v2pe, vrope, mhrope on Qwen2-VL,
  Qwen2.5-VL (the processor's real ``second_per_grid_ts``) and Qwen3-VL (deepstack), packed and padded, plus eager
  attention and LoRA: the same loss at each of 3 SGD steps and the same gradients after step 1 (fp32, to rounding).
  The first batch of every configuration has a row of odd length (padded to the shards) and a video block that
  straddles the shard boundary. Planted bugs (ids cut along the wrong dim, labels not shifted) fail the comparison.
- End to end (``deepspeed train/vlm.py``, packed, gradient checkpointing, vision frozen): SP=2 on 2 ranks at ZeRO-3
  logs the losses of a one-rank SP=1 run of the same samples, and SP=2 on 4 ranks at ZeRO-2 (two data-parallel
  groups) those of a 2-rank SP=1 run; resuming the ZeRO-3 run
  with the same N ends bit-identical to the uninterrupted run; a resume with another N is refused, naming
  ``sequence_parallel``.
- Refusals when the config is read: heads N does not divide, an uncovered attention implementation, a variant with
  its own per-layer mask (PyPE); by the command line before the process group starts: N not dividing the world
  size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DS = str(Path(PY).parent / "deepspeed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
VARIANTS = ("mrope", "mrope_i", "videorope", "hope_video", "v2pe", "vrope", "mhrope")
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _port() -> int:
    from train.launch import _free_port

    return _free_port()


def grid(work: Path, *extra: str) -> list[dict]:
    out = work / f"grid{'_'.join(extra)}.json"
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           "tests/sequence_parallel_grid.py", str(work), str(out), *extra]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sp")


@pytest.mark.slow
def test_sequence_parallel_matches_whole_rows(work):
    results = grid(work)
    assert {(r["family"], r["variant"], r["packing"]) for r in results} == {
        (f, v, p) for f in FAMILIES for v in VARIANTS for p in (False, True)
    }
    assert any(r["attn"] == "eager" for r in results) and any(r["lora"] for r in results)
    for r in results:
        name = f"{r['family']} {r['variant']} packing={r['packing']} attn={r['attn']} lora={r['lora']}"
        assert r["straddles"] and r["odd"], name  # a padded row, a video block across the shard boundary
        assert len(r["losses"]) == 3, name
        for step, (whole, shards) in enumerate(r["losses"]):
            assert shards == pytest.approx(whole, rel=5e-5), f"{name} step {step + 1}"
        assert r["grad_diff"] <= 1e-5 * r["grad_scale"], name  # after step 1, fp32 rounding (seen: <= 1.3e-6)
        assert r["losses"][1][0] != r["losses"][0][0], name  # the steps trained


@pytest.mark.slow
def test_planted_bugs_fail_the_comparison(work):
    results = grid(work, "--plant", "ids_batch_dim,labels_unshifted")
    assert [r["plant"] for r in results] == ["ids_batch_dim", "labels_unshifted"]
    for r in results:
        worst = max(abs(b - a) / abs(a) for a, b in r["losses"])
        assert worst > 1e-2 and r["grad_diff"] > 1e-2 * r["grad_scale"], r


# -- end to end ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    from data.instruct import make_vniah_instruct
    from data.vniah import PHOTO_NEEDLES, QUESTIONS
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    w = tmp_path_factory.mktemp("sp_e2e")
    folder = save_tiny_qwen_vl("qwen2_5_vl", w / "tiny", texts=[QUESTIONS["needle"], *PHOTO_NEEDLES.values()],
                               frame=28, max_frame=56, layers=2)  # fmt: skip
    data = make_vniah_instruct(w / "set", train=16, val=4, frames=8, frame_size=56, image_every=4)
    return w, folder, data


def command(folder, data, out, *extra, ranks=2, zero=3):
    launch = [DS, "--num_gpus", str(ranks), "--master_port", str(_port())] if ranks > 1 else [PY]
    return [*launch, "train/vlm.py", "--config", "configs/hf/qwen2_5_vl.yaml", f"model.hf_model={folder}",
            f"data.annotations={data['train']}", f"data.val_annotations={data['val']}",
            f"data.media_root={data['media_root']}", "train.micro_batch=2", "train.grad_accum=1", "train.lr=2e-3",
            "train.warmup_steps=1", "train.steps=3", "train.log_every=1", "train.val_every=100", "train.val_batches=1",
            "train.ckpt_every=1", "train.keep_checkpoints=3", "train.num_workers=0", "train.progress=false",
            "data.max_frames=8", "data.packing=true", "model.variant=videorope", f"train.zero_stage={zero}",
            f"train.out_dir={out}", *extra]  # fmt: skip


def run(cmd, ok=True):
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    if ok:
        assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if json.loads(x)["split"] == "train"]


@pytest.mark.slow
def test_sequence_parallel_run_and_resume(e2e):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    w, folder, data = e2e
    a, b, c, d, e, f = (w / x for x in "abcdef")
    run(command(folder, data, a, "train.sequence_parallel=2"))
    run(command(folder, data, b, ranks=1))
    assert losses(a) == pytest.approx(losses(b), rel=1e-5)  # SP=2 on 2 ranks = SP=1 on one, every step
    # ZeRO-2 with two data-parallel groups of 2: 4 ranks at SP=2 = 2 ranks at SP=1 (the same samples per step)
    run(command(folder, data, e, "train.sequence_parallel=2", zero=2, ranks=4))
    run(command(folder, data, f, zero=2))
    assert losses(e) == pytest.approx(losses(f), rel=1e-5)
    # resume the SP=2 run from step 2 with the same N: bit-identical to the uninterrupted run
    for x in (c, d):
        (x / "checkpoints").mkdir(parents=True)
        for tag in ("step_00000001", "step_00000002"):
            shutil.copytree(a / "checkpoints" / tag, x / "checkpoints" / tag)
    run(command(folder, data, c, "train.sequence_parallel=2", "train.resume=auto"))
    assert losses(c) == losses(a)[2:]
    tag = "step_00000003"
    sa = get_fp32_state_dict_from_zero_checkpoint(str(a / "checkpoints"), tag=tag)
    sc = get_fp32_state_dict_from_zero_checkpoint(str(c / "checkpoints"), tag=tag)
    assert sa.keys() == sc.keys() and all(torch.equal(sa[k], sc[k]) for k in sa)
    # another N on the same checkpoint: refused, naming the key and both values
    r = run(command(folder, data, d, "train.sequence_parallel=1", "train.resume=auto"), ok=False)
    assert r.returncode != 0
    assert "sequence_parallel: 2 (recorded) vs '<absent>' (now)" in r.stdout + r.stderr


# -- refusals -----------------------------------------------------------------------------------------------------


def _load(*overrides):
    from train.config import load_config
    from train.vlm_setup import VLMConfig

    return load_config(VLMConfig, ROOT / "configs/hf/qwen2_vl.yaml", list(overrides))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.sequence_parallel=3"], "8 attention heads and 4 KV heads"),
        (["train.sequence_parallel=2", "model.attn_implementation=flash_attention_2"], "model.attn_implementation"),
        (["train.sequence_parallel=2", "model.variant=pype"], "model.variant='pype'"),
        (["train.sequence_parallel=0"], "train.sequence_parallel must be"),
    ],
)
def test_refused_when_the_config_is_read(tiny_qwen_vl, overrides, words):
    from train.config import ConfigError

    folder = tiny_qwen_vl("qwen2_vl")
    with pytest.raises(ConfigError) as e:
        _load(f"model.hf_model={folder}", "data.annotations=x.json", *overrides)
    assert words in str(e.value)


def test_world_size_refused_by_the_command_line(tiny_qwen_vl, monkeypatch):
    import deepspeed

    from train.cli import parse
    from train.config import ConfigError
    from train.vlm_setup import VLMConfig

    def started(*args, **kwargs):
        raise AssertionError("the process group started before the configuration was checked")

    monkeypatch.setattr(deepspeed, "init_distributed", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.setenv("WORLD_SIZE", "3")
    argv = ["--config", str(ROOT / "configs/hf/qwen2_vl.yaml"), f"model.hf_model={tiny_qwen_vl('qwen2_vl')}",
            "data.annotations=x.json", "train.sequence_parallel=2"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2 must divide the number of processes \(3\)"):
        parse(VLMConfig, argv)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse(VLMConfig, argv)[0].train.sequence_parallel == 2


def test_small_vlm_and_world_size_refusals():
    from train.config import ConfigError
    from train.sequence_parallel import check_world

    with pytest.raises(ConfigError, match="applies to fine-tuning a checkpoint folder"):
        from train.config import load_config
        from train.vlm_setup import VLMConfig

        load_config(VLMConfig, None, ["train.sequence_parallel=2"])
    with pytest.raises(ConfigError, match=r"must divide the number of processes \(3\)"):
        check_world(2, 3)
    check_world(2, 4)
