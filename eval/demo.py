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
4. runs the encoding property table and attention plots (``eval/properties.py``).

Everything goes to ``--out`` (default ``outputs/demo``): ``runs/`` (the trained runs), ``resolution/``
(``resolution.md/.json/.png``), ``long_video/`` (``long_video.md/.json``, ``heatmap_<run>.png``),
``properties/`` and ``timing.json``. The job is resumable: a run whose ``model.safetensors`` exists (with the
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

__all__ = ["main", "train_vits", "train_vlm", "run_finished"]

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
    p.add_argument("--no-properties", action="store_true", help="skip eval/properties.py")
    p.add_argument("--fresh", action="store_true", help="retrain and re-evaluate everything")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("vit_steps", "vlm_steps", "limit", "samples"):
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

    print(f"[demo] 1/4 training ViTs ({', '.join(args.vit)}) on Fashion-MNIST at 28 px, {args.vit_steps} steps",
          flush=True)  # fmt: skip
    t0 = time.perf_counter()
    vit_over = [*_protocol_overrides(VIT.train), f"train.warmup_steps={max(1, args.vit_steps // 20)}",
                "train.val_batches=4", *args.vit_override]  # fmt: skip
    vit_runs = train_vits(args.vit, steps=args.vit_steps, runs=runs, overrides=vit_over, fresh=args.fresh,
                          progress=progress)  # fmt: skip
    phase("train_vit", t0)
    vlm_run = None
    if not args.no_vlm:
        print(f"[demo] 2/4 training the VLM ({args.vlm_config.name}) on V-NIAH, {args.vlm_steps} steps, "
              f"launcher {args.launcher}", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        vlm_over = [*_protocol_overrides(VLM.train), "train.warmup_steps=10", "train.val_batches=2",
                    *args.vlm_override]  # fmt: skip
        vlm_run = train_vlm(config=args.vlm_config, steps=args.vlm_steps, runs=runs, overrides=vlm_over,
                            fresh=args.fresh, launcher=args.launcher, threads=cores)  # fmt: skip
        phase("train_vlm", t0)

    print("[demo] 3/4 evaluating: ViTs at higher resolution, the VLM beyond its training length", flush=True)
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

    if not args.no_properties:
        print("[demo] 4/4 encoding properties and attention plots (eval/properties.py)", flush=True)
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
    print(f"  plots and tables: {out / 'resolution'}, {out / 'long_video'}, {out / 'properties'}")
    print(f"[demo] done in {timing['total'] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
