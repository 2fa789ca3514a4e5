"""Switch the position encoding of a timm ``VisionTransformer`` or ``Eva``, keeping every weight.

    import timm, vlpe.integrations.timm as vt
    model = timm.create_model("vit_small_patch16_224", pretrained=False)
    model = vt.convert(model, "lookhere")          # a copy: same weights, LookHere instead of the learned APE
    logits = model(torch.randn(1, 3, 512, 384))    # any input size

How: each block's attention module is replaced by :class:`HookedAttention`, which holds the *same*
projection parameters (``qkv``, q/k norms, ``proj``) and runs :func:`vlpe.attend` with the encoding's
hooks; timm's blocks (norms, MLP, LayerScale, drop-path) run unchanged. The converted model tokenises
with timm's own patch embedding at any size, builds ``vlpe.Positions`` for the grid (prefix tokens from
the model), prepares the encoding once per forward and calls ``embed``/``mix`` around the blocks. The old
absolute embedding (``pos_embed``) is dropped, except with ``encoding="ape"``, whose table starts as a
copy of it (then the converted model equals the original at the training size, and timm's dynamic-size
resampling elsewhere). timm's own rotary tables (Eva) are dropped too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import attend
from ..encodings import Context, Encoding, build, get
from ..encodings.absolute import LearnedAPE
from ..encodings.registry import by_class
from ..positions import Positions

__all__ = ["convert", "ConvertedViT", "HookedAttention", "ABSOLUTE_TABLES", "absolute_table_of"]

#: encoding class (subclasses inherit it) -> the attribute holding its learned absolute table ``([P +] h*w, C)``,
#: which a timm ViT's ``pos_embed`` initialises in :func:`convert` (its constructor then takes ``prefix``); only the
#: converter asks this, so it lives here, not on the encoding
ABSOLUTE_TABLES: dict[type, str] = {LearnedAPE: "pos_embed"}


def absolute_table_of(cls: type) -> str | None:
    """The attribute of ``cls``'s learned absolute table (the nearest registered class of its MRO), or None."""
    return by_class(ABSOLUTE_TABLES, cls)


class _Shared:
    """What the hooked attention modules read during one forward: the encoding and its context."""

    def __init__(self) -> None:
        self.enc: Encoding | None = None
        self.ctx: Context | None = None


class HookedAttention(nn.Module):
    """A timm attention module's parameters, run through :func:`vlpe.attend` with encoding hooks."""

    def __init__(self, attn: nn.Module, *, layer: int, shared: _Shared) -> None:
        super().__init__()
        for unsupported in ("gate",):
            if getattr(attn, unsupported, None) is not None:
                raise ValueError(f"convert: attention with a {unsupported!r} module is not supported")
        self.num_heads = attn.num_heads
        self.layer = layer
        self._shared = [shared]  # a list so the holder is not registered as a submodule
        if getattr(attn, "qkv", None) is not None:
            self.qkv = attn.qkv
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.qkv = None
            self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        # Eva keeps separate q/v biases (k has none); plain timm Attention has them inside qkv
        self.q_bias = getattr(attn, "q_bias", None)
        self.k_bias = getattr(attn, "k_bias", None)
        self.v_bias = getattr(attn, "v_bias", None)
        self.q_norm = getattr(attn, "q_norm", nn.Identity())
        self.k_norm = getattr(attn, "k_norm", nn.Identity())
        self.norm = getattr(attn, "norm", nn.Identity())  # Eva's scale norm before proj
        self.proj = attn.proj
        self.proj_drop = getattr(attn, "proj_drop", nn.Identity())
        drop = getattr(attn, "attn_drop", None)
        self.attn_drop = drop.p if isinstance(drop, nn.Dropout) else 0.0

    def forward(self, x: Tensor, rope: Tensor | None = None, attn_mask: Tensor | None = None, **_: Any) -> Tensor:
        B, N, C = x.shape
        H = self.num_heads
        if self.qkv is not None:
            if self.q_bias is not None:
                k_bias = self.k_bias if self.k_bias is not None else torch.zeros_like(self.q_bias)
                qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, k_bias, self.v_bias]))
            else:
                qkv = self.qkv(x)
            q, k, v = qkv.reshape(B, N, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, Dh)
        else:
            q, k, v = (p(x).reshape(B, N, H, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        shared = self._shared[0]
        out = attend(
            q,
            k,
            v,
            enc=shared.enc,
            ctx=shared.ctx,
            layer=self.layer,
            attn_mask=attn_mask,
            dropout_p=self.attn_drop if self.training else 0.0,
        )  # (B, H, N, Dh)
        out = self.norm(out.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(self.proj(out))


class ConvertedViT(nn.Module):
    """A timm ViT/Eva whose position encoding is a vlpe encoding; ``forward(images) -> logits``."""

    def __init__(self, model: nn.Module, encoding: Encoding) -> None:
        super().__init__()
        self.model = model
        self.encoding = encoding
        self._shared = _Shared()
        for i, blk in enumerate(model.blocks):
            blk.attn = HookedAttention(blk.attn, layer=i, shared=self._shared)
        self.num_prefix = int(getattr(model, "num_prefix_tokens", 0))
        self.no_embed_class = bool(getattr(model, "no_embed_class", False))

    def _tokens(self, images: Tensor) -> tuple[Tensor, Positions]:
        pe = self.model.patch_embed
        x = pe.proj(images)  # (B, C, h, w)
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # (B, h * w, C)
        x = pe.norm(x)
        prefix = []
        for name in ("cls_token", "reg_token"):
            t = getattr(self.model, name, None)
            if t is not None:
                prefix.append(t.expand(x.shape[0], -1, -1))
        if prefix:
            x = torch.cat(prefix + [x], dim=1)  # (B, P + h * w, C)
        return x, Positions.grid(h, w, prefix=self.num_prefix, device=x.device)

    def forward_features(self, images: Tensor) -> Tensor:
        x, pos = self._tokens(images)
        enc = self.encoding
        ctx = enc.prepare(pos)  # once per forward, shared by every block
        self._shared.enc, self._shared.ctx = enc, ctx
        try:
            plan = ctx.plan  # which hooks this forward has (the attention reads the same plan)
            x = enc.embed(x, ctx) if plan.embed else x
            x = self.model.norm_pre(x)
            for layer, blk in enumerate(self.model.blocks):
                x = blk(x)
                x = enc.mix(x, ctx, layer) if plan[layer].mix else x
        finally:
            self._shared.enc = self._shared.ctx = None
        return self.model.norm(x)

    def forward(self, images: Tensor) -> Tensor:
        return self.model.forward_head(self.forward_features(images))

    def no_weight_decay(self) -> set[str]:
        return {f"encoding.{n}" for n in self.encoding.no_weight_decay()}


def convert(model: nn.Module, encoding: str | Encoding, *, inplace: bool = False, **options: Any) -> ConvertedViT:
    """Return ``model`` (a timm ``VisionTransformer`` or ``Eva``) with ``encoding`` as its position encoding.

    By default ``model`` is left untouched: the converted model holds a copy of it (same weight values).
    ``inplace=True`` converts ``model`` itself (its attention modules are replaced, its ``pos_embed`` dropped)
    and shares its weights, without the copy's memory. ``options`` go to :func:`vlpe.encodings.build`;
    ``depth`` and ``num_axes=2`` are filled in. An :class:`~vlpe.encodings.Encoding` instance must fit the
    model (its ``dim``, ``num_heads``, ``num_axes=2`` and a ``depth`` covering every block) and takes no
    ``options``. With ``encoding="ape"`` the learned table is initialised from the model's ``pos_embed``.
    """
    blocks = getattr(model, "blocks", None)
    patch_embed = getattr(model, "patch_embed", None)
    if blocks is None or patch_embed is None or not hasattr(model, "forward_head"):
        raise ValueError(
            f"convert expects a timm VisionTransformer or Eva (blocks, patch_embed, forward_head), got {type(model).__name__}"
        )
    dim = int(getattr(model, "embed_dim", getattr(model, "num_features", 0)))
    heads = int(blocks[0].attn.num_heads)
    if isinstance(encoding, Encoding):
        _check_fits(encoding, dim=dim, heads=heads, depth=len(blocks), options=options)
        enc = encoding
    else:
        options.setdefault("depth", len(blocks))
        options.setdefault("num_axes", 2)
        options.setdefault("grid", tuple(int(g) for g in patch_embed.grid_size))  # the training grid
        if absolute_table_of(get(encoding)) is not None:  # a learned table: as many prefix slots as the model's
            no_cls_slot = getattr(model, "no_embed_class", False)
            options.setdefault("prefix", 0 if no_cls_slot else int(getattr(model, "num_prefix_tokens", 0)))
        enc = build(encoding, dim=dim, num_heads=heads, **options)
    if not inplace:
        import copy

        model = copy.deepcopy(model)
    pos_embed = getattr(model, "pos_embed", None)
    if enc is not encoding and absolute_table_of(type(enc)) is not None and isinstance(pos_embed, nn.Parameter):
        _init_table_from(enc, pos_embed.detach())
    # the old encodings are dropped: the converted model never reads them
    if pos_embed is not None:
        model.pos_embed = None
    if getattr(model, "rope", None) is not None:
        model.rope = None
    return ConvertedViT(model, enc)


def _check_fits(enc: Encoding, *, dim: int, heads: int, depth: int, options: dict) -> None:
    """``ValueError`` unless an encoding instance was built for this model's width, heads, 2D grid and depth."""
    name = type(enc).__name__
    if options:
        raise ValueError(
            f"convert: options {sorted(options)} only apply when the encoding is given by name; {name} is "
            f"already built (pass its name and the options instead)"
        )
    wrong = [
        f"{what}={got} (the model needs {want})"
        for what, got, want in (("dim", enc.dim, dim), ("num_heads", enc.num_heads, heads), ("num_axes", enc.num_axes, 2))
        if got != want
    ]
    if wrong:
        raise ValueError(
            f"convert: {name} was built with {', '.join(wrong)}; build it with dim={dim}, num_heads={heads}, "
            f"num_axes=2"
        )
    if enc.depth < depth:
        raise ValueError(
            f"convert: {name} was built with depth={enc.depth} but the model has {depth} blocks; build it with "
            f"depth={depth}"
        )


def _init_table_from(enc: Encoding, table: Tensor) -> None:
    """Copy timm's ``pos_embed`` (1, [P +] h*w, C) into the encoding's learned absolute table ([P +] h*w, C)."""
    target = getattr(enc, absolute_table_of(type(enc)))
    src = table.reshape(-1, table.shape[-1])
    if not isinstance(target, nn.Parameter) or tuple(target.shape) != tuple(src.shape):
        got = None if target is None else tuple(target.shape)
        raise ValueError(f"cannot initialise the {type(enc).__name__} table {got} from timm pos_embed {tuple(table.shape)}")
    with torch.no_grad():
        target.copy_(src)
