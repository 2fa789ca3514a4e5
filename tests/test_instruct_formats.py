"""data.instruct on the annotation formats of the fine-tuning stacks users come from (LLaMA-Factory and ms-swift
``messages``, ms-swift ``conversations`` with user / assistant / bot, Qwen content items), frame-list videos,
images and videos in one sample, media kept under the media root, and bad media / text skipped, counted or refused.

The example files are written here after the stacks' documented examples (LLaMA-Factory ``data/mllm_demo.json`` and
``mllm_video_demo.json``, ms-swift's custom-dataset page, the Qwen-VL model cards); each is checked against the
LLaVA file that says the same thing, which the LLaVA tests of tests/test_instruct_data.py pin down.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import numpy as np
import pytest
import torch

from data.instruct import AnnotationError, InstructDataset, MediaError, load_image, load_video, read_annotations
from data.instruct.annotations import FORMATS, parse_samples
from data.instruct.media import load_frames, load_video_indexed, video_indices
from data.video import write_video

WORDS = ["Who are they ?", "Kane and Gretzka", "What are they doing ?", "celebrating", "Why is this video funny ?",
         "a baby is reading", "What is in the image , and the video ?", "an elephant and a lion", "Be brief"]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    from models.tiny_qwen_vl import save_tiny_qwen_vl

    folder = save_tiny_qwen_vl("qwen2_5_vl", tmp_path_factory.mktemp("q25"), texts=WORDS, frame=28, max_frame=56)
    return AutoProcessor.from_pretrained(folder, local_files_only=True)


def _gray(n: int, size=(56, 56)) -> np.ndarray:
    levels = 10 + 20 * np.arange(n)  # frame t is flat gray 10 + 20 t
    return np.broadcast_to(levels[:, None, None, None], (n, *size, 3)).astype(np.uint8)  # (T, H, W, 3)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("media")
    (root / "clips").mkdir()
    write_video(root / "clips" / "fade10.mp4", _gray(10), fps=5.0)  # 10 frames at 5 fps
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(root / "wide.png")
    (root / "frames").mkdir()
    for t, frame in enumerate(_gray(4)):
        Image.fromarray(frame).save(root / "frames" / f"{t:03d}.png")
    return root


FRAMES = [f"frames/{t:03d}.png" for t in range(4)]


# the same three samples in every format ---------------------------------------------------------------------------
def _llava():
    return [
        {"id": 0, "image": ["wide.png", "wide.png"], "conversations": [
            {"from": "human", "value": "<image>Who are they ?"}, {"from": "gpt", "value": "Kane and Gretzka"},
            {"from": "human", "value": "What are they doing ?<image>"}, {"from": "gpt", "value": "celebrating"}]},
        {"id": 1, "system": "Be brief", "video": "clips/fade10.mp4", "conversations": [
            {"from": "human", "value": "<video>Why is this video funny ?"},
            {"from": "gpt", "value": "a baby is reading"}]},
        {"id": 2, "image": "wide.png", "video": "clips/fade10.mp4", "conversations": [
            {"from": "human", "value": "<image>What is in the image , and the video ?<video>"},
            {"from": "gpt", "value": "an elephant and a lion"}]},
    ]  # fmt: skip


def _sharegpt():  # LLaMA-Factory's mllm demos / ms-swift's standard format
    return [
        {"id": 0, "messages": [
            {"role": "user", "content": "<image>Who are they ?"}, {"role": "assistant", "content": "Kane and Gretzka"},
            {"role": "user", "content": "What are they doing ?<image>"},
            {"role": "assistant", "content": "celebrating"}], "images": ["wide.png", "wide.png"]},
        {"id": 1, "messages": [
            {"role": "system", "content": "Be brief"}, {"role": "user", "content": "<video>Why is this video funny ?"},
            {"role": "assistant", "content": "a baby is reading"}], "videos": ["clips/fade10.mp4"]},
        {"id": 2, "messages": [
            {"role": "user", "content": "<image>What is in the image , and the video ?<video>"},
            {"role": "assistant", "content": "an elephant and a lion"}],
         "images": ["wide.png"], "videos": ["clips/fade10.mp4"]},
    ]  # fmt: skip


def _swift_conversations():  # ms-swift's conversations with user / assistant / bot and top-level media lists
    return [
        {"id": 0, "conversations": [
            {"from": "user", "value": "<image>Who are they ?"}, {"from": "bot", "value": "Kane and Gretzka"},
            {"from": "user", "value": "What are they doing ?<image>"}, {"from": "assistant", "value": "celebrating"}],
         "images": ["wide.png", "wide.png"]},
        {"id": 1, "system": "Be brief", "conversations": [
            {"from": "user", "value": "<video>Why is this video funny ?"},
            {"from": "assistant", "value": "a baby is reading"}], "videos": ["clips/fade10.mp4"]},
        {"id": 2, "conversations": [
            {"from": "user", "value": "<image>What is in the image , and the video ?<video>"},
            {"from": "bot", "value": "an elephant and a lion"}],
         "images": ["wide.png"], "videos": ["clips/fade10.mp4"]},
    ]  # fmt: skip


def _qwen(root):  # the Qwen-VL model cards' messages: content items, file:// paths
    img = {"type": "image", "image": "file://wide.png"}
    vid = {"type": "video", "video": "file://clips/fade10.mp4"}
    return [
        {"id": 0, "messages": [
            {"role": "user", "content": [img, {"type": "text", "text": "Who are they ?"}]},
            {"role": "assistant", "content": "Kane and Gretzka"},
            {"role": "user", "content": [{"type": "text", "text": "What are they doing ?"}, img]},
            {"role": "assistant", "content": [{"type": "text", "text": "celebrating"}]}]},
        {"id": 1, "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief"}]},
            {"role": "user", "content": [vid, {"type": "text", "text": "Why is this video funny ?"}]},
            {"role": "assistant", "content": "a baby is reading"}]},
        {"id": 2, "messages": [
            {"role": "user", "content": [img, {"text": "What is in the image , "}, {"text": "and the video ?"}, vid]},
            {"role": "assistant", "content": "an elephant and a lion"}]},
    ]  # fmt: skip


def _write(path, samples, jsonl=False):
    path.write_text("\n".join(json.dumps(s) for s in samples) if jsonl else json.dumps(samples, indent=1))
    return path


def _messages(parsed):
    return [p["messages"] for p in parsed]


@pytest.mark.parametrize("name, make, fmt", [
    ("sharegpt", _sharegpt, "sharegpt"), ("swift_conversations", _swift_conversations, "llava"),
    ("qwen", _qwen, "qwen"),
])  # fmt: skip
def test_each_format_reads_as_the_equivalent_llava_file(tmp_path, media, name, make, fmt):
    samples = make(media) if make is _qwen else make()
    for jsonl in (False, True):
        path = _write(tmp_path / f"{name}.json{'l' * jsonl}", samples, jsonl)
        llava = _write(tmp_path / "llava.json", _llava())
        got = parse_samples(read_annotations(path), source=path.name)
        want = parse_samples(read_annotations(llava), source="llava.json")
        assert {g["format"] for g in got} == {fmt}
        assert _messages(got) == _messages(want)
        assert [g["id"] for g in got] == [0, 1, 2]
        assert parse_samples(read_annotations(path, format=fmt), format=fmt) == got  # the detected format, given


def test_a_format_set_by_name_checks_every_sample(tmp_path):
    path = _write(tmp_path / "set.json", _sharegpt())
    with pytest.raises(AnnotationError, match=r"set.json: sample 0: has no 'conversations' \(the llava format: .*"
                                              r"\(it has 'messages': a sharegpt sample\)"):  # fmt: skip
        read_annotations(path, format="llava")
    with pytest.raises(AnnotationError, match="format must be 'auto' or one of"):
        read_annotations(path, format="alpaca")
    odd = _write(tmp_path / "odd.json", [{"instruction": "x", "output": "y"}])
    with pytest.raises(AnnotationError) as err:
        read_annotations(odd)
    assert "odd.json: sample 0: matches no annotation format (keys ['instruction', 'output'])" in str(err.value)
    assert all(f"{name}: " in str(err.value) for name in FORMATS)  # the error lists every format read
    mixed = _sharegpt()
    mixed[2] = _qwen(None)[2]  # a qwen sample in a file whose first sample is sharegpt: read as qwen, all of it
    path = _write(tmp_path / "mixed.json", mixed)
    with pytest.raises(AnnotationError, match=r"mixed.json: sample 0: has 'images', but in the qwen format media are "
                                              r"items .* detected from sample 2"):  # fmt: skip
        read_annotations(path)


def test_dataset_items_are_the_same_in_every_format(tmp_path, processor, media):
    kwargs = dict(media_root=media, processor=processor, family="qwen2_5_vl", fps=2.0, max_frames=8)
    want = InstructDataset(annotations=_write(tmp_path / "l.json", _llava()), **kwargs)
    for samples in (_sharegpt(), _swift_conversations(), _qwen(media)):
        got = InstructDataset(annotations=_write(tmp_path / "x.json", samples), **kwargs)
        for i in range(3):
            a, b = got[i], want[i]
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(a[key], b[key]) if torch.is_tensor(a[key]) else None
    mixed = want[2]  # one image and one video in one sample, each through the processor
    assert mixed["image_grid_thw"].shape == (1, 3) and mixed["video_grid_thw"].shape == (1, 3)
    ids = mixed["input_ids"].tolist()
    image_pad, video_pad = processor.tokenizer.convert_tokens_to_ids([processor.image_token, processor.video_token])
    assert ids.index(image_pad) < ids.index(video_pad)  # in the order of the text


# frame lists ------------------------------------------------------------------------------------------------------
def test_a_video_given_as_frame_files(tmp_path, processor, media):
    question = [{"from": "human", "value": "<video>Why is this video funny ?"}, {"from": "gpt", "value": "a baby"}]
    flat = {"video": FRAMES, "conversations": question}  # a list of image files in 'video': one video of frames
    nested = {"videos": [FRAMES], "conversations": question}
    qwen = {"messages": [{"role": "user", "content": [{"type": "video", "video": [f"file://{f}" for f in FRAMES]},
                                                      {"type": "text", "text": "Why is this video funny ?"}]},
                         {"role": "assistant", "content": "a baby"}]}  # fmt: skip
    parsed = [parse_samples([s])[0]["messages"] for s in (flat, nested, qwen)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0][0]["content"][0] == {"type": "video", "frames": FRAMES}
    frames, ts, idx, rate, n = load_frames([media / f for f in FRAMES], fps=2.0, max_frames=32)
    np.testing.assert_array_equal(frames, _gray(4))  # PNG frames are lossless
    np.testing.assert_allclose(ts, [0.0, 0.5, 1.0, 1.5])  # frame k at k / fps
    thin = load_frames([media / f for f in FRAMES], fps=2.0, max_frames=2)[2]
    np.testing.assert_array_equal(thin, [0, 3])
    item = InstructDataset(annotations=[flat], media_root=media, processor=processor, family="qwen2_5_vl")[0]
    assert item["video_grid_thw"][0, 0].item() == 2  # 4 frames, 2 per temporal patch
    torch.testing.assert_close(item["second_per_grid_ts"], torch.tensor([2 * 0.5]))
    with pytest.raises(AnnotationError, match=r"videos\[1\] is an image file \(frames/000.png\) among video files"):
        parse_samples([{"videos": ["clips/fade10.mp4", "frames/000.png"], "conversations": question}])


def test_frame_lists_with_a_missing_or_odd_sized_frame_are_skipped(tmp_path, processor, media):
    from PIL import Image

    Image.fromarray(np.zeros((28, 56, 3), np.uint8)).save(tmp_path / "small.png")
    for f in FRAMES:
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_bytes((media / f).read_bytes())
    with pytest.raises(MediaError, match="the frames of one video share one size"):
        load_frames([tmp_path / FRAMES[0], tmp_path / "small.png"], fps=1.0, max_frames=8)
    sample = {"video": [*FRAMES, "frames/gone.png"], "conversations": [
        {"from": "human", "value": "<video>x"}, {"from": "gpt", "value": "celebrating"}]}  # fmt: skip
    ds = InstructDataset(annotations=[sample], media_root=tmp_path, processor=processor, family="qwen2_5_vl",
                         max_skipped_fraction=1.0)  # fmt: skip
    with pytest.warns(RuntimeWarning, match="gone.png: no such file"):
        assert ds[0] is None
    assert list(ds.skipped) == [str(tmp_path / "frames/gone.png")]


# per-item settings --------------------------------------------------------------------------------------------
def test_qwen_items_settings_are_honoured(processor, media):
    def sample(**options):
        return {"messages": [{"role": "user", "content": [
            {"type": "video", "video": "clips/fade10.mp4", **options.get("video", {})},
            {"type": "image", "image": "wide.png", **options.get("image", {})},
            {"type": "text", "text": "What is in the image , and the video ?"}]},
            {"role": "assistant", "content": "an elephant and a lion"}]}  # fmt: skip

    kwargs = dict(media_root=media, processor=processor, family="qwen2_5_vl", fps=2.0, max_frames=32)
    plain = InstructDataset(annotations=[sample()], **kwargs)[0]
    own = InstructDataset(annotations=[sample(video={"fps": 1.0}, image={"max_pixels": 28 * 28})], **kwargs)[0]
    count = InstructDataset(annotations=[sample(video={"nframes": 6})], **kwargs)[0]
    for item, fps in ((plain, 2.0), (own, 1.0)):  # the item's fps: the frames video_indices gives at that rate
        t = video_indices(10, 5.0, fps=fps, max_frames=32).size
        assert item["video_grid_thw"][0, 0].item() == -(-t // 2)
    assert count["video_grid_thw"][0, 0].item() == 3  # nframes=6: 6 frames, 3 temporal patches
    h, w = plain["image_grid_thw"][0, 1:].tolist()
    assert h * w * 14 * 14 > 28 * 28  # the processor's budget of 56 x 56 pixels: 2 x 4 patches
    h, w = own["image_grid_thw"][0, 1:].tolist()
    assert h * w * 14 * 14 <= 28 * 28  # the item's own max_pixels
    with pytest.raises(AnnotationError, match=r"messages\[0\].content\[0\] sets \['resized_height'\], which are "
                                              r"not read; a media item may set \['fps', 'nframes'"):  # fmt: skip
        parse_samples([sample(video={"resized_height": 28})])
    with pytest.raises(AnnotationError, match=r"content\[1\].fps is a video setting"):
        parse_samples([sample(image={"fps": 1.0})])
    with pytest.raises(AnnotationError, match=r"content\[0\].nframes must be a integer >= 2"):
        parse_samples([sample(video={"nframes": 1})])


def test_separate_image_and_video_budgets(processor, media):
    llava = _llava()[2]
    kwargs = dict(annotations=[llava], media_root=media, processor=processor, family="qwen2_5_vl")
    both = InstructDataset(**kwargs, max_pixels=56 * 56)[0]
    small_images = InstructDataset(**kwargs, max_pixels=56 * 56, image_max_pixels=28 * 28)[0]
    small_videos = InstructDataset(**kwargs, max_pixels=56 * 56, video_max_pixels=28 * 28)[0]
    assert torch.equal(small_images["video_grid_thw"], both["video_grid_thw"])
    assert torch.equal(small_videos["image_grid_thw"], both["image_grid_thw"])
    assert small_images["image_grid_thw"][0, 1:].prod() * 196 <= 28 * 28 < both["image_grid_thw"][0, 1:].prod() * 196
    assert small_videos["video_grid_thw"][0, 1:].prod() * 196 <= 28 * 28 < both["video_grid_thw"][0, 1:].prod() * 196


def test_videos_are_decoded_at_the_pixel_budget(tmp_path):
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (6, 120, 200, 3), dtype=np.uint8)
    write_video(tmp_path / "big.mp4", frames, fps=6.0)
    full, ts = load_video(tmp_path / "big.mp4", fps=6.0, max_frames=8)
    small, ts2 = load_video(tmp_path / "big.mp4", fps=6.0, max_frames=8, max_pixels=60 * 100)
    assert full.shape[1:] == (120, 200, 3) and small.shape[1:] == (60, 100, 3)  # aspect ratio kept, 1/4 the pixels
    assert small.shape[0] == full.shape[0]
    np.testing.assert_array_equal(ts, ts2)
    within = load_video(tmp_path / "big.mp4", fps=6.0, max_frames=8, max_pixels=120 * 200)[0]
    np.testing.assert_array_equal(within, full)  # within the budget: decoded as it is
    # the budgeted frames are the full frames scaled down: close to a box average of 2x2 blocks
    box = full.reshape(-1, 60, 2, 100, 2, 3).mean(axis=(2, 4))
    spread = np.abs(full.astype(float) - box.repeat(2, 1).repeat(2, 2)).mean()  # how far a pixel is from its block
    assert np.abs(small.astype(float) - box).mean() < 0.5 * spread


# media stay under the media root ----------------------------------------------------------------------------------
def _one(path, kind="image"):
    return {kind: path, "conversations": [{"from": "human", "value": f"<{kind}>x"}, {"from": "gpt", "value": "y"}]}


def test_paths_outside_the_media_root_are_refused(tmp_path, processor, media):
    from PIL import Image

    root = tmp_path / "data" / "media"
    root.mkdir(parents=True)
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "x.png")  # outside the root
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(root / "in.png")
    os.symlink(tmp_path / "x.png", root / "link.png")  # a symlink that resolves outside
    os.symlink(root / "in.png", root / "inside_link.png")  # one that stays inside
    os.symlink("/etc/shadow", root / "shadow.png")
    kwargs = dict(media_root=root, processor=processor, family="qwen2_5_vl")
    for path, how in (("../../x.png", "leads"), (str(tmp_path / "x.png"), "leads"), ("../../../../etc/passwd", "leads"),
                      ("file://" + str(tmp_path / "x.png"), "leads")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"sample 0: the media path .* {how} outside data.media_root .*"
                                             "data.allow_outside_root=true"):  # fmt: skip
            InstructDataset(annotations=[_one(path)], **kwargs)
    for link in ("link.png", "shadow.png"):  # caught when the file is read, before it is opened
        ds = InstructDataset(annotations=[_one(link)], **kwargs)
        with pytest.raises(ValueError, match=rf"the media path '{link}' resolves outside data.media_root"):
            ds[0]
    assert InstructDataset(annotations=[_one("inside_link.png")], **kwargs)[0] is not None
    allowed = InstructDataset(annotations=[_one("../../x.png"), _one(str(tmp_path / "x.png")), _one("link.png")],
                              allow_outside_root=True, **kwargs)  # fmt: skip
    assert all(allowed[i] is not None for i in range(3))


# bad media and text -----------------------------------------------------------------------------------------------
def test_pictures_the_processors_refuse_are_skipped_and_counted(tmp_path, processor):
    from PIL import Image

    Image.fromarray(np.zeros((2, 402, 3), np.uint8)).save(tmp_path / "strip.png")  # 201:1
    write_video(tmp_path / "strip.mp4", np.zeros((4, 2, 404, 3), np.uint8), fps=2.0)
    with pytest.raises(MediaError, match=r"strip.png: its frames are 402x2 pixels, an aspect ratio over 200:1"):
        load_image(tmp_path / "strip.png")
    samples = [_one("strip.png"), _one("strip.mp4", "video"), _one("ok.png")]
    Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "ok.png")
    ds = InstructDataset(annotations=samples, media_root=tmp_path, processor=processor, family="qwen2_5_vl",
                         max_skipped_fraction=1.0)  # fmt: skip
    with pytest.warns(RuntimeWarning, match="aspect ratio over 200"):
        assert ds[0] is None and ds[1] is None
    assert ds[2] is not None
    assert sorted(ds.skipped) == sorted(str(tmp_path / p) for p in ("strip.png", "strip.mp4"))


def test_text_that_is_no_text_and_deep_json_name_the_sample(tmp_path):
    sample = _sharegpt()[1]
    sample["messages"][2]["content"] = "a \ud800 b"
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps(_sharegpt()[0]) + "\n" + json.dumps(sample) + "\n")  # json escapes the surrogate
    with pytest.raises(AnnotationError, match=re.escape(r"s.jsonl: sample 1 (line 2): messages[2].content holds "
                                                        r"'\ud800' at character 2, a lone surrogate")):  # fmt: skip
        read_annotations(path)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AnnotationError, match="deep.json: the JSON is nested too deeply"):
        read_annotations(deep)
    deep.write_text('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n{}\n")
    with pytest.raises(AnnotationError, match="deep.json: line 1: the JSON is nested too deeply"):
        read_annotations(deep)


def test_a_set_of_broken_media_stops_with_a_clear_error(tmp_path, processor, media):
    for k in range(20):
        (tmp_path / f"v{k}.mp4").write_bytes(b"not a video" * 50)
    samples = [_one(f"v{k}.mp4", "video") for k in range(20)]
    ds = InstructDataset(annotations=samples, media_root=tmp_path, processor=processor, family="qwen2_5_vl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(15):
            assert ds[i] is None  # fewer than 16 read: no verdict yet
        with pytest.raises(ValueError, match=r"16 of the 16 samples of annotations read in this process were left "
                                             r"out, more than max_skipped_fraction=0.5: 16 media file\(s\) "
                                             "unreadable"):  # fmt: skip
            ds[15]
    # a set smaller than 16 is judged once as many samples as it holds were read
    (tmp_path / "wide.png").write_bytes((media / "wide.png").read_bytes())
    small = InstructDataset(annotations=[samples[0], _one("wide.png")], media_root=tmp_path, processor=processor,
                            family="qwen2_5_vl")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert small[1] is not None and small[0] is None  # 1 of 2 left out: not more than half
        with pytest.raises(ValueError, match="2 of the 3 samples of annotations read in this process were left out"):
            small[0]


# a learning rate per part -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_optimizer_groups_per_part(tiny_qwen_vl, family):
    from types import SimpleNamespace

    from transformers import AutoModelForImageTextToText

    from train.engine import param_groups
    from train.finetune import CausalLM, _with_parts

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen_vl(family), local_files_only=True)
    visual = model.model.visual
    mergers = [visual.merger, *getattr(visual, "deepstack_merger_list", [])]
    want = {"merger": {id(p) for m in mergers for p in m.parameters()},
            "encoding": {id(p) for p in visual.pos_embed.parameters()} if hasattr(visual, "pos_embed") else set(),
            "llm": {id(p) for p in [*model.model.language_model.parameters(), *model.lm_head.parameters()]}}
    want["vision"] = {id(p) for p in visual.parameters()} - want["merger"] - want["encoding"]
    assert (family == "qwen3_vl") == bool(want["encoding"])  # Qwen3-VL's vision tower learns a position table
    train = SimpleNamespace(lr=1e-3, lr_parts={"vision": 1e-5, "merger": 3e-3, "encoding": 5e-2},
                            weight_decay_parts={"llm": 0.1})  # fmt: skip
    module = _with_parts(CausalLM(model=model), train)
    groups = param_groups(module, 0.01)
    opt = torch.optim.AdamW(groups, lr=train.lr)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == sum(1 for _ in model.parameters())  # each parameter in one group
    lr = {"vision": 1e-5, "merger": 3e-3, "encoding": 5e-2, "llm": 1e-3}
    for g in opt.param_groups:
        assert {id(p) for p in g["params"]} <= want[g["part"]]
        assert g["lr"] == lr[g["part"]]
        decayed = any(p.ndim >= 2 and "pos_embed" not in n for n, p in module.named_parameters()
                      if any(p is q for q in g["params"]))  # fmt: skip
        assert g["weight_decay"] == ((0.1 if g["part"] == "llm" else 0.01) if decayed else 0.0)
    parts = {g["part"] for g in opt.param_groups}
    assert parts == {k for k, v in want.items() if v}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # the schedule scales every part alike
    assert [g["lr"] for g in opt.param_groups] == [0.5 * lr[g["part"]] for g in opt.param_groups]
    del sched


def test_the_new_keys_are_checked_when_the_config_is_read():
    from train.config import ConfigError, load_config
    from train.vlm_setup import VLMConfig

    base = ["model.hf_model=folder"]
    cfg = load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [*base, "train.lr_parts={vision: 2.0e-6, merger: 1e-5}"])
    assert cfg.train.lr_parts == {"vision": 2e-6, "merger": 1e-5} and cfg.data.format == "auto"
    for override, message in (("train.lr_parts={eyes: 1.0}", "train.lr_parts: unknown part 'eyes'; choose any of "
                                                              "['vision', 'merger', 'llm', 'encoding']"),
                              ("train.lr_parts={llm: 0}", "train.lr_parts.llm must be a number > 0"),
                              ("train.weight_decay_parts={llm: -1}",
                               "train.weight_decay_parts.llm must be a number >= 0"),
                              ("data.format=alpaca", "is not one of ['auto', 'llava', 'sharegpt', 'qwen']"),
                              ("data.max_skipped_fraction=2", "data.max_skipped_fraction must lie in [0, 1]"),
                              ("data.nframes=1", "data.nframes must be >= 2")):  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(VLMConfig, "configs/hf/qwen2_vl.yaml", [*base, override])
    with pytest.raises(ConfigError, match=re.escape("data.allow_outside_root applies to fine-tuning a checkpoint")):
        load_config(VLMConfig, "configs/mrope.yaml", ["data.allow_outside_root=true"])  # the small VLM


# progress in a redirected log -------------------------------------------------------------------------------------
def test_progress_in_a_log_file_is_lines_not_a_redrawn_bar(tmp_path):
    import io

    from train.progress import LineProgress, progress

    with open(tmp_path / "run.log", "w") as log:
        bar = progress(total=300, initial=0, desc="train run", file=log)
        assert isinstance(bar, LineProgress)
        for step in range(300):
            bar.update(1)
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
        bar.write("[val] step 300: accuracy=1.0000")
        bar.close()
    text = (tmp_path / "run.log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 21 and len(text) < 2000  # a line every 15 steps, and the val line
    assert lines[0].startswith("train run: step 15/300 (5%)") and lines[-2].startswith("train run: step 300/300 (100%)")
    assert lines[-2].endswith("loss=0.0033")
    resumed = io.StringIO()
    bar = LineProgress(total=10, initial=7, desc="r", every=4, file=resumed)
    for _ in range(3):
        bar.update(1)
    assert [ln.split(" (")[0] for ln in resumed.getvalue().splitlines()] == ["r: step 8/10", "r: step 10/10"]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    from tqdm import tqdm

    assert isinstance(progress(total=3, initial=0, desc="t", file=Tty()), tqdm)  # a terminal keeps its bar


@pytest.mark.slow
def test_a_fine_tune_on_broken_media_stops_with_a_clear_error(tiny_qwen_vl, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    for k in range(24):
        (tmp_path / f"v{k}.mp4").write_bytes(b"not a video" * 50)
    samples = [{"messages": [{"role": "user", "content": "<video>What item is shown in red?"},
                             {"role": "assistant", "content": "cat"}], "videos": [f"v{k}.mp4"]} for k in range(24)]
    _write(tmp_path / "train.jsonl", samples, jsonl=True)
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "train/vlm.py", "--config", "configs/hf/qwen2_vl.yaml",
           f"model.hf_model={tiny_qwen_vl('qwen2_vl')}", f"data.annotations={tmp_path / 'train.jsonl'}",
           "train.steps=20", "train.micro_batch=4", "train.grad_accum=1", "train.num_workers=0", "train.zero_stage=2",
           "train.progress=false", "train.gradient_checkpointing=false", f"train.out_dir={tmp_path / 'run'}"]
    r = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode != 0, r.stdout[-2000:]
    assert "16 of the 16 samples of train.jsonl read in this process were left out, more than " \
           "max_skipped_fraction=0.5: 16 media file(s) unreadable" in r.stderr, r.stderr[-3000:]  # fmt: skip
    assert not (tmp_path / "run" / "hf").exists()  # no export of an unchanged model
