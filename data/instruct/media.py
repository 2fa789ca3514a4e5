"""Loading the media of instruction samples: videos with decord at a target frame rate, images with Pillow.

Video frames are sampled as the Qwen-VL fine-tuning recipes do (a target ``fps`` up to a frame cap): the frame
shown at each tick ``k / fps`` of the new rate is frame ``round(k * native_fps / fps)``; when that gives more than
``max_frames`` frames, ``max_frames`` are spread uniformly over the whole video instead
(``linspace(0, N - 1, max_frames).round()``, as :func:`data.video.decode.select_indices` does for ``num_frames``);
a video of two or more frames always gives at least two (first and last), which the temporal patch of two frames
needs; ``nframes`` asks for that many frames spread uniformly instead. Timestamps are ``frame index / native fps``,
the times the frames have in the source. With a pixel budget (``max_pixels``) a larger video is decoded straight at
about that many pixels per frame, its aspect ratio kept (decord resizes while decoding), never at full size first.

A video may also be a list of frame files (:func:`load_frames`): the frames are taken as sampled at ``fps``, so
frame ``k`` is at ``k / fps`` seconds, and more than ``max_frames`` are thinned as above.

Every file that is missing or cannot be decoded raises :class:`MediaError` (what
:class:`data.instruct.InstructDataset` skips), and so does a picture whose aspect ratio exceeds
:data:`MAX_ASPECT_RATIO` (the Qwen-VL processors refuse one) or frames of different sizes in one video.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["MediaError", "video_indices", "load_video", "load_video_indexed", "load_frames", "load_image",
           "MAX_ASPECT_RATIO"]  # fmt: skip

#: the largest long side / short side ratio the Qwen-VL image and video processors accept
MAX_ASPECT_RATIO = 200


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


def video_indices(num_frames: int, native_fps: float, *, fps: float, max_frames: int,
                  nframes: int | None = None) -> np.ndarray:  # fmt: skip
    """``(T,)`` int64 source frame indices of a ``num_frames``-frame video at ``native_fps`` sampled at ``fps``
    with at most ``max_frames`` frames, or ``nframes`` frames (at most ``num_frames``) spread uniformly when given
    (see the module docstring)."""
    _check_rate(fps, max_frames)
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if not (np.isfinite(native_fps) and native_fps > 0):
        raise ValueError(f"native_fps must be a positive number, got {native_fps!r}")
    if nframes is not None:
        if isinstance(nframes, bool) or not isinstance(nframes, (int, np.integer)) or nframes < 2:
            raise ValueError(f"nframes must be an integer >= 2 (a temporal patch is 2 frames), got {nframes!r}")
        return np.unique(np.linspace(0, num_frames - 1, min(int(nframes), num_frames)).round().astype(np.int64))
    step = float(native_fps) / float(fps)  # source frames per tick of the new rate
    ticks = np.arange(int(np.floor((num_frames - 1) / step + 1e-9)) + 1)
    idx = np.unique(np.minimum(np.round(ticks * step), num_frames - 1).astype(np.int64))
    if idx.size > max_frames:
        idx = np.linspace(0, num_frames - 1, int(max_frames)).round().astype(np.int64)
    elif idx.size < 2 <= num_frames:
        idx = np.array([0, num_frames - 1], dtype=np.int64)
    return idx


def load_video(path: str | os.PathLike, *, fps: float, max_frames: int, nframes: int | None = None,
               max_pixels: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(frames, timestamps)`` of a video file: ``(T, H, W, 3)`` uint8 RGB and ``(T,)`` float64 seconds
    (``index / native fps``), sampled at ``fps`` with at most ``max_frames`` frames (or ``nframes``), decoded at
    about ``max_pixels`` per frame when larger (module docstring). Use :func:`load_video_indexed` for the source
    indices and the native rate too."""
    frames, timestamps, _, _, _ = load_video_indexed(path, fps=fps, max_frames=max_frames, nframes=nframes,
                                                     max_pixels=max_pixels)  # fmt: skip
    return frames, timestamps


def fit_size(height: int, width: int, max_pixels: int | None) -> tuple[int, int]:
    """``(height, width)`` scaled down, aspect ratio kept, to at most about ``max_pixels`` (even sides, at least
    2); unchanged when within the budget or when ``max_pixels`` is None."""
    if max_pixels is None or height * width <= max_pixels:
        return height, width
    scale = (max_pixels / float(height * width)) ** 0.5
    return max(2, 2 * round(height * scale / 2)), max(2, 2 * round(width * scale / 2))


def _check_aspect(path: Path, height: int, width: int) -> None:
    if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(path, f"its frames are {width}x{height} pixels, an aspect ratio over {MAX_ASPECT_RATIO}:1 "
                               "that the Qwen-VL processors refuse; crop or pad it")  # fmt: skip


def load_video_indexed(path: str | os.PathLike, *, fps: float, max_frames: int, nframes: int | None = None,
                       max_pixels: int | None = None):  # fmt: skip
    """:func:`load_video` plus the ``(T,)`` source indices, the native fps and the source frame count."""
    import decord

    _check_rate(fps, max_frames)
    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")

    def open_reader(**size):
        try:
            return decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1, **size)
        except Exception as err:  # decord raises RuntimeError / DECORDError for files it cannot open
            raise MediaError(path, f"decord could not open it ({type(err).__name__}: {str(err)[:200]})") from None

    vr = open_reader()
    try:
        n, native = len(vr), float(vr.get_avg_fps())
        if n < 1:
            raise MediaError(path, "the video has no frames")
        if not (np.isfinite(native) and native > 0):
            raise MediaError(path, f"the video declares no usable frame rate ({native!r})")
        idx = video_indices(n, native, fps=fps, max_frames=max_frames, nframes=nframes)
        height, width = vr.next().shape[:2]  # one frame at the source size: the size to decode at
        _check_aspect(path, height, width)
        h, w = fit_size(height, width, max_pixels)
        if (h, w) != (height, width):
            del vr
            vr = open_reader(width=w, height=h)  # decoded straight at the budget
        else:
            vr.seek(0)
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


def load_frames(paths: list[str | os.PathLike], *, fps: float, max_frames: int, nframes: int | None = None,
                max_pixels: int | None = None):  # fmt: skip
    """A video given as its frame files, in order: the tuple of :func:`load_video_indexed` (``frames``,
    ``timestamps`` = ``index / fps``, ``indices``, ``fps`` as the native rate, the number of files).

    Raises:
        MediaError: a frame is missing or undecodable (naming it), or the frames differ in size.
    """
    _check_rate(fps, max_frames)
    if not paths:
        raise ValueError("a video made of frame files needs at least one file")
    idx = video_indices(len(paths), fps, fps=fps, max_frames=max_frames, nframes=nframes)
    frames = [load_image(paths[i], max_pixels=max_pixels) for i in idx.tolist()]
    bad = next((k for k, f in enumerate(frames) if f.shape != frames[0].shape), None)
    if bad is not None:
        (h0, w0), (h1, w1) = frames[0].shape[:2], frames[bad].shape[:2]
        raise MediaError(paths[idx[bad]], f"this frame is {w1}x{h1} pixels but the first frame ({paths[idx[0]]}) is "
                                          f"{w0}x{h0}; the frames of one video share one size")  # fmt: skip
    return np.stack(frames), idx.astype(np.float64) / float(fps), idx, float(fps), len(paths)


def load_image(path: str | os.PathLike, *, max_pixels: int | None = None) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB pixels of an image file (Pillow; truncated files raise, they are not padded),
    resized down to about ``max_pixels`` when larger (JPEG files are decoded at a reduced scale first)."""
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        raise MediaError(path, "no such file")
    try:
        with Image.open(path) as img:
            _check_aspect(path, img.height, img.width)
            h, w = fit_size(img.height, img.width, max_pixels)
            if (h, w) != (img.height, img.width):
                img.draft("RGB", (w, h))  # JPEG: decode at a power-of-two reduction no smaller than (w, h)
            img.load()  # decode now: a truncated file fails here, not later
            rgb = img.convert("RGB")
            if rgb.size != (w, h):
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    except MediaError:
        raise
    except Exception as err:  # PIL.UnidentifiedImageError, OSError("image file is truncated"), ...
        raise MediaError(path, f"Pillow could not decode it ({type(err).__name__}: {err})") from None
    return np.array(rgb, dtype=np.uint8)  # (H, W, 3), a writable copy
