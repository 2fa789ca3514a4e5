"""Packed rows are exact, or refused with a clear error: flash-type attention at any batch size and row count,
padding of packed samples (collator, holes), empty batches, and malformed ``cu_seqlens``.

Every exactness reference is the sample run alone through the same tiny Qwen2-VL (transformers' sdpa attention, no
packing). Flash-attn cannot run on CPU: a reference varlen attention (a slow per-segment loop over
``cu_seq_lens_q / k``, which raises when they are missing, as a plain flash kernel would then attend across samples)
is registered in :class:`transformers.AttentionInterface` under a name the patch treats as flash-type
(:data:`vlpe.integrations.transformers.attention.VARLEN_ATTENTION`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import (  # noqa: E402
    ATOL,
    _build,
    _text_prompt,
    logits,
    make_prompt,
    pack_prompts,
    patched,
)
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: E402

from data.text import build_tokenizer  # noqa: E402
from data.vlm_collate import VLMCollator  # noqa: E402
from vlpe.encodings import multimodal as mm  # noqa: E402
from vlpe.integrations import transformers as vhf  # noqa: E402
from vlpe.integrations.transformers import attention as vattn  # noqa: E402
from vlpe.integrations.transformers.ids import pack_position_ids, prompt_position_ids  # noqa: E402

VARLEN = "vlpe_reference_varlen"
FAMILY = "qwen2_vl"


def reference_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """What ``flash_attn_varlen_func`` computes (causal, per segment of ``cu_seq_lens_q`` over the flattened
    ``B * S`` tokens), by a slow loop over segments; ``(B, S, H, D)`` as transformers' flash wrapper returns."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if any(x is None for x in (cu_q, cu_k, max_q, max_k)):
        raise RuntimeError("the reference varlen attention got no cu_seq_lens_q/k, max_length_q/k")
    if attention_mask is not None:  # transformers' flash path would unpad by the mask and drop the boundaries
        raise RuntimeError("the reference varlen attention got an attention mask beside the boundaries")
    B, H, S, D = query.shape
    Hk = key.shape[1]
    bounds = cu_q.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == B * S
    assert isinstance(max_q, int) and max_q == max_k == max(lengths)
    assert all(a // S == (b - 1) // S for a, b in zip(bounds, bounds[1:]) if b > a)  # no segment spans two rows
    if hasattr(module, "vlpe_seen"):
        module.vlpe_seen.append(cu_q)
    q = query.transpose(1, 2).reshape(B * S, H, D)
    k = key.transpose(1, 2).reshape(B * S, Hk, D).repeat_interleave(H // Hk, dim=1)
    v = value.transpose(1, 2).reshape(B * S, Hk, -1).repeat_interleave(H // Hk, dim=1)
    scale = D**-0.5 if scaling is None else scaling
    out = torch.zeros(B * S, H, v.shape[-1], dtype=query.dtype)
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # (H, L, D)
        w = (qs @ ks.transpose(-1, -2)) * scale  # (H, L, L)
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        out[a:b] = (w.masked_fill(~causal, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out.view(B, S, H, -1), None


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = _build(family)
    return _MODELS[family]


@pytest.fixture(scope="module")
def model():
    return model_of(FAMILY)


@pytest.fixture
def varlen():
    AttentionInterface.register(VARLEN, reference_varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    vattn.VARLEN_ATTENTION.add(VARLEN)
    yield VARLEN
    vattn.VARLEN_ATTENTION.discard(VARLEN)
    AttentionInterface._global_mapping.pop(VARLEN, None)
    AttentionMaskInterface._global_mapping.pop(VARLEN, None)


def _prompts(family=FAMILY):
    return {
        "image": make_prompt(family, "image", pre=3, grid=(1, 4, 6), seed=1),
        "video": make_prompt(family, "video", pre=2, seed=2, seconds=0.75),
        "text": _text_prompt(),
        "short": _text_prompt(3),
    }


def _packed_logits(model, impl, prompts, layout):
    """Logits of ``layout`` (rows of prompt names) packed with per-row cu_seqlens, run under ``impl``."""
    ids, types, mask, kw, cu = pack_prompts([[prompts[n] for n in row] for row in layout])
    padded = not bool(mask.all())
    pos, _ = vhf.position_ids(model, types, kw.get("image_grid_thw"), kw.get("video_grid_thw"),
                              mask if padded else None, kw.get("second_per_grid_ts"),
                              cu_seqlens=cu)  # fmt: skip
    model.set_attn_implementation({"text_config": impl})
    try:
        return logits(model, ids, types, kw, position_ids=pos, use_cache=False), cu
    finally:
        model.set_attn_implementation({"text_config": "sdpa"})


FLASH_VARIANTS = ("mrope", "mrope_i", "rope1d", "v2pe", "vrope", "videorope")
LAYOUTS = {1: [["image", "video", "text"]], 2: [["video", "text"], ["short", "image"]]}


FLASH_CASES = [(FAMILY, v, rows) for v in FLASH_VARIANTS for rows in (1, 2)] + [
    (FAMILY, "mhrope", 2), ("qwen2_5_vl", "qwen25vl", 2), ("qwen3_vl", "qwen3vl", 2), ("qwen3_vl", "vrope", 2)
]


@pytest.mark.parametrize("family,variant,rows", FLASH_CASES)
def test_flash_varlen_packed_rows_equal_every_sample_alone(varlen, family, variant, rows):
    """Item 1: under a flash-type attention the patch hands every attention call the varlen boundaries of the
    packed rows (3-axis 4-row tensors, 1D / V2PE 2-row and VRoPE 5-row ones, one row and two rows with padding):
    every sample's logits equal those of the sample alone (sdpa). Old code: the reference attention raises (no
    cu_seq_lens_q reached it)."""
    model = model_of(family)
    prompts = _prompts(family)
    layout = LAYOUTS[rows]
    attns = [layer.self_attn for layer in model.model.language_model.layers]
    with patched(model, variant):
        alone = {name: logits(model, *p) for name, p in prompts.items()}
        for a in attns:
            a.vlpe_seen = []  # the boundaries every layer's attention call received
        try:
            got, cu = _packed_logits(model, varlen, prompts, layout)
            seen = [a.vlpe_seen for a in attns]
        finally:
            for a in attns:
                del a.vlpe_seen
    for b, row in enumerate(layout):
        for j, name in enumerate(row):
            start, n = int(cu[b][j]), alone[name].shape[1]
            torch.testing.assert_close(got[b, start : start + n], alone[name][0], atol=ATOL, rtol=0,
                                       msg=f"{family} {variant} rows={rows} {name}")  # fmt: skip
    # computed once per forward (one tensor shared by every layer), not per layer
    assert all(len(s) == 1 and s[0] is seen[0][0] for s in seen)


def test_flash_type_names_and_the_boundaries_of_a_text_row():
    """How the patch decides flash-type, and the segments it derives (padding slots are segments of their own)."""
    assert vattn.takes_varlen("flash_attention_2") and vattn.takes_varlen("flash_attention_3")
    assert not any(vattn.takes_varlen(n) for n in ("sdpa", "eager", "vlpe_sdpa", "flex_attention", None))
    from transformers.integrations.flash_attention import flash_attention_forward

    AttentionInterface.register("kernels-test/flash-varlen", flash_attention_forward)  # as hub kernels register
    try:
        assert vattn.takes_varlen("kernels-test/flash-varlen")
    finally:
        AttentionInterface._global_mapping.pop("kernels-test/flash-varlen")
    text = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 0, 1, 2]])  # row 0: samples of 3, 2, then 2 pads
    kw = vattn.varlen_kwargs(text)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 7, 11, 14] and kw["max_length_q"] == 4
    assert vattn.varlen_kwargs(torch.arange(5).expand(2, 5)) is None  # nothing packed: the plain kernel


def test_flash_leading_padding_inside_a_packed_sample_is_exact(model, varlen):
    """Items 1 and 3: padding at the start of a packed sample (ids built with its mask) becomes segments of its own:
    the sample equals itself alone, left-padded, with its attention mask (sdpa)."""
    image, text = _prompts()["image"], _text_prompt(4)
    pad = 2
    padded = (torch.cat([torch.full((1, pad), 2), image[0]], 1), torch.cat([torch.zeros(1, pad, dtype=image[1].dtype),
              image[1]], 1), image[2])  # fmt: skip
    ids = torch.cat([text[0], padded[0]], 1)
    types = torch.cat([text[1], padded[1]], 1)
    mask = torch.ones_like(ids)
    mask[0, text[0].shape[1] : text[0].shape[1] + pad] = 0
    cu = [0, text[0].shape[1], ids.shape[1]]
    with patched(model, "rope1d"):
        want_text = logits(model, *text)
        want_image = logits(model, *padded, attention_mask=mask[:, text[0].shape[1] :])
        pos, _ = vhf.position_ids(model, types, image[2]["image_grid_thw"], attention_mask=mask, cu_seqlens=cu)
        for impl in ("sdpa", varlen):
            model.set_attn_implementation({"text_config": impl})
            try:
                got = logits(model, ids, types, image[2], position_ids=pos, use_cache=False)
            finally:
                model.set_attn_implementation({"text_config": "sdpa"})
            n = text[0].shape[1]
            torch.testing.assert_close(got[:, :n], want_text, atol=ATOL, rtol=0)
            torch.testing.assert_close(got[:, n + pad :], want_image[:, pad:], atol=ATOL, rtol=0, msg=impl)


# ------------------------------------------------------------------------------------------------ the collator


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(["what item is shown in red ? coat bag"])


def _samples():
    frames = np.random.default_rng(0).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    return [
        [("text", "what item ?"), ("image", frames), ("answer", "coat")],
        [("text", "what item is shown in red ?"), ("answer", "bag")],
        [("text", "what"), ("answer", "bag")],
    ]


def test_collator_packing_refuses_left_padding_and_keeps_padding_after_real_tokens(tok):
    """Item 2: left padding would open the first sample's cu_seqlens segment (a varlen kernel lets the sample attend
    to it): refused. With right padding no segment has padding before one of its real tokens. Old code: no error
    (the first assertion fails)."""
    with pytest.raises(ValueError, match="packing=True needs padding_side='right'"):
        VLMCollator(tok, patch_size=4, padding_side="left", packing=True)
    VLMCollator(tok, patch_size=4, padding_side="left")  # without packing left padding stays available
    lengths = [VLMCollator(tok, patch_size=4)([s])["input_ids"].shape[1] for s in _samples()]
    batch = VLMCollator(tok, patch_size=4, packing=True, max_length=lengths[0] + lengths[1],
                        position_variant="mrope")(_samples())  # fmt: skip
    assert batch["input_ids"].shape[0] == 2 and not batch["attention_mask"].all()
    cu, real = batch["cu_seqlens"].tolist(), batch["attention_mask"].reshape(-1)
    for a, b in zip(cu, cu[1:]):
        seg = real[a:b]
        assert bool(seg[0]) and torch.equal(seg, seg.sort(descending=True).values), (a, b)  # real, then padding


def test_collator_refuses_a_sample_of_no_tokens(tok):
    """Item 4 (collator): a sample that encodes to no tokens is a ValueError naming it. Old code: an empty
    (1, 0) batch, or a raw IndexError from the position ids."""
    for kw in ({}, {"packing": True}, {"position_variant": "mrope"}, {"packing": True, "position_variant": "vrope"}):
        with pytest.raises(ValueError, match="sample 1 encodes to no tokens"):
            VLMCollator(tok, patch_size=4, add_bos=False, answer_eos=False, **kw)([[("text", "what")], [("text", "")]])


# ------------------------------------------------------------------------------------ padding inside a sample


def test_padding_between_real_tokens_of_a_packed_sample_is_refused(model):
    """Item 3: a padding slot between two real tokens of one packed sample would restart its text row and split it
    (transformers' mask from packed position ids, the flash boundaries): ValueError naming the sample and the slot,
    wherever ids are built with cu_seqlens and a mask. Old code: no error (the first pytest.raises fails)."""
    types = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 1, 1]])  # row 1, sample 3: a hole at slot 5
    cu = [[0, 3, 8], [0, 4, 8]]
    match = r"sample 3 of the packed batch \(row 1\) has padding at slot 5"
    with pytest.raises(ValueError, match=match):
        mm.text_position_ids(types, mask, cu_seqlens=cu)
    with pytest.raises(ValueError, match=match):
        pack_position_ids(torch.zeros(1, 2, 8, dtype=torch.long), mask, masked=False, cu_seqlens=cu)
    for variant in ("mrope", "rope1d", "vrope", "videorope", "pype"):
        with pytest.raises(ValueError, match=match):
            mm.position_ids(variant, types, None, mask, cu_seqlens=cu)
        with pytest.raises(ValueError, match=match):
            prompt_position_ids(mm.get_variant(variant), family=FAMILY, spatial_merge_size=2, mm_token_type_ids=types,
                                attention_mask=mask, cu_seqlens=cu)  # fmt: skip
    with patched(model, "mrope"), pytest.raises(ValueError, match=match):
        vhf.position_ids(model, types, attention_mask=mask, cu_seqlens=cu)
    # padding at a sample's start or end is exact, and allowed
    ok = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 1, 1]])
    want = [[0, 1, 2, 0, 0, 0, 1, 0], [0, 1, 2, 3, 0, 0, 0, 1]]
    assert mm.text_position_ids(types, ok, cu_seqlens=cu).tolist() == want
    mm.position_ids("mrope", types, None, ok, cu_seqlens=cu)
    # without cu_seqlens a row is one sample read through its attention mask: a hole is fine there
    mm.text_position_ids(types, mask)


# -------------------------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("variant", sorted(mm.VARIANTS))
def test_a_batch_of_no_tokens_is_a_clear_error(variant):
    """Item 4: S = 0 is a ValueError (old code: a raw IndexError / RuntimeError) on every path computing ids."""
    types = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"no tokens \(S = 0\)"):
        mm.position_ids(variant, types, None)
    with pytest.raises(ValueError, match=r"no tokens \(S = 0\)"):
        mm.position_ids(variant, types, None, torch.zeros(2, 0), cu_seqlens=[0, 0])
    with pytest.raises(ValueError, match="seq >= 1"):
        prompt_position_ids(mm.get_variant(variant), family=FAMILY, spatial_merge_size=2, mm_token_type_ids=types,
                            cu_seqlens=[0, 0])  # fmt: skip
    if variant == "mrope":
        with pytest.raises(ValueError, match="packed rows of length 0"):
            mm.text_position_ids((2, 0), cu_seqlens=[0, 0])
        with pytest.raises(ValueError, match="packed rows of length 0"):
            mm.packed_samples([0, 0], 2, 0)
        assert mm.text_position_ids((2, 0)).shape == (2, 0)  # no packing: the correct empty row


# -------------------------------------------------------------------------------------- malformed cu_seqlens


BAD_CU = [
    ("abc", "must be a tensor, a numpy array or a list, got str"),
    ({0: 4}, "must be a tensor, a numpy array or a list, got dict"),
    (8, "must be a tensor, a numpy array or a list, got int"),
    (8.0, "must be a tensor, a numpy array or a list, got float"),
    ([0, 2.5, 8], r"cu_seqlens\[1\] must be an integer token offset, got float"),
    ([0.0, 8.0], r"cu_seqlens\[0\] must be an integer token offset, got float"),
    (torch.tensor([0.0, 8.0]), "must hold integer token offsets, got dtype torch.float32"),
    ([0, None, 8], r"cu_seqlens\[1\] must be an integer token offset, got NoneType"),
    (["0", "8"], r"cu_seqlens\[0\] must be an integer token offset, got str"),
    ([True, 8], r"cu_seqlens\[0\] must be an integer token offset, got bool"),
    ([[0, 8], 3], "mixes the two forms"),
    ([], "with at least 2 entries"),
    ([0, 5, 3, 8], "must not decrease"),
    ([1, 8], "must start at 0"),
    ([0, 3, 7], "must end at the row length"),
]


@pytest.mark.parametrize("cu,message", BAD_CU, ids=[repr(c)[:20] for c, _ in BAD_CU])
def test_malformed_cu_seqlens_name_the_accepted_forms(cu, message):
    """Item 5: every malformed cu_seqlens is a ValueError that says what is wrong and which forms are accepted
    (old code: a TypeError / RuntimeError for strings and dicts, misread per-row forms, no list of forms)."""
    types = torch.zeros(1, 8, dtype=torch.long)
    for call in (
        lambda: mm.position_ids("mrope", types, None, cu_seqlens=cu),
        lambda: mm.position_ids("rope1d", types, None, cu_seqlens=cu),
        lambda: mm.text_position_ids(types, cu_seqlens=cu),
    ):
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "cu_seqlens takes cumulative sample lengths" in str(err.value)
        assert "one such sequence per row" in str(err.value)


def test_well_formed_cu_seqlens_forms_agree():
    """The accepted forms (tensor, numpy array, list of ints / numpy ints / 0-d tensors, per row) give one result."""
    types = torch.zeros(2, 6, dtype=torch.long)
    want = mm.text_position_ids(types, cu_seqlens=torch.tensor([0, 2, 6, 9, 12]))
    for cu in ([0, 2, 6, 9, 12], np.array([0, 2, 6, 9, 12]), [np.int64(0), 2, 6, 9, torch.tensor(12)],
               [[0, 2, 6], [0, 3, 6]], torch.tensor([[0, 2, 6], [0, 3, 6]]), [np.array([0, 2, 6]), (0, 3, 6)]):
        assert torch.equal(mm.text_position_ids(types, cu_seqlens=cu), want), cu
