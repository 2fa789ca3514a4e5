"""Task heads shared by the classification scripts: a loss wrapper and distributed accuracy."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Classifier", "evaluate_classification", "shard", "val_loader", "reduce_accuracy"]


class Classifier(nn.Module):
    """``forward(batch) -> {"loss", "logits"}`` around a backbone mapping inputs to class logits.

    ``batch`` is ``(inputs, labels)``; ``inputs`` is whatever the backbone takes (images, a list of
    images of different sizes, point clouds). A batch with no labels (``labels`` of length 0: every sample of it
    was unreadable, ``train.vit_setup.collate``'s stand-in) has nothing to train on: the backbone still runs on its
    stand-in inputs and the loss is 0 times their logits, so every parameter gets a zero gradient and every rank
    takes part in the step's collectives.
    """

    def __init__(self, backbone: nn.Module, *, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.backbone = backbone
        self.label_smoothing = label_smoothing

    def forward(self, batch) -> dict[str, Tensor]:
        inputs, labels = batch
        logits = self.backbone(inputs)
        if labels.shape[0] == 0:  # nothing to train on (a shape, known on the host: no device sync)
            return {"loss": logits.float().sum() * 0.0, "logits": logits[:0]}
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        return {"loss": loss, "logits": logits}

    def no_weight_decay(self) -> set[str]:
        fn = getattr(self.backbone, "no_weight_decay", None)
        return {f"backbone.{n}" for n in fn()} if callable(fn) else set()


def shard(n: int, rank: int, world: int) -> range:
    """This rank's strided share of ``range(n)``."""
    return range(rank, n, world)


def val_loader(dataset, *, micro_batch: int, max_batches: int, collate: Callable, num_workers: int = 0):
    """This rank's strided share of the first ``max_batches`` validation batches (all ranks together)."""
    from torch.utils.data import DataLoader, Subset

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    idx = list(shard(len(dataset), rank, world))[: max_batches * micro_batch]
    return DataLoader(Subset(dataset, idx), batch_size=micro_batch, collate_fn=collate, num_workers=num_workers)


@torch.no_grad()
def evaluate_classification(
    model: nn.Module, batches: Iterable, device: torch.device, *, to_device: Callable
) -> dict[str, float]:
    """Top-1 accuracy and mean loss over ``batches`` (this rank's share), summed over all ranks. A batch has as many
    scored samples as labels: the inputs of a batch without labels (a stand-in for unreadable samples, see
    :class:`Classifier`) still go through the model, as on every other rank, and count for nothing."""
    correct = torch.zeros((), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        inputs, labels = to_device(batch, device)
        logits = model.backbone(inputs) if isinstance(model, Classifier) else model(inputs)
        if labels.shape[0] == 0:
            logits = logits[:0]
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double().cpu()
        correct += (logits.argmax(-1) == labels).sum().double().cpu()
        total += labels.numel()
    return reduce_accuracy(torch.stack([correct, total, loss_sum]))


def reduce_accuracy(stats: Tensor) -> dict[str, float]:
    """``{"acc", "loss", "count"}`` from this rank's ``(correct, count, summed loss)`` float64, summed over
    ranks; ``ValueError`` when nothing was scored (an accuracy of 0 over 0 samples is no measurement)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    c, t, l = stats.tolist()
    if t == 0:
        raise ValueError(
            "no validation samples were scored: the validation set is empty (data.val_limit, train.val_batches)"
        )
    return {"acc": c / t, "loss": l / t, "count": t}
