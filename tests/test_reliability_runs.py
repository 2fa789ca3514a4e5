"""Run-level reliability: one run per ``out_dir`` (a second launch is refused naming the holder; a run killed with
``kill -9`` leaves nothing that blocks its resume), a micro-batch made only of corrupt images is skipped and
counted instead of killing the run, and a tampered export (its ``vlpe.model`` metadata not JSON, not a mapping or
removed, a checkpoint's ``model.json`` not a mapping, a damaged header) is an error naming the file.

Checked against ``train/vit.py`` launches (``tests/test_train.py``'s commands), ``train.lock``'s lock file as another
process holds it, ``eval.runs.load_run`` (what the evaluations call) and ``train.checkpoint.check_export`` on
exports written with ``train.engine.export_weights`` the way ``train.engine.fit`` writes them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from test_train import ENV, PY, ROOT, TINY_VIT, _read_metrics, _run
from train.checkpoint import METADATA_KEY, CheckpointError, check_export, model_signature

TINY = [PY, "train/vit.py", "--config", "configs/vit_rope.yaml", *TINY_VIT, "data.train_limit=64",
        "data.val_limit=16", "train.val_batches=1"]  # fmt: skip


def _wait_for(what, *, proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        if proc.poll() is not None:
            raise AssertionError(f"the first run ended (rc {proc.returncode}) before it was ready:\n"
                                 f"{log.read_text()[-3000:]}")  # fmt: skip
        if time.monotonic() > end:
            raise AssertionError(f"the first run did not get ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- 1. one run per out_dir
def test_a_held_out_dir_is_refused_naming_the_holder_and_kill_9_frees_it(tmp_path):
    from train.lock import OutDirInUse, lock_out_dir

    out = tmp_path / "run"
    code = f"import time; from train.lock import lock_out_dir; lock_out_dir({str(out)!r}); " \
           f"print('held', flush=True); time.sleep(600)"  # fmt: skip
    before = time.time()
    holder = subprocess.Popen([PY, "-c", code, "--marker-arg"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutDirInUse) as e:
            lock_out_dir(out)
        msg = str(e.value)
        assert f"pid {holder.pid}" in msg and socket.gethostname() in msg and "--marker-arg" in msg
        started = json.loads((out / "run.lock").read_text())["started"]
        assert before <= started <= time.time()
        assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) in msg
        assert str(out) in msg and "\n" not in msg
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with lock_out_dir(out) as lock:  # the kernel released the killed holder's lock
        assert lock.held and lock.holder["pid"] == os.getpid()
        note = json.loads((out / "run.lock").read_text())
        assert note["pid"] == os.getpid() and note["host"] == socket.gethostname()
    assert not lock.held


def test_a_child_forked_by_the_holder_does_not_keep_the_lock_after_kill_9(tmp_path):
    """DataLoader workers are forked from the rank that holds the lock and may outlive it for a moment."""
    from train.lock import lock_out_dir

    out = tmp_path / "run"
    code = f"import os, time; from train.lock import lock_out_dir; lock_out_dir({str(out)!r}); " \
           "who = 'child' if os.fork() == 0 else 'parent'; " \
           "os.write(1, (who + ' ' + str(os.getpid()) + chr(10)).encode()); time.sleep(600)"  # fmt: skip
    holder = subprocess.Popen([PY, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    # one write(2) per process: print() under PYTHONUNBUFFERED writes its pieces one by one, and the two
    # processes' pieces interleaved on the pipe
    pids = dict(holder.stdout.readline().split() for _ in range(2))  # the child's line: it runs, past the fork
    child = int(pids["child"])
    try:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the forked child still runs
        lock_out_dir(out).release()
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_second_launch_on_a_running_out_dir_is_refused_and_resume_after_kill_9_works(tmp_path):
    from eval.runs import load_run

    out = tmp_path / "run"
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(TINY + ["train.steps=100000", "train.ckpt_every=4", "train.val_every=100000",
                                     f"train.out_dir={out}"], cwd=ROOT, env=ENV, stdout=log, stderr=log)  # fmt: skip
    try:
        # any complete checkpoint: a given one lives only until two newer ones exist (train.keep_checkpoints=2),
        # which a loaded machine's polling can miss
        _wait_for(lambda: any((out / "checkpoints").glob("step_*/COMPLETE")), proc=first, log=tmp_path / "first.log")
        second = subprocess.run(TINY + ["train.steps=4", f"train.out_dir={out}"], cwd=ROOT, env=ENV,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert first.poll() is None, "the first run ended while the second one ran"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        log.close()
    assert second.returncode != 0, f"the second launch was not refused:\n{second.stderr[-2000:]}"
    assert "in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert socket.gethostname() in second.stderr and "train/vit.py" in second.stderr
    assert "Traceback" not in second.stderr
    newest = max(int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/COMPLETE"))
    resumed = _run(TINY + [f"train.steps={newest + 2}", "train.ckpt_every=2", "train.val_every=2",
                           f"train.out_dir={out}", "train.resume=auto"])  # fmt: skip
    assert f"resumed from {out / 'checkpoints' / f'step_{newest:08d}'}" in resumed.stdout
    steps = [r["step"] for r in _read_metrics(out) if r["split"] == "train"]
    assert steps == list(range(1, newest + 3)), "each step is logged once, by one run"

    # 3 on the real run: its export re-saved without metadata and its config edited is refused, naming both
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(out / "model.safetensors")), str(out / "model.safetensors"))
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["model"]["encoding"] = "lookhere"
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(CheckpointError, match=r"model\.safetensors carries no model signature.*model\.encoding"):
        load_run(out, script="vit")


# --------------------------------------------------------------------------- 2. corrupt-only micro-batches
def _image_folder(root: Path, *, good: int, corrupt: int) -> list[bool]:
    """root/<cat|dog>/<k>.png, ``good`` readable images per class then ``corrupt`` unreadable ones in dog; returns,
    in ImageFolder's order (classes sorted, files sorted), whether each file is corrupt."""
    flags = []
    for cls, value in (("cat", 40), ("dog", 200)):
        (root / cls).mkdir(parents=True)
        for k in range(good):
            cv2.imwrite(str(root / cls / f"{k}.png"), np.full((12, 12, 3), value, np.uint8))
            flags.append(False)
    for k in range(good, good + corrupt):
        (root / "dog" / f"{k}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"truncated")
        flags.append(True)
    return flags


@pytest.mark.slow
def test_micro_batches_of_only_corrupt_images_are_skipped_and_counted(tmp_path):
    from train.data_order import ResumableBatchSampler

    train_bad = _image_folder(tmp_path / "data" / "train", good=3, corrupt=3)
    val_bad = _image_folder(tmp_path / "data" / "val", good=1, corrupt=2)
    steps, seed, val_batches = 10, 3, len(val_bad)
    out = tmp_path / "run"
    r = _run([PY, "train/vit.py", "--config", "configs/vit_rope.yaml", "model.preset=nano", "data.dataset=folder",
              f"data.root={tmp_path / 'data'}", "data.img_size=8", "data.channels=3", "model.patch_size=4",
              "train.micro_batch=1", f"train.steps={steps}", f"train.seed={seed}", f"train.val_every={steps}",
              f"train.ckpt_every={steps}", f"train.val_batches={val_batches}", "train.log_every=1",
              "train.progress=false", f"train.out_dir={out}"])  # fmt: skip
    assert "skipping image" in r.stderr
    # the run's data order (one (index, sample seed) per micro-batch), as fit draws it
    order = [b[0][0] for b in ResumableBatchSampler(len(train_bad), micro_batch=1, rank=0, world=1, seed=seed, start=0,
                                                 total=steps)]  # fmt: skip
    expected = np.cumsum([train_bad[i] for i in order]).tolist()
    assert expected[-1] > 0, "the data order draws no corrupt image: the test shows nothing"
    records = _read_metrics(out)
    train = [x for x in records if x["split"] == "train"]
    assert [x["step"] for x in train] == list(range(1, steps + 1))
    assert [x.get("skipped", 0) for x in train] == expected
    assert torch.isfinite(torch.tensor([x["loss"] for x in train])).all()
    for step, x in zip(range(steps), train):
        if train_bad[order[step]]:
            assert x["loss"] == 0.0  # nothing to train on
    (val,) = [x for x in records if x["split"] == "val"]
    assert val["count"] == val_bad.count(False)  # the corrupt ones scored as nothing


def test_the_vit_collate_counts_what_it_drops_and_stands_in_for_an_empty_batch():
    from data.collate import num_skipped
    from train.tasks import Classifier, evaluate_classification
    from train.vit_setup import collate

    img = torch.ones(3, 8, 8)
    batch = collate([(img, 0), (None, 1), (img, 1)])
    assert num_skipped(batch) == 1 and batch[0].shape == (2, 3, 8, 8) and batch[1].tolist() == [0, 1]
    with pytest.raises(ValueError, match="stand_in"):
        collate([(None, 1)])
    empty = collate([(None, 1), (None, 0)], stand_in=(3, 8, 8))
    assert num_skipped(empty) == 2 and empty[1].numel() == 0
    model = Classifier(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2)))
    loss = model(empty)["loss"]
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad is not None and not p.grad.any() for p in model.parameters())
    stats = evaluate_classification(model, [batch, empty], torch.device("cpu"), to_device=lambda b, d: b)
    assert stats["count"] == 2


# --------------------------------------------------------------------------- 3. tampered exports
VIT_CONFIG = {"model": {"preset": "nano", "patch_size": 4, "encoding": "rope"},
              "data": {"dataset": "fashion_mnist", "img_size": 28, "channels": 1}}  # fmt: skip


def _export(run: Path, *, signed: bool = True, checkpoint: bool = True) -> Path:
    """A run folder with the files ``train.engine.fit`` leaves: ``config.yaml`` (the run config), the export with the
    model signature in its metadata and a final checkpoint's ``model.json``; ``signed=False``: an export from
    before signatures (no metadata, no signed checkpoint)."""
    from train.config import from_dict, to_dict
    from train.engine import export_weights
    from train.tasks import Classifier
    from models.vit import vit_from_config as build_model
    from train.vit_setup import ViTConfig

    cfg = from_dict(ViTConfig, VIT_CONFIG)
    config = {**to_dict(cfg), "num_classes": 10, "script": "vit"}
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    signature = model_signature(config)
    meta = {METADATA_KEY: json.dumps(signature, sort_keys=True)} if signed else None
    export_weights(Classifier(build_model(cfg, 10)), run / "model.safetensors", zero_stage=0, metadata=meta)
    if signed and checkpoint:
        ckpt = run / "checkpoints" / "step_00000002"
        ckpt.mkdir(parents=True)
        (ckpt / "model.json").write_text(json.dumps(signature))
        (ckpt / "COMPLETE").write_text("2")
    return run


def _with_metadata(weights: Path, metadata: dict | None) -> None:
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(weights)), str(weights), metadata=metadata)


def _config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


@pytest.mark.parametrize("value,what", [("{not json", "is not JSON"), ("[1, 2]", "JSON array"),
                                        ("null", "JSON null")])  # fmt: skip
def test_export_metadata_that_is_not_a_json_mapping_is_an_error_naming_the_file(tmp_path, value, what):
    run = _export(tmp_path / "run")
    weights = run / "model.safetensors"
    _with_metadata(weights, {METADATA_KEY: value})
    with pytest.raises(CheckpointError, match=what) as e:
        check_export(weights, _config(run), config_path=run / "config.yaml")
    assert str(weights) in str(e.value) and METADATA_KEY in str(e.value)


def test_a_damaged_export_header_is_an_error_naming_the_file(tmp_path):
    run = _export(tmp_path / "run")
    weights = run / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
        check_export(weights, _config(run), config_path=run / "config.yaml")
    assert str(weights) in str(e.value)


@pytest.mark.parametrize("content,what", [("[1, 2]", "must hold a JSON mapping"), ("{cut", "cannot read")])
def test_a_checkpoint_signature_that_is_not_a_mapping_is_an_error_naming_it(tmp_path, content, what):
    run = _export(tmp_path / "run")
    _with_metadata(run / "model.safetensors", None)
    signature = run / "checkpoints" / "step_00000002" / "model.json"
    signature.write_text(content)
    with pytest.raises(CheckpointError, match=what) as e:
        check_export(run / "model.safetensors", _config(run), config_path=run / "config.yaml")
    assert str(signature) in str(e.value)


def test_an_edited_config_beside_an_export_stripped_of_its_metadata_is_refused(tmp_path):
    from eval.runs import load_run

    run = _export(tmp_path / "run")
    assert load_run(run, script="vit").cfg.model.encoding == "rope"
    _with_metadata(run / "model.safetensors", None)
    config = _config(run)
    config["model"]["encoding"] = "lookhere"  # parameter-free like rope: the weights alone cannot tell
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(CheckpointError) as e:
        load_run(run, script="vit")
    msg = str(e.value)
    assert str(run / "model.safetensors") in msg and "no model signature" in msg
    assert re.search(r"model\.encoding\W.*'rope'.*'lookhere'", msg) and "sign_export" in msg
    # the same with the checkpoints deleted: the run lock still shows a signing harness wrote the folder
    import shutil

    shutil.rmtree(run / "checkpoints")
    (run / "run.lock").write_text("{}")
    with pytest.raises(CheckpointError, match="no model signature"):
        load_run(run, script="vit")


def test_an_export_from_before_signatures_loads_with_a_warning_and_can_be_signed(tmp_path):
    from eval.runs import load_run
    from train.checkpoint import sign_export

    run = _export(tmp_path / "run", signed=False)
    with pytest.warns(RuntimeWarning, match=r"records no model signature.*sign_export"):
        assert load_run(run, script="vit").cfg.model.encoding == "rope"
    sign_export(run / "model.safetensors", signature=run / "config.yaml")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert load_run(run, script="vit").cfg.model.encoding == "rope"  # signed: checked
    assert not [w for w in seen if "signature" in str(w.message)]
    config = _config(run)
    config["model"]["encoding"] = "lookhere"
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(CheckpointError, match=r"model\.encoding\W.*'rope'.*'lookhere'"):
        load_run(run, script="vit")


def test_a_lock_file_that_cannot_be_opened_or_written_is_a_config_error_naming_it(tmp_path, monkeypatch):
    """A run.lock owned by another user, or a full disk while the note is written: a ConfigError naming the file,
    not a raw OSError."""
    import errno

    from train import lock as lock_mod
    from train.config import ConfigError

    real_open, real_pwrite = os.open, os.pwrite

    def refuse(path, *a, **k):
        if str(path).endswith("run.lock"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(lock_mod.os, "open", refuse)
    with pytest.raises(ConfigError, match=r"cannot open the run lock .*run\.lock \(Permission denied\)"):
        lock_mod.lock_out_dir(tmp_path / "a")
    monkeypatch.setattr(lock_mod.os, "open", real_open)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_mod.os, "pwrite", full)
    with pytest.raises(ConfigError, match=r"cannot write the run note into .*run\.lock \(No space left on device\)"):
        lock_mod.lock_out_dir(tmp_path / "b")
    monkeypatch.setattr(lock_mod.os, "pwrite", real_pwrite)
    lock_mod.lock_out_dir(tmp_path / "b").release()  # the failed attempt left no lock behind


def test_rank_0_shares_any_failure_to_lock_so_no_rank_waits_for_it(tmp_path, monkeypatch):
    """hold_out_dir broadcasts rank 0's outcome whatever went wrong: an error that skipped the broadcast would leave
    the other ranks waiting in it until the process group's timeout."""
    import torch.distributed as dist

    from train import lock as lock_mod
    from train.config import ConfigError

    sent = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src: sent.append(list(objs)))

    def broken(out_dir, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(lock_mod, "lock_out_dir", broken)
    with pytest.raises(ConfigError, match="cannot lock train.out_dir.*Input/output error"):
        lock_mod.hold_out_dir(tmp_path / "run", rank=0)
    assert len(sent) == 1 and sent[0][0][0] == "ConfigError"

