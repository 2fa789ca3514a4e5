"""The README's offline snippets run as written, within a memory budget far below a 24 GB machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: address-space limit of the process running the snippets: torch's import alone maps ~4 GB; the 1024 px ViT
#: forward must fit in what is left (an autograd graph at 4097 tokens x 12 layers needs well over 20 GB)
BUDGET = 10 * 2**30


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _block(marker: str) -> str:
    found = [b for b in _python_blocks() if marker in b]
    assert len(found) == 1, f"expected one README python block with {marker!r}, found {len(found)}"
    return found[0]


@pytest.mark.slow
def test_readme_encoding_and_timm_snippets_run_within_the_memory_budget(tmp_path):
    script = tmp_path / "snippets.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import resource
            resource.setrlimit(resource.RLIMIT_AS, ({BUDGET}, {BUDGET}))
            """
        )
        + _block("vlpe.attention_logits(")
        + _block('timm.create_model("vlpe_vit_base_patch16_224"')
        + "\nprint('snippets ok')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "snippets ok" in r.stdout, f"README snippets failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.mark.slow
def test_readme_timm_open_clip_and_hub_snippets_run_offline(tmp_path):
    """The timm API, open_clip and save/load blocks, in that order, from a scratch folder, network refused."""
    script = tmp_path / "ecosystem.py"
    script.write_text(
        "import huggingface_hub, torch, timm, models.vit\n"
        "def _refuse(*a, **k): raise AssertionError('network access attempted')\n"
        "huggingface_hub.hf_hub_download = _refuse\n"
        "top1 = 0.5  # what the README's reader measured\n"
        + _block("features_only=True, out_indices=(-2, -1)")
        + _block("import open_clip, models.clip")
        + _block(".save_pretrained(")
        + "\nassert sorted(p.name for p in __import__('pathlib').Path('vit-fmnist').iterdir()) == "
        "['README.md', 'config.json', 'model.safetensors']\nprint('snippets ok')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "snippets ok" in r.stdout, f"README snippets failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
