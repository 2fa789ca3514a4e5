"""vlpe.integrations.transformers on tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models from the installed
transformers (no weights, no network).

What is checked:
- for every registered multimodal variant, ``generate()`` on a prompt with an image and one with a video
  produces exactly the logits of one teacher-forced forward over the final sequence (generation uses the vlpe
  ids of the prompt and the vlpe ``rope_deltas`` afterwards), and a control shows that an off-by-one position
  of the generated tokens would be caught;
- the variants change the model's outputs, while the native ones reproduce the stock model where transformers
  5.x still has the released semantics (images; Qwen3-VL videos), and match the stock model fed position ids
  from an independent reference loop of the released Qwen2-VL / Qwen2.5-VL code on videos (where 5.x drifted);
- padding, beam-style batch expansion, the base ``*Model``, precomputed ids, PyPE's mask (sdpa and eager),
  per-head rotation not leaking into other models, and ``remove`` restoring the stock model bit for bit.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402

IMG, VID, VS, VE = 999, 998, 997, 996
MERGE = 2
ATOL = 1e-4  # fp32: generate vs teacher forcing differ by ~1e-5 on logits of magnitude ~10
TEXT = dict(
    hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
    vocab_size=1000, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    initializer_range=0.2,  # large enough that attention is far from uniform: positions matter
)
VISION = dict(patch_size=14, spatial_merge_size=MERGE, temporal_patch_size=2)
SPECIAL = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VARIANTS = sorted(mm.VARIANTS)


def _build(family: str):
    torch.manual_seed(0)
    if family == "qwen2_vl":  # head_dim 16: K = 8 pairs, chunked [2, 3, 3] (the default split at K = 8)
        cfg = Qwen2VLConfig(
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "rope_theta": 1e4}),
            vision_config=dict(VISION, depth=1, embed_dim=32, hidden_size=128, num_heads=2),
            **SPECIAL,
        )
        return Qwen2VLForConditionalGeneration(cfg).eval()
    if family == "qwen2_5_vl":  # a chunked split other than the default one: the native presets must read it
        cfg = Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                                    "rope_theta": 1e4}),
            vision_config=dict(VISION, depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128,
                               window_size=56, fullatt_block_indexes=[0], tokens_per_second=2),
            **SPECIAL,
        )
        return Qwen2_5_VLForConditionalGeneration(cfg).eval()
    cfg = Qwen3VLConfig(  # interleaved [4, 2, 2] at K = 8
        text_config=dict(TEXT, head_dim=16, rope_parameters={
            "rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True, "rope_theta": 1e4}),
        vision_config=dict(VISION, depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        **SPECIAL,
    )
    return Qwen3VLForConditionalGeneration(cfg).eval()


_MODELS: dict[str, torch.nn.Module] = {}


def model_for(family: str):
    if family not in _MODELS:
        _MODELS[family] = _build(family)
    return _MODELS[family]


@contextmanager
def patched(model, variant, **options):
    vhf.apply(model, variant, **options)
    try:
        yield model
    finally:
        if vhf.patch_of(model) is not None:
            vhf.remove(model)


def _pixels(n_patches: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_patches, 3 * 2 * 14 * 14, generator=g)


def make_prompt(family, kind, *, pre=3, post=2, grid=(1, 4, 6), vgrid=(3, 4, 4), close=True, seed=0, seconds=1.0):
    """``(input_ids, mm_token_type_ids, model kwargs)`` of one prompt: text, a vision block, text."""
    toks = list(range(10, 10 + pre))
    kw = {}
    if kind == "image":
        T, H, W = grid
        toks += [VS] + [IMG] * (T * H * W // MERGE**2) + ([VE] if close else [])
        kw["image_grid_thw"] = torch.tensor([grid])
        kw["pixel_values"] = _pixels(T * H * W, seed)
    else:
        T, H, W = vgrid
        per_frame = H * W // MERGE**2
        if family == "qwen3_vl":  # the Qwen3-VL processor: "<t seconds>" text before every temporal patch
            for t in range(T):
                toks += [50 + t, 51, VS] + [VID] * per_frame + [VE]
        else:
            toks += [VS] + [VID] * (T * per_frame) + ([VE] if close else [])
        kw["video_grid_thw"] = torch.tensor([vgrid])
        kw["pixel_values_videos"] = _pixels(T * H * W, seed + 1)
        if family == "qwen2_5_vl":
            kw["second_per_grid_ts"] = torch.tensor([seconds])  # temporal_patch_size / fps
    toks += list(range(20, 20 + post))
    ids = torch.tensor([toks])
    types = ((ids == IMG).long() + 2 * (ids == VID).long()).int()
    return ids, types, kw


def generate_and_teacher_force(model, ids, types, kw, *, n=4, attention_mask=None, **gen):
    """Logits of ``generate()`` per new token and of one forward over the final sequence at the same places."""
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    out = model.generate(
        input_ids=ids, mm_token_type_ids=types, **kw, **extra, max_new_tokens=n, min_new_tokens=n,
        output_logits=True, return_dict_in_generate=True, **({"do_sample": False} | gen),
    )
    seq = out.sequences
    steps = torch.stack(out.logits, dim=1)  # (B', n, V)
    B2 = seq.shape[0]
    rep = B2 // ids.shape[0]
    full_types = torch.cat([types.repeat_interleave(rep, 0), types.new_zeros(B2, n)], dim=1)
    if attention_mask is not None:
        full_mask = torch.cat([attention_mask.repeat_interleave(rep, 0), attention_mask.new_ones(B2, n)], 1)
        extra = {"attention_mask": full_mask}
    kw_full = dict(kw)
    if rep > 1:  # every returned sequence carries its prompt's vision inputs
        kw_full = _repeat_vision(kw, rep)
    with torch.no_grad():
        full = model(input_ids=seq, mm_token_type_ids=full_types, **kw_full, **extra).logits
    return seq, steps, full[:, ids.shape[1] - 1 : -1]


def _repeat_vision(kw, rep):
    out = {}
    for key, value in kw.items():
        if key.endswith("grid_thw") or key == "second_per_grid_ts":
            out[key] = value.repeat_interleave(rep, 0) if value.dim() else value
        elif key.startswith("pixel_values"):
            out[key] = value.repeat(rep, 1)
        else:
            out[key] = value
    return out


def logits(model, ids, types, kw, **extra):
    with torch.no_grad():
        return model(input_ids=ids, mm_token_type_ids=types, **kw, **extra).logits


# ------------------------------------------------------------------------------------------------------------
# generate() == teacher forcing
# ------------------------------------------------------------------------------------------------------------

CASES = [("qwen2_vl", v) for v in VARIANTS] + [
    ("qwen2_5_vl", v) for v in ("qwen25vl", "mrope_i", "mhrope", "videorope", "v2pe", "pype")
] + [("qwen3_vl", v) for v in ("qwen3vl", "mrope", "mhrope", "hope_video", "vrope", "pype")]


@pytest.mark.parametrize("family,variant", CASES)
def test_generate_equals_teacher_forcing(family, variant):
    model = model_for(family)
    with patched(model, variant):
        for kind in ("image", "video"):
            ids, types, kw = make_prompt(family, kind)
            seq, steps, full = generate_and_teacher_force(model, ids, types, kw)
            assert seq.shape[1] == ids.shape[1] + 4
            torch.testing.assert_close(steps, full, atol=ATOL, rtol=0, msg=f"{family} {variant} {kind}")


def test_teacher_forcing_check_detects_an_off_by_one_position():
    """The tolerance above is meaningful: shifting the generated tokens' ids by one breaks the equality."""
    model = model_for("qwen2_vl")
    with patched(model, "mrope_i"):
        ids, types, kw = make_prompt("qwen2_vl", "image")
        seq, steps, full = generate_and_teacher_force(model, ids, types, kw)
        full_types = torch.cat([types, types.new_zeros(1, 4)], 1)
        pos, _ = vhf.position_ids(model, full_types, kw["image_grid_thw"])
        torch.testing.assert_close(logits(model, seq, full_types, kw, position_ids=pos)[:, ids.shape[1] - 1 : -1], full)
        shifted = pos.clone()
        shifted[1:, :, ids.shape[1] :] += 1  # the design rows of the generated tokens
        off = logits(model, seq, full_types, kw, position_ids=shifted)[:, ids.shape[1] - 1 : -1]
        assert (off[:, 1:] - steps[:, 1:]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("variant", ["mrope", "videorope", "pype"])
def test_prompt_ending_inside_a_vision_block(variant):
    """No text after the image: the next token's ids come from the design's continuation (rope_deltas), not
    from the last prompt token + 1 per axis."""
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image", post=0, close=False)
    with patched(model, variant):
        _, steps, full = generate_and_teacher_force(model, ids, types, kw)
        torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


MODES = {"dynamic cache": {}, "no cache": {"use_cache": False}, "static cache": {"cache_implementation": "static"}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", ["mrope_i", "pype"])
def test_left_padded_batch(variant, mode):
    """Two prompts of different lengths, left-padded: generation (with a dynamic, a static or no cache) matches
    teacher forcing, and every sample's logits equal those of the sample alone (padding changes nothing)."""
    family = "qwen2_vl"
    model = model_for(family)
    a_ids, a_types, a_kw = make_prompt(family, "image", pre=5, grid=(1, 4, 6), seed=1)
    b_ids, b_types, b_kw = make_prompt(family, "image", pre=2, grid=(1, 4, 4), seed=2)
    pad = a_ids.shape[1] - b_ids.shape[1]
    ids = torch.cat([a_ids, torch.cat([torch.full((1, pad), 2), b_ids], 1)])
    types = torch.cat([a_types, torch.cat([torch.zeros(1, pad, dtype=b_types.dtype), b_types], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    kw = {
        "image_grid_thw": torch.cat([a_kw["image_grid_thw"], b_kw["image_grid_thw"]]),
        "pixel_values": torch.cat([a_kw["pixel_values"], b_kw["pixel_values"]]),
    }
    with patched(model, variant):
        _, steps, full = generate_and_teacher_force(model, ids, types, kw, attention_mask=mask, **MODES[mode])
        torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
        both = logits(model, ids, types, kw, attention_mask=mask)
        torch.testing.assert_close(both[0], logits(model, a_ids, a_types, a_kw)[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(both[1, pad:], logits(model, b_ids, b_types, b_kw)[0], atol=ATOL, rtol=0)


def test_expanded_batch_num_return_sequences():
    """generate() repeats the prompt (num_return_sequences): the prompt's ids are repeated with it."""
    model = model_for("qwen2_5_vl")
    ids, types, kw = make_prompt("qwen2_5_vl", "video")
    torch.manual_seed(3)
    with patched(model, "videorope"):
        seq, steps, full = generate_and_teacher_force(model, ids, types, kw, do_sample=True, num_return_sequences=2)
        assert seq.shape[0] == 2
        torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# packed rows (cu_seqlens): every sample's logits equal those of the sample alone
# ------------------------------------------------------------------------------------------------------------


def _text_prompt(n=5):
    ids = torch.arange(30, 30 + n)[None]
    return ids, torch.zeros_like(ids, dtype=torch.int32), {}


def pack_prompts(rows, *, pad_id=2):
    """Prompts ``rows`` (lists of ``make_prompt`` triples) packed into rows of one length: shorter rows end with
    right padding inside their last sample. Returns ``(ids, types, mask, model kwargs, cu_seqlens per row)``;
    the vision inputs are concatenated in order of appearance over the flattened batch."""
    S = max(sum(p[0].shape[1] for p in row) for row in rows)
    ids, types, mask, cus = [], [], [], []
    for row in rows:
        pad = S - sum(p[0].shape[1] for p in row)
        ids.append(torch.cat([p[0][0] for p in row] + [torch.full((pad,), pad_id)]))
        types.append(torch.cat([p[1][0] for p in row] + [torch.zeros(pad, dtype=row[0][1].dtype)]))
        mask.append(torch.cat([torch.ones(S - pad, dtype=torch.long), torch.zeros(pad, dtype=torch.long)]))
        lengths = [p[0].shape[1] for p in row]
        lengths[-1] += pad
        cus.append(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    flat = [p[2] for row in rows for p in row]
    kw = {key: torch.cat([d[key] for d in flat if key in d]) for key in sorted({k for d in flat for k in d})}
    return torch.stack(ids), torch.stack(types), torch.stack(mask), kw, cus


PACKED_CASES = [("qwen2_vl", v) for v in VARIANTS] + [
    ("qwen2_5_vl", v) for v in ("qwen25vl", "vrope", "pype")
] + [("qwen3_vl", v) for v in ("qwen3vl", "v2pe", "mhrope")]


@pytest.mark.parametrize("family,variant", PACKED_CASES)
def test_packed_rows_give_every_sample_its_own_logits(family, variant):
    """Samples packed into rows (cu_seqlens; one row of three, and two rows with padding) give every sample the
    logits and rope delta it gets alone; the same row without the per-sample ids does not."""
    model = model_for(family)
    image = make_prompt(family, "image", pre=3, grid=(1, 4, 6), seed=1)
    video = make_prompt(family, "video", pre=2, seed=2, seconds=0.75)
    text = _text_prompt()
    with patched(model, variant):
        alone = {}
        for name, p in (("image", image), ("video", video), ("text", text)):
            pos, deltas = vhf.position_ids(model, p[1], p[2].get("image_grid_thw"), p[2].get("video_grid_thw"),
                                           second_per_grid_ts=p[2].get("second_per_grid_ts"))  # fmt: skip
            alone[name] = (logits(model, *p), deltas)
        for layout in ([["image", "video", "text"]], [["video", "text"], ["image"]]):
            prompts = {"image": image, "video": video, "text": text}
            ids, types, mask, kw, cu = pack_prompts([[prompts[n] for n in row] for row in layout])
            padded = not bool(mask.all())
            pos, deltas = vhf.position_ids(
                model, types, kw.get("image_grid_thw"), kw.get("video_grid_thw"), mask if padded else None,
                kw.get("second_per_grid_ts"), cu_seqlens=cu,
            )  # fmt: skip
            got = logits(model, ids, types, kw, position_ids=pos, use_cache=False)
            k = 0
            for b, row in enumerate(layout):
                for j, name in enumerate(row):
                    start = int(cu[b][j])
                    want, want_delta = alone[name]
                    n = want.shape[1]
                    torch.testing.assert_close(got[b, start : start + n], want[0], atol=ATOL, rtol=0,
                                               msg=f"{family} {variant} {layout} {name}")  # fmt: skip
                    torch.testing.assert_close(deltas[k], want_delta[0])
                    k += 1
            assert deltas.shape[0] == k
            # control: the ids of the row as one sample (no cu_seqlens) mix the samples
            whole, _ = vhf.position_ids(model, types, kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                                        mask if padded else None, kw.get("second_per_grid_ts"))  # fmt: skip
            mixed = logits(model, ids, types, kw, position_ids=whole, use_cache=False)
            second = int(cu[0][1])
            assert (mixed[0, second:] - got[0, second:]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("variant", ["vrope", "pype"])
def test_packed_rows_eager_and_other_depths(variant):
    """Eager attention, and a 3-layer decoder (PyPE then has 5 position rows, which transformers does not read as
    packed: the patch builds the block-diagonal mask itself; PyPE's own mask keeps to each sample)."""
    family = "qwen2_vl"
    torch.manual_seed(0)
    cfg = model_for(family).config.to_dict()
    cfg["text_config"]["num_hidden_layers"] = 3
    cfg["text_config"]["layer_types"] = ["full_attention"] * 3
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**cfg)).eval()
    image, text = make_prompt(family, "image", seed=4), _text_prompt(4)
    ids, types, mask, kw, cu = pack_prompts([[text, image, text]])
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with patched(model, variant):
            pos, _ = vhf.position_ids(model, types, kw["image_grid_thw"], cu_seqlens=cu)
            got = logits(model, ids, types, kw, position_ids=pos, use_cache=False)
            for j, p in enumerate((text, image, text)):
                want = logits(model, *p)
                start = int(cu[0][j])
                torch.testing.assert_close(got[0, start : start + want.shape[1]], want[0], atol=ATOL, rtol=0)
    model.set_attn_implementation("sdpa")


# ------------------------------------------------------------------------------------------------------------
# the patch changes what it should, and only that
# ------------------------------------------------------------------------------------------------------------

NATIVE = {"qwen2_vl": ("mrope",), "qwen2_5_vl": ("mrope", "qwen25vl"), "qwen3_vl": ("qwen3vl", "mrope_i")}


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("mrope", "qwen25vl")])
def test_variants_change_the_outputs(variant):
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image")
    stock = logits(model, ids, types, kw)
    with patched(model, variant):
        assert (logits(model, ids, types, kw) - stock).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_native_variants_reproduce_the_stock_model_on_images(family):
    """transformers 5.x still has the released semantics for still images: the native presets equal it, through
    forward and generate()."""
    model = model_for(family)
    ids, types, kw = make_prompt(family, "image")
    stock = logits(model, ids, types, kw)
    stock_seq, stock_steps, _ = generate_and_teacher_force(model, ids, types, kw)
    for variant in NATIVE[family] + (("qwen25vl",) if family == "qwen2_vl" else ()):
        with patched(model, variant):
            torch.testing.assert_close(logits(model, ids, types, kw), stock, atol=1e-5, rtol=0)
            seq, steps, _ = generate_and_teacher_force(model, ids, types, kw)
            assert torch.equal(seq, stock_seq)
            torch.testing.assert_close(steps, stock_steps, atol=1e-5, rtol=0)


def test_qwen3_vl_native_variant_reproduces_the_stock_model_on_video():
    """Qwen3-VL splits videos into per-frame blocks, where 5.x's continuation equals the released one."""
    model = model_for("qwen3_vl")
    ids, types, kw = make_prompt("qwen3_vl", "video")
    stock = logits(model, ids, types, kw)
    with patched(model, "qwen3vl"):
        torch.testing.assert_close(logits(model, ids, types, kw), stock, atol=1e-5, rtol=0)


def _released_rope_index(types, grids, merge, *, seconds=None, tokens_per_second=None):
    """Independent slow reference of the released (4.x) Qwen2-VL / Qwen2.5-VL ``get_rope_index``, one sample:
    text after a vision block resumes at the maximum over all axes + 1; Qwen2.5-VL video time
    ``t = floor(tau * second_per_grid_t * tokens_per_second)``."""
    out, nxt, g, k = [], 0, iter(grids), 0
    types = types.tolist()
    while k < len(types):
        if types[k] == 0:
            out.append((nxt, nxt, nxt))
            nxt += 1
            k += 1
            continue
        T, H, W = next(g)
        H, W = H // merge, W // merge
        coords = []
        for tau in range(T):
            t = tau if seconds is None else int(tau * seconds * tokens_per_second)
            for i in range(H):
                for j in range(W):
                    coords.append((nxt + t, nxt + i, nxt + j))
        out += coords
        nxt = max(max(c) for c in coords) + 1
        k += T * H * W
    return torch.tensor(out).T.unsqueeze(1)  # (3, 1, S)


@pytest.mark.parametrize("family,variant", [("qwen2_vl", "mrope"), ("qwen2_5_vl", "qwen25vl")])
def test_native_variants_follow_the_released_video_semantics(family, variant):
    """On videos transformers 5.x advances text by max(h, w) only; the vlpe presets follow the released code:
    the patched model equals the stock model fed reference ids, and differs from the stock 5.x model."""
    model = model_for(family)
    ids, types, kw = make_prompt(family, "video", seconds=0.75)  # Qwen2.5-VL: t = floor(1.5 tau) = 0, 1, 3
    tps = model.config.vision_config.tokens_per_second if family == "qwen2_5_vl" else None
    ref = _released_rope_index(types[0], kw["video_grid_thw"].tolist(), MERGE,
                               seconds=0.75 if tps else None, tokens_per_second=tps)
    expected = logits(model, ids, types, kw, position_ids=ref)
    stock = logits(model, ids, types, kw)
    with patched(model, variant):
        got = logits(model, ids, types, kw)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert (got - stock).abs().max() > 0.1
        assert model.model.rope_deltas.item() == ref.max().item() + 1 - ids.shape[1]


def test_per_head_rotation_leaves_other_models_alone():
    """MHRoPE rotates through hooks on one model's attention modules: the modeling file's apply_rotary_pos_emb is
    never replaced, and a stock model of the same family is unaffected while another instance is patched."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling

    original = modeling.apply_rotary_pos_emb
    model = model_for("qwen2_vl")
    other = _build("qwen2_vl")
    torch.manual_seed(1)
    for p in other.parameters():
        p.data.add_(0.01 * torch.randn_like(p))
    ids, types, kw = make_prompt("qwen2_vl", "image")
    before = logits(other, ids, types, kw)
    with patched(model, "mhrope"):
        assert modeling.apply_rotary_pos_emb is original
        torch.testing.assert_close(logits(other, ids, types, kw), before, atol=0, rtol=0)
        with patched(other, "mhrope"):
            pass
        assert vhf.patch_of(model) is not None and vhf.patch_of(other) is None
    assert modeling.apply_rotary_pos_emb is original


def _rotate(x, angles):
    """Reference rotation, complex form: pair k is the channels (k, k + D/2), z_k * exp(i * angle_k)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angles.double())
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def test_mhrope_rotates_every_kv_head_by_its_own_axis():
    """One decoder attention of the patched model against a hand-written one: KV head h (and its query heads
    2h, 2h+1, GQA) rotated by all pairs of the axis its section assigns, section [1, 2, 1] = heads t, h, h, w."""
    model = model_for("qwen2_vl")
    text = model.model.language_model
    attn = text.layers[0].self_attn
    ids, types, kw = make_prompt("qwen2_vl", "image")
    S = ids.shape[1]
    x = torch.randn(1, S, 128)
    with patched(model, "mhrope", section=[1, 2, 1]), torch.no_grad():
        pos, _ = vhf.position_ids(model, types, kw["image_grid_thw"])
        cos, sin = text.rotary_emb(x, pos)
        assert cos.shape == (1, 4, S, 16)
        got, _ = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
    with torch.no_grad():
        q = attn.q_proj(x).view(1, S, 8, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, S, 4, 16).transpose(1, 2)
        v = attn.v_proj(x).view(1, S, 4, 16).transpose(1, 2)
        inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2).double() / 16))
        axis_of_kv_head = [0, 1, 1, 2]
        qs, ks = [], []
        for h, a in enumerate(axis_of_kv_head):
            angles = pos[1 + a, 0].double()[:, None] * inv_freq  # (S, 8)
            ks.append(_rotate(k[:, h], angles))
            qs += [_rotate(q[:, 2 * h], angles), _rotate(q[:, 2 * h + 1], angles)]
        q, k = torch.stack(qs, 1), torch.stack(ks, 1).repeat_interleave(2, 1)
        v = v.repeat_interleave(2, 1)
        scores = q @ k.transpose(-1, -2) / 4.0 + torch.full((S, S), float("-inf")).triu(1)
        want = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, S, 128))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mhrope_heads_read_their_axis():
    """With every KV head on the temporal axis, an image (one frame: t constant inside) looks like one position
    to attention: the logits equal those of 1D RoPE ids that give all image tokens the same position."""
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image")
    with patched(model, "mhrope", section=[4, 0, 0]):
        got = logits(model, ids, types, kw)
        pos, _ = vhf.position_ids(model, types, kw["image_grid_thw"])
    t_row = pos[1:2]  # (1, B, S) the t ids of the grid design
    with patched(model, "rope1d"):
        flat = torch.cat([pos[:1], t_row], 0)  # text row + one axis: the 1D variant's packed layout
        torch.testing.assert_close(logits(model, ids, types, kw, position_ids=flat), got, atol=1e-5, rtol=1e-5)  # two rotation paths, fp32 rounding


def test_remove_restores_the_stock_model():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling

    model = model_for("qwen2_vl")
    text = model.model.language_model
    rotary, attn_impl, rope_fn = text.rotary_emb, text.config._attn_implementation, modeling.apply_rotary_pos_emb
    data = {k: make_prompt("qwen2_vl", k) for k in ("image", "video")}
    stock = {k: logits(model, *v) for k, v in data.items()}
    stock_gen = generate_and_teacher_force(model, *data["video"])[0]
    vhf.apply(model, "mhrope")
    vhf.apply(model, "pype")  # replaces the previous patch
    assert text.config._attn_implementation == f"vlpe_{attn_impl}"
    assert isinstance(text.rotary_emb, vhf.MultimodalRotary)
    vhf.remove(model)
    assert text.rotary_emb is rotary and text.config._attn_implementation == attn_impl
    assert modeling.apply_rotary_pos_emb is rope_fn
    for obj in (model, model.model):
        assert not {"compute_3d_position_ids", "get_rope_index", "_prepare_position_ids_for_generation",
                    } & set(obj.__dict__)
    assert all(not layer.self_attn._forward_pre_hooks for layer in text.layers)
    for k, v in data.items():
        assert torch.equal(logits(model, *v), stock[k])
    assert torch.equal(generate_and_teacher_force(model, *data["video"])[0], stock_gen)
    with pytest.raises(ValueError, match="no vlpe patch"):
        vhf.remove(model)


# ------------------------------------------------------------------------------------------------------------
# PyPE's mask, precomputed ids, base models, errors
# ------------------------------------------------------------------------------------------------------------


def _text_hidden(model, embeds, pos):
    with torch.no_grad():
        return model.model.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state


def test_pype_mask_inside_the_image():
    """PyPE replaces raster causality inside an image: a token sees later tokens of its own or outer rings, and
    still no later text."""
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image", grid=(1, 8, 8))  # 4 x 4 image: rings 0 (outer) and 1
    with patched(model, "pype"):
        pos, _ = vhf.position_ids(model, types, kw["image_grid_thw"])
        embeds = model.model.get_input_embeddings()(ids)
        base = _text_hidden(model, embeds, pos)
        first = 4  # first image token: ring 0 (periphery)
        last_outer, centre = first + 15, first + 5  # the last image token is on the periphery; (1, 1) is inner
        for k, visible in ((last_outer, True), (centre, False), (ids.shape[1] - 1, False)):
            e = embeds.clone()
            e[0, k] += 1.0
            changed = (_text_hidden(model, e, pos)[0, first] - base[0, first]).abs().max() > 1e-4
            assert changed == visible, k


def test_pype_hands_every_layer_its_own_tables_and_mask():
    """With one descent step per layer (interval=1) the two layers have different rings; each decoder attention
    receives its layer's tables and mask."""
    model = model_for("qwen2_vl")
    text = model.model.language_model
    ids, types, kw = make_prompt("qwen2_vl", "image", grid=(1, 8, 8))
    seen = {}

    def capture(module, args, kwargs):
        seen[module.layer_idx] = (kwargs["position_embeddings"], kwargs.get("vlpe_keep"))

    with patched(model, "pype", interval=1):
        handles = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in text.layers]
        try:
            logits(model, ids, types, kw)
        finally:
            for h in handles:
                h.remove()
    grid = kw["image_grid_thw"]
    want_ids, _ = mm.position_ids("pype", types, grid, spatial_merge_size=MERGE, depth=2, interval=1)
    assert not torch.equal(want_ids[0], want_ids[1])
    for layer in (0, 1):
        (cos, sin), keep = seen[layer]
        want_cos, want_sin = mm.rotary("pype", want_ids, head_dim=16, theta=1e4, layer=layer)
        torch.testing.assert_close(cos, want_cos)
        torch.testing.assert_close(sin, want_sin)
        assert torch.equal(keep, mm.pype_attention_mask(want_ids, layer))
    assert not torch.equal(seen[0][1], seen[1][1])


def test_pype_eager_equals_sdpa():
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image")
    with patched(model, "pype"):
        sdpa = logits(model, ids, types, kw)
    before = model.model.language_model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with patched(model, "pype"):
            assert model.model.language_model.config._attn_implementation == "vlpe_eager"
            torch.testing.assert_close(logits(model, ids, types, kw), sdpa, atol=ATOL, rtol=0)
            _, steps, full = generate_and_teacher_force(model, ids, types, kw)
            torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)
    finally:
        model.set_attn_implementation(before)


def test_precomputed_position_ids_and_get_rope_index():
    model = model_for("qwen3_vl")
    ids, types, kw = make_prompt("qwen3_vl", "video")
    with patched(model, "videorope"):
        auto = logits(model, ids, types, kw)
        pos, deltas = vhf.position_ids(model, types, video_grid_thw=kw["video_grid_thw"])
        torch.testing.assert_close(logits(model, ids, types, kw, position_ids=pos), auto, atol=0, rtol=0)
        grid = kw["video_grid_thw"].repeat_interleave(3, 0)
        grid[:, 0] = 1  # the Qwen3-VL per-frame blocks
        want_ids, want_deltas = mm.position_ids("videorope", types, grid, spatial_merge_size=MERGE)
        got_ids, got_deltas = model.model.get_rope_index(ids, types, video_grid_thw=kw["video_grid_thw"])
        torch.testing.assert_close(got_ids, want_ids.to(got_ids.dtype))
        torch.testing.assert_close(got_deltas, want_deltas)
        torch.testing.assert_close(deltas, want_deltas)


@pytest.mark.parametrize("variant", ["pype", "vrope", "mrope_i"])
def test_text_model_called_without_position_ids(variant):
    """The decoder's own default positions (text only) reach the vlpe rotary as 1D positions."""
    model = model_for("qwen2_vl")
    ids = torch.arange(10, 22)[None]
    types = torch.zeros_like(ids)
    with patched(model, variant):
        embeds = model.model.get_input_embeddings()(ids)
        pos, _ = vhf.position_ids(model, types)
        want = _text_hidden(model, embeds, pos)
        torch.testing.assert_close(_text_hidden(model, embeds, None), want, atol=0, rtol=0)
        torch.testing.assert_close(_text_hidden(model, embeds, torch.arange(12)[None]), want, atol=0, rtol=0)


def test_base_model_can_be_patched():
    """Patching the base ``*Model`` alone gives the hidden states the patched generation model computes."""
    family = "qwen2_5_vl"
    model = model_for(family)
    ids, types, kw = make_prompt(family, "video")
    with patched(model, "mrope_i"):
        want = logits(model, ids, types, kw)
    with patched(model.model, "mrope_i"), torch.no_grad():
        hidden = model.model(input_ids=ids, mm_token_type_ids=types, **kw).last_hidden_state
        torch.testing.assert_close(model.lm_head(hidden), want, atol=1e-5, rtol=0)
        assert vhf.patch_of(model) is vhf.patch_of(model.model)  # found through the generation model too


def test_design_options_and_variant_objects():
    model = model_for("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "video")
    with patched(model, "hope_video", temporal_scale=0.5):
        a = logits(model, ids, types, kw)
    with patched(model, mm.Variant("diagonal", "hybrid", {"temporal_scale": 0.5})):
        torch.testing.assert_close(logits(model, ids, types, kw), a, atol=0, rtol=0)
    with patched(model, "hope_video"):
        assert (logits(model, ids, types, kw) - a).abs().max() > 1e-3
    with patched(model, "mrope_i", spatial_reset=True):
        _, steps, full = generate_and_teacher_force(model, ids, types, kw)
        torch.testing.assert_close(steps, full, atol=ATOL, rtol=0)


def test_errors():
    model = model_for("qwen2_vl")
    with pytest.raises(ValueError, match="Qwen2-VL"):
        vhf.apply(torch.nn.Linear(2, 2), "mrope")
    with pytest.raises(ValueError, match="unknown multimodal RoPE variant"):
        vhf.apply(model, "mrope_x")
    with pytest.raises(ValueError, match="does not take option"):
        vhf.apply(model, "mrope", temporal_scale=2.0)
    with pytest.raises(ValueError, match="depth"):
        vhf.apply(model, "pype", depth=5)
    with pytest.raises(ValueError, match="section"):
        vhf.apply(model, "mrope", section=[1, 1, 1])  # does not sum to the 8 rotary pairs
    assert vhf.patch_of(model) is None  # nothing was left half-applied
    longrope = Qwen2VLConfig(  # short / long factor sets switched by the sequence length: not supported
        text_config=dict(TEXT, rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                "original_max_position_embeddings": 64, "factor": 2.0,
                                                "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(VISION, depth=1, embed_dim=32, hidden_size=128, num_heads=2), **SPECIAL,
    )
    with pytest.raises(ValueError, match="longrope"):
        vhf.apply(Qwen2VLForConditionalGeneration(longrope), "mrope")
    ids, types, kw = make_prompt("qwen2_vl", "image")
    with patched(model, "mrope"):
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            model(input_ids=ids, **kw)
        broken = types.clone()
        broken[0, 6] = 0  # one image token marked as text: the blocks no longer match the grid
        with pytest.raises(ValueError, match="grid"):
            model(input_ids=ids, mm_token_type_ids=broken, **kw)


@pytest.mark.parametrize("variant", ["mhrope", "pype"])
def test_training_step_with_gradient_checkpointing(variant):
    """The per-head wrapper and the per-layer hooks survive the recomputation of checkpointed layers: gradients
    equal those without checkpointing."""
    model = _build("qwen2_vl")
    ids, types, kw = make_prompt("qwen2_vl", "image")
    grads = []
    with patched(model, variant):
        model.train()
        for checkpointing in (False, True):
            if checkpointing:
                model.activation_checkpointing_enable()
            model.zero_grad()
            model(input_ids=ids, mm_token_type_ids=types, **kw, labels=ids).loss.backward()
            grads.append(model.model.language_model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_module_leaves_no_global_state_behind():
    assert not hasattr(vhf, "_ROTATION_WRAPPERS")
    assert "vlpe.integrations.transformers" in sys.modules
