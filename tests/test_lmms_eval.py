"""The lmms-eval model ``vlpe_qwen_vl`` (``vlpe/integrations/lmms_eval.py``), checked against lmms-eval 0.7.3 itself.

Runs only where lmms-eval is installed (``make lmms-setup``, then ``.venv-lmms/bin/python -m pytest
tests/test_lmms_eval.py``); skipped elsewhere, so ``make test`` needs none of it. A tiny random Qwen2-VL folder
(:func:`models.tiny_qwen_vl.save_tiny_qwen_vl`) is scored offline on a small local task: a few mp4 files and a PNG
written here, a JSON of questions, and task YAMLs in a temporary ``--include_path`` (one multiple-choice task, one
generation task). What is checked:
- lmms-eval's own command line finds the model through the vlpe entry point and scores both tasks with its own task
  machinery: accuracy from its ``acc`` metric equals the option of smallest logged loss (lmms-eval's convention:
  mean negative log-likelihood per token) against each document's gold index, and the generation task's metric is
  the mean of its ``process_results``;
- the variant is applied (the model's rotary is vlpe's, labelled with the variant) and ``variant=none`` is the stock
  model: its logits equal those of the folder loaded with ``AutoModelForImageTextToText``, and its
  ``loglikelihood`` equals the continuation's loss computed by hand from them; the variant changes them;
- a bad ``model_args`` value raises ValueError naming what was expected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lmms_eval", reason="lmms-eval is optional: `make lmms-setup` (or pip install 'vlpe[lmms]'), "
                                        "then .venv-lmms/bin/python -m pytest tests/test_lmms_eval.py")  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "videorope"
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QUESTION = "Which color fills the video ?"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

UTILS = '''\
from PIL import Image


def doc_to_visual(doc):
    return [Image.open(doc["media"]).convert("RGB")] if doc["media"].endswith(".png") else [doc["media"]]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    kw = lmms_eval_specific_kwargs or {}
    return kw.get("pre_prompt", "") + doc["question"] + " " + " , ".join(doc["options"]) + kw.get("post_prompt", "")


def doc_to_choice(doc):
    return doc["options"]


def process_results(doc, results):
    return {"exact": float(results[0].strip() == doc["options"][doc["answer"]])}
'''

TASK = '''\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
lmms_eval_specific_kwargs:
  default:
    pre_prompt: ""
    post_prompt: " Answer :"
'''
MC = TASK + '''\
doc_to_choice: !function utils.doc_to_choice
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
'''
GEN = TASK + '''\
doc_to_target: answer
generation_kwargs:
  max_new_tokens: 3
  until: ["<|im_end|>"]
process_results: !function utils.process_results
metric_list:
  - metric: exact
    aggregation: mean
    higher_is_better: true
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    texts = [QUESTION, " , ".join(COLORS), "Answer :"]
    return save_tiny_qwen_vl("qwen2_vl", tmp_path_factory.mktemp("lmms") / "tiny-qwen2-vl", texts=texts, frame=28,
                             max_frame=56)  # fmt: skip


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    """A task folder for ``--include_path``: 3 single-color mp4 files (8 frames at 4 fps, a little noise), one
    PNG, the questions as JSON, ``utils.py`` and the two task YAMLs."""
    from PIL import Image

    from data.video import write_video

    root = tmp_path_factory.mktemp("lmms_tasks")
    rng = np.random.default_rng(0)
    docs = []
    for i, (name, rgb) in enumerate(COLORS.items()):
        frames = np.clip(np.array(rgb) + rng.integers(-20, 20, (8, 56, 56, 3)), 0, 255).astype(np.uint8)
        path = write_video(root / f"{name}.mp4", frames, fps=4.0)
        docs.append({"media": str(path), "question": QUESTION, "options": list(COLORS), "answer": i})
    png = root / "still.png"
    Image.fromarray(np.full((56, 56, 3), COLORS["green"], np.uint8)).save(png)
    docs.append({"media": str(png), "question": QUESTION, "options": list(COLORS), "answer": 1})
    (root / "docs.json").write_text(json.dumps(docs))
    (root / "utils.py").write_text(UTILS)
    for name, text, kind in (("vlpe_tiny_mc", MC, "multiple_choice"), ("vlpe_tiny_gen", GEN, "generate_until")):
        (root / f"{name}.yaml").write_text(text.format(name=name, data=root / "docs.json", output_type=kind))
    return root


def lmms_model(args: str):
    """The model as lmms-eval's CLI makes it: resolved by name through its registry, built from the arg string."""
    from lmms_eval.models import get_model

    return get_model("vlpe_qwen_vl").create_from_arg_string(args, {"device": "cpu"})


def request(lm, media: str, continuation: str | None):
    """One lmms-eval ``Instance`` (loglikelihood with ``continuation``, else generate_until) on a one-doc task."""
    from lmms_eval.api.instance import Instance

    lm.task_dict = {"t": {"test": [{"media": media}]}}
    second = continuation if continuation is not None else {"max_new_tokens": 4, "until": ["<|im_end|>"]}
    return Instance(request_type="loglikelihood" if continuation is not None else "generate_until",
                    arguments=(QUESTION, second, lambda doc: [doc["media"]], 0, "t", "test"), idx=0,
                    metadata={"task": "t", "doc_id": 0, "repeats": 1})  # fmt: skip


@pytest.mark.slow
def test_lmms_eval_cli_scores_the_tiny_model_on_a_local_task(folder, include, tmp_path):
    exe = Path(sys.executable).with_name("lmms-eval")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmms_eval"]
    out = tmp_path / "out"
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*cmd, "--model", "vlpe_qwen_vl", "--model_args",
                        f"pretrained={folder},variant={VARIANT},max_frames=4,fps=2",
                        "--tasks", "vlpe_tiny_mc,vlpe_tiny_gen", "--include_path", str(include), "--device", "cpu",
                        "--batch_size", "1", "--log_samples", "--output_path", str(out)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    print(r.stdout[-4000:])
    # lmms-eval logs an evaluation error and still exits 0: the results file is the proof
    log = r.stdout + r.stderr
    assert r.returncode == 0 and "Error during evaluation" not in log, r.stdout[-3000:] + r.stderr[-6000:]
    (results_file,) = out.rglob("*_results.json")
    results = json.loads(results_file.read_text())
    assert f"variant={VARIANT}" in results["config"]["model_args"]
    acc, exact = results["results"]["vlpe_tiny_mc"]["acc,none"], results["results"]["vlpe_tiny_gen"]["exact,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= exact <= 1.0
    docs = json.loads((include / "docs.json").read_text())
    (mc_file,) = out.rglob("*samples_vlpe_tiny_mc.jsonl")
    samples = [json.loads(line) for line in mc_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    hits = []
    for s in samples:
        losses = [float(resp[0]) for resp in s["filtered_resps"]]  # one (loss, is_greedy) per option
        assert len(losses) == len(COLORS) and all(np.isfinite(losses)) and all(x > 0 for x in losses)
        hits.append(int(np.argmin(losses)) == docs[s["doc_id"]]["answer"])
    assert acc == pytest.approx(float(np.mean(hits)))
    (gen_file,) = out.rglob("*samples_vlpe_tiny_gen.jsonl")
    gen = [json.loads(line) for line in gen_file.read_text().splitlines()]
    assert len(gen) == len(docs) and all(isinstance(s["filtered_resps"][0], str) for s in gen)
    assert exact == pytest.approx(float(np.mean([s["exact"] for s in gen])))


@pytest.mark.slow
def test_variant_is_applied_and_none_is_the_stock_model(folder, include, monkeypatch):
    from lmms_eval.api.instance import unwrap_generation_output
    from transformers import AutoModelForImageTextToText

    from vlpe.integrations import transformers as vlpe_hf
    from vlpe.integrations.transformers import MultimodalRotary

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    patched = lmms_model(f"pretrained={folder},variant={VARIANT},max_frames=4")
    stock = lmms_model(f"pretrained={folder},variant=none,max_frames=4")
    assert isinstance(patched.model.model.language_model.rotary_emb, MultimodalRotary)
    assert patched.label == vlpe_hf.patch_of(patched.model).label == VARIANT
    assert vlpe_hf.patch_of(stock.model) is None and stock.label == "none"
    reference = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()

    video = str(include / "red.mp4")
    req = request(stock, video, " red")
    inputs = stock._inputs(req)
    with torch.no_grad():
        logits = stock.model(**inputs).logits
        assert torch.equal(logits, reference(**inputs).logits)
        assert not torch.allclose(patched.model(**inputs).logits, logits)
        # the option's loss by hand: prompt + " red" through the stock model in one forward (one token)
        (cont,) = stock.tokenizer(" red", add_special_tokens=False)["input_ids"]
        full = {k: torch.cat([v, torch.tensor([[cont if k == "input_ids" else int(k == "attention_mask")]])], 1)
                if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v for k, v in inputs.items()}
        by_hand = reference(**full).logits[0, -2].double().log_softmax(-1)[cont]
    [(loss, greedy)] = [unwrap_generation_output(x)[0] for x in stock.loglikelihood([req])]  # as the evaluator does
    assert loss == pytest.approx(-float(by_hand), abs=1e-6) and isinstance(greedy, bool)
    [(loss_patched, _)] = [unwrap_generation_output(x)[0] for x in patched.loglikelihood([request(patched, video,
                                                                                                " red")])]
    assert loss_patched != pytest.approx(loss, abs=1e-6)
    for lm in (stock, patched):
        for media in (video, str(include / "still.png")):
            (text,) = lm.generate_until([request(lm, media, None)])
            assert isinstance(text, str) and "<|im_end|>" not in text


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_other_families_score_videos_and_images(family, include, tmp_path, monkeypatch):
    """Qwen2.5-VL (absolute time from the frames' timestamps) and Qwen3-VL (rendered frame times) load and answer both
    request kinds under the variant, for a video and an image."""
    from lmms_eval.api.instance import unwrap_generation_output

    from models.tiny_qwen_vl import save_tiny_qwen_vl

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    texts = [QUESTION, " , ".join(COLORS), "Answer :"]
    folder = save_tiny_qwen_vl(family, tmp_path / family, texts=texts, frame=28, max_frame=56)
    lm = lmms_model(f"pretrained={folder},variant={VARIANT},max_frames=4")
    assert lm.label == VARIANT
    for media in (str(include / "blue.mp4"), str(include / "still.png")):
        [(loss, greedy)] = [unwrap_generation_output(x)[0] for x in lm.loglikelihood([request(lm, media, " blue")])]
        assert np.isfinite(loss) and loss > 0 and isinstance(greedy, bool)
        (text,) = lm.generate_until([request(lm, media, None)])
        assert isinstance(text, str)


def test_bad_model_args_name_what_was_expected(folder, tmp_path):
    cases = {
        f"pretrained={tmp_path}": "config.json",
        f"pretrained={folder},variant=not_a_variant": "variant= expects none or one of",
        f"pretrained={folder},variant={VARIANT},scaling=yarn": "scaling= expects a JSON object",
        f"pretrained={folder},variant=none,scaling={{\"type\":\"linear\",\"factor\":2}}": "variant=none",
        f"pretrained={folder},variant={VARIANT},dtype=int8": "dtype= expects one of",
        f"pretrained={folder},variant={VARIANT},max_frames=0": "max_frames= expects a positive int",
        f"pretrained={folder},variant={VARIANT},max_frames=inf": "max_frames= expects a positive int",
        f"pretrained={folder},variant={VARIANT},fps=nan": "fps= expects a positive float",
        f"pretrained={folder},variant={VARIANT},fps=inf": "fps= expects a positive float",
        f"pretrained={folder},variant={VARIANT},frames=8": "unknown model_args ['frames']",
        f"pretrained={folder}": "variant=NAME",  # the folder records no variant
    }
    for args, expected in cases.items():
        with pytest.raises(ValueError) as err:
            lmms_model(args)
        assert expected in str(err.value), (args, str(err.value))


def test_an_export_is_evaluated_as_it_was_trained(folder, tmp_path, monkeypatch):
    """A vlpe-only export (stock loaders refuse it) loads under its recorded variant and, with variant=none, as the
    stock model with its weights; fps and max_frames default to the ones its record says it was trained with."""
    from transformers import AutoModelForImageTextToText

    from vlpe.integrations import transformers as vlpe_hf

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    model = vlpe_hf.apply(AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True), VARIANT)
    export = tmp_path / "export"
    vlpe_hf.save_pretrained(model, export, preprocessing={"fps": 1.0, "max_frames": 6})
    for f in folder.iterdir():  # the processor files
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            (export / f.name).write_bytes(f.read_bytes())
    assert json.loads((export / "config.json").read_text())["vlpe"]["export"]["stock"] is False
    recorded = lmms_model(f"pretrained={export}")
    assert recorded.label == VARIANT and (recorded.fps, recorded.max_frames) == (1.0, 6)
    given = lmms_model(f"pretrained={export},fps=3,max_frames=8")
    assert (given.fps, given.max_frames) == (3.0, 8)
    stock = lmms_model(f"pretrained={export},variant=none")
    assert vlpe_hf.patch_of(stock.model) is None and (stock.fps, stock.max_frames) == (1.0, 6)
    plain = lmms_model(f"pretrained={folder},variant=none")  # no record: the documented defaults
    assert (plain.fps, plain.max_frames) == (2.0, 32)


def test_the_recorded_pixel_budgets_resize_the_inputs(folder, include, tmp_path, monkeypatch):
    """A folder trained at a smaller budget than its processor's is evaluated at that budget: the processor's own
    output at the recorded size is the reference."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlpe.integrations import transformers as vlpe_hf

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    model = vlpe_hf.apply(AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True), VARIANT)
    export = tmp_path / "export"
    budget = 28 * 28  # one merged patch per frame / image; the folder's processor allows up to 56 x 56
    vlpe_hf.save_pretrained(model, export, processor=AutoProcessor.from_pretrained(folder, local_files_only=True),
                            preprocessing={"max_pixels": budget, "image_max_pixels": budget})  # fmt: skip
    docs = json.loads((include / "docs.json").read_text())
    for media in (docs[0]["media"], docs[-1]["media"]):  # a video, the PNG
        grids = []
        for path in (folder, export):
            lm = lmms_model(f"pretrained={path},variant={VARIANT},max_frames=4")
            inputs = lm._inputs(request(lm, media, " red"))
            grids.append(inputs.get("video_grid_thw", inputs.get("image_grid_thw")))
        default, trained = grids
        assert trained[0, 1:].prod() <= budget // 14**2 < default[0, 1:].prod(), (default, trained)
