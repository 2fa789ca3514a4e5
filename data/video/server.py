"""The decoder process (one per owning process, restarted after a timeout or a crash) and :func:`read_video`."""

from __future__ import annotations

import atexit
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from .decode import BACKENDS, INSTALL, Clip, TruncatedVideoError, VideoDecodeError, _check_sampling, _installed, _normalize_size, _read_local, _require

__all__ = ["read_video"]


_HEADER = struct.Struct("<Q")


class _DecoderGone(Exception):
    """The decoder process hung past its deadline or died; it has been killed."""


def _write_msg(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - len(buf), 1 << 22))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _read_msg(fd: int, deadline: float | None) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


def _serve() -> None:  # pragma: no cover - runs in the decoder process
    """Decoder-process main loop: read a request, decode, reply; exit when the owner closes the pipe."""
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # library prints must not corrupt the reply stream
    if _installed("av"):
        import av

        av.logging.set_level(av.logging.PANIC)
    _write_msg(out, ("ready", os.getpid()))
    while True:
        try:
            request = _read_msg(0, None)
        except EOFError:
            return
        try:
            reply = ("ok", _read_local(**request))
        except (VideoDecodeError, ValueError, ImportError) as err:  # travel back as themselves
            reply = ("err", err)
        except Exception as err:  # e.g. a request that cannot be unpacked
            reply = ("err", VideoDecodeError(request.get("path", "?"), f"{type(err).__name__}: {err}"))
        _write_msg(out, reply)


class _Decoder:
    """Handle on one decoder process (a subprocess running :func:`_serve`)."""

    STARTUP_S = 60.0
    RECYCLE_AFTER = 256  # reads per process: bounds decord's native leaks (dmlc/decord #208)

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.served = 0

    def _start(self) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the checkout: data/video/server.py
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from data.video.server import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # ffmpeg's own warnings about damaged streams
            env=env,
            bufsize=0,
            close_fds=True,
        )
        try:
            _read_msg(self.proc.stdout.fileno(), time.monotonic() + self.STARTUP_S)
        except (TimeoutError, EOFError) as err:
            self.kill()
            raise RuntimeError("the video decoder process did not start (is `data` importable?)") from err

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=10)
        except Exception:
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except Exception:
                pass

    def call(self, request: dict, timeout: float) -> Clip:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None or self.served >= self.RECYCLE_AFTER:
                self.kill()
                self._start()
                self.served = 0
            self.served += 1
            try:
                _write_msg(self.proc.stdin.fileno(), request)
                status, payload = _read_msg(self.proc.stdout.fileno(), time.monotonic() + timeout)
            except TimeoutError:
                self.kill()
                raise _DecoderGone(f"no answer within {timeout:g} s (decoder killed and restarted)") from None
            except (EOFError, BrokenPipeError, OSError) as err:
                code = self.proc.poll() if self.proc is not None else None
                self.kill()
                raise _DecoderGone(f"the decoder process died (exit code {code}): {err!r}") from None
        if status == "ok":
            return payload
        raise payload


_DECODERS: dict[int, _Decoder] = {}  # pid -> decoder; a forked child never reuses its parent's process


def _decoder() -> _Decoder:
    pid = os.getpid()
    if pid not in _DECODERS:
        _DECODERS[pid] = _Decoder()
    return _DECODERS[pid]


@atexit.register
def _shutdown_decoders() -> None:
    dec = _DECODERS.get(os.getpid())
    if dec is not None:
        dec.kill()


def read_video(
    path: str | os.PathLike,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    indices: Sequence[int] | None = None,
    size: int | Sequence[int] | None = None,
    backend: str = "auto",
    timeout: float | None = 60.0,
) -> Clip:
    """Decode frames and real timestamps of one video.

    Sampling (at most one): ``num_frames`` uniformly, ``fps`` (resample to this rate using the real
    timestamps), ``indices``; none: every frame. ``size``: (h, w) or int, centre-crop to that aspect and
    resize (antialiased) while decoding; None keeps the native resolution.
    ``backend``: "decord", "av" (PyAV), or "auto" (decord, then PyAV when decord fails or hangs).
    ``timeout``: seconds a read may take in the decoder process before it is killed and restarted;
    None decodes in this process with no protection against hangs.
    Raises FileNotFoundError for a missing path, VideoDecodeError for a file no backend can decode
    (TruncatedVideoError for a truncated one), ValueError for bad arguments, ImportError naming the
    install command when no backend is installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    _check_sampling(num_frames, fps, indices)
    size = _normalize_size(size)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such video file: {path}")
    if backend == "auto":
        order = [b for b in ("decord", "av") if _installed(b)]
        if not order:
            raise ImportError(f"reading video needs decord or PyAV; install them with: {INSTALL['decord']} av==18.1.0")
    else:
        _require(backend)
        order = [backend]
    indices = None if indices is None else list(indices)
    request = dict(path=path, num_frames=num_frames, fps=fps, indices=indices, size=size)
    failures = []
    for b in order:
        try:
            if timeout is None:
                return _read_local(backend=b, **request)
            return _decoder().call({**request, "backend": b}, timeout)
        except TruncatedVideoError:
            raise  # the file is short; another decoder will not find the missing frames
        except ValueError:
            raise  # bad sampling arguments for this video
        except (VideoDecodeError, _DecoderGone) as err:
            failures.append(f"{b}: {getattr(err, 'reason', err)}")
    raise VideoDecodeError(path, "; ".join(failures))
