"""Sequence parallelism against whole rows, over the grid of families x variants x packing, in one 2-rank launch:
``python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_grid.py WORKDIR OUT.json [--plant X,Y]``
(run by tests/test_sequence_parallel.py).

Every rank loads each configuration twice from the same tiny folder: a reference (:class:`train.finetune.CausalLM`
on whole rows, no communication) and the sequence-parallel model (:func:`train.sequence_parallel.wrap`, both ranks
one group). Both take the same batches of real mp4 / PNG samples and the same SGD steps; per step the group's loss
and the reference loss are recorded, and after step 1 the largest gradient difference (the group's gradients summed
and averaged over the 2 ranks, as DeepSpeed's data-parallel reduction does, against the reference's). Rank 0 writes
the results. ``--plant`` runs a deliberate bug (ids sharded along the batch dim, labels not shifted) to
show the comparison catches it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


VARIANTS = ("mrope", "mrope_i", "videorope", "hope_video", "v2pe", "vrope", "mhrope")
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
STEPS = 3


def folders(work: Path) -> dict[str, Path]:
    from data.vniah import PHOTO_NEEDLES, QUESTIONS
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    out = {f: work / f"tiny-{f}" for f in FAMILIES}
    if dist.get_rank() == 0:
        for f, p in out.items():
            if not (p / "config.json").is_file():
                save_tiny_qwen_vl(f, p, texts=[QUESTIONS["needle"], *PHOTO_NEEDLES.values()], frame=28, max_frame=56,
                                  layers=2)  # fmt: skip
    dist.barrier()
    return out


def dataset(work: Path) -> dict:
    from data.instruct import make_vniah_instruct

    path = work / "set"
    if dist.get_rank() == 0 and not (path / "done").is_file():
        made = make_vniah_instruct(path, train=12, val=1, frames=8, frame_size=56, image_every=3)
        (path / "done").write_text(json.dumps(made))
    dist.barrier()
    return json.loads((path / "done").read_text())


def load(folder: Path, variant: str, attn: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlpe.integrations import transformers as vlpe_hf

    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                        attn_implementation=attn)  # fmt: skip
    model.config.use_cache = False
    vlpe_hf.apply(model, variant)
    return model, AutoProcessor.from_pretrained(folder, local_files_only=True)


def batches(family: str, folder: Path, data: dict, processor, model, packing: bool) -> list[dict]:
    """STEPS batches of 3 samples each; the first one :func:`fits`."""
    from data.hf_batch import InstructCollator
    from data.instruct import InstructDataset
    from train.finetune import filler_item

    from vlpe.integrations.transformers import patch_of

    patch = patch_of(model)
    ds = InstructDataset(annotations=data["train"], media_root=data["media_root"], processor=processor, family=family,
                         max_frames=8)  # fmt: skip
    collate = InstructCollator(variant=patch.variant, family=family, spatial_merge_size=patch.spatial_merge_size,
                               pad_token_id=processor.tokenizer.pad_token_id, packing=packing,
                               filler=filler_item(processor))  # fmt: skip
    items = [ds[i] for i in range(len(ds))]
    # the first batch: a row of odd length (padded for the 2 shards) whose video block straddles the shard boundary
    first = next(c for c in itertools.combinations(range(len(items)), 3) if fits(collate([items[k] for k in c])))
    rest = [k for k in range(len(items)) if k not in first]
    return [collate([items[k] for k in first])] + [collate([items[k] for k in rest[3 * j : 3 * j + 3]])
                                                  for j in range(STEPS - 1)]  # fmt: skip


def straddles(batch: dict) -> bool:
    """Whether the video of one sample has tokens on both sides of the 2-rank shard boundary (its last video token
    before the boundary and its first one after it belong to the same sample; every sample here has at most one
    video, on Qwen3-VL a run of frame blocks with timestamps between them)."""
    types = batch["mm_token_type_ids"]  # (B, S)
    B, S = types.shape
    half = (S + 1) // 2
    if "cu_seqlens" in batch:  # (B, S) packed sample of every slot
        flat = torch.arange(B * S).view(B, S)
        seg = torch.searchsorted(batch["cu_seqlens"].long(), flat, right=True) - 1
    else:
        seg = torch.arange(B)[:, None].expand(B, S)
    for r in range(B):
        before = (types[r, :half] == 2).nonzero().flatten()
        after = (types[r, half:] == 2).nonzero().flatten() + half
        if len(before) and len(after) and seg[r, before[-1]] == seg[r, after[0]]:
            return True
    return False


def fits(batch: dict) -> bool:
    return straddles(batch) and batch["input_ids"].shape[1] % 2 == 1


def plant(kind: str):
    """Install a deliberate bug; returns what undoes it."""
    from train import sequence_parallel as spm

    if kind == "ids_batch_dim":  # the (R, B, S) ids read as (R, S, B): the sequence shard is cut along the wrong dim
        hook = spm.SequenceParallel.shard_hook

        def wrong(self, module, args, kwargs):
            a, kw = hook(self, module, args, kwargs)
            pos = torch.nn.functional.pad(kwargs["position_ids"], (0, self.pad))  # (R, B, S')
            R, B, S = pos.shape
            lo, hi = self.span(S)
            kw["position_ids"] = pos.reshape(R, S, B)[:, lo:hi].reshape(R, B, hi - lo)
            return a, kw

        spm.SequenceParallel.shard_hook = wrong
        return lambda: setattr(spm.SequenceParallel, "shard_hook", hook)
    if kind == "labels_unshifted":  # every shard position scored against its own token, not the next one
        real = spm.SequenceParallelLM.forward

        def forward(self, batch):
            labels = batch["labels"]
            fake = torch.full_like(labels, -100)
            fake[:, 1:] = labels[:, :-1]  # the forward's shift then gives every position its own label
            return real(self, {**batch, "labels": fake})

        spm.SequenceParallelLM.forward = forward
        return lambda: setattr(spm.SequenceParallelLM, "forward", real)
    raise ValueError(kind)


def run_one(family, folder, data, variant, packing, attn="sdpa", lora=False, sp=None) -> dict:
    from train.finetune import CausalLM
    from train.sequence_parallel import SequenceParallelLM

    ref_model, processor = load(folder, variant, attn)
    par_model, _ = load(folder, variant, attn)
    if lora:
        from types import SimpleNamespace

        from train.finetune import _lora

        torch.manual_seed(1)
        spec = SimpleNamespace(r=4, alpha=8, dropout=0.0, use_dora=False, target_modules=["q_proj", "v_proj"])
        ref_model = _lora(ref_model, spec)
        torch.manual_seed(1)
        par_model = _lora(par_model, spec)
    sp.install(par_model)
    ref, par = CausalLM(model=ref_model).train(), SequenceParallelLM(lm=CausalLM(model=par_model), sp=sp).train()
    params = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    pparams = dict(par.named_parameters())
    opt_r = torch.optim.SGD([p for _, p in params], lr=0.05)
    opt_p = torch.optim.SGD([pparams[n] for n, _ in params], lr=0.05)
    rec = {"family": family, "variant": variant, "packing": packing, "attn": attn, "lora": lora, "losses": [],
           "straddles": False, "odd": False}  # fmt: skip
    for step, batch in enumerate(batches(family, folder, data, processor, ref_model, packing)):
        rec["straddles"] |= straddles(batch)
        rec["odd"] |= bool(batch["input_ids"].shape[1] % 2)
        a = ref(batch)
        b = par(batch)
        a["loss"].backward()
        b["loss"].backward()
        for _, p in params:
            g = pparams[_].grad
            dist.all_reduce(g)
            g /= dist.get_world_size()
        if step == 0:
            diff = max(float((p.grad - pparams[n].grad).abs().max()) for n, p in params)
            scale = max(float(p.grad.abs().max()) for _, p in params)
            rec["grad_diff"], rec["grad_scale"] = diff, scale
            rec["correct"] = [int(a["correct"]), int(b["correct"]) if sp.rank == 0 else None]
        rec["losses"].append([float(a["loss"].detach()), float(b["loss"].detach())])
        opt_r.step(), opt_p.step()
        opt_r.zero_grad(), opt_p.zero_grad()
    return rec


def main() -> None:
    from train.sequence_parallel import SequenceParallel

    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    kinds = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[3] == "--plant" else []
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    paths, data = folders(work), dataset(work)
    sp = SequenceParallel.create(dist.get_world_size())
    results = []
    if kinds:  # one unpacked (two rows) configuration per planted bug
        for kind in kinds:
            undo = plant(kind)
            results.append({**run_one("qwen2_vl", paths["qwen2_vl"], data, "mrope", False, sp=sp), "plant": kind})
            undo()
    else:
        grid = [(f, v, p) for f in FAMILIES for v in VARIANTS for p in (False, True)]
        results = [run_one(f, paths[f], data, v, p, sp=sp) for f, v, p in grid]
        results.append(run_one("qwen2_vl", paths["qwen2_vl"], data, "mrope", False, attn="eager", sp=sp))
        results.append(run_one("qwen2_5_vl", paths["qwen2_5_vl"], data, "videorope", True, lora=True, sp=sp))
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
