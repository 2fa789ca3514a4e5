"""Bridges from vlpe to other libraries.

Each submodule imports its library lazily, so ``import vlpe.integrations`` needs neither timm nor
transformers:

- :mod:`vlpe.integrations.transformers`: switch a Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL model to
  any multimodal position design and frequency allocation of :mod:`vlpe.encodings.multimodal`.
- :mod:`vlpe.integrations.timm`: switch the position encoding of a timm ``VisionTransformer`` / ``Eva``.
- :mod:`vlpe.integrations.lmms_eval`: the lmms-eval model ``vlpe_qwen_vl`` (a Qwen-VL folder under any variant,
  found by ``lmms-eval --model vlpe_qwen_vl`` through an entry point; the ``[lmms]`` extra installs lmms-eval).
"""
