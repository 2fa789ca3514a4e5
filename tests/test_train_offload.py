"""ZeRO-Offload as DeepSpeed users write it (``deepspeed.zero_optimization.offload_optimizer.device=cpu``, with
``offload_param`` at ZeRO-3): the training loop steps DeepSpeed's CPU Adam, which DeepSpeed requires there, and it
follows the update rule of the torch AdamW used otherwise. The 2-rank launches that train with offload at ZeRO-2
and ZeRO-3 are cases of ``tests/test_finetune_launch.py::test_fine_tune_on_two_ranks_exports_a_stock_folder``.

The CPU Adam compiles a CPU op on its first use on a machine (about two minutes), hence ``slow``.
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
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(1, 3, 8))  # no decay (by name)
        self.proj = nn.Linear(8, 8)  # weight: decay; bias: no decay
        self.norm = nn.LayerNorm(8)  # no decay

    def forward(self, x):
        return self.norm(self.proj(x + self.pos_embed)).square().mean()


class _TinyParts(_Tiny):
    """Groups of its own, with a learning rate per group (as the fine-tune's ``train.lr_parts``)."""

    def split_groups(self, decay, no_decay, weight_decay):
        return [{"params": decay, "weight_decay": weight_decay, "lr": 1e-1, "part": "proj"},
                {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3, "part": "rest"}]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", [_Tiny, _TinyParts])
def test_offloaded_optimizer_is_cpu_adam_following_torch_adamw(kind):
    """Same groups and hyper-parameters as torch's AdamW (a learning rate per group included), and the same updates
    under the cosine schedule: with a large weight decay, Adam's L2 form (``adamw_mode=False``), a dropped schedule
    or a group's own rate replaced by ``train.lr`` would be far off."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from train.engine import build_optimizer, cosine_schedule, param_groups
    from train.launch import TrainSection

    train = TrainSection(lr=3e-2, min_lr=1e-3, warmup_steps=2, steps=6, weight_decay=0.5)
    torch.manual_seed(0)
    model = kind()
    reference = kind()
    reference.load_state_dict(model.state_dict())
    plain = build_optimizer(model, train, {"zero_optimization": {"stage": 2}})
    assert type(plain) is torch.optim.AdamW
    opt = build_optimizer(model, train, OFFLOAD)
    assert isinstance(opt, DeepSpeedCPUAdam)
    assert build_optimizer(model, train, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                          "nvme_path": "/tmp"}}}).__class__ is DeepSpeedCPUAdam  # fmt: skip
    want = param_groups(model, train.weight_decay)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in g["params"]] for g in want]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    rates = [1e-1, 3e-3] if kind is _TinyParts else [train.lr, train.lr]
    assert [g["lr"] for g in opt.param_groups] == rates
    for g in opt.param_groups:
        assert (g["betas"], g["eps"]) == ((0.9, 0.999), 1e-8)

    ref_opt = torch.optim.AdamW(
        [{"params": [reference.proj.weight], "weight_decay": 0.5, "lr": rates[0]},
         {"params": [reference.pos_embed, reference.proj.bias, reference.norm.weight, reference.norm.bias],
          "weight_decay": 0.0, "lr": rates[1]}], lr=train.lr, betas=(0.9, 0.999), eps=1e-8,
    )  # fmt: skip
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, cosine_schedule(train)) for o in (opt, ref_opt)]
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(train.steps):  # the same gradients for both (Adam magnifies any difference in tiny ones)
        grads = [torch.randn_like(p) for p in model.parameters()]
        for m, o, s in zip((model, reference), (opt, ref_opt), schedules):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
            o.step()
            s.step()
    for (name, a), b, a0 in zip(model.named_parameters(), reference.parameters(), start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs from torch AdamW")
        assert (a - a0).abs().max() > 1e-3, f"{name} did not move"


POINTS = ["train/points.py", "--config", "configs/points_pape_ri.yaml", "data.samples_per_class=2",
          "data.num_points=128", "model.num_groups=16", "model.group_size=8", "model.depth=2", "train.micro_batch=4",
          "train.val_batches=1", "train.progress=false", "train.steps=4", "train.val_every=4", "train.ckpt_every=2",
          "train.log_every=1", "train.lr=1e-2", "train.warmup_steps=1", "train.zero_stage=3",
          "deepspeed.zero_optimization.offload_optimizer.device=cpu",
          "deepspeed.zero_optimization.offload_param.device=cpu"]  # fmt: skip


def _run(*args):
    r = subprocess.run([sys.executable, *POINTS, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_offloaded_checkpoint_resumes(tmp_path):
    """A ZeRO-3 run with optimizer and parameters offloaded, resumed from its step-2 checkpoint, ends where the
    uninterrupted run ends, each step logged once. Within float rounding, not bit for bit: DeepSpeed's CPU Adam
    keeps its bias corrections as running products, which a resumed optimizer recomputes as powers (a few 1e-6
    here, where a resume that lost the optimizer state is off by about 1e-2)."""
    from safetensors.torch import load_file

    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    r = _run(f"train.out_dir={ref}")
    assert r.stdout.count("[train] ZeRO-Offload: optimizer state on cpu (optimizer DeepSpeedCPUAdam), parameters "
                          "on cpu") == 1, r.stdout[-2000:]  # fmt: skip
    shutil.copytree(ref, resumed)  # the same run, cut back to its step-2 checkpoint
    shutil.rmtree(resumed / "checkpoints/step_00000004")
    (resumed / "model.safetensors").unlink()
    r = _run(f"train.out_dir={resumed}", "train.resume=auto")
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout, r.stdout[-2000:]
    a, b = load_file(ref / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-5, msg=f"{k} differs after resume")
    recs = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if x["split"] == "train"] == [1, 2, 3, 4]
