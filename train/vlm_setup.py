"""What a small-VLM run is made of: its config (``configs/*.yaml`` of ``train/vlm.py``; with ``model.hf_model`` a
fine-tuning run of :mod:`train.finetune`), the checks of which keys each kind of run reads, the task's tokenizer and
its V-NIAH datasets.

Read by ``train/vlm.py`` (which trains it) and by the evaluation of its exports (``eval/long_video.py``); the model a
config describes is :func:`models.vlm.vlm_from_config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from torch.utils.data import Dataset

from train.config import _EXPONENT_FLOAT, ConfigError
from train.engine import TrainSection

__all__ = [
    "ModelSection", "LoraSection", "VLMTrainSection", "DataSection", "VLMConfig", "check_mode", "build_tokenizer",
    "build_datasets",
]  # fmt: skip


@dataclass(kw_only=True)
class ModelSection:
    preset: str = "tiny"
    variant: str = "mrope_i"  # a vlpe.encodings.multimodal variant
    variant_options: dict = field(default_factory=dict)  # design options (spatial_reset, temporal_scale, section ...)
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None  # None: the variant's own base
    initializer_range: float | None = None  # None: hidden_size ** -0.5
    vision_dim: int | None = None
    vision_depth: int | None = None
    vision_heads: int | None = None
    vision_encoding: str = "rope"
    vision_encoding_options: dict = field(default_factory=dict)
    vision_attention: Literal["frame", "block"] = "frame"
    patch_size: int = 4
    temporal_patch_size: int = 2
    merge_size: int = 2
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # fine-tuning a Hugging Face checkpoint folder (train/finetune.py)
    hf_model: str | None = None  # a Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder, read offline
    scaling: dict | None = None  # a vlpe scaling dict for the rotary tables, e.g. {type: yarn, factor: {t: 4}}
    lora: "LoraSection" = field(default_factory=lambda: LoraSection())


@dataclass(kw_only=True)
class LoraSection:
    """LoRA adapters (peft) on the decoder's linear layers; merged into the weights on export. The vision tower and
    its merger(s) are not wrapped and train in full unless ``train.freeze`` names them. ZeRO-2 or less (merging
    needs whole weights on one rank)."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    use_dora: bool = False  # DoRA (weight-decomposed LoRA, peft's use_dora): a learned magnitude per output row


@dataclass(kw_only=True)
class VLMTrainSection(TrainSection):
    """The ``train:`` section plus what fine-tuning a checkpoint folder adds."""

    gradient_checkpointing: bool = False
    freeze: list[str] = field(default_factory=list)  # any of vision, merger, llm
    lr_parts: dict = field(default_factory=dict)  # a learning rate per part: vision, merger, llm, encoding
    weight_decay_parts: dict = field(default_factory=dict)  # a weight decay per part (same names)
    sequence_parallel: int = 1  # ranks sharing each sample's sequence (Ulysses; train/sequence_parallel.py)


@dataclass(kw_only=True)
class DataSection:
    task: Literal["v_niah", "v_niah_d"] = "v_niah"
    frames: int = 8  # training length (frames per video; the longest when train_lengths is given)
    train_lengths: list[int] | None = None  # several training lengths, e.g. [2, 4, 6, 8] (max = frames); None: frames
    frame_size: int = 16  # a multiple of patch_size * merge_size
    haystack: Literal["procedural", "real"] = "procedural"
    needles: Literal["fashion_mnist", "photos"] = "fashion_mnist"
    needle_size: int | None = None  # None: the needle fills its frame (LongVA)
    needle_span: int = 1
    delta: int = 4  # v_niah_d: distractor distance in frames
    fps: float = 2.0
    train_samples: int = 20000
    val_samples: int = 256
    seed: int = 0
    # fine-tuning a checkpoint folder: LLaVA / ShareGPT annotations (data/instruct)
    annotations: str | None = None  # a JSON list or JSONL file
    val_annotations: str | None = None  # held-out samples, validated every train.val_every steps
    media_root: str | None = None  # media paths are relative to it (default: the annotations' folder)
    max_frames: int = 32  # frames of a video, sampled at data.fps
    min_pixels: int | None = None  # the processor's pixel budget per image / frame (None: the processor's)
    max_pixels: int | None = None
    max_length: int | None = None  # longer samples are dropped and counted; a packed row's budget
    packing: bool = False  # pack samples into rows (cu_seqlens)
    max_skipped: int = 100  # unreadable media files tolerated (skipped and counted)
    max_skipped_fraction: float = 0.5  # stop when more of the samples read were left out (1: never)
    format: Literal["auto", "llava", "sharegpt", "qwen"] = "auto"  # annotation format (auto: detected per file)
    allow_outside_root: bool = False  # read media paths that lead outside data.media_root
    nframes: int | None = None  # frames per video, spread uniformly (instead of data.fps up to data.max_frames)
    image_max_pixels: int | None = None  # per-kind budgets replacing data.max_pixels
    video_max_pixels: int | None = None


@dataclass(kw_only=True)
class VLMConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: VLMTrainSection = field(default_factory=VLMTrainSection)
    deepspeed: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_mode(self)


# keys that belong to one of the two kinds of run only
_TINY_ONLY = {
    "model": ("preset", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
              "initializer_range", "vision_dim", "vision_depth", "vision_heads", "vision_encoding",
              "vision_encoding_options", "vision_attention", "patch_size", "temporal_patch_size", "merge_size",
              "rope_theta"),
    "data": ("task", "frames", "train_lengths", "frame_size", "haystack", "needles", "needle_size", "needle_span",
             "delta", "train_samples", "val_samples"),
}  # fmt: skip
_HF_ONLY = {
    "model": ("scaling", "lora"),
    "data": ("annotations", "val_annotations", "media_root", "max_frames", "min_pixels", "max_pixels", "max_length",
             "packing", "max_skipped", "max_skipped_fraction", "format", "allow_outside_root", "nframes",
             "image_max_pixels", "video_max_pixels"),
    "train": ("gradient_checkpointing", "freeze", "sequence_parallel", "lr_parts", "weight_decay_parts"),
}  # fmt: skip


def check_mode(cfg: "VLMConfig") -> None:
    """``ConfigError`` for a key set away from its default that the run's kind does not read: the small VLM's
    sizes with ``model.hf_model`` (the checkpoint defines the model), fine-tuning keys without it."""
    hf = cfg.model.hf_model is not None
    wrong = _TINY_ONLY if hf else _HF_ONLY
    for section, keys in wrong.items():
        obj = getattr(cfg, section)
        default = type(obj)()
        for key in keys:
            if getattr(obj, key) != getattr(default, key):
                if hf:
                    raise ConfigError(
                        f"{section}.{key} applies to the small VLM; with model.hf_model the checkpoint folder defines "
                        f"the model and data.annotations the data: remove it (the configs of configs/hf/ set none)"
                    )
                raise ConfigError(
                    f"{section}.{key} applies to fine-tuning a checkpoint folder: set model.hf_model=DIR (see "
                    "configs/hf/), or remove it"
                )
    if cfg.model.attn_implementation == "flash_attention_2" and not hf:
        raise ConfigError("model.attn_implementation=flash_attention_2 applies to model.hf_model; the small VLM "
                          "runs sdpa or eager")  # fmt: skip
    if hf:
        parts = ("vision", "merger", "llm")
        bad = [p for p in cfg.train.freeze if p not in parts]
        if bad:
            raise ConfigError(f"train.freeze: unknown part(s) {bad}; choose any of {list(parts)}")
        if cfg.data.max_frames < 1:
            raise ConfigError(f"data.max_frames must be >= 1, got {cfg.data.max_frames}")
        if cfg.data.max_length is not None and cfg.data.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2 tokens or null, got {cfg.data.max_length}")
        if cfg.data.max_skipped < 0:
            raise ConfigError(f"data.max_skipped must be >= 0, got {cfg.data.max_skipped}")
        if cfg.data.fps <= 0:
            raise ConfigError(f"data.fps must be > 0, got {cfg.data.fps}")
        if not 0 <= cfg.data.max_skipped_fraction <= 1:
            raise ConfigError(f"data.max_skipped_fraction must lie in [0, 1] (1: never stop), got "
                              f"{cfg.data.max_skipped_fraction}")  # fmt: skip
        if cfg.data.nframes is not None and cfg.data.nframes < 2:
            raise ConfigError(f"data.nframes must be >= 2 (a temporal patch is 2 frames) or null, got "
                              f"{cfg.data.nframes}")  # fmt: skip
        for key, least in (("lr_parts", "> 0"), ("weight_decay_parts", ">= 0")):
            for part, value in getattr(cfg.train, key).items():
                if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
                    value = getattr(cfg.train, key)[part] = float(value)  # YAML 1.1 reads 1e-5 as a string
                if part not in (*parts, "encoding"):
                    raise ConfigError(f"train.{key}: unknown part {part!r}; choose any of {[*parts, 'encoding']} "
                                      f"(e.g. train.{key}={{vision: 2.0e-6, merger: 1.0e-5}})")  # fmt: skip
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not number or not (value > 0 if least == "> 0" else value >= 0):
                    raise ConfigError(f"train.{key}.{part} must be a number {least}, got {value!r}")
        if cfg.model.lora.enabled and cfg.train.zero_stage == 3:
            raise ConfigError(
                "model.lora.enabled=true needs train.zero_stage 0, 1 or 2, got 3: the adapters are merged into "
                "whole weights on one rank at export, which ZeRO-3's partitions do not hold; set train.zero_stage=2 "
                "(the decoder's base weights are frozen, so LoRA needs little memory), or fine-tune in full at ZeRO-3"
            )
        if cfg.model.lora.enabled and "llm" in cfg.train.freeze:
            raise ConfigError(
                f"model.lora.enabled=true with train.freeze={list(cfg.train.freeze)}: the decoder trains through its "
                "LoRA adapters, which freezing llm would freeze too; remove llm from train.freeze, or set "
                "model.lora.enabled=false to train the vision parts alone"
            )
        from train.sequence_parallel import check_config  # sequence parallelism: what it cannot do, refused here

        check_config(cfg)


def build_tokenizer(data: DataSection):
    """The word-level tokenizer of the task (its vocabulary comes from the task's texts; nothing downloaded)."""
    from data.text import build_tokenizer as build
    from data.vniah import vocabulary

    return build(vocabulary(data.needles))


def build_datasets(cfg: VLMConfig, *, lengths: tuple[int, ...] | None = None) -> tuple[Dataset, Dataset]:
    """(train, val) V-NIAH sets at the training length: needles from the training / test split, the needle
    frame uniform over every place in the video (one depth per frame)."""
    from data.vniah import VNIAH

    d, m = cfg.data, cfg.model
    unit = m.patch_size * m.merge_size
    if d.frame_size % unit:
        raise ConfigError(f"data.frame_size={d.frame_size} must be a multiple of patch_size x merge_size = {unit}")
    L = d.frames
    if L < d.needle_span:
        raise ConfigError(f"data.frames={L} is shorter than data.needle_span={d.needle_span}")
    if d.train_lengths is not None:
        tl = [int(x) for x in d.train_lengths]
        if not tl or max(tl) != L or min(tl) < d.needle_span:
            raise ConfigError(f"data.train_lengths={d.train_lengths} must be non-empty, end at data.frames={L} (the "
                              f"longest training video) and be >= data.needle_span={d.needle_span}")  # fmt: skip
        lengths = lengths or tuple(sorted(set(tl)))
    places = L - d.needle_span + 1
    depths = [i / (places - 1) for i in range(places)] if places > 1 else [0.0]
    common = dict(
        lengths=lengths or (L,), depths=depths, size=d.frame_size, haystack=d.haystack, needles=d.needles,
        needle_size=d.needle_size, needle_span=d.needle_span, fps=d.fps,
        distractors="single" if d.task == "v_niah_d" else None, delta=d.delta,
    )  # fmt: skip
    per_cell = lambda n: max(1, math.ceil(n / places))  # noqa: E731
    try:
        train = VNIAH(samples_per_cell=per_cell(d.train_samples), split="train", seed=d.seed, **common)
        val = VNIAH(samples_per_cell=per_cell(d.val_samples), split="test", seed=d.seed + 1, **common)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from e
    return train, val
