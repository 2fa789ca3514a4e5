"""Position encodings behind one interface.

>>> import vlpe
>>> vlpe.encodings.available()[:3]
['alibi', 'ape', ...]
>>> enc = vlpe.encodings.build("rope", dim=384, num_heads=6)
>>> n = vlpe.encodings.set_scaling(enc, resolution_scaling(14, 28, "yarn"))  # evaluate at twice the grid

Every module in this package registers its encodings with :func:`register`; :func:`available` and
:func:`build` import them all on first use.
"""

from .base import CLAIMS, HALF_PLANES, HOOKS, Context, Encoding, LatticeBias
from .functional.scaling import resolution_scaling
from . import plan, spec
from .plan import LayerPlan, Plan
from .registry import available, build, construct, get, options_of, register, register_preset
from .spec import EncodingSpec
from .rope import set_scaling

__all__ = [
    "CLAIMS", "HALF_PLANES", "HOOKS", "Context", "Encoding", "EncodingSpec", "LatticeBias", "LayerPlan", "Plan",
    "available", "build", "construct", "get", "options_of", "register", "register_preset", "resolution_scaling", "set_scaling",
]
