"""Ulysses sequence parallelism for the Qwen-VL fine-tune (``train.sequence_parallel=N``): the ``N`` ranks of a
group share every sample's sequence; the data-parallel size is ``world / N``.

    deepspeed --num_gpus 8 train/vlm.py --config configs/hf/qwen2_5_vl.yaml model.hf_model=Qwen2.5-VL-7B-Instruct \
        train.sequence_parallel=4 ...

How one micro-batch runs on a group (every rank of it holds the same whole batch, from the data-parallel sampler of
its group):

* Everything before the decoder sees whole rows: the collator computes the variant's position ids (and
  ``cu_seqlens``) on the whole (packed) row, and every rank runs the embedding and the vision tower on whole images
  and videos, so no id and no vision block depends on where a shard boundary falls.
* A forward pre-hook of the text model (registered after the vlpe patch's own, which has turned the ids into the
  packed ``(1 + rows, B, S)`` tensor) pads the row to a multiple of ``N``, builds the attention mask of the whole
  padded row with transformers' own mask builder (what the unsharded text model builds: padding, packed samples),
  then keeps this rank's contiguous shard of ``inputs_embeds``, of the LAST dim of the position ids, and of
  Qwen3-VL's deepstack inputs. The padding slots follow every real token of the row and continue its last sample
  (text positions go on, the padding mask marks them present), so the causal mask keeps them out of every real
  token's attention without a dense mask where none was needed (one unpadded row stays plain causal); their labels
  are ignored.
* Every decoder attention runs :func:`ulysses_attention`: an all-to-all turns the ``(B, H, S / N, D)`` sequence
  shards of the queries, keys and values into ``(B, H / N, S, D)`` head shards, the base attention (sdpa / eager)
  runs on the whole sequence with the whole-row mask, and a second all-to-all turns the output back into sequence
  shards. The rotary tables were applied per token before, from the shard's ids.
* :class:`SequenceParallelLM` shifts the labels on the whole row, then takes the shard's; the loss is the shard's
  summed cross-entropy over the label count of the whole batch, so the group's losses add up to the unsharded loss.

Only the text decoder is sharded; validation (``engine.eval()``) runs whole rows on every rank as without sequence
parallelism. :func:`check_config` refuses before launch what this cannot do; :func:`check_world` refuses a world
size that ``N`` does not divide before the model loads.
"""

from __future__ import annotations

import importlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from train.config import ConfigError

__all__ = ["COVERED", "check_config", "check_world", "SequenceParallel", "SequenceParallelLM", "ulysses_attention",
           "seq_to_heads", "heads_to_seq", "wrap"]  # fmt: skip

#: the base attention implementations the all-to-all wrapper runs (on the whole sequence, with a whole-row mask)
COVERED = ("sdpa", "eager")
PREFIX = "vlpe_ulysses_"


def _heads(folder: str) -> tuple[int, int, bool]:
    """``(attention heads, KV heads, sliding window)`` of a checkpoint folder's text decoder, from its config.json."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    text = raw.get("text_config") or raw
    heads = int(text.get("num_attention_heads", raw.get("num_attention_heads", 0)))
    kv = int(text.get("num_key_value_heads") or heads)
    return heads, kv, bool(text.get("use_sliding_window", False))


def check_config(cfg) -> None:
    """Refuse a ``train.sequence_parallel`` run this implementation cannot do, before anything is launched.

    Args:
        cfg: a ``train/vlm.py`` config with ``model.hf_model`` set.

    Raises:
        ConfigError: ``N < 1``; an attention implementation the wrapper does not cover; a variant with its own
            per-layer attention mask (PyPE); a text decoder whose (KV) head count ``N`` does not divide, or
            with sliding-window layers.
    """
    n = cfg.train.sequence_parallel
    if isinstance(n, bool) or n < 1:
        raise ConfigError(f"train.sequence_parallel must be a number of ranks >= 1, got {n!r}")
    if n == 1:
        return
    impl = cfg.model.attn_implementation
    if impl not in COVERED:
        raise ConfigError(
            f"train.sequence_parallel={n} runs its all-to-all attention around {list(COVERED)}, got "
            f"model.attn_implementation={impl!r}; set model.attn_implementation=sdpa (or train.sequence_parallel=1)"
        )
    from vlpe.encodings import multimodal as mm

    variant = cfg.model.variant
    v = mm.VARIANTS.get(variant) if isinstance(variant, str) else None
    if v is not None and (v.masked or v.layered):
        raise ConfigError(
            f"train.sequence_parallel={n} does not cover model.variant={variant!r} (its own per-layer attention mask "
            "is built inside the attention call from the ids it is given, which are one shard's); use another "
            "variant or train.sequence_parallel=1"
        )
    if cfg.model.hf_model and (Path(cfg.model.hf_model) / "config.json").is_file():
        heads, kv, sliding = _heads(cfg.model.hf_model)
        if heads % n or kv % n:
            raise ConfigError(
                f"train.sequence_parallel={n} splits the attention heads of each rank's all-to-all evenly: the text "
                f"decoder of {cfg.model.hf_model} has {heads} attention heads and {kv} KV heads, which {n} must both "
                f"divide; choose a sequence_parallel size that divides {kv}"
            )
        if sliding:
            raise ConfigError(
                f"train.sequence_parallel={n} does not cover sliding-window attention (use_sliding_window=true in "
                f"{cfg.model.hf_model}/config.json); set it false or train.sequence_parallel=1"
            )


def check_world(n: int, world: int) -> None:
    """Refuse a world size that ``n`` does not divide (before the model loads).

    Raises:
        ConfigError: naming both numbers and the data-parallel sizes that would fit.
    """
    if world % n:
        raise ConfigError(
            f"train.sequence_parallel={n} must divide the number of processes ({world}): every group of {n} ranks "
            f"shares one sample; launch a multiple of {n} processes or choose a divisor of {world}"
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (``N`` equal chunks) of a group; its gradient is the same exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous like x (empty_like keeps the strides of a permuted view)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: Tensor, group, n: int) -> Tensor:
    """``(B, H, S / n, D)`` sequence shards -> ``(B, H / n, S, D)`` head shards (rank ``j`` keeps heads ``j H / n``
    to ``(j + 1) H / n - 1`` of every shard, in shard order)."""
    B, H, s, D = x.shape
    x = x.reshape(B, n, H // n, s, D).permute(1, 0, 2, 3, 4)  # (n, B, H / n, s, D): chunk j goes to rank j
    x = _AllToAll.apply(x.contiguous(), group)  # (n, B, H / n, s, D): chunk i is sequence shard i
    return x.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * s, D)


def heads_to_seq(x: Tensor, group, n: int) -> Tensor:
    """``(B, S, H / n, D)`` head shards (the attention output layout) -> ``(B, S / n, H, D)`` sequence shards."""
    B, S, h, D = x.shape
    x = x.reshape(B, n, S // n, h, D).permute(1, 0, 2, 3, 4)  # (n, B, S / n, h, D): shard i goes to rank i
    x = _AllToAll.apply(x.contiguous(), group)  # (n, B, S / n, h, D): chunk j holds heads of rank j
    return x.permute(1, 2, 0, 3, 4).reshape(B, S // n, n * h, D)


def _base_attention(base: str, module: nn.Module):
    if base == "eager":  # the modeling file's own eager attention (repeat_kv, softmax in fp32)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def ulysses_attention(base: str):
    """The attention function ``vlpe_ulysses_<base>``.

    With the ``vlpe_sp`` keyword (a :class:`SequenceParallel` whose forward is running) it exchanges sequence shards
    for head shards, runs ``base`` on the whole sequence with the group's whole-row mask (the mask the text model
    hands in, built for the shard, is not used) and exchanges back; without it (validation, generation) it is
    ``base`` itself.
    """

    def attention(module, query, key, value, attention_mask, **kwargs):
        sp = kwargs.pop("vlpe_sp", None)
        impl = _base_attention(base, module)
        if sp is None:
            return impl(module, query, key, value, attention_mask, **kwargs)
        kwargs.pop("position_ids", None)  # the shard's text row; the whole-row mask below replaces it
        n, group = sp.size, sp.group
        q, k, v = (seq_to_heads(t, group, n) for t in (query, key, value))  # (B, H / n, S, D)
        out, _ = impl(module, q, k, v, sp.mask, **kwargs)  # (B, S, H / n, D)
        return heads_to_seq(out, group, n), None  # (B, S / n, H, D)

    attention.__name__ = attention.__qualname__ = f"{PREFIX}{base}_attention"
    return attention


class SequenceParallel:
    """One rank's place in its sequence-parallel group and the state of the running forward.

    Args:
        size: ranks per group (``train.sequence_parallel``).
        group: the process group of this rank's group, or None (one process: ``size`` must be 1).
        rank: this rank's index in its group.
    """

    def __init__(self, *, size: int, group, rank: int) -> None:
        self.size, self.group, self.rank = int(size), group, int(rank)
        self.mask: Tensor | None = None  # the whole padded row's attention mask of the running forward
        self.pad = 0  # slots appended to the running forward's rows
        self._armed = False

    @classmethod
    def create(cls, size: int) -> "SequenceParallel":
        """Groups of ``size`` consecutive ranks (every rank creates every group, as ``new_group`` needs).

        Raises:
            ConfigError: ``size`` does not divide the world size.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_world(size, world)
        me = dist.get_rank() if dist.is_initialized() else 0
        mine = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            g = dist.new_group(ranks) if size > 1 else None
            if me in ranks:
                mine = g
        return cls(size=size, group=mine, rank=me % size)

    def install(self, model: nn.Module) -> None:
        """Register the wrapper, switch the text decoder to it, and add the sharding hook to the text model (after
        the vlpe patch's hook, which must be installed first).

        Raises:
            ConfigError: the text decoder runs an implementation :data:`COVERED` does not name.
        """
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        text = model.model.language_model
        base = text.config._attn_implementation
        if base not in COVERED:
            raise ConfigError(f"train.sequence_parallel={self.size} covers {list(COVERED)} attention, the text "
                              f"decoder runs {base!r}; set model.attn_implementation=sdpa")  # fmt: skip
        masks = {"sdpa": sdpa_mask, "eager": eager_mask}
        AttentionInterface.register(PREFIX + base, ulysses_attention(base))
        AttentionMaskInterface.register(PREFIX + base, masks[base])
        model.set_attn_implementation({"text_config": PREFIX + base})
        text.register_forward_pre_hook(self.shard_hook, with_kwargs=True)

    @contextmanager
    def armed(self) -> Iterator["SequenceParallel"]:
        """Shard the text model's inputs inside this block (one forward of the group's batch)."""
        self._armed, self.mask, self.pad = True, None, 0
        try:
            yield self
        finally:
            self._armed = False

    def span(self, length: int) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of a row of ``length`` slots (a multiple of ``size``)."""
        s = length // self.size
        return self.rank * s, (self.rank + 1) * s

    def shard_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of the text model: pad, build the whole-row mask, keep this rank's shard (see the module
        docstring)."""
        if not self._armed:
            return None
        from transformers.masking_utils import create_causal_mask

        embeds, pos = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
        if embeds is None or not isinstance(pos, Tensor) or pos.dim() != 3:
            raise ValueError("sequence parallelism needs the text model's inputs_embeds and the patched model's "
                             "(1 + rows, B, S) position ids")  # fmt: skip
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() != 2:
            mask = None  # a block-diagonal mask of the patch: rebuilt below from the (padded) text row
        B, S, _ = embeds.shape
        pad = (-S) % self.size
        if pad:  # after every real token: causality keeps it out of their attention; its labels are ignored
            embeds = F.pad(embeds, (0, 0, 0, pad))  # (B, S', C)
            pos = F.pad(pos, (0, pad))  # (R, B, S')
            step = torch.arange(1, pad + 1, device=pos.device, dtype=pos.dtype)
            pos[0, :, S:] = pos[0, :, S - 1 : S] + step  # the text row goes on: no new segment, no dense mask
            mask = None if mask is None else F.pad(mask, (0, pad), value=1)
        text_row = pos[0].long() if mask is None else None  # packed rows: segments from the text row
        full = create_causal_mask(config=module.config, inputs_embeds=embeds, attention_mask=mask, cache=None,
                                  position_ids=text_row)  # fmt: skip
        self.mask, self.pad = full, pad  # (B, 1, S', S') or None (plain causal)
        lo, hi = self.span(S + pad)
        out = dict(kwargs)
        out["inputs_embeds"] = embeds[:, lo:hi]  # (B, S' / N, C)
        out["position_ids"] = pos[..., lo:hi]  # (R, B, S' / N)
        out["attention_mask"] = full  # 4D, kept as it is by the text model, or None (the wrapper reads self.mask)
        out["vlpe_sp"] = self
        seen = kwargs.get("visual_pos_masks")
        if seen is not None:  # Qwen3-VL's deepstack: the shard's visual tokens and their features
            seen = F.pad(seen.bool(), (0, pad))  # (B, S')
            index = (seen.reshape(-1).long().cumsum(0) - 1).view(B, -1)  # (B, S') feature row of a visual token
            keep = index[:, lo:hi][seen[:, lo:hi]]  # (n_shard,)
            out["visual_pos_masks"] = seen[:, lo:hi]
            deep = kwargs.get("deepstack_visual_embeds")
            if deep is not None:
                out["deepstack_visual_embeds"] = [d[keep] for d in deep]
        return args, out


class SequenceParallelLM(nn.Module):
    """The module DeepSpeed trains under sequence parallelism: :class:`train.finetune.CausalLM`'s outputs for a
    group's batch, each rank computing its shard (its parameters are the model's, named as under ``CausalLM``).

    ``loss``: its value is the group's whole loss (the shards' summed cross-entropy over the batch's label count,
    all-reduced over the group), its gradient ``N`` times this shard's part: DeepSpeed averages gradients over all
    ``N x D`` ranks, so the averaged gradient is the mean over the ``D`` groups of each group's whole gradient, as in
    data parallelism over the same batches. ``correct`` / ``scored`` count every sample once per group (on the
    group's rank 0). In eval mode it is ``CausalLM`` on whole rows.

    Args:
        lm: the :class:`train.finetune.CausalLM` of the patched model, whose model is installed with ``sp``
            (:meth:`SequenceParallel.install`); it runs the eval-mode forward.
        sp: this rank's :class:`SequenceParallel`.
    """

    def __init__(self, *, lm: nn.Module, sp: SequenceParallel) -> None:
        super().__init__()
        self.model = lm.model
        self.__dict__["whole"] = lm  # outside the module tree: its parameters are self.model's
        self.sp = sp

    def no_weight_decay(self) -> set[str]:
        return self.whole.no_weight_decay()

    def forward(self, batch: dict) -> dict[str, Tensor]:
        from data.hf_batch import IGNORE_INDEX, MODEL_KEYS

        if not self.training:
            return self.whole(batch)
        sp = self.sp
        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
        inputs.setdefault("use_cache", False)
        with sp.armed():
            hidden = self.model.model(**inputs).last_hidden_state  # (B, S' / N, C)
        labels = batch["labels"]  # (B, S)
        lo, hi = sp.span(labels.shape[1] + sp.pad)
        target = F.pad(labels[:, 1:], (0, 1 + sp.pad), value=IGNORE_INDEX)[:, lo:hi]  # (B, S' / N): shifted first
        where = target != IGNORE_INDEX
        logits = self.model.lm_head(hidden[where]).float()  # (n, V)
        gold = target[where]
        part = F.cross_entropy(logits, gold, reduction="sum") / batch["num_labels"].clamp_min(1)
        with torch.no_grad():
            whole = part.detach().clone()
            dist.all_reduce(whole, group=sp.group)
            seg, n = self.whole._segments(batch, labels[:, 1:] != IGNORE_INDEX)  # (B, S - 1) on the whole row
            seg = F.pad(seg, (0, 1 + sp.pad))[:, lo:hi]  # (B, S' / N)
            wrong = (logits.argmax(-1) != gold).long()
            counts = torch.zeros(2, n, dtype=torch.long, device=where.device)  # wrong, scored tokens per sample
            counts[0].index_add_(0, seg[where], wrong)
            counts[1].index_add_(0, seg[where], torch.ones_like(wrong))
            dist.all_reduce(counts, group=sp.group)
            has = (counts[1] > 0) & (sp.rank == 0)
        loss = part * sp.size + (whole - part.detach() * sp.size)  # value: the group's loss; gradient: N x part
        return {"loss": loss, "correct": (has & (counts[0] == 0)).sum(), "scored": has.sum()}


def wrap(lm: nn.Module, size: int) -> nn.Module:
    """The module DeepSpeed trains for ``train.sequence_parallel=size``: ``lm`` (a :class:`train.finetune.CausalLM`)
    when 1, else a :class:`SequenceParallelLM` whose groups are created and whose wrapper is installed on
    ``lm.model``."""
    if size == 1:
        return lm
    sp = SequenceParallel.create(size)
    sp.install(lm.model)
    return SequenceParallelLM(lm=lm, sp=sp)
