"""Classification scores of a model on batches: predictions, top-1 and class-mean accuracy, NLL, calibration.

Calibration is the expected calibration error of Guo et al. (ICML 2017) with 15 equal-width confidence bins
``(b/15, (b+1)/15]`` (the first bin also holds confidence 0): ``ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)|``
where ``conf`` is the top softmax probability.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["predict", "expected_calibration_error", "classification_metrics", "group_accuracy"]


@torch.inference_mode()
def predict(
    model: nn.Module,
    batches: Iterable,
    device: torch.device,
    *,
    desc: str | None = None,
    progress: bool = True,
    bf16: bool = False,
) -> tuple[Tensor, Tensor]:
    """Logits ``(n, classes)`` float32 and labels ``(n,)`` on the CPU for ``(inputs, labels)`` batches."""
    from tqdm import tqdm

    from train.engine import move_to

    logits, labels = [], []
    total = len(batches) if hasattr(batches, "__len__") else None
    for inputs, y in tqdm(batches, desc=desc, total=total, disable=not progress, leave=False, dynamic_ncols=True):
        inputs = move_to(inputs, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(inputs)  # (b, classes)
        logits.append(out.float().cpu())
        labels.append(y.cpu())
    if not logits:
        raise ValueError("no evaluation batches: the evaluation set is empty")
    return torch.cat(logits), torch.cat(labels)


def expected_calibration_error(probs: Tensor, labels: Tensor, *, bins: int = 15) -> float:
    """ECE with ``bins`` equal-width bins over the top-class confidence of ``probs`` (n, classes)."""
    if probs.dim() != 2 or labels.shape != probs.shape[:1]:
        raise ValueError(
            f"probs must be (n, classes) with labels (n,), got {tuple(probs.shape)} / {tuple(labels.shape)}"
        )
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    n = probs.shape[0]
    if n == 0:
        raise ValueError("expected_calibration_error needs at least one sample")
    conf, pred = probs.double().max(dim=-1)  # (n,), (n,)
    correct = (pred == labels.to(pred.device)).double()  # (n,)
    edges = torch.arange(bins + 1, dtype=torch.float64, device=conf.device) / bins  # exactly b / bins
    idx = torch.bucketize(conf, edges[1:-1], right=False)  # bin b holds edges[b] < conf <= edges[b+1]
    gap = torch.bincount(idx, weights=correct, minlength=bins) - torch.bincount(idx, weights=conf, minlength=bins)
    return float(gap.abs().sum() / n)


def classification_metrics(logits: Tensor, labels: Tensor, *, bins: int = 15) -> dict[str, Any]:
    """Top-1 accuracy, ECE (``bins`` bins), mean NLL, class-mean accuracy, the sample count and the per-item
    outcomes (``outcomes``: packed bits, see :func:`stats.pack_bits`; what the benchmark's intervals resample)."""
    from stats import pack_bits

    logits, labels = logits.float(), labels.long()
    correct = logits.argmax(-1) == labels  # (n,)
    classes = labels.unique()
    per_class = torch.stack([correct[labels == c].double().mean() for c in classes])
    return {
        "acc": float(correct.double().mean()),
        "ece": expected_calibration_error(logits.softmax(-1), labels, bins=bins),
        "nll": float(F.cross_entropy(logits, labels)),
        "class_mean_acc": float(per_class.mean()),
        "count": int(labels.numel()),
        "outcomes": pack_bits(correct.numpy()),
    }


def group_accuracy(correct: Tensor, groups: Tensor, num_groups: int) -> list[float | None]:
    """Accuracy within each group ``0..num_groups-1`` (None for an empty group)."""
    count = torch.bincount(groups.long(), minlength=num_groups)[:num_groups]
    hits = torch.bincount(groups.long(), weights=correct.double(), minlength=num_groups)[:num_groups]
    return [float(h / c) if c > 0 else None for h, c in zip(hits, count)]
