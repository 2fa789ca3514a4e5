"""vlpe: position encodings for vision transformers and vision-language models, behind one interface."""

from . import encodings
from .attention import Attention, attend, attention_logits
from .positions import Positions
from . import testing  # property checks (vlpe.testing.property_report); ~6 ms on top of the package import

__all__ = ["Positions", "encodings", "attention_logits", "attend", "Attention", "testing"]
__version__ = "0.1.0"
