"""Image pipelines: training augmentation and the resolution-extrapolation evaluation protocol.

The evaluation protocol is the one of PaPE (``ResizeSmall(int(S*256/224))`` then ``CenterCrop(S)``) and
LookHere: a model trained at size ``T`` is evaluated, with the same weights, at the LookHere sizes
224, 320, 384, 448, 512, 768, 1024 scaled by ``T/224`` (ratios 1, 1.43, 1.71, 2, 2.29, 3.43, 4.57). The
field of view stays the same; only the pixel density and the number of patch tokens grow.

Pipelines are albumentations 2.0.8 ``Compose`` objects (MIT; the project pins 2.0.8 and does not use
its AGPL successor). They take and return HWC numpy images (uint8 or float32 in [0, 1]); the datasets
of :mod:`data.images` turn the result into a ``(C, H, W)`` float tensor and normalise it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LOOKHERE_SIZES",
    "LOOKHERE_RATIOS",
    "eval_resolutions",
    "eval_resize_size",
    "eval_transform",
    "train_transform",
    "resize",
    "worker_init",
]

LOOKHERE_SIZES: tuple[int, ...] = (224, 320, 384, 448, 512, 768, 1024)
LOOKHERE_RATIOS: tuple[float, ...] = tuple(s / 224 for s in LOOKHERE_SIZES)
_INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "area", "lanczos")


def _positive_size(name: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be a positive integer (pixels), got {size!r}")
    return size


def eval_resolutions(
    train_size: int, *, ratios: Sequence[float] = LOOKHERE_RATIOS, multiple_of: int = 1
) -> list[int]:
    """Test sizes for a model trained at ``train_size``: ``round(train_size * r)`` for each ratio.

    ``multiple_of`` rounds each size to the nearest multiple (e.g. the patch size) so that every test
    image is an exact patch grid. ``eval_resolutions(224) == [224, 320, 384, 448, 512, 768, 1024]``;
    ``eval_resolutions(28) == [28, 40, 48, 56, 64, 96, 128]``.
    """
    train_size = _positive_size("train_size", train_size)
    multiple_of = _positive_size("multiple_of", multiple_of)
    ratios = tuple(float(r) for r in ratios)
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"ratios must be a non-empty sequence of positive numbers, got {ratios}")
    out = []
    for r in ratios:
        s = train_size * r / multiple_of
        out.append(max(1, int(s + 0.5 + 1e-9)) * multiple_of)  # half-up rounding, robust to 1.9999999
    return out


def eval_resize_size(size: int, *, crop_ratio: float = 224 / 256) -> int:
    """Short-side size before the centre crop: ``int(size / crop_ratio)`` (= ``int(S*256/224)`` by default)."""
    size = _positive_size("size", size)
    if not 0 < crop_ratio <= 1:
        raise ValueError(f"crop_ratio must be in (0, 1] (the crop side over the resized short side), got {crop_ratio}")
    return max(size, int(size / crop_ratio + 1e-6))


def _cv2_interpolation(name: str) -> int:
    import cv2

    table = {
        "nearest": cv2.INTER_NEAREST,
        "bilinear": cv2.INTER_LINEAR,
        "bicubic": cv2.INTER_CUBIC,
        "area": cv2.INTER_AREA,
        "lanczos": cv2.INTER_LANCZOS4,
    }
    if name not in table:
        raise ValueError(f"interpolation must be one of {list(_INTERPOLATIONS)}, got {name!r}")
    return table[name]


def _albumentations():
    try:
        import albumentations as A
    except ImportError as e:  # pragma: no cover - depends on the environment
        from ._util import MissingPackageError

        raise MissingPackageError(
            "albumentations is not installed. Install it with `pip install albumentations==2.0.8`."
        ) from e
    return A


def eval_transform(size: int, *, crop_ratio: float = 224 / 256, interpolation: str = "bicubic"):
    """The evaluation pipeline at test size ``size``: short side to ``int(size/crop_ratio)``, centre crop.

    ``crop_ratio=224/256`` is the PaPE/DeiT protocol; ``crop_ratio=1.0`` is RoPE-ViT's
    ``--eval-crop-ratio 1.0`` (the crop covers the whole short side). Downscaling uses area
    averaging (antialiased), upscaling ``interpolation``.
    """
    A = _albumentations()
    short = eval_resize_size(size, crop_ratio=crop_ratio)
    return A.Compose(
        [
            A.SmallestMaxSize(
                max_size=short, interpolation=_cv2_interpolation(interpolation), area_for_downscale="image"
            ),
            A.CenterCrop(height=size, width=size),
        ]
    )


def train_transform(
    size: int,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    color_jitter: float = 0.0,
    interpolation: str = "bicubic",
    seed: int | None = None,
):
    """Training augmentation at ``size``: RandomResizedCrop, horizontal flip, optional colour jitter.

    Use ``hflip=0`` for digits (a flipped digit is another symbol) and ``scale=(0.35, 1)`` for small
    images where 8% crops leave almost nothing. ``color_jitter`` is the brightness/contrast/saturation
    strength (0 disables it; it applies to RGB images only).
    """
    A = _albumentations()
    size = _positive_size("size", size)
    if not (0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi <= 1 (area fractions), got {scale}")
    if not (0 < ratio[0] <= ratio[1]):
        raise ValueError(f"ratio must be (lo, hi) with 0 < lo <= hi (aspect ratios), got {ratio}")
    if not 0 <= hflip <= 1:
        raise ValueError(f"hflip is a probability in [0, 1], got {hflip}")
    if color_jitter < 0:
        raise ValueError(f"color_jitter must be >= 0, got {color_jitter}")
    ops = [
        A.RandomResizedCrop(
            size=(size, size),
            scale=tuple(scale),
            ratio=tuple(ratio),
            interpolation=_cv2_interpolation(interpolation),
            area_for_downscale="image",
        )
    ]
    if hflip > 0:
        ops.append(A.HorizontalFlip(p=hflip))
    if color_jitter > 0:
        j = color_jitter
        ops.append(A.ColorJitter(brightness=j, contrast=j, saturation=j, hue=0.0, p=0.8))
    return A.Compose(ops, seed=seed)


def resize(image: Tensor, size: int | tuple[int, int], *, mode: str = "bicubic") -> Tensor:
    """Resize a ``(C, H, W)`` or ``(B, C, H, W)`` float image in [0, 1] (antialiased; clamped to [0, 1])."""
    if isinstance(size, int):
        size = (size, size)
    if len(size) != 2 or any(not isinstance(s, int) or s < 1 for s in size):
        raise ValueError(f"size must be an int or (height, width) of positive ints, got {size!r}")
    if mode not in ("bilinear", "bicubic", "nearest", "area"):
        raise ValueError(f"mode must be 'bilinear', 'bicubic', 'nearest' or 'area', got {mode!r}")
    squeeze = image.dim() == 3
    x = image.unsqueeze(0) if squeeze else image  # (B, C, H, W)
    if tuple(x.shape[-2:]) != tuple(size):
        kw = {"antialias": True, "align_corners": False} if mode in ("bilinear", "bicubic") else {}
        x = F.interpolate(x.float(), size=size, mode=mode, **kw).clamp_(0.0, 1.0)
    return x.squeeze(0) if squeeze else x


def worker_init(worker_id: int) -> None:
    """``DataLoader(worker_init_fn=...)``: one thread per worker for torch and OpenCV (albumentations FAQ)."""
    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(0)
    except ImportError:  # pragma: no cover
        pass
