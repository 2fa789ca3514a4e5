"""Tokenizers: inputs to tokens ``(B, N, C)`` plus the :class:`~vlpe.Positions` that describe them.

* :class:`ImageTokenizer`: patch embedding of any ``H x W``; same-size batches get a ``(h, w)`` grid,
  lists of different sizes are packed and padded with ``Positions.valid``.
* :class:`VideoTokenizer`: ``t x p x p`` tubelets, ``(t, h, w)`` positions, optionally in real time.
* :class:`PointTokenizer`: farthest point sampling + kNN groups + mini-PointNet; group centres as positions.

Prefix tokens: every tokenizer takes ``num_prefix`` (default 0) learned tokens (CLS first, then registers)
that it prepends to the tokens and describes in ``pos.prefix`` (coordinate 0, always valid). A model that
keeps its own CLS leaves ``num_prefix=0`` and uses :func:`prepend_prefix`, which updates both together.
"""

from ._common import PrefixTokens, prepend_prefix
from .image import ImageTokenizer
from .points import PointTokenizer, farthest_point_sample, gather_points, knn_indices
from .video import VideoTokenizer

__all__ = [
    "ImageTokenizer",
    "VideoTokenizer",
    "PointTokenizer",
    "PrefixTokens",
    "prepend_prefix",
    "farthest_point_sample",
    "knn_indices",
    "gather_points",
]
