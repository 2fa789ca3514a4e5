"""Long-video retrieval evaluation (eval/long_video.py) on a tiny VLM trained by the real training script.

What is checked:
- a checkpoint produced by ``train/vlm.py``'s ``main()`` (in-process, a few steps) loads and is evaluated on a
  V-NIAH / V-NIAH-D depth x length grid beyond its training length: every cell is a fraction of its samples,
  per-length, in-distribution (lengths <= the training length) and extrapolated means follow from the grid by
  hand; the JSON, markdown and heatmap files are written (also through the command line);
- both scorings against a model whose answer is known by construction: the decoder's attention and MLP outputs
  are zeroed, so each position predicts from its own token embedding through the tied head, and the embeddings
  are set so that ``?`` (the last prompt word) predicts one chosen answer word and that word predicts ``<eos>``.
  Teacher-forced and greedy-generation exact match must then both equal, cell by cell, the fraction of samples
  whose gold answer is that word (computed from the dataset, not from the code under test). Without the
  ``<eos>`` step the model names the word but never stops: teacher forcing (answer words only, LongVA) still
  scores it right and generation wrong, as documented;
- loading errors: a run of another script, a missing export.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

import long_video  # noqa: E402

FASHION = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
pytestmark = pytest.mark.skipif(not FASHION.exists(), reason="needs Debian dataset-fashion-mnist")

DIST_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TINY = [
    "model.num_layers=1", "model.vision_depth=1", "model.vision_dim=32", "data.frames=4",
    "data.train_samples=16", "data.val_samples=4", "train.steps=2", "train.micro_batch=4", "train.val_batches=1",
    "train.val_every=2", "train.ckpt_every=2", "train.log_every=1", "train.progress=false",
    "train.num_workers=0", "train.warmup_steps=1",
]  # fmt: skip
LENGTHS, DEPTHS, SAMPLES, SEED = [2, 4, 8], [0.0, 1.0], 4, 5


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A 2-step run of train/vlm.py (one process, in this process), trained at 4 frames."""
    import torch.distributed as dist

    from train import vlm as train_vlm

    out = tmp_path_factory.mktemp("vlm") / "tiny_mrope_i"
    saved = {k: os.environ.pop(k, None) for k in DIST_VARS}
    initialized = dist.is_initialized()
    try:
        train_vlm.main(["--config", str(ROOT / "configs" / "mrope_i.yaml"), *TINY, f"train.out_dir={out}"])
    finally:
        if dist.is_initialized() and not initialized:
            dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    return out


def test_grid_means_and_files(tiny_run, tmp_path):
    from matplotlib.image import imread

    ev = long_video.evaluate_run(tiny_run, LENGTHS, DEPTHS, samples_per_cell=SAMPLES, seed=SEED, progress=False)
    assert ev["train_frames"] == 4 and ev["lengths"] == LENGTHS and ev["depths"] == DEPTHS
    assert ev["variant"] == "mrope_i" and set(ev["tasks"]) == {"v_niah", "v_niah_d"}
    for task in ev["tasks"].values():
        assert 0.0 <= task["agreement"] <= 1.0
        for scoring in ("teacher", "generate"):
            r = task[scoring]
            grid = r["grid"]
            assert len(grid) == len(DEPTHS) and all(len(row) == len(LENGTHS) for row in grid)
            assert all(0.0 <= a <= 1.0 and (a * SAMPLES) == round(a * SAMPLES) for row in grid for a in row)
            per_length = [sum(row[j] for row in grid) / len(DEPTHS) for j in range(len(LENGTHS))]
            assert r["per_length"] == pytest.approx(per_length)
            assert r["in_distribution"] == pytest.approx((per_length[0] + per_length[1]) / 2)  # 2 and 4 frames
            assert r["extrapolated"] == pytest.approx(per_length[2])  # 8 frames
            assert r["mean"] == pytest.approx(sum(per_length) / 3)
    paths = long_video.write_report([ev], tmp_path / "out")
    saved = json.loads(paths["json"].read_text())["runs"][0]
    assert saved["tasks"]["v_niah"]["teacher"]["grid"] == ev["tasks"]["v_niah"]["teacher"]["grid"]
    md = paths["md"].read_text()
    assert "V-NIAH-D, greedy generation" in md and "| tiny_mrope_i | mrope_i | 4 |" in md
    png = tmp_path / "out" / "heatmap_tiny_mrope_i.png"
    assert imread(png).ndim == 3 and png.stat().st_size < 200_000
    # the command line: one task, one scoring, default lengths from the training length
    evals = long_video.main(["--run", str(tiny_run), "--depths", "0.5", "--samples", "1", "--tasks", "v_niah",
                             "--scoring", "teacher", "--out", str(tmp_path / "cli"), "--no-progress"])  # fmt: skip
    assert evals[0]["lengths"] == [2, 4, 8, 16, 32, 64] and set(evals[0]["tasks"]["v_niah"]) == {"teacher"}
    assert (tmp_path / "cli" / "long_video.json").is_file()


# ------------------------------------------------------------------------------------------------------------
# a model that is right by construction
# ------------------------------------------------------------------------------------------------------------


def bigram_run(src: Path, dst: Path, word: str, *, stops: bool) -> Path:
    """Copy of ``src`` whose decoder predicts the next token from the current one only: '?' -> ``word`` ->
    '<eos>' (or ``word`` again when ``stops`` is False)."""
    from safetensors.torch import load_file, save_file

    from data.text import WordTokenizer

    raw = yaml.safe_load((src / "config.yaml").read_text())
    tok = WordTokenizer(raw["tokenizer_words"])
    state = load_file(str(src / "model.safetensors"))
    prefix = "hf.model.language_model."
    emb = torch.zeros_like(state[prefix + "embed_tokens.weight"])  # (V, H): every other token is the zero vector
    emb[tok.token_to_id("?"), :2] = torch.tensor([1.0, 0.0])
    emb[tok.token_to_id(word), :2] = torch.tensor([2.0, 1.0])  # score against '?': 2 > 1 ('?' itself)
    if stops:
        emb[tok.eos_id, :2] = torch.tensor([1.5, 3.0])  # against word: 6 > 5 (word itself); against '?': 1.5 < 2
    state[prefix + "embed_tokens.weight"] = emb
    state["hf.lm_head.weight"] = emb.clone()  # tied
    for k in state:
        if k.startswith(prefix) and k.endswith(("o_proj.weight", "down_proj.weight")):
            state[k] = torch.zeros_like(state[k])  # residual stream = the token's own embedding
    state[prefix + "norm.weight"] = torch.ones_like(state[prefix + "norm.weight"])
    dst.mkdir(parents=True)
    save_file(state, str(dst / "model.safetensors"))
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    return dst


def gold_answers() -> list[str]:
    """The gold answers of the evaluation grid, from the dataset (cell-major: length, depth, sample)."""
    from data.vniah import VNIAH

    ds = VNIAH(lengths=LENGTHS, depths=DEPTHS, samples_per_cell=SAMPLES, size=16, split="test", seed=SEED)
    return [ds[i]["answer"] for i in range(len(ds))]


def expected_grid(answers: list[str], word: str) -> list[list[float]]:
    cell = lambda j, i: answers[(j * len(DEPTHS) + i) * SAMPLES : (j * len(DEPTHS) + i + 1) * SAMPLES]  # noqa: E731
    return [[sum(a == word for a in cell(j, i)) / SAMPLES for j in range(len(LENGTHS))] for i in range(len(DEPTHS))]


def test_teacher_forcing_and_generation_agree_when_the_answer_is_known(tiny_run, tmp_path):
    answers = gold_answers()
    word = Counter(answers).most_common(1)[0][0]
    want = expected_grid(answers, word)
    frac = sum(a == word for a in answers) / len(answers)
    assert 0 < frac < 1  # both outcomes occur

    run = bigram_run(tiny_run, tmp_path / "bigram", word, stops=True)
    ev = long_video.evaluate_run(run, LENGTHS, DEPTHS, samples_per_cell=SAMPLES, seed=SEED, progress=False)
    for task in ("v_niah", "v_niah_d"):  # same needles in both tasks (the distractor is blue, not asked about)
        r = ev["tasks"][task]
        assert r["teacher"]["grid"] == want and r["generate"]["grid"] == want
        assert r["agreement"] == 1.0

    # never emits <eos>: right under teacher forcing (answer words only), wrong under generation
    run = bigram_run(tiny_run, tmp_path / "no_stop", word, stops=False)
    ev = long_video.evaluate_run(run, LENGTHS, DEPTHS, samples_per_cell=SAMPLES, seed=SEED, tasks=["v_niah"],
                                 progress=False)  # fmt: skip
    r = ev["tasks"]["v_niah"]
    assert r["teacher"]["grid"] == want
    assert all(a == 0.0 for row in r["generate"]["grid"] for a in row)
    assert r["agreement"] == pytest.approx(1 - frac)


def test_load_errors(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        long_video.load_vlm_run(tmp_path / "nothing")
    other = tmp_path / "vit_run"
    other.mkdir()
    raw = yaml.safe_load((tiny_run / "config.yaml").read_text())
    (other / "config.yaml").write_text(yaml.safe_dump({**raw, "script": "vit"}))
    (other / "model.safetensors").write_bytes((tiny_run / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="train/vit.py"):
        long_video.load_vlm_run(other)
    with pytest.raises(ValueError, match="tasks must be among"):
        long_video.evaluate_run(tiny_run, [2], [0.0], tasks=["v_ruler"], progress=False)


def test_time_scaling_row_and_outcomes(tiny_run):
    """``scaling``: lengths up to the training length are untouched, longer ones change; outcomes are the hits."""
    import long_video
    from stats import unpack_bits

    kw = dict(tasks=["v_niah"], scorings=["teacher"], samples_per_cell=SAMPLES, seed=SEED, device="cpu",
              progress=False)
    plain = long_video.evaluate_run(tiny_run, [4, 16], DEPTHS, **kw)
    scaled = long_video.evaluate_run(tiny_run, [4, 16], DEPTHS, scaling="yarn", **kw)
    p, s = plain["tasks"]["v_niah"]["teacher"], scaled["tasks"]["v_niah"]["teacher"]
    assert s["outcomes"][0] == p["outcomes"][0]  # at the training length: no scaling
    for j in range(2):
        assert unpack_bits(p["outcomes"][j]).mean() == pytest.approx(p["per_length"][j])
    assert scaled["scaling"] == "yarn" and scaled["name"].endswith("+yarn")
    run = long_video.load_vlm_run(tiny_run)
    ext = long_video._time_extents(run.model, run.cfg, [4, 16])
    assert ext[16] > ext[4]  # the time extent of the position ids grows with the video
    with pytest.raises(ValueError, match="scaling"):
        long_video.evaluate_run(tiny_run, [4], DEPTHS, scaling="dynamic", **kw)
