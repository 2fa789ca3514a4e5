"""Backbones that take any vlpe encoding: ViT (timm-registered), point transformer, VLM.

Importing :mod:`models.vit` registers the ``vlpe_vit_*`` architectures with timm.
"""
