"""vlpe: position encodings for vision transformers and vision-language models, behind one interface."""

from . import encodings
from .attention import Attention, attend, attention_logits
from .positions import Positions

__all__ = ["Positions", "encodings", "attention_logits", "attend", "Attention"]
__version__ = "0.1.0"
