"""The library's surface as the README and the saved model cards show it.

Checked against: the README's "Using it" block (``README.md``), the public contract's ``attention_logits(enc, q, k,
pos, layer=0)`` (its results must not change), ``vlpe.attend``'s own signature (the order the keyword form follows),
the files that exist in this repository (for the files the evaluation scripts' ``--help`` cites), and
``models/vit.py``'s ``PRESETS`` (for the text of ``configs/_vit.yaml``).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import vlpe

ROOT = Path(__file__).resolve().parents[1]


def test_vlpe_testing_is_an_attribute_of_the_package():
    """``import vlpe`` alone (a fresh interpreter, nothing else imported) gives ``vlpe.testing.property_report``."""
    code = "import vlpe; print(callable(vlpe.testing.property_report), 'testing' in vlpe.__all__)"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stderr[-2000:]


def _inputs(layer_count: int = 2):
    torch.manual_seed(0)
    enc = vlpe.encodings.build("lookhere", dim=64, num_heads=4, depth=layer_count)
    pos = vlpe.Positions.grid(4, 4, prefix=1)
    q, k = torch.randn(2, 2, 4, 17, 16).unbind(0)
    return enc, pos, q, k


def test_attention_logits_takes_the_order_of_attend_and_keeps_the_contract():
    enc, pos, q, k = _inputs()
    contract = vlpe.attention_logits(enc, q, k, pos, layer=1)
    assert torch.equal(vlpe.attention_logits(enc, q, k, pos, 1), contract)
    assert torch.equal(vlpe.attention_logits(q, k, enc=enc, pos=pos, layer=1), contract)
    assert not torch.equal(vlpe.attention_logits(q, k, enc=enc, pos=pos), contract)  # layer 0 differs (LookHere)
    assert torch.equal(vlpe.attention_logits(q, k, enc=enc, pos=pos), vlpe.attention_logits(enc, q, k, pos))
    attend = list(inspect.signature(vlpe.attend).parameters)
    assert attend[:3] == ["q", "k", "v"] and inspect.signature(vlpe.attend).parameters["enc"].kind.name == "KEYWORD_ONLY"


def test_attention_logits_misuse_says_how_to_call_it():
    enc, pos, q, k = _inputs()
    with pytest.raises(TypeError, match=r"missing 'pos'.*attention_logits\(q, k, enc=enc, pos=pos"):
        vlpe.attention_logits(q, k, enc=enc)
    with pytest.raises(TypeError, match="'pos' both by position and by keyword"):
        vlpe.attention_logits(enc, q, k, pos, pos=pos)
    with pytest.raises(TypeError, match="at most 2 positional arguments"):
        vlpe.attention_logits(q, k, pos, enc=enc)


def test_readme_shows_one_argument_order():
    text = (ROOT / "README.md").read_text()
    using = text[text.index("## Using it") :]
    block = re.search(r"```python\n(.*?)```", using, flags=re.S).group(1)
    assert "vlpe.attention_logits(q, k, enc=enc, pos=pos" in block and "vlpe.attend(q, k, v, enc=enc" in block
    assert "vlpe.testing.property_report(" in block


def test_model_card_says_where_its_load_snippet_runs(tmp_path):
    from models.vit import ViT

    ViT(img_size=28, patch_size=4, embed_dim=32, depth=1, num_heads=4, num_classes=10).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "from models.vit import ViT" in card
    before = card[: card.index("from models.vit import ViT")]
    assert "checkout of the vlpe repository" in before and ".venv/bin/python" in before


@pytest.mark.parametrize("script", ["resolution.py", "long_video.py", "points.py"])
def test_eval_help_cites_files_that_exist(script):
    """``--help`` prints the module docstring: every ``.md`` / ``eval/*.py`` / ``configs/*`` file it names exists
    (besides the ``<script>.md`` table the script itself writes)."""
    doc = ast.get_docstring(ast.parse((ROOT / "eval" / script).read_text()))
    written = script.replace(".py", ".md")
    cited = {c for c in re.findall(r"[\w./-]+\.md\b", doc) if c != written} | set(re.findall(r"\b(?:eval|configs|data|models)/[\w./-]+", doc))
    assert cited, f"eval/{script}'s --help cites no file of the repository for its protocol"
    missing = [c for c in sorted(cited) if not (ROOT / c.rstrip(".")).exists()]
    assert not missing, f"eval/{script} --help cites {missing}, which are not in the repository"


def test_vit_defaults_describe_the_preset_they_use():
    from models.vit import PRESETS

    path = ROOT / "configs" / "_vit.yaml"
    text = path.read_text()
    preset = PRESETS[yaml.safe_load(text)["model"]["preset"]]
    comment = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    found = re.search(r"(\d+) blocks, width (\d+), (\d+) heads", comment)
    assert found, f"{path.name} should say the blocks, width and heads of its preset"
    assert tuple(map(int, found.groups())) == (preset["depth"], preset["embed_dim"], preset["num_heads"])
