"""Where vlpe keeps files it derives on a machine (built kernels, parsed meshes): ``$VLPE_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/vlpe``, else ``~/.cache/vlpe`` (the XDG base-directory convention)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["user_cache_dir"]


def user_cache_dir(sub: str = "") -> Path:
    """The cache folder (or its ``sub`` folder), not created here: callers create it with the mode they need."""
    root = os.environ.get("VLPE_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlpe")
    return Path(root) / sub if sub else Path(root)
