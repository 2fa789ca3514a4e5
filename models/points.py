"""Point transformer: FPS + kNN group tokens (Point-BERT style) into a vlpe encoder with 3D encodings.

The group centres are the tokens' positions (``vlpe.Positions.points``, continuous xyz), so any encoding
that reads continuous coordinates works: ``rope`` (num_axes=3), ``alibi``, ``sincos``, ``fourier``,
``pape``, ``pape_ri``, ``nope``, ... Encodings that need a regular grid (``peg``, ``irpe``, ``lookhere``,
``ape``) are rejected with the error the encoding raises.

``local`` is the tokenizer's per-neighbour input (:class:`vlpe.tokenizers.PointTokenizer`): ``'offsets'``
(raw centred xyz, default) or ``'invariant'`` (RIConv's rotation-invariant distances and cosine, Zhang et al.,
3DV 2019). With ``'invariant'`` and a rotation-invariant encoding (``nope``, ``pape_ri``, ``alibi``) the
logits do not change under rotations and translations of the cloud (``tests/test_points_invariant_features.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn

from vlpe.attention import Backend
from vlpe.tokenizers import PointTokenizer

from .blocks import Encoder, readout
from .hub import HubMixin

__all__ = ["PointTransformer", "points_from_config"]


class PointTransformer(nn.Module, HubMixin):
    """Classifier over point clouds ``(B, P, 3)`` (optional ``valid`` (B, P) for padded clouds).

    ``save_pretrained`` / ``from_pretrained`` as :class:`models.vit.ViT` (:mod:`models.hub`).
    """

    _card_task = "point-cloud-classification"
    _card_pipeline = None

    def __init__(
        self,
        *,
        num_classes: int,
        embed_dim: int = 96,
        depth: int = 4,
        num_heads: int = 4,
        num_groups: int = 64,
        group_size: int = 16,
        encoding: str = "rope",
        encoding_options: dict[str, Any] | None = None,
        readout: Literal["cls", "gap"] = "gap",
        mlp_ratio: float = 4.0,
        drop_path_rate: float = 0.0,
        backend: Backend = "sdpa",
        local: Literal["offsets", "invariant"] = "offsets",
    ) -> None:
        super().__init__()
        if readout not in ("cls", "gap"):
            raise ValueError(f"readout must be 'cls' or 'gap', got {readout!r}")
        self.readout = readout
        self.tokenizer = PointTokenizer(
            dim=embed_dim,
            num_groups=num_groups,
            group_size=group_size,
            num_prefix=int(readout == "cls"),
            local=local,
        )
        options = dict(encoding_options or {})
        options.setdefault("num_axes", 3)
        self.encoder = Encoder(
            dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            encoding=encoding,
            encoding_options=options,
            mlp_ratio=mlp_ratio,
            drop_path_rate=drop_path_rate,
            backend=backend,
        )
        self.head = nn.Linear(embed_dim, num_classes)

    def _card_architecture(self) -> str:
        enc = self.encoder
        return (
            f"point transformer (width {enc.norm.normalized_shape[0]}, {len(enc.blocks)} blocks, "
            f"{self.tokenizer.num_groups} groups of {self.tokenizer.group_size} points, "
            f"local features {self.tokenizer.local}, readout {self.readout})"
        )

    def no_weight_decay(self) -> set[str]:
        names = {f"tokenizer.{n}" for n in self.tokenizer.no_weight_decay()}
        return names | {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    def forward(self, points: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        """``points``: xyz (B, P, 3), or ``(xyz, valid)`` for padded clouds. Returns logits (B, classes)."""
        xyz, valid = points if isinstance(points, (tuple, list)) else (points, None)
        x, pos = self.tokenizer(xyz, valid=valid)  # (B, G', C)
        x = self.encoder(x, pos)
        return self.head(readout(x, pos, self.readout))


def points_from_config(cfg: Any, num_classes: int) -> PointTransformer:
    """The :class:`PointTransformer` a point-transformer run's config describes.

    Args:
        cfg: A :class:`train.points_setup.PointsConfig` (its ``model`` section).
        num_classes: Classes of the head.

    Returns:
        The model, initialised.
    """
    m = cfg.model
    return PointTransformer(
        num_classes=num_classes,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
        num_groups=m.num_groups,
        group_size=m.group_size,
        local=m.local,
        encoding=m.encoding,
        encoding_options=m.encoding_options,
        readout=m.readout,
        drop_path_rate=m.drop_path_rate,
        backend=m.backend,
    )
