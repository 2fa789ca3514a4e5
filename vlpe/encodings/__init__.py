"""Position encodings behind one interface.

>>> import vlpe
>>> vlpe.encodings.available()[:3]
['alibi', 'ape', ...]
>>> enc = vlpe.encodings.build("rope", dim=384, num_heads=6)

Every module in this package registers its encodings with :func:`register`; :func:`available` and
:func:`build` import them all on first use.
"""

from .base import CLAIMS, HOOKS, Context, Encoding
from .registry import available, build, get, options_of, register, register_preset

__all__ = ["CLAIMS", "HOOKS", "Context", "Encoding", "available", "build", "get", "options_of", "register", "register_preset"]
