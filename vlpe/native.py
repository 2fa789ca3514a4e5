"""Small C kernels, compiled on first use with the system's C compiler and loaded with :mod:`ctypes`.

A few host-side steps (the multimodal position ids of a batch) cost far less as one C loop than as the dozens of
torch calls they take in tensor form, whose fixed cost dominates at the sizes of a batch. :func:`library` builds a
C file of this package (plain C, no Python or torch headers: a build takes a fraction of a second) into a shared
library once, keyed by the hash of its source, the compiler and the flags, and loads it; every caller keeps its
tensor path and takes it where no library loads, so the kernels are an accelerator, never a requirement:

* ``VLPE_NATIVE=0`` turns them off for the process, ``with vlpe.native.off():`` for a block of code (every caller
  takes its tensor path; the benchmarks time both side by side this way);
* the compiler is ``$CC`` or ``cc``; without one the kernels are off;
* libraries live under ``$VLPE_CACHE_DIR/native`` (else ``$XDG_CACHE_HOME/vlpe/native``, else
  ``~/.cache/vlpe/native``), a directory made private to the user. A build writes a temporary file there and
  renames it into place, so concurrent processes (the ranks of one launch) never load a partial library;
* a compiler that fails warns once, with its message, and the kernels stay off in that process;
* a library is loaded only from a folder and a file owned by the user and writable by nobody else (a warning
  otherwise): loading one runs its code.

Portable flags only (``-O2``, no ``-march=native``): a cache on a shared home directory may be loaded by machines
of another CPU generation. ``tests/test_native.py`` checks the build, the reuse of a built library, the switch and
the failure paths.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from .cache import user_cache_dir

__all__ = ["library", "enabled", "off", "suspended", "cache_dir", "FLAGS"]

#: the compiler flags of every build (part of the cache key)
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")

_LOADED: dict[str, ctypes.CDLL | None] = {}
_OFF = [0]  # depth of open `off()` blocks


@contextlib.contextmanager
def off():
    """Inside this block every caller takes its tensor path (process-wide; blocks may nest)."""
    _OFF[0] += 1
    try:
        yield
    finally:
        _OFF[0] -= 1


def suspended() -> bool:
    """True inside :func:`off`: callers check it on every call (one list read)."""
    return _OFF[0] > 0


def enabled() -> bool:
    """False when ``VLPE_NATIVE`` is ``0`` (or ``false``, ``no``, ``off``): callers take their tensor paths."""
    return os.environ.get("VLPE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built libraries are kept: ``$VLPE_CACHE_DIR/native``, else ``$XDG_CACHE_HOME/vlpe/native``, else
    ``~/.cache/vlpe/native`` (:func:`vlpe.cache.user_cache_dir`)."""
    return user_cache_dir("native")


def library(source: str | os.PathLike) -> ctypes.CDLL | None:
    """The shared library built from the C file ``source``, or None (kernels off, no compiler, a failed build).

    Built once per (source, compiler, flags) into :func:`cache_dir` and loaded once per process; later calls
    return the loaded library (a dict lookup)."""
    key = os.fspath(source)
    if key in _LOADED:
        return _LOADED[key]
    lib = None
    if enabled():
        lib = _build_and_load(Path(source))
    _LOADED[key] = lib
    return lib


def _build_and_load(source: Path) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return None  # no compiler: the tensor paths (documented above)
    text = source.read_bytes()
    digest = hashlib.sha256(b"\0".join([text, os.fsencode(compiler), *(f.encode() for f in FLAGS)])).hexdigest()
    where = cache_dir()
    target = where / f"{source.stem}-{digest[:20]}.so"
    if not target.exists():
        try:
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{source.stem}-", suffix=".so")
            os.close(fd)
            try:
                done = subprocess.run([compiler, *FLAGS, "-o", tmp, os.fspath(source)], capture_output=True,
                                      text=True, timeout=120)
                if done.returncode != 0:
                    warnings.warn(f"vlpe: building {source.name} with {compiler} failed, so its tensor path is used "
                                  f"(set VLPE_NATIVE=0 to silence this):\n{done.stderr.strip()[-2000:]}",
                                  RuntimeWarning, stacklevel=3)
                    return None
                os.replace(tmp, target)  # atomic: a concurrent build replaces an identical file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as e:
            warnings.warn(f"vlpe: could not build {source.name} in {where} ({e}), so its tensor path is used "
                          "(set VLPE_NATIVE=0 or VLPE_CACHE_DIR)", RuntimeWarning, stacklevel=3)
            return None
    unsafe = _unsafe(where, target)
    if unsafe:
        warnings.warn(f"vlpe: not loading {target}: {unsafe}, so the tensor path of {source.name} is used (a library "
                      "there runs as this user; fix the permissions or set VLPE_CACHE_DIR to a private folder)",
                      RuntimeWarning, stacklevel=3)
        return None
    try:
        return ctypes.CDLL(os.fspath(target))
    except OSError as e:
        warnings.warn(f"vlpe: could not load {target} ({e}), so the tensor path of {source.name} is used",
                      RuntimeWarning, stacklevel=3)
        return None


def _unsafe(folder: Path, target: Path) -> str:
    """Why loading ``target`` would run code another user could have written (empty when it is safe): the
    folder or the library not owned by this user, or writable by group or others."""
    if not hasattr(os, "getuid"):
        return ""
    for path in (folder, target):
        st = path.stat()
        if st.st_uid != os.getuid():
            return f"{path} belongs to another user"
        if st.st_mode & 0o022:
            return f"{path} is writable by group or others"
    return ""
