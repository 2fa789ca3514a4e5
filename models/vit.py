"""A plain ViT that takes any vlpe encoding by name and runs at any input size with the same weights.

Pre-norm blocks (timm ``VisionTransformer`` layout: ``norm1 -> attn -> (ls) -> drop_path``, then MLP),
a convolutional patch tokenizer that emits explicit :class:`vlpe.Positions`, CLS or global-average
readout. The encoding's tables are built once per forward (``enc.prepare``) and shared by every block;
its hooks run at the fixed points of :mod:`vlpe.encodings.base`.

Registered in timm as ``vlpe_vit_{tiny,small,base}_patch{4,8,16}_{28,32,224}`` (importing ``models``
registers them)::

    model = timm.create_model("vlpe_vit_small_patch16_224", encoding="lookhere")
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor, nn

import vlpe
from vlpe.attention import Backend
from vlpe.tokenizers import ImageTokenizer

from .blocks import Encoder, readout

__all__ = ["ViT", "PRESETS", "vit"]

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    # CPU-sized for tests and the CPU configs
    "micro": dict(embed_dim=192, depth=4, num_heads=12),
    "nano": dict(embed_dim=64, depth=2, num_heads=4),
}


class ViT(nn.Module):
    """Vision transformer with a pluggable vlpe position encoding.

    Args:
        img_size: nominal training size (recorded; any size works at test time).
        encoding: a registered encoding name (``vlpe.encodings.available()``).
        encoding_options: options for that encoding (``depth``/``num_axes`` are filled in).
        readout: ``"cls"`` (CLS token, one prefix token) or ``"gap"`` (mean of the valid patch tokens).
        num_registers: extra prefix tokens after CLS.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        encoding: str = "rope",
        encoding_options: dict[str, Any] | None = None,
        readout: Literal["cls", "gap"] = "cls",
        num_registers: int = 0,
        drop_path_rate: float = 0.0,
        layer_scale: float | None = None,
        backend: Backend = "sdpa",
        fit: Literal["raise", "crop", "pad"] = "crop",
    ) -> None:
        super().__init__()
        if readout not in ("cls", "gap"):
            raise ValueError(f"readout must be 'cls' or 'gap', got {readout!r}")
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_size = patch_size
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.readout = readout
        self.num_prefix = (1 if readout == "cls" else 0) + num_registers
        self.tokenizer = ImageTokenizer(
            dim=embed_dim, patch_size=patch_size, in_chans=in_chans, num_prefix=self.num_prefix, fit=fit
        )
        options = dict(encoding_options or {})
        options.setdefault("num_axes", 2)
        if "grid_size" in vlpe.encodings.options_of(vlpe.encodings.get(encoding)):
            options.setdefault("grid_size", self.grid_size)  # learned tables sized to the training grid
        self.encoder = Encoder(
            dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            encoding=encoding,
            encoding_options=options,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            drop_path_rate=drop_path_rate,
            layer_scale=layer_scale,
            backend=backend,
        )
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        # the encoding keeps its own initialisation (zero-init tables, frequency inits)
        self.encoder.blocks.apply(self._init_weights)
        self.head.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None) -> None:
        """timm API. Positions come from each input, so this only records the nominal size."""
        if patch_size is not None and patch_size != self.patch_size:
            raise ValueError("changing the patch size of a trained vlpe ViT is not supported")
        if img_size is not None:
            self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)

    def no_weight_decay(self) -> set[str]:
        names = {f"tokenizer.{n}" for n in self.tokenizer.no_weight_decay()}
        return names | {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    @property
    def encoding(self) -> vlpe.encodings.Encoding:
        return self.encoder.encoding

    def forward_features(self, images: Tensor | list[Tensor]) -> tuple[Tensor, vlpe.Positions]:
        """Tokens after the final norm ``(B, N, C)`` and their positions."""
        x, pos = self.tokenizer(images)  # (B, N, C)
        return self.encoder(x, pos), pos

    def forward_head(self, x: Tensor, pos: vlpe.Positions) -> Tensor:
        return self.head(readout(x, pos, self.readout))

    def forward(self, images: Tensor | list[Tensor]) -> Tensor:
        x, pos = self.forward_features(images)
        return self.forward_head(x, pos)


def vit(preset: str = "small", **kwargs: Any) -> ViT:
    """A :class:`ViT` from a preset (``tiny``/``small``/``base``/``micro``/``nano``) with overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown ViT preset {preset!r}; presets: {', '.join(PRESETS)}")
    return ViT(**{**PRESETS[preset], **kwargs})


# --------------------------------------------------------------------------- timm registration
def _register_timm() -> None:
    try:
        from timm.models import register_model
    except ImportError:  # timm is optional for the library
        return

    def make(preset: str, patch: int, size: int):
        def entry(pretrained: bool = False, **kwargs: Any) -> ViT:
            if pretrained:
                raise ValueError("vlpe ViTs have no pretrained weights to download; load a checkpoint instead")
            for k in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "features_only"):
                kwargs.pop(k, None)
            kwargs.setdefault("img_size", size)
            kwargs.setdefault("patch_size", patch)
            return vit(preset, **kwargs)

        entry.__name__ = f"vlpe_vit_{preset}_patch{patch}_{size}"
        entry.__doc__ = f"vlpe ViT-{preset}/{patch} at {size}px; pass encoding='<name>' (default rope)."
        entry.__module__ = __name__
        return entry

    import timm

    for preset in ("tiny", "small", "base"):
        for patch, size in ((16, 224), (8, 224), (4, 32), (4, 28)):
            fn = make(preset, patch, size)
            if not timm.is_model(fn.__name__):
                globals()[fn.__name__] = register_model(fn)


_register_timm()
