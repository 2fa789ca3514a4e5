"""data.vlm_collate and data.text: token layout, labels, padding, patch order (frames rebuilt from
pixel_values by a reference loop, and parity with transformers' Qwen2-VL processors), timing from real
timestamps, position ids, a tiny Hugging Face Qwen2-VL consuming the batch, DataLoader workers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from data.text import SPECIAL_TOKENS, WordTokenizer, build_tokenizer
from data.video import read_video, real_clip_path
from data.vlm_collate import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, VLMCollator, to_hf_inputs
from data.vniah import VNIAH, vocabulary

P = 4  # patch size used throughout (frames are multiples of P * merge = 8)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer([*vocabulary(), "Question: what is in the video and the picture?"])


def rng_frames(seed, *shape):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------- text


def test_word_tokenizer(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(8))
    ids = tok.encode("What item is shown in red?")
    assert tok.decode(ids) == "what item is shown in red ?"
    assert tok.encode("SNEAKER") == tok.encode("sneaker") and len(tok.encode("coat bag sneaker")) == 3
    with pytest.raises(ValueError, match="zebra"):
        tok.encode("a zebra")
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode("coat bag") == tok.encode("coat bag") and again.vocab_size == tok.vocab_size
    assert WordTokenizer(reversed(tok.words)).encode("what item") == tok.encode("what item")  # ids: set of words


# ------------------------------------------------------------------------------------- token layout


def test_token_layout_and_labels(tok):
    video = rng_frames(0, 4, 16, 16, 3)  # grid (2, 4, 4) patches -> 2 * 2 * 2 = 8 merged tokens
    image = rng_frames(1, 16, 32, 3)  # grid (1, 4, 8) -> 1 * 2 * 4 = 8 merged tokens
    sample = [
        ("text", "question: what is in the video and the picture?"),
        ("video", video, np.arange(4) / 2.0),
        ("image", image),
        ("answer", "bag"),
    ]
    batch = VLMCollator(tok, patch_size=P)([sample])
    q = tok.encode("question: what is in the video and the picture?")
    vs, ve, vid, img = tok.vision_start_id, tok.vision_end_id, tok.video_token_id, tok.image_token_id
    bag = tok.token_to_id("bag")
    expected = [tok.bos_id, *q, vs, *[vid] * 8, ve, vs, *[img] * 8, ve, bag, tok.eos_id]
    assert batch["input_ids"].tolist() == [expected]
    types = [0] * (1 + len(q)) + [0] + [2] * 8 + [0] + [0] + [1] * 8 + [0] + [0, 0]
    assert batch["mm_token_type_ids"].tolist() == [types]
    assert batch["labels"].tolist() == [[-100] * (len(expected) - 2) + [bag, tok.eos_id]]
    assert batch["attention_mask"].tolist() == [[1] * len(expected)]
    assert batch["grid_thw"].tolist() == [[2, 4, 4], [1, 4, 8]] and batch["grid_types"].tolist() == [2, 1]
    assert batch["video_grid_thw"].tolist() == [[2, 4, 4]] and batch["image_grid_thw"].tolist() == [[1, 4, 8]]
    assert batch["pixel_values"].shape == (32 + 32, 3 * 2 * P * P)
    no_eos = VLMCollator(tok, patch_size=P, answer_eos=False, add_bos=False)([sample])
    assert no_eos["input_ids"][0].tolist() == expected[1:-1]


def test_padding_sides(tok):
    short = [("text", "what item ?"), ("image", rng_frames(2, 8, 8, 3)), ("answer", "coat")]
    clip = rng_frames(3, 2, 8, 8, 3)
    long = [("text", "what item is shown in red ?"), ("video", clip, [0.0, 0.5]), ("answer", "bag")]
    right = VLMCollator(tok, patch_size=P)([short, long])
    left = VLMCollator(tok, patch_size=P, padding_side="left")([short, long])
    n_short = int(right["attention_mask"][0].sum())
    S = right["input_ids"].shape[1]
    assert right["attention_mask"][0].tolist() == [1] * n_short + [0] * (S - n_short)
    assert left["attention_mask"][0].tolist() == [0] * (S - n_short) + [1] * n_short
    for key in ("input_ids", "mm_token_type_ids", "labels"):
        assert torch.equal(right[key][0, :n_short], left[key][0, S - n_short :])
        assert torch.equal(right[key][1], left[key][1])
    assert (right["input_ids"][0, n_short:] == tok.pad_id).all() and (right["labels"][0, n_short:] == -100).all()
    assert torch.equal(right["pixel_values"], left["pixel_values"])


# ----------------------------------------------------------------------------------------- patch order


def rebuild(pixel_values, grid, *, p, tp=2, m=2):
    """Reference loop: put every patch vector back at its (time, row, column) place."""
    gt, gh, gw = grid
    frames = torch.zeros(gt * tp, 3, gh * p, gw * p)
    n = 0
    for t in range(gt):
        for by in range(gh // m):
            for bx in range(gw // m):
                for my in range(m):
                    for mx in range(m):
                        patch = pixel_values[n].reshape(3, tp, p, p)  # (channel, time, y, x)
                        y, x = (by * m + my) * p, (bx * m + mx) * p
                        for k in range(tp):
                            frames[t * tp + k, :, y : y + p, x : x + p] = patch[:, k]
                        n += 1
    mean, std = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1), torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    return ((frames * std + mean) * 255).permute(0, 2, 3, 1)  # (T, H, W, 3) in 0..255


def test_pixel_values_rebuild_the_frames(tok):
    video = rng_frames(4, 5, 16, 24, 3)  # odd frame count: the last frame is repeated
    image = rng_frames(5, 8, 16, 3)
    sample = [("video", video, np.arange(5) / 4.0), ("image", image), ("answer", "bag")]
    batch = VLMCollator(tok, patch_size=P)([sample])
    pv = batch["pixel_values"]
    n_video = 3 * 4 * 6
    got = rebuild(pv[:n_video], (3, 4, 6), p=P)
    np.testing.assert_allclose(got[:5].numpy(), video, atol=1e-3)
    np.testing.assert_allclose(got[5].numpy(), video[4], atol=1e-3)
    got_img = rebuild(pv[n_video:], (1, 2, 4), p=P)
    np.testing.assert_allclose(got_img[0].numpy(), image, atol=1e-3)
    np.testing.assert_allclose(got_img[1].numpy(), image, atol=1e-3)  # an image is repeated in time
    # one merged token = one contiguous group of merge^2 patches covering a (2P x 2P) square
    group = rebuild(pv[:4], (1, 2, 2), p=P)[0].numpy()
    np.testing.assert_allclose(group, video[0, : 2 * P, : 2 * P], atol=1e-3)


def test_matches_transformers_qwen2vl_processors(tok):
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image, video = rng_frames(6, 16, 24, 3), rng_frames(7, 5, 24, 16, 3)
    batch = to_hf_inputs(VLMCollator(tok, patch_size=P)([[("image", image), ("video", video, np.arange(5) / 2.0)]]))
    kw = dict(do_resize=False, patch_size=P, merge_size=2, temporal_patch_size=2)
    ref_img = Qwen2VLImageProcessor(**kw)(images=[image], return_tensors="pt")
    video_processor = Qwen2VLVideoProcessor(**kw, do_sample_frames=False)
    ref_vid = video_processor(videos=[video], return_tensors="pt", cap_pixels_per_frame=False)
    torch.testing.assert_close(batch["pixel_values"], ref_img["pixel_values"], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["pixel_values_videos"], ref_vid["pixel_values_videos"], atol=1e-5, rtol=0)
    assert torch.equal(batch["image_grid_thw"], ref_img["image_grid_thw"])
    assert torch.equal(batch["video_grid_thw"], ref_vid["video_grid_thw"])


# ------------------------------------------------------------------------------------- timing

def test_second_per_grid_from_real_timestamps(tok):
    bikes = read_video(real_clip_path("bikes"), num_frames=9, size=16)  # 25 fps, uneven index steps
    tree = read_video(real_clip_path("tree"), num_frames=6, size=16)  # real gaps between frames
    batch = VLMCollator(tok, patch_size=P)(
        [[("video", bikes.frames, bikes.timestamps), ("answer", "bag")], [("video", tree.frames, tree.timestamps)]]
    )
    spg = batch["second_per_grid_ts"].double().numpy()
    np.testing.assert_allclose(spg[0], 2 * (9.96 - 0.0) / 8, rtol=1e-5)
    np.testing.assert_allclose(spg[1], 2 * (tree.timestamps[-1] - tree.timestamps[0]) / 5, rtol=1e-5)
    ts_b = np.append(bikes.timestamps, bikes.timestamps[-1])  # padded to 10 frames by repeating the last
    expected = np.concatenate([(ts_b[0::2] + ts_b[1::2]) / 2, (tree.timestamps[0::2] + tree.timestamps[1::2]) / 2])
    np.testing.assert_allclose(batch["video_grid_timestamps"].numpy(), expected, rtol=1e-6)
    assert batch["video_grid_thw"].tolist() == [[5, 4, 4], [3, 4, 4]]


# ---------------------------------------------------------------------------------------- positions


def test_position_ids_follow_the_released_qwen2vl_layout(tok):
    # [bos, bag, vs, video (T, H, W) = (2, 2, 2) merged, ve, bag, eos]
    sample = [("text", "bag"), ("video", rng_frames(8, 4, 16, 16, 3), np.arange(4.0)), ("answer", "bag")]
    batch = VLMCollator(tok, patch_size=P, position_variant="mrope")([sample])
    ids = batch["position_ids"][:, 0]  # (3, S)
    s = 3
    vt = [s + t for t in range(2) for i in range(2) for j in range(2)]
    vh = [s + i for t in range(2) for i in range(2) for j in range(2)]
    vw = [s + j for t in range(2) for i in range(2) for j in range(2)]
    nxt = s + 1 + 1  # the maximum over all axes + 1
    assert ids[0].tolist() == [0, 1, 2, *vt, nxt, nxt + 1, nxt + 2]
    assert ids[1].tolist() == [0, 1, 2, *vh, nxt, nxt + 1, nxt + 2]
    assert ids[2].tolist() == [0, 1, 2, *vw, nxt, nxt + 1, nxt + 2]
    assert batch["rope_deltas"].tolist() == [[nxt + 3 - 14]]

    # Qwen2.5-VL absolute time: 4 frames at 1 fps -> 2 s per temporal patch -> t = floor(tau * 2 * 2)
    abs_time = VLMCollator(tok, patch_size=P, position_variant="qwen25vl")([sample])
    assert abs_time["position_ids"][0, 0, 3:11].tolist() == [s, s, s, s, s + 4, s + 4, s + 4, s + 4]
    from vlpe.encodings import multimodal as mm

    ref, _ = mm.position_ids(
        "qwen25vl", abs_time["mm_token_type_ids"], abs_time["grid_thw"], attention_mask=abs_time["attention_mask"],
        second_per_grid_ts=torch.tensor([2.0]),
    )  # fmt: skip
    assert torch.equal(abs_time["position_ids"], ref)
    with pytest.raises(ValueError, match="unknown multimodal RoPE variant"):
        VLMCollator(tok, patch_size=P, position_variant="mrope_x")


def tiny_qwen2vl(tok, **text):
    """A randomly initialised stock transformers Qwen2-VL for the tokenizer (``text``: text-config overrides)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config={
            **dict(
                hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=tok.vocab_size,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
                bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
            ),
            **text,
        },
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=P, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=tok.image_token_id, video_token_id=tok.video_token_id, vision_start_token_id=tok.vision_start_id,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(cfg).eval()


def test_a_tiny_transformers_qwen2vl_consumes_the_batch(tok):
    model = tiny_qwen2vl(tok)
    images = [
        [("text", "what item ?"), ("image", rng_frames(9, 16, 24, 3)), ("answer", "coat")],
        [("image", rng_frames(10, 8, 8, 3)), ("text", "what"), ("image", rng_frames(11, 16, 8, 3)), ("answer", "bag")],
    ]
    for side in ("right", "left"):
        batch = VLMCollator(tok, patch_size=P, padding_side=side, position_variant="mrope")(images)
        hf = to_hf_inputs(batch)
        ours = hf.pop("position_ids")
        with torch.no_grad():
            ref, deltas = model.model.get_rope_index(
                hf["input_ids"], hf["mm_token_type_ids"], hf["image_grid_thw"], None, hf["attention_mask"]
            )
            out = model(**hf)
        real = batch["attention_mask"].bool()
        assert torch.equal(ours[:, real], ref[:, real])  # images: the released and the 5.x layouts agree
        assert torch.isfinite(out.loss)
    videos = [[("video", rng_frames(12, 3, 16, 16, 3), [0.0, 0.5, 1.0]), ("text", "what item ?"), ("answer", "bag")]]
    with torch.no_grad():
        assert torch.isfinite(model(**to_hf_inputs(VLMCollator(tok, patch_size=P)(videos))).loss)


# ---------------------------------------------------------------------------------------------- packing


def _mixed_samples():
    """Text-only, image, video and image + video samples of different lengths."""
    return [
        [("text", "what item ?"), ("image", rng_frames(20, 16, 8, 3)), ("answer", "coat")],
        [("text", "what item is shown in red ?"), ("answer", "bag")],
        [("video", rng_frames(21, 4, 16, 16, 3), [0.0, 0.5, 1.0, 1.5]), ("text", "what"), ("answer", "sneaker")],
        [("image", rng_frames(22, 8, 8, 3)), ("text", "what item ?"), ("video", rng_frames(23, 2, 8, 16, 3), [0.0, 1.0]),
         ("answer", "bag")],
    ]  # fmt: skip


def test_packing_refuses_left_padding(tok):
    # left padding would sit before a row's first sample inside its cu_seqlens segment (flash varlen attends to it)
    with pytest.raises(ValueError, match="packing=True needs padding_side='right'"):
        VLMCollator(tok, patch_size=P, padding_side="left", packing=True)


@pytest.mark.parametrize("side", ["right"])
@pytest.mark.parametrize("variant", ["mrope", "qwen25vl", "vrope", "pype"])
def test_packing_gives_every_sample_its_own_tokens_labels_and_positions(tok, side, variant):
    samples = _mixed_samples()
    opts = {"depth": 2} if variant == "pype" else {}
    alone = [VLMCollator(tok, patch_size=P, position_variant=variant, position_options=opts)([x]) for x in samples]
    lengths = [a["input_ids"].shape[1] for a in alone]
    limit = max(lengths[0] + lengths[1], lengths[2] + lengths[3])
    assert lengths[0] + lengths[1] + lengths[2] > limit  # the greedy rows are [0, 1] and [2, 3]
    packed = VLMCollator(tok, patch_size=P, padding_side=side, max_length=limit, position_variant=variant,
                         position_options=opts, packing=True)(samples)  # fmt: skip
    B, S = packed["input_ids"].shape
    assert B == 2 and S == max(lengths[0] + lengths[1], lengths[2] + lengths[3])
    # cu_seqlens over the flattened batch: the samples in order, each row's padding in its last (first) sample
    bounds = [0]
    for row in ([0, 1], [2, 3]):
        n = [lengths[i] for i in row]
        n[-1 if side == "right" else 0] += S - sum(n)
        for m in n:
            bounds.append(bounds[-1] + m)
    assert packed["cu_seqlens"].tolist() == bounds and packed["cu_seqlens"].dtype == torch.int32
    assert packed["rope_deltas"].shape[0] == 4
    for k, a in enumerate(alone):
        b, n = k // 2, lengths[k]
        row_start = 0 if side == "right" else S - (lengths[2 * b] + lengths[2 * b + 1])
        start = row_start + (lengths[2 * b] if k % 2 else 0)
        sl = slice(start, start + n)
        for key in ("input_ids", "mm_token_type_ids", "attention_mask"):
            assert torch.equal(packed[key][b, sl], a[key][0]), (key, k)
        want_labels = a["labels"][0].clone()
        want_labels[0] = -100  # nothing in the sample predicts its first token
        assert torch.equal(packed["labels"][b, sl], want_labels)
        assert torch.equal(packed["position_ids"][:, b, sl], a["position_ids"][:, 0]), k
        assert torch.equal(packed["rope_deltas"][k], a["rope_deltas"][0]), k
    pad = packed["attention_mask"] == 0
    assert (packed["input_ids"][pad] == tok.pad_id).all() and (packed["labels"][pad] == -100).all()
    for key in ("pixel_values", "grid_thw", "grid_types", "second_per_grid_ts", "video_grid_timestamps"):
        assert torch.equal(packed[key], torch.cat([a[key] for a in alone])), key


def test_packing_rows_and_hf_inputs(tok):
    samples = _mixed_samples()
    lengths = [VLMCollator(tok, patch_size=P)([x])["input_ids"].shape[1] for x in samples]
    one_row = VLMCollator(tok, patch_size=P, packing=True, position_variant="mrope")(samples)
    assert one_row["input_ids"].shape == (1, sum(lengths)) and one_row["attention_mask"].all()
    per_sample = VLMCollator(tok, patch_size=P, packing=True, max_length=max(lengths))(samples)
    assert per_sample["input_ids"].shape[0] == 4  # no two samples fit into one row
    hf = to_hf_inputs(one_row)
    assert "attention_mask" not in hf and hf["use_cache"] is False
    cu = one_row["cu_seqlens"].tolist()
    text = hf["position_ids"][0, 0]
    assert text.tolist() == sum((list(range(b - a)) for a, b in zip(cu, cu[1:])), [])  # restarts at every sample
    assert torch.equal(hf["position_ids"][1:], one_row["position_ids"])
    with pytest.raises(ValueError, match="needs its per-sample position_ids"):
        to_hf_inputs(VLMCollator(tok, patch_size=P, packing=True)(samples))
    with pytest.raises(ValueError, match="packing must be True or False"):
        VLMCollator(tok, packing="yes")


def test_a_tiny_transformers_qwen2vl_on_a_packed_batch(tok):
    """The stock transformers model (its own mrope rotary) on a packed batch: every sample's logits and the loss
    equal those of the samples collated one by one."""
    torch.manual_seed(0)
    model = tiny_qwen2vl(tok, num_hidden_layers=2, initializer_range=0.2)
    samples = _mixed_samples()
    collate = dict(patch_size=P, position_variant="mrope")
    lengths = [VLMCollator(tok, patch_size=P)([x])["input_ids"].shape[1] for x in samples]
    packed = VLMCollator(tok, **collate, packing=True, max_length=lengths[0] + lengths[1])(samples)
    with torch.no_grad():
        out = model(**to_hf_inputs(packed))
        cu = packed["cu_seqlens"].tolist()
        S = packed["input_ids"].shape[1]
        flat = out.logits.reshape(-1, out.logits.shape[-1])
        for k, x in enumerate(samples):
            one = model(**to_hf_inputs(VLMCollator(tok, **collate)([x]))).logits[0]
            torch.testing.assert_close(flat[cu[k] : cu[k] + one.shape[0]], one, atol=1e-5, rtol=0)
        unpacked = model(**to_hf_inputs(VLMCollator(tok, **collate)(samples)))
        torch.testing.assert_close(out.loss, unpacked.loss, atol=1e-5, rtol=0)
        # control: the same packed row with one text row for the whole row (no restarts) mixes the samples
        hf = to_hf_inputs(packed)
        hf["position_ids"] = hf["position_ids"].clone()
        hf["position_ids"][0] = torch.arange(S)
        mixed = model(**hf).logits
        assert (mixed - out.logits).abs().max() > 1e-3


# ------------------------------------------------------------------------------------- workers, errors


def test_dataloader_workers_with_vniah(tok):
    ds = VNIAH(lengths=(8, 12), depths=(0.0, 1.0), samples_per_cell=2, size=16, distractors="single", delta=2)
    collate = VLMCollator(tok, patch_size=P, position_variant="mrope")
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=collate)
    batches = list(loader)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(ds)
    for k, b in enumerate(batches):
        ref = collate([ds[i] for i in range(3 * k, min(3 * k + 3, len(ds)))])
        assert ref.keys() == b.keys()
        for key in ref:
            assert torch.equal(ref[key], b[key]), key
    first = batches[0]
    answer_ids = first["labels"][first["labels"] != -100].tolist()
    assert tok.decode(answer_ids).split()[0] == ds[0]["answer"]


def test_bad_inputs(tok):
    col = VLMCollator(tok, patch_size=P)
    with pytest.raises(ValueError, match="multiple of patch_size \\* merge_size = 8"):
        col([[("image", rng_frames(0, 12, 16, 3))]])
    with pytest.raises(ValueError, match="needs 4 timestamps"):
        col([[("video", rng_frames(0, 4, 8, 8, 3), [0.0, 1.0])]])
    with pytest.raises(ValueError, match="strictly increasing"):
        col([[("video", rng_frames(0, 2, 8, 8, 3), [1.0, 1.0])]])
    with pytest.raises(ValueError, match="timestamps"):
        col([[("video", rng_frames(0, 2, 8, 8, 3))]])
    with pytest.raises(ValueError, match="channels-last"):
        col([[("image", rng_frames(0, 3, 8, 8))]])
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        col([[("answer", "zebra")]])
    with pytest.raises(ValueError, match="segment"):
        col([[("audio", b"")]])
    with pytest.raises(ValueError, match="max_length=4"):
        VLMCollator(tok, patch_size=P, max_length=4)([[("text", "what item is shown in red ?")]])
    with pytest.raises(ValueError, match="padding_side"):
        VLMCollator(tok, padding_side="middle")
