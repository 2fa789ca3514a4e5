"""vlpe.integrations.transformers under peft adapters (LoRA, DoRA), in process, on the tiny Qwen2-VL / Qwen2.5-VL /
Qwen3-VL folders with their real processors (:mod:`models.tiny_qwen_vl`), one image and one video per prompt.

What is checked, against references that do not use peft's merging:
- for every registered multimodal variant (on Qwen2-VL, and MHRoPE and two more on each other family), with the
  patch applied before ``get_peft_model`` and after it (``train.finetune._lora``, the fine-tune's own adapters,
  given random weights): the logits of the adapted model, and of the same model after ``merge_and_unload``, equal
  those of a fresh copy of the folder given the merged weights computed by hand (``W + alpha / r * B @ A``; DoRA:
  each output row rescaled to its learned magnitude) and patched with the variant; the adapters change the logits;
  after merging ``patch_of`` still reports the patch and ``remove`` gives the stock model of the merged weights;
- DoRA, the same for MHRoPE in both orders;
- with LoRA the vision tower and the mergers train in full unless ``train.freeze`` names them (gradients reach
  them), the decoder through its adapters only;
- LoRA at ZeRO-3 is refused when the config is read, before any model loads or any process group starts; so is
  LoRA with ``train.freeze`` naming llm (it would freeze the adapters).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from train.config import ConfigError, load_config  # noqa: E402
from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

R, ALPHA = 4, 8
ATOL = 1e-4  # fp32: merged and unmerged projections differ by ~2e-5 on the logits
OTHERS = {"qwen2_5_vl": ("mhrope", "qwen25vl", "pype"), "qwen3_vl": ("mhrope", "qwen3vl", "vrope")}
CASES = [("qwen2_vl", v) for v in sorted(mm.VARIANTS)] + [(f, v) for f, vs in OTHERS.items() for v in vs]
_SOURCES: dict = {}


def source(family, tiny_qwen_vl):
    """The folder's model (eval mode) and the processed prompt: text, an image of 2x2 merged tokens, text, a
    four-frame video, text."""
    if family not in _SOURCES:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        folder = tiny_qwen_vl(family)
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
        g = np.random.default_rng(0)
        image = g.integers(0, 256, (56, 56, 3), dtype=np.uint8)
        video = g.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
        vs, ve = "<|vision_start|>", "<|vision_end|>"
        text = f"What item {vs}{processor.image_token}{ve} is shown {vs}{processor.video_token}{ve} in red ?"
        meta = {"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}
        inputs = processor(text=[text], images=[image], videos=[video], video_metadata=[meta], do_sample_frames=False,
                           return_tensors="pt", return_mm_token_type_ids=True)  # fmt: skip
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        _SOURCES[family] = (model.eval(), inputs)
    return _SOURCES[family]


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits  # (1, S, V)


def adapted(model, variant, order, *, dora=False):
    """A copy of ``model`` with the fine-tune's adapters (random, seeded) and the patch, in ``order``."""
    from train.finetune import _lora
    from train.vlm_setup import LoraSection

    model = copy.deepcopy(model)
    if order == "patch_first":
        vhf.apply(model, variant)
    model = _lora(model, LoraSection(enabled=True, r=R, alpha=ALPHA, dropout=0.0, use_dora=dora))
    if order == "adapters_first":
        vhf.apply(model, variant)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_magnitude_vector" in name:  # DoRA: a magnitude per output row, away from the weight's norm
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def merged_by_hand(model, *, dora=False):
    """The stock state dict of an adapted model, every adapter merged into its weight here (not by peft)."""
    state = {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            W = module.base_layer.weight.detach()  # (out, in)
            A = module.lora_A["default"].weight.detach()  # (r, in)
            B = module.lora_B["default"].weight.detach()  # (out, r)
            W = W + ALPHA / R * (B @ A)
            if dora:
                m = module.lora_magnitude_vector["default"].weight.detach()  # (out,)
                W = m[:, None] * W / W.norm(dim=1, keepdim=True)
            state[f"{name}.weight"] = W
            if module.base_layer.bias is not None:
                state[f"{name}.bias"] = module.base_layer.bias.detach()
    for name, value in model.state_dict().items():
        if "lora_" not in name and ".base_layer." not in name:
            state[name] = value
    return state


def check_merging(family, variant, order, tiny_qwen_vl, *, dora=False):
    base, inputs = source(family, tiny_qwen_vl)
    model = adapted(base, variant, order, dora=dora)
    assert any("lora_" in n for n, _ in model.named_parameters())
    reference = copy.deepcopy(base)
    reference.load_state_dict(merged_by_hand(model, dora=dora))
    stock = logits(reference, inputs)
    vhf.apply(reference, variant)
    want = logits(reference, inputs)
    plain = copy.deepcopy(base)
    vhf.apply(plain, variant)
    assert (logits(plain, inputs) - want).abs().max() > 0.1  # the adapters matter
    torch.testing.assert_close(logits(model, inputs), want, atol=ATOL, rtol=ATOL)
    patch = vhf.patch_of(model)
    merged = model.__dict__["_vlpe_peft"].merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert vhf.patch_of(merged) is patch
    torch.testing.assert_close(logits(merged, inputs), want, atol=ATOL, rtol=ATOL)
    vhf.remove(merged)  # no per-head hook stays behind, wherever it had moved
    torch.testing.assert_close(logits(merged, inputs), stock, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("order", ["patch_first", "adapters_first"])
@pytest.mark.parametrize("family,variant", CASES)
def test_lora_logits_equal_before_and_after_merging(family, variant, order, tiny_qwen_vl):
    check_merging(family, variant, order, tiny_qwen_vl)


@pytest.mark.parametrize("order", ["patch_first", "adapters_first"])
def test_dora_logits_equal_before_and_after_merging(order, tiny_qwen_vl):
    check_merging("qwen2_vl", "mhrope", order, tiny_qwen_vl, dora=True)


def test_cases_cover_every_variant_and_mhrope_on_every_family():
    assert {v for _, v in CASES} == set(mm.VARIANTS)
    assert {f for f, v in CASES if v == "mhrope"} == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}


def _part(name: str) -> str:
    if "lora_" in name:
        return "adapter"
    if ".visual." not in f".{name}":
        return "llm"
    merger = any(m in name for m in ("visual.merger.", "visual.deepstack_merger_list."))
    return "merger" if merger else "vision"


@pytest.mark.parametrize("family,dora", [("qwen2_vl", False), ("qwen3_vl", True)])
def test_lora_trains_the_vision_tower_and_mergers_unless_frozen(family, dora, tiny_qwen_vl):
    from train.finetune import load_model
    from train.vlm_setup import VLMConfig

    folder = tiny_qwen_vl(family)
    _, inputs = source(family, tiny_qwen_vl)
    common = [f"model.hf_model={folder}", "data.annotations=a.json", "train.zero_stage=2", "model.lora.enabled=true",
              "model.variant=mhrope", "train.gradient_checkpointing=false",
              f"model.lora.use_dora={str(dora).lower()}"]  # fmt: skip
    for freeze, trained in (([], {"adapter", "vision", "merger"}), (["vision"], {"adapter", "merger"}),
                            (["merger"], {"adapter", "vision"})):  # fmt: skip
        cfg = load_config(VLMConfig, f"configs/hf/{family}.yaml", [*common, f"train.freeze=[{', '.join(freeze)}]"])
        model, _, _, _ = load_model(cfg, None)
        named = dict(model.named_parameters())
        assert {_part(n) for n in named} == {"adapter", "llm", "vision", "merger"}
        assert any("lora_magnitude_vector" in n for n in named) == dora
        for name, p in named.items():
            assert p.requires_grad == (_part(name) in trained), (freeze, name)
    # with nothing frozen, one backward pass reaches every tensor of the vision tower, the mergers and the adapters
    # (but lora_A, whose gradient is 0 while lora_B starts at 0)
    cfg = load_config(VLMConfig, f"configs/hf/{family}.yaml", [*common, "train.freeze=[]"])
    model, _, _, _ = load_model(cfg, None)
    model.train()
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    trained = {n: p for n, p in model.named_parameters() if _part(n) != "llm" and "lora_A" not in n}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values()), [
        n for n, p in trained.items() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert all(p.grad is None for n, p in model.named_parameters() if _part(n) == "llm")


def test_lora_refusals_come_when_the_config_is_read(tiny_qwen_vl, monkeypatch, tmp_path):
    import deepspeed
    import torch.distributed
    from transformers import AutoModelForImageTextToText

    from train.vlm_setup import VLMConfig
    from train.vlm import main as vlm_main

    def started(*args, **kwargs):
        raise AssertionError("a model loaded or the process group started before the configuration was checked")

    monkeypatch.setattr(deepspeed, "init_distributed", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", started)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    folder = tiny_qwen_vl("qwen2_vl")
    args = ["--config", "configs/hf/qwen2_vl.yaml", f"model.hf_model={folder}", "data.annotations=a.json",
            "model.lora.enabled=true", f"train.out_dir={tmp_path / 'run'}"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.lora.enabled=true needs train.zero_stage 0, 1 or 2, got 3"):
        vlm_main(args)  # configs/hf/ run at ZeRO-3 by default
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"train.freeze=\['llm'\]: the decoder trains through its LoRA adapters"):
        load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [*args[2:], "train.zero_stage=2", "train.freeze=[llm]"])
    ok = load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [*args[2:], "train.zero_stage=2",
                                                            "model.lora.use_dora=true"])  # fmt: skip
    assert ok.model.lora.use_dora and ok.train.zero_stage == 2
