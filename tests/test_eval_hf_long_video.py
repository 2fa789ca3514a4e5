"""Long-video retrieval of a Hugging Face checkpoint folder (``eval/long_video.py --hf-model DIR --variant V``).

Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models of the installed transformers are saved with a real processor
(a word-level tokenizer built offline with ``tokenizers``, the families' own image and video processors) to a
folder, and the script is run on it end to end. What is checked:
- the command line writes the JSON, markdown and heatmaps; every accuracy is a fraction in [0, 1], the chance
  level is 1 / the number of options, and each sample's outcome is the argmax of its recorded option scores
  against the gold answer of an independently rebuilt dataset;
- the variant is applied: two variants give different position ids and different option scores on the same
  samples, and ``none`` leaves the stock model;
- the cached option scoring equals scoring ``prompt + option`` in one forward (multi-token options), for the
  patched and the stock model, in all three families;
- the haystack of ``--haystack VIDEO`` is that file's frames; errors for a folder that is not a checkpoint and
  for ``--hf-model`` without ``--variant`` on a folder whose config.json records no variant (the recorded variant
  itself: ``tests/test_integration_transformers_export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
import hf_long_video  # noqa: E402  (eval/ is on pytest's pythonpath)
import long_video  # noqa: E402

from data.vniah import PHOTO_NEEDLES, QUESTIONS  # noqa: E402

FRAME = 28  # one 2x2 merge of 14 px patches per frame


def save_tiny(family: str, folder: Path) -> Path:
    """A random ``family`` model (hidden 64, 1 layer, vision depth 1) and its processor (no chat template), saved
    to ``folder`` (:func:`models.tiny_qwen_vl.save_tiny_qwen_vl`)."""
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    texts = [QUESTIONS["needle"], "Options: , . Answer: seconds < > red cat", *PHOTO_NEEDLES.values()]
    return save_tiny_qwen_vl(family, folder, texts=texts, frame=FRAME, chat_template=False)


_FOLDERS: dict[str, Path] = {}


def folder_for(family: str, tmp_path_factory) -> Path:
    if family not in _FOLDERS:
        _FOLDERS[family] = save_tiny(family, tmp_path_factory.mktemp(family) / f"tiny-{family}")
    return _FOLDERS[family]


@pytest.fixture(scope="module")
def haystack_file(tmp_path_factory) -> Path:
    """A user's video: 12 frames of procedural footage written to an mp4."""
    from data.video import ProceduralVideo, write_video

    frames = ProceduralVideo(height=64, width=64, seed=3).frames(np.arange(12))
    return write_video(tmp_path_factory.mktemp("video") / "mine.mp4", frames, fps=4)


# --------------------------------------------------------------------------------------------------- end to end
def test_command_line_writes_reports_and_applies_the_variant(tmp_path_factory, haystack_file, tmp_path):
    folder = folder_for("qwen2_vl", tmp_path_factory)
    out = tmp_path / "report"
    lengths, depths, samples = [2, 4], [0.0, 1.0], 2
    evals = long_video.main([
        "--hf-model", str(folder), "--variant", "mrope_i", "vrope", "--haystack", str(haystack_file),
        "--lengths", *map(str, lengths), "--depths", *map(str, depths), "--samples", str(samples),
        "--frame-size", str(FRAME), "--out", str(out), "--no-progress", "--device", "cpu",
    ])  # fmt: skip
    assert (out / "long_video.json").is_file() and (out / "long_video.md").is_file()
    for ev in evals:
        assert (out / f"heatmap_{ev['name']}.png").is_file()
    saved = json.loads((out / "long_video.json").read_text())["runs"]
    assert [ev["variant"] for ev in saved] == ["mrope_i", "vrope"]
    assert "multiple choice" in (out / "long_video.md").read_text()

    gold_sets = {t: hf_long_video.build_hf_task(t, lengths, depths, samples_per_cell=samples, seed=0,
                                                frame_size=FRAME, haystack=str(haystack_file), needles="photos",
                                                delta=4, fps=2.0) for t in ("v_niah", "v_niah_d")}  # fmt: skip
    options = list(PHOTO_NEEDLES.values())
    for ev in saved:
        assert ev["chance"] == pytest.approx(1 / len(options)) and ev["options"] == options
        for t, entry in ev["tasks"].items():
            r = entry["choice"]
            cells = [a for row in r["grid"] for a in row]
            assert all(0.0 <= a <= 1.0 for a in cells) and len(cells) == len(lengths) * len(depths)
            for key in ("mean", "in_distribution", "extrapolated"):
                assert 0.0 <= r[key] <= 1.0
            # each outcome is the argmax of the recorded option scores against the independently rebuilt gold
            hits = [int(np.argmax(s)) == options.index(gold_sets[t][i]["answer"]) for i, s in enumerate(r["logliks"])]
            n = len(depths) * samples
            per_length = [sum(hits[j * n:(j + 1) * n]) / n for j in range(len(lengths))]
            assert r["per_length"] == pytest.approx(per_length)
    a, b = saved
    assert a["max_position"] != b["max_position"], "the two variants gave the same position ids"
    la, lb = np.array(a["tasks"]["v_niah"]["choice"]["logliks"]), np.array(b["tasks"]["v_niah"]["choice"]["logliks"])
    assert np.abs(la - lb).max() > 1e-6, "the two variants scored the options identically"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_other_families_evaluate(family, tmp_path_factory):
    folder = folder_for(family, tmp_path_factory)
    ev = hf_long_video.evaluate_hf(folder, [2, 4], [0.5], variant="videorope", tasks=("v_niah",),
                                   samples_per_cell=1, haystack="procedural", frame_size=FRAME, progress=False)  # fmt: skip
    r = ev["tasks"]["v_niah"]["choice"]
    assert ev["family"] == family and all(0.0 <= a <= 1.0 for a in r["per_length"])
    assert len(r["logliks"]) == 2 and all(len(s) == len(PHOTO_NEEDLES) for s in r["logliks"])


# ------------------------------------------------------------------------------------------------------ scoring
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("variant", ["mrope_i", "none"])
def test_cached_option_scores_equal_one_forward_over_prompt_and_option(family, variant, tmp_path_factory):
    from vlpe.integrations import transformers as vlpe_hf

    hf = hf_long_video.load_hf_model(folder_for(family, tmp_path_factory), variant=variant)
    assert (vlpe_hf.patch_of(hf.model) is None) == (variant == "none")
    task = hf_long_video.build_hf_task("v_niah", [4], [0.5], samples_per_cell=1, seed=1, frame_size=FRAME,
                                       haystack="procedural", needles="photos", delta=4, fps=2.0)  # fmt: skip
    options = ["cat", "red cat", "moon red cat", "astronaut"]  # one to three tokens
    prompt, option_ids = hf_long_video.prompt_and_options(hf, QUESTIONS["needle"], options)
    assert [len(i) for i in option_ids] == [1, 2, 3, 1]
    inputs = hf_long_video.model_inputs(hf, prompt, task[0], 2.0, torch.device("cpu"))
    cached = hf_long_video.option_logliks(hf.model, inputs, option_ids)
    S = inputs["input_ids"].shape[1]
    for k, toks in enumerate(option_ids):
        full = dict(inputs)
        extra = torch.tensor([toks])
        full["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], 1)
        with torch.no_grad():
            logp = hf.model(**full, use_cache=False).logits[0].double().log_softmax(-1)
        expected = sum(float(logp[S - 1 + i, t]) for i, t in enumerate(toks))
        assert float(cached[k]) == pytest.approx(expected, abs=1e-4), (k, options[k])


# ------------------------------------------------------------------------------------------------ data / errors
def test_the_haystack_is_the_users_video(haystack_file):
    from data.video import read_video

    pool = read_video(haystack_file, size=(FRAME, FRAME), backend="av").frames
    task = hf_long_video.build_hf_task("v_niah", [6], [0.0], samples_per_cell=2, seed=0, frame_size=FRAME,
                                       haystack=str(haystack_file), needles="photos", delta=4, fps=2.0)  # fmt: skip
    for sample in task:
        frames = sample["frames"].numpy()
        assert sample["needle_index"] == 0
        for f in frames[1:]:  # every frame but the needle's is a frame of the file
            assert min(np.abs(f.astype(int) - p.astype(int)).max() for p in pool) == 0


def test_errors(tmp_path, tmp_path_factory, capsys):
    with pytest.raises(ValueError, match="no config.json"):
        hf_long_video.load_hf_model(tmp_path, variant="mrope_i")
    with pytest.raises(ValueError, match="neither a video file nor a shipped clip"):
        from data.vniah import RealHaystack

        RealHaystack((str(tmp_path / "missing.mp4"),))
    # no --variant: the folder's config.json must record one (a stock checkpoint does not)
    for folder, reason in ((folder_for("qwen2_vl", tmp_path_factory), "no vlpe record"), (tmp_path, "no config.json")):
        with pytest.raises(SystemExit):
            long_video.main(["--hf-model", str(folder)])
        err = capsys.readouterr().err
        assert reason in err and "--variant" in err, err
    with pytest.raises(SystemExit):
        long_video.main([])  # neither --run nor --hf-model


def test_a_report_mixing_trained_runs_and_checkpoint_folders_has_a_table_per_scoring(tmp_path_factory):
    folder = folder_for("qwen2_vl", tmp_path_factory)
    hf = hf_long_video.evaluate_hf(folder, [2], [0.0], variant="mrope", tasks=("v_niah",), samples_per_cell=1,
                                   haystack="procedural", frame_size=FRAME, progress=False)  # fmt: skip
    choice = hf["tasks"]["v_niah"]["choice"]
    run = {**hf, "name": "trained", "tasks": {"v_niah": {"teacher": choice, "generate": choice, "agreement": 1.0}}}
    text = long_video.markdown([run, hf])
    sections = text.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["V-NIAH, teacher-forced", "V-NIAH, greedy generation",
                                                     "V-NIAH, multiple choice"]  # fmt: skip
    assert "trained" in sections[0] and hf["name"] not in sections[0]
    assert hf["name"] in sections[2] and "| trained |" not in sections[2]


def test_answer_words_the_tokenizer_cannot_encode_are_refused(tmp_path):
    import re

    from models.tiny_qwen_vl import save_tiny_qwen_vl

    folder = save_tiny_qwen_vl("qwen2_vl", tmp_path / "tiny", texts=[QUESTIONS["needle"], "cat"], frame=28)
    hf = hf_long_video.load_hf_model(folder, variant="none")
    options = list(PHOTO_NEEDLES.values())
    missing = [o for o in options if o != "cat"]
    with pytest.raises(ValueError, match=re.escape(f"cannot encode the answer word(s) {missing}: they become")):
        hf_long_video.prompt_and_options(hf, QUESTIONS["needle"], options)
    with pytest.raises(ValueError, match=r"the tokenizer cannot encode the answer word\(s\)"):
        hf_long_video.evaluate_hf(folder, [2], [0.5], variant="none", tasks=("v_niah",), samples_per_cell=1,
                                  haystack="procedural", frame_size=FRAME, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("encodes the option(s) ['cat'] like an earlier option")):
        hf_long_video.prompt_and_options(hf, QUESTIONS["needle"], ["cat", "cat"])
