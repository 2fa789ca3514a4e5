"""What loads an export checks what it reads: the record in ``config.json`` / ``model.config.vlpe`` and the file.

Every bad record or file is refused with a ValueError naming the file (or ``model.config``) and the key, before any
weight loads (:func:`vlpe_hf.from_pretrained` is checked with a folder that has no weights: a refusal there cannot
come from loading them), and ``apply`` called directly refuses the same rotary values.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from test_integration_transformers import _build  # noqa: E402

from vlpe.integrations import transformers as vhf  # noqa: E402


def folder_with(tmp_path, text: str):
    """A folder holding only a ``config.json`` with ``text``: no weights, so only the config can be read."""
    (tmp_path / "config.json").write_text(text)
    return tmp_path


BAD_OPTIONS = {  # options of a {"variant": "mrope"} record -> what the error names
    "nan theta": ({"theta": float("nan")}, "'theta'"),
    "infinite theta": ({"theta": float("inf")}, "'theta'"),
    "negative theta": ({"theta": -1.0}, "'theta'"),
    "string theta": ({"theta": "1e4"}, "'theta'"),
    "boolean theta": ({"theta": True}, "'theta'"),
    "null theta": ({"theta": None}, "'theta'"),
    "string section": ({"section": "233"}, "'section'"),
    "fractional section": ({"section": [2, 3.5, 2.5]}, "'section'"),
    "negative section": ({"section": [-1, 5, 4]}, "'section'"),
    "boolean section": ({"section": [True, 3, 4]}, "'section'"),
    "numeric allocation": ({"allocation": 3}, "'allocation'"),
    "unknown allocation": ({"allocation": "sideways"}, "sideways"),
    "list scaling": ({"scaling": [2.0]}, "'scaling'"),
    "model as option": ({"model": "x"}, "'model' is not an option"),
    "variant as option": ({"variant": "mrope_i"}, "'variant' is not an option"),
    "misspelt option": ({"spatial_rest": True}, "'spatial_rest' is not an option"),
    "huge design option": ({"temporal_stride": 1e308}, "temporal_stride"),  # the design's own check (with_options)
    "string design option": ({"temporal_stride": "2"}, "temporal_stride"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_recorded_options_name_the_file_and_key(case, tmp_path):
    options, named = BAD_OPTIONS[case]
    record = {"format": 1, "variant": "mrope", "options": options}
    folder = folder_with(tmp_path, json.dumps({"model_type": "qwen2_vl", "vlpe": record}))
    file = re.escape(str(folder / "config.json"))
    for read in (lambda: vhf.recorded_variant(folder), lambda: vhf.from_pretrained(folder)):
        with pytest.raises(ValueError, match=file) as err:
            read()
        assert named in str(err.value), str(err.value)
    model = _build("qwen2_vl")
    model.config.vlpe = record
    with pytest.raises(ValueError, match="^model.config: ") as err:
        vhf.apply(model)
    assert named in str(err.value)
    assert not hasattr(model.config, "vlpe") or vhf.patch_of(model) is None  # nothing installed


def test_bad_recorded_variant_fields_name_the_file(tmp_path):
    for fields, named in (({"design": "grid", "allocation": "chunked", "theta": float("nan")}, "'theta'"),
                          ({"design": "grid", "allocation": "chunked", "theta": "1e4"}, "'theta'"),
                          ({"design": "grid", "allocation": "chunked", "section": "abc"}, "'section'"),
                          ({"design": "pype", "allocation": "chunked"}, "not valid"),
                          ({"design": "nope", "allocation": "chunked"}, "not valid"),
                          ("not_a_variant", "unknown multimodal RoPE variant")):  # fmt: skip
        folder = folder_with(tmp_path, json.dumps({"vlpe": {"format": 1, "variant": fields, "options": {}}}))
        with pytest.raises(ValueError, match=re.escape(str(folder / "config.json"))) as err:
            vhf.recorded_variant(folder)
        assert named in str(err.value), str(err.value)


def test_apply_refuses_bad_rotary_values():
    model = _build("qwen2_vl")
    for options, named in (({"theta": float("nan")}, "'theta'"), ({"theta": "1e4"}, "'theta'"),
                           ({"theta": 0.0}, "'theta'"), ({"section": ["2", 3, 3]}, "'section'"),
                           ({"scaling": "yarn"}, "'scaling'"), ({"allocation": None}, "'allocation'")):  # fmt: skip
        with pytest.raises(ValueError, match="^apply: ") as err:
            vhf.apply(model, "mrope", **options)
        assert named in str(err.value)
        assert vhf.patch_of(model) is None
    vhf.apply(model, "mrope", theta=5e5, section=(2, 3, 3), scaling=None)  # the good forms still apply
    assert vhf.patch_of(model).variant.theta == 5e5


@pytest.mark.parametrize("text, named", [("{not json", "is not valid JSON"), (b"\xff\xfe{}", "is not valid JSON"),
                                         ("[1, 2]", "holds a JSON list"), ("null", "holds a JSON NoneType")])
def test_config_that_is_not_a_json_object_names_the_file(text, named, tmp_path):
    file = tmp_path / "config.json"
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    for read in (lambda: vhf.recorded_variant(tmp_path), lambda: vhf.from_pretrained(tmp_path),
                 lambda: vhf.from_pretrained(tmp_path, variant="mrope")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(str(file))) as err:
            read()
        assert named in str(err.value)


def test_given_variant_options_are_checked_before_loading(tmp_path):
    folder = folder_with(tmp_path, json.dumps({"model_type": "qwen2_vl"}))  # no weights: loading would fail
    for options, named in (({"model": 1}, "'model' is not an option"), ({"theta": float("nan")}, "'theta'"),
                           ({"spatial_rest": True}, "'spatial_rest'")):  # fmt: skip
        with pytest.raises(ValueError, match="from_pretrained") as err:
            vhf.from_pretrained(folder, variant="mrope", variant_options=options)
        assert named in str(err.value)
    with pytest.raises(ValueError, match="variant_options must be a dict"):
        vhf.from_pretrained(folder, variant="mrope", variant_options=[("theta", 1e4)])


# ------------------------------------------------------------------------------------------ lmms-eval model
# The model class without lmms-eval's base (``_QwenVLRequests``): its argument checks and inputs need none of it.


@pytest.mark.parametrize("arg, value", [("fps", "nan"), ("fps", float("nan")), ("fps", "inf"), ("fps", float("inf")),
                                        ("fps", "-1"), ("fps", 0), ("fps", True), ("max_frames", "inf"),
                                        ("max_frames", float("inf")), ("max_frames", float("nan")), ("max_frames", 2.5),
                                        ("max_frames", "1e400"), ("batch_size", float("nan")),
                                        ("max_new_tokens", float("inf"))])  # fmt: skip
def test_lmms_eval_model_args_are_checked_at_construction(arg, value, tmp_path):
    from vlpe.integrations.lmms_eval import _QwenVLRequests

    folder = folder_with(tmp_path, json.dumps({"model_type": "qwen2_vl"}))  # no weights: checked before loading
    with pytest.raises(ValueError, match=f"{arg}= expects a positive") as err:
        _QwenVLRequests(pretrained=str(folder), variant="mrope", **{arg: value})
    assert repr(value) in str(err.value)


def lmms_requests(processor_step: int = 2):
    """The lmms-eval model's request side alone: no weights, a processor stand-in with a temporal patch."""
    from types import SimpleNamespace

    from vlpe.integrations.lmms_eval import _QwenVLRequests

    lm = _QwenVLRequests.__new__(_QwenVLRequests)
    lm.processor = SimpleNamespace(video_processor=SimpleNamespace(temporal_patch_size=processor_step))
    lm.max_frames, lm.fps, lm._prompt_cache, lm._device = 8, 2.0, None, torch.device("cpu")
    return lm


def test_lmms_eval_unreadable_visuals_name_the_task_document_and_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import numpy as np

    from data.video import write_video

    good = write_video(tmp_path / "good.mp4", np.full((8, 56, 56, 3), 100, np.uint8), fps=4.0)
    flipped = tmp_path / "flipped.mp4"
    flipped.write_bytes(bytes(b ^ 0xFF for b in good.read_bytes()))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not an image")
    lm = lmms_requests()
    frames, _ = lm._frames(str(good))  # the intact file decodes
    assert frames.shape[0] == 4
    lm.task_dict = {"tiny_task": {"test": {7: {"media": str(flipped)}, 8: {"media": str(tmp_path / "broken.png")},
                                           9: {"media": str(good)}}}}  # fmt: skip
    for doc_id, name in ((7, "flipped.mp4"), (8, "broken.png")):
        request = SimpleNamespace(args=("Q?", None, lambda doc: [doc["media"]], doc_id, "tiny_task", "test"))
        with pytest.raises(ValueError, match=f"task 'tiny_task', document {doc_id} .*{re.escape(name)}"):
            lm._inputs(request)
    import transformers.video_utils

    def undecodable(*args, **kwargs):  # a decoder that fails on a damaged header as PyAV can: not a ValueError
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(transformers.video_utils, "load_video", undecodable)
    request = SimpleNamespace(args=("Q?", None, lambda doc: [doc["media"]], 9, "tiny_task", "test"))
    with pytest.raises(ValueError, match="task 'tiny_task', document 9 .*good.mp4.*UnicodeDecodeError"):
        lm._inputs(request)


@pytest.mark.parametrize("variant", ["mrope", None, "none"])
def test_lmms_eval_model_names_a_config_that_is_not_json(variant, tmp_path):
    from vlpe.integrations.lmms_eval import _QwenVLRequests

    folder = folder_with(tmp_path, "{not json")
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + " is not valid JSON"):
        _QwenVLRequests(pretrained=str(folder), variant=variant)
