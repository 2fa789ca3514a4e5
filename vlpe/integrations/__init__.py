"""Bridges from vlpe to other libraries.

Each submodule imports its library lazily, so ``import vlpe.integrations`` needs neither timm nor
transformers:

- :mod:`vlpe.integrations.transformers`: switch a Hugging Face Qwen2-VL / Qwen2.5-VL / Qwen3-VL model to
  any multimodal position design and frequency allocation of :mod:`vlpe.encodings.multimodal`.
"""
