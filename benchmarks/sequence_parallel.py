"""Peak memory per rank and time per step of sequence parallelism N=1 vs N=2 on the same long video sample, 2 CPU ranks.

    python benchmarks/sequence_parallel.py [--frames 64] [--side 336x224] [--layers 4] [--hidden 512] [--steps 3]

The sample: one user turn with a ``--frames``-frame video (``--side`` pixels a frame: 64 frames at 336x224 are
32 temporal patches of 12 x 8 merged tokens, 3072 video tokens) and a supervised answer, through a tiny random
Qwen2-VL (:mod:`models.tiny_qwen_vl`) whose decoder is widened to ``--hidden`` (8 heads, 4 KV heads, ``--layers``
layers), under vlpe's ``videorope``, sdpa, fp32, one SGD step per step. Each setting is one 2-rank launch
(``torch.distributed.run``, gloo):

* N=1: every rank trains on the whole sample (:class:`train.finetune.CausalLM`; data parallelism, no exchange);
* N=2: the two ranks share the sample (:class:`train.sequence_parallel.SequenceParallelLM`).

Memory: each rank samples its resident set (``/proc/self/statm``) every millisecond in a thread during a step,
after returning freed heap to the system (``malloc_trim``); the step's peak above the resident set before it is
the step's working memory (activations, gradients, the exchange buffers), reported with the absolute peak. Time:
the median step after one warm-up step. The machine's other load makes times noisy; memory is not. Prints both
settings and the ratios N=2 / N=1; writes outputs/bench/sequence_parallel.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """The largest resident set seen while the block runs (sampled every millisecond)."""

    def __enter__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def make_folder(work: Path, *, hidden: int, layers: int) -> Path:
    """A tiny Qwen2-VL folder with its decoder widened to ``hidden`` (same processor and vision tower)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from models.tiny_qwen_vl import save_tiny_qwen_vl

    base = save_tiny_qwen_vl("qwen2_vl", work / "base", texts=["answer is cat"])
    cfg = AutoConfig.from_pretrained(base, local_files_only=True)
    t = cfg.text_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = hidden, 3 * hidden, layers
    if getattr(t, "layer_types", None):
        t.layer_types = [t.layer_types[0]] * layers
    t.num_attention_heads, t.num_key_value_heads = 8, 4
    if getattr(t, "head_dim", None):
        t.head_dim = hidden // 8
    pairs = hidden // 8 // 2
    t.rope_parameters = {**t.rope_parameters, "mrope_section": [pairs - 2 * (3 * pairs // 8), 3 * pairs // 8,
                                                                3 * pairs // 8]}  # fmt: skip
    cfg.vision_config.hidden_size = hidden  # the merger's output width
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    out = work / "wide"
    model.save_pretrained(out)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def sample(processor, *, frames: int, height: int, width: int, answer: int = 32) -> dict:
    """One processed item: text, a ``frames``-frame video of ``height x width`` (random pixels), an answer of
    ``answer`` supervised tokens."""
    tok = processor.tokenizer
    t, h, w = frames // 2, height // 14, width // 14
    n = t * h * w // 4  # merged video tokens
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    start, end, pad = (tok.convert_tokens_to_ids(x) for x in ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>"))
    prompt = ids("answer is") + [start] + [pad] * n + [end] + ids("answer is")
    reply = (ids("cat") * answer)[:answer]
    input_ids = torch.tensor(prompt + reply)
    types = torch.zeros_like(input_ids)
    types[len(ids("answer is")) + 1 : len(ids("answer is")) + 1 + n] = 2
    labels = torch.full_like(input_ids, -100)
    labels[len(prompt):] = input_ids[len(prompt):]
    g = torch.Generator().manual_seed(0)
    return {"input_ids": input_ids, "mm_token_type_ids": types, "labels": labels,
            "pixel_values_videos": torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g),
            "video_grid_thw": torch.tensor([[t, h, w]])}  # fmt: skip


def worker(args) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from data.hf_batch import InstructCollator
    from train.finetune import CausalLM
    from train.sequence_parallel import SequenceParallel, SequenceParallelLM
    from vlpe.integrations import transformers as vlpe_hf

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    folder = Path(args.folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                        attn_implementation="sdpa")  # fmt: skip
    model.config.use_cache = False
    vlpe_hf.apply(model, "videorope")
    patch = vlpe_hf.patch_of(model)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    height, width = (int(x) for x in args.side.split("x"))
    item = sample(processor, frames=args.frames, height=height, width=width)
    collate = InstructCollator(variant=patch.variant, family="qwen2_vl", spatial_merge_size=2,
                               pad_token_id=processor.tokenizer.pad_token_id)  # fmt: skip
    batch = collate([item])
    if args.sp > 1:
        sp = SequenceParallel.create(args.sp)
        sp.install(model)
        module = SequenceParallelLM(lm=CausalLM(model=model), sp=sp).train()
    else:
        module = CausalLM(model=model).train()
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    libc = ctypes.CDLL("libc.so.6")
    times, work, peaks = [], [], []
    for step in range(args.steps + 1):
        libc.malloc_trim(0)
        dist.barrier()
        before = rss()
        t0 = time.perf_counter()
        with Peak() as peak:
            out = module(batch)
            out["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        dt = time.perf_counter() - t0
        dist.barrier()
        if step:  # the first step warms up
            times.append(dt)
            work.append(peak.peak - before)
            peaks.append(peak.peak)
    rec = {"sp": args.sp, "rank": dist.get_rank(), "tokens": int(batch["input_ids"].shape[1]),
           "step_s": sorted(times)[len(times) // 2], "step_working_bytes": max(work),
           "peak_rss_bytes": max(peaks)}  # fmt: skip
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rec)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def launch(folder: Path, sp: int, args, out: Path) -> list[dict]:
    from train.launch import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           __file__, "--worker", "--sp", str(sp), "--folder", str(folder), "--out", str(out), "--frames",
           str(args.frames), "--side", args.side, "--steps", str(args.steps)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--side", default="336x224", help="HEIGHTxWIDTH of a frame (multiples of 28)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--out", default="outputs/bench/sequence_parallel.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), hidden=args.hidden, layers=args.layers)
        runs = {sp: launch(folder, sp, args, Path(tmp) / f"sp{sp}.json") for sp in (1, 2)}
    mib = 1 << 20
    print(f"{runs[1][0]['tokens']} tokens ({args.frames} frames of {args.side}), decoder {args.layers} x "
          f"{args.hidden}, 2 CPU ranks")
    print(f"{'N':>2} {'rank':>4} {'step s':>8} {'step working MiB':>17} {'peak RSS MiB':>13}")
    for sp, recs in runs.items():
        for r in recs:
            print(f"{sp:>2} {r['rank']:>4} {r['step_s']:>8.2f} {r['step_working_bytes'] / mib:>17.0f} "
                  f"{r['peak_rss_bytes'] / mib:>13.0f}")  # fmt: skip
    worst = {sp: {k: max(r[k] for r in recs) for k in ("step_s", "step_working_bytes", "peak_rss_bytes")}
             for sp, recs in runs.items()}  # fmt: skip
    ratios = {k: worst[2][k] / worst[1][k] for k in worst[1]}
    print("ratios N=2 / N=1 (worst rank): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
