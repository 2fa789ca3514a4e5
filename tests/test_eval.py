"""Evaluation scripts (eval/resolution.py, eval/points.py, eval/speed.py) on tiny exported checkpoints.

Fast tests write checkpoints exactly as the training engine exports them (``train.engine.export_weights`` of a
``train.tasks.Classifier`` + ``config.yaml`` = the run config, ``num_classes``, ``script``); the slow tests
produce them with the real training scripts. ECE is checked against a slow reference loop and hand-made cases.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]

import classification  # noqa: E402
import points as eval_points  # noqa: E402
import resolution  # noqa: E402
import runs  # noqa: E402

from train.config import from_dict, to_dict  # noqa: E402
from train.engine import export_weights  # noqa: E402
from train.tasks import Classifier  # noqa: E402

FASHION = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
needs_fashion = pytest.mark.skipif(not FASHION.exists(), reason="needs Debian dataset-fashion-mnist")


# --------------------------------------------------------------------------- checkpoints
def export_run(out_dir: Path, script: str, raw: dict) -> Path:
    """A run folder as train/engine.py leaves it, for an untrained model built from ``raw``."""
    if script == "vit":
        from models.vit import vit_from_config as build_model
        from train.vit_setup import ViTConfig as Cfg, build_datasets
    else:
        from models.points import points_from_config as build_model
        from train.points_setup import PointsConfig as Cfg, build_datasets
    cfg = from_dict(Cfg, raw)
    if script == "vit":
        num_classes = build_datasets(cfg.data)[2]
    else:
        num_classes = build_datasets(cfg.data, val_only=True)[1].num_classes
    torch.manual_seed(1)
    export_weights(Classifier(build_model(cfg, num_classes)), out_dir / "model.safetensors", zero_stage=0)
    config = {**to_dict(cfg), "num_classes": num_classes, "script": script}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir


def load_by_hand(run_dir: Path, script: str):
    """Backbone and config loaded without eval/runs.py (safetensors + the training script's builders)."""
    from safetensors.torch import load_file

    if script == "vit":
        from models.vit import vit_from_config as build_model
        from train.vit_setup import ViTConfig as Cfg
    else:
        from models.points import points_from_config as build_model
        from train.points_setup import PointsConfig as Cfg
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    num_classes = raw.pop("num_classes")
    raw.pop("script")
    cfg = from_dict(Cfg, raw)
    model = Classifier(build_model(cfg, num_classes))
    model.load_state_dict(load_file(str(run_dir / "model.safetensors")))
    return cfg, model.backbone.eval()


VIT_RAW = {
    "model": {"preset": "nano", "patch_size": 4, "encoding": "rope"},
    "data": {"dataset": "fashion_mnist", "img_size": 28, "channels": 1, "train_limit": 64, "val_limit": 40},
}
SHAPES_RAW = {
    "model": {"preset": "nano", "patch_size": 4, "encoding": "alibi", "readout": "gap"},
    "data": {"dataset": "shapes", "img_size": 16, "channels": 3, "shapes_train": 8, "shapes_val": 30, "val_limit": 30},
}
POINTS_RAW = {
    "model": {"embed_dim": 32, "depth": 1, "num_heads": 2, "num_groups": 8, "group_size": 8, "encoding": "rope"},
    "data": {"dataset": "procedural", "num_points": 64, "samples_per_class": 8},
}


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    if not FASHION.exists():
        pytest.skip("needs Debian dataset-fashion-mnist")
    return export_run(tmp_path_factory.mktemp("vit_rope"), "vit", VIT_RAW)


@pytest.fixture(scope="module")
def points_run(tmp_path_factory):
    return export_run(tmp_path_factory.mktemp("points_rope"), "points", POINTS_RAW)


# --------------------------------------------------------------------------- calibration
def ece_reference(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Guo et al.'s ECE, one sample and one bin at a time (bins (b/M, (b+1)/M], bin 0 also holds 0)."""
    conf = probs.max(-1).values.tolist()
    pred = probs.argmax(-1).tolist()
    hit = [float(p == y) for p, y in zip(pred, labels.tolist())]
    n, total = len(conf), 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [i for i, c in enumerate(conf) if (lo < c <= hi) or (b == 0 and c == 0.0)]
        if members:
            acc = sum(hit[i] for i in members) / len(members)
            avg = sum(conf[i] for i in members) / len(members)
            total += len(members) / n * abs(acc - avg)
    return total


def test_ece_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(600, 7, generator=g, dtype=torch.float64) * 2.5
    guess = torch.randint(0, 7, (600,), generator=g)
    labels = torch.where(torch.rand(600, generator=g) < 0.6, logits.argmax(-1), guess)  # right about 2/3 of the time
    probs = logits.softmax(-1)
    assert classification.expected_calibration_error(probs, labels) == pytest.approx(ece_reference(probs, labels), abs=1e-12)
    for bins in (1, 4, 10):
        got = classification.expected_calibration_error(probs, labels, bins=bins)
        assert got == pytest.approx(ece_reference(probs, labels, bins), abs=1e-12)
    # confidences exactly on bin edges go to the lower bin, as in the reference
    edge = torch.tensor([b / 15 for b in range(8, 16)], dtype=torch.float64)
    probs = torch.stack([edge, 1 - edge], -1)
    labels = torch.tensor([0, 1, 0, 0, 1, 0, 1, 0])
    assert classification.expected_calibration_error(probs, labels) == pytest.approx(ece_reference(probs, labels), abs=1e-12)


def test_ece_hand_cases():
    # perfectly calibrated: in each confidence group exactly that fraction is right
    probs, labels = [], []
    for conf, n, right in ((0.6, 20, 12), (0.75, 20, 15), (0.9, 20, 18), (1.0, 10, 10)):
        probs += [[conf, 1 - conf]] * n
        labels += [0] * right + [1] * (n - right)
    probs, labels = torch.tensor(probs, dtype=torch.float64), torch.tensor(labels)
    assert classification.expected_calibration_error(probs, labels) < 1e-12
    metrics = classification.classification_metrics(probs.log().float(), labels)  # through the softmax of logits
    assert metrics["ece"] < 1e-6
    assert metrics["acc"] == pytest.approx(55 / 70)
    # all wrong at confidence 0.9: ECE = 0.9; all right at 0.9: ECE = 0.1
    p = torch.tensor([[0.9, 0.1]] * 8, dtype=torch.float64)
    assert classification.expected_calibration_error(p, torch.ones(8, dtype=torch.long)) == pytest.approx(0.9)
    assert classification.expected_calibration_error(p, torch.zeros(8, dtype=torch.long)) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        classification.expected_calibration_error(p, torch.zeros(3, dtype=torch.long))


def test_group_accuracy_and_class_mean():
    correct = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    groups = torch.tensor([0, 0, 1, 1, 1, 3])
    assert classification.group_accuracy(correct, groups, 4) == [0.5, pytest.approx(2 / 3), None, 1.0]
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    m = classification.classification_metrics(logits, torch.tensor([0, 0, 1, 1]))
    assert m["acc"] == 0.75 and m["class_mean_acc"] == 0.75
    m = classification.classification_metrics(logits, torch.tensor([0, 0, 0, 1]))
    assert m["acc"] == 1.0 and m["count"] == 4


# --------------------------------------------------------------------------- loading
def test_load_run_checks(vit_run, tmp_path):
    run = runs.load_run(vit_run, script="vit")
    assert run.num_classes == 10 and run.cfg.model.encoding == "rope" and not run.model.training
    with pytest.raises(ValueError, match="train/vit.py"):
        runs.load_run(vit_run, script="points")
    with pytest.raises(ValueError, match="config.yaml"):
        runs.load_run(tmp_path, script="vit")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((vit_run / "model.safetensors").read_bytes())
    raw = yaml.safe_load((vit_run / "config.yaml").read_text())
    raw["model"]["embed_dim"] = 32  # weights no longer fit
    (bad / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="does not match"):
        runs.load_run(bad, script="vit")
    raw["model"]["embed_dim"] = None
    raw["model"]["layer_scale"] = 0.1  # LayerScale parameters the export lacks
    (bad / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="missing"):
        runs.load_run(bad, script="vit")


# --------------------------------------------------------------------------- resolution
@needs_fashion
def test_resolution_report_files(vit_run, tmp_path):
    out = tmp_path / "res"
    evals = resolution.main(["--run", str(vit_run), "--ratios", "1", "1.43", "2", "--limit", "16",
                             "--out", str(out), "--device", "cpu", "--no-progress"])
    data = json.loads((out / "resolution.json").read_text())
    assert data["runs"] == json.loads(json.dumps(evals))
    (ev,) = data["runs"]
    assert ev["protocol"] == "resize" and ev["train_size"] == 28
    assert [r["size"] for r in ev["results"]] == [28, 40, 56]  # LookHere ratios x 28, multiples of the patch 4
    assert [r["tokens"] for r in ev["results"]] == [50, 101, 197]
    for r in ev["results"]:
        assert 0 <= r["acc"] <= 1 and 0 <= r["ece"] <= 1 and r["count"] == 16 and math.isfinite(r["nll"])
    assert ev["results"][0]["drop"] == 0.0
    md = (out / "resolution.md").read_text()
    assert "Top-1 accuracy" in md and "x1.43" in md and "vit_rope" in md
    assert (out / "resolution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_fashion
def test_training_size_reproduces_direct_accuracy(vit_run):
    from train.vit_setup import build_datasets

    ev = resolution.evaluate_run(vit_run, [1.0], device="cpu", batch_size=16, progress=False)
    cfg, model = load_by_hand(vit_run, "vit")
    val = build_datasets(cfg.data)[1]  # the training script's own validation set
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        logits = model(x)
    (r,) = ev["results"]
    assert r["count"] == len(val) == 40
    assert r["acc"] == pytest.approx(float((logits.argmax(-1) == y).double().mean()), abs=1e-12)
    assert r["ece"] == pytest.approx(ece_reference(logits.double().softmax(-1), y), abs=1e-6)


@needs_fashion
def test_protocol_choice_and_crop(vit_run):
    run = runs.load_run(vit_run, script="vit")
    assert resolution.resolve_protocol("fashion_mnist", "auto") == "resize"
    assert resolution.resolve_protocol("shapes", "auto") == "render"
    assert resolution.resolve_protocol("folder", "auto") == "crop"
    with pytest.raises(ValueError, match="does not apply"):
        resolution.resolve_protocol("fashion_mnist", "render")
    resized = resolution.test_dataset(run.cfg.data, 56, "resize")
    cropped = resolution.test_dataset(run.cfg.data, 56, "crop")
    assert len(resized) == len(cropped) == 40
    (a, ya), (b, yb) = resized[3], cropped[3]
    assert a.shape == b.shape == (1, 56, 56) and ya == yb
    # the crop keeps the centre 224/256 of the view: its content is the resize of the centre 24.5 px
    assert not torch.allclose(a, b, atol=1e-2)


def test_shapes_rerendered_and_size_quintiles(tmp_path):
    from data.shapes import Shapes

    run_dir = export_run(tmp_path / "shapes_alibi", "vit", SHAPES_RAW)
    ev = resolution.evaluate_run(run_dir, [1, 2], device="cpu", progress=False)
    assert ev["protocol"] == "render"
    shapes = Shapes(num_samples=30, resolution=16, split="test")  # evaluation reads the test split
    bins = torch.tensor([shapes.size_bin(i) for i in range(30)])
    for r in ev["results"]:
        per_bin = r["acc_by_size_bin"]
        assert len(per_bin) == 5
        weighted = sum(a * int((bins == q).sum()) for q, a in enumerate(per_bin) if a is not None)
        assert weighted / 30 == pytest.approx(r["acc"])
    # at 2x the samples are drawn again at 32 px (true detail), not the 16 px render upsampled
    cfg = runs.load_run(run_dir, script="vit").cfg
    rendered = resolution.test_dataset(cfg.data, 32, "render")[0][0]
    upsampled = resolution.test_dataset(cfg.data, 32, "resize")[0][0]
    assert rendered.shape == upsampled.shape == (3, 32, 32)
    assert torch.allclose(rendered, torch.from_numpy(shapes.render(0, 32)).permute(2, 0, 1))
    assert not torch.allclose(rendered, upsampled, atol=1e-3)


# --------------------------------------------------------------------------- points
def test_points_report(points_run, tmp_path):
    out = tmp_path / "pts"
    (ev,) = eval_points.main(["--run", str(points_run), "--factors", "2", "4", "--limit", "12",
                              "--out", str(out), "--device", "cpu", "--no-progress"])
    data = json.loads((out / "points.json").read_text())
    assert data["runs"][0]["name"] == ev["name"]
    rows = [(r["condition"], r["rotation"], r["points"], r["groups"], r["group_size"]) for r in ev["results"]]
    assert rows == [("rotation", "z", 64, 8, 8), ("rotation", "so3", 64, 8, 8),
                    ("points", "z", 128, 16, 8), ("points", "z", 256, 32, 8)]
    for r in ev["results"]:
        assert 0 <= r["acc"] <= 1 and 0 <= r["class_mean_acc"] <= 1 and 0 <= r["ece"] <= 1 and r["count"] == 12
    assert "so3" in (out / "points.md").read_text()


def test_points_train_like_reproduces_direct_accuracy(points_run):
    from train.points_setup import build_datasets, collate

    ev = eval_points.evaluate_points_run(points_run, rotations=["z"], factors=[4], grouping="extent",
                                         device="cpu", progress=False)
    cfg, model = load_by_hand(points_run, "points")
    _, val = build_datasets(cfg.data, val_only=True)
    inputs, labels = collate([val[i] for i in range(len(val))])
    with torch.no_grad():
        acc = float((model(inputs).argmax(-1) == labels).double().mean())
    train_like, more = ev["results"]
    assert train_like["count"] == len(val) and train_like["acc"] == pytest.approx(acc, abs=1e-12)
    assert (more["points"], more["groups"], more["group_size"]) == (256, 8, 32)  # extent: 4x neighbours
    run = runs.load_run(points_run, script="points")
    assert (run.model.tokenizer.num_groups, run.model.tokenizer.group_size) == (8, 8)
    with pytest.raises(ValueError, match="grouping"):
        eval_points.evaluate_points_run(points_run, grouping="bigger", progress=False)


# --------------------------------------------------------------------------- speed
def test_speed_report(tmp_path):
    pytest.importorskip("transformers")
    import speed

    out = tmp_path / "speed.json"
    speed.main(["--encodings", "rope", "mrope", "v2pe", "lh90", "pype", "--configs", "2:1", "--dim", "16",
                "--heads", "2", "--depth", "2", "--rounds", "1", "--warmup", "1", "--mm-rounds", "1",
                "--threads", "1", "--no-progress", "--out", str(out)])
    rep = json.loads(out.read_text())
    (cfg,) = rep["configs"]
    assert cfg["tokens"] == 5
    res = cfg["results"]
    assert set(res) == {"nope", "rope", "mrope", "v2pe", "lh90", "pype"}
    assert res["nope"]["ratio_min"] == 1.0 and res["nope"]["memory_ratio"] == 1.0
    assert cfg["axes"] == {"nope": 2, "rope": 2, "mrope": 3, "v2pe": 1, "lh90": 2, "pype": 2}  # pype: depth axes
    assert cfg["options"]["lh90"]["head_directions"] == "corners"  # its 3-group default needs >= 9 heads
    for r in res.values():
        assert r["min_ms"] > 0 and r["ratio_min"] > 0 and r["peak_mib"] > 0
    mm = rep["mm_position_ids"]["cases"]
    image_case = next(iter(mm.values()))
    assert image_case["identical"] is True and image_case["speedup"] > 0


def test_speed_positions_for_every_axis_count():
    import speed

    for axes in (1, 2, 3, 4, 12):
        pos = speed.positions_for(axes, 3)
        assert pos.coords.shape == (1, 10, axes) and pos.prefix == 1
    assert speed.positions_for(3, 3).coords[0, 1:, 0].abs().sum() == 0  # one frame: t = 0
    with pytest.raises(ValueError, match="registered"):
        speed.run(["no_such_encoding"], configs=[(2, 1)], dim=16, heads=2, depth=1, memory=False, mm=False)


# --------------------------------------------------------------------------- the real training path
@pytest.mark.slow
@needs_fashion
def test_eval_on_checkpoints_from_the_training_scripts(tmp_path):
    import train.points
    import train.vit

    vit_dir, pts_dir = tmp_path / "vit_rope", tmp_path / "points_rope"
    common_overrides = ["train.steps=2", "train.micro_batch=8", "train.val_every=2", "train.val_batches=1",
                        "train.ckpt_every=2", "train.warmup_steps=1", "train.progress=false"]
    train.vit.main(["--config", str(ROOT / "configs/vit_rope.yaml"), "model.preset=nano", "data.train_limit=32",
                    "data.val_limit=24", f"train.out_dir={vit_dir}", *common_overrides])
    train.points.main(["--config", str(ROOT / "configs/points_rope.yaml"), "data.dataset=procedural",
                       "data.num_points=64", "data.samples_per_class=8", "model.embed_dim=32", "model.depth=1",
                       "model.num_heads=2", "model.num_groups=8", "model.group_size=8",
                       f"train.out_dir={pts_dir}", *common_overrides])
    ev = resolution.evaluate_run(vit_dir, [1, 1.43, 4.57], device="cpu", progress=False)
    assert [r["size"] for r in ev["results"]] == [28, 40, 128]
    # the engine's last validation (step 2, its first val_batches x micro_batch images) at the training size
    val = [json.loads(line) for line in (vit_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in val if m["split"] == "val"][-1]
    direct = resolution.evaluate_run(vit_dir, [1], limit=int(last["count"]), device="cpu", progress=False)
    assert direct["results"][0]["acc"] == pytest.approx(last["acc"], abs=1e-9)
    pev = eval_points.evaluate_points_run(pts_dir, factors=[2], device="cpu", progress=False)
    assert all(0 <= r["acc"] <= 1 for r in pev["results"])
    paths = resolution.write_report([ev, ev | {"name": "copy"}], tmp_path / "out")
    assert all(p.exists() for p in paths.values())


# --------------------------------------------------------------------------- benchmark options
def test_resolution_offset_and_outcomes(vit_run):
    """``offset`` selects other images; the packed outcomes are the per-image hits the accuracy averages."""
    import resolution
    from stats import unpack_bits

    a = resolution.evaluate_run(vit_run, [1.0, 2.0], limit=20, offset=0, device="cpu", progress=False)
    b = resolution.evaluate_run(vit_run, [1.0, 2.0], limit=20, offset=20, device="cpu", progress=False)
    full = resolution.evaluate_run(vit_run, [1.0, 2.0], limit=40, device="cpu", progress=False)
    for i in range(2):
        hits = [unpack_bits(ev["results"][i]["outcomes"]) for ev in (a, b, full)]
        assert hits[0].mean() == pytest.approx(a["results"][i]["acc"])
        assert (np.concatenate(hits[:2]) == hits[2]).all()  # the two slices tile the first 40 images
    with pytest.raises(ValueError, match="offset"):
        resolution.evaluate_run(vit_run, [1.0], offset=10_000, device="cpu", progress=False)


def test_resolution_scaling_rows(vit_run):
    """Training-free scaling changes nothing at 1x and something beyond; no scaling is left on the model."""
    import resolution

    plain = resolution.evaluate_run(vit_run, [1.0, 2.29], limit=20, device="cpu", progress=False)
    for kind in ("linear", "yarn"):
        sc = resolution.evaluate_run(vit_run, [1.0, 2.29], limit=20, scaling=kind, device="cpu", progress=False)
        assert sc["scaling"] == kind and sc["name"].endswith("+" + kind)
        assert sc["results"][0]["outcomes"] == plain["results"][0]["outcomes"]
        assert sc["results"][1]["nll"] != pytest.approx(plain["results"][1]["nll"], rel=1e-6)
    again = resolution.evaluate_run(vit_run, [2.29], limit=20, device="cpu", progress=False)
    assert again["results"][0]["nll"] == pytest.approx(plain["results"][1]["nll"], rel=1e-6)
    with pytest.raises(ValueError, match="scaling"):
        resolution.evaluate_run(vit_run, [1.0], scaling="dynamic", device="cpu", progress=False)


def test_points_data_seed_draws_other_items(points_run):
    import points as points_eval

    kw = dict(rotations=["z"], factors=[], samples_per_class=2, device="cpu", progress=False)
    a = points_eval.evaluate_points_run(points_run, data_seed=1000, **kw)
    b = points_eval.evaluate_points_run(points_run, data_seed=1000, **kw)
    c = points_eval.evaluate_points_run(points_run, data_seed=1001, **kw)
    assert a["results"][0]["outcomes"] == b["results"][0]["outcomes"]
    assert a["data_seed"] == 1000 and c["data_seed"] == 1001 and a["results"][0]["count"] == 2 * a["num_classes"]
    assert a["results"][0]["nll"] != pytest.approx(c["results"][0]["nll"], rel=1e-9)
    with pytest.raises(ValueError, match="data_seed"):
        points_eval.evaluate_points_run(points_run, data_seed=-1, **kw)
