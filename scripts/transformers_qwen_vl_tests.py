"""Run transformers' own Qwen2-VL / Qwen2.5-VL / Qwen3-VL modeling tests twice, stock and with every model the tests
build patched with its checkpoint's own vlpe variant, and print the outcomes side by side.

The test files are not in the transformers wheel (the sdist ships only the top-level ``tests/*.py``). Take them
from a checkout of the installed version, e.g.::

    V=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
    git clone --depth 1 --branch v$V https://github.com/huggingface/transformers /tmp/transformers
    .venv/bin/python -m pip install --target /tmp/hf-deps parameterized   # transformers' test dependency
    .venv/bin/python scripts/transformers_qwen_vl_tests.py --tests /tmp/transformers/tests --pythonpath /tmp/hf-deps

It runs ``<tests>/models/<family>/test_modeling_<family>.py`` for each family (``--families``; ``-k`` and other
pytest options after ``--``), writes one JUnit XML per run to ``--out`` and prints, per family, tests run, passed,
failed and skipped, stock vs patched, and every test whose outcome differs with the first line of its failure.

The patched run loads this file as a pytest plugin: the ``__init__`` of every Qwen-VL ``*Model`` and
``*ForConditionalGeneration`` class is wrapped so that the outermost construction (``from_pretrained``, the meta
device and ``skip_weight_init`` contexts included) ends with ``vlpe.integrations.transformers.apply(model, V)``,
``V`` the variant that reproduces the family (:data:`FAMILY_VARIANTS`). Nothing of transformers is edited.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET

from vlpe.encodings.multimodal.checkpoints import FAMILY_VARIANTS  # each family's own design and allocation

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_PATCH_ENV = "VLPE_QWEN_VL_PATCH"
_CLASSES = {
    "qwen2_vl": ("Qwen2VLModel", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLModel", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLModel", "Qwen3VLForConditionalGeneration"),
}
_depth = threading.local()


# -- the pytest plugin of the patched run ------------------------------------------------------------------------


def _patch_on_construction(cls: type, variant: str) -> None:
    """Wrap ``cls.__init__``: the outermost model built applies ``variant`` (inner ``*Model`` builds do not)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _depth.n = depth
        if depth == 0:
            from vlpe.integrations import transformers as vhf

            vhf.apply(self, variant)

    cls.__init__ = __init__


def pytest_configure(config) -> None:
    """Install the construction wrappers when the runner asks for the patched run."""
    if not os.environ.get(_PATCH_ENV):
        return
    import importlib

    for family, names in _CLASSES.items():
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in names:
            _patch_on_construction(getattr(module, name), FAMILY_VARIANTS[family])


# -- the runner --------------------------------------------------------------------------------------------------


def outcomes(junit: pathlib.Path) -> dict[str, tuple[str, str]]:
    """``{test id: (passed | failed | skipped, first line of the message)}`` of one JUnit XML file."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, message = "failed", (child.get("message") or child.text or "").strip()
            elif child.tag == "skipped":
                state, message = "skipped", (child.get("message") or "").strip()
        result[name] = (state, message.splitlines()[0][:200] if message else "")
    return result


def run(tests: pathlib.Path, family: str, patched: bool, out: pathlib.Path, extra: list[str],
        pythonpath: list[str]) -> dict[str, tuple[str, str]]:
    """One pytest run of a family's modeling tests; its outcomes."""
    target = tests / "models" / family / f"test_modeling_{family}.py"
    if not target.is_file():
        raise SystemExit(f"{target} not found: --tests must be transformers' tests/ folder (see this script's doc)")
    junit = out / f"{family}-{'patched' if patched else 'stock'}.xml"
    env = dict(os.environ)
    plugin = str(pathlib.Path(__file__).resolve().parent)  # this file, as the plugin of the patched run
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, plugin, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop(_PATCH_ENV, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", str(target)]
    if patched:
        env[_PATCH_ENV] = "1"
        command[3:3] = ["-p", pathlib.Path(__file__).stem]
    subprocess.run([*command, *extra], cwd=tests.parent, env=env, check=False, stdout=subprocess.DEVNULL)
    return outcomes(junit)


def counts(results: dict[str, tuple[str, str]]) -> str:
    states = [s for s, _ in results.values()]
    return (f"run {len(states)}, passed {states.count('passed')}, failed {states.count('failed')}, "
            f"skipped {states.count('skipped')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=pathlib.Path, required=True, help="transformers' tests/ folder")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/vlpe-transformers-tests"))
    parser.add_argument("--pythonpath", action="append", default=[], help="a folder with the tests' dependencies")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest options (-k ...)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tests = args.tests.resolve()
    for family in args.families:
        stock = run(tests, family, False, args.out, args.pytest_args, args.pythonpath)
        patched = run(tests, family, True, args.out, args.pytest_args, args.pythonpath)
        print(f"{family} ({FAMILY_VARIANTS[family]})")
        print(f"  stock:   {counts(stock)}")
        print(f"  patched: {counts(patched)}")
        for name in sorted(set(stock) | set(patched)):
            a, b = stock.get(name, ("absent", "")), patched.get(name, ("absent", ""))
            if a[0] != b[0]:
                print(f"  differs: {name}: stock {a[0]}, patched {b[0]} {b[1] or a[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
