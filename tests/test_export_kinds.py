"""The two kinds of export, as stock loaders meet them (:mod:`vlpe.integrations.transformers.stock`).

The independent reference is stock transformers in a process that never imports vlpe (checked: ``vlpe`` is not in
its ``sys.modules``), loading the exported folder with ``AutoModelForImageTextToText`` and computing logits on
the same inputs. What is checked:
- a variant the family's config expresses (the checkpoint's own design with another ``mrope_section``, a
  ``rope_theta``; Qwen3-VL's interleaved split) is written there: stock gives vlpe's logits on a prompt with an
  image and a video, and the record states the released position semantics;
- for Qwen2-VL and Qwen2.5-VL, text after a video whose last temporal position reaches its merged height / width
  is where transformers 5.x differs from the released models: stock's logits differ there, and the record says so;
- any other variant (another design, allocation, design option or a vlpe scaling) gives a folder stock transformers
  refuses, naming vlpe and ``from_pretrained``, while vlpe's ``from_pretrained`` gives the saved model's logits;
- a patched model's own ``model.save_pretrained`` writes the same kind as ``vlpe_hf.save_pretrained``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integration_transformers import _build, logits, make_prompt  # noqa: E402

from vlpe.integrations import transformers as vhf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# loads each folder with stock transformers and computes logits; never imports vlpe
STOCK = textwrap.dedent(
    """
    import json, sys, torch
    from transformers import AutoModelForImageTextToText
    jobs = json.loads(sys.argv[1])
    out = {}
    for name, job in jobs.items():
        try:
            model = AutoModelForImageTextToText.from_pretrained(job["folder"], local_files_only=True).eval()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results = []
        for path in job["inputs"]:
            inputs = torch.load(path, weights_only=True)
            with torch.no_grad():
                results.append(model(**inputs).logits)
        torch.save(results, job["folder"] + "/stock_logits.pt")
        out[name] = {"ok": True}
    assert not any(m == "vlpe" or m.startswith("vlpe.") for m in sys.modules), "vlpe was imported"
    print(json.dumps(out))
    """
)


def prompt(family: str, *, long_video: bool):
    """Text, an image, text, a video, text. ``long_video``: a video whose last temporal position reaches its
    merged height and width (4 temporal patches over a 2 x 2 merged grid), else one that stays below them."""
    ids_i, types_i, kw_i = make_prompt(family, "image", post=2)
    vgrid = (4, 4, 4) if long_video else (2, 8, 8)
    ids_v, types_v, kw_v = make_prompt(family, "video", pre=2, seed=3, vgrid=vgrid)
    ids, types = torch.cat([ids_i, ids_v], 1), torch.cat([types_i, types_v], 1)
    return {"input_ids": ids, "mm_token_type_ids": types, **kw_i, **kw_v}


def run_stock(jobs: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", STOCK, json.dumps(jobs)], capture_output=True, text=True, timeout=600,
                       cwd="/")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def vlpe_logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


STOCK_KIND = [
    ("qwen2_vl", "mrope", {"section": [4, 2, 2]}),
    ("qwen2_vl", "mrope", {"theta": 5e4}),
    ("qwen2_5_vl", "qwen25vl", {"section": [2, 3, 3]}),
    ("qwen3_vl", "qwen3vl", {"section": [6, 1, 1]}),
    ("qwen3_vl", "mrope_i", {}),  # the t/h/w grid on one block a frame: Qwen3-VL's own ids
]
VLPE_KIND = [
    ("qwen2_vl", "mrope_i", {}),
    ("qwen2_vl", "mrope", {"temporal_stride": 2}),
    ("qwen2_5_vl", "videorope", {}),
    ("qwen2_5_vl", "mrope", {}),  # Qwen2-VL's design on a Qwen2.5-VL checkpoint
    ("qwen3_vl", "mhrope", {}),
    ("qwen3_vl", "qwen3vl", {"scaling": {"type": "yarn", "factor": {"t": 4}, "original_size": 64}}),
]


def test_each_kind_in_stock_transformers_without_vlpe(tmp_path):
    jobs, expected = {}, {}
    for i, (family, variant, options) in enumerate(STOCK_KIND + VLPE_KIND):
        model = vhf.apply(_build(family), variant, **options)
        folder = tmp_path / f"{i}-{family}-{variant}"
        if i % 2:
            model.save_pretrained(folder)  # the patched model's own method exports the same way
        else:
            vhf.save_pretrained(model, folder)
        files, want = [], []
        for long_video in (False, True):
            inputs = prompt(family, long_video=long_video)
            torch.save(inputs, folder / f"inputs_{long_video}.pt")
            files.append(str(folder / f"inputs_{long_video}.pt"))
            want.append(vlpe_logits(model, inputs))
        jobs[str(i)] = {"folder": str(folder), "inputs": files}
        expected[str(i)] = (family, variant, options, folder, want)
    results = run_stock(jobs)
    for key, (family, variant, options, folder, want) in expected.items():
        record = json.loads((folder / "config.json").read_text())["vlpe"]
        stock = (family, variant, options) in STOCK_KIND
        assert record["export"]["stock"] is stock, (family, variant, options, record)
        if not stock:
            error = results[key].get("error", "")
            assert "vlpe" in error and "vlpe.integrations.transformers.from_pretrained" in error, results[key]
            assert variant in error
            restored = vhf.from_pretrained(folder).eval()
            for long_video, w in zip((False, True), want):
                got = vlpe_logits(restored, prompt(family, long_video=long_video))
                torch.testing.assert_close(got, w, rtol=0, atol=0)
            continue
        assert results[key] == {"ok": True}, results[key]
        short, long = torch.load(folder / "stock_logits.pt", weights_only=True)
        torch.testing.assert_close(short, want[0], rtol=1e-5, atol=1e-5, msg=f"{family} {variant} {options}")
        assert "released" in record["export"]["positions"]
        if family == "qwen3_vl":  # one block a frame: no temporal extent, the same positions everywhere
            torch.testing.assert_close(long, want[1], rtol=1e-5, atol=1e-5)
            assert "transformers >= 5.0" not in record["export"]["positions"]
        else:  # the upstream difference, stated in the record
            assert (long - want[1]).abs().max() > 1e-3, (family, variant)
            assert "transformers >= 5.0" in record["export"]["positions"]


def test_the_options_decide_the_kind_without_loading_anything():
    """The kind follows from the patch alone: the family's own variant with only config-expressible settings."""
    from vlpe.integrations.transformers.stock import stock_rope

    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen2_vl"), "mrope"))) == {"mrope_section": [2, 3, 3]}
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen2_5_vl"), "qwen25vl"))) == {"mrope_section": [4, 2, 2]}
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen2_5_vl"), "qwen25vl", tokens_per_second=4))) is None
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen3_vl"), "qwen3vl", theta=2e4))) == {
        "mrope_section": [4, 2, 2], "rope_theta": 2e4}
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen2_vl"), "qwen3vl"))) is None  # one block a frame
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen3_vl"), "mrope_i"))) == {"mrope_section": [4, 2, 2]}
    assert stock_rope(vhf.patch_of(vhf.apply(_build("qwen2_vl"), "mrope", allocation="interleaved"))) is None


def test_edited_vlpe_only_records_are_refused_by_name(tmp_path):
    model = vhf.apply(_build("qwen2_vl"), "videorope")
    vhf.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["rope_parameters"]["rope_type"] = "default"  # refusal removed by hand, record kept
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*rope type 'text_config\.rope_parameters\.rope_type'"):
        vhf.from_pretrained(tmp_path)


def test_preprocessing_is_recorded_and_checked(tmp_path):
    model = vhf.apply(_build("qwen2_vl"), "mrope_i")
    vhf.save_pretrained(model, tmp_path, preprocessing={"fps": 1.0, "max_frames": 16, "min_pixels": None,
                                                         "max_pixels": 200704})  # fmt: skip
    assert vhf.recorded_preprocessing(tmp_path) == {"fps": 1.0, "max_frames": 16, "max_pixels": 200704}
    config = json.loads((tmp_path / "config.json").read_text())
    config["vlpe"]["preprocessing"]["fps"] = "fast"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*preprocessing"):
        vhf.recorded_preprocessing(tmp_path)
