"""Fine-tune a pretrained Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder under any vlpe multimodal variant:
what ``train/vlm.py`` runs when ``model.hf_model`` is set.

    deepspeed --num_gpus 8 train/vlm.py --config configs/hf/qwen2_vl.yaml model.hf_model=Qwen2-VL-7B-Instruct \
        model.variant=videorope data.annotations=llava_video_178k.json data.media_root=videos/

The workflow of the papers behind MRoPE-I, VideoRoPE, HoPE, VRoPE, V2PE and PyPE (the README's section "Fine-tune a
Qwen-VL with another position encoding"): load the folder offline with its own processor and chat template, switch its text positions and rotary
tables with :func:`vlpe.integrations.transformers.apply` (``model.scaling`` a vlpe scaling dict), fine-tune on
LLaVA / ShareGPT-style annotations (:mod:`data.instruct`: videos decoded at ``data.fps`` up to ``data.max_frames``
with their real timestamps, loss on assistant tokens only), then export a folder stock ``transformers`` loads, with
the variant recorded in its ``config.json`` (:func:`vlpe.integrations.transformers.save_pretrained`).

The pieces:

* :func:`load_model`: ``AutoModelForImageTextToText.from_pretrained(local_files_only=True)`` in fp32 (DeepSpeed's
  ``torch_autocast`` runs bf16 compute with fp32 parameters, as every script here does); at ZeRO-3 a
  ``transformers.integrations.HfDeepSpeedConfig`` of the run's DeepSpeed config is alive while it loads, so the
  weights load straight into partitioned parameters (a 7B model never materialises whole on one rank); then
  optional LoRA or DoRA (``peft``, the vision tower and mergers left fully trainable), ``train.freeze`` and
  ``train.gradient_checkpointing``, then the vlpe patch (its per-head hooks follow whatever module sits at a
  query / key projection, so adapters and their merging are covered in either order).
* :class:`CausalLM`: the module DeepSpeed trains: ``forward(batch) -> {"loss", "correct", "scored"}``, the summed
  cross-entropy of the supervised tokens divided by their number; the LM head runs on supervised positions only
  (no ``(B, S, vocab)`` logits).
* :func:`filler_item`: the label-free image + video sample that keeps the vision tower's calls equal on every rank
  (:mod:`data.hf_batch`).
* :func:`source_record`: what a resume must find unchanged besides the model section: the checkpoint folder (path
  and a fingerprint of its config and weight files) and the annotation files (path and sha256).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from train.config import ConfigError

__all__ = ["load_model", "CausalLM", "filler_item", "source_record", "freeze", "export", "main", "part_of",
           "part_groups"]  # fmt: skip

FREEZE_PARTS = ("vision", "merger", "llm")
LR_PARTS = ("vision", "merger", "llm", "encoding")


def _fingerprint(folder: Path) -> str:
    """sha256 over the folder's config.json and the names and sizes of its weight files (cheap for 15 GB folders)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def source_record(cfg) -> dict[str, Any]:
    """The checkpoint folder and annotation files a run trains from, with fingerprints (part of the signature a
    resume checks: a changed folder or data file is refused, naming both values)."""
    folder = Path(cfg.model.hf_model).resolve()
    out: dict[str, Any] = {"hf_model": str(folder), "hf_fingerprint": _fingerprint(folder)}
    for key in ("annotations", "val_annotations"):
        path = getattr(cfg.data, key)
        if path:
            p = Path(path).resolve()
            out[key] = str(p)
            out[f"{key}_sha256"] = _sha256(p)
    return out


def check_folder(path: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.hf_model={path!r} is not a Hugging Face checkpoint folder (no config.json); give the folder that "
            "holds config.json, the weights and the processor files (save_pretrained, or a downloaded snapshot)"
        )
    return folder


def freeze(model: nn.Module, parts: list[str]) -> dict[str, int]:
    """Stop gradients of ``parts`` (``vision``: the vision tower but its merger(s); ``merger``: the merger(s),
    Qwen3-VL's deepstack mergers included; ``llm``: the decoder and the LM head); returns the parameter counts
    left trainable and frozen, whole parameters even when ZeRO-3 has partitioned them (``ds_numel``: a partitioned
    parameter's own tensor is empty)."""
    unknown = [p for p in parts if p not in FREEZE_PARTS]
    if unknown:
        raise ConfigError(f"train.freeze: unknown part(s) {unknown}; choose from {list(FREEZE_PARTS)}")
    base = model.model
    visual, text = base.visual, base.language_model

    def merger(name: str) -> bool:
        return name.split(".")[0] in ("merger", "deepstack_merger_list")

    chosen: list[nn.Parameter] = []
    for name, p in visual.named_parameters():
        if ("merger" in parts and merger(name)) or ("vision" in parts and not merger(name)):
            chosen.append(p)
    if "llm" in parts:
        chosen += list(text.parameters()) + list(model.lm_head.parameters())
    for p in chosen:
        p.requires_grad_(False)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    frozen = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen}


def part_of(name: str) -> str:
    """The part of a Qwen-VL parameter (its dotted name in any wrapper): ``merger`` (the merger(s), Qwen3-VL's
    deepstack mergers included), ``encoding`` (a position encoding's own parameters: the vision tower's learned
    ``pos_embed`` table, rotary parameters), ``vision`` (the rest of the vision tower), ``llm`` (the decoder, its
    adapters and the LM head).

    Raises:
        ValueError: the name belongs to none of them.
    """
    parts = name.split(".")
    if "visual" in parts:
        after = parts[parts.index("visual") + 1 :]
        if after and after[0] in ("merger", "deepstack_merger_list"):
            return "merger"
        return "encoding" if "pos_embed" in after else "vision"
    if "language_model" in parts or "lm_head" in parts:
        return "encoding" if "rotary_emb" in parts else "llm"
    raise ValueError(f"parameter {name!r} is in none of the parts {list(LR_PARTS)} (a Qwen-VL model's visual, "
                     "language_model and lm_head)")  # fmt: skip


def part_groups(module: nn.Module, decay: list, no_decay: list, weight_decay: float, *, lr: float,
                lr_parts: dict, weight_decay_parts: dict) -> list[dict]:  # fmt: skip
    """AdamW groups with a learning rate and weight decay per part (:func:`part_of`): the engine's decayed and
    undecayed parameters (:func:`train.engine.param_groups`) split by part, in the order of :data:`LR_PARTS`.

    A part missing from ``lr_parts`` / ``weight_decay_parts`` takes ``lr`` / ``weight_decay``; undecayed
    parameters (biases, norms, ...) keep no decay. The cosine schedule scales every group's rate by the same
    factor (``train.min_lr`` is a fraction ``min_lr / lr`` of each). Each group carries its ``part``; rank 0
    prints one line per group.

    Args:
        module (nn.Module): the trained module (parameter names are read from it).
        decay (list): the parameters that take weight decay.
        no_decay (list): those that do not.
        weight_decay (float): ``train.weight_decay``.
        lr (float): ``train.lr``.
        lr_parts (dict): ``train.lr_parts``, e.g. ``{"vision": 2e-6, "merger": 1e-5}``.
        weight_decay_parts (dict): ``train.weight_decay_parts``.

    Returns:
        list[dict]: the non-empty groups (``params``, ``lr``, ``weight_decay``, ``part``).
    """
    import torch.distributed as dist

    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for decays, params in ((True, decay), (False, no_decay)):
        for part in LR_PARTS:
            chosen = [p for p in params if part_of(names[id(p)]) == part]
            if chosen:
                wd = float(weight_decay_parts.get(part, weight_decay)) if decays else 0.0
                groups.append({"params": chosen, "lr": float(lr_parts.get(part, lr)), "weight_decay": wd,
                               "part": part})  # fmt: skip
    if not dist.is_initialized() or dist.get_rank() == 0:
        for g in groups:
            n = sum(getattr(p, "ds_numel", p.numel()) for p in g["params"])
            print(f"[train] parameter group {g['part']}: lr {g['lr']:g}, weight decay {g['weight_decay']:g}, "
                  f"{n:,} parameters", flush=True)  # fmt: skip
    return groups


def load_model(cfg, ds_config: dict | None):
    """The model and processor of ``cfg.model.hf_model`` ready to train: LoRA, freezing, checkpointing, the variant.

    ``ds_config`` (the run's DeepSpeed config) is needed at ZeRO-3, where loading happens into partitioned
    parameters; the returned ``keep`` object must stay alive until ``deepspeed.initialize`` has run.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlpe.integrations import transformers as vlpe_hf

    m, t = cfg.model, cfg.train
    folder = check_folder(m.hf_model)
    keep = None
    if t.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_config)  # from_pretrained loads into ZeRO-3 partitions while it lives
    if m.attn_implementation == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not torch.cuda.is_available() or not is_flash_attn_2_available():
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs a CUDA GPU and the flash-attn package "
                f"(cuda available: {torch.cuda.is_available()}, flash-attn usable: {is_flash_attn_2_available()}); "
                "use sdpa here (packing stays exact under sdpa)"
            )
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "chat_template", None) is None:
        raise ConfigError(
            f"model.hf_model={m.hf_model!r}: its processor has no tokenizer or no chat template; an instruction "
            "fine-tune renders conversations through the checkpoint's own chat template"
        )
    model = AutoModelForImageTextToText.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32, attn_implementation=m.attn_implementation
    )
    vlpe_hf.keep_used_conversions(model)  # ZeRO-3 loading records unapplied key renamings that the save reverses
    model.config.use_cache = False
    if m.lora.enabled:
        model = _lora(model, m.lora)
    counts = freeze(model, list(t.freeze)) if t.freeze else None
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"train.freeze={list(t.freeze)} leaves no parameter to train; freeze fewer parts")
    if t.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if m.lora.enabled or "llm" in t.freeze:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    try:
        options = dict(m.variant_options)
        if m.scaling is not None:
            options["scaling"] = m.scaling
        vlpe_hf.apply(model, m.variant, **options)
    except ValueError as e:
        raise ConfigError(f"model.variant={m.variant!r}: {e}") from e
    return model, processor, keep, counts


def _lora(model, lora):
    """LoRA (or DoRA, ``lora.use_dora``) adapters of ``peft`` on the decoder's linear layers named
    ``lora.target_modules``.

    The decoder trains through its adapters only; the vision tower and its merger(s) stay fully trainable (peft
    freezes every weight it does not wrap; ``train.freeze``, applied afterwards, decides on them), so a run with
    ``train.freeze=[]`` trains the adapters, the vision tower and the mergers. Returns the Qwen model itself, its
    projections now peft layers, with the ``PeftModel`` kept for :func:`export` (which merges the adapters).

    Raises:
        ConfigError: peft is not installed.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - peft is pinned in requirements.txt
        raise ConfigError("model.lora.enabled=true needs peft (pip install peft)") from e
    names = "|".join(lora.target_modules)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, use_dora=lora.use_dora,
                        target_modules=rf".*language_model.*\.({names})")  # fmt: skip
    peft_model = get_peft_model(model, config)
    inner = peft_model.base_model.model  # the Qwen model, its linear layers now LoRA layers
    for p in inner.model.visual.parameters():  # not wrapped: trained in full (the vision and merger parts)
        p.requires_grad_(True)
    inner.__dict__["_vlpe_peft"] = peft_model  # kept for export, outside the module tree (peft_model holds inner)
    return inner


class CausalLM(nn.Module):
    """``forward(batch) -> {"loss", "correct", "scored"}`` of a Hugging Face Qwen-VL model on a :mod:`data.hf_batch`
    batch: the summed token cross-entropy of the supervised positions over ``num_labels``, computed from the
    decoder's hidden states at those positions only; ``correct`` / ``scored`` count the samples whose every
    supervised token is the argmax (teacher-forced exact match, as :func:`models.vlm.answer_accuracy`)."""

    def __init__(self, *, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> dict[str, Tensor]:
        from data.hf_batch import MODEL_KEYS

        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
        inputs.setdefault("use_cache", False)
        hidden = self.model.model(**inputs).last_hidden_state  # (B, S, C)
        target = batch["labels"][:, 1:]  # (B, S - 1): token s + 1 is predicted at s
        where = target != -100
        logits = self.model.lm_head(hidden[:, :-1][where]).float()  # (N, V)
        gold = target[where]
        loss = F.cross_entropy(logits, gold, reduction="sum") / batch["num_labels"].clamp_min(1)
        with torch.no_grad():
            seg, n = self._segments(batch, where)  # (B, S - 1) the sample of every predicted position
            wrong = (logits.argmax(-1) != gold).long()
            bad = torch.zeros(n, dtype=torch.long, device=where.device).index_add_(0, seg[where], wrong)
            has = torch.zeros_like(bad).index_add_(0, seg[where], torch.ones_like(wrong))
            has = has > 0
        return {"loss": loss, "correct": (has & (bad == 0)).sum(), "scored": has.sum()}

    @staticmethod
    def _segments(batch: dict, where: Tensor) -> tuple[Tensor, int]:
        """The sample of every predicted position ``(B, S - 1)`` (the row, or the packed segment of the predicted
        token) and the number of samples (segments)."""
        B, S1 = where.shape
        if "cu_seqlens" not in batch:
            return torch.arange(B, device=where.device)[:, None].expand(B, S1), B
        cu = batch["cu_seqlens"].to(where.device).long()  # (n + 1,)
        flat = torch.arange(B * (S1 + 1), device=where.device).view(B, S1 + 1)[:, 1:]  # the predicted token's slot
        return torch.searchsorted(cu, flat, right=True) - 1, cu.numel() - 1

    def no_weight_decay(self) -> set[str]:
        return set()


def filler_item(processor) -> dict:
    """A processed sample with one black image and one two-frame black video at the processor's smallest size
    and no supervised token (see :mod:`data.hf_batch`)."""
    import numpy as np

    tok = processor.tokenizer
    ip = processor.image_processor
    merge = int(getattr(ip, "merge_size", 2))
    patch = int(getattr(ip, "patch_size", 14))
    side = patch * merge
    image = np.zeros((side, side, 3), dtype=np.uint8)
    video = np.zeros((2, side, side, 3), dtype=np.uint8)
    text = processor.image_token + processor.video_token
    start, end = getattr(processor, "vision_start_token", None), getattr(processor, "vision_end_token", None)
    if start and end:
        text = f"{start}{processor.image_token}{end}{start}{processor.video_token}{end}"
    meta = {"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1]}
    out = processor(text=[text], images=[image], videos=[video], video_metadata=[meta], do_sample_frames=False,
                    return_tensors="pt", return_mm_token_type_ids=True)  # fmt: skip
    item = {
        "input_ids": out["input_ids"][0], "mm_token_type_ids": out["mm_token_type_ids"][0],
        "labels": torch.full_like(out["input_ids"][0], -100), "index": -1,
    }  # fmt: skip
    for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if k in out:
            item[k] = out[k]
    if tok.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set one (tokenizer.pad_token) in the checkpoint folder")
    return item


def export(engine, out_dir: Path, *, processor, zero_stage: int, source: Path | None = None,
           preprocessing: dict | None = None) -> Path:
    """The trained model as a Hugging Face folder ``<out_dir>/hf`` (stock keys, the variant in config.json, the
    processor beside it); ZeRO-3 weights are gathered module by module onto rank 0 (DeepSpeed's consolidated state
    dict); LoRA adapters are merged into the weights. Returns the folder."""
    import torch.distributed as dist

    from vlpe.integrations import transformers as vlpe_hf

    model = engine.module.model
    folder = out_dir / "hf"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # noqa: SLF001 - rank 0 only; DeepSpeed's own API
        state = None if state is None else {k.removeprefix("model."): v for k, v in state.items()}
    else:
        state = None
    peft_model = getattr(model, "_vlpe_peft", None)
    if peft_model is not None:
        merged = peft_model.merge_and_unload()
        state = merged.state_dict()
        model = merged
    if rank0:
        dtype = getattr(model.config, "dtype", None)
        if state is None:
            state = model.state_dict()
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype != torch.float32:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        vlpe_hf.save_pretrained(model, folder, state_dict=state, processor=processor, preprocessing=preprocessing)
        if source is not None:
            check_keys(folder, source)
    if dist.is_initialized():
        dist.barrier()
    return folder


def preprocessing(cfg) -> dict[str, Any]:
    """The inputs a run trains on, as the export records them for the evaluators (``fps``, ``max_frames``,
    ``min_pixels``, ``max_pixels``: the video frames' budget, ``image_max_pixels``: the images'; None where the
    processor's own budget was used)."""
    d = cfg.data
    return {"fps": float(d.fps), "max_frames": int(d.max_frames), "min_pixels": d.min_pixels,
            "max_pixels": d.video_max_pixels or d.max_pixels,
            "image_max_pixels": d.image_max_pixels or d.max_pixels}  # fmt: skip


def weight_keys(folder: Path) -> set[str]:
    """The tensor names of a folder's safetensors weights (one file or an index of shards), read from the headers."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    keys: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys


def check_keys(folder: Path, source: Path) -> None:
    """Refuse an export whose weight names are not the source folder's (another naming would not load in older
    transformers, serving engines or conversion tools).

    Raises:
        RuntimeError: naming the keys found only in the export and only in the source.
    """
    got, want = weight_keys(folder), weight_keys(source)
    if want and got != want:
        extra, missing = sorted(got - want), sorted(want - got)
        raise RuntimeError(
            f"the export {folder} names its weights unlike the source {source}: {len(extra)} key(s) only in the "
            f"export (e.g. {extra[:3]}), {len(missing)} only in the source (e.g. {missing[:3]})"
        )


def _with_parts(module: nn.Module, t) -> nn.Module:
    """``module`` whose optimizer groups are split by part (:func:`part_groups`) when ``train.lr_parts`` or
    ``train.weight_decay_parts`` is set (the engine calls its ``split_groups``)."""
    if t.lr_parts or t.weight_decay_parts:
        module.split_groups = lambda decay, no_decay, wd: part_groups(
            module, decay, no_decay, wd, lr=t.lr, lr_parts=t.lr_parts, weight_decay_parts=t.weight_decay_parts)
    return module


def main(cfg, raw: dict) -> None:
    """The fine-tuning run of ``cfg`` (a ``train/vlm.py`` config with ``model.hf_model`` set)."""
    from data.hf_batch import InstructCollator
    from data.instruct import InstructDataset
    from train.engine import deepspeed_config, fit, setup_distributed
    from train.sequence_parallel import check_world, wrap
    from train.tasks import reduce_accuracy

    from vlpe.integrations.transformers import patch_of

    d, t = cfg.data, cfg.train
    if not d.annotations:
        raise ConfigError("model.hf_model needs data.annotations (a JSON / JSONL file in the llava, sharegpt or qwen "
                          "format, see data/instruct/annotations.py)")
    rank, world, device = setup_distributed()
    check_world(t.sequence_parallel, world)  # sequence parallelism: refused before the model loads
    ds_cfg = deepspeed_config(t, cfg.deepspeed, world=world, device=device)
    model, processor, keep, counts = load_model(cfg, ds_cfg)
    patch = patch_of(model)
    family = patch.family
    common = dict(media_root=d.media_root or str(Path(d.annotations).resolve().parent), processor=processor,
                  family=family, fps=d.fps, max_frames=d.max_frames, min_pixels=d.min_pixels,
                  max_pixels=d.max_pixels, max_length=d.max_length, max_skipped=d.max_skipped,
                  max_skipped_fraction=d.max_skipped_fraction, format=d.format, nframes=d.nframes,
                  allow_outside_root=d.allow_outside_root, image_max_pixels=d.image_max_pixels,
                  video_max_pixels=d.video_max_pixels)  # fmt: skip
    try:
        train_set = InstructDataset(annotations=d.annotations, **common)
        val_set = InstructDataset(annotations=d.val_annotations, **common) if d.val_annotations else None
    except ValueError as e:
        raise ConfigError(f"data: {e}") from e
    filler = filler_item(processor)
    pad = processor.tokenizer.pad_token_id
    collate = InstructCollator(variant=patch.variant, family=family, spatial_merge_size=patch.spatial_merge_size,
                               pad_token_id=pad, packing=d.packing, max_length=d.max_length, filler=filler)  # fmt: skip
    val_collate = InstructCollator(variant=patch.variant, family=family, spatial_merge_size=patch.spatial_merge_size,
                                   pad_token_id=pad, filler=filler)  # fmt: skip
    if t.zero_stage == 3:  # loaded into partitions: this rank holds its share of every parameter
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
        total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"[train] rank {rank}: ZeRO-3 partitions hold {held:,} of {total:,} parameter elements", flush=True)
    if rank == 0 and counts is not None:
        print(f"[train] frozen {t.freeze}: {counts['trainable']:,} parameters trainable, {counts['frozen']:,} frozen",
              flush=True)  # fmt: skip

    def validate(module, device):
        from torch.utils.data import DataLoader, Subset

        from train.engine import move_to

        n = len(val_set) // world  # every rank runs the same number of batches (ZeRO-3 gathers collectively)
        n = min(n, t.val_batches * t.micro_batch)
        loader = DataLoader(Subset(val_set, range(rank * n, (rank + 1) * n)), batch_size=t.micro_batch,
                            collate_fn=val_collate, num_workers=t.num_workers)  # fmt: skip
        stats = torch.zeros(3, dtype=torch.float64)  # correct, scored, loss x scored
        for batch in loader:
            batch = move_to(batch, device)
            out = module(batch)
            scored = out["scored"].double().cpu()
            stats += torch.stack([out["correct"].double().cpu(), scored, out["loss"].detach().double().cpu() * scored])
        return reduce_accuracy(stats)

    run_config = {**raw, "script": "vlm", "source": source_record(cfg)}
    if t.sequence_parallel > 1:  # a resume with another sequence-parallel size is refused, naming both
        run_config["sequence_parallel"] = t.sequence_parallel
    fit(
        model=_with_parts(wrap(CausalLM(model=model), t.sequence_parallel), t),  # or its sequence-parallel form
        train=t,
        deepspeed_overrides=cfg.deepspeed,
        train_set=train_set,
        collate=collate,
        validate=validate if val_set is not None else None,
        run_config=run_config,
        tokens_per_sample=lambda batch: int(batch["input_ids"].numel()),
        export=lambda engine, out_dir: export(engine, out_dir, processor=processor, zero_stage=t.zero_stage,
                                              source=Path(cfg.model.hf_model), preprocessing=preprocessing(cfg)),
    )
    del keep
    if rank == 0 and t.num_workers == 0:  # DataLoader workers keep their own counts: these stay empty then
        skipped = {"dropped (longer than data.max_length)": len(train_set.dropped),
                   "skipped (unreadable media)": len(train_set.skipped)}  # fmt: skip
        print(f"[train] training samples {json.dumps(skipped)}", flush=True)
    elif rank == 0:
        print("[train] samples dropped (longer than data.max_length) or skipped (unreadable media) are counted in "
              "the train records of metrics.jsonl ('skipped', this rank's samples)", flush=True)  # fmt: skip
