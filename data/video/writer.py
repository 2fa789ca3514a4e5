"""Writing H.264 mp4 through PyAV, at a constant rate or at real (variable) timestamps."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .decode import _require

__all__ = ["write_video"]


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
    yuv420p / crf 18 plays everywhere but needs even height and width, and its pixels are not reproducible: two
    writes of the same frames on one machine decoded up to 16 levels apart (write a data set that must be the same
    every time losslessly, as :func:`data.instruct.make_vniah_instruct` does).
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
