"""Data reliability: a corrupt image in an ImageFolder is skipped, counted and warned about (up to a limit),
in the dataset, in the ViT collate and in a training run."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from data.images import ImageFolder


def _folder(root, *, corrupt=1, per_class=3):
    """root/<cat|dog>/<k>.png, the first ``corrupt`` files of "dog" replaced by bytes no decoder reads."""
    for cls, value in (("cat", 40), ("dog", 200)):
        (root / cls).mkdir(parents=True)
        for k in range(per_class):
            cv2.imwrite(str(root / cls / f"{k}.png"), np.full((12, 12, 3), value, np.uint8))
    for k in range(corrupt):
        (root / "dog" / f"{k}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"truncated")
    return root


def test_a_corrupt_image_is_skipped_counted_and_warned_about(tmp_path):
    ds = ImageFolder(_folder(tmp_path, corrupt=1), size=8)
    bad = [i for i, p in enumerate(ds.files) if p.parent.name == "dog" and p.name == "0.png"][0]
    with pytest.warns(RuntimeWarning, match=r"skipping image .*0\.png"):
        x, y = ds[bad]
    assert x is None and y == 1
    assert list(ds.skipped) == [str(ds.files[bad])]
    with pytest.warns(RuntimeWarning):
        ds[bad]  # the same file again: still skipped, still counted once
    assert len(ds.skipped) == 1
    good, label = ds[0]
    assert good.shape == (3, 8, 8) and label == 0


def test_too_many_corrupt_images_stop_the_run(tmp_path):
    ds = ImageFolder(_folder(tmp_path, corrupt=3), size=8, max_skipped=2)
    dogs = [i for i, p in enumerate(ds.files) if p.parent.name == "dog"]
    with pytest.warns(RuntimeWarning):
        ds[dogs[0]], ds[dogs[1]]
    with pytest.raises(ValueError, match=r"3 images.*max_skipped=2"):
        ds[dogs[2]]
    with pytest.raises(ValueError, match="max_skipped"):
        ImageFolder(tmp_path, max_skipped=-1)


def test_the_vit_collate_drops_skipped_images(tmp_path):
    from train.vit_setup import collate

    ds = ImageFolder(_folder(tmp_path, corrupt=1), size=8)
    with pytest.warns(RuntimeWarning):
        images, labels = collate([ds[i] for i in range(len(ds))])
    assert images.shape == (len(ds) - 1, 3, 8, 8) and labels.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="every image"):
        collate([(None, 1)])


@pytest.mark.slow
def test_training_on_a_folder_with_a_corrupt_image_completes(tmp_path):
    from test_train import _read_metrics, _run, PY

    for split in ("train", "val"):
        _folder(tmp_path / "data" / split, corrupt=1 if split == "train" else 0, per_class=4)
    out = tmp_path / "run"
    r = _run([PY, "train/vit.py", "--config", "configs/vit_rope.yaml", "model.preset=nano", "data.dataset=folder",
              f"data.root={tmp_path / 'data'}", "data.img_size=8", "data.channels=3", "model.patch_size=4",
              "train.micro_batch=4", "train.steps=3", "train.val_every=3", "train.ckpt_every=3", "train.val_batches=1",
              "train.progress=false", f"train.out_dir={out}"])
    assert "skipping image" in r.stderr
    assert [x["step"] for x in _read_metrics(out) if x["split"] == "train"][-1] == 3
    assert torch.isfinite(torch.tensor([x["loss"] for x in _read_metrics(out)])).all()
