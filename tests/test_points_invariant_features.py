"""Rotation-invariant local features of the point tokenizer (``PointTokenizer(local='invariant')``).

The features are RIConv's local reference (Zhang et al., "Rotation Invariant Convolutions for 3D Point
Clouds Deep Learning", 3DV 2019): per neighbour p_j of a group with centre c and neighbour mean m, the numbers
``|p_j - c|``, ``|p_j - m|``, ``|m - c|`` and ``cos angle(p_j - c, m - c)``. Checked here against numbers
computed by hand (a 3-4-5 triangle), for the zero-length case (cosine 0, never NaN, finite gradients), and
through whole models: with ``'invariant'`` and a rotation-invariant encoding (``nope``; ``pape_ri``, whose bias
is ``-a s^2 |d|^2``; ``alibi``, whose penalty is the Euclidean distance) the logits do not move under a uniform
SO(3) rotation plus a translation, while the same models on raw offsets (``'offsets'``, the default) do, so
the invariance test can fail. The default stays the offsets path, bit for bit.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from data.points import random_rotation
from models.points import PointTransformer
from vlpe.tokenizers import PointTokenizer, gather_points
from vlpe.tokenizers.points import invariant_local_features

SHIFT = torch.tensor([0.7, -1.3, 2.0])


def _rotation(seed: int) -> torch.Tensor:
    return torch.tensor(random_rotation(np.random.default_rng(seed), "so3"), dtype=torch.float32)  # (3, 3)


def _first_mlp_input(tok: PointTokenizer, *args, **kwargs) -> torch.Tensor:
    """What the tokenizer feeds its first MLP, (B, G, k, C), captured with a forward pre-hook."""
    seen = []
    handle = tok.first.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].detach().clone()))
    try:
        tok(*args, **kwargs)
    finally:
        handle.remove()
    return seen[0]


def _model(encoding: str, local: str) -> PointTransformer:
    torch.manual_seed(0)
    return PointTransformer(num_classes=5, embed_dim=32, depth=2, num_heads=2, num_groups=8, group_size=8,
                            encoding=encoding, local=local).eval()


# --------------------------------------------------------------------------- (a), (b) whole models
ROTATION_INVARIANT = ["nope", "pape_ri", "alibi"]


@pytest.mark.parametrize("encoding", ROTATION_INVARIANT)
def test_invariant_local_features_make_the_model_rotation_and_translation_invariant(encoding):
    model = _model(encoding, "invariant")
    torch.manual_seed(1)
    xyz = torch.randn(3, 64, 3)  # (B, P, 3)
    moved = xyz @ _rotation(7).T + SHIFT
    with torch.no_grad():
        ref, got = model(xyz), model(moved)
    assert ref.abs().max() > 0.1  # logits that say something
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # padded clouds too: the padding (garbage here) never reaches a feature
    pad = torch.full((3, 16, 3), 123.0)
    valid = torch.arange(80)[None].expand(3, -1) < 64  # (B, P)
    with torch.no_grad():
        padded = model((torch.cat([moved, pad], dim=1), valid))
    torch.testing.assert_close(padded, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("encoding", ROTATION_INVARIANT)
def test_raw_offsets_are_not_rotation_invariant(encoding):
    """The same model on raw centred xyz moves under the same rotation: the test above can fail."""
    model = _model(encoding, "offsets")
    torch.manual_seed(1)
    xyz = torch.randn(3, 64, 3)
    with torch.no_grad():
        ref, got = model(xyz), model(xyz @ _rotation(7).T + SHIFT)
    assert (got - ref).abs().max() > 1e-3
    with torch.no_grad():  # translation alone changes nothing: offsets are centred
        torch.testing.assert_close(model(xyz + SHIFT), ref, atol=1e-4, rtol=0)


def test_invariant_tokens_are_unchanged_and_positions_turn_with_the_cloud():
    torch.manual_seed(2)
    tok = PointTokenizer(dim=16, num_groups=10, group_size=6, hidden=16, in_features=2, local="invariant").eval()
    xyz, feats = torch.randn(2, 50, 3), torch.randn(2, 50, 2)
    R = _rotation(3)
    a, pa = tok(xyz, feats)
    b, pb = tok(xyz @ R.T + SHIFT, feats)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    torch.testing.assert_close(pb.coords, pa.coords @ R.T + SHIFT, atol=1e-5, rtol=0)
    assert tok.first[0].in_features == 4 + 2


# --------------------------------------------------------------------------- (c) hand-computed numbers
def test_invariant_local_features_against_hand_computed_numbers():
    # centre c = 0, neighbours 0, (3, 0, 0), (0, 3, 0): mean m = (1, 1, 0), |m - c| = sqrt 2
    nbrs = torch.tensor([[0.0, 0, 0], [3, 0, 0], [0, 3, 0]])[None, None]  # (B, G, k, 3) = (1, 1, 3, 3)
    centres = torch.zeros(1, 1, 3)  # (B, G, 3)
    r2, r5, c45 = math.sqrt(2), math.sqrt(5), 1 / math.sqrt(2)
    expected = torch.tensor([[0.0, r2, r2, 0.0],  # the centre itself: |p - c| = 0, so cos = 0
                             [3.0, r5, r2, c45],  # |(2, -1, 0)| = sqrt 5; cos = 3 / (3 sqrt 2)
                             [3.0, r5, r2, c45]])
    got = invariant_local_features(nbrs, centres)
    assert got.shape == (1, 1, 3, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got[0, 0], expected)


def test_tokenizer_feeds_the_hand_computed_features_of_its_group():
    """A 3-4-5 triangle: 'far' picks (4, 0, 0) (farthest from the mean (4/3, 1, 0)), kNN orders the rest."""
    xyz = torch.tensor([[[0.0, 0, 0], [0, 3, 0], [4, 0, 0]]])  # (1, 3, 3)
    tok = PointTokenizer(dim=8, num_groups=1, group_size=3, hidden=8, local="invariant").eval()
    centre_idx, nbr_idx = tok.group(xyz)
    assert centre_idx.tolist() == [[2]] and nbr_idx.tolist() == [[[2, 0, 1]]]
    s73 = math.sqrt(73)
    d_mc = s73 / 3  # m - c = (-8/3, 1, 0)
    expected = torch.tensor([
        [0.0, s73 / 3, d_mc, 0.0],  # (4, 0, 0), the centre
        [4.0, 5 / 3, d_mc, 8 / s73],  # (0, 0, 0): p - c = (-4, 0, 0), p - m = (-4/3, -1, 0)
        [5.0, 2 * math.sqrt(13) / 3, d_mc, 41 / (5 * s73)],  # (0, 3, 0): p - c = (-4, 3, 0), p - m = (-4/3, 2, 0)
    ])
    seen = _first_mlp_input(tok, xyz)
    assert seen.shape == (1, 1, 3, 4)
    torch.testing.assert_close(seen[0, 0], expected)
    # per-point features follow the 4 geometric numbers, per neighbour
    ftok = PointTokenizer(dim=8, num_groups=1, group_size=3, hidden=8, in_features=2, local="invariant").eval()
    feats = torch.tensor([[[1.0, 2], [3, 4], [5, 6]]])  # (1, 3, 2)
    seen = _first_mlp_input(ftok, xyz, feats)
    torch.testing.assert_close(seen[0, 0], torch.cat([expected, feats[0, [2, 0, 1]]], dim=-1))


# --------------------------------------------------------------------------- (d) zero-length vectors
def test_zero_length_vectors_give_cosine_zero_never_nan():
    same = torch.ones(1, 1, 4, 3, requires_grad=True)  # every neighbour on the centre: all vectors zero
    symmetric = torch.tensor([[[[0.0, 0, 0], [1, 0, 0], [-1, 0, 0]]]], requires_grad=True)  # mean = centre
    for nbrs, centres in ((same, torch.ones(1, 1, 3)), (symmetric, torch.zeros(1, 1, 3))):
        got = invariant_local_features(nbrs, centres)  # (1, 1, k, 4)
        assert torch.isfinite(got).all()
        assert (got[..., 3] == 0).all() and (got[..., 2] == 0).all()
        got.sum().backward()
        assert torch.isfinite(nbrs.grad).all()
    torch.testing.assert_close(invariant_local_features(symmetric, torch.zeros(1, 1, 3))[0, 0, :, :2],
                               torch.tensor([[0.0, 0], [1, 1], [1, 1]]))
    # a tiny but non-zero triangle keeps |cos| <= 1 under the clamp, and a cloud of one repeated point trains
    tiny = torch.tensor([[[[0.0, 0, 0], [1e-8, 0, 0], [0, 1e-8, 0]]]])
    assert invariant_local_features(tiny, torch.zeros(1, 1, 3))[..., 3].abs().max() <= 1
    tok = PointTokenizer(dim=8, num_groups=2, group_size=4, hidden=8, local="invariant")
    pts = torch.zeros(1, 8, 3, requires_grad=True)
    tokens, _ = tok(pts)
    tokens.square().sum().backward()
    assert torch.isfinite(tokens).all() and torch.isfinite(pts.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in tok.parameters() if p.grad is not None)


# --------------------------------------------------------------------------- (e) default = offsets, unchanged
def test_default_is_the_offsets_path_bit_for_bit():
    torch.manual_seed(5)
    xyz, feats = torch.randn(2, 40, 3), torch.randn(2, 40, 2)
    torch.manual_seed(0)
    default = PointTokenizer(dim=16, num_groups=6, group_size=5, hidden=16, in_features=2).eval()
    torch.manual_seed(0)
    offsets = PointTokenizer(dim=16, num_groups=6, group_size=5, hidden=16, in_features=2, local="offsets").eval()
    assert default.local == "offsets" and default.first[0].in_features == 3 + 2
    sd, so = default.state_dict(), offsets.state_dict()
    assert sd.keys() == so.keys() and all(torch.equal(sd[k], so[k]) for k in sd)
    ta, pa = default(xyz, feats)
    tb, pb = offsets(xyz, feats)
    assert torch.equal(ta, tb) and torch.equal(pa.coords, pb.coords)
    # what the first MLP sees is the old input exactly: raw centred xyz, then the features
    centre_idx, nbr_idx = default.group(xyz)
    centres = gather_points(xyz, centre_idx)  # (B, G, 3)
    old = torch.cat([gather_points(xyz, nbr_idx) - centres.unsqueeze(2), gather_points(feats, nbr_idx)], -1)
    assert torch.equal(_first_mlp_input(default, xyz, feats), old)
    torch.manual_seed(0)  # the model's default too
    a = PointTransformer(num_classes=3, embed_dim=16, depth=1, num_heads=2, num_groups=4, group_size=4)
    torch.manual_seed(0)
    b = PointTransformer(num_classes=3, embed_dim=16, depth=1, num_heads=2, num_groups=4, group_size=4,
                         local="offsets")
    assert a.tokenizer.local == "offsets"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_local_is_validated_and_shown():
    with pytest.raises(ValueError, match=r"local must be one of \['offsets', 'invariant'\].*'rotated'"):
        PointTokenizer(dim=8, local="rotated")
    with pytest.raises(ValueError, match="local must be one of"):
        PointTransformer(num_classes=2, local="xyz")
    assert "local='invariant'" in repr(PointTokenizer(dim=8, local="invariant"))
    assert "local='offsets'" in repr(PointTokenizer(dim=8))


# --------------------------------------------------------------------------- configs, hub and training
def test_config_field_reaches_the_model_and_is_checked():
    from train.config import ConfigError, load_config
    from models.points import points_from_config as build_model
    from train.points_setup import PointsConfig
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(PointsConfig, root / "configs/points_pape_ri.yaml", ["model.local=invariant"])
    model = build_model(cfg, 4)
    assert model.tokenizer.local == "invariant" and model.tokenizer.first[0].in_features == 4
    assert build_model(load_config(PointsConfig, root / "configs/points_pape_ri.yaml"), 4).tokenizer.local == "offsets"
    xyz_cfg = load_config(PointsConfig, root / "configs/points_pape_ri_xyz.yaml")
    assert xyz_cfg.model.local == "offsets" and xyz_cfg.model.encoding == "pape_ri"
    assert xyz_cfg.train.out_dir == "runs/points_pape_ri_xyz"
    with pytest.raises(ConfigError, match="not one of"):
        load_config(PointsConfig, root / "configs/points_pape_ri.yaml", ["model.local=rotated"])


def test_hub_round_trip_keeps_local(tmp_path):
    torch.manual_seed(0)
    m = PointTransformer(num_classes=4, embed_dim=32, depth=1, num_heads=2, num_groups=8, group_size=4,
                         encoding="pape_ri", local="invariant").eval()
    m.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["local"] == "invariant"
    assert "local features invariant" in (tmp_path / "README.md").read_text()
    back = PointTransformer.from_pretrained(tmp_path)
    assert back.tokenizer.local == "invariant"
    xyz = torch.randn(2, 48, 3)
    with torch.no_grad():
        assert torch.equal(back(xyz), m(xyz))


@pytest.mark.slow
def test_invariant_config_trains_through_the_entry_point(tmp_path):
    """Two steps of ``train/points.py`` with ``model.local: invariant``; the exported run reloads with it."""
    from pathlib import Path

    import train.points
    from eval.runs import load_run

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    train.points.main(["--config", str(root / "configs/points_pape_ri.yaml"), "model.local=invariant",
                       "data.dataset=procedural", "data.num_points=64", "data.samples_per_class=4",
                       "model.embed_dim=32", "model.depth=1", "model.num_heads=2", "model.num_groups=8",
                       "model.group_size=8", "train.steps=2", "train.micro_batch=4", "train.val_every=2",
                       "train.val_batches=1", "train.ckpt_every=2", "train.warmup_steps=1", "train.progress=false",
                       f"train.out_dir={out}"])
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["split"] == "train"][-1] == 2
    assert all(math.isfinite(r["loss"]) for r in recs if "loss" in r)
    run = load_run(out, script="points")
    assert run.cfg.model.local == "invariant" and run.model.tokenizer.local == "invariant"
