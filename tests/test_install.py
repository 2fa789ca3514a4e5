"""What an install puts where: the wheel holds ``vlpe`` only; the harness runs from the checkout through a path
entry (``scripts/link_checkout.py``, run by ``scripts/setup.sh``), never through ``sys.path`` edits in scripts;
a script next to a non-package folder named ``vlpe`` still imports the library; outputs default to ``outputs/``."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ("eval", "train", "models", "data", "benchmarks")
SKIP = shutil.ignore_patterns(".git", ".venv", ".venv-lmms", "outputs", "runs", "build", "*.egg-info", "__pycache__",
                              "*.pyc")  # fmt: skip


def _env() -> dict[str, str]:
    """The caller's environment without anything that would put the checkout on the path by other means."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel .`` builds from a copy of the checkout (once per module)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP, symlinks=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist")], cwd=src, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (built,) = (tmp / "dist").glob("vlpe-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_the_library_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"vlpe", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, sorted(top)
    assert "vlpe/encodings/__init__.py" in names and "vlpe/tokenizers/__init__.py" in names
    assert not any(n.endswith((".c", ".h", ".so")) for n in names), "the library is pure Python: no C source or build"
    assert not any(n.startswith("vlpe/demo") for n in names)  # the demo CLI is eval/properties.py


def _venv_like_setup(tmp_path: Path) -> tuple[Path, list[str]]:
    """A fresh venv that sees this interpreter's packages (torch, ...) as plain path entries (their own ``.pth``
    files, e.g. an editable finder of another checkout, are not run), like ``.venv`` before ``link_checkout``."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_env()).stdout.strip()  # fmt: skip
    deps = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    deps = [d for d in deps if Path(d).is_dir()]
    (Path(purelib) / "zz-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    return py, deps


@pytest.mark.slow
def test_every_module_of_the_wheel_imports_without_the_checkout(wheel, tmp_path):
    """The wheel installed into a fresh venv (its dependencies visible, the checkout not): every module under
    ``vlpe`` imports, from the installed copy, and ``models`` (the harness) is not importable there."""
    py, _ = _venv_like_setup(tmp_path)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_env()).stdout.strip()  # fmt: skip
    zipfile.ZipFile(wheel).extractall(purelib)  # a pure-Python wheel installs by unpacking into site-packages
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = (
        "import importlib, importlib.util, pkgutil, vlpe\n"
        "assert importlib.util.find_spec('models') is None, 'the harness is importable: not a wheel-only env'\n"
        "names = [m.name for m in pkgutil.walk_packages(vlpe.__path__, 'vlpe.')]\n"
        "failed = []\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print(vlpe.__file__)\nprint(len(names))\nprint('\\n'.join(failed))\n"
    )
    r = subprocess.run([str(py), "-c", script], cwd=work, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lib, count, *failed = r.stdout.splitlines()
    assert Path(lib).is_relative_to(purelib), lib  # the installed copy, not the checkout
    assert int(count) > 40
    assert not [f for f in failed if f], "modules of the wheel that do not import without the checkout:\n" + "\n".join(failed)


@pytest.mark.slow
def test_script_next_to_a_checkout_named_vlpe_imports_the_library(tmp_path):
    """``<dir>/vlpe -> <repo root>`` (a folder without ``__init__.py``) beside a script in ``<dir>``: the script's
    folder is ``sys.path[0]``, so the path finder meets the namespace portion first; with the checkout root on the
    path (the ``.pth`` of ``scripts/link_checkout.py``) it still finds the regular package and that one wins."""
    py, deps = _venv_like_setup(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "vlpe").symlink_to(ROOT, target_is_directory=True)
    (work / "script.py").write_text(
        "import vlpe, vlpe.encodings, models.vit, data.points, train.engine\n"
        "print(vlpe.__file__)\nprint(vlpe.encodings.__file__)\nprint(len(vlpe.encodings.available()), vlpe.Positions)\n"
    )
    # without the path entry the folder shadows the library: a namespace package with no attributes
    if not any((Path(d) / "vlpe" / "__init__.py").is_file() for d in deps):  # (a regular install would win)
        before = subprocess.run([str(py), "script.py"], cwd=work, env=_env(), capture_output=True, text=True,
                                timeout=900)  # fmt: skip
        assert before.returncode != 0 and "vlpe" in before.stderr
    link = subprocess.run([str(py), str(ROOT / "scripts" / "link_checkout.py")], env=_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert link.returncode == 0 and "vlpe-checkout.pth" in link.stdout, link.stdout + link.stderr
    r = subprocess.run([str(py), "script.py"], cwd=work, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lib, enc, count = r.stdout.splitlines()[:3]
    assert Path(lib) == ROOT / "vlpe" / "__init__.py"
    assert Path(enc) == ROOT / "vlpe" / "encodings" / "__init__.py"
    assert int(count.split()[0]) > 10
    # idempotent: a second run changes nothing and prints nothing; --check agrees
    again = subprocess.run([str(py), str(ROOT / "scripts" / "link_checkout.py")], env=_env(), capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert again.returncode == 0 and again.stdout == ""
    check = [str(py), str(ROOT / "scripts" / "link_checkout.py"), "--check"]
    assert subprocess.run(check, env=_env(), capture_output=True, timeout=60).returncode == 0


def test_setup_script_parses_and_links_the_checkout_on_every_run():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "setup.sh")]).returncode == 0
    lines = [ln for ln in (ROOT / "scripts" / "setup.sh").read_text().splitlines() if ln.strip()]
    assert lines[-1].strip() == '"$VENV/bin/python" scripts/link_checkout.py'  # after the stamp check, not in it
    assert not any(re.match(r"\s*exit 0", ln) for ln in lines)


def test_harness_never_edits_sys_path():
    offenders = [str(p.relative_to(ROOT)) for d in HARNESS for p in (ROOT / d).rglob("*.py") if "sys.path" in p.read_text()]
    offenders += [str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")
                  if p.name != Path(__file__).name and "sys.path.insert" in p.read_text()]  # fmt: skip
    assert not offenders, offenders


def test_outputs_default_to_outputs_not_results():
    """Every ``--out`` of an evaluation or benchmark script defaults under ``outputs/`` (``results/`` is written by
    ``eval/report.py`` alone, through its own ``--results``)."""
    pattern = re.compile(r"add_argument\(\s*\"--out\"[^)]*?default=([^,)]+)")
    found = 0
    for path in [*(ROOT / "eval").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for default in pattern.findall(path.read_text()):
            found += 1
            assert "outputs" in default or default.strip() == "None", f"{path.name}: --out default {default}"
            assert "results" not in default, f"{path.name}: --out default {default}"
    assert found >= 8


def _fake_tools(tmp_path: Path, *, uid: int, sudo: bool) -> tuple[dict[str, str], Path]:
    """A PATH of the tools scripts/setup.sh calls, with dpkg (every package missing), apt-get, sudo and id faked to
    log their calls, and a .venv whose stamp matches the checkout (no pip run) and whose python logs its calls."""
    import hashlib

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    for tool in ("bash", "cat", "sha256sum", "cut", "dirname"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    fakes = {"dpkg": "exit 1", "apt-get": "exit 0", "id": f"echo {uid}", **({"sudo": '"$@"'} if sudo else {})}
    for tool, body in fakes.items():
        (bin_dir / tool).write_text(f"#!{shutil.which('bash')}\necho {tool} \"$@\" >> {log}\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    venv_dir = tmp_path / "venv"
    (venv_dir / "bin").mkdir(parents=True)
    (venv_dir / "bin" / "python").write_text(f"#!{shutil.which('bash')}\necho python \"$@\" >> {log}\n")
    (venv_dir / "bin" / "python").chmod(0o755)
    digest = hashlib.sha256((ROOT / "requirements.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes())
    (venv_dir / ".vlpe-installed").write_text(digest.hexdigest() + "\n")
    return {"PATH": str(bin_dir), "VENV": str(venv_dir), "HOME": str(tmp_path)}, log


def test_setup_of_the_venv_alone_needs_no_root(tmp_path):
    env, log = _fake_tools(tmp_path, uid=1000, sudo=False)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "python"], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls == ["python scripts/link_checkout.py"], calls  # no dpkg, apt-get or sudo
    assert "@bash scripts/setup.sh python" in (ROOT / "Makefile").read_text().split("setup:", 1)[1].split("\n\n")[0]


def test_the_data_packages_without_root_or_sudo_are_a_clear_error(tmp_path):
    env, log = _fake_tools(tmp_path, uid=1000, sudo=False)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 1
    assert "is not root and has no sudo; ask an administrator to run 'apt-get install dataset-fashion-mnist" in r.stderr
    assert "fine-tuning need none of them (make setup sets up the .venv alone)" in r.stderr
    assert not any(c.startswith("apt-get") for c in log.read_text().splitlines())
    env, log = _fake_tools(tmp_path / "sudo", uid=1000, sudo=True)  # with sudo: through it, after the venv
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[-1] == "python scripts/link_checkout.py"
    assert "sudo apt-get update -qq" in calls and calls.index("sudo apt-get update -qq") > 0
