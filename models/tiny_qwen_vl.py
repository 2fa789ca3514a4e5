"""A tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder with a real processor, built offline.

It stands in for a downloaded checkpoint (``Qwen/Qwen2-VL-2B-Instruct`` ...) wherever the real one cannot be fetched:
the folder holds what ``save_pretrained`` of the model and of its processor write (``config.json``,
``model.safetensors``, the tokenizer, the families' own image and video processors, a chat template), so every
loader of a real folder reads it unchanged (``AutoProcessor`` / ``AutoModelForImageTextToText`` with
``local_files_only``). The tokenizer is a word-level fast tokenizer (``tokenizers``) over the words of the given
texts plus the Qwen special tokens; the chat template renders messages as Qwen2-VL's does (``<|im_start|>role``
... ``<|im_end|>``, a default system turn, ``<|vision_start|><|video_pad|><|vision_end|>`` for a video item).
The decoder is 1 layer of width 128 (8 heads of 16, 4 KV heads: grouped-query attention, and enough KV heads for
MHRoPE's three axes), the vision tower 1 block, 14 px patches merged 2x2.

    from models.tiny_qwen_vl import save_tiny_qwen_vl
    save_tiny_qwen_vl("qwen2_vl", "tiny-qwen2-vl", texts=["What item is shown in red?", "cat", "moon"])
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

__all__ = ["FAMILIES", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "TEMPLATE_TEXT", "tiny_tokenizer", "save_tiny_qwen_vl"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<|im_start|>",
                  "<|im_end|>"]  # fmt: skip

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# words the template and the processors write (Qwen3-VL's frame timestamps: "<0.5 seconds>")
TEMPLATE_TEXT = "system You are a helpful assistant . user assistant < > seconds 0 1 2 3 4 5 6 7 8 9"


def tiny_tokenizer(texts: Iterable[str]):
    """A word-level ``PreTrainedTokenizerFast`` over the words of ``texts`` (and the template's), with ``<unk>``,
    ``<pad>``, ``<eos>`` and the Qwen special tokens; whitespace and punctuation split as its pre-tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([TEMPLATE_TEXT, *texts])
    words = ["<unk>", "<pad>", "<eos>"] + sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    vocab = {w: i for i, w in enumerate(words + SPECIAL_TOKENS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tok


def save_tiny_qwen_vl(family: str, folder: str | Path, *, texts: Iterable[str] = (), frame: int = 28,
                      max_frame: int | None = None, seed: int = 0, chat_template: bool = True,
                      initializer_range: float = 0.2, layers: int = 1, vision_width: int = 16,
                      vision_depth: int = 1) -> Path:  # fmt: skip
    """Save a random ``family`` model (see the module docstring) and its processor to ``folder``; returns it.

    Args:
        family: ``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``.
        texts: the texts whose words the tokenizer knows (anything else is ``<unk>``).
        frame, max_frame: the processors' pixel budget: frames are resized to between ``frame**2`` and
            ``max_frame**2`` pixels (``max_frame`` defaults to ``frame``); 28 px = one 2x2 merge of 14 px patches.
        chat_template: give the processor the Qwen-style chat template (False: a processor without one).
        layers, vision_width, vision_depth: decoder layers, vision tower width and blocks (the defaults: the
            smallest model; a learnable task wants a wider tower, e.g. ``vision_width=64, vision_depth=2``).
    """
    import torch
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    folder = Path(folder)
    hi = frame if max_frame is None else max_frame
    pixels = dict(min_pixels=frame * frame, max_pixels=hi * hi)
    tok = tiny_tokenizer(texts)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    special = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                   vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])  # fmt: skip
    text = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, bos_token_id=None, initializer_range=initializer_range)  # fmt: skip
    vision = dict(depth=vision_depth, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    vh = max(2, vision_width // 16)  # vision heads (of 16 channels from a width of 32 on)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}  # head_dim 16: 8 pairs
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(text_config=dict(text, rope_parameters=rope),
                               vision_config=dict(vision, embed_dim=vision_width, hidden_size=128, num_heads=vh),
                               **special)  # fmt: skip
        model = tf.Qwen2VLForConditionalGeneration(cfg)
        procs = tf.Qwen2VLImageProcessor(**pixels), tf.Qwen2VLVideoProcessor(**pixels), tf.Qwen2VLProcessor
    elif family == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(vision, hidden_size=vision_width, intermediate_size=vision_width, num_heads=vh,
                               out_hidden_size=128, window_size=28, fullatt_block_indexes=[0], tokens_per_second=2),
            **special,
        )  # fmt: skip
        model = tf.Qwen2_5_VLForConditionalGeneration(cfg)
        procs = tf.Qwen2VLImageProcessor(**pixels), tf.Qwen2VLVideoProcessor(**pixels), tf.Qwen2_5_VLProcessor
    else:
        cfg = tf.Qwen3VLConfig(
            text_config=dict(text, head_dim=16, rope_parameters={**rope, "mrope_section": [4, 2, 2],
                                                                 "mrope_interleaved": True}),
            vision_config=dict(vision, hidden_size=vision_width, intermediate_size=vision_width, num_heads=vh,
                               out_hidden_size=128, num_position_embeddings=16, deepstack_visual_indexes=[0],
                               patch_size=14),
            **special,
        )  # fmt: skip
        model = tf.Qwen3VLForConditionalGeneration(cfg)
        size = {"shortest_edge": frame * frame, "longest_edge": hi * hi}
        procs = (tf.Qwen2VLImageProcessor(size=size, patch_size=14),
                 tf.Qwen3VLVideoProcessor(size=size, patch_size=14), tf.Qwen3VLProcessor)  # fmt: skip
    image, video, processor_cls = procs
    extra = {"chat_template": CHAT_TEMPLATE} if chat_template else {}
    processor = processor_cls(image_processor=image, tokenizer=tok, video_processor=video, **extra)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
