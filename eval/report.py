"""The benchmark suite and its report: every encoding of a family trained and evaluated with identical settings.

    python eval/report.py --suite                                  # `make bench`: train what is missing, evaluate, report
    python eval/report.py --suite --families vit --seeds 1 --steps small   # a quick end-to-end check
    python eval/report.py                                          # rewrite results/ and README from results/*/runs.json

Families (one training script and one evaluation each; every run of a family gets the same overrides):

* ``vit``: ``configs/vit_<encoding>.yaml`` (Fashion-MNIST at 28 px), ``train/vit.py``, then ``eval/resolution.py``
  at the LookHere ratios 1 ... 4.57 (in-distribution = 1x, extrapolated = the mean over the larger sizes);
* ``vlm``: ``configs/<variant>.yaml`` for every multimodal variant (V-NIAH at 8 frames), ``train/vlm.py``, then
  ``eval/long_video.py`` (V-NIAH and V-NIAH-D at 0.5x ... 16x the training length; in-distribution = lengths up to
  the training length, extrapolated = longer; teacher-forced scores in the tables);
* ``points``: ``configs/points_<encoding>.yaml`` (CGAL shapes, z rotations), ``train/points.py``, then
  ``eval/points.py`` (z and SO(3) test rotations, 2x / 4x / 8x the training point count).

Runs go to ``<runs>/<family>/steps<N>/<encoding>_seed<k>/`` and are resumable: a run whose
``model.safetensors`` exists is not trained again, an evaluation whose output exists with the same settings is
not run again (``--fresh`` redoes both). Training and evaluation run as subprocesses, ``--jobs`` at a time with
one thread each (the fastest use of a small CPU machine); each leaves ``train.log`` / ``eval.log`` and
``timing.json`` (wall and CPU seconds) in its run folder.

Sizing (``--steps``): the default ``suite`` profile was chosen so that the whole suite (3 seeds) fits in about two
hours on 2 cores (see :data:`PROFILES` for the per-run costs it was sized from); ``small`` is a minutes-long
check of the whole pipeline; an integer sets the training steps of every family (evaluation as ``suite``).
The default encodings per family are those of :data:`DEFAULT_ENCODINGS`; ``--encodings all`` runs every config
(plan the time from the per-run costs the report prints).

The report writes ``results/<family>/`` (``runs.json`` with every per-run evaluation, ``summary.json``, markdown
tables with mean +- standard deviation over seeds, plots: accuracy vs resolution of all ViT encodings with a
+-1 std band, V-NIAH heatmaps averaged over seeds per variant, accuracy vs video length; the point-cloud table)
and the README section between ``<!-- results:start -->`` and ``<!-- results:end -->`` (appended at the end of
the README when absent; nothing outside the markers is touched). The section's sentences about the papers'
claims are computed from the measured means: each says whether our measurement has the sign the paper claims,
and whether the gap exceeds the seed spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, markdown_table, write_json  # noqa: E402

__all__ = [
    "FAMILIES",
    "PROFILES",
    "DEFAULT_ENCODINGS",
    "START",
    "END",
    "Stat",
    "discover",
    "plan_runs",
    "run_suite",
    "aggregate_vit",
    "aggregate_vlm",
    "aggregate_points",
    "claims",
    "readme_section",
    "update_readme",
    "report",
    "main",
]

FAMILIES = ("vit", "vlm", "points")
START, END = "<!-- results:start -->", "<!-- results:end -->"

# Encodings run by default (``--encodings all`` runs every config). ViT: the baselines and every paper the
# report checks (LookHere, its narrowest field of view, PaPE / PaPE-RI, RoPE-Mixed, ALiBi); VLM: every variant;
# points: the rotation-invariance comparison and its baselines.
DEFAULT_ENCODINGS: dict[str, tuple[str, ...] | None] = {
    "vit": ("nope", "ape", "sincos", "rope", "rope_mixed", "alibi", "lookhere", "lh45", "pape", "pape_ri"),
    # the 1D baseline and the variants whose papers make a long-video claim (``--encodings all`` adds mhrope,
    # pype, qwen25vl and qwen3vl: about 25 more minutes on 2 cores)
    "vlm": ("rope1d", "mrope", "mrope_i", "videorope", "hope_video", "vrope", "v2pe"),
    "points": ("nope", "sincos", "rope", "alibi", "pape", "pape_ri"),
}


@dataclass(frozen=True)
class Profile:
    """Training steps per family and the evaluation settings of each."""

    steps: dict[str, int]
    vit_limit: int  # validation images per test size
    vlm_samples: int  # needles per (length, depth) cell
    points_factors: tuple[int, ...]


PROFILES: dict[str, Profile] = {
    # Per-run CPU cost measured on the 2-core development machine (one thread, seconds; see the README section
    # for the figures of the last run): ViT micro ~0.7 s/step at batch 64 (PaPE ~1.0), its evaluation ~0.35 s per
    # image over the 7 sizes (PaPE ~1.1); the tiny VLM ~0.18 s/step, evaluation ~20 s; points ~0.4 s/step.
    "suite": Profile(steps={"vit": 200, "vlm": 500, "points": 200}, vit_limit=250, vlm_samples=10,
                     points_factors=(2, 4, 8)),  # fmt: skip
    "small": Profile(steps={"vit": 20, "vlm": 20, "points": 20}, vit_limit=40, vlm_samples=2, points_factors=(2,)),
}


# ------------------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    family: str
    encoding: str  # the config's name (vit_<encoding>.yaml, <variant>.yaml, points_<encoding>.yaml)
    config: Path
    seed: int
    steps: int
    out_dir: Path

    @property
    def name(self) -> str:
        return f"{self.encoding}_seed{self.seed}"

    @property
    def key(self) -> str:
        return f"{self.family}/{self.name}"


def discover(family: str, configs: Path = ROOT / "configs") -> dict[str, Path]:
    """Encoding name -> config file of every run config of ``family`` (CPU-sized, not ``configs/full``)."""
    if family == "vit":
        return {p.stem[len("vit_"):]: p for p in sorted(configs.glob("vit_*.yaml"))}
    if family == "points":
        return {p.stem[len("points_"):]: p for p in sorted(configs.glob("points_*.yaml"))}
    if family == "vlm":
        from vlpe.encodings import multimodal as mm

        return {v: configs / f"{v}.yaml" for v in sorted(mm.VARIANTS) if (configs / f"{v}.yaml").is_file()}
    raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")


def plan_runs(families: Sequence[str], *, encodings: Sequence[str] | None, seeds: int, profile: Profile,
              steps: int | None, runs_dir: Path) -> list[RunSpec]:  # fmt: skip
    """Every (family, encoding, seed) run of the suite; ``encodings`` None = the defaults, ["all"] = every config."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    plan: list[RunSpec] = []
    known: set[str] = set()
    for fam in families:
        found = discover(fam)
        known |= set(found)
        if encodings is None:
            chosen = [e for e in (DEFAULT_ENCODINGS[fam] or found) if e in found]
        elif list(encodings) == ["all"]:
            chosen = list(found)
        else:
            chosen = [e for e in encodings if e in found]
        n = profile.steps[fam] if steps is None else steps
        for enc in chosen:
            for s in range(seeds):
                plan.append(RunSpec(fam, enc, found[enc], s, n, runs_dir / fam / f"steps{n}" / f"{enc}_seed{s}"))
    if encodings is not None and list(encodings) != ["all"]:
        unknown = sorted(set(encodings) - known)
        if unknown:
            raise ValueError(f"encodings {unknown} have no config in families {list(families)}; known: {sorted(known)}")
    return plan


def _train_cmd(spec: RunSpec) -> list[str]:
    scripts = {"vit": "train/vit.py", "vlm": "train/vlm.py", "points": "train/points.py"}
    n = spec.steps
    cmd = [sys.executable, str(ROOT / scripts[spec.family]), "--config", str(spec.config),
           f"train.steps={n}", f"train.seed={spec.seed}", f"train.out_dir={spec.out_dir}",
           f"train.warmup_steps={max(1, min(20, n // 10))}", f"train.val_every={n}", f"train.ckpt_every={n}",
           "train.keep_checkpoints=1", f"train.log_every={max(1, min(10, n // 4))}", "train.progress=false",
           "train.resume=none"]  # fmt: skip
    if spec.family == "vlm":
        cmd.append("train.num_workers=0")  # the suite already runs one process per core
    return cmd


def _eval_cmd(spec: RunSpec, profile: Profile) -> tuple[list[str], Path]:
    out = spec.out_dir / "eval"
    common = ["--run", str(spec.out_dir), "--out", str(out), "--no-progress"]
    if spec.family == "vit":
        args = [str(ROOT / "eval/resolution.py"), "--limit", str(profile.vit_limit)]
        return [sys.executable, *args, *common], out / "resolution.json"
    if spec.family == "vlm":
        args = [str(ROOT / "eval/long_video.py"), "--samples", str(profile.vlm_samples)]
        return [sys.executable, *args, *common], out / "long_video.json"
    args = [str(ROOT / "eval/points.py"), "--factors", *map(str, profile.points_factors)]
    return [sys.executable, *args, *common], out / "points.json"


def _child_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # each run is its own one-process group
    return env


def run_logged(cmd: Sequence[str], log: Path, *, env: dict[str, str], cwd: Path = ROOT) -> tuple[int, float, float]:
    """Run ``cmd`` with output to ``log``; (exit status, wall seconds, CPU seconds of it and its children)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def _steps_done(spec: RunSpec) -> int:
    try:
        lines = (spec.out_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.strip()]
    return max(steps, default=0)


@dataclass
class Outcome:
    spec: RunSpec
    eval_path: Path | None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None


def execute(spec: RunSpec, profile: Profile, *, fresh: bool, threads: int, status: dict[str, str]) -> Outcome:
    """Train (unless the export exists) and evaluate (unless done with the same settings) one run."""
    env = _child_env(threads)
    if fresh and spec.out_dir.exists():
        shutil.rmtree(spec.out_dir)
    timing_path = spec.out_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    weights = spec.out_dir / "model.safetensors"
    if not weights.is_file():
        status[spec.key] = "train"
        for stale in ("metrics.jsonl", "eval"):  # a killed run left these behind
            p = spec.out_dir / stale
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        rc, wall, cpu = run_logged(_train_cmd(spec), spec.out_dir / "train.log", env=env)
        if rc != 0 or not weights.is_file():
            return Outcome(spec, None, timing, f"training failed (exit {rc}); see {spec.out_dir / 'train.log'}")
        shutil.rmtree(spec.out_dir / "checkpoints", ignore_errors=True)  # the export is the product
        timing["train"] = {"wall_s": wall, "cpu_s": cpu, "steps": spec.steps}
        write_json(timing_path, timing)
    cmd, result = _eval_cmd(spec, profile)
    settings = spec.out_dir / "eval" / "settings.json"
    wanted = {"cmd": [c for c in cmd[2:] if c not in (str(spec.out_dir), str(spec.out_dir / "eval"))]}
    if not (result.is_file() and settings.is_file() and json.loads(settings.read_text()) == wanted):
        status[spec.key] = "eval"
        rc, wall, cpu = run_logged(cmd, spec.out_dir / "eval.log", env=env)
        if rc != 0 or not result.is_file():
            return Outcome(spec, None, timing, f"evaluation failed (exit {rc}); see {spec.out_dir / 'eval.log'}")
        write_json(settings, wanted)
        timing["eval"] = {"wall_s": wall, "cpu_s": cpu}
        write_json(timing_path, timing)
    status.pop(spec.key, None)
    return Outcome(spec, result, timing)


def run_suite(plan: Sequence[RunSpec], profile: Profile, *, jobs: int, fresh: bool = False,
              progress: bool = True) -> list[Outcome]:  # fmt: skip
    """Execute ``plan`` with ``jobs`` runs at a time (one thread each); a tqdm bar over training steps + evals."""
    from tqdm import tqdm

    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    status: dict[str, str] = {}
    total = sum(s.steps for s in plan) + len(plan)  # every training step, and one unit per evaluation
    tty = sys.stderr.isatty()
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(total=total, desc="suite", unit="step",
                                                            disable=not progress, dynamic_ncols=True,
                                                            mininterval=1.0 if tty else 30.0) as bar:
        futures = [pool.submit(execute, s, profile, fresh=fresh, threads=threads, status=status) for s in plan]
        shown = 0
        while True:
            units = 0
            for spec, f in zip(plan, futures):
                state = status.get(spec.key)
                if f.done():
                    units += spec.steps + 1
                elif state == "train":
                    units += _steps_done(spec)
                elif state == "eval":
                    units += spec.steps
            if units > shown:
                bar.update(units - shown)
                shown = units
            bar.set_postfix_str(", ".join(f"{k} {v}" for k, v in list(status.items()))[:90], refresh=False)
            if all(f.done() for f in futures):
                break
            time.sleep(2.0)
        outcomes = [f.result() for f in futures]
    for o in outcomes:
        if o.error:
            print(f"[suite] {o.spec.key}: {o.error}", file=sys.stderr)
    return outcomes


# ------------------------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds (std 0 for one seed)."""

    mean: float | None
    std: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> "Stat":
        xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        if not xs:
            return cls(None, 0.0, 0)
        m = sum(xs) / len(xs)
        s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        return cls(m, s, len(xs))

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        if self.mean is None:
            return "–"
        if self.n < 2:
            return fmt(self.mean, scale, digits)
        return f"{fmt(self.mean, scale, digits)} ± {fmt(self.std, scale, digits)}"

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n}


def _key(ev: dict, default_field: str) -> str:
    return (ev.get("bench") or {}).get("encoding") or ev[default_field]


def _group(evals: Sequence[dict], field_name: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for ev in evals:
        out.setdefault(_key(ev, field_name), []).append(ev)
    return out


def aggregate_vit(evals: Sequence[dict]) -> dict[str, Any]:
    """Per encoding: top-1 per test/train ratio, in-distribution (1x) and extrapolated (mean over > 1x)."""
    ratios = [r["ratio"] for r in evals[0]["results"]]
    out: dict[str, Any] = {"ratios": ratios, "encodings": {}}
    for enc, evs in _group(evals, "encoding").items():
        acc = {r: [] for r in ratios}
        ece1, ind, ext = [], [], []
        for ev in evs:
            by_ratio = {r["ratio"]: r for r in ev["results"]}
            if sorted(by_ratio) != sorted(ratios):
                raise ValueError(f"{ev.get('name')}: evaluated at ratios {sorted(by_ratio)}, others at {ratios}")
            for r in ratios:
                acc[r].append(by_ratio[r]["acc"])
            base = min(ratios, key=lambda r: abs(r - 1.0))
            ind.append(by_ratio[base]["acc"])
            ece1.append(by_ratio[base]["ece"])
            big = [by_ratio[r]["acc"] for r in ratios if r > 1.0 + 1e-9]
            ext.append(sum(big) / len(big) if big else None)
        out["encodings"][enc] = {
            "acc": [Stat.of(acc[r]).as_dict() for r in ratios],
            "in_distribution": Stat.of(ind).as_dict(),
            "extrapolated": Stat.of(ext).as_dict(),
            "ece_1x": Stat.of(ece1).as_dict(),
            "seeds": len(evs),
        }
    return out


def aggregate_vlm(evals: Sequence[dict]) -> dict[str, Any]:
    """Per variant and task: teacher-forced / generation accuracy in-distribution, extrapolated, per length,
    and the depth x length grid averaged over seeds."""
    first = evals[0]
    out: dict[str, Any] = {"lengths": first["lengths"], "depths": first["depths"],
                           "train_frames": first["train_frames"], "variants": {}}  # fmt: skip
    for var, evs in _group(evals, "variant").items():
        for ev in evs:
            if ev["lengths"] != first["lengths"] or ev["depths"] != first["depths"]:
                raise ValueError(f"{ev.get('name')}: a different length/depth grid than {first.get('name')}")
        entry: dict[str, Any] = {"seeds": len(evs), "tasks": {}}
        for task in sorted(set.intersection(*(set(ev["tasks"]) for ev in evs))):
            t_entry: dict[str, Any] = {}
            for scoring in ("teacher", "generate"):
                rs = [ev["tasks"][task][scoring] for ev in evs if scoring in ev["tasks"].get(task, {})]
                if not rs:
                    continue
                grid = [[Stat.of([r["grid"][i][j] for r in rs]).mean for j in range(len(first["lengths"]))]
                        for i in range(len(first["depths"]))]  # fmt: skip
                t_entry[scoring] = {
                    "in_distribution": Stat.of([r["in_distribution"] for r in rs]).as_dict(),
                    "extrapolated": Stat.of([r["extrapolated"] for r in rs]).as_dict(),
                    "mean": Stat.of([r["mean"] for r in rs]).as_dict(),
                    "per_length": [Stat.of([r["per_length"][j] for r in rs]).as_dict()
                                   for j in range(len(first["lengths"]))],  # fmt: skip
                    "grid": grid,
                }
            agree = [ev["tasks"][task].get("agreement") for ev in evs]
            t_entry["agreement"] = Stat.of(agree).as_dict()
            entry["tasks"][task] = t_entry
        out["variants"][var] = entry
    return out


def aggregate_points(evals: Sequence[dict]) -> dict[str, Any]:
    """Per encoding: accuracy under each test condition (rotations, point counts) and the z -> SO(3) drop."""
    conds = [(r["condition"], r["rotation"], r["points"]) for r in evals[0]["results"]]
    out: dict[str, Any] = {"conditions": [list(c) for c in conds], "encodings": {}}
    for enc, evs in _group(evals, "encoding").items():
        acc: dict[tuple, list] = {c: [] for c in conds}
        drop = []
        for ev in evs:
            by = {(r["condition"], r["rotation"], r["points"]): r for r in ev["results"]}
            for c in conds:
                acc[c].append(by[c]["acc"] if c in by else None)
            z = next((r["acc"] for r in ev["results"] if r["condition"] == "rotation" and r["rotation"] == "z"), None)
            so3 = next((r["acc"] for r in ev["results"] if r["condition"] == "rotation" and r["rotation"] == "so3"),
                       None)  # fmt: skip
            drop.append(None if z is None or so3 is None else so3 - z)
        out["encodings"][enc] = {
            "acc": [Stat.of(acc[c]).as_dict() for c in conds],
            "so3_minus_z": Stat.of(drop).as_dict(),
            "seeds": len(evs),
        }
    return out


def _stat(d: dict | None) -> Stat:
    return Stat(d["mean"], d["std"], d["n"]) if d else Stat(None, 0.0, 0)


# ------------------------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------------------------


def compare(what: str, paper: str, a_name: str, a: Stat, b_name: str, b: Stat, metric: str) -> str:
    """One sentence: the paper's claim that ``a`` beats ``b``, and whether the measured means agree in sign
    (and whether the gap exceeds the larger seed standard deviation). Flips with the numbers."""
    if a.mean is None or b.mean is None:
        missing = " and ".join(n for n, s in ((a_name, a), (b_name, b)) if s.mean is None)
        return f"**{what}** ({paper}): not measured — the results have no {missing} runs."
    diff = 100 * (a.mean - b.mean)
    if diff > 0:
        verdict = "agrees with the direction of the claim"
    elif diff < 0:
        verdict = "disagrees with the direction of the claim"
    else:
        verdict = "shows no difference, so it neither agrees nor disagrees with the claim"
    spread = 100 * max(a.std, b.std)
    n = min(a.n, b.n)
    if n < 2:
        caveat = " (one seed: no spread to compare the gap with)"
    elif abs(diff) <= spread:
        caveat = f" (but the gap is within the seed spread, std {spread:.1f} points over {n} seeds)"
    else:
        caveat = f" (the gap exceeds the seed spread, std {spread:.1f} points over {n} seeds)"
    return (f"**{what}** ({paper}): we measure {metric} {a_name} {a.text()} vs {b_name} {b.text()} "
            f"({diff:+.1f} points), which {verdict}{caveat}.")  # fmt: skip


def claims(summary: dict[str, Any]) -> list[str]:
    """The sentences per paper, from the aggregated measurements (see :func:`compare`)."""
    out = []
    vit = summary.get("vit")
    if vit:
        ratios = vit["ratios"]
        j = max(range(len(ratios)), key=lambda i: ratios[i])
        top = f"top-1 at {ratios[j]:.3g}x"
        enc = vit["encodings"]
        at = lambda e: _stat(enc[e]["acc"][j]) if e in enc else Stat(None, 0.0, 0)  # noqa: E731
        out.append(compare("LookHere vs 2D RoPE", "Fuller et al., NeurIPS 2024: +21.7 points top-1 over 2D RoPE at "
                           "4.57x the training resolution", "LookHere", at("lookhere"), "RoPE", at("rope"), top))
        out.append(compare("PaPE vs LookHere", "Øhrstrøm et al. 2026: up to +10.5 points over the next-best "
                           "encoding, LookHere, at 4.57x", "PaPE", at("pape"), "LookHere", at("lookhere"), top))
    vlm = summary.get("vlm")
    if vlm:
        var = vlm["variants"]

        def ext(v: str, task: str = "v_niah") -> Stat:
            t = var.get(v, {}).get("tasks", {}).get(task, {}).get("teacher")
            return _stat(t["extrapolated"]) if t else Stat(None, 0.0, 0)

        metric = "V-NIAH accuracy beyond the training length"
        out.append(compare("VideoRoPE vs MRoPE", "Wei et al., ICML 2025: V-NIAH 91.1 vs 78.7 and V-NIAH-D 87.1 vs "
                           "74.7 for M-RoPE", "VideoRoPE", ext("videorope"), "MRoPE", ext("mrope"), metric))
        if any("v_niah_d" in v.get("tasks", {}) for v in var.values()):
            out.append(compare("VideoRoPE vs MRoPE with distractors", "Wei et al., ICML 2025: V-NIAH-D +12.4 over "
                               "M-RoPE", "VideoRoPE", ext("videorope", "v_niah_d"), "MRoPE", ext("mrope", "v_niah_d"),
                               "V-NIAH-D accuracy beyond the training length"))  # fmt: skip
        out.append(compare("HoPE vs MRoPE", "Li et al., NeurIPS 2025: HoPE retrieves better than M-RoPE on V-NIAH "
                           "at lengths beyond training", "HoPE", ext("hope_video"), "MRoPE", ext("mrope"), metric))
        out.append(compare("MRoPE-I vs MRoPE", "Huang et al., ICLR 2026: interleaved allocation extrapolates "
                           "better than chunked M-RoPE", "MRoPE-I", ext("mrope_i"), "MRoPE", ext("mrope"), metric))
    pts = summary.get("points")
    if pts:
        conds = [tuple(c) for c in pts["conditions"]]
        j = next((i for i, c in enumerate(conds) if c[0] == "rotation" and c[1] == "so3"), None)
        enc = pts["encodings"]
        so3 = lambda e: _stat(enc[e]["acc"][j]) if e in enc and j is not None else Stat(None, 0.0, 0)  # noqa: E731
        out.append(compare("PaPE-RI under rotation", "Øhrstrøm et al. 2026: the rotation-invariant variant keeps "
                           "its accuracy under rotations it was not trained on", "PaPE-RI", so3("pape_ri"), "PaPE",
                           so3("pape"), "top-1 under SO(3) test rotations after z-only training"))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------------
# tables, plots, README
# ------------------------------------------------------------------------------------------------------------


def vit_table(vit: dict) -> str:
    ratios = vit["ratios"]
    head = ["encoding", "seeds", "1x (in-dist)", "extrapolated (mean > 1x)"] + [f"x{r:.3g}" for r in ratios if r > 1]
    rows = []
    order = sorted(vit["encodings"], key=lambda e: -(vit["encodings"][e]["extrapolated"]["mean"] or 0))
    for e in order:
        d = vit["encodings"][e]
        rows.append([e, d["seeds"], _stat(d["in_distribution"]).text(), _stat(d["extrapolated"]).text()]
                    + [_stat(a).text() for r, a in zip(ratios, d["acc"]) if r > 1])  # fmt: skip
    return markdown_table(head, rows)


def vlm_table(vlm: dict, scoring: str = "teacher") -> str:
    tasks = sorted({t for v in vlm["variants"].values() for t in v["tasks"]})
    head = ["variant", "seeds"]
    for t in tasks:
        name = t.replace("_", "-").upper()
        head += [f"{name} in-dist", f"{name} extrapolated"]
    head += [f"{L} fr" for L in vlm["lengths"]]
    rows = []

    def key(v: str) -> float:
        t = vlm["variants"][v]["tasks"].get("v_niah", {}).get(scoring)
        return -(t["extrapolated"]["mean"] or 0) if t else 0.0

    for v in sorted(vlm["variants"], key=key):
        d = vlm["variants"][v]
        row: list[Any] = [v, d["seeds"]]
        for t in tasks:
            s = d["tasks"].get(t, {}).get(scoring)
            row += [_stat(s["in_distribution"]).text(), _stat(s["extrapolated"]).text()] if s else ["–", "–"]
        s = d["tasks"].get("v_niah", {}).get(scoring)
        row += [_stat(x).text() for x in s["per_length"]] if s else ["–"] * len(vlm["lengths"])
        rows.append(row)
    return markdown_table(head, rows)


def points_table(pts: dict) -> str:
    conds = [tuple(c) for c in pts["conditions"]]
    head = ["encoding", "seeds"] + [f"{c[1]} rotation" if c[0] == "rotation" else f"{c[2]} points" for c in conds]
    head.append("SO(3) − z")
    rows = []
    for e in sorted(pts["encodings"]):
        d = pts["encodings"][e]
        rows.append([e, d["seeds"], *(_stat(a).text() for a in d["acc"]), _stat(d["so3_minus_z"]).text()])
    return markdown_table(head, rows)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_vit(vit: dict, path: Path) -> Path:
    """Top-1 against test/train size for every encoding: mean over seeds, band = +-1 std."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    cmap = plt.get_cmap("tab20")
    x = vit["ratios"]
    for k, e in enumerate(sorted(vit["encodings"])):
        acc = vit["encodings"][e]["acc"]
        m = [100 * (a["mean"] if a["mean"] is not None else math.nan) for a in acc]
        s = [100 * a["std"] for a in acc]
        ls = "-" if k < 10 else "--"
        ax.plot(x, m, ls, marker="o", ms=3, color=cmap(k % 20), label=e)
        ax.fill_between(x, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], color=cmap(k % 20),
                        alpha=0.15, lw=0)  # fmt: skip
    ax.set_xlabel("test size / training size")
    ax.set_ylabel("top-1 accuracy (%)")
    n = max(d["seeds"] for d in vit["encodings"].values())
    ax.set_title(f"ViT resolution extrapolation (mean ± std over up to {n} seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_vlm_lengths(vlm: dict, path: Path) -> Path:
    """Teacher-forced accuracy against video length, one line per variant, one panel per task."""
    plt = _plt()
    tasks = sorted({t for v in vlm["variants"].values() for t in v["tasks"]})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.0), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab20")
    x = vlm["lengths"]
    for ax, t in zip(axes[0], tasks):
        for k, v in enumerate(sorted(vlm["variants"])):
            s = vlm["variants"][v]["tasks"].get(t, {}).get("teacher")
            if not s:
                continue
            m = [100 * (a["mean"] if a["mean"] is not None else math.nan) for a in s["per_length"]]
            sd = [100 * a["std"] for a in s["per_length"]]
            ax.plot(x, m, marker="o", ms=3, color=cmap(k % 20), label=v)
            ax.fill_between(x, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)], color=cmap(k % 20),
                            alpha=0.12, lw=0)  # fmt: skip
        ax.axvline(vlm["train_frames"], color="k", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(L) for L in x])
        ax.set_xlabel("video length (frames; dashed: training length)")
        ax.set_title(f"{t.replace('_', '-').upper()} (teacher-forced)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact match (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_vlm_heatmaps(vlm: dict, out: Path) -> list[Path]:
    """``heatmap_<variant>.png``: the depth x length grids averaged over seeds (eval/long_video.heatmap)."""
    import long_video

    paths = []
    for v, d in sorted(vlm["variants"].items()):
        tasks = {}
        for t, entry in d["tasks"].items():
            tasks[t] = {s: {"grid": entry[s]["grid"], "in_distribution": entry[s]["in_distribution"]["mean"],
                            "extrapolated": entry[s]["extrapolated"]["mean"]}
                        for s in ("teacher", "generate") if s in entry}  # fmt: skip
        ev = {"name": v, "variant": v, "lengths": vlm["lengths"], "depths": vlm["depths"],
              "train_frames": vlm["train_frames"], "tasks": tasks}  # fmt: skip
        title = f"{v}: mean over {d['seeds']} seed(s), trained at {vlm['train_frames']} frames"
        paths.append(long_video.heatmap(ev, out / f"heatmap_{v}.png", title=title))
    return paths


def _settings_line(evals: Sequence[dict]) -> str:
    steps = sorted({(ev.get("bench") or {}).get("steps") for ev in evals} - {None})
    seeds = sorted({(ev.get("bench") or {}).get("seed", ev.get("seed")) for ev in evals} - {None})
    parts = []
    if steps:
        parts.append(f"{'/'.join(map(str, steps))} training steps")
    if seeds:
        parts.append(f"seeds {', '.join(map(str, seeds))}")
    return ", ".join(parts)


def readme_section(summary: dict[str, Any], evals: dict[str, list[dict]], timing: dict | None = None) -> str:
    """The markdown between the README markers (without the markers)."""
    lines = ["## Results", "",
             "Measured by `make bench` (`eval/report.py --suite`): every encoding of a family trained and evaluated "
             "with identical settings on the CPU-sized configs; cells are mean ± standard deviation over seeds "
             "(top-1 or exact match, %). Full tables and plots: `results/`.", ""]  # fmt: skip
    vit = summary.get("vit")
    if vit:
        lines += [f"### ViT resolution extrapolation (Fashion-MNIST, trained at 28 px; {_settings_line(evals['vit'])})",
                  "", "Same weights at larger test sizes; in-distribution = 1x, extrapolated = mean over the larger "
                  "sizes.", "", vit_table(vit), "![accuracy vs resolution](results/vit/resolution.png)", ""]
    vlm = summary.get("vlm")
    if vlm:
        lines += [f"### Long video: V-NIAH / V-NIAH-D (trained at {vlm['train_frames']} frames; "
                  f"{_settings_line(evals['vlm'])})", "",
                  "Teacher-forced exact match; in-distribution = lengths up to the training length, extrapolated = "
                  "longer; per-length columns are V-NIAH. Heatmaps: `results/vlm/heatmap_<variant>.png`.", "",
                  vlm_table(vlm), "![accuracy vs length](results/vlm/accuracy_vs_length.png)", ""]  # fmt: skip
    pts = summary.get("points")
    if pts:
        lines += [f"### Point clouds (CGAL shapes, trained with z rotations; {_settings_line(evals['points'])})", "",
                  points_table(pts), ""]
    sentences = claims(summary)
    if sentences:
        lines += ["### Do the measurements agree with the papers?", "",
                  "Computed from the numbers above (the sign of the measured difference; a gap inside the seed "
                  "spread is not evidence either way). Results that disagree with a paper are reported as measured; "
                  "these are small CPU-sized models trained for minutes, not the papers' settings.", ""]
        lines += [f"- {s}" for s in sentences] + [""]
    if timing:
        lines += ["### Cost", "", timing_text(timing), ""]
    return "\n".join(lines).rstrip() + "\n"


def update_readme(path: Path, section: str) -> bool:
    """Replace the text between the markers (appending the markers at the end when absent); True if changed."""
    text = path.read_text() if path.is_file() else ""
    s, e = text.find(START), text.find(END)
    if (s < 0) != (e < 0) or (s >= 0 and e < s) or text.count(START) > 1 or text.count(END) > 1:
        raise ValueError(f"{path}: expected one {START!r} followed by one {END!r}, or neither")
    body = f"{START}\n{section.rstrip()}\n{END}"
    if s < 0:
        new = text + ("" if text.endswith("\n") or not text else "\n") + ("\n" if text else "") + body + "\n"
    else:
        new = text[:s] + body + text[e + len(END):]
    if new != text:
        path.write_text(new)
    return new != text


def timing_text(timing: dict) -> str:
    parts = []
    for fam, d in timing.get("families", {}).items():
        parts.append(f"{fam}: {d['runs']} runs, {d['train_cpu_s']:.0f} s train + {d['eval_cpu_s']:.0f} s eval CPU "
                     f"per run ({d['train_wall_s']:.0f} + {d['eval_wall_s']:.0f} s wall)")
    out = "Per run, one thread (means over the runs of this report): " + "; ".join(parts) + "."
    if timing.get("estimate_h") is not None:
        out += (f" The whole suite as run is about {timing['cpu_h']:.1f} CPU-hours, i.e. about "
                f"{timing['estimate_h']:.1f} h on {timing['cores']} idle cores with {timing['cores']} jobs.")
    if timing.get("last_wall_s"):
        out += (f" The last `python eval/report.py --suite` took {timing['last_wall_s'] / 60:.0f} min wall with "
                f"{timing['cores']} jobs (runs already finished are reused, not retrained).")
    return out


def collect_timing(plan_or_dirs: Sequence[Path], cores: int) -> dict:
    fams: dict[str, list[dict]] = {}
    for d in plan_or_dirs:
        p = d / "timing.json"
        if p.is_file():
            fams.setdefault(d.parent.parent.name, []).append(json.loads(p.read_text()))
    out: dict[str, Any] = {"families": {}, "cores": cores}
    total = 0.0
    for fam, ts in sorted(fams.items()):
        tr = [t["train"] for t in ts if "train" in t]
        ev = [t["eval"] for t in ts if "eval" in t]
        mean = lambda xs, k: sum(x[k] for x in xs) / len(xs) if xs else 0.0  # noqa: E731
        d = {"runs": len(ts), "train_cpu_s": mean(tr, "cpu_s"), "eval_cpu_s": mean(ev, "cpu_s"),
             "train_wall_s": mean(tr, "wall_s"), "eval_wall_s": mean(ev, "wall_s")}  # fmt: skip
        out["families"][fam] = d
        total += len(ts) * (d["train_cpu_s"] + d["eval_cpu_s"])
    out["cpu_h"] = total / 3600
    out["estimate_h"] = total / 3600 / max(1, cores) if total else None
    return out


def report(results: Path, *, readme: Path | None = ROOT / "README.md", timing: dict | None = None,
           families: Sequence[str] = FAMILIES) -> dict[str, Any]:  # fmt: skip
    """Aggregate ``results/<family>/runs.json``, write tables / plots / summary.json and the README section."""
    summary: dict[str, Any] = {}
    evals: dict[str, list[dict]] = {}
    for fam in families:
        p = results / fam / "runs.json"
        if not p.is_file():
            continue
        runs = json.loads(p.read_text())["runs"]
        if not runs:
            continue
        evals[fam] = runs
        out = results / fam
        if fam == "vit":
            summary[fam] = agg = aggregate_vit(runs)
            (out / "resolution.md").write_text("# ViT resolution extrapolation (mean ± std over seeds)\n\n"
                                               + vit_table(agg))  # fmt: skip
            plot_vit(agg, out / "resolution.png")
        elif fam == "vlm":
            summary[fam] = agg = aggregate_vlm(runs)
            text = "# V-NIAH / V-NIAH-D (mean ± std over seeds)\n\n## Teacher-forced\n\n" + vlm_table(agg)
            text += "\n## Greedy generation\n\n" + vlm_table(agg, "generate")
            (out / "long_video.md").write_text(text)
            plot_vlm_lengths(agg, out / "accuracy_vs_length.png")
            plot_vlm_heatmaps(agg, out)
        else:
            summary[fam] = agg = aggregate_points(runs)
            (out / "points.md").write_text("# Point clouds (mean ± std over seeds)\n\n" + points_table(agg))
        write_json(out / "summary.json", agg)
    if not summary:
        raise ValueError(f"no results under {results}: run `python eval/report.py --suite` first")
    if timing is None and (results / "timing.json").is_file():
        timing = json.loads((results / "timing.json").read_text())
    section = readme_section(summary, evals, timing)
    (results / "README.md").write_text(section)
    if readme is not None:
        update_readme(readme, section)
    summary["claims"] = claims(summary)
    return summary


# ------------------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------------------


def _collect_evals(outcomes: Sequence[Any]) -> dict[str, list[dict]]:
    evals: dict[str, list[dict]] = {}
    for o in outcomes:
        if o.eval_path is None:
            continue
        for ev in json.loads(o.eval_path.read_text())["runs"]:
            s = o.spec
            ev["bench"] = {"family": s.family, "encoding": s.encoding, "seed": s.seed, "steps": s.steps}
            evals.setdefault(s.family, []).append(ev)
    return evals


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--suite", action="store_true", help="train and evaluate what is missing, then report")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--encodings", nargs="+", default=None,
                   help="encoding / variant names (default: DEFAULT_ENCODINGS per family; 'all': every config)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds per encoding (0 .. N-1)")
    p.add_argument("--steps", default="suite", help="'suite' (default), 'small', or an integer for every family")
    p.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="runs at a time (one thread each)")
    p.add_argument("--runs", default=str(ROOT / "runs" / "bench"), help="where the runs go")
    p.add_argument("--results", default=str(ROOT / "results"), help="where the report goes")
    p.add_argument("--readme", default=str(ROOT / "README.md"), help="README to update ('' to skip)")
    p.add_argument("--fresh", action="store_true", help="retrain and re-evaluate every planned run")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    results = Path(args.results)
    readme = Path(args.readme) if args.readme else None
    if not args.suite:
        summary = report(results, readme=readme, families=args.families)
        print("\n".join(f"- {c}" for c in summary["claims"]))
        return 0
    if args.steps in PROFILES:
        profile, steps = PROFILES[args.steps], None
    else:
        try:
            profile, steps = PROFILES["suite"], int(args.steps)
        except ValueError:
            p.error(f"--steps must be one of {list(PROFILES)} or an integer, got {args.steps!r}")
        if steps < 1:
            p.error("--steps must be >= 1")
    plan = plan_runs(args.families, encodings=args.encodings, seeds=args.seeds, profile=profile, steps=steps,
                     runs_dir=Path(args.runs))  # fmt: skip
    if not plan:
        p.error("nothing to run: no config matches --families / --encodings")
    print(f"[suite] {len(plan)} runs: " + ", ".join(
        f"{fam} {sum(s.family == fam for s in plan)} x {next(s.steps for s in plan if s.family == fam)} steps"
        for fam in args.families if any(s.family == fam for s in plan)), flush=True)  # fmt: skip
    t0 = time.perf_counter()
    outcomes = run_suite(plan, profile, jobs=args.jobs, fresh=args.fresh, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    evals = _collect_evals(outcomes)
    for fam, runs in evals.items():
        write_json(results / fam / "runs.json", {"runs": runs})
    timing = collect_timing([s.out_dir for s in plan], cores=args.jobs)
    timing["last_wall_s"] = wall
    write_json(results / "timing.json", timing)
    failed = [o for o in outcomes if o.error]
    if evals:
        summary = report(results, readme=readme, timing=timing, families=list(evals))
        print((results / "README.md").read_text())
        print(f"[suite] {len(plan) - len(failed)}/{len(plan)} runs done in {wall / 60:.1f} min wall; "
              f"report in {results}")  # fmt: skip
        del summary
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
