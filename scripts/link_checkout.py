"""Put this checkout's root on the running environment's import path (``scripts/setup.sh`` runs it).

    .venv/bin/python scripts/link_checkout.py          # writes <site-packages>/vlpe-checkout.pth
    .venv/bin/python scripts/link_checkout.py --check  # exit 1 when the file is missing or names another folder

The wheel holds the library (``vlpe``) only. The harness (``models``, ``data``, ``train``, and ``eval`` /
``benchmarks`` scripts that import them) runs from a checkout: ``python eval/report.py`` or
``deepspeed train/vlm.py`` start with their own folder as ``sys.path[0]``, so the root has to come from the
environment. A ``.pth`` file naming the root adds it as a plain path entry at start-up; no script edits its path.

The path entry also settles which ``vlpe`` a script imports when a folder named ``vlpe`` that is *not* a
package sits next to it (e.g. ``~/src/vlpe`` holding this repository, and a script in ``~/src``). Python's
path finder (first on ``sys.meta_path``) walks ``sys.path`` in order; the script's folder comes first and its
``vlpe/`` (no ``__init__.py``) is remembered as a namespace portion while the walk goes on. With only
setuptools' editable finder installed (appended to ``sys.meta_path``, consulted after the path finder), no path
entry holds a regular ``vlpe`` package, so the path finder returns the namespace package and the editable
finder is never asked: ``import vlpe.encodings`` then fails. With the checkout root on ``sys.path``, the walk
reaches ``<root>/vlpe/__init__.py``, a regular package, which wins over namespace portions wherever they are.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

NAME = "vlpe-checkout.pth"
ROOT = Path(__file__).resolve().parents[1]


def pth_path() -> Path:
    """Where the file goes: the running environment's ``purelib`` (site-packages)."""
    return Path(sysconfig.get_paths()["purelib"]) / NAME


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check that the file names this checkout")
    args = p.parse_args(argv)
    path, want = pth_path(), f"{ROOT}\n"
    have = path.read_text() if path.is_file() else None
    if have == want:
        return 0
    if args.check:
        print(f"{path}: {'missing' if have is None else 'names ' + have.strip()}; expected {ROOT}")
        return 1
    path.write_text(want)
    print(f"[setup] {path} -> {ROOT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
