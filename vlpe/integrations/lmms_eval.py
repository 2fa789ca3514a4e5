"""The lmms-eval model ``vlpe_qwen_vl``: any Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder under any vlpe variant.

    pip install 'vlpe[lmms]'        # or `make lmms-setup` (a second environment, .venv-lmms)
    lmms-eval --model vlpe_qwen_vl --model_args pretrained=DIR,variant=videorope --tasks videomme,mlvu_dev

lmms-eval finds the model through the ``lmms_eval.models`` entry point of the vlpe distribution
(:func:`manifests`), so the installed ``lmms-eval`` command knows it; lmms-eval's tasks, prompts and scoring are
used unchanged. The model is a "simple" lmms-eval model (it receives each document's text and its
``doc_to_visual``), checked against lmms-eval 0.7.3 (``lmms_eval.api.model.lmms``, ``Instance.args``).

``model_args`` (every one a ``key=value`` of lmms-eval's ``--model_args``; a bad value raises ValueError naming
what was expected):

- ``pretrained``: the checkpoint folder (``config.json``, weights, processor files), read offline.
- ``variant``: a name of :data:`vlpe.encodings.multimodal.VARIANTS` applied with
  :func:`vlpe.integrations.transformers.apply`; ``none``: the stock model; not given: the variant and options
  recorded in the folder's ``config.json`` (a folder written by :func:`vlpe.integrations.transformers.save_pretrained`).
- ``scaling``: a vlpe scaling dict as JSON (``scaling={"type":"yarn","factor":{"t":4},"original_size":32768}``);
  ``options``: the design's other options as JSON (``options={"temporal_scale":0.75}``). Both need a variant
  other than ``none`` and are added to the recorded options when no variant is given.
- ``device`` (default: ``cuda:$LOCAL_RANK`` when CUDA is available, else ``cpu``; so ``accelerate launch -m
  lmms_eval`` runs one copy per GPU), ``dtype`` (``float32`` / ``bfloat16`` / ``float16``; default bfloat16 on
  CUDA, float32 on the CPU), ``batch_size`` and ``max_batch_size`` (accepted; requests run one at a time).
- ``max_frames`` and ``fps`` (default: those the folder was fine-tuned with, as its ``config.json`` records them
  (:func:`vlpe.integrations.transformers.recorded_preprocessing`), else 32 and 2.0): a video file is decoded with
  PyAV (``transformers.video_utils``) at ``fps`` frames per second of its duration, at most ``max_frames`` frames
  spread evenly over the whole video (a multiple of the processor's temporal patch); the processor sees those
  frames with their true timestamps. Images and frames are resized to the pixel budgets the folder was trained with
  (its record's ``min_pixels`` / ``max_pixels`` / ``image_max_pixels``), else to the processor's own.
- ``max_new_tokens`` (128): the generation budget when the task sets none.

Requests: ``generate_until`` decodes greedily with the model's ``generate`` (a task's sampling settings are
ignored) and cuts the text at the task's ``until`` strings. ``loglikelihood`` (multiple-choice tasks) gives, as
lmms-eval's own models do, the continuation's mean negative log-likelihood per token after the prompt (a loss: its
multiple-choice scoring picks the option with the smallest), from one forward, and whether greedy decoding would
produce the continuation; the pairs are handed over so that lmms-eval 0.7.3's evaluator keeps them as numbers
(:func:`_through_evaluator`). Visuals are video file paths, image file paths and PIL images, placed before the text
in one user turn of the processor's chat template (without a template: ``<|vision_start|>`` pad ``<|vision_end|>``
then the text). A visual file that cannot be read (a damaged video or image, whatever its decoder raises) stops the
run with a ValueError naming the task, the document and the file: a document skipped or answered empty would be
scored as a wrong answer and change the task's metric silently. Multi-round generation is not supported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

__all__ = ["MODEL_NAME", "manifests"]  # and QwenVL, the model class (made on first use: it needs lmms-eval)

MODEL_NAME = "vlpe_qwen_vl"
_CLASS = "QwenVL"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def manifests():
    """The ``lmms_eval.models`` entry point: lmms-eval's manifest of ``vlpe_qwen_vl`` (a simple model)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=MODEL_NAME, simple_class_path=f"{__name__}.{_CLASS}")]


def __getattr__(name: str):
    """``QwenVL``: the model class, made on first use (it subclasses lmms-eval's ``lmms``, imported then)."""
    if name != _CLASS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from lmms_eval.api.model import lmms
    except ModuleNotFoundError as e:
        raise ImportError(
            f"{__name__}.{_CLASS} needs lmms-eval ({e}): pip install 'vlpe[lmms]', or `make lmms-setup` for the "
            "checkout's .venv-lmms"
        ) from None
    cls = type(_CLASS, (_QwenVLRequests, lmms), {"__module__": __name__, "__qualname__": _CLASS,
                                                "__doc__": _QwenVLRequests.__doc__})  # fmt: skip
    globals()[_CLASS] = cls
    return cls


def _json_arg(name: str, value: Any, example: str) -> dict | None:
    """A ``model_args`` value that holds a JSON object (or ``none`` / empty / None: None), as a dict; ValueError
    naming ``name`` and ``example`` otherwise."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value).strip()
    if text.lower() in ("", "none", "null"):
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{MODEL_NAME}: {name}= expects a JSON object such as {example}, got {text!r} ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{MODEL_NAME}: {name}= expects a JSON object such as {example}, got {text!r}")
    return parsed


def _positive(name: str, value: Any, kind: type) -> Any:
    """The ``model_args`` value ``value`` as a finite ``kind`` > 0 (an ``int``: a whole number); ValueError naming
    ``name`` otherwise (NaN, infinity, a boolean, zero, a fraction for an int ...)."""
    try:
        x = kind(value)
        whole = kind is not int or x == float(value)
    except (TypeError, ValueError, OverflowError):
        x, whole = None, False
    if x is None or isinstance(value, bool) or not whole or not math.isfinite(x) or x <= 0:
        example = "2" if kind is int else "a finite number such as 2.0"
        raise ValueError(f"{MODEL_NAME}: {name}= expects a positive {kind.__name__} ({example}), got {value!r}")
    return x


def _default_device() -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def _flatten(visuals: Any) -> list:
    if visuals is None:
        return []
    if isinstance(visuals, (list, tuple)):
        return [v for item in visuals for v in _flatten(item)]
    return [visuals]


def _through_evaluator(scores: list[tuple[float, bool]]) -> list:
    """``scores`` as lmms-eval's evaluator must receive them. lmms-eval 0.7.3 passes every result through
    ``unwrap_generation_output``, which turns anything but a string or a ``GenerationResult`` into its ``str()``, so
    a ``(loss, is_greedy)`` tuple reaches ``process_results`` as text and every multiple-choice task fails;
    while the installed lmms-eval does so, each tuple is handed over as the ``text`` of a ``GenerationResult``, which
    it passes through unchanged (``unwrap_generation_output(result)[0]`` is the tuple)."""
    from lmms_eval.api import instance

    unwrap = getattr(instance, "unwrap_generation_output", None)
    if unwrap is None or unwrap((0.0, True))[0] == (0.0, True):
        return scores
    return [instance.GenerationResult(text=s) for s in scores]


@contextlib.contextmanager
def _naming(request, kind: str, path: Any) -> Iterator[None]:
    """Turn any error of reading the ``kind`` file ``path`` of ``request``'s document into a ValueError naming the
    task, the document and the file (decoders raise what they like: PyAV's ``InvalidDataError``, a
    ``UnicodeDecodeError`` of a damaged header, PIL's ``UnidentifiedImageError`` ...)."""
    try:
        yield
    except Exception as e:
        *_, doc_id, task, split = request.args
        raise ValueError(
            f"{MODEL_NAME}: task {task!r}, document {doc_id!r} ({split} split): cannot read the {kind} {str(path)!r} "
            f"({type(e).__name__}: {e}); repair or replace the file, or leave the document out of the task"
        ) from e


class _QwenVLRequests:
    """The lmms-eval model ``vlpe_qwen_vl`` (see the module docstring): a Qwen-VL folder loaded offline with its own
    processor, under a vlpe variant; its scores are checked against the stock model (``variant=none``) and
    lmms-eval's own task machinery in ``tests/test_lmms_eval.py``."""

    def __init__(self, *, pretrained: str | None = None, variant: str | None = None, scaling: Any = None,
                 options: Any = None, device: str | None = None, dtype: str | None = None, batch_size: Any = 1,
                 max_batch_size: Any = None, max_frames: Any = None, fps: Any = None, max_new_tokens: Any = 128,
                 **unknown: Any) -> None:  # fmt: skip
        super().__init__()
        if unknown:
            raise ValueError(
                f"{MODEL_NAME}: unknown model_args {sorted(unknown)}; expected pretrained, variant, scaling, options, "
                "device, dtype, batch_size, max_frames, fps, max_new_tokens"
            )
        if not pretrained:
            raise ValueError(f"{MODEL_NAME}: model_args need pretrained=DIR, a Qwen2/2.5/3-VL checkpoint folder")
        self.path = Path(str(pretrained)).expanduser()
        if not (self.path / "config.json").is_file():
            raise ValueError(f"{MODEL_NAME}: pretrained={str(pretrained)!r} is not a checkpoint folder (no "
                             "config.json); expected the folder holding config.json, the weights and the processor")
        variant_options = dict(_json_arg("options", options, '{"temporal_scale":0.75}') or {})
        scaling = _json_arg("scaling", scaling, '{"type":"yarn","factor":{"t":4},"original_size":32768}')
        if scaling is not None:
            variant_options["scaling"] = scaling
        self.batch_size_per_gpu = _positive("batch_size", batch_size, int)
        from vlpe.integrations import transformers as vlpe_hf

        trained = vlpe_hf.recorded_preprocessing(self.path)  # what an export was fine-tuned on: the defaults
        self.max_frames = _positive("max_frames", trained.get("max_frames", 32) if max_frames is None else max_frames,
                                    int)  # fmt: skip
        self.fps = _positive("fps", trained.get("fps", 2.0) if fps is None else fps, float)
        self.budgets = {"image": (trained.get("min_pixels"), trained.get("image_max_pixels", trained.get("max_pixels"))),
                        "video": (trained.get("min_pixels"), trained.get("max_pixels"))}  # fmt: skip
        self.max_new_tokens = _positive("max_new_tokens", max_new_tokens, int)
        self._device = torch.device(device or _default_device())
        if dtype is None:
            dtype = "bfloat16" if self._device.type == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"{MODEL_NAME}: dtype= expects one of {', '.join(_DTYPES)}, got {dtype!r}")
        self.variant, self.variant_options = self._variant(variant, variant_options)
        self.model, self.processor = self._load(_DTYPES[dtype])
        from vlpe.integrations import transformers as vlpe_hf

        patch = vlpe_hf.patch_of(self.model)
        self.label = "none" if patch is None else patch.label
        self._prompt_cache: tuple[Any, dict] | None = None

    # -- loading --------------------------------------------------------------------------------------------------

    def _variant(self, variant: Any, options: dict) -> tuple[Any, dict]:
        """``(variant, options)`` to apply (``"none"``: the stock model), checked before any weight is read."""
        from vlpe.encodings import multimodal as mm
        from vlpe.integrations import transformers as vlpe_hf

        if variant is None or str(variant).strip() == "":
            try:
                recorded, recorded_options = vlpe_hf.recorded_variant(self.path)
            except ValueError as e:
                raise ValueError(f"{MODEL_NAME}: pretrained={str(self.path)!r} without variant=: {e} (pass "
                                 "variant=NAME, or variant=none for the stock model)") from None  # fmt: skip
            return recorded, {**recorded_options, **options}
        variant = str(variant).strip()
        if variant.lower() == "none":
            if options:
                raise ValueError(f"{MODEL_NAME}: variant=none is the stock model; scaling= / options= need a vlpe "
                                 "variant")  # fmt: skip
            return "none", {}
        try:
            mm.get_variant(variant)
        except ValueError:
            raise ValueError(f"{MODEL_NAME}: variant= expects none or one of {', '.join(mm.VARIANTS)}, got "
                             f"{variant!r}") from None  # fmt: skip
        return variant, options

    def _load(self, dtype: torch.dtype):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from vlpe.integrations import transformers as vlpe_hf

        processor = AutoProcessor.from_pretrained(self.path, local_files_only=True)
        if getattr(processor, "tokenizer", None) is None or getattr(processor, "video_processor", None) is None:
            raise ValueError(f"{MODEL_NAME}: {self.path}: the processor has no tokenizer or video processor; a "
                             "Qwen2/2.5/3-VL processor is expected")  # fmt: skip
        if self.variant == "none":
            model = AutoModelForImageTextToText.from_pretrained(self.path, local_files_only=True, dtype=dtype,
                                                                config=vlpe_hf.load_config(self.path))
        else:  # ValueError for a model vlpe cannot patch, or options the variant does not take
            model = vlpe_hf.from_pretrained(self.path, variant=self.variant, variant_options=self.variant_options,
                                            dtype=dtype)  # fmt: skip
        return model.to(self._device).eval(), processor

    # -- what lmms-eval reads -------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    # -- inputs ---------------------------------------------------------------------------------------------------

    def _frames(self, path: str):
        """``(frames (T, H, W, 3) uint8, metadata)`` of the video file ``path``: ``fps`` frames per second of its
        duration, at most ``max_frames``, spread evenly (a multiple of the temporal patch)."""
        import numpy as np
        from transformers.video_utils import load_video

        step = int(getattr(self.processor.video_processor, "temporal_patch_size", 1) or 1)

        def indices(metadata, **_):
            total = int(metadata.total_num_frames or 0)
            if total < 1:  # a container without a frame count (e.g. some .mkv / .webm): count the packets
                import av

                with av.open(path) as container:
                    total = sum(1 for packet in container.demux(video=0) if packet.size)
                if total < 1:
                    raise ValueError(f"{MODEL_NAME}: {path}: no video frames")
                metadata.total_num_frames, metadata.duration = total, total / metadata.fps if metadata.fps else None
            wanted = round(total / metadata.fps * self.fps) if metadata.fps else self.max_frames
            n = max(step, min(self.max_frames, wanted, total) // step * step)
            return np.linspace(0, total - 1, n).round().astype(int)

        return load_video(path, backend="pyav", sample_indices_fn=indices)

    def _visuals(self, request) -> list:
        """The visuals of a request's document: PIL images (image files opened) and video file paths."""
        from PIL import Image

        *_, doc_to_visual, doc_id, task, split = request.args
        if doc_to_visual is None:
            return []
        out = []
        for v in _flatten(doc_to_visual(self.task_dict[task][split][doc_id])):
            if isinstance(v, (str, os.PathLike)) and str(v).lower().endswith(_IMAGE_SUFFIXES):
                with _naming(request, "image", v):
                    v = Image.open(v).convert("RGB")
            if not isinstance(v, (str, os.PathLike, Image.Image)):
                raise ValueError(f"{MODEL_NAME} takes video file paths, image files and PIL images; task {task!r} "
                                 f"gave a {type(v).__name__}")  # fmt: skip
            out.append(v if isinstance(v, Image.Image) else str(v))
        return out

    def _prompt(self, context: str, visuals: Sequence) -> str:
        kinds = ["image" if not isinstance(v, str) else "video" for v in visuals]
        context = context.replace("<image>", "").strip() if visuals else context
        processor = self.processor
        if getattr(processor, "chat_template", None):
            content = [{"type": k} for k in kinds] + [{"type": "text", "text": context}]
            return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        cfg = self.model.config
        start, end = self.tokenizer.convert_ids_to_tokens([cfg.vision_start_token_id, cfg.vision_end_token_id])
        pads = {"image": processor.image_token, "video": processor.video_token}
        return "".join(f"{start}{pads[k]}{end}" for k in kinds) + context

    def _size(self, kind: str, default: Mapping[str, int], scale: int) -> dict | None:
        """The processor's ``size`` for ``kind`` (``image`` / ``video``) from the budgets the folder was trained with
        (``scale`` frames for a per-video budget); None when none was recorded."""
        lo, hi = self.budgets[kind]
        if lo is None and hi is None:
            return None
        lo = default["shortest_edge"] if lo is None else lo * scale
        hi = default["longest_edge"] if hi is None else hi * scale
        return {"shortest_edge": int(lo), "longest_edge": int(max(hi, lo))}

    def _inputs(self, request) -> dict:
        """The processor's tensors for a request's prompt (the last one is kept: the options of a multiple-choice
        document share it)."""
        context, _, _, doc_id, task, split = request.args
        key = (context, doc_id, task, split)
        if self._prompt_cache is not None and self._prompt_cache[0] == key:
            return self._prompt_cache[1]
        visuals = self._visuals(request)
        kwargs: dict[str, Any] = {}
        images = [v for v in visuals if not isinstance(v, str)]
        if images:
            kwargs["images"] = images
            size = self._size("image", self.processor.image_processor.size, 1)
            if size is not None:
                kwargs["images_kwargs"] = {"size": size}
        videos = []
        for v in visuals:
            if isinstance(v, str):
                with _naming(request, "video", v):
                    videos.append(self._frames(v))
        if videos:
            kwargs.update(videos=[f for f, _ in videos], video_metadata=[m for _, m in videos], do_sample_frames=False)
            per_video = self.model.config.model_type == "qwen3_vl"  # its video budget counts every frame
            size = self._size("video", self.processor.video_processor.size,
                              max(len(f) for f, _ in videos) if per_video else 1)  # fmt: skip
            if size is not None:
                kwargs["videos_kwargs"] = {"size": size}
                if getattr(self.processor.video_processor, "cap_pixels_per_frame", False) is None:
                    kwargs["videos_kwargs"]["cap_pixels_per_frame"] = False  # the budget as given, no warning
        out = self.processor(text=[self._prompt(context, visuals)], return_tensors="pt", **kwargs)
        inputs = {k: v.to(self._device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        self._prompt_cache = (key, inputs)
        return inputs

    # -- requests -------------------------------------------------------------------------------------------------

    def _progress(self, requests, desc: str):
        from tqdm import tqdm

        return tqdm(requests, desc=f"{MODEL_NAME} {desc}", disable=self.rank != 0)

    @torch.no_grad()
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in self._progress(requests, "loglikelihood"):
            context, target, _, doc_id, task, split = request.args
            continuation = target if isinstance(target, str) else target(self.task_dict[task][split][doc_id])
            cont = self.tokenizer(continuation, add_special_tokens=False)["input_ids"]
            if not cont:
                raise ValueError(f"{MODEL_NAME}: the continuation {continuation!r} has no tokens to score")
            inputs = dict(self._inputs(request))
            prompt = inputs["input_ids"]
            cont = torch.tensor([cont], dtype=prompt.dtype, device=prompt.device)
            inputs["input_ids"] = torch.cat([prompt, cont], 1)
            for key in ("attention_mask", "mm_token_type_ids"):  # text tokens: mask 1, type 0
                if key in inputs:
                    fill = torch.full_like(cont, 1 if key == "attention_mask" else 0, dtype=inputs[key].dtype)
                    inputs[key] = torch.cat([inputs[key], fill], 1)
            logits = self.model(**inputs).logits[0, prompt.shape[1] - 1:-1].double().log_softmax(-1)
            loss = -logits.gather(-1, cont[0, :, None]).mean()
            out.append((float(loss), bool((logits.argmax(-1) == cont[0]).all())))
        return _through_evaluator(out)

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = []
        for request in self._progress(requests, "generate_until"):
            gen_kwargs = dict(request.args[1] or {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = _positive("max_new_tokens", gen_kwargs.get("max_new_tokens") or self.max_new_tokens, int)
            inputs = self._inputs(request)
            ids = self.model.generate(**inputs, max_new_tokens=budget, do_sample=False, num_beams=1,
                                      pad_token_id=pad)  # fmt: skip
            text = tok.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out

    def generate_until_multi_round(self, requests) -> list[str]:
        raise NotImplementedError(f"{MODEL_NAME} answers generate_until and loglikelihood tasks; multi-round "
                                  "generation is not supported")  # fmt: skip
