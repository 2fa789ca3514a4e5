"""Shared test setup: deterministic, quiet, single-threaded torch (CI has 2 cores, tests run in 2 workers), and a
private torch-extensions folder for the session.

DeepSpeed's launch tests JIT-load C++ ops through ``torch.utils.cpp_extension.load``, which takes a ``lock`` file
in the shared per-user build folder (``~/.cache/torch_extensions/py<ver>_<accel>``) and waits for it without a
limit: a build of another session (or a lock left by a killed one) held every launch test of a loaded machine until
its timeout. The session therefore builds in its own ``TORCH_EXTENSIONS_DIR``, created once by the controlling
process (xdist workers inherit it) and seeded from the user's cache with the built files as they are (ninja finds
them up to date: no recompile), lock files left out; it is removed at the end of the session.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

#: set (to the folder) in the process that created the session's private extensions folder
PRIVATE_EXTENSIONS = "VLPE_TEST_TORCH_EXTENSIONS"


def user_extensions_dir() -> Path:
    """The build folder ``torch.utils.cpp_extension`` uses without ``TORCH_EXTENSIONS_DIR``: the user cache's
    ``torch_extensions/py<major><minor><abiflags>_<rocmXX | cuXX | cpu>`` (``_get_build_directory`` in torch)."""
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}"


def private_extensions_dir(seed: Path) -> Path:
    """A new folder holding a copy of ``seed`` (modification times kept, ``lock`` files left out)."""
    target = Path(tempfile.mkdtemp(prefix="vlpe-test-torch-extensions-"))
    if seed.is_dir():
        shutil.copytree(seed, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock"), symlinks=True)
    return target


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER") or PRIVATE_EXTENSIONS in os.environ:
        return  # a worker: the controller's folder came with the environment
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    folder = private_extensions_dir(Path(given) if given else user_extensions_dir())
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    os.environ[PRIVATE_EXTENSIONS] = str(folder)
    config._vlpe_extensions = (folder, given)


def pytest_unconfigure(config):
    made = getattr(config, "_vlpe_extensions", None)
    if made is None:
        return
    folder, given = made
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(PRIVATE_EXTENSIONS, None)
    if given is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = given


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_qwen_vl(tmp_path_factory):
    """``tiny_qwen_vl(family)``: a tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder with a real processor and chat
    template (:func:`models.tiny_qwen_vl.save_tiny_qwen_vl`) knowing the V-NIAH words, made once per session."""
    folders: dict[str, object] = {}

    def make(family: str):
        from data.vniah import PHOTO_NEEDLES, QUESTIONS
        from models.tiny_qwen_vl import save_tiny_qwen_vl

        if family not in folders:
            folder = tmp_path_factory.mktemp(family) / f"tiny-{family}"
            folders[family] = save_tiny_qwen_vl(family, folder, texts=[QUESTIONS["needle"], *PHOTO_NEEDLES.values()],
                                                frame=28, max_frame=56)  # fmt: skip
        return folders[family]

    return make
