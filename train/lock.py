"""One run at a time per ``train.out_dir``: an exclusive lock held for the whole run.

Two launches writing into one ``out_dir`` would both log every step to ``metrics.jsonl``, overwrite each other's
export and checkpoints, and ``train.resume=auto`` of either would continue from the other's state. So
``train.engine.fit`` takes :func:`hold_out_dir` before it writes anything: rank 0 locks ``<out_dir>/run.lock``
with ``fcntl.flock`` and writes a JSON note of the holder into it (pid, host, start time, command, out_dir); the
other ranks of the launch wait for rank 0's decision through the process group, so a refused launch stops on
every rank with the same :class:`OutDirInUse` error, which names the holder from its note.

The kernel releases an ``flock`` when the last descriptor of the locked file is closed, which a process killed
with ``kill -9`` does on exit: a killed run never blocks the ``train.resume=auto`` that follows it (its note stays
in the file and is overwritten by the next holder). DataLoader workers forked while the lock is held close their
copy of the descriptor at once (:func:`os.register_at_fork`), so a worker that outlives its killed parent for a
moment does not hold the lock either. The lock file is never removed (removing a locked file would let a second
launch lock a fresh file of the same name); it also tells :func:`train.checkpoint.check_export` that the folder was
written by a harness that signs its exports.

Checked in ``tests/test_reliability_runs.py``: a second ``train/vit.py`` launch on a running launch's ``out_dir`` is
refused naming the first one's pid, host and command, and ``train.resume=auto`` after ``kill -9`` of the first
one resumes.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .config import ConfigError

__all__ = ["LOCK_FILE", "OutDirInUse", "RunLock", "hold_out_dir", "lock_out_dir", "read_holder"]

LOCK_FILE = "run.lock"

#: descriptors of the locks this process holds, by resolved out_dir (closed in forked children)
_HELD: dict[str, "RunLock"] = {}


def _close_in_child() -> None:
    for lock in _HELD.values():
        try:
            os.close(lock.fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class OutDirInUse(ConfigError):
    """``train.out_dir`` is locked by another run; the message names the holder and what to do."""


class RunLock:
    """An exclusive ``flock`` on ``<out_dir>/run.lock`` (see the module); :meth:`release` (or the end of the
    process) frees it. A context manager."""

    def __init__(self, path: Path, fd: int, holder: dict) -> None:
        self.path, self.fd, self.holder = path, fd, holder

    @property
    def held(self) -> bool:
        return _HELD.get(str(self.path.parent.resolve())) is self

    def release(self) -> None:
        """Unlock and close; the holder note stays in the file (a finished run's last record). Idempotent."""
        key = str(self.path.parent.resolve())
        if _HELD.get(key) is self:
            del _HELD[key]
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(path: str | Path) -> dict | None:
    """The JSON note in a lock file (None when it is empty, unreadable or not a mapping: a holder that has not yet
    written it, or a file that is not a lock note)."""
    try:
        note = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def _describe(note: dict | None) -> str:
    if note is None:
        return "a process that has not recorded itself yet"
    started = note.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (
        f"pid {note.get('pid', '?')} on host {note.get('host', '?')}, started {when}, "
        f"command: {note.get('command', '?')}"
    )


def lock_out_dir(out_dir: str | Path, *, command: list[str] | None = None) -> RunLock:
    """Lock ``out_dir`` (created if missing) for this process, or raise :class:`OutDirInUse` naming the holder.

    ``command``: what the holder note records as the command (default ``sys.argv``). Taking a lock this process
    already holds on ``out_dir`` (a ``fit`` that follows one that raised before releasing it) releases the old one
    first: a process runs one ``fit`` at a time.
    """
    out_dir = Path(out_dir)
    path = out_dir / LOCK_FILE
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        key = str(out_dir.resolve())
        if key in _HELD:
            _HELD[key].release()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: not inherited by launched programs
    except OSError as e:
        raise ConfigError(
            f"cannot open the run lock {path} ({e.strerror or e}): train.out_dir must be a folder this user can "
            f"create and write (a lock file left by another user is not); choose another train.out_dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _describe(read_holder(path))
        raise OutDirInUse(
            f"train.out_dir={str(out_dir)!r} is in use by another run ({holder}; lock file {path}). Two runs in one "
            f"out_dir would mix their metrics, checkpoints and export: wait for that run to finish or stop it, or "
            f"set train.out_dir to another folder"
        ) from None
    except OSError as e:
        os.close(fd)
        raise ConfigError(
            f"cannot lock {path} ({os.strerror(e.errno) if e.errno else e}): train.out_dir must be on a file "
            f"system that supports flock (a local disk or NFSv4); choose another train.out_dir"
        ) from None
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(sys.argv if command is None else command),
        "out_dir": str(out_dir.resolve()),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)  # releases the lock: this run does not start
        raise ConfigError(
            f"cannot write the run note into {path} ({e.strerror or e}): free space on the disk of train.out_dir "
            f"or choose another train.out_dir"
        ) from None
    lock = RunLock(path, fd, holder)
    _HELD[key] = lock
    return lock


def hold_out_dir(out_dir: str | Path, *, rank: int) -> RunLock | None:
    """:func:`lock_out_dir` on rank 0, its outcome shared with every rank of the process group: all ranks return
    (rank 0 with the lock, the others with None) or all raise the same :class:`OutDirInUse` / :class:`ConfigError`.
    Without an initialised process group this is :func:`lock_out_dir` on rank 0."""
    import torch.distributed as dist

    lock, problem = None, None
    if rank == 0:
        try:
            lock = lock_out_dir(out_dir)
        except ConfigError as e:
            problem = (type(e).__name__, str(e))
        except OSError as e:  # anything else: still shared, or the other ranks would wait for rank 0 until timeout
            problem = (ConfigError.__name__, f"cannot lock train.out_dir={str(out_dir)!r}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem is not None:
        kind, message = problem
        raise (OutDirInUse if kind == OutDirInUse.__name__ else ConfigError)(message)
    return lock
