"""Decoding one video in this process: :class:`Clip`, the decode errors, probing, frame selection and
resizing (pure functions shared by both backends), and the decord and PyAV readers.

:func:`data.video.read_video` runs these in the decoder process (:mod:`data.video.server`) under a deadline.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Clip", "VideoInfo", "VideoDecodeError", "TruncatedVideoError", "probe_video", "select_indices", "resize_frames", "INSTALL", "BACKENDS"]


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
