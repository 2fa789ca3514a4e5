"""Export of patched Qwen-VL models: folders stock transformers loads, restored exactly under vlpe.

The independent references are the stock model (its ``state_dict``, buffers and logits) and stock transformers
loading the folder (``AutoModelForImageTextToText.from_pretrained(..., output_loading_info=True)``). What is checked:
- a patched model's ``state_dict`` keys, ``named_buffers`` and non-persistent buffers are the stock model's (also
  with a persistent buffer on the stock rotary), state dicts load both ways, and the stock rotary gets back the
  tensors as moved and loaded with the patched model;
- ``save_pretrained`` of a patched model loads in stock transformers (a vlpe-only export with the config
  :func:`vhf.load_config` restores; stock loaders refuse it, see ``test_export_kinds.py``) with no missing /
  unexpected / mismatched key and no warning, with the stock model's weights and logits, and ``config.json`` holds
  the record of the call;
- :func:`vlpe_hf.from_pretrained` and ``apply(model)`` on the stock-loaded model give the saved model's logits on a
  prompt with an image and a video (mrope_i, videorope with an option, mhrope, pype, vrope, a YaRN time scaling,
  a Variant object with a section), the options changing the logits;
- options JSON cannot hold are named in the record and refused on restore; missing records, options without a
  variant and a stale record on an unpatched model are errors, and ``remove`` deletes the record;
- ``apply`` under a meta-device context (to_empty + load_state_dict, and inside ``from_pretrained`` through a
  subclass) gives the patched logits once materialised, and ``remove`` then the stock ones;
- :func:`vlpe_hf.save_pretrained` passes a given ``state_dict`` through, saves the processor, writes nothing off
  the main process; ``eval/long_video.py --hf-model`` evaluates a folder under its recorded variant.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integration_transformers import _build, logits, make_prompt  # noqa: E402
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

YARN_T = {"type": "yarn", "factor": {"t": 4}, "original_size": 64}


def mixed_prompt(family: str):
    """``(input_ids, mm_token_type_ids, kwargs)`` of text, an image block, text, a video block, text."""
    ids_i, types_i, kw_i = make_prompt(family, "image", post=2)
    ids_v, types_v, kw_v = make_prompt(family, "video", pre=2, seed=3)
    return torch.cat([ids_i, ids_v], 1), torch.cat([types_i, types_v], 1), {**kw_i, **kw_v}


def stock_load(folder):
    """The folder loaded by stock transformers, with its loading info and every warning it logged / raised; a
    vlpe-only export (which stock transformers refuses, see ``test_export_kinds.py``) with the config vlpe restores
    (:func:`vhf.load_config`), i.e. the stock model holding the exported weights."""
    vlpe_only = json.loads((folder / "config.json").read_text()).get("vlpe", {}).get("export", {}).get("stock") is False
    config = {"config": vhf.load_config(folder)} if vlpe_only else {}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True,
                                                                      output_loading_info=True, **config)  # fmt: skip
    finally:
        logger.removeHandler(handler)
    return model.eval(), info, [r.getMessage() for r in records] + [str(w.message) for w in caught]


def names(pairs) -> list[str]:
    return sorted(name for name, _ in pairs)


# ------------------------------------------------------------------------------------------------ state dict
@pytest.mark.parametrize("variant", ["mrope_i", "mhrope", "pype"])
def test_state_dict_and_buffers_are_the_stock_models(variant):
    stock = _build("qwen2_vl")
    stock.model.language_model.rotary_emb.register_buffer("extra", torch.arange(4.0))  # persistent
    model = _build("qwen2_vl")
    model.model.language_model.rotary_emb.register_buffer("extra", torch.arange(4.0))
    vhf.apply(model, variant)
    assert sorted(model.state_dict()) == sorted(stock.state_dict())
    assert "model.language_model.rotary_emb.extra" in model.state_dict()
    assert names(model.named_buffers()) == names(stock.named_buffers())
    assert names(model.named_non_persistent_buffers()) == names(stock.named_non_persistent_buffers())
    # stock -> patched and patched -> stock, strictly
    sd = {k: v + 1 if k.endswith("rotary_emb.extra") else v for k, v in stock.state_dict().items()}
    model.load_state_dict(sd)
    stock.load_state_dict(model.state_dict())
    assert torch.equal(stock.model.language_model.rotary_emb.extra, torch.arange(4.0) + 1)
    model.double()
    rotary = vhf.remove(model).model.language_model.rotary_emb
    assert type(rotary) is type(stock.model.language_model.rotary_emb)
    assert torch.equal(rotary.extra, torch.arange(4.0, dtype=torch.float64) + 1)  # loaded, then cast
    assert rotary.inv_freq.dtype == torch.float64
    assert torch.equal(rotary.inv_freq, stock.model.language_model.rotary_emb.inv_freq.double())


# ------------------------------------------------------------------------------------- stock transformers load
@pytest.mark.parametrize("family,variant", [("qwen2_vl", "pype"), ("qwen3_vl", "mhrope"), ("qwen2_5_vl", "videorope")])
def test_save_pretrained_of_a_patched_model_loads_in_stock_transformers(family, variant, tmp_path):
    stock = _build(family)
    data = mixed_prompt(family)
    want = logits(stock, *data)
    model = vhf.apply(_build(family), variant)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["vlpe"]
    assert record["export"]["stock"] is False  # another design than the family's: a vlpe-only export
    assert {k: v for k, v in record.items() if k != "export"} == {"format": 1, "variant": variant, "options": {}}
    loaded, info, logged = stock_load(tmp_path)
    assert type(loaded) is type(stock) and vhf.patch_of(loaded) is None
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"] and not logged, (info, logged)
    assert loaded.config.vlpe == record  # kept as a plain config attribute
    assert loaded.config.text_config._attn_implementation == stock.config.text_config._attn_implementation
    reference = stock.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(reference)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    torch.testing.assert_close(logits(loaded, *data), want, atol=0, rtol=0)


# -------------------------------------------------------------------------------------------------- restore
RESTORE = [
    ("qwen2_vl", "mrope_i", {}),
    ("qwen2_vl", "videorope", {"temporal_scale": 3.0}),
    ("qwen3_vl", "mhrope", {}),
    ("qwen2_5_vl", "pype", {}),
    ("qwen2_vl", "vrope", {}),
    ("qwen2_vl", "mrope_i", {"scaling": YARN_T}),
    ("qwen2_vl", mm.Variant("diagonal", "interleaved", {"temporal_scale": 1.5}), {"section": (6, 1, 1)}),
]


@pytest.mark.parametrize("family,variant,options", RESTORE, ids=lambda x: getattr(x, "label", str(x)))
def test_restored_model_gives_the_saved_models_logits(family, variant, options, tmp_path):
    data = mixed_prompt(family)
    stock = logits(_build(family), *data)
    model = vhf.apply(_build(family), variant, **options)
    want = logits(model, *data)
    assert (want - stock).abs().max() > 1e-3
    if options:  # the options matter: a restore that dropped them would be caught
        assert (want - logits(vhf.apply(_build(family), variant), *data)).abs().max() > 1e-3
    vhf.save_pretrained(model, tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["vlpe"]
    assert json.loads(json.dumps(record)) == record and "unrecorded" not in record
    assert record["options"] == json.loads(json.dumps(options))  # tuples as lists
    restored = vhf.from_pretrained(tmp_path).eval()
    assert vhf.patch_of(restored).variant == vhf.patch_of(model).variant
    torch.testing.assert_close(logits(restored, *data), want, atol=0, rtol=0)
    loaded, _, _ = stock_load(tmp_path)
    torch.testing.assert_close(logits(loaded, *data), stock, atol=0, rtol=0)
    vhf.apply(loaded)  # the record in its config
    torch.testing.assert_close(logits(loaded, *data), want, atol=0, rtol=0)


def test_options_json_cannot_hold_are_named_and_refused(tmp_path):
    model = vhf.apply(_build("qwen2_5_vl"), "qwen25vl", second_per_grid_ts=torch.tensor([1.0]))
    assert model.config.vlpe["unrecorded"] == ["second_per_grid_ts"]
    vhf.save_pretrained(model, tmp_path)
    loaded, info, logged = stock_load(tmp_path)  # still a stock-loadable folder
    assert not info["missing_keys"] and not info["unexpected_keys"] and not logged
    for restore in (lambda: vhf.from_pretrained(tmp_path), lambda: vhf.recorded_variant(tmp_path),
                    lambda: vhf.apply(loaded)):  # fmt: skip
        with pytest.raises(ValueError, match=r"\['second_per_grid_ts'\].*JSON"):
            restore()
    restored = vhf.from_pretrained(tmp_path, variant="qwen25vl", variant_options={"second_per_grid_ts": [1.0]})
    assert vhf.patch_of(restored).design_options["second_per_grid_ts"] == [1.0]
    v = mm.Variant("diagonal", "interleaved", {"generator": torch.Generator()})
    model = vhf.apply(_build("qwen2_vl"), v)
    assert model.config.vlpe["unrecorded"] == ["design_options.generator"]
    with pytest.raises(ValueError, match="design_options.generator"):
        vhf.apply(model)


def test_missing_records_and_misuse_are_errors(tmp_path):
    model = _build("qwen2_vl")
    with pytest.raises(ValueError, match="model.config has no vlpe record.*apply\\(model, variant"):
        vhf.apply(model)
    with pytest.raises(ValueError, match="without a variant"):
        vhf.apply(model, spatial_reset=True)
    vhf.apply(model, "mrope_i", spatial_reset=True)
    assert model.config.vlpe == {"format": 1, "variant": "mrope_i", "options": {"spatial_reset": True}}
    vhf.remove(model)
    assert not hasattr(model.config, "vlpe")
    stock_dir = tmp_path / "stock"
    vhf.save_pretrained(model, stock_dir)  # an unpatched model: a stock folder
    assert "vlpe" not in json.loads((stock_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="config.json has no vlpe record.*variant"):
        vhf.from_pretrained(stock_dir)
    with pytest.raises(ValueError, match="variant_options given without variant"):
        vhf.from_pretrained(stock_dir, variant_options={"spatial_reset": True})
    assert vhf.patch_of(vhf.from_pretrained(stock_dir, variant="vrope")).label == "vrope"
    with pytest.raises(ValueError, match="no config.json"):
        vhf.from_pretrained(tmp_path / "nothing")
    with pytest.raises(ValueError, match="not of format 1"):
        vhf.read_record({"variant": "mrope_i"}, where="here")
    model.config.vlpe = {"format": 1, "variant": "mrope_i", "options": {}}  # stale: not applied
    with pytest.raises(ValueError, match="carries no vlpe patch but its config records one"):
        vhf.save_pretrained(model, tmp_path / "stale")
    with pytest.raises(ValueError, match="safetensors only"):
        vhf.save_pretrained(vhf.apply(model), tmp_path / "bin", safe_serialization=False)


# ------------------------------------------------------------------------------------------------ meta device
@pytest.mark.parametrize("variant", ["mrope_i", "mhrope", "pype"])
def test_apply_on_the_meta_device(variant, tmp_path):
    config = _build("qwen2_vl").config
    reference = _build("qwen2_vl")
    ids, types, kw = data = mixed_prompt("qwen2_vl")
    E = torch.randn(1, ids.shape[1], config.text_config.hidden_size)  # the decoder alone (no vision buffers)
    with torch.no_grad():
        stock_logits = reference(inputs_embeds=E).logits
    stock_full = logits(reference, *data)
    vhf.apply(reference, variant)
    pos, _ = vhf.position_ids(reference, types, kw["image_grid_thw"], kw["video_grid_thw"])
    with torch.no_grad():
        want = reference(inputs_embeds=E, position_ids=pos).logits
    with torch.device("meta"):
        model = transformers.Qwen2VLForConditionalGeneration(config)
        vhf.apply(model, variant)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=E, position_ids=pos).logits, want, atol=0, rtol=0)
        vhf.remove(model)  # the stock rotary's buffers are recomputed: they were never loaded
        torch.testing.assert_close(model(inputs_embeds=E).logits, stock_logits, atol=0, rtol=0)
    # inside from_pretrained (a folder with the module names as keys, which a subclass loads as is)
    folder = tmp_path / "stock"
    vhf.remove(reference).save_pretrained(folder, save_original_format=False)

    class PatchedAtInit(transformers.Qwen2VLForConditionalGeneration):
        def __init__(self, config):  # under from_pretrained's meta-device init context
            super().__init__(config)
            vhf.apply(self, variant)

    loaded, info = PatchedAtInit.from_pretrained(folder, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and vhf.patch_of(loaded).label == variant
    full = logits(vhf.apply(reference, variant), *data)
    torch.testing.assert_close(logits(loaded.eval(), *data), full, atol=0, rtol=0)
    torch.testing.assert_close(logits(vhf.remove(loaded), *data), stock_full, atol=0, rtol=0)


# ------------------------------------------------------------------------------ save helper and evaluation
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    from data.vniah import PHOTO_NEEDLES, QUESTIONS

    texts = [QUESTIONS["needle"], "Options: , . Answer: seconds < > red cat", *PHOTO_NEEDLES.values()]
    return save_tiny_qwen_vl("qwen2_vl", tmp_path_factory.mktemp("tiny") / "tiny", texts=texts, frame=28)


def test_save_pretrained_helper_passes_state_dict_and_processor(tiny_folder, tmp_path):
    processor = AutoProcessor.from_pretrained(tiny_folder, local_files_only=True)
    model = vhf.apply(AutoModelForImageTextToText.from_pretrained(tiny_folder, local_files_only=True), "vrope")
    given = {k: v * 2 if k.endswith("embed_tokens.weight") else v for k, v in model.state_dict().items()}
    vhf.save_pretrained(model, tmp_path / "off", state_dict=given, processor=processor, is_main_process=False)
    assert not (tmp_path / "off" / "config.json").exists()
    out = vhf.save_pretrained(model, tmp_path / "out", state_dict=given, processor=processor)
    loaded, info, logged = stock_load(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not logged
    got = loaded.state_dict()
    assert all(torch.equal(got[k], given[k]) for k in given)
    assert not torch.equal(got["model.language_model.embed_tokens.weight"],
                           model.state_dict()["model.language_model.embed_tokens.weight"])  # fmt: skip
    again = AutoProcessor.from_pretrained(out, local_files_only=True)
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert type(again.video_processor) is type(processor.video_processor)
    assert vhf.recorded_variant(out) == ("vrope", {})


def test_evaluation_defaults_to_the_recorded_variant(tiny_folder, tmp_path):
    import hf_long_video
    import long_video

    model = AutoModelForImageTextToText.from_pretrained(tiny_folder, local_files_only=True)
    processor = AutoProcessor.from_pretrained(tiny_folder, local_files_only=True)
    out = vhf.save_pretrained(vhf.apply(model, "videorope", temporal_scale=3.0), tmp_path / "tuned",
                              processor=processor)  # fmt: skip
    hf = hf_long_video.load_hf_model(out)
    patch = vhf.patch_of(hf.model)
    assert patch.label == "videorope" and patch.design_options["temporal_scale"] == 3.0
    assert hf.variant == "videorope" and hf.variant_options == {"temporal_scale": 3.0}
    assert vhf.patch_of(hf_long_video.load_hf_model(out, variant="none").model) is None
    with pytest.raises(ValueError, match="without --variant: .*no vlpe record"):
        hf_long_video.load_hf_model(tiny_folder)
    small = ["--lengths", "2", "--depths", "0.0", "--samples", "1", "--tasks", "v_niah", "--haystack", "procedural",
             "--frame-size", "28", "--no-progress", "--device", "cpu"]  # fmt: skip
    (ev,) = long_video.main(["--hf-model", str(out), "--out", str(tmp_path / "report"), *small])
    assert ev["variant"] == "videorope" and ev["variant_options"] == {"temporal_scale": 3.0}
    explicit = hf_long_video.evaluate_hf(out, [2], [0.0], variant="videorope", variant_options={"temporal_scale": 3.0},
                                         tasks=("v_niah",), samples_per_cell=1, haystack="procedural", frame_size=28,
                                         progress=False)  # fmt: skip
    assert ev["tasks"]["v_niah"]["choice"]["logliks"] == explicit["tasks"]["v_niah"]["choice"]["logliks"]
    assert ev["max_position"] == explicit["max_position"]
