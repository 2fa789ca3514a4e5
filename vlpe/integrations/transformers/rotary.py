"""The rotary module a patched decoder uses (``language_model.rotary_emb``) and the frequencies it starts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from vlpe.encodings import multimodal as mm
from vlpe.encodings.functional.rope import inv_freq as inv_freq_of
from vlpe.encodings.functional.scaling import parse_scaling, scale_frequencies
from vlpe.encodings.multimodal.rotary import frequencies, tables

__all__ = ["RotarySettings", "MultimodalRotary", "MultimodalRotaryEmbedding", "rotary_settings"]

_RUNTIME_ROPE_TYPES = ("longrope",)  # inv_freq switches with the sequence length (dynamic NTK is handled)
_NTK = parse_scaling({"type": "ntk", "factor": 1.0}, num_axes=1)  # the factor is given per forward (dynamic)


@dataclass(frozen=True, kw_only=True)
class RotarySettings:
    """What the tables of one patched model are computed from, besides the variant.

    Attributes:
        head_dim, num_kv_heads: of the decoder attention.
        theta: the RoPE base (the model's ``rope_theta`` unless ``theta=`` was given).
        inv_freq: fp32 inverse frequencies ``(head_dim / 2,)`` on the host, or None for vlpe's of ``theta``.
        attention_scaling: multiplies cos and sin (transformers' ``attention_scaling`` of the rope type).
        scaling: a vlpe scaling dict applied to the frequencies of ``theta`` (with ``inv_freq`` None).
        dynamic: ``(factor, max_position_embeddings)`` of rope_type ``dynamic``: NTK recomputed per forward.
    """

    head_dim: int
    num_kv_heads: int
    theta: float
    inv_freq: Tensor | None = None
    attention_scaling: float = 1.0
    scaling: Mapping[str, Any] | None = None
    dynamic: tuple[float, float] | None = None


class MultimodalRotaryEmbedding(nn.Module):
    """Replacement for the decoder's ``rotary_emb``: ``forward(x, position_ids)`` -> the decoder layers'
    ``position_embeddings``, in x's dtype.

    ``position_ids`` is the patch's packed tensor (:func:`pack_position_ids`), with or without the Hugging Face
    text row that the decoder strips from 4-row tensors; the patch's text-model pre-hook turns every other
    input into it. The result is ``(cos, sin)``: ``(B, S, D)``, ``(B, H_kv, S, D)`` for head-wise allocations,
    with a leading layer axis for layer-dependent designs, which also get the ids and sample labels their layer
    masks are built from: ``(cos, sin, ids, labels)``. The frequency matrix is computed once per device and
    kept (:attr:`cached`); it comes from :attr:`settings` alone, never from the module's tensors, so a model patched
    on the meta device gets its tables right once materialised.

    The stock module stays out of the module tree: its parameters and buffers are registered on this module under
    their own names and persistence, so the patched model's ``state_dict`` / ``load_state_dict`` /
    ``named_buffers`` / ``named_non_persistent_buffers`` are the stock model's (what ``save_pretrained`` writes and
    ``from_pretrained`` fills in), and they move, cast and load with the model. :attr:`stock` hands the stock module
    back holding them (``remove``). Named ``*RotaryEmbedding`` and showing the stock's ``rope_type``, ``config``
    and frequency rules, so that ``PreTrainedModel._init_weights`` (``init_weights`` after building on the meta
    device and ``to_empty``, ``from_pretrained`` filling in non-persistent buffers) recomputes these buffers
    exactly as it does the stock module's; the stock's are also recomputed when it is handed back after the patch
    was installed on the meta device (see :attr:`stock`). Checked against the stock model's keys, buffers and
    logits by ``tests/test_integration_transformers_export.py``.
    """

    def __init__(self, *, patch: Any, stock: nn.Module, settings: RotarySettings) -> None:
        super().__init__()
        if next(stock.children(), None) is not None:
            raise ValueError(
                f"the decoder's rotary module {type(stock).__name__} has submodules; the vlpe patch expects one that "
                "holds its tensors directly (the Qwen-VL rotary modules of transformers 5.x)"
            )
        for name, param in stock._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in stock._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in stock._non_persistent_buffers_set)
        object.__setattr__(self, "_stock", stock)  # a plain attribute: outside the module tree
        # installed while the stock's tensors are on the meta device (init contexts): recompute them once they exist
        self._stock_unset = any(t is not None and t.is_meta for t in self._tensors().values())
        self.patch = patch
        self.settings = settings
        self.cached: dict[str, tuple] = {}  # device -> (frequency matrix, attention factor, inverse frequencies)

    # what PreTrainedModel._init_weights reads of a rotary module to recompute its buffers: the stock's
    @property
    def rope_type(self) -> str | None:
        return getattr(self._stock, "rope_type", None)

    @property
    def config(self):
        return getattr(self._stock, "config", None)

    @property
    def compute_default_rope_parameters(self):
        return getattr(self._stock, "compute_default_rope_parameters", None)

    def _tensors(self) -> dict[str, Tensor | None]:
        return {**self._parameters, **self._buffers}

    @property
    def stock(self) -> nn.Module:
        """The stock rotary module, holding this module's current parameters and buffers (as moved, cast or loaded
        with the patched model). When the patch was installed on the meta device and the tensors now exist
        (``to_empty`` / ``from_pretrained``), the stock's non-loaded buffers are first recomputed by the text model's
        ``_init_weights``, as ``from_pretrained`` does for a stock model."""
        stock = self._stock
        stock._parameters.update(self._parameters)
        stock._buffers.update(self._buffers)
        if self._stock_unset and not any(t is not None and t.is_meta for t in self._tensors().values()):
            with torch.no_grad():
                self.patch.text._init_weights(stock)
            self._stock_unset = False
            self._parameters.update(stock._parameters)
            self._buffers.update(stock._buffers)
        return stock

    def extra_repr(self) -> str:
        return f"variant={self.patch.label!r}"

    def frequencies(self, device: torch.device, ids: Tensor | None = None) -> tuple[Tensor, float]:
        """The scaled frequency matrix on ``device`` and the attention factor, computed on the first call and kept
        (dynamic NTK: rebuilt on device from the kept inverse frequencies and the largest of ``ids``)."""
        key = str(device)
        if key not in self.cached:
            s = self.settings
            with torch.inference_mode(False), torch.no_grad():
                inv = None if s.inv_freq is None else s.inv_freq.to(device)
                F, factor = self._matrix(inv, None if s.dynamic else s.scaling, device)
            self.cached[key] = (F, factor, inv)
        F, factor, inv = self.cached[key]
        if self.settings.dynamic is None or ids is None:
            return F, factor
        # transformers' dynamic NTK: alpha = factor * L / L0 - (factor - 1) for the length L = max id + 1 (at least
        # L0), i.e. base theta * alpha ** (d / (d - 2)): vlpe's ntk scaling with a factor computed on device
        scale, L0 = self.settings.dynamic
        K = inv.numel()
        L = ids.amax().to(torch.float64) + 1
        alpha = (scale * torch.clamp_min(L, L0) / L0 - (scale - 1)).view(1, 1)  # (A = 1, 1)
        scaled = scale_frequencies(inv.view(1, K), _NTK, lo=self.settings.theta ** (-(K - 1) / K), num_pairs=K,
                                   factor=alpha)
        return self._matrix(scaled[0], None, device)

    def _matrix(self, inv: Tensor | None, scaling, device) -> tuple[Tensor, float]:
        s, v = self.settings, self.patch.variant
        return frequencies(
            v, head_dim=s.head_dim, num_axes=1 if v.layered else self.patch.num_axes, theta=s.theta,
            num_kv_heads=s.num_kv_heads, inv_freq=inv, scaling=scaling, device=device,
        )

    def forward(self, x: Tensor, position_ids: Tensor):
        patch = self.patch
        ids, labels = patch.unpack(position_ids)
        F, factor = self.frequencies(ids.device, ids)
        scale = self.settings.attention_scaling * factor if factor != 1.0 else self.settings.attention_scaling
        cos, sin = tables(ids, F, layered=patch.variant.layered, attention_scaling=scale, dtype=x.dtype)
        if patch.masked:
            return cos, sin, ids, labels
        return cos, sin


MultimodalRotary = MultimodalRotaryEmbedding  # the name the package exports


def model_frequencies(rotary_cls: type, cfg, rope_type: str) -> tuple[Tensor, float]:
    """``(inv_freq, attention_scaling)`` exactly as the model's rotary module computes them at init."""
    if rope_type == "default":
        fn = getattr(rotary_cls, "compute_default_rope_parameters", None)
        if fn is None:
            raise ValueError(f"{rotary_cls.__name__} has no compute_default_rope_parameters; pass theta= to apply()")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type {rope_type!r} in the model config")
        fn = ROPE_INIT_FUNCTIONS[rope_type]
    with torch.device("cpu"):  # on the host also under a meta-device context (a model built for from_pretrained)
        inv_freq, scaling = fn(cfg)
    return inv_freq.detach().float().cpu(), scaling


def config_scaling(rope: dict, cfg) -> dict[str, Any] | None:
    """The vlpe scaling dict of a config's ``rope_parameters`` (``linear`` / ``yarn``; None for ``default``), with
    transformers' defaults (``beta_fast or 32``, a missing yarn factor from the ratio of the context lengths)."""
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return {"type": "linear", "factor": rope["factor"]}
    if kind != "yarn":
        return None
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / original
    out: dict[str, Any] = {"type": "yarn", "factor": factor, "original_size": original,
                           "truncate": rope.get("truncate", True)}
    for key in ("beta_fast", "beta_slow"):
        if rope.get(key):
            out[key] = rope[key]
    if rope.get("attention_factor") is not None:
        out["attention_factor"] = rope["attention_factor"]
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        out["mscale"], out["mscale_all_dim"] = rope["mscale"], rope["mscale_all_dim"]
    return out


def rotary_settings(text: nn.Module, variant: mm.Variant, options: dict[str, Any]) -> RotarySettings:
    """The settings of the text model ``text`` under ``variant``; ``options`` may hold ``theta`` / ``scaling``."""
    cfg = text.config
    rope = cfg.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in _RUNTIME_ROPE_TYPES:
        raise ValueError(
            f"the model uses rope_type={rope_type!r}, whose frequencies change with the sequence length; vlpe "
            "tables are built from fixed inverse frequencies (default, linear, yarn, llama3 ...)"
        )
    head_dim = int(text.layers[0].self_attn.head_dim)
    common = {"head_dim": head_dim, "num_kv_heads": int(cfg.num_key_value_heads)}
    dynamic = None
    if "theta" in options or "scaling" in options:  # vlpe's frequencies of theta, vlpe's scaling
        theta = float(options.get("theta", rope.get("rope_theta", variant.theta)))
        scaling = options["scaling"] if "scaling" in options else config_scaling(rope, cfg)
        if "scaling" not in options and rope_type not in ("default", "linear", "yarn", "dynamic"):
            raise ValueError(
                f"theta= with rope_type={rope_type!r}: vlpe scales its own frequencies by linear / yarn / dynamic "
                "only; omit theta to use the model's own (scaled) frequencies"
            )
        if rope_type == "dynamic" and "scaling" not in options:
            K = head_dim // 2
            dynamic = (float(rope["factor"]), float(cfg.max_position_embeddings))
            return RotarySettings(**common, theta=theta, inv_freq=inv_freq_of(K, theta, dim=2 * K, device="cpu"),
                                   dynamic=dynamic)
        return RotarySettings(**common, theta=theta, scaling=scaling)
    stock = type(text.rotary_emb)
    if rope_type == "dynamic":  # the unscaled frequencies; the factor follows each forward's positions
        inv_freq, _ = model_frequencies(stock, cfg, "default")
        dynamic = (float(rope["factor"]), float(cfg.max_position_embeddings))
        return RotarySettings(**common, theta=float(rope["rope_theta"]), inv_freq=inv_freq, dynamic=dynamic)
    # the model's own frequencies, statically scaled as its rope_type says, recomputed in fp32
    inv_freq, attention_scaling = model_frequencies(stock, cfg, rope_type)
    theta = float(rope.get("rope_theta", variant.theta))
    return RotarySettings(**common, theta=theta, inv_freq=inv_freq, attention_scaling=float(attention_scaling))
