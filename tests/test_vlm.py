"""The small VLM (models/vlm.py), its training script (train/vlm.py) and configs.

What is checked:
- the model builds for every registered multimodal variant; forward, loss and backward run; the loss is the
  cross entropy of the answer tokens only (recomputed by hand from the logits);
- the collator's position ids (computed on the CPU with ``mm.position_ids`` and packed) are exactly what the
  patched Hugging Face model computes on its own, so training on collator ids equals the model's own positions;
- ``generate()`` logits equal one teacher-forced forward over the final sequence (left-padded prompts of two
  lengths), for several variants, with the model's own ids and with collator-style ids;
- the vision tower: coordinates match the pixels' real place in the collator's patch layout, frame attention keeps
  frames independent (block attention does not), and mixed image/video batches equal each block run alone;
- teacher-forced exact match on a hand example; every configs/<variant>.yaml (and configs/full/) loads and builds;
- (slow) a 3-step one-process run of train/vlm.py writes metrics.jsonl, config.yaml and model.safetensors, and the
  export reloads into an identical model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from data.text import build_tokenizer  # noqa: E402
from data.vlm_collate import patchify  # noqa: E402
from data.vniah import VNIAH, vocabulary  # noqa: E402
from models.vision_tower import _layout  # noqa: E402
from models.vlm import VLM, answer_accuracy, pack_position_ids, vlm  # noqa: E402
from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = sorted(mm.VARIANTS)
# smaller than the `tiny` preset: these tests build many models
SIZES = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=48,
             vision_dim=32, vision_depth=1, vision_heads=2, initializer_range=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocabulary())


@pytest.fixture(scope="module")
def samples():
    # 4 fps: 0.5 s per temporal patch, not the 1 s that time-aware designs assume when no timing is given
    ds = VNIAH(lengths=(4, 6), depths=(0.0, 1.0), samples_per_cell=1, size=16, split="test", seed=3, fps=4.0)
    return [ds[i] for i in range(len(ds))]  # lengths 4, 4, 6, 6


_MODELS: dict[str, VLM] = {}


def model_for(variant: str, tok) -> VLM:
    if variant not in _MODELS:
        torch.manual_seed(0)
        _MODELS[variant] = vlm("tiny", tokenizer=tok, variant=variant, **SIZES).eval()
    return _MODELS[variant]


# ------------------------------------------------------------------------------------------------------------
# every variant: forward, loss, backward, positions
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_loss_backward(variant, tok, samples):
    model = model_for(variant, tok)
    batch = model.collator()(samples)
    model.zero_grad()
    out = model(batch)
    logits, labels = out["logits"], batch["labels"]
    assert logits.shape == (*batch["input_ids"].shape, tok.vocab_size)
    # the loss is the mean cross entropy of the supervised (answer + <eos>) tokens, predicted one step ahead
    pred, target = logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    keep = target != -100
    assert int(keep.sum()) == 2 * len(samples)  # one answer word + <eos> per sample
    want = torch.nn.functional.cross_entropy(pred[keep].float(), target[keep])
    torch.testing.assert_close(out["loss"], want, rtol=1e-5, atol=1e-6)
    out["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["hf.model.visual.patch_embed.weight"].abs().sum() > 0  # the tower is trained through the decoder
    assert grads["hf.model.language_model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    model.zero_grad()


@pytest.mark.parametrize("variant", VARIANTS)
def test_collator_positions_equal_the_patched_model(variant, tok, samples):
    model = model_for(variant, tok)
    batch = model.collator()(samples)
    want, _ = vhf.position_ids(
        model.hf, batch["mm_token_type_ids"], video_grid_thw=batch["video_grid_thw"],
        attention_mask=batch["attention_mask"], second_per_grid_ts=batch["second_per_grid_ts"],
    )  # fmt: skip
    assert batch["position_ids"].dtype == want.dtype
    torch.testing.assert_close(batch["position_ids"], want, rtol=0, atol=0)
    with torch.no_grad():
        own = model({k: v for k, v in batch.items() if k != "position_ids"})["logits"]
        given = model(batch)["logits"]
    torch.testing.assert_close(given, own, rtol=0, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_batch_equals_every_sample_alone(variant, tok, samples):
    """Training on packed rows (collator(packing=True)): every sample's logits equal those of the sample alone,
    and the loss equals the loss of the unpacked batch."""
    model = model_for(variant, tok)
    one = [model.collator()([x]) for x in samples]
    lengths = [b["input_ids"].shape[1] for b in one]
    packed = model.collator(packing=True, max_length=lengths[0] + lengths[1] + lengths[2])(samples)
    assert packed["input_ids"].shape[0] == 2 and "attention_mask" not in packed  # rows [0, 1, 2] and [3]
    with torch.no_grad():
        out = model(packed)
        flat = out["logits"].reshape(-1, out["logits"].shape[-1])
        starts = [0, lengths[0], lengths[0] + lengths[1], packed["input_ids"].shape[1]]  # flat row-major offsets
        for k, b in enumerate(one):
            want = model(b)["logits"][0]
            torch.testing.assert_close(flat[starts[k] : starts[k] + lengths[k]], want, atol=1e-4, rtol=0)
        torch.testing.assert_close(out["loss"], model(model.collator()(samples))["loss"], atol=1e-5, rtol=0)


def test_collator_pickles_for_worker_processes(tok, samples):
    import pickle

    collate = model_for("pype", tok).collator()
    again = pickle.loads(pickle.dumps(collate))
    a, b = collate(samples), again(samples)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_variants_differ(tok, samples):
    """The variant reaches the decoder: the same weights give different logits under different position ids."""
    a, b = model_for("mrope", tok), model_for("videorope", tok)
    b.load_state_dict(a.state_dict())
    batch_a, batch_b = a.collator()(samples), b.collator()(samples)
    with torch.no_grad():
        la, lb = a(batch_a)["logits"], b(batch_b)["logits"]
    assert (la - lb).abs().max() > 1e-3


def test_pack_position_ids_hand_example():
    ids = torch.tensor([[[5, 6, 7]], [[8, 9, 9]]])  # (A=2, B=1, S=3)
    mask = torch.tensor([[0, 1, 1]])
    got = pack_position_ids(ids, mask, masked=True)
    want = torch.tensor([[[0, 0, 1]], [[5, 6, 7]], [[8, 9, 9]], [[0, 1, 1]]])
    torch.testing.assert_close(got, want)
    assert pack_position_ids(ids.float() / 2, None, masked=False)[0].tolist() == [[0.0, 1.0, 2.0]]


# ------------------------------------------------------------------------------------------------------------
# generate() == teacher forcing
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mrope_i", "videorope", "pype", "qwen25vl"])
def test_generate_equals_teacher_forcing(variant, tok, samples):
    model = model_for(variant, tok)
    n = 3
    prompt = model.collator(prompt_only=True, padding_side="left", with_positions=False)(samples)
    assert (prompt["attention_mask"] == 0).any()  # two prompt lengths: left padding is exercised
    out = model.generate(
        prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    seq, steps = out.sequences, torch.stack(out.logits, dim=1)  # (B, S + n), (B, n, V)
    B, S = prompt["input_ids"].shape
    assert seq.shape == (B, S + n)
    full = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids", "labels")}
    full["input_ids"] = seq
    full["attention_mask"] = torch.cat([prompt["attention_mask"], torch.ones(B, n, dtype=torch.long)], 1)
    full["mm_token_type_ids"] = torch.cat([prompt["mm_token_type_ids"], torch.zeros(B, n, dtype=torch.long)], 1)
    with torch.no_grad():
        own = model(full)["logits"][:, S - 1 : -1]
    torch.testing.assert_close(steps, own, atol=1e-4, rtol=0)
    # the same with ids computed the collator's way (CPU, mm.position_ids, packed)
    options = dict(model.position_options)
    if "second_per_grid_ts" in mm.DESIGNS[model.variant.design].defaults:
        options["second_per_grid_ts"] = prompt["second_per_grid_ts"]
    ids, _ = mm.position_ids(
        model.variant, full["mm_token_type_ids"], prompt["video_grid_thw"], attention_mask=full["attention_mask"],
        spatial_merge_size=2, **options,
    )  # fmt: skip
    full["position_ids"] = pack_position_ids(ids, full["attention_mask"], masked=model.variant.masked)
    with torch.no_grad():
        given = model(full)["logits"][:, S - 1 : -1]
    torch.testing.assert_close(steps, given, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# vision tower
# ------------------------------------------------------------------------------------------------------------


def test_tower_coordinates_follow_the_pixels():
    """Frames whose pixels hold their own (row, column) go through the collator's patchify; the coordinates the
    tower assigns to each patch are the patch's real place and temporal index."""
    p, m, T, H, W = 2, 2, 4, 8, 12
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    frames = torch.stack([ys, xs, torch.zeros_like(ys)]).float()  # (C, H, W)
    frames = frames.expand(T, -1, -1, -1).clone()  # (T, C, H, W)
    frames[:, 2] = torch.arange(T).float()[:, None, None]  # channel 2 holds the frame index
    patches, grid = patchify(frames, patch_size=p, temporal_patch_size=2, merge_size=m)
    px = patches.reshape(-1, 3, 2, p, p)  # (P, C, tp, p, p)
    row, col = px[:, 0, 0, 0, 0] / p, px[:, 1, 0, 0, 0] / p
    tpatch = px[:, 2, 0, 0, 0] / 2
    for per_frame in (True, False):
        layout = _layout((grid,), m, per_frame)
        coords = layout.coords.reshape(-1, 3).float()
        torch.testing.assert_close(coords, torch.stack([tpatch, row, col], -1))
        assert layout.coords.shape[0] == (grid[0] if per_frame else 1)


def _tower_model(tok, attention):
    torch.manual_seed(1)
    return vlm("tiny", tokenizer=tok, variant="mrope", vision_attention=attention, **SIZES).eval()


@pytest.mark.parametrize("attention", ["frame", "block"])
def test_tower_frame_independence(attention, tok):
    tower = _tower_model(tok, attention).visual
    grid = torch.tensor([[3, 4, 4]])
    x = torch.randn(48, tower.patch_dim)
    y = x.clone()
    y[16:32] += 1.0  # change temporal patch 1 only
    with torch.no_grad():
        a, b = tower(x, grid_thw=grid).pooler_output, tower(y, grid_thw=grid).pooler_output  # (12, out)
    same_elsewhere = torch.allclose(a[:4], b[:4]) and torch.allclose(a[8:], b[8:])
    assert not torch.allclose(a[4:8], b[4:8])
    assert same_elsewhere == (attention == "frame")


@pytest.mark.parametrize("attention", ["frame", "block"])
def test_tower_mixed_blocks_equal_separate_runs(attention, tok):
    """An image and a video of other sizes in one call (padded rows with valid masks) give each block's output
    alone: no attention across blocks, nothing lost in the padding."""
    tower = _tower_model(tok, attention).visual
    grids = [(1, 4, 6), (3, 4, 4), (2, 2, 2)]
    xs = [torch.randn(t * h * w, tower.patch_dim) for t, h, w in grids]
    with torch.no_grad():
        together = tower(torch.cat(xs), grid_thw=torch.tensor(grids)).pooler_output
        alone = torch.cat([tower(x, grid_thw=torch.tensor([g])).pooler_output for x, g in zip(xs, grids)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_tower_rejects_wrong_patches(tok):
    tower = _tower_model(tok, "frame").visual
    with pytest.raises(ValueError, match="pixel_values must be"):
        tower(torch.randn(16, tower.patch_dim + 1), grid_thw=torch.tensor([[1, 4, 4]]))


# ------------------------------------------------------------------------------------------------------------
# scoring, builder errors
# ------------------------------------------------------------------------------------------------------------


def test_answer_accuracy_hand_example():
    V = 5
    labels = torch.tensor([[-100, -100, 3, 1], [-100, -100, 2, 1], [-100, -100, -100, -100]])
    preds = torch.tensor([[0, 3, 1, 0], [0, 2, 4, 0], [0, 0, 0, 0]])  # row 1: second answer token wrong
    logits = torch.nn.functional.one_hot(preds, V).float()
    correct, scored = answer_accuracy(logits, labels)
    assert correct.tolist() == [True, False, False]
    assert scored.tolist() == [True, True, False]


def test_builder_errors(tok):
    with pytest.raises(ValueError, match="unknown VLM preset"):
        vlm("huge", tokenizer=tok)
    with pytest.raises(ValueError, match="unknown multimodal RoPE variant"):
        vlm("tiny", tokenizer=tok, variant="nope_rope", **SIZES)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        vlm("tiny", tokenizer=tok, **{**SIZES, "hidden_size": 30})
    with pytest.raises(ValueError, match="vision attention"):
        vlm("tiny", tokenizer=tok, vision_attention="video", **SIZES)


# ------------------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------------------


def _load(path: Path):
    from train.config import load_config
    from train.vlm_setup import VLMConfig

    return load_config(VLMConfig, path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_config_loads_and_builds(variant, tok):
    from models.vlm import vlm_from_config as build_model

    cfg = _load(ROOT / "configs" / f"{variant}.yaml")
    assert cfg.model.variant == variant
    assert cfg.train.out_dir.endswith(variant)
    model = build_model(cfg, tok)
    preset = mm.get_variant(variant)
    # the preset, with the options the decoder was patched with (its mrope_section, PyPE's depth ...) filled in
    assert (model.variant.name, model.variant.design, model.variant.allocation) == (
        preset.name, preset.design, preset.allocation)
    assert model.variant.design_options.items() >= preset.design_options.items()
    full = _load(ROOT / "configs" / "full" / f"{variant}.yaml")
    assert full.model.variant == variant and full.model.preset == "full"
    assert full.data.frames > cfg.data.frames and full.train.out_dir != cfg.train.out_dir


def test_config_typo_is_an_error():
    from train.config import ConfigError, load_config
    from train.vlm_setup import VLMConfig

    with pytest.raises(ConfigError, match="variant"):
        load_config(VLMConfig, ROOT / "configs" / "mrope_i.yaml", ["model.variantt=mrope"])


# ------------------------------------------------------------------------------------------------------------
# the training script
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_script_smoke(tmp_path, tok):
    from safetensors.torch import load_file

    from train.config import from_dict
    from models.vlm import vlm_from_config as build_model
    from train.vlm_setup import VLMConfig, build_datasets

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [
        sys.executable, "train/vlm.py", "--config", "configs/mrope_i.yaml", "train.steps=3", "train.micro_batch=4",
        "train.val_batches=1", "train.log_every=1", "train.progress=false", "data.train_samples=32",
        "data.val_samples=8", f"train.out_dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(r["loss"] > 0 for r in train)
    # validation: val_batches (1) x micro_batch (4) held-out samples at the training length
    assert len(val) == 1 and val[0]["count"] == 4 and 0.0 <= val[0]["acc"] <= 1.0 and val[0]["chance"] == 0.1
    # the export reloads into the model config.yaml describes and reproduces the last validation loss
    raw = yaml.safe_load((out / "config.yaml").read_text())
    assert raw["tokenizer_words"] == list(tok.words)
    cfg = from_dict(VLMConfig, {k: raw[k] for k in ("model", "data", "train", "deepspeed")})
    model = build_model(cfg, tok).eval()
    state = load_file(str(out / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"hf.lm_head.weight"}  # tied to the input embeddings
    _, val_set = build_datasets(cfg)
    batch = model.collator()([val_set[i] for i in range(4)])  # the samples validated at the last step
    with torch.no_grad():
        loss = model(batch)["loss"]
    assert abs(float(loss) - val[0]["loss"]) < 1e-4  # the export is the model that was validated
