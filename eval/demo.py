"""The main job (``make demo``): train, then test beyond the training distribution, on embedded real data.

    python eval/demo.py                      # a few minutes on 2 idle cores; a second run reuses the finished runs
    python eval/demo.py --fresh              # train and evaluate again
    python eval/demo.py --vit rope pape      # other ViT encodings (configs/vit_<name>.yaml)

What it does, with progress bars throughout:

1. trains two ViTs on Fashion-MNIST at the base resolution (28 px, ``configs/vit_rope.yaml`` and
   ``configs/vit_lookhere.yaml`` by default: LookHere's headline claim is extrapolation beyond 2D RoPE) with the
   benchmark's ViT protocol (:data:`protocols.VIT`: the same model, batch and learning rate) for fewer steps, the
   two runs side by side, one core each;
2. trains the small VLM of ``configs/mrope_i.yaml`` (MRoPE-Interleave decoder) with the benchmark's V-NIAH
   protocol (:data:`protocols.VLM`, 8 frames, photo needles) for fewer steps, launched with ``deepspeed`` (one CPU
   rank here, gloo; the first launch on a machine compiles DeepSpeed's shared-memory communication op, about
   90 s, cached afterwards);
3. evaluates the ViTs with the same weights at up to 4.57x the training resolution (``eval/resolution.py``, the
   LookHere ratios) and the VLM on V-NIAH and V-NIAH-D up to 32x its training length (``eval/long_video.py``),
   printing the tables and saving the plots;
4. fine-tunes a pretrained Hugging Face Qwen2-VL folder under another position encoding, the workflow of the
   VLM position papers (``train/vlm.py --config configs/hf/qwen2_vl.yaml model.hf_model=DIR``): a tiny random
   Qwen2-VL saved with a real processor and chat template (:mod:`models.tiny_qwen_vl`) stands in for the
   downloaded checkpoint, trained with MRoPE-I on a LLaVA-format set of V-NIAH needle videos written as real mp4
   files (:func:`data.instruct.make_vniah_instruct`), on 2 CPU ranks at ZeRO-2; the held-out exact match is read
   from the run's validation records, and the exported folder (stock-loadable, its variant in ``config.json``) is
   evaluated on V-NIAH by ``eval/long_video.py --hf-model`` under its recorded variant;
5. runs the encoding property table and attention plots (``eval/properties.py``).

Everything goes to ``--out`` (default ``outputs/demo``): ``runs/`` (the trained runs), ``resolution/``
(``resolution.md/.json/.png``), ``long_video/`` (``long_video.md/.json``, ``heatmap_<run>.png``),
``finetune/`` (the set, the tiny folder, the run and its ``hf/`` export, ``long_video/``), ``properties/`` and
``timing.json``. The job is resumable: a run whose ``model.safetensors`` exists (with the
requested steps) is reused, an evaluation whose output exists with the same runs and settings is reused;
``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["main", "train_vits", "train_vlm", "finetune_hf", "run_finished"]

DIST_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    for k in DIST_VARS:
        env.pop(k, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_finished(run_dir: Path, args: Sequence[str]) -> bool:
    """True when ``run_dir`` holds the export of a finished run started with the training arguments ``args``."""
    stamp = run_dir / "demo_args.json"
    return (run_dir / "model.safetensors").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == list(args)


def _mark_finished(run_dir: Path, args: Sequence[str]) -> None:
    (run_dir / "demo_args.json").write_text(json.dumps(list(args)) + "\n")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the export is what the demo uses


def _steps_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(x).get("step", 0) for x in lines if x.strip()), default=0)


def _clean(run_dir: Path) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)


def train_vits(encodings: Sequence[str], *, steps: int, runs: Path, overrides: Sequence[str], fresh: bool,
               progress: bool = True) -> dict[str, Path]:  # fmt: skip
    """Train ``configs/vit_<enc>.yaml`` for each encoding, side by side (one thread each); returns the run dirs."""
    from tqdm import tqdm

    out: dict[str, Path] = {}
    procs: list[tuple[str, Path, subprocess.Popen, Any, Any]] = []
    finished_args: dict[Path, list[str]] = {}
    cores = os.cpu_count() or 1
    todo = []
    for enc in encodings:
        config = ROOT / "configs" / f"vit_{enc}.yaml"
        if not config.is_file():
            known = sorted(p.stem[4:] for p in (ROOT / "configs").glob("vit_*.yaml"))
            raise ValueError(f"no ViT config for encoding {enc!r} (configs/vit_{enc}.yaml); known: {known}")
        run = runs / f"vit_{enc}"
        out[enc] = run
        args = [str(ROOT / "train" / "vit.py"), "--config", str(config), f"train.steps={steps}",
                f"train.out_dir={run}", "train.progress=false", f"train.log_every={max(1, min(5, steps))}",
                "train.resume=none", *overrides]  # fmt: skip
        if fresh or not run_finished(run, args):
            _clean(run)
            todo.append((enc, run, args))
        else:
            print(f"[demo] reusing {run} (trained {steps} steps)", flush=True)
    threads = max(1, cores // max(1, len(todo)))
    for i, (enc, run, args) in enumerate(todo):
        cmd = [sys.executable, *args]
        run.mkdir(parents=True, exist_ok=True)
        log = (run / "train.log").open("w")
        finished_args[run] = args
        bar = tqdm(total=steps, desc=f"train vit_{enc}", position=i, disable=not progress, dynamic_ncols=True)
        procs.append((enc, run, subprocess.Popen(cmd, cwd=ROOT, env=_env(threads), stdout=log,
                                                 stderr=subprocess.STDOUT), log, bar))  # fmt: skip
    while procs:
        for enc, run, proc, log, bar in list(procs):
            bar.update(max(0, _steps_done(run) - bar.n))
            if proc.poll() is not None:
                log.close()
                bar.close()
                procs.remove((enc, run, proc, log, bar))
                if proc.returncode != 0 or not (run / "model.safetensors").is_file():
                    for _, _, other, olog, obar in procs:
                        other.terminate()
                        olog.close()
                        obar.close()
                    tail = (run / "train.log").read_text()[-3000:]
                    raise RuntimeError(f"training vit_{enc} failed (exit {proc.returncode}); {run / 'train.log'}:\n"
                                       f"{tail}")  # fmt: skip
                _mark_finished(run, finished_args[run])
        time.sleep(1.0)
    return out


def train_vlm(*, config: Path, steps: int, runs: Path, overrides: Sequence[str], fresh: bool, launcher: str,
              threads: int) -> Path:  # fmt: skip
    """Train the VLM of ``config`` under the DeepSpeed launcher (one CPU rank here; its tqdm bar is shown)."""
    run = runs / f"vlm_{config.stem}"
    args = [str(ROOT / "train" / "vlm.py"), "--config", str(config), f"train.steps={steps}", f"train.out_dir={run}",
            "train.resume=none", *overrides]  # fmt: skip
    if not fresh and run_finished(run, args):
        print(f"[demo] reusing {run} (trained {steps} steps)", flush=True)
        return run
    _clean(run)
    if launcher == "deepspeed":
        ds = Path(sys.executable).with_name("deepspeed")
        if not ds.is_file():
            raise RuntimeError(f"{ds} not found: DeepSpeed is not installed in this environment (run `make setup`) "
                               "or use --launcher python")  # fmt: skip
        cmd = [str(ds), "--master_port", str(_free_port()), *args]  # one rank per GPU, or one CPU process
    else:
        cmd = [sys.executable, *args]
    print(f"[demo] {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads))
    if proc.returncode != 0 or not (run / "model.safetensors").is_file():
        raise RuntimeError(f"training the VLM failed (exit {proc.returncode}); see the output above")
    _mark_finished(run, args)
    return run


def finetune_hf(*, out: Path, steps: int, variant: str, fresh: bool, threads: int, ranks: int = 2,
                samples: int = 768) -> dict:
    """Fine-tune a tiny Qwen2-VL folder on made mp4 files (step 4 of the module docstring); returns the run's
    folders and its validation records. A run whose ``hf/`` export exists with the same arguments is reused."""
    from data.instruct import make_vniah_instruct
    from data.vniah import PHOTO_NEEDLES, QUESTIONS
    from models.tiny_qwen_vl import save_tiny_qwen_vl

    data_dir, folder, run = out / "data", out / "tiny-qwen2-vl", out / "run"
    if fresh:
        for p in (data_dir, folder, run):
            _clean(p)
    made = data_dir / "made.json"  # the set's arguments: another size makes it again
    wanted = {"train": samples, "val": max(1, min(64, samples // 4))}
    if not made.is_file() or json.loads(made.read_text()) != wanted:
        _clean(data_dir)
        make_vniah_instruct(data_dir, **wanted, frames=8, frame_size=56, fps=2.0, seed=0)
        made.write_text(json.dumps(wanted))
    if not (folder / "config.json").is_file():
        save_tiny_qwen_vl("qwen2_vl", folder, texts=[QUESTIONS["needle"], *PHOTO_NEEDLES.values()], frame=28,
                          max_frame=56, layers=2, vision_width=64, vision_depth=2)  # fmt: skip
    args = [str(ROOT / "train" / "vlm.py"), "--config", str(ROOT / "configs" / "hf" / "qwen2_vl.yaml"),
            f"model.hf_model={folder}", f"model.variant={variant}", f"data.annotations={data_dir / 'train.json'}",
            f"data.val_annotations={data_dir / 'val.json'}", f"data.media_root={data_dir / 'media'}",
            "data.max_frames=8", "train.zero_stage=2", f"train.steps={steps}", "train.micro_batch=4",
            "train.grad_accum=1", "train.lr=2e-3", "train.warmup_steps=20", "train.freeze=[]",
            "train.gradient_checkpointing=false", f"train.val_every={max(1, steps // 4)}", "train.val_batches=8",
            f"train.ckpt_every={steps}", "train.log_every=10", "train.num_workers=0", "train.progress=false",
            f"train.out_dir={run}", "train.resume=none"]  # fmt: skip
    stamp = run / "demo_args.json"
    if fresh or not ((run / "hf" / "config.json").is_file() and stamp.is_file()
                     and json.loads(stamp.read_text()) == args):  # fmt: skip
        _clean(run)
        ds = Path(sys.executable).with_name("deepspeed")
        cmd = [str(ds), "--num_gpus", str(ranks), "--master_port", str(_free_port()), *args] if ranks > 1 else \
            [sys.executable, *args]  # fmt: skip
        print(f"[demo] {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(max(1, threads // max(1, ranks))))
        if proc.returncode != 0 or not (run / "hf" / "config.json").is_file():
            raise RuntimeError(f"fine-tuning the Qwen2-VL folder failed (exit {proc.returncode}); see the output above")
        stamp.write_text(json.dumps(args) + "\n")
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the export is what the demo uses
    else:
        print(f"[demo] reusing {run} (fine-tuned {steps} steps)", flush=True)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"run": run, "export": run / "hf", "records": records}


def _cached(folder: Path, name: str, settings: dict) -> list[dict] | None:
    """The evaluations stored in ``folder/name`` if they were made with ``settings``."""
    s, result = folder / "settings.json", folder / name
    if s.is_file() and result.is_file() and json.loads(s.read_text()) == settings:
        return json.loads(result.read_text())["runs"]
    return None


def _stamp(run: Path) -> list:
    w = run / "model.safetensors"
    return [str(run), w.stat().st_mtime_ns, w.stat().st_size]


def _protocol_overrides(train: Sequence[str], steps_key: str = "train.steps") -> list[str]:
    """A benchmark protocol's training overrides without its step counts (the demo sets its own)."""
    return [o for o in train if not o.startswith((steps_key + "=", "train.warmup_steps=", "train.val_batches="))]


def main(argv: Sequence[str] | None = None) -> int:
    from data.transforms import LOOKHERE_RATIOS
    from protocols import VIT, VLM

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "demo", help="output folder")
    p.add_argument("--vit", nargs="+", default=["rope", "lookhere"], help="ViT encodings (configs/vit_<name>.yaml)")
    p.add_argument("--vit-steps", type=int, default=300, help="ViT training steps (batch 128)")
    p.add_argument("--vlm-config", type=Path, default=ROOT / "configs" / "mrope_i.yaml")
    p.add_argument("--vlm-steps", type=int, default=150, help="VLM training steps (batch 32)")
    p.add_argument("--launcher", choices=["deepspeed", "python"], default="deepspeed", help="how to start the VLM run")
    p.add_argument("--ratios", type=float, nargs="+", default=list(LOOKHERE_RATIOS), help="test/train size ratios")
    p.add_argument("--limit", type=int, default=500, help="validation images per test size")
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256],
                   help="V-NIAH lengths (frames; trained at 8)")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="needle depths (default 0, 0.2, ... 1)")
    p.add_argument("--samples", type=int, default=6, help="needles per V-NIAH cell")
    p.add_argument("--vit-override", nargs="*", default=[], metavar="KEY=VALUE", help="extra ViT config overrides")
    p.add_argument("--vlm-override", nargs="*", default=[], metavar="KEY=VALUE", help="extra VLM config overrides")
    p.add_argument("--no-vlm", action="store_true", help="skip the VLM (training and V-NIAH)")
    p.add_argument("--finetune-steps", type=int, default=300, help="fine-tuning steps of the tiny Qwen2-VL (batch 8)")
    p.add_argument("--finetune-variant", default="mrope_i", help="the variant the Qwen2-VL is fine-tuned with")
    p.add_argument("--finetune-samples", type=int, default=768,
                   help="training samples of the fine-tune (a quarter as many, at most 64, held out)")
    p.add_argument("--no-finetune", action="store_true", help="skip fine-tuning the Qwen2-VL folder")
    p.add_argument("--no-properties", action="store_true", help="skip eval/properties.py")
    p.add_argument("--fresh", action="store_true", help="retrain and re-evaluate everything")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("vit_steps", "vlm_steps", "limit", "samples", "finetune_steps", "finetune_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    import torch

    import long_video
    import resolution

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    out = Path(args.out)
    runs = out / "runs"
    progress = not args.no_progress
    timing: dict[str, float] = {}
    t_start = time.perf_counter()

    def phase(name: str, t0: float) -> None:
        timing[name] = round(time.perf_counter() - t0, 1)
        print(f"[demo] {name}: {timing[name]:.0f} s", flush=True)

    print(f"[demo] 1/5 training ViTs ({', '.join(args.vit)}) on Fashion-MNIST at 28 px, {args.vit_steps} steps",
          flush=True)  # fmt: skip
    t0 = time.perf_counter()
    vit_over = [*_protocol_overrides(VIT.train), f"train.warmup_steps={max(1, args.vit_steps // 20)}",
                "train.val_batches=4", *args.vit_override]  # fmt: skip
    vit_runs = train_vits(args.vit, steps=args.vit_steps, runs=runs, overrides=vit_over, fresh=args.fresh,
                          progress=progress)  # fmt: skip
    phase("train_vit", t0)
    vlm_run = None
    if not args.no_vlm:
        print(f"[demo] 2/5 training the VLM ({args.vlm_config.name}) on V-NIAH, {args.vlm_steps} steps, "
              f"launcher {args.launcher}", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        vlm_over = [*_protocol_overrides(VLM.train), "train.warmup_steps=10", "train.val_batches=2",
                    *args.vlm_override]  # fmt: skip
        vlm_run = train_vlm(config=args.vlm_config, steps=args.vlm_steps, runs=runs, overrides=vlm_over,
                            fresh=args.fresh, launcher=args.launcher, threads=cores)  # fmt: skip
        phase("train_vlm", t0)

    print("[demo] 3/5 evaluating: ViTs at higher resolution, the VLM beyond its training length", flush=True)
    t0 = time.perf_counter()
    folder = out / "resolution"
    settings = {"runs": [_stamp(r) for r in vit_runs.values()], "ratios": args.ratios, "limit": args.limit}
    evals = None if args.fresh else _cached(folder, "resolution.json", settings)
    if evals is None:
        evals = [resolution.evaluate_run(r, args.ratios, limit=args.limit, device="cpu", progress=progress)
                 for r in vit_runs.values()]  # fmt: skip
        resolution.write_report(evals, folder)
        (folder / "settings.json").write_text(json.dumps(settings))
    else:
        print(f"[demo] reusing {folder / 'resolution.json'}", flush=True)
    print("\n" + resolution.markdown(evals))
    phase("eval_resolution", t0)
    lv = None
    if vlm_run is not None:
        t0 = time.perf_counter()
        folder = out / "long_video"
        settings = {"runs": [_stamp(vlm_run)], "lengths": args.lengths, "depths": args.depths,
                    "samples": args.samples}  # fmt: skip
        lv = None if args.fresh else _cached(folder, "long_video.json", settings)
        if lv is None:
            lv = [long_video.evaluate_run(vlm_run, args.lengths, args.depths, samples_per_cell=args.samples,
                                          scorings=["teacher"], device="cpu", progress=progress)]  # fmt: skip
            long_video.write_report(lv, folder)
            (folder / "settings.json").write_text(json.dumps(settings))
        else:
            print(f"[demo] reusing {folder / 'long_video.json'}", flush=True)
        print("\n" + long_video.markdown(lv))
        phase("eval_long_video", t0)

    ft = None
    if not args.no_finetune:
        print(f"[demo] 4/5 fine-tuning a (tiny) Qwen2-VL folder with {args.finetune_variant} on V-NIAH mp4 files, "
              f"{args.finetune_steps} steps, 2 ranks, ZeRO-2", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        ft = finetune_hf(out=out / "finetune", steps=args.finetune_steps, variant=args.finetune_variant,
                         fresh=args.fresh, threads=cores, samples=args.finetune_samples)  # fmt: skip
        phase("finetune", t0)
        t0 = time.perf_counter()
        folder = out / "finetune" / "long_video"
        export = ft["export"]
        settings = {"export": [str(export), (export / "model.safetensors").stat().st_mtime_ns], "lengths": [8, 16, 32]}
        ft["long_video"] = None if args.fresh else _cached(folder, "long_video.json", settings)
        if ft["long_video"] is None:
            import hf_long_video

            ft["long_video"] = [hf_long_video.evaluate_hf(
                export, [8, 16, 32], [0.0, 0.5, 1.0], variant=None, tasks=("v_niah",), samples_per_cell=4,
                haystack="procedural", frame_size=56, fps=2.0, train_frames=8, device="cpu", progress=progress)]
            long_video.write_report(ft["long_video"], folder)
            (folder / "settings.json").write_text(json.dumps(settings))
        else:
            print(f"[demo] reusing {folder / 'long_video.json'}", flush=True)
        print("\n" + long_video.markdown(ft["long_video"]))
        phase("eval_finetune", t0)

    if not args.no_properties:
        print("[demo] 5/5 encoding properties and attention plots (eval/properties.py)", flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, str(ROOT / "eval" / "properties.py"), "--out", str(out / "properties")]
        rc = subprocess.run(cmd, cwd=ROOT, env=_env(cores)).returncode
        phase("properties", t0)
        if rc != 0:
            print("[demo] the property table reported failures (see above)", file=sys.stderr)
            return rc

    timing["total"] = round(time.perf_counter() - t_start, 1)
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print("[demo] summary")
    for ev in evals:
        res = ev["results"]
        top = max(res, key=lambda r: r["ratio"])
        print(f"  ViT {ev['encoding']:>10}: top-1 {100 * res[0]['acc']:.1f}% at {res[0]['size']} px -> "
              f"{100 * top['acc']:.1f}% at {top['size']} px (x{top['ratio']:.3g})")  # fmt: skip
    for ev in lv or []:
        for task, r in ev["tasks"].items():
            t = r["teacher"]
            print(f"  VLM {ev['variant']} {task.replace('_', '-').upper():>8}: {100 * t['in_distribution']:.1f}% "
                  f"up to {ev['train_frames']} frames -> {100 * t['extrapolated']:.1f}% beyond "
                  f"(up to {max(ev['lengths'])} frames)")  # fmt: skip
    if ft is not None:
        val = [r for r in ft["records"] if r["split"] == "val"]
        train = [r["loss"] for r in ft["records"] if r["split"] == "train"]
        if val:
            print(f"  Qwen2-VL fine-tuned with {args.finetune_variant}: train loss {train[0]:.2f} -> {train[-1]:.2f}, "
                  f"held-out exact match {100 * val[-1]['acc']:.1f}% (chance 12.5%) after {val[-1]['step']} steps")
        for ev in ft.get("long_video") or []:
            r = ev["tasks"]["v_niah"]["choice"]
            print(f"  its export ({ev['variant']}, multiple choice): V-NIAH {100 * r['in_distribution']:.1f}% at 8 "
                  f"frames -> {100 * r['extrapolated']:.1f}% at 16-32 frames")  # fmt: skip
    print(f"  plots and tables: {out / 'resolution'}, {out / 'long_video'}, {out / 'finetune'}, {out / 'properties'}")
    print(f"[demo] done in {timing['total'] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
