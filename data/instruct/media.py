"""Loading the media of instruction samples: videos with decord at a target frame rate, images with Pillow.

Video frames are sampled as the Qwen-VL fine-tuning recipes do (a target ``fps`` up to a frame cap): the frame
shown at each tick ``k / fps`` of the new rate is frame ``round(k * native_fps / fps)``; when that gives more than
``max_frames`` frames, ``max_frames`` are spread uniformly over the whole video instead
(``linspace(0, N - 1, max_frames).round()``, as :func:`data.video.decode.select_indices` does for ``num_frames``);
a video of two or more frames always gives at least two (first and last), which the temporal patch of two frames
needs. Timestamps are ``frame index / native fps``, the times the frames have in the source. Every file that is
missing or cannot be decoded raises :class:`MediaError` (what :class:`data.instruct.InstructDataset` skips).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["MediaError", "video_indices", "load_video", "load_image"]


class MediaError(OSError):
    """A media file that is missing or cannot be decoded."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"cannot read {self.path}: {reason}")

    def __reduce__(self):  # keep (path, reason) across DataLoader worker processes
        return (type(self), (self.path, self.reason))


def _check_rate(fps: float, max_frames: int) -> None:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not np.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number (frames sampled per second), got {fps!r}")
    if isinstance(max_frames, bool) or not isinstance(max_frames, (int, np.integer)) or max_frames < 2:
        raise ValueError(f"max_frames must be an integer >= 2 (a temporal patch is 2 frames), got {max_frames!r}")


def video_indices(num_frames: int, native_fps: float, *, fps: float, max_frames: int) -> np.ndarray:
    """``(T,)`` int64 source frame indices of a ``num_frames``-frame video at ``native_fps`` sampled at ``fps``
    with at most ``max_frames`` frames (see the module docstring)."""
    _check_rate(fps, max_frames)
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if not (np.isfinite(native_fps) and native_fps > 0):
        raise ValueError(f"native_fps must be a positive number, got {native_fps!r}")
    step = float(native_fps) / float(fps)  # source frames per tick of the new rate
    ticks = np.arange(int(np.floor((num_frames - 1) / step + 1e-9)) + 1)
    idx = np.unique(np.minimum(np.round(ticks * step), num_frames - 1).astype(np.int64))
    if idx.size > max_frames:
        idx = np.linspace(0, num_frames - 1, int(max_frames)).round().astype(np.int64)
    elif idx.size < 2 <= num_frames:
        idx = np.array([0, num_frames - 1], dtype=np.int64)
    return idx


def load_video(path: str | os.PathLike, *, fps: float, max_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """``(frames, timestamps)`` of a video file: ``(T, H, W, 3)`` uint8 RGB and ``(T,)`` float64 seconds
    (``index / native fps``), sampled at ``fps`` with at most ``max_frames`` frames (module docstring). Use
    :func:`load_video_indexed` for the source indices and the native rate too."""
    frames, timestamps, _, _, _ = load_video_indexed(path, fps=fps, max_frames=max_frames)
    return frames, timestamps


def load_video_indexed(path: str | os.PathLike, *, fps: float, max_frames: int):
    """:func:`load_video` plus the ``(T,)`` source indices, the native fps and the source frame count."""
    import decord

    _check_rate(fps, max_frames)
    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    try:
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    except Exception as err:  # decord raises RuntimeError / DECORDError for files it cannot open
        raise MediaError(path, f"decord could not open it ({type(err).__name__}: {str(err)[:200]})") from None
    try:
        n, native = len(vr), float(vr.get_avg_fps())
        if n < 1:
            raise MediaError(path, "the video has no frames")
        if not (np.isfinite(native) and native > 0):
            raise MediaError(path, f"the video declares no usable frame rate ({native!r})")
        idx = video_indices(n, native, fps=fps, max_frames=max_frames)
        frames = vr.get_batch(idx.tolist()).asnumpy()  # (T, H, W, 3) uint8
        vr.seek(0)  # releases decoder buffers
    except MediaError:
        raise
    except Exception as err:
        raise MediaError(path, f"decord failed while decoding ({type(err).__name__}: {str(err)[:200]})") from None
    finally:
        del vr
    if frames.ndim != 4 or frames.shape[0] != idx.size or frames.shape[-1] != 3:
        raise MediaError(path, f"decord returned frames of shape {frames.shape}, expected ({idx.size}, H, W, 3)")
    timestamps = idx.astype(np.float64) / native  # (T,) seconds
    return np.ascontiguousarray(frames, dtype=np.uint8), timestamps, idx, native, n


def load_image(path: str | os.PathLike) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB pixels of an image file (Pillow; truncated files raise, they are not padded)."""
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated file fails here, not later
            rgb = img.convert("RGB")
    except Exception as err:  # PIL.UnidentifiedImageError, OSError("image file is truncated"), ...
        raise MediaError(path, f"Pillow could not decode it ({type(err).__name__}: {err})") from None
    return np.array(rgb, dtype=np.uint8)  # (H, W, 3), a writable copy
