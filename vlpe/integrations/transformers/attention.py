"""What a patched decoder runs around attention: per-layer tables and masks, per-head rotation, packed rows.

Everything here is reached through transformers' and PyTorch's public extension points: the attention-function
registry (:class:`transformers.AttentionInterface`, functions ``vlpe_sdpa`` / ``vlpe_eager`` that add a
design's own mask), the ``position_embeddings`` every decoder layer receives from the rotary module, the flash
varlen keyword arguments (``cu_seq_lens_q`` ...) that the text model hands on to every attention call, and forward
hooks registered on the modules of one model instance. Nothing in a modeling file is replaced.

Packed rows under flash-type attention: transformers' flash path (``_flash_attention_forward`` in
``transformers/modeling_flash_attention_utils.py``) runs the varlen kernel on per-segment boundaries given as
``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (these win over its own inference,
which reads packing from position ids for a batch of one row only, and in Qwen-VL only from 4-row tensors). The
text-model hook derives them once per forward from the packed tensor's text row (:func:`varlen_kwargs`), for
every row count and batch size, for the implementations :func:`takes_varlen` names.
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor, nn

from vlpe.encodings import multimodal as mm
from vlpe.encodings.multimodal.rotary import rotate_heads

__all__ = ["MASK_BASES", "VARLEN_ATTENTION", "VARLEN_KEYS", "register_attention", "takes_varlen", "varlen_kwargs",
           "AttentionHooks"]  # fmt: skip

MASK_BASES = ("sdpa", "eager")
# attention implementations that read packed rows from the flash varlen kwargs (add a name to this set for an
# implementation registered in transformers.AttentionInterface that takes them); see takes_varlen
VARLEN_ATTENTION: set[str] = {"flash_attention_2", "flash_attention_3", "flash_attention_4"}
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def takes_varlen(implementation: str | None) -> bool:
    """Whether the attention ``implementation`` (a text config's ``_attn_implementation``) reads packed rows from
    the flash varlen kwargs :data:`VARLEN_KEYS`: a name in :data:`VARLEN_ATTENTION`, or one registered in
    :class:`transformers.AttentionInterface` as transformers' own ``flash_attention_forward`` (or a
    ``functools.partial`` of it), which is how transformers registers hub kernels that bring a varlen function
    (``kernels-community/flash-attn2`` ..., ``integrations/hub_kernels.py``)."""
    if not implementation:
        return False
    if implementation in VARLEN_ATTENTION:
        return True
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get(implementation)
    return fn is flash_attention_forward or getattr(fn, "func", None) is flash_attention_forward


def varlen_kwargs(text: Tensor) -> dict | None:
    """The flash varlen kwargs of packed rows, from their Hugging Face text row ``text (B, S)``.

    A segment starts at every row start and wherever a text position is not the previous one + 1 (the rule of
    transformers' ``find_packed_sequence_indices`` in ``masking_utils.py``, which builds the sdpa / eager
    block-diagonal mask from the same row), so every packed sample is one segment and every padding slot (text
    position 0, :func:`vlpe.encodings.multimodal.text_position_ids`) one of its own, attending to itself only.
    Returns ``cu_seq_lens_q`` = ``cu_seq_lens_k`` ``(n + 1,)`` int32 boundaries over the flattened ``B * S``
    tokens (the layout the varlen kernel runs on, ``(B * S, heads, dim)``) and ``max_length_q`` =
    ``max_length_k`` (int); None when every row is one segment (nothing packed: the plain kernel is exact). One
    device-to-host copy of ``B * S`` booleans; no loop over tokens.
    """
    B, S = text.shape
    if B * S == 0:
        return None
    start = torch.ones(B, S, dtype=torch.bool, device=text.device)  # (B, S) first token of a segment
    start[:, 1:] = text[:, 1:] != text[:, :-1] + 1
    first = start.reshape(-1).cpu().nonzero().squeeze(1)  # (n,) on the host: the forward's one read
    if first.shape[0] == B:
        return None
    cu = torch.cat([first, torch.tensor([B * S])]).to(torch.int32)  # (n + 1,)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = cu.to(text.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _masked_attention(base: str):
    """Attention function ``vlpe_<base>``: runs ``base`` with the ``vlpe_keep`` mask a layer hook passed, if any."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, attention_mask, **kwargs):
        keep = kwargs.pop("vlpe_keep", None)  # (B, 1, S, S) bool: the whole sequence is in this forward
        if keep is not None:
            S, K = keep.shape[-1], key.shape[-2]
            if query.shape[-2] != S or K < S:
                raise ValueError(f"a layer mask for {S} tokens met {query.shape[-2]} queries and {K} keys")
            # a query that may see no key (padding) sees itself, so that no row of the softmax is empty
            eye = torch.eye(S, dtype=torch.bool, device=keep.device)
            keep = keep | (eye & ~keep.any(-1, keepdim=True))
            if K > S:  # a static cache: slots beyond the prompt are empty
                keep = torch.nn.functional.pad(keep, (0, K - S), value=False)
            if base == "eager":
                attention_mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device)
                attention_mask = attention_mask.masked_fill(~keep.to(query.device), torch.finfo(query.dtype).min)
            else:
                attention_mask = keep.to(query.device)
        if base == "eager":  # the modeling file's own eager attention (repeat_kv, softmax in fp32, ...)
            impl = importlib.import_module(type(module).__module__).eager_attention_forward
        else:
            impl = ALL_ATTENTION_FUNCTIONS[base]
        return impl(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = attention.__qualname__ = f"vlpe_{base}_attention"
    return attention


def register_attention() -> None:
    """Register ``vlpe_sdpa`` / ``vlpe_eager`` (stateless; registering again is a no-op in effect)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for base in MASK_BASES:
        AttentionInterface.register(f"vlpe_{base}", _masked_attention(base))
        AttentionMaskInterface.register(f"vlpe_{base}", masks[base])


def head_modules(attn: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The modules whose outputs are the per-head queries and keys right before rotation: the head-wise norms
    (Qwen3-VL) or the projections."""
    if isinstance(getattr(attn, "q_norm", None), nn.Module) and isinstance(getattr(attn, "k_norm", None), nn.Module):
        return attn.q_norm, attn.k_norm
    return attn.q_proj, attn.k_proj


class AttentionHooks:
    """The hooks of :class:`vlpe.integrations.transformers.Patch` (a mixin: the patch holds ``variant``,
    ``layered``, ``masked``, ``per_head``, ``rows``, the per-call slot ``_heads`` and ``_rotating``, the modules
    carrying the per-head hooks of every layer and their handles). All are bound methods of the patch, so a deep
    copy or a pickle of the model carries them to its own patch."""

    def attention_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of every decoder attention: the layer's own tables (PyPE) and mask; per-head tables
        (MHRoPE) go to the query/key hooks, and the layer rotates by identity tables itself."""
        tables = kwargs.get("position_embeddings")
        if not isinstance(tables, tuple) or len(tables) not in (2, 4):
            return None
        kwargs = dict(kwargs)
        cos, sin = tables[:2]
        layer = module.layer_idx
        if self.layered and len(tables) == 4:  # (L, B, S, D) tables of every layer: pick this one's
            cos, sin = cos[layer], sin[layer]
        if self.per_head:
            self.place_head_hooks(module)
            if cos.dim() != 4:
                raise ValueError(
                    f"variant {self.label!r} rotates every KV head by its own axis: position_embeddings must be "
                    f"(B, H_kv, S, D) tables from its rotary module, got {tuple(cos.shape)}"
                )
            self._heads = (cos, sin)
            B, _, S, D = cos.shape
            # the layer's own rotation: by identity tables (cos 1, sin 0), exact
            cos, sin = cos.new_ones(()).expand(B, S, D), sin.new_zeros(()).expand(B, S, D)
        kwargs["position_embeddings"] = (cos, sin)
        if self.masked and len(tables) == 4:
            ids, labels = tables[2], tables[3]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None or not cache.get_seq_length(layer):
                # the whole sequence is in this forward; after a cached prefix come text tokens placed after
                # everything before them, for which the design's mask is the causal mask the model builds anyway
                keep = mm.pype_attention_mask(ids, layer, attention_mask=labels != 0)
                kwargs["vlpe_keep"] = keep & (labels.unsqueeze(-1) == labels.unsqueeze(-2)).unsqueeze(1)
        return args, kwargs

    def place_head_hooks(self, attn: nn.Module) -> None:
        """Keep :meth:`rotate_heads_hook` on the modules that produce ``attn``'s queries and keys now
        (:func:`head_modules`, read at every call): a wrapper that took a projection's place after the patch (a
        LoRA or DoRA layer) gets the hooks and the module inside it loses them, and the plain projection gets them
        back once the wrapper is gone (adapters merged and unloaded), so the whole projection, adapters included,
        is rotated exactly once whatever the order of patching and wrapping.

        Args:
            attn: a decoder attention module of the patched model (its ``layer_idx`` keys the placement).
        """
        modules = head_modules(attn)
        placed = self._rotating.get(attn.layer_idx)
        if placed is not None and all(a is b for a, b in zip(placed[0], modules)):
            return
        if placed is not None:
            for handle in placed[1]:
                handle.remove()
        handles = [m.register_forward_hook(self.rotate_heads_hook) for m in modules]
        self._rotating[attn.layer_idx] = (modules, handles)

    def attention_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """Forward hook of every decoder attention (per-head variants): the call's tables are let go."""
        self._heads = None
        return None

    def rotate_heads_hook(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        """Forward hook of the query / key module of a decoder attention (per-head variants, placed by
        :meth:`place_head_hooks`): rotates every head by the tables of its KV head, in the ``(B, S, H, D)`` layout
        those modules produce."""
        if self._heads is None:
            raise ValueError(
                f"variant {self.label!r}: a decoder attention's query/key projection ran outside the attention call "
                "that hands it its per-head tables"
            )
        cos, sin = self._heads
        D = cos.shape[-1]
        x = output if output.dim() == 4 else output.unflatten(-1, (-1, D))  # (B, S, H, D)
        out = rotate_heads(x, cos, sin, unsqueeze_dim=2)
        return out if output.dim() == 4 else out.flatten(-2)

    def text_model_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Forward pre-hook of the text model: every ``position_ids`` becomes the patch's packed tensor, and packed
        rows keep to their samples for every row count and batch size.

        Missing ids (the decoder's default, ``past + arange``) and ``(B, S)`` 1D ids are text positions: they get
        the design's ids of text. Packed rows (a text row restarting at every sample) are read only when no
        attention mask is given and nothing is cached:

        - flash-type attention (:func:`takes_varlen`): the varlen boundaries of the text row
          (:func:`varlen_kwargs`, computed once here for every layer) join the kwargs the text model hands to each
          attention call, unless the caller passed its own :data:`VARLEN_KEYS`;
        - sdpa / eager: transformers builds the block-diagonal mask from the first row of a 4-row position tensor
          (with ``use_cache=False``); for the patch's other row counts (1D designs, VRoPE's 4 axes, PyPE's layers)
          this builds the same mask from the text row, under the same conditions, with transformers' own mask
          builder.
        """
        pos = kwargs.get("position_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        embeds = kwargs.get("inputs_embeds")
        changed = False
        if not isinstance(pos, Tensor) or pos.dim() != 3:
            ref = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
            if ref is None:
                return None
            given = pos is not None
            if pos is None:
                B, S = ref.shape[:2]
                past = cache.get_seq_length() if cache is not None else 0
                pos = (torch.arange(S, device=ref.device) + past).expand(B, S)
            pos = self.text_only(pos)
            kwargs = {**kwargs, "position_ids": pos}
            changed = True
            if not (given and takes_varlen(module.config._attn_implementation)):
                return args, kwargs  # (B, S) text positions: transformers reads 4-row tensors itself
        unchanged = (args, kwargs) if changed else None
        if pos.shape[0] != self.rows + 1 or kwargs.get("attention_mask") is not None:
            return unchanged
        if takes_varlen(module.config._attn_implementation):
            if cache is not None and cache.get_seq_length() > 0:
                return unchanged  # tokens after a cached prefix: decoding, one sample per row
            if any(kwargs.get(key) is not None for key in VARLEN_KEYS):
                return unchanged  # the caller's own boundaries
            extra = varlen_kwargs(pos[0])
            return unchanged if extra is None else (args, {**kwargs, **extra})
        if pos.shape[0] == 4:
            return unchanged  # transformers builds the packed mask from the text row itself
        use_cache = kwargs.get("use_cache")
        if use_cache is None:  # the model's default, as transformers resolves it (no cache under checkpointing)
            use_cache = getattr(module.config, "use_cache", False)
            use_cache = use_cache and not (module.training and getattr(module, "gradient_checkpointing", False))
        if cache is not None or use_cache:
            return unchanged
        from transformers.masking_utils import create_causal_mask

        if embeds is None:  # only the shape, dtype and device are read
            dtype = module.get_input_embeddings().weight.dtype
            embeds = torch.empty(*pos.shape[1:], 0, dtype=dtype, device=pos.device)
        mask = create_causal_mask(
            config=module.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos[0].long()
        )
        if mask is None:  # a plain causal mask: nothing is packed
            return unchanged
        return args, {**kwargs, "attention_mask": mask}
