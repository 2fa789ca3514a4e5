"""The README's shell commands run as printed from a fresh shell, after ``make demo`` (which installs ``.venv``).

Checked against ``README.md`` itself. Its *shell blocks* are the fenced blocks without a language (or ``sh`` /
``bash`` / ``shell``) whose first line starts with a command (``make``, ``python``, ``deepspeed``, ``.venv/bin/...``,
``.`` / ``source``); the layout block and the Python blocks are not (``tests/test_reliability_readme.py`` runs
those). Each shell block runs in its own ``bash``, in the checkout root, with a fresh environment: ``PATH`` holds
the system folders only (no virtual environment), no ``PYTHONPATH``, no ``VIRTUAL_ENV``. The rule for what runs:

* a block that trains is skipped whole: one of its commands sets ``train.out_dir=`` (it trains a run that its later
  commands read, as the fine-tuning walkthroughs do) or is a ``python -c`` program (it writes a data set or a model
  folder first). These take minutes to hours; the other blocks' cheap forms below cover their launchers;
* ``make`` lines are not run: ``make demo`` / ``make test`` are the set-up this test assumes and the long jobs;
* activation lines (``.`` / ``source``), ``cd`` and ``export`` run exactly as printed;
* a command that runs ``train/X.py`` or ``eval/X.py`` (through ``python``, ``deepspeed`` with its launcher flags, or
  their ``.venv/bin/`` forms) runs as printed up to the script, with ``--help`` in place of its arguments (which
  would train or evaluate); for ``train/X.py`` the printed arguments are then parsed and checked as the script's
  first line does (``train/cli.py::parse``: the YAML, every override, the DeepSpeed config, with the world size of
  ``--num_gpus``), by the interpreter the printed launcher runs, from a scratch folder (``--config configs/...``
  resolves from any folder).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGS = {"", "sh", "bash", "shell"}
COMMAND = re.compile(r"^(make|python3?|deepspeed|\.venv/bin/\S+|\.|source)(\s|$)")
LAUNCHER = re.compile(r"^(?:\S*/)?(python3?|deepspeed)$")

#: parses a training script's command line as its main() does (with the config class of ``train/<script>_setup.py``),
#: without training
CHECK = (
    "import dataclasses, importlib, sys\n"
    "from train.cli import parse\n"
    "mod = importlib.import_module('train.' + sys.argv[1] + '_setup')\n"
    "found = [c for n, c in vars(mod).items() if n.endswith('Config') and dataclasses.is_dataclass(c)\n"
    "         and c.__module__ == mod.__name__ and 'train' in {f.name for f in dataclasses.fields(c)}]\n"
    "assert len(found) == 1, f'train/{sys.argv[1]}_setup.py: expected one config class, found {found}'\n"
    "parse(found[0], sys.argv[2:])\n"
    "print('config ok:', sys.argv[1])\n"
)


def shell_blocks() -> list[tuple[int, str]]:
    """``(line number, text)`` of every shell block of the README."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        lang, body = m.group(1), m.group(2)
        first = next((ln.strip() for ln in body.splitlines() if ln.strip()), "")
        if lang in SHELL_LANGS and COMMAND.match(first):
            out.append((text[: m.start()].count("\n") + 1, body))
    return out


def commands(block: str) -> list[str]:
    """The block's commands, backslash continuations joined, trailing comments kept out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def trains(cmds: list[str]) -> bool:
    return any("train.out_dir=" in c or re.search(r"(^|\s)-c\s", c) for c in cmds)


def cheap_form(cmd: str) -> list[str]:
    """The shell lines that stand for ``cmd`` (see the module docstring)."""
    words = shlex.split(cmd, comments=True)
    if not words or words[0] == "make":
        return []
    if words[0] in (".", "source", "cd", "export"):
        return [cmd]
    script = next((i for i, w in enumerate(words) if re.fullmatch(r"(train|eval)/\w+\.py", w)), None)
    assert script is not None and LAUNCHER.match(words[0]), f"README command of an unknown kind: {cmd!r}"
    launch, path, args = words[:script], words[script], words[script + 1 :]
    lines = [shlex.join([*launch, path, "--help"]) + " > /dev/null"]
    if path.startswith("train/"):
        if launch[0].endswith("deepspeed"):
            interp = f'"$(head -1 "$(command -v {shlex.quote(launch[0])})" | sed "s/^#!//")"'
            gpus = launch[launch.index("--num_gpus") + 1] if "--num_gpus" in launch else "1"
        else:
            interp, gpus = shlex.quote(launch[0] if "/" not in launch[0] else str(ROOT / launch[0])), "1"
        stem = Path(path).stem
        lines.append(
            f'(cd "$SCRATCH" && WORLD_SIZE={shlex.quote(gpus)} {interp} -c {shlex.quote(CHECK)} '
            f"{shlex.quote(stem)} {shlex.join(args)})"
        )
    return lines


def fresh_env(scratch: Path) -> dict:
    keep = {k: os.environ[k] for k in ("HOME", "LANG", "LC_ALL", "TERM") if k in os.environ}
    return {**keep, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SCRATCH": str(scratch),
            "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}  # fmt: skip


def test_the_readme_has_the_shell_blocks_this_test_reads():
    blocks = shell_blocks()
    cmds = [c for _, b in blocks for c in commands(b)]
    assert any(c.startswith("make demo") for c in cmds)
    assert any("train/points.py" in c for c in cmds) and any(c.startswith("deepspeed") for c in cmds)
    assert not any("positions.py" in b for _, b in blocks)  # the layout block is not a shell block


@pytest.mark.slow
@pytest.mark.parametrize("line", [n for n, b in shell_blocks() if not trains(commands(b))])
def test_readme_shell_block_runs_from_a_fresh_shell(line, tmp_path):
    block = dict(shell_blocks())[line]
    lines = [ln for c in commands(block) for ln in cheap_form(c)]
    if not lines:
        pytest.skip(f"README.md:{line}: only make targets (the set-up this test assumes)")
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=fresh_env(tmp_path), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, (
        f"README.md:{line}: the block does not run from a fresh shell as printed.\nran:\n{script}\n"
        f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
    )
    assert r.stdout.count("config ok:") == sum(ln.startswith('(cd "$SCRATCH"') for ln in lines)
