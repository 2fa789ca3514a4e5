"""``vlpe.native``: C kernels built on first use into a private cache, keyed by source, compiler and flags; reused
without the compiler; switched off by ``VLPE_NATIVE=0`` or ``native.off()``; a missing compiler is a quiet fallback,
a failing one a warning with its message; concurrent builds leave one complete library; a library others could
have written is not loaded."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from vlpe import native
from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal import grid_ids_native
from test_mm_helpers import require_grid_kernel

ADD = "int vlpe_test_add(int a, int b) { return a + b; }\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no library loaded yet in this process."""
    monkeypatch.setenv("VLPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VLPE_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native, "_LOADED", {})
    return tmp_path


def source(folder: Path, text: str = ADD, name: str = "add.c") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_a_kernel_is_built_once_into_a_private_cache_and_then_loaded_without_the_compiler(fresh, monkeypatch):
    src = source(fresh)
    lib = native.library(src)
    assert lib is not None and lib.vlpe_test_add(2, 3) == 5
    built = list((fresh / "cache" / "native").iterdir())
    assert [p.name.split("-")[0] for p in built] == ["add"] and built[0].suffix == ".so"  # no temporary left
    assert (built[0].parent.stat().st_mode & 0o777) == 0o700
    assert native.library(src) is lib  # loaded once per process

    def no_compiler(*a, **k):
        raise AssertionError("the compiler ran again for an unchanged source")

    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = native.library(src)
    assert again is not None and again.vlpe_test_add(4, 5) == 9


def test_a_changed_source_is_a_new_library(fresh):
    a = native.library(source(fresh))
    (fresh / "sub").mkdir()
    b = native.library(source(fresh, ADD.replace("a + b", "a - b"), name="sub/add.c"))  # same name, new text
    assert a.vlpe_test_add(2, 3) == 5 and b.vlpe_test_add(2, 3) == -1
    assert len(list((fresh / "cache" / "native").iterdir())) == 2


def test_kernels_are_off_with_vlpe_native_0_and_inside_off(fresh, monkeypatch):
    require_grid_kernel()  # loaded before the switch: the switch is read when a library first loads
    monkeypatch.setenv("VLPE_NATIVE", "0")
    assert not native.enabled() and native.library(source(fresh)) is None
    assert not any(fresh.glob("cache/native/add-*"))  # nothing built
    types, grid = torch.tensor([[0, 1, 1, 0]]), torch.tensor([[1, 2, 4]])
    kw = dict(m=2, stride=1, spatial_reset=False, pad_position=1, dtype=torch.int64)
    assert grid_ids_native.native_grid_ids(types, None, grid, **kw) is not None
    with native.off():
        with native.off():
            assert native.suspended()
        assert native.suspended() and grid_ids_native.native_grid_ids(types, None, grid, **kw) is None
    assert not native.suspended()


def test_no_compiler_is_a_quiet_fallback(fresh, monkeypatch):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.library(source(fresh)) is None


def test_a_failing_build_warns_with_the_compiler_message_and_falls_back(fresh):
    with pytest.warns(RuntimeWarning, match=r"building broken\.c .* failed(.|\n)*vlpe_broken"):
        assert native.library(source(fresh, "int vlpe_broken( {\n", name="broken.c")) is None
    assert not any((fresh / "cache" / "native").iterdir())  # no partial library, no temporary


def test_concurrent_builds_leave_one_complete_library(fresh):
    """Four processes build the same source at once (the ranks of one launch): every one loads a working library
    and one file is left."""
    src = source(fresh)
    go = fresh / "go"
    script = (  # import first, then wait for the others: the builds start together
        "import os, sys, time\n"
        "from vlpe import native\n"
        f"open(os.path.join({str(fresh)!r}, 'ready-' + sys.argv[1]), 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.005)\n"
        f"lib = native.library({str(src)!r})\n"
        "sys.exit(0 if lib is not None and lib.vlpe_test_add(20, 22) == 42 else 1)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], env=dict(os.environ)) for i in range(4)]
    deadline = time.monotonic() + 120
    while len(list(fresh.glob("ready-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    assert len(list((fresh / "cache" / "native").iterdir())) == 1


def test_the_grid_kernels_are_plain_c_with_the_declared_signatures():
    """The bindings' argument lists match the C functions' (a mismatch reads garbage, it does not raise)."""
    require_grid_kernel()
    text = (ROOT / "vlpe" / "encodings" / "multimodal" / "grid_ids.c").read_text()
    code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments out
    exported = re.findall(r"^int (vlpe_\w+)\(([^)]*)\)", code, flags=re.M)
    assert sorted(name for name, _ in exported) == sorted(grid_ids_native.SIGNATURES)
    for name, params in exported:
        kinds = [ctypes.c_void_p if "*" in p else ctypes.c_int if p.split()[0] == "int" else ctypes.c_int64
                 for p in params.split(",")]
        assert grid_ids_native.SIGNATURES[name] == kinds, name
        assert grid_ids_native._kernels()[name].argtypes == kinds
    assert "#include <Python.h>" not in code and "torch" not in code


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")  # merge_grids' constants
def test_the_kernels_are_not_called_inside_torch_compile(monkeypatch):
    """A ctypes call inside a compiled graph would break it: under ``torch.compile`` the tensor paths run."""
    from vlpe.encodings.multimodal.grid_ids import grid_position_ids

    def kernel_called(*a):
        raise AssertionError("the C kernel ran inside torch.compile")

    types, grid = torch.tensor([[0, 1, 1, 0, 2, 0]]), torch.tensor([[1, 2, 4], [1, 2, 2]])
    want = grid_position_ids(types, grid, validate=False)
    want_merged = mm.merge_grids(types, grid[:1], grid[1:])
    monkeypatch.setattr(grid_ids_native, "_FN", [dict.fromkeys(grid_ids_native.SIGNATURES, kernel_called)])
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, g: grid_position_ids(t, g, validate=False), backend="eager")
    got = compiled(types, grid)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    merged = torch.compile(lambda t, i, v: mm.merge_grids(t, i, v), backend="eager")(types, grid[:1], grid[1:])
    assert torch.equal(merged[0], want_merged[0]) and torch.equal(merged[1], want_merged[1])
    with pytest.raises(AssertionError, match="inside torch.compile"):  # and outside it, the kernels are called
        grid_position_ids(types, grid, validate=False)
    with pytest.raises(AssertionError, match="inside torch.compile"):
        mm.merge_grids(types, grid[:1], grid[1:])


def test_a_library_in_a_folder_others_can_write_is_not_loaded(fresh):
    src = source(fresh)
    assert native.library(src) is not None
    folder = fresh / "cache" / "native"
    folder.chmod(0o777)
    native._LOADED.clear()
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert native.library(src) is None
    folder.chmod(0o700)
    (lib,) = folder.iterdir()
    lib.chmod(0o666)
    native._LOADED.clear()
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert native.library(src) is None
