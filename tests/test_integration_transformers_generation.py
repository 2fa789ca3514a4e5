"""Generation paths of transformers beyond plain ``generate()`` on a patched model: assisted decoding, compiled
fullgraph decoding with a static cache, and building on the meta device (tiny random models, no weights).

What is checked, on Qwen2-VL, Qwen2.5-VL and Qwen3-VL:
- assisted greedy decoding (``generate(assistant_model=...)``; exact in transformers) returns the patched model's own
  greedy generation, with the model itself as assistant (every draft accepted: the main model takes several new
  tokens at once) and with another patched model (drafts rejected: the cache is cropped), for a prompt with an
  image and a video, under the checkpoint's own variant and under variants whose ids differ from stock;
- ``generate`` with a static cache and a ``torch.compile(fullgraph=True)`` decode step (``compile_config``) gives
  the eager tokens and logits (the decision prompt / cached prefix reads no device value);
- a patched model built on the meta device, moved with ``to_empty`` and initialised (``init_weights``, as
  transformers' ``test_init_weights_can_init_buffers`` does) has the buffers of one built normally (the stock ones).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integration_transformers import IMG, MERGE, VE, VID, VS, _build, _pixels  # noqa: E402
from transformers import CompileConfig  # noqa: E402
from transformers.initialization import no_init_weights  # noqa: E402

from vlpe.integrations import transformers as vhf  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
OWN = {"qwen2_vl": "mrope", "qwen2_5_vl": "qwen25vl", "qwen3_vl": "qwen3vl"}  # the checkpoint's own variant


def image_and_video_prompt(family: str, *, grid=(1, 4, 4), vgrid=(2, 4, 4)):
    """``(input_ids, mm_token_type_ids, vision kwargs)``: text, an image, text, a video, text (batch 1)."""
    toks = [10, 11, VS] + [IMG] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [VE, 12]
    T, H, W = vgrid
    per_frame = H * W // MERGE**2
    if family == "qwen3_vl":  # a timestamp before every temporal patch, as the Qwen3-VL processor writes
        for t in range(T):
            toks += [50 + t, 51, VS] + [VID] * per_frame + [VE]
    else:
        toks += [VS] + [VID] * (T * per_frame) + [VE]
    toks += [20, 21]
    ids = torch.tensor([toks])
    types = ((ids == IMG).long() + 2 * (ids == VID).long()).int()
    kw = {
        "image_grid_thw": torch.tensor([grid]), "pixel_values": _pixels(grid[0] * grid[1] * grid[2], 0),
        "video_grid_thw": torch.tensor([vgrid]), "pixel_values_videos": _pixels(T * H * W, 1),
    }
    if family == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor([1.0])
    return ids, types, kw


def _greedy(model, ids, types, kw, n, **gen):
    return model.generate(
        input_ids=ids, mm_token_type_ids=types, **kw, max_new_tokens=n, min_new_tokens=n, do_sample=False,
        eos_token_id=-1, return_dict_in_generate=True, output_logits=True, **gen,
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["own", "other"])
@pytest.mark.parametrize("assistant", ["same", "other"])
def test_assisted_decoding_equals_greedy(family, kind, assistant):
    """Candidates of several tokens (all accepted with the model as its own assistant; rejected, so the cache is
    cropped, with another model) are placed from the remembered rope deltas exactly as one-token steps."""
    variant = OWN[family] if kind == "own" else {"qwen2_vl": "vrope", "qwen2_5_vl": "videorope",
                                                 "qwen3_vl": "mrope_i"}[family]
    model = vhf.apply(_build(family), variant)
    ids, types, kw = image_and_video_prompt(family)
    n = 6
    plain = _greedy(model, ids, types, kw, n)
    if assistant == "same":
        helper = model
    else:
        torch.manual_seed(1)
        helper = vhf.apply(type(model)(copy.deepcopy(model.config)).eval(), variant)
    helper.generation_config.num_assistant_tokens = 3
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assisted = _greedy(model, ids, types, kw, n, assistant_model=helper)
    assert torch.equal(assisted.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(assisted.logits, 1), torch.stack(plain.logits, 1), atol=1e-4, rtol=1e-4)
    # another assistant has no grids for the prompt (transformers hands it the encoded vision features): it is
    # told that its drafts place the vision tokens as text; the model as its own assistant keeps the ids
    told = any("mm_encoder_outputs" in str(w.message) for w in caught)
    assert told == (assistant == "other")


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_fullgraph_generation_equals_eager(family):
    """A static cache and a fullgraph-compiled decode step (generate's ``compile_config``): the tokens and logits
    of eager decoding. Dynamo's capture is what the old code failed (``if cached == 0`` on the cache length, a
    tensor under a static cache); the ``eager`` backend keeps the test fast on CPU."""
    variant = {"qwen2_vl": "mrope", "qwen2_5_vl": "videorope", "qwen3_vl": "qwen3vl"}[family]
    model = vhf.apply(_build(family), variant)
    ids, types, kw = image_and_video_prompt(family)
    gen = dict(cache_implementation="static")
    eager = _greedy(model, ids, types, kw, 3, disable_compile=True, **gen)
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    compiled = _greedy(model, ids, types, kw, 3, compile_config=config, **gen)
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits, 1), torch.stack(eager.logits, 1), atol=1e-4, rtol=1e-4)


def test_static_cache_decode_step_reads_no_device_value():
    """The position ids of a decode step after a static cache's prefix capture in one graph (fullgraph) and equal
    the eager ones; the same call at the cache's start gives the prompt's own ids (generate's prefill)."""
    model = vhf.apply(_build("qwen2_vl"), "mrope_i")
    ids, types, kw = image_and_video_prompt("qwen2_vl")
    patch = vhf.patch_of(model)
    model.generate(input_ids=ids, mm_token_type_ids=types, **kw, max_new_tokens=1, do_sample=False)
    prompt, _ = vhf.position_ids(model, types, kw["image_grid_thw"], kw["video_grid_thw"])
    S0 = ids.shape[1]
    step = torch.compile(lambda c: patch.continue_position_ids(c, (1, 2)), fullgraph=True, backend="eager")
    for at in (S0, S0 + 3):
        cached = torch.tensor(at)
        expected = patch.continue_position_ids(at, (1, 2))
        torch.testing.assert_close(step(cached), expected)
        # an independent check: text placed at its index + the prompt's delta on every axis
        delta = prompt[1:, 0].amax() + 1 - S0
        assert torch.equal(expected[1:, 0], (torch.arange(at, at + 2) + delta).expand(expected.shape[0] - 1, -1))
    torch.testing.assert_close(step(torch.tensor(0)), prompt[..., :2])  # the pending prompt of the last call


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_init_restores_the_rotary_buffers(family):
    """Built on meta, patched, ``to_empty`` and ``init_weights``: the buffers of the model built normally, which are
    the stock model's."""
    config = _build(family).config
    with no_init_weights():
        stock = _build(family).__class__(copy.deepcopy(config))
    reference = vhf.apply(copy.deepcopy(stock), OWN[family])
    with torch.device("meta"):
        meta = stock.__class__(copy.deepcopy(config))
        vhf.apply(meta, OWN[family])
    meta.to_empty(device="cpu")
    meta.init_weights()
    got, want, plain = dict(meta.named_buffers()), dict(reference.named_buffers()), dict(stock.named_buffers())
    assert sorted(got) == sorted(want) == sorted(plain)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert [k for k in want if not torch.equal(got[k], plain[k])] == []
    rotary = meta.model.language_model.rotary_emb
    assert isinstance(rotary, vhf.MultimodalRotary)
    assert torch.equal(vhf.remove(meta).model.language_model.rotary_emb.inv_freq, plain["model.language_model."
                                                                                          "rotary_emb.inv_freq"])
