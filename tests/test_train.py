"""Training infrastructure: configs, data order, DeepSpeed launches (2 CPU ranks, gloo) and resume after kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train.config import ConfigError, load_config
from train.engine import ResumableBatchSampler, SeededDataset, TrainSection, deepspeed_config

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DS = str(Path(PY).parent / "deepspeed")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# --------------------------------------------------------------------------- configs
def _config_classes():
    from models.points import points_from_config as build_points
    from train.points_setup import PointsConfig
    from models.vit import vit_from_config as build_vit
    from train.vit_setup import ViTConfig

    return {"vit_": (ViTConfig, build_vit), "points_": (PointsConfig, build_points)}


@pytest.mark.parametrize(
    "path", sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p.name.startswith(("vit_", "points_")))
)
def test_every_config_loads_and_builds_its_model(path):
    for prefix, (cls, build) in _config_classes().items():
        if path.startswith(prefix):
            cfg = load_config(cls, ROOT / "configs" / path)
            model = build(cfg, 10)
            assert model.encoder.encoding_name == cfg.model.encoding
            full = ROOT / "configs" / "full" / path
            assert full.is_file(), f"configs/full/{path} (the GPU-sized variant) is missing"
            load_config(cls, full)


def test_config_typos_and_types_are_errors_listing_valid_keys():
    from train.vit_setup import ViTConfig

    with pytest.raises(ConfigError, match=r"unknown key 'stepz' \(did you mean 'steps'\?\); valid keys: steps"):
        load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["train.stepz=3"])
    with pytest.raises(ConfigError, match="unknown key 'modle'"):
        load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["modle.encoding=rope"])
    with pytest.raises(ConfigError, match="expected int"):
        load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["train.steps=many"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["model.readout=mean"])
    cfg = load_config(ViTConfig, ROOT / "configs/vit_rope.yaml", ["train.steps=7", "model.encoding_options.theta=10"])
    assert cfg.train.steps == 7 and cfg.model.encoding_options == {"theta": 10}


def test_deepspeed_batch_inconsistency_is_one_clear_line():
    train = TrainSection(micro_batch=4, grad_accum=2)
    cfg = deepspeed_config(train, {}, world=2, device=torch.device("cpu"))
    assert cfg["train_batch_size"] == 16 and "torch_autocast" not in cfg  # fp32 on CPU
    with pytest.raises(ConfigError) as e:
        deepspeed_config(train, {"train_batch_size": 12}, world=2, device=torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "4 x grad_accum 2 x world size 2 = 16" in msg
    gpu = deepspeed_config(train, {}, world=1, device=torch.device("cuda"))
    assert gpu["torch_autocast"]["enabled"]  # bf16 autocast on GPU; parameters stay fp32


# --------------------------------------------------------------------------- data order
def _stream(start, total, rank=0, world=1):
    s = ResumableBatchSampler(10, micro_batch=4, rank=rank, world=world, seed=3, start=start, total=total)
    return list(s)


def test_seeded_dataset_items_depend_only_on_their_seed_and_leave_the_caller_rng_alone():
    """A micro-batch fetched at once (``__getitems__``) gives each item what it gives alone, every RNG seeded from
    its seed, and the caller's torch / numpy / Python RNG states are as before."""
    import random

    import numpy as np

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i, torch.rand(2), float(np.random.rand()), random.random()

    ds = SeededDataset(Noisy())
    items = [(3, 11), (5, 12), (3, 11)]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    batch = ds.__getitems__(items)
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]
    alone = [ds[item] for item in items]
    for a, b in zip(batch, alone):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2:] == b[2:]
    assert torch.equal(batch[0][1], batch[2][1]) and not torch.equal(batch[0][1], batch[1][1])
    torch.manual_seed(11)
    assert torch.equal(batch[0][1], torch.rand(2))  # the CPU generator seeded as torch.manual_seed seeds it


def test_sampler_resumes_exactly_and_partitions_ranks():
    full = _stream(0, 9)
    assert _stream(5, 9) == full[5:]  # resuming at micro step 5 yields exactly the rest
    # every epoch of 10 samples is a permutation
    idx = [i for b in full for i, _ in b][:10]
    assert sorted(idx) == list(range(10))
    # two ranks see disjoint halves of the same global batch
    r0, r1 = _stream(0, 3, 0, 2), _stream(0, 3, 1, 2)
    for a, b in zip(r0, r1):
        assert not {s for _, s in a} & {s for _, s in b}


# --------------------------------------------------------------------------- launches
TINY_VIT = [
    "model.preset=nano",
    "data.train_limit=256",
    "data.val_limit=64",
    "train.micro_batch=8",
    "train.val_batches=2",
    "train.log_every=1",
    "train.progress=false",
]


def _run(cmd, **kw):
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _read_metrics(out: Path):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,config,extra",
    [
        ("train/vit.py", "configs/vit_lookhere.yaml", TINY_VIT),
        (
            "train/points.py",
            "configs/points_pape_ri.yaml",
            ["data.samples_per_class=2", "data.num_points=128", "model.num_groups=16", "model.group_size=8",
             "model.depth=2", "train.micro_batch=4", "train.val_batches=1", "train.progress=false"],
        ),
    ],
)
def test_two_rank_deepspeed_smoke(tmp_path, script, config, extra):
    out = tmp_path / "run"
    from train.launch import SHM_FOLDER, _free_port  # parallel test workers must not share the launcher's default port

    port = _free_port()
    _run([DS, "--num_gpus", "2", "--master_port", str(port), script, "--config", config, *extra, "train.steps=3",
          "train.val_every=3", "train.ckpt_every=3", f"train.out_dir={out}"])
    assert (out / "model.safetensors").is_file() and (out / "checkpoints/step_00000003/COMPLETE").is_file()
    # DeepSpeed's CPU all-reduce segments (66 MB of RAM per rank) do not outlive the launch
    assert not list(SHM_FOLDER.glob(f"deepspeed_allreduce_buffer_*_{port}_*")), "shared memory left in /dev/shm"
    recs = _read_metrics(out)
    assert [r["step"] for r in recs if r["split"] == "train"][-1] == 3
    assert any(r["split"] == "val" for r in recs)


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    """kill -9 mid-run, restart with train.resume=auto: the final weights equal an uninterrupted run."""
    from safetensors.torch import load_file

    common = [PY, "train/vit.py", "--config", "configs/vit_rope.yaml", *TINY_VIT, "train.steps=10",
              "train.ckpt_every=3", "train.val_every=100", "model.drop_path_rate=0.1"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    _run(common + [f"train.out_dir={ref}"])

    proc = subprocess.Popen(common + [f"train.out_dir={killed}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints/step_00000006/COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the run never reached its step-6 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "model.safetensors").exists(), "the run finished before it could be killed"
    # a half-written newer checkpoint (no COMPLETE marker) must never be picked
    (killed / "checkpoints/step_00000009").mkdir(exist_ok=True)

    r = _run(common + [f"train.out_dir={killed}", "train.resume=auto"])
    assert "resumed from" in r.stdout and "step_00000006" in r.stdout
    a, b = load_file(ref / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{k} differs after resume")

