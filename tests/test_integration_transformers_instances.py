"""The transformers patch lives on one model instance: deep copies, pickles, two models side by side, cached tables.

What is checked:
- ``copy.deepcopy`` of a patched model is patched on its own: ``remove`` on the copy leaves the original patched
  (and the reverse), for a 3-axis, the per-head (MHRoPE) and the layered (PyPE) variant, and each keeps working;
- ``torch.save(model)`` of a patched model loads back (``weights_only=False``) patched, with the same logits and
  generation, and ``remove`` on the loaded one restores the stock model;
- two models patched with different variants in one process each give what they give alone;
- the rotary module computes its frequency matrix once per device (same tensor, same ``data_ptr``, across
  forwards), and :func:`vlpe.encodings.multimodal.rotary` builds the allocation map on the host only once;
- no ``sys.modules`` anywhere in ``vlpe/integrations/``.
"""

from __future__ import annotations

import copy
import io
import pathlib

import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import (  # noqa: E402
    ATOL,
    _build,
    generate_and_teacher_force,
    logits,
    make_prompt,
)

from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

FAMILY = "qwen2_vl"


def _fresh(variant=None, family=FAMILY, **options):
    model = _build(family)
    if variant is not None:
        vhf.apply(model, variant, **options)
    return model


def _is_stock(model, stock_logits, data) -> bool:
    text = model.model.language_model
    if isinstance(text.rotary_emb, vhf.MultimodalRotary) or vhf.patch_of(model) is not None:
        return False
    if any(layer.self_attn._forward_pre_hooks or layer.self_attn._forward_hooks for layer in text.layers):
        return False
    if text._forward_pre_hooks or {"compute_3d_position_ids", "get_rope_index"} & set(model.model.__dict__):
        return False
    return torch.equal(logits(model, *data), stock_logits)


@pytest.mark.parametrize("variant", ["mrope_i", "mhrope", "pype"])
@pytest.mark.parametrize("which", ["copy", "original"])
def test_remove_on_a_deep_copy_leaves_the_other_patched(variant, which):
    data = make_prompt(FAMILY, "image")
    stock = logits(_fresh(), *data)
    model = _fresh(variant)
    patched_logits = logits(model, *data)
    assert (patched_logits - stock).abs().max() > 1e-3
    twin = copy.deepcopy(model)
    assert vhf.patch_of(twin) is not vhf.patch_of(model)
    assert vhf.patch_of(twin).model is twin and vhf.patch_of(model).model is model
    torch.testing.assert_close(logits(twin, *data), patched_logits, atol=0, rtol=0)
    removed, kept = (twin, model) if which == "copy" else (model, twin)
    vhf.remove(removed)
    assert _is_stock(removed, stock, data)
    assert vhf.patch_of(kept) is not None
    torch.testing.assert_close(logits(kept, *data), patched_logits, atol=0, rtol=0)
    _, steps, full = generate_and_teacher_force(kept, *data)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
    vhf.remove(kept)
    assert _is_stock(kept, stock, data)


@pytest.mark.parametrize("family,variant", [("qwen3_vl", "mhrope"), ("qwen2_5_vl", "pype"), ("qwen3_vl", "vrope")])
def test_deep_copies_of_other_families(family, variant):
    """Qwen3-VL rotates per head after its head-wise norms (their hooks); Qwen2.5-VL's time-aware videos."""
    data = make_prompt(family, "video")
    stock = logits(_fresh(family=family), *data)
    model = _fresh(variant, family=family)
    want = logits(model, *data)
    twin = copy.deepcopy(model)
    vhf.remove(model)
    assert _is_stock(model, stock, data)
    torch.testing.assert_close(logits(twin, *data), want, atol=0, rtol=0)
    _, steps, full = generate_and_teacher_force(twin, *data)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["videorope", "mhrope", "pype"])
def test_torch_save_of_a_patched_model(variant):
    data = make_prompt(FAMILY, "video")
    stock = logits(_fresh(), *data)
    model = _fresh(variant)
    want = logits(model, *data)
    want_seq, want_steps, _ = generate_and_teacher_force(model, *data)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert vhf.patch_of(loaded) is not None and vhf.patch_of(loaded).label == variant
    torch.testing.assert_close(logits(loaded, *data), want, atol=0, rtol=0)
    seq, steps, full = generate_and_teacher_force(loaded, *data)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(steps, want_steps, atol=0, rtol=0)
    torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
    vhf.remove(loaded)
    assert _is_stock(loaded, stock, data)
    torch.testing.assert_close(logits(model, *data), want, atol=0, rtol=0)  # the saved one is still patched


def test_two_models_with_different_variants_side_by_side():
    data = make_prompt(FAMILY, "video")
    alone = {}
    for variant in ("mhrope", "pype", "vrope"):
        alone[variant] = logits(_fresh(variant), *data)
    models = {variant: _fresh(variant) for variant in alone}
    for _ in range(2):
        for variant, model in models.items():
            torch.testing.assert_close(logits(model, *data), alone[variant], atol=0, rtol=0)
            assert vhf.patch_of(model).label == variant
    assert (alone["mhrope"] - alone["vrope"]).abs().max() > 1e-3


def test_rotary_tables_are_computed_once_per_device():
    model = _fresh("mrope_i")
    rotary = model.model.language_model.rotary_emb
    data = make_prompt(FAMILY, "image")
    logits(model, *data)
    (key,) = rotary.cached
    F = rotary.cached[key][0]
    ptr = F.data_ptr()
    logits(model, *make_prompt(FAMILY, "video"))
    generate_and_teacher_force(model, *data)
    assert list(rotary.cached) == [key]
    assert rotary.cached[key][0] is F and F.data_ptr() == ptr
    assert rotary.frequencies(torch.device("cpu"))[0].data_ptr() == ptr


def test_functional_rotary_builds_the_allocation_map_once(monkeypatch):
    from vlpe.encodings.multimodal import allocations

    ids, _ = mm.position_ids("mrope_i", torch.tensor([[0, 1, 1, 1, 1, 0]]), torch.tensor([[1, 4, 4]]))
    calls = []
    real = allocations._allocation_map
    monkeypatch.setattr(allocations, "_allocation_map", lambda *a: calls.append(a) or real(*a))
    allocations._on_device.cache_clear()
    first = mm.rotary("mrope_i", ids, head_dim=32, theta=1e4)
    second = mm.rotary("mrope_i", ids, head_dim=32, theta=1e4)
    assert len(calls) == 1
    a = allocations.allocation_map("interleaved", num_pairs=16, device=ids.device)
    b = allocations.allocation_map("interleaved", num_pairs=16, device=ids.device)
    assert a is b and a.data_ptr() == b.data_ptr()
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_no_sys_modules_in_the_integrations():
    root = pathlib.Path(vhf.__file__).resolve().parents[1]  # vlpe/integrations
    offenders = [str(p) for p in root.rglob("*.py") if "sys.modules" in p.read_text()]
    assert not offenders, offenders


def test_the_patch_holds_one_variant_with_every_option():
    """The variant of a patch carries every option of apply(): the functional API given that one object computes
    the ids and tables the patched model uses."""
    native = vhf.patch_of(_fresh("mrope")).variant
    assert native.section == (2, 3, 3) and native.theta == 1e4  # the checkpoint's mrope_section and rope_theta
    model = _fresh("mrope_i", spatial_reset=True, section=[4, 2, 2])
    v = vhf.patch_of(model).variant
    assert isinstance(v, mm.Variant) and v.name == "mrope_i"
    assert v.design_options == {"spatial_reset": True} and v.section == (4, 2, 2) and v.theta == 1e4
    data = make_prompt(FAMILY, "image")
    types, grid = data[1], data[2]["image_grid_thw"]
    pos, deltas = vhf.position_ids(model, types, grid)
    ids, want_deltas = mm.position_ids(v, types, grid)  # the same object drives the functional API
    torch.testing.assert_close(pos[1:], ids)
    torch.testing.assert_close(deltas, want_deltas)
    cos, sin = model.model.language_model.rotary_emb(torch.zeros(1), pos)
    want_cos, want_sin = mm.rotary(v, ids, head_dim=16)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)
    enc = mm.encoding(v, dim=128, num_heads=8)
    assert enc.active_variant is v
    with pytest.raises(TypeError):
        vhf.Patch(model, model.model, FAMILY, v, 2)  # keyword-only
