"""Small helpers shared by the data loaders: finding installed data, clear "missing package" errors, seeds.

Every data source of the project is a file installed by a Debian or PyPI package and found at run time;
nothing is downloaded. When a source is missing the loader raises :class:`MissingPackageError` whose
message is the exact command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = [
    "MissingPackageError",
    "require_debian_file",
    "python_package_dir",
    "cache_dir",
    "sample_rng",
    "check_choice",
    "check_positive_int",
]


class MissingPackageError(ImportError):
    """A data source (a Debian or PyPI package) is not installed; the message says how to install it."""


def require_debian_file(path: str | os.PathLike, package: str, *, what: str | None = None) -> Path:
    """Return ``path`` if it exists, else raise naming ``sudo apt-get install <package>``."""
    path = Path(path)
    if not path.exists():
        raise MissingPackageError(
            f"{what or path.name} not found at {path}: it is installed by the Debian package "
            f"'{package}'. Install it with `sudo apt-get install {package}`."
        )
    return path


def python_package_dir(module: str, *, pip_name: str | None = None) -> Path:
    """The install folder of a Python package, found without importing it (raises naming ``pip install``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"the Python package '{module}' is not installed. Install it with `pip install {pip_name or module}`."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def cache_dir(sub: str = "") -> Path:
    """Folder for derived files (parsed meshes).

    ``$VLPE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/vlpe``, else ``~/.cache/vlpe`` (the XDG base-directory
    convention); created if missing.
    """
    root = os.environ.get("VLPE_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlpe")
    path = Path(root) / sub if sub else Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sample_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on ``(seed, *keys)``: per-sample randomness independent of worker order."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *(int(k) for k in keys)])


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
