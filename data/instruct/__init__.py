"""Video / image instruction data for fine-tuning a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint folder.

Annotations are read in the formats of the common fine-tuning stacks (:mod:`.annotations`: a JSON list or JSONL
of LLaVA ``conversations``, LLaMA-Factory / ms-swift ``messages`` or Qwen content-item samples, detected per file);
media are read by :mod:`.media` (decord videos at a target fps with real timestamps, decoded at the pixel budget;
videos given as frame files; Pillow images); :class:`InstructDataset` (:mod:`.dataset`) turns each sample into the
checkpoint processor's tensors with labels on the assistant tokens only; :func:`make_vniah_instruct`
(:mod:`.vniah_set`) writes a small learnable set of V-NIAH needle videos and images in that format.

    from data.instruct import InstructDataset
    ds = InstructDataset(annotations="train.json", media_root="media", processor=processor, family="qwen2_vl")
"""

from .annotations import FORMATS, AnnotationError, parse_samples, read_annotations, to_messages
from .dataset import FAMILIES, IGNORE_INDEX, InstructDataset
from .media import MediaError, load_frames, load_image, load_video, video_indices
from .vniah_set import make_vniah_instruct

__all__ = [
    "AnnotationError",
    "FORMATS",
    "read_annotations",
    "parse_samples",
    "to_messages",
    "MediaError",
    "load_video",
    "load_frames",
    "load_image",
    "video_indices",
    "InstructDataset",
    "FAMILIES",
    "IGNORE_INDEX",
    "make_vniah_instruct",
]
