"""The main job (eval/demo.py) end to end with tiny settings (slow: real training runs, one under DeepSpeed).

What is checked: the job trains a ViT and the VLM (through the ``deepspeed`` launcher), evaluates them beyond the
training resolution / length, fine-tunes a tiny Qwen2-VL folder (2 ranks) and evaluates its export under the
recorded variant, writes the tables, plots and timing; the evaluations are those of the exported
runs (re-evaluated independently here); a second invocation reuses the finished runs and evaluations (the exports
are not rewritten), and ``--fresh`` trains again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]

import demo  # noqa: E402

FASHION = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")


def tiny_args(out: Path) -> list[str]:
    return [
        "--out", str(out), "--vit", "rope", "--vit-steps", "2",
        "--vit-override", "model.preset=nano", "data.train_limit=128", "data.val_limit=16", "train.val_batches=1",
        "train.micro_batch=16",
        "--vlm-steps", "2",
        "--vlm-override", "model.num_layers=1", "model.vision_depth=1", "data.frames=4", "data.train_samples=16",
        "data.val_samples=4", "train.micro_batch=4", "train.val_batches=1", "train.num_workers=0",
        "--ratios", "1", "2", "--limit", "8", "--lengths", "2", "4", "8", "--depths", "0", "1", "--samples", "1",
        "--finetune-steps", "3", "--finetune-samples", "8",
        "--no-properties", "--no-progress",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.exists(), reason="needs Debian dataset-fashion-mnist")
def test_demo_trains_evaluates_and_resumes(tmp_path, capfd):
    import long_video
    import resolution

    out = tmp_path / "demo"
    assert demo.main(tiny_args(out)) == 0
    first = capfd.readouterr().out
    vit, vlm = out / "runs" / "vit_rope", out / "runs" / "vlm_mrope_i"
    for f in (vit / "model.safetensors", vlm / "model.safetensors", out / "resolution" / "resolution.png",
              out / "resolution" / "resolution.md", out / "long_video" / "heatmap_vlm_mrope_i.png",
              out / "long_video" / "long_video.md", out / "timing.json"):  # fmt: skip
        assert f.is_file(), f
    assert "# Resolution extrapolation" in first and "V-NIAH-D, teacher-forced" in first
    assert "[demo] summary" in first and "launcher deepspeed" in first
    # the fine-tuned Qwen2-VL: a stock-loadable folder with its variant recorded, evaluated under it
    export = out / "finetune" / "run" / "hf"
    assert json.loads((export / "config.json").read_text())["vlpe"]["variant"] == "mrope_i"
    ft = json.loads((out / "finetune" / "long_video" / "long_video.json").read_text())["runs"][0]
    assert ft["variant"] == "mrope_i" and ft["lengths"] == [8, 16, 32] and "Qwen2-VL fine-tuned with mrope_i" in first
    # the saved evaluations are those of the exported runs
    saved = json.loads((out / "resolution" / "resolution.json").read_text())["runs"][0]
    again = resolution.evaluate_run(vit, [1, 2], limit=8, device="cpu", progress=False)
    assert [r["acc"] for r in saved["results"]] == [r["acc"] for r in again["results"]]
    assert [r["size"] for r in saved["results"]] == [28, 56]
    lv = json.loads((out / "long_video" / "long_video.json").read_text())["runs"][0]
    assert lv["lengths"] == [2, 4, 8] and lv["train_frames"] == 4
    ev = long_video.evaluate_run(vlm, [2, 4, 8], [0.0, 1.0], samples_per_cell=1, tasks=["v_niah"],
                                 scorings=["teacher"], progress=False)  # fmt: skip
    assert ev["tasks"]["v_niah"]["teacher"]["grid"] == lv["tasks"]["v_niah"]["teacher"]["grid"]

    # a second run reuses everything; --fresh trains again
    stamps = {p: p.stat().st_mtime_ns for p in (vit / "model.safetensors", vlm / "model.safetensors")}
    assert demo.main(tiny_args(out)) == 0
    second = capfd.readouterr().out
    assert second.count("[demo] reusing") == 6  # two runs, two evaluations, the fine-tune and its evaluation
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert demo.main(tiny_args(out) + ["--fresh", "--no-vlm"]) == 0
    assert (vit / "model.safetensors").stat().st_mtime_ns != stamps[vit / "model.safetensors"]
