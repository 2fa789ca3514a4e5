"""RoPE scaling of the model config (``rope_parameters``: linear / yarn / dynamic) under vlpe variants, on the tiny
random Qwen2-VL of tests/test_integration_transformers.py.

What is checked:
- the tables of ``mrope`` and ``rope1d`` equal those of the stock rotary module of a model whose config scales
  RoPE, whether vlpe takes the model's own scaled frequencies, scales ``theta=`` itself from the config, or is
  given the equivalent vlpe ``scaling=`` dict (vlpe's primitive against transformers' rotary);
- dynamic NTK follows the largest position id as transformers' does;
- ``generate()`` equals one teacher-forced forward with scaling on, for several variants, and the scaling
  changes the outputs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import (  # noqa: E402
    ATOL,
    SPECIAL,
    TEXT,
    VISION,
    generate_and_teacher_force,
    logits,
    make_prompt,
    patched,
)
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # noqa: E402

from vlpe.encodings.functional.scaling import parse_scaling  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

ROPE = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 12, "beta_fast": 8,
                         "beta_slow": 2, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}
VLPE = {  # the same scaling written as vlpe options
    "linear": {"type": "linear", "factor": 3.0},
    "yarn": {"type": "yarn", "factor": 4.0, "original_size": 8},
    "yarn_untruncated": {"type": "yarn", "factor": 2.5, "original_size": 12, "beta_fast": 8, "beta_slow": 2,
                         "truncate": False},
}


def _model(rope: dict, *, max_pos: int = 32768):
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=dict(TEXT, max_position_embeddings=max_pos,
                         rope_parameters={**rope, "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(VISION, depth=1, embed_dim=32, hidden_size=128, num_heads=2),
        **SPECIAL,
    )
    return Qwen2VLForConditionalGeneration(cfg).eval()


def _ids(B=2, S=13, high=200):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, high, (3, B, S), generator=g)


@pytest.mark.parametrize("kind", sorted(VLPE))
def test_tables_equal_the_stock_rotary(kind):
    model = _model(ROPE[kind])
    text = model.model.language_model
    ids = _ids()
    x = torch.zeros(2, ids.shape[-1], 4)
    with torch.no_grad():
        cos0, sin0 = text.rotary_emb(x, ids)
        flat = ids[:1].expand(3, -1, -1)  # text-only ids: every axis equal, i.e. 1D RoPE
        cos1d, sin1d = text.rotary_emb(x, flat)
    assert (cos0 - text.rotary_emb(x, ids * 0)[0]).abs().max() > 1e-2  # sanity: positions matter
    for options in ({}, {"theta": 1e4}, {"scaling": VLPE[kind]}):
        with patched(model, "mrope", **options), torch.no_grad():
            cos, sin = text.rotary_emb(x, ids)
            torch.testing.assert_close(cos, cos0, atol=2e-6, rtol=0, msg=f"{kind} {options}")
            torch.testing.assert_close(sin, sin0, atol=2e-6, rtol=0, msg=f"{kind} {options}")
        with patched(model, "rope1d", **options), torch.no_grad():
            cos, sin = text.rotary_emb(x, flat[0])
            torch.testing.assert_close(cos, cos1d, atol=2e-6, rtol=0, msg=f"{kind} {options}")
            torch.testing.assert_close(sin, sin1d, atol=2e-6, rtol=0, msg=f"{kind} {options}")


@pytest.mark.parametrize("high", [10, 40, 300])
def test_dynamic_ntk_follows_the_positions(high):
    """Below max_position_embeddings (16) nothing changes; beyond it the base grows with the largest id."""
    model = _model(ROPE["dynamic"], max_pos=16)
    text = model.model.language_model
    ids = _ids(high=high)
    x = torch.zeros(2, ids.shape[-1], 4)
    with torch.no_grad():
        cos0, sin0 = text.rotary_emb(x, ids)  # the stock module updates its frequencies for this length
    for variant, options in (("mrope", {}), ("mrope", {"theta": 1e4})):
        with patched(model, variant, **options), torch.no_grad():
            cos, sin = text.rotary_emb(x, ids)
        # frequencies equal to an fp32 rounding: angles at ids ~300 differ by ~1e-5
        torch.testing.assert_close(cos, cos0, atol=2e-5, rtol=0)
        torch.testing.assert_close(sin, sin0, atol=2e-5, rtol=0)
    if high > 16:
        plain = _model({"rope_type": "default"})
        with torch.no_grad():
            assert (plain.model.language_model.rotary_emb(x, ids)[0] - cos0).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["mrope", "mrope_i", "mhrope", "rope1d", "videorope", "pype"])
@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_generate_equals_teacher_forcing_with_scaling(kind, variant):
    model = _model(ROPE[kind])
    with patched(model, variant):
        for prompt in ("image", "video"):
            ids, types, kw = make_prompt("qwen2_vl", prompt)
            seq, steps, full = generate_and_teacher_force(model, ids, types, kw)
            torch.testing.assert_close(steps, full, atol=ATOL, rtol=0, msg=f"{kind} {variant} {prompt}")
        ids, types, kw = make_prompt("qwen2_vl", "video")
        scaled = logits(model, ids, types, kw)
    with patched(model, variant, scaling=None):  # the same weights without the config's scaling
        assert (logits(model, ids, types, kw) - scaled).abs().max() > 1e-3


def test_time_only_scaling_option():
    """``scaling=`` with a per-axis factor: generation stays exact, and only the temporal pairs move."""
    model = _model({"rope_type": "default"})
    time_only = {"type": "yarn", "factor": {"t": 4.0}, "original_size": 4}
    with patched(model, "mrope", scaling=time_only):
        ids, types, kw = make_prompt("qwen2_vl", "video")
        seq, steps, full = generate_and_teacher_force(model, ids, types, kw)
        torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
        text = model.model.language_model
        spatial = torch.zeros(3, 1, 5, dtype=torch.long)
        spatial[1:] = torch.arange(5) * 7  # h and w move, t stays 0
        cos, _ = text.rotary_emb(torch.zeros(1, 5, 4), spatial)
    with patched(model, "mrope"):
        cos0, _ = text.rotary_emb(torch.zeros(1, 5, 4), spatial)
    m = parse_scaling(time_only, num_axes=3).attention_factor
    torch.testing.assert_close(cos / m, cos0, atol=1e-6, rtol=0)  # spatial pairs: only the temperature
    with pytest.raises(ValueError, match="axis 'x'"):
        vhf.apply(model, "mrope", scaling={"type": "linear", "factor": {"x": 2}})
    assert vhf.patch_of(model) is None
