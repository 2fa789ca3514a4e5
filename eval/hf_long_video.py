"""Long-video retrieval (V-NIAH / V-NIAH-D) of a Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder,
with its text positions switched to any vlpe multimodal variant.

    python eval/long_video.py --hf-model path/to/Qwen2-VL-2B-Instruct --variant mrope_i --haystack my_video.mp4
    python eval/long_video.py --hf-model outputs/finetuned   # the variant recorded in its config.json

The folder is read offline (``AutoProcessor`` / ``AutoModelForImageTextToText`` with ``local_files_only``); the
variant is installed with :func:`vlpe.integrations.transformers.apply` (``--variant none``: the stock model).
Without ``--variant`` a folder is evaluated under the variant and options recorded in its ``config.json`` (a
fine-tuned folder written by :func:`vlpe.integrations.transformers.save_pretrained`); a folder without a record
then needs ``--variant``. The
samples are the ones of :mod:`data.vniah` at the model's scale: the haystack is the user's video file (looped) or
the shipped real clips, the needle (a photo drawn in red, by default) fills one frame at depth ``d``, V-NIAH-D adds
one blue distractor of another class ``delta`` frames away. Every video goes through the model's own processor
(``do_sample_frames=False``: the frames given are the frames seen, at ``fps``).

Scoring is multiple choice by log-likelihood, so it needs no instruction following and works for any model, an
untrained one included (chance = 1 / number of options): the prompt carries the video, the question and the
candidate answers as text (through the processor's chat template when it has one); each candidate is scored by the
sum of its tokens' log-probabilities after the prompt, and the sample is correct when the gold answer scores highest.
The prompt runs once; every candidate continues from its key/value cache (:func:`option_logliks`).

The result has the layout of :func:`long_video.evaluate_run` (scoring ``choice``), so the same tables and heatmaps
are written. The model was not trained on these videos, so "in distribution" means lengths up to ``train_frames``
(default: the shortest length), "extrapolated" the longer ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

__all__ = [
    "HFModel", "load_hf_model", "build_hf_task", "prompt_and_options", "model_inputs", "option_logliks",
    "evaluate_hf", "add_arguments", "check_arguments", "evaluations", "recorded_variant", "recorded_fps",
]  # fmt: skip

DEFAULT_LENGTHS = (8, 16, 32, 64)


@dataclass
class HFModel:
    """A checkpoint folder loaded for evaluation: model (eval mode, patched unless ``variant`` is ``none``), the
    variant's label and the options it was applied with."""

    path: Path
    name: str
    model: Any
    processor: Any
    variant: str
    variant_options: dict = field(default_factory=dict)


def load_hf_model(path: str | Path, *, variant: str | None = None, variant_options: dict | None = None,
                  device: str | torch.device = "cpu") -> HFModel:  # fmt: skip
    """Model and processor of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder (no network), with ``variant`` applied
    (None: the variant and options recorded in the folder's ``config.json``; ``none``: the stock model)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlpe.integrations import transformers as vlpe_hf

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--hf-model {str(path)!r} is not a Hugging Face checkpoint folder (no config.json); give the folder "
            "that holds config.json, the weights and the processor files (save_pretrained / a downloaded snapshot)"
        )
    if variant is None:  # before loading anything: ValueError naming what is missing
        if variant_options:
            raise ValueError("variant_options need a variant; without one the folder's recorded options are used")
        variant, variant_options = recorded_variant(path)
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    if getattr(processor, "video_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"{path}: the processor has no video processor or tokenizer; a Qwen-VL processor is needed")
    config = vlpe_hf.load_config(path)  # a vlpe-only export's own rope settings, which stock loaders refuse
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True, config=config)
    model = model.to(device).eval()
    if variant != "none":
        vlpe_hf.apply(model, variant, **(variant_options or {}))  # ValueError for other models / unknown variants
    label = variant if isinstance(variant, str) else vlpe_hf.patch_of(model).label  # a recorded Variant's label
    return HFModel(path=path, name=path.name, model=model, processor=processor, variant=label,
                   variant_options=dict(variant_options or {}))  # fmt: skip


def recorded_variant(path: str | Path) -> tuple[Any, dict]:
    """``(variant, options)`` recorded in the ``config.json`` of the folder ``path``; ValueError saying that
    ``--variant`` is needed when there is none (:func:`vlpe.integrations.transformers.recorded_variant`)."""
    from vlpe.integrations import transformers as vlpe_hf

    try:
        return vlpe_hf.recorded_variant(path)
    except ValueError as e:
        raise ValueError(f"--hf-model {str(path)!r} without --variant: {e} (--variant V, or none for the stock "
                         "model)") from None  # fmt: skip


def recorded_fps(path: str | Path, default: float = 2.0) -> float:
    """The frame rate the folder ``path`` was fine-tuned at (its record's ``preprocessing``), else ``default``."""
    from vlpe.integrations import transformers as vlpe_hf

    return float(vlpe_hf.recorded_preprocessing(path).get("fps", default))


def build_hf_task(task: str, lengths: Sequence[int], depths: Sequence[float], *, samples_per_cell: int, seed: int,
                  frame_size: int, haystack: str, needles: str, delta: int, fps: float):  # fmt: skip
    """The :class:`data.vniah.VNIAH` grid of ``task`` (``v_niah`` / ``v_niah_d``) with test-split needles."""
    from data.vniah import VNIAH

    if task not in ("v_niah", "v_niah_d"):
        raise ValueError(f"task must be 'v_niah' or 'v_niah_d', got {task!r}")
    return VNIAH(
        lengths=lengths, depths=depths, samples_per_cell=samples_per_cell, size=frame_size, haystack=haystack,
        needles=needles, split="test", distractors="single" if task == "v_niah_d" else None, delta=delta, fps=fps,
        seed=seed,
    )  # fmt: skip


def prompt_and_options(hf: HFModel, question: str, options: Sequence[str]) -> tuple[str, list[list[int]]]:
    """The prompt text (one video placeholder, the question, the options) and every option's token ids."""
    processor, cfg = hf.processor, hf.model.config
    tok = processor.tokenizer
    text = f"{question} Options: {', '.join(options)}."
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        sep = ""
    else:
        start, end = tok.convert_ids_to_tokens([cfg.vision_start_token_id, cfg.vision_end_token_id])
        prompt, sep = f"{start}{processor.video_token}{end}{text}\nAnswer:", " "
    ids = [tok(sep + o, add_special_tokens=False)["input_ids"] for o in options]
    empty = [o for o, i in zip(options, ids) if not i]
    if empty:
        raise ValueError(f"the tokenizer maps the options {empty} to no tokens; they cannot be scored")
    unk = tok.unk_token_id
    unknown = [o for o, i in zip(options, ids) if unk is not None and unk in i]
    if unknown:
        raise ValueError(
            f"{hf.path}: the tokenizer cannot encode the answer word(s) {unknown}: they become {tok.unk_token}, so "
            "those options would be scored alike and the table would not tell models apart; evaluate with a "
            "tokenizer that knows them (a word-level tokenizer needs them in its vocabulary)"
        )
    same = [o for k, (o, i) in enumerate(zip(options, ids)) if i in ids[:k]]
    if same:
        raise ValueError(f"{hf.path}: the tokenizer encodes the option(s) {same} like an earlier option; they cannot "
                         "be told apart")  # fmt: skip
    return prompt, ids


def model_inputs(hf: HFModel, prompt: str, sample: dict, fps: float, device) -> dict:
    """The processor's tensors of one V-NIAH sample: the prompt with its video, shown at ``fps``, frames as given."""
    frames = sample["frames"].numpy()  # (L, H, W, 3) uint8
    L = frames.shape[0]
    meta = {"fps": fps, "total_num_frames": L, "frames_indices": list(range(L))}
    out = hf.processor(text=[prompt], videos=[frames], video_metadata=[meta], do_sample_frames=False,
                       return_tensors="pt")  # fmt: skip
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


@torch.no_grad()
def option_logliks(model, inputs: dict, options: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(K,)`` float64: the summed log-probability of each option's tokens right after the prompt ``inputs``.

    One forward over the prompt (video included) with a cache; an option of several tokens then runs only its own
    tokens on that cache, which is cropped back to the prompt afterwards. Equal to scoring ``prompt + option`` in
    one forward (the tests check it).
    """
    out = model(**inputs, use_cache=True)
    first = out.logits[0, -1].double().log_softmax(-1)
    cache = out.past_key_values
    scores = []
    for toks in options:
        ll = first[toks[0]]
        if len(toks) > 1:
            cont = torch.tensor([list(toks)], dtype=torch.long, device=first.device)
            # no attention_mask: one unpadded row (transformers 5.x's stock Qwen-VL forward would build the ids of
            # the whole masked length, not of the new tokens, from a full-length mask)
            logits = model(input_ids=cont, cache=cache, use_cache=True).logits
            lp = logits[0, :-1].double().log_softmax(-1)
            ll = ll + lp.gather(-1, cont[0, 1:, None]).sum()
            cache.crop(-len(toks))  # back to the prompt
        scores.append(ll)
    return torch.stack(scores).cpu()


def evaluate_hf(
    path: str | Path,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | None = None,
    *,
    variant: str | None = None,
    variant_options: dict | None = None,
    tasks: Sequence[str] = ("v_niah", "v_niah_d"),
    samples_per_cell: int = 4,
    haystack: str = "real",
    frame_size: int = 224,
    needles: str = "photos",
    delta: int = 4,
    fps: float = 2.0,
    seed: int = 0,
    train_frames: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> dict:
    """V-NIAH / V-NIAH-D multiple-choice accuracy of a checkpoint folder under ``variant`` (None: the one recorded
    in its ``config.json``; see the module docstring); a JSON-ready dict in the layout of
    :func:`long_video.evaluate_run` (scoring ``choice``), plus ``max_position`` (per length: the largest position
    id of the first sample's prompt, per axis) and ``logliks`` (every sample's option scores)."""
    from tqdm import tqdm

    from runs import pick_device
    from long_video_report import DEFAULT_DEPTHS, summarize
    from stats import pack_bits

    from data.vniah import QUESTIONS

    if samples_per_cell < 1:
        raise ValueError(f"samples_per_cell must be >= 1, got {samples_per_cell}")
    device = pick_device(None if device is None else str(device))
    hf = load_hf_model(path, variant=variant, variant_options=variant_options, device=device)
    lengths = sorted({int(L) for L in (DEFAULT_LENGTHS if lengths is None else lengths)})
    depths = [float(d) for d in (DEFAULT_DEPTHS if depths is None else depths)]
    train_frames = lengths[0] if train_frames is None else int(train_frames)
    sets = {t: build_hf_task(t, lengths, depths, samples_per_cell=samples_per_cell, seed=seed, frame_size=frame_size,
                             haystack=haystack, needles=needles, delta=delta, fps=fps) for t in tasks}  # fmt: skip
    answers = list(sets[tasks[0]].answers)
    prompt, option_ids = prompt_and_options(hf, QUESTIONS["needle"], answers)

    hits = {t: [False] * len(sets[t]) for t in tasks}
    logliks = {t: [None] * len(sets[t]) for t in tasks}
    max_position: dict[str, list[float]] = {}
    total = sum(len(s) for s in sets.values())
    with tqdm(total=total, desc=f"{hf.name} V-NIAH", unit="video", disable=not progress, leave=False) as bar:
        for t in tasks:
            for i in range(len(sets[t])):
                sample = sets[t][i]
                inputs = model_inputs(hf, prompt, sample, fps, device)
                if t == tasks[0] and i % (len(depths) * samples_per_cell) == 0:
                    max_position[str(sample["length"])] = _max_position(hf.model, inputs)
                scores = option_logliks(hf.model, inputs, option_ids)
                logliks[t][i] = scores.tolist()
                hits[t][i] = int(scores.argmax()) == answers.index(sample["answer"])
                bar.update(1)

    per_length = len(depths) * samples_per_cell
    results: dict[str, Any] = {}
    for t in tasks:
        h = hits[t]
        grid = [[sum(h[(j * len(depths) + i) * samples_per_cell:(j * len(depths) + i + 1) * samples_per_cell])
                 / samples_per_cell for j in range(len(lengths))] for i in range(len(depths))]  # fmt: skip
        entry = summarize(grid, lengths, train_frames)
        entry["outcomes"] = [pack_bits(h[j * per_length:(j + 1) * per_length]) for j in range(len(lengths))]
        entry["logliks"] = logliks[t]
        results[t] = {"choice": entry}
    return {
        "run": str(path),
        "name": f"{hf.name}+{hf.variant}",
        "variant": hf.variant,
        "variant_options": hf.variant_options,
        "family": hf.model.config.model_type,
        "train_frames": train_frames,
        "frame_size": frame_size,
        "haystack": str(haystack),
        "needles": needles,
        "delta": delta,
        "fps": fps,
        "eval_seed": seed,
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": samples_per_cell,
        "options": answers,
        "chance": 1.0 / len(answers),
        "max_position": max_position,
        "tasks": results,
    }


def _max_position(model, inputs: dict) -> list[float]:
    """Largest position id of the prompt on every axis, from the (patched) model's ``get_rope_index``."""
    import inspect

    base = model.model if hasattr(model, "model") else model
    wanted = inspect.signature(base.get_rope_index).parameters
    kwargs = {k: inputs[k] for k in ("mm_token_type_ids", "video_grid_thw", "attention_mask", "second_per_grid_ts")
              if k in inputs and k in wanted}  # fmt: skip
    ids, _ = base.get_rope_index(inputs["input_ids"], **kwargs)
    return [float(row.max()) for row in ids.reshape(ids.shape[0], -1)]


# ------------------------------------------------------------------------------------------------------------
# command line (the options eval/long_video.py adds for --hf-model)
# ------------------------------------------------------------------------------------------------------------


def add_arguments(p) -> None:
    """The ``--hf-model`` options of ``eval/long_video.py``."""
    p.add_argument("--hf-model", action="extend", nargs="+", default=[], metavar="DIR",
                   help="a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder (read offline), scored by multiple "
                        "choice (eval/hf_long_video.py); repeat for several")
    p.add_argument("--variant", nargs="+", default=None,
                   help="--hf-model: vlpe multimodal variant(s) to apply (none: the stock model); one evaluation each "
                        "(default: the variant recorded in each folder's config.json)")
    p.add_argument("--frame-size", type=int, default=224, help="--hf-model: frame side in pixels")
    p.add_argument("--needles", default="photos", choices=["photos", "fashion_mnist"], help="--hf-model: needles")
    p.add_argument("--fps", type=float, default=None,
                   help="--hf-model: frames per second the video is shown at (default: the fps the folder was "
                        "fine-tuned at, as its config.json records it, else 2)")
    p.add_argument("--train-frames", type=int, default=None,
                   help="--hf-model: lengths up to this count as in-distribution (default: the shortest)")


def check_arguments(p, args) -> None:
    """``p.error`` for option combinations that would be ignored, and for a folder without ``--variant`` whose
    ``config.json`` records no variant to evaluate."""
    if args.hf_model and not args.variant:
        for folder in args.hf_model:
            try:
                recorded_variant(folder)
            except ValueError as e:
                p.error(str(e))
    if args.variant and not args.hf_model:
        p.error("--variant applies to --hf-model; a --run evaluates the variant it was trained with")
    if args.hf_model and args.scaling != ["none"]:
        p.error("--scaling applies to --run only; for --hf-model pass scaling= to vlpe_hf.apply (variant_options)")


def evaluations(args) -> list[dict]:
    """One :func:`evaluate_hf` per (``--hf-model`` folder, ``--variant``; none given: the recorded one)."""
    return [
        evaluate_hf(folder, args.lengths, args.depths, variant=v, tasks=args.tasks,
                    samples_per_cell=4 if args.samples is None else args.samples, haystack=args.haystack or "real",
                    frame_size=args.frame_size, needles=args.needles, delta=4 if args.delta is None else args.delta,
                    fps=recorded_fps(folder) if args.fps is None else args.fps,
                    seed=0 if args.seed is None else args.seed, train_frames=args.train_frames,
                    device=args.device, progress=not args.no_progress)
        for folder in args.hf_model
        for v in (args.variant or [None])
    ]  # fmt: skip
