"""Zero-shot classification beyond the training resolution: CLIPs with a vlpe vision tower, one per encoding.

    python eval/zero_shot.py                                   # configs/zero_shot.yaml (a few CPU minutes)
    python eval/zero_shot.py steps=100 encodings=[rope,ape] --out outputs/zero_shot   # key=value, as train/*.py
    python eval/zero_shot.py --help                            # every key with its default

Protocol. For each encoding, ``open_clip.create_model("<tower>-<encoding>")`` (the configs of
:mod:`models.clip`: a vlpe ViT through open_clip's ``timm_model_name``, open_clip's text
transformer and its bundled BPE tokenizer) is trained from scratch, contrastively, on the Fashion-MNIST
training images (Debian ``dataset-fashion-mnist``, 28 px; pixels as the config's ``preprocess_cfg`` of
:mod:`models.clip` says: [0, 1], unnormalised) paired with captions: a class name in one of
:data:`TRAIN_TEMPLATES`, drawn per image and step. Fashion-MNIST has ten classes, so a batch holds many
images of one class; the loss is CLIP's symmetric cross-entropy with every caption of the image's class
counted as a positive (the UniCL form; with unique captions it is CLIP's loss). Every encoding gets the same
seed, data order, captions and optimiser (AdamW, warm-up then cosine).

Evaluation: open_clip's zero-shot classifier (``build_zero_shot_classifier``: the mean normalised text
embedding of each class over the *held-out* :data:`TEST_TEMPLATES`), applied to the test images resized
(antialiased bicubic, the ``resize`` protocol of ``eval/resolution.py``) from 28 px to each size of
``sizes``, with the same weights. Reported: top-1 per size (chance 10%). Writes ``zero_shot.json`` and
``zero_shot.md`` to ``--out``. Checked in ``tests/test_zero_shot.py`` (the loss is open_clip's ``ClipLoss``
when every caption is unique; a seed fixes the run).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from report_tables import markdown_table, write_json

__all__ = ["ZeroShotConfig", "TRAIN_TEMPLATES", "TEST_TEMPLATES", "train_clip", "zero_shot_accuracy", "run", "main"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "zero_shot.yaml"

TRAIN_TEMPLATES = (
    "a photo of a {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a {}.",
    "a photo of the {}.",
    "a black and white photo of a {}.",
    "a low resolution photo of a {}.",
    "a cropped photo of a {}.",
)
TEST_TEMPLATES = (  # never seen in training
    "a good photo of a {}.",
    "a close-up photo of the {}.",
    "a grayscale image of a {}.",
    "a product photo of a {}.",
)


@dataclass(kw_only=True)
class ZeroShotConfig:
    """The protocol's knobs (YAML keys; a typo is an error listing these)."""

    tower: str = "vlpe-ViT-Pico-4-28"  # a models.clip tower
    encodings: list[str] = field(default_factory=list)
    steps: int = 300
    batch_size: int = 64
    lr: float = 2.0e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    train_limit: int | None = None  # training images (None: all 60,000)
    test_limit: int | None = 1000  # test images (None: all 10,000)
    sizes: list[int] = field(default_factory=lambda: [28, 42, 56, 84])
    eval_batch: int = 250
    seed: int = 0
    threads: int | None = None  # torch CPU threads (None: torch's default)
    progress: bool = True  # a progress bar over each encoding's training steps (stderr)

    def __post_init__(self) -> None:
        if not self.encodings:
            raise ValueError("encodings must name at least one encoding (see configs/zero_shot.yaml)")
        for name in ("steps", "batch_size", "eval_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 (a contrastive batch), got {self.batch_size}")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0, warmup_steps >= 0; got {self.lr}, "
                             f"{self.weight_decay}, {self.warmup_steps}")
        for name in ("train_limit", "test_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 images (or null for all), got {value}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or null for torch's default), got {self.threads}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"sizes must be a non-empty list of positive sides in pixels, got {self.sizes}")


def _fashion_mnist(split: str, limit: int | None) -> tuple[Tensor, Tensor, tuple[str, ...]]:
    """Images ``(N, 28, 28)`` uint8, labels ``(N,)`` and the class names (the first ``limit`` of ``split``)."""
    from data.images import FashionMNIST

    ds = FashionMNIST(split)
    n = len(ds) if limit is None else min(limit, len(ds))
    return torch.tensor(ds.images[:n]), torch.tensor(ds.labels[:n]), ds.classes


def _pixels(images: Tensor, size: int, preprocess: dict[str, Any] | None = None) -> Tensor:
    """uint8 ``(B, 28, 28)`` -> the tower's input ``(B, 3, size, size)``: [0, 1] (gray repeated; resized
    antialiased bicubic when ``size`` is not 28), normalised by ``preprocess``'s mean / std (the open_clip
    ``preprocess_cfg`` the model carries; the vlpe towers' is mean 0, std 1)."""
    from data.transforms import resize

    x = images.float().div_(255.0)[:, None]  # (B, 1, 28, 28)
    if size != x.shape[-1]:
        x = resize(x, size)
    x = x.expand(-1, 3, -1, -1)
    if preprocess is None:
        return x
    mean = torch.tensor(preprocess["mean"], dtype=x.dtype)[:, None, None]
    std = torch.tensor(preprocess["std"], dtype=x.dtype)[:, None, None]
    return (x - mean) / std


def _captions(classes: Sequence[str]) -> list[str]:
    """Class names as a caption reads them (``T-shirt/top`` -> ``t-shirt or top``)."""
    return [c.lower().replace("/", " or ") for c in classes]


def unicl_loss(image: Tensor, text: Tensor, scale: Tensor, labels: Tensor) -> Tensor:
    """Symmetric contrastive loss of normalised ``image``/``text`` features ``(B, D)``, positives = same label."""
    logits = scale * image @ text.T  # (B, B)
    pos = (labels[:, None] == labels[None, :]).float()  # (B, B), symmetric
    target = pos / pos.sum(1, keepdim=True)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def _optimizer(model: torch.nn.Module, cfg: ZeroShotConfig) -> torch.optim.Optimizer:
    """AdamW with CLIP's betas; no decay on biases, norms, embeddings-like 1-D tensors and the logit scale."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (rest if p.ndim < 2 or "logit_scale" in name else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=rest, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)


def _lr(step: int, cfg: ZeroShotConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * t))


def _check_configs(tower: str, encodings: Sequence[str]) -> None:
    """``ValueError`` naming the configs that exist unless every ``<tower>-<encoding>`` is an open_clip config."""
    import open_clip

    import models.clip as vo

    missing = [f"{tower}-{e}" for e in encodings if f"{tower}-{e}" not in open_clip.list_models()]
    if missing:
        raise ValueError(f"no open_clip config {missing}; towers: {list(vo.TOWERS)}; configs: {vo.names()}")


def train_clip(cfg: ZeroShotConfig, encoding: str, images: Tensor, labels: Tensor, classes: Sequence[str]):
    """Train ``<tower>-<encoding>`` from scratch; returns the CLIP (eval mode), its tokenizer and the losses."""
    import open_clip

    import models.clip as vo

    _check_configs(cfg.tower, [encoding])
    name = f"{cfg.tower}-{encoding}"
    size = vo.TOWERS[cfg.tower][2]
    torch.manual_seed(cfg.seed)
    model = open_clip.create_model(name, force_preprocess_cfg=vo.preprocess_cfg(name))  # model.visual.preprocess_cfg
    preprocess = model.visual.preprocess_cfg
    tokenizer = open_clip.get_tokenizer(name)
    captions = _captions(classes)
    tokens = tokenizer([t.format(c) for c in captions for t in TRAIN_TEMPLATES])  # (classes * T, L)
    opt = _optimizer(model, cfg)
    g = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(images), generator=g)
    losses = []
    model.train()
    from tqdm import tqdm

    bar = tqdm(range(cfg.steps), desc=f"[zero-shot] {encoding}", unit="step", disable=not cfg.progress, leave=False)
    for step in bar:
        start = (step * cfg.batch_size) % len(order)
        idx = order[start : start + cfg.batch_size]
        if len(idx) < 2:
            idx = order[: cfg.batch_size]
        x = _pixels(images[idx], size, preprocess)  # (B, 3, size, size)
        y = labels[idx]
        which = torch.randint(len(TRAIN_TEMPLATES), (len(idx),), generator=g)
        text = tokens[y * len(TRAIN_TEMPLATES) + which]  # (B, L)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        image_f, text_f, scale = model(x, text)
        loss = unicl_loss(image_f, text_f, scale, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    return model.eval(), tokenizer, losses


@torch.no_grad()
def zero_shot_accuracy(
    model, tokenizer, classes: Sequence[str], images: Tensor, labels: Tensor, sizes: Sequence[int], *, batch: int = 250
) -> dict[int, float]:
    """Top-1 of open_clip's zero-shot classifier (held-out templates) on ``images`` resized to each size."""
    import open_clip

    weights = open_clip.build_zero_shot_classifier(model, tokenizer, _captions(classes), TEST_TEMPLATES)  # (D, K)
    out = {}
    for size in sizes:
        hits = 0
        for i in range(0, len(images), batch):
            x = _pixels(images[i : i + batch], size, getattr(model.visual, "preprocess_cfg", None))  # (b, 3, s, s)
            pred = (model.encode_image(x, normalize=True) @ weights).argmax(-1)
            hits += int((pred == labels[i : i + batch]).sum())
        out[int(size)] = hits / len(images)
    return out


def run(cfg: ZeroShotConfig, *, log=print) -> dict[str, Any]:
    """Train and evaluate every encoding of ``cfg``; the result that :func:`write_report` writes."""
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, log)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: ZeroShotConfig, log) -> dict[str, Any]:
    import open_clip

    import models.clip as vo

    _check_configs(cfg.tower, cfg.encodings)  # before any training
    train_x, train_y, classes = _fashion_mnist("train", cfg.train_limit)
    test_x, test_y, _ = _fashion_mnist("test", cfg.test_limit)
    rows = {}
    for encoding in cfg.encodings:
        t0 = time.perf_counter()
        model, tokenizer, losses = train_clip(cfg, encoding, train_x, train_y, classes)
        seconds = time.perf_counter() - t0
        acc = zero_shot_accuracy(model, tokenizer, classes, test_x, test_y, cfg.sizes, batch=cfg.eval_batch)
        rows[encoding] = dict(
            top1=acc,
            loss_first=losses[0],
            loss_last=sum(losses[-10:]) / len(losses[-10:]),
            train_seconds=round(seconds, 1),
            vision_params=sum(p.numel() for p in model.visual.parameters()),
        )
        log(f"[zero-shot] {encoding}: " + ", ".join(f"{s} px {a:.3f}" for s, a in acc.items()) + f" ({seconds:.0f} s)")
    return dict(
        config=asdict(cfg),
        train_size=vo.TOWERS[cfg.tower][2],
        data=dict(dataset="fashion_mnist", train_images=len(train_x), test_images=len(test_x)),
        templates=dict(train=list(TRAIN_TEMPLATES), test=list(TEST_TEMPLATES)),
        versions=dict(torch=torch.__version__, open_clip=open_clip.__version__),
        results=rows,
    )


def table(result: dict[str, Any]) -> str:
    """One row per encoding, one column per test size (top-1 %, the training size marked)."""
    sizes = result["config"]["sizes"]
    train = result["train_size"]
    header = ["encoding"] + [f"{s} px" + (" (train)" if s == train else f" ({s / train:.2g}x)") for s in sizes]
    rows = [[enc] + [f"{100 * r['top1'][s]:.1f}" for s in sizes] for enc, r in result["results"].items()]
    return markdown_table(header, rows)


def write_report(result: dict[str, Any], out: Path) -> list[Path]:
    cfg = result["config"]
    md = (
        f"# Zero-shot Fashion-MNIST ({cfg['tower']}, {cfg['steps']} steps x {cfg['batch_size']}, seed {cfg['seed']})\n\n"
        f"Top-1 (%) of the zero-shot classifier (held-out templates) on {result['data']['test_images']} test "
        f"images; chance 10.0.\n\n" + table(result)
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "zero_shot.md").write_text(md)
    return [write_json(out / "zero_shot.json", result), out / "zero_shot.md"]


def _keys_help() -> str:
    """Every config key with its default, as the training scripts' ``--help`` lists them (``train/cli.py``)."""
    from train.config import config_keys

    rows = config_keys(ZeroShotConfig)
    width = max(len(f"{k}={v}") for k, v, _ in rows)
    lines = ["config keys and their defaults (the --config file sets its own values; override any as key=value):"]
    lines += [f"  {f'{k}={v}':<{width}}  {note}".rstrip() for k, v, note in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_keys_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML of ZeroShotConfig keys")
    ap.add_argument("--encodings", nargs="+", help="override the config's encodings")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override config keys, e.g. steps=50 (the same as giving them positionally)")  # fmt: skip
    ap.add_argument("--out", default="outputs/zero_shot")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=100 threads=2")
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from train.config import load_config

    ap = build_parser()
    args = ap.parse_intermixed_args(argv)
    overrides = [*args.overrides, *args.set]
    if args.encodings:
        overrides.append("encodings=[" + ",".join(args.encodings) + "]")
    cfg = load_config(ZeroShotConfig, args.config, overrides)
    result = run(cfg)
    for path in write_report(result, Path(args.out)):
        print(f"[zero-shot] wrote {path}")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
