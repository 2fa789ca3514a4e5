"""Long-video retrieval: a trained VLM on V-NIAH and V-NIAH-D over a depth x length grid beyond its training length.

    python eval/long_video.py --run runs/vlm_mrope_i --run runs/vlm_videorope
    python eval/long_video.py --run runs/vlm_mrope_i --lengths 4 8 16 32 64 128 --samples 10 --out outputs/long_video
    python eval/long_video.py --hf-model path/to/Qwen2-VL-2B-Instruct --variant mrope mrope_i --haystack my.mp4
    python eval/long_video.py --hf-model outputs/finetuned   # under the variant recorded in its config.json

The protocol of LongVA's V-NIAH and VideoRoPE's V-NIAH-D (the benchmark runs it as the ``vlm`` protocol of
``eval/protocols.py``), on the small frames of :mod:`data.vniah`: for every video length ``L`` (frames) and needle depth ``d`` the needle frame sits at frame
``round(d * (L - span))`` of a haystack of the run's kind (procedural or real), the question is the run's
("What item is shown in red?") and the answer one word. V-NIAH-D adds one distractor (a blue item of another
class) ``--delta`` frames before or after the needle (default: the run's ``data.delta``), side drawn with
p = 0.5 and forced near an edge, as in VideoRoPE's ``eval_v_ruler_interrupt.py``. Both tasks use the same seed,
so a V-NIAH-D sample has exactly the haystack and needle of its V-NIAH twin. Needles come from the held-out
(test) split; the evaluation seed differs from the one of the training-time validation.

Two scorings, both exact match per sample (0 or 1), cell score = mean over the cell's samples:

* ``teacher`` (LongVA's "PPL-based" scoring): one forward over prompt + gold answer; correct when the argmax
  at every answer position is the gold answer token (the closing ``<eos>`` is not scored, as in LongVA);
* ``generate``: greedy ``generate()`` from the prompt alone (left-padded batch), at most ``len(answer) + 1``
  new tokens; the decoded text up to ``<eos>`` must equal the answer. A model that names the right item but
  does not stop is wrong here, so the two scorings differ only by that (the report gives their agreement).

``in_distribution`` is the mean over lengths up to the training length (positions the model was trained
on), ``extrapolated`` the mean over longer lengths. Writes ``long_video.json``, ``long_video.md`` and one
heatmap per run (``heatmap_<run>.png``: depth x length, one panel per task and scoring) to ``--out``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from runs import pick_device
from long_video_report import (  # noqa: F401
    DEFAULT_DEPTHS,
    REPORT_SCORINGS,
    TASKS,
    heatmap,
    markdown,
    summarize,
    write_report,
)
from stats import pack_bits

import hf_long_video  # noqa: E402

__all__ = [
    "TASKS",
    "SCORINGS",
    "VLMRun",
    "load_vlm_run",
    "default_lengths",
    "DEFAULT_DEPTHS",
    "build_task",
    "score_batch",
    "evaluate_run",
    "markdown",
    "heatmap",
    "write_report",
    "main",
]

# TASKS (v_niah, v_niah_d), the report names of the scorings and DEFAULT_DEPTHS: long_video_report.py
SCALINGS = ("linear", "ntk", "yarn")  # training-free time scaling beyond the training length (--scaling)
SCORINGS = ("teacher", "generate")


@dataclass
class VLMRun:
    """A trained ``train/vlm.py`` run rebuilt from its export: model (eval mode), tokenizer and config."""

    path: Path
    name: str
    cfg: Any  # train.vlm_setup.VLMConfig
    tokenizer: Any
    model: Any  # models.vlm.VLM


def fine_tune_run(run_dir: str | Path) -> str | None:
    """What to say when ``run_dir`` is a fine-tune of a checkpoint folder (``train/vlm.py model.hf_model=...``), whose
    result is the Hugging Face folder ``<run_dir>/hf`` rather than a small-VLM export; None otherwise."""
    import yaml

    cfg_path = Path(run_dir) / "config.yaml"
    try:
        raw = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else None
    except yaml.YAMLError:
        return None  # load_vlm_run names the problem
    model = raw.get("model") if isinstance(raw, dict) else None
    if isinstance(model, dict) and model.get("hf_model"):
        return (f"{run_dir} fine-tuned the checkpoint folder {model['hf_model']}; evaluate its export with --hf-model "
                f"{Path(run_dir) / 'hf'} (it carries the variant it was trained with)")  # fmt: skip
    return None


def load_vlm_run(run_dir: str | Path, *, device: str | torch.device = "cpu") -> VLMRun:
    """Rebuild the VLM exported by ``train/vlm.py`` in ``run_dir`` (``config.yaml`` + ``model.safetensors``).

    The tokenizer is rebuilt from the word list the run recorded; the weights are loaded with safetensors
    (the output head may be missing: it is tied to the input embeddings).
    """
    import yaml
    from safetensors.torch import load_file

    from data.text import WordTokenizer
    from train.checkpoint import check_export
    from train.config import from_dict
    from models.vlm import vlm_from_config
    from train.vlm_setup import VLMConfig

    run_dir = Path(run_dir)
    problem = fine_tune_run(run_dir)
    if problem is not None:
        raise ValueError(problem)
    cfg_path, weights = run_dir / "config.yaml", run_dir / "model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise ValueError(
                f"{p} does not exist: --run must be the train.out_dir of a finished train/vlm.py run "
                f"(it holds config.yaml and model.safetensors)"
            )
    raw = yaml.safe_load(cfg_path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path} must be a mapping of config sections, got {type(raw).__name__}")
    if raw.get("script") != "vlm":
        raise ValueError(
            f"{run_dir} was exported by train/{raw.get('script')}.py but this evaluation needs a train/vlm.py run"
        )
    check_export(weights, raw, config_path=cfg_path)  # the exported model's own record of its config
    words = raw.get("tokenizer_words")
    if not isinstance(words, list) or not words:
        raise ValueError(f"{cfg_path} must record the tokenizer's word list (tokenizer_words)")
    sections = {k: raw[k] for k in ("model", "data", "train", "deepspeed") if k in raw}
    cfg = from_dict(VLMConfig, sections, where=str(cfg_path))
    tokenizer = WordTokenizer(words)
    model = vlm_from_config(cfg, tokenizer)
    recorded = raw.get("position_options") or {}
    rebuilt = {k: v for k, v in model.position_options.items() if k != "second_per_grid_ts"}
    if recorded and yaml.safe_load(yaml.safe_dump(rebuilt)) != recorded:
        raise ValueError(
            f"{cfg_path}: the rebuilt model's position options {rebuilt} differ from the recorded {recorded} "
            f"(was the config edited after training, or did the variant's defaults change?)"
        )
    result = model.load_state_dict(load_file(str(weights)), strict=False)
    missing = [k for k in result.missing_keys if k != "hf.lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{weights} does not match the model its config describes: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]} (was the config edited after training?)"
        )
    model = model.to(device).eval()
    return VLMRun(path=run_dir, name=run_dir.name, cfg=cfg, tokenizer=tokenizer, model=model)


def default_lengths(train_frames: int) -> list[int]:
    """Half, 1x, 2x, 4x, 8x and 16x the training length (frames), at least the needle span of 1."""
    return sorted({max(1, train_frames // 2), *(train_frames * f for f in (1, 2, 4, 8, 16))})


def build_task(cfg, task: str, lengths: Sequence[int], depths: Sequence[float], *, samples_per_cell: int,
               seed: int, delta: int | None = None, haystack: str | None = None):
    """The :class:`data.vniah.VNIAH` grid of ``task`` with the run's frames, needles and timing."""
    from data.vniah import VNIAH

    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    d = cfg.data
    return VNIAH(
        lengths=lengths, depths=depths, samples_per_cell=samples_per_cell, size=d.frame_size,
        haystack=haystack or d.haystack, needles=d.needles, split="test", needle_size=d.needle_size,
        needle_span=d.needle_span, distractors="single" if task == "v_niah_d" else None,
        delta=d.delta if delta is None else int(delta), fps=d.fps, seed=seed,
    )  # fmt: skip


@torch.no_grad()
def score_batch(model, tokenizer, samples: Sequence[dict], device: torch.device,
                scorings: Sequence[str] = SCORINGS) -> dict[str, list[bool]]:
    """Exact match of every sample under each scoring (see the module docstring); lists of bools."""
    from models.vlm import answer_accuracy
    from train.engine import move_to

    out: dict[str, list[bool]] = {}
    if "teacher" in scorings:
        batch = move_to(model.collator()(samples), device)
        labels = batch["labels"].masked_fill(batch["input_ids"] == tokenizer.eos_id, -100)  # answer words only
        correct, scored = answer_accuracy(model(batch)["logits"], labels)
        if not bool(scored.all()):
            raise ValueError("a sample has no answer tokens to score")
        out["teacher"] = [bool(c) for c in correct.cpu()]
    if "generate" in scorings:
        gold = [tokenizer.encode(s["answer"]) for s in samples]
        prompt = move_to(model.collator(prompt_only=True, padding_side="left", with_positions=False)(samples), device)
        n = max(len(g) for g in gold) + 1
        seq = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=tokenizer.eos_id,
                             pad_token_id=tokenizer.pad_id)  # fmt: skip
        new = seq[:, prompt["input_ids"].shape[1] :].cpu().tolist()
        hits = []
        for tokens, g in zip(new, gold):
            if tokenizer.eos_id in tokens:
                tokens = tokens[: tokens.index(tokenizer.eos_id)]
            else:
                tokens = tokens + [-1]  # never stopped: cannot equal the answer
            hits.append(tokens == g)
        out["generate"] = hits
    return out


def _cell_mean(values: list[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _time_extents(model, cfg, lengths: Sequence[int]) -> dict[int, float]:
    """Max time position id + 1 of a V-NIAH sample at every length and at the training length (the variant's
    own ids: the context a time-axis scaling stretches)."""
    from data.vlm_collate import VLMCollator

    vc = model.hf.config.vision_config
    collate = VLMCollator(model.tokenizer, patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                          merge_size=vc.spatial_merge_size, position_variant=model.variant,
                          position_options=model.position_options)  # fmt: skip
    out = {}
    for L in sorted({*lengths, cfg.data.frames}):
        sample = build_task(cfg, "v_niah", [L], [0.5], samples_per_cell=1, seed=0)[0]
        ids = collate([sample])["position_ids"]  # (A, 1, S)
        out[L] = float(ids[0].max()) + 1.0
    return out


def evaluate_run(
    run_dir: str | Path,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    *,
    tasks: Sequence[str] = TASKS,
    scorings: Sequence[str] = SCORINGS,
    samples_per_cell: int = 10,
    batch_size: int = 32,
    delta: int | None = None,
    haystack: str | None = None,
    seed: int | None = None,
    scaling: str | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> dict:
    """V-NIAH / V-NIAH-D accuracy of one exported VLM run on a depth x length grid; a JSON-ready dict.

    ``lengths`` default to :func:`default_lengths` of the training length, ``depths`` to 0, 0.2 ... 1.
    ``seed`` defaults to the run's ``data.seed + 2`` (training uses ``seed``, its validation ``seed + 1``).
    The batch shrinks with the length (``batch_size * train_frames / L``) so a batch holds about as many
    tokens at every length. Result ``tasks[task][scoring]`` holds ``grid`` (``[depth][length]`` accuracy),
    ``per_length``, ``per_depth``, ``mean``, ``in_distribution`` and ``extrapolated``; ``agreement`` the
    fraction of samples on which the two scorings agree; ``outcomes`` the per-sample exact matches of each
    length (packed bits, depth-major then sample: what the benchmark's intervals resample).

    ``scaling`` (``linear`` / ``ntk`` / ``yarn``) evaluates every length beyond the training length with that
    training-free scaling of the decoder's *time* axis only: factor = the time extent of the test video's
    position ids over the training video's (max time id + 1, from the variant's own ids), original size = the
    training extent (the long-video use of YaRN; space is left as trained).
    """
    from tqdm import tqdm

    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"tasks must be among {list(TASKS)}, got {t!r}")
    for s in scorings:
        if s not in SCORINGS:
            raise ValueError(f"scorings must be among {list(SCORINGS)}, got {s!r}")
    if not tasks or not scorings:
        raise ValueError("give at least one task and one scoring")
    if samples_per_cell < 1 or batch_size < 1:
        raise ValueError(f"samples_per_cell and batch_size must be >= 1, got {samples_per_cell}, {batch_size}")
    device = pick_device(device if device is None else str(device))
    run = load_vlm_run(run_dir, device=device)
    cfg, model, tok = run.cfg, run.model, run.tokenizer
    train_frames = cfg.data.frames
    lengths = sorted({int(L) for L in (default_lengths(train_frames) if lengths is None else lengths)})
    depths = [float(d) for d in (DEFAULT_DEPTHS if depths is None else depths)]
    seed = cfg.data.seed + 2 if seed is None else int(seed)
    sets = {t: build_task(cfg, t, lengths, depths, samples_per_cell=samples_per_cell, seed=seed, delta=delta,
                          haystack=haystack) for t in tasks}  # fmt: skip
    if scaling is not None and scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {list(SCALINGS)} or None, got {scaling!r}")
    extents = _time_extents(model, cfg, lengths) if scaling is not None else {}

    # batches of one length (index order is length-major, then depth, then sample)
    per_length = len(depths) * samples_per_cell
    plan: list[tuple[str, int, list[int]]] = []
    for j, L in enumerate(lengths):  # length-major, so the time scaling changes once per length
        for t in tasks:
            bs = max(1, int(batch_size * train_frames / max(L, train_frames)))
            idx = list(range(j * per_length, (j + 1) * per_length))
            plan += [(t, L, idx[i : i + bs]) for i in range(0, len(idx), bs)]
    hits = {t: {s: [False] * len(sets[t]) for s in scorings} for t in tasks}
    total = sum(len(i) for _, _, i in plan)
    with tqdm(total=total, desc=f"{run.name} V-NIAH", unit="video", disable=not progress, leave=False,
              dynamic_ncols=True) as bar:  # fmt: skip
        current: float | None = None
        for t, L, idx in plan:
            if scaling is not None:
                factor = extents[L] / extents[train_frames] if L > train_frames else None
                if factor != current:
                    model.set_rope_scaling(None if factor is None else {
                        "type": scaling, "factor": {"t": factor}, "original_size": {"t": extents[train_frames]}})
                    current = factor
            samples = [sets[t][i] for i in idx]
            scored = score_batch(model, tok, samples, device, scorings)
            for s in scorings:
                for i, h in zip(idx, scored[s]):
                    hits[t][s][i] = h
            bar.update(len(idx))
            bar.set_postfix(task=t, frames=samples[0]["length"])

    results: dict[str, Any] = {}
    for t in tasks:
        entry: dict[str, Any] = {}
        for s in scorings:
            grid = [[_cell_mean(hits[t][s][(j * len(depths) + i) * samples_per_cell:
                                            (j * len(depths) + i + 1) * samples_per_cell])  # fmt: skip
                     for j in range(len(lengths))] for i in range(len(depths))]
            entry[s] = summarize(grid, lengths, train_frames)
            entry[s]["outcomes"] = [pack_bits(hits[t][s][j * per_length:(j + 1) * per_length])
                                    for j in range(len(lengths))]  # fmt: skip
        if len(scorings) == 2:
            a, b = (hits[t][s] for s in SCORINGS)
            entry["agreement"] = sum(x == y for x, y in zip(a, b)) / len(a)
        results[t] = entry
    return {
        "run": str(run_dir),
        "name": run.name if scaling is None else f"{run.name}+{scaling}",
        "variant": cfg.model.variant,
        "variant_options": cfg.model.variant_options,
        "seed": cfg.train.seed,
        "train_frames": train_frames,
        "frame_size": cfg.data.frame_size,
        "haystack": haystack or cfg.data.haystack,
        "delta": cfg.data.delta if delta is None else int(delta),
        "eval_seed": seed,
        "scaling": scaling,
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": samples_per_cell,
        "chance": 1.0 / len(sets[tasks[0]].answers),
        "tasks": results,
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--run", action="extend", nargs="+", default=[],
                   help="a train/vlm.py out_dir (config.yaml + model.safetensors); repeat for several runs")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="video lengths in frames (default 0.5x, 1x, 2x, 4x, 8x, 16x the training length; "
                        "--hf-model: 8 16 32 64)")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS), help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=None, help="needles per (length, depth) cell (default 10; "
                   "--hf-model: 4)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--scoring", nargs="+", default=list(SCORINGS), choices=SCORINGS, help="--run only")
    p.add_argument("--delta", type=int, default=None, help="V-NIAH-D distractor distance (frames; default the "
                   "run's, --hf-model: 4)")
    p.add_argument("--haystack", default=None,
                   help="procedural, real (the shipped clips) or the path of a video file; default: the run's, "
                        "--hf-model: real")
    p.add_argument("--seed", type=int, default=None, help="evaluation seed (default the run's data.seed + 2; "
                   "--hf-model: 0)")
    p.add_argument("--scaling", nargs="+", default=["none"], choices=["none", *SCALINGS],
                   help="training-free time-axis scaling beyond the training length; several: one evaluation each")
    p.add_argument("--batch-size", type=int, default=32, help="batch at the training length (scaled down with length)")
    p.add_argument("--out", default="outputs/long_video", help="output folder")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true")
    hf_long_video.add_arguments(p)
    args = p.parse_args(argv)
    if not args.run and not args.hf_model:
        p.error("give --run (a train/vlm.py run) or --hf-model (a Qwen-VL checkpoint folder)")
    hf_long_video.check_arguments(p, args)
    for run in args.run:
        problem = fine_tune_run(run)
        if problem is not None:
            p.error(problem)
    evals = [
        evaluate_run(run, args.lengths, args.depths, tasks=args.tasks, scorings=args.scoring,
                     samples_per_cell=10 if args.samples is None else args.samples, batch_size=args.batch_size,
                     delta=args.delta, haystack=args.haystack, seed=args.seed, scaling=None if sc == "none" else sc,
                     device=args.device, progress=not args.no_progress)
        for run in args.run
        for sc in args.scaling
    ]  # fmt: skip
    evals += hf_long_video.evaluations(args)
    paths = write_report(evals, args.out)
    print(markdown(evals))
    print("wrote " + ", ".join(str(v) for v in paths.values()))
    return evals


if __name__ == "__main__":
    main()
