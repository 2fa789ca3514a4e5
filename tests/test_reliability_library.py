"""Bad inputs to the library surface are clear errors, and the checks that guard it are not vacuous.

Covers: NaN/inf/bool/complex/string coordinates and timestamps (``vlpe.Positions``, ``VideoTokenizer``), NaN ids in
``mm.rotary`` (and the sync-free ``validate=False``), the multi_head default section below 4 KV heads, a boolean
scaling factor, the property kit's second run on randomised parameters (a planted wrong claim), ``rope_dinov3``
with and without grid metadata against timm's ``RotaryEmbeddingDinoV3``, encoding classes called without a spec,
tampered ``models.hub`` folders, the session's private torch-extensions folder (``tests/conftest.py``), and the
``dtype`` of multimodal position ids (not a real number type; an integer type the ids do not fit).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import vlpe
from vlpe import Positions
from vlpe.encodings import construct, get, registry
from vlpe.encodings import multimodal as mm
from vlpe.encodings.functional.scaling import parse_scaling
from vlpe.testing import PropertyFailure, check, example, property_report
from vlpe.tokenizers import PointTokenizer, VideoTokenizer

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------- coordinates
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_timestamps_and_points_are_errors(bad):
    with pytest.raises(ValueError, match="NaN or infinite"):
        Positions.video(2, 2, 2, timestamps=torch.tensor([0.0, bad]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        Positions.points(torch.tensor([[0.0, bad, 1.0], [1.0, 2.0, 3.0]]))
    # validate=False: no host read, the values pass as given (callers that checked them already)
    assert Positions.points(torch.tensor([[0.0, bad, 1.0]]), validate=False).coords.isfinite().sum() == 2


@pytest.mark.parametrize(
    "coords,what",
    [
        (torch.zeros(3, 2, dtype=torch.bool), "real numbers"),
        (torch.zeros(3, 2, dtype=torch.complex64), "real numbers"),
        ([["a", "b"]], "as numbers"),
    ],
)
def test_coordinates_that_are_not_real_numbers_are_errors(coords, what):
    with pytest.raises(ValueError, match=what):
        Positions(coords)
    with pytest.raises(ValueError, match=what):
        Positions.points(coords)


def test_video_tokenizer_refuses_non_finite_timestamps_in_its_one_check():
    tok = VideoTokenizer(dim=8, patch_size=4, tubelet_size=2, in_chans=1)
    video = torch.randn(2, 1, 4, 8, 8)
    good = torch.arange(4.0)
    tokens, pos = tok(video, good)
    assert pos.coords.isfinite().all()
    bad = torch.stack([good, torch.tensor([0.0, NAN, 1.0, 2.0])])  # sample 1
    with pytest.raises(ValueError, match="timestamps of sample 1"):
        tok(video, bad)
    with pytest.raises(ValueError, match="real numbers"):
        tok(video, torch.ones(4, dtype=torch.bool))
    # check_finite=False: documented, nothing read back and the timestamps reach the positions as given
    _, loose = VideoTokenizer(dim=8, patch_size=4, tubelet_size=2, in_chans=1, check_finite=False)(video, bad)
    assert not loose.coords.isfinite().all()


def test_tokenizers_do_not_read_positions_back_a_second_time(monkeypatch):
    """The tokenizers check their inputs once themselves, so the positions they build skip ``validate``."""
    calls = []
    monkeypatch.setattr(Positions, "validate", lambda self: calls.append(1) or self)
    VideoTokenizer(dim=8, patch_size=4, tubelet_size=2, in_chans=1)(torch.randn(1, 1, 4, 8, 8), torch.arange(4.0))
    PointTokenizer(dim=8, num_groups=4, group_size=4, hidden=8)(torch.randn(1, 16, 3))
    assert calls == []


# --------------------------------------------------------------------------- multimodal rotary
def test_mm_rotary_refuses_nan_ids_and_validate_false_skips_the_read():
    ids = torch.arange(15.0).reshape(3, 1, 5)
    cos, sin = mm.rotary("mrope", ids, head_dim=16)
    assert cos.isfinite().all()
    bad = ids.clone()
    bad[1, 0, 2] = NAN
    with pytest.raises(ValueError, match="NaN or infinite"):
        mm.rotary("mrope", bad, head_dim=16)
    cos, _ = mm.rotary("mrope", bad, head_dim=16, validate=False)  # free of host syncs: the caller's promise
    assert not cos.isfinite().all()
    with pytest.raises(ValueError, match="dtype"):
        mm.rotary("mrope", torch.zeros(3, 1, 5, dtype=torch.bool), head_dim=16)


@pytest.mark.parametrize("kv", [1, 2, 3])
def test_mhrope_default_section_needs_four_kv_heads(kv):
    with pytest.raises(ValueError, match="num_kv_heads >= 4"):
        mm.rotary("mhrope", torch.zeros(3, 1, 5), head_dim=16, num_kv_heads=kv)
    # an explicit section gives every axis a head on fewer KV heads
    if kv == 3:
        cos, _ = mm.rotary("mhrope", torch.ones(3, 1, 5), head_dim=16, num_kv_heads=3, section=[1, 1, 1])
        assert cos.shape[1] == 3 and not torch.equal(cos[:, 0], torch.ones_like(cos[:, 0]))


def test_default_section_gives_every_axis_a_head_from_four_kv_heads():
    for kv in (4, 5, 8, 16):
        assert min(mm.default_section("multi_head", 8, num_kv_heads=kv)) >= 1


@pytest.mark.parametrize("key", ["factor", "attention_factor", "original_size"])
def test_a_boolean_scaling_number_is_an_error(key):
    cfg = {"type": "yarn", "factor": 2.0, "original_size": 14, key: True}
    with pytest.raises(ValueError, match="boolean"):
        parse_scaling(cfg, num_axes=2)


# --------------------------------------------------------------------------- property kit
def _planted_relative_claim():
    """Fourier features (an absolute embedding) with every parameter zeroed, wrongly claiming ``relative``: as built
    the embedding adds zero, so the claim holds vacuously; trained parameters break it."""
    fourier = get("fourier")

    class PlantedRelative(fourier):
        """Fourier features claiming relativity they do not have: a planted wrong claim for the property kit."""

        claims = fourier.claims | {"relative"}

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            with torch.no_grad():
                for p in self.parameters():
                    p.zero_()

    return PlantedRelative


def test_property_kit_catches_a_claim_that_holds_only_for_zero_parameters():
    name = "test_planted_relative"
    registry.register(name)(_planted_relative_claim())
    try:
        enc = example(name)
        check(enc, "relative", randomized=False)  # the old, vacuous check passes
        with pytest.raises(PropertyFailure, match="relative.*randomized parameters"):
            check(enc, "relative")
        report = property_report(enc)
        assert report["relative"].startswith("FAIL") and "randomized" in report["relative"]
        assert all(p.abs().sum() == 0 for p in enc.parameters())  # the check ran on a copy
    finally:
        registry._REGISTRY.pop(name, None)
    assert name not in vlpe.encodings.available()


def test_zero_init_is_checked_as_built_only():
    enc = example("irpe")
    check(enc, "zero_init")  # a fresh IRPE equals nope; randomised tables would not, and are not asked to


# --------------------------------------------------------------------------- rope_dinov3
def test_rope_dinov3_same_coordinates_same_logits_with_or_without_grid_metadata():
    """``u`` indexes the feature map from 0 (timm's RotaryEmbeddingDinoV3, default grid_offset=0): a shifted grid,
    the same coordinates without the grid, and the grid at 0 give timm's rotation, CLS rows included."""
    timm_pos = pytest.importorskip("timm.layers.pos_embed_sincos")
    H, D = 4, 16
    enc = vlpe.encodings.build("rope_dinov3", dim=H * D, num_heads=H).eval()
    shifted = Positions.grid(6, 9, prefix=1).shifted([4, 7])
    loose = Positions(shifted.coords, prefix=1)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, H, shifted.num_tokens, D, generator=g).unbind(0)
    emb = timm_pos.RotaryEmbeddingDinoV3(D, temperature=100.0).eval().get_embed([6, 9])

    def timm_rotate(x):
        return torch.cat([x[:, :, :1], timm_pos.apply_rot_embed_cat(x[:, :, 1:], emb, half=True)], dim=2)

    ref = timm_rotate(q) @ timm_rotate(k).transpose(-2, -1) * D**-0.5
    for pos in (shifted, loose, Positions.grid(6, 9, prefix=1)):
        torch.testing.assert_close(vlpe.attention_logits(enc, q, k, pos), ref, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- building a class
def test_an_encoding_class_without_a_spec_names_construct():
    irpe = get("irpe")
    with pytest.raises(TypeError, match=r"vlpe\.encodings\.construct\(IRPE.*vlpe\.encodings\.build"):
        irpe(dim=64, num_heads=4)
    with pytest.raises(TypeError, match="not an EncodingSpec.*construct"):
        irpe(spec=dict(dim=64, num_heads=4))
    with pytest.raises(TypeError, match="positional"):
        irpe(64, 4)
    enc = construct(irpe, dim=64, num_heads=4, mode="bias")  # the documented way
    assert type(enc) is irpe and enc.dim == 64


def test_readme_documents_construct_in_using_it():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    using = text.split("## Using it", 1)[1].split("\n## ", 1)[0]
    assert "vlpe.encodings.construct(" in using and "vlpe.encodings.build(" in using


# --------------------------------------------------------------------------- tampered hub folders
@pytest.fixture
def saved_vit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from models.vit import ViT

    torch.manual_seed(0)
    model = ViT(img_size=28, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=10, encoding="rope")
    model.save_pretrained(tmp_path / "good")
    return tmp_path / "good"


def _copy(folder: Path, name: str) -> Path:
    out = folder.parent / name
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize(
    "text,match",
    [("{not json", "is not valid JSON"), ("[1, 2]", "JSON object.*got a list"), ('"vit"', "got a str")],
)
def test_hub_config_that_is_not_a_json_mapping_is_an_error(saved_vit, text, match):
    from models.vit import ViT

    bad = _copy(saved_vit, "bad")
    (bad / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        ViT.from_pretrained(bad)
    assert str(bad / "config.json") in str(e.value)


def test_hub_config_of_another_model_family_is_an_error(saved_vit):
    from models.points import PointTransformer

    with pytest.raises(ValueError, match="is not a PointTransformer config") as e:
        PointTransformer.from_pretrained(saved_vit)
    assert str(saved_vit / "config.json") in str(e.value)


@pytest.mark.parametrize("damage", ["header length", "truncated", "header text"])
def test_hub_damaged_safetensors_errors_name_the_file(saved_vit, damage):
    from models.vit import ViT

    bad = _copy(saved_vit, "bad")
    path = bad / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "header length":
        data[:8] = (10**12).to_bytes(8, "little")
    elif damage == "truncated":
        data = data[:100]
    else:  # tensor names inside the JSON header overwritten
        header_len = int.from_bytes(data[:8], "little")
        start = data.index(b'"', 9)
        data[start + 1 : start + 6] = b"xxxxx"
        assert start + 6 < 8 + header_len
    path.write_bytes(bytes(data))
    with pytest.raises((ValueError, RuntimeError)) as e:
        ViT.from_pretrained(bad)
    assert str(path) in str(e.value)


# --------------------------------------------------------------------------- torch extensions of launch tests
def test_the_session_builds_torch_extensions_in_a_private_folder():
    from conftest import PRIVATE_EXTENSIONS, user_extensions_dir

    folder = os.environ.get("TORCH_EXTENSIONS_DIR")
    assert folder and os.environ.get(PRIVATE_EXTENSIONS) == folder
    assert Path(folder).is_dir() and Path(folder).resolve() != user_extensions_dir().resolve()
    from torch.utils.cpp_extension import _get_build_directory

    assert Path(_get_build_directory("some_op", verbose=False)).parent == Path(folder)  # where DeepSpeed builds


def test_private_extensions_folder_is_seeded_without_locks(tmp_path):
    from conftest import private_extensions_dir

    seed = tmp_path / "cache"
    (seed / "op").mkdir(parents=True)
    (seed / "op" / "op.so").write_bytes(b"\x7fELF")
    (seed / "op" / "build.ninja").write_text("rule x\n")
    (seed / "op" / "lock").write_text("")  # left by a killed build: copying it would make every load wait forever
    os.utime(seed / "op" / "op.so", (1_000_000_000, 1_000_000_000))
    out = private_extensions_dir(seed)
    try:
        assert sorted(p.name for p in (out / "op").iterdir()) == ["build.ninja", "op.so"]
        assert (out / "op" / "op.so").stat().st_mtime == 1_000_000_000  # ninja sees the build as up to date
    finally:
        shutil.rmtree(out)


# --------------------------------------------------------------------------- the dtype of position ids
@pytest.mark.parametrize("variant", ["mrope", "rope1d", "videorope"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, "int64", int])
def test_position_ids_refuse_a_dtype_that_is_not_a_real_number_type(variant, dtype):
    types, grid = torch.tensor([[0, 1, 1, 0]]), torch.tensor([[1, 2, 4]])
    with pytest.raises(ValueError, match="integer or floating dtype"):
        mm.position_ids(variant, types, grid, dtype=dtype)


@pytest.mark.parametrize("variant", ["mrope", "mrope_i", "rope1d"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_narrow_integer_ids_are_checked_to_fit_instead_of_wrapping(variant, dtype):
    """300 text tokens reach position 299, past int8 / uint8 (a cast wraps silently); an image shrinks the
    positions behind it, so a uint8 delta is negative. Where they fit, the ids are the int64 ids cast."""
    types = torch.zeros(1, 300, dtype=torch.int64)
    if torch.iinfo(dtype).max < 299:
        with pytest.raises(ValueError, match=rf"span \[0, 299\], outside {dtype}"):
            mm.position_ids(variant, types, None, dtype=dtype)
        mm.position_ids(variant, types, None, dtype=dtype, validate=False)  # no check, as documented
    else:
        ids, deltas = mm.position_ids(variant, types, None, dtype=dtype)
        ref = mm.position_ids(variant, types, None)
        assert ids.dtype == dtype and torch.equal(ids.long(), ref[0]) and torch.equal(deltas.long(), ref[1])
    image = torch.tensor([[0] + [1] * 16 + [0]])  # 16 tokens of one 4 x 4 image advance the position by 4
    grid = torch.tensor([[1, 8, 8]])
    ref = mm.position_ids(variant, image, grid)
    if variant != "rope1d":
        assert int(ref[1]) < 0  # the delta (next position less the real tokens) is negative
    if dtype == torch.uint8 and variant != "rope1d":
        with pytest.raises(ValueError, match="outside torch.uint8"):
            mm.position_ids(variant, image, grid, dtype=dtype)
    else:
        ids, deltas = mm.position_ids(variant, image, grid, dtype=dtype)
        assert torch.equal(ids.long(), ref[0]) and torch.equal(deltas.long(), ref[1])
