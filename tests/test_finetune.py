"""Fine-tuning a Hugging Face Qwen-VL folder (``train/finetune.py``, ``data/hf_batch.py``), in process.

Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL folders with a real processor and chat template
(:mod:`models.tiny_qwen_vl`) and a small LLaVA-format set of real mp4 files and PNG images
(:func:`data.instruct.make_vniah_instruct`). What is checked, against references that do not use the code under test:
- the training loss of a batch, padded or packed, equals transformers' own loss of the padded batch
  (``model(..., labels=)``, the model computing its own position ids); the teacher-forced exact match of a batch
  equals a per-sample loop over the samples run alone;
- the collator's position ids equal the patched model's own (``get_rope_index``) on the same padded batch;
- every batch, whatever its modalities, runs the vision tower exactly twice (the filler), and the filler changes
  neither loss nor exact match; a micro-batch whose samples were all skipped trains on nothing (loss 0);
- ``train.freeze`` stops exactly the named parts; the config refuses keys of the other kind of run;
- the resume record changes with the annotation file and the checkpoint folder.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data.hf_batch import IGNORE_INDEX, MODEL_KEYS, InstructCollator  # noqa: E402
from train.config import ConfigError, load_config  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def vniah_set(tmp_path_factory):
    from data.instruct import make_vniah_instruct

    return make_vniah_instruct(tmp_path_factory.mktemp("set"), train=10, val=4, frames=4, frame_size=56,
                               image_every=3)  # fmt: skip




def loaded(family, tiny_qwen_vl, variant="videorope"):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlpe.integrations import transformers as vlpe_hf

    folder = tiny_qwen_vl(family)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    vlpe_hf.apply(model, variant)
    return model, processor


def items_of(vniah_set, processor, family, n=6):
    from data.instruct import InstructDataset

    ds = InstructDataset(annotations=vniah_set["train"], media_root=vniah_set["media_root"], processor=processor,
                         family=family, fps=2.0, max_frames=8)  # fmt: skip
    out = [ds[i] for i in range(n)]
    assert all(it is not None for it in out)
    return out


def collator(model, processor, **kw):
    from train.finetune import filler_item
    from vlpe.integrations import transformers as vlpe_hf

    patch = vlpe_hf.patch_of(model)
    kw.setdefault("filler", filler_item(processor))
    return InstructCollator(variant=patch.variant, family=patch.family, spatial_merge_size=patch.spatial_merge_size,
                            pad_token_id=processor.tokenizer.pad_token_id, **kw)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_padded_packed_and_transformers_agree(family, vniah_set, tiny_qwen_vl):
    from train.finetune import CausalLM

    model, processor = loaded(family, tiny_qwen_vl)
    items = items_of(vniah_set, processor, family)
    assert any("image_grid_thw" in it for it in items) and any("video_grid_thw" in it for it in items)
    lm = CausalLM(model=model)
    with torch.no_grad():
        padded = collator(model, processor)(items)
        packed = collator(model, processor, packing=True)(items)
        a, b = lm(padded), lm(packed)
        inputs = {k: padded[k] for k in MODEL_KEYS if k in padded and k != "position_ids"}
        reference = model(**inputs, labels=padded["labels"]).loss  # transformers' loss, the model's own ids
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    torch.testing.assert_close(a["loss"], reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b["loss"], reference, rtol=1e-5, atol=1e-5)
    # exact match: a loop over the samples, each run alone through the model
    correct = 0
    with torch.no_grad():
        for it in items:
            one = collator(model, processor, filler=None)([it])
            logits = model(**{k: one[k] for k in MODEL_KEYS if k in one and k != "position_ids"}).logits[0]
            target = one["labels"][0, 1:]
            where = target != IGNORE_INDEX
            correct += int(bool((logits[:-1].argmax(-1)[where] == target[where]).all()))
    assert int(a["scored"]) == int(b["scored"]) == len(items)
    assert int(a["correct"]) == int(b["correct"]) == correct


@pytest.mark.parametrize("family", FAMILIES)
def test_collator_ids_are_the_patched_models_own(family, vniah_set, tiny_qwen_vl):
    model, processor = loaded(family, tiny_qwen_vl, variant="mrope_i")
    batch = collator(model, processor, filler=None)(items_of(vniah_set, processor, family, n=4))
    base = model.model
    kwargs = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in batch}
    ids, deltas = base.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                      attention_mask=batch["attention_mask"], **kwargs)  # fmt: skip
    torch.testing.assert_close(batch["position_ids"][1:], ids.to(batch["position_ids"].dtype), rtol=0, atol=0)
    torch.testing.assert_close(batch["rope_deltas"], deltas, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_every_batch_runs_the_vision_tower_twice_and_the_filler_changes_nothing(family, vniah_set, tiny_qwen_vl):
    from train.finetune import CausalLM

    model, processor = loaded(family, tiny_qwen_vl)
    items = items_of(vniah_set, processor, family)
    images = [it for it in items if "image_grid_thw" in it]
    videos = [it for it in items if "video_grid_thw" in it]
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    lm = CausalLM(model=model)
    try:
        for mixed, subset in ((False, images[:1]), (False, videos[:2]), (True, images[:1] + videos[:1]), (False, [])):
            for packing in (False, True):
                calls.clear()
                batch = collator(model, processor, packing=packing)([*subset, None])
                with torch.no_grad():
                    out = lm(batch)
                assert len(calls) == 2, (len(subset), packing)
                assert batch["num_samples"] == len(subset) and batch["num_skipped"] == 1
                if not subset:  # nothing left to train on: loss 0, nothing scored
                    assert float(out["loss"]) == 0.0 and int(out["scored"]) == 0
                elif mixed:  # both modalities: no filler is added
                    with torch.no_grad():
                        plain = lm(collator(model, processor, packing=packing, filler=None)(subset))
                    torch.testing.assert_close(out["loss"], plain["loss"], rtol=1e-6, atol=1e-6)
                    assert int(out["correct"]) == int(plain["correct"])
    finally:
        handle.remove()


def test_collator_errors(vniah_set, tiny_qwen_vl):
    model, processor = loaded("qwen2_vl", tiny_qwen_vl)
    with pytest.raises(ValueError, match="every sample of this micro-batch was dropped"):
        collator(model, processor, filler=None)([None, None])
    it = items_of(vniah_set, processor, "qwen2_vl", n=1)[0]
    with pytest.raises(ValueError, match="does not fit a packed row"):
        collator(model, processor, packing=True, max_length=4)([it])
    with pytest.raises(ValueError, match="filler"):
        collator(model, processor, filler={"labels": torch.zeros(3, dtype=torch.long)})


def test_freeze_stops_exactly_the_named_parts(tiny_qwen_vl):
    from train.finetune import freeze

    for parts in (["vision"], ["merger"], ["llm"], ["vision", "merger"]):
        model, _ = loaded("qwen3_vl", tiny_qwen_vl)
        freeze(model, parts)
        for name, p in model.named_parameters():
            in_visual = ".visual." in f".{name}"
            merger = in_visual and any(m in name for m in ("visual.merger.", "visual.deepstack_merger_list."))
            part = "merger" if merger else "vision" if in_visual else "llm"
            assert p.requires_grad == (part not in parts), (parts, name)
    with pytest.raises(ConfigError, match="unknown part"):
        freeze(model, ["brain"])


def test_config_refuses_keys_of_the_other_kind_of_run(tmp_path):
    from train.vlm_setup import VLMConfig

    ok = load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [f"model.hf_model={tmp_path}", "data.annotations=a.json"])
    assert ok.train.zero_stage == 3 and ok.train.freeze == ["vision"] and ok.model.variant == "mrope"
    for overrides, match in [
        ([f"model.hf_model={tmp_path}", "model.hidden_size=32"], "applies to the small VLM"),
        ([f"model.hf_model={tmp_path}", "data.frames=4"], "applies to the small VLM"),
        ([f"model.hf_model={tmp_path}", "train.freeze=[eyes]"], "unknown part"),
        ([f"model.hf_model={tmp_path}", "data.max_frames=0"], "max_frames"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", overrides)
    for overrides in (["data.packing=true"], ["train.freeze=[vision]"], ["model.lora.enabled=true"]):
        with pytest.raises(ConfigError, match="applies to fine-tuning a checkpoint folder"):
            load_config(VLMConfig, "configs/mrope.yaml", overrides)
    with pytest.raises(ConfigError, match="applies to fine-tuning"):  # the hf config without its folder
        load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [])


def test_the_resume_record_follows_the_folder_and_the_data(vniah_set, tiny_qwen_vl, tmp_path):
    import shutil

    from train.finetune import source_record
    from train.vlm_setup import VLMConfig

    folder = tiny_qwen_vl("qwen2_vl")
    copy = shutil.copytree(folder, tmp_path / "copy")
    data = tmp_path / "train.json"
    data.write_text(open(vniah_set["train"]).read())

    def record(f):
        return source_record(load_config(VLMConfig, "configs/hf/qwen2_vl.yaml",
                                         [f"model.hf_model={f}", f"data.annotations={data}"]))  # fmt: skip

    a = record(copy)
    assert a == record(copy)
    samples = json.loads(data.read_text())
    samples[0]["conversations"][1]["value"] = "moon"
    data.write_text(json.dumps(samples))
    b = record(copy)
    assert b["annotations_sha256"] != a["annotations_sha256"] and b["hf_fingerprint"] == a["hf_fingerprint"]
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_config"]["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    assert record(copy)["hf_fingerprint"] != b["hf_fingerprint"]


def test_optimizer_groups_read_zero3_shapes_and_drop_empty_groups():
    from torch import nn

    from train.engine import param_groups

    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    assert [len(g["params"]) for g in param_groups(m, 0.05)] == [1, 3]  # the weight matrix decays
    w = m[0].weight
    w.data = torch.empty(0)  # what a ZeRO-3 partition leaves on a rank, the full shape in ds_shape
    w.ds_shape = torch.Size([4, 3])
    groups = param_groups(m, 0.05)
    assert groups[0]["params"] == [w] and groups[0]["weight_decay"] == 0.05
    m[0].weight.requires_grad_(False)  # nothing left to decay: no empty group (DeepSpeed would drop it)
    assert [g["weight_decay"] for g in param_groups(m, 0.05)] == [0.0]


@pytest.mark.parametrize("variant", ["mrope_i", "mhrope", "pype"])
def test_activation_checkpointing_gives_the_same_gradients(variant, vniah_set, tiny_qwen_vl):
    """The patch's hooks (per-head rotation, per-layer tables and masks) run again in the recomputed forward of a
    checkpointed layer: the gradients equal those of the plain forward."""
    from train.finetune import CausalLM

    grads = []
    for checkpointing in (False, True):
        model, processor = loaded("qwen2_vl", tiny_qwen_vl, variant=variant)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        batch = collator(model, processor, packing=True)(items_of(vniah_set, processor, "qwen2_vl", n=4))
        calls = []
        model.model.language_model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        CausalLM(model=model)(batch)["loss"].backward()
        assert len(calls) == (2 if checkpointing else 1)  # the checkpointed layer ran again in the backward
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def test_load_model_refuses_what_cannot_train_here(tiny_qwen_vl, tmp_path):
    from train.finetune import load_model
    from train.vlm_setup import VLMConfig

    folder = tiny_qwen_vl("qwen2_vl")
    base = [f"model.hf_model={folder}", "data.annotations=a.json", "train.zero_stage=0"]
    cfg = load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", base + ["train.freeze=[vision, merger, llm]"])
    with pytest.raises(ConfigError, match="leaves no parameter to train"):
        load_model(cfg, None)
    if not torch.cuda.is_available():  # flash-attention-2 is a GPU kernel: said before anything loads
        cfg = load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", base + ["model.attn_implementation=flash_attention_2"])
        with pytest.raises(ConfigError, match="needs a CUDA GPU and the flash-attn package"):
            load_model(cfg, None)
