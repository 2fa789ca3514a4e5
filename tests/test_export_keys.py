"""The weights file of an export names its tensors as the source folder does, also after loading under ZeRO-3.

transformers 5.x reverses on save the key renamings it applied while loading; under DeepSpeed ZeRO-3 it records
every renaming of the architecture instead, and the save then writes ``model.model.layers.*`` for a source's
``model.layers.*``. The reference is the source file itself (safetensors headers). One process with a one-rank gloo
group stands in for a ZeRO-3 launch (the 2-rank launches of ``test_finetune_launch.py`` compare the same keys).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed, torch
    from transformers import AutoModelForImageTextToText
    from transformers.integrations import HfDeepSpeedConfig
    from vlpe.integrations import transformers as vlpe_hf
    deepspeed.init_distributed(dist_backend="gloo")
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    plain = AutoModelForImageTextToText.from_pretrained(source, local_files_only=True).state_dict()
    keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    stock = AutoModelForImageTextToText.from_pretrained(source, local_files_only=True)  # as train/finetune.py loads
    vlpe_hf.keep_used_conversions(vlpe_hf.apply(stock, "mrope_i"))
    vlpe_hf.save_pretrained(stock, out / "finetune", state_dict=plain)
    restored = vlpe_hf.from_pretrained(out / "finetune")  # vlpe's own loader under ZeRO-3
    vlpe_hf.save_pretrained(restored, out / "vlpe", state_dict=plain)
    """
)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_zero3_loaded_models_save_the_source_keys(family, tiny_qwen_vl, tmp_path):
    from train.finetune import weight_keys
    from train.launch import _free_port

    source = tiny_qwen_vl(family)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(source), str(tmp_path), str(_free_port())],
                       capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", **_env()})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    want = weight_keys(source)
    assert any(k.startswith("model.") for k in want)
    for kind in ("finetune", "vlpe"):
        got = weight_keys(tmp_path / kind)
        assert got == want, (kind, sorted(got - want)[:5], sorted(want - got)[:5])
    assert json.loads((tmp_path / "vlpe" / "config.json").read_text())["vlpe"]["variant"] == "mrope_i"


def test_an_export_with_other_keys_is_refused(tiny_qwen_vl, tmp_path):
    from safetensors.torch import load_file, save_file

    from train.finetune import check_keys

    source = tiny_qwen_vl("qwen2_vl")
    check_keys(source, source)
    tensors = load_file(source / "model.safetensors")
    save_file({("model." + k if k.startswith("model.") else k): v for k, v in tensors.items()},
              tmp_path / "model.safetensors")  # fmt: skip
    with pytest.raises(RuntimeError, match=r"only in the export \(e\.g\. \['model\.model\."):
        check_keys(tmp_path, source)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
