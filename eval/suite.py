"""Running the benchmark: train what is missing, evaluate it, keep one durable record per run.

A *job* is one (family, encoding, seed). It trains ``train/<script>.py`` with the protocol's overrides into
``<runs>/<family>/<fingerprint>/<encoding>_seed<k>/`` (weights are scratch, not committed) and then evaluates
every row of that encoding in one process (``eval/<evaluator>.py`` with the seed's own test items and one
``--scaling`` per row). The outcome, with every per-item result and the CPU time spent, is written to
``results/<family>/runs/<encoding>_seed<k>.json``: that file is what the report reads and what is committed, so a
later ``make bench`` (another machine, another day) reuses it without training again. A record also stores the
fingerprint of the claims protocol it was run under (:func:`claims.fingerprint`; the decisions use only the current
one's records, :func:`sequential.select_records`) and its provenance (:func:`provenance`: commit, library
versions, CPU model, threads). A record is reused when its
training fingerprint (overrides + config files) and evaluation arguments match the protocol; ``--fresh``
redoes it. Jobs run ``jobs`` at a time with one thread each (the fastest use of a small CPU machine).

An interrupted suite (Ctrl-C, or SIGTERM while :func:`stop_on_sigterm` is active) stops its child runs, starts no
new one and re-raises :class:`KeyboardInterrupt`; a run in flight resumes from its last checkpoint next time, and
the CPU time its stopped training attempt spent is kept in the run's ``timing.json`` (a resumed run's record counts
every attempt).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from claims import fingerprint as claims_fingerprint
from protocols import PROTOCOLS, ROOT, Protocol, config_path, train_fingerprint

__all__ = ["Job", "plan", "record_path", "record_ok", "load_records", "run_jobs", "job_command_train", "job_command_eval",
           "provenance", "stop_on_sigterm"]


@dataclass(frozen=True)
class Job:
    protocol: Protocol
    encoding: str
    seed: int
    runs_dir: Path
    results_dir: Path

    @property
    def family(self) -> str:
        return self.protocol.family

    @property
    def key(self) -> str:
        return f"{self.family}/{self.encoding}_seed{self.seed}"

    @property
    def fingerprint(self) -> str:
        return train_fingerprint(self.protocol, self.encoding)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.family / self.fingerprint / f"{self.encoding}_seed{self.seed}"

    @property
    def scalings(self) -> list[str]:
        return ["none" if r.scaling is None else r.scaling for r in self.protocol.rows_of(self.encoding)]

    @property
    def eval_args(self) -> list[str]:
        scaling = ["--scaling", *self.scalings] if self.scalings != ["none"] else []
        return [*self.protocol.eval_args, *self.protocol.seed_args(self.seed), *scaling]


def record_path(results_dir: Path, family: str, encoding: str, seed: int) -> Path:
    return results_dir / family / "runs" / f"{encoding}_seed{seed}.json"


def plan(families: Sequence[str], *, encodings: Sequence[str] | None = None, seeds: int | None = None,
         runs_dir: Path, results_dir: Path) -> list[Job]:  # fmt: skip
    """Every job of ``families``: the protocol's encodings (``encodings`` None), every config of the family
    (``["all"]``: the rows plus the extras), or the named ones; seeds ``0 .. seeds-1`` (default the protocol's)."""
    jobs: list[Job] = []
    for fam in families:
        if fam not in PROTOCOLS:
            raise ValueError(f"family must be one of {list(PROTOCOLS)}, got {fam!r}")
        p = PROTOCOLS[fam]
        if encodings is None:
            chosen = list(p.encodings)
        elif list(encodings) == ["all"]:
            chosen = [*p.encodings, *(e for e in p.extra if e not in p.encodings)]
        else:
            known = [*p.encodings, *p.extra]
            chosen = [e for e in encodings if e in known]
        missing = [e for e in chosen if not config_path(p, e).is_file()]
        if missing:
            raise ValueError(f"{fam}: no config for {missing} (expected {config_path(p, missing[0]).name})")
        n = p.seeds if seeds is None else int(seeds)
        if n < 1:
            raise ValueError(f"seeds must be >= 1, got {n}")
        jobs += [Job(p, e, s, runs_dir, results_dir) for s in range(n) for e in chosen]  # seed-major: a partial
        # suite has every row at the first seeds, which is what paired comparisons need
    if encodings is not None and list(encodings) != ["all"]:
        known = {e for fam in families for e in (*PROTOCOLS[fam].encodings, *PROTOCOLS[fam].extra)}
        unknown = sorted(set(encodings) - known)
        if unknown:
            raise ValueError(f"encodings {unknown} are in no protocol of {list(families)}; known: {sorted(known)}")
    return jobs


def job_command_train(job: Job) -> list[str]:
    p = job.protocol
    n = next((int(o.split("=", 1)[1]) for o in p.overrides(job.encoding) if o.startswith("train.steps=")), None)
    cmd = [sys.executable, str(ROOT / "train" / f"{p.script}.py"), "--config", str(config_path(p, job.encoding)),
           *p.overrides(job.encoding), f"train.seed={job.seed}", f"train.out_dir={job.run_dir}",
           "train.keep_checkpoints=1", "train.progress=false", "train.resume=auto"]  # fmt: skip
    if n is not None:
        cmd += [f"train.val_every={max(1, n // 4)}", f"train.ckpt_every={max(1, n // 2)}",
                f"train.log_every={max(1, min(20, n // 20))}"]  # fmt: skip
    return cmd


def job_command_eval(job: Job, out: Path) -> list[str]:
    script = ROOT / "eval" / f"{job.protocol.evaluator}.py"
    return [sys.executable, str(script), "--run", str(job.run_dir), "--out", str(out), "--no-progress",
            *job.eval_args]  # fmt: skip


def _child_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    # the runs import this checkout's code (the one the record's provenance names), not whichever checkout the
    # environment's .pth file points at (a second worktree sharing one .venv would run the first one's files)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # each run is its own one-process group
    return env


_LIVE: set[subprocess.Popen] = set()  # the child runs in flight
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by an interrupted run_jobs: no new child starts
STOP_GRACE_S = 20.0  # a stopped child gets this long to exit after SIGTERM before SIGKILL


def run_logged(cmd: Sequence[str], log: Path, *, env: dict[str, str]) -> tuple[int, float, float]:
    """Run ``cmd`` with output to ``log``; (exit status, wall seconds, CPU seconds of it and its children).
    While the suite is stopping nothing starts: the status is then ``-SIGTERM`` with no time spent."""
    if _STOPPING.is_set():  # (before the log is opened: an earlier attempt's log stays)
        return -signal.SIGTERM, 0.0, 0.0
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        with _LIVE_LOCK:
            if _STOPPING.is_set():
                return -signal.SIGTERM, 0.0, 0.0
            proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
            _LIVE.add(proc)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not signal the pid again
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    return proc.returncode, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def _stop_children() -> None:
    """Start no new child run and stop those in flight (SIGTERM, then SIGKILL after ``STOP_GRACE_S``)."""
    with _LIVE_LOCK:
        _STOPPING.set()
        live = list(_LIVE)
        for proc in live:
            if proc.returncode is None:
                proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        with _LIVE_LOCK:
            if not _LIVE:
                return
        time.sleep(0.05)
    with _LIVE_LOCK:
        for proc in _LIVE:
            if proc.returncode is None:
                proc.kill()


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`KeyboardInterrupt` in the main thread (as Ctrl-C does), so an
    interrupted suite stops its runs and logs itself instead of dying mid-way; the old handler is restored after."""

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def record_ok(job: Job) -> bool:
    """Whether ``job`` has a record of the current protocol (it would be reused, not run)."""
    return _record_ok(record_path(job.results_dir, job.family, job.encoding, job.seed), job)


def _record_ok(path: Path, job: Job) -> bool:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return rec.get("fingerprint") == job.fingerprint and rec.get("eval_args") == job.eval_args


def _val_curve(run_dir: Path) -> list[list[float]]:
    """(step, validation accuracy) pairs the training logged: the convergence evidence kept with the record."""
    out = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("split") == "val" and "acc" in m:
            out.append([int(m["step"]), float(m["acc"])])
    return out


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or None


def provenance(threads: int) -> dict[str, Any]:
    """Where a record came from: the commit (``git rev-parse HEAD``), whether tracked files differed from it
    (``dirty``) and which (``dirty_files``, from ``git status --porcelain``), the torch / DeepSpeed / transformers /
    numpy / scipy versions (None when not installed), Python, the CPU model (``/proc/cpuinfo``) and the threads each
    run had."""
    import importlib.metadata as md
    import platform

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "dirty_files": None if status is None else sorted(ln[2:].strip() for ln in status.splitlines() if ln),
            "torch": version("torch"), "deepspeed": version("deepspeed"), "transformers": version("transformers"),
            "numpy": version("numpy"), "scipy": version("scipy"),
            "python": platform.python_version(), "cpu": _cpu_model(), "threads": int(threads)}  # fmt: skip


def _strip(ev: dict) -> dict:
    """An evaluation without machine-local paths."""
    return {k: v for k, v in ev.items() if k not in ("run",)}


def execute(
    job: Job, *, fresh: bool, threads: int, status: dict[str, str], reevaluate: bool = False
) -> str | None:
    """Train (unless exported) and evaluate one job; write its record. An error message, or None.

    ``reevaluate``: a matching record is redone when the run's weights are here (the evaluation code changed,
    the training did not); without the weights the record is kept, so it never retrains.
    """
    rec_path = record_path(job.results_dir, job.family, job.encoding, job.seed)
    run_dir = job.run_dir
    weights = run_dir / "model.safetensors"
    if not fresh and _record_ok(rec_path, job) and not (reevaluate and weights.is_file()):
        return None
    env = _child_env(threads)
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    timing_path = run_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    if not weights.is_file():
        status[job.key] = "train"
        rc, wall, cpu = run_logged(job_command_train(job), run_dir / "train.log", env=env)
        prev = timing.get("train", {"wall_s": 0.0, "cpu_s": 0.0})  # a resumed run adds its earlier attempts
        timing["train"] = {"wall_s": wall + prev["wall_s"], "cpu_s": cpu + prev["cpu_s"]}
        if wall > 0:  # every attempt's cost is kept, a stopped or failed one included
            run_dir.mkdir(parents=True, exist_ok=True)
            timing_path.write_text(json.dumps(timing))
        if rc != 0 or not weights.is_file():
            return f"training failed (exit {rc}); see {run_dir / 'train.log'}"
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the export is the product
    status[job.key] = "eval"
    out = run_dir / "eval"
    shutil.rmtree(out, ignore_errors=True)
    rc, wall, cpu = run_logged(job_command_eval(job, out), run_dir / "eval.log", env=env)
    result = out / f"{job.protocol.evaluator}.json"
    if rc != 0 or not result.is_file():
        return f"evaluation failed (exit {rc}); see {run_dir / 'eval.log'}"
    timing["eval"] = {"wall_s": wall, "cpu_s": cpu}
    timing_path.write_text(json.dumps(timing))
    evals = json.loads(result.read_text())["runs"]
    by_scaling = {(ev.get("scaling") or "none"): ev for ev in evals}
    rows = {}
    for r in job.protocol.rows_of(job.encoding):
        ev = by_scaling.get(r.scaling or "none")
        if ev is None:
            return f"the evaluation wrote no result for scaling {r.scaling!r}; see {run_dir / 'eval.log'}"
        rows[r.name] = _strip(ev)
    record = {
        "family": job.family, "encoding": job.encoding, "seed": job.seed, "fingerprint": job.fingerprint,
        "train_overrides": list(job.protocol.overrides(job.encoding)), "eval_args": job.eval_args, "timing": timing,
        "val_curve": _val_curve(run_dir), "rows": rows, "claims_fingerprint": claims_fingerprint(),
        "provenance": provenance(threads),
    }  # fmt: skip
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = rec_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(tmp, rec_path)  # a killed suite never leaves half a record
    status.pop(job.key, None)
    return None


def run_jobs(
    jobs: Sequence[Job], *, jobs_at_once: int, fresh: bool = False, reevaluate: bool = False, progress: bool = True
) -> list[str]:
    """Execute ``jobs`` (``jobs_at_once`` concurrently, one thread each); the error messages of failed jobs.
    ``fresh`` retrains and re-evaluates everything; ``reevaluate`` re-evaluates the runs whose weights are here
    (see :func:`execute`)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs_at_once))
    status: dict[str, str] = {}
    errors: list[str] = []
    t0 = time.perf_counter()
    _STOPPING.clear()
    pool = ThreadPoolExecutor(max_workers=jobs_at_once)
    try:
        futures = {
            pool.submit(execute, j, fresh=fresh, threads=threads, status=status, reevaluate=reevaluate): j
            for j in jobs
        }
        done = 0
        for f in futures:
            err = f.result()
            done += 1
            j = futures[f]
            if err:
                errors.append(f"{j.key}: {err}")
            if progress:
                print(f"[suite] {done}/{len(jobs)} {j.key} {'FAILED: ' + err if err else 'done'} "
                      f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)  # fmt: skip
    except BaseException:  # Ctrl-C / SIGTERM: no job is left running behind the interpreter's back
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_children()
        pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)
    return errors


def load_records(results_dir: Path, family: str) -> list[dict[str, Any]]:
    """Every record of ``family`` under ``results_dir`` whose fingerprint and evaluation match the protocol."""
    p = PROTOCOLS[family]
    out = []
    for path in sorted((results_dir / family / "runs").glob("*_seed*.json")):
        rec = json.loads(path.read_text())
        job = Job(p, rec["encoding"], int(rec["seed"]), Path("."), results_dir)
        if rec.get("fingerprint") == job.fingerprint and rec.get("eval_args") == job.eval_args:
            out.append(rec)
    return out
