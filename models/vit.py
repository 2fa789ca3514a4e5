"""A plain ViT that takes any vlpe encoding by name and runs at any input size with the same weights.

Pre-norm blocks (timm ``VisionTransformer`` layout: ``norm1 -> attn -> (ls) -> drop_path``, then MLP),
a convolutional patch tokenizer that emits explicit :class:`vlpe.Positions`, CLS or global-average
readout. The encoding's tables are built once per forward (``enc.prepare``) and shared by every block;
its hooks run at the fixed points of :mod:`vlpe.encodings.base`.

It has timm's model API (``forward_features`` -> tokens, ``forward_head(pre_logits=)``,
``forward_intermediates``, ``get_classifier`` / ``reset_classifier``, ``prune_intermediate_layers``,
``set_grad_checkpointing``, ``group_matcher``) and the Hub's (``save_pretrained`` / ``from_pretrained``,
:mod:`models.hub`). Importing this module registers it in timm (:func:`register_timm`, through the glue of
:mod:`models.vit_timm`, which imports nothing from this module: no import cycle) as
``vlpe_vit_{tiny,small,base,micro,pico}_patch{16_224,8_224,4_32,4_28}`` (encoding by keyword) and, for every
registered encoding that runs on a 2D grid and fits the preset, ``<that name>_<encoding>`` (the encoding fixed
by the name, which is how open_clip's ``timm_model_name`` picks one)::

    model = timm.create_model("vlpe_vit_small_patch16_224", encoding="lookhere")
    model = timm.create_model("vlpe_vit_small_patch16_224_lookhere", features_only=True, out_indices=(-2, -1))
    model = timm.create_model("vlpe_vit_small_patch16_224", pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file="run/model.safetensors", num_classes=10))
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from torch import Tensor, nn

import vlpe
from vlpe.attention import Backend
from vlpe.tokenizers import ImageTokenizer

from .blocks import Encoder, readout
from .hub import HubMixin
from .vit_timm import (  # noqa: F401  (TIMM_SIZES, default_cfgs and timm_name: re-exported)
    TIMM_INSTALLED,
    TIMM_PRESETS,
    TIMM_SIZES,
    _READOUT_TO_POOL,
    _readout_of,
    build_timm_model,
    default_cfgs,
    register_architectures,
    timm_name,
)

__all__ = ["ViT", "PRESETS", "vit", "vit_from_config", "fits", "grid_encodings", "timm_name", "register_timm"]

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(embed_dim=192, depth=12, num_heads=3),
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    # CPU-sized for tests and the CPU configs
    "micro": dict(embed_dim=192, depth=4, num_heads=12),
    "pico": dict(embed_dim=96, depth=3, num_heads=6),  # heads in threes: LookHere's presets fit
    "nano": dict(embed_dim=64, depth=2, num_heads=4),
}

class ViT(nn.Module, HubMixin):
    """Vision transformer with a pluggable vlpe position encoding.

    Args:
        img_size: nominal training size (recorded; any size works at test time).
        encoding: a registered encoding name (``vlpe.encodings.available()``).
        encoding_options: options for that encoding (``depth``/``num_axes`` are filled in).
        readout: pooling for the head: ``"cls"`` (the class token), ``"gap"`` (mean of the valid patch
            tokens) or ``"none"`` (no pooling: the head runs on every token). timm's names ``token`` /
            ``avg`` / ``''`` are accepted too.
        class_token: prepend a learned class token; default: with ``readout="cls"`` only.
        num_registers: extra prefix tokens after CLS.
        drop_rate: dropout before the head (timm's ``drop_rate``).

    The timm methods follow ``timm.models.VisionTransformer`` (1.0.31) and are checked against it in
    ``tests/test_integration_timm.py`` (same outputs, shapes and feature info for the same call).
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
        readout: Literal["cls", "gap", "none"] = "cls",
        class_token: bool | None = None,
        num_registers: int = 0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        layer_scale: float | None = None,
        backend: Backend = "sdpa",
        fit: Literal["raise", "crop", "pad"] = "crop",
    ) -> None:
        super().__init__()
        mode = _readout_of(readout, what="readout")
        self.has_class_token = mode == "cls" if class_token is None else bool(class_token)
        if mode == "cls" and not self.has_class_token:
            raise ValueError("readout='cls' needs the class token; pass class_token=True (or leave it unset)")
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0: no head), got {num_classes!r}")
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.readout = mode
        self.num_prefix = int(self.has_class_token) + num_registers
        self.tokenizer = ImageTokenizer(
            dim=embed_dim, patch_size=patch_size, in_chans=in_chans, num_prefix=self.num_prefix, fit=fit
        )
        options = dict(encoding_options or {})
        options.setdefault("num_axes", 2)
        options.setdefault("grid", self.grid_size)  # a build-time fact: learned tables are sized to it
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
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        # timm's feature metadata: one entry per block, stride = patch size
        self.feature_info = [
            dict(module=f"encoder.blocks.{i}", num_chs=embed_dim, reduction=patch_size) for i in range(depth)
        ]
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

    @property
    def num_prefix_tokens(self) -> int:
        """timm's name for :attr:`num_prefix` (class token + registers)."""
        return self.num_prefix

    @property
    def global_pool(self) -> str:
        """The head's pooling in timm's vocabulary (``token`` / ``avg`` / ``''``)."""
        return _READOUT_TO_POOL[self.readout]

    @property
    def encoding(self) -> vlpe.encodings.Encoding:
        return self.encoder.encoding

    def set_input_size(self, img_size: int | tuple[int, int] | None = None, patch_size: int | None = None) -> None:
        """timm API. Positions come from each input, so this only records the nominal size."""
        if patch_size is not None and patch_size != self.patch_size:
            raise ValueError("changing the patch size of a trained vlpe ViT is not supported")
        if img_size is not None:
            self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)

    def no_weight_decay(self) -> set[str]:
        names = {f"tokenizer.{n}" for n in self.tokenizer.no_weight_decay()}
        return names | {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    # ------------------------------------------------------------------ timm model API
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new (freshly initialised) head for ``num_classes`` (0: none), optionally with new pooling."""
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0: no head), got {num_classes!r}")
        if global_pool is not None:
            mode = _readout_of(global_pool, what="global_pool")
            if mode == "cls" and not self.has_class_token:
                raise ValueError("global_pool='token' needs the class token; this model was built without one")
            self.readout = mode
        ref = self.tokenizer.proj.weight
        self.num_classes = num_classes
        if num_classes > 0:
            self.head = nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
            self._init_weights(self.head)
        else:
            self.head = nn.Identity()
        self.head.train(self.training)
        self._record_config(num_classes=num_classes, readout=self.readout, class_token=self.has_class_token)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.encoder.grad_checkpointing = bool(enable)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups for layer-wise learning-rate decay and partial freezing (timm's ViT grouping)."""
        del coarse  # one group per block either way, as timm's ViT
        return dict(
            stem=r"^tokenizer|^encoder\.encoding",
            blocks=[(r"^encoder\.blocks\.(\d+)", None), (r"^encoder\.norm", (99999,))],
        )

    def forward_features(
        self, images: Tensor | list[Tensor], *, return_positions: bool = False
    ) -> Tensor | tuple[Tensor, vlpe.Positions]:
        """Tokens after the final norm ``(B, N, C)`` (and their positions with ``return_positions=True``).

        A list of images of different sizes is padded to the longest; its positions (``pos.valid``) are
        needed to pool it, so it must be asked for with ``return_positions=True`` (then pass ``pos=`` to
        :meth:`forward_head`).
        """
        x, pos = self.tokenizer(images)  # (B, N, C)
        if pos.valid is not None and not return_positions:
            raise ValueError(
                "forward_features got images of different sizes (a padded batch); call it with "
                "return_positions=True and pass pos= to forward_head"
            )
        x = self.encoder(x, pos)
        return (x, pos) if return_positions else x

    def pool(self, x: Tensor, *, pos: vlpe.Positions | None = None, pool_type: str | None = None) -> Tensor:
        """``(B, N, C)`` tokens -> ``(B, C)`` (or the tokens themselves for ``none``)."""
        mode = self.readout if pool_type is None else _readout_of(pool_type, what="pool_type")
        if mode == "none":
            return x
        if pos is not None:
            return readout(x, pos, mode)
        return x[:, 0] if mode == "cls" else x[:, self.num_prefix :].mean(dim=1)  # (B, C)

    def forward_head(self, x: Tensor, pre_logits: bool = False, *, pos: vlpe.Positions | None = None) -> Tensor:
        """Pooled features through the head; ``pre_logits=True`` stops before the classifier."""
        x = self.head_drop(self.pool(x, pos=pos))
        return x if pre_logits else self.head(x)

    def forward(self, images: Tensor | list[Tensor]) -> Tensor:
        x, pos = self.forward_features(images, return_positions=True)
        return self.forward_head(x, pos=pos)

    def _take_indices(self, indices: int | Sequence[int] | None) -> list[int]:
        """timm's ``feature_take_indices``: None -> every block, n -> the last n, a sequence -> those (negative
        from the end); ``ValueError`` outside ``[0, depth)``."""
        depth = len(self.encoder.blocks)
        if indices is None:
            return list(range(depth))
        if isinstance(indices, int):
            if not 0 < indices <= depth:
                raise ValueError(f"indices={indices}: the last n blocks needs 1 <= n <= {depth}")
            return list(range(depth - indices, depth))
        take = []
        for i in indices:
            if not isinstance(i, int) or not -depth <= i < depth:
                raise ValueError(f"block index {i!r} is outside the model's {depth} blocks")
            take.append(depth + i if i < 0 else i)
        if not take:
            raise ValueError("indices is empty; pass None for every block")
        return take

    def forward_intermediates(
        self,
        x: Tensor | list[Tensor],
        indices: int | Sequence[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]] | dict[str, Any]:
        """timm's ``forward_intermediates``: the tokens after the chosen blocks, as ``(B, C, h, w)`` maps
        (``NCHW``) or ``(B, h*w, C)`` (``NLC``; a padded list of different sizes needs ``NLC``), prefix
        tokens split off (``return_prefix_tokens``: ``(tokens, prefix)`` pairs); with the final normed tokens
        unless ``intermediates_only``."""
        fmt = getattr(output_fmt, "value", output_fmt)
        if fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take = self._take_indices(indices)
        tokens, pos = self.tokenizer(x)  # (B, P + N, C)
        if fmt == "NCHW" and pos.grid is None:
            raise ValueError("output_fmt='NCHW' needs one image size per batch; use 'NLC' for mixed sizes")
        final, inter = self.encoder.run(tokens, pos, take=set(take), last=max(take) if stop_early else None)
        if norm:
            inter = [self.encoder.norm(t) for t in inter]
        P = self.num_prefix
        prefix = [t[:, :P] for t in inter] if P else None  # (B, P, C) each
        inter = [t[:, P:] for t in inter]  # (B, N, C) each
        if fmt == "NCHW":
            h, w = pos.grid
            inter = [t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for t in inter]  # (B, C, h, w)
        if output_dict:
            out: dict[str, Any] = {"image_intermediates": inter}
            if prefix is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = self.encoder.norm(final)
            return out
        if return_prefix_tokens and prefix is not None:
            inter = list(zip(inter, prefix))
        if intermediates_only:
            return inter
        return self.encoder.norm(final), inter

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks after the last of ``indices`` (and the final norm / the head); returns the indices."""
        take = self._take_indices(indices)
        self.encoder.blocks = self.encoder.blocks[: max(take) + 1]
        if prune_norm:
            self.encoder.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        self._unsaveable = "its blocks were pruned (prune_intermediate_layers); save the unpruned model"
        return take

    def _card_architecture(self) -> str:
        depth, heads = len(self.encoder.blocks), self.encoder.blocks[0].attn.num_heads
        return (
            f"ViT (width {self.embed_dim}, {depth} blocks, {heads} heads, patch {self.patch_size}, trained at "
            f"{self.img_size[0]}x{self.img_size[1]} px, readout {self.readout})"
        )


def vit(preset: str = "small", **kwargs: Any) -> ViT:
    """A :class:`ViT` from a preset (``tiny``/``small``/``base``/``micro``/``pico``/``nano``) with overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown ViT preset {preset!r}; presets: {', '.join(PRESETS)}")
    return ViT(**{**PRESETS[preset], **kwargs})


def vit_from_config(cfg: Any, num_classes: int) -> ViT:
    """The :class:`ViT` a ViT run's config describes.

    Args:
        cfg: A :class:`train.vit_setup.ViTConfig` (its ``model`` section, and ``data.img_size`` / ``data.channels``).
        num_classes: Classes of the head.

    Returns:
        The model, initialised.
    """
    m = cfg.model
    sizes = dict(embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads)
    sizes = {k: v for k, v in sizes.items() if v is not None}
    return vit(
        m.preset,
        img_size=cfg.data.img_size,
        patch_size=m.patch_size,
        in_chans=cfg.data.channels,
        num_classes=num_classes,
        mlp_ratio=m.mlp_ratio,
        encoding=m.encoding,
        encoding_options=m.encoding_options,
        readout=m.readout,
        num_registers=m.num_registers,
        drop_path_rate=m.drop_path_rate,
        layer_scale=m.layer_scale,
        backend=m.backend,
        **sizes,
    )


def fits(preset: str, encoding: str) -> bool:
    """Whether ``encoding`` builds for ``preset``'s width, heads and depth on a 2D grid (LookHere's direction
    presets need 12 heads, for instance); the encoding's own ``ValueError`` says why not."""
    dims = PRESETS[preset]
    options: dict[str, Any] = dict(num_axes=2, depth=dims["depth"], grid=(2, 2))
    with torch.random.fork_rng(devices=[]):  # a trial build draws no number from the caller's generator
        try:
            vlpe.encodings.build(encoding, dim=dims["embed_dim"], num_heads=dims["num_heads"], **options)
        except ValueError:
            return False
    return True


def grid_encodings() -> list[str]:
    """Registered encodings that run on a 2D image grid: ``supported_axes`` allows 2 and the encoding builds
    for at least one of the timm presets."""
    out = []
    for name in vlpe.encodings.available():
        axes = vlpe.encodings.get(name).supported_axes
        if (axes is None or 2 in axes) and any(fits(p, name) for p in TIMM_PRESETS):
            out.append(name)
    return out


def _create(variant: str, *, preset: str, patch: int, size: int, fixed: str | None, pretrained: bool, **kwargs):
    model = build_timm_model(
        variant, lambda **kw: vit(preset, **kw), patch=patch, size=size, fixed=fixed, pretrained=pretrained, **kwargs
    )
    if isinstance(model, ViT):  # whether the class token exists is not implied by the pooling timm records
        model._model_args = {"class_token": model.has_class_token}
    return model


def register_timm(encoding: str | None = None) -> list[str]:
    """Register the ``vlpe_vit_*`` architectures in timm for ``encoding`` fixed by the name (a registered
    encoding, e.g. one of your own: every preset it :func:`fits`, every size) or, with None, chosen by keyword
    (every preset and size). Returns the names; names already registered are left as they are. Import-time
    registration covers :func:`grid_encodings`."""
    presets = TIMM_PRESETS
    if encoding is not None:
        vlpe.encodings.get(encoding)  # ValueError naming the registered ones
        presets = tuple(p for p in TIMM_PRESETS if fits(p, encoding))
        if not presets:
            raise ValueError(
                f"encoding {encoding!r} does not build on a 2D grid for any of the presets {TIMM_PRESETS}; grid "
                f"encodings: {grid_encodings()}"
            )
    return register_architectures(encoding, presets, create=_create)


if TIMM_INSTALLED:  # the architectures of every grid encoding, at import (timm is optional for the library)
    for _enc in (None, *grid_encodings()):
        register_timm(_enc)
    del _enc
