"""TensorBoard through DeepSpeed's own monitor: a short ``train/vit.py`` run with ``deepspeed.tensorboard.enabled``
(from a ``--deepspeed_config`` file: in the middle of a one-process command line, and ``--deepspeed_config=FILE`` at
the end of a 2-rank ``deepspeed`` launch) writes event files under ``<out_dir>/tensorboard`` whose loss, lr,
throughput and validation scalars equal the ``metrics.jsonl`` records, and the script ends by printing where the
weights went."""

from __future__ import annotations

import json

import pytest

from test_train import DS, PY, TINY_VIT, _read_metrics, _run

pytest.importorskip("tensorboard")


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["python", "deepspeed_2_ranks"])
def test_tensorboard_events_equal_the_jsonl_and_the_weights_path_is_printed(launch, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train.launch import _free_port

    out = tmp_path / "run"
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"tensorboard": {"enabled": True}}))
    common = [*TINY_VIT, "data.train_limit=64", "data.val_limit=16", "train.val_batches=1", "train.steps=4",
              "train.val_every=2", "train.ckpt_every=4", f"train.out_dir={out}"]  # fmt: skip
    if launch == "python":
        cmd = [PY, "train/vit.py", "--config", "configs/vit_rope.yaml", "--deepspeed_config", str(ds), *common]
    else:
        cmd = [DS, "--num_gpus", "2", "--master_port", str(_free_port()), "train/vit.py", "--config",
               "configs/vit_rope.yaml", *common, f"--deepspeed_config={ds}"]  # fmt: skip
    r = _run(cmd)
    weights = (out / "model.safetensors").resolve()
    final = (out / "checkpoints" / "step_00000004").resolve()
    assert weights.is_file() and final.is_dir()
    assert f"weights: {weights}" in r.stdout and str(final) in r.stdout

    logdir = out / "tensorboard"  # what the README tells to open: tensorboard --logdir <out_dir>/tensorboard
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = _read_metrics(out)
    train = [rec for rec in records if rec["split"] == "train"]
    val = [rec for rec in records if rec["split"] == "val"]
    assert [rec["step"] for rec in train] == [1, 2, 3, 4] and [rec["step"] for rec in val] == [2, 4]
    for split, recs, keys in (("train", train, ("loss", "lr", "samples_per_s", "tokens_per_s")),
                              ("val", val, ("acc", "loss"))):  # fmt: skip
        for key in keys:
            tag = f"{split}/{key}"
            assert tag in tags, f"{tag} missing from {sorted(tags)}"
            events = acc.Scalars(tag)
            assert [e.step for e in events] == [rec["step"] for rec in recs]
            for e, rec in zip(events, recs):  # TensorBoard keeps float32
                assert e.value == pytest.approx(rec[key], rel=1e-6, abs=1e-12), (tag, e.step)
