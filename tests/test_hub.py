"""save_pretrained / from_pretrained of the vlpe backbones (huggingface_hub's PyTorchModelHubMixin), offline."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import safetensors.torch
import torch
from huggingface_hub import ModelCard, PyTorchModelHubMixin

from models.points import PointTransformer
from models.vit import ViT


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Every load here is from a local folder: a download attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr("huggingface_hub.file_download.hf_hub_download", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _vit(**kw):
    torch.manual_seed(0)
    return ViT(
        img_size=28, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=10, encoding="lookhere",
        encoding_options={"global_slope": 1.5}, num_registers=1, **kw,
    ).eval()


def test_vit_round_trip_config_weights_and_card(tmp_path):
    m = _vit()
    assert isinstance(m, PyTorchModelHubMixin)
    m.save_pretrained(tmp_path, model_card_kwargs=dict(dataset="fashion_mnist", results={"top-1 @ 28 px": 0.8712}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["encoding"] == "lookhere" and config["encoding_options"] == {"global_slope": 1.5}
    assert config["num_registers"] == 1 and config["num_classes"] == 10
    assert set(safetensors.torch.load_file(tmp_path / "model.safetensors")) == set(m.state_dict())

    back = ViT.from_pretrained(tmp_path)
    assert not back.training
    x = torch.randn(2, 3, 28, 44)  # any size, as the original
    with torch.no_grad():
        assert torch.equal(back(x), m(x))

    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.library_name == "vlpe" and card.data.license == "apache-2.0"
    assert card.data.datasets == ["fashion_mnist"] and "encoding:lookhere" in card.data.tags
    result = card.data.eval_results[0]
    assert (result.metric_name, result.metric_value, result.dataset_name) == ("top-1 @ 28 px", 0.8712, "fashion_mnist")
    assert "**lookhere**" in card.text and "| top-1 @ 28 px | 0.8712 |" in card.text


def test_saved_config_is_the_model_as_it_is_now(tmp_path):
    """A head reset after construction is saved with the new classes and pooling (the class token stays)."""
    m = _vit()
    m.reset_classifier(3, "avg")
    m.save_pretrained(tmp_path)
    back = ViT.from_pretrained(tmp_path)
    assert back.num_classes == 3 and back.readout == "gap" and back.has_class_token
    x = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        assert torch.equal(back(x), m(x))
    card = (tmp_path / "README.md").read_text()
    assert "Training data: not recorded" in card and "Measured results: none recorded" in card
    m.save_pretrained(tmp_path, model_card_kwargs=dict(dataset="digits", results={"top-1": 0.5}))
    assert "digits" in (tmp_path / "README.md").read_text()  # the card is rewritten with the weights


def test_loading_is_strict_and_bad_input_raises(tmp_path):
    _vit().save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="size mismatch|Missing|Unexpected|Error"):
        ViT.from_pretrained(tmp_path, embed_dim=64, num_heads=4)  # a config override the weights do not fit
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        ViT.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'dataset' and 'results'"):
        _vit().save_pretrained(tmp_path, model_card_kwargs=dict(accuracy=0.9))
    with pytest.raises(ValueError, match="results must be"):
        _vit().save_pretrained(tmp_path, model_card_kwargs=dict(results=0.9))
    pruned = _vit()
    pruned.prune_intermediate_layers([0])
    with pytest.raises(ValueError, match="pruned"):
        pruned.save_pretrained(tmp_path)


def test_point_transformer_round_trip(tmp_path):
    torch.manual_seed(0)
    m = PointTransformer(num_classes=4, embed_dim=32, depth=2, num_heads=2, num_groups=8, group_size=4,
                         encoding="rope").eval()
    m.save_pretrained(tmp_path, model_card_kwargs=dict(dataset="cgal shapes", results={"top-1": 0.75}))
    back = PointTransformer.from_pretrained(tmp_path)
    xyz = torch.randn(2, 64, 3)
    with torch.no_grad():
        assert torch.equal(back(xyz), m(xyz))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.pipeline_tag is None and card.data.eval_results[0].task_type == "point-cloud-classification"
    assert "point transformer" in card.text and "**rope**" in card.text
